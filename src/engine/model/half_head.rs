//! Proposal readouts through an f16 copy of the LM head, with commits kept exact. Only pass
//! R's readout decides what is committed (`engine::pipeline`, "The step"); earlier readouts are proposals
//! and only steer speculation. On CPU every SPEED step reads out every row, and the LM head is
//! a quarter of a step's weight bytes on the shipped model, so half the bytes there shortens
//! the speculative step (the baseline reads out one step in R).
//!
//! A pass-R readout is screened: the f16 logits are within `error_bound` of the f32 head's, so
//! the f32 argmax lies among the logits within twice the bound of the largest, and those are
//! recomputed with the f32 kernel (the same arithmetic the f32 head uses for that pair), which
//! makes the argmax exactly the f32 head's, ties included. Called by `model::host` only.

use crate::engine::kernels::Kernels;
use crate::engine::kernels::f16::{self, PackedF16};

/// The LM head in f16, with what its error bound needs.
#[derive(Debug, Clone)]
pub struct HalfHead {
    weights: PackedF16,
    inner: usize,
    vocab: usize,
    /// The largest L2 norm of a weight row, for Cauchy–Schwarz in `error_bound`.
    max_row_norm: f64,
}

impl HalfHead {
    /// An f16 copy of `lm_head` (`[vocab × inner]`), or `None` where it would not be faster
    /// (no vectorised f16 kernel on this CPU) or not faithful (a weight outside f16's range,
    /// or not finite).
    pub fn new(lm_head: &[f32], inner: usize, kernels: &Kernels) -> Option<Self> {
        if !f16::fast(kernels) || lm_head.iter().any(|w| !w.is_finite() || w.abs() > 65504.0) {
            return None;
        }
        let max_row_norm = lm_head
            .chunks_exact(inner)
            .map(|row| {
                row.iter()
                    .map(|&w| f64::from(w).powi(2))
                    .sum::<f64>()
                    .sqrt()
            })
            .fold(0.0, f64::max);
        Some(Self {
            weights: PackedF16::new(lm_head, inner),
            inner,
            vocab: lm_head.len() / inner,
            max_row_norm,
        })
    }

    /// An upper bound on |f32-head logit − f16-head logit| for the normed state `x`, every
    /// vocabulary entry. With S = Σ|xᵢ·wᵢ| ≤ ‖x‖₂·‖w‖₂ and f32 summation error γₙ·S (any order,
    /// n = inner): f16 rounding moves the exact sum by ≤ 2⁻¹¹·S + 2⁻²⁵·‖x‖₁ (relative in f16's
    /// normal range, absolute in its subnormal one), and each computed sum is off by
    /// ≤ γₙ·(1 + 2⁻¹¹)·S + γₙ·2⁻²⁵·‖x‖₁. Products flushed as subnormal add ≤ n·2⁻¹²⁶ each.
    pub fn error_bound(&self, x: &[f32]) -> f64 {
        let n = self.inner as f64;
        let gamma = 1.01 * n * f64::from(f32::EPSILON) / 2.0;
        let (u16, tiny) = (2f64.powi(-11), 2f64.powi(-25));
        let l2 = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        let l1: f64 = x.iter().map(|&v| f64::from(v).abs()).sum();
        let s = l2 * self.max_row_norm;
        let bound = (u16 + gamma * (2.0 + u16)) * s + (1.0 + gamma) * tiny * l1;
        // The bound's own f64 arithmetic, and the flushed products.
        bound * (1.0 + 1e-9) + 2.0 * n * 2f64.powi(-126)
    }

    /// Logits for the rows of `x` (`[rows × inner]`); rows with `exact[m]` are screened against
    /// `f32_head` so that their argmax is the f32 head's. The buffer is a recycled one
    /// (`host_buffers`): the product writes every logit.
    pub fn readouts(
        &self,
        kernels: &Kernels,
        x: &[f32],
        exact: &[bool],
        f32_head: &[f32],
    ) -> Vec<f32> {
        let (rows, vocab) = (exact.len(), self.vocab);
        let mut out = super::host_buffers::take(rows * vocab);
        self.weights.matmul(kernels, x, rows, &mut out);
        for ((xr, logits), _) in x
            .chunks_exact(self.inner)
            .zip(out.chunks_exact_mut(vocab))
            .zip(exact)
            .filter(|(_, e)| **e)
        {
            self.screen(kernels, xr, logits, f32_head);
        }
        out
    }

    /// Recomputes with the f32 head every logit that could be the f32 argmax.
    fn screen(&self, kernels: &Kernels, x: &[f32], logits: &mut [f32], f32_head: &[f32]) {
        let inner = self.inner;
        let bound = self.error_bound(x);
        if !bound.is_finite() || logits.iter().any(|l| !l.is_finite()) {
            kernels.matmul_t(x, f32_head.into(), 1, inner, logits);
            return;
        }
        let top = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let floor = f64::from(top) - 2.0 * bound;
        for (j, l) in logits.iter_mut().enumerate() {
            if f64::from(*l) >= floor {
                let row = &f32_head[j * inner..(j + 1) * inner];
                kernels.matmul_t(x, row.into(), 1, inner, std::slice::from_mut(l));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::SplitMix;

    fn normal(rng: &mut SplitMix, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                (u - 0.5) * 2.0 * scale
            })
            .collect()
    }

    fn argmax(v: &[f32]) -> usize {
        (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
    }

    #[test]
    fn screened_readouts_have_the_f32_heads_argmax_and_approximate_within_the_bound() {
        let (inner, vocab) = (64, 300);
        let mut rng = SplitMix(7);
        let mut head = normal(&mut rng, vocab * inner, 0.5);
        // Near-ties the f16 head cannot separate: rows that differ in one low bit.
        for j in (0..vocab).step_by(3) {
            let (a, b) = head.split_at_mut((j + 1) * inner);
            b[..inner].copy_from_slice(&a[j * inner..]);
            b[5] = f32::from_bits(b[5].to_bits() ^ 1);
        }
        let kernels = Kernels::single_threaded();
        let Some(half) = HalfHead::new(&head, inner, &kernels) else {
            return; // no AVX-512 here: the f32 head is used and nothing is screened.
        };
        for rows in 1..=5 {
            let x = normal(&mut rng, rows * inner, 3.0);
            let mut exact = vec![0f32; rows * vocab];
            kernels.matmul_t(&x, (&head).into(), rows, inner, &mut exact);
            let proposals = half.readouts(&kernels, &x, &vec![false; rows], &head);
            let commits = half.readouts(&kernels, &x, &vec![true; rows], &head);
            for m in 0..rows {
                let r = m * vocab..(m + 1) * vocab;
                let bound = half.error_bound(&x[m * inner..(m + 1) * inner]);
                for (p, e) in proposals[r.clone()].iter().zip(&exact[r.clone()]) {
                    assert!(
                        f64::from((p - e).abs()) <= bound,
                        "{p} vs {e}, bound {bound}"
                    );
                }
                assert_eq!(argmax(&commits[r.clone()]), argmax(&exact[r.clone()]));
                let top = argmax(&exact[r.clone()]);
                assert_eq!(commits[r][top].to_bits(), exact[m * vocab + top].to_bits());
            }
        }
    }
}
