//! CPU kernels for the decode step on f32 host memory: a small-M matmul that reads each weight
//! row once for all M rows, RMSNorm, rotary embedding, single-query attention, SiLU, softmax.
//! Called by `model::host` only; GPU devices use candle's own kernels instead.
//!
//! Why a kernel of our own: candle's CPU matmul for 2–6 rows costs ~5× its 1-row time, which
//! erases SPEED's gain (speculation.md §6). Here every output element of row `m` is computed
//! with the same arithmetic whatever M is and however the work is split between threads, so a
//! token's hidden state does not depend on which other rows shared its step: speculative and
//! baseline decoding agree bit for bit.
//!
//! `f16_matmul` is the same product with f16 weights, for `model::half_head`'s proposal
//! readouts, which need a bound on their error rather than these bits.
//!
//! AVX-512 runs the matmul where the CPU has it (measured on this project's Xeon: baseline
//! decoding 6–9 % faster than with AVX2, SPEED 5 % faster); everything else uses AVX2 + FMA.

use std::sync::OnceLock;

use rayon::prelude::*;

pub mod f16_matmul;

/// Rows of `x` processed together against one weight row (registers hold 2 accumulators each).
const ROW_BLOCK: usize = 4;
/// Weight matrices with at least this many elements (16 MB: Ouro-1.4B's, not the shipped
/// model's) are split across threads by output rows; below it, waking a second thread costs
/// more than it saves (measured: hidden 256 steps were 15 % slower threaded).
const PARALLEL_MIN_ELEMENTS: usize = 1 << 22;

/// Which instruction set the kernels use, chosen once per process at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F for the matmul (16 lanes, 32 registers), AVX2 + FMA for everything else.
    Avx512,
    Avx2Fma,
    Portable,
}

impl Isa {
    /// Whether the AVX2 + FMA kernels may run (true for every x86 level above the fallback).
    fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx2Fma)
    }
}

/// The instruction set detected on this CPU: AVX-512F, AVX2 + FMA, or the portable fallback.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            return Isa::Avx2Fma;
        }
        Isa::Portable
    })
}

/// Offers `buf`'s whole 2 MB pages to the kernel as transparent huge pages: before the memory
/// is first written (`collapse` false: later faults get huge pages) or after it (`collapse`
/// true: the kernel merges what is already there, Linux ≥ 6.1). Best effort: systems without
/// THP, or with it off, keep 4 KB pages and lose nothing else.
pub fn advise_huge_pages(buf: &[f32], collapse: bool) {
    #[cfg(target_os = "linux")]
    {
        /// `MADV_COLLAPSE` (Linux 6.1), not in every libc crate release.
        const MADV_COLLAPSE: libc::c_int = 25;
        const HUGE: usize = 2 << 20;
        let start = buf.as_ptr() as usize;
        let first = start.next_multiple_of(HUGE);
        let end = (start + std::mem::size_of_val(buf)) / HUGE * HUGE;
        if end <= first {
            return;
        }
        let advice = if collapse {
            MADV_COLLAPSE
        } else {
            libc::MADV_HUGEPAGE
        };
        // SAFETY: [first, end) lies inside `buf`'s allocation and is page aligned; both advices
        // only change how the kernel backs the pages, never their contents. Errors are ignored.
        unsafe { libc::madvise(first as *mut libc::c_void, end - first, advice) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (buf, collapse);
}

/// Hands memory the allocator holds free back to the kernel. glibc raises its mmap threshold
/// after the first large free, so weights freed one by one while loading stay resident in the
/// heap unless trimmed. A no-op elsewhere.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own heap to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `out[m][j] = Σ_k x[m][k] · w[j][k]` for `x: [rows × inner]`, `w: [outs × inner]` (a linear
/// layer's weight as stored, no transpose), `out: [rows × outs]`.
pub fn matmul_t(x: &[f32], w: &[f32], rows: usize, inner: usize, out: &mut [f32]) {
    let outs = w.len() / inner;
    debug_assert_eq!(x.len(), rows * inner);
    debug_assert_eq!(out.len(), rows * outs);
    let isa = isa();
    if w.len() < PARALLEL_MIN_ELEMENTS || rayon::current_num_threads() == 1 {
        let to = OutLayout { col: 1, row: outs };
        return matmul_t_serial(isa, x, w, rows, inner, out, to);
    }
    // Threads own disjoint slices: the output transposed, each thread a range of weight rows.
    let mut out_t = vec![0f32; outs * rows];
    let chunk_outs = outs.div_ceil(rayon::current_num_threads() * 2).max(16);
    let to = OutLayout { col: rows, row: 1 };
    out_t
        .par_chunks_mut(chunk_outs * rows)
        .zip(w.par_chunks(chunk_outs * inner))
        .for_each(|(o, w)| matmul_t_serial(isa, x, w, rows, inner, o, to));
    for (j, col) in out_t.chunks_exact(rows).enumerate() {
        for (m, v) in col.iter().enumerate() {
            out[m * outs + j] = *v;
        }
    }
}

/// Where the kernels put the product of input row `r` and weight row `j`: `out[j·col + r·row]`
/// (row-major `[rows × outs]` is `col` 1, `row` outs; transposed is `col` rows, `row` 1).
#[derive(Debug, Clone, Copy)]
struct OutLayout {
    col: usize,
    row: usize,
}

/// One thread's share: writes the products with the weight rows in `w` where `to` says. Few
/// input rows take more weight rows at a time, so that there are always 4–8 (AVX2) or 8–16
/// (AVX-512) independent accumulators and each input load feeds several FMAs. The grouping does not
/// change any result: every (row, weight row) pair is computed the same way.
fn matmul_t_serial(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    rows: usize,
    inner: usize,
    out: &mut [f32],
    to: OutLayout,
) {
    match (isa, rows) {
        // AVX-512 has 32 registers: 16 accumulators plus the weight and input chunks fit.
        (Isa::Avx512, 1..=2) => sweep::<8>(isa, x, w, inner, out, to),
        (Isa::Avx512, _) => sweep::<4>(isa, x, w, inner, out, to),
        (_, 1..=2) => sweep::<4>(isa, x, w, inner, out, to),
        _ => sweep::<2>(isa, x, w, inner, out, to),
    }
}

fn sweep<const J: usize>(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    inner: usize,
    out: &mut [f32],
    to: OutLayout,
) {
    let mut w_groups = w.chunks_exact(J * inner);
    for (g, wg) in (&mut w_groups).enumerate() {
        let ws: [&[f32]; J] = std::array::from_fn(|j| &wg[j * inner..(j + 1) * inner]);
        for (i, block) in x.chunks(ROW_BLOCK * inner).enumerate() {
            let o = &mut out[g * J * to.col..];
            dots_dispatch(isa, block, ws, o, to, i * ROW_BLOCK);
        }
    }
    let done = w.len() / inner - w_groups.remainder().len() / inner;
    for (j, w_row) in w_groups.remainder().chunks_exact(inner).enumerate() {
        for (i, block) in x.chunks(ROW_BLOCK * inner).enumerate() {
            let o = &mut out[(done + j) * to.col..];
            dots_dispatch(isa, block, [w_row], o, to, i * ROW_BLOCK);
        }
    }
}

/// Writes `out[j·to.col + (first + r)·to.row]` = row r of `block` · `ws[j]`.
#[inline(always)]
fn dots_dispatch<const J: usize>(
    isa: Isa,
    block: &[f32],
    ws: [&[f32]; J],
    out: &mut [f32],
    to: OutLayout,
    first: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` returns Avx512 only after detecting AVX-512F, AVX2 and FMA.
        Isa::Avx512 => unsafe { avx512::dots(block, ws, out, to, first) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        Isa::Avx2Fma => unsafe { avx2::dots(block, ws, out, to, first) },
        _ => portable::dots(block, ws, out, to, first),
    }
}

mod portable {
    /// Dot products of up to `ROW_BLOCK` rows of `xs` with each weight row in `ws`. Every
    /// (row, weight row) pair uses one 8-lane accumulator and the same order, whatever the
    /// block sizes.
    pub fn dots<const J: usize>(
        xs: &[f32],
        ws: [&[f32]; J],
        out: &mut [f32],
        to: super::OutLayout,
        first: usize,
    ) {
        let inner = ws[0].len();
        for (j, w) in ws.iter().enumerate() {
            for (r, x) in xs.chunks_exact(inner).enumerate() {
                out[j * to.col + (first + r) * to.row] = dot(x, w);
            }
        }
    }

    #[inline(always)]
    pub fn dot(x: &[f32], w: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let mut xc = x.chunks_exact(8);
        let mut wc = w.chunks_exact(8);
        for (xs, ws) in (&mut xc).zip(&mut wc) {
            for (a, (x, w)) in acc.iter_mut().zip(xs.iter().zip(ws)) {
                *a += x * w;
            }
        }
        let mut sum = super::hsum8(&acc);
        for (a, b) in xc.remainder().iter().zip(wc.remainder()) {
            sum += a * b;
        }
        sum
    }
}

/// The horizontal sum of 8 lanes, in the tree the AVX2 kernel's `reduce4` uses.
#[inline(always)]
fn hsum8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// AVX2/FMA dot products of up to 4 rows of `xs` with `J` (1, 2 or 4) weight rows: each
    /// weight chunk is loaded once for all rows and each row chunk once for all weight rows.
    /// Each (row, weight row) pair has one accumulator and the same arithmetic for any block.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots<const J: usize>(
        xs: &[f32],
        ws: [&[f32]; J],
        out: &mut [f32],
        to: super::OutLayout,
        first: usize,
    ) {
        let inner = ws[0].len();
        let rows = (xs.len() / inner).min(super::ROW_BLOCK);
        let main = inner - inner % 8;
        let mut acc = [[_mm256_setzero_ps(); J]; super::ROW_BLOCK];
        let xp = xs.as_ptr();
        let mut k = 0;
        while k < main {
            // SAFETY: k + 8 <= inner; every row r < rows has `inner` elements in `xs`, and
            // every weight row has `inner` elements.
            unsafe {
                let w: [__m256; J] =
                    std::array::from_fn(|j| _mm256_loadu_ps(ws[j].as_ptr().add(k)));
                // Weight rows stream from L3: fetch the next group's rows while this one
                // computes (a prefetch never faults, even past the end).
                for wj in ws {
                    _mm_prefetch::<_MM_HINT_T0>(
                        wj.as_ptr().wrapping_add(k + J * inner) as *const i8
                    );
                }
                for (r, a) in acc.iter_mut().enumerate().take(rows) {
                    let x = _mm256_loadu_ps(xp.add(r * inner + k));
                    for j in 0..J {
                        a[j] = _mm256_fmadd_ps(x, w[j], a[j]);
                    }
                }
            }
            k += 8;
        }
        // Horizontal sums four accumulators at a time; each accumulator's tree is the same
        // whatever it is grouped with (see `reduce4`).
        let mut sums = [[0f32; super::ROW_BLOCK]; J];
        for j in 0..J {
            let a = |r: usize| if r < rows { acc[r][j] } else { acc[0][j] };
            let mut four = [0f32; 4];
            // SAFETY: `four` holds exactly 4 floats.
            unsafe { _mm_storeu_ps(four.as_mut_ptr(), reduce4(a(0), a(1), a(2), a(3))) };
            sums[j] = four;
        }
        for j in 0..J {
            for r in 0..rows {
                let mut sum = sums[j][r];
                for kk in main..inner {
                    sum += xs[r * inner + kk] * ws[j][kk];
                }
                out[j * to.col + (first + r) * to.row] = sum;
            }
        }
    }

    /// e^x for 8 lanes (Cephes' expf polynomial, ~1 ulp): a vector exp, since libm's is
    /// scalar and the per-row exps of SiLU and softmax would otherwise dominate row cost.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
            _mm256_set1_ps(88.3),
        );
        let fx = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
            _mm256_set1_ps(0.5),
        ));
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ] {
            y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
        }
        y = _mm256_fmadd_ps(
            y,
            _mm256_mul_ps(x, x),
            _mm256_add_ps(x, _mm256_set1_ps(1.0)),
        );
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(fx),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
    }

    /// `x[i] = e^(x[i] − shift)`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted(x: &mut [f32], shift: f32) {
        let s = _mm256_set1_ps(shift);
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` holds exactly 8 floats.
            unsafe {
                _mm256_storeu_ps(
                    c.as_mut_ptr(),
                    exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), s)),
                )
            };
        }
        for v in chunks.into_remainder() {
            *v = exp1(*v - shift);
        }
    }

    /// `gate[i] = silu(gate[i]) · up[i]`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        let one = _mm256_set1_ps(1.0);
        let mut g = gate.chunks_exact_mut(8);
        let mut u = up.chunks_exact(8);
        for (gc, uc) in (&mut g).zip(&mut u) {
            // SAFETY: both chunks hold exactly 8 floats.
            unsafe {
                let x = _mm256_loadu_ps(gc.as_ptr());
                let sig = _mm256_div_ps(
                    x,
                    _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))),
                );
                _mm256_storeu_ps(
                    gc.as_mut_ptr(),
                    _mm256_mul_ps(sig, _mm256_loadu_ps(uc.as_ptr())),
                );
            }
        }
        for (gv, uv) in g.into_remainder().iter_mut().zip(u.remainder()) {
            *gv = *gv / (1.0 + exp1(-*gv)) * uv;
        }
    }

    /// The same polynomial on one lane, so a row's tail matches its vector part.
    #[target_feature(enable = "avx2,fma")]
    fn exp1(x: f32) -> f32 {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds exactly 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), exp8(_mm256_set1_ps(x))) };
        lanes[0]
    }

    /// `[Σa, Σb, Σc, Σd]`, each by the tree ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn reduce4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let ab = _mm256_hadd_ps(a, b);
        let cd = _mm256_hadd_ps(c, d);
        let abcd = _mm256_hadd_ps(ab, cd);
        _mm_add_ps(
            _mm256_castps256_ps128(abcd),
            _mm256_extractf128_ps::<1>(abcd),
        )
    }

    /// Positions whose scores are computed together: their accumulators and the query's
    /// `C` chunks fill the 16 registers.
    const SCORE_BLOCK: usize = 8;

    /// One head's attention scores, `scores[s] = (q · keys[s·stride ..]) · scale` for
    /// `s < scores.len()`, with `q` (`8·C` floats) held in registers. Every position has its
    /// own accumulator, summed over the chunks in order and reduced by `reduce4`'s tree, so
    /// its score does not depend on the block it falls in.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn head_scores<const C: usize>(
        q: &[f32],
        keys: &[f32],
        stride: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let len = scores.len();
        assert!(q.len() >= 8 * C && (len == 0 || keys.len() >= (len - 1) * stride + 8 * C));
        // SAFETY (all loads below): chunk c of position s lies inside `q` / `keys` by the
        // assertion above.
        let qv: [__m256; C] =
            std::array::from_fn(|c| unsafe { _mm256_loadu_ps(q.as_ptr().add(8 * c)) });
        let key =
            |s: usize, c: usize| unsafe { _mm256_loadu_ps(keys.as_ptr().add(s * stride + 8 * c)) };
        let zero = _mm256_setzero_ps();
        let mut s = 0;
        while s + SCORE_BLOCK <= len {
            let mut acc = [zero; SCORE_BLOCK];
            for (c, qc) in qv.iter().enumerate() {
                for (p, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(*qc, key(s + p, c), *a);
                }
            }
            for (p, group) in acc.chunks_exact(4).enumerate() {
                let sums = _mm_mul_ps(
                    reduce4(group[0], group[1], group[2], group[3]),
                    _mm_set1_ps(scale),
                );
                // SAFETY: s + 4·p + 4 <= len = scores.len().
                unsafe { _mm_storeu_ps(scores.as_mut_ptr().add(s + 4 * p), sums) };
            }
            s += SCORE_BLOCK;
        }
        for (s, score) in scores.iter_mut().enumerate().skip(s) {
            let mut a = zero;
            for (c, qc) in qv.iter().enumerate() {
                a = _mm256_fmadd_ps(*qc, key(s, c), a);
            }
            *score = _mm_cvtss_f32(reduce4(a, zero, zero, zero)) * scale;
        }
    }

    /// `out = Σ_s probs[s] · values[s·stride ..]` for one head of `8·C` floats: one
    /// accumulator per chunk, summed over the positions in order.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn head_values<const C: usize>(
        probs: &[f32],
        values: &[f32],
        stride: usize,
        out: &mut [f32],
    ) {
        let len = probs.len();
        assert!(out.len() >= 8 * C && (len == 0 || values.len() >= (len - 1) * stride + 8 * C));
        let mut acc = [_mm256_setzero_ps(); C];
        for (s, &p) in probs.iter().enumerate() {
            let w = _mm256_set1_ps(p);
            for (c, a) in acc.iter_mut().enumerate() {
                // SAFETY: chunk c of position s lies inside `values` by the assertion above.
                let v = unsafe { _mm256_loadu_ps(values.as_ptr().add(s * stride + 8 * c)) };
                *a = _mm256_fmadd_ps(w, v, *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: 8·c + 8 <= out.len() by the assertion above.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *a) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// AVX-512 dot products of up to 4 rows of `xs` with `J` (1, 4 or 8) weight rows; the
    /// row count becomes a constant so that every accumulator stays in a register.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn dots<const J: usize>(
        xs: &[f32],
        ws: [&[f32]; J],
        out: &mut [f32],
        to: super::OutLayout,
        first: usize,
    ) {
        let rows = xs.len() / ws[0].len();
        // SAFETY: the caller's features; `rows` rows of `xs` exist.
        unsafe {
            match rows {
                1 => dots_rows::<1, J>(xs, ws, out, to, first),
                2 => dots_rows::<2, J>(xs, ws, out, to, first),
                3 => dots_rows::<3, J>(xs, ws, out, to, first),
                _ => dots_rows::<4, J>(xs, ws, out, to, first),
            }
        }
    }

    /// Each (row, weight row) pair has one 16-lane accumulator fed in the same order and the
    /// same reduction, whatever R and J are, so a row's
    /// result does not depend on which rows or weight rows it was grouped with.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dots_rows<const R: usize, const J: usize>(
        xs: &[f32],
        ws: [&[f32]; J],
        out: &mut [f32],
        to: super::OutLayout,
        first: usize,
    ) {
        let inner = ws[0].len();
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        let xp = xs.as_ptr();
        let mut k = 0;
        while k < inner {
            // The last chunk of a row not a multiple of 16 long loads its tail under a mask
            // (zeros elsewhere), so every chunk runs the same FMAs.
            let mask: __mmask16 = if inner - k >= 16 {
                !0
            } else {
                (1u16 << (inner - k)) - 1
            };
            // SAFETY: masked-off lanes are neither read nor faulted on and the others lie
            // within the `inner` elements of every weight row and of the R rows of `xs`; a
            // prefetch never faults.
            unsafe {
                let w: [__m512; J] =
                    std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, ws[j].as_ptr().add(k)));
                for wj in ws {
                    _mm_prefetch::<_MM_HINT_T0>(
                        wj.as_ptr().wrapping_add(k + J * inner) as *const i8
                    );
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = _mm512_maskz_loadu_ps(mask, xp.add(r * inner + k));
                    for j in 0..J {
                        a[j] = _mm512_fmadd_ps(x, w[j], a[j]);
                    }
                }
            }
            k += 16;
        }
        for (r, a) in acc.iter().enumerate() {
            store_sums(a, out, to, first + r);
        }
    }

    /// Writes `out[j·to.col + at·to.row]` = the sum of accumulator `j`'s 16 lanes, four at a time
    /// (a group of fewer repeats its last accumulator and drops the copies).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn store_sums<const J: usize>(
        acc: &[__m512; J],
        out: &mut [f32],
        to: super::OutLayout,
        at: usize,
    ) {
        for j0 in (0..J).step_by(4) {
            let lane = |j: usize| halves(acc[(j0 + j).min(J - 1)]);
            let mut four = [0f32; 4];
            // SAFETY: `four` holds exactly 4 floats.
            unsafe {
                _mm_storeu_ps(
                    four.as_mut_ptr(),
                    super::avx2::reduce4(lane(0), lane(1), lane(2), lane(3)),
                )
            };
            for (j, v) in four.iter().enumerate().take(J - j0) {
                out[(j0 + j) * to.col + at * to.row] = *v;
            }
        }
    }

    /// Lanes i and i + 8 added: the first level of every accumulator's reduction tree.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn halves(a: __m512) -> __m256 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        _mm256_add_ps(_mm512_castps512_ps256(a), hi)
    }
}

/// MXCSR bits: flush subnormal results to zero (FTZ, bit 15), read subnormal inputs as zero
/// (DAZ, bit 6).
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);

/// While alive, this thread's float operations flush subnormals to zero (FTZ and DAZ); the
/// previous mode comes back on drop. Decoding needs it: a trained model's activations go
/// subnormal (attention probabilities of scores far below the row's maximum and SiLU of very
/// negative gates can), and every vector operation that meets a subnormal takes a ~100-cycle
/// microcode assist; random-weight benchmarks never show it. Measured on the shipped model
/// with this guard in the host step (`spex bench`): 1.68× → 1.91×, baseline 382 → 425 tok/s,
/// SPEED 642 → 810 tok/s, generated text unchanged. The values lost are below 1.2·10⁻³⁸, far
/// under the rounding differences between any two Ouro implementations.
#[derive(Debug)]
pub struct SubnormalsFlushed {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl SubnormalsFlushed {
    /// Sets FTZ and DAZ on this thread until the guard drops (a no-op off x86-64).
    pub fn enter() -> Self {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: reads this thread's MXCSR and sets only its FTZ and DAZ flags; the rounding
        // mode and exception masks are kept.
        #[allow(deprecated)]
        unsafe {
            use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
            let saved = _mm_getcsr();
            _mm_setcsr(saved | FTZ_DAZ);
            Self { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self {}
    }
}

impl Drop for SubnormalsFlushed {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: restores the MXCSR value this thread had when the guard was made.
        #[allow(deprecated)]
        unsafe {
            std::arch::x86_64::_mm_setcsr(self.saved);
        }
    }
}

/// A dot product with a fixed summation order (vectorisable by the compiler).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    portable::dot(a, b)
}

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`: x / sqrt(mean(x²) + eps) · weight.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// Rotary embedding in the rotate-half ("NeoX") layout, in place, on every head of one row.
/// `cos`/`sin` hold `head_dim / 2` values for the row's position.
pub fn rope_row(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (x1, x2) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

/// Shapes for one row's attention over its pass's cache.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Causal single-query attention of one row: `q` [heads·head_dim] against the first `len`
/// positions of `keys`/`values` ([positions × kv_heads·head_dim]); GQA maps head h to kv head
/// h / (heads / kv_heads). `scores` is scratch space.
pub fn attend_row(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    shape: AttnShape,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { attend_row_avx2(q, keys, values, len, shape, out, scores) },
        _ => attend_row_impl(q, keys, values, len, shape, out, scores),
    }
}

/// Head-major attention with the query head and the output head in registers (`head_dim`
/// 64 or 128; other sizes take the portable loops compiled with AVX2). Ten times fewer
/// instructions than the portable loops, whose per-position horizontal sums made attention
/// compute-bound even with the cache in L2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_row_avx2(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    shape: AttnShape,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let AttnShape {
        heads,
        kv_heads,
        head_dim,
    } = shape;
    if head_dim != 64 && head_dim != 128 {
        return attend_row_impl(q, keys, values, len, shape, out, scores);
    }
    let (kv_dim, group) = (kv_heads * head_dim, heads / kv_heads);
    let scale = 1.0 / (head_dim as f32).sqrt();
    scores.clear();
    scores.resize(heads * len, 0.0);
    for (h, head_scores) in scores.chunks_exact_mut(len).enumerate() {
        let (qh, kh) = (&q[h * head_dim..], &keys[(h / group) * head_dim..]);
        // SAFETY: AVX2 and FMA are enabled for this function; the kernels check the bounds.
        unsafe {
            match head_dim {
                64 => avx2::head_scores::<8>(qh, kh, kv_dim, scale, head_scores),
                _ => avx2::head_scores::<16>(qh, kh, kv_dim, scale, head_scores),
            }
        }
        softmax_in_place(head_scores);
    }
    for (h, oh) in out.chunks_exact_mut(head_dim).take(heads).enumerate() {
        let (probs, vh) = (
            &scores[h * len..(h + 1) * len],
            &values[(h / group) * head_dim..],
        );
        // SAFETY: as above.
        unsafe {
            match head_dim {
                64 => avx2::head_values::<8>(probs, vh, kv_dim, oh),
                _ => avx2::head_values::<16>(probs, vh, kv_dim, oh),
            }
        }
    }
}

#[inline(always)]
fn attend_row_impl(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    shape: AttnShape,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let AttnShape {
        heads,
        kv_heads,
        head_dim,
    } = shape;
    let kv_dim = kv_heads * head_dim;
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    // Position-major loops: each cached K and V row is read once, front to back, for all
    // heads, so the hardware prefetcher sees one sequential stream (the cache is evicted by
    // the weights every step). Per head the arithmetic and its order are those of the
    // head-major loop, so the results do not change.
    scores.clear();
    scores.resize(heads * len, 0.0);
    for (s, k) in keys.chunks_exact(kv_dim).take(len).enumerate() {
        for h in 0..heads {
            let kv_off = (h / group) * head_dim;
            let qh = &q[h * head_dim..(h + 1) * head_dim];
            scores[h * len + s] = dot(qh, &k[kv_off..kv_off + head_dim]) * scale;
        }
    }
    for head_scores in scores.chunks_exact_mut(len) {
        softmax_in_place(head_scores);
    }
    out.fill(0.0);
    for (s, v) in values.chunks_exact(kv_dim).take(len).enumerate() {
        for (h, oh) in out.chunks_exact_mut(head_dim).take(heads).enumerate() {
            let kv_off = (h / group) * head_dim;
            let p = scores[h * len + s];
            for (o, vv) in oh.iter_mut().zip(&v[kv_off..kv_off + head_dim]) {
                *o += p * vv;
            }
        }
    }
}

/// Numerically stable softmax, in place.
#[inline(always)]
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { avx2::exp_shifted(x, max) },
        _ => x.iter_mut().for_each(|v| *v = (*v - max).exp()),
    }
    let sum: f32 = x.iter().sum();
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// SiLU(gate) · up, element-wise, into `gate`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { avx2::silu_mul(gate, up) },
        _ => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    fn transposed(rows: usize) -> OutLayout {
        OutLayout { col: rows, row: 1 }
    }

    /// The instruction sets this CPU can run, the detected one last.
    fn supported_isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Portable];
        if isa().has_avx2() {
            isas.push(Isa::Avx2Fma);
        }
        if isa() == Isa::Avx512 {
            isas.push(Isa::Avx512);
        }
        isas
    }

    #[test]
    fn matmul_is_row_invariant() {
        let mut seed = 7;
        let (inner, outs) = (37, 300_000 / 37 + 5);
        let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..6 * inner).map(|_| lcg(&mut seed)).collect();
        let mut all = vec![0f32; 6 * outs];
        matmul_t(&x, &w, 6, inner, &mut all);
        for m in 0..6 {
            let mut one = vec![0f32; outs];
            matmul_t(&x[m * inner..(m + 1) * inner], &w, 1, inner, &mut one);
            assert_eq!(one, all[m * outs..(m + 1) * outs], "row {m}");
        }
    }

    #[test]
    fn every_isa_is_row_invariant_on_tails_and_odd_groups() {
        let mut seed = 11;
        // 13 weight rows leave remainders for every group size; 203 and 40 leave lane tails.
        for inner in [203, 40, 16, 5] {
            let outs = 13;
            let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
            let x: Vec<f32> = (0..8 * inner).map(|_| lcg(&mut seed)).collect();
            for isa in supported_isas() {
                let mut all = vec![0f32; 8 * outs];
                matmul_t_serial(isa, &x, &w, 8, inner, &mut all, transposed(8));
                for rows in 1..=7 {
                    let mut some = vec![0f32; rows * outs];
                    let to = transposed(rows);
                    matmul_t_serial(isa, &x[..rows * inner], &w, rows, inner, &mut some, to);
                    for (j, col) in some.chunks_exact(rows).enumerate() {
                        assert_eq!(col, &all[j * 8..j * 8 + rows], "{isa:?} {inner} {rows}");
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_matches_candle_on_odd_shapes() {
        use candle_core::{Device, Tensor};
        let mut seed = 3;
        for &(rows, inner, outs) in &[
            (1, 1, 1),
            (1, 7, 5),
            (2, 17, 33),
            (3, 31, 9),
            (4, 64, 64),
            (5, 100, 3),
            (7, 257, 129),
            (13, 15, 1000),
            (4, 256, 1100),
        ] {
            let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
            let x: Vec<f32> = (0..rows * inner).map(|_| lcg(&mut seed)).collect();
            let mut out = vec![0f32; rows * outs];
            matmul_t(&x, &w, rows, inner, &mut out);
            let xt = Tensor::from_slice(&x, (rows, inner), &Device::Cpu).unwrap();
            let wt = Tensor::from_slice(&w, (outs, inner), &Device::Cpu).unwrap();
            let expect: Vec<f32> = xt
                .matmul(&wt.t().unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for (a, b) in out.iter().zip(&expect) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{rows}x{inner}x{outs}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn every_isa_agrees_closely_with_portable() {
        let mut seed = 5;
        let (inner, outs) = (203, 17);
        let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..3 * inner).map(|_| lcg(&mut seed)).collect();
        let mut a = vec![0f32; 3 * outs];
        matmul_t_serial(Isa::Portable, &x, &w, 3, inner, &mut a, transposed(3));
        for isa in supported_isas() {
            let mut b = vec![0f32; 3 * outs];
            matmul_t_serial(isa, &x, &w, 3, inner, &mut b, transposed(3));
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() < 1e-4, "{isa:?}: {p} vs {q}");
            }
        }
    }

    #[test]
    fn attention_kernels_agree_closely_with_the_portable_loops() {
        let mut seed = 13;
        for head_dim in [64, 128, 32] {
            for (heads, kv_heads) in [(4, 4), (4, 2)] {
                for len in [1, 7, 8, 9, 33] {
                    let shape = AttnShape {
                        heads,
                        kv_heads,
                        head_dim,
                    };
                    let mut random = |n: usize| (0..n).map(|_| 4.0 * lcg(&mut seed)).collect();
                    let q: Vec<f32> = random(heads * head_dim);
                    let keys: Vec<f32> = random(len * kv_heads * head_dim);
                    let values: Vec<f32> = random(len * kv_heads * head_dim);
                    let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                    attend_row_impl(&q, &keys, &values, len, shape, &mut a, &mut Vec::new());
                    attend_row(&q, &keys, &values, len, shape, &mut b, &mut Vec::new());
                    for (x, y) in a.iter().zip(&b) {
                        assert!((x - y).abs() < 1e-5, "{shape:?} len {len}: {x} vs {y}");
                    }
                }
            }
        }
    }

    #[test]
    fn attention_over_one_position_returns_its_value() {
        let shape = AttnShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        let q = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let k = [0.5, 0.5, 0.5, 0.5];
        let v = [1.0, 2.0, 3.0, 4.0];
        let mut out = [0f32; 8];
        attend_row(&q, &k, &v, 1, shape, &mut out, &mut Vec::new());
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
    }
}
