//! Which rows a step runs (`engine::pipeline`, "The step" and "Draft then verify"): every
//! token in flight under SPEED's pipelining; under a drafting policy, the token still
//! drafting alone, or the whole group once its drafts are in, which a draft model supplies
//! before the group's first pass. Part of the scheduler; nothing else calls it.

use std::time::{Duration, Instant};

use super::Pipeline;
use crate::engine::error::{EngineError, Result};
use crate::engine::model::{ReadoutKind, StepModel, StepRow};
use crate::engine::pass::Pass;
use crate::engine::policy::{DraftSource, Drafting, Proposal};

impl<B: StepModel> Pipeline<B> {
    /// A draft model's round ("Draft then verify"): when the verified token waits alone at
    /// pass 1, the draft model's drafts (γ, or as many as may still matter) join it. Returns
    /// the time the draft model took, which the step counts.
    pub(super) fn draft_round(&mut self) -> Result<Duration> {
        let from_model = |d: &Drafting| d.source == DraftSource::Model;
        let Some(drafting) = self.policy.drafting().filter(from_model) else {
            return Ok(Duration::ZERO);
        };
        let root = match self.window.front() {
            Some(t) if self.window.len() == 1 && t.passes_done == 0 => t.pos,
            _ => return Ok(Duration::ZERO),
        };
        let wanted = (1..=drafting.tokens)
            .take_while(|k| self.may_speculate(root + k))
            .count();
        let Some(drafter) = self.drafter.as_mut().filter(|_| wanted > 0) else {
            return Ok(Duration::ZERO);
        };
        let started = Instant::now();
        let text: Vec<u32> = self.prompt.iter().chain(&self.output).copied().collect();
        let drafts = drafter.draft(&text, wanted, &self.options.sampling)?;
        for (k, draft) in drafts.into_iter().enumerate() {
            self.spawn(root + 1 + k, draft, false, Pass::FIRST);
        }
        Ok(started.elapsed())
    }

    /// Which of the window's tokens run in this step ("Draft then verify"): all of them,
    /// except under a policy that drafts from its own passes while a token is still below
    /// the draft depth, when only those run and the rest wait.
    pub(super) fn running(&self) -> Vec<bool> {
        let drafting_below = (self.policy.drafting())
            .and_then(|d| match d.source {
                DraftSource::Passes(depth) => Some(depth.number()),
                DraftSource::Model => None,
            })
            .filter(|&depth| self.window.iter().any(|t| t.passes_done < depth));
        (self.window.iter())
            .map(|t| drafting_below.is_none_or(|depth| t.passes_done < depth))
            .collect()
    }

    /// The step's rows: each running token's, then their side candidates'; `candidates` are
    /// those in flight after each window entry.
    pub(super) fn rows(
        &mut self,
        running: &[bool],
        candidates: &[Vec<Proposal>],
    ) -> Vec<StepRow<B::Hidden>> {
        // A full draft proposes nothing more: its tokens go on to their verification.
        let draft_full = (self.policy.drafting()).is_some_and(|d| self.window.len() > d.tokens);
        let kinds: Vec<(ReadoutKind, Option<ReadoutKind>)> = (self.window.iter().zip(candidates))
            .map(|(t, c)| {
                let pass = t.next_pass();
                let kind = match draft_full && !pass.is_last(self.passes()) {
                    true => ReadoutKind::None,
                    false => self.readout_after(pass, c.len()),
                };
                // A side candidate's readout is used only if it wins in this step, which
                // takes its parent's readout: otherwise the LM head would run for nothing.
                let side_kind = t.side.as_ref().map(|s| match kind.wanted() {
                    true => self.readout_after(s.next_pass(), 0),
                    false => ReadoutKind::None,
                });
                (kind, side_kind)
            })
            .collect();
        let (mut rows, mut side_rows) = (Vec::new(), Vec::new());
        let tokens = self.window.iter_mut().zip(kinds).zip(running);
        for ((t, (kind, side_kind)), _) in tokens.filter(|(_, runs)| **runs) {
            rows.push(t.row(kind, false));
            if let (Some(side), Some(kind)) = (t.side.as_deref_mut(), side_kind) {
                side_rows.push(side.row(kind, true));
            }
        }
        rows.extend(side_rows);
        rows
    }
}

/// Errors unless a drafting policy can run: γ inside the `context` positions, a group of
/// γ + 1 rows within the rows the backend computes exactly (`invariant_rows`, `None`: any),
/// and a draft model beside the model where the policy drafts with one.
pub(super) fn check_drafting(
    policy: &str,
    drafting: Drafting,
    context: usize,
    invariant_rows: Option<usize>,
    has_drafter: bool,
) -> Result<()> {
    if drafting.tokens >= context {
        return Err(EngineError::Invalid(format!(
            "{policy} drafts γ = {} tokens per round, above the context of {context} positions",
            drafting.tokens
        )));
    }
    if let Some(rows) = invariant_rows.filter(|&rows| drafting.tokens + 1 > rows) {
        return Err(EngineError::Invalid(format!(
            "{policy} drafts γ = {} tokens per round, but this device keeps a step exact up to {rows} rows (γ + 1)",
            drafting.tokens
        )));
    }
    if drafting.source == DraftSource::Model && !has_drafter {
        return Err(EngineError::Invalid(format!(
            "policy `{policy}` drafts with a draft model, and none is loaded beside this one (--draft-model NAME)"
        )));
    }
    Ok(())
}
