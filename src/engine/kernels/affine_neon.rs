//! The affine blocks' NEON kernel (`affine`'s one definition): a pair's 16 lanes in four
//! registers. Each 16-weight chunk of a weight row is dequantized once for all rows of a
//! block (its integers widened to f32 and `s·q + b` fused), then one fused multiply-add per row
//! and register, so the lanes see the portable loops' operations in their order and
//! [`hsum16`] sums them: the same bits (the kernels' tests hold them to it under qemu).

use std::arch::aarch64::*;

use super::affine::{AffineMatrix, hsum16};
use super::dense::{ROW_BLOCK, row_blocks};
use super::{OutLayout, SharedOut};

/// [`super::affine::product`] with NEON (every aarch64 CPU has it).
pub(super) fn product(x: &[f32], w: AffineMatrix<'_>, out: SharedOut<'_>, to: OutLayout) {
    let inner = w.inner();
    let rows = x.len() / inner.max(1);
    for block in row_blocks(rows, ROW_BLOCK) {
        let xs = &x[block.start * inner..block.end * inner];
        for j in 0..w.rows() {
            // SAFETY: NEON is part of every aarch64 target; `xs` holds whole rows of `inner`,
            // the weights' row length.
            unsafe {
                with_rows!(block.len(), R => rows_times::<R>(xs, w, j, out, to, block.start));
            }
        }
    }
}

/// 16 integers at `p` (8-bit: one a byte; 4-bit: the low nibbles of 16 bytes, or the high ones
/// where `high`) as `s·q + b`, lane `l` in register `l / 4`.
///
/// # Safety
/// 16 bytes are readable at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn dequant16(
    p: *const u8,
    four_bit: Option<bool>,
    s: float32x4_t,
    b: float32x4_t,
) -> [float32x4_t; 4] {
    // SAFETY: the caller's bounds; NEON is part of every aarch64 target.
    unsafe {
        let v = vld1q_u8(p);
        let v = match four_bit {
            Some(false) => vandq_u8(v, vdupq_n_u8(0x0F)),
            Some(true) => vshrq_n_u8::<4>(v),
            None => v,
        };
        let (lo, hi) = (vmovl_u8(vget_low_u8(v)), vmovl_high_u8(v));
        let q = [
            vmovl_u16(vget_low_u16(lo)),
            vmovl_high_u16(lo),
            vmovl_u16(vget_low_u16(hi)),
            vmovl_high_u16(hi),
        ];
        q.map(|q| vfmaq_f32(b, s, vcvtq_f32_u32(q)))
    }
}

/// Rows `xs` (`R` of `w.inner()`) times weight row `j` into `out` (row `first + r`).
///
/// # Safety
/// The CPU must have NEON; `xs` holds `R` whole rows of `w.inner()`.
#[target_feature(enable = "neon")]
unsafe fn rows_times<const R: usize>(
    xs: &[f32],
    w: AffineMatrix<'_>,
    j: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let (kind, inner) = (w.kind(), w.inner());
    let row = w.row(j);
    let mut acc = [[vdupq_n_f32(0.0); 4]; R];
    for g in 0..inner / kind.group() {
        let block = &row[g * kind.block_bytes()..(g + 1) * kind.block_bytes()];
        let f = |at: usize| {
            f32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
        };
        let (s, b) = (vdupq_n_f32(f(0)), vdupq_n_f32(f(4)));
        let packed = &block[8..];
        // (packed byte offset, nibble half or none, activation offset in the group) per chunk
        // of 16 lanes, in the definition's order.
        let chunks = (0..kind.group() / 16).map(|c| match kind.bits() {
            4 => (16 * (c / 2), Some(c % 2 == 1), 32 * (c / 2) + 16 * (c % 2)),
            _ => (16 * c, None, 16 * c),
        });
        for (byte, half, at) in chunks {
            // SAFETY: the chunk's 16 bytes lie in the block.
            let wv = unsafe { dequant16(packed[byte..byte + 16].as_ptr(), half, s, b) };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xp = xs[r * inner + g * kind.group() + at..][..16].as_ptr();
                for (i, (a, wi)) in acc_r.iter_mut().zip(wv).enumerate() {
                    // SAFETY: `xp` holds 16 floats.
                    *a = vfmaq_f32(*a, unsafe { vld1q_f32(xp.add(4 * i)) }, wi);
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let mut lanes = [0f32; 16];
        for (i, a) in acc_r.iter().enumerate() {
            // SAFETY: `lanes` holds 16 floats.
            unsafe { vst1q_f32(lanes.as_mut_ptr().add(4 * i), *a) };
        }
        out.set(j * to.col + (first + r) * to.row, hsum16(&lanes));
    }
}
