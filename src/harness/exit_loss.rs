//! What a lossy exit rule costs in prediction: its cross-entropy on held-out text, beside the
//! baseline's (pass R's) on the same text.
//!
//! The text is teacher-forced through every pass (the reference forward,
//! `LoopedModel::hidden_per_pass`) and each position is read out at the pass its rule picks:
//! the gate's threshold rule over that position's λ, the first pass whose top-1 probability
//! reaches the confidence, or the fixed depth. This is how adaptive exit is scored where it is
//! proposed (Ouro's per-step loss and its threshold rule, which mlx-lm's `exit_threshold`
//! reproduces: every pass computed, one chosen), so it measures the rule's choice of depth
//! alone. The decoding lane adds what its copied KV entries change in later tokens
//! (`policy::exit`), which the bench's agreement and departure measure.

use candle_core::{D, DType, Tensor};
use serde::Serialize;

use crate::engine::error::{EngineError, Result};
use crate::engine::exit_gate::{self, ExitThreshold, sigmoid};
use crate::engine::model::LoopedModel;
use crate::engine::pass::Pass;
use crate::engine::policy::{ExitRule, PolicyKind, top_probability};
use crate::engine::tokenizer::TextTokenizer;
use crate::train::gate::spread_windows;

/// The held-out cross-entropy of one exit rule and of the baseline, in nats per token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HeldOutLoss {
    /// Mean −log p(next token) read out where the rule stops.
    pub nats: f64,
    /// The same at pass R: the baseline's.
    pub baseline_nats: f64,
    /// Mean passes the rule runs per token.
    pub passes_per_token: f64,
    /// Tokens scored.
    pub tokens: usize,
}

impl HeldOutLoss {
    /// What the rule adds to the baseline's cross-entropy.
    pub fn excess_nats(&self) -> f64 {
        self.nats - self.baseline_nats
    }
}

/// One window's per-pass readouts, as log-probabilities, and per-pass gate λ (empty without a
/// gate), position-major: `log_probs[r][t]` after pass r + 1 at position t.
struct Readouts {
    log_probs: Vec<Vec<Vec<f32>>>,
    lambdas: Vec<Vec<f32>>,
}

/// Teacher-forces `window` through every pass of `model`.
fn readouts(model: &LoopedModel, window: &[u32]) -> Result<Readouts> {
    let ids = Tensor::new(window, &model.device)?.unsqueeze(0)?;
    let states = model.hidden_per_pass(&ids)?;
    let log_probs = (model.readouts(&states)?.iter())
        .map(|l| {
            let l = l.to_dtype(DType::F32)?.squeeze(0)?;
            Ok(candle_nn::ops::log_softmax(&l, D::Minus1)?.to_vec2::<f32>()?)
        })
        .collect::<Result<Vec<_>>>()?;
    let lambdas = match &model.weights.exit_gate {
        Some(gate) => {
            let gate = gate.to_f32()?;
            let bias = gate.bias.to_vec1::<f32>()?[0];
            (states.iter())
                .map(|h| {
                    let h = h.to_dtype(DType::F32)?.squeeze(0)?;
                    let logits = h.matmul(&gate.weight.t()?)?.squeeze(1)?.to_vec1::<f32>()?;
                    Ok(logits.into_iter().map(|x| sigmoid(x + bias)).collect())
                })
                .collect::<Result<Vec<_>>>()?
        }
        None => Vec::new(),
    };
    Ok(Readouts { log_probs, lambdas })
}

/// The pass `rule` stops position `t` at, under `threshold` where the rule is the gate's
/// without its own. The confidence rule reads the same top-1 probability as the lane
/// (`policy::top_probability`: the log-softmax is the logits shifted, which it ignores).
fn stop_at(rule: ExitRule, threshold: ExitThreshold, r: &Readouts, t: usize) -> Pass {
    let passes = r.log_probs.len();
    match rule {
        ExitRule::Pass(pass) => pass.min(Pass::last(passes)),
        ExitRule::Gate { threshold: own } => {
            let lambdas: Vec<f32> = r.lambdas.iter().map(|l| l[t]).collect();
            exit_gate::threshold_exit(&lambdas, own.unwrap_or(threshold))
        }
        ExitRule::Confidence { min_probability } => (0..passes - 1)
            .find(|&p| top_probability(&r.log_probs[p][t]) >= min_probability)
            .map_or(Pass::last(passes), Pass::from_index),
    }
}

/// Running sums of one rule's score.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    nats: f64,
    baseline: f64,
    passes: usize,
    tokens: usize,
}

/// The held-out cross-entropy of each of `rules` over `windows` (token ids; each scores every
/// position but its last), with the baseline's; `threshold` is the run's gate threshold. The
/// forward runs once per window for all the rules.
pub fn held_out_scores(
    model: &LoopedModel,
    rules: &[ExitRule],
    threshold: ExitThreshold,
    windows: &[Vec<u32>],
) -> Result<Vec<HeldOutLoss>> {
    check_scorable(model, rules)?;
    let last = model.passes() - 1;
    let mut sums = vec![Sums::default(); rules.len()];
    for window in windows.iter().filter(|w| w.len() >= 2) {
        let r = readouts(model, window)?;
        for (t, next) in window.iter().skip(1).map(|&n| n as usize).enumerate() {
            let baseline = -f64::from(r.log_probs[last][t][next]);
            for (rule, s) in rules.iter().zip(&mut sums) {
                let stop = stop_at(*rule, threshold, &r, t);
                s.nats -= f64::from(r.log_probs[stop.index()][t][next]);
                s.baseline += baseline;
                s.passes += stop.number();
                s.tokens += 1;
            }
        }
    }
    (sums.into_iter())
        .map(|s| match s.tokens {
            0 => Err(EngineError::Invalid(
                "--held-out: the text gives no window of two tokens to score".into(),
            )),
            n => Ok(HeldOutLoss {
                nats: s.nats / n as f64,
                baseline_nats: s.baseline / n as f64,
                passes_per_token: s.passes as f64 / n as f64,
                tokens: n,
            }),
        })
        .collect()
}

/// Errors where the reference forward cannot score `rules` on `model`: quantized weights
/// (it reads float tensors), or the gate's rule on a model without a gate.
fn check_scorable(model: &LoopedModel, rules: &[ExitRule]) -> Result<()> {
    let weights = model.weight_type();
    if !["f32", "bf16", "f16"].contains(&weights.as_str()) {
        return Err(EngineError::Invalid(format!(
            "--held-out scores exit rules with the reference forward, which reads float \
             weights; this model's are {weights}"
        )));
    }
    let gated = rules.iter().any(|r| matches!(r, ExitRule::Gate { .. }));
    if gated && model.weights.exit_gate.is_none() {
        return Err(EngineError::Invalid(
            "exit:gate reads the checkpoint's exit gate, which this model has not".into(),
        ));
    }
    Ok(())
}

/// [`held_out_scores`] of one rule.
pub fn held_out_loss(
    model: &LoopedModel,
    rule: ExitRule,
    threshold: ExitThreshold,
    windows: &[Vec<u32>],
) -> Result<HeldOutLoss> {
    let mut scores = held_out_scores(model, &[rule], threshold, windows)?;
    scores
        .pop()
        .ok_or_else(|| EngineError::Invalid("no rule scored".into()))
}

/// Windows scored per held-out file, and their most tokens.
const WINDOWS_PER_FILE: usize = 4;
const WINDOW_TOKENS: usize = 256;

/// The held-out text of `files` as windows of token ids: four spread over
/// each file (fewer tokens each where the model's positions are fewer), the whole file where
/// it is shorter.
pub fn held_out_windows(
    files: &[std::path::PathBuf],
    tokenizer: &TextTokenizer,
    positions: usize,
) -> Result<Vec<Vec<u32>>> {
    let len = WINDOW_TOKENS.min(positions);
    let mut windows = Vec::new();
    for (_, text) in crate::train::read_corpus(files)? {
        let stream = tokenizer.encode(&text)?;
        match stream.len() > len {
            true => windows.extend(spread_windows(&stream, WINDOWS_PER_FILE, len)),
            false => windows.push(stream),
        }
    }
    Ok(windows)
}

/// The held-out loss of each of `policies` that exits early (`None` for the others), on
/// `windows`, under the run's gate `threshold`.
pub fn held_out_losses(
    model: &LoopedModel,
    policies: &[PolicyKind],
    threshold: ExitThreshold,
    windows: &[Vec<u32>],
) -> Result<Vec<Option<HeldOutLoss>>> {
    let rule_of = |p: &PolicyKind| match p {
        PolicyKind::Exit { rule, .. } => Some(*rule),
        _ => None,
    };
    let rules: Vec<ExitRule> = policies.iter().filter_map(rule_of).collect();
    let mut scores = held_out_scores(model, &rules, threshold, windows)?.into_iter();
    Ok((policies.iter())
        .map(|p| rule_of(p).and_then(|_| scores.next()))
        .collect())
}
