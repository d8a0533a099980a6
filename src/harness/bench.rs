//! The headless benchmark: baseline and every listed policy on the same prompts in one
//! process, outputs compared token for token, speedups and the pipeline's ceiling measured in
//! the same run (`harness::metrics`). The lanes of a run take turns of a few milliseconds
//! (`engine::lanes`), so all see the same machine: on a shared machine whose speed drifts, a
//! speedup from lanes run one after the other moved widely between identical runs.
//! `spex bench` prints what this returns.

use std::time::Duration;

use serde::Serialize;

use super::lanes::Lanes;
use super::metrics::{RunStats, speedup};
use crate::engine::checkpoint::LoadedModel;
use crate::engine::decoder::DecodeOptions;
use crate::engine::error::{EngineError, Result};
use crate::engine::events::DecodeEvent;
use crate::engine::model::timing::StepTimes;
use crate::engine::policy::PolicyKind;

/// One policy's run of one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct LaneResult {
    pub policy: PolicyKind,
    pub tokens: Vec<u32>,
    pub stats: RunStats,
    /// The logit margin of each committed decode token's pass-R readout, by output index.
    #[serde(skip)]
    pub margins: Vec<f32>,
}

impl LaneResult {
    fn new(policy: PolicyKind, passes: usize) -> Self {
        Self {
            policy,
            tokens: Vec::new(),
            stats: RunStats::new(passes),
            margins: Vec::new(),
        }
    }

    /// Folds one of the lane's events in.
    fn record(&mut self, event: DecodeEvent) {
        self.stats.record(&event);
        match event {
            DecodeEvent::Prefill(_) => {}
            DecodeEvent::Step(step) => {
                let passes = self.stats.passes;
                let last = step.rows.iter().filter(|r| r.pass.is_last(passes));
                let margins = last.filter_map(|r| r.prediction.as_ref().map(|p| p.margin));
                self.margins.extend(margins);
            }
            DecodeEvent::Finished(finish) => self.tokens = finish.tokens,
        }
    }
}

/// How a policy's text compares with the baseline's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Comparison {
    /// Token for token the baseline's.
    Identical,
    /// It differs first at this output index, where the baseline's logit margin was this
    /// (greedy near-ties can resolve differently in a batch; anything else is a bug).
    Differs { index: usize, margin: f32 },
    /// A policy that verifies by rejection, under sampling: its own sample of the same
    /// distribution, so its text is not compared.
    SameDistribution,
    /// A lossy early exit (`policy::exit`): its text may leave the baseline's by design.
    Lossy(Departure),
}

/// How far a lossy lane's text kept to the baseline's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Departure {
    /// The first output index where it differs; `None`: it did not.
    pub departs_at: Option<usize>,
    /// The baseline's output tokens it has at the same index.
    pub agreeing: usize,
    /// The baseline's output tokens.
    pub of: usize,
}

impl Departure {
    /// `lane`'s text against `baseline`'s, index by index.
    pub fn of(baseline: &[u32], lane: &[u32]) -> Self {
        let departs_at = (baseline.iter().zip(lane))
            .position(|(a, b)| a != b)
            .or_else(|| (baseline.len() != lane.len()).then(|| baseline.len().min(lane.len())));
        Self {
            departs_at,
            agreeing: baseline.iter().zip(lane).filter(|(a, b)| a == b).count(),
            of: baseline.len(),
        }
    }

    /// The share of the baseline's output tokens it has at the same index.
    pub fn agreement(&self) -> f64 {
        self.agreeing as f64 / self.of.max(1) as f64
    }

    /// Where it left the baseline's text and how much agrees, in words.
    pub fn describe(&self) -> String {
        match self.departs_at {
            _ if self.of == 0 => "nothing to compare yet".into(),
            Some(index) => format!(
                "departs at token {index}, {:.0}% agree",
                100.0 * self.agreement()
            ),
            None => format!("kept to the baseline's {} tokens", self.of),
        }
    }
}

/// One policy on one prompt: the run whose speedup is its median, and every run's statistics.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    pub lane: LaneResult,
    /// The baseline's statistics in the same run as `lane`.
    pub baseline: RunStats,
    /// Every run's (baseline, policy) statistics, in run order.
    #[serde(skip)]
    pub runs: Vec<(RunStats, RunStats)>,
    pub comparison: Comparison,
}

impl PolicyResult {
    /// Baseline decode time / policy decode time (same tokens, prefill excluded).
    pub fn speedup(&self) -> f64 {
        speedup(&self.baseline, &self.lane.stats)
    }

    /// Whether its text differs where it must not.
    pub fn is_mismatch(&self) -> bool {
        matches!(self.comparison, Comparison::Differs { .. })
    }
}

/// Every policy on one prompt, compared with the baseline.
#[derive(Debug, Clone, Serialize)]
pub struct PromptResult {
    pub prompt: String,
    /// The baseline's text (every run's is the same).
    pub baseline_tokens: Vec<u32>,
    pub policies: Vec<PolicyResult>,
    pub step_times: StepTimes,
}

/// Runs one policy to the end and folds its events.
pub fn run_lane(
    loaded: &LoadedModel,
    policy: PolicyKind,
    prompt: &str,
    options: DecodeOptions,
) -> Result<LaneResult> {
    Ok(run_interleaved(loaded, &[policy], prompt, options, Duration::ZERO)?.remove(0))
}

/// How the lanes of a bench share the machine.
#[derive(Debug, Clone, Copy)]
pub struct Turns {
    /// Interleaved runs of every lane per prompt.
    pub runs: usize,
    /// Compute a lane runs before the next takes its turn ([`Lanes::with_turn`]).
    pub turn: Duration,
}

/// What a bench races against the baseline, and how: the speculative policies (the baseline
/// is always lane 0 and is not listed) and how their lanes take turns on the machine.
#[derive(Debug, Clone, Copy)]
pub struct Lineup<'a> {
    /// The speculative policies, in lane order after the baseline.
    pub policies: &'a [PolicyKind],
    /// Runs per prompt and the compute of each lane's turn.
    pub turns: Turns,
}

/// Every policy on one prompt, interleaved by compute (`engine::lanes`): the lanes take turns
/// of `turn` (zero: a step at a time), so machine drift slows all alike. Returns the lanes in
/// `policies` order.
pub fn run_interleaved(
    loaded: &LoadedModel,
    policies: &[PolicyKind],
    prompt: &str,
    options: DecodeOptions,
    turn: Duration,
) -> Result<Vec<LaneResult>> {
    run_observed(loaded, policies, prompt, options, turn, &mut |_, _| Ok(()))
}

/// What a bench shows of each lane's events as they come: the lane's index and the event
/// (`spex bench --record-dir` writes them to traces).
pub type Observer<'a> = dyn FnMut(usize, &DecodeEvent) -> Result<()> + 'a;

/// [`run_interleaved`], showing every event to `observe` first.
pub fn run_observed(
    loaded: &LoadedModel,
    policies: &[PolicyKind],
    prompt: &str,
    options: DecodeOptions,
    turn: Duration,
    observe: &mut Observer,
) -> Result<Vec<LaneResult>> {
    let passes = loaded.model().passes();
    let mut lanes = Lanes::new(loaded, prompt, policies, options)?.with_turn(turn);
    let mut results: Vec<LaneResult> = policies
        .iter()
        .map(|&p| LaneResult::new(p, passes))
        .collect();
    while let Some(next) = lanes.next_turn() {
        if let Some(event) = lanes.advance(next)? {
            observe(next, &event)?;
            results[next].record(event);
        }
    }
    Ok(results)
}

/// Benchmarks one prompt: `lineup.turns.runs` interleaved runs of the baseline and every
/// policy of `lineup`; for each policy the lanes of its median run (by its speedup) and every
/// run's statistics; then the step times at the run's mid position. The first run's events go
/// to `observe` (lane 0 is the baseline, lane k the k-th policy).
pub fn bench_prompt(
    loaded: &LoadedModel,
    prompt: &str,
    options: DecodeOptions,
    lineup: Lineup<'_>,
    observe: &mut Observer,
) -> Result<PromptResult> {
    let Lineup {
        policies,
        turns: Turns { runs, turn },
    } = lineup;
    if policies.is_empty() || policies.contains(&PolicyKind::Baseline) {
        return Err(EngineError::Invalid(format!(
            "bench races baseline against the other policies: {}",
            crate::engine::policy::forms(|row| row.speculative)
        )));
    }
    let lanes: Vec<PolicyKind> = std::iter::once(PolicyKind::Baseline)
        .chain(policies.iter().copied())
        .collect();
    let mut all_runs: Vec<Vec<LaneResult>> = Vec::with_capacity(runs);
    for k in 0..runs.max(1) {
        let run = match k {
            0 => run_observed(loaded, &lanes, prompt, options, turn, observe)?,
            _ => run_interleaved(loaded, &lanes, prompt, options, turn)?,
        };
        if let Some(first) = all_runs.first()
            && let Some(lane) = run.iter().zip(first).find(|(a, b)| a.tokens != b.tokens)
        {
            return Err(EngineError::Invalid(format!(
                "{} decoding is not deterministic: two runs of {prompt:?} differ",
                lane.0.policy
            )));
        }
        all_runs.push(run);
    }
    let baseline = all_runs[0][0].clone();
    let exact = options.sampling.is_greedy();
    let results = (1..lanes.len())
        .map(|k| policy_result(&all_runs, k, &baseline, exact))
        .collect();
    let prompt_len = loaded.tokenizer.encode(prompt)?.len();
    let mid = (prompt_len + baseline.tokens.len() / 2).min(options.context.saturating_sub(1));
    Ok(PromptResult {
        prompt: prompt.to_string(),
        baseline_tokens: baseline.tokens,
        policies: results,
        step_times: loaded.backend.step_times(mid, 20)?,
    })
}

/// Lane `k`'s result over all runs (lane 0 is the baseline); under sampling a policy that
/// keeps only the distribution is not compared token for token.
fn policy_result(
    all_runs: &[Vec<LaneResult>],
    k: usize,
    baseline: &LaneResult,
    greedy: bool,
) -> PolicyResult {
    let runs: Vec<(RunStats, RunStats)> = all_runs
        .iter()
        .map(|run| (run[0].stats.clone(), run[k].stats.clone()))
        .collect();
    let median = median_run(&runs);
    let lane = all_runs[median][k].clone();
    let compared = greedy || lane.policy.build().keeps_baseline_sample();
    let comparison = match first_difference(baseline, &lane) {
        _ if lane.policy.is_lossy() => {
            Comparison::Lossy(Departure::of(&baseline.tokens, &lane.tokens))
        }
        _ if !compared => Comparison::SameDistribution,
        None => Comparison::Identical,
        Some((index, margin)) => Comparison::Differs { index, margin },
    };
    PolicyResult {
        baseline: runs[median].0.clone(),
        lane,
        runs,
        comparison,
    }
}

/// The index of the run whose speedup is the median (the lower middle of an even count).
pub fn median_run(runs: &[(RunStats, RunStats)]) -> usize {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (
            speedup(&runs[a].0, &runs[a].1),
            speedup(&runs[b].0, &runs[b].1),
        );
        x.total_cmp(&y)
    });
    order[(order.len() - 1) / 2]
}

/// The first output index where the lanes differ, with the baseline's logit margin there.
fn first_difference(baseline: &LaneResult, other: &LaneResult) -> Option<(usize, f32)> {
    (Departure::of(&baseline.tokens, &other.tokens).departs_at).map(|i| {
        (
            i,
            i.checked_sub(1)
                .and_then(|j| baseline.margins.get(j))
                .copied()
                .unwrap_or(f32::NAN),
        )
    })
}
