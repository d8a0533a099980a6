//! AVX-512F dot products for the small-M matmul (16 lanes, 32 registers: twice the
//! accumulators of AVX2). Compiled for AVX-512F, AVX2 and FMA; `super`'s dispatch calls them
//! only after `isa()` detected all three.

use std::arch::x86_64::*;

use super::{OutLayout, SharedOut, avx2};

/// AVX-512 dot products of up to `X86_ROW_BLOCK` (6) rows of `xs` with `J` (1, 4 or 8) weight rows; the
/// row count becomes a constant so that every accumulator stays in a register.
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA, and every weight row in `ws` must hold
/// `ws[0].len()` elements (the rows of `xs` are whole: it holds a multiple of that many).
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dots<const J: usize>(
    xs: &[f32],
    ws: [&[f32]; J],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let rows = xs.len() / ws[0].len();
    // SAFETY: the caller's features; `rows` rows of `xs` exist.
    unsafe {
        match rows {
            1 => dots_rows::<1, J>(xs, ws, out, to, first),
            2 => dots_rows::<2, J>(xs, ws, out, to, first),
            3 => dots_rows::<3, J>(xs, ws, out, to, first),
            4 => dots_rows::<4, J>(xs, ws, out, to, first),
            5 => dots_rows::<5, J>(xs, ws, out, to, first),
            _ => dots_rows::<6, J>(xs, ws, out, to, first),
        }
    }
}

/// Each (row, weight row) pair has one 16-lane accumulator fed in the same order and the
/// same reduction, whatever R and J are, so a row's
/// result does not depend on which rows or weight rows it was grouped with.
///
/// # Safety
/// As [`dots`], and `xs` holds at least `R` rows.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dots_rows<const R: usize, const J: usize>(
    xs: &[f32],
    ws: [&[f32]; J],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let inner = ws[0].len();
    let mut acc = [[_mm512_setzero_ps(); J]; R];
    let xp = xs.as_ptr();
    let mut k = 0;
    while k < inner {
        // The last chunk of a row not a multiple of 16 long loads its tail under a mask
        // (zeros elsewhere), so every chunk runs the same FMAs.
        let mask: __mmask16 = if inner - k >= 16 {
            !0
        } else {
            (1u16 << (inner - k)) - 1
        };
        // SAFETY: masked-off lanes are neither read nor faulted on and the others lie
        // within the `inner` elements of every weight row and of the R rows of `xs`; a
        // prefetch never faults.
        unsafe {
            let w: [__m512; J] =
                std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, ws[j].as_ptr().add(k)));
            for wj in ws {
                _mm_prefetch::<_MM_HINT_T0>(wj.as_ptr().wrapping_add(k + J * inner) as *const i8);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let x = _mm512_maskz_loadu_ps(mask, xp.add(r * inner + k));
                for j in 0..J {
                    a[j] = _mm512_fmadd_ps(x, w[j], a[j]);
                }
            }
        }
        k += 16;
    }
    for (r, a) in acc.iter().enumerate() {
        store_sums(a, out, to, first + r);
    }
}

/// Writes `out[j·to.col + at·to.row]` = the sum of accumulator `j`'s 16 lanes, four at a time
/// (a group of fewer repeats its last accumulator and drops the copies).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn store_sums<const J: usize>(acc: &[__m512; J], out: SharedOut<'_>, to: OutLayout, at: usize) {
    for j0 in (0..J).step_by(4) {
        let lane = |j: usize| halves(acc[(j0 + j).min(J - 1)]);
        let mut four = [0f32; 4];
        // SAFETY: `four` holds exactly 4 floats.
        unsafe {
            _mm_storeu_ps(
                four.as_mut_ptr(),
                avx2::reduce4(lane(0), lane(1), lane(2), lane(3)),
            )
        };
        for (j, v) in four.iter().enumerate().take(J - j0) {
            out.set((j0 + j) * to.col + at * to.row, *v);
        }
    }
}

/// Lanes i and i + 8 added: the first level of every accumulator's reduction tree.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn halves(a: __m512) -> __m256 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    _mm256_add_ps(_mm512_castps512_ps256(a), hi)
}
