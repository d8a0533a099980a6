//! The Q8_0 products of `q8_0`'s one definition on aarch64 with the dot-product extension:
//! `sdot` multiplies 4 bytes of each of 4 interleaved weight rows by an activation's 4 bytes
//! broadcast and adds each row's 4 products into its lane, so two registers carry a group's 8
//! rows, as `vpdpbusd` does on x86 (both operands signed here: no offset). The integer sums are
//! exact and the float part is the definition's one fused multiply-add a block, so the results
//! have the portable loops' bits (the kernels' tests hold them to it under qemu).

use std::arch::aarch64::*;

use half::f16;

use super::packed::GROUP_ROWS;
use super::q4_0::BlockQ4_0x8;
use super::q8_0::{BlockQ8_0x8, QuantRowsView};
use super::{OutLayout, SharedOut};

/// `acc` plus, in each 32-bit lane, the 4 products of `a`'s and `b`'s bytes in that lane: the
/// `sdot` instruction, written out because its intrinsic (`vdotq_s32`) is not stable Rust.
///
/// # Safety
/// The CPU must have the dot-product extension.
#[inline(always)]
pub(super) unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: the caller's feature; the instruction reads and writes registers only.
    unsafe {
        std::arch::asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// A group's 8 sums for product row `row` (rows 0..4 in `halves[0]`, 4..8 in `halves[1]`)
/// into `out`, weight row `j` at `j · to.col + row · to.row`: NEON's `q8_0::store8`.
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn store8(
    halves: [float32x4_t; 2],
    out: SharedOut<'_>,
    to: OutLayout,
    row: usize,
) {
    let mut sums = [0f32; GROUP_ROWS];
    // SAFETY: `sums` holds 8 floats.
    unsafe {
        vst1q_f32(sums.as_mut_ptr(), halves[0]);
        vst1q_f32(sums.as_mut_ptr().add(4), halves[1]);
    }
    for (j, s) in sums.into_iter().enumerate() {
        out.set(j * to.col + row * to.row, s);
    }
}

/// A group's block of 8 rows as `sdot` takes it.
pub(super) trait SdotGroup {
    /// The 8 rows' scales.
    fn scales(&self) -> &[f16; GROUP_ROWS];
    /// The 32 signed weights of the 8 rows: `[2·k4]` holds bytes `4·k4..4·k4 + 4` of rows
    /// 0..4, a 4-byte lane each, and `[2·k4 + 1]` those of rows 4..8.
    ///
    /// # Safety
    /// The CPU must have NEON.
    unsafe fn weights(&self) -> [int8x16_t; 16];
}

impl SdotGroup for BlockQ8_0x8 {
    fn scales(&self) -> &[f16; GROUP_ROWS] {
        &self.d
    }

    /// The stored bytes less 128 (`q8_0`'s layout).
    #[inline(always)]
    unsafe fn weights(&self) -> [int8x16_t; 16] {
        // SAFETY: the caller's feature; the block's 256 bytes are readable.
        std::array::from_fn(|i| unsafe {
            let stored = vld1q_u8(self.qu.as_ptr().add(16 * i));
            vreinterpretq_s8_u8(veorq_u8(stored, vdupq_n_u8(0x80)))
        })
    }
}

impl SdotGroup for BlockQ4_0x8 {
    fn scales(&self) -> &[f16; GROUP_ROWS] {
        &self.d
    }

    /// Each 16 bytes hold weights `4·k..4·k + 4` (low nibbles) and `16 + 4·k..` (high) of 4
    /// rows (`q4_0`'s layout); each nibble less 8.
    #[inline(always)]
    unsafe fn weights(&self) -> [int8x16_t; 16] {
        // SAFETY: the caller's feature; the block's 128 bytes are readable.
        unsafe {
            let (mut w, eight) = ([vdupq_n_s8(0); 16], vdupq_n_s8(8));
            for k in 0..4 {
                for half in 0..2 {
                    let v = vld1q_u8(self.qs.as_ptr().add(32 * k + 16 * half));
                    let lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
                    let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                    w[2 * k + half] = vsubq_s8(lo, eight);
                    w[2 * (k + 4) + half] = vsubq_s8(hi, eight);
                }
            }
            w
        }
    }
}

/// Every group of `groups` times each row of `xs`, into `out` as `q8_0::product` lays it.
///
/// # Safety
/// The CPU must have the dot-product extension; `xs` holds whole rows of `xs.blocks` blocks
/// and `groups` whole groups of as many.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn sdot_groups<G: SdotGroup>(
    xs: QuantRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let at = out.from(g * GROUP_ROWS * to.col);
        for r in 0..xs.rows() {
            let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            for (k, item) in group.iter().enumerate() {
                let d: [f32; GROUP_ROWS] = item.scales().map(f16::to_f32);
                let xp = xs.qs[(r * b + k) * 32..].as_ptr();
                // SAFETY: the caller's features.
                let w = unsafe { item.weights() };
                let (mut ilo, mut ihi) = (vdupq_n_s32(0), vdupq_n_s32(0));
                for k4 in 0..8 {
                    // SAFETY: the row's 32 bytes at `xp` are readable; the caller's features.
                    unsafe {
                        let x4 = vreinterpretq_s8_s32(vdupq_n_s32(std::ptr::read_unaligned(
                            xp.add(4 * k4).cast::<i32>(),
                        )));
                        ilo = sdot(ilo, w[2 * k4], x4);
                        ihi = sdot(ihi, w[2 * k4 + 1], x4);
                    }
                }
                let dx = vdupq_n_f32(xs.scales[r * b + k]);
                // SAFETY: `d` holds 8 floats.
                let (dlo, dhi) = unsafe { (vld1q_f32(d.as_ptr()), vld1q_f32(d.as_ptr().add(4))) };
                lo = vfmaq_f32(lo, vcvtq_f32_s32(ilo), vmulq_f32(dlo, dx));
                hi = vfmaq_f32(hi, vcvtq_f32_s32(ihi), vmulq_f32(dhi, dx));
            }
            // SAFETY: the caller's features.
            unsafe { store8([lo, hi], at, to, first + r) };
        }
    }
}
