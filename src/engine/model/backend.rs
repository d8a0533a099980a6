//! The step backend: the small set of operations a batched step needs, implemented once per
//! place the step can run (`host`: spex's CPU kernels on f32 host memory; `device`: candle ops
//! on any device and dtype, the GPU path). Each backend has its own activation, hidden-state
//! and KV-buffer types, so parts of two backends cannot meet. The step itself, Ouro's
//! sandwich layer included, is written once over these operations (`model::step`).
//!
//! [`Backend`] is the choice, made once when a model is loaded.

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::device::DeviceBackend;
use super::host::{HOST_DTYPES, HostBackend};
use super::{LayerWeights, LoadOptions, LoopedModel, RowSlot, Weights};
use crate::engine::config::OuroConfig;
use crate::engine::error::Result;
use crate::engine::kv_cache::{KvCache, KvStore};

/// One implementation of the batched step's operations.
pub trait StepBackend: Send + Sync + fmt::Debug + 'static {
    /// A token's state between passes: the normed hidden state after its last pass.
    type Hidden: Clone + Send + fmt::Debug;
    /// The activations of a step's rows, `[rows × width]`.
    type Act;
    /// The K/V buffers.
    type Kv: KvStore;
    /// What a step keeps while it runs: what every layer needs of the rows, computed once per
    /// step (the device's RoPE rows, cache-write indices and attention mask), or a guard (the
    /// host flushes subnormals).
    type Step;
    /// The model whose weights the operations read.
    fn model(&self) -> &LoopedModel;

    /// Empty K/V buffers for `capacity` positions of every pass.
    fn new_store(&self, capacity: usize) -> Result<Self::Kv>;

    /// Enters a step over the rows `slots`.
    fn enter_step(&self, slots: &[RowSlot], cache: &KvCache<Self::Kv>) -> Result<Self::Step>;

    /// Each row's input: a token's embedding (pass 1) or the state its last pass left.
    fn embed(&self, inputs: Vec<super::RowInput<Self::Hidden>>) -> Result<Self::Act>;

    /// RMSNorm of every row with gains `weight`.
    fn rms_norm(&self, x: &Self::Act, weight: &Tensor) -> Result<Self::Act>;

    /// `x · wᵀ` for a linear layer's weight stored `[out, in]`.
    fn linear(&self, x: &Self::Act, weight: &Tensor) -> Result<Self::Act>;

    /// `silu(x · gateᵀ) ⊙ (x · upᵀ)`: the MLP's first half. A backend that splits a step
    /// across threads does it in one job.
    fn gated(&self, x: &Self::Act, gate: &Tensor, up: &Tensor) -> Result<Self::Act> {
        let up = self.linear(x, up)?;
        self.silu_mul(self.linear(x, gate)?, &up)
    }

    /// `h + delta` (the residual stream), reusing `h`.
    fn add(&self, h: Self::Act, delta: &Self::Act) -> Result<Self::Act>;

    /// `silu(gate) · up`, reusing `gate`.
    fn silu_mul(&self, gate: Self::Act, up: &Self::Act) -> Result<Self::Act>;

    /// Attention of layer `layer`: the Q/K/V projections of `a`, RoPE at each row's position,
    /// each row's K/V written at (its pass, its position), and each row's causal attention
    /// over its own pass's entries up to its position. `[rows × heads·head_dim]`.
    fn attention(
        &self,
        step: &Self::Step,
        w: &LayerWeights,
        layer: usize,
        slots: &[RowSlot],
        a: &Self::Act,
        cache: &mut KvCache<Self::Kv>,
    ) -> Result<Self::Act>;

    /// The LM head on the rows that ask for a readout (logits over the vocabulary, f32).
    fn readouts(&self, slots: &[RowSlot], h: &Self::Act) -> Result<Vec<Option<Vec<f32>>>>;

    /// Each of the step's rows' state, to carry into its next pass (a backend that pads its
    /// matrices drops the padding here).
    fn row_states(&self, slots: &[RowSlot], h: Self::Act) -> Result<Vec<Self::Hidden>>;

    /// How far a proposal readout's logits may be from the f32 head's for a row whose new
    /// state is `state`; `None` where readouts are the f32 head's.
    fn proposal_error_bound(&self, _state: &Self::Hidden) -> Option<f64> {
        None
    }
}

/// The backend a model was loaded with: chosen once, from its device and dtype.
#[derive(Debug, Clone)]
pub enum Backend {
    /// spex's CPU kernels (CPU, f32).
    Host(Arc<HostBackend>),
    /// candle ops on the model's device and dtype.
    Device(Arc<DeviceBackend>),
}

impl Backend {
    /// The host kernels on the CPU in f32, bf16 or f16, reading the weights in that type (copied
    /// to aligned huge pages first; the first in a process also fixes the kernels' prefetch
    /// plan by timing its steps); candle ops on other devices, and on the CPU where `options`
    /// ask for them (the GPU path's CPU twin).
    pub fn for_weights(
        config: OuroConfig,
        weights: Weights,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Self> {
        if Self::runs_on_host(device, dtype, options) {
            return Self::host(config, weights.aligned_for_host()?, dtype, options);
        }
        let model = LoopedModel::new(config, weights, device.clone(), dtype)?;
        Ok(Self::Device(Arc::new(DeviceBackend::new(Arc::new(model)))))
    }

    /// Whether a model loaded on `device` in `dtype` with `options` decodes on the host
    /// kernels: the one rule [`Backend::for_weights`] and the loaders follow.
    pub fn runs_on_host(device: &Device, dtype: DType, options: LoadOptions) -> bool {
        device.is_cpu() && HOST_DTYPES.contains(&dtype) && !options.candle_ops
    }

    /// The host kernels over weights already laid out for them (`Weights::aligned_for_host`,
    /// or read straight into an arena); the first in a process also fixes the kernels'
    /// prefetch plan by timing its steps.
    pub fn host(
        config: OuroConfig,
        weights: Weights,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Self> {
        let model = LoopedModel::new(config, weights, Device::Cpu, dtype)?;
        let host = HostBackend::new(Arc::new(model), options)?;
        crate::engine::metrics::choose_prefetch(&host)?;
        Ok(Self::Host(Arc::new(host)))
    }

    /// The model the backend steps.
    pub fn model(&self) -> &Arc<LoopedModel> {
        match self {
            Self::Host(b) => b.shared_model(),
            Self::Device(b) => b.shared_model(),
        }
    }

    /// Its name, for reports.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Host(_) => "host kernels",
            Self::Device(_) => "candle ops",
        }
    }
}
