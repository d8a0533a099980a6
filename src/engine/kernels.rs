//! CPU kernels for the decode step on f32 host memory: a small-M matmul that reads each weight
//! row once for all M rows, RMSNorm, rotary embedding, single-query attention, SiLU, softmax.
//! Called by `model::host` only; GPU devices use candle's own kernels instead.
//!
//! Why a kernel of our own: candle's CPU matmul for 2–6 rows costs ~5× its 1-row time, which
//! erases SPEED's gain (speculation.md §6). Here every output element of row `m` is computed
//! with the same arithmetic whatever M is and however the work is split between threads, so a
//! token's hidden state does not depend on which other rows shared its step: speculative and
//! baseline decoding agree bit for bit.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Rows of `x` processed together against one weight row (registers hold 2 accumulators each).
const ROW_BLOCK: usize = 4;
/// Weight matrices with at least this many elements are split across threads by output rows.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 18;

/// Which instruction set the matmul uses, chosen once per process at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx2Fma,
    Portable,
}

/// The instruction set detected on this CPU (AVX2 + FMA, or the portable fallback).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Isa::Avx2Fma;
        }
        Isa::Portable
    })
}

/// `out[m][j] = Σ_k x[m][k] · w[j][k]` for `x: [rows × inner]`, `w: [outs × inner]` (a linear
/// layer's weight as stored, no transpose), `out: [rows × outs]`.
pub fn matmul_t(x: &[f32], w: &[f32], rows: usize, inner: usize, out: &mut [f32]) {
    let outs = w.len() / inner;
    debug_assert_eq!(x.len(), rows * inner);
    debug_assert_eq!(out.len(), rows * outs);
    let mut out_t = vec![0f32; outs * rows];
    let isa = isa();
    if w.len() >= PARALLEL_MIN_ELEMENTS && rayon::current_num_threads() > 1 {
        let chunk_outs = outs.div_ceil(rayon::current_num_threads() * 2).max(16);
        out_t
            .par_chunks_mut(chunk_outs * rows)
            .zip(w.par_chunks(chunk_outs * inner))
            .for_each(|(o, w)| matmul_t_serial(isa, x, w, rows, inner, o));
    } else {
        matmul_t_serial(isa, x, w, rows, inner, &mut out_t);
    }
    for (j, col) in out_t.chunks_exact(rows).enumerate() {
        for (m, v) in col.iter().enumerate() {
            out[m * outs + j] = *v;
        }
    }
}

/// One thread's share: writes `out_t[j][m]` (transposed) for the weight rows in `w`.
fn matmul_t_serial(isa: Isa, x: &[f32], w: &[f32], rows: usize, inner: usize, out_t: &mut [f32]) {
    for (w_row, out_col) in w.chunks_exact(inner).zip(out_t.chunks_exact_mut(rows)) {
        for (block, out_block) in x
            .chunks(ROW_BLOCK * inner)
            .zip(out_col.chunks_mut(ROW_BLOCK))
        {
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa()` returns Avx2Fma only after detecting both features at run time.
                Isa::Avx2Fma => unsafe { avx2::dots(block, w_row, out_block) },
                _ => portable::dots(block, w_row, out_block),
            }
        }
    }
}

mod portable {
    /// Dot products of up to `ROW_BLOCK` rows of `xs` with `w`, in 8 lanes × 2 accumulators,
    /// the same order for every row whatever the block size.
    pub fn dots(xs: &[f32], w: &[f32], out: &mut [f32]) {
        let inner = w.len();
        for (x, o) in xs.chunks_exact(inner).zip(out.iter_mut()) {
            *o = dot(x, w);
        }
    }

    pub fn dot(x: &[f32], w: &[f32]) -> f32 {
        let mut acc = [[0f32; 8]; 2];
        let mut xc = x.chunks_exact(16);
        let mut wc = w.chunks_exact(16);
        for (xs, ws) in (&mut xc).zip(&mut wc) {
            for lane in 0..8 {
                acc[0][lane] += xs[lane] * ws[lane];
                acc[1][lane] += xs[8 + lane] * ws[8 + lane];
            }
        }
        let mut sum = 0f32;
        for lane in 0..8 {
            sum += acc[0][lane] + acc[1][lane];
        }
        for (a, b) in xc.remainder().iter().zip(wc.remainder()) {
            sum += a * b;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// AVX2/FMA dot products of up to 4 rows with one weight row: the weight chunk is loaded
    /// once and used by every row. Each row's arithmetic is identical for any block size.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(xs: &[f32], w: &[f32], out: &mut [f32]) {
        let inner = w.len();
        let rows = out.len().min(xs.len() / inner);
        let main = inner - inner % 16;
        let mut acc = [[_mm256_setzero_ps(); 2]; super::ROW_BLOCK];
        let wp = w.as_ptr();
        let xp = xs.as_ptr();
        let mut k = 0;
        while k < main {
            // SAFETY: k + 16 <= inner, and every row r < rows has `inner` elements in `xs`.
            unsafe {
                let w0 = _mm256_loadu_ps(wp.add(k));
                let w1 = _mm256_loadu_ps(wp.add(k + 8));
                for (r, a) in acc.iter_mut().enumerate().take(rows) {
                    let x = xp.add(r * inner + k);
                    a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, a[0]);
                    a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8)), w1, a[1]);
                }
            }
            k += 16;
        }
        for (r, a) in acc.iter().enumerate().take(rows) {
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds exactly 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(a[0], a[1])) };
            let mut sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
                + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            for kk in main..inner {
                sum += xs[r * inner + kk] * w[kk];
            }
            out[r] = sum;
        }
    }
}

/// A dot product with a fixed summation order (vectorisable by the compiler).
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
    let AttnShape {
        heads,
        kv_heads,
        head_dim,
    } = shape;
    let kv_dim = kv_heads * head_dim;
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    for h in 0..heads {
        let kv_off = (h / group) * head_dim;
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        scores.clear();
        scores.extend((0..len).map(|s| {
            let k = &keys[s * kv_dim + kv_off..s * kv_dim + kv_off + head_dim];
            dot(qh, k) * scale
        }));
        softmax_in_place(scores);
        let oh = &mut out[h * head_dim..(h + 1) * head_dim];
        oh.fill(0.0);
        for (s, p) in scores.iter().enumerate() {
            let v = &values[s * kv_dim + kv_off..s * kv_dim + kv_off + head_dim];
            for (o, vv) in oh.iter_mut().zip(v) {
                *o += p * vv;
            }
        }
    }
}

/// Numerically stable softmax, in place.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// SiLU(gate) · up, element-wise, into `gate`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
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
    fn portable_and_detected_isa_agree_closely() {
        let mut seed = 5;
        let (inner, outs) = (203, 17);
        let w: Vec<f32> = (0..outs * inner).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..3 * inner).map(|_| lcg(&mut seed)).collect();
        let (mut a, mut b) = (vec![0f32; 3 * outs], vec![0f32; 3 * outs]);
        matmul_t_serial(Isa::Portable, &x, &w, 3, inner, &mut a);
        matmul_t_serial(isa(), &x, &w, 3, inner, &mut b);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-4);
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
