//! Decoding policies: where a token's readouts start children, which candidates they start,
//! and how a readout settles the candidates in flight for the next position. The scheduler
//! in `pipeline` is the same for every policy and asks only these questions; a new policy is
//! a new implementation, and touches neither the walk nor the dashboard.
//!
//! `speed` holds the policies that commit exactly the baseline's choice (greedy or
//! seed-coupled: `engine::sampling`); `loopspec` the one that verifies by rejection
//! sampling; `self_draft` and `draft_model` draft-then-verify decoding, whose window the
//! scheduler paces from the policy's [`Drafting`].

mod draft_model;
mod loopspec;
mod self_draft;
mod speed;
pub mod table;

use std::fmt;
use std::sync::Arc;

pub use draft_model::DraftModel;
pub use loopspec::LoopSpec;
pub use self_draft::SelfDraft;
pub use speed::{Baseline, Dual, Speed};

use super::pass::Pass;
use super::sampling::Sampling;

/// A candidate for the next position.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    pub token: u32,
    /// The distribution `token` was drawn from, which a verification by rejection needs
    /// (LoopSpec); `None` for a deterministic choice (greedy or seed-coupled).
    pub drawn_from: Option<Arc<[f32]>>,
}

impl Proposal {
    /// A deterministic choice.
    pub fn chosen(token: u32) -> Self {
        Self {
            token,
            drawn_from: None,
        }
    }
}

/// How a readout settles the candidates in flight for the next position.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The candidate at this index (0: the first) survives; any other is dropped.
    Keep(usize),
    /// Every candidate is wrong: they and everything younger are flushed. At pass R this
    /// token is committed instead; before it, it is proposed anew.
    Reject(Proposal),
}

/// What one readout does for the next position, decided while the step is timed.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Nothing at this pass.
    Nothing,
    /// Nothing is in flight: start children, a first candidate and perhaps a second beside it.
    /// `gated` says whether a gate decided about the second (the gate-open rate's count).
    Propose {
        first: Proposal,
        second: Option<Proposal>,
        gated: bool,
    },
    /// A first candidate is in flight and the second-proposal gate was asked: what it opened
    /// for, if anything (LoopSpec's gated second proposal).
    Gate(Option<Proposal>),
    /// Keep one of the candidates in flight, or reject them all.
    Settle(Verdict),
    /// Pass R with nothing in flight: commit this token.
    Commit(u32),
}

impl Action {
    /// The token this readout stands for in events: the one it commits, keeps or proposes.
    pub fn shown(&self, candidates: &[Proposal]) -> Option<u32> {
        match self {
            Self::Nothing | Self::Gate(_) => None,
            Self::Propose { first, .. } => Some(first.token),
            Self::Settle(Verdict::Keep(i)) => candidates.get(*i).map(|c| c.token),
            Self::Settle(Verdict::Reject(p)) => Some(p.token),
            Self::Commit(token) => Some(*token),
        }
    }

    /// Whether a second-proposal gate was asked, and if so whether it opened.
    pub fn gate(&self) -> Option<bool> {
        match self {
            Self::Propose {
                second,
                gated: true,
                ..
            } => Some(second.is_some()),
            Self::Gate(second) => Some(second.is_some()),
            _ => None,
        }
    }
}

/// A readout as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Readout<'a> {
    pub logits: &'a [f32],
    /// The pass it was read out after.
    pub pass: Pass,
    /// R, the model's passes.
    pub passes: usize,
    /// The position it predicts (the row's position + 1).
    pub pos: usize,
    /// How logits become a token in this run.
    pub sampling: &'a Sampling,
}

impl Readout<'_> {
    /// Whether this is the last pass's readout, which commits.
    pub fn is_last(&self) -> bool {
        self.pass.is_last(self.passes)
    }
}

/// How a draft-then-verify policy paces the window (`engine::pipeline`, "Draft then
/// verify"): `tokens` drafts (γ) follow the verified token, drafted one after another from
/// `source`; then the whole group runs its remaining passes together and pass R checks every
/// draft at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drafting {
    pub source: DraftSource,
    /// γ: drafts per round, 1 or more.
    pub tokens: usize,
}

/// Where a draft-then-verify policy's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// The model's own first d passes (d below R): each draft runs passes 1..=d and its
    /// pass-d readout drafts the next, while the tokens past d wait.
    Passes(Pass),
    /// A separate draft model with the same tokenizer (`engine::drafter`), asked for the
    /// round's γ drafts at once before the group's first pass.
    Model,
}

/// What a policy decides for the scheduler.
pub trait Policy: Send + Sync + fmt::Debug {
    /// Its name in the CLI, events and the dashboard.
    fn name(&self) -> &'static str;

    /// A one-line complaint if the policy cannot run on a model with `passes` passes.
    fn check(&self, _passes: usize) -> Result<(), String> {
        Ok(())
    }

    /// Whether a token whose next position has `in_flight` candidates needs a readout after
    /// `pass` (< R). Pass R always reads out: it commits.
    fn reads_out(&self, pass: Pass, passes: usize, in_flight: usize) -> bool;

    /// What a readout does, given the candidates in flight for its next position (the
    /// first, then any second). At pass R it returns `Commit` or `Settle`.
    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action;

    /// Whether its text under sampling is the baseline's for the same seed: true for the
    /// policies that commit only pass-R seed-coupled choices (`engine::sampling`); a policy
    /// that verifies by rejection keeps the distribution, not the sample.
    fn keeps_baseline_sample(&self) -> bool {
        true
    }

    /// `Some` for a draft-then-verify policy: the scheduler holds the tokens past the draft
    /// depth while the next is drafted. `None` (SPEED's pipelining): every token advances a
    /// pass in every step.
    fn drafting(&self) -> Option<Drafting> {
        None
    }
}

/// The policies the CLI, models.toml and the dashboard can name, each a row of
/// [`table::POLICIES`] (how it is written and what it does). The dual gate's best value
/// depends on how peaked a model's pass-1 readouts are, so it is a per-model setting;
/// LoopSpec's depths default to first proposals at pass 1 and no second ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PolicyKind {
    /// The default where nothing names a policy.
    #[default]
    Speed,
    Dual {
        margin_below: f32,
    },
    LoopSpec {
        d1: Pass,
        d2: Option<Pass>,
    },
    /// Draft then verify from the model's own first passes.
    SelfDraft {
        depth: Pass,
        tokens: usize,
    },
    /// Draft then verify from a separate draft model.
    Draft {
        tokens: usize,
    },
    Baseline,
}

impl PolicyKind {
    /// `dual` with its default gate.
    pub const DUAL: Self = Self::Dual {
        margin_below: Dual::DEFAULT_MARGIN,
    };

    /// `loopspec` with its defaults: first proposals at depth 1, no second.
    pub const LOOPSPEC: Self = Self::LoopSpec {
        d1: Pass::FIRST,
        d2: None,
    };

    /// A boxed policy with these parameters.
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            Self::Speed => Box::new(Speed::default()),
            Self::Dual { margin_below } => Box::new(Dual {
                margin_below,
                ..Dual::default()
            }),
            Self::LoopSpec { d1, d2 } => Box::new(LoopSpec { d1, d2 }),
            Self::SelfDraft { depth, tokens } => Box::new(SelfDraft { depth, tokens }),
            Self::Draft { tokens } => Box::new(DraftModel { tokens }),
            Self::Baseline => Box::new(Baseline),
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    /// A name from [`table::POLICIES`], with its parameters.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        table::parse(s)
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
    /// The name `FromStr` reads back: parameters only where they are not the default.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Dual { margin_below } if *margin_below != Dual::DEFAULT_MARGIN => {
                write!(f, "dual:{margin_below}")
            }
            Self::LoopSpec { d1, d2 } => {
                f.write_str("loopspec")?;
                if *d1 != Pass::FIRST {
                    write!(f, ":d1={d1}")?;
                }
                match d2 {
                    Some(d2) => write!(f, ":d2={d2}"),
                    None => Ok(()),
                }
            }
            Self::SelfDraft { depth, tokens } => {
                f.write_str("self-draft")?;
                if *depth != Pass::FIRST {
                    write!(f, ":d={depth}")?;
                }
                if *tokens != SelfDraft::DEFAULT_TOKENS {
                    write!(f, ":g={tokens}")?;
                }
                Ok(())
            }
            Self::Draft { tokens } => match *tokens == DraftModel::DEFAULT_TOKENS {
                true => f.write_str("draft"),
                false => write!(f, "draft:g={tokens}"),
            },
            _ => f.write_str(self.build().name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readout<'a>(logits: &'a [f32], pass: Pass, sampling: &'a Sampling) -> Readout<'a> {
        Readout {
            logits,
            pass,
            passes: 4,
            pos: 3,
            sampling,
        }
    }

    #[test]
    fn policy_names_round_trip_with_their_parameters() {
        for name in [
            "speed",
            "dual",
            "dual:0.5",
            "baseline",
            "loopspec",
            "loopspec:d1=2",
            "loopspec:d2=3",
            "loopspec:d1=2:d2=3",
            "self-draft",
            "self-draft:d=2",
            "self-draft:g=6",
            "self-draft:d=2:g=1",
            "draft",
            "draft:g=7",
        ] {
            let kind: PolicyKind = name.parse().expect("a valid policy name");
            assert_eq!(kind.to_string(), name);
        }
        assert_eq!("dual:1".parse::<PolicyKind>(), Ok(PolicyKind::DUAL));
        assert_eq!(
            "loopspec:d1=1".parse::<PolicyKind>(),
            Ok(PolicyKind::LOOPSPEC)
        );
    }

    #[test]
    fn the_dual_gate_opens_for_a_near_tie_at_the_first_pass_only() {
        // A runner-up 0.75 logits below the best: inside a 1.0 gate, outside a 0.5 one.
        let logits = [0.0, 2.0, 1.25];
        let second = |k: PolicyKind, pass| match k
            .build()
            .act(&readout(&logits, pass, &Sampling::GREEDY), &[])
        {
            Action::Propose { second, .. } => second.map(|p| p.token),
            other => panic!("{other:?}"),
        };
        let first = Pass::FIRST;
        assert_eq!(second(PolicyKind::DUAL, first), Some(2));
        assert_eq!(second(PolicyKind::DUAL, first.next()), None);
        assert_eq!(second("dual:0.5".parse().expect("valid"), first), None);
        assert_eq!(second(PolicyKind::Speed, first), None);
    }

    #[test]
    fn greedy_readouts_keep_the_candidate_they_agree_with_or_reject_all() {
        let logits = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0];
        let c = |ids: &[u32]| ids.iter().map(|&i| Proposal::chosen(i)).collect::<Vec<_>>();
        let reject = Action::Settle(Verdict::Reject(Proposal::chosen(7)));
        for kind in [PolicyKind::Speed, PolicyKind::DUAL, PolicyKind::LOOPSPEC] {
            let policy = kind.build();
            let pass = Pass::last(4);
            let act = |ids: &[u32]| policy.act(&readout(&logits, pass, &Sampling::GREEDY), &c(ids));
            assert_eq!(act(&[7]), Action::Settle(Verdict::Keep(0)));
            assert_eq!(act(&[3, 7]), Action::Settle(Verdict::Keep(1)));
            assert_eq!(act(&[7, 3]), Action::Settle(Verdict::Keep(0)));
            assert_eq!(act(&[3]), reject);
            assert_eq!(act(&[3, 4]), reject);
            assert_eq!(act(&[]), Action::Commit(7));
        }
        let r = readout(&[1.0, 3.0, 3.0], Pass::FIRST, &Sampling::GREEDY);
        assert_eq!(Speed::default().act(&r, &[]).shown(&[]), Some(1));
    }

    #[test]
    fn loopspec_checks_only_at_pass_r_and_gates_a_second_at_d2() {
        let kind: PolicyKind = "loopspec:d1=1:d2=2".parse().expect("valid");
        let policy = kind.build();
        let (first, second, third) = (Pass::FIRST, Pass::FIRST.next(), Pass::new(3).expect("3"));
        assert!(policy.reads_out(first, 4, 0) && policy.reads_out(third, 4, 0));
        assert!(policy.reads_out(second, 4, 1) && !policy.reads_out(third, 4, 1));
        assert!(!policy.reads_out(first, 4, 2));
        let logits = [0.0, 4.0, 1.0];
        let act = |pass, ids: &[u32]| {
            let c: Vec<Proposal> = ids.iter().map(|&i| Proposal::chosen(i)).collect();
            policy.act(&readout(&logits, pass, &Sampling::GREEDY), &c)
        };
        assert_eq!(act(second, &[2]), Action::Gate(Some(Proposal::chosen(1))));
        assert_eq!(act(second, &[1]), Action::Gate(None));
        assert_eq!(act(third, &[2]), Action::Nothing);
        assert_eq!(kind.build().check(4), Ok(()));
        assert!(kind.build().check(2).is_err());
    }

    #[test]
    fn bad_policy_names_say_what_is_wrong() {
        for bad in [
            "dual:0",
            "dual:-1",
            "dual:x",
            "dual:inf",
            "speed:1",
            "fast",
            "loopspec:d1=0",
            "loopspec:d3=1",
            "loopspec:d1=2:d2=2",
            "loopspec:d1=x",
            "loopspec:d1=1:d1=2",
            "loopspec:1",
            "self-draft:g=0",
            "self-draft:d=0",
            "self-draft:g=x",
            "self-draft:g=2:g=3",
            "self-draft:x=1",
            "self-draft:4",
            "draft:g=0",
            "draft:d=1",
        ] {
            let err = bad
                .parse::<PolicyKind>()
                .expect_err("an invalid policy name");
            assert!(err.contains(bad), "{err}");
        }
    }
}
