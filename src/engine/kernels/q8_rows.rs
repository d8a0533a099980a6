//! Activation rows quantized per block of 32 for `q8_0`'s and `q4_0`'s integer products
//! ([`QuantizedRows`]), once a product for every thread and weight (`super::Input`), and the
//! views of some of its rows the kernels take.

use super::Rows;
use super::act_quant::{block_scale, push_rounded};
use super::q8_0::{Q8Isa, QK8_0};

/// Activation rows quantized per block of 32 for the integer products: `qs` (`rows × inner`
/// bytes), 8 times each block's sum (`sums8`: the weights are `vpdpbusd`'s unsigned operand,
/// offset by 128 for Q8_0 and by 8 for Q4_0, and `offset · Σx` comes off each product) and
/// one f32 scale per block (`scales`); for VNNI's pairs of rows (`q8_vnni`) the same of rows
/// `2p` and `2p + 1` interleaved (`pair_*`: 4 bytes of each in turn, and the two rows' sums and
/// scales side by side; an odd last row paired with itself). The scale stays f32 (llama.cpp rounds it to f16): it is one
/// float a block, and an f16 would add a rounding.
#[derive(Debug, Default)]
pub struct QuantizedRows {
    qs: Vec<i8>,
    #[cfg(target_arch = "x86_64")]
    sums8: Vec<i32>,
    scales: Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    pairs: Pairs,
    blocks: usize,
}

impl QuantizedRows {
    /// Quantizes `input`'s rows, reusing this value's buffers: per block `d = max|x| / 127`
    /// and `round(x / d)`, so every value lies in −127..=127.
    pub fn quantize(&mut self, isa: Q8Isa, input: &Rows<'_>) {
        debug_assert_eq!(input.inner % QK8_0, 0);
        self.blocks = input.inner / QK8_0;
        self.qs.clear();
        self.scales.clear();
        let used = input.rows * input.inner;
        for block in input.x[..used].chunks_exact(QK8_0) {
            let (d, id) = block_scale(block);
            self.scales.push(d);
            push_rounded(isa, block, id, &mut self.qs);
        }
        #[cfg(target_arch = "x86_64")]
        {
            self.sums8.clear();
            let sum8 = |b: &[i8]| 8 * b.iter().map(|&q| i32::from(q)).sum::<i32>();
            self.sums8.extend(self.qs.chunks_exact(QK8_0).map(sum8));
            self.pairs.clear();
            if isa == Q8Isa::Avx512Vnni && input.rows > 1 {
                self.interleave_pairs(input.rows);
            }
        }
    }

    /// Fills [`Pairs`] from the rows.
    #[cfg(target_arch = "x86_64")]
    fn interleave_pairs(&mut self, rows: usize) {
        let b = self.blocks;
        for p in 0..rows.div_ceil(2) {
            let pair = [2 * p, (2 * p + 1).min(rows - 1)];
            for k in 0..b {
                let block = |r: usize| &self.qs[(r * b + k) * QK8_0..(r * b + k + 1) * QK8_0];
                let (x0, x1) = (block(pair[0]), block(pair[1]));
                for (a, c) in x0.chunks_exact(4).zip(x1.chunks_exact(4)) {
                    self.pairs.qs.extend_from_slice(a);
                    self.pairs.qs.extend_from_slice(c);
                }
                for r in pair {
                    self.pairs.sums8.push(self.sums8[r * b + k]);
                    self.pairs.scales.push(self.scales[r * b + k]);
                }
            }
        }
    }

    /// Rows `range` of it (from an even row where it has pairs).
    pub(super) fn rows(&self, range: std::ops::Range<usize>) -> QuantRowsView<'_> {
        let b = self.blocks;
        let bytes = range.start * b * QK8_0..range.end * b * QK8_0;
        #[cfg(target_arch = "x86_64")]
        let pairs = range.start / 2..range.end.div_ceil(2);
        QuantRowsView {
            #[cfg(target_arch = "x86_64")]
            sums8: &self.sums8[range.start * b..range.end * b],
            #[cfg(target_arch = "x86_64")]
            pair_qs: self
                .pairs
                .qs
                .get(pairs.start * b * 2 * QK8_0..)
                .unwrap_or(&[]),
            #[cfg(target_arch = "x86_64")]
            pair_sums8: self.pairs.sums8.get(pairs.start * b * 2..).unwrap_or(&[]),
            #[cfg(target_arch = "x86_64")]
            pair_scales: self.pairs.scales.get(pairs.start * b * 2..).unwrap_or(&[]),
            qs: &self.qs[bytes],
            scales: &self.scales[range.start * b..range.end * b],
            blocks: b,
        }
    }

    /// Its rows.
    pub(super) fn len(&self) -> usize {
        self.scales.len() / self.blocks.max(1)
    }
}

/// [`QuantizedRows`]' rows by pairs, for VNNI.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Default)]
struct Pairs {
    qs: Vec<i8>,
    sums8: Vec<i32>,
    scales: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
impl Pairs {
    fn clear(&mut self) {
        self.qs.clear();
        self.sums8.clear();
        self.scales.clear();
    }
}

/// Some rows of a [`QuantizedRows`].
#[derive(Debug, Clone, Copy)]
pub(super) struct QuantRowsView<'a> {
    /// The rows' quantized values, row after row.
    pub(super) qs: &'a [i8],
    /// Each block's sum times 8, row after row.
    #[cfg(target_arch = "x86_64")]
    pub(super) sums8: &'a [i32],
    /// The rows' pairs (from the first), interleaved ([`QuantizedRows`]).
    #[cfg(target_arch = "x86_64")]
    pub(super) pair_qs: &'a [i8],
    /// The pairs' block sums times 8, the two rows side by side.
    #[cfg(target_arch = "x86_64")]
    pub(super) pair_sums8: &'a [i32],
    /// The pairs' block scales, the two rows side by side.
    #[cfg(target_arch = "x86_64")]
    pub(super) pair_scales: &'a [f32],
    /// Each row's block scales, row after row.
    pub(super) scales: &'a [f32],
    /// Blocks a row.
    pub(super) blocks: usize,
}

impl QuantRowsView<'_> {
    pub(super) fn rows(&self) -> usize {
        self.scales.len() / self.blocks.max(1)
    }
}
