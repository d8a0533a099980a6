//! The element type of a weight matrix the matmul streams: f32, or bf16 and f16 as a
//! checkpoint stores them (Ouro's released models are bf16). Called by the matmul kernels
//! (`avx512`, `avx2`, `neon`, `portable`), which widen each chunk of weights to f32 in
//! registers and then run the f32 arithmetic, and by `model::host`, which hands them the
//! weights as stored ([`Weight`]).
//!
//! Why as stored: at real size a decode step is bound by the bytes of weights it reads, so a
//! bf16 matrix read as bf16 costs half of its f32 copy, and no f32 copy is ever made. Why
//! widened and not multiplied in bf16 (AVX-512 BF16's `vdpbf16ps`): every bf16 and f16 value
//! is exactly an f32, so a product over stored weights has, bit for bit, the value of the f32
//! kernel over the same weights widened. The row-invariance that makes speculation exact
//! carries over unchanged, and the f32 kernels' tests hold the stored types too. The
//! activations stay f32, so nothing is rounded that the f32 path does not round.

use half::{bf16, f16};

use super::affine::AffineMatrix;
use super::k_quants::{self, KMatrix, KQuant, Q4K, Q6K, QK_K};
use super::packed::Packed;
use super::q4_0::Q4Matrix;
use super::q5k::Q5K;
use super::q8_0::{Q8Matrix, QK8_0};

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A weight element: read as f32 exactly.
pub trait WeightElement: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// The value as f32 (exact for every implementor).
    fn to_f32(self) -> f32;

    /// The slice itself where the elements are bf16 (AVX-512 BF16 multiplies those as
    /// stored).
    fn as_bf16(_: &[Self]) -> Option<&[bf16]> {
        None
    }

    /// Eight elements from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C, and eight elements must be readable at `p`. Inlined
    /// into the AVX2 kernels, whose target features cover both.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;

    /// The elements of `p`'s 16 that `mask` selects, widened to f32, zeros elsewhere.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, BW and VL, and the selected elements must be readable.
    /// Inlined into the AVX-512 kernels, whose target features cover them.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(mask: __mmask16, p: *const Self) -> __m512;

    /// Eight elements from `p`, widened to f32, as two 4-lane registers.
    ///
    /// # Safety
    /// Eight elements must be readable at `p` (NEON is part of every aarch64 CPU).
    #[cfg(target_arch = "aarch64")]
    unsafe fn load8(p: *const Self) -> (float32x4_t, float32x4_t);
}

impl WeightElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller's features and bounds.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(mask: __mmask16, p: *const Self) -> __m512 {
        // SAFETY: the caller's features and bounds; masked-off lanes are not read.
        unsafe { _mm512_maskz_loadu_ps(mask, p) }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> (float32x4_t, float32x4_t) {
        // SAFETY: the caller's bounds.
        unsafe { (vld1q_f32(p), vld1q_f32(p.add(4))) }
    }
}

impl WeightElement for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the top half of an f32: the widening is a shift, exact.
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    fn as_bf16(w: &[Self]) -> Option<&[bf16]> {
        Some(w)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller's features and bounds; eight bf16 are the 16 bytes loaded.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(mask: __mmask16, p: *const Self) -> __m512 {
        // SAFETY: the caller's features and bounds; masked-off lanes are not read.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> (float32x4_t, float32x4_t) {
        // SAFETY: the caller's bounds; eight bf16 are the 16 bytes loaded.
        unsafe {
            let halves = vld1q_u16(p.cast());
            (
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(halves))),
                vreinterpretq_f32_u32(vshll_high_n_u16::<16>(halves)),
            )
        }
    }
}

impl WeightElement for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller's features and bounds; eight f16 are the 16 bytes loaded.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(mask: __mmask16, p: *const Self) -> __m512 {
        // SAFETY: the caller's features and bounds; masked-off lanes are not read.
        unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())) }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> (float32x4_t, float32x4_t) {
        // SAFETY: the caller's bounds: eight f16 are the 16 bytes loaded.
        let halves = unsafe { vld1q_u16(p.cast()) };
        let (low, high): (float32x4_t, float32x4_t);
        // NEON's f16 intrinsics are not in stable Rust, but its widening is base ARMv8-A
        // Advanced SIMD (no FEAT_FP16): `fcvtl`/`fcvtl2` widen four halves each, exactly
        // (every f16 is an f32), where `f16::to_f32` took a call and a feature check each.
        // SAFETY: register-only instructions every aarch64 CPU has; no memory is touched.
        unsafe {
            std::arch::asm!(
                "fcvtl {low:v}.4s, {halves:v}.4h",
                "fcvtl2 {high:v}.4s, {halves:v}.8h",
                halves = in(vreg) halves,
                low = out(vreg) low,
                high = out(vreg) high,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        (low, high)
    }
}

/// A weight matrix's elements as stored, `[outs × inner]` row-major: what the matmuls take.
#[derive(Debug, Clone, Copy)]
pub enum Weight<'a> {
    /// Stored in f32.
    F32(&'a [f32]),
    /// Stored in bf16.
    Bf16(&'a [bf16]),
    /// Stored in f16.
    F16(&'a [f16]),
    /// Stored in GGUF's Q8_0 blocks, 32 weights each, in the kernels' layout (`q8_0`),
    /// multiplied with integer dot products over quantized activations.
    Q8_0(Q8Matrix<'a>),
    /// Stored in GGUF's Q4_0 blocks, 32 weights each, in the kernels' layout (`q4_0`),
    /// multiplied as Q8_0 is.
    Q4_0(Q4Matrix<'a>),
    /// Stored in GGUF's Q4_K super-blocks, 256 weights each (`k_quants`).
    Q4K(KMatrix<'a, Q4K>),
    /// Stored in GGUF's Q5_K super-blocks, 256 weights each (`k_quants`, `q5k`).
    Q5K(KMatrix<'a, Q5K>),
    /// Stored in GGUF's Q6_K super-blocks, 256 weights each (`k_quants`).
    Q6K(KMatrix<'a, Q6K>),
    /// Stored in mlx's affine groups (`affine`), multiplied with f32 activations.
    Affine(AffineMatrix<'a>),
}

/// A quantized block type the kernels read as stored (ordered as [`Self::ALL`] lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum QuantKind {
    /// 32 weights: an f16 scale and 32 bytes ([`super::BlockQ8_0`]).
    Q8_0,
    /// 32 weights: an f16 scale and 16 bytes of nibbles ([`super::BlockQ4_0`]).
    Q4_0,
    /// 256 weights in 8 sub-blocks with 6-bit scales and mins ([`super::BlockQ4K`]).
    Q4K,
    /// 256 weights in 8 sub-blocks as Q4_K's, each weight with a fifth bit
    /// ([`super::BlockQ5K`]).
    Q5K,
    /// 256 weights in 16 sub-blocks with 8-bit scales ([`super::BlockQ6K`]).
    Q6K,
}

impl QuantKind {
    /// Every kind.
    pub const ALL: [Self; 5] = [Self::Q8_0, Self::Q4_0, Self::Q4K, Self::Q5K, Self::Q6K];

    /// Its name as llama.cpp prints it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }

    /// Weights a block holds.
    pub const fn block_weights(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q4_0 => QK8_0,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes a block takes.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => std::mem::size_of::<super::BlockQ8_0>(),
            Self::Q4_0 => std::mem::size_of::<super::BlockQ4_0>(),
            Self::Q4K => std::mem::size_of::<super::BlockQ4K>(),
            Self::Q5K => std::mem::size_of::<super::BlockQ5K>(),
            Self::Q6K => std::mem::size_of::<super::BlockQ6K>(),
        }
    }
}

/// A weight matrix with its shape: `weight`'s elements, `inner` to a row.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    /// Its elements, row after row.
    pub weight: Weight<'a>,
    /// Elements a row: the products' inner dimension.
    pub inner: usize,
}

impl Matrix<'_> {
    /// Its rows: a product's outputs for each input row.
    pub fn outs(self) -> usize {
        self.weight.len() / self.inner.max(1)
    }
}

impl<'a> From<&'a [f32]> for Weight<'a> {
    fn from(w: &'a [f32]) -> Self {
        Self::F32(w)
    }
}

impl<'a> From<&'a Vec<f32>> for Weight<'a> {
    fn from(w: &'a Vec<f32>) -> Self {
        Self::F32(w)
    }
}

impl<'a> From<&'a [bf16]> for Weight<'a> {
    fn from(w: &'a [bf16]) -> Self {
        Self::Bf16(w)
    }
}

impl<'a> From<&'a [f16]> for Weight<'a> {
    fn from(w: &'a [f16]) -> Self {
        Self::F16(w)
    }
}

impl<'a> From<Q8Matrix<'a>> for Weight<'a> {
    fn from(w: Q8Matrix<'a>) -> Self {
        Self::Q8_0(w)
    }
}

impl<'a> From<Q4Matrix<'a>> for Weight<'a> {
    fn from(w: Q4Matrix<'a>) -> Self {
        Self::Q4_0(w)
    }
}

impl<'a> From<KMatrix<'a, Q4K>> for Weight<'a> {
    fn from(w: KMatrix<'a, Q4K>) -> Self {
        Self::Q4K(w)
    }
}

impl<'a> From<KMatrix<'a, Q5K>> for Weight<'a> {
    fn from(w: KMatrix<'a, Q5K>) -> Self {
        Self::Q5K(w)
    }
}

impl<'a> From<KMatrix<'a, Q6K>> for Weight<'a> {
    fn from(w: KMatrix<'a, Q6K>) -> Self {
        Self::Q6K(w)
    }
}

/// Elements `range` of K-quant matrix `w`, dequantized (whole super-blocks decoded).
fn widen_k<K: KQuant>(w: KMatrix<'_, K>, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
    let inner = w.inner();
    let mut block = [0f32; QK_K];
    for at in (range.start / QK_K * QK_K..range.end).step_by(QK_K) {
        let (row, k) = (at / inner, at % inner / QK_K);
        K::dequantize(&k_quants::decoded(w, row, k), &mut block);
        let (lo, hi) = (range.start.max(at), range.end.min(at + QK_K));
        out.extend_from_slice(&block[lo - at..hi - at]);
    }
}

impl<'a> Weight<'a> {
    /// A matrix of `kind` blocks held in `bytes` in the kernels' layout (`packed`), `inner`
    /// weights a row; an error says why not (the size, or an odd address).
    pub fn quantized(kind: QuantKind, bytes: &'a [u8], inner: usize) -> Result<Self, String> {
        let blocks = inner / kind.block_weights();
        let rows = bytes.len() / (blocks * kind.block_bytes()).max(1);
        match kind {
            QuantKind::Q8_0 => Packed::from_bytes(bytes, rows, blocks).map(Self::Q8_0),
            QuantKind::Q4_0 => Packed::from_bytes(bytes, rows, blocks).map(Self::Q4_0),
            QuantKind::Q4K => Packed::from_bytes(bytes, rows, blocks).map(Self::Q4K),
            QuantKind::Q5K => Packed::from_bytes(bytes, rows, blocks).map(Self::Q5K),
            QuantKind::Q6K => Packed::from_bytes(bytes, rows, blocks).map(Self::Q6K),
        }
    }

    /// Its number of elements.
    pub fn len(self) -> usize {
        match self {
            Self::F32(w) => w.len(),
            Self::Bf16(w) => w.len(),
            Self::F16(w) => w.len(),
            Self::Q8_0(w) => w.len(),
            Self::Q4_0(w) => w.len(),
            Self::Q4K(w) => w.len(),
            Self::Q5K(w) => w.len(),
            Self::Q6K(w) => w.len(),
            Self::Affine(w) => w.rows() * w.inner(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// The bytes it is stored in: what a product streams.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32(w) => std::mem::size_of_val(w),
            Self::Bf16(w) => std::mem::size_of_val(w),
            Self::F16(w) => std::mem::size_of_val(w),
            Self::Q8_0(w) => w.bytes(),
            Self::Q4_0(w) => w.bytes(),
            Self::Q4K(w) => w.bytes(),
            Self::Q5K(w) => w.bytes(),
            Self::Q6K(w) => w.bytes(),
            Self::Affine(w) => w.as_bytes().len(),
        }
    }

    /// Elements `range` (whole rows of a quantized matrix, from a multiple of 8: the decode
    /// threads' shares are).
    pub fn slice(self, range: std::ops::Range<usize>) -> Self {
        match self {
            Self::F32(w) => Self::F32(&w[range]),
            Self::Bf16(w) => Self::Bf16(&w[range]),
            Self::F16(w) => Self::F16(&w[range]),
            Self::Q8_0(w) => Self::Q8_0(w.slice_elements(range)),
            Self::Q4_0(w) => Self::Q4_0(w.slice_elements(range)),
            Self::Q4K(w) => Self::Q4K(w.slice_elements(range)),
            Self::Q5K(w) => Self::Q5K(w.slice_elements(range)),
            Self::Q6K(w) => Self::Q6K(w.slice_elements(range)),
            Self::Affine(w) => {
                let inner = w.inner();
                Self::Affine(w.slice_rows(range.start / inner..range.end.div_ceil(inner)))
            }
        }
    }

    /// The stored bits as 64-bit words, the few bytes at either end outside 8-byte alignment
    /// left out (and a quantized matrix's few tail rows): what a read-bandwidth probe sums
    /// (`harness::roofline`).
    pub fn words(self) -> &'a [u64] {
        let bits: &'a [u8] = match self {
            Self::F32(w) => bytemuck::cast_slice(w),
            Self::Bf16(w) => bytemuck::cast_slice(w),
            Self::F16(w) => bytemuck::cast_slice(w),
            Self::Q8_0(w) => return w.words(),
            Self::Q4_0(w) => return w.words(),
            Self::Q4K(w) => return w.words(),
            Self::Q5K(w) => return w.words(),
            Self::Q6K(w) => return w.words(),
            Self::Affine(w) => w.as_bytes(),
        };
        bytemuck::pod_align_to::<u8, u64>(bits).1
    }

    /// Elements `range`, widened to f32 (a row of the embedding, say).
    pub fn widen_into(self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        match self {
            Self::F32(w) => out.extend_from_slice(&w[range]),
            Self::Bf16(w) => out.extend(w[range].iter().map(|v| v.to_f32())),
            Self::F16(w) => out.extend(w[range].iter().map(|v| WeightElement::to_f32(*v))),
            Self::Q8_0(w) => w.widen_into(range, out),
            Self::Q4_0(w) => w.widen_into(range, out),
            Self::Q4K(w) => widen_k(w, range, out),
            Self::Q5K(w) => widen_k(w, range, out),
            Self::Q6K(w) => widen_k(w, range, out),
            Self::Affine(w) => w.widen_into(range, out),
        }
    }
}
