//! [`DecodeOptions`]: the limits and the sampling rule of one run, which the scheduler
//! obeys and callers set (re-exported as `engine::DecodeOptions`).

use crate::engine::exit_gate::ExitThreshold;
use crate::engine::sampling::Sampling;

/// Limits and the sampling rule of one run.
#[derive(Debug, Clone, Copy)]
pub struct DecodeOptions {
    /// Tokens to generate, the prefill's first token included.
    pub max_tokens: usize,
    /// KV cache capacity in positions (prompt plus output).
    pub context: usize,
    /// Greedy, or seed-coupled sampling (`engine::sampling`).
    pub sampling: Sampling,
    /// Where the exit gate's threshold rule stops a token (`--exit-threshold`); `None`: the
    /// checkpoint's `early_exit_threshold`. Only the lossy `exit:gate` lane acts on it; every
    /// other run only reports it.
    pub exit_threshold: Option<ExitThreshold>,
}

impl DecodeOptions {
    /// The run's gate threshold: its own, else the checkpoint's `checkpoint`.
    pub fn exit_threshold_or(&self, checkpoint: ExitThreshold) -> ExitThreshold {
        self.exit_threshold.unwrap_or(checkpoint)
    }

    /// Greedy decoding of up to `max_tokens` tokens with a cache of `context` positions.
    pub fn greedy(max_tokens: usize, context: usize) -> Self {
        Self {
            max_tokens,
            context,
            sampling: Sampling::GREEDY,
            exit_threshold: None,
        }
    }
}
