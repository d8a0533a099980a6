//! The full-sequence forward pass: every position of a batch of sequences through all R
//! passes with a causal mask, built only from differentiable ops. The trainer backpropagates
//! through it; the tests use it as the unbatched reference for the step. On CPU f32 it uses
//! the fused ops of `fused.rs` (same values, much less memory traffic); elsewhere, candle's
//! primitive ops.

use candle_core::{D, DType, Device, Tensor};

use super::{LayerWeights, LoopedModel, fused};
use crate::engine::error::Result;

/// Which implementation of the elementwise ops a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ops {
    /// `fused.rs`: CPU f32 only.
    Fused,
    /// candle's primitive ops: any device and dtype.
    Composed,
}

impl Ops {
    /// The fused ops where they run (CPU f32), the composed ones elsewhere.
    pub fn for_tensor(t: &Tensor) -> Self {
        match (t.device(), t.dtype()) {
            (Device::Cpu, DType::F32) => Self::Fused,
            _ => Self::Composed,
        }
    }
}

/// RMSNorm composed from primitive ops (candle's fused `rms_norm` has no backward pass).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let mean_sq = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(mean_sq + eps)?.sqrt()?)?
        .broadcast_mul(weight)?)
}

fn norm(ops: Ops, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    match ops {
        Ops::Fused => Ok(fused::rms_norm(x, weight, eps)?),
        Ops::Composed => rms_norm(x, weight, eps),
    }
}

/// `[.., in] · wᵀ` for a batched input.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_matmul(&w.t()?)?)
}

impl LoopedModel {
    /// Logits after every pass for `ids` `[batch, seq]`: a vector of R tensors
    /// `[batch, seq, vocab]` (ouro-format.md, "Forward pass").
    pub fn forward_sequence(&self, ids: &Tensor) -> Result<Vec<Tensor>> {
        self.readouts(&self.hidden_per_pass(ids)?)
    }

    /// The LM head on every pass's hidden state: `[.., hidden]` → `[.., vocab]` each.
    pub fn readouts(&self, hidden_per_pass: &[Tensor]) -> Result<Vec<Tensor>> {
        hidden_per_pass
            .iter()
            .map(|h| linear(h, &self.weights.lm_head))
            .collect()
    }

    /// The normed hidden state after every pass, `[batch, seq, hidden]` each.
    pub fn hidden_per_pass(&self, ids: &Tensor) -> Result<Vec<Tensor>> {
        self.hidden_per_pass_with(ids, Ops::for_tensor(&self.weights.norm))
    }

    /// `hidden_per_pass` with a chosen implementation of the elementwise ops.
    pub fn hidden_per_pass_with(&self, ids: &Tensor, ops: Ops) -> Result<Vec<Tensor>> {
        let (batch, seq) = ids.dims2()?;
        let mut h = self
            .weights
            .embed_tokens
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((batch, seq, self.config.hidden_size))?;
        let mask: Vec<f32> = (0..seq)
            .flat_map(|i| (0..seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_slice(&mask, (seq, seq), &self.device)?.to_dtype(self.dtype)?;
        let mut out = Vec::with_capacity(self.passes());
        for _ in 0..self.passes() {
            for layer in &self.weights.layers {
                h = self.layer_sequence(layer, &h, &mask, ops)?;
            }
            h = norm(ops, &h, &self.weights.norm, self.config.rms_norm_eps)?;
            out.push(h.clone());
        }
        Ok(out)
    }

    fn rope(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let (_, _, seq, _) = x.dims4()?;
        Ok(match ops {
            Ops::Fused => fused::rope(x, &self.rope.cos, &self.rope.sin, self.rope.half)?,
            Ops::Composed => {
                let cos = self.rope.cos_t.narrow(0, 0, seq)?;
                let sin = self.rope.sin_t.narrow(0, 0, seq)?;
                candle_nn::rotary_emb::rope_slow(x, &cos, &sin)?
            }
        })
    }

    /// Causal attention of `q` over `k`, `v` (`[batch, heads, seq, head_dim]`, GQA expanded).
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        ops: Ops,
    ) -> Result<Tensor> {
        let (_, _, _, head_dim) = q.dims4()?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let scores = q.matmul(&k.t()?)?;
        let probs = match ops {
            Ops::Fused => fused::causal_softmax(&scores, scale)?,
            Ops::Composed => {
                let scores = (scores * scale)?.broadcast_add(mask)?;
                candle_nn::ops::softmax(&scores, D::Minus1)?
            }
        };
        Ok(probs.matmul(&v.contiguous()?)?)
    }

    fn layer_sequence(
        &self,
        w: &LayerWeights,
        h: &Tensor,
        mask: &Tensor,
        ops: Ops,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let eps = cfg.rms_norm_eps;
        let (batch, seq, _) = h.dims3()?;
        let (heads, kv_heads, head_dim) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let a = norm(ops, h, &w.input_layernorm, eps)?;
        let split = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((batch, seq, n, head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let q = self.rope(&split(linear(&a, &w.q_proj)?, heads)?, ops)?;
        let k = self.rope(&split(linear(&a, &w.k_proj)?, kv_heads)?, ops)?;
        let v = split(linear(&a, &w.v_proj)?, kv_heads)?;
        let group = heads / kv_heads;
        let repeat = |t: Tensor| -> Result<Tensor> {
            if group == 1 {
                return Ok(t);
            }
            Ok(t.unsqueeze(2)?
                .expand((batch, kv_heads, group, seq, head_dim))?
                .reshape((batch, heads, seq, head_dim))?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let attn = self
            .attention(&q, &k, &v, mask, ops)?
            .transpose(1, 2)?
            .reshape((batch, seq, heads * head_dim))?;
        let o = norm(ops, &linear(&attn, &w.o_proj)?, &w.input_layernorm_2, eps)?;
        let h = (h + o)?;
        let x = norm(ops, &h, &w.post_attention_layernorm, eps)?;
        let gate = candle_nn::ops::silu(&linear(&x, &w.gate_proj)?)?;
        let down = linear(&(gate * linear(&x, &w.up_proj)?)?, &w.down_proj)?;
        let down = norm(ops, &down, &w.post_attention_layernorm_2, eps)?;
        Ok((h + down)?)
    }
}
