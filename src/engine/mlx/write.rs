//! Writing an mlx-community checkpoint directory from spex's own (`spex quantize --type
//! mlx-4bit`): every 2-d tensor whose rows hold whole groups quantized as mlx-lm's
//! `quantize_model` would (the embedding and every linear layer; Ouro's exit gate at 8 bits,
//! its `quant_predicate`), the rest as stored; `config.json` with the `quantization` block and
//! its `quantization_config` copy; the tokenizer beside them. What it writes is checked by an
//! independent reader (mlx's own `mx.dequantize` and mlx-lm's forward:
//! `tests/reference/mlx_quant.py`).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::{EXIT_GATE_MODULE, QUANTIZATION, Quantization, quantize_rows};
use crate::engine::error::{EngineError, Result};
use crate::engine::kernels::AffineKind;

/// The kind mlx-lm's Ouro gives its exit gate.
fn gate_kind() -> Option<AffineKind> {
    AffineKind::new(8, 64)
}

/// What to write: the source's `config.json` (as JSON), its tensors' names and a reader of
/// each, its `tokenizer.json` bytes and the kind of the matrices.
pub struct MlxJob<'a> {
    /// The source's config, written back with the quantization block.
    pub config: Value,
    /// Every tensor of the source, by name.
    pub names: Vec<String>,
    /// Reads one of them.
    pub read: &'a (dyn Fn(&str) -> candle_core::Result<Tensor> + Sync),
    /// Where they come from, for messages.
    pub weights_path: &'a Path,
    /// Its `tokenizer.json`.
    pub tokenizer: &'a [u8],
    /// The matrices' kind.
    pub kind: AffineKind,
    /// The threads its tensors are quantized on.
    pub threads: &'a crate::engine::kernels::pool::Pool,
}

/// Writes `job` into directory `out` (each file atomically).
pub fn write_mlx(job: MlxJob<'_>, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| EngineError::file(out, e))?;
    remove_weights(out)?;
    let file = out.join("model.safetensors");
    let mut quantization = Quantization {
        kind: job.kind,
        modules: HashMap::new(),
    };
    // Each on the job's threads, read when it is written: the source is never held whole.
    let each = |name: String| {
        let tensor = (job.read)(&name).map_err(|e| EngineError::file(job.weights_path, e))?;
        written_as(&name, tensor, job.kind)
            .map_err(|e| EngineError::file(&file, format!("{name}: {e}")))
    };
    let each = job.threads.map(job.names, &each);
    let mut written: HashMap<String, Tensor> = HashMap::new();
    for tensor in each.into_iter().collect::<Result<Vec<_>>>()? {
        if let Written::Quantized { module, kind, .. } = &tensor
            && *kind != job.kind
        {
            quantization.modules.insert(module.clone(), Some(*kind));
        }
        written.extend(tensor.into_tensors());
    }
    crate::engine::files::write_via_temporary(&file, |temp| {
        candle_core::safetensors::save(&written, temp).map_err(std::io::Error::other)
    })?;
    let mut config = job.config;
    if let Some(map) = config.as_object_mut() {
        map.insert(QUANTIZATION.to_string(), quantization.to_json());
        map.insert("quantization_config".to_string(), quantization.to_json());
    }
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(|e| EngineError::file(&path, e))?;
    crate::engine::files::write_atomically(&path, |w| w.write_all((text + "\n").as_bytes()))?;
    let tokenizer = out.join("tokenizer.json");
    crate::engine::files::write_atomically(&tokenizer, |w| w.write_all(job.tokenizer))
}

/// One source tensor as the checkpoint stores it.
enum Written {
    /// A matrix quantized: its module (the name less `.weight`), kind, and scales, biases and
    /// packed words.
    Quantized {
        module: String,
        kind: AffineKind,
        parts: [Tensor; 3],
    },
    /// Any other tensor, by name, as stored.
    Stored(String, Tensor),
}

impl Written {
    /// Its tensors by name.
    fn into_tensors(self) -> Vec<(String, Tensor)> {
        match self {
            Self::Quantized { module, parts, .. } => {
                let [scales, biases, words] = parts;
                vec![
                    (format!("{module}.scales"), scales),
                    (format!("{module}.biases"), biases),
                    (format!("{module}.weight"), words),
                ]
            }
            Self::Stored(name, tensor) => vec![(name, tensor)],
        }
    }
}

/// Tensor `name` as written: quantized where it is a 2-d weight whose rows hold whole groups
/// (the exit gate in its own kind, the rest in `kind`), else as stored.
fn written_as(name: &str, tensor: Tensor, kind: AffineKind) -> candle_core::Result<Written> {
    let module = name.strip_suffix(".weight");
    let kind = match module {
        Some(EXIT_GATE_MODULE) => gate_kind(),
        _ => Some(kind),
    };
    let quantizable =
        |k: &AffineKind| tensor.dims().len() == 2 && tensor.dims()[1].is_multiple_of(k.group());
    Ok(match (kind.filter(quantizable), module) {
        (Some(kind), Some(module)) => Written::Quantized {
            module: module.to_string(),
            kind,
            parts: quantized(&tensor, kind)?,
        },
        _ => Written::Stored(name.to_string(), tensor),
    })
}

/// Removes the weights a checkpoint already in `out` holds (its `*.safetensors` and shard
/// index), which a replaced checkpoint must not leave for a loader to read beside the new one.
fn remove_weights(out: &Path) -> Result<()> {
    let entries = std::fs::read_dir(out).map_err(|e| EngineError::file(out, e))?;
    for path in entries.flatten().map(|e| e.path()) {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.ends_with(".safetensors") || name == crate::engine::format::SHARD_INDEX {
            std::fs::remove_file(&path).map_err(|e| EngineError::file(&path, e))?;
        }
    }
    Ok(())
}

/// `tensor` (`[rows, inner]`) quantized: its scales and biases in its own float type, and its
/// packed words (`uint32`, `[rows, inner·bits/32]`).
fn quantized(tensor: &Tensor, kind: AffineKind) -> candle_core::Result<[Tensor; 3]> {
    let dtype = match tensor.dtype() {
        d @ (DType::BF16 | DType::F16) => d,
        _ => DType::F32,
    };
    let (rows, inner) = tensor.dims2()?;
    let values = tensor
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let (packed, scales, biases) = quantize_rows(&values, kind, dtype);
    let words: Vec<u32> = (packed.chunks_exact(4))
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let groups = inner / kind.group();
    let float = |v: Vec<f32>| Tensor::from_vec(v, (rows, groups), &Device::Cpu)?.to_dtype(dtype);
    Ok([
        float(scales)?,
        float(biases)?,
        Tensor::from_vec(
            words,
            (rows, inner * kind.bits() as usize / 32),
            &Device::Cpu,
        )?,
    ])
}
