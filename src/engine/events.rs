//! The typed, owned events a decoder emits: one per prefill, one per step, one at the end.
//! The CLI (`--json`), the benchmark and the dashboard all consume this one stream.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::kv_cache::PassOccupancy;
use super::pass::Pass;
use super::tokenizer::TextTokenizer;

/// A token id with its text, as shown to people.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Token {
    /// The tokenizer's id.
    pub id: u32,
    /// Its text on its own (partial UTF-8 shows as U+FFFD).
    pub text: String,
}

/// A row's readout: the next-token prediction after its pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The predicted token: the readout's decision.
    pub token: Token,
    /// Its probability under the readout's softmax.
    pub prob: f32,
    /// Logit of the best token minus the runner-up: how near a tie the prediction was.
    pub margin: f32,
    /// The most likely tokens of the readout's softmax, most likely first (the inspector's
    /// and the traces' view of a readout).
    pub top: Vec<Ranked>,
}

/// A token with its probability under a readout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ranked {
    /// The token.
    pub token: Token,
    /// Its probability.
    pub prob: f32,
}

impl Prediction {
    /// How many of the most likely tokens a prediction lists.
    pub const TOP: usize = 5;

    /// The decision `best` with its probability, its margin over the runner-up and the
    /// readout's top tokens, for events. Computed outside the timed region: decoding needs
    /// only its decision.
    pub fn describe(tokenizer: &TextTokenizer, logits: &[f32], best: u32) -> Self {
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(Self::TOP + 1);
        let mut second = f32::NEG_INFINITY;
        for (i, &l) in logits.iter().enumerate() {
            if i != best as usize && l > second {
                second = l;
            }
            if top.len() < Self::TOP || l > top[top.len() - 1].1 {
                let at = top.iter().position(|&(_, t)| l > t).unwrap_or(top.len());
                top.insert(at, (i as u32, l));
                top.truncate(Self::TOP);
            }
        }
        let max = top.first().map_or(0.0, |&(_, l)| l);
        let sum = crate::engine::kernels::sum_exp(logits, max);
        let prob = |l: f32| (l - max).exp() / sum;
        let token = |id: u32| Token {
            id,
            text: tokenizer.token_text(id),
        };
        let chosen = logits[best as usize];
        Prediction {
            token: token(best),
            prob: prob(chosen),
            margin: chosen - second,
            top: (top.into_iter())
                .map(|(id, l)| Ranked {
                    token: token(id),
                    prob: prob(l),
                })
                .collect(),
        }
    }
}

/// One row of a step: the token at `pos` that ran pass `pass`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowEvent {
    /// The token's position.
    pub pos: usize,
    /// The pass the row ran.
    pub pass: Pass,
    /// The token in the row.
    pub token: Token,
    /// Whether the token's id is verified (committed) or still a guess.
    pub verified: bool,
    /// Proposed as a second candidate beside its parent's first (policies `dual`, `loopspec`).
    pub second: bool,
    /// One of two candidates that its parent's readout did not choose: it left the window,
    /// and the `pass` rows it ran are wasted work (no KV entries to free: the chosen one holds
    /// the slot).
    pub dropped: bool,
    /// The row's readout, where one was read out after this pass.
    pub prediction: Option<Prediction>,
    /// Whether the readout asked a second-proposal gate, and if so whether it opened.
    pub gate: Option<bool>,
    /// Whether the prediction was checked against an existing child's guess (the
    /// denominator of the flip rate).
    pub checked_child: bool,
    /// The exit gate's λ after this pass (`engine::exit_gate`), where the model has a gate;
    /// absent from traces recorded before spex evaluated it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_probability: Option<f32>,
}

/// A deeper pass changed the prediction for position `pos` (`engine::pipeline`, "The step").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Flip {
    /// The position whose prediction changed (the row's position + 1).
    pub pos: usize,
    /// The pass whose readout changed it.
    pub pass: Pass,
    /// The guess that was in flight.
    pub old: Token,
    /// The deeper pass's prediction.
    pub new: Token,
}

/// Speculative tokens discarded after a flip, and what that cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Flush {
    /// First and last flushed position (inclusive).
    pub first_pos: usize,
    /// The last flushed position (inclusive).
    pub last_pos: usize,
    /// Rows already computed for the flushed tokens: wasted work.
    pub rows_wasted: usize,
    /// KV entries freed in each pass.
    pub kv_freed_per_pass: Vec<usize>,
}

/// A token that became part of the output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Committed {
    /// The token's position.
    pub pos: usize,
    /// The token.
    pub token: Token,
    /// The pass whose readout proposed the guess that survived (R: no speculation survived).
    pub accepted_depth: Pass,
    /// The guess that survived was a second proposal (a runner-up).
    pub from_second: bool,
    /// The pass Ouro's exit gate stops the token that predicted this one at, under the run's
    /// threshold (`PrefillEvent::exit_threshold`), from that token's λ
    /// (`exit_gate::known_exit`). Reported only: no lossless policy acts on it. Absent
    /// without a gate, for the prefill's token, and in older traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate_exit: Option<Pass>,
    /// Output text this token completes (multi-byte characters can span tokens).
    pub text_delta: String,
}

/// Everything one step did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepEvent {
    /// The step's number, from 1.
    pub step: u64,
    /// The rows it ran, in the order they ran.
    pub rows: Vec<RowEvent>,
    /// The predictions its readouts changed.
    pub flips: Vec<Flip>,
    /// The speculative tokens the flips discarded.
    pub flushes: Vec<Flush>,
    /// The tokens it committed, oldest first.
    pub committed: Vec<Committed>,
    /// Each pass's cache occupancy after the step, pass 1 first.
    pub kv: Vec<PassOccupancy>,
    #[serde(rename = "compute_us", with = "super::units::micros")]
    /// Its compute time: the model's step and any drafting (`compute_us`, in microseconds, in
    /// JSON).
    pub compute: Duration,
}

/// The prompt's prefill: all R passes over the prompt, and the first generated token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillEvent {
    /// The prompt's length, in tokens.
    pub prompt_tokens: usize,
    /// The first generated token, read out after pass R at the prompt's last position.
    pub first: Committed,
    /// Each pass's cache occupancy after the prefill, pass 1 first.
    pub kv: Vec<PassOccupancy>,
    /// Where the exit gate's threshold rule stops a token in this run (the checkpoint's
    /// `early_exit_threshold`, or `--exit-threshold`); absent where the model has no gate,
    /// and in traces recorded before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_threshold: Option<crate::engine::exit_gate::ExitThreshold>,
    #[serde(rename = "compute_us", with = "super::units::micros")]
    /// Its compute time (`compute_us`, in microseconds, in JSON).
    pub compute: Duration,
}

/// Why a run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The output reached the token budget.
    MaxTokens,
    /// The model committed an end-of-text token.
    EndOfText,
    /// The output filled the context.
    ContextFull,
    /// The caller stopped the run.
    Cancelled,
}

/// The end of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinishEvent {
    /// Why it stopped.
    pub reason: FinishReason,
    /// The committed output's ids (the prompt excluded).
    pub tokens: Vec<u32>,
    /// The output decoded as one text.
    pub text: String,
    /// Output text no committed token's `text_delta` carried: where the output ends inside a
    /// multi-byte character, its U+FFFD. A stream of deltas plus this tail ends like `text`.
    pub text_tail: String,
    #[serde(rename = "decode_compute_us", with = "super::units::micros")]
    /// Compute time of the decode steps, prefill excluded (`decode_compute_us`, in
    /// microseconds, in JSON).
    pub decode_compute: Duration,
    /// The decode steps run.
    pub steps: u64,
}

/// One event of a decoder's stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum DecodeEvent {
    /// The prompt's prefill, first.
    Prefill(PrefillEvent),
    /// One decode step.
    Step(StepEvent),
    /// The end of the run, last.
    Finished(FinishEvent),
}
