//! The portable kernels: plain loops, vectorised by the compiler, for CPUs without AVX2. Their
//! summation trees are the vector kernels' (`hsum8` is `avx2::reduce4`'s), and the tests hold
//! every ISA to them.

use super::kv_element::KvElement;
use super::{OutLayout, SharedOut, WeightElement};

/// Dot products of up to `ROW_BLOCK` rows of `xs` with each weight row of `w` (rows of
/// `inner`; `J` only sets the grouping, which changes nothing here). Every (row, weight row)
/// pair uses one 8-lane accumulator and the same order, whatever the block sizes.
pub fn dots<const J: usize, W: WeightElement>(
    xs: &[f32],
    w: &[W],
    inner: usize,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    for (j, w_row) in w.chunks_exact(inner).enumerate() {
        for (r, x) in xs.chunks_exact(inner).enumerate() {
            out.set(j * to.col + (first + r) * to.row, dot(x, w_row));
        }
    }
}

/// `x · w` with 8 partial sums in order of k, reduced by [`hsum8`]; weights widened exactly.
#[inline(always)]
pub fn dot<W: WeightElement>(x: &[f32], w: &[W]) -> f32 {
    let mut acc = [0f32; 8];
    let mut xc = x.chunks_exact(8);
    let mut wc = w.chunks_exact(8);
    for (xs, ws) in (&mut xc).zip(&mut wc) {
        for (a, (x, w)) in acc.iter_mut().zip(xs.iter().zip(ws)) {
            *a += x * w.to_f32();
        }
    }
    let mut sum = hsum8(&acc);
    for (a, b) in xc.remainder().iter().zip(wc.remainder()) {
        sum += a * b.to_f32();
    }
    sum
}

/// The horizontal sum of 8 lanes, in the tree the AVX2 kernel's `reduce4` uses.
#[inline(always)]
pub(super) fn hsum8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// Numerically stable softmax in place, the sum in `avx2::softmax`'s order (8 lanes, the
/// `hsum8` tree, then the tail).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    x.iter_mut().for_each(|v| *v = (*v - max).exp());
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    let sum = chunks.remainder().iter().fold(hsum8(&lanes), |s, v| s + v);
    x.iter_mut().for_each(|v| *v /= sum);
}

/// One head's attention scores, `scores[s] = (q · keys[s·stride ..][..q.len()]) · scale`, each
/// key widened to f32 (exactly) first, so an f16 cache sums as its f32 values would.
pub fn head_scores<E: KvElement>(
    q: &[f32],
    keys: &[E],
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let mut wide = Widened::default();
    for (s, score) in scores.iter_mut().enumerate() {
        let key = wide.of(&keys[s * stride..s * stride + q.len()]);
        *score = dot(q, key) * scale;
    }
}

/// `out += Σ_s probs[s] · values[s·stride ..][..out.len()]` for one head, the positions in
/// order.
pub fn head_values<E: KvElement>(probs: &[f32], values: &[E], stride: usize, out: &mut [f32]) {
    let (width, mut wide) = (out.len(), Widened::default());
    for (s, &p) in probs.iter().enumerate() {
        let value = wide.of(&values[s * stride..s * stride + width]);
        for (o, v) in out.iter_mut().zip(value) {
            *o += p * v;
        }
    }
}

/// A cache row as f32: an f32 row as it is, another element type widened into a buffer by
/// half's slice conversion, which uses the CPU's f16 instructions where it has them (NEON's
/// on aarch64; element by element the conversion would not vectorise).
#[derive(Default)]
struct Widened(Vec<f32>);

impl Widened {
    fn of<'a, E: KvElement>(&'a mut self, row: &'a [E]) -> &'a [f32] {
        if let Some(row) = E::as_f32(row) {
            return row;
        }
        self.0.resize(row.len(), 0.0);
        E::widen(row, &mut self.0);
        &self.0
    }
}
