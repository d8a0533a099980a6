//! The device step's elementwise ops, each one launch: [`rope_split`] (RoPE and the head-major
//! layout of Q, K and V), [`write_rows`] (a step's K or V rows into the cache) and
//! [`silu_mul`]. Each runs its kernel in `kernels.cu` on CUDA and the CPU twin here elsewhere;
//! every element depends on its own row alone.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, InplaceOp2, Layout, Shape};
use candle_core::{Storage, Tensor, WithDType};

use super::dims::{SplitDims, WriteDims};
use super::{Elem, by_dtype};
use crate::engine::custom_op::{contiguous_range, cpu_operand, op_error};
use crate::engine::error::Result;
use crate::engine::kernels::rope_row;

/// [`write_rows`]'s "this row is not written" (a second candidate's, or a padding row's).
pub const NO_ROW: u32 = u32::MAX;

/// RoPE at each row's position and the head-major split of a step's projections, in one op:
/// `q` `[rows, heads · head_dim]`, `k` and `v` `[rows, kv_heads · head_dim]`, `cos` and `sin`
/// `[rows, head_dim / 2]` (candle's non-interleaved `rope`: a head's first half rotates with
/// its second) → `[heads + 2 · kv_heads, rows, head_dim]`: Q's heads rotated, then K's
/// rotated, then V's as they are. `narrow(0, …)` gives each, contiguous.
pub fn rope_split(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let op = RopeSplit {
        cos: cos.clone(),
        sin: sin.clone(),
    };
    Ok(q.apply_op3_no_bwd(k, v, &op)?)
}

/// Writes row `i` of `src` (`[kv_heads, rows, head_dim]`) into `cache` (`[kv_heads, cache rows,
/// head_dim]`) at cache row `to[i]` (`[rows]` u32; [`NO_ROW`]: not written), in place.
pub fn write_rows(cache: &Tensor, src: &Tensor, to: &Tensor) -> Result<()> {
    Ok(cache.inplace_op2(src, &WriteRows { to: to.clone() })?)
}

/// SiLU(`gate`) · `up`, elementwise, one launch.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.apply_op2_no_bwd(up, &SiluMul)?)
}

/// The operands of [`rope_split`] beyond candle's three.
pub(super) struct RopeSplit {
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
}

impl RopeSplit {
    const OP: &str = "rope split";

    pub(super) fn dims(
        &self,
        q: &Layout,
        k: &Layout,
        v: &Layout,
    ) -> candle_core::Result<SplitDims> {
        let (rows, q_width) = q.shape().dims2()?;
        let (k_rows, kv_width) = k.shape().dims2()?;
        let (cos_rows, half) = self.cos.dims2()?;
        let head_dim = 2 * half;
        let ok = head_dim > 0
            && q_width % head_dim == 0
            && kv_width % head_dim == 0
            && k_rows == rows
            && v.shape().dims2()? == (rows, kv_width)
            && cos_rows == rows
            && self.sin.dims2()? == (rows, half);
        match ok {
            true => Ok(SplitDims {
                rows,
                heads: q_width / head_dim,
                kv_heads: kv_width / head_dim,
                head_dim,
            }),
            false => Err(op_error(
                Self::OP,
                format!(
                    "shapes q {:?}, k {:?}, v {:?}, cos {:?}, sin {:?} do not fit",
                    q.dims(),
                    k.dims(),
                    v.dims(),
                    self.cos.dims(),
                    self.sin.dims()
                ),
            )),
        }
    }
}

impl CustomOp3 for RopeSplit {
    fn name(&self) -> &'static str {
        "spex-rope-split"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = self.dims(lq, lk, lv)?;
        let (cos, lc) = self.cos.storage_and_layout();
        let (sin, ls) = self.sin.storage_and_layout();
        let (Storage::Cpu(cos), Storage::Cpu(sin)) = (&*cos, &*sin) else {
            return Err(op_error(Self::OP, "cos and sin are not on the CPU"));
        };
        let out = by_dtype!(Self::OP, q.dtype(), |T| {
            let operand = |s, l, what| cpu_operand::<T>(Self::OP, s, l, what);
            let sources = [
                operand(q, lq, "q")?,
                operand(k, lk, "k")?,
                operand(v, lv, "v")?,
            ];
            let angles = [operand(cos, lc, "cos")?, operand(sin, ls, "sin")?];
            Ok(rope_split_cpu(dims, sources, angles))
        })?;
        Ok((out, dims.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(lq, lk, lv)?;
        let operands = [(q, lq), (k, lk), (v, lv)];
        let out = by_dtype!(Self::OP, q.dtype(), |T| {
            super::cuda::rope_split::<T>(dims, &self.cos, &self.sin, operands)
        })?;
        Ok((out, dims.out_shape()))
    }
}

/// The CPU twin of `rope_split`: each output row from its own input row, rotated by the host
/// kernels' [`rope_row`] in f32.
fn rope_split_cpu<T: Elem>(
    dims: SplitDims,
    [q, k, v]: [&[T]; 3],
    [cos, sin]: [&[T]; 2],
) -> CpuStorage {
    let SplitDims {
        rows,
        heads,
        kv_heads,
        head_dim,
    } = dims;
    let half = head_dim / 2;
    let widen = |x: &[T]| x.iter().map(|&x| x.f32()).collect::<Vec<f32>>();
    let (cos, sin) = (widen(cos), widen(sin));
    let mut out = Vec::with_capacity((heads + 2 * kv_heads) * rows * head_dim);
    let parts = [(q, heads, true), (k, kv_heads, true), (v, kv_heads, false)];
    for (src, width, rotated) in parts {
        for head in 0..width {
            for row in 0..rows {
                let x = &src[(row * width + head) * head_dim..][..head_dim];
                if !rotated {
                    out.extend_from_slice(x);
                    continue;
                }
                let mut x = widen(x);
                let angles = row * half..(row + 1) * half;
                rope_row(&mut x, head_dim, &cos[angles.clone()], &sin[angles]);
                out.extend(x.into_iter().map(T::of));
            }
        }
    }
    T::to_cpu_storage_owned(out)
}

/// The operand of [`write_rows`] beyond candle's two: each row's cache row.
pub(super) struct WriteRows {
    pub(super) to: Tensor,
}

impl WriteRows {
    const OP: &str = "write rows";

    pub(super) fn dims(&self, cache: &Layout, src: &Layout) -> candle_core::Result<WriteDims> {
        let (kv_heads, cache_rows, head_dim) = cache.shape().dims3()?;
        let (src_heads, rows, src_dim) = src.shape().dims3()?;
        match (src_heads, src_dim, self.to.dims1()?) == (kv_heads, head_dim, rows) {
            true => Ok(WriteDims {
                rows,
                kv_heads,
                cache_rows,
                head_dim,
            }),
            false => Err(op_error(
                Self::OP,
                format!(
                    "shapes cache {:?}, rows {:?}, to {:?} do not fit",
                    cache.dims(),
                    src.dims(),
                    self.to.dims()
                ),
            )),
        }
    }
}

impl InplaceOp2 for WriteRows {
    fn name(&self) -> &'static str {
        "spex-write-rows"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        lc: &Layout,
        src: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        let dims = self.dims(lc, ls)?;
        let (to, lt) = self.to.storage_and_layout();
        let Storage::Cpu(to) = &*to else {
            return Err(op_error(
                Self::OP,
                "the rows' cache rows are not on the CPU",
            ));
        };
        let to = cpu_operand::<u32>(Self::OP, to, lt, "to")?;
        let cache_range = contiguous_range(Self::OP, lc, "cache")?;
        by_dtype!(Self::OP, src.dtype(), |T| {
            let src = cpu_operand::<T>(Self::OP, src, ls, "src")?;
            let cache = T::slice_mut(cache)
                .ok_or_else(|| op_error(Self::OP, "the cache and the rows differ in dtype"))?;
            let cache = &mut cache[cache_range];
            write_rows_cpu(dims, cache, src, to)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        lc: &Layout,
        src: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        let dims = self.dims(lc, ls)?;
        by_dtype!(Self::OP, src.dtype(), |T| {
            super::cuda::write_rows::<T>(dims, &self.to, cache, lc, (src, ls))
        })
    }
}

/// The CPU twin of `write_rows`.
fn write_rows_cpu<T: Elem>(
    d: WriteDims,
    cache: &mut [T],
    src: &[T],
    to: &[u32],
) -> candle_core::Result<()> {
    for (row, &at) in to.iter().enumerate() {
        if at == NO_ROW {
            continue;
        }
        let at = at as usize;
        if at >= d.cache_rows {
            let message = format!("row {row}'s cache row {at} is past {} rows", d.cache_rows);
            return Err(op_error(WriteRows::OP, message));
        }
        for head in 0..d.kv_heads {
            let from = &src[(head * d.rows + row) * d.head_dim..][..d.head_dim];
            cache[(head * d.cache_rows + at) * d.head_dim..][..d.head_dim].copy_from_slice(from);
        }
    }
    Ok(())
}

/// [`silu_mul`]'s op.
pub(super) struct SiluMul;

impl SiluMul {
    const OP: &str = "silu mul";

    pub(super) fn elements(&self, gate: &Layout, up: &Layout) -> candle_core::Result<usize> {
        match gate.shape() == up.shape() {
            true => Ok(gate.shape().elem_count()),
            false => Err(op_error(
                Self::OP,
                format!("shapes {:?} and {:?} differ", gate.dims(), up.dims()),
            )),
        }
    }
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "spex-silu-mul"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        lg: &Layout,
        up: &CpuStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.elements(lg, lu)?;
        let out = by_dtype!(Self::OP, gate.dtype(), |T| {
            let gate = cpu_operand::<T>(Self::OP, gate, lg, "gate")?;
            let up = cpu_operand::<T>(Self::OP, up, lu, "up")?;
            let out = gate.iter().zip(up).map(|(&g, &u)| {
                let g = g.f32();
                T::of(g / (1.0 + (-g).exp()) * u.f32())
            });
            Ok(T::to_cpu_storage_owned(out.collect()))
        })?;
        Ok((out, lg.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gate: &candle_core::CudaStorage,
        lg: &Layout,
        up: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let n = self.elements(lg, lu)?;
        let out = by_dtype!(Self::OP, gate.dtype(), |T| {
            super::cuda::silu_mul::<T>(n, (gate, lg), (up, lu))
        })?;
        Ok((out, lg.shape().clone()))
    }
}
