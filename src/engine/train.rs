//! `spex train`: trains a looped model in the Ouro format with a weighted cross-entropy on the
//! readout after every pass (SPEED §4's per-layer-group loss; Ouro's per-step loss), so that
//! early passes already predict what pass R will. AdamW (our own, so its moments can be saved
//! and resumed), warm-up + cosine schedule, gradient clipping, a fixed seed, whole held-out
//! plays for validation, and resumable checkpoints; a fresh run may start from a trained
//! checkpoint and grow its K (`train.init_from`). The CLI renders progress; this module
//! reports it through a callback.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

pub use super::config::ModelShape;
use super::config::OuroConfig;
use super::error::{EngineError, Result, toml_error};
use super::format;
use super::model::fused;
use super::model::reference::Ops;
use super::model::{LoopedModel, Weights};
use super::random_checkpoint::{SplitMix, write_json};
use super::tokenizer::{TextTokenizer, train_bpe};

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
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::file(path, e))?;
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
        config.ouro_config(4096).validate(path)?;
        if config.train.pass_weights.len() != m.passes {
            return Err(err(
                "train.pass_weights",
                "needs one weight per pass (model.passes values)",
            ));
        }
        if config.train.eval_every == 0 || config.train.eval_batches == 0 {
            return Err(err(
                "train.eval_every",
                "eval_every and eval_batches must be positive",
            ));
        }
        if config.train.seq_len == 0 || config.train.batch == 0 || config.train.seq_len >= m.context
        {
            return Err(err(
                "train.seq_len",
                "must be positive and below model.context",
            ));
        }
        Ok(config)
    }

    /// The Ouro config of the model, for a tokenizer of `vocab` tokens.
    pub fn ouro_config(&self, vocab: usize) -> OuroConfig {
        self.model.ouro_config(vocab, "float32")
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

/// Token streams of the corpus: training files and held-out files.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub train: Vec<u32>,
    pub validation: Vec<u32>,
}

/// Reads the corpus files; errors name a missing or empty file.
pub fn read_corpus(files: &[PathBuf]) -> Result<Vec<(PathBuf, String)>> {
    if files.is_empty() {
        return Err(EngineError::Invalid("corpus: no files given".into()));
    }
    let texts = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).map_err(|e| EngineError::file(f, e))?;
            if text.trim().is_empty() {
                return Err(EngineError::file(f, "empty corpus file"));
            }
            Ok((f.clone(), text))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(texts)
}

/// Progress of a training run, reported after every step.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Progress {
    pub step: usize,
    pub steps: usize,
    pub loss_per_pass: Vec<f64>,
    pub lr: f64,
    pub tokens_seen: u64,
    pub tokens_per_sec: f64,
    pub elapsed_secs: f64,
    pub validation: Option<Validation>,
}

/// Held-out metrics: loss of every pass's readout and its top-1 agreement with pass R.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct Validation {
    pub loss_per_pass: Vec<f64>,
    pub agreement_with_last: Vec<f64>,
}

/// What is saved next to the weights to resume a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainState {
    config: TrainConfig,
    step: usize,
    tokens_seen: u64,
    elapsed_secs: f64,
    history: Vec<Progress>,
}

impl TrainState {
    /// A fresh state, or, with `resume`, the saved one when its model shape matches `config`.
    /// Refuses to start fresh over an existing checkpoint.
    fn begin(config: &TrainConfig, config_path: &Path, out: &Path, resume: bool) -> Result<Self> {
        if !resume {
            if out.join("model.safetensors").exists() {
                return Err(EngineError::file(
                    out,
                    "already holds a checkpoint: pass --resume or choose another --out",
                ));
            }
            return Ok(Self {
                config: config.clone(),
                step: 0,
                tokens_seen: 0,
                elapsed_secs: 0.0,
                history: Vec::new(),
            });
        }
        let state_path = out.join(STATE_JSON);
        let text =
            std::fs::read_to_string(&state_path).map_err(|e| EngineError::file(&state_path, e))?;
        let state: Self =
            serde_json::from_str(&text).map_err(|e| EngineError::file(&state_path, e))?;
        if state.config.model != config.model {
            return Err(EngineError::file(
                &state_path,
                format!(
                    "resume: checkpoint has shape {:?}, {} asks for {:?}",
                    state.config.model,
                    config_path.display(),
                    config.model
                ),
            ));
        }
        Ok(Self {
            config: config.clone(),
            ..state
        })
    }
}

/// The model over a `VarMap`, seeded fresh or, when resuming at `resume_step`, loaded with the
/// saved weights and optimiser moments from `out`.
fn build_model(
    ouro: OuroConfig,
    config: &TrainConfig,
    out: &Path,
    resume_step: Option<usize>,
) -> Result<(LoopedModel, VarMap, AdamW)> {
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let weights = Weights::load(&vb, &ouro)?;
    match resume_step {
        Some(_) => {
            let path = out.join("model.safetensors");
            varmap
                .load(&path)
                .map_err(|e| EngineError::file(&path, e))?;
        }
        None => seeded_init(&varmap, config.train.seed)?,
    }
    let model = LoopedModel::new(ouro, weights, Device::Cpu, DType::F32)?;
    let mut opt = AdamW::new(&varmap)?;
    if let Some(step) = resume_step {
        let path = out.join(STATE_TENSORS);
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| EngineError::file(&path, e))?;
        opt.load_state(&tensors, step)?;
    }
    Ok((model, varmap, opt))
}

/// AdamW with decoupled weight decay (Loshchilov & Hutter), moments kept as named tensors so
/// that a checkpoint can hold them.
struct AdamW {
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: usize,
}

impl AdamW {
    const BETA1: f64 = 0.9;
    const BETA2: f64 = 0.95;
    const EPS: f64 = 1e-8;

    fn new(varmap: &VarMap) -> Result<Self> {
        let mut vars: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .expect("var map lock poisoned: this is a bug")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        let m = vars
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<candle_core::Result<_>>()?;
        let v = vars
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { vars, m, v, t: 0 })
    }

    /// Clips the global gradient norm to `clip` and applies one update; returns the norm.
    fn step(
        &mut self,
        grads: &candle_core::backprop::GradStore,
        lr: f64,
        decay: f64,
        clip: f64,
    ) -> Result<f64> {
        let mut norm_sq = 0f64;
        for (_, var) in &self.vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                norm_sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let norm = norm_sq.sqrt();
        let scale = if norm > clip { clip / norm } else { 1.0 };
        self.t += 1;
        let (b1, b2) = (Self::BETA1, Self::BETA2);
        let (c1, c2) = (1.0 - b1.powi(self.t as i32), 1.0 - b2.powi(self.t as i32));
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = (g * scale)?;
            self.m[i] = ((&self.m[i] * b1)? + (&g * (1.0 - b1))?)?;
            self.v[i] = ((&self.v[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let update = ((&self.m[i] / c1)? / ((&self.v[i] / c2)?.sqrt()? + Self::EPS)?)?;
            // Norm weights and the embedding are not decayed.
            let wd = if name.contains("norm") || name.contains("embed") {
                0.0
            } else {
                decay
            };
            let w = var.as_tensor();
            var.set(&((w * (1.0 - lr * wd))? - (update * lr)?)?)?;
        }
        Ok(norm)
    }

    fn named_state(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            out.insert(format!("adam_m.{name}"), self.m[i].clone());
            out.insert(format!("adam_v.{name}"), self.v[i].clone());
        }
        out
    }

    fn load_state(&mut self, state: &HashMap<String, Tensor>, t: usize) -> Result<()> {
        for (i, (name, _)) in self.vars.iter().enumerate() {
            if let (Some(m), Some(v)) = (
                state.get(&format!("adam_m.{name}")),
                state.get(&format!("adam_v.{name}")),
            ) {
                self.m[i] = m.clone();
                self.v[i] = v.clone();
            }
        }
        self.t = t;
        Ok(())
    }
}

/// A Gaussian sample from two uniforms (Box–Muller).
fn gaussian(rng: &mut SplitMix) -> f32 {
    let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Sets every variable from the seed: norms to 1, the embedding N(0, 0.02²), linear layers
/// N(0, 1/fan_in). candle's CPU RNG cannot be seeded, so the init is ours.
fn seeded_init(varmap: &VarMap, seed: u64) -> Result<()> {
    let data = varmap
        .data()
        .lock()
        .expect("var map lock poisoned: this is a bug");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = SplitMix(seed);
    for name in names {
        let var = &data[name];
        let dims = var.as_tensor().dims().to_vec();
        let n: usize = dims.iter().product();
        let std = if name.contains("norm") {
            0.0
        } else if name.contains("embed") {
            0.02
        } else {
            1.0 / (dims[dims.len() - 1] as f32).sqrt()
        };
        let values: Vec<f32> = (0..n)
            .map(|_| {
                if std == 0.0 {
                    1.0
                } else {
                    std * gaussian(&mut rng)
                }
            })
            .collect();
        var.set(&Tensor::from_vec(values, dims, &Device::Cpu)?)?;
    }
    Ok(())
}

/// Trains a byte-level BPE on the training plays (not the held-out ones) into `out`.
fn fresh_tokenizer(
    config: &TrainConfig,
    texts: &[(PathBuf, String)],
    out: &Path,
) -> Result<PathBuf> {
    std::fs::create_dir_all(out).map_err(|e| EngineError::file(out, e))?;
    let path = out.join("tokenizer.json");
    let train_texts = texts
        .iter()
        .filter(|(p, _)| !is_validation(config, p))
        .map(|(_, t)| t.as_str());
    train_bpe(
        train_texts.flat_map(|t| t.lines()),
        config.model.vocab,
        &path,
    )?;
    Ok(path)
}

/// A trained checkpoint a fresh run starts from (`train.init_from`).
struct InitSource {
    weights: PathBuf,
    tokenizer: PathBuf,
}

impl InitSource {
    fn open(dir: &Path) -> Result<Self> {
        let source = Self {
            weights: dir.join("model.safetensors"),
            tokenizer: dir.join("tokenizer.json"),
        };
        for file in [&source.weights, &source.tokenizer] {
            if !file.is_file() {
                return Err(EngineError::file(file, "train.init_from: no such file"));
            }
        }
        Ok(source)
    }

    /// Sets every variable to the checkpoint's tensor of the same name. Layers the checkpoint
    /// lacks keep their seeded init except the gains of the norms on their two outputs
    /// (Ouro's sandwich norms), which start at zero: each new layer adds nothing to the
    /// residual stream, so a deeper model begins as the trained one (ReZero-style; zeroing
    /// the projections instead would not do, as the RMSNorm after them scales any small
    /// update back up to unit size).
    fn load_into(&self, varmap: &VarMap) -> Result<()> {
        let tensors = candle_core::safetensors::load(&self.weights, &Device::Cpu)
            .map_err(|e| EngineError::file(&self.weights, e))?;
        let file = |message: String| EngineError::file(&self.weights, message);
        let source_layers = tensors.keys().filter_map(|n| format::layer_of(n)).max();
        let data = varmap
            .data()
            .lock()
            .expect("var map lock poisoned: this is a bug");
        let mut unused: Vec<&String> = tensors
            .keys()
            .filter(|n| !data.contains_key(*n) && !format::is_exit_gate(n))
            .collect();
        unused.sort();
        if let Some(name) = unused.first() {
            // A deeper or untied checkpoint loaded into a smaller or tied shape would silently
            // compute something else.
            return Err(file(format!(
                "train.init_from: tensor {name} has no place in this config's shape"
            )));
        }
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for name in names {
            let var = &data[name];
            let target = var.as_tensor();
            let value = match tensors.get(name) {
                Some(t) if t.dims() == target.dims() => t.to_dtype(DType::F32)?,
                Some(t) => {
                    return Err(file(format!(
                        "train.init_from: tensor {name} has shape {:?}, the config asks for {:?}",
                        t.dims(),
                        target.dims()
                    )));
                }
                None if format::layer_of(name) > source_layers => {
                    if format::layer_tensor_of(name).is_some_and(|t| t.is_output_gain()) {
                        target.zeros_like()?
                    } else {
                        continue;
                    }
                }
                None => {
                    return Err(file(format!("train.init_from: tensor {name} is missing")));
                }
            };
            var.set(&value)?;
        }
        Ok(())
    }
}

/// Everything a run needs, prepared and checked before anything is written.
pub struct Trainer {
    config: TrainConfig,
    out: PathBuf,
    corpus: Corpus,
    model: LoopedModel,
    varmap: VarMap,
    opt: AdamW,
    state: TrainState,
}

const STATE_JSON: &str = "train-state.json";
const STATE_TENSORS: &str = "train-state.safetensors";

impl Trainer {
    /// Prepares a run: reads config and corpus, trains the tokenizer (or, with `resume`,
    /// reloads tokenizer, weights and optimiser state from `out`). Errors leave `out` untouched.
    pub fn prepare(
        config_path: &Path,
        corpus_files: &[PathBuf],
        out: &Path,
        resume: bool,
    ) -> Result<Self> {
        let config = TrainConfig::load(config_path)?;
        let texts = read_corpus(corpus_files)?;
        let state = TrainState::begin(&config, config_path, out, resume)?;
        let init = match (&config.train.init_from, resume) {
            (Some(dir), false) => Some(InitSource::open(dir)?),
            _ => None,
        };
        let tokenizer_path = match &init {
            Some(init) => init.tokenizer.clone(),
            None if resume => out.join("tokenizer.json"),
            None => fresh_tokenizer(&config, &texts, out)?,
        };
        let tokenizer = TextTokenizer::load(&tokenizer_path, &[0])?;
        let corpus = tokenize_corpus(&config, &tokenizer, &texts)?;
        let ouro = config.ouro_config(config.model.vocab.max(tokenizer.vocab_size()));
        let (model, varmap, opt) = build_model(ouro, &config, out, resume.then_some(state.step))?;
        if let Some(init) = &init {
            // Written only once the checkpoint has proved to fit: errors leave `out` alone.
            init.load_into(&varmap)?;
            std::fs::create_dir_all(out).map_err(|e| EngineError::file(out, e))?;
            let copy = out.join("tokenizer.json");
            std::fs::copy(&init.tokenizer, &copy).map_err(|e| EngineError::file(&copy, e))?;
        }
        Ok(Self {
            config,
            out: out.to_path_buf(),
            corpus,
            model,
            varmap,
            opt,
            state,
        })
    }

    /// The Ouro config of the model being trained.
    pub fn model_config(&self) -> &OuroConfig {
        &self.model.config
    }

    /// The model being trained (its weights are the optimiser's variables).
    pub fn model(&self) -> &LoopedModel {
        &self.model
    }

    /// Training and validation tokens.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// Runs to `train.steps` (or until `stop` says so), checkpointing every few minutes and at
    /// the end. Calls `on_progress` after every step.
    pub fn run(
        &mut self,
        mut on_progress: impl FnMut(&Progress),
        stop: impl Fn() -> bool,
    ) -> Result<Progress> {
        let t = self.config.train.clone();
        let started = Instant::now();
        let elapsed_before = self.state.elapsed_secs;
        let mut last_save = Instant::now();
        let mut progress = self.state.history.last().cloned().unwrap_or_default();
        let mut steps_this_run = 0usize;
        while self.state.step < t.steps && !stop() {
            let step = self.state.step;
            let lr = self.config.lr_at(step);
            let losses = self.train_step(step, lr)?;
            self.state.step += 1;
            self.state.tokens_seen += (t.batch * t.seq_len) as u64;
            self.state.elapsed_secs = elapsed_before + started.elapsed().as_secs_f64();
            let run_secs = started.elapsed().as_secs_f64().max(1e-9);
            steps_this_run += 1;
            let tokens_this_run = (steps_this_run * t.batch * t.seq_len) as f64;
            progress = Progress {
                step: self.state.step,
                steps: t.steps,
                loss_per_pass: losses,
                lr,
                tokens_seen: self.state.tokens_seen,
                tokens_per_sec: tokens_this_run / run_secs,
                elapsed_secs: self.state.elapsed_secs,
                validation: None,
            };
            if self.state.step.is_multiple_of(t.eval_every) || self.state.step == t.steps {
                progress.validation = Some(self.validate()?);
                self.state.history.push(progress.clone());
            }
            on_progress(&progress);
            if last_save.elapsed() >= Duration::from_secs_f64(t.checkpoint_minutes * 60.0) {
                self.save()?;
                last_save = Instant::now();
            }
        }
        self.save()?;
        Ok(progress)
    }

    /// One optimisation step; returns the loss of every pass.
    fn train_step(&mut self, step: usize, lr: f64) -> Result<Vec<f64>> {
        let t = &self.config.train;
        let mut rng = SplitMix(t.seed ^ (step as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
        let span = self.corpus.train.len() - t.seq_len - 1;
        let starts: Vec<usize> = (0..t.batch)
            .map(|_| (rng.next_u64() % span as u64) as usize)
            .collect();
        let (loss, per_pass) = self.loss(&self.corpus.train, &starts)?;
        let grads = loss.backward()?;
        self.opt.step(&grads, lr, t.weight_decay, t.grad_clip)?;
        Ok(per_pass)
    }

    /// The weighted loss over the windows starting at `starts`, and each pass's loss.
    fn loss(&self, tokens: &[u32], starts: &[usize]) -> Result<(Tensor, Vec<f64>)> {
        let t = &self.config.train;
        let (inputs, targets) = windows(tokens, starts, t.seq_len)?;
        let hidden = self.model.hidden_per_pass(&inputs)?;
        let vocab = self.model.config.vocab_size;
        let targets = targets.flatten_all()?;
        let logits: Vec<Tensor> = self
            .model
            .readouts(&hidden)?
            .iter()
            .map(|l| Ok(l.reshape(((), vocab))?))
            .collect::<Result<_>>()?;
        let last = logits.last().expect("at least one pass: this is a bug");
        // Only read when agreement_weight > 0.
        let teacher = if t.agreement_weight > 0.0 {
            candle_nn::ops::softmax_last_dim(&last.detach())?
        } else {
            last.detach()
        };
        let weight_sum: f64 = t.pass_weights.iter().sum();
        let mut total: Option<Tensor> = None;
        let mut per_pass = Vec::with_capacity(logits.len());
        for (r, (l, w)) in logits.iter().zip(&t.pass_weights).enumerate() {
            let alpha = if r + 1 < logits.len() {
                t.agreement_weight
            } else {
                0.0
            };
            let (mixed, hard) = mixed_cross_entropy(l, &targets, &teacher, alpha)?;
            per_pass.push(hard);
            let term = (mixed * (w / weight_sum))?;
            total = Some(match total {
                Some(acc) => (acc + term)?,
                None => term,
            });
        }
        Ok((total.expect("at least one pass: this is a bug"), per_pass))
    }

    /// Loss per pass and top-1 agreement with pass R on fixed held-out windows.
    pub fn validate(&self) -> Result<Validation> {
        let t = &self.config.train;
        let tokens = &self.corpus.validation;
        let span = tokens.len().saturating_sub(t.seq_len + 1).max(1);
        let passes = self.model.passes();
        let mut v = Validation {
            loss_per_pass: vec![0.0; passes],
            agreement_with_last: vec![0.0; passes],
        };
        for b in 0..t.eval_batches {
            let starts: Vec<usize> = (0..t.batch)
                .map(|i| ((b * t.batch + i) * 7919 * t.seq_len) % span)
                .collect();
            let (inputs, targets) = windows(tokens, &starts, t.seq_len)?;
            let hidden = self.model.hidden_per_pass(&inputs)?;
            let targets = targets.flatten_all()?;
            let vocab = self.model.config.vocab_size;
            let logits: Vec<Tensor> = self
                .model
                .readouts(&hidden)?
                .iter()
                .map(|l| Ok(l.reshape(((), vocab))?.detach()))
                .collect::<Result<_>>()?;
            let last = logits[passes - 1].argmax(1)?;
            for (r, l) in logits.iter().enumerate() {
                v.loss_per_pass[r] +=
                    candle_nn::loss::cross_entropy(l, &targets)?.to_scalar::<f32>()? as f64;
                let agree = l
                    .argmax(1)?
                    .eq(&last)?
                    .to_dtype(DType::F32)?
                    .mean_all()?
                    .to_scalar::<f32>()?;
                v.agreement_with_last[r] += agree as f64;
            }
        }
        for x in v
            .loss_per_pass
            .iter_mut()
            .chain(v.agreement_with_last.iter_mut())
        {
            *x /= t.eval_batches as f64;
        }
        Ok(v)
    }

    /// Writes a standard Ouro checkpoint plus the optimiser state, each file atomically.
    pub fn save(&self) -> Result<()> {
        let out = &self.out;
        let tmp = out.join("model.safetensors.tmp");
        let mut tensors: HashMap<String, Tensor> = self
            .varmap
            .data()
            .lock()
            .expect("var map lock poisoned: this is a bug")
            .iter()
            .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
            .collect();
        tensors.extend(format::neutral_exit_gate(&self.model.config, DType::F32)?);
        candle_core::safetensors::save(&tensors, &tmp).map_err(|e| EngineError::file(&tmp, e))?;
        std::fs::rename(&tmp, out.join("model.safetensors"))
            .map_err(|e| EngineError::file(out, e))?;
        let tmp = out.join("train-state.safetensors.tmp");
        candle_core::safetensors::save(&self.opt.named_state(), &tmp)
            .map_err(|e| EngineError::file(&tmp, e))?;
        std::fs::rename(&tmp, out.join(STATE_TENSORS)).map_err(|e| EngineError::file(out, e))?;
        write_json(&out.join("config.json"), &self.model.config.to_json())?;
        let state = serde_json::to_value(&self.state)
            .map_err(|e| EngineError::file(out.join(STATE_JSON), e))?;
        write_json(&out.join(STATE_JSON), &state)
    }
}

/// Cross-entropy of `logits` against (1 − alpha)·one-hot(`targets`) + alpha·`soft`: the
/// differentiable mixed loss and the plain cross-entropy's value.
fn mixed_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    soft: &Tensor,
    alpha: f64,
) -> Result<(Tensor, f64)> {
    if Ops::for_tensor(logits) == Ops::Fused {
        let both = fused::cross_entropy(logits, &targets.to_vec1::<u32>()?, soft, alpha)?;
        let hard = both.get(1)?.to_scalar::<f32>()? as f64;
        return Ok((both.get(0)?, hard));
    }
    let hard = candle_nn::loss::cross_entropy(logits, targets)?;
    let value = hard.to_scalar::<f32>()? as f64;
    if alpha == 0.0 {
        return Ok((hard, value));
    }
    let log_p = candle_nn::ops::log_softmax(logits, 1)?;
    let soft_ce = (soft * log_p)?.sum(1)?.mean(0)?.neg()?;
    Ok((((hard * (1.0 - alpha))? + (soft_ce * alpha)?)?, value))
}

fn is_validation(config: &TrainConfig, path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| config.train.validation_files.iter().any(|v| v == n))
}

/// Tokenizes every file (documents separated by `<|endoftext|>`), split into training and
/// held-out streams; without named held-out files the last tenth is held out.
fn tokenize_corpus(
    config: &TrainConfig,
    tokenizer: &TextTokenizer,
    texts: &[(PathBuf, String)],
) -> Result<Corpus> {
    let (mut train, mut validation) = (Vec::new(), Vec::new());
    for (path, text) in texts {
        let ids = tokenizer.encode(text)?;
        let into = if is_validation(config, path) {
            &mut validation
        } else {
            &mut train
        };
        into.extend(ids);
        into.push(0);
    }
    if validation.is_empty() {
        let cut = train.len() - train.len() / 10;
        validation = train.split_off(cut);
    }
    let need = config.train.seq_len + 2;
    if train.len() < need || validation.len() < need {
        return Err(EngineError::Invalid(format!(
            "corpus: {} training and {} held-out tokens; each needs at least seq_len + 2 = {need}",
            train.len(),
            validation.len()
        )));
    }
    Ok(Corpus { train, validation })
}

/// Inputs `[batch, seq]` and next-token targets from windows at `starts`.
fn windows(tokens: &[u32], starts: &[usize], seq: usize) -> Result<(Tensor, Tensor)> {
    let mut inputs = Vec::with_capacity(starts.len() * seq);
    let mut targets = Vec::with_capacity(starts.len() * seq);
    for &s in starts {
        inputs.extend_from_slice(&tokens[s..s + seq]);
        targets.extend_from_slice(&tokens[s + 1..s + seq + 1]);
    }
    Ok((
        Tensor::from_vec(inputs, (starts.len(), seq), &Device::Cpu)?,
        Tensor::from_vec(targets, (starts.len(), seq), &Device::Cpu)?,
    ))
}
