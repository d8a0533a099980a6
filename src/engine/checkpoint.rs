//! Finding and loading an Ouro checkpoint directory: `config.json`, one or more memory-mapped
//! `*.safetensors` (with `model.safetensors.index.json` when sharded) and `tokenizer.json`.
//! Used by the CLI, the dashboard and the tests; every failure names the file at fault. Also
//! the JSON writer for the `config.json` files spex writes. `spex quantize` reads these
//! checkpoints in `engine::quantize`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use super::chat::ChatTemplate;
use super::config::OuroConfig;
use super::error::{EngineError, Result};
use super::looped::LoopedConfig;
use super::memory::check_device_room;
use super::model::{Backend, LoadOptions, LoopedModel, Weights, host_matrix_specs};
use super::tensor_files::{Preloaded, TensorFiles};
use super::tokenizer::TextTokenizer;

pub use super::model::LoadProgress;

/// The files of one checkpoint directory, checked to exist.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// The engine's shape of the checkpoint (its config.json, read once).
    pub config: LoopedConfig,
    /// Its `*.safetensors` files, sorted by name: one, or the shards.
    pub weight_files: Vec<PathBuf>,
    /// Its `tokenizer.json`.
    pub tokenizer_file: PathBuf,
    /// Its mlx quantization, where its matrices are mlx-quantized (`engine::mlx`).
    pub quantization: Option<crate::engine::mlx::Quantization>,
}

impl Checkpoint {
    /// Resolves the files of the checkpoint in `dir` and parses its config.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(EngineError::file(dir, "no such checkpoint directory"));
        }
        let config_file = dir.join("config.json");
        // `exists`, not `is_file`: a config.json that is a FIFO or a device is refused by
        // the capped read as what it is, not reported as missing.
        if !config_file.exists() {
            return Err(EngineError::file(&config_file, "missing"));
        }
        let ouro = OuroConfig::load(&config_file)?;
        let (config, quantization) = (ouro.looped(), ouro.quantization);
        let tokenizer_file = dir.join("tokenizer.json");
        if !tokenizer_file.exists() {
            return Err(EngineError::file(&tokenizer_file, "missing"));
        }
        crate::engine::files::check_readable(
            &tokenizer_file,
            crate::engine::files::FileKind::Tokenizer,
        )?;
        Ok(Self {
            dir: dir.to_path_buf(),
            weight_files: weight_files(dir)?,
            config,
            tokenizer_file,
            quantization,
        })
    }

    /// Loads the weights on `device` in `dtype` with the backend that suits them; a wrong or
    /// missing tensor names itself.
    pub fn load_model(
        &self,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Backend> {
        self.load_model_reporting(device, dtype, options, &mut |_| {})
    }

    /// [`Checkpoint::load_model`], telling `progress` how far the host kernels' weights are
    /// read (the bulk of a large checkpoint's load).
    pub fn load_model_reporting(
        &self,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Backend> {
        if self.quantization.is_some() && Backend::runs_on_host(device, dtype, options) {
            // Quantized matrices stay as stored: the files' bytes, not the dense shape's.
            let file_bytes = (self.weight_files.iter())
                .map(|f| std::fs::metadata(f).map_or(0, |m| m.len() as usize))
                .sum::<usize>();
            let timing = 2 * crate::engine::memory::kv_cache_bytes(
                &self.config,
                crate::engine::memory::TIMING_POSITIONS,
                4,
            );
            let what = format!("{}'s weights", self.dir.display());
            crate::engine::memory::check_host_room(&what, file_bytes * 10 / 9 + timing)?;
        } else {
            check_device_room(device, &self.config, dtype, &self.dir)?;
        }
        let files =
            TensorFiles::open(&self.weight_files)?.with_quantization(self.quantization.clone());
        if Backend::runs_on_host(device, dtype, options) {
            return self.load_host(files, dtype, options, progress);
        }
        let vb = VarBuilder::from_backend(Box::new(files), dtype, device.clone());
        let weights = Weights::load(&vb, &self.config).map_err(|e| self.tensor_error(e))?;
        Backend::for_weights(self.config.clone(), weights, device, dtype, options)
    }

    /// The host kernels' model: the matrices they stream read straight from the files into
    /// one arena in `dtype` (`TensorFiles::read_into_arena`), so the load holds the weights
    /// once and copies them once; the rest read as tensors.
    fn load_host(
        &self,
        files: TensorFiles,
        dtype: DType,
        options: LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Backend> {
        let mut specs = host_matrix_specs(&self.config);
        let quantization = self.quantization.as_ref();
        if quantization.is_some() && !self.config.tied {
            // mlx quantizes the embedding too: it stays in blocks, its rows dequantized as
            // they are looked up (as a GGUF file's).
            specs.push((
                super::format::EMBED_TOKENS.to_string(),
                (self.config.vocab, self.config.hidden).into(),
            ));
        }
        let stored_bytes = |(name, shape): &(String, candle_core::Shape)| match quantization {
            Some(q) if files.is_quantized(name) => {
                let kind = q.kind_of(name);
                shape.elem_count() / kind.group() * kind.block_bytes()
            }
            _ => shape.elem_count() * dtype.size_in_bytes(),
        };
        let total_bytes = specs.iter().map(|s| stored_bytes(s) as u64).sum();
        let mut read_bytes = 0;
        let mut read = |bytes: u64| {
            read_bytes += bytes;
            progress(LoadProgress::Reading {
                read_bytes,
                total_bytes,
            });
        };
        let mut tensors = match quantization {
            Some(_) => files.read_affine_into_arena(&specs, &mut read),
            None => Ok(Default::default()),
        }
        .map_err(|e| self.tensor_error(e))?;
        specs.retain(|(name, _)| !tensors.contains_key(name));
        let dense = match dtype {
            DType::BF16 => files.read_into_arena::<half::bf16>(&specs, &mut read),
            DType::F16 => files.read_into_arena::<half::f16>(&specs, &mut read),
            _ => files.read_into_arena::<f32>(&specs, &mut read),
        }
        .map_err(|e| self.tensor_error(e))?;
        tensors.extend(dense);
        let preloaded = Preloaded { files, tensors };
        let vb = VarBuilder::from_backend(Box::new(preloaded), dtype, Device::Cpu);
        let weights = Weights::load(&vb, &self.config)
            .and_then(Weights::with_f32_norms)
            .map_err(|e| self.tensor_error(e))?;
        progress(LoadProgress::TimingSteps);
        Backend::host(self.config.clone(), weights, dtype, options)
    }

    fn tensor_error(&self, e: candle_core::Error) -> EngineError {
        let message = e.to_string();
        let name = message
            .split_whitespace()
            .find(|w| w.starts_with("model.") || w.starts_with("lm_head"))
            .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric() && c != '.' && c != '_'))
            .unwrap_or("?")
            .to_string();
        let path = if self.weight_files.len() == 1 {
            self.weight_files[0].clone()
        } else {
            self.dir.clone()
        };
        let message = message.lines().next().unwrap_or_default().to_string();
        EngineError::Tensor {
            path,
            name,
            message,
        }
    }

    /// Loads `tokenizer.json`, with the chat template of `tokenizer_config.json` where there
    /// is one.
    pub fn load_tokenizer(&self) -> Result<TextTokenizer> {
        let tokenizer = TextTokenizer::load(&self.tokenizer_file, &self.config.eos_token_ids)?;
        Ok(tokenizer.with_chat_template(ChatTemplate::load(&self.dir)?))
    }
}

/// The element type the checkpoint in `dir` stores its weights in, by its config; `None`
/// where the config cannot be read (loading then names the fault).
pub fn stored_dtype(dir: &Path) -> Option<DType> {
    // mlx-quantized matrices compute in f32 on the host, as a GGUF file's.
    OuroConfig::load(&dir.join("config.json"))
        .ok()
        .map(|c| match c.quantization {
            Some(_) => DType::F32,
            None => c.stored_dtype(),
        })
}

/// Whether `dir` holds a checkpoint's files (a config, weights or a shard index): what a
/// command that writes one must not replace unasked.
pub fn holds_checkpoint(dir: &Path) -> bool {
    let named = ["config.json", "model.safetensors", SHARD_INDEX];
    named.iter().any(|n| dir.join(n).exists())
        || std::fs::read_dir(dir).is_ok_and(|entries| {
            (entries.flatten()).any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        })
}

pub use super::format::SHARD_INDEX;

/// The shard files an index (`model.safetensors.index.json`) names in its `weight_map`,
/// each once, in order. A name outside the index's folder (absolute, or through `..`) is an
/// error: a downloaded index must not reach other files.
pub fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = crate::engine::files::read_text(index, crate::engine::files::FileKind::Settings)?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| EngineError::file(index, format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| EngineError::Config {
            path: index.to_path_buf(),
            field: "weight_map".into(),
            message: "missing or not an object".into(),
        })?;
    let names: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    let outside = |n: &&&str| n.starts_with('/') || n.split('/').any(|part| part == "..");
    if let Some(bad) = names.iter().find(outside) {
        return Err(EngineError::file(
            index,
            format!("shard `{bad}` is outside the checkpoint's folder"),
        ));
    }
    Ok(names.into_iter().map(String::from).collect())
}

/// The safetensors files: those the index names when sharded, else every `*.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(SHARD_INDEX);
    if index.is_file() {
        let files: Vec<PathBuf> = (shard_names(&index)?.iter()).map(|n| dir.join(n)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(EngineError::file(
                missing,
                "named in model.safetensors.index.json but missing",
            ));
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| EngineError::file(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(EngineError::file(dir.join("model.safetensors"), "missing"));
    }
    Ok(files)
}

/// A loaded model on the backend chosen for it, with its tokenizer, shared by every decoder
/// thread.
#[derive(Debug, Clone)]
pub struct LoadedModel {
    /// The model, on the backend it decodes with (host kernels or candle ops).
    pub backend: Backend,
    /// Its tokenizer.
    pub tokenizer: Arc<TextTokenizer>,
    /// Where it was loaded from.
    pub origin: Origin,
    /// The draft model beside it, for the policy that drafts with one
    /// (`policy::draft_model`); attached by [`LoadedModel::with_draft`].
    pub draft: Option<Arc<LoadedModel>>,
}

impl Origin {
    /// Its tokenizer file, for messages.
    pub fn tokenizer_file(&self) -> std::path::PathBuf {
        match self {
            Self::Dir(dir) => dir.join("tokenizer.json"),
            Self::Gguf(path) => gguf_tokenizer_file(path).unwrap_or_else(|| path.clone()),
            Self::Embedded(_) => Path::new("<embedded>").join("tokenizer.json"),
        }
    }
}

/// Where a loaded model's files are.
#[derive(Debug, Clone)]
pub enum Origin {
    /// A checkpoint directory.
    Dir(std::path::PathBuf),
    /// A GGUF file in llama.cpp's Ouro layout (`engine::gguf`).
    Gguf(std::path::PathBuf),
    /// Built into the binary.
    Embedded(CheckpointBytes),
}

impl Origin {
    /// The element type the checkpoint stores its weights in, by its config's `torch_dtype`
    /// (f32 for the embedded model, and where the config cannot be read: loading then names
    /// the fault).
    pub fn stored_dtype(&self) -> DType {
        match self {
            Self::Dir(dir) => stored_dtype(dir).unwrap_or(DType::F32),
            // Quantized weights compute in f32 on the host (`gguf::load`).
            Self::Gguf(_) | Self::Embedded(_) => DType::F32,
        }
    }

    /// Whether its files are on this machine (the config of a directory, the GGUF file).
    pub fn is_present(&self) -> bool {
        match self {
            Self::Dir(dir) => dir.join("config.json").is_file(),
            Self::Gguf(path) => path.is_file(),
            Self::Embedded(_) => true,
        }
    }

    /// The type its weights are stored in, read from the config or the GGUF header without
    /// loading them (`bf16`, `Q4_K_M`, `mlx4/g64`); `None` where neither can be read.
    pub fn weight_type(&self) -> Option<String> {
        match self {
            Self::Dir(dir) => {
                let config = OuroConfig::load(&dir.join("config.json")).ok()?;
                Some(match config.quantization {
                    Some(q) => q.kind.name(),
                    None => config.stored_dtype().as_str().to_string(),
                })
            }
            Self::Gguf(path) => crate::engine::gguf::load::GgufFile::open(path)
                .ok()?
                .weight_type_name()
                .map(str::to_string),
            Self::Embedded(_) => Some(DType::F32.as_str().to_string()),
        }
    }
}

/// One checkpoint a load reads: where its files are, the element type its weights load in,
/// and whether generation also stops at the chat end-of-turn token.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// Where the checkpoint is.
    pub origin: Origin,
    /// The element type the weights are loaded in.
    pub dtype: DType,
    /// Stop at the chat template's end-of-turn token too ([`LoadedModel::enable_chat_stop`]).
    pub chat_stop: bool,
}

/// What one load brings up on one device: a model and, for the policy that drafts with a
/// separate model (`policy::draft_model`), its draft model beside it, both with `options`.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// The model decoded.
    pub model: ModelFiles,
    /// Its draft model, if a run will draft with one.
    pub draft: Option<ModelFiles>,
    /// The backend's settings, the same for both.
    pub options: LoadOptions,
}

/// A checkpoint's three files held in memory (spex's own model, built into the binary).
#[derive(Debug, Clone, Copy)]
pub struct CheckpointBytes {
    /// The `config.json`.
    pub config: &'static [u8],
    /// The weights, one `.safetensors` file.
    pub weights: &'static [u8],
    /// The `tokenizer.json`.
    pub tokenizer: &'static [u8],
}

/// The embedded checkpoint's config file, as messages name it.
const EMBEDDED_CONFIG: &str = "<embedded>/config.json";

impl CheckpointBytes {
    /// The engine's shape of the checkpoint: its config.json parsed and checked.
    pub(super) fn looped_config(&self) -> Result<LoopedConfig> {
        let path = Path::new(EMBEDDED_CONFIG);
        let json: serde_json::Value =
            serde_json::from_slice(self.config).map_err(|e| EngineError::file(path, e))?;
        Ok(OuroConfig::from_json(&json, path)?.looped())
    }
}

impl LoadedModel {
    /// Makes generation stop at the chat end-of-turn token too.
    pub fn enable_chat_stop(&mut self) {
        let mut tokenizer = (*self.tokenizer).clone();
        tokenizer.stop_at_end_of_turn();
        self.tokenizer = Arc::new(tokenizer);
    }

    /// Loads `plan` on `device`: the model, then its draft model attached to it
    /// ([`LoadedModel::with_draft`]), telling `progress` how far each one's weights are read.
    pub fn open(
        plan: &LoadPlan,
        device: &Device,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let model = Self::open_one(&plan.model, device, plan.options, progress)?;
        let Some(draft) = &plan.draft else {
            return Ok(model);
        };
        // Loaded with the model's options, so that its prefetch plan is timed on as many
        // threads as it decodes with: `with_draft` then moves it onto the model's own pool.
        let draft = Self::open_one(draft, device, plan.options, progress)?;
        model.with_draft(draft)
    }

    /// Loads one checkpoint of a [`LoadPlan`].
    fn open_one(
        files: &ModelFiles,
        device: &Device,
        options: LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let mut loaded = match &files.origin {
            Origin::Dir(dir) => Self::load_reporting(dir, device, files.dtype, options, progress)?,
            Origin::Gguf(path) => Self::load_gguf(path, device, files.dtype, options, progress)?,
            Origin::Embedded(bytes) => Self::from_bytes(*bytes, device, files.dtype, options)?,
        };
        if files.chat_stop {
            loaded.enable_chat_stop();
        }
        Ok(loaded)
    }

    /// Opens and loads the checkpoint in `dir` with the default [`LoadOptions`].
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Self> {
        Self::load_with(dir, device, dtype, LoadOptions::default())
    }

    /// Opens and loads the checkpoint in `dir`.
    pub fn load_with(
        dir: &Path,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Self> {
        Self::load_reporting(dir, device, dtype, options, &mut |_| {})
    }

    /// [`LoadedModel::load_with`], telling `progress` how far the weights are read.
    pub fn load_reporting(
        dir: &Path,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let checkpoint = Checkpoint::open(dir)?;
        let tokenizer = checkpoint.load_tokenizer()?;
        let backend = checkpoint.load_model_reporting(device, dtype, options, progress)?;
        Self::assemble(
            backend,
            tokenizer,
            Origin::Dir(dir.to_path_buf()),
            &dir.join("config.json"),
        )
    }

    /// Loads the GGUF file at `path` (`engine::gguf`), with the `tokenizer.json` beside it
    /// where there is one, else the tokenizer its metadata holds; the chat template of a
    /// `tokenizer_config.json` beside it.
    pub fn load_gguf(
        path: &Path,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let file = super::gguf::load::GgufFile::open(path)?;
        let config = file.config()?;
        let tokenizer = match gguf_tokenizer_file(path) {
            Some(beside) => TextTokenizer::load(&beside, &config.eos_token_ids)?,
            None => {
                TextTokenizer::new(super::gguf::vocab::tokenizer(&file)?, &config.eos_token_ids)
            }
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        let tokenizer = tokenizer.with_chat_template(ChatTemplate::load(dir)?);
        let backend =
            super::gguf::load::load_model(&file, &config, device, dtype, options, progress)?;
        Self::assemble(backend, tokenizer, Origin::Gguf(path.to_path_buf()), path)
    }

    /// Loads a checkpoint held in memory (the binary's embedded model).
    pub fn from_bytes(
        bytes: CheckpointBytes,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Self> {
        let path = Path::new(EMBEDDED_CONFIG);
        let config = bytes.looped_config()?;
        check_device_room(device, &config, dtype, Path::new("<embedded>"))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes.tokenizer)
            .map_err(|e| EngineError::file("<embedded>/tokenizer.json", e))?;
        let tokenizer = TextTokenizer::new(inner, &config.eos_token_ids);
        let vb = VarBuilder::from_buffered_safetensors(bytes.weights.to_vec(), dtype, device)
            .map_err(|e| EngineError::file("<embedded>/model.safetensors", e))?;
        let weights = Weights::load(&vb, &config)
            .map_err(|e| EngineError::file("<embedded>/model.safetensors", e))?;
        let backend = Backend::for_weights(config, weights, device, dtype, options)?;
        Self::assemble(backend, tokenizer, Origin::Embedded(bytes), path)
    }

    /// The model, whatever its backend.
    pub fn model(&self) -> &Arc<LoopedModel> {
        self.backend.model()
    }

    fn assemble(
        backend: Backend,
        tokenizer: TextTokenizer,
        origin: Origin,
        config_path: &Path,
    ) -> Result<Self> {
        let model = backend.model();
        if tokenizer.vocab_size() > model.config.vocab {
            return Err(EngineError::Config {
                path: config_path.to_path_buf(),
                field: "vocab_size".into(),
                message: format!(
                    "{} is smaller than the tokenizer's {} tokens",
                    model.config.vocab,
                    tokenizer.vocab_size()
                ),
            });
        }
        Ok(Self {
            backend,
            tokenizer: Arc::new(tokenizer),
            origin,
            draft: None,
        })
    }

    /// This model with `draft` beside it as its draft model; an error names both tokenizer
    /// files unless they give every id the same token.
    pub fn with_draft(self, draft: LoadedModel) -> Result<Self> {
        if !self.tokenizer.same_vocabulary(&draft.tokenizer) {
            return Err(EngineError::Invalid(format!(
                "the draft model's tokenizer {} differs from the model's {}: a draft model must share its vocabulary",
                draft.origin.tokenizer_file().display(),
                self.origin.tokenizer_file().display()
            )));
        }
        // The draft model decodes between the model's steps: on the model's own threads.
        let backend = match (&self.backend, draft.backend) {
            (Backend::Host(model), Backend::Host(d)) => {
                Backend::Host(Arc::new(d.on_threads_of(model.kernels())))
            }
            (_, other) => other,
        };
        let draft = LoadedModel { backend, ..draft };
        Ok(Self {
            draft: Some(Arc::new(draft)),
            ..self
        })
    }
}

/// The `tokenizer.json` beside GGUF file `path`, if there is one (it wins over the file's
/// own tokenizer metadata).
pub fn gguf_tokenizer_file(path: &Path) -> Option<PathBuf> {
    Some(path.with_file_name("tokenizer.json")).filter(|p| p.exists())
}

/// Writes pretty JSON to `path`.
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| EngineError::file(path, e))?;
    super::files::write_atomically(path, |out| out.write_all((text + "\n").as_bytes()))
}
