//! The headless benchmark: baseline and a speculative policy on the same prompts in one
//! process, outputs checked token for token, speedup and the pipeline's ceiling measured in
//! the same run (speculation.md §5). The two lanes of a run are interleaved step by step, as
//! in the dashboard's race, so both see the same machine: on a shared machine whose speed
//! drifts, a speedup from lanes run one after the other moved by ±15 % between identical
//! runs. `spex bench` prints what this returns.

use std::time::Duration;

use serde::Serialize;

use super::checkpoint::LoadedModel;
use super::decoder::DecodeOptions;
use super::decoder::Decoder;
use super::error::{EngineError, Result};
use super::events::DecodeEvent;
use super::metrics::{RunStats, StepTimes, measure_step_times, speedup};
use super::policy::PolicyKind;

/// One policy's run of one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct LaneResult {
    pub policy: PolicyKind,
    pub tokens: Vec<u32>,
    pub stats: RunStats,
    /// Baseline only: the logit margin of each committed decode token, by output index.
    #[serde(skip)]
    pub margins: Vec<f32>,
}

/// Both lanes of one prompt, compared.
#[derive(Debug, Clone, Serialize)]
pub struct PromptResult {
    pub prompt: String,
    /// The lanes of the run whose speedup is the median of all runs.
    pub baseline: LaneResult,
    pub speculative: LaneResult,
    /// Every run's lanes' statistics (baseline, speculative), in run order.
    #[serde(skip)]
    pub runs: Vec<(RunStats, RunStats)>,
    pub step_times: StepTimes,
    /// The first output index where the lanes differ, with the baseline's logit margin there.
    pub mismatch: Option<(usize, f32)>,
}

impl PromptResult {
    /// Baseline decode time / speculative decode time (same tokens, prefill excluded).
    pub fn speedup(&self) -> f64 {
        speedup(&self.baseline.stats, &self.speculative.stats)
    }
}

/// A lane being decoded, its events folded as they come.
struct LaneRun {
    decoder: Decoder,
    result: LaneResult,
    passes: usize,
    /// Compute used so far, prefill included.
    used: Duration,
    done: bool,
}

impl LaneRun {
    fn new(
        loaded: &LoadedModel,
        policy: PolicyKind,
        prompt: &str,
        options: DecodeOptions,
    ) -> Result<Self> {
        let passes = loaded.model().passes();
        Ok(Self {
            decoder: Decoder::new(loaded, policy.build(), prompt, options)?,
            result: LaneResult {
                policy,
                tokens: Vec::new(),
                stats: RunStats::new(passes),
                margins: Vec::new(),
            },
            passes,
            used: Duration::ZERO,
            done: false,
        })
    }

    /// Runs the lane's next event and folds it in.
    fn advance(&mut self) -> Result<()> {
        let Some(event) = self.decoder.next_event()? else {
            self.done = true;
            return Ok(());
        };
        self.result.stats.record(&event);
        match event {
            DecodeEvent::Prefill(p) => self.used += p.compute,
            DecodeEvent::Step(step) => {
                self.used += step.compute;
                let last = step.rows.iter().filter(|r| r.pass.is_last(self.passes));
                let margins = last.filter_map(|r| r.prediction.as_ref().map(|p| p.margin));
                self.result.margins.extend(margins);
            }
            DecodeEvent::Finished(finish) => self.result.tokens = finish.tokens,
        }
        Ok(())
    }
}

/// Runs one policy to the end and folds its events.
pub fn run_lane(
    loaded: &LoadedModel,
    policy: PolicyKind,
    prompt: &str,
    options: DecodeOptions,
) -> Result<LaneResult> {
    let mut lane = LaneRun::new(loaded, policy, prompt, options)?;
    while !lane.done {
        lane.advance()?;
    }
    Ok(lane.result)
}

/// Baseline and `policy` on one prompt, interleaved: the lane that has used less compute so
/// far runs its next step, so the lanes take turns a few steps at a time and machine drift
/// slows both alike. Returns (baseline, speculative).
pub fn run_interleaved(
    loaded: &LoadedModel,
    policy: PolicyKind,
    prompt: &str,
    options: DecodeOptions,
) -> Result<(LaneResult, LaneResult)> {
    let mut lanes = [
        LaneRun::new(loaded, PolicyKind::Baseline, prompt, options)?,
        LaneRun::new(loaded, policy, prompt, options)?,
    ];
    while let Some(next) = lanes.iter_mut().filter(|l| !l.done).min_by_key(|l| l.used) {
        next.advance()?;
    }
    let [baseline, speculative] = lanes;
    Ok((baseline.result, speculative.result))
}

/// Benchmarks one prompt: `runs` interleaved runs of baseline and `policy` (the speculative
/// lane), keeping every run's statistics and the lanes of the median run (by speedup), then
/// the step times at the run's mid position.
pub fn bench_prompt(
    loaded: &LoadedModel,
    prompt: &str,
    options: DecodeOptions,
    (policy, runs): (PolicyKind, usize),
) -> Result<PromptResult> {
    if policy == PolicyKind::Baseline {
        return Err(EngineError::Invalid(
            "bench races baseline against a speculative policy: speed or dual[:MARGIN]".into(),
        ));
    }
    let mut lanes: Vec<(LaneResult, LaneResult)> = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let (baseline, speculative) = run_interleaved(loaded, policy, prompt, options)?;
        if let Some((b, s)) = lanes.first() {
            for (again, first) in [(&baseline, b), (&speculative, s)] {
                if again.tokens != first.tokens {
                    return Err(EngineError::Invalid(format!(
                        "{} decoding is not deterministic: two runs of {prompt:?} differ",
                        again.policy
                    )));
                }
            }
        }
        lanes.push((baseline, speculative));
    }
    let runs: Vec<(RunStats, RunStats)> = lanes
        .iter()
        .map(|(b, s)| (b.stats.clone(), s.stats.clone()))
        .collect();
    let (baseline, speculative) = lanes.swap_remove(median_run(&runs));
    let prompt_len = loaded.tokenizer.encode(prompt)?.len();
    let mid = (prompt_len + baseline.tokens.len() / 2).min(options.context.saturating_sub(1));
    let step_times = measure_step_times(&loaded.backend, mid, 20)?;
    let mismatch = first_difference(&baseline, &speculative);
    Ok(PromptResult {
        prompt: prompt.to_string(),
        baseline,
        speculative,
        runs,
        step_times,
        mismatch,
    })
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
fn first_difference(baseline: &LaneResult, speculative: &LaneResult) -> Option<(usize, f32)> {
    baseline
        .tokens
        .iter()
        .zip(&speculative.tokens)
        .position(|(a, b)| a != b)
        .or_else(|| {
            (baseline.tokens.len() != speculative.tokens.len())
                .then(|| baseline.tokens.len().min(speculative.tokens.len()))
        })
        .map(|i| {
            (
                i,
                i.checked_sub(1)
                    .and_then(|j| baseline.margins.get(j))
                    .copied()
                    .unwrap_or(f32::NAN),
            )
        })
}
