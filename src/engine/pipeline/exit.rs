//! What the scheduler does with the exit gate: where it stops each committed token (reported
//! under every policy), and for a lossy early exit (`policy::exit`) the gate's λ history each
//! readout is judged by and the token that stops before pass R, whose skipped passes' KV
//! entries are filled so that later tokens attend to it at every pass.

use std::time::Instant;

use super::Pipeline;
use crate::engine::error::{EngineError, Result};
use crate::engine::events::StepEvent;
use crate::engine::exit_gate::{self, ExitThreshold};
use crate::engine::model::StepModel;
use crate::engine::pass::Pass;
use crate::engine::policy::{KvFill, Policy};

/// Errors where `policy` exits by the checkpoint's gate and the model has none.
pub(super) fn check_gate(policy: &dyn Policy, has_gate: bool) -> Result<()> {
    match policy.early_exit() {
        Some(exit) if exit.needs_gate && !has_gate => Err(EngineError::Invalid(
            "exit:gate reads the checkpoint's exit gate (model.early_exit_gate.weight and \
             .bias), and this checkpoint has none: use exit:confidence=P or exit:pass=N"
                .into(),
        )),
        _ => Ok(()),
    }
}

impl<B: StepModel> Pipeline<B> {
    /// Each of the step's rows' λ after every pass it has run, this step's included (rows in
    /// the order they ran: the running tokens, then their side candidates); empty where the
    /// model has no gate.
    pub(super) fn lambdas_by_row(&self, running: &[bool], gates: Option<&[f32]>) -> Vec<Vec<f32>> {
        // Only an early exit reads them: the lossless policies' steps allocate nothing here.
        let Some(gates) = gates.filter(|_| self.policy.early_exit().is_some()) else {
            return Vec::new();
        };
        let ran = || (self.window.iter().zip(running)).filter(|(_, ran)| **ran);
        let tokens = ran().map(|(t, _)| t);
        let sides = ran().filter_map(|(t, _)| t.side.as_deref());
        (tokens.chain(sides).zip(gates))
            .map(|(t, &lambda)| t.lambdas.iter().copied().chain([lambda]).collect())
            .collect()
    }

    /// Where the exit gate stops a token in this run: `--exit-threshold`, else the
    /// checkpoint's.
    pub(super) fn exit_threshold(&self) -> ExitThreshold {
        (self.options).exit_threshold_or(self.backend.exit_threshold())
    }

    /// Where the exit gate stops the token at `index` under the run's threshold, from the λ
    /// of the passes it ran (`exit_gate::known_exit`); `None` without a gate.
    pub(super) fn gate_exit(&self, index: usize) -> Option<Pass> {
        let lambdas = &self.window[index].lambdas;
        let threshold = self.exit_threshold();
        (!lambdas.is_empty())
            .then(|| exit_gate::known_exit(lambdas, self.passes(), threshold))
            .flatten()
    }

    /// The token at `index`, at `pos`, stops after `pass`: its deeper passes' KV entries are
    /// filled as the policy says, copies of its pass-`pass` ones or projections of its state
    /// (`policy::exit`, "The skipped passes' KV entries"), and it leaves the window at the end
    /// of the step. The fill is part of the step's compute (`event`'s and the run's), since the
    /// walk runs after the step is timed.
    pub(super) fn exit_early(
        &mut self,
        index: usize,
        pos: usize,
        pass: Pass,
        event: &mut StepEvent,
    ) -> Result<()> {
        let started = Instant::now();
        let fill = self.policy.early_exit().map(|e| e.fill).unwrap_or_default();
        match fill {
            KvFill::Project => {
                // The state this step's row left: the walk reads a token out after its step.
                let hidden = self.window[index].hidden.clone().ok_or_else(|| {
                    EngineError::Invalid(format!("exit at position {pos}: no state to project"))
                })?;
                (self.backend).project_skipped(&mut self.cache, pos, pass, hidden)?;
            }
            KvFill::Copy => self.cache.fill_skipped(pos, pass)?,
        }
        self.window[index].exited = true;
        let filled = started.elapsed();
        event.compute += filled;
        self.decode_compute += filled;
        Ok(())
    }
}
