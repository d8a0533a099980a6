//! The sizes of one call of each device op, checked against its operands by the op
//! (`attention`, `elementwise`) and read by its CUDA launch (`cuda`): plain values, so the
//! launches need nothing of the ops.

use candle_core::Shape;

/// `decode_attention`'s sizes, checked against every operand's layout.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub(super) rows: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) cache_rows: usize,
    pub(super) head_dim: usize,
}

impl Dims {
    pub(super) fn out_shape(&self) -> Shape {
        Shape::from((self.rows, self.heads * self.head_dim))
    }
}

/// `rope_split`'s sizes, checked against every operand.
#[derive(Debug, Clone, Copy)]
pub(super) struct SplitDims {
    pub(super) rows: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
}

impl SplitDims {
    pub(super) fn out_shape(&self) -> Shape {
        Shape::from((self.heads + 2 * self.kv_heads, self.rows, self.head_dim))
    }
}

/// `write_rows`'s sizes.
#[derive(Debug, Clone, Copy)]
pub(super) struct WriteDims {
    pub(super) rows: usize,
    pub(super) kv_heads: usize,
    pub(super) cache_rows: usize,
    pub(super) head_dim: usize,
}
