//! AVX-512F dot products for the small-M matmul and the attention kernels (16 lanes, 32
//! registers: twice the accumulators of AVX2). Compiled for AVX-512F/VL, AVX2 and FMA (and
//! F16C for the attention's f16 cache); `super`'s dispatch calls them only after `isa()`
//! detected them all.

use std::arch::x86_64::*;

use super::avx2::{PREFETCH_POSITIONS, prefetch_head};
use super::kv_element::KvElement;
use super::{OutLayout, SharedOut};

/// AVX-512 dot products of up to `X86_ROW_BLOCK` (6) rows of `xs` with `J` (1, 4 or 8) weight rows; the
/// row count becomes a constant so that every accumulator stays in a register.
///
/// # Safety
/// The CPU must have AVX-512F and VL, AVX2 and FMA, and every weight row in `ws` must hold
/// `ws[0].len()` elements (the rows of `xs` are whole: it holds a multiple of that many).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
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
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn dots_rows<const R: usize, const J: usize>(
    xs: &[f32],
    ws: [&[f32]; J],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let inner = ws[0].len();
    let full = inner - inner % 16;
    let mut acc = [[_mm512_setzero_ps(); J]; R];
    // SAFETY (both): row r of `xs` starts at r · inner, inside `xs` for r < R.
    let x: [*const f32; R] = std::array::from_fn(|r| unsafe { xs.as_ptr().add(r * inner) });
    let w: [*const f32; J] = std::array::from_fn(|j| ws[j].as_ptr());
    let ahead = super::prefetch_ahead(J * inner);
    let mut k = 0;
    while k < full {
        // SAFETY: k + 16 <= inner, within every row of `xs` and every weight row.
        unsafe { chunk(&mut acc, (x, w), k, !0, ahead) };
        k += 16;
    }
    if k < inner {
        // The last chunk of a row not a multiple of 16 long loads its tail under a mask
        // (zeros elsewhere), so every chunk runs the same FMAs.
        let mask: __mmask16 = (1u16 << (inner - k)) - 1;
        // SAFETY: the unmasked lanes lie within `inner`; masked-off lanes are not read.
        unsafe { chunk(&mut acc, (x, w), k, mask, 0) };
    }
    for (r, a) in acc.iter().enumerate() {
        store_sums(a, out, to, first + r);
    }
}

/// One 16-lane chunk at `k` of every (row, weight row) pair: each weight chunk loaded once
/// for all rows, each row chunk once for all weight rows; the weight rows' chunk `ahead`
/// floats on (`super::prefetch_ahead`: later groups', streaming from L3) is prefetched.
///
/// # Safety
/// The lanes of `mask` from `k` on lie within every row behind `x` and `w`.
#[inline(always)]
unsafe fn chunk<const R: usize, const J: usize>(
    acc: &mut [[__m512; J]; R],
    (x, w): ([*const f32; R], [*const f32; J]),
    k: usize,
    mask: __mmask16,
    ahead: usize,
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
        if ahead > 0 {
            for wj in w {
                _mm_prefetch::<_MM_HINT_T0>(wj.wrapping_add(k + ahead) as *const i8);
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

/// One head's attention scores, `scores[s] = (q · keys[s·stride ..]) · scale` for
/// `s < scores.len()`, with `q` (`16·C` floats) held in registers; sixteen positions at a
/// time, each with its own accumulator summed over the chunks in order and reduced by
/// [`reduce1`]'s tree (`reduce16` is the same tree for sixteen at once), so a score does not
/// depend on the block it falls in. Half the instructions of `avx2::head_scores`, whose
/// reductions it also amortises over sixteen positions instead of four.
/// The keys are f32 or f16 (widened exactly, then the same arithmetic).
/// Checks its own bounds: safe where AVX-512F/VL, AVX2, FMA and F16C are enabled.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
pub fn head_scores<const C: usize, E: KvElement>(
    q: &[f32],
    keys: &[E],
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let len = scores.len();
    assert!(q.len() >= 16 * C && (len == 0 || keys.len() >= (len - 1) * stride + 16 * C));
    // SAFETY (all loads below): the features `E::load16` needs are enabled here, and chunk c
    // of position s lies inside `q` / `keys` by the assertion above.
    let qv: [__m512; C] =
        std::array::from_fn(|c| unsafe { _mm512_loadu_ps(q.as_ptr().add(16 * c)) });
    let key = |s: usize, c: usize| unsafe { E::load16(keys.as_ptr().add(s * stride + 16 * c)) };
    let mut s = 0;
    while s + 16 <= len {
        for p in s..s + 16 {
            prefetch_head(keys, (p + PREFETCH_POSITIONS) * stride, 16 * C);
        }
        let mut acc = [_mm512_setzero_ps(); 16];
        for (c, qc) in qv.iter().enumerate() {
            for (p, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(*qc, key(s + p, c), *a);
            }
        }
        let sums = _mm512_mul_ps(reduce16(&acc), _mm512_set1_ps(scale));
        // SAFETY: s + 16 <= len = scores.len().
        unsafe { _mm512_storeu_ps(scores.as_mut_ptr().add(s), sums) };
        s += 16;
    }
    for (s, score) in scores.iter_mut().enumerate().skip(s) {
        let mut a = _mm512_setzero_ps();
        for (c, qc) in qv.iter().enumerate() {
            a = _mm512_fmadd_ps(*qc, key(s, c), a);
        }
        *score = reduce1(a) * scale;
    }
}

/// The sum of `a`'s sixteen lanes by a fixed tree: lanes i and i + 8, then i and i + 4, i
/// and i + 2, then the last pair.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn reduce1(a: __m512) -> f32 {
    let s1 = halves(a);
    let s2 = _mm_add_ps(_mm256_castps256_ps128(s1), _mm256_extractf32x4_ps::<1>(s1));
    let s3 = _mm_add_ps(s2, _mm_movehl_ps(s2, s2));
    _mm_cvtss_f32(_mm_add_ss(s3, _mm_movehdup_ps(s3)))
}

/// Lane j: [`reduce1`] of `acc[j]`, the same pairs added in the same tree, sixteen at once
/// (each level's shuffles gather the pairs of two accumulators into one register).
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
fn reduce16(acc: &[__m512; 16]) -> __m512 {
    // Lanes i and i + 8: accumulator 2k's eight sums, then 2k + 1's.
    let w: [__m512; 8] = std::array::from_fn(|k| {
        let (a, b) = (acc[2 * k], acc[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    // Then i and i + 4: four accumulators' four sums, one per 128-bit quarter.
    let x: [__m512; 4] = std::array::from_fn(|m| {
        let (a, b) = (w[2 * m], w[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    // Then i and i + 2, and the last pair, within each quarter.
    let y: [__m512; 2] = std::array::from_fn(|n| {
        let (a, b) = (x[2 * n], x[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    });
    let z = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]),
    );
    // Lane l now holds accumulator (l mod 4)·4 + l / 4's sum; the transpose is its own inverse.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, z)
}

/// Two heads' `out[h] += Σ_s probs[h·probs_stride + s] · values[s·stride + offsets[h] ..]`
/// for s < `count`, each head `16·C` floats of `out`, side by side: one accumulator per
/// (head, chunk), loaded from `out` and summed over the positions in order, exactly what a
/// head alone sums. Two heads at once give the FMAs two independent chains per chunk, so
/// their latency does not bound the loop, and read both heads' lines of an entry together.
/// The values are f32 or f16 (widened exactly).
/// Checks its own bounds: safe where AVX-512F/VL, AVX2, FMA and F16C are enabled.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
pub fn head_pair_values<const C: usize, E: KvElement>(
    (probs, probs_stride, count): (&[f32], usize, usize),
    values: &[E],
    (offsets, stride): ([usize; 2], usize),
    out: &mut [f32],
) {
    let reach = offsets.iter().max().map_or(0, |o| o + 16 * C);
    assert!(out.len() >= 32 * C && probs.len() >= probs_stride + count);
    assert!(count == 0 || values.len() >= (count - 1) * stride + reach);
    // SAFETY: 16·(C·h + c) + 16 <= out.len() by the assertion above.
    let mut acc: [[__m512; C]; 2] = std::array::from_fn(|h| {
        std::array::from_fn(|c| unsafe { _mm512_loadu_ps(out.as_ptr().add(16 * (C * h + c))) })
    });
    for s in 0..count {
        for offset in offsets {
            prefetch_head(values, (s + PREFETCH_POSITIONS) * stride + offset, 16 * C);
        }
        for (h, (a, offset)) in acc.iter_mut().zip(offsets).enumerate() {
            let w = _mm512_set1_ps(probs[h * probs_stride + s]);
            for (c, a) in a.iter_mut().enumerate() {
                // SAFETY: chunk c of head h at position s lies inside `values` by the
                // assertion above, and the features `E::load16` needs are enabled here.
                let v = unsafe { E::load16(values.as_ptr().add(s * stride + offset + 16 * c)) };
                *a = _mm512_fmadd_ps(w, v, *a);
            }
        }
    }
    for (h, a) in acc.iter().enumerate() {
        for (c, a) in a.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * (C * h + c)), *a) };
        }
    }
}
