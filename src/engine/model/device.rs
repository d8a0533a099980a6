//! The batched step with candle ops on the model's device and dtype: the GPU path. It also
//! runs on CPU (the tests drive it there), so the code a GPU executes is exercised here.

use candle_core::{DType, Tensor};
use candle_nn::ops::{rms_norm, softmax_last_dim};
use candle_nn::rotary_emb::rope;

use super::{Hidden, LayerWeights, LoopedModel, RowInput, StepOutput, StepRow};
use crate::engine::error::{EngineError, Result};
use crate::engine::kv_cache::KvCache;

pub(super) fn step(
    model: &LoopedModel,
    rows: &[StepRow],
    cache: &mut KvCache,
) -> Result<StepOutput> {
    let cfg = &model.config;
    let dev = &model.device;
    let mut h = embed_rows(model, rows)?;
    let positions: Vec<u32> = rows.iter().map(|r| r.pos as u32).collect();
    let positions = Tensor::new(positions.as_slice(), dev)?;
    let cos = model.rope.cos_t.index_select(&positions, 0)?;
    let sin = model.rope.sin_t.index_select(&positions, 0)?;
    for (index, layer) in model.weights.layers.iter().enumerate() {
        h = layer_forward(model, layer, index, rows, &h, (&cos, &sin), cache)?;
    }
    let h = rms_norm(&h, &model.weights.norm, cfg.rms_norm_eps as f32)?;
    let wanted: Vec<u32> = (0..rows.len() as u32)
        .filter(|&i| rows[i as usize].readout)
        .collect();
    let mut logits: Vec<Option<Vec<f32>>> = vec![None; rows.len()];
    if !wanted.is_empty() {
        let sel = h.index_select(&Tensor::new(wanted.as_slice(), dev)?, 0)?;
        let all = sel
            .matmul(&model.weights.lm_head.t()?)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        for (&i, l) in wanted.iter().zip(all) {
            logits[i as usize] = Some(l);
        }
    }
    let hidden = (0..rows.len())
        .map(|i| Ok(Hidden::Device(h.narrow(0, i, 1)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(StepOutput { hidden, logits })
}

/// `[rows, hidden]`: embeddings for pass-1 rows, carried states for the others.
fn embed_rows(model: &LoopedModel, rows: &[StepRow]) -> Result<Tensor> {
    let parts = rows
        .iter()
        .map(|row| match &row.input {
            RowInput::Token(id) => {
                if *id as usize >= model.config.vocab_size {
                    return Err(EngineError::Invalid(format!(
                        "token id {id} is outside the vocabulary"
                    )));
                }
                Ok(model.weights.embed_tokens.narrow(0, *id as usize, 1)?)
            }
            RowInput::Hidden(Hidden::Device(t)) => Ok(t.clone()),
            RowInput::Hidden(Hidden::Host(v)) => {
                Ok(Tensor::from_slice(v, (1, v.len()), &model.device)?.to_dtype(model.dtype)?)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

fn layer_forward(
    model: &LoopedModel,
    w: &LayerWeights,
    layer: usize,
    rows: &[StepRow],
    h: &Tensor,
    rope_rows: (&Tensor, &Tensor),
    cache: &mut KvCache,
) -> Result<Tensor> {
    let eps = model.config.rms_norm_eps as f32;
    let a = rms_norm(h, &w.input_layernorm, eps)?;
    let attn = attention(model, w, layer, rows, &a, rope_rows, cache)?;
    let o = rms_norm(&attn.matmul(&w.o_proj.t()?)?, &w.input_layernorm_2, eps)?;
    let h = (h + o)?;
    let x = rms_norm(&h, &w.post_attention_layernorm, eps)?;
    let gate = candle_nn::ops::silu(&x.matmul(&w.gate_proj.t()?)?)?;
    let up = x.matmul(&w.up_proj.t()?)?;
    let down = (gate * up)?.matmul(&w.down_proj.t()?)?;
    let down = rms_norm(&down, &w.post_attention_layernorm_2, eps)?;
    Ok((h + down)?)
}

/// `[rows, heads, head_dim]` → rotary embedding at each row's own position.
fn rotate(
    x: &Tensor,
    heads: usize,
    head_dim: usize,
    (cos, sin): (&Tensor, &Tensor),
) -> Result<Tensor> {
    let m = x.dim(0)?;
    let x = x
        .reshape((1, m, heads, head_dim))?
        .transpose(1, 2)?
        .contiguous()?;
    Ok(rope(&x, cos, sin)?
        .transpose(1, 2)?
        .reshape((m, heads * head_dim))?)
}

fn attention(
    model: &LoopedModel,
    w: &LayerWeights,
    layer: usize,
    rows: &[StepRow],
    a: &Tensor,
    rope_rows: (&Tensor, &Tensor),
    cache: &mut KvCache,
) -> Result<Tensor> {
    let cfg = &model.config;
    let (heads, kv_heads, head_dim) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let q = rotate(&a.matmul(&w.q_proj.t()?)?, heads, head_dim, rope_rows)?;
    let k = rotate(&a.matmul(&w.k_proj.t()?)?, kv_heads, head_dim, rope_rows)?;
    let v = a.matmul(&w.v_proj.t()?)?;
    for (i, row) in rows.iter().enumerate() {
        cache.write_device(
            layer,
            row.pass,
            row.pos,
            &k.narrow(0, i, 1)?,
            &v.narrow(0, i, 1)?,
        )?;
    }
    // Rows of one pass (a prefill chunk) attend together under a causal mask; rows of
    // different passes read different cache slices.
    let mut outputs: Vec<Option<Tensor>> = vec![None; rows.len()];
    let mut passes: Vec<usize> = rows.iter().map(|r| r.pass).collect();
    passes.sort_unstable();
    passes.dedup();
    for pass in passes {
        let idx: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].pass == pass).collect();
        let out = attend_group(model, layer, pass, rows, &idx, &q, cache)?;
        for (n, &i) in idx.iter().enumerate() {
            outputs[i] = Some(out.narrow(0, n, 1)?);
        }
    }
    let outputs: Vec<Tensor> = outputs
        .into_iter()
        .map(|o| o.expect("every row belongs to one pass group: this is a bug"))
        .collect();
    Ok(Tensor::cat(&outputs, 0)?)
}

/// Attention of the rows `idx` (all at `pass`) over that pass's cache, causal by position.
fn attend_group(
    model: &LoopedModel,
    layer: usize,
    pass: usize,
    rows: &[StepRow],
    idx: &[usize],
    q: &Tensor,
    cache: &KvCache,
) -> Result<Tensor> {
    let cfg = &model.config;
    let (heads, kv_heads, head_dim) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let len = idx.iter().map(|&i| rows[i].pos + 1).max().unwrap_or(0);
    let (keys, values) = cache
        .device_layer(layer)
        .expect("device step needs a device cache: this is a bug");
    let start = pass * cache.capacity();
    let per_head = |t: &Tensor| -> Result<Tensor> {
        let t = t
            .narrow(0, start, len)?
            .reshape((len, kv_heads, head_dim))?
            .transpose(0, 1)?;
        let group = heads / kv_heads;
        let t = t.unsqueeze(1)?.expand((kv_heads, group, len, head_dim))?;
        Ok(t.reshape((heads, len, head_dim))?)
    };
    let (k, v) = (per_head(keys)?, per_head(values)?);
    let sel = Tensor::new(
        idx.iter().map(|&i| i as u32).collect::<Vec<_>>().as_slice(),
        &model.device,
    )?;
    let g = idx.len();
    let qg = q
        .index_select(&sel, 0)?
        .reshape((g, heads, head_dim))?
        .transpose(0, 1)?
        .contiguous()?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = (qg.matmul(&k.t()?)? * scale)?;
    let mask: Vec<f32> = idx
        .iter()
        .flat_map(|&i| {
            (0..len).map(move |s| {
                if s > rows[i].pos {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    let mask = Tensor::from_slice(&mask, (g, len), &model.device)?.to_dtype(scores.dtype())?;
    let probs = softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let out = probs.matmul(&v.contiguous()?)?; // [heads, g, head_dim]
    Ok(out.transpose(0, 1)?.reshape((g, heads * head_dim))?)
}
