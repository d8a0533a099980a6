//! CPU kernels for the decode step on f32 host memory: a small-M matmul that reads each weight
//! row once for all M rows, RMSNorm, rotary embedding, single-query attention, SiLU, softmax.
//! Called by `model::host` only; GPU devices use candle's own kernels instead.
//!
//! Why a kernel of our own: candle's CPU matmul for 2–6 rows costs ~5× its 1-row time, which
//! erases SPEED's gain (speculation.md §6). Here every output element of row `m` is computed
//! with the same arithmetic whatever M is and however the work is split between threads, so a
//! token's hidden state does not depend on which other rows shared its step: speculative and
//! baseline decoding agree bit for bit.
//!
//! `f16` is the same product with f16 weights, for `model::half_head`'s proposal
//! readouts, which need a bound on their error rather than these bits.
//!
//! AVX-512 runs the matmul where the CPU has it (measured on this project's Xeon: baseline
//! decoding 6–9 % faster than with AVX2, SPEED 5 % faster); everything else uses AVX2 + FMA.
//! On aarch64 the matmul is NEON's (`neon`), the rest the portable loops.

//! One file per role: this one detects the ISA once and dispatches (the safe API), then
//! `portable`, `avx2`, `avx512`, `f16` (the proposal head's matmul) and `subnormals` (the
//! FTZ/DAZ guard).

use std::sync::OnceLock;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod f16;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod pool;
mod portable;
mod subnormals;
#[cfg(test)]
mod tests;

pub use subnormals::SubnormalsFlushed;

/// Rows of `x` processed together against one weight row (registers hold 2 accumulators each).
const ROW_BLOCK: usize = 4;
/// Weight matrices with at least this many elements (16 MB: Ouro-1.4B's, not the shipped
/// model's) are split across threads by output rows; below it, waking a second thread costs
/// more than it saves (measured: hidden 256 steps were 15 % slower threaded).
const PARALLEL_MIN_ELEMENTS: usize = 1 << 22;

/// Weight matrices with at least this many elements are split across the decode threads
/// when `--threads` is above 1 (a hidden-256 projection has 65,536).
const POOL_MIN_ELEMENTS: usize = 1 << 14;
/// Weight rows a thread's share of a matmul is a multiple of (whole groups of every sweep).
const SHARE_ALIGN: usize = 16;

/// Which instruction set the kernels use, chosen once per process at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F for the matmul (16 lanes, 32 registers), AVX2 + FMA for everything else.
    Avx512,
    Avx2Fma,
    /// aarch64's NEON for the matmul (every aarch64 CPU has it), portable loops elsewhere.
    Neon,
    Portable,
}

impl Isa {
    /// Whether the AVX2 + FMA kernels may run (true for every x86 level above the fallback).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx2Fma)
    }

    /// Portable 0, AVX2 + FMA 1, AVX-512 2: a CPU runs every level up to its own.
    fn level(self) -> u8 {
        match self {
            Isa::Portable => 0,
            Isa::Avx2Fma | Isa::Neon => 1,
            Isa::Avx512 => 2,
        }
    }
}

/// The instruction set the kernels use, chosen once per process: `force_isa`'s, else the best
/// this CPU has.
static ISA: OnceLock<Isa> = OnceLock::new();

/// The instruction set the kernels use: AVX-512F, AVX2 + FMA, or the portable fallback.
pub fn isa() -> Isa {
    *ISA.get_or_init(detected_isa)
}

/// The best instruction set this CPU runs.
pub fn detected_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        return Isa::Avx2Fma;
    }
    #[cfg(target_arch = "aarch64")]
    return Isa::Neon;
    #[allow(unreachable_code)]
    Isa::Portable
}

/// Makes the kernels use `isa` (a lower one than the CPU's best, to measure it on this
/// machine). Call it before anything decodes: an error if this CPU cannot run `isa`, or if
/// the kernels already chose a different one.
pub fn force_isa(isa: Isa) -> Result<(), String> {
    let detected = detected_isa();
    // NEON and the x86 extensions are different machines: neither runs the other's kernels.
    let other_family = (isa == Isa::Neon) != (detected == Isa::Neon) && isa != Isa::Portable;
    if other_family || isa.level() > detected.level() {
        return Err(format!("this CPU runs {detected:?} at best, not {isa:?}"));
    }
    match ISA.set(isa) {
        Ok(()) => Ok(()),
        Err(_) if self::isa() == isa => Ok(()),
        Err(_) => Err(format!("the kernels already run {:?}", self::isa())),
    }
}

/// `out[m][j] = Σ_k x[m][k] · w[j][k]` for `x: [rows × inner]`, `w: [outs × inner]` (a linear
/// layer's weight as stored, no transpose), `out: [rows × outs]`.
pub fn matmul_t(x: &[f32], w: &[f32], rows: usize, inner: usize, out: &mut [f32]) {
    let outs = w.len() / inner;
    debug_assert_eq!(x.len(), rows * inner);
    debug_assert_eq!(out.len(), rows * outs);
    let isa = isa();
    let pool = pool::pool();
    if pool.threads() > 1 && w.len() >= POOL_MIN_ELEMENTS {
        return matmul_t_pooled(pool, isa, (x, rows, inner), &mut [(w, out)]);
    }
    if w.len() < PARALLEL_MIN_ELEMENTS || rayon::current_num_threads() == 1 {
        let to = OutLayout { col: 1, row: outs };
        return matmul_t_serial(isa, x, w, rows, inner, out, to);
    }
    // Threads own disjoint slices: the output transposed, each thread a range of weight rows.
    let mut out_t = vec![0f32; outs * rows];
    let chunk_outs = outs.div_ceil(rayon::current_num_threads() * 2).max(16);
    let to = OutLayout { col: rows, row: 1 };
    out_t
        .par_chunks_mut(chunk_outs * rows)
        .zip(w.par_chunks(chunk_outs * inner))
        .for_each(|(o, w)| matmul_t_serial(isa, x, w, rows, inner, o, to));
    for (j, col) in out_t.chunks_exact(rows).enumerate() {
        for (m, v) in col.iter().enumerate() {
            out[m * outs + j] = *v;
        }
    }
}

/// Products of one input `x: [rows × inner]` with several weights, `outᵢ = x · wᵢᵀ` (the Q,
/// K and V projections; gate and up): one job of the decode threads for all of them, so that
/// the threads meet once instead of once per weight.
pub fn matmuls_t(x: &[f32], rows: usize, inner: usize, products: &mut [(&[f32], &mut [f32])]) {
    let pool = pool::pool();
    if pool.threads() > 1 && products.iter().all(|(w, _)| w.len() >= POOL_MIN_ELEMENTS) {
        return matmul_t_pooled(pool, isa(), (x, rows, inner), products);
    }
    for (w, out) in products.iter_mut() {
        matmul_t(x, w, rows, inner, out);
    }
}

/// Matmuls split across the decode threads by weight rows. With one input row each thread
/// writes its share of the output in place; with several, a row-major block of its own
/// columns, copied into place row by row afterwards.
fn matmul_t_pooled(
    pool: &pool::Pool,
    isa: Isa,
    (x, rows, inner): (&[f32], usize, usize),
    products: &mut [(&[f32], &mut [f32])],
) {
    let parts = pool.threads();
    let share = |outs: usize, part: usize| pool::share(outs, parts, part, SHARE_ALIGN);
    let (weights, mut outs): (Vec<&[f32]>, Vec<&mut [f32]>) =
        products.iter_mut().map(|(w, o)| (*w, &mut **o)).unzip();
    let widths: Vec<usize> = weights.iter().map(|w| w.len() / inner).collect();
    let mut blocks: Vec<Vec<pool::Padded<std::sync::Mutex<Block>>>> = Vec::new();
    for (i, &width) in widths.iter().enumerate() {
        let mut rest: &mut [f32] = match rows {
            1 => std::mem::take(&mut outs[i]),
            _ => &mut [],
        };
        let mine = (0..parts)
            .map(|part| {
                let len = share(width, part).len();
                let block = match rows {
                    1 => {
                        let (block, tail) = std::mem::take(&mut rest).split_at_mut(len);
                        rest = tail;
                        Block::InPlace(block)
                    }
                    _ => Block::Own(vec![0f32; rows * len]),
                };
                pool::Padded(std::sync::Mutex::new(block))
            })
            .collect();
        blocks.push(mine);
    }
    pool.run(&|part| {
        for ((w, &width), blocks) in weights.iter().zip(&widths).zip(&blocks) {
            let range = share(width, part);
            let w = &w[range.start * inner..range.end * inner];
            let to = OutLayout {
                col: 1,
                row: range.len(),
            };
            let mut block = blocks[part].lock().unwrap_or_else(|e| e.into_inner());
            matmul_t_serial(isa, x, w, rows, inner, block.slice(), to);
        }
    });
    for ((out, &width), blocks) in outs.iter_mut().zip(&widths).zip(blocks) {
        for (part, block) in blocks.into_iter().enumerate() {
            let Block::Own(data) = block.0.into_inner().unwrap_or_else(|e| e.into_inner()) else {
                continue;
            };
            place_columns(out, width, share(width, part), &data);
        }
    }
}

/// Copies `block` (`[rows × columns.len()]`, one thread's share) into `columns` of every
/// row of `out` (`[rows × width]`).
fn place_columns(out: &mut [f32], width: usize, columns: std::ops::Range<usize>, block: &[f32]) {
    let rows = out.chunks_exact_mut(width.max(1));
    for (dest, row) in rows.zip(block.chunks_exact(columns.len().max(1))) {
        dest[columns.clone()].copy_from_slice(row);
    }
}

/// Where one thread writes its share of a product.
enum Block<'a> {
    /// Straight into the output (one input row: a share is a contiguous slice of it).
    InPlace(&'a mut [f32]),
    /// A `[rows × share]` block of its own.
    Own(Vec<f32>),
}

impl Block<'_> {
    fn slice(&mut self) -> &mut [f32] {
        match self {
            Block::InPlace(s) => s,
            Block::Own(v) => v,
        }
    }
}

/// Where the kernels put the product of input row `r` and weight row `j`: `out[j·col + r·row]`
/// (row-major `[rows × outs]` is `col` 1, `row` outs; transposed is `col` rows, `row` 1).
#[derive(Debug, Clone, Copy)]
struct OutLayout {
    col: usize,
    row: usize,
}

/// One thread's share: writes the products with the weight rows in `w` where `to` says. Few
/// input rows take more weight rows at a time, so that there are always 4–8 (AVX2) or 8–16
/// (AVX-512) independent accumulators and each input load feeds several FMAs. The grouping does not
/// change any result: every (row, weight row) pair is computed the same way.
fn matmul_t_serial(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    rows: usize,
    inner: usize,
    out: &mut [f32],
    to: OutLayout,
) {
    match (isa, rows) {
        // AVX-512 has 32 registers: 16 accumulators plus the weight and input chunks fit.
        (Isa::Avx512, 1..=2) => sweep::<8>(isa, x, w, inner, out, to),
        (Isa::Avx512, _) => sweep::<4>(isa, x, w, inner, out, to),
        (_, 1..=2) => sweep::<4>(isa, x, w, inner, out, to),
        _ => sweep::<2>(isa, x, w, inner, out, to),
    }
}

fn sweep<const J: usize>(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    inner: usize,
    out: &mut [f32],
    to: OutLayout,
) {
    let mut w_groups = w.chunks_exact(J * inner);
    for (g, wg) in (&mut w_groups).enumerate() {
        let ws: [&[f32]; J] = std::array::from_fn(|j| &wg[j * inner..(j + 1) * inner]);
        for (i, block) in x.chunks(ROW_BLOCK * inner).enumerate() {
            let o = &mut out[g * J * to.col..];
            dots_dispatch(isa, block, ws, o, to, i * ROW_BLOCK);
        }
    }
    let done = w.len() / inner - w_groups.remainder().len() / inner;
    for (j, w_row) in w_groups.remainder().chunks_exact(inner).enumerate() {
        for (i, block) in x.chunks(ROW_BLOCK * inner).enumerate() {
            let o = &mut out[(done + j) * to.col..];
            dots_dispatch(isa, block, [w_row], o, to, i * ROW_BLOCK);
        }
    }
}

/// Writes `out[j·to.col + (first + r)·to.row]` = row r of `block` · `ws[j]`.
#[inline(always)]
fn dots_dispatch<const J: usize>(
    isa: Isa,
    block: &[f32],
    ws: [&[f32]; J],
    out: &mut [f32],
    to: OutLayout,
    first: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` returns Avx512 only after detecting AVX-512F, AVX2 and FMA.
        Isa::Avx512 => unsafe { avx512::dots(block, ws, out, to, first) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        Isa::Avx2Fma => unsafe { avx2::dots(block, ws, out, to, first) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::dots(block, ws, out, to, first),
        _ => portable::dots(block, ws, out, to, first),
    }
}

/// A dot product with a fixed summation order (vectorisable by the compiler).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    portable::dot(a, b)
}

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`: x / sqrt(mean(x²) + eps) · weight.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// Rotary embedding in the rotate-half ("NeoX") layout, in place, on every head of one row.
/// `cos`/`sin` hold `head_dim / 2` values for the row's position.
pub fn rope_row(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (x1, x2) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

/// Shapes for one row's attention over its pass's cache.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Causal single-query attention of one row: `q` [heads·head_dim] against the first `len`
/// positions of `keys`/`values` ([positions × kv_heads·head_dim]); GQA maps head h to kv head
/// h / (heads / kv_heads). `scores` is scratch space.
pub fn attend_row(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    shape: AttnShape,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { avx2::attend_row(q, keys, values, len, shape, out, scores) },
        _ => portable::attend_row(q, keys, values, len, shape, out, scores),
    }
}

/// Numerically stable softmax, in place.
#[inline(always)]
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { avx2::exp_shifted(x, max) },
        _ => x.iter_mut().for_each(|v| *v = (*v - max).exp()),
    }
    let sum: f32 = x.iter().sum();
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// SiLU(gate) · up, element-wise, into `gate`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { avx2::silu_mul(gate, up) },
        _ => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        }
    }
}
