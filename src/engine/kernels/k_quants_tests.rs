//! The K-quant kernels: the layout keeps every integer, dequantization is llama.cpp's (candle's
//! port of it as the independent reader), one result on every ISA whatever the rows and the
//! threads' split, within the activations' rounding of the dequantized f32 product.

use candle_core::quantized::{GgmlDType, QTensor};

use super::k_quants::{KRows, Q4K, Q6K, QK_K, decoded, product};
use super::packed::{Interleave, Packed, repack};
use super::q8_0::Q8Isa;
use super::tests::{assert_within_activation_rounding, lcg, supported_isas, with_threads};
use super::*;

/// `outs × inner` random weights quantized to `dtype` by candle (GGUF's bytes), and the same
/// dequantized by candle.
fn quantized(outs: usize, inner: usize, dtype: GgmlDType, seed: &mut u64) -> (Vec<u8>, Vec<f32>) {
    let dense: Vec<f32> = (0..outs * inner).map(|_| lcg(seed)).collect();
    let t = candle_core::Tensor::from_vec(dense, (outs, inner), &candle_core::Device::Cpu)
        .expect("tensor");
    let q = QTensor::quantize(&t, dtype).expect("quantize");
    let wide = q.dequantize(&candle_core::Device::Cpu).expect("dequantize");
    let wide = wide
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("values");
    (q.data().expect("bytes").to_vec(), wide)
}

/// [`quantized`] in the kernels' layout.
fn packed<K: Interleave>(
    outs: usize,
    inner: usize,
    dtype: GgmlDType,
    seed: &mut u64,
) -> (Vec<u8>, Vec<f32>) {
    let (mut bytes, wide) = quantized(outs, inner, dtype, seed);
    repack::<K>(&mut bytes, outs, inner / QK_K);
    (bytes, wide)
}

fn view<K: Interleave>(bytes: &[u8], outs: usize, inner: usize) -> Packed<'_, K> {
    Packed::from_bytes(bytes, outs, inner / QK_K).expect("layout")
}

fn run<K: k_quants_simd::Groups>(
    isa: Q8Isa,
    x: &[f32],
    rows: usize,
    inner: usize,
    w: Packed<'_, K>,
) -> Vec<f32> {
    let outs = w.rows();
    let mut q = KRows::default();
    q.quantize(isa, &Rows { x, rows, inner });
    let mut out = vec![f32::NAN; rows * outs];
    let to = OutLayout { col: 1, row: outs };
    product(isa, Prefetch::L2, &q, w, SharedOut::new(&mut out), to);
    out
}

fn isas_give_the_portable_bits<K: k_quants_simd::Groups>(dtype: GgmlDType) {
    let mut seed = 7;
    for (outs, inner) in [(1, 256), (8, 256), (13, 512), (37, 768), (16, 2048)] {
        let (bytes, _) = packed::<K>(outs, inner, dtype, &mut seed);
        let w = view::<K>(&bytes, outs, inner);
        let x: Vec<f32> = (0..7 * inner).map(|_| 3.0 * lcg(&mut seed)).collect();
        let alone: Vec<Vec<f32>> = (0..7)
            .map(|r| run(Q8Isa::Portable, &x[r * inner..(r + 1) * inner], 1, inner, w))
            .collect();
        for isa in supported_isas() {
            for rows in 1..=7 {
                let got = run(Q8Isa::for_isa(isa), &x[..rows * inner], rows, inner, w);
                for (r, want) in alone.iter().enumerate().take(rows) {
                    let row = &got[r * outs..(r + 1) * outs];
                    let same = row
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dtype:?} {isa:?} outs {outs} inner {inner} rows {rows} row {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_isa_gives_the_portable_bits_whatever_the_rows() {
    isas_give_the_portable_bits::<Q4K>(GgmlDType::Q4K);
    isas_give_the_portable_bits::<Q6K>(GgmlDType::Q6K);
}

fn layout_keeps_the_weights<K: KQuant>(dtype: GgmlDType)
where
    for<'a> Weight<'a>: From<Packed<'a, K>>,
{
    let mut seed = 3;
    for outs in [3, 8, 13, 24] {
        let inner = 512;
        let (bytes, wide) = packed::<K>(outs, inner, dtype, &mut seed);
        let w = Weight::from(view::<K>(&bytes, outs, inner));
        let mut got = Vec::new();
        w.widen_into(0..outs * inner, &mut got);
        assert_eq!(got, wide, "{dtype:?} {outs} rows");
        let mut part = Vec::new();
        w.widen_into(inner + 5..2 * inner - 3, &mut part);
        assert_eq!(
            part,
            wide[inner + 5..2 * inner - 3],
            "{dtype:?} part of row 1"
        );
        if outs > 8 {
            let rest = w.slice(8 * inner..outs * inner);
            let mut got = Vec::new();
            rest.widen_into(0..rest.len(), &mut got);
            assert_eq!(got, wide[8 * inner..], "{dtype:?} {outs} rows from 8");
        }
    }
}

#[test]
fn the_layout_keeps_every_weight_and_dequantizes_as_llama_cpp() {
    layout_keeps_the_weights::<Q4K>(GgmlDType::Q4K);
    layout_keeps_the_weights::<Q6K>(GgmlDType::Q6K);
}

#[test]
fn grouped_rows_decode_as_their_stored_blocks() {
    let mut seed = 9;
    let (outs, inner) = (16, 512);
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        let (stored, _) = quantized(outs, inner, dtype, &mut seed);
        let mut bytes = stored.clone();
        match dtype {
            GgmlDType::Q4K => repack::<Q4K>(&mut bytes, outs, 2),
            _ => repack::<Q6K>(&mut bytes, outs, 2),
        }
        for row in 0..outs {
            for k in 0..2 {
                let (a, b) = if dtype == GgmlDType::Q4K {
                    let s: &[BlockQ4K] = bytemuck::cast_slice(&stored);
                    (
                        Q4K::decode(&s[row * 2 + k]),
                        decoded(view::<Q4K>(&bytes, outs, inner), row, k),
                    )
                } else {
                    let s: &[BlockQ6K] = bytemuck::cast_slice(&stored);
                    (
                        Q6K::decode(&s[row * 2 + k]),
                        decoded(view::<Q6K>(&bytes, outs, inner), row, k),
                    )
                };
                assert_eq!(
                    (a.d, a.dmin, a.sc, a.m),
                    (b.d, b.dmin, b.sc, b.m),
                    "{dtype:?} {row} {k}"
                );
                assert_eq!(a.q, b.q, "{dtype:?} {row} {k}");
            }
        }
    }
}

fn within_rounding<K: k_quants_simd::Groups>(dtype: GgmlDType) {
    let mut seed = 11;
    let (outs, inner) = (29, 1024);
    let (bytes, wide) = packed::<K>(outs, inner, dtype, &mut seed);
    let x: Vec<f32> = (0..3 * inner).map(|_| 2.0 * lcg(&mut seed)).collect();
    let got = run(
        Q8Isa::for_isa(detected_isa()),
        &x,
        3,
        inner,
        view::<K>(&bytes, outs, inner),
    );
    let label = format!("{dtype:?}");
    assert_within_activation_rounding(&x, &wide, &got, inner, QK_K, &label);
}

#[test]
fn products_lie_within_the_activations_rounding_of_the_f32_product() {
    within_rounding::<Q4K>(GgmlDType::Q4K);
    within_rounding::<Q6K>(GgmlDType::Q6K);
}

#[test]
fn threads_and_pooled_products_give_the_serial_bits() {
    let mut seed = 5;
    let (outs, inner) = (1024, 256);
    let (w4, _) = packed::<Q4K>(outs, inner, GgmlDType::Q4K, &mut seed);
    let (w6, _) = packed::<Q6K>(outs, inner, GgmlDType::Q6K, &mut seed);
    let (w4, w6) = (view::<Q4K>(&w4, outs, inner), view::<Q6K>(&w6, outs, inner));
    let x: Vec<f32> = (0..5 * inner).map(|_| lcg(&mut seed)).collect();
    let isa = Q8Isa::for_isa(detected_isa());
    let (s4, s6) = (run(isa, &x, 5, inner, w4), run(isa, &x, 5, inner, w6));
    for threads in [1, 2, 3] {
        let k = with_threads(threads);
        let (mut a, mut b) = (vec![0f32; 5 * outs], vec![0f32; 5 * outs]);
        k.matmuls_t(
            &x,
            5,
            inner,
            &mut [(Weight::Q4K(w4), &mut a), (Weight::Q6K(w6), &mut b)],
        );
        assert_eq!((&a, &b), (&s4, &s6), "{threads} threads");
    }
}
