//! `spex quantize`: a spex checkpoint written as a GGUF file in llama.cpp's Ouro layout, its
//! matrices quantized (`engine::gguf::write`).

use std::path::PathBuf;

use clap::Args;

use crate::engine::checkpoint::quantize_checkpoint;
use crate::engine::gguf::write::FileType;

/// Write a spex checkpoint as a quantized GGUF file (llama.cpp's Ouro layout).
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// The checkpoint to quantize: a models.toml entry, a checkpoint directory or an ORG/NAME
    /// hub repo (default: models.toml's default entry).
    #[arg(long)]
    pub model: Option<String>,
    /// The matrices' type: q8_0, or q4_k_m (llama.cpp's Q4_K/Q6_K mix).
    #[arg(long = "type", value_parser = parse_file_type, default_value = "q8_0")]
    pub file_type: FileType,
    /// The GGUF file to write.
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

/// Runs `spex quantize`.
pub fn run(args: &QuantizeArgs) -> anyhow::Result<()> {
    if !args.force && args.out.exists() {
        anyhow::bail!(
            "{}: already exists: pass --force to replace it, or choose another --out",
            args.out.display()
        );
    }
    let hub = crate::hub::HubSettings::from_env()?;
    let resolved = super::models::resolve(args.model.as_deref(), &hub, &mut |_| {})?;
    let name = args.file_type.name();
    let config = quantize_checkpoint(&resolved.source, &resolved.name, args.file_type, &args.out)?;
    let bytes = std::fs::metadata(&args.out).map_or(0, |m| m.len());
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
