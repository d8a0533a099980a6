//! The affine blocks' vector kernels (`affine`'s one definition): AVX-512 holds a pair's 16
//! lanes in one register, AVX2 in two. Each weight chunk is dequantized once for all rows of
//! a block: its integers widened to f32 and `s·q + b` fused, then one FMA per row.

use std::arch::x86_64::*;

use super::affine::{AffineMatrix, hsum16};
use super::dense::{RUN_BYTES, X86_ROW_BLOCK, row_blocks};
use super::{Isa, OutLayout, SharedOut, row_starts};

/// How far ahead of a weight row's current block its lines are prefetched into L1: the
/// hardware prefetchers alone left the 4-bit 1-row step waiting on memory at a third of the
/// read bandwidth (4, 8 and 16 KiB measured alike; the smallest keeps J rows' lines in L1).
const PREFETCH_BYTES: usize = 4096;

/// [`super::affine::product`] on AVX-512 or AVX2 (`isa`, which `Kernels::new` checked the
/// CPU has).
pub(super) fn product(isa: Isa, x: &[f32], w: AffineMatrix<'_>, out: SharedOut<'_>, to: OutLayout) {
    let inner = w.inner();
    let rows = x.len() / inner.max(1);
    let blocks = row_blocks(rows, X86_ROW_BLOCK);
    let row_bytes = w.as_bytes().len() / w.rows().max(1);
    let run = if rows <= X86_ROW_BLOCK {
        w.rows().max(1)
    } else {
        (RUN_BYTES / row_bytes.max(1)).max(1).next_multiple_of(4)
    };
    for start in (0..w.rows()).step_by(run) {
        let wr = w.slice_rows(start..(start + run).min(w.rows()));
        let run_out = out.from(start * to.col);
        for block in blocks.clone() {
            let xs = &x[block.start * inner..block.end * inner];
            let n = block.len();
            // SAFETY: `isa` was checked against the CPU (`Kernels::new`); `xs` holds `n`
            // whole rows of `inner`, the weights' row length.
            unsafe {
                // Bits, group and rows as constants: the chunk loop unrolls, each chunk's
                // nibble half fixed.
                macro_rules! groups {
                    ($kernel:ident, $bits:literal) => {
                        match w.kind().group() {
                            32 => with_rows!(n, R => $kernel::<R, $bits, 32>(xs, wr, run_out, to, block.start)),
                            64 => with_rows!(n, R => $kernel::<R, $bits, 64>(xs, wr, run_out, to, block.start)),
                            _ => with_rows!(n, R => $kernel::<R, $bits, 128>(xs, wr, run_out, to, block.start)),
                        }
                    };
                }
                match (isa, w.kind().bits()) {
                    (Isa::Avx2Fma, 4) => groups!(avx2, 4),
                    (Isa::Avx2Fma, _) => groups!(avx2, 8),
                    (_, 4) => groups!(avx512, 4),
                    _ => groups!(avx512, 8),
                }
            }
        }
    }
}

/// Every weight row of `w` against the `R` rows of `xs`, four weight rows at a time.
///
/// # Safety
/// The CPU must have AVX-512F, BW and VL, AVX2 and FMA; `xs` holds `R` rows of `w.inner()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn avx512<const R: usize, const B: u32, const G: usize>(
    xs: &[f32],
    w: AffineMatrix<'_>,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let full = w.rows() / 4 * 4;
    // SAFETY: the caller's features and rows; the weight rows are `w`'s.
    unsafe {
        for j in (0..full).step_by(4) {
            pairs_512::<R, 4, B, G>(xs, w, j, out, to, first);
        }
        for j in full..w.rows() {
            pairs_512::<R, 1, B, G>(xs, w, j, out, to, first);
        }
    }
}

/// Sixteen 8-bit integers from `p` as `s·q + b`.
///
/// # Safety
/// AVX-512F; 16 bytes must be readable at `p`.
#[inline(always)]
unsafe fn dequant16(p: *const u8, s: __m512, b: __m512) -> __m512 {
    // SAFETY: the caller's features and bounds.
    unsafe {
        let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, b)
    }
}

/// Weight rows `j0..j0 + J` of `w` against the `R` rows of `xs`: one 16-lane accumulator a
/// pair, fed in the order of k.
///
/// # Safety
/// As [`avx512`], and `j0 + J ≤ w.rows()`.
#[inline(always)]
unsafe fn pairs_512<const R: usize, const J: usize, const B: u32, const G: usize>(
    xs: &[f32],
    w: AffineMatrix<'_>,
    j0: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let (kind, inner) = (w.kind(), w.inner());
    let (group, block_bytes) = (G, kind.block_bytes());
    let row_bytes = w.as_bytes().len() / w.rows();
    let x: [*const f32; R] = row_starts(xs, inner);
    let wj: [*const u8; J] = row_starts(&w.as_bytes()[j0 * row_bytes..], row_bytes);
    // SAFETY: every block read lies within weight rows j0..j0 + J, every x read within R rows
    // of `inner` (the caller's bounds).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        for g in 0..inner / group {
            let at = g * block_bytes;
            let mut s = [_mm512_setzero_ps(); J];
            let mut b = [_mm512_setzero_ps(); J];
            for j in 0..J {
                let ahead = wj[j].wrapping_add(at + PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                s[j] = _mm512_set1_ps((wj[j].add(at) as *const f32).read_unaligned());
                b[j] = _mm512_set1_ps((wj[j].add(at + 4) as *const f32).read_unaligned());
            }
            let k = g * group;
            match B {
                4 => group4_512::<R, J, G>(&mut acc, x, wj, at + 8, k, s, b),
                _ => group8_512::<R, J, G>(&mut acc, x, wj, at + 8, k, s, b),
            }
        }
        let mut lanes = [0f32; 16];
        for (r, acc_r) in acc.iter().enumerate() {
            for (j, a) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
                out.set((j0 + j) * to.col + (first + r) * to.row, hsum16(&lanes));
            }
        }
    }
}

/// Every (row, weight row) accumulator += the row's 16 values at `k` times the weight row's
/// 16 dequantized weights `wk`.
///
/// # Safety
/// AVX-512F; 16 floats readable at `k` of every row.
#[inline(always)]
unsafe fn fma_rows<const R: usize, const J: usize>(
    acc: &mut [[__m512; J]; R],
    x: [*const f32; R],
    k: usize,
    wk: [__m512; J],
) {
    // SAFETY: the caller's features and bounds.
    unsafe {
        for r in 0..R {
            let xr = _mm512_loadu_ps(x[r].add(k));
            for j in 0..J {
                acc[r][j] = _mm512_fmadd_ps(xr, wk[j], acc[r][j]);
            }
        }
    }
}

/// One group of 4-bit weights (packed from `wj[j] + at`, activations from `k` on): the
/// group's 16 weights `s·q + b`, q = 0..15, each one FMA as the definition computes it, then
/// each nibble selects its weight with one `vpermps` (which reads an index lane's low 4 bits:
/// the low nibble as it is). Chunks of 32 weights, 16 bytes: the even weights, then the odd.
///
/// # Safety
/// AVX-512F; the group's bytes readable in every weight row, its values in every row.
#[inline(always)]
unsafe fn group4_512<const R: usize, const J: usize, const G: usize>(
    acc: &mut [[__m512; J]; R],
    x: [*const f32; R],
    wj: [*const u8; J],
    at: usize,
    k: usize,
    s: [__m512; J],
    b: [__m512; J],
) {
    // SAFETY: the caller's features and bounds.
    unsafe {
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let mut table = [_mm512_setzero_ps(); J];
        for j in 0..J {
            table[j] = _mm512_fmadd_ps(iota, s[j], b[j]);
        }
        for c in 0..G / 32 {
            let mut bytes = [_mm512_setzero_si512(); J];
            for j in 0..J {
                let p = wj[j].add(at + c * 16) as *const __m128i;
                bytes[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(p));
            }
            for half in 0..2 {
                let mut wk = [_mm512_setzero_ps(); J];
                for j in 0..J {
                    let q = match half {
                        0 => bytes[j],
                        _ => _mm512_srli_epi32::<4>(bytes[j]),
                    };
                    wk[j] = _mm512_permutexvar_ps(q, table[j]);
                }
                fma_rows(acc, x, k + c * 32 + half * 16, wk);
            }
        }
    }
}

/// One group of 8-bit weights: chunks of 16 bytes in order.
///
/// # Safety
/// As [`group4_512`].
#[inline(always)]
unsafe fn group8_512<const R: usize, const J: usize, const G: usize>(
    acc: &mut [[__m512; J]; R],
    x: [*const f32; R],
    wj: [*const u8; J],
    at: usize,
    k: usize,
    s: [__m512; J],
    b: [__m512; J],
) {
    // SAFETY: the caller's features and bounds.
    unsafe {
        for c in 0..G / 16 {
            let mut wk = [_mm512_setzero_ps(); J];
            for j in 0..J {
                wk[j] = dequant16(wj[j].add(at + c * 16), s[j], b[j]);
            }
            fma_rows(acc, x, k + c * 16, wk);
        }
    }
}

/// As [`avx512`] on AVX2: a pair's 16 lanes in two registers; two weight rows at a time for
/// one or two rows, else one (16 registers hold 12 accumulators).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `xs` holds `R` rows of `w.inner()`.
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<const R: usize, const B: u32, const G: usize>(
    xs: &[f32],
    w: AffineMatrix<'_>,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    // SAFETY: the caller's features and rows; the weight rows are `w`'s.
    unsafe {
        let mut j = 0;
        if R <= 2 {
            while j + 2 <= w.rows() {
                pairs_avx2::<R, 2, B, G>(xs, w, j, out, to, first);
                j += 2;
            }
        }
        while j < w.rows() {
            pairs_avx2::<R, 1, B, G>(xs, w, j, out, to, first);
            j += 1;
        }
    }
}

/// Sixteen weights as `s·q + b`, lanes 0–7 and 8–15: 8-bit integers at `p`, or the low
/// (`half` 0) or high nibbles of the 16 bytes at `p`.
///
/// # Safety
/// AVX2 and FMA; 16 bytes must be readable at `p`.
#[inline(always)]
unsafe fn dequant16_avx2<const B: u32>(
    p: *const u8,
    half: usize,
    s: __m256,
    b: __m256,
) -> [__m256; 2] {
    // SAFETY: the caller's features and bounds.
    unsafe {
        let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
        let (lo, hi) = match (B, half) {
            (4, 0) => {
                let nib = _mm256_set1_epi32(0x0F);
                (_mm256_and_si256(lo, nib), _mm256_and_si256(hi, nib))
            }
            (4, _) => (_mm256_srli_epi32::<4>(lo), _mm256_srli_epi32::<4>(hi)),
            _ => (lo, hi),
        };
        [
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s, b),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s, b),
        ]
    }
}

/// As [`pairs_512`] on AVX2.
///
/// # Safety
/// As [`avx2`], and `j0 + J ≤ w.rows()`.
#[inline(always)]
unsafe fn pairs_avx2<const R: usize, const J: usize, const B: u32, const G: usize>(
    xs: &[f32],
    w: AffineMatrix<'_>,
    j0: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let (kind, inner) = (w.kind(), w.inner());
    let (group, block_bytes) = (G, kind.block_bytes());
    let row_bytes = w.as_bytes().len() / w.rows();
    let x: [*const f32; R] = row_starts(xs, inner);
    let wj: [*const u8; J] = row_starts(&w.as_bytes()[j0 * row_bytes..], row_bytes);
    // SAFETY: as in `pairs_512`.
    unsafe {
        let mut acc = [[[_mm256_setzero_ps(); 2]; J]; R];
        for g in 0..inner / group {
            let at = g * block_bytes;
            let mut s = [_mm256_setzero_ps(); J];
            let mut b = [_mm256_setzero_ps(); J];
            for j in 0..J {
                let ahead = wj[j].wrapping_add(at + PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                s[j] = _mm256_set1_ps((wj[j].add(at) as *const f32).read_unaligned());
                b[j] = _mm256_set1_ps((wj[j].add(at + 4) as *const f32).read_unaligned());
            }
            for c in 0..group / 16 {
                let mut wk = [[_mm256_setzero_ps(); 2]; J];
                for j in 0..J {
                    let (p, half) = match B {
                        4 => (wj[j].add(at + 8 + c / 2 * 16), c % 2),
                        _ => (wj[j].add(at + 8 + c * 16), 0),
                    };
                    wk[j] = dequant16_avx2::<B>(p, half, s[j], b[j]);
                }
                let k = g * group + c * 16;
                for r in 0..R {
                    let (x0, x1) = (
                        _mm256_loadu_ps(x[r].add(k)),
                        _mm256_loadu_ps(x[r].add(k + 8)),
                    );
                    for j in 0..J {
                        acc[r][j][0] = _mm256_fmadd_ps(x0, wk[j][0], acc[r][j][0]);
                        acc[r][j][1] = _mm256_fmadd_ps(x1, wk[j][1], acc[r][j][1]);
                    }
                }
            }
        }
        let mut lanes = [0f32; 16];
        for (r, acc_r) in acc.iter().enumerate() {
            for (j, [a0, a1]) in acc_r.iter().enumerate() {
                _mm256_storeu_ps(lanes.as_mut_ptr(), *a0);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), *a1);
                out.set((j0 + j) * to.col + (first + r) * to.row, hsum16(&lanes));
            }
        }
    }
}
