//! What-if re-simulation is exact for greedy runs: a run recorded under one policy, replayed
//! under another by `engine::what_if`, takes the steps a real run of that policy takes, on
//! random checkpoints of several shapes (which flip often and start many second candidates)
//! and on many prompts.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::path::Path;

use common::{OPTIONS, PROMPTS, Variant, random_model, recorded_race, spec};
use spex::engine::policy::PolicyKind;
use spex::engine::{LoadedModel, Sampling};
use spex::harness::bench::run_lane;
use spex::harness::race::RaceEvent;
use spex::harness::trace::Trace;
use spex::harness::what_if::{RecordedRun, StepCosts, WhatIf, WhatIfDraft, simulate};
use std::sync::Arc;

/// A race of `policy` against baseline on `prompt`, as a trace.
fn recorded(loaded: &LoadedModel, prompt: &str, policy: PolicyKind) -> Trace {
    let trace = recorded_race(loaded, prompt, policy, OPTIONS);
    let failed = |e: &RaceEvent| matches!(e, RaceEvent::Error(_));
    assert!(!trace.events.iter().any(failed));
    trace
}

/// The policies replayed on a model with `passes` passes.
fn policies(passes: usize) -> Vec<PolicyKind> {
    let mut all = vec![
        PolicyKind::Baseline,
        PolicyKind::Speed,
        PolicyKind::DUAL,
        "dual:0.25".parse().expect("a valid policy"),
        PolicyKind::LOOPSPEC,
        "self-draft".parse().expect("a valid policy"),
        "self-draft:g=2".parse().expect("a valid policy"),
    ];
    if passes >= 3 {
        for name in [
            "loopspec:d1=2",
            "loopspec:d2=2",
            "loopspec:d1=1:d2=2",
            "self-draft:d=2:g=3",
        ] {
            all.push(name.parse().expect("a valid policy"));
        }
    }
    all
}

#[test]
fn what_if_step_counts_equal_real_runs() {
    let (mut checked, mut differing) = (0, 0);
    for (variant, layers, passes) in [
        (Variant::Tied, 1, 2),
        (Variant::Untied, 2, 3),
        (Variant::Gqa, 2, 4),
        (Variant::Tied, 1, 4),
    ] {
        let (_dir, loaded) = random_model(&spec(layers, passes, variant, 7 + passes as u64));
        for (i, prompt) in PROMPTS.iter().enumerate().step_by(3) {
            // Record under speed and under dual alternately: a dual run's committed tokens
            // include second candidates that won.
            let source = [PolicyKind::Speed, PolicyKind::DUAL][i % 2];
            let trace = recorded(&loaded, prompt, source);
            let run = RecordedRun::of(&trace, Path::new("test.jsonl")).expect("a greedy trace");
            let oracle = Arc::new(spex::harness::what_if::Oracle::new(run));
            let costs = StepCosts::fit(&oracle.run().step_samples);
            let mut steps = Vec::new();
            for policy in policies(passes) {
                let real = run_lane(&loaded, policy, prompt, OPTIONS).expect("a real run");
                let what_if = simulate(&oracle, policy, &costs, None).expect("a what-if");
                assert_eq!(
                    what_if.steps, real.stats.steps,
                    "{variant:?} K={layers} R={passes} {prompt:?}: {policy} recorded as {source}"
                );
                steps.push(real.stats.steps);
                checked += 1;
            }
            differing += usize::from(steps.windows(2).any(|w| w[0] != w[1]));
        }
    }
    assert_eq!(checked, 7 * (7 + 11 + 11 + 11));
    assert!(
        differing >= 20,
        "policies differ in steps on {differing} prompts"
    );
}

#[test]
fn what_if_needs_every_pass_read_out() {
    let (_dir, loaded) = random_model(&spec(1, 3, Variant::Tied, 3));
    let trace = recorded(&loaded, PROMPTS[0], PolicyKind::LOOPSPEC);
    let run = RecordedRun::of(&trace, Path::new("ls.jsonl")).expect("a greedy trace");
    let err = WhatIf::of(vec![run], &[PolicyKind::Speed]).expect_err("loopspec skips passes");
    let message = err.to_string();
    assert!(
        message.starts_with("ls.jsonl: ") && message.contains("no pass-2 readout"),
        "{message}"
    );
    let speed = recorded(&loaded, PROMPTS[0], PolicyKind::Speed);
    let run = RecordedRun::of(&speed, Path::new("speed.jsonl")).expect("a greedy trace");
    let draft = "draft".parse().expect("a valid policy");
    let err = WhatIf::of(vec![run], &[draft]).expect_err("no draft model's predictions");
    assert!(
        err.to_string()
            .contains("what-if replays `draft` with its draft model only"),
        "{err}"
    );
    let mut sampled = recorded(&loaded, PROMPTS[0], PolicyKind::Speed);
    sampled.header.sampling = Sampling {
        temperature: 0.8,
        ..Sampling::GREEDY
    };
    let err = RecordedRun::of(&sampled, Path::new("s.jsonl")).expect_err("sampled");
    assert!(err.to_string().contains("greedy"), "{err}");
}

#[test]
fn step_costs_from_another_trace_time_every_run() {
    let (_a, small) = random_model(&spec(1, 3, Variant::Tied, 4));
    let (_b, other) = random_model(&spec(2, 4, Variant::Untied, 5));
    let runs = || {
        let trace = recorded(&small, PROMPTS[1], PolicyKind::Speed);
        vec![RecordedRun::of(&trace, Path::new("a.jsonl")).expect("a greedy trace")]
    };
    // The other model's steps, sampled: any trace can lend its step costs.
    let mut lender = recorded(&other, PROMPTS[2], PolicyKind::LOOPSPEC);
    lender.header.sampling.temperature = 0.8;
    let samples = spex::harness::what_if::step_samples(&lender);
    let steps_recorded = (lender.events.iter())
        .filter(|e| {
            matches!(
                e,
                RaceEvent::Decode {
                    event: spex::engine::events::DecodeEvent::Step(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!(samples.len(), steps_recorded);
    let costs = StepCosts::fit(&samples);
    let policies = [PolicyKind::Speed, PolicyKind::DUAL];
    let own = WhatIf::of(runs(), &policies).expect("a what-if");
    let lent = WhatIf::timed(runs(), &policies, Some(costs), None).expect("a what-if");
    assert_eq!(lent.step_costs, Some(costs));
    assert_eq!(own.step_costs, None);
    for (o, l) in own.forecasts.iter().zip(&lent.forecasts) {
        assert_eq!((o.steps, o.rows_per_step), (l.steps, l.rows_per_step));
    }
    // The baseline runs one row a step: its time is its steps at the lent one-row cost.
    let baseline = &lent.forecasts[0];
    let expected_us = baseline.steps as f64 * costs.one_row_us;
    assert!((baseline.decode_us - expected_us).abs() <= 1e-9 * expected_us);
}

/// With its draft model, the `draft` policy's what-if takes the steps a real run takes.
#[test]
fn a_draft_models_what_if_takes_the_real_runs_steps() {
    let (_dir, loaded) = random_model(&spec(2, 3, Variant::Untied, 5));
    let (_draft_dir, draft) = random_model(&spec(1, 1, Variant::Untied, 6));
    let drafted = loaded
        .clone()
        .with_draft(draft.clone())
        .expect("one tokenizer");
    let what_if_draft = WhatIfDraft::measured(draft).expect("a draft model");
    assert!(what_if_draft.token_us > 0.0);
    for prompt in PROMPTS.iter().step_by(4) {
        let trace = recorded(&loaded, prompt, PolicyKind::Speed);
        let run = RecordedRun::of(&trace, Path::new("test.jsonl")).expect("a greedy trace");
        let oracle = Arc::new(spex::harness::what_if::Oracle::new(run));
        let costs = StepCosts::fit(&oracle.run().step_samples);
        for name in ["draft:g=1", "draft:g=3"] {
            let policy: PolicyKind = name.parse().expect("a valid policy");
            let real = run_lane(&drafted, policy, prompt, OPTIONS).expect("a real run");
            let what_if =
                simulate(&oracle, policy, &costs, Some(&what_if_draft)).expect("a what-if");
            assert_eq!(what_if.steps, real.stats.steps, "{prompt:?}: {policy}");
            assert!(what_if.decode_us > 0.0);
        }
    }
}
