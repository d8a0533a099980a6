//! Q4_0 weights (GGUF's `block_q4_0`: 32 four-bit weights and one f16 scale a block, 4.5 bits
//! a weight) multiplied as stored. A weight is its nibble less 8 times the scale, so a block is
//! a Q8_0 block whose bytes lie in −8..=7, and `q8_0`'s one definition holds unchanged:
//! `acc = fma(isum(b), dw(b) · dx(b), acc)` over the blocks in order, `isum` the exact integer
//! sum of the 32 products against the activations quantized per block of 32
//! ([`super::q8_0::QuantizedRows`]). Every ISA gives the portable loops' bits, whatever the
//! other rows of a step and the threads' split, so speculative output equals the baseline's.
//!
//! # Layout
//!
//! A group interleaves 8 rows' blocks as Q8_0's does, 4 bytes of each row in turn, but the
//! bytes are the stored ones: byte `4·k + t` of a row holds weight `4·k + t` in its low nibble
//! and weight `16 + 4·k + t` in its high one. So one 32-byte load holds two of Q8_0's 4-byte
//! steps of all 8 rows, split by a mask and a shift.
//!
//! # The offset
//!
//! On x86 the nibbles (0..=15) are `vpmaddubsw`'s and `vpdpbusd`'s unsigned operand against
//! the signed activations, and `8 · Σx` (a block's activations, once per row and block for
//! every weight row: `QuantizedRows::sums8`) comes off the sum: `Σ(q − 8)·x = Σq·x − 8·Σx`,
//! exact in integers. NEON's `sdot` takes both signed, so there each nibble less 8.

use half::f16;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::packed::{GROUP_ROWS, Interleave, Packed};
use super::q8_0::{Blocks32, Groups32, QK8_0};
#[cfg(target_arch = "x86_64")]
use super::q8_0::{QuantRowsView, broadcast4, prefetch, scales8, store8};
use super::weight_element::QuantKind;
#[cfg(target_arch = "x86_64")]
use super::{OutLayout, Prefetch, SharedOut};

/// GGUF's `block_q4_0`: weight `i < 16` is `((qs[i] & 15) − 8) · d`, weight `16 + i` is
/// `((qs[i] >> 4) − 8) · d`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4_0 {
    /// The block's scale.
    pub d: f16,
    /// The weights' nibbles.
    pub qs: [u8; QK8_0 / 2],
}

/// One block of each of 8 weight rows, interleaved ([`KindQ4_0::pack`]): `d[j]` is row `j`'s
/// scale and `qs[32k + 4j + t]` its stored byte `4k + t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4_0x8 {
    /// The 8 rows' scales.
    pub d: [f16; GROUP_ROWS],
    /// Their nibbles, 4 bytes of each row in turn.
    pub qs: [u8; QK8_0 / 2 * GROUP_ROWS],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_0x8>() == 8 * 18);

// SAFETY: `repr(C)` of an f16 (2 bytes, align 2) and 16 u8 at offset 2: 18 bytes, no padding,
// and every bit pattern is a valid f16 and u8.
unsafe impl bytemuck::Zeroable for BlockQ4_0 {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for BlockQ4_0 {}
// SAFETY: `repr(C)` of 8 f16 (16 bytes, align 2) and 128 u8 at offset 16: 144 bytes, no
// padding, every bit pattern valid.
unsafe impl bytemuck::Zeroable for BlockQ4_0x8 {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for BlockQ4_0x8 {}

impl BlockQ4_0 {
    /// The block of `x` (32 floats) as llama.cpp's `quantize_row_q4_0_ref` makes it: `d` is
    /// the value of largest magnitude over −8 (so that value is −8 exactly), stored in f16, and
    /// each nibble `min(15, trunc(x / d + 8.5))` with the unrounded f32 reciprocal.
    pub fn quantize(x: &[f32]) -> Self {
        let mut max = 0f32;
        for &v in x {
            if v.abs() > max.abs() {
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let nibble = |v: f32| ((v * id + 8.5) as u8).min(15);
        let mut qs = [0u8; QK8_0 / 2];
        for (i, q) in qs.iter_mut().enumerate() {
            *q = nibble(x[i]) | (nibble(x[QK8_0 / 2 + i]) << 4);
        }
        Self {
            d: f16::from_f32(d),
            qs,
        }
    }

    /// Its 32 weights as the one definition takes them: each nibble less 8.
    pub fn weights(&self) -> [i8; QK8_0] {
        let mut w = [0i8; QK8_0];
        for (i, &q) in self.qs.iter().enumerate() {
            w[i] = (q & 0x0F) as i8 - 8;
            w[QK8_0 / 2 + i] = (q >> 4) as i8 - 8;
        }
        w
    }

    /// Its 32 weights in f32 (exact).
    pub fn dequantize_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, q) in out.iter_mut().zip(self.weights()) {
            *o = f32::from(q) * d;
        }
    }
}

/// GGUF's Q4_0 as [`Interleave`]s it: [`BlockQ4_0`]s in [`BlockQ4_0x8`] groups.
#[derive(Debug, Clone, Copy)]
pub struct KindQ4_0;

impl Interleave for KindQ4_0 {
    const KIND: QuantKind = QuantKind::Q4_0;
    type Block = BlockQ4_0;
    type Group = BlockQ4_0x8;

    fn pack(rows: &[BlockQ4_0; GROUP_ROWS]) -> BlockQ4_0x8 {
        let mut item = BlockQ4_0x8 {
            d: [f16::ZERO; GROUP_ROWS],
            qs: [0; QK8_0 / 2 * GROUP_ROWS],
        };
        for (j, b) in rows.iter().enumerate() {
            item.d[j] = b.d;
            for k in 0..QK8_0 / 8 {
                let at = 32 * k + 4 * j;
                item.qs[at..at + 4].copy_from_slice(&b.qs[4 * k..4 * k + 4]);
            }
        }
        item
    }
}

impl Blocks32 for KindQ4_0 {
    fn group_row(item: &BlockQ4_0x8, j: usize) -> (f16, [i8; QK8_0]) {
        let mut block = BlockQ4_0 {
            d: item.d[j],
            qs: [0; QK8_0 / 2],
        };
        for (k, four) in block.qs.chunks_exact_mut(4).enumerate() {
            let at = 32 * k + 4 * j;
            four.copy_from_slice(&item.qs[at..at + 4]);
        }
        (block.d, block.weights())
    }

    fn block_row(b: &BlockQ4_0) -> (f16, [i8; QK8_0]) {
        (b.d, b.weights())
    }
}

/// A Q4_0 matrix in the kernels' layout (`packed`).
pub type Q4Matrix<'a> = Packed<'a, KindQ4_0>;

impl Groups32 for KindQ4_0 {
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_groups<const R: usize>(
        plan: Prefetch,
        xs: QuantRowsView<'_>,
        groups: &[BlockQ4_0x8],
        out: SharedOut<'_>,
        to: OutLayout,
        first: usize,
    ) {
        // SAFETY: the caller's.
        unsafe { avx2_groups::<R>(plan, xs, groups, out, to, first) }
    }
}

/// A group's block as 8 vectors of unsigned nibbles: `[k]` holds weights `4k..4k + 4` of the 8
/// rows (a 4-byte lane each), as Q8_0's `k`th 32-byte step does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn nibbles(item: &BlockQ4_0x8) -> [__m256i; 8] {
    let nib = _mm256_set1_epi8(0x0F);
    let mut w = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        // SAFETY: the feature; the block's 128 bytes are readable.
        let v = unsafe { _mm256_loadu_si256(item.qs.as_ptr().add(32 * k).cast()) };
        w[k] = _mm256_and_si256(v, nib);
        w[k + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
    }
    w
}

/// AVX2's products of the one definition: per group block and row, 8 `vpmaddubsw` of the
/// nibbles and the activations (a pair at most 2 · 15 · 127, four of them 15240 < 2¹⁵, added
/// in 16 bits), two `vpmaddwd` by ones, less `8 · Σx`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `xs` holds `R` rows of `xs.blocks` blocks and
/// `groups` whole groups of as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_groups<const R: usize>(
    plan: Prefetch,
    xs: QuantRowsView<'_>,
    groups: &[BlockQ4_0x8],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    let ones = _mm256_set1_epi16(1);
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, item) in group.iter().enumerate() {
            prefetch(plan, item);
            // SAFETY: the features.
            let (w, dw) = (nibbles(item), unsafe { scales8(&item.d) });
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xp = xs.qs[(r * b + k) * QK8_0..].as_ptr();
                let half = |h: usize| {
                    // SAFETY: row `r` holds block `k`'s 32 bytes at `xp`.
                    let p = |i: usize| unsafe {
                        _mm256_maddubs_epi16(w[4 * h + i], broadcast4(xp.add(4 * (4 * h + i))))
                    };
                    let sum = _mm256_add_epi16(
                        _mm256_add_epi16(p(0), p(1)),
                        _mm256_add_epi16(p(2), p(3)),
                    );
                    _mm256_madd_epi16(sum, ones)
                };
                let isum = _mm256_sub_epi32(
                    _mm256_add_epi32(half(0), half(1)),
                    _mm256_set1_epi32(xs.sums8[r * b + k]),
                );
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xs.scales[r * b + k]));
                *acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc_r);
            }
        }
        let at = out.from(g * GROUP_ROWS * to.col);
        for (r, a) in acc.into_iter().enumerate() {
            // SAFETY: the features.
            unsafe { store8(a, at, to, first + r) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl super::q8_vnni::VnniGroup for BlockQ4_0x8 {
    const SHIFT: u32 = 0;

    fn scales(&self) -> &[f16; GROUP_ROWS] {
        &self.d
    }

    #[inline(always)]
    unsafe fn weights(&self) -> [__m256i; 8] {
        // SAFETY: the caller's feature.
        unsafe { nibbles(self) }
    }
}
