//! The window's entries: a token in flight with its side candidate, and what a step read
//! out for it. The scheduler in `pipeline` owns them; nothing else does.

use super::super::model::{ReadoutKind, RowInput, RowSlot, StepRow};
use super::super::pass::Pass;
use super::super::policy::{Action, Proposal};

/// A token in the pipeline window.
#[derive(Debug)]
pub(super) struct InFlight<H> {
    pub(super) pos: usize,
    /// Its token, and what it was drawn from when a policy verifies by rejection.
    pub(super) proposal: Proposal,
    /// Its id is committed (its parent finished all R passes and agreed).
    pub(super) verified: bool,
    /// Passes completed so far (a count: the rows computed for this token).
    pub(super) passes_done: usize,
    pub(super) hidden: Option<H>,
    /// The exit gate's λ after each pass it ran, where the model has a gate.
    pub(super) lambdas: Vec<f32>,
    /// It stopped before pass R (a lossy early exit): its deeper passes' KV entries are
    /// filled, and it leaves the window at the end of the step.
    pub(super) exited: bool,
    /// The pass of the parent's readout that proposed this guess (γ: `harness::metrics`).
    pub(super) proposed_at: Pass,
    /// Proposed as a second candidate, for acceptance by source.
    pub(super) second: bool,
    /// A second candidate for this token's next position, beside the first (its child, the
    /// next token in the window). It runs its passes like any token, with its KV entries set
    /// aside, and starts no children until its parent's readout chooses it.
    pub(super) side: Option<Box<InFlight<H>>>,
}

impl<H> InFlight<H> {
    /// A token at `pos` that has run no pass yet.
    pub(super) fn new(pos: usize, proposal: Proposal, verified: bool, proposed_at: Pass) -> Self {
        Self {
            pos,
            proposal,
            verified,
            passes_done: 0,
            hidden: None,
            lambdas: Vec::new(),
            exited: false,
            proposed_at,
            second: false,
            side: None,
        }
    }

    /// The exit gate's λ after its last pass, where the model has a gate.
    pub(super) fn exit_probability(&self) -> Option<f32> {
        self.lambdas.last().copied()
    }

    /// Whether it has run every pass it will: all R, or it stopped early.
    pub(super) fn is_done(&self, passes: usize) -> bool {
        self.exited || self.passes_done == passes
    }

    pub(super) fn token(&self) -> u32 {
        self.proposal.token
    }

    /// The pass this token runs in the next step.
    pub(super) fn next_pass(&self) -> Pass {
        Pass::from_index(self.passes_done)
    }

    /// The pass it ran last, if it ran one.
    pub(super) fn last_pass(&self) -> Option<Pass> {
        Pass::new(self.passes_done)
    }

    /// Rows computed for it and its side candidate.
    pub(super) fn rows_done(&self) -> usize {
        self.passes_done + self.side.as_ref().map_or(0, |s| s.passes_done)
    }

    /// Its row in the next step.
    pub(super) fn row(&mut self, readout: ReadoutKind, second: bool) -> StepRow<H> {
        StepRow {
            slot: RowSlot {
                pos: self.pos,
                pass: self.next_pass(),
                readout,
                second,
            },
            input: match self.hidden.take() {
                Some(h) => RowInput::Hidden(h),
                None => RowInput::Token(self.token()),
            },
        }
    }
}

/// A row's logits with the policy's action on them.
pub(super) type Decided = (Vec<f32>, Action);

/// What one window entry's rows read out in a step: its own, and its side candidate's.
#[derive(Debug, Default)]
pub(super) struct Readouts {
    pub(super) main: Option<Decided>,
    pub(super) side: Option<Decided>,
    /// The pass its row ran in this step, if it ran (a token waiting for a draft does not).
    pub(super) ran: Option<Pass>,
}
