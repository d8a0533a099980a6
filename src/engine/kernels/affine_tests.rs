//! The affine kernels: the portable definition's bits on every ISA, whatever the rows and the
//! threads' split, and within f32 summation of the exact product of the dequantized weights.

use super::affine::{self, AffineKind, AffineMatrix, write_block};
use super::tests::{lcg, supported_isas, with_threads};
use super::*;

/// `outs` rows of `inner` random blocks of `kind`, and the same weights dequantized in f64.
fn matrix(kind: AffineKind, outs: usize, inner: usize, seed: &mut u64) -> (Vec<u8>, Vec<f64>) {
    let (mut bytes, mut wide) = (Vec::new(), Vec::new());
    let top = (1u32 << kind.bits()) as f32;
    for _ in 0..outs * inner / kind.group() {
        let (scale, bias) = (0.01 + lcg(seed).abs() * 0.05, lcg(seed) * 0.4);
        let q: Vec<u8> = (0..kind.group())
            .map(|_| ((lcg(seed) + 0.5) * top).min(top - 1.0) as u8)
            .collect();
        wide.extend(
            q.iter()
                .map(|&q| f64::from(scale.mul_add(f32::from(q), bias))),
        );
        write_block(kind, scale, bias, &q, &mut bytes);
    }
    (bytes, wide)
}

fn run(isa: Isa, x: &[f32], w: AffineMatrix<'_>) -> Vec<f32> {
    let rows = x.len() / w.inner();
    let mut ordered = Vec::new();
    affine::deinterleave(x, &mut ordered);
    let x = if w.kind().bits() == 4 { &ordered } else { x };
    let mut out = vec![f32::NAN; rows * w.rows()];
    let to = OutLayout {
        col: 1,
        row: w.rows(),
    };
    affine::product(isa, x, w, SharedOut::new(&mut out), to);
    out
}

fn kinds() -> Vec<AffineKind> {
    (AffineKind::BITS.iter())
        .flat_map(|&b| AffineKind::GROUP_SIZES.map(|g| AffineKind::new(b, g)))
        .flatten()
        .collect()
}

#[test]
fn every_isa_gives_the_portable_bits_whatever_the_rows() {
    let mut seed = 11;
    for kind in kinds() {
        for (outs, inner) in [(1, 128), (7, 256), (37, 384), (9, 2048)] {
            let (bytes, _) = matrix(kind, outs, inner, &mut seed);
            let w = AffineMatrix::new(&bytes, outs, inner / kind.group(), kind).unwrap();
            let x: Vec<f32> = (0..9 * inner).map(|_| 3.0 * lcg(&mut seed)).collect();
            let alone: Vec<Vec<f32>> = (0..9)
                .map(|r| run(Isa::Portable, &x[r * inner..(r + 1) * inner], w))
                .collect();
            for isa in supported_isas() {
                for rows in 1..=9 {
                    let got = run(isa, &x[..rows * inner], w);
                    for (r, want) in alone.iter().enumerate().take(rows) {
                        let row = &got[r * outs..(r + 1) * outs];
                        let same = row
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{isa:?} {kind:?} {outs}x{inner} rows {rows} row {r}");
                    }
                }
            }
        }
    }
}

#[test]
fn products_are_the_dequantized_weights_times_the_rows() {
    let mut seed = 5;
    for kind in kinds() {
        let (outs, inner) = (13, 512);
        let (bytes, wide) = matrix(kind, outs, inner, &mut seed);
        let w = AffineMatrix::new(&bytes, outs, inner / kind.group(), kind).unwrap();
        let mut widened = Vec::new();
        Weight::Affine(w).widen_into(0..outs * inner, &mut widened);
        assert!(widened.iter().zip(&wide).all(|(a, b)| f64::from(*a) == *b));
        let x: Vec<f32> = (0..3 * inner).map(|_| lcg(&mut seed)).collect();
        let got = run(detected_isa(), &x, w);
        for r in 0..3 {
            for j in 0..outs {
                let terms = (0..inner).map(|k| f64::from(x[r * inner + k]) * wide[j * inner + k]);
                let (exact, size): (f64, f64) =
                    terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                // f32 summation of `inner` terms: within inner · ε of the terms' magnitudes.
                let bound = size * inner as f64 * f64::from(f32::EPSILON);
                let diff = (f64::from(got[r * outs + j]) - exact).abs();
                assert!(diff <= bound, "{kind:?} row {r} out {j}: {diff} > {bound}");
            }
        }
    }
}

#[test]
fn thread_splits_change_no_bit() {
    let mut seed = 3;
    let kind = AffineKind::new(4, 64).unwrap();
    let (outs, inner) = (300, 512);
    let (bytes, _) = matrix(kind, outs, inner, &mut seed);
    let w = AffineMatrix::new(&bytes, outs, inner / kind.group(), kind).unwrap();
    let x: Vec<f32> = (0..5 * inner).map(|_| lcg(&mut seed)).collect();
    let serial = run(detected_isa(), &x, w);
    for threads in [1, 2, 3] {
        let mut got = vec![0f32; 5 * outs];
        with_threads(threads).matmul_t(&x, Weight::Affine(w), 5, inner, &mut got);
        assert_eq!(got, serial, "{threads} threads");
    }
}

#[test]
fn kinds_name_themselves_by_their_dims_and_no_gguf_block_does() {
    for kind in kinds() {
        let [a, b] = kind.dims();
        assert_eq!(a * b, kind.block_bytes());
        assert_eq!(AffineKind::from_dims(kind.dims()), Some(kind));
    }
    assert_eq!(AffineKind::new(3, 64), None);
    assert_eq!(AffineKind::new(4, 48), None);
    assert_eq!(AffineKind::from_dims([34, 1]), None);
}
