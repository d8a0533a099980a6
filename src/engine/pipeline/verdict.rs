//! The walk's verdicts (`engine::pipeline`, step 3): a readout keeps one of the candidates in
//! flight for the next position or rejects them all, a second candidate that wins takes the
//! first's place, and a pass-R readout commits. Part of the scheduler; nothing else calls it.

use super::Pipeline;
use super::in_flight::{Decided, Readouts};
use crate::engine::error::{EngineError, Result};
use crate::engine::events::{Committed, Flip, StepEvent};
use crate::engine::model::StepModel;
use crate::engine::pass::Pass;
use crate::engine::policy::{Proposal, Verdict};

impl<B: StepModel> Pipeline<B> {
    /// A policy's answer the scheduler cannot carry out (`what` it did), as an error naming
    /// the policy: the `Policy` trait's contract, broken.
    pub(super) fn policy_error(&self, what: &str) -> EngineError {
        EngineError::Invalid(format!("policy {}: {what}", self.policy.name()))
    }

    /// The flip `verdict` makes of the first candidate for the position after the token at
    /// `index`, read out at `pass`: `None` where it keeps the first. An error where it names
    /// a candidate not in flight.
    pub(super) fn flip(
        &self,
        index: usize,
        pass: Pass,
        verdict: &Verdict,
        candidates: &[Proposal],
    ) -> Result<Option<Flip>> {
        let new = match verdict {
            Verdict::Keep(0) => return Ok(None),
            Verdict::Keep(i) => candidates.get(*i).map(|c| c.token),
            Verdict::Reject(p) => Some(p.token),
        };
        let (Some(new), Some(first)) = (new, candidates.first()) else {
            return Err(self.policy_error("kept or rejected a candidate not in flight"));
        };
        Ok(Some(Flip {
            pos: self.window[index].pos + 1,
            pass,
            old: self.token(first.token),
            new: self.token(new),
        }))
    }

    /// Carries out the policy's verdict on the candidates of the token at `index` (whose
    /// flip, if any, [`Self::flip`] made): a first candidate found wrong is a flip (pass < R)
    /// or a misprediction found at commit (pass R); of two candidates one leaves; a rejection
    /// flushes everything younger, which was computed from a wrong token. Returns whether the
    /// walk goes on, and on a rejection the token to commit or propose instead.
    pub(super) fn settle(
        &mut self,
        index: usize,
        verdict: Verdict,
        side_readout: Option<Decided>,
        readouts: &mut Vec<Readouts>,
        event: &mut StepEvent,
    ) -> Result<(bool, Option<Proposal>)> {
        match verdict {
            Verdict::Keep(0) => {
                self.drop_side(index, event);
                Ok((true, None))
            }
            Verdict::Keep(_) => {
                self.promote_side(index, side_readout, readouts, event)?;
                Ok((true, None))
            }
            Verdict::Reject(instead) => {
                self.drop_side(index, event);
                event.flushes.extend(self.flush_from(index + 1));
                readouts.truncate(index + 1);
                Ok((false, Some(instead)))
            }
        }
    }

    /// The side candidate of the token at `index` lost: it leaves as a dropped row.
    pub(super) fn drop_side(&mut self, index: usize, event: &mut StepEvent) {
        if let Some(side) = self.window[index].side.take() {
            self.cache.drop_second(side.pos);
            event.rows.extend(self.last_row_event(&side, true));
        }
    }

    /// The side candidate of the token at `index` won: the first candidate leaves as a
    /// dropped row, anything it started is flushed, and the side takes its place in the
    /// window (and in the walk, with the readout it made this step).
    pub(super) fn promote_side(
        &mut self,
        index: usize,
        side_readout: Option<Decided>,
        readouts: &mut Vec<Readouts>,
        event: &mut StepEvent,
    ) -> Result<()> {
        let Some(side) = self.window[index].side.take() else {
            return Err(self.policy_error("kept a second candidate where none was in flight"));
        };
        event.flushes.extend(self.flush_from(index + 2));
        let first = self.window.remove(index + 1);
        event
            .rows
            .extend(first.and_then(|f| self.last_row_event(&f, true)));
        self.cache.promote_second(side.pos, side.passes_done)?;
        let ran = side.last_pass();
        self.window.push_back(*side);
        readouts.truncate(index + 1);
        readouts.push(Readouts {
            main: side_readout,
            side: None,
            ran,
        });
        Ok(())
    }

    /// Commits the position after the token at `index`, after its readout at `pass` (R, or an
    /// early exit's): the surviving child's token, or the readout's own choice where none
    /// survived; with where the exit gate would have stopped that token. An error where the
    /// policy answered that readout with neither.
    pub(super) fn commit_final(
        &mut self,
        index: usize,
        pass: Pass,
        surviving: Option<usize>,
        chosen: Option<Proposal>,
    ) -> Result<Committed> {
        let pos = self.window[index].pos;
        let gate_exit = self.gate_exit(index);
        let (token, depth) = match (surviving, chosen) {
            (Some(child), _) => (self.window[child].token(), self.window[child].proposed_at),
            (None, Some(commit)) => (commit.token, pass),
            (None, None) => {
                return Err(self.policy_error("answered a pass-R readout without a commit"));
            }
        };
        Ok(Committed {
            gate_exit,
            ..self.commit(pos + 1, token, depth, surviving)
        })
    }
}
