//! [`DecodeOptions`]: the limits and the sampling rule of one run, which the scheduler
//! obeys and callers set (re-exported as `engine::DecodeOptions`).

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
}

impl DecodeOptions {
    /// Greedy decoding of up to `max_tokens` tokens with a cache of `context` positions.
    pub fn greedy(max_tokens: usize, context: usize) -> Self {
        Self {
            max_tokens,
            context,
            sampling: Sampling::GREEDY,
        }
    }
}
