//! Reading a GGUF checkpoint (`super`'s layout) through candle's GGUF reader: the header and
//! metadata checked and turned into the engine's config, then the weights. For the host
//! kernels, every quantized matrix is read straight from the file into the weight arena as its
//! blocks, the rows of `attn_q` and `attn_k` moved back to spex's order as they land; dense
//! tensors (the norms, any F32/F16/BF16 matrix) are read as tensors. For another device every
//! tensor is dequantized. Every failure is one line naming the file and, where there is one,
//! the key or the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

use super::{ARCHITECTURE, CONFIG_KEYS, config_key, ggml_name, gguf_name, gguf_row, quant_kind};
use crate::engine::config::OuroConfig;
use crate::engine::error::{EngineError, Result};
use crate::engine::format::{self, LayerTensor};
use crate::engine::kernels::QuantKind;
use crate::engine::looped::LoopedConfig;

/// An open GGUF file: its metadata and tensor table, and the file for reading tensors.
pub struct GgufFile {
    path: PathBuf,
    file: Mutex<File>,
    content: Content,
    bytes: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish()
    }
}

impl GgufFile {
    /// Opens `path` and reads its header, metadata and tensor table; an error names the file
    /// (a truncated or foreign file) or its `general.architecture`.
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| EngineError::file(path, e))?;
        let bytes = file
            .metadata()
            .map_err(|e| EngineError::file(path, e))?
            .len();
        let content = Content::read(&mut file)
            .map_err(|e| EngineError::file(path, format!("not a readable GGUF file: {e}")))?;
        let this = Self {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            content,
            bytes,
        };
        let arch = this.string("general.architecture")?;
        if arch != ARCHITECTURE {
            return Err(this.key_error(
                "general.architecture",
                &format!(
                    "\"{arch}\" is not a looped model spex reads (it reads \"{ARCHITECTURE}\")"
                ),
            ));
        }
        Ok(this)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its metadata.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// An error about metadata key `key`.
    pub fn key_error(&self, key: &str, message: &str) -> EngineError {
        EngineError::Config {
            path: self.path.clone(),
            field: key.to_string(),
            message: message.to_string(),
        }
    }

    /// String key `key`.
    pub fn string(&self, key: &str) -> Result<String> {
        match self.metadata().get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(self.key_error(key, "must be a string")),
            None => Err(self.key_error(key, "missing")),
        }
    }

    /// The engine's shape of the model: the `ouro.*` keys read as the config fields they hold
    /// ([`CONFIG_KEYS`]) and checked as a config.json is (`OuroConfig::from_json`); an error
    /// names the GGUF key. Tied when the file has no `output` tensor; the token ids from the
    /// tokenizer keys.
    pub fn config(&self) -> Result<LoopedConfig> {
        let mut json = serde_json::Map::new();
        json.insert("model_type".into(), ARCHITECTURE.into());
        for (field, key, optional) in CONFIG_KEYS {
            let key = config_key(key);
            match self.metadata().get(&key) {
                Some(v) => {
                    let n = number(v).ok_or_else(|| self.key_error(&key, "must be a number"))?;
                    json.insert(field.into(), n);
                }
                None if optional => {}
                None => return Err(self.key_error(&key, "missing")),
            }
        }
        if !json.contains_key("vocab_size") {
            let rows = self
                .info("token_embd.weight")?
                .shape
                .dims()
                .first()
                .copied();
            json.insert("vocab_size".into(), rows.unwrap_or(0).into());
        }
        json.entry("rope_theta").or_insert(10_000.0.into());
        json.insert(
            "tie_word_embeddings".into(),
            self.info("output.weight").is_err().into(),
        );
        for (field, key) in [
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ] {
            if let Some(v) = self.metadata().get(key).and_then(number) {
                json.insert(field.into(), v);
            }
        }
        let config = OuroConfig::from_json(&serde_json::Value::Object(json), &self.path)
            .map_err(|e| self.renamed(e))?;
        Ok(config.looped())
    }

    /// `e` with a config field's name replaced by the GGUF key that holds it.
    fn renamed(&self, e: EngineError) -> EngineError {
        match e {
            EngineError::Config {
                path,
                field,
                message,
            } => {
                let key = (CONFIG_KEYS.iter())
                    .find(|(f, _, _)| *f == field)
                    .map_or(field, |(_, key, _)| config_key(key));
                EngineError::Config {
                    path,
                    field: key,
                    message,
                }
            }
            other => other,
        }
    }

    /// The table entry of GGUF tensor `name`.
    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.tensor_error(name, "missing"))
    }

    /// An error about GGUF tensor `name`.
    pub fn tensor_error(&self, name: &str, message: impl std::fmt::Display) -> EngineError {
        EngineError::Tensor {
            path: self.path.clone(),
            name: name.to_string(),
            message: message.to_string(),
        }
    }

    /// The GGML type of the file's first query projection: what its matrices mostly are.
    pub fn weight_type(&self) -> Option<GgmlDType> {
        let name = super::layer_name(LayerTensor::QProj, 0);
        self.content.tensor_infos.get(&name).map(|i| i.ggml_dtype)
    }

    /// What the file's weights are, as llama.cpp names its file types (`Q4_K_M`): its
    /// `general.file_type`, else its first query projection's block type.
    pub fn weight_type_name(&self) -> Option<&'static str> {
        let code = self
            .metadata()
            .get("general.file_type")
            .and_then(|v| v.to_u32().ok());
        code.and_then(super::file_type_name)
            .or_else(|| self.weight_type().map(super::ggml_name))
    }

    /// Reads GGUF tensor `name`'s stored bytes into `out`, which must be their size; a file
    /// too short for them names the tensor.
    fn read_stored(&self, name: &str, info: &TensorInfo, out: &mut [u8]) -> Result<()> {
        let start = self.content.tensor_data_offset.saturating_add(info.offset);
        if start.saturating_add(out.len() as u64) > self.bytes {
            return Err(
                self.tensor_error(name, "the file ends before the tensor's data: truncated")
            );
        }
        let mut file = self
            .file
            .lock()
            .map_err(|_| self.tensor_error(name, "reader poisoned"))?;
        (file
            .seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(out)))
        .map_err(|e| self.tensor_error(name, e))
    }

    /// Spex's tensor `name` (`engine::format`), dequantized to f32 on the CPU, its rows in
    /// spex's order (heads of `head_dim` rows).
    fn read_dense(&self, name: &str, head_dim: usize) -> Result<Tensor> {
        let gguf =
            gguf_name(name).ok_or_else(|| self.tensor_error(name, "not in the GGUF layout"))?;
        let info = self.info(&gguf)?;
        let mut bytes = vec![0u8; stored_bytes(info)];
        self.read_stored(&gguf, info, &mut bytes)?;
        let storage = candle_core::quantized::QStorage::from_data(
            bytes.into(),
            &Device::Cpu,
            info.ggml_dtype,
        )
        .and_then(|s| candle_core::quantized::QTensor::new(s, info.shape.clone()))
        .and_then(|q| q.dequantize(&Device::Cpu))
        .map_err(|e| self.tensor_error(&gguf, e))?;
        match format::layer_tensor_of(name).is_some_and(super::is_permuted) {
            true => {
                let rows = info.shape.dims()[0];
                let order: Vec<u32> = (0..rows).map(|r| gguf_row(r, head_dim) as u32).collect();
                let order = Tensor::new(order.as_slice(), &Device::Cpu)
                    .map_err(|e| self.tensor_error(&gguf, e))?;
                storage
                    .index_select(&order, 0)
                    .map_err(|e| self.tensor_error(&gguf, e))
            }
            false => Ok(storage),
        }
    }
}

/// A metadata number as JSON.
fn number(v: &Value) -> Option<serde_json::Value> {
    Some(match v {
        Value::U8(n) => (*n).into(),
        Value::I8(n) => (*n).into(),
        Value::U16(n) => (*n).into(),
        Value::I16(n) => (*n).into(),
        Value::U32(n) => (*n).into(),
        Value::I32(n) => (*n).into(),
        Value::U64(n) => (*n).into(),
        Value::I64(n) => (*n).into(),
        Value::F32(n) => f64::from(*n).into(),
        Value::F64(n) => (*n).into(),
        _ => return None,
    })
}

/// The bytes a tensor's data takes in the file.
fn stored_bytes(info: &TensorInfo) -> usize {
    info.shape.elem_count() / info.ggml_dtype.block_size() * info.ggml_dtype.type_size()
}

/// A quantized matrix chosen for the arena: spex's name, the file's, its table entry, its
/// block type and its shape in blocks (rows × blocks a row × bytes a block).
struct Picked<'a> {
    name: String,
    gguf: String,
    info: &'a TensorInfo,
    kind: QuantKind,
    blocks: Shape,
}

/// Reads the host kernels' quantized matrices (every matrix `specs` lists that the file
/// stores in a `kernels::QuantKind`) into one arena of blocks, `[rows, blocks, block bytes]`, each
/// named by spex's name, telling `read` the bytes of each. A matrix in a type neither these
/// kernels nor the dense ones read is an error naming it and its type.
pub fn read_blocks_into_arena(
    file: &GgufFile,
    specs: &[(String, Shape)],
    head_dim: usize,
    read: &mut dyn FnMut(u64),
) -> Result<HashMap<String, Tensor>> {
    let mut picked = Vec::new();
    for (name, shape) in specs {
        let gguf =
            gguf_name(name).ok_or_else(|| file.tensor_error(name, "not in the GGUF layout"))?;
        let info = file.info(&gguf)?;
        if info.shape.dims() != shape.dims() {
            return Err(file.tensor_error(
                &gguf,
                format!("shape {:?}, expected {:?}", info.shape.dims(), shape.dims()),
            ));
        }
        match (quant_kind(info.ggml_dtype), info.ggml_dtype) {
            (Some(kind), _) => {
                let (rows, inner) = (shape.dims()[0], shape.dims()[1]);
                let blocks = Shape::from((rows, inner / kind.block_weights(), kind.block_bytes()));
                picked.push(Picked {
                    name: name.clone(),
                    gguf,
                    info,
                    kind,
                    blocks,
                });
            }
            (None, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => {}
            (None, other) => {
                return Err(file.tensor_error(
                    &gguf,
                    format!(
                        "{} is a type spex cannot read yet (it reads F32, F16, BF16, {})",
                        ggml_name(other),
                        QuantKind::ALL.map(QuantKind::name).join(", ")
                    ),
                ));
            }
        }
    }
    let shapes: Vec<Shape> = picked.iter().map(|p| p.blocks.clone()).collect();
    let mut arena = crate::engine::memory::Arena::<u8>::new(&shapes)
        .map_err(|e| EngineError::file(file.path(), e))?;
    for (i, p) in picked.iter().enumerate() {
        let (slot, blocks) = (arena.slot_mut(i), &p.blocks);
        file.read_stored(&p.gguf, p.info, slot)?;
        let (rows, row_blocks) = (blocks.dims()[0], blocks.dims()[1]);
        if format::layer_tensor_of(&p.name).is_some_and(super::is_permuted) {
            let row_bytes = row_blocks * blocks.dims()[2];
            let stored = slot.to_vec();
            for (r, row) in slot.chunks_exact_mut(row_bytes).enumerate() {
                let at = gguf_row(r, head_dim) * row_bytes;
                row.copy_from_slice(&stored[at..at + row_bytes]);
            }
        }
        crate::engine::kernels::repack(p.kind, slot, rows, row_blocks);
        read(slot.len() as u64);
    }
    let views = arena
        .finish(&Device::Cpu)
        .map_err(|e| EngineError::file(file.path(), e))?;
    Ok(picked.into_iter().map(|p| p.name).zip(views).collect())
}

/// A `VarBuilder` backend over a GGUF file: the blocks already in the arena as they are, every
/// other tensor dequantized and converted to the builder's type.
pub struct GgufSource<'a> {
    /// The file.
    pub file: &'a GgufFile,
    /// Quantized matrices read as blocks, by spex's name.
    pub blocks: HashMap<String, Tensor>,
    /// The model's head width (`attn_q`/`attn_k` rows are permuted by head).
    pub head_dim: usize,
}

impl SimpleBackend for GgufSource<'_> {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(blocks) = self.blocks.get(name) {
            return Ok(blocks.clone());
        }
        let tensor = self
            .file
            .read_dense(name, self.head_dim)
            .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
        crate::engine::tensor_files::expect_shape(tensor, shape, name)?
            .to_dtype(dtype)?
            .to_device(device)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let tensor = self
            .file
            .read_dense(name, self.head_dim)
            .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
        tensor.to_dtype(dtype)?.to_device(device)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.blocks.contains_key(name)
            || gguf_name(name).is_some_and(|g| self.file.content.tensor_infos.contains_key(&g))
    }
}

/// Loads the model in GGUF file `file`, of shape `config` (its [`GgufFile::config`]), on
/// `device`: on the host kernels (a CPU and a host
/// `dtype`) with its quantized matrices as stored and f32 activations; elsewhere with every
/// tensor dequantized to `dtype`. `progress` hears how far the weights are read.
pub fn load_model(
    file: &GgufFile,
    config: &LoopedConfig,
    device: &Device,
    dtype: DType,
    options: crate::engine::model::LoadOptions,
    progress: &mut dyn FnMut(crate::engine::model::LoadProgress),
) -> Result<crate::engine::model::Backend> {
    use crate::engine::model::{Backend, LoadProgress, Weights, host_matrix_specs};
    let (config, head_dim) = (config.clone(), config.head_dim);
    let tensor_error = |e: candle_core::Error| EngineError::file(file.path(), e);
    if !Backend::runs_on_host(device, dtype, options) {
        crate::engine::memory::check_device_room(device, &config, dtype, file.path())?;
        let source = GgufSource {
            file,
            blocks: HashMap::new(),
            head_dim,
        };
        let vb = candle_nn::VarBuilder::from_backend(Box::new(source), dtype, device.clone());
        let weights = Weights::load(&vb, &config).map_err(tensor_error)?;
        return Backend::for_weights(config, weights, device, dtype, options);
    }
    let timing = 2 * crate::engine::memory::kv_cache_bytes(
        &config,
        crate::engine::memory::TIMING_POSITIONS,
        4,
    );
    let what = format!("{}'s weights", file.path().display());
    crate::engine::memory::check_host_room(&what, file.bytes() as usize + timing)?;
    let mut specs = host_matrix_specs(&config);
    if !config.tied {
        specs.push((
            format::EMBED_TOKENS.to_string(),
            (config.vocab, config.hidden).into(),
        ));
    }
    let (mut read_bytes, total_bytes) = (0, file.bytes());
    let mut read = |bytes: u64| {
        read_bytes += bytes;
        progress(LoadProgress::Reading {
            read_bytes,
            total_bytes,
        });
    };
    let blocks = read_blocks_into_arena(file, &specs, head_dim, &mut read)?;
    let vb = candle_nn::VarBuilder::from_backend(
        Box::new(GgufSource {
            file,
            blocks,
            head_dim,
        }),
        dtype,
        Device::Cpu,
    );
    let weights = Weights::load(&vb, &config)
        .and_then(Weights::with_f32_norms)
        .map_err(tensor_error)?;
    progress(LoadProgress::TimingSteps);
    Backend::host(config, weights, dtype, options)
}
