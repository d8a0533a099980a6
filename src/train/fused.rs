//! Fused CPU training ops with hand-written backward passes: RMSNorm, rotary embedding, the
//! causal softmax of attention and a cross-entropy against a mix of hard and soft targets.
//! candle's composed versions make one full-size temporary per primitive op, forward and
//! backward; at training shapes that elementwise traffic cost more than the matmuls (issue 3:
//! the gemm microkernel was the lesser part of a training step). Training's sequence forward
//! uses them on CPU f32 ([`Fused`], a `SequenceOps`) and the composed ops on other devices; the
//! tests check both give the same values and gradients. Rows are processed in parallel in
//! fixed chunks, and reductions across rows are summed in chunk order, so training stays
//! deterministic.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::engine::custom_op::cpu_operand;
use crate::engine::error::Result;
use crate::engine::kernels;
use crate::engine::model::Rope as RopeTables;
use crate::engine::model::reference::{Composed, SequenceOps};

type CResult<T> = candle_core::Result<T>;

/// The fused ops as the sequence forward's elementwise ops (CPU f32 only).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fused;

impl Fused {
    /// Whether the fused ops run on `t`'s device and dtype (CPU f32).
    pub fn runs_on(t: &Tensor) -> bool {
        t.device().is_cpu() && t.dtype() == candle_core::DType::F32
    }

    /// The fused ops where they run (`t` on CPU in f32), candle's composed ones elsewhere.
    pub fn where_they_run(t: &Tensor) -> &'static dyn SequenceOps {
        if Self::runs_on(t) { &Fused } else { &Composed }
    }
}

impl SequenceOps for Fused {
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        Ok(rms_norm(x, weight, eps)?)
    }

    fn rope(&self, x: &Tensor, rope: &RopeTables) -> Result<Tensor> {
        Ok(self::rope(x, &rope.cos, &rope.sin, rope.half)?)
    }

    /// The mask is implied: the fused softmax is causal by construction.
    fn causal_softmax(&self, scores: &Tensor, scale: f64, _mask: &Tensor) -> Result<Tensor> {
        Ok(causal_softmax(scores, scale)?)
    }
}

/// Rows handed to one rayon task: big enough that scheduling costs nothing next to the work.
const ROWS_PER_TASK: usize = 64;

/// An f32 operand's elements, checked contiguous (`custom_op::cpu_operand`).
fn contiguous<'a>(s: &'a CpuStorage, l: &Layout, op: &'static str) -> CResult<&'a [f32]> {
    cpu_operand(op, s, l, "an operand")
}

fn last_dim(shape: &Shape, op: &'static str) -> CResult<usize> {
    match shape.dims().last() {
        Some(&d) if d > 0 => Ok(d),
        _ => bail!("{op}: needs a non-empty last dimension, got {shape:?}"),
    }
}

/// `x · rsqrt(mean(x²) + eps) · weight` over the last dimension.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, self.name())?;
        let w = contiguous(s2, l2, self.name())?;
        let h = last_dim(l1.shape(), self.name())?;
        if w.len() != h {
            bail!(
                "fused-rms-norm: weight has {} values for rows of {h}",
                w.len()
            );
        }
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .for_each(|(yc, xc)| {
                for (yr, xr) in yc.chunks_mut(h).zip(xc.chunks(h)) {
                    kernels::rms_norm(xr, w, self.eps, yr);
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let h = w.elem_count();
        let rows = x.elem_count() / h;
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &RmsNormGrad { eps: self.eps })?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = packed.narrow(0, rows, 1)?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The gradients of RMSNorm packed as `[rows + 1, hidden]`: dx, then dweight.
struct RmsNormGrad {
    eps: f32,
}

impl RmsNormGrad {
    /// With r = rsqrt(mean(x²) + eps): dx = r·g·w − r³·x·Σ(g·w·x)/H, dw += r·g·x.
    fn rows(&self, x: &[f32], w: &[f32], g: &[f32], dx: &mut [f32], dw: &mut [f32]) {
        let h = w.len();
        for ((xr, gr), dxr) in x.chunks(h).zip(g.chunks(h)).zip(dx.chunks_mut(h)) {
            let mean_sq = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (mean_sq + self.eps).sqrt();
            let gwx: f32 = (0..h).map(|i| gr[i] * w[i] * xr[i]).sum();
            let c = r * r * r * gwx / h as f32;
            for i in 0..h {
                dxr[i] = r * gr[i] * w[i] - c * xr[i];
                dw[i] += r * gr[i] * xr[i];
            }
        }
    }
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "fused-rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, self.name())?;
        let w = contiguous(s2, l2, self.name())?;
        let g = contiguous(s3, l3, self.name())?;
        let h = w.len();
        let rows = x.len() / h;
        let mut out = vec![0f32; (rows + 1) * h];
        let (dx, dw) = out.split_at_mut(rows * h);
        let chunk = h * ROWS_PER_TASK;
        let partials: Vec<Vec<f32>> = dx
            .par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk).zip(g.par_chunks(chunk)))
            .map(|(dxc, (xc, gc))| {
                let mut part = vec![0f32; h];
                self.rows(xc, w, gc, dxc, &mut part);
                part
            })
            .collect();
        for part in partials {
            dw.iter_mut().zip(part).for_each(|(d, p)| *d += p);
        }
        Ok((CpuStorage::F32(out), Shape::from((rows + 1, h))))
    }
}

/// Rotary embedding of `x` `[batch, heads, seq, head_dim]` with tables `[positions, head_dim/2]`
/// (the rotate-half convention of `candle_nn::rotary_emb::rope_slow`).
pub fn rope(x: &Tensor, cos: &[f32], sin: &[f32], half: usize) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Rope {
        cos: cos.to_vec(),
        sin: sin.to_vec(),
        half,
        inverse: false,
    })
}

struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    /// Rotates by −θ: the transpose of the rotation, i.e. its backward pass.
    inverse: bool,
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous(s, l, self.name())?;
        let (_, _, seq, head_dim) = l.shape().dims4()?;
        let half = self.half;
        if head_dim != 2 * half || seq * half > self.cos.len() {
            bail!("fused-rope: shape {:?} does not fit the tables", l.shape());
        }
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(head_dim * seq)
            .zip(x.par_chunks(head_dim * seq))
            .for_each(|(yc, xc)| {
                for (t, (yr, xr)) in yc.chunks_mut(head_dim).zip(xc.chunks(head_dim)).enumerate() {
                    let (cos, sin) = (&self.cos[t * half..], &self.sin[t * half..]);
                    for i in 0..half {
                        let (x1, x2, s) = (xr[i], xr[i + half], sign * sin[i]);
                        yr[i] = x1 * cos[i] - x2 * s;
                        yr[i + half] = x2 * cos[i] + x1 * s;
                    }
                }
            });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let inverse = Rope {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            half: self.half,
            inverse: !self.inverse,
        };
        Ok(Some(grad.contiguous()?.apply_op1(inverse)?))
    }
}

/// Causal softmax of `scale · scores` over the last dimension of `[.., seq, seq]`: row i
/// attends to columns 0..=i; later columns get probability 0.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    scores.contiguous()?.apply_op1(CausalSoftmax {
        scale: scale as f32,
    })
}

struct CausalSoftmax {
    scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "fused-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = contiguous(s, l, self.name())?;
        let seq = last_dim(l.shape(), self.name())?;
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(seq * seq)
            .zip(x.par_chunks(seq * seq))
            .for_each(|(yc, xc)| {
                for (i, (yr, xr)) in yc.chunks_mut(seq).zip(xc.chunks(seq)).enumerate() {
                    let visible = &mut yr[..=i];
                    visible
                        .iter_mut()
                        .zip(xr)
                        .for_each(|(o, v)| *o = v * self.scale);
                    kernels::softmax_in_place(visible);
                }
            });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad_x = y.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad { scale: self.scale })?;
        Ok(Some(grad_x))
    }
}

/// dx = scale · y · (g − Σ g·y), row by row.
struct SoftmaxGrad {
    scale: f32,
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let y = contiguous(s1, l1, self.name())?;
        let g = contiguous(s2, l2, self.name())?;
        let n = last_dim(l1.shape(), self.name())?;
        let mut dx = vec![0f32; y.len()];
        let chunk = n * ROWS_PER_TASK;
        dx.par_chunks_mut(chunk)
            .zip(y.par_chunks(chunk).zip(g.par_chunks(chunk)))
            .for_each(|(dc, (yc, gc))| {
                for ((dr, yr), gr) in dc.chunks_mut(n).zip(yc.chunks(n)).zip(gc.chunks(n)) {
                    let dot = kernels::dot(yr, gr);
                    for i in 0..n {
                        dr[i] = self.scale * yr[i] * (gr[i] - dot);
                    }
                }
            });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Mean cross-entropy of `logits` `[rows, vocab]` against targets that mix the one-hot
/// `targets` (weight 1 − `soft_weight`) with the distributions `soft` `[rows, vocab]`
/// (weight `soft_weight`; ignored when it is 0). Returns `[2]`: the mixed loss and the plain
/// hard-target loss; both are differentiable.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &[u32],
    soft: &Tensor,
    soft_weight: f64,
) -> candle_core::Result<Tensor> {
    let op = CrossEntropy {
        targets: targets.to_vec(),
        soft_weight: soft_weight as f32,
        grad: None,
    };
    logits.contiguous()?.apply_op2(&soft.contiguous()?, op)
}

struct CrossEntropy {
    targets: Vec<u32>,
    soft_weight: f32,
    /// In the backward op: the incoming gradients of the mixed and the hard loss.
    grad: Option<(f32, f32)>,
}

/// What the forward op computes per row: (mixed loss, hard loss).
fn row_losses(z: &[f32], lse: f32, target: usize, q: Option<&[f32]>, alpha: f32) -> (f32, f32) {
    let hard = lse - z[target];
    let soft = q.map_or(0.0, |q| lse - kernels::dot(q, z));
    ((1.0 - alpha) * hard + alpha * soft, hard)
}

/// log Σ exp(z), with `scratch` receiving exp(z − max).
fn log_sum_exp(z: &[f32], scratch: &mut [f32]) -> f32 {
    scratch.copy_from_slice(z);
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    kernels::softmax_in_place(scratch);
    // softmax_in_place normalises; recover the sum from the max entry's probability.
    let p_max = scratch.iter().copied().fold(0.0, f32::max);
    max - p_max.ln()
}

impl CrossEntropy {
    fn check(&self, rows: usize, vocab: usize) -> CResult<()> {
        if self.targets.len() != rows {
            bail!(
                "cross-entropy: {} targets for {rows} rows",
                self.targets.len()
            );
        }
        if let Some(t) = self.targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("cross-entropy: target {t} outside a vocabulary of {vocab}");
        }
        Ok(())
    }

    fn forward(&self, z: &[f32], q: &[f32], vocab: usize) -> (f32, f32) {
        let use_soft = self.soft_weight != 0.0;
        let chunk = vocab * ROWS_PER_TASK;
        let sums: Vec<(f32, f32)> = z
            .par_chunks(chunk)
            .enumerate()
            .map(|(c, zc)| {
                let mut scratch = vec![0f32; vocab];
                let mut acc = (0f32, 0f32);
                for (i, zr) in zc.chunks(vocab).enumerate() {
                    let row = c * ROWS_PER_TASK + i;
                    let lse = log_sum_exp(zr, &mut scratch);
                    let qr = use_soft.then(|| &q[row * vocab..(row + 1) * vocab]);
                    let target = self.targets[row] as usize;
                    let (m, h) = row_losses(zr, lse, target, qr, self.soft_weight);
                    acc = (acc.0 + m, acc.1 + h);
                }
                acc
            })
            .collect();
        sums.iter().fold((0.0, 0.0), |a, s| (a.0 + s.0, a.1 + s.1))
    }

    /// dz = ((g₀ + g₁)·softmax(z) − g₀·(1 − α)·onehot − g₀·α·q − g₁·onehot) / rows.
    fn backward(&self, z: &[f32], q: &[f32], vocab: usize, (g0, g1): (f32, f32)) -> Vec<f32> {
        let rows = z.len() / vocab;
        let alpha = self.soft_weight;
        let scale = 1.0 / rows as f32;
        let mut dz = vec![0f32; z.len()];
        dz.par_chunks_mut(vocab)
            .zip(z.par_chunks(vocab))
            .enumerate()
            .for_each(|(row, (dr, zr))| {
                dr.copy_from_slice(zr);
                kernels::softmax_in_place(dr);
                dr.iter_mut().for_each(|d| *d *= (g0 + g1) * scale);
                if alpha != 0.0 {
                    let qr = &q[row * vocab..(row + 1) * vocab];
                    let w = g0 * alpha * scale;
                    dr.iter_mut().zip(qr).for_each(|(d, qv)| *d -= w * qv);
                }
                dr[self.targets[row] as usize] -= (g0 * (1.0 - alpha) + g1) * scale;
            });
        dz
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let z = contiguous(s1, l1, self.name())?;
        let q = contiguous(s2, l2, self.name())?;
        let (rows, vocab) = l1.shape().dims2()?;
        self.check(rows, vocab)?;
        if self.soft_weight != 0.0 && q.len() != z.len() {
            bail!(
                "cross-entropy: soft targets {:?} for logits {:?}",
                l2.shape(),
                l1.shape()
            );
        }
        if let Some(grad) = self.grad {
            return Ok((
                CpuStorage::F32(self.backward(z, q, vocab, grad)),
                l1.shape().clone(),
            ));
        }
        let (mixed, hard) = self.forward(z, q, vocab);
        let out = vec![mixed / rows as f32, hard / rows as f32];
        Ok((CpuStorage::F32(out), Shape::from(2)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        soft: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_vec1::<f32>()?;
        let op = CrossEntropy {
            targets: self.targets.clone(),
            soft_weight: self.soft_weight,
            grad: Some((g[0], g[1])),
        };
        Ok((Some(logits.apply_op2_no_bwd(soft, &op)?), None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device, Tensor, Var};

    use super::*;
    use crate::engine::model::Rope as RopeTables;

    fn randn(shape: &[usize]) -> Var {
        Var::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Values and the gradients of a random projection of the output agree between the
    /// fused and the composed op.
    fn same_values_and_grads(
        inputs: &[Var],
        fused: impl Fn(&[Tensor]) -> Tensor,
        composed: impl Fn(&[Tensor]) -> Tensor,
    ) {
        let xs: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let (a, b) = (fused(&xs), composed(&xs));
        assert!(
            max_diff(&a, &b) < 1e-5,
            "values differ by {}",
            max_diff(&a, &b)
        );
        let probe = Tensor::randn(0f32, 1.0, a.shape(), &Device::Cpu).unwrap();
        let ga = (a * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        for v in inputs {
            let (da, db) = (ga.get(v.as_tensor()), gb.get(v.as_tensor()));
            let (da, db) = (da.expect("fused grad"), db.expect("composed grad"));
            assert!(
                max_diff(da, db) < 1e-4,
                "grads differ by {}",
                max_diff(da, db)
            );
        }
    }

    #[test]
    fn rms_norm_matches_composed() {
        let inputs = [randn(&[3, 70, 16]), randn(&[16])];
        same_values_and_grads(
            &inputs,
            |x| rms_norm(&x[0], &x[1], 1e-6).unwrap(),
            |x| crate::engine::model::reference::rms_norm(&x[0], &x[1], 1e-6).unwrap(),
        );
    }

    #[test]
    fn rope_matches_rope_slow() {
        let tables =
            RopeTables::new(8, 10_000.0, 16, &Device::Cpu, candle_core::DType::F32).unwrap();
        let (cos, sin) = (
            tables.cos_t.narrow(0, 0, 7).unwrap(),
            tables.sin_t.narrow(0, 0, 7).unwrap(),
        );
        same_values_and_grads(
            &[randn(&[2, 3, 7, 8])],
            |x| rope(&x[0], &tables.cos, &tables.sin, tables.half).unwrap(),
            |x| candle_nn::rotary_emb::rope_slow(&x[0], &cos, &sin).unwrap(),
        );
    }

    #[test]
    fn causal_softmax_matches_masked_softmax() {
        let seq = 6;
        let mask: Vec<f32> = (0..seq * seq)
            .map(|i| {
                if i % seq > i / seq {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (seq, seq), &Device::Cpu).unwrap();
        same_values_and_grads(
            &[randn(&[2, 3, seq, seq])],
            |x| causal_softmax(&x[0], 0.125).unwrap(),
            |x| {
                let s = (&x[0] * 0.125).unwrap().broadcast_add(&mask).unwrap();
                candle_nn::ops::softmax(&s, D::Minus1).unwrap()
            },
        );
    }

    #[test]
    fn cross_entropy_matches_composed_for_hard_and_soft_targets() {
        let (rows, vocab) = (130, 13);
        let targets: Vec<u32> = (0..rows as u32).map(|i| (i * 7) % vocab as u32).collect();
        let target_t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let soft = candle_nn::ops::softmax_last_dim(randn(&[rows, vocab]).as_tensor()).unwrap();
        for alpha in [0.0, 0.3, 1.0] {
            same_values_and_grads(
                &[randn(&[rows, vocab])],
                |x| cross_entropy(&x[0], &targets, &soft, alpha).unwrap(),
                |x| {
                    let hard = candle_nn::loss::cross_entropy(&x[0], &target_t).unwrap();
                    let log_p = candle_nn::ops::log_softmax(&x[0], 1).unwrap();
                    let soft_ce = (&soft * log_p).unwrap().sum(1).unwrap().mean(0).unwrap();
                    let mixed =
                        ((&hard * (1.0 - alpha)).unwrap() - (soft_ce * alpha).unwrap()).unwrap();
                    Tensor::stack(&[mixed, hard], 0).unwrap()
                },
            );
        }
    }
}
