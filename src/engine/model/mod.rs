//! The looped (Ouro-format) decoder: K shared layers applied R times, a readout after every
//! pass. The model is immutable; all decode state lives in the `KvCache` and the hidden states
//! the caller passes in. Two implementations of the batched step share this interface: `host`
//! (CPU, f32, spex's own kernels) and `device` (candle ops, any device and dtype). `reference`
//! is the full-sequence forward used for training and as the tests' unbatched reference.

mod device;
pub mod fused;
mod half_head;
mod host;
pub mod reference;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::config::OuroConfig;
use super::error::Result;
use super::kernels;
use super::kv_cache::KvCache;

/// `SPEX_F32_PROPOSALS=1` keeps every readout on the f32 head (to compare speculation with
/// exact proposals; commits are exact either way).
fn f32_proposals_asked() -> bool {
    std::env::var_os("SPEX_F32_PROPOSALS").is_some_and(|v| v == "1")
}

/// Initial values when a `VarMap`-backed builder creates weights (training): N(0, 1/fan_in).
fn init_linear(fan_in: usize) -> candle_nn::Init {
    candle_nn::Init::Randn {
        mean: 0.0,
        stdev: (1.0 / fan_in as f64).sqrt(),
    }
}

/// Copies CPU f32 matrices into one arena: it starts on a 2 MB boundary and is offered to
/// the kernel as huge pages, and every matrix starts on a 64-byte boundary. Each tensor becomes
/// a view into the arena.
fn into_arena(mats: &mut [&mut Tensor]) -> candle_core::Result<()> {
    const HUGE_F32: usize = (2 << 20) / 4;
    let Some(device) = mats.first().map(|t| t.device().clone()) else {
        return Ok(());
    };
    let slots: Vec<usize> = mats
        .iter()
        .map(|t| t.elem_count().div_ceil(16) * 16)
        .collect();
    let total: usize = slots.iter().sum();
    let mut arena = vec![0f32; total + HUGE_F32];
    let base = arena.as_ptr().align_offset(2 << 20).min(HUGE_F32);
    kernels::advise_huge_pages(&arena[base..base + total], false);
    let mut placed = Vec::with_capacity(mats.len());
    let mut at = base;
    for (t, slot) in mats.iter_mut().zip(&slots) {
        let data = t.flatten_all()?.to_vec1::<f32>()?;
        arena[at..at + data.len()].copy_from_slice(&data);
        placed.push((at, t.shape().clone()));
        // Drop the original now, not after the loop: loading then holds the weights about
        // once plus one matrix, not twice (a 1.4B model on CPU is 5.6 GB of f32).
        **t = Tensor::zeros((), DType::F32, &device)?;
        kernels::release_free_memory();
        at += slot;
    }
    kernels::advise_huge_pages(&arena[base..base + total], true);
    let len = arena.len();
    let arena = Tensor::from_vec(arena, len, &device)?;
    for (t, (start, shape)) in mats.iter_mut().zip(placed) {
        **t = arena.narrow(0, start, shape.elem_count())?.reshape(shape)?;
    }
    Ok(())
}

/// Norm weights start at 1.
const ONES: candle_nn::Init = candle_nn::Init::Const(1.0);

/// The weights of one shared layer (all linear layers without bias, stored `[out, in]`).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
    pub input_layernorm: Tensor,
    pub input_layernorm_2: Tensor,
    pub post_attention_layernorm: Tensor,
    pub post_attention_layernorm_2: Tensor,
}

impl LayerWeights {
    /// Reads (or creates) one shared layer's tensors under `vb` (`model.layers.{i}`).
    fn load(vb: &VarBuilder, config: &OuroConfig) -> candle_core::Result<Self> {
        let hidden = config.hidden_size;
        let ones = ONES;
        let attn = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        let q_out = config.num_attention_heads * config.head_dim;
        let kv_out = config.kv_dim();
        let inter = config.intermediate_size;
        Ok(LayerWeights {
            q_proj: attn.get_with_hints((q_out, hidden), "q_proj.weight", init_linear(hidden))?,
            k_proj: attn.get_with_hints((kv_out, hidden), "k_proj.weight", init_linear(hidden))?,
            v_proj: attn.get_with_hints((kv_out, hidden), "v_proj.weight", init_linear(hidden))?,
            o_proj: attn.get_with_hints((hidden, q_out), "o_proj.weight", init_linear(q_out))?,
            gate_proj: mlp.get_with_hints(
                (inter, hidden),
                "gate_proj.weight",
                init_linear(hidden),
            )?,
            up_proj: mlp.get_with_hints((inter, hidden), "up_proj.weight", init_linear(hidden))?,
            down_proj: mlp.get_with_hints(
                (hidden, inter),
                "down_proj.weight",
                init_linear(inter),
            )?,
            input_layernorm: vb.get_with_hints(hidden, "input_layernorm.weight", ones)?,
            input_layernorm_2: vb.get_with_hints(hidden, "input_layernorm_2.weight", ones)?,
            post_attention_layernorm: vb.get_with_hints(
                hidden,
                "post_attention_layernorm.weight",
                ones,
            )?,
            post_attention_layernorm_2: vb.get_with_hints(
                hidden,
                "post_attention_layernorm_2.weight",
                ones,
            )?,
        })
    }
}

/// Every tensor of an Ouro checkpoint that the forward pass uses.
#[derive(Debug, Clone)]
pub struct Weights {
    pub embed_tokens: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// The LM head; the embedding itself when the checkpoint ties them.
    pub lm_head: Tensor,
}

impl Weights {
    /// Reads (or, for a `VarMap`-backed builder, creates) every tensor by its Ouro name.
    pub fn load(vb: &VarBuilder, config: &OuroConfig) -> candle_core::Result<Self> {
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let ones = ONES;
        let embed_tokens = vb.get_with_hints(
            (vocab, hidden),
            "model.embed_tokens.weight",
            candle_nn::Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        )?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| LayerWeights::load(&vb.pp(format!("model.layers.{i}")), config))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = vb.get_with_hints(hidden, "model.norm.weight", ones)?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            vb.get_with_hints((vocab, hidden), "lm_head.weight", init_linear(hidden))?
        };
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    /// The same weights with every matrix the host kernels stream copied into one arena of
    /// huge pages, each on a 64-byte boundary (`into_arena`): no 16-float load straddles two
    /// cache lines, a step's 17 MB of weights need a handful of TLB entries instead of
    /// thousands, and step times no longer depend on where a process's allocations land.
    pub fn aligned_for_host(mut self) -> candle_core::Result<Self> {
        let mut mats: Vec<&mut Tensor> = Vec::new();
        for layer in &mut self.layers {
            mats.extend([
                &mut layer.q_proj,
                &mut layer.k_proj,
                &mut layer.v_proj,
                &mut layer.o_proj,
                &mut layer.gate_proj,
                &mut layer.up_proj,
                &mut layer.down_proj,
            ]);
        }
        mats.push(&mut self.lm_head);
        into_arena(&mut mats)?;
        Ok(self)
    }

    /// The tensors by their Ouro names, for writing a checkpoint.
    pub fn named(&self, config: &OuroConfig) -> Vec<(String, Tensor)> {
        let mut out = vec![
            (
                "model.embed_tokens.weight".to_string(),
                self.embed_tokens.clone(),
            ),
            ("model.norm.weight".to_string(), self.norm.clone()),
        ];
        if !config.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), self.lm_head.clone()));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (name, t) in [
                ("self_attn.q_proj.weight", &l.q_proj),
                ("self_attn.k_proj.weight", &l.k_proj),
                ("self_attn.v_proj.weight", &l.v_proj),
                ("self_attn.o_proj.weight", &l.o_proj),
                ("mlp.gate_proj.weight", &l.gate_proj),
                ("mlp.up_proj.weight", &l.up_proj),
                ("mlp.down_proj.weight", &l.down_proj),
                ("input_layernorm.weight", &l.input_layernorm),
                ("input_layernorm_2.weight", &l.input_layernorm_2),
                (
                    "post_attention_layernorm.weight",
                    &l.post_attention_layernorm,
                ),
                (
                    "post_attention_layernorm_2.weight",
                    &l.post_attention_layernorm_2,
                ),
            ] {
                out.push((format!("{p}.{name}"), t.clone()));
            }
        }
        out
    }
}

/// Rotary tables for positions `0..positions`: `[positions, head_dim / 2]`, host and device.
#[derive(Debug, Clone)]
pub struct Rope {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub cos_t: Tensor,
    pub sin_t: Tensor,
}

impl Rope {
    /// Tables for `positions` positions with base `theta`, computed in f32 once for both paths.
    pub fn new(
        head_dim: usize,
        theta: f64,
        positions: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64) as f32)
            .collect();
        let (mut cos, mut sin) = (
            Vec::with_capacity(positions * half),
            Vec::with_capacity(positions * half),
        );
        for pos in 0..positions {
            for f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let cos_t = Tensor::from_slice(&cos, (positions, half), device)?.to_dtype(dtype)?;
        let sin_t = Tensor::from_slice(&sin, (positions, half), device)?.to_dtype(dtype)?;
        Ok(Self {
            half,
            cos,
            sin,
            cos_t,
            sin_t,
        })
    }

    /// Host cos and sin values for one position.
    pub fn at(&self, pos: usize) -> (&[f32], &[f32]) {
        let range = pos * self.half..(pos + 1) * self.half;
        (&self.cos[range.clone()], &self.sin[range])
    }
}

/// Which implementation runs the batched step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepBackend {
    /// spex's CPU kernels on host f32 memory.
    Host,
    /// candle ops on the model's device and dtype (GPUs; also runs on CPU for tests).
    Device,
}

/// A token's state between passes: the normed hidden state after its last pass.
#[derive(Debug, Clone)]
pub enum Hidden {
    Host(Vec<f32>),
    Device(Tensor),
}

/// What a row starts its pass from.
#[derive(Debug, Clone)]
pub enum RowInput {
    /// Pass 1: the token's embedding.
    Token(u32),
    /// Later passes: the hidden state the previous pass left.
    Hidden(Hidden),
}

/// One row of a batched step: a token at `pos` running pass `pass` (0-based).
#[derive(Debug, Clone)]
pub struct StepRow {
    pub pos: usize,
    pub pass: usize,
    pub input: RowInput,
    /// Whether to apply the LM head to this row's new state.
    pub readout: bool,
    /// A second candidate for the (pass, position) of the row before it: its K/V entries are
    /// set aside (`KvCache::promote_alternate` keeps them), the earlier row's stay in place.
    pub alternate: bool,
}

/// What a batched step returns, one entry per row in input order.
#[derive(Debug)]
pub struct StepOutput {
    pub hidden: Vec<Hidden>,
    /// Logits over the vocabulary for rows that asked for a readout.
    pub logits: Vec<Option<Vec<f32>>>,
}

/// An immutable looped model, ready to run batched steps.
#[derive(Debug)]
pub struct LoopedModel {
    pub config: OuroConfig,
    pub weights: Weights,
    pub rope: Rope,
    pub device: Device,
    pub dtype: DType,
    backend: StepBackend,
    /// The host path's f16 LM head for proposal readouts (`half_head`), where it is faster;
    /// built by `from_checkpoint` only, since it copies weights that must not change.
    half_head: Option<half_head::HalfHead>,
}

impl LoopedModel {
    /// Wraps loaded weights; picks the host kernels on CPU in f32, candle ops otherwise.
    pub fn new(config: OuroConfig, weights: Weights, device: Device, dtype: DType) -> Result<Self> {
        let positions = config.max_position_embeddings.min(1 << 16);
        let rope = Rope::new(
            config.head_dim,
            config.rope_theta,
            positions,
            &device,
            dtype,
        )?;
        let backend = if device.is_cpu() && dtype == DType::F32 {
            StepBackend::Host
        } else {
            StepBackend::Device
        };
        Ok(Self {
            config,
            weights,
            rope,
            device,
            dtype,
            backend,
            half_head: None,
        })
    }

    /// `new` for weights read from a checkpoint (not training's variables, which must stay
    /// the tensors the optimiser updates and would leave a copy stale): on the host path,
    /// matrices move to aligned buffers and proposal readouts get the f16 head.
    pub fn from_checkpoint(
        config: OuroConfig,
        weights: Weights,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        let host = device.is_cpu() && dtype == DType::F32;
        let weights = if host {
            weights.aligned_for_host()?
        } else {
            weights
        };
        let mut model = Self::new(config, weights, device, dtype)?;
        if host && !f32_proposals_asked() {
            let head = model.weights.lm_head.flatten_all()?.to_vec1::<f32>()?;
            model.half_head = half_head::HalfHead::new(&head, model.config.hidden_size);
        }
        Ok(model)
    }

    /// Forces a step implementation (the device path can run on CPU, which the tests use).
    pub fn with_backend(mut self, backend: StepBackend) -> Self {
        if backend == StepBackend::Host {
            assert!(
                self.device.is_cpu() && self.dtype == DType::F32,
                "host kernels need CPU f32 weights: this is a bug"
            );
        }
        self.backend = backend;
        self
    }

    /// The same model (sharing its weight tensors) with its steps on `backend`.
    pub fn on_backend(&self, backend: StepBackend) -> Result<Self> {
        let model = Self::new(
            self.config.clone(),
            self.weights.clone(),
            self.device.clone(),
            self.dtype,
        )?;
        Ok(Self {
            half_head: self.half_head.clone(),
            ..model
        }
        .with_backend(backend))
    }

    /// The implementation this model's steps run on.
    pub fn backend(&self) -> StepBackend {
        self.backend
    }

    /// The same model with every readout on the f32 head: ordinary greedy decoding's
    /// arithmetic, which the tests compare the screened readouts against.
    pub fn with_f32_readouts(mut self) -> Self {
        self.half_head = None;
        self
    }

    /// How far a proposal readout's logits may be from the f32 head's for the normed state
    /// `state` (a step's hidden output); `None` where readouts are f32.
    pub fn proposal_error_bound(&self, state: &[f32]) -> Option<f64> {
        self.half_head
            .as_ref()
            .filter(|_| self.backend == StepBackend::Host)
            .map(|h| h.error_bound(state))
    }

    /// R, the passes.
    pub fn passes(&self) -> usize {
        self.config.total_ut_steps
    }

    /// An empty KV cache of `capacity` positions that suits this model's step backend.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        Ok(match self.backend {
            StepBackend::Host => KvCache::new_host(&self.config, capacity),
            StepBackend::Device => {
                KvCache::new_device(&self.config, capacity, &self.device, self.dtype)?
            }
        })
    }

    /// The device path with second candidates: the other rows first, then the second
    /// candidates with the first candidates' entries set aside around them (two sweeps of
    /// the weights; the host kernels do it in one).
    fn device_step_with_alternates(
        &self,
        rows: &[StepRow],
        cache: &mut KvCache,
    ) -> Result<StepOutput> {
        let (alts, firsts): (Vec<usize>, Vec<usize>) =
            (0..rows.len()).partition(|&i| rows[i].alternate);
        let pick =
            |idx: &[usize]| -> Vec<StepRow> { idx.iter().map(|&i| rows[i].clone()).collect() };
        let first_out = device::step(self, &pick(&firsts), cache)?;
        let layers = self.weights.layers.len();
        let swap_all = |cache: &mut KvCache| -> Result<()> {
            for &i in &alts {
                for layer in 0..layers {
                    cache.swap_alternate(layer, rows[i].pass, rows[i].pos)?;
                }
            }
            Ok(())
        };
        swap_all(cache)?;
        let alt_out = device::step(self, &pick(&alts), cache)?;
        swap_all(cache)?;
        let mut slots: Vec<Option<(Hidden, Option<Vec<f32>>)>> =
            (0..rows.len()).map(|_| None).collect();
        for (idx, out) in [(&firsts, first_out), (&alts, alt_out)] {
            for ((&i, h), l) in idx.iter().zip(out.hidden).zip(out.logits) {
                slots[i] = Some((h, l));
            }
        }
        let (hidden, logits) = slots
            .into_iter()
            .map(|s| s.expect("every row ran in one of the two sweeps: this is a bug"))
            .unzip();
        Ok(StepOutput { hidden, logits })
    }

    /// Runs every row through the K shared layers once, weights read once for all rows. Each
    /// row writes its K/V at (its pass, its position) and attends to its own pass's cache up to
    /// its position (speculation.md §3, step 1); rows asking for it get a readout (step 2).
    pub fn step(&self, rows: &[StepRow], cache: &mut KvCache) -> Result<StepOutput> {
        let slots: Vec<(usize, usize)> = rows.iter().map(|r| (r.pass, r.pos)).collect();
        cache.check_slots(&slots)?;
        for row in rows {
            if row.pos >= self.rope.cos.len() / self.rope.half.max(1) {
                return Err(super::error::EngineError::CacheFull {
                    position: row.pos,
                    capacity: self.config.max_position_embeddings,
                });
            }
        }
        let out = match self.backend {
            StepBackend::Host => host::step(self, rows, cache)?,
            StepBackend::Device if rows.iter().any(|r| r.alternate) => {
                self.device_step_with_alternates(rows, cache)?
            }
            StepBackend::Device => device::step(self, rows, cache)?,
        };
        for row in rows {
            cache.mark_written(row.pass, row.pos);
        }
        Ok(out)
    }
}
