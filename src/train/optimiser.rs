//! AdamW, our own so that its moments can be saved with a checkpoint and resumed.

use std::collections::HashMap;

use candle_core::{Tensor, Var};
use candle_nn::VarMap;

use crate::engine::error::Result;

/// AdamW with decoupled weight decay (Loshchilov & Hutter), moments kept as named tensors so
/// that a checkpoint can hold them.
pub(super) struct AdamW {
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: usize,
}

impl AdamW {
    const BETA1: f64 = 0.9;
    const BETA2: f64 = 0.95;
    const EPS: f64 = 1e-8;

    pub(super) fn new(varmap: &VarMap) -> Result<Self> {
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
    pub(super) fn step(
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

    pub(super) fn named_state(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            out.insert(format!("adam_m.{name}"), self.m[i].clone());
            out.insert(format!("adam_v.{name}"), self.v[i].clone());
        }
        out
    }

    pub(super) fn load_state(&mut self, state: &HashMap<String, Tensor>, t: usize) -> Result<()> {
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
