//! AVX-512 VNNI's products of `q8_0`'s one definition for both blocks of 32 (Q8_0 and Q4_0):
//! per group block, the 8 rows' weights as `vpdpbusd`'s unsigned operand against the signed
//! activations, less the weights' offset times the activations' block sum.
//!
//! One row takes 256-bit registers, a lane per weight row. Two rows or more take two groups at
//! once in 512-bit registers: lanes 0..8 hold a weight vector of the first group's rows, lanes
//! 8..16 the same of the second's (one `vinserti64x4` a vector), so each activation's 4 bytes
//! reach every lane in `vpdpbusd`'s own broadcast from memory. No weight is shuffled for a row
//! and no activation is copied, and each row's lanes start from the offset's product: a row
//! and a block of two groups cost 8 `vpdpbusd`, an add, and the float part. Every lane is
//! still one (row, weight row) pair fed the definition's integer sums and FMAs in order, so
//! the bits are the one-row kernel's and the portable loops': half the multiply-add
//! instructions a row of the one-row kernel, which a speculative step of R rows needs to stay
//! under its weights' reads (SPEED, arXiv 2310.12072, §3).

use std::arch::x86_64::*;

use half::f16;

use super::packed::GROUP_ROWS;
use super::q8_0::{QK8_0, QuantRowsView, broadcast4, prefetch, scales8, store8};
use super::{OutLayout, Prefetch, SharedOut};

/// A group's block of 8 rows as the VNNI kernels take it.
pub(super) trait VnniGroup {
    /// `log2` of the weights' offset over 8: the offset's product is `sums8 << SHIFT`
    /// (`QuantizedRows::sums8` holds `8 · Σx`).
    const SHIFT: u32;
    /// The 8 rows' scales.
    fn scales(&self) -> &[f16; GROUP_ROWS];
    /// The 32 weights of the 8 rows plus the offset, unsigned: `[k4]` holds weights
    /// `4·k4..4·k4 + 4` of each row, a 4-byte lane a row.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn weights(&self) -> [__m256i; 8];
}

/// The one definition's products of `xs`' rows and `groups` (module docs): one row in 256-bit
/// lanes, more against two groups at once.
///
/// # Safety
/// The CPU must have AVX-512F, VL and VNNI, AVX2, FMA and F16C; `xs` holds `R` rows of
/// `xs.blocks` blocks and `groups` whole groups of as many.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn groups<G: VnniGroup, const R: usize>(
    plan: Prefetch,
    xs: QuantRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        match R {
            1 => one_row::<G>(plan, xs, groups, out, to, first),
            _ => duos::<G, R>(plan, xs, groups, out, to, first),
        }
    }
}

/// One row: per group block, 8 `vpdpbusd` into a lane per weight row.
///
/// # Safety
/// As [`groups`], one row.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn one_row<G: VnniGroup>(
    plan: Prefetch,
    xs: QuantRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = _mm256_setzero_ps();
        for (k, item) in group.iter().enumerate() {
            prefetch(plan, item);
            // SAFETY: the features.
            let (w, dw) = unsafe { (item.weights(), scales8(item.scales())) };
            let xp = xs.qs[k * QK8_0..].as_ptr();
            let (mut even, mut odd) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for k4 in (0..8).step_by(2) {
                // SAFETY: the row holds block `k`'s 32 bytes at `xp`.
                let (x0, x1) =
                    unsafe { (broadcast4(xp.add(4 * k4)), broadcast4(xp.add(4 * k4 + 4))) };
                even = _mm256_dpbusd_epi32(even, w[k4], x0);
                odd = _mm256_dpbusd_epi32(odd, w[k4 + 1], x1);
            }
            let off = _mm256_set1_epi32(xs.sums8[k] << G::SHIFT);
            let isum = _mm256_sub_epi32(_mm256_add_epi32(even, odd), off);
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xs.scales[k]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
        }
        // SAFETY: the features.
        unsafe { store8(acc, out.from(g * GROUP_ROWS * to.col), to, first) };
    }
}

/// `R` rows (2 to 6) against two groups at once (module docs); a last odd group is taken as
/// both halves and its copy's lanes dropped.
///
/// # Safety
/// As [`groups`].
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn duos<G: VnniGroup, const R: usize>(
    plan: Prefetch,
    xs: QuantRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    // Cut once here: the loop reads row `r`'s block `k` at `r · b + k`, its 32 bytes through a
    // raw pointer (a bounds check for each row and block would stay in the loop).
    let (qs, sums8, scales) = (
        &xs.qs[..R * b * QK8_0],
        &xs.sums8[..R * b],
        &xs.scales[..R * b],
    );
    let count = groups.len() / b.max(1);
    for g in (0..count).step_by(2) {
        let pair = [g, (g + 1).min(count - 1)].map(|g| &groups[g * b..(g + 1) * b]);
        let mut acc = [_mm512_setzero_ps(); R];
        for (k, (lo, hi)) in pair[0].iter().zip(pair[1]).enumerate() {
            prefetch(plan, lo);
            prefetch(plan, hi);
            // SAFETY: the features.
            let (w, dw) = unsafe { (two(lo.weights(), hi.weights()), two_scales(lo, hi)) };
            for (r, acc) in acc.iter_mut().enumerate() {
                // `at` < R · b: `r` < R and `k` < b.
                let at = r * b + k;
                // SAFETY: row `r`'s 32 bytes of block `k` lie in `qs` (sliced above).
                let xp = unsafe { qs.as_ptr().add(at * QK8_0) };
                // The offset's product comes off first, as the chain's start.
                let mut chain = [
                    _mm512_set1_epi32(-(sums8[at] << G::SHIFT)),
                    _mm512_setzero_si512(),
                ];
                for (k4, w) in w.iter().enumerate() {
                    // SAFETY: 4 of the block's 32 bytes at `xp`; any 4 bytes are a valid i32.
                    let x = unsafe { std::ptr::read_unaligned(xp.add(4 * k4).cast::<i32>()) };
                    chain[k4 % 2] = _mm512_dpbusd_epi32(chain[k4 % 2], *w, _mm512_set1_epi32(x));
                }
                let isum = _mm512_add_epi32(chain[0], chain[1]);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(scales[at]));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
            }
        }
        for (r, a) in acc.into_iter().enumerate() {
            let halves = [
                _mm512_castps512_ps256(a),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
            ];
            for (i, half) in halves.into_iter().enumerate().take((count - g).min(2)) {
                let at = out.from((g + i) * GROUP_ROWS * to.col);
                // SAFETY: the features.
                unsafe { store8(half, at, to, first + r) };
            }
        }
    }
}

/// A weight vector of each of two groups in one 512-bit register: `lo`'s in lanes 0..8.
#[target_feature(enable = "avx512f")]
#[inline]
fn two(lo: [__m256i; 8], hi: [__m256i; 8]) -> [__m512i; 8] {
    std::array::from_fn(|k4| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo[k4]), hi[k4]))
}

/// Two groups' scales as [`two`] lays out their weights.
///
/// # Safety
/// The CPU must have AVX-512F and F16C.
#[target_feature(enable = "avx512f,f16c")]
#[inline]
unsafe fn two_scales<G: VnniGroup>(lo: &G, hi: &G) -> __m512 {
    // SAFETY: the caller's features.
    let (lo, hi) = unsafe { (scales8(lo.scales()), scales8(hi.scales())) };
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
        _mm256_castps_pd(hi),
    ))
}
