//! Training Ouro's exit gate alone (`spex train-gate`): every other weight frozen, the gate
//! λ_r = σ(w · h_r + b) fitted to a supervised target, *stop where this pass already agrees
//! with pass R* (the simpler of the two objectives the exit gate can learn; Ouro's own is an
//! entropy-regularised loss over the whole exit distribution). Each (position, pass r < R)
//! of the corpus is one example: the normed state after pass r, labelled 1 when pass r's
//! argmax equals pass R's. That is a logistic regression on frozen features, fitted by
//! full-batch Adam on the binary cross-entropy.
//!
//! The gate is then written into a copy of the checkpoint by overwriting the gate tensors'
//! bytes in place ([`write_gate`]): the header and every other tensor stay byte-identical, so
//! what was measured of the model's other weights still holds.

use std::path::Path;

use candle_core::{D, DType, Device, Tensor};

use crate::engine::error::{EngineError, Result};
use crate::engine::exit_gate::sigmoid;
use crate::engine::format::{EXIT_GATE_BIAS, EXIT_GATE_WEIGHT};
use crate::engine::model::LoopedModel;

/// The examples: normed states `[examples × hidden]`, each pass's label, and its pass.
#[derive(Debug, Clone, Default)]
pub struct GateExamples {
    pub hidden: usize,
    pub states: Vec<f32>,
    /// 1 where the pass's argmax equals pass R's.
    pub labels: Vec<f32>,
    /// The pass each example was read after (1 to R − 1).
    pub passes: Vec<usize>,
}

impl GateExamples {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn state(&self, i: usize) -> &[f32] {
        &self.states[i * self.hidden..(i + 1) * self.hidden]
    }
}

/// Runs the reference forward over each window of `windows` (token ids) and collects every
/// (position, pass r < R) as an example.
pub fn collect(model: &LoopedModel, windows: &[Vec<u32>]) -> Result<GateExamples> {
    let hidden = model.config.hidden;
    let passes = model.passes();
    let mut out = GateExamples {
        hidden,
        ..GateExamples::default()
    };
    for window in windows {
        let ids = Tensor::new(window.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let states = model.hidden_per_pass(&ids)?;
        let logits = model.readouts(&states)?;
        let argmax =
            |t: &Tensor| -> Result<Vec<u32>> { Ok(t.argmax(D::Minus1)?.flatten_all()?.to_vec1()?) };
        let last = argmax(&logits[passes - 1])?;
        for (r, (state, readout)) in states.iter().zip(&logits).take(passes - 1).enumerate() {
            let chosen = argmax(readout)?;
            let rows: Vec<f32> = state.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            out.states.extend(rows);
            out.labels.extend(
                chosen
                    .iter()
                    .zip(&last)
                    .map(|(a, b)| f32::from(u8::from(a == b))),
            );
            out.passes.extend(std::iter::repeat_n(r + 1, chosen.len()));
        }
    }
    Ok(out)
}

/// A fitted gate.
#[derive(Debug, Clone, PartialEq)]
pub struct FittedGate {
    pub weight: Vec<f32>,
    pub bias: f32,
}

impl FittedGate {
    /// λ for the normed state `h`.
    pub fn lambda(&self, h: &[f32]) -> f32 {
        sigmoid(h.iter().zip(&self.weight).map(|(x, w)| x * w).sum::<f32>() + self.bias)
    }
}

/// How the gate is fitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateFit {
    /// Full-batch Adam steps.
    pub steps: usize,
    /// Adam's learning rate.
    pub lr: f32,
}

/// Fits the gate to `examples` by full-batch Adam on the mean binary cross-entropy, from a
/// zero weight and the bias of the labels' base rate.
pub fn fit(examples: &GateExamples, settings: GateFit) -> FittedGate {
    let n = examples.len().max(1) as f32;
    let rate = (examples.labels.iter().sum::<f32>() / n).clamp(1e-4, 1.0 - 1e-4);
    let mut gate = FittedGate {
        weight: vec![0.0; examples.hidden],
        bias: (rate / (1.0 - rate)).ln(),
    };
    let mut adam = Adam::new(examples.hidden + 1);
    for _ in 0..settings.steps {
        let mut grad = vec![0f32; examples.hidden + 1];
        for i in 0..examples.len() {
            let h = examples.state(i);
            let error = gate.lambda(h) - examples.labels[i];
            for (g, x) in grad.iter_mut().zip(h) {
                *g += error * x;
            }
            grad[examples.hidden] += error;
        }
        grad.iter_mut().for_each(|g| *g /= n);
        let mut params: Vec<f32> = gate.weight.iter().copied().chain([gate.bias]).collect();
        adam.step(&mut params, &grad, settings.lr);
        gate.bias = params.pop().unwrap_or_default();
        gate.weight = params;
    }
    gate
}

/// Adam's moments for a flat parameter vector.
struct Adam {
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
}

impl Adam {
    fn new(len: usize) -> Self {
        Self {
            m: vec![0.0; len],
            v: vec![0.0; len],
            t: 0,
        }
    }

    fn step(&mut self, params: &mut [f32], grad: &[f32], lr: f32) {
        const B1: f32 = 0.9;
        const B2: f32 = 0.999;
        self.t += 1;
        let (c1, c2) = (1.0 - B1.powi(self.t), 1.0 - B2.powi(self.t));
        for (((p, g), m), v) in params
            .iter_mut()
            .zip(grad)
            .zip(&mut self.m)
            .zip(&mut self.v)
        {
            *m = B1 * *m + (1.0 - B1) * g;
            *v = B2 * *v + (1.0 - B2) * g * g;
            *p -= lr * (*m / c1) / ((*v / c2).sqrt() + 1e-8);
        }
    }
}

/// How a gate does on a set of examples, per pass r < R.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GateScore {
    /// Mean binary cross-entropy, in nats.
    pub cross_entropy: f64,
    /// Per pass: the share of examples whose pass agrees with pass R.
    pub agreement_per_pass: Vec<f64>,
    /// Per pass: the mean λ.
    pub mean_lambda_per_pass: Vec<f64>,
    /// Per pass: the share where λ ≥ 0.5 matches the label.
    pub accuracy_per_pass: Vec<f64>,
}

/// One pass's sums while a gate is scored.
#[derive(Debug, Clone, Copy, Default)]
struct PassTally {
    examples: usize,
    agreeing: f64,
    lambdas: f64,
    right: usize,
}

/// `gate` scored on `examples` of a model with `passes` passes.
pub fn score(gate: &FittedGate, examples: &GateExamples, passes: usize) -> GateScore {
    let mut sums = vec![PassTally::default(); passes.saturating_sub(1)];
    let mut cross_entropy = 0f64;
    for i in 0..examples.len() {
        let (lambda, label) = (gate.lambda(examples.state(i)), examples.labels[i]);
        let p = f64::from(lambda).clamp(1e-7, 1.0 - 1e-7);
        cross_entropy -= match label > 0.5 {
            true => p.ln(),
            false => (1.0 - p).ln(),
        };
        let s = &mut sums[examples.passes[i] - 1];
        s.examples += 1;
        s.agreeing += f64::from(label);
        s.lambdas += f64::from(lambda);
        s.right += usize::from((lambda >= 0.5) == (label > 0.5));
    }
    let per = |f: fn(&PassTally) -> f64| -> Vec<f64> {
        sums.iter()
            .map(|s| f(s) / s.examples.max(1) as f64)
            .collect()
    };
    GateScore {
        cross_entropy: cross_entropy / examples.len().max(1) as f64,
        agreement_per_pass: per(|s| s.agreeing),
        mean_lambda_per_pass: per(|s| s.lambdas),
        accuracy_per_pass: per(|s| s.right as f64),
    }
}

/// Overwrites the exit gate's tensors in `dir`'s `model.safetensors` with `gate`, in the
/// element type they are stored in, through a temporary file renamed into place: the header
/// and every other tensor's bytes are unchanged. Errors name the file and the tensor.
pub fn write_gate(dir: &Path, gate: &FittedGate) -> Result<()> {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).map_err(|e| EngineError::file(&path, e))?;
    let (header_len, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| EngineError::file(&path, format!("not a safetensors file: {e}")))?;
    let data_start = 8 + header_len;
    for (name, values) in [
        (EXIT_GATE_WEIGHT, gate.weight.as_slice()),
        (EXIT_GATE_BIAS, std::slice::from_ref(&gate.bias)),
    ] {
        let info = header
            .info(name)
            .ok_or_else(|| EngineError::file(&path, format!("no tensor {name}")))?;
        let count: usize = info.shape.iter().product();
        if count != values.len() {
            return Err(EngineError::file(
                &path,
                format!("{name} holds {count} values, the gate has {}", values.len()),
            ));
        }
        let encoded = encode(values, info.dtype).ok_or_else(|| {
            EngineError::file(&path, format!("{name} is {:?}, not a float", info.dtype))
        })?;
        let (begin, end) = info.data_offsets;
        bytes[data_start + begin..data_start + end].copy_from_slice(&encoded);
    }
    crate::engine::files::write_via_temporary(&path, |temp| std::fs::write(temp, &bytes))
}

/// `values` as little-endian bytes of `dtype` (f32, f16 or bf16).
fn encode(values: &[f32], dtype: safetensors::Dtype) -> Option<Vec<u8>> {
    use safetensors::Dtype;
    Some(match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => (values.iter())
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        Dtype::BF16 => (values.iter())
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => return None,
    })
}

/// What `spex train-gate` asks for.
#[derive(Debug, Clone)]
pub struct GateTraining<'a> {
    /// The checkpoint directory whose gate is trained (read only).
    pub model: &'a Path,
    /// The corpus files.
    pub corpus: &'a [std::path::PathBuf],
    /// The corpus files (by name) held out for the score.
    pub held_out: &'a [String],
    /// Training windows cut evenly from the training files, and their length in tokens.
    pub windows: usize,
    pub seq_len: usize,
    pub fit: GateFit,
    /// Where the checkpoint is copied with its new gate (must not exist).
    pub out: &'a Path,
}

/// The trained gate's scores: the checkpoint's own gate and the new one, on the training and
/// the held-out examples.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GateReport {
    pub train_examples: usize,
    pub held_out_examples: usize,
    pub before: Option<GateScore>,
    pub train: GateScore,
    pub held_out: GateScore,
}

/// Trains the gate of `job.model` and writes the checkpoint with it to `job.out`.
pub fn train_gate(job: &GateTraining) -> Result<GateReport> {
    if job.out.exists() {
        return Err(EngineError::file(
            job.out,
            "already exists: give a new directory",
        ));
    }
    let loaded = crate::engine::LoadedModel::load(job.model, &Device::Cpu, DType::F32)?;
    let model = loaded.model();
    // What the gate is written into, checked before minutes of work.
    let weights = job.model.join("model.safetensors");
    if model.weights.exit_gate.is_none() || !weights.is_file() {
        return Err(EngineError::file(
            &weights,
            "train-gate writes the exit gate into one model.safetensors holding it \
             (model.early_exit_gate.weight and .bias)",
        ));
    }
    if model.passes() < 2 {
        return Err(EngineError::Invalid(
            "train-gate: a model of one pass has no pass to exit before".into(),
        ));
    }
    let texts = super::read_corpus(job.corpus)?;
    let is_held_out = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| job.held_out.iter().any(|h| h == n))
    };
    let (mut train, mut held_out) = (Vec::new(), Vec::new());
    for (path, text) in &texts {
        let into = if is_held_out(path) {
            &mut held_out
        } else {
            &mut train
        };
        into.extend(loaded.tokenizer.encode(text)?);
    }
    let train = collect(model, &spread_windows(&train, job.windows, job.seq_len))?;
    let held_out = collect(
        model,
        &spread_windows(&held_out, job.windows.div_ceil(4), job.seq_len),
    )?;
    if train.len() == 0 || held_out.len() == 0 {
        return Err(EngineError::Invalid(
            "train-gate: the training files and the held-out files (--held-out) each need a window of text".into(),
        ));
    }
    let passes = model.passes();
    let before = (model.weights.exit_gate.as_ref())
        .map(|g| -> Result<FittedGate> {
            let weight = g.weight.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let bias = g.bias.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok(FittedGate {
                weight,
                bias: bias.first().copied().unwrap_or_default(),
            })
        })
        .transpose()?
        .map(|g| score(&g, &held_out, passes));
    let gate = fit(&train, job.fit);
    copy_checkpoint(job.model, job.out)?;
    write_gate(job.out, &gate)?;
    Ok(GateReport {
        train_examples: train.len(),
        held_out_examples: held_out.len(),
        before,
        train: score(&gate, &train, passes),
        held_out: score(&gate, &held_out, passes),
    })
}

/// `count` windows of `len` tokens spread evenly over `stream` (none where it is short).
pub fn spread_windows(stream: &[u32], count: usize, len: usize) -> Vec<Vec<u32>> {
    let room = stream.len().saturating_sub(len);
    if stream.len() < len || count == 0 {
        return Vec::new();
    }
    (0..count)
        .map(|k| room * k / count.max(1))
        .map(|start| stream[start..start + len].to_vec())
        .collect()
}

/// Copies every file of the checkpoint directory `from` into a new directory `to`.
fn copy_checkpoint(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).map_err(|e| EngineError::file(to, e))?;
    let listing = std::fs::read_dir(from).map_err(|e| EngineError::file(from, e))?;
    for entry in listing {
        let path = entry.map_err(|e| EngineError::file(from, e))?.path();
        if let (true, Some(name)) = (path.is_file(), path.file_name()) {
            std::fs::copy(&path, to.join(name)).map_err(|e| EngineError::file(&path, e))?;
        }
    }
    Ok(())
}
