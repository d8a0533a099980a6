//! The batched step on CPU f32 memory with spex's kernels (`engine::kernels`). Weights stay in
//! their candle tensors and are viewed in place; the KV cache is host memory. Readouts go
//! through `half_head` where the model has one (proposals in f16, commits screened exact).

use std::ops::Deref;

use candle_core::{CpuStorage, Storage, StorageRef, Tensor};

use super::{Hidden, LayerWeights, LoopedModel, RowInput, StepOutput, StepRow};
use crate::engine::error::{EngineError, Result};
use crate::engine::kernels::{self, AttnShape};
use crate::engine::kv_cache::KvCache;

/// A read view of a contiguous CPU f32 tensor's elements.
struct HostView<'a> {
    guard: StorageRef<'a>,
    start: usize,
    len: usize,
}

impl<'a> HostView<'a> {
    fn new(t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        if !layout.is_contiguous() || !matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))) {
            return Err(EngineError::Invalid(
                "host kernels need contiguous CPU f32 weights".to_string(),
            ));
        }
        Ok(Self {
            guard,
            start: layout.start_offset(),
            len: layout.shape().elem_count(),
        })
    }
}

impl Deref for HostView<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &*self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.start..self.start + self.len],
            _ => unreachable!("HostView::new checked the storage: this is a bug"),
        }
    }
}

/// `x [rows × in] · wᵀ` with the small-M kernel.
fn linear(x: &[f32], w: &Tensor, rows: usize) -> Result<Vec<f32>> {
    let w = HostView::new(w)?;
    let inner = x.len() / rows;
    let mut out = vec![0f32; rows * (w.len() / inner)];
    kernels::matmul_t(x, &w, rows, inner, &mut out);
    Ok(out)
}

fn rms_norm(x: &[f32], w: &Tensor, eps: f32) -> Result<Vec<f32>> {
    let w = HostView::new(w)?;
    let mut out = vec![0f32; x.len()];
    kernels::rms_norm(x, &w, eps, &mut out);
    Ok(out)
}

pub(super) fn step(
    model: &LoopedModel,
    rows: &[StepRow],
    cache: &mut KvCache,
) -> Result<StepOutput> {
    let _flushed = kernels::SubnormalsFlushed::enter();
    let cfg = &model.config;
    let hidden = cfg.hidden_size;
    let mut h = Vec::with_capacity(rows.len() * hidden);
    {
        let embed = HostView::new(&model.weights.embed_tokens)?;
        for row in rows {
            match &row.input {
                RowInput::Token(id) => {
                    let id = *id as usize;
                    if id >= cfg.vocab_size {
                        return Err(EngineError::Invalid(format!(
                            "token id {id} is outside the vocabulary"
                        )));
                    }
                    h.extend_from_slice(&embed[id * hidden..(id + 1) * hidden]);
                }
                RowInput::Hidden(Hidden::Host(state)) => h.extend_from_slice(state),
                RowInput::Hidden(Hidden::Device(_)) => {
                    return Err(EngineError::Invalid(
                        "device hidden state given to the host step: this is a bug".into(),
                    ));
                }
            }
        }
    }
    for (index, layer) in model.weights.layers.iter().enumerate() {
        layer_forward(model, layer, index, rows, &mut h, cache)?;
    }
    let h = rms_norm(&h, &model.weights.norm, cfg.rms_norm_eps as f32)?;
    let logits = readouts(model, rows, &h)?;
    let hidden_out = h
        .chunks_exact(hidden)
        .map(|r| Hidden::Host(r.to_vec()))
        .collect();
    Ok(StepOutput {
        hidden: hidden_out,
        logits,
    })
}

/// One shared layer (Ouro's sandwich norms) on every row, in place on `h`.
fn layer_forward(
    model: &LoopedModel,
    w: &LayerWeights,
    layer: usize,
    rows: &[StepRow],
    h: &mut [f32],
    cache: &mut KvCache,
) -> Result<()> {
    let cfg = &model.config;
    let (m, eps) = (rows.len(), cfg.rms_norm_eps as f32);
    let a = rms_norm(h, &w.input_layernorm, eps)?;
    let attn = attention(model, w, layer, rows, &a, cache)?;
    let o = linear(&attn, &w.o_proj, m)?;
    let o = rms_norm(&o, &w.input_layernorm_2, eps)?;
    h.iter_mut().zip(&o).for_each(|(x, d)| *x += d);
    let x = rms_norm(h, &w.post_attention_layernorm, eps)?;
    let mut gate = linear(&x, &w.gate_proj, m)?;
    let up = linear(&x, &w.up_proj, m)?;
    kernels::silu_mul(&mut gate, &up);
    let down = linear(&gate, &w.down_proj, m)?;
    let down = rms_norm(&down, &w.post_attention_layernorm_2, eps)?;
    h.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
    Ok(())
}

/// Q/K/V projections, per-row RoPE, cache writes, then each row attends to its own pass.
fn attention(
    model: &LoopedModel,
    w: &LayerWeights,
    layer: usize,
    rows: &[StepRow],
    a: &[f32],
    cache: &mut KvCache,
) -> Result<Vec<f32>> {
    let cfg = &model.config;
    let m = rows.len();
    let (q_dim, kv_dim, head_dim) = (
        cfg.num_attention_heads * cfg.head_dim,
        cfg.kv_dim(),
        cfg.head_dim,
    );
    let mut q = linear(a, &w.q_proj, m)?;
    let mut k = linear(a, &w.k_proj, m)?;
    let v = linear(a, &w.v_proj, m)?;
    let shape = AttnShape {
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim,
    };
    let mut out = vec![0f32; m * q_dim];
    let mut scores = Vec::new();
    // Each row writes its entry and then attends, in row order: rows of one pass come in
    // position order, so every row sees exactly the entries before its own, and a second
    // candidate sees its own entry at the position it shares with the row before it.
    for (i, row) in rows.iter().enumerate() {
        let (cos, sin) = model.rope.at(row.pos);
        let (qi, oi) = (
            &mut q[i * q_dim..(i + 1) * q_dim],
            &mut out[i * q_dim..(i + 1) * q_dim],
        );
        kernels::rope_row(qi, head_dim, cos, sin);
        kernels::rope_row(&mut k[i * kv_dim..(i + 1) * kv_dim], head_dim, cos, sin);
        if row.alternate {
            cache.swap_alternate(layer, row.pass, row.pos)?;
        }
        let range = i * kv_dim..(i + 1) * kv_dim;
        cache.write_host(layer, row.pass, row.pos, &k[range.clone()], &v[range]);
        let (keys, values) = cache.host_pass(layer, row.pass, row.pos + 1);
        kernels::attend_row(qi, keys, values, row.pos + 1, shape, oi, &mut scores);
        if row.alternate {
            cache.swap_alternate(layer, row.pass, row.pos)?;
        }
    }
    Ok(out)
}

/// LM head on the rows that asked for a readout, all in one matmul.
fn readouts(model: &LoopedModel, rows: &[StepRow], h: &[f32]) -> Result<Vec<Option<Vec<f32>>>> {
    let hidden = model.config.hidden_size;
    let wanted: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].readout).collect();
    let mut logits: Vec<Option<Vec<f32>>> = vec![None; rows.len()];
    if wanted.is_empty() {
        return Ok(logits);
    }
    let x: Vec<f32> = wanted
        .iter()
        .flat_map(|&i| h[i * hidden..(i + 1) * hidden].iter().copied())
        .collect();
    let all = match &model.half_head {
        // Proposals through the f16 head; rows at pass R (they commit) screened exact.
        Some(head) => {
            let exact: Vec<bool> = wanted
                .iter()
                .map(|&i| rows[i].pass + 1 == model.passes())
                .collect();
            head.readouts(&x, &exact, &HostView::new(&model.weights.lm_head)?)
        }
        None => linear(&x, &model.weights.lm_head, wanted.len())?,
    };
    let vocab = all.len() / wanted.len();
    for (n, &i) in wanted.iter().enumerate() {
        logits[i] = Some(all[n * vocab..(n + 1) * vocab].to_vec());
    }
    Ok(logits)
}
