//! The prefill: all R passes over the prompt before the pipeline starts, batched one step
//! per pass (`engine::pipeline`, "Looped models"), and the first output token.

use std::time::Instant;

use super::{Phase, Pipeline};
use crate::engine::error::Result;
use crate::engine::events::PrefillEvent;
use crate::engine::model::{ReadoutKind, RowInput, RowSlot, StepModel, StepRow};
use crate::engine::pass::Pass;

impl<B: StepModel> Pipeline<B> {
    /// All R passes over the prompt, one batched step per pass; the last position's pass-R
    /// readout is the first output token, verified, which enters the window at pass 1.
    pub(super) fn prefill(&mut self) -> Result<PrefillEvent> {
        let started = Instant::now();
        let passes = self.passes();
        let n = self.prompt.len();
        let mut inputs: Vec<RowInput<B::Hidden>> =
            self.prompt.iter().map(|&id| RowInput::Token(id)).collect();
        let mut last_logits = None;
        for pass in Pass::all(passes) {
            let rows: Vec<StepRow<B::Hidden>> = inputs
                .drain(..)
                .enumerate()
                .map(|(pos, input)| StepRow {
                    slot: RowSlot {
                        pos,
                        pass,
                        readout: match pass.is_last(passes) && pos + 1 == n {
                            true => self.commit_readout(),
                            false => ReadoutKind::None,
                        },
                        second: false,
                    },
                    input,
                })
                .collect();
            let out = self.backend.run_step(rows, &mut self.cache)?;
            inputs = out.hidden.into_iter().map(RowInput::Hidden).collect();
            last_logits = out.logits.into_iter().next_back().flatten();
        }
        let logits =
            last_logits.expect("prefill reads out the last position at pass R: this is a bug");
        let last = Pass::last(passes);
        let first = self
            .act(&logits, last, n, &[])
            .shown(&[])
            .expect("pass R with nothing in flight commits: this is a bug");
        self.phase = Phase::Decoding;
        let committed = self.commit(n, first, last, None);
        Ok(PrefillEvent {
            prompt_tokens: n,
            first: committed,
            kv: self.cache.occupancy(),
            compute: started.elapsed(),
        })
    }
}
