//! Decode attention over the stacked per-pass KV cache, as one candle op: every row of a device
//! step attends to its own pass's span of the layer's cache (and, for a second candidate, to
//! its own K/V as one column after it) in a single launch. The device backend calls
//! [`decode_attention`] once per layer; on CUDA it runs `decode_attention` in `kernels.cu`,
//! elsewhere the CPU twin below, the same algorithm.
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
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Storage, Tensor};

use super::dims::Dims;
use super::{Elem, by_dtype};
use crate::engine::custom_op::{cpu_operand, op_error};
use crate::engine::error::Result;

const OP: &str = "decode attention";

/// Columns per chunk of the online softmax (the kernel's shared-memory score buffer).
pub const CHUNK: usize = 1024;
/// The widest head the kernel takes (its per-thread accumulators).
pub const MAX_HEAD_DIM: usize = 256;
/// [`RowSpan::extra`]'s encoding of "none" in the metadata tensor.
pub(super) const NO_EXTRA: u32 = u32::MAX;

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
    let to_u32 = |x: usize| {
        u32::try_from(x)
            .map_err(|_| op_error("decode attention", format!("cache row {x} past u32")))
    };
    let flat: Vec<u32> = (spans.iter())
        .flat_map(|s| {
            [
                to_u32(s.start),
                to_u32(s.len),
                s.extra.map_or(Ok(NO_EXTRA), to_u32),
            ]
        })
        .collect::<candle_core::Result<_>>()?;
    Ok(Tensor::from_vec(flat, (spans.len(), 3), device)?)
}

/// Attention of `q` (`[heads, rows, head_dim]`, after RoPE) over the layer's cache (`keys`,
/// `values`: `[kv_heads, cache rows, head_dim]`) by `spans` (from [`spans_tensor`]), with the
/// step's own K/V (`k_step`, `v_step`: `[kv_heads, rows, head_dim]`) for extra columns.
/// Returns `[rows, heads · head_dim]`. All inputs contiguous, one dtype (f32, bf16 or f16).
pub fn decode_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    k_step: &Tensor,
    v_step: &Tensor,
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
pub(super) struct DecodeAttention {
    pub(super) k_step: Tensor,
    pub(super) v_step: Tensor,
    pub(super) spans: Tensor,
    pub(super) scale: f32,
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
            false => Err(op_error(
                OP,
                format!(
                    "shapes q {:?}, keys {:?}, values {:?}, k_step {:?}, v_step {:?}, spans {:?} do not fit",
                    q.dims(),
                    keys.dims(),
                    values.dims(),
                    self.k_step.dims(),
                    self.v_step.dims(),
                    self.spans.dims()
                ),
            )),
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
            return Err(op_error(OP, "the step's operands are not on the CPU"));
        };
        let spans = cpu_operand::<u32>(OP, spans, ls, "spans")?;
        let out = by_dtype!(OP, q.dtype(), |T| {
            let operand = |s, l, what| cpu_operand::<T>(OP, s, l, what);
            let inputs = Inputs {
                q: operand(q, lq, "q")?,
                keys: operand(keys, lk, "keys")?,
                values: operand(values, lv, "values")?,
                k_step: operand(k_step, lks, "k_step")?,
                v_step: operand(v_step, lvs, "v_step")?,
            };
            run(self.scale, dims, spans, inputs)
        })?;
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
        let out = by_dtype!(OP, q.dtype(), |T| {
            let step = (&self.k_step, &self.v_step, &self.spans);
            super::cuda::decode_attention::<T>(dims, (step, self.scale), operands)
        })?;
        Ok((out, dims.out_shape()))
    }
}

/// The CPU twin's operands, contiguous slices of one element type.
struct Inputs<'a, T> {
    q: &'a [T],
    keys: &'a [T],
    values: &'a [T],
    k_step: &'a [T],
    v_step: &'a [T],
}

/// The CPU twin of the kernel: one (row, head) at a time.
fn run<'a, T: Elem>(
    scale: f32,
    dims: Dims,
    spans: &[u32],
    Inputs {
        q,
        keys,
        values,
        k_step,
        v_step,
    }: Inputs<'a, T>,
) -> candle_core::Result<CpuStorage> {
    let Dims {
        rows,
        heads,
        kv_heads,
        cache_rows,
        head_dim: hd,
    } = dims;
    let mut out = vec![T::of(0.0); rows * heads * hd];
    for (row, span) in spans.chunks_exact(3).enumerate() {
        let (start, len, extra) = (span[0] as usize, span[1] as usize, span[2]);
        if start + len > cache_rows || (extra != NO_EXTRA && extra as usize >= rows) {
            let message = format!("row {row}'s span {span:?} is outside the cache");
            return Err(op_error(OP, message));
        }
        let total = len + usize::from(extra != NO_EXTRA);
        for head in 0..heads {
            let kv = head / (heads / kv_heads);
            // A column's entry: the span's in the cache, then the step's extra row.
            let entry = |cache: &'a [T], step: &'a [T], col: usize| match col < len {
                true => &cache[(kv * cache_rows + start + col) * hd..][..hd],
                false => &step[(kv * rows + extra as usize) * hd..][..hd],
            };
            let key = |col: usize| entry(keys, k_step, col);
            let value = |col: usize| entry(values, v_step, col);
            let q_row = &q[(head * rows + row) * hd..(head * rows + row + 1) * hd];
            let o = (row * heads + head) * hd;
            attend(q_row, total, key, value, scale, &mut out[o..o + hd]);
        }
    }
    Ok(T::to_cpu_storage_owned(out))
}

/// One (row, head): an online softmax over chunks of [`CHUNK`] columns from column 0.
fn attend<'a, T: Elem>(
    q: &[T],
    total: usize,
    key: impl Fn(usize) -> &'a [T],
    value: impl Fn(usize) -> &'a [T],
    scale: f32,
    out: &mut [T],
) {
    let q: Vec<f32> = q.iter().map(|&x| x.f32()).collect();
    let mut acc = vec![0f32; q.len()];
    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
    let mut p = Vec::with_capacity(CHUNK);
    for c0 in (0..total).step_by(CHUNK) {
        let n = CHUNK.min(total - c0);
        p.clear();
        p.extend((c0..c0 + n).map(|col| {
            let s: f32 = q.iter().zip(key(col)).map(|(a, b)| a * b.f32()).sum();
            s * scale
        }));
        let m_new = p.iter().fold(m, |a, &b| a.max(b));
        let mut sum = 0f32;
        for e in p.iter_mut() {
            *e = (*e - m_new).exp();
            sum += *e;
        }
        let rescale = (m - m_new).exp();
        l = l * rescale + sum;
        acc.iter_mut().for_each(|a| *a *= rescale);
        for (j, &pj) in p.iter().enumerate() {
            for (a, v) in acc.iter_mut().zip(value(c0 + j)) {
                *a += pj * v.f32();
            }
        }
        m = m_new;
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = T::of(if total > 0 { a / l } else { 0.0 });
    }
}
