//! The bench's bandwidth figures at real size: the read bandwidth probed over the model's own
//! weights around every prompt (`harness::roofline`), and the share of it each prompt's
//! baseline read. Every figure is computed here, once; the CLI formats them.

use super::bench::PromptResult;
use super::report::{BenchReport, Spread};
use super::roofline;
use crate::engine::model::LoopedModel;
use crate::engine::{EngineError, LoadedModel};

/// The read bandwidth over the model's own weights (`harness::roofline`), where the host
/// kernels decode a model whose passes read DRAM; `None` elsewhere (weights in cache, or
/// candle's ops decoding).
pub fn probe(loaded: &LoadedModel) -> Result<Option<f64>, EngineError> {
    if roofline::layer_bytes_per_pass(loaded.model()) < roofline::MEANINGFUL_FROM_BYTES {
        return Ok(None);
    }
    roofline::loaded_weights_read_bytes_per_sec(loaded).transpose()
}

/// The baseline against the machine's read bandwidth. Each prompt's baseline is set against
/// the probes taken either side of it: where the bandwidth moves from minute to minute, one
/// probe at the end measures a different machine from most of the decoding.
#[derive(Debug, Clone)]
pub struct Bandwidth {
    /// Probed before the first prompt and after each, in bytes per second.
    pub probes: Vec<f64>,
    /// The probes' spread.
    pub probed: Spread,
    /// The weight bytes a baseline token reads.
    pub weight_bytes_per_token: u64,
    /// The first policy's baseline over every prompt.
    pub baseline_tokens_per_sec: f64,
    /// What that baseline reads a second: its tokens a second × a token's weight bytes.
    pub baseline_read_bytes_per_sec: f64,
    /// Each prompt's baseline tokens a second × weight bytes a token, over the mean of the
    /// probes either side of it, in prompt order.
    pub shares: Vec<f64>,
    /// The shares' spread.
    pub share: Spread,
}

impl Bandwidth {
    /// From the probes around the prompts (none where the model's passes stay in cache, or
    /// candle's ops decode) and the first policy's baselines: each prompt's in `results`,
    /// and over every prompt in `report`, the bench's figures of the same `results`.
    pub fn of(
        model: &LoopedModel,
        results: &[PromptResult],
        report: &BenchReport,
        probes: Vec<f64>,
    ) -> Option<Self> {
        if probes.len() != results.len() + 1 {
            return None;
        }
        let baseline_tokens_per_sec = report.policies.first()?.figures.baseline_tokens_per_sec;
        let shares: Vec<f64> = (results.iter().zip(probes.windows(2)))
            .filter_map(|(r, around)| {
                let tokens_per_sec = r.policies.first()?.baseline.tokens_per_sec();
                let read_bytes_per_sec = (around[0] + around[1]) / 2.0;
                Some(roofline::bandwidth_share(
                    model,
                    tokens_per_sec,
                    read_bytes_per_sec,
                ))
            })
            .collect();
        let weight_bytes_per_token = roofline::weight_bytes_per_token(model);
        Some(Self {
            probed: Spread::of(&probes),
            share: Spread::of(&shares),
            weight_bytes_per_token,
            baseline_tokens_per_sec,
            baseline_read_bytes_per_sec: weight_bytes_per_token as f64 * baseline_tokens_per_sec,
            probes,
            shares,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn the_spread_takes_the_lower_middle_and_zeros_for_nothing() {
        let s = Spread::of(&[3.0, 1.0, 4.0, 2.0]);
        assert_eq!((s.median, s.low, s.high), (2.0, 1.0, 4.0));
        assert_eq!(Spread::of(&[]), Spread::default());
    }
}
