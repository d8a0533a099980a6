//! The CUDA implementation of [`super::decode_attention`]: `kernel.cu`, compiled to PTX by
//! build.rs, launched on candle's stream with one block per (row, head).

use candle_core::CudaStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};

use candle_core::{Layout, Storage, WithDType};

use super::{DecodeAttention, Dims, bail, range};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode_attention.ptx"));
/// The kernel's threads per (row, head) block (`THREADS` in kernel.cu).
const THREADS: u32 = 128;

fn on_gpu<'a>(storage: &'a Storage, what: &str) -> candle_core::Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        _ => Err(bail(format!("{what} is not on the GPU"))),
    }
}

pub fn run<T: CudaDType + DeviceRepr + WithDType>(
    op: &DecodeAttention,
    dims: Dims,
    [(q, lq), (keys, lk), (values, lv)]: [(&CudaStorage, &Layout); 3],
    kernel: &str,
) -> candle_core::Result<CudaStorage> {
    let dev = q.device.clone();
    let (spans, ls) = op.spans.storage_and_layout();
    let (k_step, lks) = op.k_step.storage_and_layout();
    let (v_step, lvs) = op.v_step.storage_and_layout();
    let spans = (on_gpu(&spans, "spans")?.as_cuda_slice::<u32>()?).slice(range(ls, "spans")?);
    let k_step = (on_gpu(&k_step, "k_step")?.as_cuda_slice::<T>()?).slice(range(lks, "k_step")?);
    let v_step = (on_gpu(&v_step, "v_step")?.as_cuda_slice::<T>()?).slice(range(lvs, "v_step")?);
    let q = q.as_cuda_slice::<T>()?.slice(range(lq, "q")?);
    let keys = keys.as_cuda_slice::<T>()?.slice(range(lk, "keys")?);
    let values = values.as_cuda_slice::<T>()?.slice(range(lv, "values")?);
    let func = dev.get_or_load_custom_func(kernel, "spex_decode_attention", PTX)?;
    let cfg = LaunchConfig {
        grid_dim: (dims.rows as u32, dims.heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every element is written by the kernel before it is read.
    let out = unsafe { dev.alloc::<T>(dims.rows * dims.heads * dims.head_dim)? };
    let mut builder = func.builder();
    builder.arg(&q);
    builder.arg(&keys);
    builder.arg(&values);
    builder.arg(&k_step);
    builder.arg(&v_step);
    builder.arg(&spans);
    builder.arg(&out);
    let ints = [
        dims.rows,
        dims.heads,
        dims.kv_heads,
        dims.cache_rows,
        dims.head_dim,
    ]
    .map(|x| x as i32);
    for x in &ints {
        builder.arg(x);
    }
    builder.arg(&op.scale);
    // SAFETY: the arguments match the kernel's signature in kernel.cu, and their
    // sizes were checked against the dims (`DecodeAttention::dims`) the grid is built from.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
