//! Build script: with the `cuda` feature, compiles the device step's kernels
//! (src/engine/model/device_ops/kernels.cu) to PTX for `CUDA_COMPUTE_CAP` (default 90: H100,
//! H200) with the nvcc that candle's kernels are built with (`NVCC`, `CUDA_HOME/bin` or
//! PATH; `.ci/cuda-env` sets them up). Without the feature it does nothing.

use std::path::PathBuf;
use std::process::Command;

const KERNEL: &str = "src/engine/model/device_ops/kernels.cu";

fn main() {
    println!("cargo:rerun-if-changed={KERNEL}");
    for var in ["NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap = cap.trim_end_matches(['a', 'f']);
    let nvcc = std::env::var("NVCC").ok().or_else(|| {
        let home = std::env::var("CUDA_HOME").ok()?;
        let path = PathBuf::from(home).join("bin/nvcc");
        path.exists().then(|| path.display().to_string())
    });
    let nvcc = nvcc.unwrap_or_else(|| "nvcc".into());
    let ptx = out.join("device_ops.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&ptx)
        .arg(KERNEL)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} --ptx {KERNEL} failed ({s}); source .ci/cuda-env first"),
        Err(e) => panic!("{nvcc}: {e}; source .ci/cuda-env first"),
    }
}
