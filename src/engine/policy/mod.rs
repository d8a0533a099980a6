//! Decoding policies: where a token's readouts start children, which candidates they start,
//! and how a readout settles the candidates in flight for the next position. The scheduler
//! in `pipeline` is the same for every policy and asks only these questions ([`Policy`]); a
//! new policy is a new implementation, and touches neither the walk nor the dashboard (a lossy
//! early exit, [`Action::Exit`], is the one action the walk has for it).
//!
//! `speed` holds the policies that commit exactly the baseline's choice (greedy or
//! seed-coupled: `engine::sampling`); `loopspec` the one that verifies by rejection
//! sampling; `self_draft` and `draft_model` draft-then-verify decoding, whose window the
//! scheduler paces from the policy's [`Drafting`].
//!
//! This file is the one table of the policies a user can name ([`POLICIES`]): each row's
//! name, how it is written, what it does and how its parameters parse. Parsing
//! ([`PolicyKind`]'s `FromStr`), the list an unknown name's error gives, the CLI's help
//! ([`help`]) and the bench's refusal of a lane that does not speculate all read it. A new
//! policy is its own file (its [`Policy`] type and its parameters' parser) and, here, its
//! `mod` line, its [`PolicyKind`] variant with its `build` arm, and its row.

mod decide;
mod draft_model;
mod exit;
mod loopspec;
mod self_draft;
mod speed;

use std::fmt;

pub use decide::{Action, DraftSource, Drafting, Policy, Proposal, Readout, Verdict};
pub use draft_model::DraftModel;
pub use exit::{EarlyExit, Exit, ExitRule, KvFill, top_probability};
pub use loopspec::LoopSpec;
pub use self_draft::SelfDraft;
pub use speed::{Baseline, Dual, Speed};

use super::pass::Pass;
#[cfg(test)]
use super::sampling::Sampling;

/// The policies the CLI, models.toml and the dashboard can name, each a row of
/// [`POLICIES`] (how it is written and what it does). The dual gate's best value
/// depends on how peaked a model's pass-1 readouts are, so it is a per-model setting;
/// LoopSpec's depths default to first proposals at pass 1 and no second ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PolicyKind {
    /// The default where nothing names a policy.
    #[default]
    Speed,
    /// SPEED with a gated second proposal ([`Dual`](struct@Dual)).
    Dual {
        /// The gate: the runner-up starts when it is less than this below the best (in logits
        /// when greedy).
        margin_below: f32,
    },
    /// LoopSpec's proposals, verified by rejection sampling at pass R
    /// ([`LoopSpec`](struct@LoopSpec)).
    LoopSpec {
        /// The depth first proposals are drawn at.
        d1: Pass,
        /// The depth gated second proposals are drawn at; `None`: no second proposals.
        d2: Option<Pass>,
    },
    /// Draft then verify from the model's own first passes.
    SelfDraft {
        /// d: the pass the drafts are read out after (below R).
        depth: Pass,
        /// γ: drafts per round.
        tokens: usize,
    },
    /// Draft then verify from a separate draft model.
    Draft {
        /// γ: drafts per round.
        tokens: usize,
    },
    /// Lossy early exit: one token at a time, committed at the first pass its rule accepts
    /// ([`Exit`](struct@Exit)).
    Exit {
        /// Where a token stops.
        rule: ExitRule,
        /// How its skipped passes' K/V entries are filled.
        fill: KvFill,
    },
    /// One token at a time through every pass: what the others are held to.
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
            Self::Exit { rule, fill } => Box::new(Exit { rule, fill }),
            Self::Baseline => Box::new(Baseline),
        }
    }

    /// Whether its text may leave the baseline's by design (a lossy early exit): compared as
    /// lossy, never as identical.
    pub fn is_lossy(self) -> bool {
        self.build().early_exit().is_some()
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    /// A name from [`POLICIES`], with its parameters.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse(s)
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
            Self::Exit { rule, fill } => exit::write_exit(*rule, *fill, f),
            _ => f.write_str(self.build().name()),
        }
    }
}

/// One policy a user can name.
#[derive(Debug, Clone, Copy)]
pub struct PolicyRow {
    /// The name before any `:`.
    pub name: &'static str,
    /// The ways it is written, parameters in brackets where they are optional.
    pub forms: &'static [&'static str],
    /// What it does, in a few words (the CLI's help).
    pub summary: &'static str,
    /// Whether it races against the baseline as a lane of its own.
    pub speculative: bool,
    /// The policy its parameters (what follows `name:`, or "" when written alone) make.
    parse: fn(&str) -> Result<PolicyKind, String>,
}

impl PolicyRow {
    /// Whether its text may leave the baseline's (a lossy early exit), as its policy says
    /// ([`PolicyKind::is_lossy`]): what-if leaves such rows out.
    pub fn is_lossy(&self) -> bool {
        let written = self.forms[0].split('[').next().unwrap_or(self.name);
        parse(written).is_ok_and(PolicyKind::is_lossy)
    }
}

/// Every policy a user can name, in the order the help lists them.
pub const POLICIES: [PolicyRow; 7] = [
    PolicyRow {
        name: "speed",
        forms: &["speed"],
        summary: "SPEED: each token starts from the one before's pass-1 prediction",
        speculative: true,
        parse: parse_speed,
    },
    PolicyRow {
        name: "dual",
        forms: &["dual[:MARGIN]"],
        summary: "SPEED with a gated second proposal; MARGIN sets the gate in logits",
        speculative: true,
        parse: parse_dual,
    },
    PolicyRow {
        name: "loopspec",
        forms: &["loopspec[:d1=N][:d2=M]"],
        summary: "LoopSpec's proposals at depth N, gated second ones at M, verified by \
                  rejection sampling",
        speculative: true,
        parse: parse_loopspec,
    },
    PolicyRow {
        name: "self-draft",
        forms: &["self-draft[:d=N][:g=M]"],
        summary: "draft then verify: M tokens drafted from pass N, then verified together",
        speculative: true,
        parse: parse_self_draft,
    },
    PolicyRow {
        name: "draft",
        forms: &["draft[:g=M]"],
        summary: "draft then verify with M tokens from --draft-model",
        speculative: true,
        parse: parse_draft,
    },
    PolicyRow {
        name: "exit",
        forms: &["exit:gate[=T]", "exit:confidence=P", "exit:pass=N"],
        summary: "LOSSY early exit: a token stops at the first pass where the exit gate's \
                  cumulative probability reaches T (default --exit-threshold, else the \
                  checkpoint's), its top-1 probability reaches P, or pass N, and its text may \
                  leave the baseline's; :fill=project fills its skipped K/V entries by \
                  projection, not copies",
        speculative: true,
        parse: parse_exit,
    },
    PolicyRow {
        name: "baseline",
        forms: &["baseline"],
        summary: "one token at a time, every pass: what the others are held to",
        speculative: false,
        parse: parse_baseline,
    },
];

/// The forms of the rows `which` keeps, as a list: `a, b, c or d`.
pub fn forms(which: impl Fn(&PolicyRow) -> bool) -> String {
    let all: Vec<&str> = (POLICIES.iter())
        .filter(|row| which(row))
        .flat_map(|row| row.forms.iter().copied())
        .collect();
    match all.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// The CLI's help for a policy flag: `intro`, then every policy (the speculative ones unless
/// `baseline`) with what it does, then the default.
pub fn help(intro: &str, baseline: bool) -> String {
    let listed: Vec<String> = (POLICIES.iter())
        .filter(|row| baseline || row.speculative)
        .map(|row| format!("{} ({})", row.forms.join(", "), row.summary))
        .collect();
    format!(
        "{intro}: {} (default: the entry's, else speed)",
        listed.join("; ")
    )
}

/// Parses `s`: a row's name alone, or `name:parameters`.
fn parse(s: &str) -> Result<PolicyKind, String> {
    let (name, params) = s.split_once(':').unwrap_or((s, ""));
    if s.ends_with(':') {
        return Err(format!(
            "policy `{s}`: nothing after `:` (write `{name}` alone, or give its parameters)"
        ));
    }
    let unknown = || format!("unknown policy `{s}` (expected {})", forms(|_| true));
    let row = POLICIES
        .iter()
        .find(|row| row.name == name)
        .ok_or_else(unknown)?;
    (row.parse)(params).map_err(|e| match e.is_empty() {
        true => unknown(),
        false => format!("policy `{s}`: {e}"),
    })
}

/// `kind` where it is written alone; given parameters it does not take, an empty error,
/// which [`parse`] reports as an unknown policy with the list of forms.
fn none_taken(params: &str, kind: PolicyKind) -> Result<PolicyKind, String> {
    match params.is_empty() {
        true => Ok(kind),
        false => Err(String::new()),
    }
}

fn parse_speed(params: &str) -> Result<PolicyKind, String> {
    none_taken(params, PolicyKind::Speed)
}

fn parse_baseline(params: &str) -> Result<PolicyKind, String> {
    none_taken(params, PolicyKind::Baseline)
}

fn parse_dual(params: &str) -> Result<PolicyKind, String> {
    if params.is_empty() {
        return Ok(PolicyKind::DUAL);
    }
    match params.parse::<f32>() {
        Ok(m) if m.is_finite() && m > 0.0 => Ok(PolicyKind::Dual { margin_below: m }),
        _ => Err("the dual margin must be a positive number of logits".into()),
    }
}

fn parse_loopspec(params: &str) -> Result<PolicyKind, String> {
    loopspec::parse_depths(params).map(|(d1, d2)| PolicyKind::LoopSpec { d1, d2 })
}

fn parse_self_draft(params: &str) -> Result<PolicyKind, String> {
    self_draft::parse_drafting(params)
        .map(|(depth, tokens)| PolicyKind::SelfDraft { depth, tokens })
}

fn parse_exit(params: &str) -> Result<PolicyKind, String> {
    exit::parse_exit(params).map(|(rule, fill)| PolicyKind::Exit { rule, fill })
}

fn parse_draft(params: &str) -> Result<PolicyKind, String> {
    draft_model::parse_tokens(params).map(|tokens| PolicyKind::Draft { tokens })
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
            lambdas: &[],
            exit_threshold: crate::engine::exit_gate::ExitThreshold::EVERY_PASS,
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

#[cfg(test)]
mod table_tests {
    use super::*;

    /// Every form a row lists parses to a policy of that row, and the policy's name reads
    /// back; the list an unknown name gives names every form.
    #[test]
    fn every_row_parses_its_forms_and_the_list_names_them_all() {
        for row in POLICIES {
            let written = row.forms[0].split('[').next().unwrap_or(row.name);
            let kind = parse(written).unwrap();
            assert_eq!(kind.to_string(), written, "{}", row.name);
            assert_eq!(
                kind != PolicyKind::Baseline,
                row.speculative,
                "{}",
                row.name
            );
            assert_eq!(row.is_lossy(), row.name == "exit", "{}", row.name);
        }
        assert_eq!(
            forms(|_| true),
            "speed, dual[:MARGIN], loopspec[:d1=N][:d2=M], self-draft[:d=N][:g=M], draft[:g=M], \
             exit:gate[=T], exit:confidence=P, exit:pass=N or baseline"
        );
        assert!(
            parse("speed:x")
                .unwrap_err()
                .starts_with("unknown policy `speed:x`")
        );
        let raced = help("Raced", false);
        assert!(
            raced.contains("loopspec[:d1=N][:d2=M] (LoopSpec's") && !raced.contains("baseline (")
        );
        assert!(help("The policy", true).contains("; baseline (one token at a time"));
    }
}
