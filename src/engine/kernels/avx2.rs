//! AVX2 + FMA kernels: the small-M matmul's dot products, vector exp (SiLU, softmax) and
//! head-major attention. Every function here is compiled for AVX2 and FMA; calling one on a
//! CPU without them is undefined behaviour, so callers go through `super`'s dispatch, which
//! checks the `Kernels`' ISA first. Functions that check their own bounds are safe to call
//! where the features are enabled.

use std::arch::x86_64::*;

use super::kv_element::KvElement;
use super::{OutLayout, Prefetch, SharedOut, WeightElement};

/// AVX2/FMA dot products of up to `X86_ROW_BLOCK` (6) rows of `xs` with every weight row of
/// `w`, `J` (1–3) rows at a time: `w` holds whole groups of `J` rows of `inner`. Each weight
/// chunk is loaded once for all rows and each row chunk once for all weight rows. The row
/// count becomes a constant so that every accumulator stays in a register (6 rows × 2 weight
/// rows + 2 weight chunks + 1 row chunk = 15 of 16). One call takes a run of groups, so the
/// call, the row dispatch and the setup are paid once a run (`super::sweep`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must hold a multiple of `J · inner` elements and
/// `xs` a multiple of `inner`.
#[target_feature(enable = "avx2,fma,f16c")]
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

/// Each (row, weight row) pair has one accumulator fed in the same order and reduced by
/// `reduce4`'s tree (the same whatever it is grouped with), so a row's result does not
/// depend on R, J or the other rows.
///
/// # Safety
/// As [`dots`], and `xs` holds at least `R` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_rows<const R: usize, const J: usize, W: WeightElement>(
    xs: &[f32],
    w: &[W],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    plan: Prefetch,
    first: usize,
) {
    let bytes = std::mem::size_of::<W>();
    let (near, far) = (plan.near(bytes, J * inner), plan.far(bytes));
    for (g, group) in w.chunks_exact(J * inner).enumerate() {
        let ws: [&[W]; J] = super::row_slices(group, inner);
        // SAFETY: the caller's features; `ws` rows and `xs`' R rows hold `inner` elements.
        let acc = unsafe { group_sums::<R, J, W>(xs, ws, near, far) };
        store_sums(&acc, xs, ws, out.from(g * J * to.col), to, first);
    }
}

/// The 8-lane accumulators of every (row, weight row) pair of one group of weight rows `ws`,
/// over the multiple-of-8 part of each row; the weight rows `near` and `far` floats on (later
/// groups', streaming from L3 or DRAM: `super::prefetch`) prefetched into L1 and L2, where
/// the plan has them.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `xs` holds at least R rows of `ws[0].len()`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_sums<const R: usize, const J: usize, W: WeightElement>(
    xs: &[f32],
    ws: [&[W]; J],
    near: Option<usize>,
    far: usize,
) -> [[__m256; J]; R] {
    let inner = ws[0].len();
    let main = inner - inner % 8;
    let mut acc = [[_mm256_setzero_ps(); J]; R];
    let xp = xs.as_ptr();
    // The group's J rows are contiguous: J · 8 floats of the lines `near` and `far` floats
    // past it are prefetched a chunk, in order, from one pointer each, as `avx512::dots_rows`
    // does (one pointer per row and distance left too few registers).
    let (near_at, far_at) = (
        near.map(|near| ws[0].as_ptr().wrapping_add(near)),
        ws[0].as_ptr().wrapping_add(far),
    );
    let mut k = 0;
    while k < main {
        // SAFETY: k + 8 <= inner; every row r < R has `inner` elements in `xs`, and every
        // weight row has `inner` elements.
        unsafe {
            let w: [__m256; J] = std::array::from_fn(|j| W::load8(ws[j].as_ptr().add(k)));
            // Every line of the J · 8 elements: lines of 64 bytes, at most a line apart.
            let bytes = std::mem::size_of::<W>();
            for line in 0..(J * 8 * bytes).div_ceil(64) {
                let at = J * k + line * 64 / bytes;
                // A prefetch never faults, even past the end.
                if let Some(near_at) = near_at {
                    _mm_prefetch::<_MM_HINT_T0>(near_at.wrapping_add(at) as *const i8);
                }
                if far > 0 {
                    _mm_prefetch::<_MM_HINT_T1>(far_at.wrapping_add(at) as *const i8);
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(xp.add(r * inner + k));
                for j in 0..J {
                    a[j] = _mm256_fmadd_ps(x, w[j], a[j]);
                }
            }
        }
        k += 8;
    }
    acc
}

/// Horizontal sums of four rows at a time, every weight row's before any store (a group of
/// fewer rows repeats its last and drops the copies), plus each row's tail past the last
/// multiple of 8. Summing them all first keeps the accumulators in registers: sums and
/// stores interleaved spilled every accumulator to the stack, which slowed a 4-row step on
/// forced AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_sums<const R: usize, const J: usize, W: WeightElement>(
    acc: &[[__m256; J]; R],
    xs: &[f32],
    ws: [&[W]; J],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let inner = ws[0].len();
    let main = inner - inner % 8;
    let mut sums = [[0f32; 4]; J];
    for r0 in (0..R).step_by(4) {
        for (j, four) in sums.iter_mut().enumerate() {
            let a = |r: usize| acc[(r0 + r).min(R - 1)][j];
            // SAFETY: `four` holds exactly 4 floats.
            unsafe { _mm_storeu_ps(four.as_mut_ptr(), reduce4(a(0), a(1), a(2), a(3))) };
        }
        for (j, four) in sums.iter().enumerate() {
            for (r, &sum) in four.iter().enumerate().take(R - r0) {
                let row = r0 + r;
                let tail = (main..inner).map(|kk| xs[row * inner + kk] * ws[j][kk].to_f32());
                let at = j * to.col + (first + row) * to.row;
                out.set(at, tail.fold(sum, |s, p| s + p));
            }
        }
    }
}

/// e^x for 8 lanes (Cephes' expf polynomial, ~1 ulp): a vector exp, since libm's is
/// scalar and the per-row exps of SiLU and softmax would otherwise dominate row cost.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
        _mm256_set1_ps(88.3),
    );
    let fx = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(x, x),
        _mm256_add_ps(x, _mm256_set1_ps(1.0)),
    );
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(fx),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
}

/// `x[i] = e^(x[i] − shift)`. Safe where AVX2 and FMA are enabled.
#[target_feature(enable = "avx2,fma")]
pub fn exp_shifted(x: &mut [f32], shift: f32) {
    let s = _mm256_set1_ps(shift);
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 floats.
        unsafe {
            _mm256_storeu_ps(
                c.as_mut_ptr(),
                exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), s)),
            )
        };
    }
    for v in chunks.into_remainder() {
        *v = exp1(*v - shift);
    }
}

/// Σ e^(x[i] − shift), over 8 lanes and then the tail. Safe where AVX2 and FMA are enabled.
#[target_feature(enable = "avx2,fma")]
pub fn sum_exp(x: &[f32], shift: f32) -> f32 {
    let s = _mm256_set1_ps(shift);
    let mut acc = _mm256_setzero_ps();
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        // SAFETY: `c` holds exactly 8 floats.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(v, s)));
    }
    let zero = _mm256_setzero_ps();
    let sum = _mm_cvtss_f32(reduce4(acc, zero, zero, zero));
    tail.iter().fold(sum, |sum, &v| sum + exp1(v - shift))
}

/// Numerically stable softmax in place: the max and the sum over 8 lanes (the sum's lanes
/// folded by `reduce4`'s tree, then the tail in order), so neither is a chain of dependent
/// scalar operations (they were half of a row's attention at 128 positions).
#[target_feature(enable = "avx2,fma")]
pub fn softmax(x: &mut [f32]) {
    let mut chunks = x.chunks_exact(8);
    let mut max8 = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 floats.
        max8 = _mm256_max_ps(max8, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds exactly 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), max8) };
    let max = (lanes.iter().chain(chunks.remainder())).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    exp_shifted(x, max);
    let mut chunks = x.chunks_exact(8);
    let mut sum8 = _mm256_setzero_ps();
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 floats.
        sum8 = _mm256_add_ps(sum8, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let zero = _mm256_setzero_ps();
    let sum = _mm_cvtss_f32(reduce4(sum8, zero, zero, zero));
    let sum = chunks.remainder().iter().fold(sum, |s, v| s + v);
    let sum8 = _mm256_set1_ps(sum);
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 floats.
        unsafe {
            _mm256_storeu_ps(
                c.as_mut_ptr(),
                _mm256_div_ps(_mm256_loadu_ps(c.as_ptr()), sum8),
            )
        };
    }
    for v in chunks.into_remainder() {
        *v /= sum;
    }
}

/// `gate[i] = silu(gate[i]) · up[i]`. Safe where AVX2 and FMA are enabled.
#[target_feature(enable = "avx2,fma")]
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let one = _mm256_set1_ps(1.0);
    let mut g = gate.chunks_exact_mut(8);
    let mut u = up.chunks_exact(8);
    for (gc, uc) in (&mut g).zip(&mut u) {
        // SAFETY: both chunks hold exactly 8 floats.
        unsafe {
            let x = _mm256_loadu_ps(gc.as_ptr());
            let sig = _mm256_div_ps(
                x,
                _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))),
            );
            _mm256_storeu_ps(
                gc.as_mut_ptr(),
                _mm256_mul_ps(sig, _mm256_loadu_ps(uc.as_ptr())),
            );
        }
    }
    for (gv, uv) in g.into_remainder().iter_mut().zip(u.remainder()) {
        *gv = *gv / (1.0 + exp1(-*gv)) * uv;
    }
}

/// The same polynomial on one lane, so a row's tail matches its vector part.
#[target_feature(enable = "avx2,fma")]
fn exp1(x: f32) -> f32 {
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds exactly 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), exp8(_mm256_set1_ps(x))) };
    lanes[0]
}

/// `[Σa, Σb, Σc, Σd]`, each by the tree ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn reduce4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let ab = _mm256_hadd_ps(a, b);
    let cd = _mm256_hadd_ps(c, d);
    let abcd = _mm256_hadd_ps(ab, cd);
    _mm_add_ps(
        _mm256_castps256_ps128(abcd),
        _mm256_extractf128_ps::<1>(abcd),
    )
}

/// How many positions ahead the attention kernels prefetch a head's cache entry: a row's
/// cache comes from L3 (the step's weights pass through L2 between its layers), one head's few
/// lines at the stride of a whole entry. Prefetching them took time off a 4-row step.
pub(super) const PREFETCH_POSITIONS: usize = 16;

/// Prefetches the cache lines of one head's entry, `cache[at..at + len]` (a prefetch never
/// faults, so `at` may lie past the end).
#[inline(always)]
pub(super) fn prefetch_head<E>(cache: &[E], at: usize, len: usize) {
    let start = cache.as_ptr().wrapping_add(at) as *const i8;
    for line in (0..len * std::mem::size_of::<E>()).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line)) };
    }
}

/// Positions whose scores are computed together: their accumulators and the query's
/// `C` chunks fill the 16 registers.
const SCORE_BLOCK: usize = 8;

/// One head's attention scores, `scores[s] = (q · keys[s·stride ..]) · scale` for
/// `s < scores.len()`, with `q` (`8·C` floats) held in registers. Every position has its
/// own accumulator, summed over the chunks in order and reduced by `reduce4`'s tree, so
/// its score does not depend on the block it falls in.
/// The keys are f32 or f16 (widened exactly, then the same arithmetic).
/// Checks its own bounds: safe where AVX2, FMA and F16C are enabled.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn head_scores<const C: usize, E: KvElement>(
    q: &[f32],
    keys: &[E],
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let len = scores.len();
    assert!(q.len() >= 8 * C && (len == 0 || keys.len() >= (len - 1) * stride + 8 * C));
    let qv: [__m256; C] = std::array::from_fn(|c| {
        // SAFETY: chunk c lies inside `q` by the assertion above.
        unsafe { _mm256_loadu_ps(q.as_ptr().add(8 * c)) }
    });
    let key = |s: usize, c: usize| {
        // SAFETY: the features `E::load8` needs are enabled here, and chunk c of position s
        // lies inside `keys` by the assertion above.
        unsafe { E::load8(keys.as_ptr().add(s * stride + 8 * c)) }
    };
    let zero = _mm256_setzero_ps();
    let mut s = 0;
    while s + SCORE_BLOCK <= len {
        for p in s..s + SCORE_BLOCK {
            prefetch_head(keys, (p + PREFETCH_POSITIONS) * stride, 8 * C);
        }
        let mut acc = [zero; SCORE_BLOCK];
        for (c, qc) in qv.iter().enumerate() {
            for (p, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(*qc, key(s + p, c), *a);
            }
        }
        for (p, group) in acc.chunks_exact(4).enumerate() {
            let sums = _mm_mul_ps(
                reduce4(group[0], group[1], group[2], group[3]),
                _mm_set1_ps(scale),
            );
            // SAFETY: s + 4·p + 4 <= len = scores.len().
            unsafe { _mm_storeu_ps(scores.as_mut_ptr().add(s + 4 * p), sums) };
        }
        s += SCORE_BLOCK;
    }
    for (s, score) in scores.iter_mut().enumerate().skip(s) {
        let mut a = zero;
        for (c, qc) in qv.iter().enumerate() {
            a = _mm256_fmadd_ps(*qc, key(s, c), a);
        }
        *score = _mm_cvtss_f32(reduce4(a, zero, zero, zero)) * scale;
    }
}

/// `out += Σ_s probs[s] · values[s·stride ..]` for one head of `8·C` floats: one
/// accumulator per chunk, loaded from `out`, summed over the positions in order.
/// The values are f32 or f16 (widened exactly).
/// Checks its own bounds: safe where AVX2, FMA and F16C are enabled.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn head_values<const C: usize, E: KvElement>(
    probs: &[f32],
    values: &[E],
    stride: usize,
    out: &mut [f32],
) {
    let len = probs.len();
    assert!(out.len() >= 8 * C && (len == 0 || values.len() >= (len - 1) * stride + 8 * C));
    // SAFETY: 8·c + 8 <= out.len() by the assertion above.
    let mut acc: [__m256; C] =
        std::array::from_fn(|c| unsafe { _mm256_loadu_ps(out.as_ptr().add(8 * c)) });
    for (s, &p) in probs.iter().enumerate() {
        prefetch_head(values, (s + PREFETCH_POSITIONS) * stride, 8 * C);
        let w = _mm256_set1_ps(p);
        for (c, a) in acc.iter_mut().enumerate() {
            // SAFETY: chunk c of position s lies inside `values` by the assertion above, and
            // the features `E::load8` needs are enabled here.
            let v = unsafe { E::load8(values.as_ptr().add(s * stride + 8 * c)) };
            *a = _mm256_fmadd_ps(w, v, *a);
        }
    }
    for (c, a) in acc.iter().enumerate() {
        // SAFETY: 8·c + 8 <= out.len() by the assertion above.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *a) };
    }
}
