//! The policies that commit exactly the baseline's choice: ordinary decoding, SPEED, and SPEED
//! with a gated second proposal. Every readout applies the run's sampling rule (greedy, or
//! seed-coupled sampling, `engine::sampling`) and a candidate survives only if it equals that
//! choice, so their text is the baseline's token for token.

use super::{Action, Policy, Proposal, Readout, Verdict};
use crate::engine::pass::Pass;

/// The action of a policy that re-checks its candidates at every readout: commit the choice at
/// pass R when nothing is in flight, keep the candidate equal to it, or reject them all for
/// it; propose it (alone) when nothing is in flight before pass R.
fn choose_and_check(r: &Readout, candidates: &[Proposal]) -> Action {
    let best = r.sampling.choose(r.logits, r.pos, false).best;
    if candidates.is_empty() {
        if r.is_last() {
            return Action::Commit(best);
        }
        return Action::Propose {
            first: Proposal::chosen(best),
            second: None,
            gated: false,
        };
    }
    Action::Settle(
        candidates
            .iter()
            .position(|c| c.token == best)
            .map_or(Verdict::Reject(Proposal::chosen(best)), Verdict::Keep),
    )
}

/// Ordinary decoding: one token at a time through all R passes, then commit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Baseline;

impl Policy for Baseline {
    fn name(&self) -> &'static str {
        "baseline"
    }

    fn reads_out(&self, _pass: Pass, _passes: usize, _in_flight: usize) -> bool {
        false
    }

    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        choose_and_check(r, candidates)
    }
}

/// SPEED (Hooper et al., arXiv 2310.12072; `engine::pipeline`, "The step"): a child starts from the first
/// readout at or after `first_pass` and is re-checked after every deeper pass.
#[derive(Debug, Clone, Copy)]
pub struct Speed {
    /// The first pass whose readout may start a child.
    pub first_pass: Pass,
}

impl Default for Speed {
    fn default() -> Self {
        Self {
            first_pass: Pass::FIRST,
        }
    }
}

impl Policy for Speed {
    fn name(&self) -> &'static str {
        "speed"
    }

    fn reads_out(&self, pass: Pass, passes: usize, _in_flight: usize) -> bool {
        pass >= self.first_pass && pass.number() < passes
    }

    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        choose_and_check(r, candidates)
    }
}

/// SPEED with a gated second proposal (spex's extension, in the direction of LoopSpec's
/// second proposal, arXiv 2609.17184): when the readout at `first_pass` that starts a child is
/// nearly a tie (the runner-up within `margin_below` of the best), the runner-up starts too,
/// as a second candidate for the same position. The parent's next readout keeps the
/// candidate it agrees with, so a flip to the runner-up, the most common flip, no longer
/// empties a pipeline slot. Costs one more row in the steps where the gate opens. The text is
/// the baseline's: commits still come from pass R only.
#[derive(Debug, Clone, Copy)]
pub struct Dual {
    /// Where children start and are re-checked: exactly as SPEED.
    pub speed: Speed,
    /// The gate, in the readout's scores: the runner-up starts when it is less than this below
    /// the best.
    pub margin_below: f32,
}

impl Dual {
    /// A margin of 1.0: the runner-up's probability above e⁻¹ of the best's.
    pub const DEFAULT_MARGIN: f32 = 1.0;
}

impl Default for Dual {
    fn default() -> Self {
        Self {
            speed: Speed::default(),
            margin_below: Self::DEFAULT_MARGIN,
        }
    }
}

impl Policy for Dual {
    fn name(&self) -> &'static str {
        "dual"
    }

    fn reads_out(&self, pass: Pass, passes: usize, in_flight: usize) -> bool {
        self.speed.reads_out(pass, passes, in_flight)
    }

    /// SPEED's action, and where it proposes at `first_pass`, the runner-up (the largest of
    /// the other scores, the first on ties) when it is within the gate: a second scan that
    /// only those readouts pay for. Greedy scores are logits; sampled ones l/T + G.
    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        if !candidates.is_empty() || r.pass != self.speed.first_pass || r.is_last() {
            return choose_and_check(r, candidates);
        }
        let choice = r.sampling.choose(r.logits, r.pos, true);
        let second = choice
            .runner_up
            .filter(|&(_, gap)| gap < self.margin_below)
            .map(|(id, _)| Proposal::chosen(id));
        Action::Propose {
            first: Proposal::chosen(choice.best),
            second,
            gated: true,
        }
    }
}
