//! `cargo bench --bench step -- --only roofline`: where the default model's 1-row and R-row
//! steps stand against this core's two limits, measured in the same process: its peak
//! multiply-adds per second (independent FMA chains, no memory) and the bytes per second the
//! kernels' 1-row product streams over the model's own layer matrices. A 1-row step cannot
//! beat its bytes over the stream rate, an R-row one neither that nor its multiply-adds over
//! the peak, so the ceiling R·t1/tR has a bound that this machine sets, whatever the kernels
//! do (`engine::metrics`, `engine::kernels`).
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

use std::time::{Duration, Instant};

use spex::engine::LoadedModel;
use spex::engine::kernels;
use spex::engine::model::{Backend, LoadOptions};

/// The position the steps attend up to, as in the other step tables.
const POS: usize = 128;

/// What one row of a step costs the default model: multiply-adds, and the bytes it reads
/// that no other row of the step shares (its pass's K/V); and the weight bytes a step reads
/// once for all its rows.
struct RowCost {
    macs: f64,
    own_bytes: f64,
    weight_bytes: f64,
}

impl RowCost {
    fn of(loaded: &LoadedModel, kv_bytes: usize) -> Self {
        let c = &loaded.model().config;
        let (hidden, q_dim, kv_dim) = (c.hidden, c.heads * c.head_dim, c.kv_dim());
        let layer = hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * c.intermediate;
        let head = c.vocab * hidden;
        // The proposal readouts go through the f16 head where the backend built one.
        let half_head = matches!(&loaded.backend, Backend::Host(b) if b.has_half_head());
        let head_bytes = if half_head { 2 } else { 4 };
        let attention = 2 * POS * q_dim;
        Self {
            macs: (c.layers * (layer + attention) + head) as f64,
            own_bytes: (c.layers * 2 * POS * kv_dim * kv_bytes) as f64,
            weight_bytes: (c.layers * layer * 4 + head * head_bytes) as f64,
        }
    }
}

/// Prints the two limits, the default model's steps against them, and the ceilings.
pub fn table(options: LoadOptions) {
    let loaded = super::load_shipped("shakespeare-r4k6-sync", options);
    let kv_bytes = match options.kv_dtype {
        spex::engine::model::KvDtype::F16 => 2,
        spex::engine::model::KvDtype::F32 => 4,
    };
    let cost = RowCost::of(&loaded, kv_bytes);
    let kernels = loaded.backend.kernels().expect("the host kernels").clone();
    let (peak, stream) = (
        peak_macs_per_sec(&kernels),
        stream_bytes_per_sec(&loaded, &kernels),
    );
    let passes = loaded.model().passes();
    let t = loaded
        .backend
        .median_step_times(POS, &[1, passes], 300)
        .expect("steps");
    let bounds = Bounds {
        memory: (cost.weight_bytes, cost.own_bytes, stream),
        compute: (cost.macs, peak.unwrap_or(f64::INFINITY)),
    };
    match peak {
        Some(p) => println!("peak: {:.1} G multiply-adds/s on one core", p / 1e9),
        None => println!("peak: not measured on this instruction set"),
    }
    println!(
        "stream: {:.1} GB/s (1-row products over the layers' matrices alone, swept again and again)",
        stream / 1e9
    );
    println!(
        "a row: {:.2} M multiply-adds, {:.2} MB of its own K/V; a step: {:.1} MB of weights\n",
        cost.macs / 1e6,
        cost.own_bytes / 1e6,
        cost.weight_bytes / 1e6
    );
    bounds.print(&[(1, t[0]), (passes, t[1])]);
}

/// A step's two lower bounds by its row count: its bytes over the stream rate, its
/// multiply-adds over the peak.
struct Bounds {
    /// (weight bytes, each row's own bytes, bytes per second)
    memory: (f64, f64, f64),
    /// (each row's multiply-adds, multiply-adds per second)
    compute: (f64, f64),
}

impl Bounds {
    fn memory(&self, rows: f64) -> f64 {
        let (weights, own, rate) = self.memory;
        (weights + rows * own) / rate
    }

    fn compute(&self, rows: f64) -> f64 {
        rows * self.compute.0 / self.compute.1
    }

    /// The table of `steps` (rows, measured compute), the first of one row and the last of
    /// R, and the ceilings: measured, with all compute hidden under the stream, and with none.
    fn print(&self, steps: &[(usize, Duration)]) {
        let ms = |s: f64| format!("{:.3} ms", s * 1e3);
        println!("| step | measured | memory bound | compute bound | measured − memory bound |");
        println!("|---|---|---|---|---|");
        for &(rows, t) in steps {
            let (measured, rows_f) = (t.as_secs_f64(), rows as f64);
            println!(
                "| {rows} row(s) | {} | {} | {} | {} |",
                ms(measured),
                ms(self.memory(rows_f)),
                ms(self.compute(rows_f)),
                ms(measured - self.memory(rows_f)),
            );
        }
        let ((_, t1), (r, tr)) = (steps[0], steps[steps.len() - 1]);
        let r = r as f64;
        let hidden = |rows| self.memory(rows).max(self.compute(rows));
        let serial = |rows| self.memory(rows) + self.compute(rows);
        println!(
            "\nceiling R·t1/tR: measured {:.2}×; with all compute hidden under the stream {:.2}×; with none {:.2}×",
            r * t1.as_secs_f64() / tr.as_secs_f64(),
            r * hidden(1.0) / hidden(r),
            r * serial(1.0) / serial(r),
        );
        println!(
            "(every row here is read out, the 1-row step's too; `spex bench` reads a baseline token out at pass R only, so its ceiling is lower)"
        );
    }
}

/// Bytes per second that the 1-row product streams over the model's own layer matrices,
/// swept again and again as decode steps sweep them (copies of the same shapes; the median
/// of 30 sweeps after 5 that warm the caches).
fn stream_bytes_per_sec(loaded: &LoadedModel, kernels: &kernels::Kernels) -> f64 {
    let layers = &loaded.model().weights.layers;
    let matrices: Vec<(Vec<f32>, usize)> = (layers.iter())
        .flat_map(|l| {
            [
                &l.q_proj,
                &l.k_proj,
                &l.v_proj,
                &l.o_proj,
                &l.gate_proj,
                &l.up_proj,
                &l.down_proj,
            ]
        })
        .map(|w| {
            let (_, inner) = w.dims2().expect("a matrix");
            (
                w.flatten_all()
                    .and_then(|w| w.to_vec1())
                    .expect("f32 weights"),
                inner,
            )
        })
        .collect();
    let bytes: usize = matrices.iter().map(|(w, _)| w.len() * 4).sum();
    let x = vec![0.5f32; 4096];
    let mut out = vec![0f32; 4096];
    let mut times: Vec<Duration> = (0..35)
        .map(|_| {
            let t = Instant::now();
            for (w, inner) in &matrices {
                kernels.matmul_t(
                    &x[..*inner],
                    w.into(),
                    1,
                    *inner,
                    &mut out[..w.len() / inner],
                );
            }
            t.elapsed()
        })
        .skip(5)
        .collect();
    times.sort_unstable();
    bytes as f64 / times[times.len() / 2].as_secs_f64()
}

/// Multiply-adds per second of one core in the widest FMA the kernels use, from independent
/// chains that never touch memory; `None` off x86-64 or without AVX2.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn peak_macs_per_sec(kernels: &kernels::Kernels) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let iterations = 2_000_000;
        let lanes_per_iteration = match kernels.isa() {
            kernels::Isa::Avx512 | kernels::Isa::Avx512Bf16 => 24 * 16,
            kernels::Isa::Avx2Fma => 12 * 8,
            _ => return None,
        };
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                // SAFETY: a `Kernels`' ISA was checked against the CPU when it was made.
                let sum = unsafe {
                    match kernels.isa() {
                        kernels::Isa::Avx512 | kernels::Isa::Avx512Bf16 => {
                            fma_chains_512(iterations)
                        }
                        _ => fma_chains_256(iterations),
                    }
                };
                std::hint::black_box(sum);
                t.elapsed()
            })
            .min()
            .expect("five runs");
        Some((iterations * lanes_per_iteration) as f64 / best.as_secs_f64())
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// 12 independent 8-lane FMA chains, `n` FMAs each.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_chains_256(n: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(1.0); 12];
    let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    for _ in 0..n {
        for v in &mut acc {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    let mut lanes = [0f32; 8];
    let total = acc
        .iter()
        .fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), total) };
    lanes.iter().sum()
}

/// 24 independent 16-lane FMA chains, `n` FMAs each.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains_512(n: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(1.0); 24];
    let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    for _ in 0..n {
        for v in &mut acc {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    let total = acc
        .iter()
        .fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v));
    _mm512_reduce_add_ps(total)
}
