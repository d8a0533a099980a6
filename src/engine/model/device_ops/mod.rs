//! spex's own device ops: the parts of a device step that candle's composed ops would run as
//! several launches, or with sums that depend on the rows beside a row, as one op each. The
//! device backend ([`super::device`]) calls them; each has a CUDA kernel (`kernels.cu`,
//! compiled to PTX by build.rs with the `cuda` feature, launched from `cuda`) and a CPU twin
//! in its own module, the same algorithm in Rust, which the tests run. Every op computes in f32
//! whatever the tensors' dtype and rounds once.
//!
//! - [`decode_attention`]: every row over its own pass's span of the stacked cache, one launch
//!   a layer, batch-invariant (was about ten launches, summing over every span present).
//! - [`rope_split`]: RoPE and the head-major layout of a step's Q, K and V (was five).
//! - [`write_rows`]: a step's K or V rows into the cache at their rows (was an index-select and
//!   a scatter, shaped by how many rows were first candidates).
//! - [`silu_mul`]: the MLP's SiLU(gate)·up (was two).

mod attention;
#[cfg(feature = "cuda")]
mod cuda;
mod dims;
mod elementwise;
#[doc(hidden)]
pub mod fixtures;
#[cfg(test)]
mod tests;

pub use attention::{CHUNK, MAX_HEAD_DIM, RowSpan, decode_attention, spans_tensor};
pub use elementwise::{NO_ROW, rope_split, silu_mul, write_rows};

use candle_core::{CpuStorage, WithDType};
use half::{bf16, f16};

/// An element the CPU twins read and write, computed in f32.
trait Elem: WithDType {
    fn f32(self) -> f32;
    fn of(x: f32) -> Self;
    /// `storage`'s elements, writable, where they are of this type.
    fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]>;
}

impl Elem for f32 {
    fn f32(self) -> f32 {
        self
    }
    fn of(x: f32) -> Self {
        x
    }
    fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]> {
        match storage {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for bf16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn of(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]> {
        match storage {
            CpuStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for f16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn of(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]> {
        match storage {
            CpuStorage::F16(v) => Some(v),
            _ => None,
        }
    }
}

/// Runs `$body` with `$t` the element type of `$dtype` (f32, bf16 or f16); other dtypes are
/// an error of `$op`.
macro_rules! by_dtype {
    ($op:expr, $dtype:expr, |$t:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            dtype => Err($crate::engine::custom_op::op_error(
                $op,
                format!("{dtype:?} is not supported"),
            )),
        }
    };
}
use by_dtype;
