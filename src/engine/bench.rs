//! The headless benchmark: baseline and SPEED on the same prompts in one process, outputs
//! checked token for token, speedup and the pipeline's ceiling measured in the same run
//! (speculation.md §5). `spex bench` prints what this returns.

use serde::Serialize;

use super::checkpoint::LoadedModel;
use super::decoder::Decoder;
use super::error::{EngineError, Result};
use super::events::DecodeEvent;
use super::metrics::{RunStats, StepTimes, measure_step_times, speedup};
use super::pipeline::DecodeOptions;
use super::policy::{Policy, PolicyKind};

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
    pub baseline: LaneResult,
    pub speculative: LaneResult,
    pub step_times: StepTimes,
    /// The first output index where the lanes differ, with the baseline's logit margin there.
    pub mismatch: Option<(usize, f32)>,
}

impl PromptResult {
    /// Baseline decode time / SPEED decode time (same tokens, prefill excluded).
    pub fn speedup(&self) -> f64 {
        speedup(&self.baseline.stats, &self.speculative.stats)
    }
}

/// Runs one policy to the end and folds its events.
pub fn run_lane(
    loaded: &LoadedModel,
    policy: PolicyKind,
    prompt: &str,
    options: DecodeOptions,
) -> Result<LaneResult> {
    run_policy(loaded, policy, policy.build(), prompt, options)
}

fn run_policy(
    loaded: &LoadedModel,
    kind: PolicyKind,
    policy: Box<dyn Policy>,
    prompt: &str,
    options: DecodeOptions,
) -> Result<LaneResult> {
    let mut decoder = Decoder::new(loaded, policy, prompt, options)?;
    let mut stats = RunStats::new(loaded.model().passes());
    let mut margins = Vec::new();
    let mut tokens = Vec::new();
    while let Some(event) = decoder.next_event()? {
        stats.record(&event);
        if let DecodeEvent::Step(step) = &event {
            let last_pass = step
                .rows
                .iter()
                .filter(|r| r.pass.is_last(loaded.model().passes()));
            margins.extend(last_pass.filter_map(|r| r.prediction.as_ref().map(|p| p.margin)));
        }
        if let DecodeEvent::Finished(finish) = event {
            tokens = finish.tokens;
        }
    }
    Ok(LaneResult {
        policy: kind,
        tokens,
        stats,
        margins,
    })
}

/// Benchmarks one prompt: baseline and `policy` (the speculative lane, kept in the `speculative`
/// field) alternately `runs` times, each lane keeping its fastest run (noise from other
/// processes only ever slows a run down), then the step times at the run's mid position.
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
    let mut baseline = run_lane(loaded, PolicyKind::Baseline, prompt, options)?;
    let mut speculative = run_lane(loaded, policy, prompt, options)?;
    for _ in 1..runs {
        for lane in [&mut baseline, &mut speculative] {
            let again = run_lane(loaded, lane.policy, prompt, options)?;
            if again.tokens != lane.tokens {
                return Err(EngineError::Invalid(format!(
                    "{:?} decoding is not deterministic: two runs of {prompt:?} differ",
                    lane.policy
                )));
            }
            if again.stats.decode_compute < lane.stats.decode_compute {
                *lane = again;
            }
        }
    }
    let prompt_len = loaded.tokenizer.encode(prompt)?.len();
    let mid = (prompt_len + baseline.tokens.len() / 2).min(options.context.saturating_sub(1));
    let step_times = measure_step_times(&loaded.backend, mid, 20)?;
    let mismatch = baseline
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
        });
    Ok(PromptResult {
        prompt: prompt.to_string(),
        baseline,
        speculative,
        step_times,
        mismatch,
    })
}
