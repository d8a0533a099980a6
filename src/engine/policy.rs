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

    fn speculates_at(&self, pass: usize, passes: usize) -> bool {
        self.speed.speculates_at(pass, passes)
    }

    fn second_proposal_below(&self, pass: usize) -> Option<f32> {
        (pass == self.speed.first_pass).then_some(self.margin_below)
    }
}

/// The policies the CLI, models.toml and the dashboard can name: `speed`, `baseline`, `dual`
/// or `dual:MARGIN` (the second-proposal gate in logits; the gate's best value depends on how
/// peaked a model's pass-1 readouts are, so it is a per-model setting).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PolicyKind {
    Speed,
    Dual { margin_below: f32 },
    Baseline,
}

impl PolicyKind {
    /// `dual` with its default gate.
    pub const DUAL: Self = Self::Dual {
        margin_below: Dual::DEFAULT_MARGIN,
    };

    /// A boxed policy with these parameters.
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            Self::Speed => Box::new(Speed::default()),
            Self::Dual { margin_below } => Box::new(Dual {
                margin_below,
                ..Dual::default()
            }),
            Self::Baseline => Box::new(Baseline),
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "speed" => Ok(Self::Speed),
            None if s == "dual" => Ok(Self::DUAL),
            None if s == "baseline" => Ok(Self::Baseline),
            Some(("dual", margin)) => match margin.parse::<f32>() {
                Ok(m) if m.is_finite() && m > 0.0 => Ok(Self::Dual { margin_below: m }),
                _ => Err(format!(
                    "policy `{s}`: the dual margin must be a positive number of logits"
                )),
            },
            _ => Err(format!(
                "unknown policy `{s}` (expected speed, dual, dual:MARGIN or baseline)"
            )),
        }
    }
}

impl TryFrom<String> for PolicyKind {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<PolicyKind> for String {
    fn from(kind: PolicyKind) -> Self {
        kind.to_string()
    }
}

impl fmt::Display for PolicyKind {
    /// The name `FromStr` reads back: the margin only where it is not the default.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Dual { margin_below } if *margin_below != Dual::DEFAULT_MARGIN => {
                write!(f, "dual:{margin_below}")
            }
            _ => f.write_str(self.build().name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_round_trip_with_their_margin() {
        for name in ["speed", "dual", "dual:0.5", "baseline"] {
            let kind: PolicyKind = name.parse().expect("a valid policy name");
            assert_eq!(kind.to_string(), name);
        }
        assert_eq!("dual:1".parse::<PolicyKind>(), Ok(PolicyKind::DUAL));
        let margin = |k: PolicyKind| k.build().second_proposal_below(1);
        assert_eq!(margin("dual:0.5".parse().expect("valid")), Some(0.5));
        assert_eq!(margin(PolicyKind::Speed), None);
    }

    #[test]
    fn bad_policy_names_say_what_is_wrong() {
        for bad in ["dual:0", "dual:-1", "dual:x", "dual:inf", "speed:1", "fast"] {
            let err = bad
                .parse::<PolicyKind>()
                .expect_err("an invalid policy name");
            assert!(err.contains(bad), "{err}");
        }
    }
}
