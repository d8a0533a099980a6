//! The dashboard runtime: sets up the terminal (restored on quit, error and panic), runs the
//! race on its own thread, and loops with `tokio::select!` over terminal input, engine events
//! and a frame timer. Once per frame it drains the engine's events into one `App::update`,
//! then draws from state alone. The events come from a `Source`: a live race here, or a
//! recorded trace (`replay`).

pub mod app;
pub mod explorer;
pub mod inspector;
pub mod keymap;
pub mod loading;
pub mod present;
pub mod replay;
pub mod run_view;
pub mod svg;
pub mod ui;

use std::io::{IsTerminal, Stdout};
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossterm::event::{DisableMouseCapture, EnableMouseCapture, Event, EventStream};
use crossterm::execute;
use crossterm::terminal::{
    EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode,
};
use futures::StreamExt;
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;
use tokio::sync::mpsc;

use crate::engine::policy::PolicyKind;
use crate::engine::{DecodeOptions, LoadedModel};
use crate::harness::race::{RaceControl, RaceEvent, run_race};
use crate::harness::trace::{TraceHeader, TraceWriter};
use app::{App, Command, ModelInfo, Msg};

/// A popup of `width` × `height` cells (at most the area's) in the middle of `area`.
pub(crate) fn centered(
    area: ratatui::layout::Rect,
    (width, height): (u16, u16),
) -> ratatui::layout::Rect {
    let (w, h) = (width.min(area.width), height.min(area.height));
    ratatui::layout::Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    }
}

/// How the dashboard starts.
#[derive(Debug, Clone)]
pub struct DashboardOptions {
    /// A prompt to run at once.
    pub prompt: Option<String>,
    /// Without `prompt`: the prompt the editor opens with, ready for Enter.
    pub sample_prompt: String,
    /// Wrap prompts in the chat template before decoding.
    pub chat: bool,
    pub decode: DecodeOptions,
    /// The speculative lane's policy (speed or dual, with its gate).
    pub policy: PolicyKind,
    pub info: ModelInfo,
    pub frame_interval: Duration,
    /// Record every run from the start: the first to this path, the next ones beside it
    /// (`NAME-2.EXT`, …). Without it, `w` records to `spex-SECONDS.jsonl`.
    pub record: Option<std::path::PathBuf>,
    /// The traces' header, less the prompt and the model's fingerprint (filled in when
    /// recording first starts: it reads every weight).
    pub trace: TraceHeader,
    /// Start in presenter mode.
    pub present: bool,
}

/// Where a dashboard's events come from.
trait Source {
    /// Carries out the app's commands.
    fn execute(&mut self, commands: Vec<Command>) -> anyhow::Result<()>;
    /// What to fold into the app at this frame, if anything.
    fn frame(&mut self) -> anyhow::Result<Option<Msg>>;
    /// Stops whatever runs.
    fn stop(&mut self);
}

/// Errors unless both stdin and stdout are terminals.
pub fn require_tty() -> Result<(), String> {
    if std::io::stdin().is_terminal() && std::io::stdout().is_terminal() {
        Ok(())
    } else {
        Err("the dashboard needs a terminal (stdin and stdout); for scripts and pipes use `spex generate --prompt TEXT`".into())
    }
}

fn restore_terminal() {
    let _ = disable_raw_mode();
    let _ = execute!(
        std::io::stdout(),
        DisableMouseCapture,
        LeaveAlternateScreen,
        crossterm::cursor::Show
    );
}

/// Restores the terminal when dropped: on quit, on error and while a panic unwinds.
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
    }
}

fn setup_terminal() -> std::io::Result<(TerminalGuard, Terminal<CrosstermBackend<Stdout>>)> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore_terminal();
        hook(info);
    }));
    enable_raw_mode()?;
    let guard = TerminalGuard;
    execute!(std::io::stdout(), EnterAlternateScreen, EnableMouseCapture)?;
    let terminal = Terminal::new(CrosstermBackend::new(std::io::stdout()))?;
    Ok((guard, terminal))
}

/// What a dashboard session needs before its first frame: a terminal (checked to be one),
/// the runtime of its event loop, the alternate screen (left when the guard drops) and its
/// size.
type Dashboard = (
    tokio::runtime::Runtime,
    TerminalGuard,
    Terminal<CrosstermBackend<Stdout>>,
    (u16, u16),
);

fn open_dashboard() -> anyhow::Result<Dashboard> {
    require_tty().map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (guard, terminal) = setup_terminal()?;
    let size = terminal.size()?;
    Ok((runtime, guard, terminal, (size.width, size.height)))
}

/// The race thread of the current run and its control channel.
struct RaceHandle {
    control: std_mpsc::Sender<RaceControl>,
    thread: JoinHandle<()>,
}

impl RaceHandle {
    fn start(
        loaded: &LoadedModel,
        prompt: String,
        options: (PolicyKind, DecodeOptions),
        events: mpsc::UnboundedSender<RaceEvent>,
    ) -> Self {
        let (control, control_rx) = std_mpsc::channel();
        let loaded = loaded.clone();
        let thread = std::thread::Builder::new()
            .name("spex-race".into())
            .spawn(move || {
                run_race(&loaded, &prompt, options, control_rx, |ev| {
                    events.send(ev).is_ok()
                })
            })
            .expect("spawning the race thread failed: this is a bug");
        Self { control, thread }
    }

    /// Stops the race and joins its thread.
    fn stop(self) {
        let _ = self.control.send(RaceControl::Stop);
        drop(self.control);
        let _ = self.thread.join();
    }
}

/// Runs the dashboard until the user quits.
pub fn run(loaded: &LoadedModel, options: DashboardOptions) -> anyhow::Result<()> {
    let (runtime, _guard, mut terminal, size) = open_dashboard()?;
    let mut app = App::new(options.info.clone(), options.prompt.clone(), size);
    let autostart = !app.prompt.is_empty();
    if !autostart {
        app = app.with_sample_prompt(&options.sample_prompt);
    }
    if options.present {
        app = app.presenting();
    }
    app.sampling = options.decode.sampling;
    let (tx, rx) = mpsc::unbounded_channel::<RaceEvent>();
    let mut races = Races {
        loaded,
        options: &options,
        sampling: options.decode.sampling,
        events: tx,
        pending: rx,
        current: None,
        recorder: None,
        recording: options.record.is_some(),
        fingerprint: None,
        prompt: String::new(),
        history: Vec::new(),
        runs: 0,
    };
    app.recording = races.recording;
    let pace = (options.frame_interval, autostart);
    runtime.block_on(event_loop(&mut terminal, &mut app, &mut races, pace))
}

/// The race of the current run, restarted and steered by the app's commands.
struct Races<'a> {
    loaded: &'a LoadedModel,
    options: &'a DashboardOptions,
    /// The sampling rule of the next race (the dashboard's keys change it).
    sampling: crate::engine::Sampling,
    events: mpsc::UnboundedSender<RaceEvent>,
    pending: mpsc::UnboundedReceiver<RaceEvent>,
    current: Option<RaceHandle>,
    /// The current run's trace, when recording.
    recorder: Option<TraceWriter>,
    /// Whether runs are recorded.
    recording: bool,
    /// The model's weights' and tokenizer's SHA-256, once computed.
    fingerprint: Option<(String, String)>,
    /// The current run's prompt and every event it sent so far (a recording started midway
    /// writes them first).
    prompt: String,
    history: Vec<RaceEvent>,
    /// Runs started so far.
    runs: usize,
}

impl Races<'_> {
    /// Opens the current run's trace and writes what the run sent so far.
    fn open_trace(&mut self) -> anyhow::Result<()> {
        let (weights, tokenizer) = match &self.fingerprint {
            Some(f) => f.clone(),
            None => crate::harness::trace::fingerprint(&self.loaded.origin)?,
        };
        self.fingerprint = Some((weights.clone(), tokenizer.clone()));
        let mut header = TraceHeader {
            prompt: self.prompt.clone(),
            policy: self.options.policy,
            sampling: self.sampling,
            ..self.options.trace.clone()
        };
        (header.model.weights_sha256, header.model.tokenizer_sha256) = (weights, tokenizer);
        let path = match &self.options.record {
            Some(path) => crate::harness::trace::numbered(path, self.runs),
            None => {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                format!("spex-{}.jsonl", now.map_or(0, |d| d.as_secs())).into()
            }
        };
        let mut writer = TraceWriter::create(&path, &header)?;
        for event in &self.history {
            writer.record(event)?;
        }
        self.recorder = Some(writer);
        Ok(())
    }
}

impl Source for Races<'_> {
    fn execute(&mut self, commands: Vec<Command>) -> anyhow::Result<()> {
        for command in commands {
            match command {
                Command::StartRace { prompt } => {
                    self.stop();
                    // Events of the stopped race must not reach the new run.
                    while self.pending.try_recv().is_ok() {}
                    self.runs += 1;
                    (self.prompt, self.recorder) = (prompt.clone(), None);
                    self.history.clear();
                    if self.recording {
                        self.open_trace()?;
                    }
                    let prompt = if self.options.chat {
                        self.loaded.tokenizer.chat_prompt(&prompt)?
                    } else {
                        prompt
                    };
                    self.current = Some(RaceHandle::start(
                        self.loaded,
                        prompt,
                        (
                            self.options.policy,
                            crate::engine::DecodeOptions {
                                sampling: self.sampling,
                                ..self.options.decode
                            },
                        ),
                        self.events.clone(),
                    ));
                }
                Command::Control(c) => {
                    if let Some(r) = &self.current {
                        let _ = r.control.send(c);
                    }
                }
                Command::SetSampling(sampling) => self.sampling = sampling,
                Command::Record(on) => {
                    self.recording = on;
                    self.recorder = None;
                    if on && self.runs > 0 {
                        self.open_trace()?;
                    }
                }
                Command::Seek(_) | Command::Quit => {}
            }
        }
        Ok(())
    }

    fn frame(&mut self) -> anyhow::Result<Option<Msg>> {
        // Everything the engine sent since the last frame, in one update.
        let mut batch = Vec::new();
        while let Ok(event) = self.pending.try_recv() {
            if let Some(Err(e)) = self.recorder.as_mut().map(|r| r.record(&event)) {
                // The run goes on unrecorded; the error line says why.
                self.recorder = None;
                batch.push(RaceEvent::Error(format!("recording stopped: {e}")));
            }
            self.history.push(event.clone());
            batch.push(event);
        }
        Ok((!batch.is_empty()).then_some(Msg::Engine(batch)))
    }

    fn stop(&mut self) {
        if let Some(r) = self.current.take() {
            r.stop();
        }
    }
}

fn input_msg(event: Option<std::io::Result<Event>>) -> std::io::Result<Option<Msg>> {
    Ok(match event {
        Some(Ok(Event::Key(k))) => Some(Msg::Key(k)),
        Some(Ok(Event::Mouse(m))) => Some(Msg::Mouse(m)),
        Some(Ok(Event::Resize(w, h))) => Some(Msg::Resize(w, h)),
        Some(Ok(_)) | None => None,
        Some(Err(e)) => return Err(e),
    })
}

async fn event_loop(
    terminal: &mut Terminal<CrosstermBackend<Stdout>>,
    app: &mut App,
    source: &mut impl Source,
    (frame_interval, autostart): (Duration, bool),
) -> anyhow::Result<()> {
    let mut input = EventStream::new();
    let mut frames = tokio::time::interval(frame_interval);
    frames.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut pending = if autostart { app.start() } else { Vec::new() };
    terminal.draw(|f| ui::draw(f, app))?;
    while !app.should_quit {
        if let Err(e) = source.execute(std::mem::take(&mut pending)) {
            pending = app.update(Msg::Failed(e.to_string()));
        }
        tokio::select! {
            event = input.next() => {
                if event.is_none() {
                    break; // the terminal's input closed
                }
                if let Some(msg) = input_msg(event)? {
                    pending = app.update(msg);
                    terminal.draw(|f| ui::draw(f, app))?;
                }
            }
            _ = frames.tick() => {
                if let Some(msg) = source.frame()? {
                    pending = app.update(msg);
                }
                terminal.draw(|f| ui::draw(f, app))?;
            }
        }
    }
    source.stop();
    Ok(())
}
