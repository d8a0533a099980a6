//! The dashboard runtime: sets up the terminal (restored on quit, error and panic), runs the
//! race on its own thread, and loops with `tokio::select!` over terminal input, engine events
//! and a frame timer. Once per frame it drains the engine's events into one `App::update`,
//! then draws from state alone. The events come from a `Source`: a live race here, or a
//! recorded trace (`replay`).

pub mod app;
pub mod explorer;
pub mod frames;
pub mod inspector;
pub mod keymap;
mod live;
pub mod loading;
pub mod present;
pub mod replay;
pub mod run_view;
pub mod svg;
pub mod ui;

use std::io::{IsTerminal, Stdout};
use std::time::Duration;

use crossterm::event::{
    DisableBracketedPaste, DisableMouseCapture, EnableBracketedPaste, EnableMouseCapture, Event,
    EventStream,
};
use crossterm::execute;
use crossterm::terminal::{
    EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode,
};
use futures::StreamExt;
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;
use ratatui::layout::Size;

use crate::engine::policy::PolicyKind;
use crate::engine::{DecodeOptions, LoadedModel};
use crate::harness::trace::TraceHeader;
use app::{App, Command, ModelInfo, Msg};
use frames::FrameClock;

/// `text` as the terminal may be given it: every control character but the newline (which
/// the panels split lines at) shown as '?', one character for one, so that an escape sequence
/// or a bell in a prompt, a model's output or a trace never reaches the terminal, and a
/// cursor counted in characters stays where it was.
pub(crate) fn printable(text: &str) -> String {
    (text.chars())
        .map(|c| match c {
            '\n' => '\n',
            c if c.is_control() => '?',
            c => c,
        })
        .collect()
}

/// Token text made visible in a cell: [`printable`], with spaces as '·' and newlines as '⏎'.
pub(crate) fn visible(text: &str) -> String {
    (printable(text).chars())
        .map(|c| match c {
            ' ' => '·',
            '\n' => '⏎',
            c => c,
        })
        .collect()
}

/// A popup of `size` cells (at most the area's) in the middle of `area`.
pub(crate) fn centered(area: ratatui::layout::Rect, size: Size) -> ratatui::layout::Rect {
    let (w, h) = (size.width.min(area.width), size.height.min(area.height));
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
    /// Print the frame clock's summary (`frames::FrameClock`) on quit.
    pub frame_stats: bool,
}

/// Where a dashboard's events come from.
trait Source {
    /// Carries out the app's commands.
    fn execute(&mut self, commands: Vec<Command>) -> anyhow::Result<()>;
    /// What to fold into the app at this frame, if anything.
    fn frame(&mut self) -> anyhow::Result<Option<Msg>>;
    /// Stops whatever runs (and finishes what it was writing).
    fn stop(&mut self) -> anyhow::Result<()>;
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
        DisableBracketedPaste,
        DisableMouseCapture,
        LeaveAlternateScreen,
        crossterm::cursor::Show
    );
}

/// Restores the terminal and exits with the conventional status (128 + the signal's number)
/// when the process is sent SIGTERM, SIGHUP or SIGINT (raw mode turns Ctrl-C into a key, so
/// SIGINT comes only from `kill`). A thread of its own waits for them, so a UI thread busy
/// with a long load or replay cannot delay it. Traces are flushed line by line, so what they
/// hold stays whole.
fn restore_on_signals() -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    // Once a process: the loading screen and the dashboard each set the terminal up.
    static WATCHING: std::sync::Once = std::sync::Once::new();
    if WATCHING.is_completed() {
        return Ok(());
    }
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGHUP, SIGINT])?;
    std::thread::Builder::new()
        .name("spex-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                restore_terminal();
                std::process::exit(128 + signal);
            }
        })?;
    WATCHING.call_once(|| {});
    Ok(())
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
    restore_on_signals()?;
    execute!(
        std::io::stdout(),
        EnterAlternateScreen,
        EnableMouseCapture,
        EnableBracketedPaste
    )?;
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

/// Runs the dashboard until the user quits.
pub fn run(loaded: &LoadedModel, options: DashboardOptions) -> anyhow::Result<()> {
    let (runtime, guard, mut terminal, size) = open_dashboard()?;
    let mut app = App::new(options.info.clone(), options.prompt.clone(), size);
    let autostart = !app.prompt.is_empty();
    if !autostart {
        app = app.with_sample_prompt(&options.sample_prompt);
    }
    if options.present {
        app = app.presenting();
    }
    app.sampling = options.decode.sampling;
    let mut races = live::Races::new(loaded, &options);
    app.recording = races.recording;
    let clock = runtime.block_on(event_loop(
        &mut terminal,
        &mut app,
        &mut races,
        options.frame_interval,
        autostart,
    ))?;
    drop(guard); // the terminal restored before the summary is printed
    if options.frame_stats {
        eprintln!("{}", clock.summary());
    }
    Ok(())
}

fn input_msg(event: Option<std::io::Result<Event>>) -> std::io::Result<Option<Msg>> {
    Ok(match event {
        Some(Ok(Event::Key(k))) => Some(Msg::Key(k)),
        Some(Ok(Event::Mouse(m))) => Some(Msg::Mouse(m)),
        Some(Ok(Event::Resize(w, h))) => Some(Msg::Resize(w, h)),
        Some(Ok(Event::Paste(text))) => Some(Msg::Paste(text)),
        Some(Ok(_)) | None => None,
        Some(Err(e)) => return Err(e),
    })
}

/// Runs the dashboard over `source` until the user quits, drawing a frame every
/// `frame_interval`; where `autostart`, the app's run starts before the first frame.
async fn event_loop(
    terminal: &mut Terminal<CrosstermBackend<Stdout>>,
    app: &mut App,
    source: &mut impl Source,
    frame_interval: Duration,
    autostart: bool,
) -> anyhow::Result<FrameClock> {
    let mut input = EventStream::new();
    let mut frames = tokio::time::interval(frame_interval);
    frames.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut clock = FrameClock::start();
    let mut pending = if autostart { app.start() } else { Vec::new() };
    draw(terminal, app, None)?;
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
                    draw(terminal, app, None)?;
                }
            }
            _ = frames.tick() => {
                if let Some(msg) = source.frame()? {
                    pending = app.update(msg);
                }
                draw(terminal, app, Some(&mut clock))?;
            }
        }
    }
    source.stop()?;
    Ok(clock)
}

/// Draws one frame from the app's state. The frame timer's draws are counted on `clock`
/// (the rate the dashboard holds); a key's immediate redraw is not.
fn draw(
    terminal: &mut Terminal<CrosstermBackend<Stdout>>,
    app: &App,
    clock: Option<&mut FrameClock>,
) -> std::io::Result<()> {
    let decoding = app.run.as_ref().is_some_and(|run| !run.done);
    let started = std::time::Instant::now();
    terminal.draw(|f| ui::draw(f, app))?;
    if let Some(clock) = clock {
        clock.record(decoding, started.elapsed());
    }
    Ok(())
}
