//! `spex quantize`: a spex checkpoint written as a GGUF file in llama.cpp's Ouro layout
//! (`engine::gguf::write`) or as an mlx-community checkpoint directory (`engine::mlx::write`),
//! its matrices quantized.

use std::path::PathBuf;

use clap::Args;

use crate::engine::quantize::{QuantizeTarget, quantize_checkpoint};

/// Write a spex checkpoint as a quantized GGUF file (llama.cpp's Ouro layout) or mlx
/// checkpoint directory (mlx-community's layout).
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// The checkpoint to quantize: a models.toml entry, a checkpoint directory or an ORG/NAME
    /// hub repo (default: models.toml's default entry).
    #[arg(long)]
    pub model: Option<String>,
    /// The matrices' type: q8_0, q4_0 (its LM head in Q6_K, as llama.cpp writes it), q4_k_s,
    /// q4_k_m or q5_k_m (llama.cpp's K-quant mixes), written as a GGUF file; or mlx-4bit or
    /// mlx-8bit (mlx's affine groups of 64; -g32 or -g128 after it for other groups), written
    /// as a checkpoint directory.
    #[arg(long = "type", default_value = "q8_0", value_parser = parse_target)]
    pub target: QuantizeTarget,
    /// The GGUF file, or the mlx checkpoint directory, to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace the file `--out` names.
    #[arg(long)]
    pub force: bool,
}

/// A `--type`: the engine's names ([`QuantizeTarget`]).
pub(super) fn parse_target(s: &str) -> Result<QuantizeTarget, String> {
    s.parse()
}

/// Runs `spex quantize`.
pub fn run(args: &QuantizeArgs) -> anyhow::Result<()> {
    let target = args.target;
    if !args.force && args.out.exists() {
        anyhow::bail!(
            "{}: already exists: pass --force to replace it, or choose another --out",
            args.out.display()
        );
    }
    let hub = crate::hub::HubSettings::from_env()?;
    let resolved = super::models::resolve(args.model.as_deref(), &hub, &mut |_| {})?;
    let name = target.name();
    let threads = crate::engine::kernels::pool::available_cores();
    let config = quantize_checkpoint(&resolved.source, &resolved.name, target, &args.out, threads)?;
    let weights = match target {
        QuantizeTarget::Gguf(_) => args.out.clone(),
        QuantizeTarget::Mlx(_) => args.out.join("model.safetensors"),
    };
    let bytes = std::fs::metadata(weights).map_or(0, |m| m.len());
    println!(
        "wrote {}: {} in {name}, hidden {} K={} R={}, {:.1} MB",
        args.out.display(),
        resolved.name,
        config.hidden,
        config.layers,
        config.passes,
        bytes as f64 / 1e6
    );
    Ok(())
}
