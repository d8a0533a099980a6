//! The Q8_0 and Q4_0 kernels: one result on every ISA, independent of the other rows and of
//! the threads' split, and within the activations' rounding of the dequantized f32 product.

use super::q4_0::{BlockQ4_0, KindQ4_0};
use super::q8_0::{BlockQ8_0, Groups32, KindQ8_0, Q8Isa, QK8_0, QuantizedRows, product};
use super::tests::{assert_within_activation_rounding, lcg, supported_isas, with_threads};
use super::*;

/// A block type of 32 weights as the tests make and widen it.
trait Kind: Groups32 {
    fn quantize(x: &[f32]) -> Self::Block;
    fn dequantize(b: &Self::Block, out: &mut [f32]);
}

impl Kind for KindQ8_0 {
    fn quantize(x: &[f32]) -> BlockQ8_0 {
        BlockQ8_0::quantize(x)
    }
    fn dequantize(b: &BlockQ8_0, out: &mut [f32]) {
        b.dequantize_into(out);
    }
}

impl Kind for KindQ4_0 {
    fn quantize(x: &[f32]) -> BlockQ4_0 {
        BlockQ4_0::quantize(x)
    }
    fn dequantize(b: &BlockQ4_0, out: &mut [f32]) {
        b.dequantize_into(out);
    }
}

/// Runs `$test::<K>()` for both kinds.
macro_rules! both_kinds {
    ($($test:ident => $generic:ident),* $(,)?) => {$(
        #[test]
        fn $test() {
            $generic::<KindQ8_0>();
            $generic::<KindQ4_0>();
        }
    )*};
}

both_kinds! {
    every_isa_gives_the_portable_bits_whatever_the_rows => portable_bits,
    products_lie_within_the_activations_rounding_of_the_f32_product => within_rounding,
    threads_and_pooled_products_give_the_serial_bits => threads_serial,
    the_layout_keeps_every_weight_and_widens_like_the_blocks => layout_widens,
}

/// `outs` rows of `inner` random weights quantized to `K` in the kernels' layout, and the
/// same weights dequantized.
fn q8_matrix<K: Kind>(outs: usize, inner: usize, seed: &mut u64) -> (Vec<K::Block>, Vec<f32>) {
    let dense: Vec<f32> = (0..outs * inner).map(|_| lcg(seed)).collect();
    let mut blocks: Vec<K::Block> = dense.chunks_exact(QK8_0).map(K::quantize).collect();
    let mut wide = vec![0f32; outs * inner];
    for (b, out) in blocks.iter().zip(wide.chunks_exact_mut(QK8_0)) {
        K::dequantize(b, out);
    }
    packed::repack::<K>(bytemuck::cast_slice_mut(&mut blocks), outs, inner / QK8_0);
    (blocks, wide)
}

/// The blocks of [`q8_matrix`] as the kernels take them.
fn view<K: Kind>(w: &[K::Block], inner: usize) -> Packed<'_, K> {
    let blocks = inner / QK8_0;
    Packed::from_bytes(bytemuck::cast_slice(w), w.len() / blocks, blocks).unwrap()
}

fn run<K: Kind>(isa: Q8Isa, x: &[f32], rows: usize, inner: usize, w: &[K::Block]) -> Vec<f32> {
    let outs = w.len() * QK8_0 / inner;
    let w = view::<K>(w, inner);
    let mut q = QuantizedRows::default();
    q.quantize(isa, &Rows { x, rows, inner });
    let mut out = vec![f32::NAN; rows * outs];
    product(
        isa,
        Prefetch::L2,
        &q,
        w,
        SharedOut::new(&mut out),
        OutLayout { col: 1, row: outs },
    );
    out
}

fn portable_bits<K: Kind>() {
    let mut seed = 7;
    for (outs, inner) in [
        (1, 32),
        (5, 64),
        (24, 64),
        (37, 96),
        (40, 96),
        (64, 256),
        (19, 2048),
    ] {
        let (w, _) = q8_matrix::<K>(outs, inner, &mut seed);
        let x: Vec<f32> = (0..7 * inner).map(|_| 3.0 * lcg(&mut seed)).collect();
        let alone: Vec<Vec<f32>> = (0..7)
            .map(|r| {
                run::<K>(
                    Q8Isa::Portable,
                    &x[r * inner..(r + 1) * inner],
                    1,
                    inner,
                    &w,
                )
            })
            .collect();
        for isa in supported_isas() {
            for rows in 1..=7 {
                let got = run::<K>(Q8Isa::for_isa(isa), &x[..rows * inner], rows, inner, &w);
                for (r, want) in alone.iter().enumerate().take(rows) {
                    let row = &got[r * outs..(r + 1) * outs];
                    let same = row
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{isa:?} outs {outs} inner {inner} rows {rows} row {r}"
                    );
                }
            }
        }
    }
}

fn within_rounding<K: Kind>() {
    let mut seed = 11;
    let (outs, inner) = (29, 512);
    let (w, wide) = q8_matrix::<K>(outs, inner, &mut seed);
    let x: Vec<f32> = (0..3 * inner).map(|_| 2.0 * lcg(&mut seed)).collect();
    let got = run::<K>(Q8Isa::for_isa(detected_isa()), &x, 3, inner, &w);
    let label = std::any::type_name::<K>();
    assert_within_activation_rounding(&x, &wide, &got, inner, QK8_0, label);
}

fn threads_serial<K: Kind>()
where
    for<'a> Weight<'a>: From<Packed<'a, K>>,
{
    let mut seed = 5;
    let (outs, inner) = (1024, 64);
    let (w, _) = q8_matrix::<K>(outs, inner, &mut seed);
    let (w2, _) = q8_matrix::<K>(outs, inner, &mut seed);
    let x: Vec<f32> = (0..5 * inner).map(|_| lcg(&mut seed)).collect();
    let serial = run::<K>(Q8Isa::for_isa(detected_isa()), &x, 5, inner, &w);
    let serial2 = run::<K>(Q8Isa::for_isa(detected_isa()), &x, 5, inner, &w2);
    for threads in [1, 2, 3] {
        let k = with_threads(threads);
        let mut got = vec![0f32; 5 * outs];
        k.matmul_t(&x, Weight::from(view::<K>(&w, inner)), 5, inner, &mut got);
        assert_eq!(got, serial, "{threads} threads");
        let (mut a, mut b) = (vec![0f32; 5 * outs], vec![0f32; 5 * outs]);
        k.matmuls_t(
            &x,
            5,
            inner,
            &mut [
                (Weight::from(view::<K>(&w, inner)), &mut a),
                (Weight::from(view::<K>(&w2, inner)), &mut b),
            ],
        );
        assert_eq!(
            (a, b),
            (serial.clone(), serial2.clone()),
            "{threads} threads, two products"
        );
    }
}

fn layout_widens<K: Kind>()
where
    for<'a> Weight<'a>: From<Packed<'a, K>>,
{
    let mut seed = 3;
    for outs in [3, 8, 13, 24] {
        let inner = 64;
        let (w, wide) = q8_matrix::<K>(outs, inner, &mut seed);
        let mut got = Vec::new();
        Weight::from(view::<K>(&w, inner)).widen_into(0..outs * inner, &mut got);
        assert_eq!(got, wide, "{outs} rows");
        let mut row = Vec::new();
        Weight::from(view::<K>(&w, inner)).widen_into(inner + 5..2 * inner - 3, &mut row);
        assert_eq!(
            row,
            wide[inner + 5..2 * inner - 3],
            "{outs} rows, part of row 1"
        );
        if outs > 8 {
            let half = Weight::from(view::<K>(&w, inner)).slice(8 * inner..outs * inner);
            let mut rest = Vec::new();
            half.widen_into(0..half.len(), &mut rest);
            assert_eq!(rest, wide[8 * inner..], "{outs} rows from 8");
        }
    }
}

#[test]
fn blocks_quantize_as_llama_cpp_rounds() {
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
    let b = BlockQ8_0::quantize(&x);
    assert_eq!(b.d.to_f32(), half::f16::from_f32(15.5 / 127.0).to_f32());
    assert_eq!((b.qs[0], b.qs[1], b.qs[31]), (-127, -119, 127)); // −14.5 · 127 / 15.5 = −118.8
    assert_eq!(BlockQ8_0::quantize(&[0.0; 32]).qs, [0; 32]);
}

#[test]
fn q4_0_blocks_quantize_as_llama_cpp_rounds() {
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
    let b = BlockQ4_0::quantize(&x);
    // The first value of largest magnitude, −15.5, is −8 steps exactly.
    assert_eq!(b.d.to_f32(), half::f16::from_f32(15.5 / 8.0).to_f32());
    let w = b.weights();
    // −14.5 · 8 / 15.5 = −7.48 and 15.5 clamps to 7; 0.5 · 8 / 15.5 = 0.26.
    assert_eq!((w[0], w[1], w[16], w[31]), (-8, -7, 0, 7));
    assert_eq!(BlockQ4_0::quantize(&[0.0; 32]).weights(), [0; 32]);
}
