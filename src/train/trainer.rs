//! A training run: prepared and checked before anything is written, stepped with progress
//! reported through a callback, validated on held-out windows and checkpointed atomically
//! (weights in the Ouro format, optimiser state beside them) so that it resumes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use super::config::TrainConfig;
use super::corpus::{Corpus, fresh_tokenizer, read_corpus, tokenize_corpus, windows};
use super::fused::Fused;
use super::init::{InitSource, seeded_init};
use super::loss::{mixed_cross_entropy, soft_target};
use super::optimiser::AdamW;
use crate::engine::checkpoint::write_json;
use crate::engine::error::{EngineError, Result};
use crate::engine::format;
use crate::engine::looped::LoopedConfig;
use crate::engine::model::{LoopedModel, Weights};
use crate::engine::rng::SplitMix;
use crate::engine::tokenizer::TextTokenizer;

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
            crate::engine::files::read_text(&state_path, crate::engine::files::FileKind::Settings)?;
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
    ouro: LoopedConfig,
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
        let ouro = config.model_config(config.model.vocab.max(tokenizer.vocab_size()));
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
    pub fn model_config(&self) -> &LoopedConfig {
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

    /// The sequence forward with the fused ops where they run (CPU f32).
    fn hidden_per_pass(&self, inputs: &Tensor) -> Result<Vec<Tensor>> {
        let ops = Fused::where_they_run(&self.model.weights.norm);
        self.model.hidden_per_pass_with(inputs, ops)
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
        // Stop before a non-finite loss reaches the weights: the last checkpoint saved stays
        // the last good one.
        if let Some(pass) = per_pass.iter().position(|l| !l.is_finite()) {
            return Err(EngineError::Invalid(format!(
                "training stopped at step {}: pass {}'s loss is not finite (the last checkpoint \
                 saved is kept)",
                step + 1,
                pass + 1
            )));
        }
        let grads = loss.backward()?;
        self.opt.step(&grads, lr, t.weight_decay, t.grad_clip)?;
        Ok(per_pass)
    }

    /// The weighted loss over the windows starting at `starts`, and each pass's loss.
    fn loss(&self, tokens: &[u32], starts: &[usize]) -> Result<(Tensor, Vec<f64>)> {
        let t = &self.config.train;
        let (inputs, targets) = windows(tokens, starts, t.seq_len)?;
        let hidden = self.hidden_per_pass(&inputs)?;
        let vocab = self.model.config.vocab;
        let targets = targets.flatten_all()?;
        let logits: Vec<Tensor> = self
            .model
            .readouts(&hidden)?
            .iter()
            .map(|l| Ok(l.reshape(((), vocab))?))
            .collect::<Result<_>>()?;
        let last = logits.last().expect("at least one pass: this is a bug");
        let teacher_of_first = soft_target(last, t.agreement_weight, t.agreement_temperature)?;
        let teacher_of_last = soft_target(&logits[0], t.last_pass_agreement_weight, 1.0)?;
        let weight_sum: f64 = t.pass_weights.iter().sum();
        let mut total: Option<Tensor> = None;
        let mut per_pass = Vec::with_capacity(logits.len());
        for (r, (l, w)) in logits.iter().zip(&t.pass_weights).enumerate() {
            let (alpha, teacher) = if r + 1 < logits.len() {
                (t.agreement_weight, &teacher_of_first)
            } else {
                (t.last_pass_agreement_weight, &teacher_of_last)
            };
            let (mixed, hard) = mixed_cross_entropy(l, &targets, teacher, alpha)?;
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
            let hidden = self.hidden_per_pass(&inputs)?;
            let targets = targets.flatten_all()?;
            let vocab = self.model.config.vocab;
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
