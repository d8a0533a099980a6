//! Decoding policies: where a token's readouts start children, which candidates they start,
//! and how a readout settles the candidates in flight for the next position. The scheduler
//! in `pipeline` is the same for every policy and asks only these questions; a new policy is
//! a new implementation, and touches neither the walk nor the dashboard.

use std::fmt;

use super::pass::Pass;
use super::sampling::Sampling;

/// What one readout decides, computed while the step is timed: the token it favours and,
/// where the policy's gate opens, a second candidate to start beside the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The token this readout favours: what it proposes, and what it commits at pass R.
    pub best: u32,
    /// A second candidate for the next position, when the readout starts children.
    pub second: Option<u32>,
}

/// How a readout settles the candidates already in flight for the next position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The candidate at this index (0: the first) survives; any other is dropped.
    Keep(usize),
    /// Every candidate is wrong: they and everything younger are flushed. At pass R the
    /// decision's `best` is committed instead; before it, the readout proposes anew.
    Reject,
}

/// A readout as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Readout<'a> {
    pub logits: &'a [f32],
    /// The pass it was read out after.
    pub pass: Pass,
    /// The position it predicts (the row's position + 1).
    pub pos: usize,
    /// How logits become a token in this run.
    pub sampling: &'a Sampling,
}

/// What a policy decides for the scheduler.
pub trait Policy: Send + Sync + fmt::Debug {
    /// Its name in the CLI, events and the dashboard.
    fn name(&self) -> &'static str;

    /// Whether a token's readout after `pass` (< `passes`) starts or re-checks its children.
    /// Pass `passes` (R) always reads out: it commits.
    fn speculates_at(&self, pass: Pass, passes: usize) -> bool;

    /// A readout's decision: the run's sampling rule applied to its logits (greedy: the
    /// argmax, the first on ties; seed-coupled sampling otherwise, speculation.md §4b).
    fn decide(&self, r: &Readout) -> Decision {
        Decision {
            best: r.sampling.choose(r.logits, r.pos, false).best,
            second: None,
        }
    }

    /// How the readout that made `decision` settles `candidates` (the first candidate, then
    /// any second): greedy keeps the candidate equal to its best token.
    fn settle(&self, decision: &Decision, candidates: &[u32]) -> Verdict {
        candidates
            .iter()
            .position(|&c| c == decision.best)
            .map_or(Verdict::Reject, Verdict::Keep)
    }
}

/// Ordinary greedy decoding: one token at a time through all R passes, then commit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Baseline;

impl Policy for Baseline {
    fn name(&self) -> &'static str {
        "baseline"
    }

    fn speculates_at(&self, _pass: Pass, _passes: usize) -> bool {
        false
    }
}

/// SPEED (Hooper et al., arXiv 2310.12072; speculation.md §3): a child starts from the first
/// readout at or after `first_pass` and is re-checked after every deeper pass.
#[derive(Debug, Clone, Copy)]
pub struct Speed {
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

    fn speculates_at(&self, pass: Pass, passes: usize) -> bool {
        pass >= self.first_pass && pass.number() < passes
    }
}

/// SPEED with a gated second proposal (spex's extension, in the direction of LoopSpec's
/// second proposal, arXiv 2609.17184): when the readout at `first_pass` that starts a child is
/// nearly a tie (the runner-up within `margin_below` logits of the best), the runner-up starts
/// too, as a second candidate for the same position. The parent's next readout keeps the
/// candidate it agrees with, so a flip to the runner-up, the most common flip, no longer
/// empties a pipeline slot. Costs one more row in the steps where the gate opens. Greedy
/// output is unchanged: commits still come from pass R only.
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

    fn speculates_at(&self, pass: Pass, passes: usize) -> bool {
        self.speed.speculates_at(pass, passes)
    }

    /// The run's choice, and at `first_pass` the runner-up (the largest of the other scores,
    /// the first on ties) when it is within the gate: a second scan that only the readouts at
    /// `first_pass` pay for. Greedy scores are logits; sampled ones l/T + G.
    fn decide(&self, r: &Readout) -> Decision {
        let at_first = r.pass == self.speed.first_pass;
        let choice = r.sampling.choose(r.logits, r.pos, at_first);
        let second = choice
            .runner_up
            .filter(|&(_, gap)| gap < self.margin_below)
            .map(|(id, _)| id);
        Decision {
            best: choice.best,
            second,
        }
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
        // A runner-up 0.75 logits below the best: inside a 1.0 gate, outside a 0.5 one.
        let logits = [0.0, 2.0, 1.25];
        let second = |k: PolicyKind, pass| {
            let r = Readout {
                logits: &logits,
                pass,
                pos: 3,
                sampling: &Sampling::GREEDY,
            };
            k.build().decide(&r).second
        };
        let first = Pass::FIRST;
        assert_eq!(second(PolicyKind::DUAL, first), Some(2));
        assert_eq!(second(PolicyKind::DUAL, first.next()), None);
        assert_eq!(second("dual:0.5".parse().expect("valid"), first), None);
        assert_eq!(second(PolicyKind::Speed, first), None);
    }

    #[test]
    fn greedy_readouts_keep_the_candidate_they_agree_with_or_reject_all() {
        let decision = Decision {
            best: 7,
            second: None,
        };
        for kind in [PolicyKind::Speed, PolicyKind::DUAL, PolicyKind::Baseline] {
            let policy = kind.build();
            assert_eq!(policy.settle(&decision, &[7]), Verdict::Keep(0));
            assert_eq!(policy.settle(&decision, &[3, 7]), Verdict::Keep(1));
            assert_eq!(policy.settle(&decision, &[7, 3]), Verdict::Keep(0));
            assert_eq!(policy.settle(&decision, &[3]), Verdict::Reject);
            assert_eq!(policy.settle(&decision, &[3, 4]), Verdict::Reject);
        }
        let r = Readout {
            logits: &[1.0, 3.0, 3.0],
            pass: Pass::FIRST,
            pos: 3,
            sampling: &Sampling::GREEDY,
        };
        assert_eq!(Speed::default().decide(&r).best, 1);
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
