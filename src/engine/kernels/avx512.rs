//! AVX-512F dot products for the small-M matmul (16 lanes, 32 registers: twice the
//! accumulators of AVX2). Compiled for AVX-512F/VL, AVX2 and FMA; `super`'s dispatch calls
//! them only after `isa()` detected all four.

use std::arch::x86_64::*;

use super::{OutLayout, SharedOut, prefetch};

/// AVX-512 dot products of up to `X86_ROW_BLOCK` (6) rows of `xs` with every weight row of
/// `w`, `J` (1 or 4) rows at a time: `w` holds whole groups of `J` rows of `inner`. The row
/// count becomes a constant so that every accumulator stays in a register. One call takes a
/// run of groups, so the call, the row dispatch and the setup are paid once a run, not once a
/// group (`super::sweep`).
///
/// # Safety
/// The CPU must have AVX-512F and VL, AVX2 and FMA; `w` must hold a multiple of `J · inner`
/// elements and `xs` a multiple of `inner`.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
pub unsafe fn dots<const J: usize>(
    xs: &[f32],
    w: &[f32],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    // SAFETY: the caller's features; that many rows of `xs` exist.
    unsafe { with_rows!(xs.len() / inner, R => dots_rows::<R, J>(xs, w, inner, out, to, first)) }
}

/// Each (row, weight row) pair has one 16-lane accumulator fed in the same order and the
/// same reduction, whatever R and J are, so a row's
/// result does not depend on which rows or weight rows it was grouped with.
///
/// # Safety
/// As [`dots`], and `xs` holds at least `R` rows.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn dots_rows<const R: usize, const J: usize>(
    xs: &[f32],
    w: &[f32],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let full = inner - inner % 16;
    // SAFETY: row r of `xs` starts at r · inner, inside `xs` for r < R.
    let x: [*const f32; R] = std::array::from_fn(|r| unsafe { xs.as_ptr().add(r * inner) });
    let ahead = (prefetch::near(4, J * inner), prefetch::far(4));
    for (g, group) in w.chunks_exact(J * inner).enumerate() {
        // SAFETY: weight row j of the group starts at j · inner, inside `group` for j < J.
        let wj: [*const f32; J] = std::array::from_fn(|j| unsafe { group.as_ptr().add(j * inner) });
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        let mut k = 0;
        while k < full {
            // SAFETY: k + 16 <= inner, within every row of `xs` and every weight row.
            unsafe { chunk(&mut acc, (x, wj), k, !0, ahead) };
            k += 16;
        }
        if k < inner {
            // The last chunk of a row not a multiple of 16 long loads its tail under a mask
            // (zeros elsewhere), so every chunk runs the same FMAs.
            let mask: __mmask16 = (1u16 << (inner - k)) - 1;
            // SAFETY: the unmasked lanes lie within `inner`; masked-off lanes are not read.
            unsafe { chunk(&mut acc, (x, wj), k, mask, (0, 0)) };
        }
        let group_out = out.from(g * J * to.col);
        for (r, a) in acc.iter().enumerate() {
            store_sums(a, group_out, to, first + r);
        }
    }
}

/// One 16-lane chunk at `k` of every (row, weight row) pair: each weight chunk loaded once
/// for all rows, each row chunk once for all weight rows; the weight rows' chunks `ahead.0`
/// floats on (into L1) and `ahead.1` on (into L2, where not zero) are prefetched: later
/// groups', streaming from L3 or DRAM (`super::prefetch`).
///
/// # Safety
/// The lanes of `mask` from `k` on lie within every row behind `x` and `w`.
#[inline(always)]
unsafe fn chunk<const R: usize, const J: usize>(
    acc: &mut [[__m512; J]; R],
    (x, w): ([*const f32; R], [*const f32; J]),
    k: usize,
    mask: __mmask16,
    (near, far): (usize, usize),
) {
    const {
        assert!(
            R <= super::X86_ROW_BLOCK && super::X86_ROW_BLOCK == 6,
            "rows! unrolls six"
        )
    };
    // SAFETY: the caller's bounds; a prefetch never faults, even past the end.
    unsafe {
        let wk: [__m512; J] = std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, w[j].add(k)));
        if near > 0 {
            for wj in w {
                _mm_prefetch::<_MM_HINT_T0>(wj.wrapping_add(k + near) as *const i8);
            }
        }
        if far > 0 {
            for wj in w {
                _mm_prefetch::<_MM_HINT_T1>(wj.wrapping_add(k + far) as *const i8);
            }
        }
        // Unrolled by hand, so that every accumulator index is a constant (the rolled loop
        // measured 5–15 % slower at 5 and 6 rows).
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

/// Writes `out[j·to.col + at·to.row]` = the sum of accumulator `j`'s 16 lanes, four at a time
/// (a group of fewer repeats its last accumulator and drops the copies).
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn store_sums<const J: usize>(acc: &[__m512; J], out: SharedOut<'_>, to: OutLayout, at: usize) {
    for j0 in (0..J).step_by(4) {
        let lane = |j: usize| halves(acc[(j0 + j).min(J - 1)]);
        let mut four = [0f32; 4];
        // SAFETY: `four` holds exactly 4 floats.
        unsafe {
            _mm_storeu_ps(
                four.as_mut_ptr(),
                reduce4(lane(0), lane(1), lane(2), lane(3)),
            )
        };
        for (j, v) in four.iter().enumerate().take(J - j0) {
            out.set((j0 + j) * to.col + at * to.row, *v);
        }
    }
}

/// Lanes i and i + 8 added: the first level of every accumulator's reduction tree.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn halves(a: __m512) -> __m256 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    _mm256_add_ps(_mm512_castps512_ps256(a), hi)
}

/// `avx2::reduce4`'s tree, the same sums of the same pairs, in instructions that have EVEX
/// forms. `vhaddps` has none: it reads only registers 0–15, and LLVM then keeps every
/// accumulator of the dot products there, spilling those beyond 16 to the stack on every
/// chunk (a 5-row product cost 1.8× a 4-row one).
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
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
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn hadd(a: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}
