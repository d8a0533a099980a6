//! What a trace's records must hold for its readers to trust them: every pass within the
//! header's passes, every token id within the model's vocabulary, every position within the
//! context, and each lane's steps numbered one by one. A damaged or hostile trace is then one
//! line naming the line and what is wrong with it, never a reader indexing past a per-pass
//! array, sizing a buffer by a position, or reporting a replay that "did not reproduce".

use super::race::RaceEvent;
use crate::engine::events::{Committed, DecodeEvent, Prediction, StepEvent};
use crate::engine::pass::Pass;

/// The bounds one trace's records are checked against, and each lane's last step.
pub(super) struct RecordCheck {
    passes: usize,
    /// The vocabulary's size, where the header's config gives it.
    vocab: Option<u64>,
    /// Positions a run may reach: its context (at least one past the prompt's last token).
    positions: usize,
    last_step: std::collections::HashMap<super::race::Lane, u64>,
}

impl RecordCheck {
    /// The check of a model of `passes` passes and `vocab` tokens (where known), run with a
    /// context of `context` positions.
    pub(super) fn new(passes: usize, vocab: Option<u64>, context: usize) -> Self {
        Self {
            passes,
            vocab,
            positions: context.max(1),
            last_step: Default::default(),
        }
    }

    /// Errors, as the line's message, unless `event` (read from `line`) fits the trace.
    pub(super) fn check(&mut self, line: usize, event: &RaceEvent) -> Result<(), String> {
        let RaceEvent::Decode { lane, event } = event else {
            return Ok(());
        };
        let at = |message: String| format!("line {line}: {message}");
        match event {
            DecodeEvent::Prefill(p) => {
                if p.prompt_tokens > self.positions {
                    let (n, most) = (p.prompt_tokens, self.positions);
                    return Err(at(format!("a prompt of {n} tokens in a context of {most}")));
                }
                self.occupancy(p.kv.len()).map_err(at)?;
                self.committed(&p.first).map_err(at)
            }
            DecodeEvent::Step(step) => {
                // A lane numbers its steps one by one: a step out of order, twice or
                // missing is a damaged trace.
                if let Some(last) = self.last_step.insert(*lane, step.step)
                    && step.step != last + 1
                {
                    return Err(at(format!(
                        "step {} of the {lane:?} lane follows its step {last}, not step {}",
                        step.step,
                        last + 1
                    )));
                }
                self.step(step)
                    .map_err(|e| at(format!("step {}: {e}", step.step)))
            }
            DecodeEvent::Finished(f) => (f.tokens.iter())
                .try_for_each(|&id| self.token(id))
                .map_err(at),
        }
    }

    fn step(&self, step: &StepEvent) -> Result<(), String> {
        for row in &step.rows {
            self.slot(row.pass, row.pos)?;
            self.token(row.token.id)?;
            self.prediction(row.prediction.as_ref())?;
        }
        for flip in &step.flips {
            self.slot(flip.pass, flip.pos)?;
            self.token(flip.old.id)?;
            self.token(flip.new.id)?;
        }
        for flush in &step.flushes {
            self.position(flush.first_pos.max(flush.last_pos))?;
            self.occupancy(flush.kv_freed_per_pass.len())?;
        }
        step.committed.iter().try_for_each(|c| self.committed(c))?;
        self.occupancy(step.kv.len())
    }

    fn committed(&self, c: &Committed) -> Result<(), String> {
        self.slot(c.accepted_depth, c.pos)?;
        self.token(c.token.id)
    }

    fn prediction(&self, p: Option<&Prediction>) -> Result<(), String> {
        let Some(p) = p else { return Ok(()) };
        self.token(p.token.id)?;
        p.top.iter().try_for_each(|r| self.token(r.token.id))
    }

    fn slot(&self, pass: Pass, pos: usize) -> Result<(), String> {
        if pass.number() > self.passes {
            return Err(format!(
                "pass {pass} is past the model's {} passes",
                self.passes
            ));
        }
        self.position(pos)
    }

    fn position(&self, pos: usize) -> Result<(), String> {
        match pos < self.positions {
            true => Ok(()),
            false => Err(format!(
                "position {pos} is past the context of {}",
                self.positions
            )),
        }
    }

    fn occupancy(&self, per_pass: usize) -> Result<(), String> {
        match per_pass <= self.passes {
            true => Ok(()),
            false => Err(format!(
                "{per_pass} passes of KV cache in a model of {}",
                self.passes
            )),
        }
    }

    fn token(&self, id: u32) -> Result<(), String> {
        match self.vocab {
            Some(vocab) if u64::from(id) >= vocab => Err(format!(
                "token id {id} is outside the vocabulary of {vocab}"
            )),
            _ => Ok(()),
        }
    }
}
