//! Where a run's weights start: a seeded initialisation of our own (candle's CPU RNG cannot be
//! seeded), or a trained checkpoint (`train.init_from`) whose K may grow, new layers starting
//! as identities.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

use crate::engine::error::{EngineError, Result};
use crate::engine::format;
use crate::engine::rng::SplitMix;

/// A Gaussian sample from two uniforms (Box–Muller).
fn gaussian(rng: &mut SplitMix) -> f32 {
    let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Sets every variable from the seed: norms to 1, the embedding N(0, 0.02²), linear layers
/// N(0, 1/fan_in). candle's CPU RNG cannot be seeded, so the init is ours.
pub(super) fn seeded_init(varmap: &VarMap, seed: u64) -> Result<()> {
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

/// A trained checkpoint a fresh run starts from (`train.init_from`).
pub(super) struct InitSource {
    weights: PathBuf,
    pub(super) tokenizer: PathBuf,
}

impl InitSource {
    pub(super) fn open(dir: &Path) -> Result<Self> {
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
    pub(super) fn load_into(&self, varmap: &VarMap) -> Result<()> {
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
