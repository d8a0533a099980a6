//! AVX-512 BF16 products for bf16 weights (on CPUs with the AVX512_BF16 extension):
//! `vdpbf16ps` multiplies 32 bf16 pairs and adds them into 16 f32 lanes, twice AVX-512F's
//! multiply-adds an instruction and no widening of the weights, so a step's extra rows ride
//! under the weight stream instead of adding to it. The activations are rounded to bf16 (to
//! nearest, even) once per product, as llama.cpp does for bf16 weights; the sums stay f32.
//!
//! Exactness holds as on every other path: each (row, weight row) pair has one accumulator fed
//! its 32-element chunks in order and reduced by `avx512::store_group`'s tree, whatever rows or
//! weight rows share its block, and each row's activations round the same way alone or beside
//! others, so a token's result does not depend on the rows beside it. Only `super`'s dispatch
//! calls this, for a `Kernels` whose ISA was checked to include AVX-512 BF16.

use std::arch::x86_64::*;

use half::bf16;

use super::dense::{RUN_BYTES, X86_ROW_BLOCK, row_blocks};
use super::{OutLayout, Prefetch, SharedOut, avx512};

/// Weight rows a kernel call takes at a time (6 rows × 4 of accumulators, 4 weight chunks
/// and a row chunk: 29 of 32 registers), as `avx512` does.
const J: usize = 4;

/// `out = x · wᵀ` over one thread's weight rows `w` (`[outs × inner]` bf16), `x` `[rows ×
/// inner]` f32 rounded to bf16 first, in blocks of up to 6 rows and runs of weights as
/// `super::sweep` takes them.
///
/// # Safety
/// The CPU must have AVX-512F, BW, VL and BF16, AVX2, FMA and F16C; `w` holds whole rows of
/// `inner` and `x` whole rows of `inner`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub unsafe fn sweep(
    plan: Prefetch,
    x: &[f32],
    w: &[bf16],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
) {
    ROUNDED.with_borrow_mut(|xs| {
        // SAFETY: this function's features and the caller's shapes.
        unsafe { sweep_rounded(x, rounded(x, inner, xs), w, inner, out, to, plan) }
    });
}

thread_local! {
    /// A thread's rounded rows, kept for its next product (no allocation per product).
    static ROUNDED: std::cell::RefCell<Vec<bf16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`sweep`] with the rows already rounded and padded (`rounded`).
///
/// # Safety
/// As [`sweep`]; `xs` holds `x`'s rows rounded, each padded to a multiple of 32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn sweep_rounded(
    x: &[f32],
    xs: &[bf16],
    w: &[bf16],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    plan: Prefetch,
) {
    let rows = x.len() / inner;
    let stride = inner.next_multiple_of(32);
    let blocks = row_blocks(rows, X86_ROW_BLOCK);
    let group = J * inner;
    let grouped = w.len() / group * group;
    let run = match rows <= X86_ROW_BLOCK {
        true => grouped.max(group),
        false => (RUN_BYTES / 2).div_ceil(group) * group,
    };
    for (c, run_w) in w[..grouped].chunks(run).enumerate() {
        let run_out = out.from(c * (run / inner) * to.col);
        for block in blocks.clone() {
            let block_x = &xs[block.start * stride..block.end * stride];
            // SAFETY: this function's features; whole groups of J rows, whole padded rows.
            unsafe { dots::<J>(block_x, run_w, inner, run_out, to, plan, block.start) };
        }
    }
    if grouped < w.len() {
        let rest_out = out.from(grouped / inner * to.col);
        for block in blocks {
            let block_x = &xs[block.start * stride..block.end * stride];
            // SAFETY: as above, one weight row at a time.
            unsafe {
                dots::<1>(
                    block_x,
                    &w[grouped..],
                    inner,
                    rest_out,
                    to,
                    plan,
                    block.start,
                )
            };
        }
    }
}

/// The rows of `x` rounded to bf16 (to nearest, even), each padded with zeros to a multiple of
/// 32, in `buffer`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
fn rounded<'a>(x: &[f32], inner: usize, buffer: &'a mut Vec<bf16>) -> &'a [bf16] {
    let stride = inner.next_multiple_of(32);
    buffer.clear();
    buffer.resize(x.len() / inner * stride, bf16::ZERO);
    for (row, padded) in x.chunks_exact(inner).zip(buffer.chunks_exact_mut(stride)) {
        for (k, to) in (0..inner).step_by(32).zip(padded.chunks_exact_mut(32)) {
            let lanes = |at: usize| match inner.saturating_sub(k + at).min(16) {
                16 => !0,
                n => (1u16 << n) - 1,
            };
            // SAFETY: the lanes of each mask lie within the row (masked-off lanes are not
            // read, and read as zero); `to` holds 32 bf16, the 64 bytes stored.
            unsafe {
                let low = _mm512_maskz_loadu_ps(lanes(0), row.as_ptr().add(k));
                let high = _mm512_maskz_loadu_ps(lanes(16), row.as_ptr().wrapping_add(k + 16));
                let both = _mm512_cvtne2ps_pbh(high, low);
                _mm512_storeu_si512(
                    to.as_mut_ptr().cast(),
                    std::mem::transmute::<__m512bh, __m512i>(both),
                );
            }
        }
    }
    buffer
}

/// The products of up to 6 padded rows `xs` with every weight row of `w`, `G` at a time.
///
/// # Safety
/// As [`sweep`]; `w` holds whole groups of `G` rows of `inner`, `xs` whole rows of `inner`
/// rounded up to a multiple of 32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn dots<const G: usize>(
    xs: &[bf16],
    w: &[bf16],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    plan: Prefetch,
    first: usize,
) {
    let stride = inner.next_multiple_of(32);
    // SAFETY: the caller's features; that many rows of `xs` exist.
    unsafe {
        with_rows!(xs.len() / stride, R => dots_rows::<R, G>(xs, w, inner, out, to, plan, first))
    }
}

/// # Safety
/// As [`dots`], and `xs` holds at least `R` padded rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn dots_rows<const R: usize, const G: usize>(
    xs: &[bf16],
    w: &[bf16],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    plan: Prefetch,
    first: usize,
) {
    let stride = inner.next_multiple_of(32);
    let full = inner - inner % 32;
    let x: [*const bf16; R] = super::row_starts(xs, stride);
    // Into L1, each weight row's own line `near / G` elements ahead (the plan's near bytes
    // over 4 over G: 1 KB of each row in `l2`, 4 KB of the group), no floor of a group: at
    // Ouro-1.4B's shape a group of 4 rows is 16–45 KB, and a whole group ahead evicted lines
    // (and the rows of `x`) from L1 before their use. One address running through the
    // contiguous group 4 times as fast as the rows, as the f32 kernels prefetch, reaches rows
    // 2–4 of a group late: with both variants alternating in one process over products of an
    // Ouro-1.4B-shaped stack, the running address made the one-row and the 4-row sweeps
    // slower. One row with the far prefetch on takes no near prefetch: L1's own prefetcher
    // keeps up with it, and the prefetches only took load slots.
    let (near, far) = (plan.near(size_of::<f32>(), 0), plan.far(size_of::<bf16>()));
    let near_per_row = near.filter(|_| R > 1 || far == 0).map(|near| near / G);
    for (g, group) in w.chunks_exact(G * inner).enumerate() {
        let wj: [*const bf16; G] = super::row_starts(group, inner);
        // Into L2, one line (32 bf16) a row a chunk, `far` ahead in the contiguous group (the
        // next groups), as `avx512::dots_rows` prefetches.
        let far_at = group.as_ptr().wrapping_add(far);
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        let mut k = 0;
        while k < full {
            // SAFETY: k + 32 <= inner, within every weight row and every padded row.
            unsafe { chunk(&mut acc, x, wj, k, !0) };
            for (line, row) in wj.iter().enumerate() {
                // A prefetch never faults, whatever the address.
                if let Some(ahead) = near_per_row {
                    _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(k + ahead).cast());
                }
                if far > 0 {
                    _mm_prefetch::<_MM_HINT_T1>(far_at.wrapping_add(G * k + 32 * line).cast());
                }
            }
            k += 32;
        }
        if k < inner {
            // The weights' tail under a mask (zeros past `inner`); the rows are zero-padded.
            let mask: __mmask32 = (1u32 << (inner - k)) - 1;
            // SAFETY: the unmasked weight lanes lie within `inner`; padded rows hold 32 more.
            unsafe { chunk(&mut acc, x, wj, k, mask) };
        }
        avx512::store_group::<R, G, Products>(&acc, out.from(g * G * to.col), to, first);
    }
}

/// This kernel's own copy of `avx512::store_group` (see there).
enum Products {}

/// One 32-element chunk at `k` of every (row, weight row) pair.
///
/// # Safety
/// The weight lanes of `mask` from `k` on lie within every weight row, and 32 elements from
/// `k` within every padded row.
#[inline(always)]
unsafe fn chunk<const R: usize, const G: usize>(
    acc: &mut [[__m512; G]; R],
    x: [*const bf16; R],
    w: [*const bf16; G],
    k: usize,
    mask: __mmask32,
) {
    // SAFETY: the caller's bounds; __m512i and __m512bh are both 64 bytes of lanes.
    unsafe {
        let wk: [__m512bh; G] = std::array::from_fn(|j| {
            std::mem::transmute(_mm512_maskz_loadu_epi16(mask, w[j].add(k).cast()))
        });
        for r in 0..R {
            let xr: __m512bh = std::mem::transmute(_mm512_loadu_si512(x[r].add(k).cast()));
            for j in 0..G {
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, wk[j]);
            }
        }
    }
}
