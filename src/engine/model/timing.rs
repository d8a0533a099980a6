//! Timing the decode step: a baseline token's R one-row steps against one R-row step (the
//! pipeline's ceiling, R · t(1 row) / t(R rows)), the medians of steps of any row count, and
//! the host kernels' prefetch plan, chosen at load by timing each candidate on the model's own
//! steps. The loader calls [`choose_prefetch`]; the harness (`crate::harness`) and `cargo
//! bench` call the rest.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::host::HostBackend;
use super::{ReadoutKind, RowInput, RowSlot, StepBackend, StepRow, step};
use crate::engine::error::Result;
use crate::engine::kernels::prefetch;
use crate::engine::kv_cache::KvCache;
use crate::engine::pass::Pass;

/// Step compute of baseline and of a full pipeline at the same position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct StepTimes {
    /// A baseline step: the mean of one token's R one-row steps (LM head on the last only).
    #[serde(rename = "one_row_us", with = "crate::engine::units::micros")]
    pub one_row: Duration,
    /// One step of R rows, every row read out.
    #[serde(rename = "full_us", with = "crate::engine::units::micros")]
    pub full: Duration,
    /// R: the rows of the full step, and the one-row steps a baseline token takes.
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
pub fn measure_step_times<B: StepBackend>(
    backend: &B,
    pos: usize,
    repeats: usize,
) -> Result<StepTimes> {
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
pub fn median_step_times<B: StepBackend>(
    backend: &B,
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

/// Median compute of each batch of rows at `pos`, over a cache of `pos + 1` positions.
fn median_times<B: StepBackend>(
    backend: &B,
    pos: usize,
    batches: &[Vec<RowSlot>],
    repeats: usize,
) -> Result<Vec<Duration>> {
    median_times_on(&[backend], pos, pos + 1, batches, repeats.into())
}

/// The host kernels' prefetch plan for `backend` (`kernels::prefetch`), timed when the model
/// loads: each candidate's median one-row and R-row step at position 64 (or the model's
/// last), 25 rounds, fewer where that would take more than [`PLAN_TIMING_BUDGET`] (a model of
/// Ouro-1.4B's shape gets only a few). Each round gives every candidate a turn, as a race
/// gives its lanes: a baseline token's R one-row steps (the LM head on the last only), then
/// one R-row step, on one of two KV caches that the candidates' turns alternate between, so
/// that its steps follow its own and find its cache where another's turn left it, as a race's
/// steps do (`median_times_on`). Each cache holds only the positions the steps read (the
/// first tiles of every pass, laid out as in a run's cache of any capacity).
pub fn choose_prefetch(backend: &HostBackend) -> Result<prefetch::Choice> {
    let passes = backend.model().passes();
    let positions = backend.model().config.positions;
    let pos = 64.min(positions.saturating_sub(1));
    let capacity = pos + 1;
    prefetch::choose(backend.kernels().isa(), |plans| {
        let turn = token_and_pipeline(passes, pos);
        let lanes: Vec<HostBackend> = plans.iter().map(|&p| backend.with_prefetch(p)).collect();
        let lanes: Vec<&HostBackend> = lanes.iter().collect();
        let batches: Vec<Vec<RowSlot>> =
            (plans.iter()).flat_map(|_| turn.iter().cloned()).collect();
        let rounds = Rounds {
            most: 25,
            budget: Some(PLAN_TIMING_BUDGET),
        };
        let t = median_times_on(&lanes, pos, capacity, &batches, rounds)?;
        Ok(t.chunks_exact(turn.len())
            .map(|t| step_times(t, passes))
            .map(|times| (times.one_row, times.full))
            .collect())
    })
}

/// How long the prefetch plan's timing may take when a model loads: a model so large that its
/// 25 rounds would take longer streams its weights from DRAM, where the plans differ by far
/// more than the noise of a few rounds, and 25 rounds at Ouro-1.4B's shape made its load many
/// seconds longer.
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
/// dropped. The batches split evenly between the `lanes` (backends of one model), and the lanes
/// take turns on two KV caches of `capacity` positions, as a race's two lanes do (one lane's
/// turn leaves the other's cache to come from memory; with an odd number of lanes, the last's
/// turn leaves the first's cache warm). Two caches, not one a lane: peak memory would grow
/// with the candidates the plans' timing holds at load.
fn median_times_on<B: StepBackend>(
    lanes: &[&B],
    pos: usize,
    capacity: usize,
    batches: &[Vec<RowSlot>],
    rounds: Rounds,
) -> Result<Vec<Duration>> {
    let passes = lanes[0].model().passes();
    let mut caches = (0..lanes.len().min(2))
        .map(|_| {
            let mut cache = KvCache::new(lanes[0].new_store(capacity)?, passes, capacity);
            if pos > 0 {
                for pass in Pass::all(passes) {
                    cache.mark_written(pass, pos - 1);
                }
            }
            Ok(cache)
        })
        .collect::<Result<Vec<_>>>()?;
    let (per_lane, shared) = (batches.len().div_ceil(lanes.len()), caches.len());
    let mut times = vec![Vec::with_capacity(rounds.most); batches.len()];
    let (mut warm_ups, mut repeats) = (2, rounds.most);
    let mut round = 0;
    while round < warm_ups + repeats {
        let started_round = Instant::now();
        for (i, (batch, t)) in batches.iter().zip(&mut times).enumerate() {
            let lane = i / per_lane;
            let (backend, cache) = (lanes[lane], &mut caches[lane % shared]);
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
