//! What every spex custom op over candle storage needs, written once: the device ops
//! (`model::device_ops`) and training's fused ops (`train::fused`) read their operands and
//! name their errors through it.

use std::ops::Range;

use candle_core::{CpuStorage, Layout, WithDType};

/// An op's error: its name and what is wrong.
pub fn op_error(op: &str, message: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {message}"))
}

/// The range of `layout`'s elements in its storage; an error of `op` naming the operand
/// (`what`) unless it is contiguous.
pub fn contiguous_range(
    op: &str,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<Range<usize>> {
    let (start, end) = (layout.contiguous_offsets())
        .ok_or_else(|| op_error(op, format!("{what} is not contiguous")))?;
    Ok(start..end)
}

/// An operand's elements on the CPU, checked contiguous and of type `T`.
pub fn cpu_operand<'a, T: WithDType>(
    op: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    Ok(&storage.as_slice::<T>()?[contiguous_range(op, layout, what)?])
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    #[test]
    fn an_operand_is_read_where_contiguous_and_named_where_not() {
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu)
            .and_then(|t| t.reshape((2, 3)))
            .unwrap();
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            panic!("a CPU tensor")
        };
        let x = cpu_operand::<f32>("op", cpu, layout, "x").unwrap();
        assert_eq!(x, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let transposed = layout.transpose(0, 1).unwrap();
        let err = cpu_operand::<f32>("op", cpu, &transposed, "x").unwrap_err();
        assert_eq!(err.to_string(), "op: x is not contiguous");
    }
}
