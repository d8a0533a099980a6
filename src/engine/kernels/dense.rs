//! The float matmuls (f32, bf16 and f16 weights): one thread's share of `x · wᵀ`, every
//! input row against weight rows a few at a time, on the CPU's instruction set. Called by the
//! pooled products in `kernels` and the tests; the quantized types have their own (`q8_0`,
//! `k_quants`, `affine`), which borrow the row blocking here.

#[cfg(target_arch = "aarch64")]
use super::neon;
use super::{Isa, OutLayout, SharedOut, Tuning, WeightElement, portable};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512, avx512_bf16};

/// Rows of `x` processed together against one group of weight rows, NEON and portable.
pub(super) const ROW_BLOCK: usize = 4;
/// The same on x86, whose kernels hold up to 6 rows' accumulators in registers: a `dual`
/// step's 4 rows and a second candidate are one block, and the weights' registers are loaded
/// once for all 5 (AVX2 with 2 weight rows at a time, AVX-512 with 4: `matmul_t_serial`).
pub(super) const X86_ROW_BLOCK: usize = 6;

/// One thread's share: writes the products with the weight rows in `w` where `to` says. How
/// many weight rows a kernel takes at a time is chosen per ISA and row count, as measured
/// (below). The grouping does not change any result: every (row, weight row) pair is computed
/// the same way.
pub(super) fn matmul_t_serial<W: WeightElement>(
    t: Tuning,
    x: &[f32],
    w: &[W],
    rows: usize,
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
) {
    let (x86, other) = (X86_ROW_BLOCK, ROW_BLOCK);
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Avx512Bf16, Some(w)) = (t.isa, W::as_bf16(w)) {
        // SAFETY: a `Tuning` holds Avx512Bf16 only after `Kernels::new` checked the CPU has
        // AVX-512F, BW, VL and BF16, AVX2, FMA and F16C; `w` and `x` hold whole rows of `inner`.
        return unsafe { avx512_bf16::sweep(t.prefetch, x, w, inner, out, to) };
    }
    match (t.isa, rows) {
        // AVX-512 has 32 registers: 6 rows × 4 weight rows of accumulators plus the weight and
        // input chunks fit. Fewer rows take 4 weight rows too: 1–2 rows × 8 weight rows, in
        // runs of groups, made the 1-row step measurably dearer when the weights stream from
        // DRAM; one or two rows are bound by memory, not FMAs.
        (Isa::Avx512 | Isa::Avx512Bf16, _) => sweep::<4, W>(t, x, x86, w, inner, out, to),
        // AVX2's 16 registers hold at most 12 accumulators: 1–4 rows × 3 weight rows, and from
        // 5 rows on blocks of up to 6 rows × 2 weight rows. One or two rows are bound by
        // memory, and fewer weight streams were faster: with kernels taking runs of groups
        // (forced AVX2), 3 weight rows at a time made the default model's 1-row and 2-row
        // steps cheaper than 4. Splitting 5 rows as 3 + 2 rows × 3 weight rows left the 2-row
        // block's 6 accumulators waiting on FMA latency: the 5-row step took longer in two
        // blocks than in one.
        (Isa::Avx2Fma, 1..=4) => sweep::<3, W>(t, x, x86, w, inner, out, to),
        (Isa::Avx2Fma, _) => sweep::<2, W>(t, x, x86, w, inner, out, to),
        (_, 1..=2) => sweep::<4, W>(t, x, other, w, inner, out, to),
        _ => sweep::<2, W>(t, x, other, w, inner, out, to),
    }
}

/// Every row of `x`, in blocks of at most `block_rows`, times `J` weight rows at a time (the
/// weight rows left over one at a time). Each call of a kernel takes a run of weight groups,
/// so its call, row dispatch and setup are paid once a run: one run of the whole matrix where
/// the rows are one block, else runs of [`RUN_BYTES`], still in L1 when the next block reads
/// them. A call for each group made the default model's steps dearer than one run: its
/// 3–5-row steps under AVX-512, and its 1–5-row steps under forced AVX2.
fn sweep<const J: usize, W: WeightElement>(
    t: Tuning,
    x: &[f32],
    block_rows: usize,
    w: &[W],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
) {
    let rows = x.len() / inner;
    let blocks = row_blocks(rows, block_rows);
    let group = J * inner;
    let grouped = w.len() / group * group;
    let run = if rows <= block_rows {
        grouped.max(group)
    } else {
        (RUN_BYTES / std::mem::size_of::<W>()).div_ceil(group) * group
    };
    for (c, run_w) in w[..grouped].chunks(run).enumerate() {
        let run_out = out.from(c * (run / inner) * to.col);
        for block in blocks.clone() {
            let xs = &x[block.start * inner..block.end * inner];
            dots_dispatch::<J, W>(t, xs, run_w, inner, run_out, to, block.start);
        }
    }
    if grouped < w.len() {
        let rest_out = out.from(grouped / inner * to.col);
        for block in blocks {
            let xs = &x[block.start * inner..block.end * inner];
            dots_dispatch::<1, W>(t, xs, &w[grouped..], inner, rest_out, to, block.start);
        }
    }
}

/// The most weight bytes a kernel call takes where the rows are several blocks (L1 holds them
/// for the next block).
pub(super) const RUN_BYTES: usize = 16 << 10;

/// `rows` split into the fewest blocks of at most `most` rows, of nearly equal size (7 rows
/// in blocks of 6 are 4 + 3, not 6 + 1: a block of one row has too few accumulators to keep
/// the FMA units busy).
pub(super) fn row_blocks(
    rows: usize,
    most: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> + Clone {
    let blocks = rows.div_ceil(most);
    (0..blocks).map(move |b| b * rows / blocks..(b + 1) * rows / blocks)
}

/// Writes `out[j·to.col + (first + r)·to.row]` = row r of `block` · weight row j of `w`, for
/// every weight row of `w` (whole groups of `J`).
#[inline(always)]
fn dots_dispatch<const J: usize, W: WeightElement>(
    t: Tuning,
    block: &[f32],
    w: &[W],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    match t.isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Tuning` holds Avx512 only after `Kernels::new` checked the CPU has
        // AVX-512F, BW and VL, AVX2, FMA and F16C; `sweep` passes whole groups and whole rows.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            avx512::dots::<J, W>(block, w, inner, out, to, t.prefetch, first)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        Isa::Avx2Fma => unsafe { avx2::dots::<J, W>(block, w, inner, out, to, t.prefetch, first) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::dots::<J, W>(block, w, inner, out, to, first),
        _ => portable::dots::<J, W>(block, w, inner, out, to, first),
    }
}
