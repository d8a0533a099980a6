//! What-if re-simulation (`spex explain --what-if`): a recorded greedy run replayed under
//! other policies by the real scheduler (`engine::pipeline`), over an oracle step model that
//! answers from the recorded per-pass readouts instead of the weights (`oracle`). Step counts
//! are those a real run of each policy takes; the time each would take comes from the step
//! costs the recorded run measured (`StepCosts`, fitted to its steps), so the speedup is a
//! prediction for the machine the trace was recorded on. Read by the CLI's `explain`.

mod drafts;
mod oracle;
mod recorded;

use std::sync::Arc;

use serde::Serialize;
use tokenizers::Tokenizer;
use tokenizers::models::bpe::BPE;

pub use drafts::WhatIfDraft;
pub use oracle::{Lineage, LineageStore, Oracle};
pub use recorded::{RecordedRun, step_samples};

use super::race::Lane;
use crate::engine::decoder::DecodeOptions;
use crate::engine::error::{EngineError, Result};
use crate::engine::events::{DecodeEvent, FinishReason};
use crate::engine::pipeline::Pipeline;
use crate::engine::policy::PolicyKind;
use crate::engine::sampling::Sampling;
use crate::engine::tokenizer::TextTokenizer;

/// A step's compute as `one_row + extra_row · (rows − 1)`, in µs, fitted by least squares to
/// a recorded run's steps (both lanes: the baseline's 1-row steps pin the intercept).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepCosts {
    pub one_row_us: f64,
    pub extra_row_us: f64,
}

impl StepCosts {
    /// The fit to `(rows, compute)` samples; with one row count only, its mean and no slope.
    pub fn fit(samples: &[(usize, std::time::Duration)]) -> Self {
        let n = samples.len().max(1) as f64;
        let xs = || samples.iter().map(|&(rows, _)| rows as f64 - 1.0);
        let ts = || samples.iter().map(|&(_, t)| t.as_secs_f64() * 1e6);
        let (mean_x, mean_t) = (xs().sum::<f64>() / n, ts().sum::<f64>() / n);
        let var: f64 = xs().map(|x| (x - mean_x).powi(2)).sum();
        let cov: f64 = xs()
            .zip(ts())
            .map(|(x, t)| (x - mean_x) * (t - mean_t))
            .sum();
        let extra_row_us = if var > 0.0 { cov / var } else { 0.0 };
        Self {
            one_row_us: mean_t - extra_row_us * mean_x,
            extra_row_us,
        }
    }

    /// Predicted compute of a step of `rows` rows, in µs.
    pub fn step_us(&self, rows: usize) -> f64 {
        self.one_row_us + self.extra_row_us * (rows as f64 - 1.0)
    }
}

/// One policy replayed over one recorded run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Simulated {
    pub steps: u64,
    pub rows: usize,
    /// Predicted decode compute, µs.
    pub decode_us: f64,
}

/// Replays `run` under `policy` with the real scheduler over the oracle, `draft` drafting
/// for the `draft` policy; errors (naming the trace) where the run lacks a readout the
/// policy needs, and if the replay's text is not the recorded one.
pub fn simulate(
    oracle: &Arc<Oracle>,
    policy: PolicyKind,
    costs: &StepCosts,
    draft: Option<&WhatIfDraft>,
) -> Result<Simulated> {
    replay(oracle, policy, costs, draft).map_err(|e| EngineError::file(&oracle.run().path, e))
}

fn replay(
    oracle: &Arc<Oracle>,
    policy: PolicyKind,
    costs: &StepCosts,
    draft: Option<&WhatIfDraft>,
) -> Result<Simulated> {
    let run = oracle.run();
    // The oracle reads no prompt token; a draft model reads them all.
    let (prompt, drafter) = match (policy, draft) {
        (PolicyKind::Draft { .. }, Some(draft)) => {
            let (drafter, count) = draft.drafter(run.context)?;
            (draft.prompt(run)?, Some((drafter, count, draft.token_us)))
        }
        (PolicyKind::Draft { .. }, None) => {
            return Err(EngineError::Invalid(format!(
                "what-if replays `{policy}` with its draft model only (--draft-model NAME)"
            )));
        }
        _ => (vec![0; run.prompt_tokens], None),
    };
    let eos = &run.config.eos_token_ids;
    let tokenizer = Arc::new(TextTokenizer::new(Tokenizer::new(BPE::default()), eos));
    let (drafter, drafted) = match drafter {
        Some((drafter, count, token_us)) => (Some(drafter), Some((count, token_us))),
        None => (None, None),
    };
    let mut pipeline = Pipeline::new(
        oracle.clone(),
        drafter,
        tokenizer,
        policy.build(),
        prompt,
        replay_options(run),
    )?;
    let mut steps = 0;
    while let Some(event) = pipeline.next_event()? {
        if let DecodeEvent::Finished(f) = event {
            steps = f.steps;
        }
    }
    if pipeline.output() != run.output.as_slice() {
        return Err(EngineError::Invalid(format!(
            "what-if under {policy} did not reproduce the recorded text: this is a bug"
        )));
    }
    let decode_rows = &pipeline.cache().store().rows_per_step[run.config.passes..];
    let drafting_us = drafted.map_or(0.0, |(count, token_us)| count.get() as f64 * token_us);
    Ok(Simulated {
        steps,
        rows: decode_rows.iter().sum(),
        decode_us: decode_rows.iter().map(|&m| costs.step_us(m)).sum::<f64>() + drafting_us,
    })
}

/// The recorded run's options, greedy: as many tokens as it asked for where it ended on its
/// own (end of text, a full context), else as many as it decoded.
fn replay_options(run: &RecordedRun) -> DecodeOptions {
    let max_tokens = match run.finish {
        Some(FinishReason::EndOfText | FinishReason::ContextFull) => run.max_tokens,
        _ => run.tokens(),
    };
    DecodeOptions {
        max_tokens,
        context: run.context,
        sampling: Sampling::GREEDY,
        // The gate's threshold acts only on the lossy lanes what-if refuses.
        exit_threshold: None,
    }
}

/// A policy's forecast over every run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Forecast {
    pub policy: String,
    pub steps: u64,
    pub rows_per_step: f64,
    pub decode_us: f64,
    /// Predicted baseline decode time over this policy's.
    pub speedup: f64,
    /// The recorded runs' own steps, where every run was recorded with this policy.
    pub recorded_steps: Option<u64>,
}

/// What `spex explain --what-if` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WhatIf {
    pub runs: usize,
    pub tokens: usize,
    /// The step costs every run was timed with, where they came from elsewhere (another
    /// trace: the same policies projected onto another model or machine); `None` where each
    /// run's own steps were fitted.
    pub step_costs: Option<StepCosts>,
    /// Baseline first, then the policies asked for.
    pub forecasts: Vec<Forecast>,
}

impl WhatIf {
    /// Replays every run under baseline and each of `policies`, timed by the step costs each
    /// run measured.
    pub fn of(runs: Vec<RecordedRun>, policies: &[PolicyKind]) -> Result<Self> {
        Self::timed(runs, policies, None, None)
    }

    /// Replays every run under baseline and each of `policies`, timed by `step_costs` where
    /// given (the steps each policy takes come from the runs, the time of a step from
    /// elsewhere), else by each run's own; `draft` drafts for the `draft` policy.
    pub fn timed(
        runs: Vec<RecordedRun>,
        policies: &[PolicyKind],
        step_costs: Option<StepCosts>,
        draft: Option<&WhatIfDraft>,
    ) -> Result<Self> {
        if let Some(lossy) = policies.iter().find(|p| p.is_lossy()) {
            return Err(EngineError::Invalid(format!(
                "--what-if {lossy}: a lossy early exit commits tokens the recorded run never \
                 read out, so a replay cannot say what it does; race it with `spex bench \
                 --policy {lossy}`"
            )));
        }
        let tokens = runs.iter().map(RecordedRun::tokens).sum();
        let oracles: Vec<(Arc<Oracle>, StepCosts)> = (runs.into_iter())
            .map(|run| {
                let costs = step_costs.unwrap_or_else(|| StepCosts::fit(&run.step_samples));
                (Arc::new(Oracle::new(run)), costs)
            })
            .collect();
        let mut all = vec![PolicyKind::Baseline];
        all.extend(policies.iter().filter(|&&p| p != PolicyKind::Baseline));
        let mut forecasts = Vec::with_capacity(all.len());
        for policy in all {
            let mut total = Simulated {
                steps: 0,
                rows: 0,
                decode_us: 0.0,
            };
            for (oracle, costs) in &oracles {
                let s = simulate(oracle, policy, costs, draft)?;
                total.steps += s.steps;
                total.rows += s.rows;
                total.decode_us += s.decode_us;
            }
            let recorded = (oracles.iter())
                .map(|(o, _)| recorded_steps(o.run(), policy))
                .sum::<Option<u64>>();
            forecasts.push(Forecast {
                policy: policy.to_string(),
                steps: total.steps,
                rows_per_step: total.rows as f64 / total.steps.max(1) as f64,
                decode_us: total.decode_us,
                speedup: 0.0,
                recorded_steps: recorded,
            });
        }
        let baseline_us = forecasts[0].decode_us;
        for f in &mut forecasts {
            f.speedup = baseline_us / f.decode_us.max(f64::MIN_POSITIVE);
        }
        Ok(Self {
            runs: oracles.len(),
            tokens,
            step_costs,
            forecasts,
        })
    }
}

/// The steps `run` recorded for `policy`: its speculative lane's if that ran `policy`, its
/// baseline lane's for baseline.
fn recorded_steps(run: &RecordedRun, policy: PolicyKind) -> Option<u64> {
    let lane = if run.policy == policy {
        Lane::Speculative
    } else if policy == PolicyKind::Baseline {
        Lane::Baseline
    } else {
        return None;
    };
    run.steps.get(&lane).copied()
}
