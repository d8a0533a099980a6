//! Kernel tests of the stored weight types: bf16 and f16 widened give the f32 kernel's bits,
//! and AVX-512 BF16's products are row-invariant and close to the exact product.

use super::tests::{lcg, supported_isas};
use super::*;

/// Weights stored in bf16 or f16 give, on every ISA that widens them (all but AVX-512 BF16's
/// bf16 products), every row count and the lane tails, the bits the f32 kernel gives over the
/// same weights widened (a widened bf16 or f16 is exact), serially and split across threads:
/// the stored types inherit the f32 kernels' exactness.
#[test]
fn stored_bf16_and_f16_weights_give_the_bits_of_their_f32_widening() {
    use half::{bf16, f16};
    let mut seed = 29;
    for (inner, outs) in [(203, 13), (40, 9), (256, 70), (5, 3)] {
        let raw: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        let b: Vec<bf16> = raw.iter().map(|&v| bf16::from_f32(v)).collect();
        let h: Vec<f16> = raw.iter().map(|&v| f16::from_f32(v)).collect();
        let b_wide: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
        let h_wide: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let x: Vec<f32> = (0..7 * inner).map(|_| lcg(&mut seed) * 3.0).collect();
        let stored = [
            (Weight::from(&b[..]), &b_wide),
            (Weight::from(&h[..]), &h_wide),
        ];
        for isa in supported_isas() {
            for rows in 1..=7 {
                for (w, wide) in stored {
                    if isa == Isa::Avx512Bf16 && matches!(w, Weight::Bf16(_)) {
                        continue; // rounds the activations: `bf16_products_…` below.
                    }
                    let (mut got, mut want) = (vec![0f32; rows * outs], vec![0f32; rows * outs]);
                    let (xs, to) = (&x[..rows * inner], OutLayout { col: 1, row: outs });
                    let out = SharedOut::new(&mut got);
                    with_weight!(w,
                        w => matmul_t_serial(Tuning::from(isa), xs, w, rows, inner, out, to),
                        _q => unreachable!("dense weights only")
                    );
                    let out = SharedOut::new(&mut want);
                    matmul_t_serial(Tuning::from(isa), xs, wide, rows, inner, out, to);
                    assert_eq!(got, want, "{isa:?} {inner} {rows} {}", w.bytes());
                }
            }
        }
        for threads in [2, 3] {
            let pool = pool::Pool::new(threads).expect("threads");
            let (mut got, mut want) = (vec![0f32; 5 * outs], vec![0f32; 5 * outs]);
            let xs = Rows {
                x: &x[..5 * inner],
                rows: 5,
                inner,
            };
            let widening = match detected_isa() {
                Isa::Avx512Bf16 => Isa::Avx512,
                other => other,
            };
            matmul_t_pooled(
                &pool,
                Tuning::from(widening),
                xs,
                &mut [(Weight::from(&b[..]), &mut got)],
            );
            matmul_t_pooled(
                &pool,
                Tuning::from(widening),
                xs,
                &mut [(Weight::from(&b_wide), &mut want)],
            );
            assert_eq!(got, want, "{threads} threads, inner {inner}");
        }
    }
}

/// AVX-512 BF16's products (activations rounded to bf16, 32 pairs an instruction) are row
/// invariant bit for bit over 1–13 rows (several blocks) and lane tails, the same split across
/// threads, and within f32 rounding of the exact product of the rounded activations.
#[test]
fn bf16_products_are_row_invariant_and_close_to_the_rounded_product() {
    use half::bf16;
    if detected_isa() != Isa::Avx512Bf16 {
        return; // this CPU has no AVX-512 BF16.
    }
    let mut seed = 31;
    for (inner, outs) in [(203, 13), (64, 9), (2048, 70), (5, 3), (33, 6)] {
        let w: Vec<bf16> = (0..outs * inner)
            .map(|_| bf16::from_f32(lcg(&mut seed)))
            .collect();
        let x: Vec<f32> = (0..13 * inner).map(|_| lcg(&mut seed) * 3.0).collect();
        let product = |rows: usize| {
            let mut out = vec![0f32; rows * outs];
            let to = OutLayout { col: 1, row: outs };
            let (xs, sh) = (&x[..rows * inner], SharedOut::new(&mut out));
            matmul_t_serial(Tuning::from(Isa::Avx512Bf16), xs, &w, rows, inner, sh, to);
            out
        };
        let all = product(13);
        for rows in 1..=12 {
            assert_eq!(
                product(rows),
                all[..rows * outs],
                "inner {inner}, {rows} rows"
            );
        }
        for (m, xr) in x.chunks_exact(inner).enumerate() {
            for (j, wr) in w.chunks_exact(inner).enumerate() {
                let terms = xr
                    .iter()
                    .zip(wr)
                    .map(|(a, b)| f64::from(bf16::from_f32(*a).to_f32()) * f64::from(b.to_f32()));
                let (exact, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                let got = f64::from(all[m * outs + j]);
                assert!(
                    (got - exact).abs() <= 1e-5 * size,
                    "{got} vs {exact} ({inner})"
                );
            }
        }
        let pool = pool::Pool::new(2).expect("threads");
        let mut split = vec![0f32; 13 * outs];
        matmul_t_pooled(
            &pool,
            Tuning::from(Isa::Avx512Bf16),
            Rows {
                x: &x,
                rows: 13,
                inner,
            },
            &mut [((&w[..]).into(), &mut split)],
        );
        assert_eq!(split, all, "two threads, inner {inner}");
    }
}
