//! Kernel tests: row invariance on every ISA this CPU runs, agreement with candle and the
//! portable loops.

use super::*;

pub(super) fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
}

/// The CPU's best kernels on `threads` threads.
fn with_threads(threads: usize) -> Kernels {
    Kernels::new(KernelOptions {
        threads: Some(threads),
        ..KernelOptions::default()
    })
    .expect("threads")
}

/// `isa`, which the tests run only where the CPU has it, with the default prefetch plan.
impl From<Isa> for Tuning {
    fn from(isa: Isa) -> Self {
        Tuning {
            isa,
            prefetch: Prefetch::L1,
        }
    }
}

fn transposed(rows: usize) -> OutLayout {
    OutLayout { col: rows, row: 1 }
}

/// The instruction sets this CPU can run, the detected one last.
pub(super) fn supported_isas() -> Vec<Isa> {
    let mut isas = vec![Isa::Portable];
    if detected_isa().has_avx2() {
        isas.push(Isa::Avx2Fma);
    }
    if detected_isa().has_avx512() {
        isas.push(Isa::Avx512);
    }
    if detected_isa() == Isa::Avx512Bf16 {
        isas.push(Isa::Avx512Bf16);
    }
    if detected_isa() == Isa::Neon {
        isas.push(Isa::Neon);
    }
    isas
}

#[test]
fn matmul_is_row_invariant() {
    let mut seed = 7;
    let (inner, outs) = (37, 300_000 / 37 + 5);
    let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
    let x: Vec<f32> = (0..6 * inner).map(|_| lcg(&mut seed)).collect();
    let mut all = vec![0f32; 6 * outs];
    Kernels::single_threaded().matmul_t(&x, (&w).into(), 6, inner, &mut all);
    for m in 0..6 {
        let mut one = vec![0f32; outs];
        Kernels::single_threaded().matmul_t(
            &x[m * inner..(m + 1) * inner],
            (&w).into(),
            1,
            inner,
            &mut one,
        );
        assert_eq!(one, all[m * outs..(m + 1) * outs], "row {m}");
    }
}

#[test]
fn every_isa_is_row_invariant_on_tails_and_odd_groups() {
    let mut seed = 11;
    // 13 weight rows leave remainders for every group size; 203 and 40 leave lane tails.
    for inner in [203, 40, 16, 5] {
        let outs = 13;
        let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..13 * inner).map(|_| lcg(&mut seed)).collect();
        for isa in supported_isas() {
            let mut all = vec![0f32; 13 * outs];
            matmul_t_serial(
                Tuning::from(isa),
                &x,
                &w,
                13,
                inner,
                SharedOut::new(&mut all),
                transposed(13),
            );
            for rows in 1..=12 {
                let mut some = vec![0f32; rows * outs];
                let to = transposed(rows);
                matmul_t_serial(
                    Tuning::from(isa),
                    &x[..rows * inner],
                    &w,
                    rows,
                    inner,
                    SharedOut::new(&mut some),
                    to,
                );
                for (j, col) in some.chunks_exact(rows).enumerate() {
                    assert_eq!(col, &all[j * 13..j * 13 + rows], "{isa:?} {inner} {rows}");
                }
            }
        }
    }
}

#[test]
fn matmul_matches_candle_on_odd_shapes() {
    use candle_core::{Device, Tensor};
    let mut seed = 3;
    for &(rows, inner, outs) in &[
        (1, 1, 1),
        (1, 7, 5),
        (2, 17, 33),
        (3, 31, 9),
        (4, 64, 64),
        (5, 100, 3),
        (7, 257, 129),
        (13, 15, 1000),
        (4, 256, 1100),
    ] {
        let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..rows * inner).map(|_| lcg(&mut seed)).collect();
        let mut out = vec![0f32; rows * outs];
        Kernels::single_threaded().matmul_t(&x, (&w).into(), rows, inner, &mut out);
        let xt = Tensor::from_slice(&x, (rows, inner), &Device::Cpu).unwrap();
        let wt = Tensor::from_slice(&w, (outs, inner), &Device::Cpu).unwrap();
        let expect: Vec<f32> = xt
            .matmul(&wt.t().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in out.iter().zip(&expect) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{rows}x{inner}x{outs}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn every_isa_agrees_closely_with_portable() {
    let mut seed = 5;
    let (inner, outs) = (203, 17);
    let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
    let x: Vec<f32> = (0..3 * inner).map(|_| lcg(&mut seed)).collect();
    let mut a = vec![0f32; 3 * outs];
    matmul_t_serial(
        Tuning::from(Isa::Portable),
        &x,
        &w,
        3,
        inner,
        SharedOut::new(&mut a),
        transposed(3),
    );
    for isa in supported_isas() {
        let mut b = vec![0f32; 3 * outs];
        matmul_t_serial(
            Tuning::from(isa),
            &x,
            &w,
            3,
            inner,
            SharedOut::new(&mut b),
            transposed(3),
        );
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-4, "{isa:?}: {p} vs {q}");
        }
    }
}

#[test]
fn attention_kernels_agree_closely_with_the_portable_loops() {
    let mut seed = 13;
    for head_dim in [64, 128, 32] {
        for (heads, kv_heads) in [(4, 4), (4, 2)] {
            for len in [1, 7, 8, 9, 33] {
                let shape = AttnShape {
                    heads,
                    kv_heads,
                    head_dim,
                };
                let mut random = |n: usize| (0..n).map(|_| 4.0 * lcg(&mut seed)).collect();
                let q: Vec<f32> = random(heads * head_dim);
                let keys: Vec<f32> = random(len * kv_heads * head_dim);
                let values: Vec<f32> = random(len * kv_heads * head_dim);
                let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                let query = [attention::Query {
                    q: &q,
                    cached: len,
                    own: None,
                }];
                let cache = (&keys[..], &values[..]);
                let mut scores = Vec::new();
                attention::attend_group_on(
                    Isa::Portable,
                    &query,
                    cache,
                    (shape, 0..heads),
                    &mut a,
                    &mut scores,
                );
                attend_row(&q, &keys, &values, len, shape, &mut b, &mut Vec::new());
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() < 1e-5, "{shape:?} len {len}: {x} vs {y}");
                }
                for isa in supported_isas() {
                    let all_heads = (shape, 0..heads);
                    attention::attend_group_on(isa, &query, cache, all_heads, &mut b, &mut scores);
                    for (x, y) in a.iter().zip(&b) {
                        assert!(
                            (x - y).abs() < 1e-5,
                            "{isa:?} {shape:?} len {len}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

/// A group of rows over one cache, some with their own entry after it (second candidates),
/// gives each row the bits it gets alone over the cache with its entry written in place; in
/// an f32 and an f16 cache (whose own entries are rounded as the cache stores them).
#[test]
fn a_group_attends_as_its_rows_alone_bit_for_bit() {
    let mut seed = 29;
    for isa in supported_isas() {
        for (head_dim, heads, kv_heads) in [(64, 4, 4), (64, 4, 2), (128, 2, 1), (32, 2, 2)] {
            let shape = AttnShape {
                heads,
                kv_heads,
                head_dim,
            };
            group_attends_as_alone::<f32>(isa, shape, &mut seed);
            group_attends_as_alone::<half::f16>(isa, shape, &mut seed);
        }
    }
}

/// Random values of `E`, as f32 (exactly what an `E` cache reads back).
fn random_kv<E: KvElement>(n: usize, seed: &mut u64) -> Vec<f32> {
    let x: Vec<f32> = (0..n).map(|_| 4.0 * lcg(seed)).collect();
    let mut stored = vec![E::default(); n];
    E::narrow(&x, &mut stored);
    let mut back = vec![0f32; n];
    E::widen(&stored, &mut back);
    back
}

fn narrowed<E: KvElement>(x: &[f32]) -> Vec<E> {
    let mut out = vec![E::default(); x.len()];
    E::narrow(x, &mut out);
    out
}

fn group_attends_as_alone<E: KvElement>(isa: Isa, shape: AttnShape, seed: &mut u64) {
    let (heads, head_dim) = (shape.heads, shape.head_dim);
    let kv_dim = shape.kv_heads * head_dim;
    let (keys, values) = (
        random_kv::<E>(70 * kv_dim, seed),
        random_kv::<E>(70 * kv_dim, seed),
    );
    let rows: Vec<(usize, bool)> = vec![
        (70, false),
        (33, true),
        (1, false),
        (0, true),
        (64, true),
        (15, true),
    ];
    let qs: Vec<Vec<f32>> = (rows.iter())
        .map(|_| (0..heads * head_dim).map(|_| 4.0 * lcg(seed)).collect())
        .collect();
    let owns: Vec<(Vec<f32>, Vec<f32>)> = (rows.iter())
        .map(|_| (random_kv::<E>(kv_dim, seed), random_kv::<E>(kv_dim, seed)))
        .collect();
    let queries: Vec<attention::Query> = (rows.iter().zip(&qs).zip(&owns))
        .map(|((&(cached, own), q), (k, v))| attention::Query {
            q,
            cached,
            own: own.then_some((&k[..], &v[..])),
        })
        .collect();
    let q_dim = heads * head_dim;
    let mut group = vec![0f32; rows.len() * q_dim];
    let (keys_e, values_e) = (narrowed::<E>(&keys), narrowed::<E>(&values));
    let cache = (&keys_e[..], &values_e[..]);
    let all_heads = all_heads_of(shape);
    attention::attend_group_on(isa, &queries, cache, all_heads, &mut group, &mut Vec::new());
    tiled_layout_gives_the_same_bits(isa, shape, &queries, cache, &group);
    heads_alone_give_the_same_bits(isa, shape, &queries, cache, &group);
    rows_alone_give_the_same_bits::<E>(isa, shape, &queries, (&keys, &values), &group);
}

/// The group's cache laid out in tiles, with room for more positions, gives the same bits.
fn tiled_layout_gives_the_same_bits<E: KvElement>(
    isa: Isa,
    shape: AttnShape,
    queries: &[attention::Query],
    (keys_e, values_e): (&[E], &[E]),
    group: &[f32],
) {
    let (head_dim, kv_dim) = (shape.head_dim, shape.kv_heads * shape.head_dim);
    let strides = KvLayout::Tiles.strides(shape.kv_heads, head_dim);
    let by_tiles = |rows: &[E]| {
        let mut tiles = vec![E::default(); KvLayout::Tiles.elements(75, shape.kv_heads, head_dim)];
        for (s, row) in rows.chunks_exact(kv_dim).enumerate() {
            for (j, entry) in row.chunks_exact(head_dim).enumerate() {
                tiles[strides.offset(j, s)..][..head_dim].copy_from_slice(entry);
            }
        }
        tiles
    };
    let (keys_t, values_t) = (by_tiles(keys_e), by_tiles(values_e));
    let view = KvView {
        keys: &keys_t,
        values: &values_t,
        layout: KvLayout::Tiles,
    };
    let mut tiled = vec![0f32; group.len()];
    let all_heads = all_heads_of(shape);
    attention::attend_group_on(isa, queries, view, all_heads, &mut tiled, &mut Vec::new());
    let same_bits = (tiled.iter().zip(group)).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same_bits,
        "{isa:?} {shape:?}: the tiled layout gave other bits"
    );
}

/// Each head alone gives the bits it gave among all heads.
fn heads_alone_give_the_same_bits<E: KvElement>(
    isa: Isa,
    shape: AttnShape,
    queries: &[attention::Query],
    cache: (&[E], &[E]),
    group: &[f32],
) {
    let (heads, head_dim) = (shape.heads, shape.head_dim);
    let q_dim = heads * head_dim;
    for h in 0..heads {
        let mut one = vec![0f32; queries.len() * head_dim];
        let head = (shape, h..h + 1);
        attention::attend_group_on(isa, queries, cache, head, &mut one, &mut Vec::new());
        for (n, o) in one.chunks_exact(head_dim).enumerate() {
            let whole = &group[n * q_dim + h * head_dim..][..head_dim];
            assert_eq!(o, whole, "{isa:?} {shape:?} row {n} head {h}");
        }
    }
}

/// Each row alone, its own entry (if any) appended to the cache, gives the bits it gave in
/// the group.
fn rows_alone_give_the_same_bits<E: KvElement>(
    isa: Isa,
    shape: AttnShape,
    queries: &[attention::Query],
    (keys, values): (&[f32], &[f32]),
    group: &[f32],
) {
    let (q_dim, kv_dim) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    for (n, query) in queries.iter().enumerate() {
        let (mut k, mut v) = (
            keys[..query.cached * kv_dim].to_vec(),
            values[..query.cached * kv_dim].to_vec(),
        );
        if let Some((own_k, own_v)) = query.own {
            k.extend_from_slice(own_k);
            v.extend_from_slice(own_v);
        }
        let alone = [attention::Query {
            q: query.q,
            cached: k.len() / kv_dim,
            own: None,
        }];
        let mut out = vec![0f32; q_dim];
        let cache = (&narrowed::<E>(&k)[..], &narrowed::<E>(&v)[..]);
        attention::attend_group_on(
            isa,
            &alone,
            cache,
            all_heads_of(shape),
            &mut out,
            &mut Vec::new(),
        );
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&out),
            bits(&group[n * q_dim..(n + 1) * q_dim]),
            "{isa:?} {shape:?} row {n}"
        );
    }
}

fn all_heads_of(shape: AttnShape) -> (AttnShape, std::ops::Range<usize>) {
    (shape, 0..shape.heads)
}

/// An f16 cache gives the bits of the same values widened to an f32 cache, on every ISA: the
/// kernels widen exactly and then do the f32 arithmetic.
#[test]
fn an_f16_cache_attends_as_its_values_in_f32_bit_for_bit() {
    let mut seed = 31;
    for isa in supported_isas() {
        for (head_dim, heads, kv_heads) in [(64, 4, 4), (128, 4, 2), (32, 2, 2)] {
            let shape = AttnShape {
                heads,
                kv_heads,
                head_dim,
            };
            let kv_dim = kv_heads * head_dim;
            let keys = random_kv::<half::f16>(45 * kv_dim, &mut seed);
            let values = random_kv::<half::f16>(45 * kv_dim, &mut seed);
            let q: Vec<f32> = (0..heads * head_dim)
                .map(|_| 4.0 * lcg(&mut seed))
                .collect();
            let query = [attention::Query {
                q: &q,
                cached: 45,
                own: None,
            }];
            let (mut wide, mut half) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            let f32_cache = (&keys[..], &values[..]);
            let (k16, v16) = (narrowed::<half::f16>(&keys), narrowed::<half::f16>(&values));
            let heads = all_heads_of(shape);
            attention::attend_group_on(
                isa,
                &query,
                f32_cache,
                heads.clone(),
                &mut wide,
                &mut Vec::new(),
            );
            attention::attend_group_on(
                isa,
                &query,
                (&k16[..], &v16[..]),
                heads,
                &mut half,
                &mut Vec::new(),
            );
            assert_eq!(wide, half, "{isa:?} {shape:?}");
        }
    }
}

#[test]
fn attention_over_one_position_returns_its_value() {
    let shape = AttnShape {
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let q = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
    let k = [0.5, 0.5, 0.5, 0.5];
    let v = [1.0, 2.0, 3.0, 4.0];
    let mut out = [0f32; 8];
    attend_row(&q, &k, &v, 1, shape, &mut out, &mut Vec::new());
    assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn products_split_across_threads_are_the_serial_ones_bit_for_bit() {
    let mut seed = 11;
    let inner = 96;
    let ws: Vec<Vec<f32>> = [300, 704, 17]
        .iter()
        .map(|outs| (0..outs * inner).map(|_| lcg(&mut seed)).collect())
        .collect();
    for threads in [2, 3] {
        let pool = pool::Pool::new(threads).expect("threads");
        for rows in 1..=5 {
            let x: Vec<f32> = (0..rows * inner).map(|_| lcg(&mut seed)).collect();
            let mut outs: Vec<Vec<f32>> = (ws.iter())
                .map(|w| vec![0f32; rows * w.len() / inner])
                .collect();
            let mut pairs: Vec<(Weight<'_>, &mut [f32])> = (ws.iter().map(Weight::from))
                .zip(outs.iter_mut().map(Vec::as_mut_slice))
                .collect();
            matmul_t_pooled(
                &pool,
                Tuning::from(detected_isa()),
                (&x, rows, inner),
                &mut pairs,
            );
            for (w, got) in ws.iter().zip(&outs) {
                let outs_n = w.len() / inner;
                let mut want = vec![0f32; rows * outs_n];
                let to = OutLayout {
                    col: 1,
                    row: outs_n,
                };
                matmul_t_serial(
                    Tuning::from(detected_isa()),
                    &x,
                    w,
                    rows,
                    inner,
                    SharedOut::new(&mut want),
                    to,
                );
                assert_eq!(
                    got, &want,
                    "{threads} threads, {rows} rows, {outs_n} outputs"
                );
            }
        }
    }
}

#[test]
fn the_gated_mlp_split_across_threads_is_the_serial_one_bit_for_bit() {
    let mut seed = 23;
    let inner = 128;
    for outs in [704, 300] {
        let gate_w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        let up_w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        for rows in 1..=5 {
            let x: Vec<f32> = (0..rows * inner).map(|_| lcg(&mut seed) * 4.0).collect();
            let run = |threads: usize| {
                let kernels = with_threads(threads);
                let (mut gate, mut up) = (vec![0f32; rows * outs], vec![0f32; rows * outs]);
                gated_t_on(
                    &kernels,
                    (&x, rows, inner),
                    ((&gate_w).into(), (&up_w).into()),
                    (&mut gate, &mut up),
                );
                gate
            };
            let serial = run(1);
            let mut want = vec![0f32; rows * outs];
            let mut up = vec![0f32; rows * outs];
            let to = OutLayout { col: 1, row: outs };
            matmul_t_serial(
                Tuning::from(detected_isa()),
                &x,
                &gate_w,
                rows,
                inner,
                SharedOut::new(&mut want),
                to,
            );
            matmul_t_serial(
                Tuning::from(detected_isa()),
                &x,
                &up_w,
                rows,
                inner,
                SharedOut::new(&mut up),
                to,
            );
            silu_mul(&mut want, &up);
            assert_eq!(serial, want, "one thread is matmuls then silu_mul");
            for threads in [2, 3] {
                assert_eq!(
                    run(threads),
                    serial,
                    "{threads} threads, {rows} rows, {outs} wide"
                );
            }
        }
    }
}

#[test]
fn the_f16_head_split_across_threads_is_the_serial_one_bit_for_bit() {
    let mut seed = 5;
    let (inner, outs) = (64, 1000);
    let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
    let packed = f16::PackedF16::new(&w, inner);
    for rows in 1..=5 {
        let x: Vec<f32> = (0..rows * inner).map(|_| lcg(&mut seed)).collect();
        let mut serial = vec![0f32; rows * outs];
        packed.matmul(&with_threads(1), &x, rows, &mut serial);
        for threads in [2, 3] {
            let mut split = vec![0f32; rows * outs];
            packed.matmul(&with_threads(threads), &x, rows, &mut split);
            assert_eq!(split, serial, "{threads} threads, {rows} rows");
        }
    }
}

#[test]
fn sum_exp_matches_the_scalar_sum_closely() {
    let mut seed = 11;
    for n in [0, 1, 7, 8, 9, 100, 4096, 4099] {
        let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 20.0).collect();
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let shift = if n == 0 { 0.0 } else { max };
        let want: f64 = x.iter().map(|&v| f64::from(v - shift).exp()).sum();
        let got = f64::from(sum_exp(&x, shift));
        assert!(
            (got - want).abs() <= 1e-5 * want.max(1e-30),
            "{n}: {got} vs {want}"
        );
    }
}
