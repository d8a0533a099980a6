//! The device step backend: candle ops on the model's device and dtype, the GPU path. It also
//! runs on CPU (the tests drive it there), so the code a GPU executes is exercised here.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_nn::ops::{rms_norm, softmax_last_dim};
use candle_nn::rotary_emb::rope;

use super::backend::StepBackend;
use super::{LayerWeights, LoopedModel, RowInput, RowSlot};
use crate::engine::error::{EngineError, Result};
use crate::engine::kv_cache::{AsideSlot, KvCache, KvStore};
use crate::engine::pass::Pass;

/// candle ops on the model's device and dtype.
#[derive(Debug)]
pub struct DeviceBackend {
    model: Arc<LoopedModel>,
}

impl DeviceBackend {
    /// candle ops over `model`, on its device and dtype.
    pub fn new(model: Arc<LoopedModel>) -> Self {
        Self { model }
    }

    /// The model, shared.
    pub fn shared_model(&self) -> &Arc<LoopedModel> {
        &self.model
    }

    /// Cos and sin rows at each row's position.
    fn rope_rows(&self, slots: &[RowSlot]) -> Result<(Tensor, Tensor)> {
        let positions: Vec<u32> = slots.iter().map(|s| s.pos as u32).collect();
        let positions = Tensor::new(positions.as_slice(), &self.model.device)?;
        Ok((
            self.model.rope.cos_t.index_select(&positions, 0)?,
            self.model.rope.sin_t.index_select(&positions, 0)?,
        ))
    }
}

impl StepBackend for DeviceBackend {
    type Hidden = Tensor;
    type Act = Tensor;
    type Kv = DeviceKv;
    type StepGuard = ();
    const SECOND_CANDIDATES_IN_ONE_SWEEP: bool = false;

    fn model(&self) -> &LoopedModel {
        &self.model
    }

    fn new_store(&self, capacity: usize) -> Result<DeviceKv> {
        DeviceKv::new(&self.model, capacity)
    }

    fn enter_step(&self) {}

    /// `[rows, hidden]`: embeddings for pass-1 rows, carried states for the others.
    fn embed(&self, inputs: Vec<RowInput<Tensor>>) -> Result<Tensor> {
        let parts = inputs
            .into_iter()
            .map(|input| match input {
                RowInput::Token(id) if id as usize >= self.model.config.vocab_size => Err(
                    EngineError::Invalid(format!("token id {id} is outside the vocabulary")),
                ),
                RowInput::Token(id) => {
                    Ok(self.model.weights.embed_tokens.narrow(0, id as usize, 1)?)
                }
                RowInput::Hidden(t) => Ok(t),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(x, weight, self.model.config.rms_norm_eps as f32)?)
    }

    fn linear(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        Ok(x.matmul(&weight.t()?)?)
    }

    fn add(&self, h: Tensor, delta: &Tensor) -> Result<Tensor> {
        Ok((h + delta)?)
    }

    fn silu_mul(&self, gate: Tensor, up: &Tensor) -> Result<Tensor> {
        Ok((candle_nn::ops::silu(&gate)? * up)?)
    }

    /// Q/K/V projections, RoPE, cache writes, then attention grouped by pass: rows of one
    /// pass (a prefill chunk) attend together under a causal mask; rows of different passes
    /// read different cache slices.
    fn attention(
        &self,
        w: &LayerWeights,
        layer: usize,
        slots: &[RowSlot],
        a: &Tensor,
        cache: &mut KvCache<DeviceKv>,
    ) -> Result<Tensor> {
        let cfg = &self.model.config;
        let (heads, kv_heads, head_dim) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let rope_rows = self.rope_rows(slots)?;
        let rope_rows = (&rope_rows.0, &rope_rows.1);
        let q = rotate(&self.linear(a, &w.q_proj)?, heads, head_dim, rope_rows)?;
        let k = rotate(&self.linear(a, &w.k_proj)?, kv_heads, head_dim, rope_rows)?;
        let v = self.linear(a, &w.v_proj)?;
        for (i, slot) in slots.iter().enumerate() {
            let (ki, vi) = (k.narrow(0, i, 1)?, v.narrow(0, i, 1)?);
            cache
                .store_mut()
                .write(layer, slot.pass, slot.pos, &ki, &vi)?;
        }
        let mut outputs: Vec<Option<Tensor>> = vec![None; slots.len()];
        let mut passes: Vec<Pass> = slots.iter().map(|s| s.pass).collect();
        passes.sort_unstable();
        passes.dedup();
        for pass in passes {
            let idx: Vec<usize> = (0..slots.len())
                .filter(|&i| slots[i].pass == pass)
                .collect();
            let out = attend_group(self, layer, pass, slots, &idx, &q, cache.store())?;
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

    fn readouts(&self, slots: &[RowSlot], h: &Tensor) -> Result<Vec<Option<Vec<f32>>>> {
        let wanted: Vec<u32> = (0..slots.len() as u32)
            .filter(|&i| slots[i as usize].readout.wanted())
            .collect();
        let mut logits: Vec<Option<Vec<f32>>> = vec![None; slots.len()];
        if wanted.is_empty() {
            return Ok(logits);
        }
        let sel = h.index_select(&Tensor::new(wanted.as_slice(), &self.model.device)?, 0)?;
        let all = self
            .linear(&sel, &self.model.weights.lm_head)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        for (&i, l) in wanted.iter().zip(all) {
            logits[i as usize] = Some(l);
        }
        Ok(logits)
    }

    fn row_states(&self, h: Tensor) -> Result<Vec<Tensor>> {
        let (rows, _) = h.dims2()?;
        (0..rows).map(|i| Ok(h.narrow(0, i, 1)?)).collect()
    }
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

/// Attention of the rows `idx` (all at `pass`) over that pass's cache, causal by position.
fn attend_group(
    b: &DeviceBackend,
    layer: usize,
    pass: Pass,
    slots: &[RowSlot],
    idx: &[usize],
    q: &Tensor,
    store: &DeviceKv,
) -> Result<Tensor> {
    let model = &b.model;
    let cfg = &model.config;
    let (heads, kv_heads, head_dim) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let len = idx.iter().map(|&i| slots[i].pos + 1).max().unwrap_or(0);
    let (keys, values) = (&store.keys[layer], &store.values[layer]);
    let start = pass.index() * store.capacity;
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
                if s > slots[i].pos {
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

/// Device K/V buffers, one `[passes·capacity, kv_dim]` tensor pair per layer, and the K/V
/// rows set aside for second candidates, by (layer, pass, position).
#[derive(Debug, Clone)]
pub struct DeviceKv {
    capacity: usize,
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    aside: HashMap<AsideSlot, (Tensor, Tensor)>,
}

impl DeviceKv {
    fn new(model: &LoopedModel, capacity: usize) -> Result<Self> {
        let cfg = &model.config;
        let shape = (cfg.total_ut_steps * capacity, cfg.kv_dim());
        let zeros = |_| Tensor::zeros(shape, model.dtype, &model.device);
        let layers = cfg.num_hidden_layers;
        Ok(Self {
            capacity,
            keys: (0..layers).map(zeros).collect::<candle_core::Result<_>>()?,
            values: (0..layers).map(zeros).collect::<candle_core::Result<_>>()?,
            aside: HashMap::new(),
        })
    }

    /// Writes one K/V row (`[1, kv_dim]` tensors) at (`layer`, `pass`, `pos`).
    fn write(
        &mut self,
        layer: usize,
        pass: Pass,
        pos: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let row = pass.index() * self.capacity + pos;
        self.keys[layer].slice_set(&k.contiguous()?, 0, row)?;
        self.values[layer].slice_set(&v.contiguous()?, 0, row)?;
        Ok(())
    }
}

impl KvStore for DeviceKv {
    fn swap_aside(&mut self, layer: usize, pass: Pass, pos: usize) -> Result<()> {
        let row = pass.index() * self.capacity + pos;
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        let current = (
            keys.narrow(0, row, 1)?.copy()?,
            values.narrow(0, row, 1)?.copy()?,
        );
        // An empty slot leaves the first candidate's entry in place: the second's row is
        // about to overwrite it.
        if let Some((k, v)) = self.aside.remove(&(layer, pass, pos)) {
            keys.slice_set(&k, 0, row)?;
            values.slice_set(&v, 0, row)?;
        }
        self.aside.insert((layer, pass, pos), current);
        Ok(())
    }

    fn forget_aside(&mut self, pos: usize) {
        self.aside.retain(|&(_, _, p), _| p != pos);
    }

    fn entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let read = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.narrow(0, pass.index() * self.capacity, len)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?)
        };
        Ok((read(&self.keys[layer])?, read(&self.values[layer])?))
    }

    fn layers(&self) -> usize {
        self.keys.len()
    }
}
