//! What the scheduler shows of itself: its accessors, and the parts of its events built from
//! its state alone (a token with its text, a row before its readout, the finish). The walk that
//! decides what happens is in the module above.

use std::time::Duration;

use super::Pipeline;
use super::in_flight::InFlight;
use crate::engine::events::{FinishEvent, FinishReason, RowEvent, Token};
use crate::engine::kv_cache::KvCache;
use crate::engine::model::StepModel;
use crate::engine::pass::Pass;

impl<B: StepModel> Pipeline<B> {
    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Committed output ids so far.
    pub fn output(&self) -> &[u32] {
        &self.output
    }

    /// The prompt's ids.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The KV cache (tests compare it between policies).
    pub fn cache(&self) -> &KvCache<B::Kv> {
        &self.cache
    }

    /// Compute time of the decode steps so far (prefill excluded).
    pub fn decode_compute(&self) -> Duration {
        self.decode_compute
    }

    pub(super) fn finish_event(&mut self, reason: FinishReason) -> FinishEvent {
        FinishEvent {
            reason,
            tokens: self.output.clone(),
            text: self.tokenizer.decode(&self.output),
            text_tail: self.detokenizer.finish(&self.tokenizer),
            decode_compute: self.decode_compute,
            steps: self.steps,
        }
    }

    pub(super) fn token(&self, id: u32) -> Token {
        Token {
            id,
            text: self.tokenizer.token_text(id),
        }
    }

    /// The event of the row an in-flight token ran last, if it ran one (a dropped side or
    /// first candidate, a side waiting for its parent's choice).
    pub(super) fn last_row_event(
        &self,
        t: &InFlight<B::Hidden>,
        dropped: bool,
    ) -> Option<RowEvent> {
        Some(self.row_event(t, t.last_pass()?, dropped))
    }

    /// The event of an in-flight token's row at `pass`, before its readout is described.
    pub(super) fn row_event(&self, t: &InFlight<B::Hidden>, pass: Pass, dropped: bool) -> RowEvent {
        RowEvent {
            pos: t.pos,
            pass,
            token: self.token(t.token()),
            verified: t.verified,
            second: t.second,
            dropped,
            prediction: None,
            gate: None,
            checked_child: false,
            exit_probability: t.exit_probability(),
        }
    }
}
