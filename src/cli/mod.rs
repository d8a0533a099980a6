//! Command-line parsing and the headless commands (`generate`, `bench`, `random-checkpoint`).
//! `main` calls [`run`]; the dashboard and the trainer are reached from here too.

mod bench;
mod chart;
pub mod device;
mod explain;
mod generate;
pub mod hub;
mod load_bar;
pub mod models;
mod quantize;
pub mod random;
mod record;
mod replay;
mod session;
mod sweep;
mod sweep_exits;
mod sweep_policies;
mod sweep_sizes;
mod train;
mod train_gate;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::engine::exit_gate::ExitThreshold;
use crate::engine::kernels::Prefetch;
use crate::engine::model::KvDtype;
use crate::engine::policy::{self as policy_table, PolicyKind};
use crate::engine::{DecodeOptions, EngineError, Sampling};
use session::model_label;
pub use session::{Session, load_model, load_model_with};

/// spex: speculative pipelined decoding on looped language models.
///
/// The flags before a subcommand are the dashboard's (`spex --model M`); with a subcommand they
/// are refused, never silently ignored: `spex --model M bench` is one line saying so.
#[derive(Debug, Parser)]
#[command(name = "spex", version, about, args_conflicts_with_subcommands = true)]
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
    RandomCheckpoint(random::RandomArgs),
    /// Write a checkpoint as a quantized GGUF file in llama.cpp's Ouro layout.
    Quantize(quantize::QuantizeArgs),
    /// Train a looped model in the Ouro format.
    Train(train::TrainArgs),
    /// Train a checkpoint's exit gate alone, the other weights frozen, and write a copy.
    TrainGate(train_gate::TrainGateArgs),
    /// Open the dashboard (what `spex` with no subcommand does).
    Tui(TuiArgs),
    /// Replay a recorded trace in the dashboard, with no model loaded.
    Replay(replay::ReplayArgs),
    /// Where early passes disagreed with the committed tokens, over recorded traces.
    Explain(explain::ExplainArgs),
    /// The bench over a varying quantity, as a table and an SVG chart (for slides).
    Sweep(sweep::SweepArgs),
    /// Draw a recorded run's dashboard at one step as an SVG picture (for slides).
    Snapshot(replay::SnapshotArgs),
    /// List the models of models.toml and whether each is on this machine.
    Models,
    /// Download a models.toml entry (or ORG/NAME) into the hub cache.
    Pull {
        /// Entry name or ORG/NAME repo id.
        name: String,
        /// A branch, tag or 40-hex commit (default: the entry's `revision`, else `main`).
        #[arg(long)]
        revision: Option<String>,
        /// The one weights file to fetch from a repo that holds many, like `NAME.Q4_K_M.gguf`
        /// (default: the entry's `file`, else the repo's safetensors checkpoint).
        #[arg(long)]
        file: Option<String>,
    },
}

/// Which model to load and how.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A models.toml entry name, a checkpoint directory or an ORG/NAME hub repo id
    /// (default: models.toml's default entry).
    #[arg(long)]
    pub model: Option<String>,
    /// KV cache capacity in positions (prompt plus output); sizes the cache's memory.
    #[arg(long, default_value_t = crate::engine::decoder::DEFAULT_CONTEXT)]
    pub context: usize,
    /// auto, cpu, cuda, cuda:N or metal (default: the entry's, else auto).
    #[arg(long)]
    pub device: Option<device::DeviceSpec>,
    /// f32, bf16 or f16 (default: the entry's, else the checkpoint's stored type). On the CPU,
    /// spex's kernels read bf16 and f16 weights as stored; f32 widens them.
    #[arg(long)]
    pub dtype: Option<device::DTypeSpec>,
    /// Decode through candle's ops even on the CPU (the GPU path's code; slower), not spex's
    /// kernels.
    #[arg(long)]
    pub candle_ops: bool,
    /// Use only the local hub cache (also HF_HUB_OFFLINE=1).
    #[arg(long)]
    pub offline: bool,
    /// Wrap the prompt in the chat template (default: the entry's `chat`).
    #[arg(long)]
    pub chat: bool,
    /// Proposal readouts through the f32 LM head instead of its f16 copy (CPU; commits are
    /// exact either way).
    #[arg(long)]
    pub f32_proposals: bool,
    /// The CPU KV cache's element type: f16 (half the bytes each attention row reads) or f32
    /// (equal to a full-precision forward). Both lanes of a race use the same.
    #[arg(long, value_enum, default_value_t = KvCacheArg::F16)]
    pub kv_cache: KvCacheArg,
    /// The CPU kernels' instruction set: auto (the best this CPU has), avx512bf16, avx512,
    /// avx2, neon (aarch64) or portable (a lower one measures it on this machine).
    #[arg(long, value_enum, default_value_t = IsaArg::Auto)]
    pub isa: IsaArg,
    /// The draft model of the `draft` policy: a models.toml entry or checkpoint directory with
    /// the same tokenizer (default: the entry's `draft`, if any).
    #[arg(long)]
    pub draft_model: Option<String>,
    /// Threads a CPU decode step is split over (both lanes of a race or bench use the same;
    /// default and most: the physical cores this process may use).
    #[arg(long)]
    pub threads: Option<usize>,
    /// How the CPU kernels prefetch weights: auto (each plan timed on the model's own steps
    /// when it loads) or one plan for every product.
    #[arg(long, value_enum, default_value_t = PrefetchArg::AUTO)]
    pub prefetch: PrefetchArg,
    /// The cumulative exit probability in (0, 1] at which Ouro's exit gate stops a token:
    /// what the pipeline panel marks and `exit:gate` (without `=T`) acts on (default: the
    /// checkpoint's `early_exit_threshold`, else 1, every pass).
    #[arg(long, value_name = "T")]
    pub exit_threshold: Option<ExitThreshold>,
}

/// `--prefetch`: `auto` (`None`: the plans are timed at load) or one of
/// [`Prefetch::CANDIDATES`], by its name. Its values are the candidates', so a new plan is a
/// new value with no second list here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchArg(Option<Prefetch>);

impl PrefetchArg {
    /// `auto`.
    pub const AUTO: Self = Self(None);
    /// `auto`, then every candidate in order.
    const ALL: [Self; 1 + Prefetch::CANDIDATES.len()] = {
        let mut all = [Self::AUTO; 1 + Prefetch::CANDIDATES.len()];
        let mut i = 0;
        while i < Prefetch::CANDIDATES.len() {
            all[i + 1] = Self(Some(Prefetch::CANDIDATES[i]));
            i += 1;
        }
        all
    };

    /// The plan asked for (`None` for `auto`, which times them at load).
    fn plan(self) -> Option<Prefetch> {
        self.0
    }
}

impl clap::ValueEnum for PrefetchArg {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let value = match self.0 {
            None => clap::builder::PossibleValue::new("auto"),
            Some(plan) => clap::builder::PossibleValue::new(plan.name()).help(plan.about()),
        };
        Some(value)
    }
}

impl ModelArgs {
    /// `--model NAME` with every other setting at its default.
    pub fn named(model: &str) -> Self {
        Self {
            model: Some(model.to_string()),
            context: crate::engine::decoder::DEFAULT_CONTEXT,
            device: None,
            dtype: None,
            candle_ops: false,
            offline: false,
            chat: false,
            f32_proposals: false,
            kv_cache: KvCacheArg::F16,
            isa: IsaArg::Auto,
            draft_model: None,
            threads: None,
            prefetch: PrefetchArg::AUTO,
            exit_threshold: None,
        }
    }

    /// A run of up to `max_tokens` tokens in `--context`, sampled as `sampling` says, with
    /// `--exit-threshold`.
    pub fn decode_options(&self, max_tokens: usize, sampling: Sampling) -> DecodeOptions {
        DecodeOptions {
            max_tokens,
            context: self.context,
            sampling,
            exit_threshold: self.exit_threshold,
        }
    }
}

/// `--kv-cache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheArg {
    F16,
    F32,
}

impl From<KvCacheArg> for KvDtype {
    fn from(arg: KvCacheArg) -> Self {
        match arg {
            KvCacheArg::F16 => KvDtype::F16,
            KvCacheArg::F32 => KvDtype::F32,
        }
    }
}

/// `--isa`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IsaArg {
    Auto,
    /// AVX-512 with BF16's dot products for bf16 weights (activations rounded to bf16).
    Avx512bf16,
    /// AVX-512F: bf16 and f16 weights widened to f32 exactly.
    Avx512,
    Avx2,
    /// aarch64's NEON.
    Neon,
    Portable,
}

impl IsaArg {
    /// The instruction set asked for (`None` for `auto`), checked against this CPU.
    fn isa(self) -> Result<Option<crate::engine::kernels::Isa>, EngineError> {
        use crate::engine::kernels::Isa;
        let isa = match self {
            Self::Auto => return Ok(None),
            Self::Avx512bf16 => Isa::Avx512Bf16,
            Self::Avx512 => Isa::Avx512,
            Self::Avx2 => Isa::Avx2Fma,
            Self::Neon => Isa::Neon,
            Self::Portable => Isa::Portable,
        };
        (isa.checked().map(Some)).map_err(|e| EngineError::Invalid(format!("--isa: {e}")))
    }
}

/// How tokens are chosen: greedy (temperature 0) or seed-coupled sampling, in which every
/// policy reproduces the baseline's text for the same seed.
#[derive(Debug, Clone, Default, Args)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy (default: the entry's, else 0).
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Sample only among the K most likely tokens (default: the entry's, else all).
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probability reaches P (default: the
    /// entry's, else all).
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Seed of the sampling noise (default: the entry's, else 0).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// These flags over the entry's defaults, checked.
    pub fn resolve(&self, session: &Session) -> Result<Sampling, EngineError> {
        let defaults = session.sampling;
        let sampling = Sampling {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k: self.top_k.or(defaults.top_k),
            top_p: self.top_p.or(defaults.top_p),
            seed: self.seed.unwrap_or(defaults.seed),
        };
        sampling.check().map_err(EngineError::Invalid)?;
        if let Some(note) = sampling.greedy_note() {
            eprintln!("spex: {note}");
        }
        Ok(sampling)
    }
}

/// Tokens a command that decodes generates unless `--max-tokens` says otherwise: the same
/// for the dashboard, `generate`, `bench` and the sweeps.
pub const DEFAULT_MAX_TOKENS: usize = 128;

/// `spex generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    // The help comes from the policy table (`engine::policy::POLICIES`).
    #[arg(long, help = policy_table::help("The policy", true))]
    pub policy: Option<PolicyKind>,
    /// Tokens to generate.
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS, value_parser = parse_count::<usize>)]
    pub max_tokens: usize,
    /// Record the run to this trace file (JSON Lines; `spex replay FILE` shows it).
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// One JSON object per event instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How `bench` and the sweeps race their lanes: the prompts, the interleaved runs and the
/// turn. One group, so the three commands share one meaning and one default for each flag.
#[derive(Debug, Clone, Args)]
pub struct LaneArgs {
    /// A file with one prompt per line (default: the built-in prompts).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Runs per prompt, each interleaving the lanes (see --turn-ms); the figures are the run
    /// with the median speedup's (bench's overall line: every run's, min–median–max).
    #[arg(long, default_value_t = 3, value_parser = parse_count::<u64>)]
    pub runs: u64,
    /// Compute, in milliseconds, each lane runs before the next takes its turn. Short turns
    /// let a drifting machine slow all lanes alike; 0 alternates every step, where the lanes
    /// share the caches as a decoder running alone does not.
    #[arg(long, default_value_t = 2.0, value_parser = parse_turn_ms)]
    pub turn_ms: f64,
}

impl LaneArgs {
    /// The runs and turn, as the harness takes them.
    pub fn turns(&self) -> crate::harness::bench::Turns {
        crate::harness::bench::Turns {
            runs: self.runs as usize,
            turn: std::time::Duration::from_secs_f64(self.turn_ms / 1e3),
        }
    }

    /// The prompts (`--prompts`, else the built-in ones).
    pub fn read_prompts(&self) -> Result<Vec<String>, EngineError> {
        bench::read_prompts(self.prompts.as_deref())
    }
}

/// `spex bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub lanes: LaneArgs,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS, value_parser = parse_count::<usize>)]
    pub max_tokens: usize,
    // The help comes from the policy table (`engine::policy::POLICIES`).
    #[arg(long, value_delimiter = ',', help = policy_table::help(
        "The policies raced against baseline, comma-separated, all in one interleaved run",
        false,
    ))]
    pub policy: Vec<PolicyKind>,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Record the first run of every prompt and policy to a trace in this directory
    /// (`01-dual_2.jsonl`, …; created if missing). `generate` and `tui` take `--record FILE`.
    #[arg(long, value_name = "DIR")]
    pub record_dir: Option<PathBuf>,
    /// Text files on which each lossy lane's exit rule is scored: its cross-entropy beside the
    /// baseline's, every pass teacher-forced, comma-separated.
    #[arg(long, value_name = "FILE", value_delimiter = ',')]
    pub held_out: Vec<PathBuf>,
}

/// `spex tui` (and `spex` alone).
#[derive(Debug, Clone, Args)]
pub struct TuiArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Start this prompt at once.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Tokens to generate per run.
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS, value_parser = parse_count::<usize>)]
    pub max_tokens: usize,
    // The help comes from the policy table (`engine::policy::POLICIES`).
    #[arg(long, help = policy_table::help("The policy raced against baseline", false))]
    pub policy: Option<PolicyKind>,
    /// Frames per second of the dashboard.
    #[arg(long, default_value_t = 30)]
    pub fps: u32,
    /// Record every run to a trace: the first to this file, the next ones beside it
    /// (NAME-2.EXT, …); `spex replay FILE` shows one.
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Presenter mode: the speedup in large digits, the text and the pipeline in large
    /// cells, high contrast, 2 steps per second (`p` switches, `+`/`-` change the pace).
    #[arg(long)]
    pub present: bool,
    /// On quit, print how many frames per second the dashboard drew, while decoding and in
    /// all, and its slowest draw.
    #[arg(long)]
    pub frame_stats: bool,
}

/// Parses the command line and runs it.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Some(Command::Generate(args)) => generate::run(&args),
        Some(Command::Bench(args)) => bench::run(&args),
        Some(Command::RandomCheckpoint(args)) => random::run(&args),
        Some(Command::Quantize(args)) => quantize::run(&args),
        Some(Command::Train(args)) => train::run(&args),
        Some(Command::TrainGate(args)) => train_gate::run(&args),
        Some(Command::Tui(args)) => dashboard(&args),
        Some(Command::Replay(args)) => replay::run(&args),
        Some(Command::Explain(args)) => explain::run(&args),
        Some(Command::Sweep(args)) => sweep::run(&args),
        Some(Command::Snapshot(args)) => replay::snapshot(&args),
        Some(Command::Models) => models::list(),
        Some(Command::Pull {
            name,
            revision,
            file,
        }) => hub::run(&name, revision.as_deref(), file.as_deref()),
        None => dashboard(&cli.dashboard),
    }
}

fn dashboard(args: &TuiArgs) -> anyhow::Result<()> {
    let (model, policy) = (args.model.clone(), args.policy);
    let session = crate::tui::loading::while_loading(model_label(&model), move |progress| {
        load_model_with(&model, policy.as_slice(), progress)
    })??;
    let policy = session.speculative_policy(args.policy);
    if let Some(path) = &args.record {
        record::check_target(path, &session)?;
    }
    let info = crate::tui::app::ModelInfo {
        name: session.name.clone(),
        passes: session.loaded.model().passes(),
        layers: session.loaded.model().config.layers,
        device: session.device.clone(),
        dtype: session.dtype.clone(),
        policy,
    };
    let decode = (args.model).decode_options(args.max_tokens, args.sampling.resolve(&session)?);
    let options = crate::tui::DashboardOptions {
        prompt: args.prompt.clone(),
        sample_prompt: session.sample_prompt.clone(),
        chat: session.chat,
        decode,
        record: args.record.clone(),
        trace: record::template(&session, decode),
        policy,
        info,
        frame_interval: std::time::Duration::from_secs_f64(1.0 / f64::from(args.fps.max(1))),
        present: args.present,
        frame_stats: args.frame_stats,
    };
    crate::tui::run(&session.loaded, options)
}

/// A count of at least 1 (`--max-tokens`, `--runs`): refused as the command line is read,
/// before a model loads.
pub(crate) fn parse_count<T: std::str::FromStr + PartialEq + From<u8>>(
    s: &str,
) -> Result<T, String> {
    let n: T = s
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number"))?;
    if n == T::from(0) {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

/// `--turn-ms`: a finite number of milliseconds, 0 to 1000.
pub(crate) fn parse_turn_ms(s: &str) -> Result<f64, String> {
    let ms: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1000.0).contains(&ms) {
        Ok(ms)
    } else {
        Err(format!("{ms} ms is outside 0–1000"))
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every flag of every command says what it does in `--help`.
    #[test]
    fn every_flag_has_help() {
        fn visit(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in command.get_arguments() {
                let builtin = matches!(arg.get_id().as_str(), "help" | "version");
                if !builtin && arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} --{}", arg.get_id()));
                }
            }
            for sub in command.get_subcommands() {
                visit(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        visit(&super::Cli::command(), "spex", &mut missing);
        assert!(missing.is_empty(), "flags without help: {missing:?}");
    }

    /// `--prefetch` takes `auto` and each candidate plan by the name reports give it.
    #[test]
    fn prefetch_takes_each_candidate_by_its_name() {
        use super::{Prefetch, PrefetchArg};
        use clap::ValueEnum;
        assert_eq!(
            PrefetchArg::from_str("auto", false).map(|a| a.plan()),
            Ok(None)
        );
        for plan in Prefetch::CANDIDATES {
            let arg = PrefetchArg::from_str(plan.name(), false);
            assert_eq!(arg.map(|a| a.plan()), Ok(Some(plan)), "{}", plan.name());
        }
        assert!(PrefetchArg::from_str("l3", false).is_err());
    }
}
