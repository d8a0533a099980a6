//! What a policy decides, and the types it decides with: the scheduler (`engine::pipeline`)
//! asks a [`Policy`] whether a token reads out after a pass and what each readout does
//! ([`Action`]) to the candidates in flight ([`Proposal`]) for the next position.

use std::fmt;
use std::sync::Arc;

use super::super::pass::Pass;
use super::super::sampling::Sampling;
use super::EarlyExit;
/// A candidate for the next position.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// The candidate token.
    pub token: u32,
    /// The distribution `token` was drawn from, which a verification by rejection needs
    /// (LoopSpec); `None` for a deterministic choice (greedy or seed-coupled).
    pub drawn_from: Option<Arc<[f32]>>,
}

impl Proposal {
    /// A deterministic choice.
    pub fn chosen(token: u32) -> Self {
        Self {
            token,
            drawn_from: None,
        }
    }
}

/// How a readout settles the candidates in flight for the next position.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The candidate at this index (0: the first) survives; any other is dropped.
    Keep(usize),
    /// Every candidate is wrong: they and everything younger are flushed. At pass R this
    /// token is committed instead; before it, it is proposed anew.
    Reject(Proposal),
}

/// What one readout does for the next position, decided while the step is timed.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Nothing at this pass.
    Nothing,
    /// Nothing is in flight: start children, a first candidate and perhaps a second beside it.
    /// `gated` says whether a gate decided about the second (the gate-open rate's count).
    Propose {
        /// The first candidate.
        first: Proposal,
        /// A second candidate beside it, where the policy proposes one.
        second: Option<Proposal>,
        /// Whether a gate decided about the second.
        gated: bool,
    },
    /// A first candidate is in flight and the second-proposal gate was asked: what it opened
    /// for, if anything (LoopSpec's gated second proposal).
    Gate(Option<Proposal>),
    /// Keep one of the candidates in flight, or reject them all.
    Settle(Verdict),
    /// Pass R with nothing in flight: commit this token.
    Commit(u32),
    /// Before pass R, nothing in flight: commit this token now and skip the deeper passes of
    /// the one that read it out (a lossy early exit, `policy::exit`).
    Exit(u32),
}

impl Action {
    /// The token this readout stands for in events: the one it commits, keeps or proposes.
    pub fn shown(&self, candidates: &[Proposal]) -> Option<u32> {
        match self {
            Self::Nothing | Self::Gate(_) => None,
            Self::Propose { first, .. } => Some(first.token),
            Self::Settle(Verdict::Keep(i)) => candidates.get(*i).map(|c| c.token),
            Self::Settle(Verdict::Reject(p)) => Some(p.token),
            Self::Commit(token) | Self::Exit(token) => Some(*token),
        }
    }

    /// Whether a second-proposal gate was asked, and if so whether it opened.
    pub fn gate(&self) -> Option<bool> {
        match self {
            Self::Propose {
                second,
                gated: true,
                ..
            } => Some(second.is_some()),
            Self::Gate(second) => Some(second.is_some()),
            _ => None,
        }
    }
}

/// A readout as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Readout<'a> {
    /// Its logits over the vocabulary.
    pub logits: &'a [f32],
    /// The pass it was read out after.
    pub pass: Pass,
    /// R, the model's passes.
    pub passes: usize,
    /// The position it predicts (the row's position + 1).
    pub pos: usize,
    /// How logits become a token in this run.
    pub sampling: &'a Sampling,
    /// The exit gate's λ after each of the token's passes so far, this one included; empty
    /// where the model has no gate.
    pub lambdas: &'a [f32],
    /// The run's gate threshold: the checkpoint's `early_exit_threshold`, or
    /// `--exit-threshold` (`engine::exit_gate`).
    pub exit_threshold: crate::engine::exit_gate::ExitThreshold,
}

impl Readout<'_> {
    /// Whether this is the last pass's readout, which commits.
    pub fn is_last(&self) -> bool {
        self.pass.is_last(self.passes)
    }
}

/// How a draft-then-verify policy paces the window (`engine::pipeline`, "Draft then
/// verify"): `tokens` drafts (γ) follow the verified token, drafted one after another from
/// `source`; then the whole group runs its remaining passes together and pass R checks every
/// draft at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drafting {
    /// Where the drafts come from.
    pub source: DraftSource,
    /// γ: drafts per round, 1 or more.
    pub tokens: usize,
}

/// Where a draft-then-verify policy's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// The model's own first d passes (d below R): each draft runs passes 1..=d and its
    /// pass-d readout drafts the next, while the tokens past d wait.
    Passes(Pass),
    /// A separate draft model with the same tokenizer (`engine::drafter`), asked for the
    /// round's γ drafts at once before the group's first pass.
    Model,
}

/// What a policy decides for the scheduler.
pub trait Policy: Send + Sync + fmt::Debug {
    /// Its name in the CLI, events and the dashboard.
    fn name(&self) -> &'static str;

    /// A one-line complaint if the policy cannot run on a model with `passes` passes.
    fn check(&self, _passes: usize) -> Result<(), String> {
        Ok(())
    }

    /// Whether a token whose next position has `in_flight` candidates needs a readout after
    /// `pass` (< R). Pass R always reads out: it commits.
    fn reads_out(&self, pass: Pass, passes: usize, in_flight: usize) -> bool;

    /// What a readout does, given the candidates in flight for its next position (the
    /// first, then any second). At pass R it returns `Commit` or `Settle`.
    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action;

    /// Whether its text under sampling is the baseline's for the same seed: true for the
    /// policies that commit only pass-R seed-coupled choices (`engine::sampling`); a policy
    /// that verifies by rejection keeps the distribution, not the sample.
    fn keeps_baseline_sample(&self) -> bool {
        true
    }

    /// `Some` for a draft-then-verify policy: the scheduler holds the tokens past the draft
    /// depth while the next is drafted. `None` (SPEED's pipelining): every token advances a
    /// pass in every step.
    fn drafting(&self) -> Option<Drafting> {
        None
    }

    /// `Some` for a lossy early exit (`policy::exit`): it may commit before pass R, so its
    /// readouts there are commits', and the scheduler fills
    /// the skipped passes' KV entries. `None`: commits come from pass R only.
    fn early_exit(&self) -> Option<EarlyExit> {
        None
    }
}
