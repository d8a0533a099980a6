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
pub(super) fn with_threads(threads: usize) -> Kernels {
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

/// Asserts that `got` (rows × outs, row-major) lies within the activations' rounding of the
/// f64 product of `x` (rows × inner) and `wide` (outs × inner, the weights dequantized), the
/// activations quantized to 8 bits per `block` values: each is off by at most half its
/// block's step max|x| / 127, and the float steps add a relative 1e-5 of Σ|x·w| at most.
pub(super) fn assert_within_activation_rounding(
    x: &[f32],
    wide: &[f32],
    got: &[f32],
    inner: usize,
    block: usize,
    label: &str,
) {
    let outs = wide.len() / inner;
    for (r, xr) in x.chunks_exact(inner).enumerate() {
        for (j, wr) in wide.chunks_exact(inner).enumerate() {
            let products = || {
                xr.iter()
                    .zip(wr)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
            };
            let exact: f64 = products().sum();
            let bound: f64 = (xr.chunks_exact(block).zip(wr.chunks_exact(block)))
                .map(|(xb, wb)| {
                    let d = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                    f64::from(d / 2.0 * wb.iter().map(|v| v.abs()).sum::<f32>())
                })
                .sum::<f64>()
                + 1e-5 * products().map(f64::abs).sum::<f64>();
            let err = (f64::from(got[r * outs + j]) - exact).abs();
            assert!(
                err <= bound,
                "{label} row {r} col {j}: error {err} over bound {bound}"
            );
        }
    }
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
                Rows { x: &x, rows, inner },
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
                    Rows { x: &x, rows, inner },
                    (&gate_w).into(),
                    (&up_w).into(),
                    &mut gate,
                    &mut up,
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
