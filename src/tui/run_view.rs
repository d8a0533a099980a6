//! The current run as the dashboard shows it: both lanes' text and statistics, the pipeline's
//! columns, the flip log, the KV gauges, and every position's readouts for the inspector,
//! folded from the engine's events by `on_decode`. `App` owns one; `ui` draws it.

use std::collections::{BTreeMap, VecDeque};

use crate::engine::events::{DecodeEvent, FinishReason, StepEvent, Token};
use crate::engine::exit_gate::ExitThreshold;
use crate::engine::kv_cache::PassOccupancy;
use crate::engine::pass::Pass;
use crate::harness::bench::Departure;
use crate::harness::metrics::RunStats;
use crate::harness::metrics::speedup;
use crate::harness::race::Lane;
use crate::harness::report::Figures;

pub use super::inspector::PositionView;

/// Steps of the pipeline view kept in memory (the view shows as many as fit).
const MAX_COLUMNS: usize = 512;
/// Flips kept in the log.
const MAX_FLIPS: usize = 200;

/// How a pipeline cell is drawn.
#[derive(Debug, Clone, PartialEq)]
pub enum CellKind {
    /// The token's id is committed.
    Verified,
    /// The token is a guess still in flight.
    Speculative,
    /// This row's readout changed the prediction for the next position.
    Flipped { old: String, new: String },
    /// The row's work was thrown away by a flush in this step.
    Flushed,
}

/// One token at one pass in one step, or a draft group: the tokens a draft-then-verify
/// policy runs together at one pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    /// The (oldest) token's text.
    pub text: String,
    pub pos: usize,
    pub kind: CellKind,
    /// Tokens at this pass in this step: 1, or a draft group's size.
    pub tokens: usize,
    /// Ouro's exit gate would stop this token here, before pass R: the first pass where its
    /// chance of having exited reaches the run's threshold
    /// (`inspector::PositionView::gate_exit`).
    pub gate_exit: bool,
}

impl Cell {
    /// What the cell says: the token, or for a group its size and its oldest token
    /// (`5×the`); a flipped cell draws its old and new tokens instead.
    pub fn label(&self) -> String {
        match self.tokens {
            1 => self.text.clone(),
            n => format!("{n}×{}", self.text),
        }
    }

    /// Adds another token of a draft group: the cell takes the most telling kind, a
    /// rejection first, then tokens still in flight, then kept ones, then flushed ones.
    fn join(&mut self, kind: CellKind) {
        let rank = |k: &CellKind| match k {
            CellKind::Flipped { .. } => 3,
            CellKind::Speculative => 2,
            CellKind::Verified => 1,
            CellKind::Flushed => 0,
        };
        self.tokens += 1;
        if rank(&kind) > rank(&self.kind) {
            self.kind = kind;
        }
    }
}

/// One step of the SPEED lane: a cell per pass (pass 1 first).
#[derive(Debug, Clone, PartialEq)]
pub struct StepColumn {
    pub step: u64,
    pub cells: Vec<Option<Cell>>,
}

/// A flip with its surroundings, for the log.
#[derive(Debug, Clone, PartialEq)]
pub struct FlipEntry {
    pub step: u64,
    pub pos: usize,
    pub pass: usize,
    pub old: String,
    pub new: String,
    /// The last committed words before the flipped position.
    pub context: String,
}

/// One lane's output and statistics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaneView {
    pub text: String,
    pub tokens: Vec<u32>,
    pub stats: RunStats,
    pub finished: Option<FinishReason>,
    pub scroll: u16,
}

/// Whether the lanes agree so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agreement {
    /// Identical over the first `n` tokens both lanes have.
    Same(usize),
    /// They first differ at this output index.
    Differ(usize),
    /// Not compared: under sampling a policy that verifies by rejection (LoopSpec) draws
    /// its own sample of the baseline's distribution.
    SameDistribution,
    /// A lossy early exit: how far its text kept to the baseline's over the tokens both
    /// lanes have.
    Lossy(Departure),
}

/// Everything about the current run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunView {
    pub prompt: String,
    pub speculative: LaneView,
    pub baseline: LaneView,
    pub columns: VecDeque<StepColumn>,
    pub flips: VecDeque<FlipEntry>,
    pub kv: Vec<PassOccupancy>,
    pub speedup_history: VecDeque<f64>,
    /// R · t(1 row) / t(R rows), measured when the race started.
    pub ceiling: Option<f64>,
    /// The position of the first output token (the prompt's length).
    pub first_pos: usize,
    /// Every position's readouts, flips and commit in the speculative lane (the inspector).
    pub positions: BTreeMap<usize, PositionView>,
    /// Where the exit gate stops a token in this run; `None` without a gate.
    pub exit_threshold: Option<ExitThreshold>,
    pub done: bool,
}

impl RunView {
    fn lane_mut(&mut self, lane: Lane) -> &mut LaneView {
        match lane {
            Lane::Speculative => &mut self.speculative,
            Lane::Baseline => &mut self.baseline,
        }
    }

    /// Baseline time per token over SPEED time per token, as `spex bench` computes it.
    pub fn speedup(&self) -> Option<f64> {
        let s = speedup(&self.baseline.stats, &self.speculative.stats);
        (s > 0.0).then_some(s)
    }

    /// The run's figures so far, computed as `spex bench` computes its own.
    pub fn figures(&self) -> Figures {
        Figures::of(&self.baseline.stats, &self.speculative.stats)
    }

    /// A lossy lane's departure from the baseline over the tokens both lanes have committed.
    pub fn departure(&self) -> Departure {
        let (a, b) = (&self.speculative.tokens, &self.baseline.tokens);
        let both = a.len().min(b.len());
        Departure::of(&b[..both], &a[..both])
    }

    /// The identical-output check over the tokens both lanes have committed.
    pub fn agreement(&self) -> Agreement {
        let d = self.departure();
        match d.departs_at {
            Some(i) => Agreement::Differ(i),
            None => Agreement::Same(d.of),
        }
    }
}

pub(super) fn on_decode(run: &mut RunView, lane: Lane, event: &DecodeEvent) {
    match event {
        DecodeEvent::Prefill(p) => {
            let view = run.lane_mut(lane);
            view.stats = RunStats::new(p.kv.len());
            view.tokens.push(p.first.token.id);
            view.text.push_str(&p.first.text_delta);
            if lane == Lane::Speculative {
                run.kv.clone_from(&p.kv);
                run.first_pos = p.first.pos;
                run.exit_threshold = p.exit_threshold;
            }
        }
        DecodeEvent::Step(step) => {
            let view = run.lane_mut(lane);
            view.stats.record(event);
            for c in &step.committed {
                view.tokens.push(c.token.id);
                view.text.push_str(&c.text_delta);
            }
            if lane == Lane::Speculative {
                super::inspector::record(&mut run.positions, step, run.kv.len());
                record_pipeline(run, step);
            }
        }
        DecodeEvent::Finished(f) => {
            let view = run.lane_mut(lane);
            view.text.push_str(&f.text_tail);
            view.finished = Some(f.reason);
        }
    }
}

/// Adds the SPEED step to the pipeline view, the flip log and the KV gauges.
fn record_pipeline(run: &mut RunView, step: &StepEvent) {
    let passes = run
        .kv
        .len()
        .max(step.rows.iter().map(|r| r.pass.number()).max().unwrap_or(1));
    if run.columns.len() == MAX_COLUMNS {
        run.columns.pop_front();
    }
    let mut cells = step_cells(step, passes);
    if let Some(threshold) = run.exit_threshold {
        for (index, cell) in cells.iter_mut().enumerate() {
            if let Some(cell) = cell.as_mut().filter(|c| c.tokens == 1) {
                let view = run.positions.get(&(cell.pos + 1));
                let stop = view.and_then(|v| v.gate_exit(threshold));
                let early = stop.filter(|p| !p.is_last(passes));
                cell.gate_exit = early == Some(Pass::from_index(index));
            }
        }
    }
    run.columns.push_back(StepColumn {
        step: step.step,
        cells,
    });
    record_flips(run, step);
    run.kv.clone_from(&step.kv);
}

/// One cell per pass for a step's column: the row's token, coloured by what became of it.
fn step_cells(step: &StepEvent, passes: usize) -> Vec<Option<Cell>> {
    let mut cells: Vec<Option<Cell>> = vec![None; passes];
    let flushed_from = step.flushes.iter().map(|f| f.first_pos).min();
    for row in &step.rows {
        let flip = step
            .flips
            .iter()
            .find(|f| f.pos == row.pos + 1 && f.pass == row.pass);
        let kind = match (flip, flushed_from) {
            (Some(f), _) => CellKind::Flipped {
                old: shown(&f.old),
                new: shown(&f.new),
            },
            (None, Some(first)) if row.pos >= first => CellKind::Flushed,
            // A candidate its parent did not choose: its work is thrown away too.
            _ if row.dropped => CellKind::Flushed,
            _ if row.verified => CellKind::Verified,
            _ => CellKind::Speculative,
        };
        let text = shown(&row.token);
        match &mut cells[row.pass.index()] {
            // Two candidates for one position (a second proposal): the cell shows both, the one
            // dropped after the bar, and takes the kind of the one kept.
            Some(cell) if cell.pos == row.pos => {
                if row.dropped {
                    cell.text = format!("{}|{text}", cell.text);
                } else {
                    cell.text = format!("{text}|{}", cell.text);
                    cell.kind = kind;
                }
            }
            // Another token at this pass: a draft group verifying together.
            Some(cell) => cell.join(kind),
            slot => {
                *slot = Some(Cell {
                    text,
                    pos: row.pos,
                    kind,
                    tokens: 1,
                    gate_exit: false,
                })
            }
        }
    }
    cells
}

/// Appends a step's flips to the flip log, each with the last words of the text before it.
fn record_flips(run: &mut RunView, step: &StepEvent) {
    for f in &step.flips {
        // From the end: the text can be long, and a replay folds every flip of it.
        let context: String = {
            let mut words: Vec<&str> = run
                .speculative
                .text
                .split_whitespace()
                .rev()
                .take(4)
                .collect();
            words.reverse();
            words.join(" ")
        };
        if run.flips.len() == MAX_FLIPS {
            run.flips.pop_front();
        }
        run.flips.push_back(FlipEntry {
            step: step.step,
            pos: f.pos,
            pass: f.pass.number(),
            old: shown(&f.old),
            new: shown(&f.new),
            context,
        });
    }
}

/// A token's text for display; tokens with no text of their own (ids past the tokenizer's
/// vocabulary, or lone bytes of a multi-byte character) show their id.
fn shown(token: &Token) -> String {
    if token.text.is_empty() || token.text == "\u{FFFD}" {
        format!("#{}", token.id)
    } else {
        token.text.clone()
    }
}
