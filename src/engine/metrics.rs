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

use std::time::{Duration, Instant};

use serde::Serialize;

use super::decoder::DEFAULT_CONTEXT;
use super::error::Result;
use super::events::DecodeEvent;
use super::kernels::prefetch;
use super::kv_cache::KvCache;
use super::model::host::HostBackend;
use super::model::{Backend, ReadoutKind, RowInput, RowSlot, StepBackend, StepRow, step};
use super::pass::Pass;

/// Counters of one decoding run, updated event by event.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunStats {
    pub passes: usize,
    /// Tokens committed by decode steps (the prefill's first token is not counted).
    pub tokens: usize,
    #[serde(rename = "decode_compute_us", with = "super::units::micros")]
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

/// Step compute of baseline and of a full pipeline at the same position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct StepTimes {
    /// A baseline step: the mean of one token's R one-row steps (LM head on the last only).
    #[serde(rename = "one_row_us", with = "super::units::micros")]
    pub one_row: Duration,
    /// One step of R rows, every row read out.
    #[serde(rename = "full_us", with = "super::units::micros")]
    pub full: Duration,
    pub rows: usize,
}

impl StepTimes {
    /// R · t(1 row) / t(R rows): the speedup with no flips.
    pub fn ceiling(&self) -> f64 {
        self.rows as f64 * self.one_row.as_secs_f64() / self.full.as_secs_f64()
    }
}

/// Step compute at position `pos`: a baseline token's R one-row steps (the LM head only on the
/// last, as baseline decoding does) and one R-row step with every row read out (as SPEED
/// does). Reading out every 1-row step instead would overstate the ceiling: on the shipped
/// model the LM head is a quarter of a step's weights.
pub fn measure_step_times(backend: &Backend, pos: usize, repeats: usize) -> Result<StepTimes> {
    let passes = backend.model().passes();
    let t = median_times(backend, pos, &token_and_pipeline(passes, pos), repeats)?;
    Ok(step_times(&t, passes))
}

/// A baseline token's R one-row steps at `pos` (the LM head only on the last) and one R-row
/// step with every row read out: what [`measure_step_times`] and [`choose_prefetch`] time.
fn token_and_pipeline(passes: usize, pos: usize) -> Vec<Vec<RowSlot>> {
    let slot = |pass: Pass, readout: ReadoutKind| RowSlot {
        pos,
        pass,
        readout,
        second: false,
    };
    let mut batches: Vec<Vec<RowSlot>> = Pass::all(passes)
        .map(|pass| match pass.is_last(passes) {
            true => vec![slot(pass, ReadoutKind::Argmax)],
            false => vec![slot(pass, ReadoutKind::None)],
        })
        .collect();
    batches.push(
        Pass::all(passes)
            .map(|pass| slot(pass, every_readout(pass, passes)))
            .collect(),
    );
    batches
}

/// The mean one-row step and the R-row step from [`token_and_pipeline`]'s medians.
fn step_times(medians: &[Duration], passes: usize) -> StepTimes {
    let token: Duration = medians[..passes].iter().sum();
    StepTimes {
        one_row: token / u32::try_from(passes).unwrap_or(u32::MAX),
        full: medians[passes],
        rows: passes,
    }
}

/// Median compute of a step of each of `row_counts` rows (rows at passes 1, 2, …, all at
/// `pos`, all read out; counts above R add second candidates beside the rows at passes 1,
/// 2, …, as `dual` does). Used by `cargo bench`.
pub fn median_step_times(
    backend: &Backend,
    pos: usize,
    row_counts: &[usize],
    repeats: usize,
) -> Result<Vec<Duration>> {
    let passes = backend.model().passes();
    let slot = |pass: Pass, second: bool| RowSlot {
        pos,
        pass,
        readout: every_readout(pass, passes),
        second,
    };
    let batches: Vec<Vec<RowSlot>> = row_counts
        .iter()
        .map(|&n| {
            let seconds = Pass::all(n.saturating_sub(passes)).map(|pass| slot(pass, true));
            (Pass::all(n.min(passes)).map(|pass| slot(pass, false)))
                .chain(seconds)
                .collect()
        })
        .collect();
    median_times(backend, pos, &batches, repeats)
}

/// A speculative step's readout after `pass`: a greedy commit at pass R, a proposal before.
fn every_readout(pass: Pass, passes: usize) -> ReadoutKind {
    if pass.is_last(passes) {
        ReadoutKind::Argmax
    } else {
        ReadoutKind::Proposal
    }
}

/// Median compute of each batch of rows at `pos`, on the backend the model was loaded with.
fn median_times(
    backend: &Backend,
    pos: usize,
    batches: &[Vec<RowSlot>],
    repeats: usize,
) -> Result<Vec<Duration>> {
    let mut before = |_: usize| {};
    match backend {
        Backend::Host(b) => median_times_on(
            &**b,
            (pos, pos + 1, 1),
            batches,
            repeats.into(),
            &mut before,
        ),
        Backend::Device(b) => median_times_on(
            &**b,
            (pos, pos + 1, 1),
            batches,
            repeats.into(),
            &mut before,
        ),
    }
}

/// Fixes the host kernels' prefetch plan (`kernels::prefetch`), the first time a process loads
/// a host model: each candidate's median one-row and R-row step at position 64 (or the
/// model's last), 25 rounds (about 0.1 s on the default model), fewer where that would take
/// more than [`PLAN_TIMING_BUDGET`] (Ouro-1.4B's shape: 2 rounds of 0.9 s). Each round gives every
/// candidate a turn, as a race gives its lanes: a baseline token's R one-row steps (the LM
/// head on the last only), then one R-row step, over the candidate's own KV cache of the
/// default context, so that its steps follow its own and find its cache laid out as a run's
/// and where the other's turn left it. On an AMD EPYC Zen 4 VM, one-row steps that each read
/// out a proposal over a cache of 65 positions (as timed before) put `l1` within a few
/// percent of `l2` and sometimes chose it, though `l1` ran both lanes of a race slower
/// (`spex bench --prefetch l1|l2`: speculative lane 15–35 %); with a 512-position cache the
/// plans' 4-row steps differ more, as in the race (`prefetch::cheapest` weighs the rest).
pub fn choose_prefetch(backend: &HostBackend) -> Result<&'static prefetch::Choice> {
    let passes = backend.model().passes();
    let positions = backend.model().config.max_position_embeddings;
    let pos = 64.min(positions.saturating_sub(1));
    let capacity = DEFAULT_CONTEXT.clamp(pos + 1, positions.max(pos + 1));
    prefetch::choose_once(passes, |apply| {
        let turn = token_and_pipeline(passes, pos);
        let plans = prefetch::Prefetch::CANDIDATES;
        let batches: Vec<Vec<RowSlot>> =
            (plans.iter()).flat_map(|_| turn.iter().cloned()).collect();
        let mut before = |batch: usize| apply(plans[batch / turn.len()]);
        let lanes = (pos, capacity, plans.len());
        let rounds = Rounds {
            most: 25,
            budget: Some(PLAN_TIMING_BUDGET),
        };
        let t = median_times_on(backend, lanes, &batches, rounds, &mut before)?;
        Ok(t.chunks_exact(turn.len())
            .map(|t| step_times(t, passes))
            .map(|times| (times.one_row, times.full))
            .collect())
    })
}

/// How long the prefetch plan's timing may take when a model loads: a model so large that its
/// 25 rounds would take longer streams its weights from DRAM, where the plans differ by far
/// more than the noise of a few rounds (Ouro-1.4B's shape on an AMD EPYC Zen 4: 4-row steps of
/// 130 ms with `l1` against 101 ms with `l2`), and 25 rounds made its load 22 s longer.
pub const PLAN_TIMING_BUDGET: Duration = Duration::from_secs(2);

/// How many timed rounds: `most`, or as many as fit in `budget` (at least one) after the
/// first warm-up round shows a round's time.
#[derive(Debug, Clone, Copy)]
struct Rounds {
    most: usize,
    budget: Option<Duration>,
}

impl From<usize> for Rounds {
    fn from(most: usize) -> Self {
        Self { most, budget: None }
    }
}

impl Rounds {
    /// Warm-up rounds and timed rounds, given the first warm-up round's time: two warm-ups
    /// and `most` rounds where they fit the budget, else one warm-up and what fits.
    fn plan(self, first_round: Duration) -> (usize, usize) {
        match self.budget {
            Some(budget) if first_round * (self.most as u32 + 2) > budget => {
                let fit = budget.as_secs_f64() / first_round.as_secs_f64().max(1e-9);
                (1, (fit as usize).clamp(1, self.most))
            }
            _ => (2, self.most),
        }
    }
}

/// Median compute of each batch of rows at `pos` (every row's input a token), the batches
/// interleaved so that machine noise hits them alike; the warm-up rounds (`Rounds::plan`) are
/// dropped.
/// `before(i)` runs before batch `i` each time, untimed. The batches split evenly into
/// `lanes` runs with a KV cache of `capacity` positions each, as a race's lanes have (one
/// lane's turn leaves the other's cache to come from memory).
fn median_times_on<B: StepBackend>(
    backend: &B,
    (pos, capacity, lanes): (usize, usize, usize),
    batches: &[Vec<RowSlot>],
    rounds: Rounds,
    before: &mut dyn FnMut(usize),
) -> Result<Vec<Duration>> {
    let passes = backend.model().passes();
    let mut caches = (0..lanes.max(1))
        .map(|_| {
            let mut cache = KvCache::new(backend.new_store(capacity)?, passes, capacity);
            if pos > 0 {
                for pass in Pass::all(passes) {
                    cache.mark_written(pass, pos - 1);
                }
            }
            Ok(cache)
        })
        .collect::<Result<Vec<_>>>()?;
    let per_lane = batches.len().div_ceil(caches.len());
    let mut times = vec![Vec::with_capacity(rounds.most); batches.len()];
    let (mut warm_ups, mut repeats) = (2, rounds.most);
    let mut round = 0;
    while round < warm_ups + repeats {
        let started_round = Instant::now();
        for (i, (batch, t)) in batches.iter().zip(&mut times).enumerate() {
            before(i);
            let cache = &mut caches[i / per_lane];
            let rows = batch
                .iter()
                .map(|&slot| StepRow {
                    slot,
                    input: RowInput::Token(1),
                })
                .collect();
            let started = Instant::now();
            step(backend, rows, cache)?;
            if round >= warm_ups {
                t.push(started.elapsed());
            }
        }
        if round == 0 {
            (warm_ups, repeats) = rounds.plan(started_round.elapsed());
        }
        round += 1;
    }
    Ok(times.iter_mut().map(|t| median(t)).collect())
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}
