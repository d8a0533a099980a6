//! `spex sweep policies`: every policy's speedup on each model, one bench per model
//! (`harness::sweep::policy_point`), as a table (or `--json`) and a bar chart: SPEED against
//! dual, LoopSpec and draft-then-verify on the same model and machine.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;

use super::chart::{BarChart, draw_bars};
use super::{ModelArgs, SamplingArgs, parse_count};
use crate::engine::PolicyKind;
use crate::harness::bench::{Lineup, Turns};
use crate::harness::sweep::{ModelPoint, NamedModel, policy_point};

/// `spex sweep policies`.
#[derive(Debug, Args)]
pub struct PolicyArgs {
    /// The models, comma-separated: models.toml entries or checkpoint directories.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shakespeare-r4k6-sync,shakespeare-r4k6,shakespeare-r4k4"
    )]
    pub models: Vec<String>,
    /// How every model is loaded (its `--model` is `--models`').
    #[command(flatten)]
    pub load: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub lanes: super::LaneArgs,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = super::DEFAULT_MAX_TOKENS, value_parser = parse_count::<usize>)]
    pub max_tokens: usize,
    /// The policies, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "speed,dual,loopspec,self-draft"
    )]
    pub policy: Vec<PolicyKind>,
    /// Chart tokens per second, each model's baseline beside its policies, instead of
    /// speedups: models of different depths side by side.
    #[arg(long)]
    pub tokens_per_sec: bool,
    /// Where the chart is written (an SVG).
    #[arg(long, value_name = "FILE", default_value = "sweep-policies.svg")]
    pub svg: PathBuf,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &PolicyArgs) -> anyhow::Result<()> {
    if args.load.model.is_some() {
        anyhow::bail!("--model: the policy sweep names its models with --models");
    }
    let prompts = args.lanes.read_prompts()?;
    let turns = args.lanes.turns();
    let (points, machine) = measure_models(args, &prompts, turns)?;
    let chart = match args.tokens_per_sec {
        true => rate_chart(
            &points,
            format!("tokens/s on {machine}, {} tokens", args.max_tokens),
        ),
        false => policy_chart(
            &points,
            format!("speedup by policy on {machine}, {} tokens", args.max_tokens),
        ),
    };
    draw_bars(&chart, &args.svg)?;
    let failed: Vec<String> = (points.iter())
        .flat_map(|m| {
            (m.policies.iter().filter(|p| p.failed()))
                .map(|p| format!("{} on {}", p.policy, m.model))
        })
        .collect();
    let print = || print_policies(&points);
    super::chart::report_sweep(&points, args.json, &args.svg, print, &failed)
}

/// Every model of `args.models` loaded in turn and raced on `prompts`, with progress on a
/// terminal's stderr; returns the points and the machine they ran on.
fn measure_models(
    args: &PolicyArgs,
    prompts: &[String],
    turns: Turns,
) -> anyhow::Result<(Vec<ModelPoint>, String)> {
    let terminal = std::io::stderr().is_terminal();
    let (mut points, mut machine) = (Vec::with_capacity(args.models.len()), String::new());
    for (m, model) in args.models.iter().enumerate() {
        let load = ModelArgs {
            model: Some(model.clone()),
            ..args.load.clone()
        };
        let session = super::load_model(&load, &args.policy)?;
        machine = super::device::machine_name(&session.loaded);
        let options = load.decode_options(args.max_tokens, args.sampling.resolve(&session)?);
        let prompts: Vec<String> = (prompts.iter())
            .map(|p| session.prompt(p))
            .collect::<Result<_, _>>()?;
        let mut progress = |done: usize| {
            if terminal {
                eprint!(
                    "\rspex sweep: model {}/{}, prompt {done}/{}",
                    m + 1,
                    args.models.len(),
                    prompts.len()
                );
            }
        };
        let lineup = Lineup {
            policies: &args.policy,
            turns,
        };
        let model = NamedModel {
            name: &session.name,
            loaded: &session.loaded,
        };
        points.push(policy_point(
            model,
            &prompts,
            options,
            lineup,
            &mut progress,
        )?);
    }
    if terminal {
        eprintln!();
    }
    Ok((points, machine))
}

fn print_policies(points: &[ModelPoint]) {
    let Some(first) = points.first() else {
        return;
    };
    let mut header = format!(
        "{:<24} {:>4} {:>9} {:>8}",
        "model", "K·R", "base t/s", "ceiling"
    );
    for p in &first.policies {
        header.push_str(&format!(" {:>14} {:>7}", p.policy, "t/s"));
    }
    println!("{header}");
    for point in points {
        let mut line = format!(
            "{:<24} {:>4} {:>9.1} {:>7.2}×",
            point.model, point.layer_applications, point.baseline_tokens_per_sec, point.ceiling
        );
        for p in &point.policies {
            line.push_str(&format!(" {:>13.2}× {:>7.1}", p.speedup, p.tokens_per_sec));
        }
        println!("{line}");
    }
}

/// A group's name: the model and the layers a token goes through.
fn group_name(m: &ModelPoint) -> String {
    format!("{} (K·R = {})", m.model, m.layer_applications)
}

/// Bars of tokens per second, grouped by model: its baseline, then each policy.
fn rate_chart(points: &[ModelPoint], title: String) -> BarChart {
    let policies = (points.first().into_iter()).flat_map(|m| m.policies.iter());
    BarChart {
        title,
        y_desc: "tokens per second",
        groups: points.iter().map(group_name).collect(),
        bars: std::iter::once("baseline".to_string())
            .chain(policies.map(|p| p.policy.clone()))
            .collect(),
        values: (points.iter())
            .map(|m| {
                let rates = m.policies.iter().map(|p| p.tokens_per_sec);
                std::iter::once(m.baseline_tokens_per_sec)
                    .chain(rates)
                    .collect()
            })
            .collect(),
        marks: Vec::new(),
        mark_name: "",
    }
}

/// Bars of each policy's speedup, grouped by model, with each model's ceiling.
fn policy_chart(points: &[ModelPoint], title: String) -> BarChart {
    BarChart {
        title,
        y_desc: "speedup over baseline (×)",
        groups: points.iter().map(group_name).collect(),
        bars: (points.first().into_iter())
            .flat_map(|m| m.policies.iter().map(|p| p.policy.clone()))
            .collect(),
        values: (points.iter())
            .map(|m| m.policies.iter().map(|p| p.speedup).collect())
            .collect(),
        marks: points.iter().map(|m| m.ceiling).collect(),
        mark_name: "ceiling",
    }
}
