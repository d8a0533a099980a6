//! `spex random-checkpoint`: a checkpoint of random weights at any shape (Ouro-1.4B's, say),
//! in the real file format, for the tests and the benchmarks.

use std::path::PathBuf;

use clap::Args;

use super::device::{DTypeSpec, dtype_name};
use crate::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};

/// `spex random-checkpoint`.
#[derive(Debug, Args)]
pub struct RandomArgs {
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// The hidden size (the residual stream's width); a multiple of --heads.
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// K, the shared layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// R, the passes.
    #[arg(long, default_value_t = 4)]
    pub passes: usize,
    /// Attention heads (each of --hidden / --heads dimensions).
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads, dividing --heads (grouped-query attention; default: --heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// The MLP's inner width (default: 11/4 of --hidden, Ouro's proportion).
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Target tokenizer vocabulary (a few KB of text caps what BPE can learn; the config's
    /// vocab_size is padded up to this).
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    /// The model's positions (the most its config.json allows); a run's KV cache is
    /// `--context` of the commands that decode.
    #[arg(long, default_value_t = 2048)]
    pub positions: usize,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A separate LM head (as Ouro's released models have) instead of tied embeddings.
    #[arg(long)]
    pub untied: bool,
    /// The tensors' element type in the files: f32, bf16 (as Ouro's released models are
    /// stored) or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: DTypeSpec,
    /// Replace the checkpoint `--out` already holds.
    #[arg(long)]
    pub force: bool,
}

/// Writes the random checkpoint `args` describe.
pub(super) fn run(args: &RandomArgs) -> anyhow::Result<()> {
    if args.heads == 0 || !args.hidden.is_multiple_of(args.heads) {
        anyhow::bail!(
            "random-checkpoint: --hidden {} must be a positive multiple of --heads {}",
            args.hidden,
            args.heads
        );
    }
    if !args.force && crate::engine::checkpoint::holds_checkpoint(&args.out) {
        anyhow::bail!(
            "{}: already holds a checkpoint: pass --force to replace it, or choose another --out",
            args.out.display()
        );
    }
    let spec = RandomSpec {
        shape: crate::engine::config::ModelShape {
            hidden: args.hidden,
            layers: args.layers,
            passes: args.passes,
            heads: args.heads,
            kv_heads: args.kv_heads.unwrap_or(args.heads),
            head_dim: args.hidden / args.heads.max(1),
            intermediate: args.intermediate.unwrap_or(args.hidden * 11 / 4),
            vocab: args.vocab,
            context: args.positions,
            tied: !args.untied,
        },
        random_exit_gate: false,
        seed: args.seed,
        pad_vocab_to: Some(args.vocab),
        dtype: args.dtype.0,
        ..RandomSpec::default()
    };
    // The draws in f32 and the tensors in their stored type.
    let what = std::path::Path::new("random-checkpoint");
    (spec.shape.validate(what, "--"))
        .map_err(|e| anyhow::anyhow!(e.to_string().replace('_', "-")))?;
    crate::engine::memory::check_shape_room(&spec.shape, 2, what)?;
    let config = write_random_checkpoint(&args.out, &spec)?;
    println!(
        "wrote {}: hidden {} K={} R={} vocab {}, {}",
        args.out.display(),
        config.hidden,
        config.layers,
        config.passes,
        config.vocab,
        dtype_name(args.dtype.0)
    );
    Ok(())
}
