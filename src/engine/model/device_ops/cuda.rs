//! The CUDA side of the device ops: `kernels.cu`, compiled to PTX by build.rs, loaded once per
//! device as one module and launched on candle's stream. Each function here checks nothing
//! the op's `dims` has not; it finds the operands' device memory and launches.

use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Storage, Tensor, WithDType};

use super::dims::{Dims, SplitDims, WriteDims};
use crate::engine::custom_op::{contiguous_range, op_error};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/device_ops.ptx"));
/// `decode_attention`'s threads per (row, head) block (`THREADS` in kernels.cu).
const ATTENTION_THREADS: u32 = 128;
/// Threads per block of the elementwise kernels (grid-stride loops).
const ELEMENTWISE_THREADS: u32 = 256;

/// Where a kernel's element type is named in its function's name.
fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// A kernel's function name for element type `T`, as `kernels.cu` defines it.
fn kernel<T: WithDType>(name: &str) -> String {
    format!("{name}_{}", suffix(T::DTYPE))
}

/// The module `kernels.cu` is loaded as, once per device.
const MODULE: &str = "spex_device_ops";

/// A grid of `n` elements' worth of blocks, capped (the kernels loop over the rest).
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEMENTWISE_THREADS as usize).clamp(1, 65_535);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// An operand's elements on the GPU, checked contiguous.
fn view<'a, T: CudaDType>(
    op: &str,
    (s, l): (&'a CudaStorage, &Layout),
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?
        .slice(contiguous_range(op, l, what)?))
}

/// A tensor the op carries beside candle's operands, read on the GPU with `read`.
fn with_gpu<R>(
    op: &str,
    t: &Tensor,
    what: &str,
    read: impl FnOnce((&CudaStorage, &Layout)) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => read((s, layout)),
        _ => Err(op_error(op, format!("{what} is not on the GPU"))),
    }
}

/// The step's K and V rows and the rows' spans, then the softmax scale.
type StepOperands<'a> = ((&'a Tensor, &'a Tensor, &'a Tensor), f32);

pub(super) fn decode_attention<T: CudaDType + DeviceRepr + WithDType>(
    dims: Dims,
    ((k_step, v_step, spans), scale): StepOperands,
    [q, keys, values]: [(&CudaStorage, &Layout); 3],
) -> candle_core::Result<CudaStorage> {
    const OP: &str = "decode attention";
    let dev = q.0.device.clone();
    let func = dev.get_or_load_custom_func(&kernel::<T>("decode_attention"), MODULE, PTX)?;
    // SAFETY: every element is written by the kernel before it is read.
    let out = unsafe { dev.alloc::<T>(dims.rows * dims.heads * dims.head_dim)? };
    let (q, keys, values) = (
        view::<T>(OP, q, "q")?,
        view::<T>(OP, keys, "keys")?,
        view::<T>(OP, values, "values")?,
    );
    with_gpu(OP, k_step, "k_step", |k_step| {
        with_gpu(OP, v_step, "v_step", |v_step| {
            with_gpu(OP, spans, "spans", |spans| {
                let (k_step, v_step) = (
                    view::<T>(OP, k_step, "k_step")?,
                    view::<T>(OP, v_step, "v_step")?,
                );
                let spans = view::<u32>(OP, spans, "spans")?;
                let mut b = func.builder();
                b.arg(&q)
                    .arg(&keys)
                    .arg(&values)
                    .arg(&k_step)
                    .arg(&v_step)
                    .arg(&spans)
                    .arg(&out);
                let ints = [
                    dims.rows,
                    dims.heads,
                    dims.kv_heads,
                    dims.cache_rows,
                    dims.head_dim,
                ]
                .map(|x| x as i32);
                ints.iter().for_each(|x| {
                    b.arg(x);
                });
                b.arg(&scale);
                let cfg = LaunchConfig {
                    grid_dim: (dims.rows as u32, dims.heads as u32, 1),
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the arguments are the kernel's (kernels.cu) in order and type, and
                // their sizes were checked against the dims the grid is built from.
                unsafe { b.launch(cfg) }.w()?;
                Ok(())
            })
        })
    })?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

pub(super) fn rope_split<T: CudaDType + DeviceRepr + WithDType>(
    dims: SplitDims,
    cos: &Tensor,
    sin: &Tensor,
    [q, k, v]: [(&CudaStorage, &Layout); 3],
) -> candle_core::Result<CudaStorage> {
    const OP: &str = "rope split";
    let dev = q.0.device.clone();
    let func = dev.get_or_load_custom_func(&kernel::<T>("rope_split"), MODULE, PTX)?;
    let n = (dims.heads + 2 * dims.kv_heads) * dims.rows * dims.head_dim;
    // SAFETY: every element is written by the kernel before it is read.
    let out = unsafe { dev.alloc::<T>(n)? };
    let (q, k, v) = (
        view::<T>(OP, q, "q")?,
        view::<T>(OP, k, "k")?,
        view::<T>(OP, v, "v")?,
    );
    with_gpu(OP, cos, "cos", |cos| {
        with_gpu(OP, sin, "sin", |sin| {
            let (cos, sin) = (view::<T>(OP, cos, "cos")?, view::<T>(OP, sin, "sin")?);
            let mut b = func.builder();
            b.arg(&q).arg(&k).arg(&v).arg(&cos).arg(&sin).arg(&out);
            let ints = [dims.rows, dims.heads, dims.kv_heads, dims.head_dim].map(|x| x as i32);
            ints.iter().for_each(|x| {
                b.arg(x);
            });
            // SAFETY: the arguments are the kernel's in order and type; sizes checked in dims.
            unsafe { b.launch(elementwise(n / 2)) }.w()?;
            Ok(())
        })
    })?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

pub(super) fn write_rows<T: CudaDType + DeviceRepr + WithDType>(
    dims: WriteDims,
    to: &Tensor,
    cache: &mut CudaStorage,
    lc: &Layout,
    src: (&CudaStorage, &Layout),
) -> candle_core::Result<()> {
    const OP: &str = "write rows";
    let dev = cache.device.clone();
    let func = dev.get_or_load_custom_func(&kernel::<T>("write_rows"), MODULE, PTX)?;
    let src = view::<T>(OP, src, "src")?;
    let cache_range = contiguous_range(OP, lc, "cache")?;
    let mut cache = cache.as_cuda_slice_mut::<T>()?.slice_mut(cache_range);
    with_gpu(OP, to, "to", |to| {
        let to = view::<u32>(OP, to, "to")?;
        let n = dims.kv_heads * dims.rows * dims.head_dim;
        let mut b = func.builder();
        b.arg(&mut cache).arg(&src).arg(&to);
        let ints = [dims.rows, dims.kv_heads, dims.cache_rows, dims.head_dim].map(|x| x as i32);
        ints.iter().for_each(|x| {
            b.arg(x);
        });
        // SAFETY: the arguments are the kernel's in order and type; sizes checked in dims, and
        // the kernel skips rows whose cache row is NO_ROW or past the cache.
        unsafe { b.launch(elementwise(n)) }.w()?;
        Ok(())
    })
}

pub(super) fn silu_mul<T: CudaDType + DeviceRepr + WithDType>(
    n: usize,
    gate: (&CudaStorage, &Layout),
    up: (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    const OP: &str = "silu mul";
    let dev = gate.0.device.clone();
    let func = dev.get_or_load_custom_func(&kernel::<T>("silu_mul"), MODULE, PTX)?;
    let (gate, up) = (view::<T>(OP, gate, "gate")?, view::<T>(OP, up, "up")?);
    // SAFETY: every element is written by the kernel before it is read.
    let out = unsafe { dev.alloc::<T>(n)? };
    let mut b = func.builder();
    b.arg(&gate).arg(&up).arg(&out);
    let n_arg = n as u64;
    b.arg(&n_arg);
    // SAFETY: the arguments are the kernel's in order and type; gate and up hold n elements.
    unsafe { b.launch(elementwise(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
