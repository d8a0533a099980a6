//! `cargo bench --bench replay`: how fast `spex replay` draws a long trace (issue 15's
//! targets: ≥ 30 frames per second on a 10,000-step trace, a step back in < 50 ms). Records
//! a race of 10,000+ speculative steps on a small random checkpoint in memory, then times,
//! at 120 × 36 cells: frames while playing forward one step a frame, a step back from the
//! end, and a jump to the start and to the end.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use spex::engine::config::ModelShape;
#[path = "../common/mod.rs"]
mod common;

use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use spex::engine::{DecodeOptions, LoadedModel, Sampling};
use spex::harness::trace::Trace;
use spex::tui::app::App;
use spex::tui::replay::{Replayer, model_info};
use spex::tui::ui::draw;

const TOKENS: usize = 4000;

/// A recorded race of `TOKENS` tokens on a small random checkpoint.
fn long_trace() -> Trace {
    let dir = tempfile::TempDir::new().expect("temp dir");
    let shape = ModelShape {
        hidden: 32,
        layers: 1,
        passes: 4,
        heads: 2,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 64,
        vocab: 300,
        context: TOKENS + 64,
        tied: true,
    };
    let spec = RandomSpec {
        shape,
        seed: 11,
        ..RandomSpec::default()
    };
    write_random_checkpoint(dir.path(), &spec).expect("checkpoint");
    let loaded = LoadedModel::load(dir.path(), &Device::Cpu, DType::F32).expect("load");
    let options = DecodeOptions {
        max_tokens: TOKENS,
        context: TOKENS + 64,
        sampling: Sampling::GREEDY,
        exit_threshold: None,
    };
    common::recorded_race(&loaded, "To be", PolicyKind::Speed, options)
}

/// Moves the replay to `step` and draws it: what one frame of `spex replay` does.
fn frame(
    app: &mut App,
    replayer: &mut Replayer,
    terminal: &mut Terminal<TestBackend>,
    step: usize,
) {
    replayer.go_to(step);
    if let Some(msg) = replayer.message() {
        app.update(msg);
    }
    terminal.draw(|f| draw(f, app)).expect("draw");
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let started = Instant::now();
    let trace = long_trace();
    let steps = trace.steps();
    let lines = trace.events.len();
    println!(
        "trace: {steps} speculative steps, {lines} events, recorded in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut app = App::new(model_info(&trace), None, (120, 36));
    app.prompt = trace.header.prompt.clone();
    let mut replayer = Replayer::new(trace, "bench.jsonl".into(), 0);
    let mut terminal = Terminal::new(TestBackend::new(120, 36)).expect("terminal");
    frame(&mut app, &mut replayer, &mut terminal, 0);
    // Playing: one step a frame through the whole trace.
    let mut worst = Duration::ZERO;
    let t = Instant::now();
    for step in 1..=steps {
        let f = Instant::now();
        frame(&mut app, &mut replayer, &mut terminal, step);
        worst = worst.max(f.elapsed());
    }
    let per_frame = t.elapsed() / steps as u32;
    println!(
        "play forward: {} per frame ({:.0} frames/s), worst {}",
        ms(per_frame),
        1.0 / per_frame.as_secs_f64(),
        ms(worst)
    );
    for (name, to) in [
        ("step back from the end", steps - 1),
        ("jump to the start", 0),
        ("jump to the end", steps),
        ("step back from the middle", steps / 2),
        ("step back again", steps / 2 - 1),
    ] {
        let t = Instant::now();
        frame(&mut app, &mut replayer, &mut terminal, to);
        println!("{name} (to step {to}): {}", ms(t.elapsed()));
    }
}
