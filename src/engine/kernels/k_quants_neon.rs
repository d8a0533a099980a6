//! Q4_K's, Q5_K's and Q6_K's products of `k_quants`' one definition on aarch64 with the
//! dot-product extension, over [`GroupQ4K`]'s lane-pair layout: a 16-byte register holds 8
//! weights of each of 2 rows (a 4-byte lane per row and half), so `sdot` against 8 activation
//! bytes duplicated in both halves adds 4 products into each lane, as `vpdpbusd` does on x86
//! (both operands signed here: the weights are 0..32). Adjacent lanes hold one row's two
//! halves, so one pairwise add gives 4 rows' sub-block sums, which the scales multiply exactly
//! (`vmlaq_s32`); the mins come from the activations' 32-value sums. Q5_K's fifth bits (`q5k`)
//! join the nibbles as 16 where set. The float part is the definition's two FMAs a
//! super-block, so the results have the portable loops' bits (the kernels' tests hold them to
//! it under qemu).

use std::arch::aarch64::*;

use half::f16;

use super::k_quants::{GroupQ4K, GroupQ6K, KBlock, KRowsView, q4k_scale_min};
use super::packed::GROUP_ROWS;
use super::q5k::NibbleGroup;
use super::q8_neon::{sdot, store8};
use super::{OutLayout, SharedOut};

/// Rows whose sums one pass over a group keeps.
const MOST_ROWS: usize = 4;

/// A group's scales and mins as `i32`, by sub-block then row.
fn scales_by_row(g: &GroupQ4K) -> [[[i32; GROUP_ROWS]; 8]; 2] {
    let by = |min: bool| {
        std::array::from_fn(|s| {
            std::array::from_fn(|j| {
                let (sc, m) = q4k_scale_min(g, j, s);
                i32::from(if min { m } else { sc })
            })
        })
    };
    [by(false), by(true)]
}

/// 8 bytes at `p` in both halves of a register.
///
/// # Safety
/// `p` holds 8 readable bytes.
#[inline(always)]
unsafe fn duplicated8(p: *const i8) -> int8x16_t {
    // SAFETY: the caller's.
    unsafe { vreinterpretq_s8_u64(vdupq_n_u64(std::ptr::read_unaligned(p.cast()))) }
}

/// One row's super-block against a group's: each of the 8 rows' integer sums `Σₛ sc·Σ q·x`
/// and `Σₛ m·sum32`, rows 0..4 then 4..8.
///
/// # Safety
/// The CPU must have the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
unsafe fn block_sums<G: NibbleGroup>(
    x: KBlock<'_>,
    whole: &G,
    scales: &[[[i32; GROUP_ROWS]; 8]; 2],
) -> ([int32x4_t; 2], [int32x4_t; 2]) {
    let (nib, sixteen, item) = (vdupq_n_u8(0x0F), vdupq_n_u8(16), whole.low());
    // Each byte's bit `bit` of `h` as 16: Q5_K's fifth bits.
    let fifth = |h, bit: u8| vandq_u8(vtstq_u8(h, vdupq_n_u8(1 << bit)), sixteen);
    let mut isum = [vdupq_n_s32(0); 2];
    let mut msum = [vdupq_n_s32(0); 2];
    for (s, (sc, m)) in scales[0].iter().zip(&scales[1]).enumerate() {
        let xp = x.x[32 * s..][..32].as_ptr();
        // SAFETY: `xp` holds the sub-block's 32 bytes.
        let xv = unsafe { [0, 1, 2, 3].map(|i| duplicated8(xp.add(8 * i))) };
        let mut part = [vdupq_n_s32(0); 4];
        for (pair, part) in part.iter_mut().enumerate() {
            for u in 0..2 {
                // SAFETY: the group's 1024 bytes are readable; the features.
                unsafe {
                    let v = vld1q_u8(item.qs.as_ptr().add(128 * s + 64 * u + 16 * pair));
                    let (mut lo, mut hi) = (vandq_u8(v, nib), vshrq_n_u8::<4>(v));
                    if G::FIFTH {
                        // Run 2s + u is run 4t + c (`q5k`).
                        let h = vld1q_u8(whole.fifth().as_ptr().add(64 * (s / 2) + 16 * pair));
                        let c = (2 * (s % 2) + u) as u8;
                        lo = vorrq_u8(lo, fifth(h, 2 * c));
                        hi = vorrq_u8(hi, fifth(h, 2 * c + 1));
                    }
                    let (lo, hi) = (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi));
                    *part = sdot(sdot(*part, lo, xv[u]), hi, xv[2 + u]);
                }
            }
        }
        let sums = [vpaddq_s32(part[0], part[1]), vpaddq_s32(part[2], part[3])];
        let sum32 = i32::from(x.sum32[s]);
        for half in 0..2 {
            // SAFETY: each row set holds 4 values from `4 · half`.
            let (scv, mv) = unsafe {
                (
                    vld1q_s32(sc[4 * half..].as_ptr()),
                    vld1q_s32(m[4 * half..].as_ptr()),
                )
            };
            isum[half] = vmlaq_s32(isum[half], sums[half], scv);
            msum[half] = vmlaq_n_s32(msum[half], mv, sum32);
        }
    }
    (isum, msum)
}

/// Rows `rows` of `xs` (at most 4) times one group's super-blocks: each row's 8 sums.
///
/// # Safety
/// The CPU must have the dot-product extension; `group` holds `xs.blocks` super-blocks.
#[target_feature(enable = "neon,dotprod")]
unsafe fn group_sums<G: NibbleGroup>(
    xs: KRowsView<'_>,
    group: &[G],
    rows: std::ops::Range<usize>,
) -> [[float32x4_t; 2]; MOST_ROWS] {
    let mut acc = [[vdupq_n_f32(0.0); 2]; MOST_ROWS];
    for (k, whole) in group.iter().enumerate() {
        let item = whole.low();
        let scales = scales_by_row(item);
        let d = item.d.map(f16::to_f32);
        let dmin = item.dmin.map(f16::to_f32);
        for (r, acc) in rows.clone().zip(acc.iter_mut()) {
            let x = xs.block(r, k);
            // SAFETY: the features.
            let (isum, msum) = unsafe { block_sums(x, whole, &scales) };
            for half in 0..2 {
                // SAFETY: `d` and `dmin` hold 8 floats.
                let (dv, dminv) = unsafe {
                    (
                        vld1q_f32(d[4 * half..].as_ptr()),
                        vld1q_f32(dmin[4 * half..].as_ptr()),
                    )
                };
                let up = vmulq_f32(dv, vdupq_n_f32(x.dx));
                acc[half] = vfmaq_f32(acc[half], vcvtq_f32_s32(isum[half]), up);
                let down = vmulq_f32(dminv, vdupq_n_f32(-x.dx));
                acc[half] = vfmaq_f32(acc[half], vcvtq_f32_s32(msum[half]), down);
            }
        }
    }
    acc
}

/// Every group of `groups` times each row of `xs`, into `out` as `k_quants::product` lays it,
/// row `first` of the product being `xs`' first, `sums` giving a group's 8 sums for up to 4
/// rows.
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
unsafe fn store_groups<G>(
    xs: KRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
    sums: impl Fn(&[G], std::ops::Range<usize>) -> [[float32x4_t; 2]; MOST_ROWS],
) {
    let total = xs.rows();
    for (g, group) in groups.chunks_exact(xs.blocks).enumerate() {
        let at = out.from(g * GROUP_ROWS * to.col);
        for start in (0..total).step_by(MOST_ROWS) {
            let rows = start..(start + MOST_ROWS).min(total);
            let acc = sums(group, rows.clone());
            for (r, acc) in rows.zip(acc) {
                // SAFETY: the caller's feature.
                unsafe { store8(acc, at, to, first + r) };
            }
        }
    }
}

/// Q4_K's and Q5_K's groups (module docs).
///
/// # Safety
/// The CPU must have the dot-product extension; `xs` holds whole rows of `xs.blocks`
/// super-blocks and `groups` whole groups of as many.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn q4k_sdot<G: NibbleGroup>(
    xs: KRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    // SAFETY: the caller's.
    let sums = |group: &[G], rows| unsafe { group_sums(xs, group, rows) };
    // SAFETY: the caller's.
    unsafe { store_groups(xs, groups, out, to, first, sums) };
}

/// One row's super-block against a Q6_K group's: each of the 8 rows'
/// `Σₛ sc·(Σ q·x − 32·sum16)`, rows 0..4 then 4..8. Each sub-block's 16 weights of a row pair
/// are two registers: low nibbles joined with their high bits (`GroupQ6K`'s layout).
///
/// # Safety
/// The CPU must have the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
unsafe fn q6k_block_sums(x: KBlock<'_>, item: &GroupQ6K) -> [int32x4_t; 2] {
    let (nib, top) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x30));
    let mut isum = [vdupq_n_s32(0); 2];
    let mut bias = [vdupq_n_s32(0); 2];
    for (s, scales) in item.scales.iter().enumerate() {
        let xp = x.x[16 * s..][..16].as_ptr();
        // SAFETY: `xp` holds the sub-block's 16 bytes.
        let (xa, xb) = unsafe { (duplicated8(xp), duplicated8(xp.add(8))) };
        let mut part = [vdupq_n_s32(0); 4];
        for (pair, part) in part.iter_mut().enumerate() {
            // SAFETY: each 64-byte run is readable; the features.
            let (l, h) = unsafe {
                (
                    vld1q_u8(item.low(s).as_ptr().add(16 * pair)),
                    vld1q_u8(item.high(s / 2).as_ptr().add(16 * pair)),
                )
            };
            // Weights 0..8 of each row-half at bits 0 and 4 of `h` from sub-block s's pair.
            let (ha, hb) = match s % 2 {
                0 => (vshlq_n_u8::<4>(h), vshlq_n_u8::<2>(h)),
                _ => (h, vshrq_n_u8::<2>(h)),
            };
            let va = vorrq_u8(vandq_u8(l, nib), vandq_u8(ha, top));
            let vb = vorrq_u8(vshrq_n_u8::<4>(l), vandq_u8(hb, top));
            // SAFETY: the features.
            *part = unsafe {
                sdot(
                    sdot(*part, vreinterpretq_s8_u8(va), xa),
                    vreinterpretq_s8_u8(vb),
                    xb,
                )
            };
        }
        let sums = [vpaddq_s32(part[0], part[1]), vpaddq_s32(part[2], part[3])];
        // SAFETY: the sub-block's 8 scales.
        let sc16 = vmovl_s8(unsafe { vld1_s8(scales.as_ptr()) });
        let sc = [
            vmovl_s16(vget_low_s16(sc16)),
            vmovl_s16(vget_high_s16(sc16)),
        ];
        let sum16 = i32::from(x.sum16[s]);
        for half in 0..2 {
            isum[half] = vmlaq_s32(isum[half], sums[half], sc[half]);
            bias[half] = vmlaq_n_s32(bias[half], sc[half], sum16);
        }
    }
    [0, 1].map(|half| vsubq_s32(isum[half], vshlq_n_s32::<5>(bias[half])))
}

/// Q6_K's groups, as [`q4k_sdot`] Q4_K's, with the definition's one FMA a super-block.
///
/// # Safety
/// As [`q4k_sdot`].
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn q6k_sdot(
    xs: KRowsView<'_>,
    groups: &[GroupQ6K],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let sums = |group: &[GroupQ6K], rows: std::ops::Range<usize>| {
        let mut acc = [[vdupq_n_f32(0.0); 2]; MOST_ROWS];
        for (k, item) in group.iter().enumerate() {
            let d = item.d.map(f16::to_f32);
            for (r, acc) in rows.clone().zip(acc.iter_mut()) {
                let x = xs.block(r, k);
                // SAFETY: the caller's feature.
                let isum = unsafe { q6k_block_sums(x, item) };
                for half in 0..2 {
                    // SAFETY: `d` holds 8 floats.
                    let dv = unsafe { vld1q_f32(d[4 * half..].as_ptr()) };
                    let up = vmulq_f32(dv, vdupq_n_f32(x.dx));
                    acc[half] = vfmaq_f32(acc[half], vcvtq_f32_s32(isum[half]), up);
                }
            }
        }
        acc
    };
    // SAFETY: the caller's.
    unsafe { store_groups(xs, groups, out, to, first, sums) };
}
