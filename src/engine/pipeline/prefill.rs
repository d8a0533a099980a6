//! The prefill: all R passes over the prompt before the pipeline starts, batched one step
//! per pass (`engine::pipeline`, "Looped models"), and the first output token.

use std::time::Instant;

use super::{Phase, Pipeline};
use crate::engine::error::{EngineError, Result};
use crate::engine::events::PrefillEvent;
use crate::engine::model::StepModel;
use crate::engine::pass::Pass;

impl<B: StepModel> Pipeline<B> {
    /// All R passes over the prompt, one batched step per pass; the last position's pass-R
    /// readout is the first output token, verified, which enters the window at pass 1.
    pub(super) fn prefill(&mut self) -> Result<PrefillEvent> {
        let started = Instant::now();
        let n = self.prompt.len();
        let readout = self.commit_readout();
        let logits = (self.backend).read_tokens(&mut self.cache, 0, &self.prompt, readout)?;
        // Non-finite weights (or a config that divides by zero) show first here: every later
        // choice would be the argmax of NaNs, the end-of-text token at once.
        if let Some(i) = logits.iter().position(|l| !l.is_finite()) {
            return Err(EngineError::Invalid(format!(
                "prefill: the logits are not finite (token {i}: {}): the checkpoint's weights \
                 hold NaN or inf, or overflow",
                logits[i]
            )));
        }
        let last = Pass::last(self.passes());
        let action = self.act(&logits, last, n, &[], &[]);
        let Some(first) = action.shown(&[]) else {
            return Err(self.policy_error("answered the prompt's pass-R readout without a commit"));
        };
        self.phase = Phase::Decoding;
        let committed = self.commit(n, first, last, None);
        Ok(PrefillEvent {
            prompt_tokens: n,
            first: committed,
            kv: self.cache.occupancy(),
            exit_threshold: (self.backend.has_exit_gate()).then(|| self.exit_threshold()),
            compute: started.elapsed(),
        })
    }
}
