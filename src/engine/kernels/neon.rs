//! NEON kernels for aarch64 (Arm laptops and servers): the small-M matmul's dot products,
//! the decode step's bulk. Each (row, weight row) pair has one 8-lane accumulator (two 4-lane
//! registers) fed by fused multiply-adds in order of k, reduced in `portable::hsum8`'s tree,
//! so a product is the same whatever rows and weight rows share its block: speculative and
//! baseline decoding agree bit for bit on aarch64 as on x86. NEON is part of every aarch64
//! CPU, so nothing is detected at run time. Attention, SiLU and softmax use the portable
//! loops, which the compiler vectorises for NEON.

use std::arch::aarch64::*;

use super::dense::ROW_BLOCK;
use super::{OutLayout, SharedOut, WeightElement};

/// NEON dot products of up to 4 rows of `xs` with every weight row of `w`, `J` at a time: `w`
/// holds whole groups of `J` rows of `inner` (`super::sweep`).
///
/// Panics unless `xs` holds whole rows of `inner`.
pub fn dots<const J: usize, W: WeightElement>(
    xs: &[f32],
    w: &[W],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    for (g, group) in w.chunks_exact(J * inner).enumerate() {
        let ws: [&[W]; J] = super::row_slices(group, inner);
        group_dots(xs, ws, out.from(g * J * to.col), to, first);
    }
}

/// [`dots`] with one group of `J` weight rows: each weight chunk is loaded once for all rows
/// and each row chunk once for all weight rows.
///
/// Panics unless every weight row in `ws` holds `ws[0].len()` elements and `xs` whole rows.
fn group_dots<const J: usize, W: WeightElement>(
    xs: &[f32],
    ws: [&[W]; J],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let inner = ws[0].len();
    assert!(ws.iter().all(|w| w.len() == inner) && xs.len().is_multiple_of(inner.max(1)));
    let rows = (xs.len() / inner.max(1)).min(ROW_BLOCK);
    let main = inner - inner % 8;
    // SAFETY: NEON is part of every aarch64 CPU; the zero vectors need nothing else.
    let zero = unsafe { vdupq_n_f32(0.0) };
    let mut acc = [[(zero, zero); J]; ROW_BLOCK];
    let mut k = 0;
    while k < main {
        // SAFETY: k + 8 <= inner; every weight row holds `inner` elements (asserted) and every
        // row r < rows of `xs` too, so each 4-float load is in bounds.
        unsafe {
            let w: [(float32x4_t, float32x4_t); J] =
                std::array::from_fn(|j| W::load8(ws[j].as_ptr().add(k)));
            for (r, a) in acc.iter_mut().enumerate().take(rows) {
                let p = xs.as_ptr().add(r * inner + k);
                let (lo, hi) = (vld1q_f32(p), vld1q_f32(p.add(4)));
                for j in 0..J {
                    a[j].0 = vfmaq_f32(a[j].0, lo, w[j].0);
                    a[j].1 = vfmaq_f32(a[j].1, hi, w[j].1);
                }
            }
        }
        k += 8;
    }
    for j in 0..J {
        for (r, a) in acc.iter().enumerate().take(rows) {
            // SAFETY: NEON is part of every aarch64 CPU.
            let mut sum = unsafe { hsum8(a[j].0, a[j].1) };
            for kk in main..inner {
                sum += xs[r * inner + kk] * ws[j][kk].to_f32();
            }
            out.set(j * to.col + (first + r) * to.row, sum);
        }
    }
}

/// The 8 lanes' sum in `portable::hsum8`'s tree: ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
///
/// # Safety
/// Needs NEON (every aarch64 CPU has it).
#[inline(always)]
unsafe fn hsum8(lo: float32x4_t, hi: float32x4_t) -> f32 {
    // SAFETY: the caller runs on aarch64, where NEON is always present.
    unsafe {
        let pairs = vpaddq_f32(lo, hi); // l0+l1, l2+l3, l4+l5, l6+l7
        let quads = vpaddq_f32(pairs, pairs); // (l0+l1)+(l2+l3), (l4+l5)+(l6+l7), …
        vgetq_lane_f32::<0>(quads) + vgetq_lane_f32::<1>(quads)
    }
}
