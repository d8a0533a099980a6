//! AVX-512 VNNI's products of `q8_0`'s one definition for both blocks of 32 (Q8_0 and Q4_0):
//! per group block, the 8 rows' weights as `vpdpbusd`'s unsigned operand against the signed
//! activations, less the weights' offset times the activations' block sum.
//!
//! One row takes 256-bit registers, a lane per weight row. Two rows or more go by pairs in
//! 512-bit registers: lane `2j` is weight row `j` against the pair's first row, lane `2j + 1`
//! against its second, each weight vector widened once a block for every pair (one `vpermd`) and
//! each pair's activations broadcast 8 bytes at a time from their interleaved copy
//! (`QuantizedRows`' pairs). Every lane is still one (row, weight row) pair fed the definition's
//! integer sums and FMAs in order, so the bits are the one-row kernel's and the portable loops':
//! only half the multiply-add instructions a row, which a speculative step of R rows needs to
//! stay under its weights' reads (SPEED, arXiv 2310.12072, §3).

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

/// `v` shifted left by `G::SHIFT` (0 or 4: Q4_0's offset 8, Q8_0's 128).
#[inline(always)]
fn offset<G: VnniGroup>(sums8: __m512i) -> __m512i {
    // SAFETY: AVX-512F, which every caller's features include.
    unsafe {
        match G::SHIFT {
            0 => sums8,
            _ => _mm512_slli_epi32::<4>(sums8),
        }
    }
}

/// The one definition's products of `xs`' rows and `groups` (module docs): one row in 256-bit
/// lanes, more by pairs.
///
/// # Safety
/// The CPU must have AVX-512F, VL and VNNI, AVX2, FMA and F16C; `xs` holds `R` rows of
/// `xs.blocks` blocks (and their pairs where `R` > 1) and `groups` whole groups of as many.
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
            2 => pairs::<G, 1>(plan, xs, groups, out, to, first),
            3 | 4 => pairs::<G, 2>(plan, xs, groups, out, to, first),
            _ => pairs::<G, 3>(plan, xs, groups, out, to, first),
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
            let off = _mm512_castsi512_si256(offset::<G>(_mm512_set1_epi32(xs.sums8[k])));
            let isum = _mm256_sub_epi32(_mm256_add_epi32(even, odd), off);
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xs.scales[k]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
        }
        // SAFETY: the features.
        unsafe { store8(acc, out.from(g * GROUP_ROWS * to.col), to, first) };
    }
}

/// `P` pairs of rows (the last pair's second row a copy of its first where the rows are odd):
/// per group block and pair, 8 `vpdpbusd` in 512-bit lanes (module docs).
///
/// # Safety
/// As [`groups`]; `xs` holds `2·P − 1` or `2·P` rows.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pairs<G: VnniGroup, const P: usize>(
    plan: Prefetch,
    xs: QuantRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let (b, rows) = (xs.blocks, xs.rows());
    // Checked once here, not at every block: the loop reads pair `p`'s block `k` at
    // `p · b + k` through raw pointers (bounds checks there were a third of its instructions).
    let (pair_qs, pair_sums8, pair_scales) = (
        &xs.pair_qs[..P * b * 2 * QK8_0],
        &xs.pair_sums8[..P * b * 2],
        &xs.pair_scales[..P * b * 2],
    );
    let twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let widen = |v: __m256i| _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(v));
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = [_mm512_setzero_ps(); P];
        for (k, item) in group.iter().enumerate() {
            prefetch(plan, item);
            // SAFETY: the features.
            let w = unsafe { item.weights() }.map(widen);
            // SAFETY: the features.
            let dw = unsafe { scales8(item.scales()) };
            let dw = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(dw));
            for (p, acc_p) in acc.iter_mut().enumerate() {
                // `at` < P · b: `p` < P and `k` < b (a group holds b blocks).
                let at = p * b + k;
                // SAFETY: the pair's 64 bytes of block `k` lie in `pair_qs` (sliced above).
                let xp = unsafe { pair_qs.as_ptr().add(at * 2 * QK8_0) };
                let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for k4 in (0..8).step_by(2) {
                    // SAFETY: the pair's 64 bytes of block `k` are readable at `xp`.
                    let (x0, x1) = unsafe {
                        (
                            _mm512_set1_epi64(std::ptr::read_unaligned(xp.add(8 * k4).cast())),
                            _mm512_set1_epi64(std::ptr::read_unaligned(xp.add(8 * k4 + 8).cast())),
                        )
                    };
                    even = _mm512_dpbusd_epi32(even, w[k4], x0);
                    odd = _mm512_dpbusd_epi32(odd, w[k4 + 1], x1);
                }
                // SAFETY: the two rows' sums and scales of block `k`, side by side at `2·at`,
                // lie in the slices above; any 8 bytes are a valid i64.
                let (sums8, dx) = unsafe {
                    (
                        std::ptr::read_unaligned(pair_sums8.as_ptr().add(2 * at).cast::<i64>()),
                        std::ptr::read_unaligned(pair_scales.as_ptr().add(2 * at).cast::<i64>()),
                    )
                };
                let off = offset::<G>(_mm512_set1_epi64(sums8));
                let isum = _mm512_sub_epi32(_mm512_add_epi32(even, odd), off);
                let scale = _mm512_mul_ps(dw, _mm512_castsi512_ps(_mm512_set1_epi64(dx)));
                *acc_p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc_p);
            }
        }
        let at = out.from(g * GROUP_ROWS * to.col);
        for (p, a) in acc.into_iter().enumerate() {
            let mut lanes = [0f32; 2 * GROUP_ROWS];
            // SAFETY: the features; `lanes` holds 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), a) };
            for (half, row) in [2 * p, 2 * p + 1].into_iter().enumerate() {
                if row < rows {
                    for j in 0..GROUP_ROWS {
                        at.set(j * to.col + (first + row) * to.row, lanes[2 * j + half]);
                    }
                }
            }
        }
    }
}
