//! `spex sweep lengths`: the bench at several generation lengths, as a table (or `--json`)
//! and a chart of speedup and ceiling against length, an SVG drawn with plotters at slide
//! size (1280 × 720).

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::{ModelArgs, SamplingArgs, parse_count};
use crate::engine::PolicyKind;
use crate::harness::bench::Lineup;
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
    /// The ceiling against model size (random bf16 checkpoints of Ouro's proportions, up to
    /// Ouro-1.4B's shape), beside the roofline's bound from the machine's measured read
    /// bandwidth and multiply-add rate.
    Sizes(super::sweep_sizes::SizeArgs),
    /// Every policy's speedup on each model (default: the shipped ones), as bars.
    Policies(super::sweep_policies::PolicyArgs),
    /// LOSSY early exit's speedup against how much of the baseline's text it keeps, every
    /// rule over its settings, beside a lossless policy.
    Exits(super::sweep_exits::ExitArgs),
}

/// `spex sweep lengths`.
#[derive(Debug, Args)]
pub struct LengthArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub lanes: super::LaneArgs,
    /// The generation lengths, in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128,256", value_parser = parse_count::<usize>)]
    pub lengths: Vec<usize>,
    /// The policies, comma-separated (default: the entry's policy, else speed).
    #[arg(long, value_delimiter = ',')]
    pub policy: Vec<PolicyKind>,
    /// Where the chart is written (an SVG).
    #[arg(long, value_name = "FILE", default_value = "sweep-lengths.svg")]
    pub svg: PathBuf,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &SweepArgs) -> anyhow::Result<()> {
    let chart = match &args.sweep {
        Sweep::Lengths(args) => &args.svg,
        Sweep::Sizes(args) => &args.svg,
        Sweep::Policies(args) => &args.svg,
        Sweep::Exits(args) => &args.svg,
    };
    // Checked before the sweep runs, not after it.
    crate::engine::files::check_writable(chart, "--svg")?;
    match &args.sweep {
        Sweep::Lengths(args) => lengths(args),
        Sweep::Sizes(args) => super::sweep_sizes::run(args),
        Sweep::Policies(args) => super::sweep_policies::run(args),
        Sweep::Exits(args) => super::sweep_exits::run(args),
    }
}

fn lengths(args: &LengthArgs) -> anyhow::Result<()> {
    let prompts = args.lanes.read_prompts()?;
    let session = super::load_model(&args.model, &args.policy)?;
    let context = args.model.context;
    if let Some(&long) = args.lengths.iter().find(|&&n| n >= context) {
        anyhow::bail!("--lengths: {long} tokens do not fit the context of {context} tokens");
    }
    // Each length's `max_tokens`, set by `sweep_lengths`.
    let options = (args.model).decode_options(1, args.sampling.resolve(&session)?);
    let policies = session.bench_policies(&args.policy);
    let turns = args.lanes.turns();
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
        options,
        &args.lengths,
        Lineup {
            policies: &policies,
            turns,
        },
        &mut progress,
    )?;
    if terminal {
        eprintln!();
    }
    let title = format!(
        "{} on {}: speedup against generation length",
        session.name,
        super::device::machine_name(&session.loaded)
    );
    super::chart::draw(&length_chart(&sweep, title), &args.svg)?;
    super::chart::report_sweep(
        &sweep,
        args.json,
        &args.svg,
        || print_lengths(&sweep),
        &sweep.failed(),
    )
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

/// The length sweep's chart: the ceiling (dashed) and each policy's speedup.
fn length_chart(sweep: &LengthSweep, title: String) -> super::chart::Chart {
    let line = |f: &dyn Fn(&crate::harness::sweep::LengthPoint) -> f64| -> Vec<(f64, f64)> {
        (sweep.points.iter())
            .map(|p| (p.max_tokens as f64, f(p)))
            .collect()
    };
    let mut series = vec![super::chart::Series {
        name: "ceiling".into(),
        points: line(&|p| p.ceiling),
        dashed: true,
    }];
    let names = sweep
        .points
        .first()
        .map(|p| p.policies.iter().map(|q| q.policy.clone()));
    for (k, name) in names.into_iter().flatten().enumerate() {
        series.push(super::chart::Series {
            name,
            points: line(&|p| p.policies[k].speedup),
            dashed: false,
        });
    }
    super::chart::Chart {
        title,
        x_desc: "tokens generated",
        y_desc: "speedup over baseline (×)",
        x_axis: super::chart::XAxis::Log2,
        series,
    }
}
