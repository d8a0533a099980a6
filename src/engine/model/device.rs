//! The device step backend: candle ops on the model's device and dtype, the GPU path, with
//! spex's own ops ([`super::device_ops`]) where candle's would take several launches or sum a
//! row beside others. A step uploads what its layers need of the rows once ([`DeviceStep`]);
//! each layer then runs a fixed number of ops whatever the rows and passes (one RoPE split,
//! one write of every row's K and V, one [`decode_attention`] for all rows), and copies
//! nothing from the host. Every decode step's matrices have the same number of rows
//! (`padded_rows`) and the attention reduces each row over its own span, so a row's
//! arithmetic does not depend on the rows beside it. It also runs on the CPU (the tests drive
//! it there), so the code a GPU executes is exercised here.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_nn::ops::rms_norm;

use super::backend::StepBackend;
use super::device_ops::{
    NO_ROW, RowSpan, decode_attention, rope_split, silu_mul, spans_tensor, write_rows,
};
use super::{LayerWeights, LoopedModel, RowInput, RowSlot};
use crate::engine::error::{EngineError, Result};
use crate::engine::exit_gate::ExitGate;
use crate::engine::kernels::AttnShape;
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

    /// The rows every decode step's matrices have (`padded_rows`).
    pub fn step_rows(&self) -> usize {
        padded_rows(&self.model, 0)
    }

    /// The GPU's name where the model decodes on one, as its driver reports it ("NVIDIA …");
    /// `None` on the CPU.
    pub fn accelerator(&self) -> Option<String> {
        match &self.model.device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(cuda) => cuda.cuda_stream().context().name().ok(),
            _ => None,
        }
    }
}

/// What every layer of a device step needs of its rows, uploaded once per step rather than
/// once per layer: a GPU pays a launch and a host-to-device copy for each (kernel launches
/// dominate small-batch decoding), so the count per layer is fixed, whatever the rows and
/// their passes.
///
/// A second candidate shares its (pass, position) with a first candidate whose entry stays in
/// the cache; it attends to its own K/V as an extra column after its span instead (the host
/// swaps its entry in around the row; both leave the first's entry in place and the second's
/// aside), so both run in the same sweep.
#[derive(Debug)]
pub struct DeviceStep {
    /// RoPE's cos and sin at each row's position, `[rows, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
    /// Each row's cache row (pass · capacity + position), `[padded rows]` u32; [`NO_ROW`] for
    /// second candidates (their entries are set aside) and padding rows: one write of every
    /// row's K/V, the same shape in every step.
    write_to: Tensor,
    /// The second candidates: (row, pass, position), in row order.
    seconds: Vec<(usize, Pass, usize)>,
    /// What each (padded) row attends to, for [`decode_attention`]: its own pass's span up to
    /// its position (a second candidate: up to the one before, then its own K/V).
    spans: Tensor,
}

/// The rows a device step's matrices have: its own, padded with zero rows to 2·R (a window of
/// R tokens, each with a second candidate at most). Matrix kernels (cuBLAS, candle's CPU gemm)
/// are chosen by the matrices' shape, and with them the order of a row's sums; with one shape
/// for every decode step a row's results no longer depend on how many rows ran beside it, so
/// a speculative step computes a token's pass bit for bit as the baseline's one-row step does
/// (batch invariance; bf16 on candle's CPU ops went from 3–7 of 8 prompts identical to 8 of
/// 8). On a GPU the extra rows ride on the weights the step reads anyway. A prefill's rows,
/// the same in both lanes, are not padded.
fn padded_rows(model: &LoopedModel, rows: usize) -> usize {
    rows.max(2 * model.passes())
}

impl DeviceStep {
    fn new(model: &LoopedModel, slots: &[RowSlot], capacity: usize) -> Result<Self> {
        let device = &model.device;
        let padded = padded_rows(model, slots.len());
        let mut write_to: Vec<u32> = (slots.iter())
            .map(|s| match s.second {
                true => NO_ROW,
                false => (s.pass.index() * capacity + s.pos) as u32,
            })
            .collect();
        write_to.resize(padded, NO_ROW);
        let mut positions: Vec<u32> = slots.iter().map(|s| s.pos as u32).collect();
        positions.resize(padded, 0);
        let positions = Tensor::new(positions.as_slice(), device)?;
        let seconds = (slots.iter().enumerate())
            .filter(|(_, s)| s.second)
            .map(|(row, s)| (row, s.pass, s.pos))
            .collect();
        Ok(Self {
            cos: model.rope.cos_t.index_select(&positions, 0)?,
            sin: model.rope.sin_t.index_select(&positions, 0)?,
            write_to: Tensor::new(write_to.as_slice(), device)?,
            seconds,
            spans: spans_tensor(&row_spans(slots, capacity, padded), device)?,
        })
    }
}

/// What each row of `slots` attends to, padded with empty rows to `padded`: a first
/// candidate its pass's entries up to its position (its own just written); a second candidate
/// those before its position, then its own K/V (row `i` of the step's), in the column its
/// entry has in the baseline, so the online softmax's chunks fall alike.
fn row_spans(slots: &[RowSlot], capacity: usize, padded: usize) -> Vec<RowSpan> {
    let mut spans: Vec<RowSpan> = (slots.iter().enumerate())
        .map(|(i, slot)| RowSpan {
            start: slot.pass.index() * capacity,
            len: slot.pos + usize::from(!slot.second),
            extra: slot.second.then_some(i),
        })
        .collect();
    spans.resize(padded, RowSpan::EMPTY);
    spans
}

impl StepBackend for DeviceBackend {
    type Hidden = Tensor;
    type Act = Tensor;
    type Kv = DeviceKv;
    type Step = DeviceStep;

    fn model(&self) -> &LoopedModel {
        &self.model
    }

    /// Decode steps are padded to one shape of 2·R rows (`padded_rows`); a step of more
    /// rows has another shape, whose sums may fall otherwise.
    fn invariant_rows(&self) -> Option<usize> {
        Some(padded_rows(&self.model, 0))
    }

    fn new_store(&self, capacity: usize) -> Result<DeviceKv> {
        DeviceKv::new(&self.model, capacity)
    }

    fn enter_step(&self, slots: &[RowSlot], cache: &KvCache<DeviceKv>) -> Result<DeviceStep> {
        DeviceStep::new(&self.model, slots, cache.store().capacity)
    }

    /// `[padded rows, hidden]`: embeddings for pass-1 rows, carried states for the others,
    /// then zero rows up to `padded_rows`.
    fn embed(&self, inputs: Vec<RowInput<Tensor>>) -> Result<Tensor> {
        let parts = inputs
            .into_iter()
            .map(|input| match input {
                RowInput::Token(id) if id as usize >= self.model.config.vocab => Err(
                    EngineError::Invalid(format!("token id {id} is outside the vocabulary")),
                ),
                RowInput::Token(id) => {
                    Ok(self.model.weights.embed_tokens.narrow(0, id as usize, 1)?)
                }
                RowInput::Hidden(t) => Ok(t),
            })
            .collect::<Result<Vec<_>>>()?;
        let h = Tensor::cat(&parts, 0)?;
        let (rows, hidden) = h.dims2()?;
        let padding = padded_rows(&self.model, rows) - rows;
        if padding == 0 {
            return Ok(h);
        }
        let zeros = Tensor::zeros((padding, hidden), h.dtype(), h.device())?;
        Ok(Tensor::cat(&[&h, &zeros], 0)?)
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
        silu_mul(&gate, up)
    }

    /// Q/K/V projections, one [`rope_split`], one write of the first candidates' K and V,
    /// then one [`decode_attention`] for all rows: each over its own pass's span of the cache (a second
    /// candidate also over its own K/V), read in place. Grouped-query heads share their K/V
    /// head in the kernel, so the cache is never repeated per head.
    fn attention(
        &self,
        step: &DeviceStep,
        w: &LayerWeights,
        layer: usize,
        _: &[RowSlot],
        a: &Tensor,
        cache: &mut KvCache<DeviceKv>,
    ) -> Result<Tensor> {
        let AttnShape {
            heads,
            kv_heads,
            head_dim,
        } = self.model.attn_shape();
        let projections = [&w.q_proj, &w.k_proj, &w.v_proj].map(|w| self.linear(a, w));
        let [q, k, v] = projections;
        let qkv = rope_split(&q?, &k?, &v?, &step.cos, &step.sin)?;
        let (q, k) = (qkv.narrow(0, 0, heads)?, qkv.narrow(0, heads, kv_heads)?);
        let v = qkv.narrow(0, heads + kv_heads, kv_heads)?;
        write(step, layer, &k, &v, cache)?;
        let store = cache.store();
        let scale = 1.0 / (head_dim as f32).sqrt();
        decode_attention(
            &q,
            &store.keys[layer],
            &store.values[layer],
            &k,
            &v,
            &step.spans,
            scale,
        )
    }

    fn readouts(&self, slots: &[RowSlot], h: &Tensor) -> Result<Vec<Option<Vec<f32>>>> {
        let wanted: Vec<u32> = (0..slots.len() as u32)
            .filter(|&i| slots[i as usize].readout.wanted())
            .collect();
        let mut logits: Vec<Option<Vec<f32>>> = vec![None; slots.len()];
        if wanted.is_empty() {
            return Ok(logits);
        }
        // The head's product padded like the step's (repeating a wanted row).
        let mut picked = wanted.clone();
        picked.resize(padded_rows(&self.model, wanted.len()), wanted[0]);
        let sel = h.index_select(&Tensor::new(picked.as_slice(), &self.model.device)?, 0)?;
        let all = self
            .linear(&sel, &self.model.weights.lm_head)?
            .narrow(0, 0, wanted.len())?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        for (&i, l) in wanted.iter().zip(all) {
            logits[i as usize] = Some(l);
        }
        Ok(logits)
    }

    /// `σ(h · wᵀ + b)` for every row in one product (the padded rows' too, then dropped).
    fn exit_probabilities(&self, h: &Tensor, gate: &ExitGate) -> Result<Vec<f32>> {
        let w = gate.weight.to_dtype(h.dtype())?;
        let b = gate.bias.to_dtype(DType::F32)?;
        let logits = h.matmul(&w.t()?)?.to_dtype(DType::F32)?.broadcast_add(&b)?;
        Ok(candle_nn::ops::sigmoid(&logits)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    fn row_states(&self, slots: &[RowSlot], h: Tensor) -> Result<Vec<Tensor>> {
        (0..slots.len()).map(|i| Ok(h.narrow(0, i, 1)?)).collect()
    }
}

/// Writes the first candidates' K/V (`[kv_heads, rows, head_dim]`) into the cache, one write
/// each for all rows, and sets the second candidates' aside (the attention reads theirs from
/// the step's own K/V).
fn write(
    step: &DeviceStep,
    layer: usize,
    k: &Tensor,
    v: &Tensor,
    cache: &mut KvCache<DeviceKv>,
) -> Result<()> {
    let store = cache.store();
    write_rows(&store.keys[layer], k, &step.write_to)?;
    write_rows(&store.values[layer], v, &step.write_to)?;
    for &(row, pass, pos) in &step.seconds {
        // A copy of its own: a view would keep the step's whole Q/K/V tensor alive.
        let entry = |t: &Tensor| t.narrow(1, row, 1)?.force_contiguous();
        (cache.store_mut()).set_aside(layer, pass, pos, entry(k)?, entry(v)?);
        cache.note_second(pass, pos);
    }
    Ok(())
}

/// Device K/V buffers, one `[kv_heads, passes · capacity, head_dim]` tensor pair per layer
/// (head-major: the attention kernel reads a head's span contiguously), and the K/V
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
        let shape = (cfg.kv_heads, cfg.passes * capacity, cfg.head_dim);
        let zeros = |_| Tensor::zeros(shape, model.dtype, &model.device);
        let layers = cfg.layers;
        if model.device.is_cpu() {
            let bytes =
                crate::engine::memory::kv_cache_bytes(cfg, capacity, model.dtype.size_in_bytes());
            crate::engine::memory::check_kv_cache_room(capacity, bytes)?;
        }
        Ok(Self {
            capacity,
            keys: (0..layers).map(zeros).collect::<candle_core::Result<_>>()?,
            values: (0..layers).map(zeros).collect::<candle_core::Result<_>>()?,
            aside: HashMap::new(),
        })
    }

    /// Sets a second candidate's entry (`[kv_heads, 1, head_dim]` each) aside at (`layer`,
    /// `pass`, `pos`): where [`KvStore::swap_aside`] around its row would leave it.
    fn set_aside(&mut self, layer: usize, pass: Pass, pos: usize, k: Tensor, v: Tensor) {
        self.aside.insert((layer, pass, pos), (k, v));
    }
}

impl KvStore for DeviceKv {
    fn swap_aside(&mut self, layer: usize, pass: Pass, pos: usize) -> Result<()> {
        let row = pass.index() * self.capacity + pos;
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        let current = (
            keys.narrow(1, row, 1)?.contiguous()?.copy()?,
            values.narrow(1, row, 1)?.contiguous()?.copy()?,
        );
        // An empty slot leaves the first candidate's entry in place: the second's row is
        // about to overwrite it.
        if let Some((k, v)) = self.aside.remove(&(layer, pass, pos)) {
            keys.slice_set(&k, 1, row)?;
            values.slice_set(&v, 1, row)?;
        }
        self.aside.insert((layer, pass, pos), current);
        Ok(())
    }

    fn forget_aside(&mut self, pos: usize) {
        self.aside.retain(|&(_, _, p), _| p != pos);
    }

    fn copy_entry(&mut self, layer: usize, from: Pass, to: Pass, pos: usize) -> Result<()> {
        let (at, row) = (
            from.index() * self.capacity + pos,
            to.index() * self.capacity + pos,
        );
        for buffer in [&self.keys[layer], &self.values[layer]] {
            let entry = buffer.narrow(1, at, 1)?.contiguous()?.copy()?;
            buffer.slice_set(&entry, 1, row)?;
        }
        Ok(())
    }

    fn entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let read = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.narrow(1, pass.index() * self.capacity, len)?
                .transpose(0, 1)?
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
