//! The bench's figures, each computed once from the run statistics (`metrics`): one
//! [`Figures`] per comparison of a policy with its baseline, gathered per prompt and per
//! policy over every prompt into a [`BenchReport`]. `spex bench`'s table and its `--json`
//! only format this value; the dashboard's stats panel reads [`Figures`] too.

use serde::Serialize;

use super::bench::{Comparison, Departure, PolicyResult, PromptResult};
use super::metrics::{Acceptance, RunStats, speedup};
use crate::engine::model::timing::StepTimes;
use crate::engine::policy::PolicyKind;

/// What one policy's run shows against the baseline's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figures {
    pub baseline_tokens_per_sec: f64,
    pub tokens_per_sec: f64,
    /// Baseline decode time / policy decode time.
    pub speedup: f64,
    /// Mean accepted length (R at best).
    pub gamma: f64,
    pub acceptance: Acceptance,
    /// How often a gate opened for a second proposal; `None` for a policy without one.
    pub gate_open_rate: Option<f64>,
    #[serde(rename = "flip_rate_per_pass")]
    pub flip_rates: Vec<f64>,
    /// Rows computed for tokens later flushed, of all rows.
    #[serde(rename = "wasted_row_slots")]
    pub wasted: f64,
    pub second_proposals: usize,
    pub accepted_second: usize,
}

impl Figures {
    /// The figures of `policy` against `baseline`, run side by side.
    pub fn of(baseline: &RunStats, policy: &RunStats) -> Self {
        Self {
            baseline_tokens_per_sec: baseline.tokens_per_sec(),
            tokens_per_sec: policy.tokens_per_sec(),
            speedup: speedup(baseline, policy),
            gamma: policy.gamma(),
            acceptance: policy.acceptance(),
            gate_open_rate: (policy.gate_checks > 0).then(|| policy.gate_open_rate()),
            flip_rates: policy.flip_rates(),
            wasted: policy.wasted_fraction(),
            second_proposals: policy.second_proposals,
            accepted_second: policy.accepted_second,
        }
    }

    /// The lowest and highest flip rate of the passes after the first, where every one of
    /// them is at least [`NEARLY_ALL_FLIPS`]: then almost no guess survives to be committed
    /// (random weights do this: each pass's prediction is nearly independent of the last),
    /// so the speedup shows flushes, and the ceiling is the figure a run can show. `None`
    /// otherwise, and for a model of one pass.
    pub fn nearly_all_flipped(&self) -> Option<(f64, f64)> {
        let deeper = self.flip_rates.get(1..).filter(|r| !r.is_empty())?;
        let low = deeper.iter().copied().fold(f64::INFINITY, f64::min);
        let high = deeper.iter().copied().fold(0.0, f64::max);
        (low >= NEARLY_ALL_FLIPS).then_some((low, high))
    }
}

/// The flip rate from which [`Figures::nearly_all_flipped`] calls a pass's predictions
/// nearly all flipped. The shipped model's deeper passes flip only a small share of theirs
/// (`spex bench --max-tokens 64`).
pub const NEARLY_ALL_FLIPS: f64 = 0.9;

/// One policy on one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct PromptPolicy {
    pub policy: PolicyKind,
    pub comparison: Comparison,
    /// The shown (median) run's statistics, the baseline's beside them.
    pub baseline: RunStats,
    pub stats: RunStats,
    #[serde(flatten)]
    pub figures: Figures,
    /// Every run's speedup, in run order.
    pub run_speedups: Vec<f64>,
}

/// Every policy on one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct PromptReport {
    pub prompt: String,
    pub ceiling: f64,
    pub step_times: StepTimes,
    pub policies: Vec<PromptPolicy>,
}

impl PromptReport {
    /// The figures of one prompt's bench.
    pub fn of(r: &PromptResult) -> Self {
        let policies = (r.policies.iter())
            .map(|p| PromptPolicy {
                policy: p.lane.policy,
                comparison: p.comparison,
                baseline: p.baseline.clone(),
                stats: p.lane.stats.clone(),
                figures: Figures::of(&p.baseline, &p.lane.stats),
                run_speedups: p.runs.iter().map(|(b, s)| speedup(b, s)).collect(),
            })
            .collect();
        Self {
            prompt: r.prompt.clone(),
            ceiling: r.step_times.ceiling(),
            step_times: r.step_times,
            policies,
        }
    }
}

/// The median, lowest and highest of a set of figures.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Spread {
    /// The lower of the middle two for an even count.
    pub median: f64,
    /// The lowest.
    pub low: f64,
    /// The highest.
    pub high: f64,
}

impl Spread {
    /// The spread of `values`; zeros where there are none.
    pub fn of(values: &[f64]) -> Self {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = |i: usize| sorted.get(i).copied().unwrap_or(0.0);
        let last = sorted.len().saturating_sub(1);
        Self {
            median: at(last / 2),
            low: at(0),
            high: at(last),
        }
    }
}

/// One policy summed over every prompt's shown (median) run.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    pub policy: String,
    #[serde(flatten)]
    pub figures: Figures,
    /// The overall speedup of each run (every prompt's k-th run together), sorted.
    pub run_speedups: Vec<f64>,
    /// Their spread.
    pub run_speedup_spread: Spread,
    /// Prompts whose text differs from the baseline's where it must not.
    pub mismatches: usize,
    /// Prompts whose text is compared (all but same-distribution ones).
    pub compared: usize,
    /// Compared on every prompt, and identical on every one.
    pub identical: bool,
    /// Its text is its own sample of the baseline's distribution, not compared.
    pub same_distribution: bool,
    /// What a lossy lane lost against the baseline; `None` for the lossless ones.
    pub lossy: Option<Loss>,
}

/// What a lossy lane (`policy::exit`) lost against the baseline, over every prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Loss {
    /// The share of the baseline's output tokens it has at the same index.
    pub agreement: f64,
    /// Each prompt's first output index where its text departs (`None`: it did not).
    pub departs_at: Vec<Option<usize>>,
    /// Passes run per committed token (R for the baseline).
    pub passes_per_token: f64,
    /// Its rule's cross-entropy on held-out text beside the baseline's, where the bench was
    /// given some (`harness::exit_loss`).
    pub held_out: Option<crate::harness::exit_loss::HeldOutLoss>,
}

impl Loss {
    /// The loss of the lanes `lanes`, whose statistics summed are `stats`; `None` unless
    /// they are lossy.
    fn of(lanes: &[&PolicyResult], stats: &RunStats) -> Option<Self> {
        let departures: Vec<Departure> = (lanes.iter())
            .filter_map(|p| match p.comparison {
                Comparison::Lossy(d) => Some(d),
                _ => None,
            })
            .collect();
        if departures.is_empty() {
            return None;
        }
        let (agreeing, of) =
            (departures.iter()).fold((0, 0), |(a, o), d| (a + d.agreeing, o + d.of));
        Some(Self {
            agreement: agreeing as f64 / of.max(1) as f64,
            departs_at: departures.iter().map(|d| d.departs_at).collect(),
            passes_per_token: stats.rows as f64 / stats.tokens.max(1) as f64,
            held_out: None,
        })
    }

    /// The prompts whose text departed from the baseline's.
    pub fn departed(&self) -> usize {
        self.departs_at.iter().flatten().count()
    }
}

/// The whole bench: every prompt, and every policy over all of them.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub prompts: Vec<PromptReport>,
    pub policies: Vec<PolicyReport>,
    /// The prompts' mean ceiling.
    pub ceiling: f64,
}

impl BenchReport {
    /// The figures of a bench whose prompts gave `results`, on a model of `passes` passes.
    pub fn of(results: &[PromptResult], passes: usize) -> Self {
        let count = results.first().map_or(0, |r| r.policies.len());
        let policies = (0..count)
            .map(|k| {
                let lanes: Vec<&PolicyResult> = results.iter().map(|r| &r.policies[k]).collect();
                let (baseline, stats) =
                    summed(lanes.iter().map(|p| (&p.baseline, &p.lane.stats)), passes);
                let mismatches = lanes.iter().filter(|p| p.is_mismatch()).count();
                let compared = (lanes.iter())
                    .filter(|p| p.comparison != Comparison::SameDistribution)
                    .count();
                let run_speedups = run_speedups(&lanes, passes);
                let lossy = Loss::of(&lanes, &stats);
                PolicyReport {
                    policy: lanes[0].lane.policy.to_string(),
                    figures: Figures::of(&baseline, &stats),
                    run_speedup_spread: Spread::of(&run_speedups),
                    run_speedups,
                    mismatches,
                    compared,
                    identical: mismatches == 0 && compared == results.len() && lossy.is_none(),
                    same_distribution: compared < results.len(),
                    lossy,
                }
            })
            .collect();
        let ceilings = results.iter().map(|r| r.step_times.ceiling());
        Self {
            prompts: results.iter().map(PromptReport::of).collect(),
            policies,
            ceiling: ceilings.sum::<f64>() / results.len().max(1) as f64,
        }
    }

    /// The policies whose text differs from the baseline's where it must not.
    pub fn failed(&self) -> Vec<&str> {
        (self.policies.iter())
            .filter(|p| p.mismatches > 0)
            .map(|p| p.policy.as_str())
            .collect()
    }
}

/// Baseline and policy statistics summed over prompts.
fn summed<'a>(
    pairs: impl Iterator<Item = (&'a RunStats, &'a RunStats)>,
    passes: usize,
) -> (RunStats, RunStats) {
    let (mut base, mut policy) = (RunStats::new(passes), RunStats::new(passes));
    for (b, s) in pairs {
        base.add(b);
        policy.add(s);
    }
    (base, policy)
}

/// The overall speedup of each run (every prompt's k-th run together), sorted.
fn run_speedups(lanes: &[&PolicyResult], passes: usize) -> Vec<f64> {
    let runs = lanes.iter().map(|p| p.runs.len()).min().unwrap_or(0);
    let mut speedups: Vec<f64> = (0..runs)
        .map(|k| {
            let (base, policy) = summed(lanes.iter().map(|p| (&p.runs[k].0, &p.runs[k].1)), passes);
            speedup(&base, &policy)
        })
        .collect();
    speedups.sort_by(f64::total_cmp);
    speedups
}

/// The process's peak resident memory in bytes (Linux `VmHWM`), if known.
pub fn peak_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flipping(flip_rates: &[f64]) -> Option<(f64, f64)> {
        let figures = Figures {
            flip_rates: flip_rates.to_vec(),
            ..Figures::of(&RunStats::default(), &RunStats::default())
        };
        figures.nearly_all_flipped()
    }

    #[test]
    fn nearly_all_flipped_needs_every_pass_after_the_first() {
        assert_eq!(flipping(&[0.0, 0.98, 1.0, 0.92]), Some((0.92, 1.0)));
        assert_eq!(flipping(&[0.0, 0.9]), Some((0.9, 0.9)));
        assert_eq!(flipping(&[0.0, 0.99, 0.5, 0.99]), None);
        assert_eq!(flipping(&[0.0, 0.05, 0.01, 0.02]), None);
        assert_eq!(flipping(&[0.0]), None);
        assert_eq!(flipping(&[]), None);
    }
}
