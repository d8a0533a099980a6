//! The element type of the host KV cache: f32, or f16 (half the bytes an attention row
//! streams). Called by `kernels::attention` (reads, widened to f32 in registers) and
//! `model::host` (writes, narrowed once when a row's K/V is stored).
//!
//! Why f16: a decode row's attention reads its pass's whole cache, 256 KB per layer at
//! position 128 on the shipped model, and at hidden 256 that is the part of a step that grows
//! with its rows (`attention`'s header). llama.cpp stores its KV cache in f16 by default for
//! the same reason. Exactness holds because every row reads the same rounded entries: a
//! first candidate from the cache, a second candidate its own entry rounded the same way
//! (`round`), so a token's hidden state still does not depend on the rows beside it.

use half::f16;
use half::slice::HalfFloatSliceExt;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A KV cache element: stored from f32 (each value the nearest element), read back as f32
/// exactly (f32 represents every f16). All-zero bits are its zero ([`bytemuck::Zeroable`]), so
/// a cache starts as pages the kernel zeroes (`engine::zeroed_pages`).
pub trait KvElement:
    Copy + Default + bytemuck::Zeroable + Send + Sync + std::fmt::Debug + 'static
{
    /// `dst := src`, each element the nearest to its f32 (vectorised where the CPU converts).
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `dst := src` as f32.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// The slice itself where the elements are f32 (nothing to widen).
    fn as_f32(row: &[Self]) -> Option<&[f32]>;
    /// Eight elements from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU must have AVX and F16C, and eight elements must be readable at `p`. Inlined
    /// into the AVX2 kernels, whose target features cover both.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
    /// Sixteen elements from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, and sixteen elements must be readable at `p`. Inlined
    /// into the AVX-512 kernels, whose target features cover it.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;
}

impl KvElement for f32 {
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn as_f32(row: &[Self]) -> Option<&[f32]> {
        Some(row)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller's features and bounds.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: the caller's features and bounds.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl KvElement for f16 {
    fn narrow(src: &[f32], dst: &mut [Self]) {
        // F16C's conversion where the CPU has it (half detects it at run time), rounding to
        // nearest even like the software one.
        dst.convert_from_f32_slice(src);
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller's features and bounds; eight f16 are the 16 bytes loaded.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: the caller's features and bounds; sixteen f16 are the 32 bytes loaded.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}
