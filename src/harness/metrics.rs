//! One definition of every metric for the CLI, the benchmark and the dashboard: run
//! statistics folded from the event stream, the speedup, and the step times that give the
//! pipeline's ceiling.
//!
//! - **Speedup**: the baseline's decode time over a policy's, for the same model, prompt,
//!   device, dtype and number of tokens, prefill excluded, measured in the same process.
//! - **Ceiling**: R · t(1-row step) / t(R-row step), timed on the same model: what the pipeline
//!   would give with no flips (`engine::pipeline`, "The step").
//! - **γ, the mean accepted length**: N·R / (Σ over committed tokens of the depth their
//!   surviving guess was accepted at), LoopSpec's eq. 9; a SPEED token whose guess stood since
//!   pass r counts as accepted at depth r, a restart at depth R. R means every token came from
//!   pass 1.
//! - **Flip rate at pass r**: flips detected at pass r over the readouts at pass r that had a
//!   child.
//! - **Acceptance by source**: the shares of committed tokens that came from the first
//!   proposal, the second, or a full-depth restart.
//! - **Wasted row-slots**: rows computed for tokens later flushed, over all rows computed.
//! - **KV occupancy per pass**: committed and speculative entries against the capacity.

use std::time::Duration;

use serde::Serialize;

use crate::engine::events::DecodeEvent;
use crate::engine::pass::Pass;

/// Counters of one decoding run, updated event by event.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunStats {
    pub passes: usize,
    /// Tokens committed by decode steps (the prefill's first token is not counted).
    pub tokens: usize,
    #[serde(rename = "decode_compute_us", with = "crate::engine::units::micros")]
    pub decode_compute: Duration,
    pub steps: u64,
    /// Rows computed by decode steps.
    pub rows: usize,
    /// Rows computed for tokens later flushed.
    pub rows_wasted: usize,
    /// Flips detected after pass r (index r − 1), commit-time mispredictions at pass R included.
    pub flips_per_pass: Vec<usize>,
    /// Readouts after pass r that were checked against an existing child.
    pub checks_per_pass: Vec<usize>,
    /// Committed tokens by the pass whose proposal survived (index r − 1).
    pub accepted_by_depth: Vec<usize>,
    /// Readouts that asked a second-proposal gate, and those where it opened.
    pub gate_checks: usize,
    pub gate_opens: usize,
    /// Second candidates started (policies `dual`, `loopspec:d2=M`).
    pub second_proposals: usize,
    /// Committed tokens whose surviving guess was a second proposal.
    pub accepted_second: usize,
}

impl RunStats {
    /// Empty counters for a model with `passes` passes.
    pub fn new(passes: usize) -> Self {
        Self {
            passes,
            flips_per_pass: vec![0; passes],
            checks_per_pass: vec![0; passes],
            accepted_by_depth: vec![0; passes],
            ..Self::default()
        }
    }

    /// Folds one event in.
    pub fn record(&mut self, event: &DecodeEvent) {
        let DecodeEvent::Step(step) = event else {
            return;
        };
        // Counters grow to the deepest pass seen, so a stream joined midway cannot index
        // past them.
        let deepest = step
            .rows
            .iter()
            .map(|r| r.pass.number())
            .chain(step.committed.iter().map(|c| c.accepted_depth.number()))
            .max()
            .unwrap_or(0);
        if deepest > self.passes {
            self.passes = deepest;
            for v in [
                &mut self.flips_per_pass,
                &mut self.checks_per_pass,
                &mut self.accepted_by_depth,
            ] {
                v.resize(deepest, 0);
            }
        }
        self.steps += 1;
        self.decode_compute += step.compute;
        self.rows += step.rows.len();
        for row in &step.rows {
            if row.checked_child {
                self.checks_per_pass[row.pass.index()] += 1;
            }
        }
        for flip in &step.flips {
            self.flips_per_pass[flip.pass.index()] += 1;
        }
        self.rows_wasted += step.flushes.iter().map(|f| f.rows_wasted).sum::<usize>();
        self.rows_wasted += step
            .rows
            .iter()
            .filter(|r| r.dropped)
            .map(|r| r.pass.number())
            .sum::<usize>();
        self.gate_checks += step.rows.iter().filter(|r| r.gate.is_some()).count();
        self.gate_opens += step.rows.iter().filter(|r| r.gate == Some(true)).count();
        // A second candidate runs its first pass exactly once, whatever becomes of it.
        self.second_proposals += step
            .rows
            .iter()
            .filter(|r| r.second && r.pass == Pass::FIRST)
            .count();
        for c in &step.committed {
            self.tokens += 1;
            self.accepted_by_depth[c.accepted_depth.index()] += 1;
            self.accepted_second += usize::from(c.from_second);
        }
    }

    /// Adds another run's counters to these (totals over several prompts).
    pub fn add(&mut self, other: &RunStats) {
        self.tokens += other.tokens;
        self.decode_compute += other.decode_compute;
        self.steps += other.steps;
        self.rows += other.rows;
        self.rows_wasted += other.rows_wasted;
        self.gate_checks += other.gate_checks;
        self.gate_opens += other.gate_opens;
        self.second_proposals += other.second_proposals;
        self.accepted_second += other.accepted_second;
        for (into, from) in [
            (&mut self.flips_per_pass, &other.flips_per_pass),
            (&mut self.checks_per_pass, &other.checks_per_pass),
            (&mut self.accepted_by_depth, &other.accepted_by_depth),
        ] {
            if into.len() < from.len() {
                into.resize(from.len(), 0);
            }
            for (a, b) in into.iter_mut().zip(from) {
                *a += b;
            }
        }
        self.passes = self.passes.max(other.passes);
    }

    /// Decode tokens per second of compute.
    pub fn tokens_per_sec(&self) -> f64 {
        let secs = self.decode_compute.as_secs_f64();
        if secs > 0.0 {
            self.tokens as f64 / secs
        } else {
            0.0
        }
    }

    /// Compute per decoded token.
    pub fn time_per_token(&self) -> Option<Duration> {
        (self.tokens > 0).then(|| self.decode_compute / self.tokens as u32)
    }

    /// γ, the mean accepted length: N·R / Σ accepted depth (LoopSpec eq. 9).
    pub fn gamma(&self) -> f64 {
        let depth_sum: usize = self
            .accepted_by_depth
            .iter()
            .enumerate()
            .map(|(i, n)| (i + 1) * n)
            .sum();
        if depth_sum == 0 {
            return 0.0;
        }
        (self.tokens * self.passes) as f64 / depth_sum as f64
    }

    /// Flips at pass `pass` over the readouts there that had a child.
    pub fn flip_rate(&self, pass: Pass) -> f64 {
        let checks = self.checks_per_pass[pass.index()];
        if checks == 0 {
            0.0
        } else {
            self.flips_per_pass[pass.index()] as f64 / checks as f64
        }
    }

    /// The flip rate of every pass, pass 1 first.
    pub fn flip_rates(&self) -> Vec<f64> {
        Pass::all(self.passes).map(|p| self.flip_rate(p)).collect()
    }

    /// Acceptance by source: the shares of committed tokens whose
    /// surviving guess was a first proposal, a second proposal, or none (a full-depth
    /// restart, committed from pass R's own readout).
    pub fn acceptance(&self) -> Acceptance {
        let restart = self.accepted_by_depth.last().copied().unwrap_or(0);
        let share = |n: usize| {
            if self.tokens == 0 {
                0.0
            } else {
                n as f64 / self.tokens as f64
            }
        };
        let first = self.tokens.saturating_sub(restart + self.accepted_second);
        Acceptance {
            first: share(first),
            second: share(self.accepted_second),
            restart: share(restart),
        }
    }

    /// Share of second-proposal gates that opened.
    pub fn gate_open_rate(&self) -> f64 {
        if self.gate_checks == 0 {
            0.0
        } else {
            self.gate_opens as f64 / self.gate_checks as f64
        }
    }

    /// Share of computed rows that were later flushed.
    pub fn wasted_fraction(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.rows_wasted as f64 / self.rows as f64
        }
    }
}

/// Acceptance by source: shares of committed tokens, summing to 1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Acceptance {
    pub first: f64,
    pub second: f64,
    pub restart: f64,
}

/// Baseline time per token over the policy's time per token.
pub fn speedup(baseline: &RunStats, policy: &RunStats) -> f64 {
    match (baseline.time_per_token(), policy.time_per_token()) {
        (Some(b), Some(p)) if !p.is_zero() => b.as_secs_f64() / p.as_secs_f64(),
        _ => 0.0,
    }
}
