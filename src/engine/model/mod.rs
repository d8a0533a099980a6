//! The looped (Ouro-format) decoder: K shared layers applied R times, a readout after every
//! pass. The model is immutable; all decode state lives in the `KvCache` and the hidden states
//! the caller passes in. Two implementations of the batched step share this interface: `host`
//! (CPU, f32, spex's own kernels) and `device` (candle ops, any device and dtype). `reference`
//! is the full-sequence forward used for training and as the tests' unbatched reference.

mod device;
mod half_head;
mod host;
pub mod reference;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::config::OuroConfig;
use super::error::Result;
use super::format::{self, LayerTensor, Role};
use super::kv_cache::KvCache;
use super::memory;

/// How a checkpoint's weights are prepared for decoding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Every readout through the f32 LM head, no f16 proposal head (to compare speculation
    /// with exact proposals; commits are exact either way). CLI: `--f32-proposals`.
    pub f32_proposals: bool,
}

/// Initial values when a `VarMap`-backed builder creates weights (training): projections
/// N(0, 1/fan_in), the LM head N(0, 1/hidden), the embedding N(0, 0.02²), norm gains 1.
fn init_for(role: Role) -> candle_nn::Init {
    let randn = |stdev: f64| candle_nn::Init::Randn { mean: 0.0, stdev };
    match role {
        Role::Embedding => randn(0.02),
        Role::Linear { fan_in } | Role::LmHead { fan_in } => randn((1.0 / fan_in as f64).sqrt()),
        Role::ExitGate => candle_nn::Init::Const(0.0),
        Role::Norm => candle_nn::Init::Const(1.0),
    }
}

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
    /// Reads (or creates) layer `index`'s tensors by their names in `format`'s table.
    fn load(vb: &VarBuilder, config: &OuroConfig, index: usize) -> candle_core::Result<Self> {
        let tensors = LayerTensor::ALL
            .map(|t| {
                let (shape, role) = t.shape_and_role(config);
                vb.get_with_hints(shape, &t.name(index), init_for(role))
            })
            .into_iter()
            .collect::<candle_core::Result<Vec<_>>>()?;
        let Ok(
            [
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                gate_proj,
                up_proj,
                down_proj,
                input_layernorm,
                input_layernorm_2,
                post_attention_layernorm,
                post_attention_layernorm_2,
            ],
        ) = <[Tensor; 11]>::try_from(tensors)
        else {
            unreachable!("LayerTensor::ALL has eleven entries: this is a bug")
        };
        Ok(LayerWeights {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            gate_proj,
            up_proj,
            down_proj,
            input_layernorm,
            input_layernorm_2,
            post_attention_layernorm,
            post_attention_layernorm_2,
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
    /// Reads (or, for a `VarMap`-backed builder, creates) every tensor the forward pass uses
    /// by its Ouro name (`format`); the exit gate is not read.
    pub fn load(vb: &VarBuilder, config: &OuroConfig) -> candle_core::Result<Self> {
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let embed_tokens = vb.get_with_hints(
            (vocab, hidden),
            format::EMBED_TOKENS,
            init_for(Role::Embedding),
        )?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| LayerWeights::load(vb, config, i))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = vb.get_with_hints(hidden, format::FINAL_NORM, init_for(Role::Norm))?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            vb.get_with_hints(
                (vocab, hidden),
                format::LM_HEAD,
                init_for(Role::LmHead { fan_in: hidden }),
            )?
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
        memory::into_arena(&mut mats)?;
        Ok(self)
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
        options: LoadOptions,
    ) -> Result<Self> {
        let host = device.is_cpu() && dtype == DType::F32;
        let weights = if host {
            weights.aligned_for_host()?
        } else {
            weights
        };
        let mut model = Self::new(config, weights, device, dtype)?;
        if host && !options.f32_proposals {
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
