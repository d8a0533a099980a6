//! `spex train-gate`: trains a checkpoint's exit gate alone (`train::gate`) and prints how
//! it predicts, per pass, whether that pass already agrees with pass R.

use std::path::PathBuf;

use clap::Args;

use crate::train::gate::{GateFit, GateReport, GateScore, GateTraining, train_gate};

/// `spex train-gate`.
#[derive(Debug, Args)]
pub struct TrainGateArgs {
    /// The checkpoint directory whose gate is trained (read, not changed).
    #[arg(long)]
    pub model: PathBuf,
    /// Corpus text files.
    #[arg(long, num_args = 1.., required = true)]
    pub corpus: Vec<PathBuf>,
    /// Corpus files (by name) held out for the score, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "macbeth_gut.txt,twelfth_night_gut.txt"
    )]
    pub held_out: Vec<String>,
    /// Training windows, cut evenly from the training files.
    #[arg(long, default_value_t = 48, value_parser = super::parse_count::<usize>)]
    pub windows: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 256, value_parser = super::parse_count::<usize>)]
    pub seq_len: usize,
    /// Full-batch Adam steps.
    #[arg(long, default_value_t = 300, value_parser = super::parse_count::<usize>)]
    pub steps: usize,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    /// Where the checkpoint is written with its new gate (a new directory).
    #[arg(long)]
    pub out: PathBuf,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &TrainGateArgs) -> anyhow::Result<()> {
    if !(args.lr.is_finite() && args.lr > 0.0) {
        anyhow::bail!("--lr {}: a learning rate is a positive number", args.lr);
    }
    let report = train_gate(&GateTraining {
        model: &args.model,
        corpus: &args.corpus,
        held_out: &args.held_out,
        windows: args.windows,
        seq_len: args.seq_len,
        fit: GateFit {
            steps: args.steps,
            lr: args.lr,
        },
        out: &args.out,
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
        println!("checkpoint with the trained gate: {}", args.out.display());
    }
    Ok(())
}

fn print_report(report: &GateReport) {
    println!(
        "{} training examples, {} held out (a position at each pass before R)",
        report.train_examples, report.held_out_examples
    );
    let row = |name: &str, s: &GateScore| {
        let percent = |v: &[f64]| -> String {
            let cells: Vec<String> = v.iter().map(|x| format!("{:.0}%", 100.0 * x)).collect();
            cells.join(" ")
        };
        println!(
            "{name:<20} cross-entropy {:.3}  agree with pass R [{}]  mean λ [{}]  right [{}]",
            s.cross_entropy,
            percent(&s.agreement_per_pass),
            percent(&s.mean_lambda_per_pass),
            percent(&s.accuracy_per_pass)
        );
    };
    if let Some(before) = &report.before {
        row("held out, before", before);
    }
    row("training, after", &report.train);
    row("held out, after", &report.held_out);
}
