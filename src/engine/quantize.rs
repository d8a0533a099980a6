//! `spex quantize`: a spex checkpoint (a directory of float safetensors, or the embedded
//! model) rewritten as a GGUF file in llama.cpp's Ouro layout or an mlx-community checkpoint.
//! Called by the CLI, the size sweep and the tests.

use std::path::{Path, PathBuf};

use candle_core::Device;

use super::checkpoint::{Checkpoint, Origin};
use super::error::{EngineError, Result};
use super::kernels::AffineKind;
use super::looped::LoopedConfig;
use super::mlx::write as mlx_write;
use super::tensor_files::TensorFiles;

/// What `spex quantize` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantizeTarget {
    /// A GGUF file in llama.cpp's Ouro layout.
    Gguf(crate::engine::gguf::write::FileType),
    /// An mlx-community checkpoint directory, its matrices in this kind.
    Mlx(AffineKind),
}

impl QuantizeTarget {
    /// Its name, as `spex quantize --type` takes it: `q8_0`, `q4_k_m`, `mlx-4bit` (groups of
    /// 64, mlx-lm's default), `mlx-8bit-g32`.
    pub fn name(self) -> String {
        match self {
            Self::Gguf(t) => t.name().to_string(),
            Self::Mlx(k) if k.group() == 64 => format!("mlx-{}bit", k.bits()),
            Self::Mlx(k) => format!("mlx-{}bit-g{}", k.bits(), k.group()),
        }
    }

    /// Every target, by name.
    pub fn all() -> Vec<Self> {
        let gguf = crate::engine::gguf::write::FileType::ALL.map(|(t, _)| Self::Gguf(t));
        let mlx = (AffineKind::BITS.iter())
            .flat_map(|&b| {
                (AffineKind::GROUP_SIZES.iter()).filter_map(move |&g| AffineKind::new(b, g))
            })
            .map(Self::Mlx);
        gguf.into_iter().chain(mlx).collect()
    }
}

impl std::str::FromStr for QuantizeTarget {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let all = Self::all();
        all.iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .copied()
            .ok_or_else(|| {
                let names: Vec<String> = (all.iter())
                    .map(|t| t.name())
                    .filter(|n| !n.contains("-g"))
                    .collect();
                format!(
                    "\"{s}\" is not a type spex writes ({}; mlx types take -g32 or -g128 for other \
                 groups than 64)",
                    names.join(", ")
                )
            })
    }
}

impl From<crate::engine::gguf::write::FileType> for QuantizeTarget {
    fn from(t: crate::engine::gguf::write::FileType) -> Self {
        Self::Gguf(t)
    }
}

/// A source checkpoint's parts, as `quantize_checkpoint` reads them.
struct Source {
    config: LoopedConfig,
    /// Where the weights come from, for messages.
    weights_path: PathBuf,
    tokenizer_path: PathBuf,
    tokenizer_bytes: Vec<u8>,
    /// Every tensor as stored, read by name (for an mlx target).
    stored: Stored,
}

/// A source's tensors as stored, by name.
enum Stored {
    /// In a checkpoint's files, read when asked for.
    Files(TensorFiles),
    /// Already in memory (the embedded model).
    Loaded(std::collections::HashMap<String, candle_core::Tensor>),
}

impl Stored {
    fn names(&self) -> Vec<String> {
        match self {
            Self::Files(files) => files.names(),
            Self::Loaded(map) => map.keys().cloned().collect(),
        }
    }

    fn read(&self, name: &str) -> candle_core::Result<candle_core::Tensor> {
        match self {
            Self::Files(files) => files.read(name, &Device::Cpu),
            Self::Loaded(map) => {
                map.get(name)
                    .cloned()
                    .ok_or_else(|| candle_core::Error::CannotFindTensor {
                        path: name.to_string(),
                    })
            }
        }
    }
}

/// Reads `origin` for quantizing: its config and tokenizer, and every tensor as stored by name.
fn quantize_source(origin: &Origin) -> Result<Source> {
    use crate::engine::files::{FileKind, read_capped};
    match origin {
        Origin::Dir(dir) => {
            let checkpoint = Checkpoint::open(dir)?;
            if checkpoint.quantization.is_some() {
                return Err(EngineError::file(
                    dir.join("config.json"),
                    "already quantized (mlx): quantize a checkpoint of float weights",
                ));
            }
            let stored = Stored::Files(TensorFiles::open(&checkpoint.weight_files)?);
            let bytes = read_capped(&checkpoint.tokenizer_file, FileKind::Tokenizer)?;
            Ok(Source {
                config: checkpoint.config,
                weights_path: dir.clone(),
                tokenizer_path: checkpoint.tokenizer_file,
                tokenizer_bytes: bytes,
                stored,
            })
        }
        Origin::Embedded(bytes) => {
            let config = bytes.looped_config()?;
            let at = "<embedded>/model.safetensors";
            let stored = candle_core::safetensors::load_buffer(bytes.weights, &Device::Cpu)
                .map_err(|e| EngineError::file(at, e))?;
            Ok(Source {
                config,
                weights_path: at.into(),
                tokenizer_path: "<embedded>/tokenizer.json".into(),
                tokenizer_bytes: bytes.tokenizer.to_vec(),
                stored: Stored::Loaded(stored),
            })
        }
        Origin::Gguf(path) => Err(EngineError::file(
            path,
            "already a GGUF file: quantize a spex checkpoint",
        )),
    }
}

/// Quantizes the spex checkpoint at `origin` (a directory or the embedded model) into `out`,
/// named `name`: a GGUF file, or an mlx checkpoint directory, its tensors quantized on
/// `threads` threads. Returns the model's shape.
pub fn quantize_checkpoint(
    origin: &Origin,
    name: &str,
    target: QuantizeTarget,
    out: &Path,
    threads: usize,
) -> Result<LoopedConfig> {
    let threads = super::kernels::pool::Pool::new(threads.max(1))
        .map_err(|e| EngineError::file(out, format!("cannot start {threads} threads: {e}")))?;
    let source = quantize_source(origin)?;
    let Source {
        config,
        weights_path,
        tokenizer_path,
        tokenizer_bytes,
        stored,
    } = source;
    let read = |name: &str| stored.read(name);
    let file_type = match target {
        QuantizeTarget::Gguf(file_type) => file_type,
        QuantizeTarget::Mlx(kind) => {
            let job = mlx_write::MlxJob {
                config: config.to_json(),
                names: stored.names(),
                read: &read,
                weights_path: &weights_path,
                tokenizer: &tokenizer_bytes,
                kind,
                threads: &threads,
            };
            mlx_write::write_mlx(job, out)?;
            return Ok(config);
        }
    };
    let tokenizer: serde_json::Value = serde_json::from_slice(&tokenizer_bytes)
        .map_err(|e| EngineError::file(&tokenizer_path, format!("not valid JSON: {e}")))?;
    let job = crate::engine::gguf::write::QuantizeJob {
        config: &config,
        read: &read,
        weights_path: &weights_path,
        tokenizer: &tokenizer,
        tokenizer_path: &tokenizer_path,
        name,
        file_type,
        threads: &threads,
    };
    crate::engine::gguf::write::write_gguf(&job, out)?;
    Ok(config)
}
