//! `spex quantize`: a spex checkpoint written as a GGUF file in llama.cpp's Ouro layout
//! (`engine::gguf::write`) or as an mlx-community checkpoint directory (`engine::mlx::write`),
//! its matrices quantized.

use std::path::PathBuf;

use clap::Args;

use crate::engine::checkpoint::{QuantizeTarget, quantize_checkpoint};
use crate::engine::gguf::write::FileType;
use crate::engine::kernels::AffineKind;

/// The mlx types `--type` takes, with their bits.
const MLX_TYPES: [(&str, u32); 2] = [("mlx-4bit", 4), ("mlx-8bit", 8)];

/// Write a spex checkpoint as a quantized GGUF file (llama.cpp's Ouro layout) or mlx
/// checkpoint directory (mlx-community's layout).
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// The checkpoint to quantize: a models.toml entry, a checkpoint directory or an ORG/NAME
    /// hub repo (default: models.toml's default entry).
    #[arg(long)]
    pub model: Option<String>,
    /// The matrices' type: q8_0, or q4_k_m (llama.cpp's Q4_K/Q6_K mix), written as a GGUF
    /// file; or mlx-4bit or mlx-8bit (mlx's affine groups), written as a checkpoint directory.
    #[arg(long = "type", default_value = "q8_0")]
    pub file_type: String,
    /// Weights a group of an mlx type shares its scale and bias with: 32, 64 or 128.
    #[arg(long, default_value_t = 64)]
    pub group_size: usize,
    /// The GGUF file, or the mlx checkpoint directory, to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace the file `--out` names.
    #[arg(long)]
    pub force: bool,
}

pub(super) fn parse_file_type(s: &str) -> Result<FileType, String> {
    (FileType::ALL.iter())
        .find(|(_, name)| name.eq_ignore_ascii_case(s))
        .map(|(t, _)| *t)
        .ok_or_else(|| {
            let known: Vec<&str> = FileType::ALL.iter().map(|(_, n)| *n).collect();
            format!("\"{s}\" is not a type spex writes ({})", known.join(", "))
        })
}

/// The target `--type` and `--group-size` name.
fn target(args: &QuantizeArgs) -> anyhow::Result<QuantizeTarget> {
    let Some((_, bits)) = MLX_TYPES
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(&args.file_type))
    else {
        let file_type = parse_file_type(&args.file_type).map_err(|e| {
            let mlx: Vec<&str> = MLX_TYPES.iter().map(|(n, _)| *n).collect();
            anyhow::anyhow!("--type: {e}, or {}", mlx.join(", "))
        })?;
        return Ok(QuantizeTarget::Gguf(file_type));
    };
    let kind = AffineKind::new(*bits, args.group_size).ok_or_else(|| {
        let sizes: Vec<String> = AffineKind::GROUP_SIZES.map(|g| g.to_string()).to_vec();
        anyhow::anyhow!(
            "--group-size: {} is not a group size spex writes ({})",
            args.group_size,
            sizes.join(", ")
        )
    })?;
    Ok(QuantizeTarget::Mlx(kind))
}

/// Runs `spex quantize`.
pub fn run(args: &QuantizeArgs) -> anyhow::Result<()> {
    let target = target(args)?;
    if !args.force && args.out.exists() {
        anyhow::bail!(
            "{}: already exists: pass --force to replace it, or choose another --out",
            args.out.display()
        );
    }
    let hub = crate::hub::HubSettings::from_env()?;
    let resolved = super::models::resolve(args.model.as_deref(), &hub, &mut |_| {})?;
    let name = match target {
        QuantizeTarget::Gguf(t) => t.name().to_string(),
        QuantizeTarget::Mlx(kind) => kind.name(),
    };
    let config = quantize_checkpoint(&resolved.source, &resolved.name, target, &args.out)?;
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
