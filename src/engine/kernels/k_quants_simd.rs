//! The K-quant kernels' vector loops: `k_quants`' one definition over 8 interleaved weight rows
//! at once. Called by `k_quants::product` for whole groups; Q6_K's here, each vector lane a
//! weight row, Q4_K's and Q5_K's in `q4k_simd`.
//!
//! Q6_K's layout is Q4_K's (`q4k_simd`): 8 weights of each row in every 64 bytes, a 4-byte
//! lane per row and half, against 8 activation bytes broadcast to every lane pair. Its
//! unsigned 6-bit weights and the signed activation bytes are the byte products' operands:
//! - **AVX2**: `vpmaddubsw`'s pairs cannot saturate (2 · 63 · 127 < 2¹⁵): two of them add to
//!   a 16-bit lane (≤ 32004) holding 4 products of a 16-weight sub-block, and one `vpmaddwd`
//!   against the lane's scale pair scales and sums them, so no `vpmulld` is needed. The −32
//!   comes from the activations' 16-value sums, once a super-block and row.
//! - **VNNI**: a lane's 8 products start from the activations' offset for that lane, so it
//!   holds `Σ (q − 32)·x` and packs to 16 bits; a `vpdpwssd` then scales two sub-blocks
//!   ([`q6k_vnni`]).
//!
//! The float work is one FMA a super-block for 8 outputs. Every sum is the one definition's
//! exact integer.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::k_quants::{GroupQ6K, KBlock};
use super::k_quants::{KMatrix, KQuant, KRowsView, Q4K, Q6K, portable};
#[cfg(target_arch = "x86_64")]
use super::packed::GROUP_ROWS;
#[cfg(target_arch = "x86_64")]
use super::q4k_simd::{broadcast8, broadcast8_512, q4k_avx2, q4k_vnni, rows_in_order};
use super::q5k::Q5K;
use super::q8_0::Q8Isa;
#[cfg(target_arch = "x86_64")]
use super::q8_0::{prefetch, store8};
use super::{OutLayout, Prefetch, SharedOut};

/// Rows a kernel call takes at most: their sums stay in registers (AVX-512's 32 take 6).
pub(super) fn row_block(isa: Q8Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Q8Isa::Avx512Vnni => 6,
        _ => 4,
    }
}

/// Whether `isa`'s Q6_K kernel reads the activations' lane offsets (`k_quants::q6k_offsets`):
/// only AVX-512 VNNI's does, so only its rows pay for them.
pub(super) fn reads_q6k_offsets(isa: Q8Isa) -> bool {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Q8Isa::Avx512Vnni => true,
        _ => false,
    }
}

/// A K-quant type's group kernels.
pub(super) trait Groups: KQuant {
    /// One block of rows `xs` (at most [`row_block`]) times every group of `groups`, into
    /// `out` as `k_quants::product` lays it, row `first` of the product being `xs`' first.
    fn groups(
        isa: Q8Isa,
        plan: Prefetch,
        xs: KRowsView<'_>,
        groups: &[Self::Group],
        out: SharedOut<'_>,
        to: OutLayout,
        first: usize,
    );
}

/// The portable loops over whole groups.
fn portable_groups<K: KQuant>(
    xs: KRowsView<'_>,
    groups: &[K::Group],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let w = KMatrix::<K> {
        groups,
        tail: &[],
        blocks: xs.blocks,
    };
    portable(xs, w, out, to, first);
}

/// [`Groups`] for a type whose kernels are `$avx2`, `$vnni` and `$neon` (`$group`: a
/// kernel's group type parameter, where it has one).
macro_rules! groups_impl {
    ($kind:ty, $avx2:ident, $vnni:ident, $neon:ident $(, $group:ty)?) => {
        impl Groups for $kind {
            fn groups(
                isa: Q8Isa,
                plan: Prefetch,
                xs: KRowsView<'_>,
                groups: &[Self::Group],
                out: SharedOut<'_>,
                to: OutLayout,
                first: usize,
            ) {
                let _ = plan;
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Q8Isa::Avx2` is made only where AVX2, FMA and F16C were checked
                    // (`Kernels::new`); `xs` holds whole rows of `xs.blocks` super-blocks and
                    // `groups` whole groups of as many.
                    Q8Isa::Avx2 => unsafe {
                        with_rows!(xs.rows(), R => $avx2::<R $(, $group)?>(plan, xs, groups, out, to, first))
                    },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Q8Isa::Avx512Vnni` is made only where AVX-512 (F, BW, VL) was
                    // checked and VNNI detected; as above otherwise.
                    Q8Isa::Avx512Vnni => unsafe {
                        with_rows!(xs.rows(), R => $vnni::<R $(, $group)?>(plan, xs, groups, out, to, first))
                    },
                    #[cfg(target_arch = "aarch64")]
                    // SAFETY: `Q8Isa::NeonDot` is made only where the dot-product extension
                    // was detected; as above otherwise.
                    Q8Isa::NeonDot => unsafe {
                        super::k_quants_neon::$neon(xs, groups, out, to, first)
                    },
                    _ => portable_groups::<$kind>(xs, groups, out, to, first),
                }
            }
        }
    };
}

groups_impl!(Q4K, q4k_avx2, q4k_vnni, q4k_sdot, _);
groups_impl!(Q5K, q4k_avx2, q4k_vnni, q4k_sdot, _);
groups_impl!(Q6K, q6k_avx2, q6k_vnni, q6k_sdot);

/// The weights of sub-blocks `2p` and `2p + 1`, 32 bytes from `at` in each 64-byte run (rows
/// `at / 8` on): `[s][0]` weights 0..8 and `[s][1]` weights 8..16 of each row, a lane a half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn q6k_weights_avx2(item: &GroupQ6K, p: usize, at: usize) -> [[__m256i; 2]; 2] {
    let (nib, top) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    // SAFETY: the feature; each run holds 64 bytes.
    let (h, l0, l1) = unsafe {
        (
            _mm256_loadu_si256(item.high(p).as_ptr().add(at).cast()),
            _mm256_loadu_si256(item.low(2 * p).as_ptr().add(at).cast()),
            _mm256_loadu_si256(item.low(2 * p + 1).as_ptr().add(at).cast()),
        )
    };
    let join = |low: __m256i, high: __m256i| {
        _mm256_or_si256(_mm256_and_si256(low, nib), _mm256_and_si256(high, top))
    };
    [
        [
            join(l0, _mm256_slli_epi16::<4>(h)),
            join(_mm256_srli_epi16::<4>(l0), _mm256_slli_epi16::<2>(h)),
        ],
        [
            join(l1, h),
            join(_mm256_srli_epi16::<4>(l1), _mm256_srli_epi16::<2>(h)),
        ],
    ]
}

/// Each row's scales of sub-blocks `2t` and `2t + 1` as a 16-bit pair in its lane (rows in
/// order): against the pair of 16-value sums, row j's part of `Σₛ sc[s]·sum16[s]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn q6k_scale_pairs_avx2(item: &GroupQ6K, t: usize) -> __m256i {
    // SAFETY: the feature; each sub-block has 8 scales.
    let (a, b) = unsafe {
        (
            _mm_loadl_epi64(item.scales[2 * t].as_ptr().cast()),
            _mm_loadl_epi64(item.scales[2 * t + 1].as_ptr().cast()),
        )
    };
    // Bytes a₀ b₀ a₁ b₁ …, widened: lane j holds (a_j, b_j).
    _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b))
}

/// Sub-block `s`'s scales of rows `4q..4q + 4` as the lanes take them: lane `k` (row
/// `4q + k / 2`) holds its row's scale in both 16-bit halves. The 4 bytes are spread before
/// they are widened, so that one in-lane byte shuffle places them: it runs for every
/// sub-block and half, shared by the rows but a fair share of a 1-row step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn q6k_lane_scales_avx2(item: &GroupQ6K, s: usize, q: usize) -> __m256i {
    let four = &item.scales[s][4 * q..4 * q + 4];
    let word = i32::from_le_bytes([four[0], four[1], four[2], four[3]].map(|b| b as u8));
    let spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_cvtsi32_si128(word), spread))
}

/// Q6_K's one definition for `R` rows over whole groups, with AVX2 (module docs).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `xs` holds `R` rows of `xs.blocks` super-blocks and
/// `groups` whole groups of as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_avx2<const R: usize>(
    plan: Prefetch,
    xs: KRowsView<'_>,
    groups: &[GroupQ6K],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, item) in group.iter().enumerate() {
            prefetch(plan, item);
            let x: [KBlock<'_>; R] = xs.blocks(k);
            let mut isum = [[_mm256_setzero_si256(); 2]; R];
            for q in 0..2 {
                for p in 0..8 {
                    let w = q6k_weights_avx2(item, p, 32 * q);
                    for (odd, w) in w.iter().enumerate() {
                        let s = 2 * p + odd;
                        let sc = q6k_lane_scales_avx2(item, s, q);
                        for (x, isum) in x.iter().zip(isum.iter_mut()) {
                            // SAFETY: the features; `x.x` holds a super-block's 256 values
                            // (`KRowsView::blocks`) and s < 16: sub-block s is 16 bytes from 16s.
                            let (lo, hi) = unsafe {
                                let xp = x.x.as_ptr().add(16 * s);
                                (broadcast8(xp), broadcast8(xp.add(8)))
                            };
                            let sum = _mm256_add_epi16(
                                _mm256_maddubs_epi16(w[0], lo),
                                _mm256_maddubs_epi16(w[1], hi),
                            );
                            isum[q] = _mm256_add_epi32(isum[q], _mm256_madd_epi16(sum, sc));
                        }
                    }
                }
            }
            let mut bias = [_mm256_setzero_si256(); R];
            for t in 0..8 {
                let pairs = q6k_scale_pairs_avx2(item, t);
                for (x, bias) in x.iter().zip(bias.iter_mut()) {
                    // SAFETY: the features; `x.sum16` holds a super-block's 16 sums and t < 8:
                    // sums 2t and 2t + 1 are 4 bytes.
                    let sums = unsafe {
                        let sums = x.sum16.as_ptr().add(2 * t);
                        _mm256_set1_epi32(std::ptr::read_unaligned(sums.cast()))
                    };
                    *bias = _mm256_add_epi32(*bias, _mm256_madd_epi16(pairs, sums));
                }
            }
            // SAFETY: the features; `d` is 16 bytes.
            let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(item.d.as_ptr().cast())) };
            for r in 0..R {
                // Each row's two lanes summed, rows in order, less 32 · Σₛ sc[s]·sum16[s].
                let rows =
                    _mm256_sub_epi32(rows_in_order(isum[r]), _mm256_slli_epi32::<5>(bias[r]));
                let up = _mm256_mul_ps(d, _mm256_set1_ps(x[r].dx));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), up, acc[r]);
            }
        }
        let at = out.from(g * GROUP_ROWS * to.col);
        for (r, a) in acc.into_iter().enumerate() {
            // SAFETY: the features.
            unsafe { store8(a, at, to, first + r) };
        }
    }
}

/// The weights of sub-blocks `2p` and `2p + 1` in 64-byte registers, as
/// [`q6k_weights_avx2`] for all 8 rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn q6k_weights_512(item: &GroupQ6K, p: usize) -> [[__m512i; 2]; 2] {
    let (nib, top) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    // SAFETY: the features; each run holds 64 bytes.
    let (h, l0, l1) = unsafe {
        (
            _mm512_loadu_si512(item.high(p).as_ptr().cast()),
            _mm512_loadu_si512(item.low(2 * p).as_ptr().cast()),
            _mm512_loadu_si512(item.low(2 * p + 1).as_ptr().cast()),
        )
    };
    // (low & 0x0F) | (high & 0x30) in one `vpternlogd` (0xEC: A & C | B) once high is masked.
    let join = |low: __m512i, high: __m512i| {
        _mm512_ternarylogic_epi32::<0xEC>(low, _mm512_and_si512(high, top), nib)
    };
    [
        [
            join(l0, _mm512_slli_epi16::<4>(h)),
            join(_mm512_srli_epi16::<4>(l0), _mm512_slli_epi16::<2>(h)),
        ],
        [
            join(l1, h),
            join(_mm512_srli_epi16::<4>(l1), _mm512_srli_epi16::<2>(h)),
        ],
    ]
}

/// `vpermw` indices picking, from 4 sub-blocks' widened scales (word `8v + j`: sub-block
/// `4u + v`, row `j`), the scale pairs for the packed sums of sub-blocks `4u + 2·pair` and
/// `4u + 2·pair + 1`: word `k` (128-bit run `c = k / 8`, its word `w = k % 8`) is row
/// `2c + w / 2 % 2`'s scale of the pair's sub-block `w / 4`, as `vpackssdw` lays the two
/// sub-blocks' lanes (row `2c`'s halves, row `2c + 1`'s; first sub-block, then the second).
#[cfg(target_arch = "x86_64")]
const fn q6k_pair_words(pair: usize) -> [i16; 32] {
    let mut words = [0; 32];
    let mut k = 0;
    while k < 32 {
        let (c, w) = (k / 8, k % 8);
        words[k] = (8 * (2 * pair + w / 4) + 2 * c + w / 2 % 2) as i16;
        k += 1;
    }
    words
}

#[cfg(target_arch = "x86_64")]
static Q6K_PAIR_WORDS: [[i16; 32]; 2] = [q6k_pair_words(0), q6k_pair_words(1)];

/// Q6_K's one definition for `R` rows over whole groups, with AVX-512 VNNI. Each lane's 8
/// products `q·x` (`vpdpbusd`, unsigned weights) start from the activations' lane offset
/// (`k_quants::q6k_offsets`), so the lane holds `Σ (q − 32)·x`, under 2¹⁵ in magnitude:
/// `vpackssdw` packs two sub-blocks' lanes to 16 bits exactly, and one `vpdpwssd` against
/// their scale pairs scales both and adds each row's halves. A pair of sub-blocks takes 5
/// multiplies a row of activations (4 `vpdpbusd`, one `vpdpwssd`), and the −32 none.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, AVX2, FMA and F16C; `xs` holds `R` rows of
/// `xs.blocks` super-blocks and `groups` whole groups of as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_vnni<const R: usize>(
    plan: Prefetch,
    xs: KRowsView<'_>,
    groups: &[GroupQ6K],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    // SAFETY: the features; each table is 64 bytes.
    let pair_words = unsafe { Q6K_PAIR_WORDS.map(|w| _mm512_loadu_si512(w.as_ptr().cast())) };
    let row_lanes = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13);
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, item) in group.iter().enumerate() {
            prefetch(plan, item);
            let x: [KBlock<'_>; R] = xs.blocks(k);
            let offsets6: [&[i32]; R] = xs.offsets6(k);
            let mut isum = [_mm512_setzero_si512(); R];
            for u in 0..4 {
                // SAFETY: the features; sub-blocks 4u..4u + 4 hold 32 scales.
                let sc16 = unsafe {
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256(item.scales[4 * u].as_ptr().cast()))
                };
                for (pair, &words) in pair_words.iter().enumerate() {
                    let p = 2 * u + pair;
                    let w = q6k_weights_512(item, p);
                    let sc = _mm512_permutexvar_epi16(words, sc16);
                    let rows = x.iter().zip(&offsets6).zip(isum.iter_mut());
                    for ((x, offsets6), isum) in rows {
                        let lanes = |odd: usize| {
                            let s = 2 * p + odd;
                            // SAFETY: the features; `x.x` holds a super-block's 256 values
                            // (`KRowsView::blocks`) and `offsets6` its 32 offsets
                            // (`KRowsView::offsets6`), and s < 16: sub-block s is 16 bytes from
                            // 16s, its offsets 2 from 2s.
                            let (start, lo, hi) = unsafe {
                                let xp = x.x.as_ptr().add(16 * s);
                                (
                                    broadcast8_512(offsets6.as_ptr().add(2 * s).cast()),
                                    broadcast8_512(xp),
                                    broadcast8_512(xp.add(8)),
                                )
                            };
                            let part = _mm512_dpbusd_epi32(start, w[odd][0], lo);
                            _mm512_dpbusd_epi32(part, w[odd][1], hi)
                        };
                        let packed = _mm512_packs_epi32(lanes(0), lanes(1));
                        *isum = _mm512_dpwssd_epi32(*isum, packed, sc);
                    }
                }
            }
            // SAFETY: the features; `d` is 16 bytes.
            let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(item.d.as_ptr().cast())) };
            for r in 0..R {
                // Lanes (row 2c, row 2c + 1) × (even, odd sub-blocks) of each 128-bit run:
                // each row's two added, then the rows in order.
                let v = _mm512_add_epi32(isum[r], _mm512_shuffle_epi32::<0x4E>(isum[r]));
                let rows = _mm512_castsi512_si256(_mm512_permutexvar_epi32(row_lanes, v));
                let up = _mm256_mul_ps(d, _mm256_set1_ps(x[r].dx));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), up, acc[r]);
            }
        }
        let at = out.from(g * GROUP_ROWS * to.col);
        for (r, a) in acc.into_iter().enumerate() {
            // SAFETY: the features.
            unsafe { store8(a, at, to, first + r) };
        }
    }
}
