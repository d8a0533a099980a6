//! `--device auto|cpu|cuda[:N]|metal`, `--dtype f32|bf16|f16` and `--threads N`: parsing,
//! choosing a candle device, the dtype a checkpoint stores (the default) and the decode
//! threads. `auto` picks CUDA, then Metal, then the CPU. spex's own kernels run on the CPU in
//! every dtype (unless `--candle-ops`); other devices run candle's ops through the same step
//! code.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};

use crate::engine::EngineError;

/// A device as the user names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum DeviceSpec {
    Auto,
    Cpu,
    Cuda(usize),
    Metal,
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "metal" => Ok(Self::Metal),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| {
                    format!("unknown device `{other}` (expected auto, cpu, cuda, cuda:N or metal)")
                }),
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::Metal => f.write_str("metal"),
        }
    }
}

/// A dtype as the user names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub struct DTypeSpec(pub DType);

impl FromStr for DTypeSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self(DType::F32)),
            "bf16" => Ok(Self(DType::BF16)),
            "f16" => Ok(Self(DType::F16)),
            other => Err(format!(
                "unknown dtype `{other}` (expected f32, bf16 or f16)"
            )),
        }
    }
}

impl TryFrom<String> for DTypeSpec {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// The name of a dtype as the CLI spells it.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// Opens the device; a backend this build lacks is one clear error naming the cargo feature.
pub fn open(spec: DeviceSpec) -> Result<Device, EngineError> {
    let missing = |name: &str, feature: &str| {
        EngineError::Invalid(format!(
            "--device {name}: this spex was built without {name} support (cargo build --release --features {feature})"
        ))
    };
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            if !candle_core::utils::cuda_is_available() {
                return Err(missing("cuda", "cuda"));
            }
            Device::new_cuda(n).map_err(|e| {
                let hint = if e.to_string().contains("CUDA_ERROR_STUB_LIBRARY") {
                    " (no NVIDIA driver on this machine: libcuda.so.1 is .ci/cuda-env's stub)"
                } else {
                    ""
                };
                EngineError::Invalid(format!("--device cuda:{n}: {}{hint}", first_line(&e)))
            })
        }
        DeviceSpec::Metal => {
            if !candle_core::utils::metal_is_available() {
                return Err(missing("metal", "metal"));
            }
            Device::new_metal(0)
                .map_err(|e| EngineError::Invalid(format!("--device metal: {}", first_line(&e))))
        }
        DeviceSpec::Auto => {
            if candle_core::utils::cuda_is_available()
                && let Ok(d) = Device::new_cuda(0)
            {
                return Ok(d);
            }
            if candle_core::utils::metal_is_available()
                && let Ok(d) = Device::new_metal(0)
            {
                return Ok(d);
            }
            Ok(Device::Cpu)
        }
    }
}

/// The message of a candle error without the backtrace candle appends to it on further lines
/// when `RUST_BACKTRACE` is set: errors are one line.
fn first_line(e: &candle_core::Error) -> String {
    let text = e.to_string();
    text.lines()
        .next()
        .unwrap_or_default()
        .trim_end()
        .to_string()
}

/// Checks that `device` can run `dtype` (Metal has no bf16 matmul in candle).
pub fn check_dtype(device: &Device, dtype: DType) -> Result<(), EngineError> {
    if device.is_metal() && dtype == DType::BF16 {
        return Err(EngineError::Invalid(
            "--dtype bf16: candle's Metal backend lacks bf16 matmul; use f16 or f32".into(),
        ));
    }
    Ok(())
}

/// A short name of an opened device for the footer.
pub fn device_name(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// The decode threads `--threads` asks for: the available cores by default, and at most them
/// (a one-line note on stderr where more were asked for); 0 is an error.
pub fn decode_threads(asked: Option<usize>) -> Result<usize, EngineError> {
    let cores = crate::engine::kernels::pool::available_cores();
    match asked {
        None => Ok(cores),
        Some(0) => Err(EngineError::Invalid(
            "--threads 0: must be at least 1".into(),
        )),
        Some(n) if n > cores => {
            eprintln!(
                "spex: --threads {n}: this machine has {cores} core(s) free for spex; using {cores}"
            );
            Ok(cores)
        }
        Some(n) => Ok(n),
    }
}

/// What `loaded` decodes on, for headings: the GPU's name where candle ops run on one, else
/// the CPU's model name, else "an unknown CPU".
pub fn machine_name(loaded: &crate::engine::LoadedModel) -> String {
    (loaded.backend.info().accelerator).unwrap_or_else(cpu_name)
}

/// The CPU's model name, else "an unknown CPU".
pub fn cpu_name() -> String {
    cpu_model().unwrap_or_else(|| "an unknown CPU".into())
}

/// The CPU's model name (Linux `/proc/cpuinfo`), if known.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}
