//! [`Backend`]: the step backend a model was loaded with, chosen once from its device and
//! dtype, and what it reports of itself ([`BackendInfo`]) so that callers format it without
//! matching its variants. Each variant is one implementation of `StepBackend`.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device};

use super::device::DeviceBackend;
use super::host::{HOST_DTYPES, HostBackend};
use super::timing::{self, StepTimes};
use super::{BlockKind, KvDtype, LoadOptions, LoopedModel, Weights};
use crate::engine::error::Result;
use crate::engine::kernels::{Isa, Kernels, Matrix, prefetch};
use crate::engine::looped::LoopedConfig;

/// The backend a model was loaded with: chosen once, from its device and dtype.
#[derive(Debug, Clone)]
pub enum Backend {
    /// spex's CPU kernels (CPU, f32).
    Host(Arc<HostBackend>),
    /// candle ops on the model's device and dtype.
    Device(Arc<DeviceBackend>),
}

impl Backend {
    /// The host kernels on the CPU in f32, bf16 or f16, reading the weights in that type (copied
    /// to aligned huge pages first; unless `options` fix the prefetch plan, it is chosen by
    /// timing the model's steps); candle ops on other devices, and on the CPU where `options`
    /// ask for them (the GPU path's CPU twin).
    pub fn for_weights(
        config: LoopedConfig,
        weights: Weights,
        device: &Device,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Self> {
        if Self::runs_on_host(device, dtype, options) {
            return Self::host(config, weights.aligned_for_host()?, dtype, options);
        }
        let model = LoopedModel::new(config, weights, device.clone(), dtype)?;
        Ok(Self::Device(Arc::new(DeviceBackend::new(Arc::new(model)))))
    }

    /// Whether a model loaded on `device` in `dtype` with `options` decodes on the host
    /// kernels: the one rule [`Backend::for_weights`] and the loaders follow.
    pub fn runs_on_host(device: &Device, dtype: DType, options: LoadOptions) -> bool {
        device.is_cpu() && HOST_DTYPES.contains(&dtype) && !options.candle_ops
    }

    /// The host kernels over weights already laid out for them (`Weights::aligned_for_host`,
    /// or read straight into an arena); unless `options` fix the prefetch plan, it is chosen
    /// by timing the model's steps.
    pub fn host(
        config: LoopedConfig,
        weights: Weights,
        dtype: DType,
        options: LoadOptions,
    ) -> Result<Self> {
        let model = LoopedModel::new(config, weights, Device::Cpu, dtype)?;
        let host = HostBackend::new(Arc::new(model), options)?;
        let host = match options.kernels.prefetch {
            Some(_) => host,
            None => {
                let choice = timing::choose_prefetch(&host)?;
                // The timing's caches and buffers, freed, go back to the kernel: glibc's heap
                // would keep them resident through the whole run.
                crate::engine::memory::release_free_memory();
                host.with_prefetch_choice(choice)
            }
        };
        Ok(Self::Host(Arc::new(host)))
    }

    /// The model the backend steps.
    pub fn model(&self) -> &Arc<LoopedModel> {
        match self {
            Self::Host(b) => b.shared_model(),
            Self::Device(b) => b.shared_model(),
        }
    }

    /// Its name, for reports.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Host(_) => "host kernels",
            Self::Device(_) => "candle ops",
        }
    }

    /// The host kernels, where they decode.
    pub fn kernels(&self) -> Option<&Kernels> {
        match self {
            Self::Host(b) => Some(b.kernels()),
            Self::Device(_) => None,
        }
    }

    /// `f` of every layer's projections as the host kernels read them; `None` where candle's
    /// ops decode.
    pub fn with_layer_matrices<R>(&self, f: impl FnOnce(&[Matrix<'_>]) -> R) -> Option<Result<R>> {
        match self {
            Self::Host(b) => Some(b.with_layer_matrices(f)),
            Self::Device(_) => None,
        }
    }

    /// What the backend is, for reports.
    pub fn info(&self) -> BackendInfo {
        match self {
            Self::Host(b) => BackendInfo {
                name: self.name(),
                host: Some(HostInfo {
                    isa: b.kernels().isa(),
                    threads: b.kernels().pool().threads(),
                    kv_dtype: b.options().kv_dtype,
                    prefetch: b.prefetch_choice().cloned(),
                    integer_products: (self.model().block_kinds().iter())
                        .any(|k| matches!(k, BlockKind::Gguf(_)))
                        .then(|| b.kernels().integer_products()),
                }),
                step_rows: None,
                accelerator: None,
            },
            Self::Device(b) => BackendInfo {
                name: self.name(),
                host: None,
                step_rows: Some(b.step_rows()),
                accelerator: b.accelerator(),
            },
        }
    }

    /// The step times at `pos` that give the ceiling (`timing::measure_step_times`).
    pub fn step_times(&self, pos: usize, repeats: usize) -> Result<StepTimes> {
        match self {
            Self::Host(b) => timing::measure_step_times(&**b, pos, repeats),
            Self::Device(b) => timing::measure_step_times(&**b, pos, repeats),
        }
    }

    /// The median step of each of `row_counts` rows at `pos` (`timing::median_step_times`).
    pub fn median_step_times(
        &self,
        pos: usize,
        row_counts: &[usize],
        repeats: usize,
    ) -> Result<Vec<Duration>> {
        match self {
            Self::Host(b) => timing::median_step_times(&**b, pos, row_counts, repeats),
            Self::Device(b) => timing::median_step_times(&**b, pos, row_counts, repeats),
        }
    }
}

/// What decodes a model, as reports show it.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendInfo {
    /// "host kernels" or "candle ops".
    pub name: &'static str,
    /// Where the host kernels decode: their settings.
    pub host: Option<HostInfo>,
    /// Where candle ops decode: the rows every decode step is padded to (batch invariance).
    pub step_rows: Option<usize>,
    /// The GPU's name, where candle ops decode on one.
    pub accelerator: Option<String>,
}

/// The host kernels' settings.
#[derive(Debug, Clone, PartialEq)]
pub struct HostInfo {
    /// The instruction set the kernels run.
    pub isa: Isa,
    /// The decode threads.
    pub threads: usize,
    /// The KV cache's element type.
    pub kv_dtype: KvDtype,
    /// The prefetch plan and, where it was timed, each candidate's steps.
    pub prefetch: Option<prefetch::Choice>,
    /// The integer dot products of GGUF's quantized matrices (`Kernels::integer_products`),
    /// where the model holds any.
    pub integer_products: Option<&'static str>,
}
