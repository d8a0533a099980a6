//! `cargo bench --bench step [-- --threads N] [--isa avx512|avx2|portable]
//! [--kv-cache f16|f32] [--prefetch l1|l2|far|none] [--only shipped|kernels|rows --rows N|attention|stream|quantized --layers N|roofline]`:
//! step compute by rows on random checkpoints
//! (hidden 256 and 512, K=4, R=4, vocab 4096), with spex's CPU kernels and with candle's own
//! ops, and the resulting ceiling R·t(1 row)/t(R rows); then the same for the shipped models'
//! real weights. Prints one table per comparison.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use spex::engine::LoadedModel;
use spex::engine::kernels::{Isa, KernelOptions, Kernels, Prefetch};
use spex::engine::model::device::DeviceBackend;
use spex::engine::model::{Backend, KvDtype, LoadOptions};
use spex::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use std::sync::Arc;

mod roofline;

/// The small-M kernel alone against candle's matmul, per weight shape and row count.
fn kernel_table(kernels: &Kernels) {
    println!(
        "| weight (out×in) | kernel | 1 row | 2 rows | 4 rows | 5 rows | 6 rows | 4 rows / 1 row |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (outs, inner) in [(256, 256), (704, 256), (256, 704), (4096, 256), (1408, 512)] {
        let w: Vec<f32> = (0..outs * inner)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let wt = candle_core::Tensor::from_slice(&w, (outs, inner), &Device::Cpu).expect("tensor");
        let mut rows_times = [[Duration::ZERO; 5]; 2];
        for (ri, rows) in [1usize, 2, 4, 5, 6].into_iter().enumerate() {
            let x: Vec<f32> = (0..rows * inner).map(|i| (i % 13) as f32 / 13.0).collect();
            let xt =
                candle_core::Tensor::from_slice(&x, (rows, inner), &Device::Cpu).expect("tensor");
            let mut out = vec![0f32; rows * outs];
            let mut t_spex = Vec::new();
            let mut t_candle = Vec::new();
            for _ in 0..300 {
                let t = Instant::now();
                kernels.matmul_t(&x, (&w).into(), rows, inner, &mut out);
                t_spex.push(t.elapsed());
                let t = Instant::now();
                let _ = xt.matmul(&wt.t().expect("t")).expect("matmul");
                t_candle.push(t.elapsed());
            }
            t_spex.sort_unstable();
            t_candle.sort_unstable();
            rows_times[0][ri] = t_spex[150];
            rows_times[1][ri] = t_candle[150];
        }
        for (name, t) in [("spex", rows_times[0]), ("candle", rows_times[1])] {
            let us = |d: Duration| format!("{:.1} µs", d.as_secs_f64() * 1e6);
            println!(
                "| {outs}×{inner} | {name} | {} | {} | {} | {} | {} | {:.2} |",
                us(t[0]),
                us(t[1]),
                us(t[2]),
                us(t[3]),
                us(t[4]),
                t[2].as_secs_f64() / t[0].as_secs_f64()
            );
        }
    }
    println!();
}

/// Step compute by rows on the shipped models (their real weights; every row's input is a
/// token embedding, all read out), host kernels with `options`.
fn shipped_models_table(pos: usize, options: LoadOptions) {
    println!(
        "| model | 1 row | 2 rows | 3 rows | 4 rows | 4 rows + a second | 4 rows / 1 row | ceiling R·t1/tR |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for name in [
        "shakespeare-r4k6-sync",
        "shakespeare-r4k6",
        "shakespeare-r4k4",
    ] {
        let loaded = load_shipped(name, options);
        let t = loaded
            .backend
            .median_step_times(pos, &[1, 2, 3, 4, 5], 200)
            .expect("steps");
        let ms = |d: Duration| format!("{:.3} ms", d.as_secs_f64() * 1e3);
        let ratio = t[3].as_secs_f64() / t[0].as_secs_f64();
        println!(
            "| {name} | {} | {} | {} | {} | {} | {ratio:.2} | {:.2}× |",
            ms(t[0]),
            ms(t[1]),
            ms(t[2]),
            ms(t[3]),
            ms(t[4]),
            4.0 / ratio
        );
    }
    println!();
}

/// One row's attention over 128 positions in each cache layout: hot (one cache, read over
/// and over) and cold (caches spread over 64 MB, each read once in a while, as a step finds
/// its pass's cache after streaming the weights).
fn attention_table(kernels: &Kernels) {
    use spex::engine::kernels::{AttnShape, HeadSpan, KvLayout, KvView, Query};
    let shape = AttnShape {
        heads: 4,
        kv_heads: 4,
        head_dim: 64,
    };
    let (kv_dim, positions) = (256, 128);
    let entries = positions * kv_dim;
    let caches = (64 << 20) / (2 * entries * 2);
    let cache: Vec<half::f16> = (0..caches * entries)
        .map(|i| half::f16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
        .collect();
    let q: Vec<f32> = (0..256).map(|i| (i % 13) as f32 / 13.0).collect();
    let query = Query {
        q: &q,
        cached: positions,
        own: None,
    };
    let (mut out, mut scores) = (vec![0f32; 256], Vec::new());
    let layouts = [("rows", KvLayout::Rows), ("tiles", KvLayout::Tiles)];
    for (layout_name, layout) in layouts {
        for (name, spread) in [("hot", false), ("cold", true)] {
            let mut times = Vec::new();
            for n in 0..2000 {
                let at = if spread { (n % caches) * entries } else { 0 };
                let view = KvView {
                    keys: &cache[at..at + entries],
                    values: &cache[at..at + entries],
                    layout,
                };
                let t = Instant::now();
                kernels.attend_group(
                    &[query],
                    view,
                    HeadSpan { shape, heads: 0..4 },
                    &mut out,
                    &mut scores,
                );
                times.push(t.elapsed());
            }
            times.sort_unstable();
            println!(
                "attention, 1 row, 128 positions, 4 heads of 64, f16, {layout_name} layout, {name}: {:.2} µs",
                times[1000].as_secs_f64() * 1e6
            );
        }
    }
}

/// The small-M matmul over a weight stream the size of the default model's layers (26 MB of
/// 704×256 matrices, one after another, as a step reads them from L3), by rows: the part of
/// a step's cost that the weights' bandwidth and the rows' arithmetic share.
fn stream_table(kernels: &Kernels) {
    let (outs, inner, count) = (704, 256, 36);
    let ws: Vec<Vec<f32>> = (0..count)
        .map(|m| {
            (0..outs * inner)
                .map(|i| (((i + m) * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect()
        })
        .collect();
    println!("| rows | 26 MB of weights | per row over 1 row |");
    println!("|---|---|---|");
    let mut one = 0.0;
    for rows in 1..=6 {
        let x: Vec<f32> = (0..rows * inner).map(|i| (i % 13) as f32 / 13.0).collect();
        let mut out = vec![0f32; rows * outs];
        let mut times = Vec::new();
        for _ in 0..60 {
            let t = Instant::now();
            for w in &ws {
                kernels.matmul_t(&x, w.into(), rows, inner, &mut out);
            }
            times.push(t.elapsed());
        }
        times.sort_unstable();
        let ms = times[30].as_secs_f64() * 1e3;
        if rows == 1 {
            one = ms;
        }
        println!(
            "| {rows} | {ms:.3} ms | {:.3} ms |",
            (ms - one) / (rows - 1).max(1) as f64
        );
    }
}

/// `--only quantized [--layers N]`: one layer's projections at Ouro-1.4B's shape (2048 wide,
/// MLP 5632), eight layers of them (400 MB of bf16, more than any L3) or `N`, in bf16, Q8_0,
/// Q4_K, Q5_K and Q6_K, by rows: the cost of a step's extra rows where the weights stream from
/// DRAM, or with one layer (29 MB of Q4_K) the kernels' arithmetic where they stay in cache.
fn quantized_table(kernels: &Kernels, layers: usize) {
    use spex::engine::kernels::{BlockQ8_0, QK8_0, QuantKind, Weight, repack};
    let shapes = [
        (2048, 2048),
        (2048, 2048),
        (2048, 2048),
        (2048, 2048),
        (5632, 2048),
        (5632, 2048),
        (2048, 5632),
    ];
    let mut dense = Vec::new();
    let mut q8 = Vec::new();
    let k_kinds = [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K];
    let mut k_quants: [Vec<(Vec<u8>, usize)>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for layer in 0..layers {
        for (m, &(outs, inner)) in shapes.iter().enumerate() {
            let w: Vec<f32> = (0..outs * inner)
                .map(|i| (((i + m + layer) * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            let mut blocks: Vec<BlockQ8_0> =
                w.chunks_exact(QK8_0).map(BlockQ8_0::quantize).collect();
            repack(
                QuantKind::Q8_0,
                bytemuck::cast_slice_mut(&mut blocks),
                outs,
                inner / QK8_0,
            );
            q8.push((blocks, inner));
            dense.push((
                w.iter()
                    .map(|&v| half::bf16::from_f32(v))
                    .collect::<Vec<_>>(),
                inner,
            ));
            for (&kind, out) in k_kinds.iter().zip(&mut k_quants) {
                // One layer quantized, copied to the others (the bytes' values do not matter).
                if layer > 0 {
                    let copy = out[m].clone();
                    out.push(copy);
                    continue;
                }
                let dtype = spex::engine::gguf::ggml_type(kind);
                let t = candle_core::Tensor::from_vec(w.clone(), (outs, inner), &Device::Cpu);
                let q = candle_core::quantized::QTensor::quantize(&t.expect("tensor"), dtype);
                let mut bytes = q.and_then(|q| Ok(q.data()?.to_vec())).expect("quantize");
                repack(kind, &mut bytes, outs, inner / kind.block_weights());
                out.push((bytes, inner));
            }
        }
    }
    println!(
        "| rows | bf16 | Q8_0 | Q4_K | Q5_K | Q6_K | per row over 1 row: Q8_0, Q4_K, Q5_K, Q6_K |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut one = [0.0; 4];
    for rows in [1, 2, 3, 4, 5] {
        let median = |weights: &[(Weight<'_>, usize)]| {
            let mut times = Vec::new();
            for _ in 0..9 {
                let t = Instant::now();
                for &(w, inner) in weights {
                    let x: Vec<f32> = (0..rows * inner)
                        .map(|i| (i % 13) as f32 / 13.0 - 0.4)
                        .collect();
                    let mut out = vec![0f32; rows * w.len() / inner];
                    kernels.matmul_t(&x, w, rows, inner, &mut out);
                }
                times.push(t.elapsed());
            }
            times.sort_unstable();
            times[4].as_secs_f64() * 1e3
        };
        let d: Vec<(Weight<'_>, usize)> = dense
            .iter()
            .map(|(w, i)| (Weight::from(&w[..]), *i))
            .collect();
        let q: Vec<(Weight<'_>, usize)> = (q8.iter())
            .map(|(w, i)| {
                let bytes: &[u8] = bytemuck::cast_slice(w);
                (
                    Weight::quantized(QuantKind::Q8_0, bytes, *i).expect("blocks"),
                    *i,
                )
            })
            .collect();
        let k = |which: usize| -> Vec<(Weight<'_>, usize)> {
            (k_quants[which].iter())
                .map(|(b, i)| {
                    (
                        Weight::quantized(k_kinds[which], b, *i).expect("blocks"),
                        *i,
                    )
                })
                .collect()
        };
        let (tb, tq) = (
            median(&d),
            [median(&q), median(&k(0)), median(&k(1)), median(&k(2))],
        );
        if rows == 1 {
            one = tq;
        }
        let extra = |i: usize| (tq[i] - one[i]) / (rows - 1).max(1) as f64;
        println!(
            "| {rows} | {tb:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.2}, {:.2}, {:.2}, {:.2} ms |",
            tq[0],
            tq[1],
            tq[2],
            tq[3],
            extra(0),
            extra(1),
            extra(2),
            extra(3)
        );
    }
}

/// `--only rows --rows N`: nothing but N-row steps of the default model (about 20 s), for a
/// profiler (`perf record`) to see one step shape alone.
fn profile_rows(options: LoadOptions) {
    let rows: usize = arg_value("--rows").map_or(1, |r| r.parse().expect("--rows N"));
    let loaded = load_shipped("shakespeare-r4k6-sync", options);
    let t = loaded
        .backend
        .median_step_times(128, &[rows], 20_000)
        .expect("steps");
    println!("{rows} rows: {:.3} ms", t[0].as_secs_f64() * 1e3);
}

/// The shipped model `name` (`assets/models/`) on the host kernels with `options`.
fn load_shipped(name: &str, options: LoadOptions) -> LoadedModel {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/models");
    LoadedModel::load_with(&root.join(name), &Device::Cpu, DType::F32, options).expect("load")
}

/// The value after `name` among the arguments after `--`.
fn arg_value(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

fn main() {
    let threads = arg_value("--threads").map_or(1, |t| t.parse().expect("--threads N"));
    let isa = arg_value("--isa").map(|isa| match isa.as_str() {
        "avx512bf16" => Isa::Avx512Bf16,
        "avx512" => Isa::Avx512,
        "avx2" => Isa::Avx2Fma,
        "neon" => Isa::Neon,
        _ => Isa::Portable,
    });
    let prefetch = arg_value("--prefetch").map(|plan| {
        (Prefetch::CANDIDATES.into_iter())
            .find(|p| p.name() == plan)
            .unwrap_or(Prefetch::L1)
    });
    let kernel_options = KernelOptions {
        isa,
        prefetch,
        threads: Some(threads),
    };
    let kernels = Kernels::new(kernel_options).expect("--isa, --threads");
    let kv_dtype = match arg_value("--kv-cache").as_deref() {
        Some("f32") => KvDtype::F32,
        _ => KvDtype::F16,
    };
    let options = LoadOptions {
        kv_dtype,
        kernels: kernel_options,
        ..LoadOptions::default()
    };
    let isa = kernels.isa();
    println!("decode threads: {threads}, instruction set: {isa:?}, KV cache: {kv_dtype:?}\n");
    match arg_value("--only").as_deref() {
        Some("shipped") => return shipped_models_table(128, options),
        Some("kernels") => return kernel_table(&kernels),
        Some("rows") => return profile_rows(options),
        Some("attention") => return attention_table(&kernels),
        Some("stream") => return stream_table(&kernels),
        Some("quantized") => {
            let layers = arg_value("--layers").map_or(8, |n| n.parse().expect("--layers N"));
            return quantized_table(&kernels, layers);
        }
        Some("roofline") => return roofline::table(options),
        _ => {}
    }
    kernel_table(&kernels);
    shipped_models_table(128, options);
    random_models_table(128, options);
}

/// Step compute by rows on random checkpoints of hidden 256 and 512 (K=4, R=4, vocab 4096),
/// spex's kernels against candle's ops.
fn random_models_table(pos: usize, options: LoadOptions) {
    println!(
        "| hidden | step path | 1 row | 2 rows | 3 rows | 4 rows | 4 rows / 1 row | ceiling R·t1/tR |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for hidden in [256, 512] {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let spec = RandomSpec {
            shape: spex::engine::config::ModelShape {
                hidden,
                layers: 4,
                passes: 4,
                heads: hidden / 64,
                kv_heads: hidden / 64,
                head_dim: 64,
                intermediate: hidden * 11 / 4,
                vocab: 4096,
                context: 512,
                tied: true,
            },
            pad_vocab_to: Some(4096),
            ..RandomSpec::default()
        };
        write_random_checkpoint(dir.path(), &spec).expect("checkpoint");
        let loaded =
            LoadedModel::load_with(dir.path(), &Device::Cpu, DType::F32, options).expect("load");
        let candle_ops = Backend::Device(Arc::new(DeviceBackend::new(loaded.model().clone())));
        for (name, backend) in [
            ("spex kernels", &loaded.backend),
            ("candle ops", &candle_ops),
        ] {
            let t = backend
                .median_step_times(pos, &[1, 2, 3, 4], 200)
                .expect("steps");
            let ms = |d: Duration| format!("{:.3} ms", d.as_secs_f64() * 1e3);
            let ratio = t[3].as_secs_f64() / t[0].as_secs_f64();
            println!(
                "| {hidden} | {name} | {} | {} | {} | {} | {ratio:.2} | {:.2}× |",
                ms(t[0]),
                ms(t[1]),
                ms(t[2]),
                ms(t[3]),
                4.0 / ratio
            );
        }
    }
}
