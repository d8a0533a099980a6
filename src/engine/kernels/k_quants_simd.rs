//! The K-quant kernels' vector loops: `k_quants`' one definition over 8 interleaved weight rows
//! at once. Called by `k_quants::product` for whole groups; Q6_K's here, each vector lane a
//! weight row, Q4_K's in `q4k_simd`.
//!
//! Q6_K's weights are unsigned integers (0..64) and the activations signed bytes, which is
//! exactly the operand order of AVX-512 VNNI's `vpdpbusd` and of AVX2's `vpmaddubsw` (whose
//! pairs cannot saturate: 2·63·127 < 2¹⁵), so no offsets are needed: a 4-byte slice of each
//! row times 4 broadcast activation bytes adds into each row's lane. The sub-block scales
//! multiply the lanes' exact sums (`vpmulld`), the −32 comes from the activations' 16-value
//! sums, and the float work is one FMA a super-block for 8 outputs. The x86 body is written
//! once (`q6k_kernel!`) for both ISAs, which differ only in how 4 products are summed.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::k_quants::GroupQ6K;
use super::k_quants::{KMatrix, KQuant, KRowsView, Q4K, Q6K, portable};
#[cfg(target_arch = "x86_64")]
use super::packed::GROUP_ROWS;
#[cfg(target_arch = "x86_64")]
use super::q4k_simd::{q4k_avx2, q4k_vnni};
use super::q8_0::Q8Isa;
#[cfg(target_arch = "x86_64")]
use super::q8_0::{broadcast4, prefetch, store8};
use super::{OutLayout, Prefetch, SharedOut};

/// Rows a kernel call takes at most: their sums stay in registers (AVX-512's 32 take 6).
pub(super) fn row_block(isa: Q8Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Q8Isa::Avx512Vnni => 6,
        _ => 4,
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

/// [`Groups`] for a type whose x86 kernels are `$avx2` and `$vnni`.
macro_rules! groups_impl {
    ($kind:ty, $avx2:ident, $vnni:ident) => {
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
                        with_rows!(xs.rows(), R => $avx2::<R>(plan, xs, groups, out, to, first))
                    },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Q8Isa::Avx512Vnni` is made only where AVX-512 (F, BW, VL) was
                    // checked and VNNI detected; as above otherwise.
                    Q8Isa::Avx512Vnni => unsafe {
                        with_rows!(xs.rows(), R => $vnni::<R>(plan, xs, groups, out, to, first))
                    },
                    _ => portable_groups::<$kind>(xs, groups, out, to, first),
                }
            }
        }
    };
}

groups_impl!(Q4K, q4k_avx2, q4k_vnni);
groups_impl!(Q6K, q6k_avx2, q6k_vnni);

/// `acc` plus the 4-product sums of `w`'s unsigned and `x`'s signed bytes in each 32-bit
/// lane, with `vpmaddubsw` and `vpmaddwd` (exact: module docs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn dot_avx2(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(w, x);
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// The same with one `vpdpbusd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512vnni,avx512vl")]
#[inline]
fn dot_vnni(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, w, x)
}

/// Q6_K's kernel `$name` with the 4-product sum `$dot`.
macro_rules! q6k_kernel {
    ($name:ident, $features:literal, $dot:ident) => {
        /// Q6_K's one definition for `R` rows over whole groups.
        ///
        /// # Safety
        /// The CPU must have the features enabled; `xs` holds `R` rows of `xs.blocks`
        /// super-blocks and `groups` whole groups of as many.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize>(
            plan: Prefetch,
            xs: KRowsView<'_>,
            groups: &[GroupQ6K],
            out: SharedOut<'_>,
            to: OutLayout,
            first: usize,
        ) {
            let (b, nib, high) = (xs.blocks, _mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
            for (g, group) in groups.chunks_exact(b).enumerate() {
                let mut acc = [_mm256_setzero_ps(); R];
                for (k, item) in group.iter().enumerate() {
                    prefetch(plan, item);
                    let mut isum = [_mm256_setzero_si256(); R];
                    let mut bias = [_mm256_setzero_si256(); R];
                    let mut low_scale = _mm256_setzero_si256();
                    for s in 0..16 {
                        let q = item.qs[s].as_ptr();
                        // SAFETY: the features; the sub-block's 8 scales and 96 bytes.
                        let (sc, a, c, h) = unsafe {
                            (
                                _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                    item.scales[s].as_ptr().cast(),
                                )),
                                _mm256_loadu_si256(q.cast()),
                                _mm256_loadu_si256(q.add(32).cast()),
                                _mm256_loadu_si256(q.add(64).cast()),
                            )
                        };
                        let v = [
                            _mm256_or_si256(
                                _mm256_and_si256(a, nib),
                                _mm256_and_si256(_mm256_slli_epi16::<4>(h), high),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(a), nib),
                                _mm256_and_si256(_mm256_slli_epi16::<2>(h), high),
                            ),
                            _mm256_or_si256(_mm256_and_si256(c, nib), _mm256_and_si256(h, high)),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(c), nib),
                                _mm256_and_si256(_mm256_srli_epi16::<2>(h), high),
                            ),
                        ];
                        // Sub-blocks s − 1 and s's scales as each lane's 16-bit pair.
                        let scale_pair = match s % 2 {
                            0 => _mm256_setzero_si256(),
                            _ => _mm256_or_si256(low_scale, _mm256_slli_epi32::<16>(sc)),
                        };
                        low_scale = _mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF));
                        for (r, isum_r) in isum.iter_mut().enumerate() {
                            let x = xs.block(r, k);
                            let (bsum, xp) = (x.sum16, x.x[16 * s..16 * s + 16].as_ptr());
                            // SAFETY: the features; `xp` holds 16 bytes.
                            let part = unsafe {
                                let p0 = $dot(_mm256_setzero_si256(), v[0], broadcast4(xp));
                                let p0 = $dot(p0, v[1], broadcast4(xp.add(4)));
                                let p1 = $dot(_mm256_setzero_si256(), v[2], broadcast4(xp.add(8)));
                                let p1 = $dot(p1, v[3], broadcast4(xp.add(12)));
                                _mm256_add_epi32(p0, p1)
                            };
                            *isum_r = _mm256_add_epi32(*isum_r, _mm256_mullo_epi32(part, sc));
                            if s % 2 == 1 {
                                // SAFETY: the features; `bsum` holds sub-blocks s − 1 and s.
                                let sums = unsafe { broadcast4(bsum[s - 1..s + 1].as_ptr()) };
                                let pairs = _mm256_madd_epi16(scale_pair, sums);
                                bias[r] = _mm256_add_epi32(bias[r], pairs);
                            }
                        }
                    }
                    // isum − 32 · Σₛ sc[s] · bsum[s]: the definition's, exact.
                    for (isum_r, bias_r) in isum.iter_mut().zip(bias) {
                        *isum_r = _mm256_sub_epi32(*isum_r, _mm256_slli_epi32::<5>(bias_r));
                    }
                    // SAFETY: the features; `d` is 16 bytes.
                    let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(item.d.as_ptr().cast())) };
                    for (r, a) in acc.iter_mut().enumerate() {
                        let up = _mm256_mul_ps(d, _mm256_set1_ps(xs.block(r, k).dx));
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), up, *a);
                    }
                }
                let at = out.from(g * GROUP_ROWS * to.col);
                for (r, a) in acc.into_iter().enumerate() {
                    // SAFETY: the features.
                    unsafe { store8(a, at, to, first + r) };
                }
            }
        }
    };
}

q6k_kernel!(q6k_avx2, "avx2,fma,f16c", dot_avx2);
q6k_kernel!(
    q6k_vnni,
    "avx512f,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_vnni
);
