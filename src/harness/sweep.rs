//! Sweeps: the bench (`bench::bench_prompt`, figured by `report::BenchReport`) repeated over
//! one quantity that varies, so a chart can show how speedup moves with it. The length sweep
//! runs every prompt at each generation length: SPEED's pipeline fills and drains once per
//! run, so a short generation pays a larger share of its start. Read by the CLI's `sweep`.

use serde::Serialize;

use super::bench::{Lineup, bench_prompt};
use super::report::BenchReport;
use super::roofline::Roofline;
use crate::engine::LoadedModel;
use crate::engine::decoder::DecodeOptions;
use crate::engine::error::{EngineError, Result};
use crate::engine::exit_gate::ExitThreshold;
use crate::engine::policy::PolicyKind;

/// One policy at one point of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyPoint {
    pub policy: String,
    /// Over every prompt: baseline decode time / policy decode time.
    pub speedup: f64,
    pub tokens_per_sec: f64,
    /// Identical to the baseline on every prompt where it must be (never for a lossy lane).
    pub identical: bool,
    /// A lossy lane's share of the baseline's tokens it has at the same index; `None` for
    /// the lossless ones.
    pub lossy_agreement: Option<f64>,
}

impl PolicyPoint {
    /// Whether its text differed from the baseline's where it must not: a lossless lane
    /// that is not identical.
    pub fn failed(&self) -> bool {
        !self.identical && self.lossy_agreement.is_none()
    }
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
            .flat_map(|p| p.policies.iter().filter(|q| q.failed()))
            .map(|q| q.policy.clone())
            .collect();
        failed.sort();
        failed.dedup();
        failed
    }
}

/// The bench of `lineup` on every prompt at each of `lengths` tokens (`options` with each
/// length as its `max_tokens`); `progress` hears each (length, prompt) pair before it runs,
/// counted from 1.
pub fn sweep_lengths(
    loaded: &LoadedModel,
    prompts: &[String],
    options: DecodeOptions,
    lengths: &[usize],
    lineup: Lineup<'_>,
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
        let report = bench_prompts(loaded, prompts, options, lineup, &mut progress)?;
        points.push(point(max_tokens, &report));
    }
    Ok(LengthSweep {
        prompts: prompts.len(),
        points,
    })
}

/// The bench of `lineup` on every prompt, as one report; `progress` hears each prompt before
/// it runs, counted from 1.
fn bench_prompts(
    loaded: &LoadedModel,
    prompts: &[String],
    options: DecodeOptions,
    lineup: Lineup<'_>,
    progress: &mut dyn FnMut(usize),
) -> Result<BenchReport> {
    let mut results = Vec::with_capacity(prompts.len());
    for (j, prompt) in prompts.iter().enumerate() {
        progress(j + 1);
        let mut observe = |_: usize, _: &_| Ok(());
        results.push(bench_prompt(loaded, prompt, options, lineup, &mut observe)?);
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
            identical: p.mismatches == 0 && p.lossy.is_none(),
            lossy_agreement: p.lossy.as_ref().map(|l| l.agreement),
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

/// A loaded model and the name its points are charted under.
#[derive(Debug, Clone, Copy)]
pub struct NamedModel<'a> {
    /// The name its point carries ([`ModelPoint::model`]).
    pub name: &'a str,
    /// The model and tokenizer the bench runs.
    pub loaded: &'a LoadedModel,
}

/// The bench of `lineup` on every prompt of `model`; `progress` hears each prompt before it
/// runs, counted from 1.
pub fn policy_point(
    model: NamedModel<'_>,
    prompts: &[String],
    options: DecodeOptions,
    lineup: Lineup<'_>,
    progress: &mut dyn FnMut(usize),
) -> Result<ModelPoint> {
    let NamedModel { name, loaded } = model;
    if prompts.is_empty() {
        return Err(EngineError::Invalid(
            "a sweep needs at least one prompt".into(),
        ));
    }
    let report = bench_prompts(loaded, prompts, options, lineup, progress)?;
    let config = &loaded.model().config;
    Ok(ModelPoint {
        model: name.to_string(),
        layer_applications: config.layers * config.passes,
        baseline_tokens_per_sec: baseline_tokens_per_sec(&report),
        ceiling: report.ceiling,
        policies: policy_points(&report),
    })
}

/// One model size in one weight type: its steps measured, and the roofline's bound on them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SizePoint {
    pub hidden: usize,
    /// The weight type asked for (`bf16`, `q8_0`, `q4_k_m`).
    pub weights: String,
    /// The types its matrices are stored in (`LoopedModel::weight_type`: `q4_k+q6_k`; a
    /// quantized file's rows too short for a type's blocks take another).
    pub stored: String,
    /// Weight bytes one pass reads.
    pub bytes_per_pass: u64,
    /// The read bandwidth over this model's own weights (`roofline::weights_read_bytes_per_sec`),
    /// the mean of a probe just before its steps are timed and one just after: from DRAM at
    /// real size, from the caches where its weights fit there.
    pub read_bytes_per_sec: f64,
    pub one_row_ms: f64,
    pub full_ms: f64,
    /// R · t(1 row) / t(R rows), measured.
    pub ceiling: f64,
    /// The same from the roofline's step times with memory and arithmetic overlapped
    /// (`roofline::step_bound`): the bound. `None` for quantized weights, whose integer dot
    /// products the bf16 multiply-add rate does not time.
    pub ceiling_bound: Option<f64>,
    /// The same with memory, then arithmetic: what a step that cannot overlap them reaches.
    pub ceiling_serial: Option<f64>,
}

/// The machine's arithmetic the roofline is drawn from; its bandwidth is probed beside each
/// size's steps ([`SizePoint::read_bytes_per_sec`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MachineLimits {
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

/// The machine's multiply-add rate at 1 and at R rows, measured with `loaded`'s kernels.
/// Errors where the model does not decode on the host.
pub fn machine_limits(loaded: &LoadedModel) -> Result<MachineLimits> {
    let kernels = host_kernels(loaded)?;
    let passes = loaded.model().passes();
    Ok(MachineLimits {
        multiply_adds_per_sec: (
            super::roofline::multiply_adds_per_sec(kernels, 1),
            super::roofline::multiply_adds_per_sec(kernels, passes),
        ),
    })
}

/// `loaded`'s host kernels; an error where candle's ops decode it.
fn host_kernels(loaded: &LoadedModel) -> Result<&crate::engine::kernels::Kernels> {
    loaded.backend.kernels().ok_or_else(not_on_host)
}

fn not_on_host() -> EngineError {
    EngineError::Invalid("the size sweep times spex's CPU kernels".into())
}

/// The read bandwidth over `loaded`'s own layer weights, in bytes per second.
fn weights_bandwidth(loaded: &LoadedModel) -> Result<f64> {
    super::roofline::loaded_weights_read_bytes_per_sec(loaded).ok_or_else(not_on_host)?
}

/// `loaded`'s steps at position `pos`, and their bound under `limits` (`machine_limits`) and
/// the bandwidth probed over its weights either side of them: on a machine whose bandwidth
/// moves from one minute to the next, one probe for the whole sweep set some sizes' steps
/// against a different machine.
pub fn size_point(
    loaded: &LoadedModel,
    weights: &str,
    pos: usize,
    limits: MachineLimits,
) -> Result<SizePoint> {
    let (one_row_rate, full_rate) = limits.multiply_adds_per_sec;
    let model = loaded.model();
    let passes = model.passes();
    let before = weights_bandwidth(loaded)?;
    let times = loaded.backend.step_times(pos, 20)?;
    let read_bytes_per_sec = (before + weights_bandwidth(loaded)?) / 2.0;
    let roofline = |multiply_adds_per_sec| Roofline {
        read_bytes_per_sec,
        multiply_adds_per_sec,
    };
    let one = super::roofline::step_bound(model, 1, roofline(one_row_rate));
    let full = super::roofline::step_bound(model, passes, roofline(full_rate));
    let r = passes as f64;
    let stored = model.weight_type();
    let bf16 = (stored == "bf16").then_some(());
    Ok(SizePoint {
        hidden: model.config.hidden,
        weights: weights.to_string(),
        stored,
        bytes_per_pass: super::roofline::layer_bytes_per_pass(model),
        read_bytes_per_sec,
        one_row_ms: times.one_row.as_secs_f64() * 1e3,
        full_ms: times.full.as_secs_f64() * 1e3,
        ceiling: times.ceiling(),
        ceiling_bound: bf16.map(|()| r * one.overlapped_secs / full.overlapped_secs),
        ceiling_serial: bf16.map(|()| r * one.serial_secs / full.serial_secs),
    })
}

/// One lane of the exit sweep: a lossy early exit at one setting, or the lossless policy it
/// is drawn beside.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExitPoint {
    pub policy: String,
    /// The rule's name before its setting (`exit:confidence`, `exit:pass`, `exit:gate`), or
    /// the lossless policy's name.
    pub family: String,
    /// Over every prompt: baseline decode time / its decode time.
    pub speedup: f64,
    /// The share of the baseline's output tokens it has at the same index (1 for a lossless
    /// lane whose text is the baseline's).
    pub agreement: f64,
    /// The prompts whose text departed from the baseline's.
    pub departed: usize,
    /// Passes run per committed token, for a lossy lane.
    pub passes_per_token: Option<f64>,
    pub lossy: bool,
}

/// Speedup against agreement: every exit rule over its settings, and a lossless policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExitSweep {
    pub prompts: usize,
    pub baseline_tokens_per_sec: f64,
    pub points: Vec<ExitPoint>,
}

impl ExitSweep {
    /// The lossless policies whose text differed from the baseline's.
    pub fn failed(&self) -> Vec<String> {
        (self.points.iter())
            .filter(|p| !p.lossy && p.agreement < 1.0)
            .map(|p| p.policy.clone())
            .collect()
    }
}

/// The settings `spex sweep exits` races where it is given none.
#[derive(Debug, Clone, PartialEq)]
pub struct ExitSettings {
    /// `exit:confidence=P` for each P.
    pub confidences: Vec<f32>,
    /// `exit:gate=T` for each T, where the model has a gate.
    pub gate_thresholds: Vec<ExitThreshold>,
}

/// The lossy lanes of an exit sweep on a model of `passes` passes: every fixed depth below
/// R, each confidence, and each gate threshold where `has_gate`.
pub fn exit_lanes(passes: usize, has_gate: bool, settings: &ExitSettings) -> Vec<PolicyKind> {
    use crate::engine::pass::Pass;
    use crate::engine::policy::ExitRule;
    let depths = (1..passes).filter_map(Pass::new).map(ExitRule::Pass);
    let confident = (settings.confidences.iter())
        .map(|&min_probability| ExitRule::Confidence { min_probability });
    let gated = (settings.gate_thresholds.iter())
        .filter(|_| has_gate)
        .map(|&threshold| ExitRule::Gate {
            threshold: Some(threshold),
        });
    (depths.chain(confident).chain(gated))
        .map(|rule| PolicyKind::Exit {
            rule,
            fill: Default::default(),
        })
        .collect()
}

/// The bench of `lineup` (exit lanes and a lossless policy) on every prompt, as points of
/// speedup against agreement; `progress` hears each prompt before it runs, counted from 1.
pub fn sweep_exits(
    loaded: &LoadedModel,
    prompts: &[String],
    options: DecodeOptions,
    lineup: Lineup<'_>,
    progress: &mut dyn FnMut(usize),
) -> Result<ExitSweep> {
    if prompts.is_empty() {
        return Err(EngineError::Invalid(
            "a sweep needs at least one prompt".into(),
        ));
    }
    let report = bench_prompts(loaded, prompts, options, lineup, progress)?;
    let points = (report.policies.iter())
        .map(|p| ExitPoint {
            // An exit rule's lanes are one line through its settings; a lossless one, a point.
            family: match p.lossy {
                Some(_) => p.policy.split('=').next().unwrap_or_default().to_string(),
                None => p.policy.clone(),
            },
            policy: p.policy.clone(),
            speedup: p.figures.speedup,
            agreement: match &p.lossy {
                Some(loss) => loss.agreement,
                None if p.mismatches == 0 => 1.0,
                None => 0.0,
            },
            departed: (p.lossy.as_ref()).map_or(p.mismatches, super::report::Loss::departed),
            passes_per_token: p.lossy.as_ref().map(|l| l.passes_per_token),
            lossy: p.lossy.is_some(),
        })
        .collect();
    Ok(ExitSweep {
        prompts: prompts.len(),
        baseline_tokens_per_sec: baseline_tokens_per_sec(&report),
        points,
    })
}
