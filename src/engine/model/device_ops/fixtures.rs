//! Test fixtures of the device ops, one definition shared by their unit tests (`tests`), the
//! kernels' host harness (`tests/device_ops.rs`) and the GPU run (`tests/exactness_cuda.rs`):
//! the attention case, random and rounded tensors, and the rule by which a kernel's output is
//! close to its CPU twin's. Not part of spex's interface (hidden from the docs).

use candle_core::{DType, Device, Tensor};

use crate::engine::error::Result;

use super::{CHUNK, RowSpan, decode_attention, spans_tensor};

/// The dtypes every op is checked in.
pub const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Standard normal values of `shape`, on the CPU.
pub fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).expect("randn")
}

/// `t` as `dtype` rounds it, in f32: what an op reading `dtype` reads.
pub fn rounded(t: &Tensor, dtype: DType) -> Tensor {
    t.to_dtype(dtype)
        .and_then(|t| t.to_dtype(DType::F32))
        .expect("rounded")
}

/// `t`'s values as f32, flattened, from whatever device.
pub fn flat(t: &Tensor) -> Vec<f32> {
    (t.to_dtype(DType::F32).and_then(|t| t.flatten_all()))
        .and_then(|t| t.to_device(&Device::Cpu))
        .and_then(|t| t.to_vec1())
        .expect("readable as f32")
}

/// One rounding of `dtype`, relative; f32's allows for sums in different orders.
pub fn one_rounding(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => 1e-5,
    }
}

/// A kernel's output against its CPU twin's: equal to within one rounding of `dtype` (both
/// compute in f32 and round once, but sum in different orders, so a value near a midpoint may
/// round either way).
pub fn assert_close(what: &str, dtype: DType, twin: &[f32], kernel: &[f32]) {
    assert_eq!(twin.len(), kernel.len(), "{what} {dtype:?}: sizes");
    for (i, (a, b)) in twin.iter().zip(kernel).enumerate() {
        let bound = 1e-5 + one_rounding(dtype) * a.abs();
        assert!(
            (a - b).abs() <= bound,
            "{what} {dtype:?}: element {i}: kernel {b}, CPU twin {a}"
        );
    }
}

/// The sizes of an attention case.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// One pass's rows of the cache; the cache holds two passes.
    pub capacity: usize,
}

impl AttentionShape {
    /// Grouped heads of 32, small enough for the host harness and the f64 reference.
    pub const SMALL: Self = Self {
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        capacity: 1200,
    };
    /// Ouro's head size, for the GPU.
    pub const WIDE: Self = Self {
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        capacity: 1500,
    };
}

/// One attention call, q `[heads, rows, head_dim]` over a cache of two passes, with four
/// rows: a short span; a span of the second pass that crosses a chunk, whose second chunk
/// scores higher (its running maximum moves there and the first chunk's sums are rescaled); a
/// second candidate's span with its extra column (step row 2); and a padding row.
#[derive(Debug, Clone)]
pub struct AttentionCase {
    pub shape: AttentionShape,
    pub q: Tensor,
    pub keys: Tensor,
    pub values: Tensor,
    pub k_step: Tensor,
    pub v_step: Tensor,
    pub spans: Vec<RowSpan>,
}

impl AttentionCase {
    /// The case of `shape`, its values rounded to `dtype` (so every reader reads the same).
    pub fn new(shape: AttentionShape, dtype: DType) -> Self {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim: dim,
            capacity,
        } = shape;
        let (rows, long) = (4, capacity - 100);
        assert!(long > CHUNK, "the long span crosses a chunk");
        let r = |shape: &[usize]| rounded(&randn(shape), dtype);
        let second_chunk = capacity + CHUNK..capacity + long;
        let boost: Vec<f32> = (0..2 * capacity)
            .map(|row| {
                if second_chunk.contains(&row) {
                    3.0
                } else {
                    1.0
                }
            })
            .collect();
        let boost = Tensor::from_vec(boost, (1, 2 * capacity, 1), &Device::Cpu).expect("boost");
        let keys = (randn(&[kv_heads, 2 * capacity, dim]).broadcast_mul(&boost)).expect("keys");
        let span = |start, len, extra| RowSpan { start, len, extra };
        Self {
            shape,
            q: r(&[heads, rows, dim]),
            keys: rounded(&keys, dtype),
            values: r(&[kv_heads, 2 * capacity, dim]),
            k_step: r(&[kv_heads, rows, dim]),
            v_step: r(&[kv_heads, rows, dim]),
            spans: vec![
                span(0, 9, None),
                span(capacity, long, None),
                span(capacity, 5, Some(2)),
                RowSpan::EMPTY,
            ],
        }
    }

    /// The softmax scale, 1/√head_dim.
    pub fn scale(&self) -> f32 {
        1.0 / (self.shape.head_dim as f32).sqrt()
    }

    /// `decode_attention` over the case in `dtype` on `device` (the CPU twin or the kernel).
    pub fn attend(&self, device: &Device, dtype: DType) -> Result<Tensor> {
        let on = |t: &Tensor| t.to_dtype(dtype).and_then(|t| t.to_device(device));
        let spans = spans_tensor(&self.spans, device)?;
        decode_attention(
            &on(&self.q)?,
            &on(&self.keys)?,
            &on(&self.values)?,
            &on(&self.k_step)?,
            &on(&self.v_step)?,
            &spans,
            self.scale(),
        )
    }
}
