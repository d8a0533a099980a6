//! The host step backend: spex's CPU kernels (`engine::kernels`) on host memory, over weight
//! matrices in the type the checkpoint stores (f32, bf16 or f16: `kernels::Weight`) and f32
//! activations, norms and KV cache (or an f16 cache). Weights stay in their candle tensors
//! and are viewed in place. Readouts of an f32 model go through `half_head` where there is
//! one (proposals in f16, commits screened exact).

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Storage, StorageRef, Tensor};

use super::backend::StepBackend;
use super::half_head::HalfHead;
use super::host_buffers;
use super::host_kv::{HostKv, KvBuffers};
use super::{BlockKind, LayerWeights, LoadOptions, LoopedModel, ReadoutKind, RowInput, RowSlot};
use crate::engine::error::{EngineError, Result};
use crate::engine::exit_gate::{ExitGate, sigmoid};
use crate::engine::kernels::prefetch::{Choice, Prefetch};
use crate::engine::kernels::{
    self, AffineMatrix, HeadSpan, Kernels, KvElement, Matrix, SubnormalsFlushed, Weight,
};
use crate::engine::kv_cache::KvCache;

/// A read view of a contiguous CPU tensor's elements as stored.
struct HostView<'a> {
    guard: StorageRef<'a>,
    start: usize,
    len: usize,
    /// The last dimension: a matrix's row length.
    inner: usize,
    /// The block kind of a matrix of quantized blocks.
    quant: Option<BlockKind>,
}

impl<'a> HostView<'a> {
    fn new(t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        if !layout.is_contiguous() || !matches!(&*guard, Storage::Cpu(_)) {
            return Err(EngineError::Invalid(
                "host kernels need contiguous CPU weights".to_string(),
            ));
        }
        // A quantized matrix is `[rows, blocks, block bytes]` (`gguf`): its rows hold the
        // blocks' weights.
        let quant = super::block_kind_of(t);
        let inner = match quant {
            Some(kind) => layout.dims()[1] * kind.block_weights(),
            None => layout.dims().last().copied().unwrap_or(1),
        };
        Ok(Self {
            guard,
            start: layout.start_offset(),
            len: layout.shape().elem_count(),
            inner,
            quant,
        })
    }

    /// The elements as the matmuls take them: f32, bf16 or f16, or quantized blocks.
    fn weight(&self) -> Result<Weight<'_>> {
        let range = self.start..self.start + self.len;
        match (&*self.guard, self.quant) {
            (Storage::Cpu(CpuStorage::F32(v)), _) => Ok(Weight::F32(&v[range])),
            (Storage::Cpu(CpuStorage::BF16(v)), _) => Ok(Weight::Bf16(&v[range])),
            (Storage::Cpu(CpuStorage::F16(v)), _) => Ok(Weight::F16(&v[range])),
            (Storage::Cpu(CpuStorage::U8(v)), Some(BlockKind::Affine(kind))) => {
                let groups = self.inner / kind.group();
                let rows = self.len / (groups * kind.block_bytes()).max(1);
                AffineMatrix::new(&v[range], rows, groups, kind)
                    .map(Weight::Affine)
                    .map_err(EngineError::Invalid)
            }
            (Storage::Cpu(CpuStorage::U8(v)), Some(BlockKind::Gguf(kind))) => {
                Weight::quantized(kind, &v[range], self.inner).map_err(EngineError::Invalid)
            }
            (other, _) => Err(EngineError::Invalid(format!(
                "host kernels read f32, bf16 or f16 weights or quantized blocks, not {:?}",
                other.dtype()
            ))),
        }
    }

    /// The elements of an f32 tensor (norm gains, which loading keeps in f32).
    fn f32(&self) -> Result<&[f32]> {
        match self.weight()? {
            Weight::F32(v) => Ok(v),
            _ => Err(EngineError::Invalid(
                "host kernels need f32 norm gains".to_string(),
            )),
        }
    }
}

/// A step's activations: `rows` rows of equal width, row-major.
#[derive(Debug, Clone)]
pub struct HostRows {
    data: Vec<f32>,
    rows: usize,
}

impl Drop for HostRows {
    /// Its buffer goes back to the thread's spares (`host_buffers`).
    fn drop(&mut self) {
        host_buffers::give(std::mem::take(&mut self.data));
    }
}

impl HostRows {
    /// Its rows' elements, taken out: not given back to the spares when it drops (a caller
    /// done with them may `host_buffers::give` them).
    fn into_data(mut self) -> Vec<f32> {
        std::mem::take(&mut self.data)
    }

    fn width(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    /// The rows at `indices`, in that order.
    fn select(&self, indices: &[usize]) -> HostRows {
        let width = self.width();
        let data = indices
            .iter()
            .flat_map(|&i| self.data[i * width..(i + 1) * width].iter().copied())
            .collect();
        HostRows {
            data,
            rows: indices.len(),
        }
    }
}

/// The weight types the host kernels read as stored.
pub const HOST_DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// spex's kernels on CPU weights as stored, with the f16 proposal head where it is faster.
#[derive(Debug, Clone)]
pub struct HostBackend {
    model: Arc<LoopedModel>,
    half_head: Option<Arc<HalfHead>>,
    options: LoadOptions,
    /// The model's own kernels: instruction set, prefetch plan, decode threads.
    kernels: Kernels,
    /// How the prefetch plan was fixed, where the loader fixed it.
    prefetch_choice: Option<Choice>,
}

impl HostBackend {
    /// The host kernels over `model`, whose weights must be on the CPU in f32, bf16 or f16 (a
    /// one-line error otherwise); builds the f16 proposal head for f32 weights unless
    /// `options` ask for f32 proposals (a bf16 or f16 head is already half the bytes).
    pub fn new(model: Arc<LoopedModel>, options: LoadOptions) -> Result<Self> {
        if !model.device.is_cpu() || !HOST_DTYPES.contains(&model.dtype) {
            return Err(EngineError::Invalid(format!(
                "the host kernels need CPU weights in f32, bf16 or f16, not {:?} {:?}",
                model.device, model.dtype
            )));
        }
        let kernels = Kernels::new(options.kernels).map_err(EngineError::Invalid)?;
        // Only an f32 head gains from an f16 copy (bf16, f16 and quantized heads are as thin).
        let half_head = if options.f32_proposals || model.weights.lm_head.dtype() != DType::F32 {
            None
        } else {
            let head = model.weights.lm_head.flatten_all()?.to_vec1::<f32>()?;
            HalfHead::new(&head, model.config.hidden, &kernels).map(Arc::new)
        };
        Ok(Self {
            model,
            half_head,
            kernels,
            prefetch_choice: options.kernels.prefetch.map(Choice::Forced),
            options,
        })
    }

    /// The model, shared.
    pub fn shared_model(&self) -> &Arc<LoopedModel> {
        &self.model
    }

    /// The options it was built with.
    pub fn options(&self) -> LoadOptions {
        self.options
    }

    /// The same model on the same threads with prefetch plan `plan` (the loader times each).
    pub fn with_prefetch(&self, plan: Prefetch) -> Self {
        Self {
            kernels: self.kernels.with_prefetch(plan),
            ..self.clone()
        }
    }

    /// The same model on `other`'s decode threads (`Kernels::on_threads_of`).
    pub fn on_threads_of(&self, other: &Kernels) -> Self {
        Self {
            kernels: self.kernels.on_threads_of(other),
            ..self.clone()
        }
    }

    /// The model with the prefetch plan `choice` fixed.
    pub fn with_prefetch_choice(self, choice: Choice) -> Self {
        Self {
            kernels: self.kernels.with_plans(choice.plans()),
            prefetch_choice: Some(choice),
            ..self
        }
    }

    /// Its kernels.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// `f` of every layer's projections as the kernels read them (the LM head left out): the
    /// pages a step streams, for a probe of the bandwidth they are read at.
    pub fn with_layer_matrices<R>(&self, f: impl FnOnce(&[Matrix<'_>]) -> R) -> Result<R> {
        let views = (self.model.weights.layers.iter())
            .flat_map(LayerWeights::projections)
            .map(HostView::new)
            .collect::<Result<Vec<_>>>()?;
        let matrices = (views.iter())
            .map(|view| {
                let weight = view.weight()?;
                Ok(Matrix {
                    weight,
                    inner: view.inner,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(f(&matrices))
    }

    /// How its prefetch plan was fixed (forced, or timed with the trials).
    pub fn prefetch_choice(&self) -> Option<&Choice> {
        self.prefetch_choice.as_ref()
    }

    /// Whether proposal readouts go through the f16 head (built where it is faster and
    /// faithful, and the options did not ask for f32 proposals).
    pub fn has_half_head(&self) -> bool {
        self.half_head.is_some()
    }

    fn eps(&self) -> f32 {
        self.model.config.rms_norm_eps as f32
    }

    /// Several linear layers on one input, in one job of the decode threads.
    fn linears<const N: usize>(
        &self,
        x: &HostRows,
        weights: [&Tensor; N],
    ) -> Result<[HostRows; N]> {
        let inner = x.width();
        let views = (weights.iter())
            .map(|w| HostView::new(w))
            .collect::<Result<Vec<_>>>()?;
        let products = (views.iter())
            .map(HostView::weight)
            .collect::<Result<Vec<_>>>()?;
        let mut outs: [Vec<f32>; N] =
            std::array::from_fn(|i| host_buffers::take(x.rows * (products[i].len() / inner)));
        let mut pairs: Vec<(Weight<'_>, &mut [f32])> = (products.into_iter())
            .zip(outs.iter_mut().map(Vec::as_mut_slice))
            .collect();
        self.kernels.matmuls_t(&x.data, x.rows, inner, &mut pairs);
        drop(pairs);
        Ok(outs.map(|data| HostRows { data, rows: x.rows }))
    }

    /// The attention of every row (each first candidate's K/V already in the cache, each
    /// second candidate's in `k`/`v` only), the rows of one pass in groups that stream that
    /// pass's cache once (`kernels::attend_group`), split across the decode threads by
    /// groups, and by heads too where the groups alone would leave a thread idle. Each row
    /// reads only entries written before any row attends, and its result does not depend on
    /// its group, its thread or the split.
    fn attend_groups<E: KvElement>(
        &self,
        layer: usize,
        slots: &[RowSlot],
        qkv: Projections<'_>,
        out: &mut [f32],
        store: &KvBuffers<E>,
    ) {
        let Projections { q, k, v } = qkv;
        let (q_dim, kv_dim) = (q.len() / slots.len(), k.len() / slots.len());
        let (shape, groups) = (self.model.attn_shape(), pass_groups(slots));
        let pool = self.kernels.pool();
        let parts = pool.threads();
        let splits = if groups.len() % parts == 0 {
            1
        } else {
            parts.min(shape.heads)
        };
        let items = groups.len() * splits;
        let out = kernels::SharedOut::new(out);
        let attend = |part: usize| {
            let (mut scores, mut item_out) = (Vec::new(), Vec::new());
            for item in (part..items).step_by(parts) {
                let group = &groups[item / splits];
                let heads = kernels::pool::share(shape.heads, splits, item % splits, 1);
                let width = heads.len() * shape.head_dim;
                let queries: Vec<kernels::Query> = (group.iter())
                    .map(|&i| {
                        let (slot, own) = (slots[i], i * kv_dim..(i + 1) * kv_dim);
                        kernels::Query {
                            q: &q[i * q_dim..(i + 1) * q_dim],
                            cached: if slot.second { slot.pos } else { slot.pos + 1 },
                            own: slot.second.then(|| (&k[own.clone()], &v[own])),
                        }
                    })
                    .collect();
                let cached = queries.iter().map(|query| query.cached).max().unwrap_or(0);
                let cache = store.pass(layer, slots[group[0]].pass, cached);
                item_out.resize(group.len() * width, 0.0);
                let at = heads.start * shape.head_dim;
                self.kernels.attend_group(
                    &queries,
                    cache,
                    HeadSpan { shape, heads },
                    &mut item_out,
                    &mut scores,
                );
                for (o, &i) in item_out.chunks_exact(width).zip(group) {
                    out.set_all(i * q_dim + at, o);
                }
            }
        };
        match items.min(parts) {
            1 => attend(0),
            _ => pool.run(&attend),
        }
    }
}

/// Rows that read one pass's cache in one attention group: each pass's rows in row order,
/// in groups of at most [`GROUP_ROWS`] (a long prompt's rows still split across threads).
fn pass_groups(slots: &[RowSlot]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        let open =
            (groups.iter_mut()).find(|g| slots[g[0]].pass == slot.pass && g.len() < GROUP_ROWS);
        match open {
            Some(group) => group.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups
}

/// The most rows in one attention group.
const GROUP_ROWS: usize = 4;

impl StepBackend for HostBackend {
    type Hidden = Vec<f32>;
    type Act = HostRows;
    type Kv = HostKv;
    type Step = SubnormalsFlushed;

    fn model(&self) -> &LoopedModel {
        &self.model
    }

    fn new_store(&self, capacity: usize) -> Result<HostKv> {
        HostKv::new(&self.model, capacity, self.options.kv_dtype)
    }

    fn enter_step(&self, _: &[RowSlot], _: &KvCache<HostKv>) -> Result<SubnormalsFlushed> {
        Ok(SubnormalsFlushed::enter())
    }

    fn embed(&self, inputs: Vec<RowInput<Vec<f32>>>) -> Result<HostRows> {
        let (hidden, vocab) = (self.model.config.hidden, self.model.config.vocab);
        let view = HostView::new(&self.model.weights.embed_tokens)?;
        let embed = view.weight()?;
        let mut data = Vec::with_capacity(inputs.len() * hidden);
        for input in &inputs {
            match input {
                RowInput::Token(id) if *id as usize >= vocab => {
                    return Err(EngineError::Invalid(format!(
                        "token id {id} is outside the vocabulary"
                    )));
                }
                RowInput::Token(id) => {
                    let id = *id as usize;
                    embed.widen_into(id * hidden..(id + 1) * hidden, &mut data);
                }
                RowInput::Hidden(state) => data.extend_from_slice(state),
            }
        }
        Ok(HostRows {
            data,
            rows: inputs.len(),
        })
    }

    fn rms_norm(&self, x: &HostRows, weight: &Tensor) -> Result<HostRows> {
        let view = HostView::new(weight)?;
        let mut data = host_buffers::take(x.data.len());
        kernels::rms_norm(&x.data, view.f32()?, self.eps(), &mut data);
        Ok(HostRows { data, ..*x })
    }

    fn linear(&self, x: &HostRows, weight: &Tensor) -> Result<HostRows> {
        let view = HostView::new(weight)?;
        let w = view.weight()?;
        let inner = x.width();
        let mut data = host_buffers::take(x.rows * (w.len() / inner));
        self.kernels.matmul_t(&x.data, w, x.rows, inner, &mut data);
        Ok(HostRows { data, ..*x })
    }

    fn gated(&self, x: &HostRows, gate: &Tensor, up: &Tensor) -> Result<HostRows> {
        let views = (HostView::new(gate)?, HostView::new(up)?);
        let (gate_w, up_w) = (views.0.weight()?, views.1.weight()?);
        let inner = x.width();
        let mut gate = host_buffers::take(x.rows * (gate_w.len() / inner));
        let mut up = host_buffers::take(x.rows * (up_w.len() / inner));
        self.kernels
            .gated_t(&x.data, x.rows, inner, (gate_w, up_w), (&mut gate, &mut up));
        host_buffers::give(up);
        Ok(HostRows {
            data: gate,
            rows: x.rows,
        })
    }

    fn add(&self, mut h: HostRows, delta: &HostRows) -> Result<HostRows> {
        h.data
            .iter_mut()
            .zip(&delta.data)
            .for_each(|(x, d)| *x += d);
        Ok(h)
    }

    fn silu_mul(&self, mut gate: HostRows, up: &HostRows) -> Result<HostRows> {
        self.kernels.silu_mul(&mut gate.data, &up.data);
        Ok(gate)
    }

    fn attention(
        &self,
        _: &SubnormalsFlushed,
        w: &LayerWeights,
        layer: usize,
        slots: &[RowSlot],
        a: &HostRows,
        cache: &mut KvCache<HostKv>,
    ) -> Result<HostRows> {
        let cfg = &self.model.config;
        let (q_dim, kv_dim, head_dim) = (cfg.heads * cfg.head_dim, cfg.kv_dim(), cfg.head_dim);
        let [mut q, mut k, mut v] = self.linears(a, [&w.q_proj, &w.k_proj, &w.v_proj])?;
        // Borrowed in place: the three go back to the spares when dropped.
        let (q, k, v) = (&mut q.data, &mut k.data, &mut v.data);
        let mut out = host_buffers::take(a.rows * q_dim);
        // RoPE; every first candidate's K/V written in row order and every second
        // candidate's set aside, each rounded as the cache stores it; then every row's
        // attention.
        let store = cache.store_mut();
        for (i, &slot) in slots.iter().enumerate() {
            let (cos, sin) = self.model.rope.at(slot.pos);
            kernels::rope_row(&mut q[i * q_dim..(i + 1) * q_dim], head_dim, cos, sin);
            let ki = &mut k[i * kv_dim..(i + 1) * kv_dim];
            kernels::rope_row(ki, head_dim, cos, sin);
            let vi = &mut v[i * kv_dim..(i + 1) * kv_dim];
            store.store((layer, slot.pass, slot.pos), slot.second, ki, vi);
        }
        for slot in slots.iter().filter(|s| s.second) {
            cache.note_second(slot.pass, slot.pos);
        }
        let qkv = Projections { q, k, v };
        match cache.store() {
            HostKv::F32(b) => self.attend_groups(layer, slots, qkv, &mut out, b),
            HostKv::F16(b) => self.attend_groups(layer, slots, qkv, &mut out, b),
        }
        Ok(HostRows {
            data: out,
            rows: a.rows,
        })
    }

    /// The LM head on the rows that asked for a readout: proposals through the f16 head where
    /// there is one and greedy commits screened exact, all in one matmul; rows that need every
    /// logit exact (sampled commits) through the f32 head.
    fn readouts(&self, slots: &[RowSlot], h: &HostRows) -> Result<Vec<Option<Vec<f32>>>> {
        let mut logits: Vec<Option<Vec<f32>>> = vec![None; slots.len()];
        let exact = |k: ReadoutKind| k == ReadoutKind::Exact || self.half_head.is_none();
        let f32_rows: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].readout.wanted() && exact(slots[i].readout))
            .collect();
        let f16_rows: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].readout.wanted() && !exact(slots[i].readout))
            .collect();
        let lm_head = &self.model.weights.lm_head;
        for (rows, through_f16) in [(f32_rows, false), (f16_rows, true)] {
            if rows.is_empty() {
                continue;
            }
            let x = h.select(&rows);
            let all = match &self.half_head {
                Some(head) if through_f16 => {
                    let screened: Vec<bool> = rows
                        .iter()
                        .map(|&i| slots[i].readout == ReadoutKind::Argmax)
                        .collect();
                    let view = HostView::new(lm_head)?;
                    head.readouts(&self.kernels, &x.data, &screened, view.f32()?)
                }
                _ => self.linear(&x, lm_head)?.into_data(),
            };
            let vocab = all.len() / rows.len();
            for (n, &i) in rows.iter().enumerate() {
                logits[i] = Some(all[n * vocab..(n + 1) * vocab].to_vec());
            }
            host_buffers::give(all);
        }
        Ok(logits)
    }

    /// Each row's `w · h + b` through the kernels' fixed-order dot product: a row's λ does not
    /// depend on the rows beside it.
    fn exit_probabilities(&self, h: &HostRows, gate: &ExitGate) -> Result<Vec<f32>> {
        let (weight, bias) = (HostView::new(&gate.weight)?, HostView::new(&gate.bias)?);
        let (w, b) = (weight.f32()?, bias.f32()?);
        let b = b.first().copied().unwrap_or(0.0);
        let width = h.width();
        Ok((h.data.chunks_exact(width))
            .map(|row| sigmoid(kernels::dot(row, w) + b))
            .collect())
    }

    fn row_states(&self, _: &[RowSlot], h: HostRows) -> Result<Vec<Vec<f32>>> {
        let width = h.width();
        Ok(h.data.chunks_exact(width).map(<[f32]>::to_vec).collect())
    }

    fn proposal_error_bound(&self, state: &Vec<f32>) -> Option<f64> {
        self.half_head.as_ref().map(|h| h.error_bound(state))
    }
}

/// One layer's query, key and value projections of a step's rows, after RoPE (`[rows ×
/// heads·head_dim]`, and `[rows × kv_heads·head_dim]` for the keys and values).
#[derive(Debug, Clone, Copy)]
struct Projections<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}
