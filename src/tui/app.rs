//! The dashboard's state and its one update function. Terminal input and engine events arrive
//! as [`Msg`]s; [`App::update`] folds them into state and returns [`Command`]s for the runtime
//! (start a race, steer it, quit). Rendering (`ui`) reads this state and nothing else.

use std::collections::VecDeque;

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, MouseEvent, MouseEventKind};

use super::keymap::{self, Action, Mode};

use crate::engine::events::{DecodeEvent, FinishReason, StepEvent, Token};
use crate::engine::kv_cache::PassOccupancy;
use crate::engine::metrics::RunStats;
use crate::engine::metrics::speedup;
use crate::engine::policy::PolicyKind;
use crate::engine::race::{Lane, RaceControl, RaceEvent};
use crate::engine::rng::SplitMix;
use crate::engine::sampling::Sampling;

/// The temperatures `t` and `T` step through (0 is greedy).
pub const TEMPERATURES: [f32; 8] = [0.0, 0.3, 0.5, 0.7, 0.8, 1.0, 1.2, 1.5];
/// Steps of the pipeline view kept in memory (the view shows as many as fit).
const MAX_COLUMNS: usize = 512;
/// Flips kept in the log.
const MAX_FLIPS: usize = 200;
/// Points of the speedup sparkline.
const MAX_HISTORY: usize = 400;
/// Selectable SPEED steps per second; `None` is flat out.
pub const RATES: [Option<f64>; 9] = [
    Some(1.0),
    Some(2.0),
    Some(5.0),
    Some(10.0),
    Some(20.0),
    Some(50.0),
    Some(100.0),
    Some(200.0),
    None,
];

/// Input to [`App::update`].
#[derive(Debug, Clone)]
pub enum Msg {
    Key(KeyEvent),
    Mouse(MouseEvent),
    Resize(u16, u16),
    /// Every engine event that arrived since the last frame.
    Engine(Vec<RaceEvent>),
    /// Something the runtime could not do (write a trace): the error line says it.
    Failed(String),
    /// A replay's frame: its events (after starting the run afresh, if `reset`) and where
    /// the replay now stands.
    Replay {
        reset: bool,
        events: Vec<RaceEvent>,
        status: ReplayStatus,
    },
}

/// Where a replay stands: the footer shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayStatus {
    /// The trace file's name.
    pub file: String,
    /// Steps of the speculative lane shown so far, of `steps`.
    pub step: usize,
    pub steps: usize,
}

/// A move through a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seek {
    Back,
    Start,
    End,
}

/// What the runtime must do after an update.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// The sampling rule for the races started from now on.
    SetSampling(Sampling),
    StartRace {
        prompt: String,
    },
    Control(RaceControl),
    /// Replay only: move through the trace.
    Seek(Seek),
    /// Record the current and later runs to traces (true), or stop (false).
    Record(bool),
    Quit,
}

/// Which pane the keys scroll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Focus {
    Prompt,
    Speculative,
    Baseline,
    Flips,
}

impl Focus {
    fn next(self) -> Self {
        match self {
            Self::Prompt => Self::Speculative,
            Self::Speculative => Self::Baseline,
            Self::Baseline => Self::Flips,
            Self::Flips => Self::Prompt,
        }
    }
}

/// What the footer says about the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelInfo {
    pub name: String,
    pub passes: usize,
    pub layers: usize,
    pub device: String,
    pub dtype: String,
    pub policy: PolicyKind,
}

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

/// One token at one pass in one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    pub text: String,
    pub pos: usize,
    pub kind: CellKind,
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

    /// The identical-output check over the tokens both lanes have committed.
    pub fn agreement(&self) -> Agreement {
        let (a, b) = (&self.speculative.tokens, &self.baseline.tokens);
        match a.iter().zip(b).position(|(x, y)| x != y) {
            Some(i) => Agreement::Differ(i),
            None => Agreement::Same(a.len().min(b.len())),
        }
    }
}

/// The dashboard's whole state.
#[derive(Debug, Clone, PartialEq)]
pub struct App {
    pub info: ModelInfo,
    pub prompt: String,
    /// Cursor position in `prompt`, in characters.
    pub cursor: usize,
    pub focus: Focus,
    pub run: Option<RunView>,
    pub paused: bool,
    pub rate_index: usize,
    pub show_help: bool,
    pub size: (u16, u16),
    pub error: Option<String>,
    pub should_quit: bool,
    /// How the next run chooses tokens (`t`/`T` change the temperature, `s` the seed).
    pub sampling: Sampling,
    /// Set when the dashboard replays a trace instead of running the model.
    pub replay: Option<ReplayStatus>,
    /// Whether runs are being recorded to traces.
    pub recording: bool,
}

impl App {
    /// Whether the lanes' texts must agree token for token (greedy, or a policy that
    /// commits the baseline's seed-coupled sample), and if so whether they do.
    pub fn agreement(&self, run: &RunView) -> Agreement {
        if self.sampling.is_greedy() || self.info.policy.build().keeps_baseline_sample() {
            run.agreement()
        } else {
            Agreement::SameDistribution
        }
    }

    /// A fresh dashboard; with a prompt given, the first command starts it at once.
    pub fn new(info: ModelInfo, prompt: Option<String>, size: (u16, u16)) -> Self {
        Self {
            info,
            cursor: prompt.as_deref().map_or(0, |p| p.chars().count()),
            prompt: prompt.unwrap_or_default(),
            focus: Focus::Prompt,
            run: None,
            paused: false,
            rate_index: RATES.len() - 1,
            show_help: false,
            size,
            error: None,
            should_quit: false,
            sampling: Sampling::GREEDY,
            replay: None,
            recording: false,
        }
    }

    /// Steps per second of the SPEED lane, `None` when flat out.
    pub fn rate(&self) -> Option<f64> {
        RATES[self.rate_index]
    }

    /// Folds one message into the state.
    pub fn update(&mut self, msg: Msg) -> Vec<Command> {
        match msg {
            Msg::Key(key) if key.kind != KeyEventKind::Release => self.on_key(key),
            Msg::Key(_) => Vec::new(),
            Msg::Mouse(mouse) => {
                match mouse.kind {
                    MouseEventKind::ScrollUp => self.scroll(-3),
                    MouseEventKind::ScrollDown => self.scroll(3),
                    _ => {}
                }
                Vec::new()
            }
            Msg::Resize(w, h) => {
                self.size = (w, h);
                Vec::new()
            }
            Msg::Engine(events) => {
                for event in events {
                    self.on_engine(event);
                }
                Vec::new()
            }
            Msg::Failed(message) => {
                self.error = Some(message);
                Vec::new()
            }
            Msg::Replay {
                reset,
                events,
                status,
            } => {
                if reset || self.run.is_none() {
                    self.run = Some(RunView {
                        prompt: self.prompt.clone(),
                        ..RunView::default()
                    });
                }
                for event in events {
                    self.on_engine(event);
                }
                self.replay = Some(status);
                Vec::new()
            }
        }
    }

    /// Starts a run of the prompt being edited (an empty one is an error line, not a run).
    pub fn start(&mut self) -> Vec<Command> {
        if self.prompt.trim().is_empty() {
            self.error = Some("prompt: empty: type some text, then Enter".into());
            return Vec::new();
        }
        self.error = None;
        self.paused = false;
        self.run = Some(RunView {
            prompt: self.prompt.clone(),
            ..RunView::default()
        });
        self.focus = Focus::Speculative;
        vec![
            Command::StartRace {
                prompt: self.prompt.clone(),
            },
            Command::Control(RaceControl::Rate(self.rate())),
        ]
    }

    /// A key, looked up in the keymap (`keymap::BINDINGS`, which the help lists too).
    fn on_key(&mut self, key: KeyEvent) -> Vec<Command> {
        if keymap::action(Mode::Always, key) == Some(Action::Quit) {
            return self.act(Action::Quit);
        }
        if self.show_help {
            self.show_help = false;
            return Vec::new();
        }
        if self.focus == Focus::Prompt {
            return match keymap::action(Mode::Prompt, key) {
                Some(action) => self.act(action),
                None => {
                    self.on_edit_key(key);
                    Vec::new()
                }
            };
        }
        keymap::action(Mode::Panes, key).map_or_else(Vec::new, |action| self.act(action))
    }

    /// What each action does.
    fn act(&mut self, action: Action) -> Vec<Command> {
        match action {
            Action::Quit => {
                self.should_quit = true;
                return vec![Command::Quit];
            }
            Action::Help => self.show_help = true,
            Action::TogglePause => return self.toggle_pause(),
            Action::SingleStep => {
                self.paused = true;
                return vec![
                    Command::Control(RaceControl::Pause),
                    Command::Control(RaceControl::Step),
                ];
            }
            Action::ToggleRecording if self.replay.is_some() => {
                self.error = Some("w records live runs; this is already a trace".into());
            }
            Action::ToggleRecording => {
                self.recording = !self.recording;
                return vec![Command::Record(self.recording)];
            }
            Action::StepForward => return self.act(Action::SingleStep),
            Action::StepBack => return self.seek(Seek::Back),
            Action::ToStart => return self.seek(Seek::Start),
            Action::ToEnd => return self.seek(Seek::End),
            Action::Faster => return self.change_rate(1),
            Action::Slower => return self.change_rate(-1),
            Action::Rerun | Action::RunPrompt => return self.start(),
            Action::EditPrompt => self.focus = Focus::Prompt,
            Action::NextFocus | Action::LeavePrompt => self.focus = self.focus.next(),
            Action::ScrollUp => return self.scroll_cmd(-1),
            Action::ScrollDown => return self.scroll_cmd(1),
            Action::PageUp => return self.scroll_cmd(-10),
            Action::PageDown => return self.scroll_cmd(10),
            Action::Hotter => return self.resample(1, false),
            Action::Cooler => return self.resample(-1, false),
            Action::NewSeed => return self.resample(0, true),
        }
        Vec::new()
    }

    /// A move through a replay (pausing it); live runs cannot move back.
    fn seek(&mut self, seek: Seek) -> Vec<Command> {
        if self.replay.is_none() {
            self.error = Some("← Home End move through a replay: spex replay FILE".into());
            return Vec::new();
        }
        self.paused = true;
        vec![Command::Control(RaceControl::Pause), Command::Seek(seek)]
    }

    /// A key typed into the prompt editor.
    fn on_edit_key(&mut self, key: KeyEvent) {
        let len = self.prompt.chars().count();
        match key.code {
            KeyCode::Char(c) => {
                let at = self.byte_index(self.cursor);
                self.prompt.insert(at, c);
                self.cursor += 1;
            }
            KeyCode::Backspace if self.cursor > 0 => {
                self.cursor -= 1;
                let at = self.byte_index(self.cursor);
                self.prompt.remove(at);
            }
            KeyCode::Delete if self.cursor < len => {
                let at = self.byte_index(self.cursor);
                self.prompt.remove(at);
            }
            KeyCode::Left => self.cursor = self.cursor.saturating_sub(1),
            KeyCode::Right => self.cursor = (self.cursor + 1).min(len),
            KeyCode::Home => self.cursor = 0,
            KeyCode::End => self.cursor = len,
            _ => {}
        }
    }

    fn byte_index(&self, chars: usize) -> usize {
        self.prompt
            .char_indices()
            .nth(chars)
            .map_or(self.prompt.len(), |(i, _)| i)
    }

    fn toggle_pause(&mut self) -> Vec<Command> {
        self.paused = !self.paused;
        let control = if self.paused {
            RaceControl::Pause
        } else {
            RaceControl::Resume
        };
        vec![Command::Control(control)]
    }

    fn change_rate(&mut self, delta: isize) -> Vec<Command> {
        self.rate_index = self
            .rate_index
            .saturating_add_signed(delta)
            .min(RATES.len() - 1);
        vec![Command::Control(RaceControl::Rate(self.rate()))]
    }

    /// Moves the temperature `steps` along `TEMPERATURES` and, if asked, draws a new seed;
    /// then reruns the prompt with that rule.
    fn resample(&mut self, steps: isize, new_seed: bool) -> Vec<Command> {
        let t = self.sampling.temperature;
        let at = TEMPERATURES
            .iter()
            .position(|&x| x >= t)
            .unwrap_or(TEMPERATURES.len() - 1);
        let at = at.saturating_add_signed(steps).min(TEMPERATURES.len() - 1);
        self.sampling.temperature = TEMPERATURES[at];
        if new_seed {
            self.sampling.seed = SplitMix(self.sampling.seed).next_u64() % 1_000_000;
        }
        let mut commands = vec![Command::SetSampling(self.sampling)];
        commands.extend(self.start());
        commands
    }

    fn scroll_cmd(&mut self, lines: i32) -> Vec<Command> {
        self.scroll(lines);
        Vec::new()
    }

    fn scroll(&mut self, lines: i32) {
        let focus = self.focus;
        let Some(run) = self.run.as_mut() else { return };
        let lane = match focus {
            Focus::Baseline => &mut run.baseline,
            _ => &mut run.speculative,
        };
        lane.scroll = lane.scroll.saturating_add_signed(lines as i16);
    }

    fn on_engine(&mut self, event: RaceEvent) {
        let Some(run) = self.run.as_mut() else { return };
        match event {
            RaceEvent::Error(message) => self.error = Some(message),
            RaceEvent::Done => run.done = true,
            RaceEvent::StepTimes(times) => run.ceiling = Some(times.ceiling()),
            RaceEvent::Decode { lane, event } => {
                on_decode(run, lane, &event);
                if let Some(s) = run.speedup() {
                    if run.speedup_history.len() == MAX_HISTORY {
                        run.speedup_history.pop_front();
                    }
                    run.speedup_history.push_back(s);
                }
            }
        }
    }
}

fn on_decode(run: &mut RunView, lane: Lane, event: &DecodeEvent) {
    match event {
        DecodeEvent::Prefill(p) => {
            let view = run.lane_mut(lane);
            view.stats = RunStats::new(p.kv.len());
            view.tokens.push(p.first.token.id);
            view.text.push_str(&p.first.text_delta);
            if lane == Lane::Speculative {
                run.kv.clone_from(&p.kv);
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
    run.columns.push_back(StepColumn {
        step: step.step,
        cells: step_cells(step, passes),
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
            slot => {
                *slot = Some(Cell {
                    text,
                    pos: row.pos,
                    kind,
                })
            }
        }
    }
    cells
}

/// Appends a step's flips to the flip log, each with the last words of the text before it.
fn record_flips(run: &mut RunView, step: &StepEvent) {
    for f in &step.flips {
        let context: String = {
            let words: Vec<&str> = run.speculative.text.split_whitespace().collect();
            words[words.len().saturating_sub(4)..].join(" ")
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
