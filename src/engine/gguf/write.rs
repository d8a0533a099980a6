//! Writing a GGUF checkpoint in `super`'s layout from spex's own weights (`spex quantize`):
//! every matrix quantized (its rows of `attn_q`/`attn_k` permuted as llama.cpp's converter
//! does), the norms in F32, the shape in `ouro.*` keys and the tokenizer in
//! `tokenizer.ggml.*` keys. What it writes is checked by an independent reader (llama.cpp's
//! `gguf` package on PyPI: `tests/reference/gguf_check.py`).

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};

use super::{ARCHITECTURE, config_key, ggml_type, gguf_name, gguf_row};
use crate::engine::error::{EngineError, Result};
use crate::engine::format::{self, LayerTensor};
use crate::engine::kernels::{BlockQ8_0, QK8_0, QuantKind};
use crate::engine::looped::LoopedConfig;
use crate::engine::model::Weights;

/// The weight types `spex quantize` writes, by llama.cpp's file-type names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    /// Every matrix in Q8_0.
    Q8_0,
}

impl FileType {
    /// Every file type, with its name as the CLI takes it.
    pub const ALL: [(Self, &'static str); 1] = [(Self::Q8_0, "q8_0")];

    /// Its llama.cpp `general.file_type` (`LLAMA_FTYPE_MOSTLY_Q8_0` is 7).
    fn code(self) -> u32 {
        match self {
            Self::Q8_0 => 7,
        }
    }

    /// The block type of its matrices.
    fn kind(self) -> QuantKind {
        match self {
            Self::Q8_0 => QuantKind::Q8_0,
        }
    }
}

/// What to write: the model's shape, weights (f32 on the CPU) and tokenizer (`tokenizer.json`,
/// parsed, and its path for messages), and the file type.
#[derive(Debug)]
pub struct QuantizeJob<'a> {
    /// The model's shape.
    pub config: &'a LoopedConfig,
    /// Its weights in f32 on the CPU.
    pub weights: &'a Weights,
    /// Its `tokenizer.json`.
    pub tokenizer: &'a serde_json::Value,
    /// Where that tokenizer came from.
    pub tokenizer_path: &'a Path,
    /// The model's name (`general.name`).
    pub name: &'a str,
    /// The type its matrices are written in.
    pub file_type: FileType,
}

/// Writes `job` to `out` (atomically: a failed write leaves no file).
pub fn write_gguf(job: &QuantizeJob<'_>, out: &Path) -> Result<()> {
    let mut metadata = config_metadata(job);
    metadata.extend(super::vocab::metadata(
        job.tokenizer,
        job.tokenizer_path,
        job.config.bos_token_id,
        job.config.eos_token_ids.first().copied(),
    )?);
    let tensors = tensors(job).map_err(|e| EngineError::file(out, e))?;
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    crate::engine::files::write_via_temporary(out, |temp| {
        let mut file = std::fs::File::create(temp)?;
        candle_core::quantized::gguf_file::write(&mut file, &meta_refs, &tensor_refs)
            .map_err(std::io::Error::other)?;
        // candle writes version 2, whose little-endian layout version 3 keeps unchanged; 3 is
        // what llama.cpp writes today.
        file.seek(SeekFrom::Start(4))?;
        file.write_all(&3u32.to_le_bytes())?;
        file.sync_all()
    })
}

/// The `general.*` and `ouro.*` keys of `job`.
fn config_metadata(job: &QuantizeJob<'_>) -> Vec<(String, Value)> {
    let c = job.config;
    let u = |n: usize| Value::U32(n as u32);
    let keys: [(&str, Value); 14] = [
        ("block_count", u(c.layers)),
        ("num_loops", u(c.passes)),
        ("context_length", u(c.positions)),
        ("embedding_length", u(c.hidden)),
        ("feed_forward_length", u(c.intermediate)),
        ("attention.head_count", u(c.heads)),
        ("attention.head_count_kv", u(c.kv_heads)),
        ("attention.key_length", u(c.head_dim)),
        ("attention.value_length", u(c.head_dim)),
        ("rope.dimension_count", u(c.head_dim)),
        ("rope.freq_base", Value::F32(c.rope_theta as f32)),
        (
            "attention.layer_norm_rms_epsilon",
            Value::F32(c.rms_norm_eps as f32),
        ),
        ("vocab_size", u(c.vocab)),
        ("skip_loop_final_norm", Value::Bool(false)),
    ];
    let mut out = vec![
        (
            "general.architecture".to_string(),
            Value::String(ARCHITECTURE.into()),
        ),
        ("general.name".to_string(), Value::String(job.name.into())),
        (
            "general.file_type".to_string(),
            Value::U32(job.file_type.code()),
        ),
        ("general.quantization_version".to_string(), Value::U32(2)),
    ];
    out.extend(keys.into_iter().map(|(k, v)| (config_key(k), v)));
    out
}

/// Every tensor of `job` in the GGUF's names and order, quantized where it is a matrix.
fn tensors(job: &QuantizeJob<'_>) -> candle_core::Result<Vec<(String, QTensor)>> {
    let w = job.weights;
    let mut named: Vec<(&str, &Tensor, Option<LayerTensor>)> = vec![
        (format::EMBED_TOKENS, &w.embed_tokens, None),
        (format::FINAL_NORM, &w.norm, None),
    ];
    if !job.config.tied {
        named.push((format::LM_HEAD, &w.lm_head, None));
    }
    let mut layer_names = Vec::new();
    for layer in 0..job.config.layers {
        for t in LayerTensor::ALL {
            layer_names.push((t.name(layer), layer, t));
        }
    }
    let mut out = Vec::new();
    for (name, tensor, _) in named {
        out.push((gguf_or(name)?, encode(tensor, None, job)?));
    }
    for (name, layer, t) in &layer_names {
        let tensor = w.layers[*layer].tensor(*t);
        out.push((gguf_or(name)?, encode(tensor, Some(*t), job)?));
    }
    Ok(out)
}

fn gguf_or(name: &str) -> candle_core::Result<String> {
    gguf_name(name).ok_or_else(|| candle_core::Error::Msg(format!("{name} has no GGUF name")))
}

/// One tensor as the file stores it: a matrix quantized (rows permuted where `t` says), a
/// vector in F32.
fn encode(
    tensor: &Tensor,
    t: Option<LayerTensor>,
    job: &QuantizeJob<'_>,
) -> candle_core::Result<QTensor> {
    let tensor = tensor.to_dtype(candle_core::DType::F32)?;
    let &[rows, inner] = tensor.dims() else {
        return QTensor::quantize(&tensor, GgmlDType::F32);
    };
    let kind = job.file_type.kind();
    if !inner.is_multiple_of(kind.block_weights()) {
        return QTensor::quantize(&tensor, GgmlDType::F32);
    }
    let values = tensor.flatten_all()?.to_vec1::<f32>()?;
    let head_dim = job.config.head_dim;
    let permuted = t.is_some_and(super::is_permuted);
    let mut bytes = Vec::with_capacity(rows * inner / QK8_0 * std::mem::size_of::<BlockQ8_0>());
    // Stored row `gguf_row(r)` holds spex's row `r`.
    let mut order: Vec<usize> = (0..rows).collect();
    if permuted {
        for r in 0..rows {
            order[gguf_row(r, head_dim)] = r;
        }
    }
    for &source in &order {
        for block in values[source * inner..(source + 1) * inner].chunks_exact(QK8_0) {
            bytes.extend_from_slice(bytemuck::bytes_of(&BlockQ8_0::quantize(block)));
        }
    }
    let storage = QStorage::from_data(bytes.into(), &Device::Cpu, ggml_type(kind))?;
    QTensor::new(storage, (rows, inner))
}
