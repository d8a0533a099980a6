//! `x · wᵀ` with f16 weights widened to f32 in registers: half the bytes of an f32 matrix, for
//! the proposal readouts of `model::half_head` (which bounds the error and screens commits).
//! AVX-512 only; `half_head` does not use f16 weights where this would run the portable loop.

use half::f16;

/// Whether `matmul_t` below runs vectorised for rows of `inner` elements on this CPU.
pub fn fast_for(inner: usize) -> bool {
    super::isa() == super::Isa::Avx512 && inner.is_multiple_of(16)
}

/// `out[m][j] = Σ_k x[m][k] · w[j][k]` for `x: [rows × inner]`, `w: [outs × inner]` in f16,
/// `out: [rows × outs]`. Summation order is unspecified: callers use a bound, not bits.
pub fn matmul_t(x: &[f32], w: &[f16], rows: usize, inner: usize, out: &mut [f32]) {
    let outs = w.len() / inner;
    debug_assert_eq!(x.len(), rows * inner);
    debug_assert_eq!(out.len(), rows * outs);
    #[cfg(target_arch = "x86_64")]
    if fast_for(inner) {
        for (block, first) in x.chunks(4 * inner).zip((0..rows).step_by(4)) {
            // SAFETY: `fast_for` checked AVX-512F and whole 16-lane chunks per row.
            unsafe { avx512::rows(block, w, inner, &mut out[first * outs..]) };
        }
        return;
    }
    for (xr, or) in x.chunks_exact(inner).zip(out.chunks_exact_mut(outs)) {
        for (o, wr) in or.iter_mut().zip(w.chunks_exact(inner)) {
            *o = xr.iter().zip(wr).map(|(a, b)| a * b.to_f32()).sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::f16;

    /// Up to 4 rows of `xs` against every row of `w`, 4 weight rows at a time.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows(xs: &[f32], w: &[f16], inner: usize, out: &mut [f32]) {
        // SAFETY: the caller's features; `rows` rows of `xs` exist.
        unsafe {
            match xs.len() / inner {
                1 => block::<1>(xs, w, inner, out),
                2 => block::<2>(xs, w, inner, out),
                3 => block::<3>(xs, w, inner, out),
                _ => block::<4>(xs, w, inner, out),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize>(xs: &[f32], w: &[f16], inner: usize, out: &mut [f32]) {
        let outs = w.len() / inner;
        let groups = outs / 4;
        for g in 0..groups {
            // SAFETY: weight rows 4g..4g+4 exist.
            unsafe { dots::<R, 4>(xs, w, inner, 4 * g, out, outs) };
        }
        for j in 4 * groups..outs {
            // SAFETY: weight row j exists.
            unsafe { dots::<R, 1>(xs, w, inner, j, out, outs) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots<const R: usize, const J: usize>(
        xs: &[f32],
        w: &[f16],
        inner: usize,
        first: usize,
        out: &mut [f32],
        outs: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        let (xp, wp) = (xs.as_ptr(), w.as_ptr().wrapping_add(first * inner));
        for k in (0..inner).step_by(16) {
            // SAFETY: `inner` is a multiple of 16, so every 16-element load lies inside weight
            // rows first..first+J and the R rows of `xs`; f16 is two bytes, as the load reads.
            unsafe {
                let wv: [__m512; J] = std::array::from_fn(|j| {
                    _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(j * inner + k).cast()))
                });
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = _mm512_loadu_ps(xp.add(r * inner + k));
                    for j in 0..J {
                        a[j] = _mm512_fmadd_ps(x, wv[j], a[j]);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, v) in a.iter().enumerate() {
                out[r * outs + first + j] = _mm512_reduce_add_ps(*v);
            }
        }
    }
}
