//! The token inspector's state: for every position of the speculative lane, the last readout
//! that predicted it at each pass (the survivor's: a flushed instance's come earlier), with
//! its step, every flip of it, and how it was committed. Folded from the lane's steps by
//! [`record`]; `ui` draws the panel for the position under the cursor.

use std::collections::BTreeMap;

use crate::engine::events::{Prediction, StepEvent, Token};
use crate::engine::pass::Pass;

/// What the run knows about one position.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PositionView {
    /// Per pass (pass 1 first): the step of the last readout that predicted this position,
    /// and the readout.
    pub readouts: Vec<Option<(u64, Prediction)>>,
    /// Every flip of the prediction for this position: step, pass, old, new.
    pub flips: Vec<(u64, Pass, Token, Token)>,
    /// The committed token, the step that committed it, the depth of the proposal that
    /// survived (R: none did) and whether that proposal was a second one.
    pub committed: Option<(u64, Token, Pass, bool)>,
}

/// Folds one step of the speculative lane into `positions`.
pub fn record(positions: &mut BTreeMap<usize, PositionView>, step: &StepEvent, passes: usize) {
    for row in step.rows.iter().filter(|r| !r.dropped) {
        if let Some(p) = &row.prediction {
            let view = positions.entry(row.pos + 1).or_default();
            if view.readouts.len() < passes.max(row.pass.number()) {
                view.readouts.resize(passes.max(row.pass.number()), None);
            }
            view.readouts[row.pass.index()] = Some((step.step, p.clone()));
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
