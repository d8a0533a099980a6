//! The K-quant kernels: the layout keeps every integer, dequantization is llama.cpp's (candle's
//! port of it as the independent reader), one result on every ISA whatever the rows and the
//! threads' split, within the activations' rounding of the dequantized f32 product.

use candle_core::quantized::{GgmlDType, QTensor};

use super::k_quants::{KRows, Q4K, Q6K, QK_K, decoded, product};
use super::packed::{Interleave, Packed, repack};
use super::q5k::Q5K;
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
    q.quantize(isa, &Rows { x, rows, inner }, K::KIND == QuantKind::Q6K);
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
    isas_give_the_portable_bits::<Q5K>(GgmlDType::Q5K);
    isas_give_the_portable_bits::<Q6K>(GgmlDType::Q6K);
}

/// Every ISA against the portable loops on `rows` rows of blocks `block` (16 rows of 2
/// super-blocks) times activations all `+1`, all `−1` and of alternating sign: the largest
/// sums the kernels' 16-bit lanes hold.
fn extremes_give_the_portable_bits<K: k_quants_simd::Groups>(block: K::Block) {
    let (outs, inner) = (16, 512);
    let mut bytes: Vec<u8> = (0..outs * 2)
        .flat_map(|_| bytemuck::bytes_of(&block).to_vec())
        .collect();
    repack::<K>(&mut bytes, outs, 2);
    let w = view::<K>(&bytes, outs, inner);
    for x in [
        |_| 1.0,
        |_| -1.0,
        |i: usize| if i.is_multiple_of(2) { 1.0 } else { -1.0 },
    ] {
        let x: Vec<f32> = (0..inner).map(x).collect();
        let want = run(Q8Isa::Portable, &x, 1, inner, w);
        for isa in supported_isas() {
            let got = run(Q8Isa::for_isa(isa), &x, 1, inner, w);
            assert_eq!(got, want, "{:?} {isa:?}", K::KIND);
        }
    }
}

#[test]
fn the_largest_integers_give_the_portable_bits() {
    let one = half::f16::ONE;
    let mut q4: BlockQ4K = bytemuck::Zeroable::zeroed();
    (q4.d, q4.dmin, q4.scales, q4.qs) = (one, one, [0xFF; 12], [0xFF; QK_K / 2]);
    extremes_give_the_portable_bits::<Q4K>(q4);
    let mut q5: BlockQ5K = bytemuck::Zeroable::zeroed();
    (q5.d, q5.dmin, q5.scales) = (one, one, [0xFF; 12]);
    (q5.qh, q5.qs) = ([0xFF; QK_K / 8], [0xFF; QK_K / 2]);
    extremes_give_the_portable_bits::<Q5K>(q5);
    let mut q6: BlockQ6K = bytemuck::Zeroable::zeroed();
    (q6.d, q6.scales) = (one, [-128; QK_K / 16]);
    (q6.ql, q6.qh) = ([0xFF; QK_K / 2], [0xFF; QK_K / 4]);
    extremes_give_the_portable_bits::<Q6K>(q6);
    (q6.ql, q6.qh) = ([0; QK_K / 2], [0; QK_K / 4]);
    extremes_give_the_portable_bits::<Q6K>(q6);
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
    layout_keeps_the_weights::<Q5K>(GgmlDType::Q5K);
    layout_keeps_the_weights::<Q6K>(GgmlDType::Q6K);
}

fn grouped_rows_decode_as_stored<K: KQuant>(dtype: GgmlDType) {
    let mut seed = 9;
    let (outs, inner) = (16, 512);
    let (stored, _) = quantized(outs, inner, dtype, &mut seed);
    let mut bytes = stored.clone();
    repack::<K>(&mut bytes, outs, 2);
    let blocks: &[K::Block] = bytemuck::cast_slice(&stored);
    for row in 0..outs {
        for k in 0..2 {
            let a = K::decode(&blocks[row * 2 + k]);
            let b = decoded(view::<K>(&bytes, outs, inner), row, k);
            assert_eq!(
                (a.d, a.dmin, a.sc, a.m),
                (b.d, b.dmin, b.sc, b.m),
                "{dtype:?} {row} {k}"
            );
            assert_eq!(a.q, b.q, "{dtype:?} {row} {k}");
        }
    }
}

#[test]
fn grouped_rows_decode_as_their_stored_blocks() {
    grouped_rows_decode_as_stored::<Q4K>(GgmlDType::Q4K);
    grouped_rows_decode_as_stored::<Q5K>(GgmlDType::Q5K);
    grouped_rows_decode_as_stored::<Q6K>(GgmlDType::Q6K);
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
    within_rounding::<Q5K>(GgmlDType::Q5K);
    within_rounding::<Q6K>(GgmlDType::Q6K);
}

#[test]
fn threads_and_pooled_products_give_the_serial_bits() {
    let mut seed = 5;
    let (outs, inner) = (1024, 256);
    let (w4, _) = packed::<Q4K>(outs, inner, GgmlDType::Q4K, &mut seed);
    let (w5, _) = packed::<Q5K>(outs, inner, GgmlDType::Q5K, &mut seed);
    let (w6, _) = packed::<Q6K>(outs, inner, GgmlDType::Q6K, &mut seed);
    let w4 = view::<Q4K>(&w4, outs, inner);
    let w5 = view::<Q5K>(&w5, outs, inner);
    let w6 = view::<Q6K>(&w6, outs, inner);
    let x: Vec<f32> = (0..5 * inner).map(|_| lcg(&mut seed)).collect();
    let isa = Q8Isa::for_isa(detected_isa());
    let serial = [
        run(isa, &x, 5, inner, w4),
        run(isa, &x, 5, inner, w5),
        run(isa, &x, 5, inner, w6),
    ];
    for threads in [1, 2, 3] {
        let k = with_threads(threads);
        let mut got = [(); 3].map(|_| vec![0f32; 5 * outs]);
        let [a, b, c] = &mut got;
        k.matmuls_t(
            &x,
            5,
            inner,
            &mut [
                (Weight::Q4K(w4), a),
                (Weight::Q5K(w5), b),
                (Weight::Q6K(w6), c),
            ],
        );
        assert_eq!(got, serial, "{threads} threads");
    }
}
