//! The affine blocks' vector kernels (`affine`'s one definition): AVX-512 holds a pair's 16
//! lanes in one register, AVX2 in two. Each weight chunk is dequantized once for all rows of
//! a block: its integers widened to f32 and `s·q + b` fused, then one FMA per row.

use std::arch::x86_64::*;

use super::affine::{AffineMatrix, hsum16};
use super::{Isa, OutLayout, SharedOut, X86_ROW_BLOCK, row_blocks, row_starts};

/// Weight bytes a run of weight rows holds where the input rows are several blocks: each
/// block reads the run while it is still in L1 (`super::sweep`'s reason).
const RUN_BYTES: usize = 16 << 10;

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
                match (isa, w.kind().bits()) {
                    (Isa::Avx2Fma, 4) => {
                        with_rows!(n, R => avx2::<R, 4>(xs, wr, run_out, to, block.start))
                    }
                    (Isa::Avx2Fma, _) => {
                        with_rows!(n, R => avx2::<R, 8>(xs, wr, run_out, to, block.start))
                    }
                    (_, 4) => with_rows!(n, R => avx512::<R, 4>(xs, wr, run_out, to, block.start)),
                    _ => with_rows!(n, R => avx512::<R, 8>(xs, wr, run_out, to, block.start)),
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
unsafe fn avx512<const R: usize, const B: u32>(
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
            pairs_512::<R, 4, B>(xs, w, j, out, to, first);
        }
        for j in full..w.rows() {
            pairs_512::<R, 1, B>(xs, w, j, out, to, first);
        }
    }
}

/// Sixteen integers from `p` (8 bytes of 4-bit ones, 16 of 8-bit) as `s·q + b`.
///
/// # Safety
/// AVX-512F/BW; the bytes must be readable.
#[inline(always)]
unsafe fn dequant16<const B: u32>(p: *const u8, s: __m512, b: __m512) -> __m512 {
    // SAFETY: the caller's features and bounds.
    unsafe {
        let q = if B == 4 {
            let v = _mm_loadl_epi64(p as *const __m128i);
            // Each byte twice: lane 2i takes its low nibble, lane 2i + 1 its high one.
            let wide = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v));
            let shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
            _mm512_and_si512(_mm512_srlv_epi32(wide, shifts), _mm512_set1_epi32(0x0F))
        } else {
            _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
        };
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, b)
    }
}

/// Weight rows `j0..j0 + J` of `w` against the `R` rows of `xs`: one 16-lane accumulator a
/// pair, fed in the order of k.
///
/// # Safety
/// As [`avx512`], and `j0 + J ≤ w.rows()`.
#[inline(always)]
unsafe fn pairs_512<const R: usize, const J: usize, const B: u32>(
    xs: &[f32],
    w: AffineMatrix<'_>,
    j0: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let (kind, inner) = (w.kind(), w.inner());
    let (group, block_bytes) = (kind.group(), kind.block_bytes());
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
                s[j] = _mm512_set1_ps((wj[j].add(at) as *const f32).read_unaligned());
                b[j] = _mm512_set1_ps((wj[j].add(at + 4) as *const f32).read_unaligned());
            }
            for c in 0..group / 16 {
                let mut wk = [_mm512_setzero_ps(); J];
                for j in 0..J {
                    wk[j] = dequant16::<B>(wj[j].add(at + 8 + c * 2 * B as usize), s[j], b[j]);
                }
                let k = g * group + c * 16;
                for r in 0..R {
                    let xr = _mm512_loadu_ps(x[r].add(k));
                    for j in 0..J {
                        acc[r][j] = _mm512_fmadd_ps(xr, wk[j], acc[r][j]);
                    }
                }
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

/// As [`avx512`] on AVX2: a pair's 16 lanes in two registers; two weight rows at a time for
/// one or two rows, else one (16 registers hold 12 accumulators).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `xs` holds `R` rows of `w.inner()`.
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<const R: usize, const B: u32>(
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
                pairs_avx2::<R, 2, B>(xs, w, j, out, to, first);
                j += 2;
            }
        }
        while j < w.rows() {
            pairs_avx2::<R, 1, B>(xs, w, j, out, to, first);
            j += 1;
        }
    }
}

/// Sixteen integers from `p` as `s·q + b`, lanes 0–7 and 8–15.
///
/// # Safety
/// AVX2 and FMA; the bytes must be readable.
#[inline(always)]
unsafe fn dequant16_avx2<const B: u32>(p: *const u8, s: __m256, b: __m256) -> [__m256; 2] {
    // SAFETY: the caller's features and bounds.
    unsafe {
        let (lo, hi) = if B == 4 {
            let v = _mm_loadl_epi64(p as *const __m128i);
            let d = _mm_unpacklo_epi8(v, v);
            let shifts = _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0);
            let nib = _mm256_set1_epi32(0x0F);
            let lo = _mm256_cvtepu8_epi32(d);
            let hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(d, d));
            (
                _mm256_and_si256(_mm256_srlv_epi32(lo, shifts), nib),
                _mm256_and_si256(_mm256_srlv_epi32(hi, shifts), nib),
            )
        } else {
            (
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i)),
            )
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
unsafe fn pairs_avx2<const R: usize, const J: usize, const B: u32>(
    xs: &[f32],
    w: AffineMatrix<'_>,
    j0: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let (kind, inner) = (w.kind(), w.inner());
    let (group, block_bytes) = (kind.group(), kind.block_bytes());
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
                s[j] = _mm256_set1_ps((wj[j].add(at) as *const f32).read_unaligned());
                b[j] = _mm256_set1_ps((wj[j].add(at + 4) as *const f32).read_unaligned());
            }
            for c in 0..group / 16 {
                let mut wk = [[_mm256_setzero_ps(); 2]; J];
                for j in 0..J {
                    let p = wj[j].add(at + 8 + c * 2 * B as usize);
                    wk[j] = dequant16_avx2::<B>(p, s[j], b[j]);
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
