//! `spex sweep exits`: lossy early exit's speedup against how much of the baseline's text it
//! keeps, every rule over its settings (`harness::sweep::sweep_exits`), with a lossless
//! policy's point on the same chart: the answer to "why not just exit early?" on one model
//! and machine.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;

use super::chart::{Chart, Series, XAxis, draw};
use super::{ModelArgs, SamplingArgs, parse_count};
use crate::engine::PolicyKind;
use crate::engine::exit_gate::ExitThreshold;
use crate::harness::bench::Lineup;
use crate::harness::sweep::{ExitSettings, ExitSweep, exit_lanes, sweep_exits};

/// `spex sweep exits`.
#[derive(Debug, Args)]
pub struct ExitArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub lanes: super::LaneArgs,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = super::DEFAULT_MAX_TOKENS, value_parser = parse_count::<usize>)]
    pub max_tokens: usize,
    /// The lossless policy drawn beside the exits (default: the entry's, else speed).
    #[arg(long)]
    pub policy: Option<PolicyKind>,
    /// The top-1 probabilities `exit:confidence=P` is raced at, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.5,0.7,0.8,0.9,0.95,0.99"
    )]
    pub confidence: Vec<f32>,
    /// The thresholds `exit:gate=T` is raced at where the model has an exit gate.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3,0.5,0.7,0.9")]
    pub gate: Vec<ExitThreshold>,
    /// Where the chart is written (an SVG).
    #[arg(long, value_name = "FILE", default_value = "sweep-exits.svg")]
    pub svg: PathBuf,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &ExitArgs) -> anyhow::Result<()> {
    let prompts = args.lanes.read_prompts()?;
    let asked: Vec<PolicyKind> = args.policy.into_iter().collect();
    let session = super::load_model(&args.model, &asked)?;
    let lossless = match session.bench_policies(&asked).first() {
        Some(&policy) => policy,
        None => PolicyKind::Speed,
    };
    if lossless.is_lossy() {
        anyhow::bail!(
            "--policy {lossless}: the exit sweep draws a lossless policy beside the exits"
        );
    }
    let settings = ExitSettings {
        confidences: args.confidence.clone(),
        gate_thresholds: args.gate.clone(),
    };
    let loaded = &session.loaded;
    let has_gate = loaded.model().weights.exit_gate.is_some();
    let mut policies = exit_lanes(loaded.model().passes(), has_gate, &settings);
    policies.push(lossless);
    let options = (args.model).decode_options(args.max_tokens, args.sampling.resolve(&session)?);
    let prompts: Vec<String> = (prompts.iter())
        .map(|p| session.prompt(p))
        .collect::<Result<_, _>>()?;
    let terminal = std::io::stderr().is_terminal();
    let total = prompts.len();
    let mut progress = |done: usize| {
        if terminal {
            eprint!("\rspex sweep: prompt {done}/{total}");
        }
    };
    let lineup = Lineup {
        policies: &policies,
        turns: args.lanes.turns(),
    };
    let sweep = sweep_exits(loaded, &prompts, options, lineup, &mut progress)?;
    if terminal {
        eprintln!();
    }
    let title = format!(
        "{} on {}: lossy early exit against {lossless}, {} tokens",
        session.name,
        super::device::machine_name(loaded),
        args.max_tokens
    );
    draw(&exit_chart(&sweep, title), &args.svg)?;
    let print = || print_exits(&sweep);
    super::chart::report_sweep(&sweep, args.json, &args.svg, print, &sweep.failed())
}

fn print_exits(sweep: &ExitSweep) {
    println!(
        "{} prompts, baseline {:.1} tok/s",
        sweep.prompts, sweep.baseline_tokens_per_sec
    );
    println!(
        "{:<22} {:>8} {:>9} {:>9} {:>13}",
        "policy", "speedup", "agree", "departed", "passes/token"
    );
    for p in &sweep.points {
        let passes = p.passes_per_token.map_or("—".into(), |n| format!("{n:.2}"));
        let kind = if p.lossy { "lossy" } else { "lossless" };
        println!(
            "{:<22} {:>7.2}× {:>8.1}% {:>5}/{:<3} {:>13}  {kind}",
            p.policy,
            p.speedup,
            100.0 * p.agreement,
            p.departed,
            sweep.prompts,
            passes
        );
    }
}

/// Speedup against agreement: one line per exit rule through its settings, the lossless
/// policy as its own point at 100 %, and the baseline's 1× dashed.
fn exit_chart(sweep: &ExitSweep, title: String) -> Chart {
    let mut families: Vec<&str> = Vec::new();
    for p in &sweep.points {
        if !families.contains(&p.family.as_str()) {
            families.push(&p.family);
        }
    }
    let mut series: Vec<Series> = families
        .into_iter()
        .map(|family| {
            let mut points: Vec<(f64, f64)> = (sweep.points.iter())
                .filter(|p| p.family == family)
                .map(|p| (100.0 * p.agreement, p.speedup))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let lossy = sweep.points.iter().any(|p| p.family == family && p.lossy);
            Series {
                name: match lossy {
                    true => format!("{family} (lossy)"),
                    false => format!("{family} (lossless)"),
                },
                points,
                dashed: false,
            }
        })
        .collect();
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let left = xs.fold(100.0f64, f64::min);
    series.push(Series {
        name: "baseline".into(),
        points: vec![(left, 1.0), (100.0, 1.0)],
        dashed: true,
    });
    Chart {
        title,
        x_desc: "baseline tokens kept at the same index (%)",
        y_desc: "speedup over baseline (×)",
        x_axis: XAxis::Percent,
        series,
    }
}
