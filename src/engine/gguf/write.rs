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
use crate::engine::kernels::{BlockQ4_0, BlockQ8_0, QK8_0, QuantKind};
use crate::engine::looped::LoopedConfig;

/// The weight types `spex quantize` writes, by llama.cpp's file-type names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    /// Every matrix in Q8_0.
    Q8_0,
    /// Every matrix in Q4_0 but the LM head, in Q6_K (as llama.cpp's quantizer writes it).
    Q4_0,
    /// llama.cpp's Q4_K_S mix: Q4_K, with Q6_K for the LM head and Q5_K for the first four
    /// `attn_v` and the first eighth of the `ffn_down` matrices.
    Q4KS,
    /// llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the LM head and for `attn_v` and
    /// `ffn_down` in the first and last eighth of the layers and every third between.
    Q4KM,
    /// llama.cpp's Q5_K_M mix: Q4_K_M's with Q5_K for Q4_K.
    Q5KM,
}

impl FileType {
    /// Every file type, with its name as the CLI takes it.
    pub const ALL: [(Self, &'static str); 5] = [
        (Self::Q8_0, "q8_0"),
        (Self::Q4_0, "q4_0"),
        (Self::Q4KS, "q4_k_s"),
        (Self::Q4KM, "q4_k_m"),
        (Self::Q5KM, "q5_k_m"),
    ];

    /// Its name, as the CLI takes it.
    pub fn name(self) -> &'static str {
        (Self::ALL.iter())
            .find(|(t, _)| *t == self)
            .map_or("", |(_, name)| name)
    }

    /// Its llama.cpp `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`: `Q8_0` is 7, `Q4_0` 2,
    /// `Q4_K_S` 14, `Q4_K_M` 15, `Q5_K_M` 17).
    fn code(self) -> u32 {
        match self {
            Self::Q8_0 => 7,
            Self::Q4_0 => 2,
            Self::Q4KS => 14,
            Self::Q4KM => 15,
            Self::Q5KM => 17,
        }
    }

    /// The block type of matrix `role` of a model of `layers` layers, as llama.cpp's
    /// `llama_tensor_get_type` picks it, where rows of `inner` weights take it. A row that
    /// does not hold whole super-blocks takes Q8_0 (llama.cpp takes Q5_0 or Q5_1 for a
    /// K-quant, which spex does not read) and one that holds no whole Q8_0 block is F32
    /// (`None`).
    fn kind(self, role: MatrixRole, layers: usize, inner: usize) -> Option<QuantKind> {
        let more_bits = |i: usize| {
            i < layers / 8 || i >= 7 * layers / 8 || {
                i >= layers / 8 && (i - layers / 8) % 3 == 2
            }
        };
        use LayerTensor::{DownProj, VProj};
        let kind = match (self, role) {
            (Self::Q8_0, _) => QuantKind::Q8_0,
            (_, MatrixRole::Head) => QuantKind::Q6K,
            (Self::Q4_0, _) => QuantKind::Q4_0,
            (Self::Q4KM | Self::Q5KM, MatrixRole::Layer(layer, VProj | DownProj))
                if more_bits(layer) =>
            {
                QuantKind::Q6K
            }
            (Self::Q4KS, MatrixRole::Layer(layer, VProj)) if layer < 4 => QuantKind::Q5K,
            (Self::Q4KS, MatrixRole::Layer(layer, DownProj)) if layer < layers / 8 => {
                QuantKind::Q5K
            }
            (Self::Q4KS | Self::Q4KM, _) => QuantKind::Q4K,
            (Self::Q5KM, _) => QuantKind::Q5K,
        };
        if inner.is_multiple_of(kind.block_weights()) {
            Some(kind)
        } else if inner.is_multiple_of(QK8_0) {
            Some(QuantKind::Q8_0)
        } else {
            None
        }
    }
}

/// Which matrix of the model a tensor is, for [`FileType::kind`].
#[derive(Debug, Clone, Copy)]
enum MatrixRole {
    /// The LM head (the embedding where the two are tied).
    Head,
    /// The token embedding, untied.
    Embedding,
    /// A layer's matrix: the layer and which.
    Layer(usize, LayerTensor),
}

/// What to write: the model's shape, weights (read by name) and tokenizer (`tokenizer.json`,
/// parsed, and its path for messages), and the file type.
pub struct QuantizeJob<'a> {
    /// The model's shape.
    pub config: &'a LoopedConfig,
    /// Reads its weights, each when it is written: a model is never held whole in f32 (four
    /// times a bf16 file), only the tensors being quantized.
    pub read: &'a (dyn Fn(&str) -> candle_core::Result<Tensor> + Sync),
    /// Where the weights come from, for messages.
    pub weights_path: &'a Path,
    /// Its `tokenizer.json`.
    pub tokenizer: &'a serde_json::Value,
    /// Where that tokenizer came from.
    pub tokenizer_path: &'a Path,
    /// The model's name (`general.name`).
    pub name: &'a str,
    /// The type its matrices are written in.
    pub file_type: FileType,
    /// The threads its tensors are quantized on.
    pub threads: &'a crate::engine::kernels::pool::Pool,
}

/// Writes `job` to `out` (atomically: a failed write leaves no file).
pub fn write_gguf(job: &QuantizeJob<'_>, out: &Path) -> Result<()> {
    let mut metadata = config_metadata(job);
    metadata.extend(super::vocab::metadata(
        job.tokenizer,
        job.tokenizer_path,
        job.config.bos_token_id,
        job.config.eos_token_ids.first().copied(),
        job.config.vocab,
    )?);
    let tensors = tensors(job)?;
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

/// Every tensor of `job` in the GGUF's names and order, quantized where it is a matrix: read
/// (its shape checked) and encoded on the job's threads (K-quant rounding is a search a
/// block, the slowest part), each thread holding one tensor at a time.
fn tensors(job: &QuantizeJob<'_>) -> Result<Vec<(String, QTensor)>> {
    let c = job.config;
    let embedding = match c.tied {
        true => MatrixRole::Head,
        false => MatrixRole::Embedding,
    };
    let matrix = vec![c.vocab, c.hidden];
    // A vector has no matrix role: it is written in F32.
    let mut named: Vec<(String, Vec<usize>, Option<MatrixRole>)> = vec![
        (format::EMBED_TOKENS.into(), matrix.clone(), Some(embedding)),
        (format::FINAL_NORM.into(), vec![c.hidden], None),
    ];
    if !c.tied {
        named.push((format::LM_HEAD.into(), matrix, Some(MatrixRole::Head)));
    }
    for layer in 0..c.layers {
        for t in LayerTensor::ALL {
            let (shape, _) = t.shape_and_role(c);
            named.push((t.name(layer), shape, Some(MatrixRole::Layer(layer, t))));
        }
    }
    let each = |(name, shape, role): (String, Vec<usize>, Option<MatrixRole>)| {
        let tensor = (job.read)(&name)
            .and_then(|t| crate::engine::tensor_files::expect_shape(t, shape.into(), &name))
            .map_err(|e| EngineError::file(job.weights_path, e))?;
        let encoded = gguf_or(&name).and_then(|gguf| Ok((gguf, encode(tensor, role, job)?)));
        encoded.map_err(|e| EngineError::file(job.weights_path, format!("{name}: {e}")))
    };
    job.threads.map(named, &each).into_iter().collect()
}

fn gguf_or(name: &str) -> candle_core::Result<String> {
    gguf_name(name).ok_or_else(|| candle_core::Error::Msg(format!("{name} has no GGUF name")))
}

/// One tensor as the file stores it: a matrix quantized (rows permuted where it is `attn_q`
/// or `attn_k`), a vector in F32. Q8_0 and Q4_0 are spex's own rounding (which gguf-py's
/// equals); the K-quants are candle's port of llama.cpp's `quantize_row_q4_K_ref`, `_q5_K_ref`
/// and `_q6_K_ref`.
///
/// It holds one copy of the matrix at a time where it can (the tensor, then its values, then
/// the permuted rows): the pool's threads encode the largest matrices together.
fn encode(
    source: Tensor,
    role: Option<MatrixRole>,
    job: &QuantizeJob<'_>,
) -> candle_core::Result<QTensor> {
    let tensor = source.to_dtype(candle_core::DType::F32)?;
    drop(source);
    let (&[rows, inner], Some(role)) = (tensor.dims(), role) else {
        return QTensor::quantize(&tensor, GgmlDType::F32);
    };
    let Some(kind) = job.file_type.kind(role, job.config.layers, inner) else {
        return QTensor::quantize(&tensor, GgmlDType::F32);
    };
    let values = tensor.flatten_all()?.to_vec1::<f32>()?;
    drop(tensor);
    let head_dim = job.config.head_dim;
    let stored = match role {
        MatrixRole::Layer(_, t) if super::is_permuted(t) => {
            // Stored row `gguf_row(r)` holds spex's row `r`.
            let mut order: Vec<usize> = (0..rows).collect();
            for r in 0..rows {
                order[gguf_row(r, head_dim)] = r;
            }
            (order.iter())
                .flat_map(|&source| values[source * inner..(source + 1) * inner].iter().copied())
                .collect()
        }
        _ => values,
    };
    let mut bytes = Vec::with_capacity(rows * inner / kind.block_weights() * kind.block_bytes());
    for block in stored.chunks_exact(QK8_0) {
        match kind {
            QuantKind::Q8_0 => {
                bytes.extend_from_slice(bytemuck::bytes_of(&BlockQ8_0::quantize(block)))
            }
            QuantKind::Q4_0 => {
                bytes.extend_from_slice(bytemuck::bytes_of(&BlockQ4_0::quantize(block)))
            }
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => {
                let stored = Tensor::from_vec(stored, (rows, inner), &Device::Cpu)?;
                return QTensor::quantize(&stored, ggml_type(kind));
            }
        }
    }
    let storage = QStorage::from_data(bytes.into(), &Device::Cpu, ggml_type(kind))?;
    QTensor::new(storage, (rows, inner))
}
