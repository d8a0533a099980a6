//! Writes small random checkpoints in the real Ouro format (config.json, safetensors, a
//! byte-level BPE tokenizer.json trained on a few KB of text). Tests build them in temp
//! directories; `spex random-checkpoint` builds them for benchmarks.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::checkpoint::write_json;
use super::config::ModelShape;
use super::error::{EngineError, Result};
use super::format::{Role, checkpoint_tensors, neutral_exit_gate};
use super::looped::LoopedConfig;
use super::rng::SplitMix;
use super::tokenizer::train_bpe;

/// Public-domain text (Shakespeare's sonnets) to train the test tokenizers on.
pub const SAMPLE_TEXT: &str = include_str!("../../assets/sample-text.txt");

/// The shape of a random checkpoint and how to write it.
#[derive(Debug, Clone)]
pub struct RandomSpec {
    /// The model's shape.
    pub shape: ModelShape,
    /// Write the weights as two shards plus `model.safetensors.index.json`.
    pub sharded: bool,
    /// Draw Ouro's early-exit gate (which spex ignores) from the generator like the other
    /// weights, as the tests' checkpoints do; otherwise write the neutral gate
    /// (`format::neutral_exit_gate`), drawing nothing.
    pub random_exit_gate: bool,
    /// The element type the weights are stored in.
    pub dtype: DType,
    /// Seeds the generator the weights are drawn from: the same seed, the same weights.
    pub seed: u64,
    /// Pad the config's vocab_size to this (a small corpus caps the tokenizer's size; real
    /// checkpoints also have more rows than tokens).
    pub pad_vocab_to: Option<usize>,
}

impl Default for RandomSpec {
    fn default() -> Self {
        Self {
            shape: ModelShape {
                hidden: 64,
                layers: 2,
                passes: 4,
                heads: 4,
                kv_heads: 4,
                head_dim: 16,
                intermediate: 128,
                vocab: 384,
                context: 256,
                tied: true,
            },
            sharded: false,
            random_exit_gate: true,
            dtype: DType::F32,
            seed: 1,
            pad_vocab_to: None,
        }
    }
}

impl RandomSpec {
    /// The config.json this spec writes, for a tokenizer of `tokenizer_vocab` tokens.
    pub fn config(&self, tokenizer_vocab: usize) -> LoopedConfig {
        let vocab = self.pad_vocab_to.unwrap_or(0).max(tokenizer_vocab);
        self.shape.looped(vocab, self.dtype)
    }
}

/// Writes a random checkpoint into `dir` (created if needed).
pub fn write_random_checkpoint(dir: &Path, spec: &RandomSpec) -> Result<LoopedConfig> {
    std::fs::create_dir_all(dir).map_err(|e| EngineError::file(dir, e))?;
    let tokenizer_path = dir.join("tokenizer.json");
    train_bpe(SAMPLE_TEXT.lines(), spec.shape.vocab, &tokenizer_path)?;
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| EngineError::file(&tokenizer_path, e))?;
    let config = spec.config(tokenizer.get_vocab_size(true));
    write_json(&dir.join("config.json"), &config.to_json())?;
    let mut tensors = random_tensors(&config, spec)?;
    if !spec.random_exit_gate {
        tensors.extend(neutral_exit_gate(&config, spec.dtype)?);
    }
    write_weights(dir, tensors, spec.sharded)?;
    Ok(config)
}

/// The name, shape and scale (0 for norm weights) of every tensor drawn at random, from
/// `format`'s table: all but the exit gate unless the spec draws it too.
fn tensor_shapes(config: &LoopedConfig, spec: &RandomSpec) -> Vec<(String, Vec<usize>, f32)> {
    checkpoint_tensors(config)
        .into_iter()
        .filter(|t| spec.random_exit_gate || t.role != Role::ExitGate)
        .map(|t| {
            let scale = match t.role {
                Role::Embedding => 1.0,
                Role::LmHead { fan_in } => 1.0 / (fan_in as f32).sqrt(),
                Role::Linear { fan_in } => 1.7 / (fan_in as f32).sqrt(),
                Role::Norm => 0.0,
                Role::ExitGate => 0.1,
            };
            (t.name, t.shape, scale)
        })
        .collect()
}

fn random_tensors(config: &LoopedConfig, spec: &RandomSpec) -> Result<Vec<(String, Tensor)>> {
    let mut rng = SplitMix(spec.seed);
    tensor_shapes(config, spec)
        .into_iter()
        .map(|(name, shape, scale)| {
            let n: usize = shape.iter().product();
            // Norm weights (scale 0) are 1 ± noise; the rest uniform in ±scale.
            let data: Vec<f32> = (0..n)
                .map(|_| {
                    if scale == 0.0 {
                        1.0 + 0.1 * rng.uniform()
                    } else {
                        scale * rng.uniform()
                    }
                })
                .collect();
            let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(spec.dtype)?;
            Ok((name, t))
        })
        .collect()
}

/// Writes `tensors` to `path` through a temporary file, so an interrupted write never leaves
/// a cut one under the real name.
fn save_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    super::files::write_via_temporary(path, |temp| {
        candle_core::safetensors::save(tensors, temp).map_err(std::io::Error::other)
    })
}

/// Writes `model.safetensors`, or two shards and an index.
pub fn write_weights(dir: &Path, tensors: Vec<(String, Tensor)>, sharded: bool) -> Result<()> {
    if !sharded {
        let map: HashMap<String, Tensor> = tensors.into_iter().collect();
        let path = dir.join("model.safetensors");
        return save_safetensors(&map, &path);
    }
    let half = tensors.len() / 2;
    let mut weight_map = serde_json::Map::new();
    let mut shards: [HashMap<String, Tensor>; 2] = Default::default();
    for (n, (name, t)) in tensors.into_iter().enumerate() {
        let shard = usize::from(n >= half);
        weight_map.insert(
            name.clone(),
            format!("model-0000{}-of-00002.safetensors", shard + 1).into(),
        );
        shards[shard].insert(name, t);
    }
    for (s, map) in shards.iter().enumerate() {
        let path = dir.join(format!("model-0000{}-of-00002.safetensors", s + 1));
        save_safetensors(map, &path)?;
    }
    write_json(
        &dir.join("model.safetensors.index.json"),
        &serde_json::json!({ "metadata": {}, "weight_map": weight_map }),
    )
}
