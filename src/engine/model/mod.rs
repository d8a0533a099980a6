//! The looped (Ouro-format) decoder: K shared layers applied R times, a readout after every
//! pass. The model is immutable; all decode state lives in the `KvCache` and the hidden states
//! the caller passes in (`step(&backend, rows, &mut cache)`). `step` is the batched step,
//! written once over a [`StepBackend`]'s operations; `host` (CPU, f32, spex's own kernels,
//! proposals through `half_head`) and `device` (candle ops, any device and dtype) implement
//! them, and [`Backend`] is the choice made at load time. `reference` is the full-sequence
//! forward used for training and as the tests' unbatched reference.

pub mod backend;
mod choice;
pub mod device;
pub mod device_ops;
mod half_head;
pub mod host;
mod host_buffers;
mod host_kv;
pub mod reference;
mod step;
pub mod timing;

pub use backend::StepBackend;
pub use choice::{Backend, BackendInfo, HostInfo};
pub use host_kv::{HostKv, KvDtype};
pub use step::{ReadoutKind, RowInput, RowSlot, StepModel, StepOutput, StepRow, step};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::error::Result;
use super::exit_gate::ExitGate;
use super::format::{self, LayerTensor, Role};
use super::kernels::AttnShape;
use super::looped::LoopedConfig;
use super::memory;

/// How a checkpoint's weights are prepared for decoding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Every readout through the f32 LM head, no f16 proposal head (to compare speculation
    /// with exact proposals; commits are exact either way). CLI: `--f32-proposals`.
    pub f32_proposals: bool,
    /// The host KV cache's element type (CPU models; the device path keeps its dtype).
    /// CLI: `--kv-cache`.
    pub kv_dtype: KvDtype,
    /// Decode through candle's ops even on the CPU: the GPU path's code, as its CPU twin and
    /// the reference the host kernels are held to. CLI: `--candle-ops`.
    pub candle_ops: bool,
    /// The host kernels' instruction set, prefetch plan and threads (CPU models). CLI:
    /// `--isa`, `--prefetch`, `--threads`.
    pub kernels: crate::engine::kernels::KernelOptions,
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
    /// The query projection.
    pub q_proj: Tensor,
    /// The key projection.
    pub k_proj: Tensor,
    /// The value projection.
    pub v_proj: Tensor,
    /// The attention's output projection.
    pub o_proj: Tensor,
    /// The MLP's gate projection.
    pub gate_proj: Tensor,
    /// The MLP's up projection.
    pub up_proj: Tensor,
    /// The MLP's down projection.
    pub down_proj: Tensor,
    /// The norm's gain before attention.
    pub input_layernorm: Tensor,
    /// The norm's gain on attention's output, before the residual add.
    pub input_layernorm_2: Tensor,
    /// The norm's gain before the MLP.
    pub post_attention_layernorm: Tensor,
    /// The norm's gain on the MLP's output, before the residual add.
    pub post_attention_layernorm_2: Tensor,
}

/// A layer's seven projections, in the order the host kernels stream them, borrowed (`mut`
/// for mutably): the one list of them.
macro_rules! projections {
    ($layer:expr $(, $m:tt)?) => {
        [
            &$($m)? $layer.q_proj,
            &$($m)? $layer.k_proj,
            &$($m)? $layer.v_proj,
            &$($m)? $layer.o_proj,
            &$($m)? $layer.gate_proj,
            &$($m)? $layer.up_proj,
            &$($m)? $layer.down_proj,
        ]
    };
}

impl LayerWeights {
    /// The seven projections (`[out, in]` matrices), in the order a step streams them.
    pub fn projections(&self) -> [&Tensor; 7] {
        projections!(self)
    }

    /// Its tensor `t`.
    pub fn tensor(&self, t: LayerTensor) -> &Tensor {
        match t {
            LayerTensor::QProj => &self.q_proj,
            LayerTensor::KProj => &self.k_proj,
            LayerTensor::VProj => &self.v_proj,
            LayerTensor::OProj => &self.o_proj,
            LayerTensor::GateProj => &self.gate_proj,
            LayerTensor::UpProj => &self.up_proj,
            LayerTensor::DownProj => &self.down_proj,
            LayerTensor::InputNorm => &self.input_layernorm,
            LayerTensor::InputNorm2 => &self.input_layernorm_2,
            LayerTensor::PostAttentionNorm => &self.post_attention_layernorm,
            LayerTensor::PostAttentionNorm2 => &self.post_attention_layernorm_2,
        }
    }

    /// Reads (or creates) layer `index`'s tensors by their names in `format`'s table, in the
    /// table's order.
    fn load(vb: &VarBuilder, config: &LoopedConfig, index: usize) -> candle_core::Result<Self> {
        let get = |t: LayerTensor| {
            let (shape, role) = t.shape_and_role(config);
            vb.get_with_hints(shape, &t.name(index), init_for(role))
        };
        Ok(LayerWeights {
            q_proj: get(LayerTensor::QProj)?,
            k_proj: get(LayerTensor::KProj)?,
            v_proj: get(LayerTensor::VProj)?,
            o_proj: get(LayerTensor::OProj)?,
            gate_proj: get(LayerTensor::GateProj)?,
            up_proj: get(LayerTensor::UpProj)?,
            down_proj: get(LayerTensor::DownProj)?,
            input_layernorm: get(LayerTensor::InputNorm)?,
            input_layernorm_2: get(LayerTensor::InputNorm2)?,
            post_attention_layernorm: get(LayerTensor::PostAttentionNorm)?,
            post_attention_layernorm_2: get(LayerTensor::PostAttentionNorm2)?,
        })
    }
}

/// Every tensor of an Ouro checkpoint that the forward pass uses.
#[derive(Debug, Clone)]
pub struct Weights {
    /// The token embedding, `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// The K shared layers, in order.
    pub layers: Vec<LayerWeights>,
    /// The norm's gain after the last layer of every pass.
    pub norm: Tensor,
    /// The LM head; the embedding itself when the checkpoint ties them.
    pub lm_head: Tensor,
    /// Ouro's early-exit gate, where the checkpoint has one: evaluated beside decoding
    /// (`engine::exit_gate`), never changing a committed token.
    pub exit_gate: Option<ExitGate>,
}

impl Weights {
    /// Reads (or, for a `VarMap`-backed builder, creates) every tensor the forward pass uses
    /// by its Ouro name (`format`); the exit gate where the checkpoint holds both its tensors
    /// (a builder that creates tensors, as training's, makes none).
    pub fn load(vb: &VarBuilder, config: &LoopedConfig) -> candle_core::Result<Self> {
        let (hidden, vocab) = (config.hidden, config.vocab);
        let embed_tokens = vb.get_with_hints(
            (vocab, hidden),
            format::EMBED_TOKENS,
            init_for(Role::Embedding),
        )?;
        let layers = (0..config.layers)
            .map(|i| LayerWeights::load(vb, config, i))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = vb.get_with_hints(hidden, format::FINAL_NORM, init_for(Role::Norm))?;
        let lm_head = if config.tied {
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
            exit_gate: load_exit_gate(vb, hidden)?,
        })
    }

    /// The same weights with every matrix the host kernels stream copied into one arena of
    /// huge pages in its stored type, each on a 64-byte boundary (`into_arena`): no 16-float
    /// load straddles two cache lines, a step's 17 MB of weights need a handful of TLB entries
    /// instead of thousands, and step times no longer depend on where a process's allocations
    /// land. The norm gains, a few KB, become f32, which the host's norms read.
    pub fn aligned_for_host(self) -> candle_core::Result<Self> {
        let mut weights = self.with_f32_norms()?;
        memory::into_arena(&mut weights.host_matrices())?;
        Ok(weights)
    }

    /// The matrices the host kernels stream, in [`host_matrix_specs`]' order: every layer's
    /// projections, then the LM head.
    fn host_matrices(&mut self) -> Vec<&mut Tensor> {
        let mut mats: Vec<&mut Tensor> = Vec::new();
        for layer in &mut self.layers {
            mats.extend(projections!(layer, mut));
        }
        mats.push(&mut self.lm_head);
        mats
    }

    /// The same weights with the norm gains in f32, which the host's norms read (a few KB).
    pub fn with_f32_norms(mut self) -> candle_core::Result<Self> {
        let to_f32 = |t: &mut Tensor| -> candle_core::Result<()> {
            *t = t.to_dtype(DType::F32)?;
            Ok(())
        };
        to_f32(&mut self.norm)?;
        self.exit_gate = self.exit_gate.as_ref().map(ExitGate::to_f32).transpose()?;
        for layer in &mut self.layers {
            to_f32(&mut layer.input_layernorm)?;
            to_f32(&mut layer.input_layernorm_2)?;
            to_f32(&mut layer.post_attention_layernorm)?;
            to_f32(&mut layer.post_attention_layernorm_2)?;
        }
        Ok(self)
    }
}

/// The exit gate `vb` holds, if it holds both of its tensors.
fn load_exit_gate(vb: &VarBuilder, hidden: usize) -> candle_core::Result<Option<ExitGate>> {
    let holds = |name| vb.contains_tensor(name);
    if !(holds(format::EXIT_GATE_WEIGHT) && holds(format::EXIT_GATE_BIAS)) {
        return Ok(None);
    }
    Ok(Some(ExitGate {
        weight: vb.get((1, hidden), format::EXIT_GATE_WEIGHT)?,
        bias: vb.get(1, format::EXIT_GATE_BIAS)?,
    }))
}

/// The names and shapes of the matrices the host kernels stream, in the order a host arena
/// holds them: every layer's projections in the format's order, then the LM head (the
/// embedding where the checkpoint ties them). The loaders read these straight into the arena.
pub fn host_matrix_specs(config: &LoopedConfig) -> Vec<(String, candle_core::Shape)> {
    let mut specs = Vec::new();
    for layer in 0..config.layers {
        for t in LayerTensor::ALL {
            if let (shape, Role::Linear { .. }) = t.shape_and_role(config) {
                specs.push((t.name(layer), shape.into()));
            }
        }
    }
    let head = match config.tied {
        true => format::EMBED_TOKENS,
        false => format::LM_HEAD,
    };
    specs.push((head.to_string(), (config.vocab, config.hidden).into()));
    specs
}

/// How far a load has come, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadProgress {
    /// Before any reading: the checkpoint's files are downloading into the local hub cache,
    /// `done_bytes` of the current file's `total_bytes` (reported by the CLI's pull).
    Downloading {
        /// Bytes of the current file downloaded so far.
        done_bytes: u64,
        /// The current file's size, in bytes.
        total_bytes: u64,
    },
    /// The host kernels' matrices: `read_bytes` of `total_bytes` read into their arena.
    Reading {
        /// Bytes read so far.
        read_bytes: u64,
        /// The matrices' size, in bytes.
        total_bytes: u64,
    },
    /// Read; the first host model of a process times its steps to fix the prefetch plan.
    TimingSteps,
}

/// The kind of blocks a host tensor of quantized weights holds, ordered as headers list them:
/// GGUF's kinds first, in [`QuantKind::ALL`](crate::engine::kernels::QuantKind::ALL)'s order,
/// then mlx's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum BlockKind {
    /// GGUF's blocks, `[rows, blocks, block bytes]` of `U8` (`gguf`): the block bytes differ
    /// for every kind.
    Gguf(crate::engine::kernels::QuantKind),
    /// mlx's affine groups, `[rows, groups, ·, ·]` of `U8` (`kernels::AffineKind::dims`).
    Affine(crate::engine::kernels::AffineKind),
}

impl BlockKind {
    /// Weights a block holds along a row.
    pub fn block_weights(self) -> usize {
        match self {
            Self::Gguf(k) => k.block_weights(),
            Self::Affine(k) => k.group(),
        }
    }

    /// Its name in headers (`Q4_K`, `mlx4/g64`).
    pub fn name(self) -> String {
        match self {
            Self::Gguf(k) => k.name().to_string(),
            Self::Affine(k) => k.name(),
        }
    }
}

/// The block kind of a host tensor of quantized blocks, if `t` is one.
pub fn block_kind_of(t: &Tensor) -> Option<BlockKind> {
    match (t.dtype(), t.dims()) {
        (DType::U8, &[_, _, bytes]) => (crate::engine::kernels::QuantKind::ALL.into_iter())
            .find(|k| k.block_bytes() == bytes)
            .map(BlockKind::Gguf),
        (DType::U8, &[_, _, a, b]) => {
            crate::engine::kernels::AffineKind::from_dims([a, b]).map(BlockKind::Affine)
        }
        _ => None,
    }
}

/// Rotary tables for positions `0..positions`: `[positions, head_dim / 2]`, host and device.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Entries per position: head_dim / 2.
    pub half: usize,
    /// Host cosines, `[positions, half]` row-major, in f32.
    pub cos: Vec<f32>,
    /// Host sines, laid out the same way.
    pub sin: Vec<f32>,
    /// The cosines as a tensor on the model's device, in its dtype.
    pub cos_t: Tensor,
    /// The sines as a tensor on the model's device, in its dtype.
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

    /// Positions the tables cover.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Host cos and sin values for one position.
    pub fn at(&self, pos: usize) -> (&[f32], &[f32]) {
        let range = pos * self.half..(pos + 1) * self.half;
        (&self.cos[range.clone()], &self.sin[range])
    }
}

/// An immutable looped model: its config, weights and rotary tables. Steps run on a
/// [`StepBackend`] that holds it; the sequence forward (`reference`) runs on it directly.
#[derive(Debug)]
pub struct LoopedModel {
    /// Its shape.
    pub config: LoopedConfig,
    /// Its weights.
    pub weights: Weights,
    /// Its rotary tables.
    pub rope: Rope,
    /// The device its tensors are on.
    pub device: Device,
    /// The element type it computes in.
    pub dtype: DType,
}

impl LoopedModel {
    /// Wraps loaded (or, for training, created) weights.
    pub fn new(
        config: LoopedConfig,
        weights: Weights,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        let positions = config.positions.min(1 << 16);
        let rope = Rope::new(
            config.head_dim,
            config.rope_theta,
            positions,
            &device,
            dtype,
        )?;
        Ok(Self {
            config,
            weights,
            rope,
            device,
            dtype,
        })
    }

    /// R, the passes.
    pub fn passes(&self) -> usize {
        self.config.passes
    }

    /// The block types of its layers' quantized matrices, in order, each once (none where
    /// every matrix is dense).
    pub fn block_kinds(&self) -> Vec<BlockKind> {
        let mut kinds: Vec<BlockKind> = Vec::new();
        for layer in &self.weights.layers {
            for t in crate::engine::format::LayerTensor::ALL {
                if let Some(k) = block_kind_of(layer.tensor(t))
                    && !kinds.contains(&k)
                {
                    kinds.push(k);
                }
            }
        }
        kinds.sort();
        kinds
    }

    /// The type its layers' matrices are stored in, as the headers name it: the block types
    /// of quantized matrices (`gguf`), joined by `+` where a file mixes them (`Q4_K+Q6_K`, a
    /// Q4_K_M file), else the element type (`bf16`).
    pub fn weight_type(&self) -> String {
        let kinds = self.block_kinds();
        if !kinds.is_empty() {
            return kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join("+");
        }
        let first = self.weights.layers.first().map(|l| &l.q_proj);
        format!("{:?}", first.map_or(self.dtype, |t| t.dtype())).to_lowercase()
    }

    /// The attention's heads, K/V heads and head width.
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape {
            heads: self.config.heads,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
        }
    }
}
