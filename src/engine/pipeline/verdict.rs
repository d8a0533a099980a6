//! The walk's verdicts (`engine::pipeline`, step 3): a readout keeps one of the candidates in
//! flight for the next position or rejects them all, and a second candidate that wins takes
//! the first's place. Part of the scheduler; nothing else calls it.

use super::Pipeline;
use super::in_flight::{Decided, Readouts};
use crate::engine::error::Result;
use crate::engine::events::{Flip, StepEvent};
use crate::engine::model::StepModel;
use crate::engine::policy::{Proposal, Verdict};

impl<B: StepModel> Pipeline<B> {
    /// Carries out the policy's verdict on the candidates of the token at `index`: a first
    /// candidate found wrong is a flip (pass < R) or a misprediction found at commit (pass
    /// R); of two candidates one leaves; a rejection flushes everything younger, which was
    /// computed from a wrong token. Returns whether the walk goes on, and on a rejection the
    /// token to commit or propose instead.
    pub(super) fn settle(
        &mut self,
        index: usize,
        verdict: Verdict,
        candidates: &[Proposal],
        side_readout: Option<Decided>,
        readouts: &mut Vec<Readouts>,
        event: &mut StepEvent,
    ) -> Result<(bool, Option<Proposal>)> {
        let t = &self.window[index];
        let new = match &verdict {
            Verdict::Keep(0) => None,
            Verdict::Keep(i) => Some(candidates[*i].token),
            Verdict::Reject(p) => Some(p.token),
        };
        if let Some(new) = new {
            event.flips.push(Flip {
                pos: t.pos + 1,
                pass: t.last_pass(),
                old: self.token(candidates[0].token),
                new: self.token(new),
            });
        }
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
            if side.passes_done > 0 {
                event.rows.push(self.row_event(&side, true));
            }
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
        let side = self.window[index]
            .side
            .take()
            .expect("a second candidate is kept only where one is in flight: this is a bug");
        event.flushes.extend(self.flush_from(index + 2));
        let first = self
            .window
            .remove(index + 1)
            .expect("the first candidate is in flight: this is a bug");
        event.rows.push(self.row_event(&first, true));
        self.cache.promote_second(side.pos, side.passes_done)?;
        self.window.push_back(*side);
        readouts.truncate(index + 1);
        readouts.push(Readouts {
            main: side_readout,
            side: None,
            ran: true,
        });
        Ok(())
    }
}
