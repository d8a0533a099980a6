//! The full-sequence forward pass: every position of a batch of sequences through all R
//! passes with a causal mask, built only from differentiable candle ops. The trainer
//! backpropagates through it; the tests use it as the unbatched reference for the step.

use candle_core::{D, Tensor};

use super::{LayerWeights, LoopedModel};
use crate::engine::error::Result;

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
    /// `[batch, seq, vocab]` (ouro-format.md, "Forward pass").
    pub fn forward_sequence(&self, ids: &Tensor) -> Result<Vec<Tensor>> {
        let hidden_states = self.hidden_per_pass(ids)?;
        hidden_states
            .iter()
            .map(|h| linear(h, &self.weights.lm_head))
            .collect()
    }

    /// The normed hidden state after every pass, `[batch, seq, hidden]` each.
    pub fn hidden_per_pass(&self, ids: &Tensor) -> Result<Vec<Tensor>> {
        let (batch, seq) = ids.dims2()?;
        let mut h = self
            .weights
            .embed_tokens
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((batch, seq, self.config.hidden_size))?;
        let cos = self.rope.cos_t.narrow(0, 0, seq)?;
        let sin = self.rope.sin_t.narrow(0, 0, seq)?;
        let mask: Vec<f32> = (0..seq)
            .flat_map(|i| (0..seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_slice(&mask, (seq, seq), &self.device)?.to_dtype(self.dtype)?;
        let mut out = Vec::with_capacity(self.passes());
        for _ in 0..self.passes() {
            for layer in &self.weights.layers {
                h = self.layer_sequence(layer, &h, (&cos, &sin), &mask)?;
            }
            h = rms_norm(&h, &self.weights.norm, self.config.rms_norm_eps)?;
            out.push(h.clone());
        }
        Ok(out)
    }

    fn layer_sequence(
        &self,
        w: &LayerWeights,
        h: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        mask: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let eps = cfg.rms_norm_eps;
        let (batch, seq, _) = h.dims3()?;
        let (heads, kv_heads, head_dim) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let a = rms_norm(h, &w.input_layernorm, eps)?;
        let split = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((batch, seq, n, head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let q = split(linear(&a, &w.q_proj)?, heads)?;
        let k = split(linear(&a, &w.k_proj)?, kv_heads)?;
        let v = split(linear(&a, &w.v_proj)?, kv_heads)?;
        let q = candle_nn::rotary_emb::rope_slow(&q, cos, sin)?;
        let k = candle_nn::rotary_emb::rope_slow(&k, cos, sin)?;
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
        let scores = (q.matmul(&k.t()?)? / (head_dim as f64).sqrt())?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let attn = probs.matmul(&v.contiguous()?)?.transpose(1, 2)?.reshape((
            batch,
            seq,
            heads * head_dim,
        ))?;
        let o = rms_norm(&linear(&attn, &w.o_proj)?, &w.input_layernorm_2, eps)?;
        let h = (h + o)?;
        let x = rms_norm(&h, &w.post_attention_layernorm, eps)?;
        let gate = candle_nn::ops::silu(&linear(&x, &w.gate_proj)?)?;
        let down = linear(&(gate * linear(&x, &w.up_proj)?)?, &w.down_proj)?;
        let down = rms_norm(&down, &w.post_attention_layernorm_2, eps)?;
        Ok((h + down)?)
    }
}
