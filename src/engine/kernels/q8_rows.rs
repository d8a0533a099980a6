//! Activation rows quantized per block of 32 for `q8_0`'s and `q4_0`'s integer products
//! ([`QuantizedRows`]), once a product for every thread and weight (`super::Input`), and the
//! views of some of its rows the kernels take.

use super::Rows;
use super::act_quant::Blocks32;
use super::q8_0::{Q8Isa, QK8_0};

/// Activation rows quantized per block of 32 for the integer products: `qs` (`rows × inner`
/// bytes), 8 times each block's sum (`sums8`: the weights are `vpdpbusd`'s unsigned operand,
/// offset by 128 for Q8_0 and by 8 for Q4_0, and `offset · Σx` comes off each product) and
/// one f32 scale per block (`scales`). The scale stays f32 (llama.cpp rounds it to f16): it is
/// one float a block, and an f16 would add a rounding.
#[derive(Debug, Default)]
pub struct QuantizedRows {
    qs: Vec<i8>,
    #[cfg(target_arch = "x86_64")]
    sums8: Vec<i32>,
    scales: Vec<f32>,
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
        #[cfg(target_arch = "x86_64")]
        self.sums8.clear();
        let mut blocks = Blocks32 {
            qs: &mut self.qs,
            scales: &mut self.scales,
            #[cfg(target_arch = "x86_64")]
            sums8: &mut self.sums8,
        };
        blocks.push(isa, &input.x[..input.rows * input.inner]);
    }

    /// Rows `range` of it.
    pub(super) fn rows(&self, range: std::ops::Range<usize>) -> QuantRowsView<'_> {
        let b = self.blocks;
        let bytes = range.start * b * QK8_0..range.end * b * QK8_0;
        QuantRowsView {
            #[cfg(target_arch = "x86_64")]
            sums8: &self.sums8[range.start * b..range.end * b],
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

/// Some rows of a [`QuantizedRows`].
#[derive(Debug, Clone, Copy)]
pub(super) struct QuantRowsView<'a> {
    /// The rows' quantized values, row after row.
    pub(super) qs: &'a [i8],
    /// Each block's sum times 8, row after row.
    #[cfg(target_arch = "x86_64")]
    pub(super) sums8: &'a [i32],
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
