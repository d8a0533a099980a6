//! `harness::explain` over a hand-made trace: its tallies by pass and by token class, and its
//! most frequent disagreeing pair. A submodule of `traces.rs`.

use std::time::Duration;

use spex::engine::Pass;
use spex::engine::events::{
    Committed, DecodeEvent, Prediction, PrefillEvent, RowEvent, StepEvent, Token,
};
use spex::harness::explain::{Explanation, Tally, TokenClass};
use spex::harness::race::{Lane, RaceEvent};
use spex::harness::trace::Trace;

fn token(id: u32, text: &str) -> Token {
    Token {
        id,
        text: text.into(),
    }
}

fn row(pos: usize, pass: usize, said: Token) -> RowEvent {
    RowEvent {
        pos,
        pass: Pass::new(pass).unwrap(),
        token: token(0, "?"),
        verified: false,
        second: false,
        dropped: false,
        prediction: Some(Prediction {
            token: said,
            prob: 0.5,
            margin: 1.0,
            top: Vec::new(),
        }),
        gate: None,
        exit_probability: None,
        checked_child: false,
    }
}

fn commit(pos: usize, t: Token) -> Committed {
    Committed {
        pos,
        text_delta: t.text.clone(),
        token: t,
        accepted_depth: Pass::new(2).unwrap(),
        from_second: false,
        gate_exit: None,
    }
}

fn step(n: u64, rows: Vec<RowEvent>, committed: Vec<Committed>) -> RaceEvent {
    RaceEvent::Decode {
        lane: Lane::Speculative,
        event: DecodeEvent::Step(StepEvent {
            step: n,
            rows,
            flips: Vec::new(),
            flushes: Vec::new(),
            committed,
            kv: Vec::new(),
            compute: Duration::from_micros(10),
        }),
    }
}

/// A two-pass trace whose counted pass-1 readouts disagree once with what was committed
/// ("X" for " my") and agree once (","): of a position read out twice, only the
/// survivor's readout counts.
fn hand_made_trace() -> Trace {
    let (x, my, comma) = (token(20, "X"), token(21, " my"), token(31, ","));
    let prefill = RaceEvent::Decode {
        lane: Lane::Speculative,
        event: DecodeEvent::Prefill(PrefillEvent {
            prompt_tokens: 3,
            first: commit(3, token(10, " the")),
            kv: Vec::new(),
            exit_threshold: None,
            compute: Duration::from_micros(10),
        }),
    };
    let events = vec![
        prefill,
        step(1, vec![row(3, 1, x.clone())], vec![]),
        // Pass 2 commits " my" at 4; the child's first readout for 5 says "HAMLET"…
        step(
            2,
            vec![row(3, 2, my.clone()), row(4, 1, token(30, "HAMLET"))],
            vec![commit(4, my.clone())],
        ),
        // …but a later instance's pass-1 readout for 5 (the survivor's) says ",".
        step(3, vec![row(4, 1, comma.clone())], vec![]),
        step(
            4,
            vec![row(4, 2, comma.clone())],
            vec![commit(5, comma.clone())],
        ),
        RaceEvent::Done,
    ];
    let mut header = super::header("To be", spex::engine::PolicyKind::Speed);
    header.model.passes = 2;
    Trace {
        header,
        events,
        cut_line: None,
    }
}

#[test]
fn the_explorer_counts_a_hand_made_trace() {
    let (x, my) = (token(20, "X"), token(21, " my"));
    let trace = hand_made_trace();
    let e = Explanation::of(&[trace.clone(), trace], 10);
    assert_eq!((e.traces, e.positions), (2, 4));
    assert_eq!(
        e.by_pass,
        vec![Tally {
            readouts: 4,
            disagreed: 2
        }]
    );
    assert_eq!(
        e.by_class[&TokenClass::WordStart],
        Tally {
            readouts: 2,
            disagreed: 2
        }
    );
    assert_eq!(
        e.by_class[&TokenClass::Punctuation],
        Tally {
            readouts: 2,
            disagreed: 0
        }
    );
    assert_eq!(e.pairs.len(), 1);
    let pair = &e.pairs[0];
    assert_eq!(
        (pair.pass, &pair.said, &pair.committed, pair.count),
        (1, &x, &my, 2)
    );
    assert_eq!((e.disagreeing.readouts, e.agreeing.readouts), (2, 2));
}
