//! The CPU implementation of [`super::decode_attention`]: the kernel's algorithm
//! (`kernel.cu`), one (row, head) at a time, in f32 whatever the dtype.

use candle_core::{CpuStorage, Layout, WithDType};
use half::{bf16, f16};

use super::{CHUNK, DecodeAttention, Dims, NO_EXTRA, bail, range};

/// An element the op reads and writes, computed in f32.
pub trait Elem: WithDType {
    fn f32(self) -> f32;
    fn of(x: f32) -> Self;
}

impl Elem for f32 {
    fn f32(self) -> f32 {
        self
    }
    fn of(x: f32) -> Self {
        x
    }
}

impl Elem for bf16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn of(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Elem for f16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn of(x: f32) -> Self {
        f16::from_f32(x)
    }
}

type Operand<'a> = (&'a CpuStorage, &'a Layout, &'static str);

fn slice<'a, T: Elem>((s, l, what): Operand<'a>) -> candle_core::Result<&'a [T]> {
    Ok(&s.as_slice::<T>()?[range(l, what)?])
}

pub fn run<T: Elem>(
    op: &DecodeAttention,
    dims: Dims,
    spans: &[u32],
    [q, keys, values]: [Operand; 3],
    [k_step, v_step]: [Operand; 2],
) -> candle_core::Result<CpuStorage> {
    let Dims {
        rows,
        heads,
        kv_heads,
        cache_rows,
        head_dim: hd,
    } = dims;
    let (q, keys, values) = (slice::<T>(q)?, slice::<T>(keys)?, slice::<T>(values)?);
    let (k_step, v_step) = (slice::<T>(k_step)?, slice::<T>(v_step)?);
    let mut out = vec![T::of(0.0); rows * heads * hd];
    for (row, span) in spans.chunks_exact(3).enumerate() {
        let (start, len, extra) = (span[0] as usize, span[1] as usize, span[2]);
        if start + len > cache_rows || (extra != NO_EXTRA && extra as usize >= rows) {
            return Err(bail(format!(
                "row {row}'s span {span:?} is outside the cache"
            )));
        }
        for head in 0..heads {
            let kv = head / (heads / kv_heads);
            let total = len + usize::from(extra != NO_EXTRA);
            // A column's entry: the span's in the cache, then the step's extra row.
            let at = |col: usize| match col < len {
                true => (true, (kv * cache_rows + start + col) * hd),
                false => (false, (kv * rows + extra as usize) * hd),
            };
            let key = |col: usize| match at(col) {
                (true, o) => &keys[o..o + hd],
                (false, o) => &k_step[o..o + hd],
            };
            let value = |col: usize| match at(col) {
                (true, o) => &values[o..o + hd],
                (false, o) => &v_step[o..o + hd],
            };
            let q_row = &q[(head * rows + row) * hd..(head * rows + row + 1) * hd];
            let o = (row * heads + head) * hd;
            attend(q_row, total, key, value, op.scale, &mut out[o..o + hd]);
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
