//! `spex sweep lengths`: the bench at several generation lengths, as a table (or `--json`)
//! and a chart of speedup and ceiling against length, an SVG drawn with plotters at slide
//! size (1280 × 720).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::{ModelArgs, SamplingArgs, parse_count, parse_turn_ms};
use crate::engine::{DecodeOptions, PolicyKind};
use crate::harness::bench::Turns;
use crate::harness::sweep::{LengthSweep, sweep_lengths};

/// `spex sweep`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    #[command(subcommand)]
    pub sweep: Sweep,
}

/// What a sweep varies.
#[derive(Debug, Subcommand)]
pub enum Sweep {
    /// Speedup and ceiling against generation length, for each policy.
    Lengths(LengthArgs),
}

/// `spex sweep lengths`.
#[derive(Debug, Args)]
pub struct LengthArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A file with one prompt per line (default: the built-in prompts).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// The generation lengths, in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128,256", value_parser = parse_count::<usize>)]
    pub lengths: Vec<usize>,
    /// Interleaved runs per prompt and length (the median run's figures are kept).
    #[arg(long, default_value_t = 1, value_parser = parse_count::<u64>)]
    pub runs: u64,
    /// Compute, in milliseconds, each lane runs before the next takes its turn.
    #[arg(long, default_value_t = 2.0, value_parser = parse_turn_ms)]
    pub turn_ms: f64,
    /// The policies, comma-separated (default: the entry's policy, else speed).
    #[arg(long, value_delimiter = ',')]
    pub policy: Vec<PolicyKind>,
    /// Where the chart is written.
    #[arg(long, default_value = "sweep-lengths.svg")]
    pub chart: PathBuf,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &SweepArgs) -> anyhow::Result<()> {
    match &args.sweep {
        Sweep::Lengths(args) => lengths(args),
    }
}

fn lengths(args: &LengthArgs) -> anyhow::Result<()> {
    let prompts = super::bench::read_prompts(args.prompts.as_deref())?;
    let session = super::load_model(&args.model)?;
    let context = args.model.context;
    if let Some(&long) = args.lengths.iter().find(|&&n| n >= context) {
        anyhow::bail!("--lengths: {long} tokens do not fit the context of {context} tokens");
    }
    let options = DecodeOptions {
        max_tokens: 1,
        context,
        sampling: args.sampling.resolve(&session)?,
    };
    let policies = session.bench_policies(&args.policy);
    let turns = Turns {
        runs: args.runs as usize,
        turn: std::time::Duration::from_secs_f64(args.turn_ms / 1e3),
    };
    let prompts: Vec<String> = (prompts.iter())
        .map(|p| session.prompt(p))
        .collect::<Result<_, _>>()?;
    // A counter on a terminal; nothing in a pipe or a log.
    let terminal = std::io::stderr().is_terminal();
    let mut progress = |done: usize, total: usize| {
        if terminal {
            eprint!("\rspex sweep: run {done}/{total}");
        }
    };
    let sweep = sweep_lengths(
        &session.loaded,
        &prompts,
        (options, &args.lengths),
        (&policies, turns),
        &mut progress,
    )?;
    if terminal {
        eprintln!();
    }
    let machine = (session.loaded.backend.info().accelerator)
        .or_else(super::device::cpu_model)
        .unwrap_or_else(|| "an unknown CPU".into());
    let title = format!(
        "{} on {machine}: speedup against generation length",
        session.name
    );
    draw_lengths(&sweep, &title, &args.chart)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&sweep)?);
    } else {
        print_lengths(&sweep);
        println!("chart: {}", args.chart.display());
    }
    let failed = sweep.failed();
    if !failed.is_empty() {
        anyhow::bail!("{} output differs from baseline", failed.join(", "));
    }
    Ok(())
}

fn print_lengths(sweep: &LengthSweep) {
    let Some(first) = sweep.points.first() else {
        return;
    };
    let mut header = format!("{:>7} {:>9} {:>8}", "tokens", "base t/s", "ceiling");
    for p in &first.policies {
        header.push_str(&format!(" {:>14}", p.policy));
    }
    println!("{header}");
    for point in &sweep.points {
        let mut line = format!(
            "{:>7} {:>9.1} {:>7.2}×",
            point.max_tokens, point.baseline_tokens_per_sec, point.ceiling
        );
        for p in &point.policies {
            line.push_str(&format!(" {:>13.2}×", p.speedup));
        }
        println!("{line}");
    }
}

/// The policies' colours, in order (then again).
const COLOURS: [RGBColor; 5] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
];

/// Speedup (one line per policy) and the ceiling (dashed) against the generation length, on
/// a log₂ axis, written to `path` as an SVG of 1280 × 720.
fn draw_lengths(sweep: &LengthSweep, title: &str, path: &Path) -> anyhow::Result<()> {
    let chart_error = |e: &dyn std::fmt::Display| anyhow::anyhow!("{}: {e}", path.display());
    let log2 = |n: usize| (n as f64).log2();
    let xs: Vec<f64> = sweep.points.iter().map(|p| log2(p.max_tokens)).collect();
    let (x0, x1) = (xs[0] - 0.25, xs[xs.len() - 1] + 0.25);
    let ys = (sweep.points.iter())
        .flat_map(|p| std::iter::once(p.ceiling).chain(p.policies.iter().map(|q| q.speedup)));
    let top = ys.fold(1.0f64, f64::max) * 1.1;
    let root = SVGBackend::new(path, (1280, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_error(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 32))
        .margin(24)
        .x_label_area_size(64)
        .y_label_area_size(80)
        .build_cartesian_2d(x0..x1, 0.0..top)
        .map_err(|e| chart_error(&e))?;
    chart
        .configure_mesh()
        .x_desc("tokens generated")
        .y_desc("speedup over baseline (×)")
        .x_labels(xs.len())
        .x_label_formatter(&|x| format!("{}", 2f64.powf(*x).round()))
        .axis_desc_style(("sans-serif", 24))
        .label_style(("sans-serif", 20))
        .draw()
        .map_err(|e| chart_error(&e))?;
    draw_lines(&mut chart, &xs, sweep).map_err(|e| chart_error(&e))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 22))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| chart_error(&e))?;
    root.present().map_err(|e| chart_error(&e))?;
    Ok(())
}

/// The chart's axes: tokens (log₂) and speedup.
type Axes<'a> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The ceiling (dashed) and one line of dots per policy, with their legend entries.
fn draw_lines(
    chart: &mut Axes,
    xs: &[f64],
    sweep: &LengthSweep,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let ceiling: Vec<(f64, f64)> = xs
        .iter()
        .zip(&sweep.points)
        .map(|(&x, p)| (x, p.ceiling))
        .collect();
    let grey = RGBColor(90, 90, 90);
    chart
        .draw_series(DashedLineSeries::new(ceiling, 10, 6, grey.stroke_width(3)))?
        .label("ceiling")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], grey.stroke_width(3)));
    let count = sweep.points[0].policies.len();
    for k in 0..count {
        let colour = COLOURS[k % COLOURS.len()];
        let line: Vec<(f64, f64)> = (xs.iter().zip(&sweep.points))
            .map(|(&x, p)| (x, p.policies[k].speedup))
            .collect();
        let style = colour.stroke_width(4);
        chart
            .draw_series(LineSeries::new(line.clone(), style))?
            .label(sweep.points[0].policies[k].policy.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
        chart.draw_series(line.into_iter().map(|p| Circle::new(p, 6, colour.filled())))?;
    }
    Ok(())
}
