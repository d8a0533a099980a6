//! The typed, owned events a decoder emits: one per prefill, one per step, one at the end.
//! The CLI (`--json`), the benchmark and the dashboard all consume this one stream.

use std::time::Duration;

use serde::Serialize;

use super::kv_cache::PassOccupancy;
use super::pass::Pass;
use super::tokenizer::TextTokenizer;

/// A token id with its text, as shown to people.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Token {
    pub id: u32,
    pub text: String,
}

/// A row's readout: the next-token prediction after its pass.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    pub token: Token,
    pub prob: f32,
    /// Logit of the best token minus the runner-up: how near a tie the prediction was.
    pub margin: f32,
}

impl Prediction {
    /// The decision `best` with its probability and its margin over the runner-up, for events.
    /// Computed outside the timed region: decoding needs only the argmax.
    pub fn describe(tokenizer: &TextTokenizer, logits: &[f32], best: u32) -> Self {
        let top = logits[best as usize];
        let mut second = f32::NEG_INFINITY;
        let mut sum = 0f32;
        for (i, &l) in logits.iter().enumerate() {
            sum += (l - top).exp();
            if i != best as usize && l > second {
                second = l;
            }
        }
        Prediction {
            token: Token {
                id: best,
                text: tokenizer.token_text(best),
            },
            prob: 1.0 / sum,
            margin: top - second,
        }
    }
}

/// One row of a step: the token at `pos` that ran pass `pass`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RowEvent {
    pub pos: usize,
    pub pass: Pass,
    pub token: Token,
    /// Whether the token's id is verified (committed) or still a guess.
    pub verified: bool,
    /// Proposed as a second candidate beside its parent's first (policies `dual`, `loopspec`).
    pub second: bool,
    /// One of two candidates that its parent's readout did not choose: it left the window,
    /// and the `pass` rows it ran are wasted work (no KV entries to free: the chosen one holds
    /// the slot).
    pub dropped: bool,
    pub prediction: Option<Prediction>,
    /// Whether the readout asked a second-proposal gate, and if so whether it opened.
    pub gate: Option<bool>,
    /// Whether the prediction was checked against an existing child's guess (the
    /// denominator of the flip rate).
    pub checked_child: bool,
}

/// A deeper pass changed the prediction for position `pos` (speculation.md §3).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Flip {
    pub pos: usize,
    pub pass: Pass,
    pub old: Token,
    pub new: Token,
}

/// Speculative tokens discarded after a flip, and what that cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Flush {
    /// First and last flushed position (inclusive).
    pub first_pos: usize,
    pub last_pos: usize,
    /// Rows already computed for the flushed tokens: wasted work.
    pub rows_wasted: usize,
    /// KV entries freed in each pass.
    pub kv_freed_per_pass: Vec<usize>,
}

/// A token that became part of the output.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Committed {
    pub pos: usize,
    pub token: Token,
    /// The pass whose readout proposed the guess that survived (R: no speculation survived).
    pub accepted_depth: Pass,
    /// The guess that survived was a second proposal (a runner-up).
    pub from_second: bool,
    /// Output text this token completes (multi-byte characters can span tokens).
    pub text_delta: String,
}

/// Everything one step did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepEvent {
    pub step: u64,
    pub rows: Vec<RowEvent>,
    pub flips: Vec<Flip>,
    pub flushes: Vec<Flush>,
    pub committed: Vec<Committed>,
    pub kv: Vec<PassOccupancy>,
    #[serde(rename = "compute_us", serialize_with = "micros")]
    pub compute: Duration,
}

/// The prompt's prefill: all R passes over the prompt, and the first generated token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefillEvent {
    pub prompt_tokens: usize,
    pub first: Committed,
    pub kv: Vec<PassOccupancy>,
    #[serde(rename = "compute_us", serialize_with = "micros")]
    pub compute: Duration,
}

/// Why a run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    MaxTokens,
    EndOfText,
    ContextFull,
    Cancelled,
}

/// The end of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FinishEvent {
    pub reason: FinishReason,
    pub tokens: Vec<u32>,
    pub text: String,
    /// Output text no committed token's `text_delta` carried: where the output ends inside a
    /// multi-byte character, its U+FFFD. A stream of deltas plus this tail ends like `text`.
    pub text_tail: String,
    #[serde(rename = "decode_compute_us", serialize_with = "micros")]
    pub decode_compute: Duration,
    pub steps: u64,
}

/// One event of a decoder's stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum DecodeEvent {
    Prefill(PrefillEvent),
    Step(StepEvent),
    Finished(FinishEvent),
}

/// Serialises a duration as whole microseconds (the `*_us` fields of events and stats).
pub(crate) fn micros<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_micros() as u64)
}
