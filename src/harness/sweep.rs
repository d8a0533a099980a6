//! Sweeps: the bench (`bench::bench_prompt`, figured by `report::BenchReport`) repeated over
//! one quantity that varies, so a chart can show how speedup moves with it. The length sweep
//! runs every prompt at each generation length: SPEED's pipeline fills and drains once per
//! run, so a short generation pays a larger share of its start. Read by the CLI's `sweep`.

use serde::Serialize;

use super::bench::{Turns, bench_prompt};
use super::report::BenchReport;
use crate::engine::LoadedModel;
use crate::engine::decoder::DecodeOptions;
use crate::engine::error::{EngineError, Result};
use crate::engine::policy::PolicyKind;

/// One policy at one point of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyPoint {
    pub policy: String,
    /// Over every prompt: baseline decode time / policy decode time.
    pub speedup: f64,
    pub tokens_per_sec: f64,
    /// Identical to the baseline on every prompt where it must be.
    pub identical: bool,
}

/// The bench at one generation length.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LengthPoint {
    pub max_tokens: usize,
    pub baseline_tokens_per_sec: f64,
    /// R · t(1 row) / t(R rows), the prompts' mean.
    pub ceiling: f64,
    pub policies: Vec<PolicyPoint>,
}

/// Speedup and ceiling against generation length.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LengthSweep {
    pub prompts: usize,
    pub points: Vec<LengthPoint>,
}

impl LengthSweep {
    /// The policies whose text differed from the baseline's where it must not, at any length.
    pub fn failed(&self) -> Vec<String> {
        let mut failed: Vec<String> = (self.points.iter())
            .flat_map(|p| p.policies.iter().filter(|q| !q.identical))
            .map(|q| q.policy.clone())
            .collect();
        failed.sort();
        failed.dedup();
        failed
    }
}

/// The bench of `policies` on every prompt at each of `lengths` tokens; `progress` hears
/// each (length, prompt) pair before it runs, counted from 1.
pub fn sweep_lengths(
    loaded: &LoadedModel,
    prompts: &[String],
    (options, lengths): (DecodeOptions, &[usize]),
    (policies, turns): (&[PolicyKind], Turns),
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LengthSweep> {
    if lengths.is_empty() || prompts.is_empty() {
        return Err(EngineError::Invalid(
            "a sweep needs at least one length and one prompt".into(),
        ));
    }
    let total = lengths.len() * prompts.len();
    let mut points = Vec::with_capacity(lengths.len());
    for (i, &max_tokens) in lengths.iter().enumerate() {
        let options = DecodeOptions {
            max_tokens,
            ..options
        };
        let done = i * prompts.len();
        let mut progress = |j: usize| progress(done + j, total);
        let report = bench_prompts(loaded, prompts, options, (policies, turns), &mut progress)?;
        points.push(point(max_tokens, &report));
    }
    Ok(LengthSweep {
        prompts: prompts.len(),
        points,
    })
}

/// The bench of `policies` on every prompt, as one report; `progress` hears each prompt
/// before it runs, counted from 1.
fn bench_prompts(
    loaded: &LoadedModel,
    prompts: &[String],
    options: DecodeOptions,
    lanes: (&[PolicyKind], Turns),
    progress: &mut dyn FnMut(usize),
) -> Result<BenchReport> {
    let mut results = Vec::with_capacity(prompts.len());
    for (j, prompt) in prompts.iter().enumerate() {
        progress(j + 1);
        let mut observe = |_: usize, _: &_| Ok(());
        results.push(bench_prompt(loaded, prompt, options, lanes, &mut observe)?);
    }
    Ok(BenchReport::of(&results, loaded.model().passes()))
}

fn point(max_tokens: usize, report: &BenchReport) -> LengthPoint {
    LengthPoint {
        max_tokens,
        baseline_tokens_per_sec: baseline_tokens_per_sec(report),
        ceiling: report.ceiling,
        policies: policy_points(report),
    }
}

fn baseline_tokens_per_sec(report: &BenchReport) -> f64 {
    (report.policies.first()).map_or(0.0, |p| p.figures.baseline_tokens_per_sec)
}

fn policy_points(report: &BenchReport) -> Vec<PolicyPoint> {
    (report.policies.iter())
        .map(|p| PolicyPoint {
            policy: p.policy.clone(),
            speedup: p.figures.speedup,
            tokens_per_sec: p.figures.tokens_per_sec,
            identical: p.mismatches == 0,
        })
        .collect()
}

/// Every policy's bench on one model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelPoint {
    pub model: String,
    /// K · R: the layers a token goes through.
    pub layer_applications: usize,
    pub baseline_tokens_per_sec: f64,
    /// R · t(1 row) / t(R rows), the prompts' mean.
    pub ceiling: f64,
    pub policies: Vec<PolicyPoint>,
}

/// The bench of `policies` on every prompt of `loaded`, named `model`; `progress` hears each
/// prompt before it runs, counted from 1.
pub fn policy_point(
    (model, loaded): (&str, &LoadedModel),
    prompts: &[String],
    options: DecodeOptions,
    lanes: (&[PolicyKind], Turns),
    progress: &mut dyn FnMut(usize),
) -> Result<ModelPoint> {
    if prompts.is_empty() {
        return Err(EngineError::Invalid(
            "a sweep needs at least one prompt".into(),
        ));
    }
    let report = bench_prompts(loaded, prompts, options, lanes, progress)?;
    let config = &loaded.model().config;
    Ok(ModelPoint {
        model: model.to_string(),
        layer_applications: config.num_hidden_layers * config.total_ut_steps,
        baseline_tokens_per_sec: baseline_tokens_per_sec(&report),
        ceiling: report.ceiling,
        policies: policy_points(&report),
    })
}

/// One model size: its steps measured, and the roofline's bound on them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SizePoint {
    pub hidden: usize,
    /// Weight bytes one pass reads.
    pub bytes_per_pass: u64,
    pub one_row_ms: f64,
    pub full_ms: f64,
    /// R · t(1 row) / t(R rows), measured.
    pub ceiling: f64,
    /// The same from the roofline's step times with memory and arithmetic overlapped
    /// (`roofline::step_bound`): the bound.
    pub ceiling_bound: f64,
    /// The same with memory, then arithmetic: what a step that cannot overlap them reaches.
    pub ceiling_serial: f64,
}

/// The machine's limits the roofline is drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MachineLimits {
    pub read_bytes_per_sec: f64,
    /// The kernels' multiply-add rate at 1 row and at R rows.
    pub multiply_adds_per_sec: (f64, f64),
}

/// The ceiling against model size, beside its roofline bound.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SizeSweep {
    #[serde(flatten)]
    pub limits: MachineLimits,
    pub points: Vec<SizePoint>,
}

/// The machine's limits, measured with `loaded`'s kernels: its read bandwidth and its
/// multiply-add rate at 1 and at R rows. Errors where the model does not decode on the host.
pub fn machine_limits(loaded: &LoadedModel) -> Result<MachineLimits> {
    let kernels = (loaded.backend.kernels())
        .ok_or_else(|| EngineError::Invalid("the size sweep times spex's CPU kernels".into()))?;
    let passes = loaded.model().passes();
    Ok(MachineLimits {
        read_bytes_per_sec: super::roofline::read_bytes_per_sec(kernels.pool()),
        multiply_adds_per_sec: (
            super::roofline::multiply_adds_per_sec(kernels, 1),
            super::roofline::multiply_adds_per_sec(kernels, passes),
        ),
    })
}

/// `loaded`'s steps at position `pos`, and their bound under `limits` (`machine_limits`).
pub fn size_point(loaded: &LoadedModel, pos: usize, limits: MachineLimits) -> Result<SizePoint> {
    let MachineLimits {
        read_bytes_per_sec,
        multiply_adds_per_sec: (one_row_rate, full_rate),
    } = limits;
    let model = loaded.model();
    let passes = model.passes();
    let times = loaded.backend.step_times(pos, 20)?;
    let one = super::roofline::step_bound(model, 1, (read_bytes_per_sec, one_row_rate));
    let full = super::roofline::step_bound(model, passes, (read_bytes_per_sec, full_rate));
    let r = passes as f64;
    Ok(SizePoint {
        hidden: model.config.hidden_size,
        bytes_per_pass: super::roofline::layer_bytes_per_pass(model),
        one_row_ms: times.one_row.as_secs_f64() * 1e3,
        full_ms: times.full.as_secs_f64() * 1e3,
        ceiling: times.ceiling(),
        ceiling_bound: r * one.overlapped_secs / full.overlapped_secs,
        ceiling_serial: r * one.serial_secs / full.serial_secs,
    })
}
