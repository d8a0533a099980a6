//! `spex explain FILE|DIR… [--what-if POLICY,…]`: the misprediction explorer over recorded
//! traces, and what other policies would have done on the same runs, as tables or JSON.

use std::path::PathBuf;

use clap::Args;

use serde::Serialize;

use crate::engine::{EngineError, PolicyKind};
use crate::harness::explain::Explanation;
use crate::harness::trace::Trace;
use crate::harness::what_if::{RecordedRun, StepCosts, WhatIf, WhatIfDraft, step_samples};

/// `spex explain`.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// Trace files, or directories of them (every `.jsonl` inside, e.g. a `bench --record-dir`
    /// directory).
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// How many of the most frequent disagreements to list.
    #[arg(long, default_value_t = 20)]
    pub top: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    // The list of policies comes from the policy table (`engine::policy::POLICIES`).
    #[arg(long = "what-if", value_delimiter = ',', value_name = "POLICY", help = what_if_help())]
    pub what_if: Vec<PolicyKind>,
    /// Time the what-if steps by the step costs fitted to this trace's steps instead of each
    /// run's own: any trace, of any model and machine (one recorded at Ouro-1.4B's shape on
    /// a GPU, say), projects the recorded runs' policies onto it.
    #[arg(long, value_name = "TRACE", requires = "what_if")]
    pub step_costs: Option<PathBuf>,
    /// The draft model the `draft` policy's what-if drafts with (a models.toml entry or a
    /// checkpoint directory; its cost per token is measured on this machine).
    #[arg(long, value_name = "NAME", requires = "what_if")]
    pub draft_model: Option<String>,
}

/// The JSON `spex explain --json` prints.
#[derive(Debug, Serialize)]
struct Report {
    /// The traces read, in order: an occurrence's `trace` indexes this list.
    files: Vec<PathBuf>,
    #[serde(flatten)]
    explanation: Explanation,
    #[serde(skip_serializing_if = "Option::is_none")]
    what_if: Option<WhatIf>,
}

pub fn run(args: &ExplainArgs) -> anyhow::Result<()> {
    let mut traces = Vec::new();
    let mut runs = Vec::new();
    let files = trace_files(&args.traces)?;
    for path in &files {
        let trace = Trace::read(path)?;
        if let Some(line) = trace.cut_line {
            eprintln!(
                "spex: {}: line {line} was cut short; using the lines before it",
                path.display()
            );
        }
        if !args.what_if.is_empty() {
            runs.push(RecordedRun::of(&trace, path)?);
        }
        traces.push(trace);
    }
    let what_if = match args.what_if.is_empty() {
        true => None,
        false => {
            let draft = match &args.draft_model {
                Some(name) => {
                    let session = super::load_model(&super::ModelArgs::named(name), &[])?;
                    Some(WhatIfDraft::measured(session.loaded)?)
                }
                None => None,
            };
            let costs = step_costs(args)?;
            Some(WhatIf::timed(runs, &args.what_if, costs, draft.as_ref())?)
        }
    };
    let report = Report {
        files,
        explanation: Explanation::of(&traces, args.top),
        what_if,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&report.explanation, &report.files);
        if let Some(w) = &report.what_if {
            print_what_if(w);
        }
    }
    Ok(())
}

/// The step costs of `--step-costs`' trace, if given; an error names a trace with no steps.
fn step_costs(args: &ExplainArgs) -> anyhow::Result<Option<StepCosts>> {
    let Some(path) = &args.step_costs else {
        return Ok(None);
    };
    let samples = step_samples(&Trace::read(path)?);
    if samples.is_empty() {
        anyhow::bail!("{}: the trace holds no decode step to time", path.display());
    }
    Ok(Some(StepCosts::fit(&samples)))
}

fn print_what_if(w: &WhatIf) {
    let costs = match &w.step_costs {
        Some(c) => format!(
            "steps timed as {:.1} µs + {:.1} µs per extra row",
            c.one_row_us, c.extra_row_us
        ),
        None => "step costs fitted to each run's recorded steps".into(),
    };
    println!(
        "what-if over {} recorded runs, {} tokens ({costs}):",
        w.runs, w.tokens
    );
    println!(
        "  {:<20} {:>7} {:>9} {:>10} {:>8}  {:>14}",
        "policy", "steps", "rows/step", "decode ms", "speedup", "recorded steps"
    );
    for f in &w.forecasts {
        let recorded = f.recorded_steps.map_or_else(String::new, |r| r.to_string());
        println!(
            "  {:<20} {:>7} {:>9.2} {:>10.1} {:>7.2}×  {:>14}",
            f.policy,
            f.steps,
            f.rows_per_step,
            f.decode_us / 1e3,
            f.speedup,
            recorded
        );
    }
}

/// `--what-if`'s help, listing every policy the table holds.
fn what_if_help() -> String {
    format!(
        "Replay the recorded greedy runs under these policies too, comma-separated ({}): the \
         steps each takes, and its speedup predicted from the step costs the run measured. The \
         runs must have read out every pass (speed or dual)",
        crate::engine::policy::forms(|row| !row.is_lossy())
    )
}

/// The files named, with directories replaced by their `.jsonl` files in name order.
fn trace_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, EngineError> {
    let mut files = Vec::new();
    for path in paths {
        if !path.is_dir() {
            files.push(path.clone());
            continue;
        }
        let listing = std::fs::read_dir(path).map_err(|e| EngineError::file(path, e))?;
        let mut inside: Vec<PathBuf> = listing
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        if inside.is_empty() {
            return Err(EngineError::file(
                path,
                "no .jsonl traces in this directory",
            ));
        }
        inside.sort();
        files.extend(inside);
    }
    Ok(files)
}

fn print(e: &Explanation, files: &[PathBuf]) {
    let readouts: usize = e.by_pass.iter().map(|t| t.readouts).sum();
    println!(
        "{} traces, {} committed positions, {readouts} readouts before pass R",
        e.traces, e.positions
    );
    let by_pass: Vec<String> = (e.by_pass.iter().enumerate())
        .map(|(i, t)| format!("pass {} {:.1}% of {}", i + 1, 100.0 * t.rate(), t.readouts))
        .collect();
    println!(
        "disagreement with the committed token: {}",
        by_pass.join(" · ")
    );
    if !e.by_exit_gate.is_empty() {
        let buckets: Vec<String> = (e.by_exit_gate.iter())
            .filter(|b| b.tally.readouts > 0)
            .map(|b| {
                let (low, high, t) = (b.low, b.high, b.tally);
                format!("{low}–{high} {:.1}% of {}", 100.0 * t.rate(), t.readouts)
            })
            .collect();
        println!(
            "by the exit gate's λ after the pass: {}",
            buckets.join(" · ")
        );
    }
    println!("by the committed token's class:");
    for (class, t) in &e.by_class {
        let name = format!("{class:?}");
        println!("  {name:<12} {:>5.1}% of {}", 100.0 * t.rate(), t.readouts);
    }
    println!(
        "disagreeing readouts: mean margin {:.2} logits, probability {:.2}; agreeing: {:.2}, {:.2}",
        e.disagreeing.mean_margin,
        e.disagreeing.mean_prob,
        e.agreeing.mean_margin,
        e.agreeing.mean_prob
    );
    println!("most frequent: pass r said X, the committed token was Y");
    println!(
        "  {:>6}  {:>4}  {:<16} {:<16} first seen",
        "count", "pass", "said", "committed"
    );
    for p in &e.pairs {
        let first = p.occurrences.first().map_or_else(String::new, |o| {
            let file = files.get(o.trace).and_then(|f| f.file_name());
            let file = file.map_or_else(String::new, |f| f.to_string_lossy().into_owned());
            format!("{file} step {}", o.step)
        });
        println!(
            "  {:>6}  {:>4}  {:<16} {:<16} {first}",
            p.count,
            p.pass,
            format!("{:?}", p.said.text),
            format!("{:?}", p.committed.text)
        );
    }
}
