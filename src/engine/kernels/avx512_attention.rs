//! The attention's two per-head loops in AVX-512, for heads of 128 (Ouro's): `attention`
//! dispatches here where the kernels' ISA has AVX-512F. 32 registers hold the query's 8
//! chunks of 16 floats with 8 positions' accumulators beside them, where AVX2's 16 registers
//! hold the query alone and spill the rest, and each instruction widens and multiplies 16
//! elements instead of 8. One row's attention over one layer's 64, 256 or 1024 positions
//! (16 heads of 128, f16, tiled cache) took less time than AVX2's, hot and cold. Heads of 64
//! stay on AVX2, which holds them without spilling: this loop took their scores and values
//! longer hot.
//!
//! Exactness: as in `avx2`, every position's score has one accumulator fed the head's chunks
//! in order and reduced by one fixed tree, and every output chunk sums the positions in order,
//! so a row's result does not depend on the block or the group it falls in.

use std::arch::x86_64::*;

use super::avx2::{PREFETCH_POSITIONS, prefetch_head, reduce4};
use super::kv_element::KvElement;

/// Positions whose scores are computed together (8 accumulators beside the query's chunks).
const SCORE_BLOCK: usize = 8;

/// An accumulator's 16 lanes folded to 8 (the halves added), for [`reduce4`]'s tree.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn fold(a: __m512) -> __m256 {
    _mm256_add_ps(
        _mm512_castps512_ps256(a),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
    )
}

/// The sums of eight accumulators, one a lane: each [`fold`]ed, then [`reduce4`]'s tree four
/// at a time (each sum from its own accumulator alone, so a position's score is the same
/// whichever block it falls in).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn reduce8(acc: &[__m512; SCORE_BLOCK]) -> (__m128, __m128) {
    let f: [__m256; SCORE_BLOCK] = std::array::from_fn(|p| fold(acc[p]));
    (
        reduce4(f[0], f[1], f[2], f[3]),
        reduce4(f[4], f[5], f[6], f[7]),
    )
}

/// One head's attention scores, `scores[s] = (q · keys[s·stride ..]) · scale` for
/// `s < scores.len()`, with `q` (`16·C` floats) held in registers.
/// Checks its own bounds: safe where AVX-512F, AVX2, FMA and F16C are enabled.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub fn head_scores<const C: usize, E: KvElement>(
    q: &[f32],
    keys: &[E],
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let len = scores.len();
    assert!(q.len() >= 16 * C && (len == 0 || keys.len() >= (len - 1) * stride + 16 * C));
    let qv: [__m512; C] = std::array::from_fn(|c| {
        // SAFETY: chunk c lies inside `q` by the assertion above.
        unsafe { _mm512_loadu_ps(q.as_ptr().add(16 * c)) }
    });
    let key = |s: usize, c: usize| {
        // SAFETY: chunk c of position s lies inside `keys` by the assertion above, and the
        // features `E::load16` needs are enabled here.
        unsafe { E::load16(keys.as_ptr().add(s * stride + 16 * c)) }
    };
    let scale4 = _mm_set1_ps(scale);
    let mut s = 0;
    while s + SCORE_BLOCK <= len {
        for p in s..s + SCORE_BLOCK {
            prefetch_head(keys, (p + PREFETCH_POSITIONS) * stride, 16 * C);
        }
        let mut acc = [_mm512_setzero_ps(); SCORE_BLOCK];
        for (c, qc) in qv.iter().enumerate() {
            for (p, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(*qc, key(s + p, c), *a);
            }
        }
        let (low, high) = reduce8(&acc);
        // SAFETY: s + 8 <= len = scores.len().
        unsafe {
            _mm_storeu_ps(scores.as_mut_ptr().add(s), _mm_mul_ps(low, scale4));
            _mm_storeu_ps(scores.as_mut_ptr().add(s + 4), _mm_mul_ps(high, scale4));
        }
        s += SCORE_BLOCK;
    }
    for (s, score) in scores.iter_mut().enumerate().skip(s) {
        let mut acc = _mm512_setzero_ps();
        for (c, qc) in qv.iter().enumerate() {
            acc = _mm512_fmadd_ps(*qc, key(s, c), acc);
        }
        let zero = _mm256_setzero_ps();
        *score = _mm_cvtss_f32(reduce4(fold(acc), zero, zero, zero)) * scale;
    }
}

/// `out += Σ_s probs[s] · values[s·stride ..]` for one head of `16·C` floats: one
/// accumulator per chunk, loaded from `out`, summed over the positions in order.
/// Checks its own bounds: safe where AVX-512F, AVX2, FMA and F16C are enabled.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub fn head_values<const C: usize, E: KvElement>(
    probs: &[f32],
    values: &[E],
    stride: usize,
    out: &mut [f32],
) {
    let len = probs.len();
    assert!(out.len() >= 16 * C && (len == 0 || values.len() >= (len - 1) * stride + 16 * C));
    // SAFETY: 16·c + 16 <= out.len() by the assertion above.
    let mut acc: [__m512; C] =
        std::array::from_fn(|c| unsafe { _mm512_loadu_ps(out.as_ptr().add(16 * c)) });
    for (s, &p) in probs.iter().enumerate() {
        prefetch_head(values, (s + PREFETCH_POSITIONS) * stride, 16 * C);
        let w = _mm512_set1_ps(p);
        for (c, a) in acc.iter_mut().enumerate() {
            // SAFETY: chunk c of position s lies inside `values` by the assertion above, and
            // the features `E::load16` needs are enabled here.
            let v = unsafe { E::load16(values.as_ptr().add(s * stride + 16 * c)) };
            *a = _mm512_fmadd_ps(w, v, *a);
        }
    }
    for (c, a) in acc.iter().enumerate() {
        // SAFETY: 16·c + 16 <= out.len() by the assertion above.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), *a) };
    }
}
