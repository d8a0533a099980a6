//! Decoding policies: where a token's readouts start children and get re-checked. The
//! scheduler in `pipeline` is the same for every policy; a policy only answers questions.

use std::fmt;

/// What a policy decides for the scheduler.
pub trait Policy: Send + Sync + fmt::Debug {
    /// Its name in the CLI, events and the dashboard.
    fn name(&self) -> &'static str;

    /// Whether a token's readout after `pass` (1-based, < `passes`) starts or re-checks its
    /// child. Pass `passes` (R) always commits and needs no permission.
    fn speculates_at(&self, pass: usize, passes: usize) -> bool;

    /// The logit margin (best over runner-up) below which a readout after `pass` that starts
    /// a child also starts the runner-up as a second candidate; `None` where it never does
    /// (the decoder then does not look for a runner-up at all).
    fn second_proposal_below(&self, _pass: usize) -> Option<f32> {
        None
    }
}

/// Ordinary greedy decoding: one token at a time through all R passes, then commit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Baseline;

impl Policy for Baseline {
    fn name(&self) -> &'static str {
        "baseline"
    }

    fn speculates_at(&self, _pass: usize, _passes: usize) -> bool {
        false
    }
}

/// SPEED (Hooper et al., arXiv 2310.12072; speculation.md §3): a child starts from the first
/// readout at or after `first_pass` and is re-checked after every deeper pass.
#[derive(Debug, Clone, Copy)]
pub struct Speed {
    pub first_pass: usize,
}

impl Default for Speed {
    fn default() -> Self {
        Self { first_pass: 1 }
    }
}

impl Policy for Speed {
    fn name(&self) -> &'static str {
        "speed"
    }

    fn speculates_at(&self, pass: usize, passes: usize) -> bool {
        pass >= self.first_pass && pass < passes
    }
}

/// SPEED with a gated second proposal (spex's extension, in the direction of LoopSpec's
/// second proposal, arXiv 2609.17184): when the pass-1 readout that starts a child is nearly a
/// tie (the runner-up within `margin_below` logits of the best), the runner-up starts too, as
/// a second candidate for the same position. The parent's pass-2 readout keeps the candidate
/// it agrees with, so a flip to the runner-up, the most common flip, no longer empties a
/// pipeline slot. Costs one more row in the steps where the gate opens. Greedy output is
/// unchanged: commits still come from pass R only.
#[derive(Debug, Clone, Copy)]
pub struct Dual {
    /// Where children start and are re-checked: exactly as SPEED.
    pub speed: Speed,
    pub margin_below: f32,
}

impl Default for Dual {
    /// A margin of 1.0 (runner-up probability above e⁻¹ of the best's) measured best on the
    /// shipped model: `spex bench` gave 2.14 / 2.09× at a margin of 0.5, 2.17 / 2.23× at 1.0,
    /// 2.13 / 2.11× at 1.5 and 2.07× at 2.0 (runs interleaved).
    fn default() -> Self {
        Self {
            speed: Speed::default(),
            margin_below: 1.0,
        }
    }
}

impl Policy for Dual {
    fn name(&self) -> &'static str {
        "dual"
    }

    fn speculates_at(&self, pass: usize, passes: usize) -> bool {
        self.speed.speculates_at(pass, passes)
    }

    fn second_proposal_below(&self, pass: usize) -> Option<f32> {
        (pass == self.speed.first_pass).then_some(self.margin_below)
    }
}

/// The policies the CLI and the dashboard can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    Speed,
    Dual,
    Baseline,
}

impl PolicyKind {
    /// A boxed policy with its default parameters.
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            Self::Speed => Box::new(Speed::default()),
            Self::Dual => Box::new(Dual::default()),
            Self::Baseline => Box::new(Baseline),
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "speed" => Ok(Self::Speed),
            "dual" => Ok(Self::Dual),
            "baseline" => Ok(Self::Baseline),
            other => Err(format!(
                "unknown policy `{other}` (expected speed, dual or baseline)"
            )),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.build().name())
    }
}
