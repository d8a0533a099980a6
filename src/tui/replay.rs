//! The dashboard over a recorded trace, with no model loaded (`spex replay FILE`). A
//! [`Replayer`] is the dashboard's event source: it feeds the trace's events to the app a step
//! of the speculative lane at a time, at the dashboard's rate, and moves back by folding the
//! trace again from its start, so every panel at step N is what the live run showed there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ratatui::layout::Size;

use super::app::{App, Command, ModelInfo, Msg, ReplayStatus, Seek};
use super::explorer::Analysis;
use super::{Source, event_loop, open_dashboard};
use crate::harness::race::{RaceControl, RaceEvent};
use crate::harness::trace::{Trace, is_speculative_step};

/// Steps per second when the dashboard's rate is "max".
const FLAT_OUT_STEPS_PER_SEC: f64 = 60.0;

/// A trace being replayed, and where it stands.
#[derive(Debug)]
pub struct Replayer {
    events: Arc<[RaceEvent]>,
    /// `ends[k]`: how many events make up step k: everything before the speculative lane's
    /// step k + 1 (the whole trace for the last).
    ends: Vec<usize>,
    file: String,
    /// The whole trace explained, for the explorer (interactive replays only: a snapshot
    /// cannot open it).
    analysis: Option<Arc<Analysis>>,
    /// The step shown.
    step: usize,
    /// Events already given to the app.
    given: usize,
    /// The app must start its run afresh before the next events (a move back).
    reset: bool,
    playing: bool,
    steps_per_sec: f64,
    /// When the replay last moved on while playing.
    last_move: Instant,
}

impl Replayer {
    /// A replay of `trace`, named `file` in the footer, standing at `step`, paused.
    pub fn new(trace: Trace, file: String, step: usize) -> Self {
        // Step k shows everything before the speculative lane's step k + 1; the last, all.
        let mut ends: Vec<usize> = (trace.events.iter().enumerate())
            .filter(|(_, e)| is_speculative_step(e))
            .map(|(i, _)| i)
            .collect();
        ends.push(trace.events.len());
        let mut replayer = Self {
            events: trace.events.into(),
            ends,
            file,
            analysis: None,
            step: 0,
            given: 0,
            reset: true,
            playing: false,
            steps_per_sec: FLAT_OUT_STEPS_PER_SEC,
            last_move: Instant::now(),
        };
        replayer.go_to(step);
        replayer
    }

    /// [`Replayer::new`] with the explorer's analysis of the trace, which `x` shows. Its
    /// what-if replays every policy, so only a dashboard a person steers pays for it.
    pub fn explained(trace: Trace, file: String, step: usize) -> Self {
        let analysis = Arc::new(Analysis::of(&trace, &file));
        Self {
            analysis: Some(analysis),
            ..Self::new(trace, file, step)
        }
    }

    /// The speculative lane's steps in the trace.
    pub fn steps(&self) -> usize {
        self.ends.len() - 1
    }

    /// Stands at `step` (clamped to the trace); a move back refolds from the start.
    pub fn go_to(&mut self, step: usize) {
        let step = step.min(self.steps());
        if self.ends[step] < self.given {
            (self.reset, self.given) = (true, 0);
        }
        self.step = step;
    }

    /// The app's next message: the events between what it has and the current step.
    pub fn message(&mut self) -> Option<Msg> {
        let end = self.ends[self.step];
        if end == self.given && !self.reset {
            return None;
        }
        let msg = Msg::Replay {
            reset: self.reset,
            trace: self.events.clone(),
            events: self.given..end,
            status: ReplayStatus {
                file: self.file.clone(),
                step: self.step,
                steps: self.steps(),
                analysis: self.analysis.clone(),
            },
        };
        (self.given, self.reset) = (end, false);
        Some(msg)
    }

    /// Moves on by the steps due at the current rate, while playing.
    fn play(&mut self) {
        if !self.playing || self.step == self.steps() {
            self.last_move = Instant::now();
            return;
        }
        let due = (self.last_move.elapsed().as_secs_f64() * self.steps_per_sec) as usize;
        if due > 0 {
            self.go_to(self.step + due);
            self.last_move = Instant::now();
        }
    }
}

impl Source for Replayer {
    fn execute(&mut self, commands: Vec<Command>) -> anyhow::Result<()> {
        for command in commands {
            match command {
                Command::StartRace { .. } => {
                    // The app started its run afresh: give it everything again.
                    (self.reset, self.given, self.step) = (true, 0, 0);
                    self.playing = true;
                }
                Command::Control(RaceControl::Pause | RaceControl::Stop) => self.playing = false,
                Command::Control(RaceControl::Resume) => self.playing = true,
                Command::Control(RaceControl::Step) => self.go_to(self.step + 1),
                Command::Control(RaceControl::Rate(rate)) => {
                    self.steps_per_sec = rate.unwrap_or(FLAT_OUT_STEPS_PER_SEC);
                }
                Command::Seek(Seek::Back) => self.go_to(self.step.saturating_sub(1)),
                Command::Seek(Seek::Start) => self.go_to(0),
                Command::Seek(Seek::End) => self.go_to(self.steps()),
                Command::Seek(Seek::To(step)) => self.go_to(step),
                Command::SetSampling(_) | Command::Record(_) | Command::Quit => {}
            }
        }
        Ok(())
    }

    fn frame(&mut self) -> anyhow::Result<Option<Msg>> {
        self.play();
        Ok(self.message())
    }

    fn stop(&mut self) -> anyhow::Result<()> {
        self.playing = false;
        Ok(())
    }
}

/// The dashboard's model line for a trace's run.
pub fn model_info(trace: &Trace) -> ModelInfo {
    let h = &trace.header;
    ModelInfo {
        name: h.model.name.clone(),
        passes: h.model.passes,
        layers: h.model.layers,
        device: h.device.clone(),
        dtype: h.dtype.clone(),
        policy: h.policy,
    }
}

/// Replays `trace` (read from `file`) in the dashboard from `step`, a frame every
/// `frame_interval`, in presenter mode where `present`, until the user quits.
pub fn run(
    trace: Trace,
    file: String,
    step: usize,
    frame_interval: Duration,
    present: bool,
) -> anyhow::Result<()> {
    super::require_tty().map_err(anyhow::Error::msg)?;
    let (info, header) = (model_info(&trace), trace.header.clone());
    // The explorer's analysis replays the run under every policy: done before the terminal
    // turns raw, so that Ctrl-C still interrupts it.
    let mut replayer = Replayer::explained(trace, file, step);
    let (runtime, _guard, mut terminal, size) = open_dashboard()?;
    let mut app = App::new(info, None, size);
    if present {
        app = app.presenting();
    }
    app.prompt = header.prompt;
    app.sampling = header.sampling;
    app.paused = true;
    if let Some(msg) = replayer.message() {
        app.update(msg);
    }
    app.focus = super::app::Focus::Speculative;
    runtime.block_on(event_loop(
        &mut terminal,
        &mut app,
        &mut replayer,
        frame_interval,
        false,
    ))?;
    Ok(())
}

/// The dashboard of `trace` at `step`, drawn `size` cells large (presenter mode's screen where
/// `present`), as an SVG picture.
pub fn snapshot(
    trace: Trace,
    file: String,
    step: usize,
    size: Size,
    present: bool,
) -> anyhow::Result<String> {
    let passes = trace.header.model.passes;
    let least = match present {
        true => super::present::min_size(passes),
        false => super::ui::min_size(passes),
    };
    let Size {
        width: w,
        height: h,
    } = size;
    if w < least.width || h < least.height {
        anyhow::bail!(
            "--width {w} --height {h}: the dashboard of {passes} passes needs at least {} × {} \
             cells",
            least.width,
            least.height
        );
    }
    let mut app = App::new(model_info(&trace), None, (w, h));
    app.present = present;
    app.prompt = trace.header.prompt.clone();
    app.sampling = trace.header.sampling;
    app.focus = super::app::Focus::Speculative;
    let mut replayer = Replayer::new(trace, file, step);
    if let Some(msg) = replayer.message() {
        app.update(msg);
    }
    let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(w, h))?;
    terminal.draw(|f| super::ui::draw(f, &app))?;
    Ok(super::svg::to_svg(terminal.backend().buffer()))
}
