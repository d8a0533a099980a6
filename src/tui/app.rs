//! The dashboard's state and its one update function. Terminal input and engine events arrive
//! as [`Msg`]s; [`App::update`] folds them into state and returns [`Command`]s for the runtime
//! (start a race, steer it, quit). Rendering (`ui`) reads this state and nothing else.

use std::ops::Range;
use std::sync::Arc;

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, MouseEvent, MouseEventKind};

use super::explorer::{self, Analysis, ExplorerCursor};
use super::keymap::{self, Action, Mode};
use super::run_view::on_decode;
pub use super::run_view::{Agreement, Cell, CellKind, FlipEntry, LaneView, RunView, StepColumn};

use crate::engine::policy::PolicyKind;
use crate::engine::rng::SplitMix;
use crate::engine::sampling::Sampling;
use crate::harness::race::{RaceControl, RaceEvent};

/// The temperatures `t` and `T` step through (0 is greedy).
pub const TEMPERATURES: [f32; 8] = [0.0, 0.3, 0.5, 0.7, 0.8, 1.0, 1.2, 1.5];
/// Points of the speedup sparkline.
const MAX_HISTORY: usize = 400;
/// Presenter mode's place in [`RATES`]: 2 steps per second, the pace for a talk.
const PRESENTER_RATE: usize = 1;
const _: () = assert!(matches!(RATES[PRESENTER_RATE], Some(r) if r == 2.0));

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
    /// Text pasted into the terminal (bracketed paste): one update, however long.
    Paste(String),
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
        /// Every event of the trace, shared with the replayer: a move back refolds up to all
        /// of them, which copying would double.
        trace: Arc<[RaceEvent]>,
        /// This frame's events in `trace`.
        events: Range<usize>,
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
    /// The whole trace explained, for the explorer (computed once, shared by every frame).
    pub analysis: Option<Arc<Analysis>>,
}

/// A move through a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seek {
    Back,
    Start,
    End,
    /// To this step of the speculative lane (the explorer's `g`).
    To(usize),
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

/// The dashboard's whole state.
#[derive(Debug, Clone, PartialEq)]
pub struct App {
    pub info: ModelInfo,
    pub prompt: String,
    /// `prompt` is the sample the dashboard opened with: Enter runs it, and the first key
    /// that types or deletes replaces it.
    pub prompt_is_sample: bool,
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
    /// The token inspector's cursor: an output index of the speculative lane.
    pub inspect: Option<usize>,
    /// Presenter mode: large speedup, text and pipeline only (`ui::present`).
    pub present: bool,
    /// The misprediction explorer's cursor, while it is open.
    pub explorer: Option<ExplorerCursor>,
}

impl App {
    /// Whether the lanes' texts must agree token for token (greedy, or a policy that
    /// commits the baseline's seed-coupled sample), and if so whether they do.
    pub fn agreement(&self, run: &RunView) -> Agreement {
        if self.info.policy.is_lossy() {
            Agreement::Lossy(run.departure())
        } else if self.sampling.is_greedy() || self.info.policy.build().keeps_baseline_sample() {
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
            prompt_is_sample: false,
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
            inspect: None,
            present: false,
            explorer: None,
        }
    }

    /// Opens with `sample` in the prompt editor, ready for Enter; typing replaces it.
    pub fn with_sample_prompt(mut self, sample: &str) -> Self {
        self.prompt = sample.to_string();
        self.cursor = sample.chars().count();
        self.prompt_is_sample = !sample.is_empty();
        self
    }

    /// Presenter mode on, at the pace for a talk: 2 steps per second.
    pub fn presenting(mut self) -> Self {
        self.present = true;
        self.rate_index = PRESENTER_RATE;
        self
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
            Msg::Paste(text) => {
                self.on_paste(&text);
                Vec::new()
            }
            Msg::Engine(events) => {
                for event in &events {
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
                trace,
                events,
                status,
            } => {
                if reset || self.run.is_none() {
                    self.run = Some(RunView {
                        prompt: self.prompt.clone(),
                        ..RunView::default()
                    });
                }
                for event in &trace[events] {
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
        self.prompt_is_sample = false;
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
            Action::TogglePresenter => self.present = !self.present,
            Action::ToggleRecording => {
                self.recording = !self.recording;
                return vec![Command::Record(self.recording)];
            }
            Action::Inspect => {
                let last = self.run.as_ref().map(|r| r.speculative.tokens.len());
                self.inspect = match self.inspect {
                    Some(_) => None,
                    None => last.map(|n| n.saturating_sub(1)),
                };
            }
            Action::Explore => {
                self.explorer = match self.explorer {
                    Some(_) => None,
                    None => Some(ExplorerCursor::default()),
                };
            }
            Action::ExplorePrevious => self.move_explorer(-1),
            Action::ExploreNext => self.move_explorer(1),
            Action::GoToOccurrence => return self.go_to_occurrence(),
            Action::InspectPrevious => self.move_inspector(-1),
            Action::InspectNext => self.move_inspector(1),
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

    /// Moves the inspector's cursor by `by` tokens within the speculative lane's output,
    /// opening it at the last token first if it is closed.
    fn move_inspector(&mut self, by: isize) {
        let tokens = self.run.as_ref().map_or(0, |r| r.speculative.tokens.len());
        if tokens == 0 {
            return;
        }
        let at = self.inspect.unwrap_or(tokens - 1);
        self.inspect = Some(at.saturating_add_signed(by).min(tokens - 1));
    }

    /// Selects the explorer's previous or next pair (opening it if closed).
    fn move_explorer(&mut self, by: isize) {
        let cursor = self.explorer.get_or_insert_default();
        let pair = cursor
            .pair
            .saturating_add_signed(by)
            .min(explorer::PAIRS - 1);
        *cursor = ExplorerCursor {
            pair,
            occurrence: 0,
        };
    }

    /// A replay's move to the next occurrence of the explorer's selected pair.
    fn go_to_occurrence(&mut self) -> Vec<Command> {
        let analysis = self.replay.as_ref().and_then(|r| r.analysis.clone());
        let (Some(cursor), Some(analysis)) = (self.explorer.as_mut(), analysis) else {
            self.error = Some("g goes to a pair of the explorer (x) in a replay".into());
            return Vec::new();
        };
        let pair = analysis.explanation.pairs.get(cursor.pair);
        let Some(occurrences) = pair.map(|p| &p.occurrences).filter(|o| !o.is_empty()) else {
            return Vec::new();
        };
        let to = occurrences[cursor.occurrence % occurrences.len()].step;
        cursor.occurrence += 1;
        self.seek(Seek::To(to as usize))
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
        if std::mem::take(&mut self.prompt_is_sample)
            && matches!(
                key.code,
                KeyCode::Char(_) | KeyCode::Backspace | KeyCode::Delete
            )
        {
            self.prompt.clear();
            self.cursor = 0;
        }
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

    /// Pasted text, into the prompt editor at the cursor (replacing a sample prompt); outside
    /// the editor a paste does nothing. Carriage returns are dropped: a paste's lines end in
    /// newlines whatever the terminal sent.
    fn on_paste(&mut self, text: &str) {
        if self.focus != Focus::Prompt || self.show_help {
            return;
        }
        if std::mem::take(&mut self.prompt_is_sample) {
            self.prompt.clear();
            self.cursor = 0;
        }
        let text = text.replace("\r\n", "\n").replace('\r', "\n");
        let at = self.byte_index(self.cursor);
        self.prompt.insert_str(at, &text);
        self.cursor += text.chars().count();
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

    fn on_engine(&mut self, event: &RaceEvent) {
        let Some(run) = self.run.as_mut() else { return };
        match event {
            RaceEvent::Error(message) => self.error = Some(message.clone()),
            RaceEvent::Done => run.done = true,
            RaceEvent::StepTimes(times) => run.ceiling = Some(times.ceiling()),
            RaceEvent::Decode { lane, event } => {
                on_decode(run, *lane, event);
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
