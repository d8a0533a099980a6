//! The batched step, written once for every backend (`engine::pipeline`, "The step", 1–2): M rows,
//! each its own position and pass, through the K shared layers once, weights read once for
//! all rows; then a readout for the rows that ask. Ouro's sandwich layer lives here and
//! nowhere else (`engine::format`, "The forward pass"); `reference.rs` is the independent oracle.

use std::fmt;

use super::LayerWeights;
use super::backend::StepBackend;
use crate::engine::error::{EngineError, Result};
use crate::engine::exit_gate::ExitThreshold;
use crate::engine::kv_cache::{KvCache, KvStore};
use crate::engine::pass::Pass;

/// What the scheduler (`engine::pipeline`) asks of a looped model: its shape, empty K/V
/// buffers and the batched step. Every step backend is one, through the step written once
/// over its operations ([`step`]); the what-if oracle (`harness::what_if`) is the other, which
/// answers a step from a recorded run's readouts.
pub trait StepModel: Send + Sync + fmt::Debug + 'static {
    /// A token's state between passes.
    type Hidden: Clone + Send + fmt::Debug;
    /// The K/V buffers.
    type Kv: KvStore;

    /// R, the passes.
    fn passes(&self) -> usize;

    /// Positions the model can address (its RoPE table).
    fn positions(&self) -> usize;

    /// Empty K/V buffers for `capacity` positions of every pass.
    fn empty_kv(&self, capacity: usize) -> Result<Self::Kv>;

    /// The batched step over `rows` (`engine::pipeline`, "The step", 1–2).
    fn run_step(
        &self,
        rows: Vec<StepRow<Self::Hidden>>,
        cache: &mut KvCache<Self::Kv>,
    ) -> Result<StepOutput<Self::Hidden>>;

    /// The most rows a decode step may have and still compute each row as a one-row step
    /// does (batch invariance); `None`: any number.
    fn invariant_rows(&self) -> Option<usize> {
        None
    }

    /// Whether each step reports its rows' exit probabilities (the checkpoint has Ouro's exit
    /// gate, `engine::exit_gate`).
    fn has_exit_gate(&self) -> bool {
        false
    }

    /// Where the exit gate's threshold rule stops a token (`LoopedConfig::exit_threshold`).
    fn exit_threshold(&self) -> ExitThreshold {
        ExitThreshold::EVERY_PASS
    }

    /// Fills the K/V entries a token at `pos` skipped by stopping after `exited_at`, from its
    /// state `hidden` projected through each layer's K/V weights (`step::project_skipped`).
    fn project_skipped(
        &self,
        _cache: &mut KvCache<Self::Kv>,
        _pos: usize,
        _exited_at: Pass,
        _hidden: Self::Hidden,
    ) -> Result<()> {
        Err(EngineError::Invalid(
            "fill=project needs a model's weights; this one replays a recorded run".into(),
        ))
    }

    /// All R passes over `tokens` at positions `start..`, one batched step per pass (a
    /// prefill, or a draft model reading on): only the last token's pass-R row reads out,
    /// as `readout` asks; returns its logits (an error where there were none: no token, or
    /// `ReadoutKind::None`).
    fn read_tokens(
        &self,
        cache: &mut KvCache<Self::Kv>,
        start: usize,
        tokens: &[u32],
        readout: ReadoutKind,
    ) -> Result<Vec<f32>> {
        let passes = self.passes();
        let mut inputs: Vec<RowInput<Self::Hidden>> =
            tokens.iter().map(|&id| RowInput::Token(id)).collect();
        let mut last = None;
        for pass in Pass::all(passes) {
            let rows: Vec<StepRow<Self::Hidden>> = (inputs.drain(..).enumerate())
                .map(|(i, input)| StepRow {
                    slot: RowSlot {
                        pos: start + i,
                        pass,
                        readout: match pass.is_last(passes) && i + 1 == tokens.len() {
                            true => readout,
                            false => ReadoutKind::None,
                        },
                        second: false,
                    },
                    input,
                })
                .collect();
            let out = self.run_step(rows, cache)?;
            inputs = out.hidden.into_iter().map(RowInput::Hidden).collect();
            last = out.logits.into_iter().next_back().flatten();
        }
        last.ok_or_else(|| {
            EngineError::Invalid(format!(
                "reading {} token(s) from position {start}: no readout of the last one",
                tokens.len()
            ))
        })
    }
}

impl<B: StepBackend> StepModel for B {
    type Hidden = B::Hidden;
    type Kv = B::Kv;

    fn passes(&self) -> usize {
        self.model().passes()
    }

    fn positions(&self) -> usize {
        self.model().config.positions
    }

    fn invariant_rows(&self) -> Option<usize> {
        StepBackend::invariant_rows(self)
    }

    fn has_exit_gate(&self) -> bool {
        self.model().weights.exit_gate.is_some()
    }

    fn exit_threshold(&self) -> ExitThreshold {
        self.model().config.exit_threshold
    }

    fn project_skipped(
        &self,
        cache: &mut KvCache<Self::Kv>,
        pos: usize,
        exited_at: Pass,
        hidden: Self::Hidden,
    ) -> Result<()> {
        project_skipped(self, cache, pos, exited_at, hidden)
    }

    fn empty_kv(&self, capacity: usize) -> Result<Self::Kv> {
        self.new_store(capacity)
    }

    fn run_step(
        &self,
        rows: Vec<StepRow<Self::Hidden>>,
        cache: &mut KvCache<Self::Kv>,
    ) -> Result<StepOutput<Self::Hidden>> {
        step(self, rows, cache)
    }
}

/// What a row starts its pass from.
#[derive(Debug, Clone)]
pub enum RowInput<H> {
    /// Pass 1: the token's embedding.
    Token(u32),
    /// Later passes: the hidden state the previous pass left.
    Hidden(H),
}

/// Where a row runs: a token at `pos` running pass `pass`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSlot {
    /// The token's position.
    pub pos: usize,
    /// The pass it runs.
    pub pass: Pass,
    /// Which readout of this row's new state the LM head makes, if any.
    pub readout: ReadoutKind,
    /// A second candidate for the (pass, position) of the row before it: its K/V entries are
    /// set aside (`KvCache::promote_second` keeps them), the earlier row's stay in place.
    pub second: bool,
}

/// What a row's readout is for, which decides how exact its logits must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadoutKind {
    /// No readout.
    None,
    /// A proposal: it only steers speculation, so it may be approximate (the f16 head).
    Proposal,
    /// A greedy commit: its argmax must be the f32 head's.
    Argmax,
    /// A sampled commit: every logit must be the f32 head's (top-p and the Gumbel noise look
    /// at all of them).
    Exact,
}

impl ReadoutKind {
    /// Whether the row is read out at all.
    pub fn wanted(self) -> bool {
        self != Self::None
    }
}

/// One row of a batched step.
#[derive(Debug, Clone)]
pub struct StepRow<H> {
    /// Where it runs.
    pub slot: RowSlot,
    /// What it starts from.
    pub input: RowInput<H>,
}

/// What a batched step returns, one entry per row in input order.
#[derive(Debug)]
pub struct StepOutput<H> {
    /// Each row's new hidden state: the next pass's input.
    pub hidden: Vec<H>,
    /// Logits over the vocabulary for rows that asked for a readout.
    pub logits: Vec<Option<Vec<f32>>>,
    /// Each row's exit probability after this pass, where the model has an exit gate
    /// (`engine::exit_gate`).
    pub exit_probabilities: Option<Vec<f32>>,
}

/// Runs every row through the K shared layers once. Each row writes its K/V at (its pass, its
/// position) and attends to its own pass's cache up to its position (`engine::pipeline`, "The step", step
/// 1); rows asking for it get a readout (step 2).
pub fn step<B: StepBackend>(
    backend: &B,
    rows: Vec<StepRow<B::Hidden>>,
    cache: &mut KvCache<B::Kv>,
) -> Result<StepOutput<B::Hidden>> {
    let slots: Vec<RowSlot> = rows.iter().map(|r| r.slot).collect();
    let passes_and_positions: Vec<(Pass, usize)> = slots.iter().map(|s| (s.pass, s.pos)).collect();
    cache.check_slots(&passes_and_positions)?;
    let model = backend.model();
    if let Some(row) = slots.iter().find(|s| s.pos >= model.rope.positions()) {
        return Err(EngineError::CacheFull {
            position: row.pos,
            capacity: model.config.positions,
        });
    }
    let out = sweep(backend, rows, cache)?;
    for slot in &slots {
        cache.mark_written(slot.pass, slot.pos);
    }
    Ok(out)
}

/// One read of the weights for all `rows`.
fn sweep<B: StepBackend>(
    backend: &B,
    rows: Vec<StepRow<B::Hidden>>,
    cache: &mut KvCache<B::Kv>,
) -> Result<StepOutput<B::Hidden>> {
    let model = backend.model();
    let (slots, inputs): (Vec<RowSlot>, Vec<_>) =
        rows.into_iter().map(|r| (r.slot, r.input)).unzip();
    let step = backend.enter_step(&slots, cache)?;
    let mut h = backend.embed(inputs)?;
    for (index, layer) in model.weights.layers.iter().enumerate() {
        h = layer_forward(backend, &step, &slots, layer, index, h, cache)?;
    }
    let h = backend.rms_norm(&h, &model.weights.norm)?;
    let logits = backend.readouts(&slots, &h)?;
    // A backend that pads its rows returns theirs too: only the slots' rows are kept.
    let exit_probabilities = (model.weights.exit_gate.as_ref())
        .map(|gate| backend.exit_probabilities(&h, gate))
        .transpose()?
        .map(|mut all| {
            all.truncate(slots.len());
            all
        });
    Ok(StepOutput {
        hidden: backend.row_states(&slots, h)?,
        logits,
        exit_probabilities,
    })
}

/// Fills the K/V entries a token at `pos` skipped by stopping after `exited_at` (a lossy early
/// exit, `policy::exit`) by projection: its last state `hidden` is the input of every layer
/// of the next pass (exactly so for the first layer, the state propagation of CALM's early
/// exit for the rest), so each layer's input norm and K/V projections of it, RoPE'd at `pos`,
/// are written at the next pass and copied into the deeper ones, which share the layers. It
/// runs the step's attention op, whose query projection and attention output are wasted.
pub fn project_skipped<B: StepBackend>(
    backend: &B,
    cache: &mut KvCache<B::Kv>,
    pos: usize,
    exited_at: Pass,
    hidden: B::Hidden,
) -> Result<()> {
    let model = backend.model();
    if exited_at.is_last(model.passes()) {
        return Ok(());
    }
    let next = exited_at.next();
    cache.check_slots(&[(next, pos)])?;
    let slots = [RowSlot {
        pos,
        pass: next,
        readout: ReadoutKind::None,
        second: false,
    }];
    let step = backend.enter_step(&slots, cache)?;
    let h = backend.embed(vec![RowInput::Hidden(hidden)])?;
    for (index, layer) in model.weights.layers.iter().enumerate() {
        let a = backend.rms_norm(&h, &layer.input_layernorm)?;
        backend.attention(&step, layer, index, &slots, &a, cache)?;
    }
    cache.mark_written(next, pos);
    cache.fill_skipped(pos, next)
}

/// One shared layer with Ouro's sandwich norms (`engine::format`, "The forward pass").
fn layer_forward<B: StepBackend>(
    b: &B,
    step: &B::Step,
    slots: &[RowSlot],
    w: &LayerWeights,
    index: usize,
    h: B::Act,
    cache: &mut KvCache<B::Kv>,
) -> Result<B::Act> {
    let a = b.rms_norm(&h, &w.input_layernorm)?;
    let attn = b.attention(step, w, index, slots, &a, cache)?;
    let o = b.rms_norm(&b.linear(&attn, &w.o_proj)?, &w.input_layernorm_2)?;
    let h = b.add(h, &o)?;
    let x = b.rms_norm(&h, &w.post_attention_layernorm)?;
    let down = b.linear(&b.gated(&x, &w.gate_proj, &w.up_proj)?, &w.down_proj)?;
    let down = b.rms_norm(&down, &w.post_attention_layernorm_2)?;
    b.add(h, &down)
}
