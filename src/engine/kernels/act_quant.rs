//! The one rule both quantized-activation formats (`q8_0::QuantizedRows`, 32 values a block;
//! `k_quants::KRows`, 256) round by: a block's scale `d = max|x| / 127`, its inverse, and each
//! value `round(x · (1/d))` (ties away from zero) as a saturating `i8`, NaN to 0.
//!
//! Why vectors: the rows are quantized once a product, on the calling thread before the
//! decode threads start, so at R rows a scalar `roundf` call a value is R × the product's
//! inner width of serial work inside every step (SPEED, arXiv 2310.12072, §3: the extra rows'
//! cost is what bounds the speedup). The AVX2 loop computes the same function exactly:
//! truncation, the exact fraction, and ±1 where it is at least a half.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::q8_0::Q8Isa;

/// The scale of a block of values quantized to 8 bits and its reciprocal: `d = max|x| / 127` in
/// f32, and `1 / d` (0 for an all-zero block), the rule of llama.cpp's `quantize_row_q8_0_ref`
/// that Q8_0 weights and both activation formats share.
pub(super) fn block_scale(x: &[f32]) -> (f32, f32) {
    scale_of(x.iter().fold(0f32, |m, v| m.max(v.abs())))
}

/// [`block_scale`] of a block whose largest magnitude (NaNs ignored) is `amax`.
fn scale_of(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

/// Blocks of 32 values quantized by the one rule, appended: each block's scale to `scales`, its
/// 32 values to `qs` and, on x86, 8 times their sum to `sums8` (`q8_rows::QuantizedRows`).
pub(super) struct Blocks32<'a> {
    pub(super) qs: &'a mut Vec<i8>,
    pub(super) scales: &'a mut Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    pub(super) sums8: &'a mut Vec<i32>,
}

impl Blocks32<'_> {
    /// Appends `x`'s blocks (`x.len()` a multiple of 32), with AVX2 where `isa`'s kernels run it:
    /// one pass a block for its scale, values and sum. Scalar maxima and a call a block were
    /// most of the serial work of a Q8_0 step's quantized rows (module docs).
    pub(super) fn push(&mut self, isa: Q8Isa, x: &[f32]) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: both ISAs are made only where AVX2, FMA and F16C were checked (`Q8Isa`).
            Q8Isa::Avx2 | Q8Isa::Avx512Vnni => unsafe { self.push_avx2(x) },
            _ => {
                for block in x.chunks_exact(32) {
                    let (d, id) = block_scale(block);
                    self.scales.push(d);
                    push_rounded(isa, block, id, self.qs);
                    #[cfg(target_arch = "x86_64")]
                    self.sums8.push(
                        8 * self.qs[self.qs.len() - 32..]
                            .iter()
                            .map(|&q| i32::from(q))
                            .sum::<i32>(),
                    );
                }
            }
        }
    }

    /// [`Self::push`] in AVX2: the largest magnitude by `vmaxps` (NaN lanes give way to the
    /// running maximum, as `f32::max` ignores NaN), then [`round32`] and the lanes' sum.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn push_avx2(&mut self, x: &[f32]) {
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        self.qs.reserve(x.len());
        let at = self.qs.len();
        let dst = self.qs.spare_capacity_mut().as_mut_ptr().cast::<i8>();
        for (c, run) in x.chunks_exact(32).enumerate() {
            // SAFETY: the feature; `run` holds 32 floats.
            let v: [__m256; 4] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(run.as_ptr().add(8 * i)) });
            let m = v.iter().fold(_mm256_setzero_ps(), |m, &v| {
                _mm256_max_ps(_mm256_and_ps(v, magnitude), m)
            });
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_movehdup_ps(m));
            let (d, id) = scale_of(_mm_cvtss_f32(m));
            self.scales.push(d);
            let (bytes, sum) = round32(v, id);
            self.sums8.push(8 * sum);
            // SAFETY: the feature; `reserve` made room for `x.len()` bytes from `at`.
            unsafe { _mm256_storeu_si256(dst.add(32 * c).cast(), bytes) };
        }
        // SAFETY: every byte from `at` to `at + x.len()` was written above.
        unsafe { self.qs.set_len(at + x.len()) };
    }
}

/// Appends `round(v · id) as i8` for every `v` of `x` to `out` (module docs), with AVX2 where
/// `isa`'s kernels run it and `x` is whole 32-value runs.
pub(super) fn push_rounded(isa: Q8Isa, x: &[f32], id: f32, out: &mut Vec<i8>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: both ISAs are made only where AVX2, FMA and F16C were checked (`Q8Isa`).
        Q8Isa::Avx2 | Q8Isa::Avx512Vnni if x.len().is_multiple_of(32) => unsafe {
            push_rounded_avx2(x, id, out)
        },
        _ => out.extend(x.iter().map(|v| (v * id).round() as i8)),
    }
}

/// [`push_rounded`]'s loop in AVX2, 32 values at a time.
///
/// # Safety
/// The CPU must have AVX2; `x.len()` is a multiple of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn push_rounded_avx2(x: &[f32], id: f32, out: &mut Vec<i8>) {
    out.reserve(x.len());
    let at = out.len();
    let dst = out.spare_capacity_mut().as_mut_ptr().cast::<i8>();
    for (c, run) in x.chunks_exact(32).enumerate() {
        // SAFETY: the feature; `run` holds 32 floats.
        let v = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(run.as_ptr().add(8 * i)) });
        let (bytes, _) = round32(v, id);
        // SAFETY: the feature; `reserve` made room for `x.len()` bytes from `at`.
        unsafe { _mm256_storeu_si256(dst.add(32 * c).cast(), bytes) };
    }
    // SAFETY: every byte from `at` to `at + x.len()` was written above.
    unsafe { out.set_len(at + x.len()) };
}

/// 32 values times `id`, each rounded by [`round_away`], as bytes in order, and their sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn round32(v: [__m256; 4], id: f32) -> (__m256i, i32) {
    let id = _mm256_set1_ps(id);
    let r = v.map(|v| round_away(_mm256_mul_ps(v, id)));
    let bytes = _mm256_packs_epi16(
        _mm256_packs_epi32(r[0], r[1]),
        _mm256_packs_epi32(r[2], r[3]),
    );
    // `vpackssdw`/`vpacksswb` interleave 128-bit lanes; this puts the 32 bytes back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let lanes = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    let lanes = _mm_add_epi32(
        _mm256_castsi256_si128(lanes),
        _mm256_extracti128_si256::<1>(lanes),
    );
    let lanes = _mm_add_epi32(lanes, _mm_unpackhi_epi64(lanes, lanes));
    let lanes = _mm_add_epi32(lanes, _mm_shuffle_epi32::<0b01>(lanes));
    (
        _mm256_permutevar8x32_epi32(bytes, order),
        _mm_cvtsi128_si32(lanes),
    )
}

/// `y.round()` (ties away from zero) clamped to −128..=127 as `i32`, NaN to 0: `f32::round`
/// then a saturating `as i8`, lane by lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn round_away(y: __m256) -> __m256i {
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // Exact: `y − trunc(y)` needs no rounding for any finite `y`.
    let frac = _mm256_and_ps(_mm256_sub_ps(y, t), magnitude);
    let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
    let unit = _mm256_or_ps(_mm256_set1_ps(1.0), _mm256_andnot_ps(magnitude, y));
    let r = _mm256_add_ps(t, _mm256_and_ps(up, unit));
    let r = _mm256_min_ps(
        _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
        _mm256_set1_ps(127.0),
    );
    let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
    _mm256_and_si256(_mm256_cvttps_epi32(r), ordered)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every ISA rounds every value as `f32::round` and `as i8` do: ties, both signs, the
    /// saturating ends, infinities and NaN.
    #[test]
    fn every_isa_rounds_as_the_scalar_rule() {
        let mut x: Vec<f32> = (-600..600).map(|i| i as f32 * 0.25).collect();
        x.extend([0.49999997, -0.49999997, 0.5, -0.5, 1.5, -2.5, 126.5, -127.5]);
        x.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e30,
            -1e30,
            0.0,
            -0.0,
        ]);
        x.resize(x.len().next_multiple_of(32), 0.75);
        let want: Vec<i8> = x.iter().map(|v| v.round() as i8).collect();
        for isa in super::super::tests::supported_isas() {
            let mut got = vec![7i8];
            push_rounded(Q8Isa::for_isa(isa), &x, 1.0, &mut got);
            assert_eq!(got[0], 7, "{isa:?}: the bytes before are kept");
            assert_eq!(&got[1..], &want[..], "{isa:?}");
        }
    }

    /// Every ISA's blocks of 32 take the scalar rule's scale, values and sums: blocks with NaN
    /// (ignored by the largest magnitude), an infinity, all zeros, negative zero and ties.
    #[test]
    fn every_isa_quantizes_blocks_as_the_scalar_rule() {
        let mut seed = 7u64;
        let mut x: Vec<f32> = (0..32 * 40)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
            })
            .collect();
        x[3] = f32::NAN;
        x[32 + 5] = f32::INFINITY;
        x[64..96].fill(0.0);
        x[96..128].fill(-0.0);
        x[128 + 31] = f32::NAN;
        x[160..192].fill(f32::NAN);
        x[192..224].copy_from_slice(&[127.0, -63.5, 0.5, -0.5, 1.5, -2.5].repeat(6)[..32]);
        let mut want = (Vec::new(), Vec::new(), Vec::new());
        for block in x.chunks_exact(32) {
            let (d, id) = block_scale(block);
            let qs: Vec<i8> = block.iter().map(|v| (v * id).round() as i8).collect();
            want.2
                .push(8 * qs.iter().map(|&q| i32::from(q)).sum::<i32>());
            want.0.extend(qs);
            want.1.push(d.to_bits());
        }
        for isa in super::super::tests::supported_isas() {
            let (mut qs, mut scales, mut sums8) = (vec![7i8], vec![1f32], vec![2i32]);
            let mut blocks = Blocks32 {
                qs: &mut qs,
                scales: &mut scales,
                #[cfg(target_arch = "x86_64")]
                sums8: &mut sums8,
            };
            blocks.push(Q8Isa::for_isa(isa), &x);
            assert_eq!(qs[1..], want.0[..], "{isa:?}");
            let bits: Vec<u32> = scales[1..].iter().map(|d| d.to_bits()).collect();
            assert_eq!(bits, want.1, "{isa:?}");
            #[cfg(target_arch = "x86_64")]
            assert_eq!(sums8[1..], want.2[..], "{isa:?}");
            let _ = &mut sums8;
        }
    }
}
