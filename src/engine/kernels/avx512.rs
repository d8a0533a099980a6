//! AVX-512F dot products for the small-M matmul (16 lanes, 32 registers: twice the
//! accumulators of AVX2), over f32 weights or bf16/f16 ones widened as they load
//! (`WeightElement::load16`). Compiled for AVX-512F/BW/VL, AVX2, FMA and F16C; `super`'s
//! dispatch calls them only for a `Kernels` whose ISA was checked to include them all.

use std::arch::x86_64::*;

use super::{OutLayout, Prefetch, SharedOut, WeightElement};

/// AVX-512 dot products of up to `X86_ROW_BLOCK` (6) rows of `xs` with every weight row of
/// `w`, `J` (1 or 4) rows at a time: `w` holds whole groups of `J` rows of `inner`. The row
/// count becomes a constant so that every accumulator stays in a register. One call takes a
/// run of groups, so the call, the row dispatch and the setup are paid once a run, not once a
/// group (`super::sweep`).
///
/// # Safety
/// The CPU must have AVX-512F, BW and VL, AVX2, FMA and F16C; `w` must hold a multiple of
/// `J · inner` elements and `xs` a multiple of `inner`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn dots<const J: usize, W: WeightElement>(
    xs: &[f32],
    w: &[W],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    plan: Prefetch,
    first: usize,
) {
    // SAFETY: the caller's features; that many rows of `xs` exist.
    unsafe {
        with_rows!(xs.len() / inner, R => dots_rows::<R, J, W>(xs, w, inner, out, to, plan, first))
    }
}

/// Each (row, weight row) pair has one 16-lane accumulator fed in the same order and the
/// same reduction, whatever R and J are, so a row's result does not depend on which rows or
/// weight rows it was grouped with.
///
/// # Safety
/// As [`dots`], and `xs` holds at least `R` rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dots_rows<const R: usize, const J: usize, W: WeightElement>(
    xs: &[f32],
    w: &[W],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    plan: Prefetch,
    first: usize,
) {
    let full = inner - inner % 16;
    let x: [*const f32; R] = super::row_starts(xs, inner);
    let bytes = std::mem::size_of::<W>();
    let (near, far) = (plan.near(bytes, J * inner), plan.far(bytes));
    for (g, group) in w.chunks_exact(J * inner).enumerate() {
        let wj: [*const W; J] = super::row_starts(group, inner);
        // The group's J rows are contiguous: the lines `near` and `far` floats past it are
        // prefetched J a chunk, in order, from one pointer each. Per row, beside the loads,
        // they were the same lines from 2·J pointers, more than the registers left beside the
        // rows' and weights': the 6-row loop reloaded pointers from the stack on every chunk.
        // One pointer per group made the default model's 1-row and 4-row steps faster, and
        // hot 256-wide products of 4 and 6 rows (`cargo bench --bench step`, binaries
        // alternating).
        let (near_at, far_at) = (
            near.map(|near| group.as_ptr().wrapping_add(near)),
            group.as_ptr().wrapping_add(far),
        );
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        let mut k = 0;
        while k < full {
            // SAFETY: k + 16 <= inner, within every row of `xs` and every weight row.
            unsafe { chunk(&mut acc, x, wj, k, !0) };
            if let Some(near_at) = near_at {
                lines_ahead::<J, W, _MM_HINT_T0>(near_at.wrapping_add(J * k));
            }
            if far > 0 {
                lines_ahead::<J, W, _MM_HINT_T1>(far_at.wrapping_add(J * k));
            }
            k += 16;
        }
        if k < inner {
            // The last chunk of a row not a multiple of 16 long loads its tail under a mask
            // (zeros elsewhere), so every chunk runs the same FMAs.
            let mask: __mmask16 = (1u16 << (inner - k)) - 1;
            // SAFETY: the unmasked lanes lie within `inner`; masked-off lanes are not read.
            unsafe { chunk(&mut acc, x, wj, k, mask) };
        }
        store_group::<R, J, W>(&acc, out.from(g * J * to.col), to, first);
    }
}

/// Prefetches the cache lines of `J` chunks of 16 elements from `at` on with `HINT`: `J`
/// lines of f32, half as many of bf16 or f16 (a prefetch never faults, even past the end).
#[inline(always)]
fn lines_ahead<const J: usize, W, const HINT: i32>(at: *const W) {
    let bytes = std::mem::size_of::<W>();
    for line in 0..(J * 16 * bytes).div_ceil(64) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<HINT>(at.wrapping_add(line * 64 / bytes) as *const i8) };
    }
}

/// One 16-lane chunk at `k` of every (row, weight row) pair: each weight chunk loaded once
/// for all rows, each row chunk once for all weight rows.
///
/// # Safety
/// The lanes of `mask` from `k` on lie within every row behind `x` and `w`.
#[inline(always)]
unsafe fn chunk<const R: usize, const J: usize, W: WeightElement>(
    acc: &mut [[__m512; J]; R],
    x: [*const f32; R],
    w: [*const W; J],
    k: usize,
    mask: __mmask16,
) {
    const {
        assert!(
            R <= super::dense::X86_ROW_BLOCK && super::dense::X86_ROW_BLOCK == 6,
            "rows! unrolls six"
        )
    };
    // SAFETY: the caller's bounds.
    unsafe {
        let wk: [__m512; J] = std::array::from_fn(|j| W::load16(mask, w[j].add(k)));
        // Unrolled by hand, so that every accumulator index is a constant (the rolled loop
        // measured slower at 5 and 6 rows).
        macro_rules! rows {
            ($($r:literal)*) => {$(
                if $r < R {
                    let xr = _mm512_maskz_loadu_ps(mask, x[$r].add(k));
                    for j in 0..J {
                        acc[$r][j] = _mm512_fmadd_ps(xr, wk[j], acc[$r][j]);
                    }
                }
            )*};
        }
        rows!(0 1 2 3 4 5);
    }
}

/// Writes every (row, weight row) sum of a group: four rows of four weight rows at once by
/// [`reduce16`], the rows left over by [`store_sums`]. Both reduce every accumulator by the
/// same tree, so which way a row goes changes no bit of its result. At hidden 256 a dot is
/// only 16 chunks, so the reductions count: four rows at once took time off hot 4-row
/// products (`cargo bench --bench step -- --only kernels`).
///
/// `Caller` gives each kernel (each weight type's, and `avx512_bf16`'s) a copy of its own:
/// LLVM inlines a function with one caller, and one copy shared by three kernels was not
/// inlined, so every group's accumulators went through the stack, and the default model's
/// 4-row step and its `speed` lane slowed.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::extra_unused_type_parameters)] // `Caller` only names the copy (above).
pub(super) fn store_group<const R: usize, const J: usize, Caller>(
    acc: &[[__m512; J]; R],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let mut r = 0;
    if J == 4 {
        while r + 4 <= R {
            let a = |i: usize, j: usize| acc[r + i][j];
            let sums = reduce16([
                [a(0, 0), a(0, 1), a(0, 2), a(0, 3)],
                [a(1, 0), a(1, 1), a(1, 2), a(1, 3)],
                [a(2, 0), a(2, 1), a(2, 2), a(2, 3)],
                [a(3, 0), a(3, 1), a(3, 2), a(3, 3)],
            ]);
            let at = first + r;
            store_four(out, to, at, _mm512_castps512_ps128(sums));
            store_four(out, to, at + 1, _mm512_extractf32x4_ps::<1>(sums));
            store_four(out, to, at + 2, _mm512_extractf32x4_ps::<2>(sums));
            store_four(out, to, at + 3, _mm512_extractf32x4_ps::<3>(sums));
            r += 4;
        }
    }
    for (i, a) in acc[r..].iter().enumerate() {
        store_sums(a, out, to, first + r + i);
    }
}

/// Row `at`'s four sums `four` into `out[j·to.col + at·to.row]`: one vector store where the
/// four are contiguous (`to.col` 1), else one store each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn store_four(out: SharedOut<'_>, to: OutLayout, at: usize, four: __m128) {
    if to.col == 1 {
        // SAFETY: `span` checked that the four elements exist and are this view's to write.
        unsafe { _mm_storeu_ps(out.span(at * to.row, 4), four) };
    } else {
        store_first(out, to, at, four, 4);
    }
}

/// The first `count` (≤ 4) of row `at`'s sums `four` into `out[j·to.col + at·to.row]`, one
/// store each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn store_first(out: SharedOut<'_>, to: OutLayout, at: usize, four: __m128, count: usize) {
    let mut sums = [0f32; 4];
    // SAFETY: `sums` holds exactly 4 floats.
    unsafe { _mm_storeu_ps(sums.as_mut_ptr(), four) };
    for (j, v) in sums.iter().enumerate().take(count) {
        out.set(j * to.col + at * to.row, *v);
    }
}

/// The sums of 16 accumulators, `a[r][j]` in lane `4r + j`: each by `reduce4`'s tree (lanes i
/// and i + 8, then neighbours, neighbours, and the two halves), the same pairs added in the
/// same order, but 16 at a time in 512-bit shuffles and adds: fewer instructions than four
/// [`store_sums`] take, and one vector store per row where they take four scalar ones.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce16(a: [[__m512; 4]; 4]) -> __m512 {
    // Rows 0 and 1, then 2 and 3: per weight row j, both rows' lanes i + (i + 8); then the
    // neighbours twice, leaving each row's j-th partial pair (o₀, o₁) in two 128-bit lanes.
    let pair = |r: usize| {
        let h = |j: usize| fold_halves(a[r][j], a[r + 1][j]);
        hadd512(hadd512(h(0), h(1)), hadd512(h(2), h(3)))
    };
    let (d01, d23) = (pair(0), pair(2));
    // Lanes [o₀ of row 0, o₀ of row 1, …] and [o₁ …]: their sum is one row per 128-bit lane.
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(d01, d23),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(d01, d23),
    )
}

/// `x`'s lanes i + (i + 8) in lanes 0–7 and `y`'s in lanes 8–15: [`halves`] of both at once.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn fold_halves(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
    )
}

/// [`hadd`] on 512 bits: `[a0+a1, a2+a3, b0+b1, b2+b3]` in each 128-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn hadd512(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}

/// Writes `out[j·to.col + at·to.row]` = the sum of accumulator `j`'s 16 lanes, four at a time
/// (a group of fewer repeats its last accumulator and drops the copies).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn store_sums<const J: usize>(acc: &[__m512; J], out: SharedOut<'_>, to: OutLayout, at: usize) {
    for j0 in (0..J).step_by(4) {
        let lane = |j: usize| halves(acc[(j0 + j).min(J - 1)]);
        let sums = reduce4(lane(0), lane(1), lane(2), lane(3));
        let group_out = out.from(j0 * to.col);
        if J - j0 >= 4 {
            store_four(group_out, to, at, sums);
        } else {
            store_first(group_out, to, at, sums, J - j0);
        }
    }
}

/// Lanes i and i + 8 added: the first level of every accumulator's reduction tree.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn halves(a: __m512) -> __m256 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    _mm256_add_ps(_mm512_castps512_ps256(a), hi)
}

/// `avx2::reduce4`'s tree, the same sums of the same pairs, in instructions that have EVEX
/// forms. `vhaddps` has none: it reads only registers 0–15, and LLVM then keeps every
/// accumulator of the dot products there, spilling those beyond 16 to the stack on every
/// chunk (a 5-row product cost far more than a 4-row one).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let abcd = hadd(hadd(a, b), hadd(c, d));
    _mm_add_ps(
        _mm256_castps256_ps128(abcd),
        _mm256_extractf32x4_ps::<1>(abcd),
    )
}

/// `_mm256_hadd_ps(a, b)`: `[a0+a1, a2+a3, b0+b1, b2+b3]` in each 128-bit half, from two
/// shuffles and an add (IEEE addition commutes, so the bits are `vhaddps`'s).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn hadd(a: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}
