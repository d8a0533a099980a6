//! The training config file (TOML): the model's shape and the optimisation settings,
//! validated as a whole before anything runs.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use crate::engine::config::ModelShape;
use crate::engine::error::{EngineError, Result, toml_error};
use crate::engine::looped::LoopedConfig;

/// Optimisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSettings {
    pub seq_len: usize,
    pub batch: usize,
    pub steps: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub seed: u64,
    /// Loss weight of each pass's readout, pass 1 first (R values).
    pub pass_weights: Vec<f64>,
    /// Share of the target that passes 1..R−1 take from pass R's (detached) distribution
    /// instead of the next token: 0 is plain cross-entropy, 1 pure self-distillation. It
    /// trains early passes to agree with pass R, which is what SPEED's speculation needs.
    #[serde(default)]
    pub agreement_weight: f64,
    /// Share of pass R's target taken from pass 1's (detached) distribution instead of the
    /// next token: the other direction of `agreement_weight`, pulling the deep readout towards
    /// what SPEED proposes from, so fewer proposals flip. 0 trains pass R on the tokens alone.
    #[serde(default)]
    pub last_pass_agreement_weight: f64,
    /// Temperature of pass R's distribution as the target of passes 1..R−1: below 1 sharpens
    /// it, so they learn its top-1 token (what agreement counts) more than the rest of it.
    /// Pass R's own target stays at temperature 1. Measured on the default model, sharpening
    /// does not pay: the passes share their weights, so pass 1's overconfidence reaches pass R
    /// (pass R's held-out loss rose at 0.7, and more at 0.5 together with
    /// `last_pass_agreement_weight` 0.5).
    #[serde(default = "unit_temperature")]
    pub agreement_temperature: f64,
    /// Corpus files (by file name) held out whole for validation.
    pub validation_files: Vec<String>,
    /// Start a fresh run from this checkpoint directory (relative to the working directory)
    /// instead of random weights, with its tokenizer. Its tensors must match this shape's,
    /// except that K may grow: layers past the checkpoint's start as identity blocks (their
    /// output norms' gains zero), so a deeper model begins exactly where the trained one ended.
    #[serde(default)]
    pub init_from: Option<PathBuf>,
    pub eval_every: usize,
    pub eval_batches: usize,
    pub checkpoint_minutes: f64,
}

/// The optimisation settings that must be finite and in range before a step runs: a NaN or
/// negative rate, clip or pass weight would write a NaN checkpoint. The error is the field
/// and what it must be.
fn check_hyperparameters(
    t: &TrainSettings,
) -> std::result::Result<(), (&'static str, &'static str)> {
    let at_least_zero = [
        ("train.min_lr", t.min_lr),
        ("train.weight_decay", t.weight_decay),
        ("train.checkpoint_minutes", t.checkpoint_minutes),
    ];
    for (field, value) in at_least_zero {
        if !(value.is_finite() && value >= 0.0) {
            return Err((field, "must be a finite number, 0 or more"));
        }
    }
    for (field, value) in [("train.lr", t.lr), ("train.grad_clip", t.grad_clip)] {
        if !(value.is_finite() && value > 0.0) {
            return Err((field, "must be a positive finite number"));
        }
    }
    if t.min_lr > t.lr {
        return Err(("train.min_lr", "must not exceed train.lr"));
    }
    if !(t.pass_weights.iter()).all(|w| w.is_finite() && *w >= 0.0) {
        return Err(("train.pass_weights", "must be finite and 0 or more"));
    }
    if t.pass_weights.iter().sum::<f64>() <= 0.0 {
        return Err(("train.pass_weights", "need at least one positive weight"));
    }
    if t.batch == 0 {
        return Err(("train.batch", "must be positive"));
    }
    if t.steps == 0 {
        return Err(("train.steps", "must be positive"));
    }
    Ok(())
}

fn unit_temperature() -> f64 {
    1.0
}

/// A training config file (TOML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub model: ModelShape,
    pub train: TrainSettings,
}

impl TrainConfig {
    /// Reads and validates a TOML training config.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::engine::files::read_text(path, crate::engine::files::FileKind::Settings)?;
        let config: Self = toml::from_str(&text).map_err(|e| toml_error(path, &text, &e))?;
        let err = |field: &str, message: &str| EngineError::Config {
            path: path.to_path_buf(),
            field: field.into(),
            message: message.into(),
        };
        let m = &config.model;
        if m.layers == 0 || m.passes == 0 {
            return Err(err(
                "model.layers",
                "K·R (model.layers × model.passes) must be positive",
            ));
        }
        if m.heads == 0 || !m.hidden.is_multiple_of(m.heads) {
            return Err(err("model.hidden", "must be divisible by model.heads"));
        }
        // Parameters, gradients and AdamW's two moments: four f32 copies of the weights.
        m.validate(path, "model.")?;
        crate::engine::memory::check_shape_room(m, 4, path)?;
        if config.train.pass_weights.len() != m.passes {
            return Err(err(
                "train.pass_weights",
                "needs one weight per pass (model.passes values)",
            ));
        }
        let t = &config.train;
        check_hyperparameters(t).map_err(|(field, message)| err(field, message))?;
        for (field, weight) in [
            ("train.agreement_weight", t.agreement_weight),
            (
                "train.last_pass_agreement_weight",
                t.last_pass_agreement_weight,
            ),
        ] {
            if !(0.0..=1.0).contains(&weight) {
                return Err(err(field, "must be between 0 and 1"));
            }
        }
        if !(t.agreement_temperature > 0.0 && t.agreement_temperature.is_finite()) {
            return Err(err(
                "train.agreement_temperature",
                "must be a positive number",
            ));
        }
        if config.train.eval_every == 0 || config.train.eval_batches == 0 {
            return Err(err(
                "train.eval_every",
                "eval_every and eval_batches must be positive",
            ));
        }
        if config.train.seq_len == 0 || config.train.seq_len >= m.context {
            return Err(err(
                "train.seq_len",
                "must be positive and below model.context",
            ));
        }
        Ok(config)
    }

    /// The engine's shape of the model, for a tokenizer of `vocab` tokens, in f32.
    pub fn model_config(&self, vocab: usize) -> LoopedConfig {
        self.model.looped(vocab, candle_core::DType::F32)
    }

    /// Learning rate at `step`: linear warm-up, then cosine decay to `min_lr`.
    pub fn lr_at(&self, step: usize) -> f64 {
        let t = &self.train;
        if step < t.warmup_steps {
            return t.lr * (step + 1) as f64 / t.warmup_steps as f64;
        }
        let progress = (step - t.warmup_steps) as f64 / (t.steps - t.warmup_steps).max(1) as f64;
        t.min_lr
            + 0.5 * (t.lr - t.min_lr) * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
    }
}
