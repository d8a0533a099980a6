//! `spex replay FILE`: the dashboard over a recorded trace, no model loaded; `spex snapshot`:
//! the same at one step, as an SVG picture.

use std::path::{Path, PathBuf};

use clap::Args;

use super::models;
use crate::harness::trace::{ModelFingerprint, Trace, fingerprint};

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
    /// Presenter mode: the speedup in large digits, the text and the pipeline in large
    /// cells, high contrast, 2 steps per second.
    #[arg(long)]
    pub present: bool,
    /// Check that the trace was recorded with this model (a models.toml entry, a checkpoint
    /// directory or an ORG/NAME hub repo): an error if its weights or tokenizer differ.
    #[arg(long)]
    pub model: Option<String>,
}

pub fn run(args: &ReplayArgs) -> anyhow::Result<()> {
    let trace = Trace::read(&args.file)?;
    if let Some(model) = &args.model {
        check_model(&trace, &args.file, model)?;
    }
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
    crate::tui::replay::run(trace, name, args.step, interval, args.present)
}

/// Errors unless `model` has the weights and tokenizer `trace` (read from `file`) was
/// recorded with, naming what differs.
fn check_model(trace: &Trace, file: &Path, model: &str) -> anyhow::Result<()> {
    let hub = crate::hub::HubSettings::from_env()?;
    let mut bar = super::hub::PullBar::default();
    let resolved = models::resolve(Some(model), &hub, &mut |p| bar.show(p));
    bar.finish();
    let resolved = resolved?;
    let ModelFingerprint {
        weights_sha256: weights,
        tokenizer_sha256: tokenizer,
    } = fingerprint(&resolved.source)?;
    let recorded = &trace.header.model;
    let short = |hash: &str| hash.chars().take(12).collect::<String>();
    let mut differs = Vec::new();
    if weights != recorded.weights_sha256 {
        differs.push(format!(
            "weights sha256 {}… (recorded {}…)",
            short(&weights),
            short(&recorded.weights_sha256)
        ));
    }
    if tokenizer != recorded.tokenizer_sha256 {
        differs.push(format!(
            "tokenizer sha256 {}… (recorded {}…)",
            short(&tokenizer),
            short(&recorded.tokenizer_sha256)
        ));
    }
    if differs.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "{}: recorded with model `{}`, but --model {model} differs: {}",
        file.display(),
        recorded.name,
        differs.join(", ")
    )
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
    #[arg(long, value_name = "FILE")]
    pub svg: PathBuf,
    /// The dashboard's width in cells (at most 400).
    #[arg(long, default_value_t = 120)]
    pub width: u16,
    /// The dashboard's height in cells (at most 200).
    #[arg(long, default_value_t = 36)]
    pub height: u16,
    /// Draw presenter mode's screen instead of the full dashboard.
    #[arg(long)]
    pub present: bool,
}

pub fn snapshot(args: &SnapshotArgs) -> anyhow::Result<()> {
    use crate::engine::files;
    files::refuse_same_file(&args.svg, &args.file, "--svg")?;
    files::check_writable(&args.svg, "--svg")?;
    let trace = Trace::read(&args.file)?;
    if args.step > trace.steps() {
        anyhow::bail!(
            "{}: --step {}: the trace's last step is {}",
            args.file.display(),
            args.step,
            trace.steps()
        );
    }
    let name = args.file.file_name().map_or_else(
        || args.file.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let size = ratatui::layout::Size::new(args.width.min(400), args.height.min(200));
    let svg = crate::tui::replay::snapshot(trace, name, args.step, size, args.present)?;
    files::write_atomically(&args.svg, |out| out.write_all(svg.as_bytes()))?;
    Ok(())
}
