//! Decode attention over the stacked per-pass KV cache, as one candle op: every row of a device
//! step attends to its own pass's span of the layer's cache (and, for a second candidate, to
//! its own K/V as one column after it) in a single launch. The device backend
//! ([`super::device`]) calls [`decode_attention`] once per layer; on CUDA it runs
//! `kernel.cu`, elsewhere [`DecodeAttention::cpu_fwd`], the same algorithm.
//!
//! Why an op of its own rather than candle's composed ops (gather the spans, Q·Kᵀ, mask,
//! softmax, P·V):
//! - **Batch invariance.** Each (row, head) is reduced over its own span from column 0, with an
//!   online softmax over fixed chunks of [`CHUNK`] columns. Nothing in a row's arithmetic
//!   depends on the rows beside it, so a token's pass has the same bits alone (the baseline)
//!   as in a speculative step. The composed ops sum a row's scores over the spans of every
//!   pass present: where its own span starts, and how a GPU groups its sums, vary with them.
//! - **Launches.** One launch replaces about ten per layer, and the spans are read in place.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};

use crate::engine::error::Result;

/// Columns per chunk of the online softmax (the kernel's shared-memory score buffer).
pub const CHUNK: usize = 1024;
/// The widest head the kernel takes (its per-thread accumulators).
pub const MAX_HEAD_DIM: usize = 256;
/// [`RowSpan::extra`]'s encoding of "none" in the metadata tensor.
const NO_EXTRA: u32 = u32::MAX;

/// What one row of a step attends to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSpan {
    /// The span's first cache row (its pass · the cache's capacity).
    pub start: usize,
    /// The span's entries (0: a padding row, whose output is zeros).
    pub len: usize,
    /// A row of the step's own K/V attended to as one more column after the span: a second
    /// candidate's own entry, which the cache does not hold.
    pub extra: Option<usize>,
}

impl RowSpan {
    /// A padding row: attends to nothing.
    pub const EMPTY: RowSpan = RowSpan {
        start: 0,
        len: 0,
        extra: None,
    };
}

/// The rows' spans as the op's `[rows, 3]` u32 metadata, uploaded once per step.
pub fn spans_tensor(spans: &[RowSpan], device: &candle_core::Device) -> Result<Tensor> {
    let to_u32 = |x: usize| u32::try_from(x).expect("cache rows fit in u32: this is a bug");
    let flat: Vec<u32> = (spans.iter())
        .flat_map(|s| {
            [s.start, s.len]
                .map(to_u32)
                .into_iter()
                .chain([s.extra.map_or(NO_EXTRA, to_u32)])
        })
        .collect();
    Ok(Tensor::from_vec(flat, (spans.len(), 3), device)?)
}

/// Attention of `q` (`[heads, rows, head_dim]`, after RoPE) over the layer's cache (`keys`,
/// `values`: `[kv_heads, cache rows, head_dim]`) by `spans` (from [`spans_tensor`]), with the
/// step's own K/V (`k_step`, `v_step`: `[kv_heads, rows, head_dim]`) for extra columns.
/// Returns `[rows, heads · head_dim]`. All inputs contiguous, one dtype (f32, bf16 or f16).
pub fn decode_attention(
    q: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    (k_step, v_step): (&Tensor, &Tensor),
    spans: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let op = DecodeAttention {
        k_step: k_step.clone(),
        v_step: v_step.clone(),
        spans: spans.clone(),
        scale,
    };
    Ok(q.apply_op3_no_bwd(keys, values, &op)?)
}

/// The op: the operands beyond candle's three (q, keys, values) ride along as tensors.
struct DecodeAttention {
    k_step: Tensor,
    v_step: Tensor,
    spans: Tensor,
    scale: f32,
}

/// The sizes of one call, checked against every operand's layout.
#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: usize,
    heads: usize,
    kv_heads: usize,
    cache_rows: usize,
    head_dim: usize,
}

impl Dims {
    fn out_shape(&self) -> Shape {
        Shape::from((self.rows, self.heads * self.head_dim))
    }
}

fn bail(message: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("decode attention: {message}"))
}

/// The contiguous range of `layout` in its storage.
fn range(layout: &Layout, what: &str) -> candle_core::Result<std::ops::Range<usize>> {
    let (start, end) =
        (layout.contiguous_offsets()).ok_or_else(|| bail(format!("{what} is not contiguous")))?;
    Ok(start..end)
}

impl DecodeAttention {
    fn dims(&self, q: &Layout, keys: &Layout, values: &Layout) -> candle_core::Result<Dims> {
        let (heads, rows, head_dim) = q.shape().dims3()?;
        let (kv_heads, cache_rows, key_dim) = keys.shape().dims3()?;
        let dims = Dims {
            rows,
            heads,
            kv_heads,
            cache_rows,
            head_dim,
        };
        let step = (kv_heads, rows, head_dim);
        let ok = key_dim == head_dim
            && values.shape().dims3()? == (kv_heads, cache_rows, head_dim)
            && self.k_step.dims3()? == step
            && self.v_step.dims3()? == step
            && self.spans.dims2()? == (rows, 3)
            && kv_heads > 0
            && heads % kv_heads == 0
            && head_dim <= MAX_HEAD_DIM;
        match ok {
            true => Ok(dims),
            false => Err(bail(format!(
                "shapes q {:?}, keys {:?}, values {:?}, k_step {:?}, v_step {:?}, spans {:?} do not fit",
                q.dims(),
                keys.dims(),
                values.dims(),
                self.k_step.dims(),
                self.v_step.dims(),
                self.spans.dims()
            ))),
        }
    }
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "spex-decode-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        keys: &CpuStorage,
        lk: &Layout,
        values: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = self.dims(lq, lk, lv)?;
        let (spans, ls) = self.spans.storage_and_layout();
        let (k_step, lks) = self.k_step.storage_and_layout();
        let (v_step, lvs) = self.v_step.storage_and_layout();
        let (Storage::Cpu(spans), Storage::Cpu(k_step), Storage::Cpu(v_step)) =
            (&*spans, &*k_step, &*v_step)
        else {
            return Err(bail("the step's operands are not on the CPU".into()));
        };
        let spans = &spans.as_slice::<u32>()?[range(ls, "spans")?];
        let storages = [(q, lq, "q"), (keys, lk, "keys"), (values, lv, "values")];
        let steps = [(k_step, lks, "k_step"), (v_step, lvs, "v_step")];
        let out = match q.dtype() {
            DType::F32 => cpu::run::<f32>(self, dims, spans, storages, steps)?,
            DType::BF16 => cpu::run::<bf16>(self, dims, spans, storages, steps)?,
            DType::F16 => cpu::run::<f16>(self, dims, spans, storages, steps)?,
            dtype => return Err(bail(format!("{dtype:?} is not supported"))),
        };
        Ok((out, dims.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        keys: &candle_core::CudaStorage,
        lk: &Layout,
        values: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(lq, lk, lv)?;
        let operands = [(q, lq), (keys, lk), (values, lv)];
        let out = match q.dtype() {
            DType::F32 => cuda::run::<f32>(self, dims, operands, "decode_attention_f32")?,
            DType::BF16 => cuda::run::<bf16>(self, dims, operands, "decode_attention_bf16")?,
            DType::F16 => cuda::run::<f16>(self, dims, operands, "decode_attention_f16")?,
            dtype => return Err(bail(format!("{dtype:?} is not supported"))),
        };
        Ok((out, dims.out_shape()))
    }
}

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(test)]
mod tests;
