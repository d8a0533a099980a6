//! The token inspector's state: for every position of the speculative lane, the last readout
//! that predicted it at each pass (the survivor's: a flushed instance's come earlier), with
//! its step, every flip of it, and how it was committed. Folded from the lane's steps by
//! [`record`]; `ui` draws the panel for the position under the cursor.

use std::collections::BTreeMap;

use crate::engine::events::{Prediction, StepEvent, Token};
use crate::engine::exit_gate::{ExitThreshold, exits_at, known_exit};
use crate::engine::pass::Pass;

/// What the run knows about one position.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PositionView {
    /// Per pass (pass 1 first): the step of the last readout that predicted this position,
    /// and the readout.
    pub readouts: Vec<Option<(u64, Prediction)>>,
    /// Per pass: the exit gate's λ after it on the row that read out (Ouro's gate,
    /// `engine::exit_gate`), where the model has one.
    pub exit_probabilities: Vec<Option<f32>>,
    /// Every flip of the prediction for this position: step, pass, old, new.
    pub flips: Vec<(u64, Pass, Token, Token)>,
    /// The committed token, the step that committed it, the depth of the proposal that
    /// survived (R: none did) and whether that proposal was a second one.
    pub committed: Option<(u64, Token, Pass, bool)>,
}

/// The exit gate at one pass of a position (Ouro's exit distribution, `engine::exit_gate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateAt {
    /// The probability of exiting at this pass: λ times the chance of getting here.
    pub exit: f32,
    /// The chance of having exited by this pass, the exits so far summed: a threshold rule
    /// stops at the first pass where it reaches the threshold.
    pub by_now: f32,
}

impl PositionView {
    /// The gate at each pass, pass 1 first, as far as every pass before has a λ
    /// (`exit_gate::exits_at`).
    pub fn gate_at_passes(&self) -> Vec<GateAt> {
        let known: Vec<f32> = self.exit_probabilities.iter().map_while(|l| *l).collect();
        let mut by_now = 0.0f32;
        (exits_at(&known).into_iter())
            .map(|exit| {
                by_now += exit;
                GateAt { exit, by_now }
            })
            .collect()
    }
}

impl PositionView {
    /// The pass Ouro's exit gate stops this position's predicting token at under `threshold`
    /// (the run's: `PrefillEvent::exit_threshold`), as far as its λ are known
    /// (`exit_gate::known_exit`).
    pub fn gate_exit(&self, threshold: ExitThreshold) -> Option<Pass> {
        let known: Vec<f32> = self.exit_probabilities.iter().map_while(|l| *l).collect();
        known_exit(&known, self.exit_probabilities.len(), threshold)
    }
}

/// Folds one step of the speculative lane into `positions`.
pub fn record(positions: &mut BTreeMap<usize, PositionView>, step: &StepEvent, passes: usize) {
    for row in step.rows.iter().filter(|r| !r.dropped) {
        let len = passes.max(row.pass.number());
        if let Some(p) = &row.prediction {
            let view = positions.entry(row.pos + 1).or_default();
            set_pass(&mut view.readouts, len, row.pass, (step.step, p.clone()));
        }
        if let Some(lambda) = row.exit_probability {
            let view = positions.entry(row.pos + 1).or_default();
            set_pass(&mut view.exit_probabilities, len, row.pass, lambda);
        }
    }
    for f in &step.flips {
        let flip = (step.step, f.pass, f.old.clone(), f.new.clone());
        positions.entry(f.pos).or_default().flips.push(flip);
    }
    for c in &step.committed {
        let view = positions.entry(c.pos).or_default();
        view.committed = Some((step.step, c.token.clone(), c.accepted_depth, c.from_second));
    }
}

/// `per_pass[pass] = value`, the list first grown to at least `len` passes.
fn set_pass<T: Clone>(per_pass: &mut Vec<Option<T>>, len: usize, pass: Pass, value: T) {
    if per_pass.len() < len {
        per_pass.resize(len, None);
    }
    per_pass[pass.index()] = Some(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_at_each_pass_follows_the_exit_distribution_until_a_lambda_is_missing() {
        let view = PositionView {
            exit_probabilities: vec![Some(0.5), Some(0.5), Some(0.5), None, Some(0.9)],
            ..PositionView::default()
        };
        let gates = view.gate_at_passes();
        let exits: Vec<f32> = gates.iter().map(|g| g.exit).collect();
        let by_now: Vec<f32> = gates.iter().map(|g| g.by_now).collect();
        assert_eq!(exits, [0.5, 0.25, 0.125]);
        assert_eq!(by_now, [0.5, 0.75, 0.875]);
    }
}
