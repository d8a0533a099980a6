//! The dashboard's loading screen: while a checkpoint loads on a thread of its own, one line
//! names the model with the bytes read and the rate, and a gauge shows how far, redrawn ten
//! times a second, so that a multi-gigabyte model never leaves a blank terminal. The quit keys
//! (`keymap`: q, Ctrl-C) leave with an error; the abandoned load ends with the process.
//! Called by `cli::dashboard` before `run`, which then opens the dashboard itself.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crossterm::event::{Event, KeyEventKind};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Style};
use ratatui::widgets::{Block, Borders, Gauge, Paragraph};

use super::keymap::{self, Action, Mode};
use crate::engine::checkpoint::LoadProgress;

/// How often the screen is redrawn (and the keys polled).
const FRAME: Duration = Duration::from_millis(100);

/// Runs `load` on a thread of its own, drawing its progress until it returns, and returns
/// its result; an error if the terminal cannot be set up or a quit key is pressed first.
pub fn while_loading<T: Send + 'static>(
    label: String,
    load: impl FnOnce(&mut dyn FnMut(LoadProgress)) -> T + Send + 'static,
) -> anyhow::Result<T> {
    super::require_tty().map_err(anyhow::Error::msg)?;
    let (_guard, mut terminal) = super::setup_terminal()?;
    let (sender, progress) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name("spex-load".into())
        .spawn(move || {
            load(&mut |p| {
                let _ = sender.send(p);
            })
        })?;
    let started = Instant::now();
    let mut last = None;
    while !worker.is_finished() {
        last = progress.try_iter().last().or(last);
        terminal.draw(|frame| draw_loading(frame, &label, last, started.elapsed()))?;
        if crossterm::event::poll(FRAME)?
            && let Event::Key(key) = crossterm::event::read()?
            && key.kind == KeyEventKind::Press
            && keymap::action(Mode::Panes, key) == Some(Action::Quit)
        {
            anyhow::bail!("left while loading {label}");
        }
    }
    worker
        .join()
        .map_err(|_| anyhow::anyhow!("the loading thread panicked: this is a bug"))
}

/// The loading screen: the line, and a gauge of the bytes read.
pub fn draw_loading(
    frame: &mut Frame,
    label: &str,
    progress: Option<LoadProgress>,
    elapsed: Duration,
) {
    let [_, line, gauge, _] = Layout::vertical([
        Constraint::Fill(1),
        Constraint::Length(1),
        Constraint::Length(3),
        Constraint::Fill(1),
    ])
    .areas(frame.area());
    let gb = |bytes: u64| bytes as f64 / 1e9;
    let (text, ratio) = match progress {
        Some(LoadProgress::Reading {
            read_bytes,
            total_bytes,
        }) => (
            format!(
                "loading {label}: {:.2} of {:.2} GB of weights, {:.0} MB/s",
                gb(read_bytes),
                gb(total_bytes),
                read_bytes as f64 / 1e6 / elapsed.as_secs_f64().max(1e-3)
            ),
            read_bytes as f64 / total_bytes.max(1) as f64,
        ),
        Some(LoadProgress::Downloading {
            done_bytes,
            total_bytes,
        }) => (
            format!(
                "downloading {label}: {:.2} of {:.2} GB of this file",
                gb(done_bytes),
                gb(total_bytes)
            ),
            done_bytes as f64 / total_bytes.max(1) as f64,
        ),
        Some(LoadProgress::TimingSteps) => (
            format!("loading {label}: read; timing the kernels' steps"),
            1.0,
        ),
        None => (format!("loading {label}…"), 0.0),
    };
    frame.render_widget(Paragraph::new(text).centered(), line);
    let bar = Gauge::default()
        .block(Block::default().borders(Borders::ALL).title(" q quits "))
        .gauge_style(Style::default().fg(Color::Cyan))
        .ratio(ratio.clamp(0.0, 1.0));
    frame.render_widget(bar, gauge);
}
