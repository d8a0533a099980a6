//! The step backend: the small set of operations a batched step needs, implemented once per
//! place the step can run (`host`: spex's CPU kernels on f32 host memory; `device`: candle ops
//! on any device and dtype, the GPU path). Each backend has its own activation, hidden-state
//! and KV-buffer types, so parts of two backends cannot meet. The step itself, Ouro's
//! sandwich layer included, is written once over these operations (`model::step`).
//!
//! `model::Backend` is the choice, made once when a model is loaded.

use std::fmt;

use candle_core::Tensor;

use super::{LayerWeights, LoopedModel, RowSlot};
use crate::engine::error::Result;
use crate::engine::exit_gate::ExitGate;
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

    /// Every row's exit probability λ = σ(w · h + b) after this pass, from the normed states
    /// `h` and the model's exit gate (`engine::exit_gate`).
    fn exit_probabilities(&self, h: &Self::Act, gate: &ExitGate) -> Result<Vec<f32>>;

    /// Each of the step's rows' state, to carry into its next pass (a backend that pads its
    /// matrices drops the padding here).
    fn row_states(&self, slots: &[RowSlot], h: Self::Act) -> Result<Vec<Self::Hidden>>;

    /// How far a proposal readout's logits may be from the f32 head's for a row whose new
    /// state is `state`; `None` where readouts are the f32 head's.
    fn proposal_error_bound(&self, _state: &Self::Hidden) -> Option<f64> {
        None
    }

    /// The most rows a decode step may have and still compute each row as a one-row step
    /// does (batch invariance); `None`: any number.
    fn invariant_rows(&self) -> Option<usize> {
        None
    }
}
