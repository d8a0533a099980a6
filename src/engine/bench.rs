//! The headless benchmark: baseline and SPEED on the same prompts in one process, outputs
//! checked token for token, speedup and the pipeline's ceiling measured in the same run
//! (speculation.md §5). `spex bench` prints what this returns.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::checkpoint::LoadedModel;
use super::error::{EngineError, Result};
use super::events::DecodeEvent;
use super::metrics::RunStats;
use super::model::{LoopedModel, RowInput, StepRow};
use super::pipeline::{DecodeOptions, Decoder};
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

/// Step compute of baseline and of a full pipeline at the same position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepTimes {
    /// A baseline step: the mean of one token's R one-row steps (LM head on the last only).
    #[serde(rename = "one_row_us", serialize_with = "micros")]
    pub one_row: Duration,
    /// One step of R rows, every row read out.
    #[serde(rename = "full_us", serialize_with = "micros")]
    pub full: Duration,
    pub rows: usize,
}

impl StepTimes {
    /// R · t(1 row) / t(R rows): the speedup with no flips.
    pub fn ceiling(&self) -> f64 {
        self.rows as f64 * self.one_row.as_secs_f64() / self.full.as_secs_f64()
    }
}

/// Both lanes of one prompt, compared.
#[derive(Debug, Clone, Serialize)]
pub struct PromptResult {
    pub prompt: String,
    pub baseline: LaneResult,
    pub speed: LaneResult,
    pub step_times: StepTimes,
    /// The first output index where the lanes differ, with the baseline's logit margin there.
    pub mismatch: Option<(usize, f32)>,
}

impl PromptResult {
    /// Baseline decode time / SPEED decode time (same tokens, prefill excluded).
    pub fn speedup(&self) -> f64 {
        speedup(&self.baseline.stats, &self.speed.stats)
    }
}

/// Baseline time per token over the policy's time per token.
pub fn speedup(baseline: &RunStats, policy: &RunStats) -> f64 {
    match (baseline.time_per_token(), policy.time_per_token()) {
        (Some(b), Some(p)) if !p.is_zero() => b.as_secs_f64() / p.as_secs_f64(),
        _ => 0.0,
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
    let mut stats = RunStats::new(loaded.model.passes());
    let mut margins = Vec::new();
    let mut tokens = Vec::new();
    while let Some(event) = decoder.next_event()? {
        stats.record(&event);
        if let DecodeEvent::Step(step) = &event {
            let last_pass = step.rows.iter().filter(|r| r.pass == loaded.model.passes());
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

/// Step compute at position `pos`: a baseline token's R one-row steps (the LM head only on the
/// last, as baseline decoding does) and one R-row step with every row read out (as SPEED
/// does). Reading out every 1-row step instead would overstate the ceiling: on the shipped
/// model the LM head is a quarter of a step's weights.
pub fn measure_step_times(model: &LoopedModel, pos: usize, repeats: usize) -> Result<StepTimes> {
    let passes = model.passes();
    let row = |pass: usize, readout: bool| StepRow {
        pos,
        pass,
        input: RowInput::Token(1),
        readout,
        alternate: false,
    };
    let mut batches: Vec<Vec<StepRow>> = (0..passes)
        .map(|pass| vec![row(pass, pass + 1 == passes)])
        .collect();
    batches.push((0..passes).map(|pass| row(pass, true)).collect());
    let t = median_times(model, pos, &batches, repeats)?;
    let token: Duration = t[..passes].iter().sum();
    Ok(StepTimes {
        one_row: token / passes as u32,
        full: t[passes],
        rows: passes,
    })
}

/// Median compute of a step of each of `row_counts` rows (rows at passes 0, 1, …, all at
/// `pos`, all read out). Used by `cargo bench`.
pub fn median_step_times(
    model: &LoopedModel,
    pos: usize,
    row_counts: &[usize],
    repeats: usize,
) -> Result<Vec<Duration>> {
    let batches: Vec<Vec<StepRow>> = row_counts
        .iter()
        .map(|&n| {
            (0..n)
                .map(|pass| StepRow {
                    pos,
                    pass,
                    input: RowInput::Token(1),
                    readout: true,
                    alternate: false,
                })
                .collect()
        })
        .collect();
    median_times(model, pos, &batches, repeats)
}

/// Median compute of each batch of rows at `pos`, the batches interleaved so that machine
/// noise hits them alike; two warm-up rounds are dropped.
fn median_times(
    model: &LoopedModel,
    pos: usize,
    batches: &[Vec<StepRow>],
    repeats: usize,
) -> Result<Vec<Duration>> {
    let mut cache = model.new_cache(pos + 1)?;
    if pos > 0 {
        for pass in 0..model.passes() {
            cache.mark_written(pass, pos - 1);
        }
    }
    let mut times = vec![Vec::with_capacity(repeats); batches.len()];
    for round in 0..repeats + 2 {
        for (batch, t) in batches.iter().zip(&mut times) {
            let started = Instant::now();
            model.step(batch, &mut cache)?;
            if round >= 2 {
                t.push(started.elapsed());
            }
        }
    }
    Ok(times.iter_mut().map(|t| median(t)).collect())
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Benchmarks one prompt: baseline and `policy` (the speculative lane, kept in the `speed`
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
    let mut speed = run_lane(loaded, policy, prompt, options)?;
    for _ in 1..runs {
        for lane in [&mut baseline, &mut speed] {
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
    let step_times = measure_step_times(&loaded.model, mid, 20)?;
    let mismatch = baseline
        .tokens
        .iter()
        .zip(&speed.tokens)
        .position(|(a, b)| a != b)
        .or_else(|| {
            (baseline.tokens.len() != speed.tokens.len())
                .then(|| baseline.tokens.len().min(speed.tokens.len()))
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
        speed,
        step_times,
        mismatch,
    })
}

fn micros<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e6)
}
