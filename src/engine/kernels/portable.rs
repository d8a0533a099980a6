//! The portable kernels: plain loops, vectorised by the compiler, for CPUs without AVX2. Their
//! summation trees are the vector kernels' (`hsum8` is `avx2::reduce4`'s), and the tests hold
//! every ISA to them.

use super::{AttnShape, OutLayout, SharedOut};

/// Dot products of up to `ROW_BLOCK` rows of `xs` with each weight row in `ws`. Every
/// (row, weight row) pair uses one 8-lane accumulator and the same order, whatever the
/// block sizes.
pub fn dots<const J: usize>(
    xs: &[f32],
    ws: [&[f32]; J],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let inner = ws[0].len();
    for (j, w) in ws.iter().enumerate() {
        for (r, x) in xs.chunks_exact(inner).enumerate() {
            out.set(j * to.col + (first + r) * to.row, dot(x, w));
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
    let mut sum = hsum8(&acc);
    for (a, b) in xc.remainder().iter().zip(wc.remainder()) {
        sum += a * b;
    }
    sum
}

/// The horizontal sum of 8 lanes, in the tree the AVX2 kernel's `reduce4` uses.
#[inline(always)]
pub(super) fn hsum8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// Causal single-query attention of one row, position-major (see `super::attend_row`).
#[inline(always)]
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
        super::softmax_in_place(head_scores);
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
