//! A policy that breaks the `Policy` trait's contract (a new policy is its own file, so a
//! contributor's may) stops the run with one error naming the policy, not a panic.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use common::{Variant, random_model, spec};
use spex::engine::events::DecodeEvent;
use spex::engine::pass::Pass;
use spex::engine::policy::{Action, Policy, PolicyKind, Proposal, Readout, Verdict};
use spex::engine::{DecodeOptions, Decoder};

/// How [`Broken`] breaks the contract.
#[derive(Debug, Clone, Copy)]
enum Breach {
    /// Answers a pass-R readout with nothing in flight without a commit.
    NoCommit,
    /// Keeps a candidate that is not in flight.
    KeepsAbsent,
}

/// SPEED, but for its breach.
#[derive(Debug)]
struct Broken {
    speed: Box<dyn Policy>,
    breach: Breach,
}

impl Policy for Broken {
    fn name(&self) -> &'static str {
        "broken"
    }

    fn reads_out(&self, pass: Pass, passes: usize, in_flight: usize) -> bool {
        self.speed.reads_out(pass, passes, in_flight)
    }

    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        match self.breach {
            Breach::NoCommit if r.is_last() && candidates.is_empty() => Action::Nothing,
            Breach::KeepsAbsent if !candidates.is_empty() => Action::Settle(Verdict::Keep(2)),
            _ => self.speed.act(r, candidates),
        }
    }
}

/// The error a run of a policy that breaks the contract `breach` way ends with.
fn run_error(breach: Breach) -> String {
    let (_dir, loaded) = random_model(&spec(2, 4, Variant::Tied, 3));
    let policy = Box::new(Broken {
        speed: PolicyKind::Speed.build(),
        breach,
    });
    let options = DecodeOptions::greedy(8, 64);
    let mut decoder = Decoder::new(&loaded, policy, "To be, or not", options).unwrap();
    loop {
        match decoder.next_event() {
            Ok(Some(DecodeEvent::Finished(_)) | None) => panic!("{breach:?}: the run finished"),
            Ok(_) => {}
            Err(e) => return e.to_string(),
        }
    }
}

#[test]
fn a_policy_that_breaks_the_contract_ends_the_run_with_one_line() {
    let e = run_error(Breach::NoCommit);
    assert!(
        e.contains("policy broken: answered the prompt's pass-R readout without a commit"),
        "{e}"
    );
    let e = run_error(Breach::KeepsAbsent);
    assert!(
        e.contains("policy broken: kept or rejected a candidate not in flight"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
}
