//! The bench's bandwidth figures at real size: the read bandwidth probed over the model's own
//! weights around every prompt (`harness::roofline`), and the share of it each prompt's
//! baseline read. `bench` calls it between prompts and formats its line and JSON.

use crate::engine::{EngineError, LoadedModel};
use crate::harness::bench::PromptResult;
use crate::harness::report::BenchReport;

/// The read bandwidth over the model's own weights (`harness::roofline`), where the host
/// kernels decode a model whose passes read DRAM; `None` elsewhere (weights in cache, or
/// candle's ops decoding).
pub(super) fn probe_bandwidth(loaded: &LoadedModel) -> Result<Option<f64>, EngineError> {
    use crate::harness::roofline;
    if roofline::layer_bytes_per_pass(loaded.model()) < roofline::MEANINGFUL_FROM_BYTES {
        return Ok(None);
    }
    roofline::loaded_weights_read_bytes_per_sec(loaded).transpose()
}

/// The baseline against the machine's read bandwidth (`harness::roofline`), each figure
/// computed once for the table and the JSON. Each prompt's baseline is set against the
/// probes taken either side of it: where the bandwidth moves from minute to minute, one
/// probe at the end measures a different machine from most of the decoding.
#[derive(Debug, Clone)]
pub(super) struct Bandwidth {
    /// Probed before the first prompt and after each, in bytes per second.
    pub(super) probes: Vec<f64>,
    weight_bytes_per_token: u64,
    baseline_tokens_per_sec: f64,
    /// Each prompt's baseline tokens a second × weight bytes a token, over the mean of the
    /// probes either side of it, in prompt order.
    pub(super) shares: Vec<f64>,
}

impl Bandwidth {
    /// From the probes around the prompts (none where the model's passes stay in cache, or
    /// candle's ops decode) and the first policy's baselines.
    pub(super) fn of(
        model: &crate::engine::model::LoopedModel,
        (results, report): (&[PromptResult], &BenchReport),
        probes: Vec<f64>,
    ) -> Option<Self> {
        use crate::harness::roofline;
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
        Some(Self {
            weight_bytes_per_token: roofline::weight_bytes_per_token(model),
            baseline_tokens_per_sec,
            probes,
            shares,
        })
    }

    /// The median, lowest and highest of `values` (the lower of the middle two for an even
    /// count); zeros where there are none.
    pub(super) fn median_low_high(values: &[f64]) -> (f64, f64, f64) {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = |i: usize| sorted.get(i).copied().unwrap_or(0.0);
        let last = sorted.len().saturating_sub(1);
        (at(last / 2), at(0), at(last))
    }
}

/// The line under the table at real size: the bandwidth probed, a baseline token's weight
/// bytes, and the share of the bandwidth the baseline read around each prompt.
pub(super) fn print_bandwidth(bandwidth: Option<&Bandwidth>) {
    let Some(b) = bandwidth else {
        return;
    };
    let gb = |bytes_per_sec: f64| bytes_per_sec / 1e9;
    let (_, low, high) = Bandwidth::median_low_high(&b.probes);
    let (share, least, most) = Bandwidth::median_low_high(&b.shares);
    let bytes = b.weight_bytes_per_token as f64;
    println!(
        "read bandwidth over the weights {:.1}–{:.1} GB/s, probed around every prompt; a \
         baseline token reads {:.2} GB of weights, so {:.2} tok/s reads {:.1} GB/s; around \
         each prompt the baseline read {:.0} % of the bandwidth (median; {:.0}–{:.0} %)",
        gb(low),
        gb(high),
        bytes / 1e9,
        b.baseline_tokens_per_sec,
        gb(bytes * b.baseline_tokens_per_sec),
        100.0 * share,
        100.0 * least,
        100.0 * most,
    );
}
