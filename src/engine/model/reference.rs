//! The full-sequence forward pass: every position of a batch of sequences through all R
//! passes with a causal mask, built only from differentiable ops. The tests use it as the
//! unbatched reference (the oracle) for the batched step, with candle's primitive ops; the
//! trainer backpropagates through it with its own fused ops (`crate::train::Fused`, same
//! values, much less memory traffic), passed in as a [`SequenceOps`].

use candle_core::{D, Tensor};

use super::{LayerWeights, LoopedModel, Rope};
use crate::engine::error::Result;

/// The elementwise ops of the sequence forward, the part an implementation may fuse.
pub trait SequenceOps: Sync {
    /// RMSNorm over the last dimension.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor>;
    /// Rotary embedding of `[batch, heads, seq, head_dim]` at positions `0..seq`.
    fn rope(&self, x: &Tensor, rope: &Rope) -> Result<Tensor>;
    /// Softmax of `scores · scale` over the last dimension under the causal `mask`.
    fn causal_softmax(&self, scores: &Tensor, scale: f64, mask: &Tensor) -> Result<Tensor>;
    /// Keys (after RoPE) or values as a decode step's KV cache would read them back.
    fn stored_kv(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
}

/// candle's primitive ops: any device and dtype, differentiable.
#[derive(Debug, Clone, Copy, Default)]
pub struct Composed;

impl SequenceOps for Composed {
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        rms_norm(x, weight, eps)
    }

    fn rope(&self, x: &Tensor, rope: &Rope) -> Result<Tensor> {
        let (_, _, seq, _) = x.dims4()?;
        let cos = rope.cos_t.narrow(0, 0, seq)?;
        let sin = rope.sin_t.narrow(0, 0, seq)?;
        Ok(candle_nn::rotary_emb::rope_slow(x, &cos, &sin)?)
    }

    fn causal_softmax(&self, scores: &Tensor, scale: f64, mask: &Tensor) -> Result<Tensor> {
        let scores = (scores * scale)?.broadcast_add(mask)?;
        Ok(candle_nn::ops::softmax(&scores, D::Minus1)?)
    }
}

/// [`Composed`] with keys and values rounded to f16, as the host KV cache stores them
/// (`model::KvDtype::F16`): the reference for steps over an f16 cache.
#[derive(Debug, Clone, Copy, Default)]
pub struct ComposedF16Kv;

impl SequenceOps for ComposedF16Kv {
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        Composed.rms_norm(x, weight, eps)
    }

    fn rope(&self, x: &Tensor, rope: &Rope) -> Result<Tensor> {
        Composed.rope(x, rope)
    }

    fn causal_softmax(&self, scores: &Tensor, scale: f64, mask: &Tensor) -> Result<Tensor> {
        Composed.causal_softmax(scores, scale, mask)
    }

    fn stored_kv(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        Ok(x.to_dtype(candle_core::DType::F16)?.to_dtype(dtype)?)
    }
}

/// RMSNorm composed from primitive ops (candle's fused `rms_norm` has no backward pass).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let mean_sq = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(mean_sq + eps)?.sqrt()?)?
        .broadcast_mul(weight)?)
}

/// `[.., in] · wᵀ` for a batched input.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_matmul(&w.t()?)?)
}

impl LoopedModel {
    /// Logits after every pass for `ids` `[batch, seq]`: a vector of R tensors
    /// `[batch, seq, vocab]` (`engine::format`, "The forward pass").
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
        self.hidden_per_pass_with(ids, &Composed)
    }

    /// `hidden_per_pass` with a chosen implementation of the elementwise ops.
    pub fn hidden_per_pass_with(&self, ids: &Tensor, ops: &dyn SequenceOps) -> Result<Vec<Tensor>> {
        let (batch, seq) = ids.dims2()?;
        let mut h = self
            .weights
            .embed_tokens
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((batch, seq, self.config.hidden))?;
        let mask: Vec<f32> = (0..seq)
            .flat_map(|i| (0..seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_slice(&mask, (seq, seq), &self.device)?.to_dtype(self.dtype)?;
        let mut out = Vec::with_capacity(self.passes());
        for _ in 0..self.passes() {
            for layer in &self.weights.layers {
                h = self.layer_sequence(layer, &h, &mask, ops)?;
            }
            h = ops.rms_norm(&h, &self.weights.norm, self.config.rms_norm_eps)?;
            out.push(h.clone());
        }
        Ok(out)
    }

    /// Causal attention of `q` over `k`, `v` (`[batch, heads, seq, head_dim]`, GQA expanded).
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        ops: &dyn SequenceOps,
    ) -> Result<Tensor> {
        let (_, _, _, head_dim) = q.dims4()?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let probs = ops.causal_softmax(&q.matmul(&k.t()?)?, scale, mask)?;
        Ok(probs.matmul(&v.contiguous()?)?)
    }

    fn layer_sequence(
        &self,
        w: &LayerWeights,
        h: &Tensor,
        mask: &Tensor,
        ops: &dyn SequenceOps,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let eps = cfg.rms_norm_eps;
        let (batch, seq, _) = h.dims3()?;
        let (heads, kv_heads, head_dim) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let a = ops.rms_norm(h, &w.input_layernorm, eps)?;
        let split = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((batch, seq, n, head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let q = ops.rope(&split(linear(&a, &w.q_proj)?, heads)?, &self.rope)?;
        let k = ops.stored_kv(&ops.rope(&split(linear(&a, &w.k_proj)?, kv_heads)?, &self.rope)?)?;
        let v = ops.stored_kv(&split(linear(&a, &w.v_proj)?, kv_heads)?)?;
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
        let o = ops.rms_norm(&linear(&attn, &w.o_proj)?, &w.input_layernorm_2, eps)?;
        let h = (h + o)?;
        let x = ops.rms_norm(&h, &w.post_attention_layernorm, eps)?;
        let gate = candle_nn::ops::silu(&linear(&x, &w.gate_proj)?)?;
        let down = linear(&(gate * linear(&x, &w.up_proj)?)?, &w.down_proj)?;
        let down = ops.rms_norm(&down, &w.post_attention_layernorm_2, eps)?;
        Ok((h + down)?)
    }
}
