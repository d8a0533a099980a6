//! Command-line parsing and the headless commands (`generate`, `bench`, `random-checkpoint`).
//! `main` calls [`run`]; the dashboard and the trainer are reached from here too.

mod bench;
mod generate;
pub mod models;
mod train;

use std::path::PathBuf;

use candle_core::{DType, Device};
use clap::{Args, Parser, Subcommand};

use crate::engine::policy::PolicyKind;
use crate::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use crate::engine::{EngineError, LoadedModel};

/// spex: speculative pipelined decoding on looped language models.
#[derive(Debug, Parser)]
#[command(name = "spex", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// With no subcommand: the dashboard's options.
    #[command(flatten)]
    pub dashboard: TuiArgs,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream generated text for a prompt.
    Generate(GenerateArgs),
    /// Run baseline and SPEED on prompts in one process and compare them.
    Bench(BenchArgs),
    /// Write a random checkpoint in the Ouro format (for tests and benchmarks).
    RandomCheckpoint(RandomArgs),
    /// Train a looped model in the Ouro format.
    Train(train::TrainArgs),
    /// Open the dashboard (what `spex` with no subcommand does).
    Tui(TuiArgs),
}

/// Which model to load and how.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A checkpoint directory or a models.toml entry name (default: models.toml's default).
    #[arg(long)]
    pub model: Option<String>,
    /// KV cache capacity in positions.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
}

/// `spex generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// speed or baseline.
    #[arg(long, default_value = "speed")]
    pub policy: PolicyKind,
    /// Tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// One JSON object per event instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `spex bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A file with one prompt per line (default: the built-in prompts).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `spex tui` (and `spex` alone).
#[derive(Debug, Clone, Args)]
pub struct TuiArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Start this prompt at once.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Tokens to generate per run.
    #[arg(long, default_value_t = 200)]
    pub max_tokens: usize,
    /// Frames per second of the dashboard.
    #[arg(long, default_value_t = 30)]
    pub fps: u32,
}

/// `spex random-checkpoint`.
#[derive(Debug, Args)]
pub struct RandomArgs {
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// K, the shared layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// R, the passes.
    #[arg(long, default_value_t = 4)]
    pub passes: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Target tokenizer vocabulary (a few KB of text caps what BPE can learn; the config's
    /// vocab_size is padded up to this).
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    #[arg(long, default_value_t = 2048)]
    pub context: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Parses the command line and runs it.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Some(Command::Generate(args)) => generate::run(&args),
        Some(Command::Bench(args)) => bench::run(&args),
        Some(Command::RandomCheckpoint(args)) => random_checkpoint(&args),
        Some(Command::Train(args)) => train::run(&args),
        Some(Command::Tui(args)) => dashboard(&args),
        None => dashboard(&cli.dashboard),
    }
}

/// Loads the model named by `args` on the CPU in f32.
pub fn load_model(args: &ModelArgs) -> Result<LoadedModel, EngineError> {
    let dir = models::resolve(args.model.as_deref())?;
    LoadedModel::load(&dir, &Device::Cpu, DType::F32)
}

fn dashboard(args: &TuiArgs) -> anyhow::Result<()> {
    crate::tui::require_tty().map_err(anyhow::Error::msg)?;
    let loaded = load_model(&args.model)?;
    let name = args.model.model.clone().unwrap_or_else(|| {
        loaded
            .checkpoint
            .dir
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let info = crate::tui::app::ModelInfo {
        name,
        passes: loaded.model.passes(),
        layers: loaded.model.config.num_hidden_layers,
        device: "cpu".into(),
        dtype: "f32".into(),
        policy: "speed".into(),
    };
    let options = crate::tui::DashboardOptions {
        prompt: args.prompt.clone(),
        decode: crate::engine::DecodeOptions {
            max_tokens: args.max_tokens,
            context: args.model.context,
        },
        info,
        frame_interval: std::time::Duration::from_secs_f64(1.0 / f64::from(args.fps.max(1))),
    };
    crate::tui::run(&loaded, options)
}

fn random_checkpoint(args: &RandomArgs) -> anyhow::Result<()> {
    let spec = RandomSpec {
        hidden: args.hidden,
        layers: args.layers,
        passes: args.passes,
        heads: args.heads,
        kv_heads: args.kv_heads.unwrap_or(args.heads),
        head_dim: args.hidden / args.heads.max(1),
        intermediate: args.intermediate.unwrap_or(args.hidden * 11 / 4),
        vocab: args.vocab,
        context: args.context,
        tied: true,
        sharded: false,
        early_exit_gate: false,
        dtype: DType::F32,
        seed: args.seed,
        pad_vocab_to: Some(args.vocab),
    };
    let config = write_random_checkpoint(&args.out, &spec)?;
    println!(
        "wrote {}: hidden {} K={} R={} vocab {}",
        args.out.display(),
        config.hidden_size,
        config.num_hidden_layers,
        config.total_ut_steps,
        config.vocab_size
    );
    Ok(())
}
