//! Q8_0 weights (GGUF's `block_q8_0`: 32 signed bytes and one f16 scale a block, 8.5 bits a
//! weight) multiplied as stored, with integer dot products. Called by the matmul dispatch
//! (`super::product_columns`, `Kernels::matmul_t`) for [`Weight::Q8_0`](super::Weight) matrices,
//! which a quantized checkpoint's loader hands the host backend.
//!
//! Why integers: at real size a bf16 step already streams its weights at the memory's pace, so
//! the next gain is fewer bytes; but on a stream half as thick, an f32 product over widened
//! weights no longer hides the extra rows of a speculative step under the weight reads (SPEED,
//! arXiv 2310.12072, §3: a step of R rows must cost about one row's weight reads). So, as
//! llama.cpp does, each activation row is quantized per block of 32 to 8 bits
//! ([`QuantizedRows`]), and a block's 32 products are integer multiply-adds: AVX2's
//! `vpmaddubsw` + `vpmaddwd`, AVX-512 VNNI's `vpdpbusd`, 4 to 8 times the multiply-adds of an
//! f32 FMA.
//!
//! # One result on every ISA
//!
//! The product of activation row `r` and weight row `j` is defined as: for each of 8 lanes
//! `l`, `acc[l] = fma(isum(b, l), dw(b) · dx(b), acc[l])` over the blocks `b` in order, from 0,
//! where `isum(b, l)` is the exact integer sum of the 4 products at `32b + 4l .. 32b + 4l + 4`
//! and `dw`, `dx` are the weight's and the activation's block scales; then the lanes' sum in
//! `portable::hsum8`'s tree. The integer part is exact on any ISA and the float part is the
//! same sequence of roundings, so the portable loops, AVX2 and AVX-512 VNNI agree bit for bit
//! (the tests hold them to it), and a row's result depends on nothing but its own inputs: not
//! on the other rows of its step, nor on how the threads split the weight rows. Speculative
//! output on quantized weights therefore equals the baseline's, token for token.

use half::f16;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{OutLayout, Rows, SharedOut};

/// Weights a Q8_0 block holds.
pub const QK8_0: usize = 32;

/// GGUF's `block_q8_0`: `qs[i] · d` is weight `i` of the block.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ8_0 {
    /// The block's scale.
    pub d: f16,
    /// The quantized weights.
    pub qs: [i8; QK8_0],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

// SAFETY: `repr(C)` of an f16 (2 bytes, align 2) and 32 i8 at offset 2: 34 bytes, no padding,
// and every bit pattern is a valid f16 and i8.
unsafe impl bytemuck::Zeroable for BlockQ8_0 {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for BlockQ8_0 {}

impl BlockQ8_0 {
    /// The block nearest `x` (32 floats), as llama.cpp's `quantize_row_q8_0_ref` makes it:
    /// `d = max|x| / 127` in f32, stored in f16, and each weight `round(x / d)` (half away
    /// from zero) with the unrounded f32 reciprocal.
    pub fn quantize(x: &[f32]) -> Self {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; QK8_0];
        for (q, v) in qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        Self {
            d: f16::from_f32(d),
            qs,
        }
    }

    /// Its 32 weights in f32 (exact: an f16 times a byte has at most 19 significant bits).
    pub fn dequantize_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, q) in out.iter_mut().zip(self.qs) {
            *o = f32::from(q) * d;
        }
    }
}

/// Activation rows quantized per block of 32 for the integer products: `qs` (`rows × inner`
/// bytes) and one f32 scale per block (`scales`, `rows × inner / 32`). The scale stays f32
/// (llama.cpp rounds it to f16): it is one float a block, and an f16 would add a rounding.
#[derive(Debug, Default)]
pub struct QuantizedRows {
    qs: Vec<i8>,
    scales: Vec<f32>,
    blocks: usize,
}

impl QuantizedRows {
    /// Quantizes `input`'s rows, reusing this value's buffers: per block `d = max|x| / 127`
    /// and `round(x / d)`, so every value lies in −127..=127.
    pub fn quantize(&mut self, input: &Rows<'_>) {
        debug_assert_eq!(input.inner % QK8_0, 0);
        self.blocks = input.inner / QK8_0;
        self.qs.clear();
        self.scales.clear();
        let used = input.rows * input.inner;
        for block in input.x[..used].chunks_exact(QK8_0) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            self.scales.push(d);
            self.qs.extend(block.iter().map(|v| (v * id).round() as i8));
        }
    }

    /// Rows `range` of it.
    fn rows(&self, range: std::ops::Range<usize>) -> QuantRowsView<'_> {
        let b = self.blocks;
        QuantRowsView {
            qs: &self.qs[range.start * b * QK8_0..range.end * b * QK8_0],
            scales: &self.scales[range.start * b..range.end * b],
            blocks: b,
        }
    }

    /// Its rows.
    fn len(&self) -> usize {
        self.scales.len() / self.blocks.max(1)
    }
}

/// Some rows of a [`QuantizedRows`].
#[derive(Debug, Clone, Copy)]
struct QuantRowsView<'a> {
    qs: &'a [i8],
    scales: &'a [f32],
    blocks: usize,
}

/// Weight-row runs of about this many bytes are multiplied by every block of rows before the
/// next run, so a run read once from memory serves the later blocks from L1 and L2.
const RUN_BYTES: usize = 16 << 10;
/// Rows a kernel call takes at most: their 2 weight rows' accumulators stay in registers.
const ROW_BLOCK: usize = 4;
/// Weight rows a kernel takes at a time.
const J: usize = 2;

/// Which kernel runs: chosen once per product from the model's instruction set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Q8Isa {
    /// Plain loops with `f32::mul_add`.
    Portable,
    /// AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 VNNI on 256-bit registers (with AVX-512VL), AVX2 + FMA + F16C besides.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Q8Isa {
    /// The kernel for `isa` on this CPU (VNNI where detected beside AVX-512).
    pub(super) fn for_isa(isa: super::Isa) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if isa.has_avx512()
                && std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Self::Avx512Vnni;
            }
            if isa.has_avx2() {
                return Self::Avx2;
            }
        }
        let _ = isa;
        Self::Portable
    }
}

/// `out[j·to.col + r·to.row]` = activation row `r` of `x` · weight row `j` of `w` (rows of
/// `x.blocks` blocks), for every row and weight row: in runs of weight rows, each run times
/// every block of up to [`ROW_BLOCK`] rows.
pub(super) fn product(
    isa: Q8Isa,
    x: &QuantizedRows,
    w: &[BlockQ8_0],
    out: SharedOut<'_>,
    to: OutLayout,
) {
    let blocks = x.blocks;
    let rows = x.len();
    let row_bytes = blocks * std::mem::size_of::<BlockQ8_0>();
    let run_rows = (RUN_BYTES / row_bytes.max(1)).max(1).next_multiple_of(J);
    let outs = w.len() / blocks.max(1);
    for start in (0..outs).step_by(run_rows) {
        let end = (start + run_rows).min(outs);
        let run_w = &w[start * blocks..end * blocks];
        let run_out = out.from(start * to.col);
        for first in (0..rows).step_by(ROW_BLOCK) {
            let xs = x.rows(first..(first + ROW_BLOCK).min(rows));
            dots(isa, xs, run_w, run_out, to, first);
        }
    }
}

/// One block of rows times every weight row of `w`: whole groups of [`J`], then the rest one
/// at a time.
fn dots(
    isa: Q8Isa,
    xs: QuantRowsView<'_>,
    w: &[BlockQ8_0],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let group = J * xs.blocks;
    let grouped = w.len() / group * group;
    let rest_out = out.from(grouped / xs.blocks * to.col);
    let rest = &w[grouped..];
    let rows = xs.scales.len() / xs.blocks;
    match isa {
        Q8Isa::Portable => {
            portable_dots::<J>(xs, &w[..grouped], out, to, first);
            portable_dots::<1>(xs, rest, rest_out, to, first);
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Q8Isa::Avx2` is made only where the model's instruction set has AVX2, FMA
        // and F16C (`Kernels::new` checked the CPU); `xs` holds `rows` rows of whole blocks.
        Q8Isa::Avx2 => unsafe {
            with_rows!(rows, R => {
                avx2_dots::<R, J>(xs, &w[..grouped], out, to, first);
                avx2_dots::<R, 1>(xs, rest, rest_out, to, first);
            })
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Q8Isa::Avx512Vnni` is made only where AVX-512 (F, BW, VL) was checked and
        // VNNI detected; as above otherwise.
        Q8Isa::Avx512Vnni => unsafe {
            with_rows!(rows, R => {
                vnni_dots::<R, J>(xs, &w[..grouped], out, to, first);
                vnni_dots::<R, 1>(xs, rest, rest_out, to, first);
            })
        },
    }
}

/// The portable loops of the one definition (module docs): 8 lanes of 4-product integer sums,
/// each fused into its lane, the lanes summed in `hsum8`'s tree.
fn portable_dots<const G: usize>(
    xs: QuantRowsView<'_>,
    w: &[BlockQ8_0],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    let rows = xs.scales.len() / b.max(1);
    for (j, w_row) in w.chunks_exact(b.max(1)).enumerate() {
        for r in 0..rows {
            let x_qs = &xs.qs[r * b * QK8_0..(r + 1) * b * QK8_0];
            let x_d = &xs.scales[r * b..(r + 1) * b];
            let mut acc = [0f32; 8];
            for ((wb, xq), dx) in w_row.iter().zip(x_qs.chunks_exact(QK8_0)).zip(x_d) {
                let scale = wb.d.to_f32() * dx;
                for (l, a) in acc.iter_mut().enumerate() {
                    let isum: i32 = (0..4)
                        .map(|k| i32::from(wb.qs[4 * l + k]) * i32::from(xq[4 * l + k]))
                        .sum();
                    *a = (isum as f32).mul_add(scale, *a);
                }
            }
            out.set(
                j * to.col + (first + r) * to.row,
                super::portable::hsum8(&acc),
            );
        }
    }
}

/// A weight block's scale, widened and broadcast.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scale8(d: f16) -> __m256 {
    // SAFETY: the caller's features.
    unsafe {
        let wide = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d.to_bits())));
        _mm256_broadcastss_ps(wide)
    }
}

/// Stores the lane sums of `acc` (R rows × G weight rows) where `to` says, in `hsum8`'s tree.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store<const R: usize, const G: usize>(
    acc: &[[__m256; G]; R],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let mut four = [0f32; 4];
    #[allow(clippy::needless_range_loop)] // `j` picks a column of every row's accumulators.
    for r0 in (0..R).step_by(4) {
        for j in 0..G {
            let a = |r: usize| acc[(r0 + r).min(R - 1)][j];
            // SAFETY: the caller's features; `four` holds exactly 4 floats.
            unsafe {
                let sums = super::avx2::reduce4(a(0), a(1), a(2), a(3));
                _mm_storeu_ps(four.as_mut_ptr(), sums);
            }
            for (r, &sum) in four.iter().enumerate().take(R - r0) {
                out.set(j * to.col + (first + r0 + r) * to.row, sum);
            }
        }
    }
}

/// AVX2's products of the one definition: `|w| · sign(x, w)` with `vpmaddubsw` (no pair
/// overflows: 128 · 127 · 2 < 2¹⁵), then `vpmaddwd` by ones into the 8 lanes' 4-product sums.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `xs` holds `R` rows of `xs.blocks` blocks and `w`
/// whole rows of them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_dots<const R: usize, const G: usize>(
    xs: QuantRowsView<'_>,
    w: &[BlockQ8_0],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    let ones = _mm256_set1_epi16(1);
    for (g, group) in w.chunks_exact(G * b).enumerate() {
        let mut acc = [[_mm256_setzero_ps(); G]; R];
        for k in 0..b {
            let mut wq = [_mm256_setzero_si256(); G];
            let mut aw = [_mm256_setzero_si256(); G];
            let mut dw = [_mm256_setzero_ps(); G];
            for j in 0..G {
                let block = &group[j * b + k];
                // SAFETY: the features; a block's 32 bytes are readable.
                unsafe {
                    wq[j] = _mm256_loadu_si256(block.qs.as_ptr().cast());
                    dw[j] = scale8(block.d);
                }
                aw[j] = _mm256_sign_epi8(wq[j], wq[j]);
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: row `r` of `xs` holds block `k`'s 32 bytes.
                let xq = unsafe { _mm256_loadu_si256(xs.qs.as_ptr().add((r * b + k) * 32).cast()) };
                let dx = _mm256_set1_ps(xs.scales[r * b + k]);
                for j in 0..G {
                    let pairs = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xq, wq[j]));
                    let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                    acc_r[j] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw[j], dx), acc_r[j]);
                }
            }
        }
        // SAFETY: the features.
        unsafe { store::<R, G>(&acc, out.from(g * G * to.col), to, first) };
    }
}

/// AVX-512 VNNI's products of the one definition: `vpdpbusd` of the activations offset by 128
/// (unsigned) and the weights, less 128 · Σw (the weights' own `vpdpbusd` with ones, once a
/// block for every row): the same 8 lanes' 4-product sums as AVX2's.
///
/// # Safety
/// The CPU must have AVX-512F, VL and VNNI, AVX2, FMA and F16C; as [`avx2_dots`] otherwise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn vnni_dots<const R: usize, const G: usize>(
    xs: QuantRowsView<'_>,
    w: &[BlockQ8_0],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    let (ones, flip) = (_mm256_set1_epi8(1), _mm256_set1_epi8(i8::MIN));
    for (g, group) in w.chunks_exact(G * b).enumerate() {
        let mut acc = [[_mm256_setzero_ps(); G]; R];
        for k in 0..b {
            let mut wq = [_mm256_setzero_si256(); G];
            let mut offset = [_mm256_setzero_si256(); G];
            let mut dw = [_mm256_setzero_ps(); G];
            for j in 0..G {
                let block = &group[j * b + k];
                // SAFETY: the features; a block's 32 bytes are readable.
                unsafe {
                    wq[j] = _mm256_loadu_si256(block.qs.as_ptr().cast());
                    dw[j] = scale8(block.d);
                }
                let sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, wq[j]);
                offset[j] = _mm256_slli_epi32::<7>(sum);
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: row `r` of `xs` holds block `k`'s 32 bytes.
                let xq = unsafe { _mm256_loadu_si256(xs.qs.as_ptr().add((r * b + k) * 32).cast()) };
                let xu = _mm256_xor_si256(xq, flip);
                let dx = _mm256_set1_ps(xs.scales[r * b + k]);
                for j in 0..G {
                    let raw = _mm256_dpbusd_epi32(_mm256_setzero_si256(), xu, wq[j]);
                    let isum = _mm256_cvtepi32_ps(_mm256_sub_epi32(raw, offset[j]));
                    acc_r[j] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw[j], dx), acc_r[j]);
                }
            }
        }
        // SAFETY: the features.
        unsafe { store::<R, G>(&acc, out.from(g * G * to.col), to, first) };
    }
}
