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

/// What to write: the source's `config.json` (as JSON), every tensor by name, its
/// `tokenizer.json` bytes and the kind of the matrices.
#[derive(Debug)]
pub struct MlxJob<'a> {
    /// The source's config, written back with the quantization block.
    pub config: Value,
    /// Every tensor of the source, by name.
    pub tensors: Vec<(String, Tensor)>,
    /// Its `tokenizer.json`.
    pub tokenizer: &'a [u8],
    /// The matrices' kind.
    pub kind: AffineKind,
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
    let mut written: HashMap<String, Tensor> = HashMap::new();
    for (name, tensor) in job.tensors {
        let module = name.strip_suffix(".weight");
        let kind = match module {
            Some(EXIT_GATE_MODULE) => gate_kind(),
            _ => Some(job.kind),
        };
        let quantizable = |k: &AffineKind| {
            tensor.dims().len() == 2 && module.is_some() && tensor.dims()[1] % k.group() == 0
        };
        match (kind.filter(quantizable), module) {
            (Some(kind), Some(module)) => {
                if kind != job.kind {
                    quantization.modules.insert(module.to_string(), Some(kind));
                }
                let [scales, biases, words] = quantized(&tensor, kind)
                    .map_err(|e| EngineError::file(&file, format!("{name}: {e}")))?;
                written.insert(format!("{module}.scales"), scales);
                written.insert(format!("{module}.biases"), biases);
                written.insert(name, words);
            }
            _ => {
                written.insert(name, tensor);
            }
        }
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
