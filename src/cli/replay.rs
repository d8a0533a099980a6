//! `spex replay FILE`: the dashboard over a recorded trace, no model loaded; `spex snapshot`:
//! the same at one step, as an SVG picture.

use std::path::PathBuf;

use clap::Args;

use crate::engine::trace::Trace;

/// `spex replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// A trace written by `--record`.
    pub file: PathBuf,
    /// Start at this step of the speculative lane.
    #[arg(long, default_value_t = 0)]
    pub step: usize,
    /// Frames per second of the dashboard.
    #[arg(long, default_value_t = 30)]
    pub fps: u32,
}

pub fn run(args: &ReplayArgs) -> anyhow::Result<()> {
    let trace = Trace::read(&args.file)?;
    if let Some(line) = trace.cut_line {
        eprintln!(
            "spex: {}: line {line} was cut short (a recording that stopped); replaying the lines before it",
            args.file.display()
        );
    }
    let name = args.file.file_name().map_or_else(
        || args.file.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let interval = std::time::Duration::from_secs_f64(1.0 / f64::from(args.fps.max(1)));
    crate::tui::replay::run(trace, name, args.step, interval)
}

/// `spex snapshot`.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// A trace written by `--record`.
    pub file: PathBuf,
    /// The step of the speculative lane to draw.
    #[arg(long, default_value_t = 0)]
    pub step: usize,
    /// Where to write the SVG.
    #[arg(long)]
    pub out: PathBuf,
    /// The dashboard's size in cells.
    #[arg(long, default_value_t = 120)]
    pub width: u16,
    #[arg(long, default_value_t = 36)]
    pub height: u16,
}

pub fn snapshot(args: &SnapshotArgs) -> anyhow::Result<()> {
    let trace = Trace::read(&args.file)?;
    let name = args.file.file_name().map_or_else(
        || args.file.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let size = (args.width.clamp(40, 400), args.height.clamp(12, 200));
    let svg = crate::tui::replay::snapshot(trace, name, args.step, size)?;
    std::fs::write(&args.out, svg).map_err(|e| crate::engine::EngineError::file(&args.out, e))?;
    Ok(())
}
