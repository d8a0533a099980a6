//! `config.json` of an Ouro-format checkpoint: parsing, validation and writing.
//! Read by the checkpoint loader and written by the trainer and the random-checkpoint builder.

use std::path::Path;

use candle_core::DType;
use serde_json::{Map, Value, json};

use super::error::{EngineError, Result};
use super::exit_gate::ExitThreshold;
use super::looped::{Family, LoopedConfig};

/// The architecture fields of an Ouro checkpoint that spex uses (`engine::format`).
#[derive(Debug, Clone, PartialEq)]
pub struct OuroConfig {
    /// The residual stream's width.
    pub hidden_size: usize,
    /// K: the shared layers applied on every pass.
    pub num_hidden_layers: usize,
    /// R: the passes (Ouro's "UT steps").
    pub total_ut_steps: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (fewer than the query heads under grouped-query attention; the query
    /// heads' number when absent).
    pub num_key_value_heads: usize,
    /// Each head's width (`hidden_size` / heads when absent).
    pub head_dim: usize,
    /// The MLP's inner width.
    pub intermediate_size: usize,
    /// Rows of the embedding and the LM head.
    pub vocab_size: usize,
    /// The positions the model supports.
    pub max_position_embeddings: usize,
    /// RoPE's base.
    pub rope_theta: f64,
    /// The RMSNorms' epsilon.
    pub rms_norm_eps: f64,
    /// Whether the LM head is the embedding's transpose (false when absent).
    pub tie_word_embeddings: bool,
    /// The token a prompt starts with, where there is one.
    pub bos_token_id: Option<u32>,
    /// The tokens that end a generation (`eos_token_id`: one id or a list).
    pub eos_token_ids: Vec<u32>,
    /// The element type's name, as PyTorch spells it (`bfloat16`; `float32` when absent).
    pub torch_dtype: String,
    /// The cumulative exit probability at which Ouro's exit gate stops a token
    /// (`engine::exit_gate`); Ouro's default, 1.0 (every pass), when absent.
    pub early_exit_threshold: ExitThreshold,
    /// mlx's `quantization` block, where the matrices are mlx-quantized (`engine::mlx`).
    pub quantization: Option<crate::engine::mlx::Quantization>,
}

/// The element types a checkpoint's `torch_dtype` names, with their names: the one table
/// both ways read (writing a config, choosing the default `--dtype`).
const TORCH_DTYPES: [(DType, &str); 3] = [
    (DType::F32, "float32"),
    (DType::BF16, "bfloat16"),
    (DType::F16, "float16"),
];

/// `dtype`'s `torch_dtype` name (float32's for a type checkpoints do not store).
pub fn torch_dtype_name(dtype: DType) -> &'static str {
    (TORCH_DTYPES.iter())
        .find(|(d, _)| *d == dtype)
        .map_or("float32", |(_, name)| name)
}

impl OuroConfig {
    /// The element type the weights are stored in, by `torch_dtype` (f32 for a name spex
    /// does not know: loading reads each tensor's own type anyway).
    pub fn stored_dtype(&self) -> DType {
        (TORCH_DTYPES.iter())
            .find(|(_, name)| *name == self.torch_dtype)
            .map_or(DType::F32, |(d, _)| *d)
    }

    /// Reads and validates `config.json`; errors name the file and the field.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::engine::files::read_text(path, crate::engine::files::FileKind::Settings)?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| EngineError::file(path, format!("not valid JSON: {e}")))?;
        Self::from_json(&value, path)
    }

    /// Parses a config from JSON; `path` is only used in error messages.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self> {
        let fields = Fields {
            map: value
                .as_object()
                .ok_or_else(|| EngineError::file(path, "expected a JSON object"))?,
            path,
        };
        let model_type = fields.string("model_type")?;
        if model_type != "ouro" {
            return Err(fields.error(
                "model_type",
                format!("unknown model_type \"{model_type}\" (spex reads \"ouro\")"),
            ));
        }
        let hidden_size = fields.usize("hidden_size")?;
        let num_attention_heads = fields.usize("num_attention_heads")?;
        let head_dim = match fields.map.get("head_dim") {
            Some(Value::Null) | None => hidden_size / num_attention_heads.max(1),
            Some(_) => fields.usize("head_dim")?,
        };
        let config = Self {
            hidden_size,
            num_hidden_layers: fields.usize("num_hidden_layers")?,
            total_ut_steps: fields.usize("total_ut_steps")?,
            num_attention_heads,
            num_key_value_heads: match fields.map.get("num_key_value_heads") {
                Some(Value::Null) | None => num_attention_heads,
                Some(_) => fields.usize("num_key_value_heads")?,
            },
            head_dim,
            intermediate_size: fields.usize("intermediate_size")?,
            vocab_size: fields.usize("vocab_size")?,
            max_position_embeddings: fields.usize("max_position_embeddings")?,
            rope_theta: fields.f64("rope_theta")?,
            rms_norm_eps: fields.f64("rms_norm_eps")?,
            tie_word_embeddings: fields.bool_or("tie_word_embeddings", false)?,
            bos_token_id: fields.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: fields.token_ids("eos_token_id")?,
            torch_dtype: fields.string_or("torch_dtype", "float32")?,
            early_exit_threshold: fields.threshold_or("early_exit_threshold")?,
            quantization: match fields.map.get(crate::engine::mlx::QUANTIZATION) {
                None | Some(Value::Null) => None,
                Some(block) => Some(
                    crate::engine::mlx::Quantization::parse(block)
                        .map_err(|(field, message)| fields.error(&field, message))?,
                ),
            },
        };
        if !TORCH_DTYPES
            .iter()
            .any(|(_, name)| *name == config.torch_dtype)
        {
            let known: Vec<&str> = TORCH_DTYPES.iter().map(|(_, name)| *name).collect();
            return Err(fields.error(
                "torch_dtype",
                format!(
                    "\"{}\" is not a type spex reads ({})",
                    config.torch_dtype,
                    known.join(", ")
                ),
            ));
        }
        let act = fields.string_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(fields.error(
                "hidden_act",
                format!("\"{act}\" (spex runs Ouro's \"silu\")"),
            ));
        }
        if let Some(scaling) = fields.map.get("rope_scaling")
            && !scaling.is_null()
        {
            return Err(fields.error("rope_scaling", "only null is supported"));
        }
        config.validate(path)?;
        Ok(config)
    }

    /// Checks every size field against its bounds ([`FIELD_LIMITS`]) and the relations
    /// between fields (heads dividing evenly, an even head dimension). What the sizes add up
    /// to in memory is checked where it is allocated (`memory::check_device_room`,
    /// `memory::check_host_room`).
    pub fn validate(&self, path: &Path) -> Result<()> {
        let err = |field: &str, message: &str| EngineError::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            message: message.to_string(),
        };
        for field in FIELD_LIMITS {
            let (value, most) = ((field.value)(self), field.most);
            if value == 0 {
                return Err(err(field.name, "must be positive"));
            }
            if value > most {
                return Err(err(
                    field.name,
                    &format!("{value} is more than spex reads (at most {most})"),
                ));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(err("rms_norm_eps", "must be a positive number"));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(err("rope_theta", "must be a positive number"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(err(
                "num_key_value_heads",
                "must divide num_attention_heads",
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(err("head_dim", "must be even (rotary embedding)"));
        }
        Ok(())
    }

    /// The engine's shape of this checkpoint (`engine::looped`): the one place Ouro's names
    /// become spex's.
    pub fn looped(&self) -> LoopedConfig {
        LoopedConfig {
            family: Family::Ouro,
            hidden: self.hidden_size,
            layers: self.num_hidden_layers,
            passes: self.total_ut_steps,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            intermediate: self.intermediate_size,
            vocab: self.vocab_size,
            positions: self.max_position_embeddings,
            rope_theta: self.rope_theta,
            rms_norm_eps: self.rms_norm_eps,
            tied: self.tie_word_embeddings,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids.clone(),
            stored_dtype: self.stored_dtype(),
            exit_threshold: self.early_exit_threshold,
        }
    }

    /// The JSON written next to spex's own checkpoints (a standard Ouro config).
    pub fn to_json(&self) -> Value {
        json!({
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "total_ut_steps": self.total_ut_steps,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids.first(),
            "pad_token_id": self.eos_token_ids.first(),
            "hidden_act": "silu",
            "torch_dtype": self.torch_dtype,
            // The shortest decimal that reads back as the f32 (0.7, not 0.699999988).
            "early_exit_threshold": (self.early_exit_threshold.to_string().parse::<f64>())
                .unwrap_or(1.0),
        })
    }
}

impl From<&LoopedConfig> for OuroConfig {
    /// The Ouro config of a looped shape: what spex writes beside the weights it makes.
    fn from(c: &LoopedConfig) -> Self {
        Self {
            hidden_size: c.hidden,
            num_hidden_layers: c.layers,
            total_ut_steps: c.passes,
            num_attention_heads: c.heads,
            num_key_value_heads: c.kv_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate,
            vocab_size: c.vocab,
            max_position_embeddings: c.positions,
            rope_theta: c.rope_theta,
            rms_norm_eps: c.rms_norm_eps,
            tie_word_embeddings: c.tied,
            bos_token_id: c.bos_token_id,
            eos_token_ids: c.eos_token_ids.clone(),
            torch_dtype: torch_dtype_name(c.stored_dtype).to_string(),
            early_exit_threshold: c.exit_threshold,
            quantization: None,
        }
    }
}

impl LoopedConfig {
    /// The `config.json` of this shape, in Ouro's format.
    pub fn to_json(&self) -> Value {
        OuroConfig::from(self).to_json()
    }

    /// The shape of an Ouro `config.json` given as JSON (a trace keeps its model's);
    /// `path` names it in errors.
    pub fn from_ouro_json(value: &Value, path: &Path) -> Result<Self> {
        OuroConfig::from_json(value, path).map(|c| c.looped())
    }
}

/// The size fields of [`OuroConfig`] with the largest value spex accepts for each: far beyond
/// any released looped model, and small enough that no product of them overflows a size.
/// Passes bound the rows of a step and what every pass keeps (KV caches, trace rows); token
/// ids are `u32`, so the vocabulary cannot outgrow them.
pub const FIELD_LIMITS: [SizeField; 9] = [
    SizeField::new("hidden_size", "hidden", 1 << 20, |c| c.hidden_size),
    SizeField::new("num_hidden_layers", "layers", MOST_LAYERS, |c| {
        c.num_hidden_layers
    }),
    SizeField::new("total_ut_steps", "passes", MOST_PASSES, |c| {
        c.total_ut_steps
    }),
    SizeField::new("num_attention_heads", "heads", 4096, |c| {
        c.num_attention_heads
    }),
    SizeField::new("num_key_value_heads", "kv_heads", 4096, |c| {
        c.num_key_value_heads
    }),
    SizeField::new("head_dim", "head_dim", 4096, |c| c.head_dim),
    SizeField::new("intermediate_size", "intermediate", 1 << 40, |c| {
        c.intermediate_size
    }),
    SizeField::new("vocab_size", "vocab", 1 << 32, |c| c.vocab_size),
    SizeField::new("max_position_embeddings", "context", MOST_POSITIONS, |c| {
        c.max_position_embeddings
    }),
];

/// One size field of an Ouro config (a row of [`FIELD_LIMITS`]).
#[derive(Debug, Clone, Copy)]
pub struct SizeField {
    /// Its name in `config.json`.
    pub name: &'static str,
    /// The [`ModelShape`] field that sets it (spex's own configs and flags).
    pub shape_name: &'static str,
    /// The largest value spex accepts.
    pub most: usize,
    /// Where a parsed config holds it.
    value: fn(&OuroConfig) -> usize,
}

impl SizeField {
    const fn new(
        name: &'static str,
        shape_name: &'static str,
        most: usize,
        value: fn(&OuroConfig) -> usize,
    ) -> Self {
        Self {
            name,
            shape_name,
            most,
            value,
        }
    }
}

/// The most passes a model may have (`FIELD_LIMITS`): they bound a step's rows and what
/// every pass keeps.
pub const MOST_PASSES: usize = 256;
/// The most shared layers a model may have.
pub const MOST_LAYERS: usize = 4096;
/// The most positions a model (and so a run's context) may have.
pub const MOST_POSITIONS: usize = 1 << 32;

/// A model's shape as spex's own configs name it (training configs, random checkpoints).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// The residual stream's width.
    pub hidden: usize,
    /// K, the shared layers.
    pub layers: usize,
    /// R, the passes.
    pub passes: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Each head's width.
    pub head_dim: usize,
    /// The MLP's inner width.
    pub intermediate: usize,
    /// Vocabulary the BPE trainer aims for (the config holds at least the tokenizer's size).
    pub vocab: usize,
    /// The positions the model supports, in tokens.
    pub context: usize,
    /// Whether the LM head is the embedding's transpose.
    pub tied: bool,
}

impl ModelShape {
    /// The engine's shape of this model, for a vocabulary of `vocab` rows, stored as `dtype`.
    pub fn looped(&self, vocab: usize, dtype: DType) -> LoopedConfig {
        self.ouro_config(vocab, torch_dtype_name(dtype)).looped()
    }

    /// Checks the shape as a checkpoint's config is checked ([`OuroConfig::validate`]); errors
    /// name the shape's own field, as `{prefix}{field}` (`model.hidden`, `--hidden`). What
    /// its weights need in memory is `memory::check_shape_room`'s.
    pub fn validate(&self, path: &Path, prefix: &str) -> Result<()> {
        let config = self.ouro_config(self.vocab, "float32");
        config.validate(path).map_err(|e| match e {
            EngineError::Config {
                path,
                field,
                message,
            } => {
                let name = (FIELD_LIMITS.iter())
                    .find(|f| f.name == field)
                    .map_or(field.as_str(), |f| f.shape_name);
                EngineError::Config {
                    path,
                    field: format!("{prefix}{name}"),
                    message,
                }
            }
            e => e,
        })
    }

    /// The Ouro config of this shape for a vocabulary of `vocab` rows, stored as `torch_dtype`.
    pub fn ouro_config(&self, vocab: usize, torch_dtype: &str) -> OuroConfig {
        OuroConfig {
            hidden_size: self.hidden,
            num_hidden_layers: self.layers,
            total_ut_steps: self.passes,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate,
            vocab_size: vocab,
            max_position_embeddings: self.context,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: self.tied,
            bos_token_id: Some(0),
            eos_token_ids: vec![0],
            torch_dtype: torch_dtype.to_string(),
            early_exit_threshold: ExitThreshold::EVERY_PASS,
            quantization: None,
        }
    }
}

struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    /// An error about `field`, one line whatever the file's strings hold.
    fn error(&self, field: &str, message: impl Into<String>) -> EngineError {
        EngineError::Config {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message: super::error::one_line(&message.into()),
        }
    }

    fn get(&self, field: &str) -> Result<&Value> {
        self.map
            .get(field)
            .filter(|v| !v.is_null())
            .ok_or_else(|| self.error(field, "missing"))
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.get(field)?
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| self.error(field, "expected a non-negative integer"))
    }

    fn f64(&self, field: &str) -> Result<f64> {
        self.get(field)?
            .as_f64()
            .ok_or_else(|| self.error(field, "expected a number"))
    }

    fn string(&self, field: &str) -> Result<String> {
        self.get(field)?
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| self.error(field, "expected a string"))
    }

    fn string_or(&self, field: &str, default: &str) -> Result<String> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default.to_string()),
            Some(_) => self.string(field),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(field, "expected true or false")),
        }
    }

    /// A probability in (0, 1]; `EVERY_PASS` when absent.
    fn threshold_or(&self, field: &str) -> Result<ExitThreshold> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(ExitThreshold::EVERY_PASS),
            Some(v) => (v.as_f64())
                .and_then(|p| ExitThreshold::new(p as f32))
                .ok_or_else(|| self.error(field, format!("{v} must be a probability in (0, 1]"))),
        }
    }

    /// A token id or a list of them (HF configs use both); absent means none.
    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        let bad = || self.error(field, "expected a token id or a list of token ids");
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|id| id as u32).ok_or_else(bad))
                .collect(),
            Some(v) => v.as_u64().map(|id| vec![id as u32]).ok_or_else(bad),
        }
    }
}
