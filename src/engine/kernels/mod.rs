//! CPU kernels for the decode step: a small-M matmul that reads each weight row once for all
//! M rows, over weights in the type the checkpoint stores (f32, bf16 or f16: `weight_element`),
//! RMSNorm, rotary embedding, single-query attention over an f32 or f16 KV cache
//! (`kv_element`), SiLU, softmax. Called by `model::host` (the host step backend) and its
//! proposal head, and by the harness that times them; GPU devices use the device step's ops.
//!
//! Why a kernel of our own: candle's CPU matmul for 2–6 rows costs several times its 1-row
//! time, which erases SPEED's gain, whose premise is that a step of R rows costs about one
//! row's weight reads. Here every output element of row `m` is computed with the same
//! arithmetic whatever M is and however the work is split between threads, so a token's hidden
//! state does not depend on which other rows shared its step: speculative and baseline decoding
//! agree bit for bit.
//!
//! Weights as stored: at real size (Ouro-1.4B reads 2.5 GB of layer weights a pass) a step is
//! bound by memory, so bf16 weights are read as bf16, half an f32 copy's bytes. Every ISA
//! widens them to f32 in registers (exact), so its products have the bits of the f32 kernel
//! over the widened weights; AVX-512 BF16 instead multiplies bf16 pairs (`avx512_bf16`,
//! activations rounded to bf16), twice the multiply-adds an instruction, so that the extra rows
//! of a speculative step stay under the weight stream.
//!
//! `f16` is the same product with f16 weights, for `model::half_head`'s proposal
//! readouts, which need a bound on their error rather than these bits.
//!
//! AVX-512 runs the matmul where the CPU has it (measured faster than AVX2 for baseline and
//! SPEED decoding alike); everything else uses AVX2 + FMA.
//! On aarch64 the matmul is NEON's (`neon`), the rest the portable loops.
//!
//! # What else makes a step fast
//!
//! Each was measured in interleaved runs when it went in (the git log has the numbers):
//! - **Subnormals flushed to zero** during a step (`subnormals`): a trained model's activations
//!   go subnormal, and every vector op on one takes a microcode assist, many times its cost.
//! - **Keys and values in f16** (`kv_element`): the attention streams its pass's whole cache,
//!   the part of a step that grows with its rows, so half the bytes is half that time. Every
//!   row reads the same rounded entries, so batch invariance holds; `--kv-cache f32` keeps f32.
//! - **The cache in tiles** (`KvLayout::Tiles`: per pass, tiles of 64 positions, each every kv
//!   head's entries in turn): the attention walks it tile by tile, one contiguous stream the
//!   hardware prefetchers follow whatever the capacity; `attention` keeps the query and the
//!   output head in registers and scores 8 positions per block.
//! - **Proposal readouts through an f16 LM head** (`model::half_head`): readouts before pass R
//!   only steer speculation; a pass-R readout recomputes in f32 every logit within twice a
//!   proven error bound of the largest, so its choice is exactly the f32 head's.
//! - **A prefetch plan timed on the machine** (`prefetch`): whether the weights come from L3 or
//!   DRAM differs between machines, so the first model a process loads times prefetching into
//!   L1 only against also into L2, on its own steps, and keeps the faster.
//! - **Weights in one arena of huge pages** (`engine::memory`), each matrix 64-byte aligned, read
//!   from the files in their stored type; **activation buffers recycled**, not zeroed
//!   (`model::host_buffers`); **decode threads that spin** briefly between a step's kernels
//!   and then park (`pool`).
//!
//! Settings are values: each host model's [`Kernels`] holds its instruction set (checked
//! against the CPU when made, which every `unsafe` dispatch rests on), its prefetch plan and its
//! decode threads, so two models in one process never disturb each other.
//!
//! One file per role: this one holds [`Kernels`] and dispatches (the safe API), then
//! `portable`, `avx2`, `avx512`, `avx512_bf16`, `neon`, `f16` (the proposal head's matmul),
//! `weight_element` and `kv_element` (the stored types), `packed` (quantized rows
//! interleaved), `q8_0` and `q8_neon` (Q8_0), `q4_0` (Q4_0), `k_quants`, `k_quants_simd` and `q4k_simd` (Q4_K, Q6_K), `affine` and `affine_simd` (mlx's
//! 4- and 8-bit groups),
//! `pool` (the decode threads), `prefetch`, `attention` and `subnormals` (the FTZ/DAZ guard).

/// Evaluates `$call` with the constant `$r` equal to `$rows` (1–6; more count as 6), so that
/// a kernel's loops over its rows unroll and every accumulator stays in a register: the one
/// dispatch on a row count that the x86 matmuls and the f16 head share. Defined above the
/// `mod` lines so that those modules see it.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
macro_rules! with_rows {
    ($rows:expr, $r:ident => $call:expr) => {
        match $rows {
            1 => {
                const $r: usize = 1;
                $call
            }
            2 => {
                const $r: usize = 2;
                $call
            }
            3 => {
                const $r: usize = 3;
                $call
            }
            4 => {
                const $r: usize = 4;
                $call
            }
            5 => {
                const $r: usize = 5;
                $call
            }
            _ => {
                const $r: usize = 6;
                $call
            }
        }
    };
}

/// Evaluates `$call` with `$w` bound to the typed slice inside the [`Weight`] `$weight`, or
/// `$qcall` with `$q` bound to its blocks where it is quantized: the one dispatch from a stored
/// element type to the generic kernels.
macro_rules! with_weight {
    ($weight:expr, $w:ident => $call:expr, $q:ident => $qcall:expr) => {
        match $weight {
            Weight::F32($w) => $call,
            Weight::Bf16($w) => $call,
            Weight::F16($w) => $call,
            Weight::Q8_0($q) => $qcall,
            Weight::Q4_0($q) => $qcall,
            Weight::Q4K($q) => $qcall,
            Weight::Q5K($q) => $qcall,
            Weight::Q6K($q) => $qcall,
            Weight::Affine($q) => $qcall,
        }
    };
}

mod act_quant;
mod affine;
#[cfg(target_arch = "aarch64")]
mod affine_neon;
#[cfg(target_arch = "x86_64")]
mod affine_simd;
#[cfg(test)]
mod affine_tests;
mod attention;
#[cfg(test)]
mod attention_tests;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_attention;
#[cfg(target_arch = "x86_64")]
mod avx512_bf16;
mod claims;
mod dense;
pub mod f16;
mod isa;
mod k_quants;
#[cfg(target_arch = "aarch64")]
mod k_quants_neon;
mod k_quants_simd;
#[cfg(test)]
mod k_quants_tests;
mod kv_element;
#[cfg(target_arch = "aarch64")]
mod neon;
mod packed;
pub mod pool;
mod portable;
pub mod prefetch;
mod q4_0;
mod q4k_simd;
mod q5k;
mod q8_0;
#[cfg(target_arch = "aarch64")]
mod q8_neon;
mod q8_rows;
#[cfg(test)]
mod q8_tests;
#[cfg(target_arch = "x86_64")]
mod q8_vnni;
mod settings;
mod shared_out;
mod subnormals;
#[cfg(test)]
mod tests;
mod weight_element;
#[cfg(test)]
mod weight_tests;

pub use affine::{
    AffineKind, AffineMatrix, pack as pack_affine, unpack as unpack_affine, weight as affine_weight,
};
pub use attention::{AttnShape, HeadSpan, KvLayout, KvStrides, KvView, Query, attend_row};
use claims::Claims;
use dense::matmul_t_serial;
pub use isa::{Isa, detected_isa};
use k_quants::KRows;
pub use k_quants::{
    BlockQ4K, BlockQ6K, GroupQ4K, GroupQ6K, KMatrix, KQuant, Q4K, Q6K, QK_K, RunQ6K,
};
pub use kv_element::KvElement;
pub use packed::{GROUP_ROWS, Interleave, Packed};
pub use prefetch::Prefetch;
pub use q4_0::{BlockQ4_0, BlockQ4_0x8, KindQ4_0, Q4Matrix};
pub use q5k::{BlockQ5K, GroupQ5K, Q5K};
pub use q8_0::{BlockQ8_0, BlockQ8_0x8, Blocks32, KindQ8_0, Q8Matrix, QK8_0};
use q8_0::{Q8Isa, QuantizedRows};
use settings::Tuning;
pub use settings::{KernelOptions, Kernels};
pub use shared_out::SharedOut;
pub use subnormals::SubnormalsFlushed;
pub use weight_element::{Matrix, QuantKind, Weight, WeightElement};

/// Weight matrices with at least this many elements are split across the decode threads
/// when `--threads` is above 1 (a hidden-256 projection has 65,536).
const POOL_MIN_ELEMENTS: usize = 1 << 14;
/// Weight rows a thread's share of a matmul is a multiple of (whole groups of every sweep).
const SHARE_ALIGN: usize = 16;

/// [`Kernels::gated_t`].
fn gated_t_on(
    k: &Kernels,
    input: Rows<'_>,
    gate_w: Weight<'_>,
    up_w: Weight<'_>,
    gate: &mut [f32],
    up: &mut [f32],
) {
    let Rows { x, rows, inner } = input;
    let pool = k.pool();
    if pool.threads() == 1 || gate_w.len() < POOL_MIN_ELEMENTS || up_w.len() != gate_w.len() {
        k.matmul_t(x, gate_w, rows, inner, gate);
        k.matmul_t(x, up_w, rows, inner, up);
        return k.silu_mul(gate, up);
    }
    let (parts, t, width) = (pool.threads(), k.tuning(rows), gate_w.len() / inner);
    let (gate, up) = (SharedOut::new(gate), SharedOut::new(up));
    let input = Input::new(t, input, &[gate_w, up_w]);
    let claims = Claims::new(width, parts, SHARE_ALIGN);
    pool.run(&|part| {
        while let Some(range) = claims.next(part) {
            for (w, out) in [(gate_w, gate), (up_w, up)] {
                product_columns(t, &input, w, out, range.clone());
            }
            for r in 0..rows {
                let at = r * width + range.start;
                silu_mul_shared(t.isa, gate.from(at), up.from(at), range.len());
            }
        }
    });
}

/// [`silu_mul`] on the first `len` elements of two shared outputs, through chunks on the
/// stack (the vector kernels need slices).
fn silu_mul_shared(isa: Isa, gate: SharedOut<'_>, up: SharedOut<'_>, len: usize) {
    const CHUNK: usize = 64;
    let (mut g, mut u) = ([0f32; CHUNK], [0f32; CHUNK]);
    for start in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - start);
        gate.from(start).get_all(&mut g[..n]);
        up.from(start).get_all(&mut u[..n]);
        silu_mul_on(isa, &mut g[..n], &u[..n]);
        gate.set_all(start, &g[..n]);
    }
}

/// Matmuls split across the decode threads by weight rows: each thread writes its own
/// columns of every output row in place (nothing is copied or allocated per job, which cost
/// steps of several rows a measurable share of their time).
fn matmul_t_pooled(
    pool: &pool::Pool,
    t: Tuning,
    input: Rows<'_>,
    products: &mut [(Weight<'_>, &mut [f32])],
) {
    let inner = input.inner;
    let parts = pool.threads();
    let outs: Vec<(Weight<'_>, SharedOut<'_>)> = (products.iter_mut())
        .map(|(w, out)| (*w, SharedOut::new(out)))
        .collect();
    let weights: Vec<Weight<'_>> = outs.iter().map(|(w, _)| *w).collect();
    let input = Input::new(t, input, &weights);
    let claims: Vec<Claims> = (outs.iter())
        .map(|(w, _)| Claims::new(w.len() / inner, parts, SHARE_ALIGN))
        .collect();
    pool.run(&|part| {
        for (&(w, out), claims) in outs.iter().zip(&claims) {
            while let Some(range) = claims.next(part) {
                product_columns(t, &input, w, out, range);
            }
        }
    });
}

/// A product's input rows and, where one of its weights is quantized, the same rows quantized
/// once for every thread and weight (`q8_0::QuantizedRows`, a buffer of the calling thread's
/// reused from call to call).
struct Input<'a> {
    rows: Rows<'a>,
    q8: QuantizedRows,
    qk: KRows,
    /// The rows reordered as 4-bit affine chunks are read (`affine::deinterleave`).
    nibble_order: Vec<f32>,
}

thread_local! {
    /// The calling thread's spare quantized-activation buffers.
    static SPARE_Q8: std::cell::Cell<(QuantizedRows, KRows, Vec<f32>)> = std::cell::Cell::default();
}

impl<'a> Input<'a> {
    fn new(t: Tuning, rows: Rows<'a>, weights: &[Weight<'_>]) -> Self {
        let (mut q8, mut qk, mut nibble_order) = SPARE_Q8.take();
        let isa = Q8Isa::for_isa(t.isa);
        if (weights.iter()).any(|w| matches!(w, Weight::Q8_0(_) | Weight::Q4_0(_))) {
            q8.quantize(isa, &rows);
        }
        if weights
            .iter()
            .any(|w| matches!(w, Weight::Q4K(_) | Weight::Q5K(_) | Weight::Q6K(_)))
        {
            let q6k = (weights.iter()).any(|w| matches!(w, Weight::Q6K(_)));
            qk.quantize(isa, &rows, q6k);
        }
        if (weights.iter()).any(|w| matches!(w, Weight::Affine(a) if a.kind().bits() == 4)) {
            affine::deinterleave(rows.x, &mut nibble_order);
        }
        Self {
            rows,
            q8,
            qk,
            nibble_order,
        }
    }
}

impl Drop for Input<'_> {
    fn drop(&mut self) {
        SPARE_Q8.set((
            std::mem::take(&mut self.q8),
            std::mem::take(&mut self.qk),
            std::mem::take(&mut self.nibble_order),
        ));
    }
}

/// One thread's share of `out = x · wᵀ` (`out: [rows × outs]`): the weight rows `range`, into
/// those columns of every row.
fn product_columns(
    t: Tuning,
    input: &Input<'_>,
    w: Weight<'_>,
    out: SharedOut<'_>,
    range: std::ops::Range<usize>,
) {
    let Rows { x, rows, inner } = input.rows;
    let to = OutLayout {
        col: 1,
        row: w.len() / inner,
    };
    let w = w.slice(range.start * inner..range.end * inner);
    let out = out.from(range.start);
    with_weight!(w,
        w => matmul_t_serial(t, x, w, rows, inner, out, to),
        q => q.product(t, input, out, to)
    );
}

/// A quantized matrix's product (`product_columns`): its block type's integer kernels over the
/// input's rows quantized for them.
trait QuantizedProduct {
    fn product(self, t: Tuning, input: &Input<'_>, out: SharedOut<'_>, to: OutLayout);
}

impl QuantizedProduct for Q8Matrix<'_> {
    fn product(self, t: Tuning, input: &Input<'_>, out: SharedOut<'_>, to: OutLayout) {
        q8_0::product(Q8Isa::for_isa(t.isa), t.prefetch, &input.q8, self, out, to);
    }
}

impl QuantizedProduct for Q4Matrix<'_> {
    fn product(self, t: Tuning, input: &Input<'_>, out: SharedOut<'_>, to: OutLayout) {
        q8_0::product(Q8Isa::for_isa(t.isa), t.prefetch, &input.q8, self, out, to);
    }
}

impl QuantizedProduct for AffineMatrix<'_> {
    fn product(self, t: Tuning, input: &Input<'_>, out: SharedOut<'_>, to: OutLayout) {
        let x = match self.kind().bits() {
            4 => &input.nibble_order,
            _ => input.rows.x,
        };
        affine::product(t.isa, x, self, out, to);
    }
}

impl<K: k_quants_simd::Groups> QuantizedProduct for KMatrix<'_, K> {
    fn product(self, t: Tuning, input: &Input<'_>, out: SharedOut<'_>, to: OutLayout) {
        k_quants::product(Q8Isa::for_isa(t.isa), t.prefetch, &input.qk, self, out, to);
    }
}

/// Rewrites `bytes`, `rows` rows of `blocks` blocks of `kind` as GGUF stores them, into the
/// kernels' layout in place (`packed`).
pub fn repack(kind: QuantKind, bytes: &mut [u8], rows: usize, blocks: usize) {
    match kind {
        QuantKind::Q8_0 => packed::repack::<KindQ8_0>(bytes, rows, blocks),
        QuantKind::Q4_0 => packed::repack::<KindQ4_0>(bytes, rows, blocks),
        QuantKind::Q4K => packed::repack::<Q4K>(bytes, rows, blocks),
        QuantKind::Q5K => packed::repack::<Q5K>(bytes, rows, blocks),
        QuantKind::Q6K => packed::repack::<Q6K>(bytes, rows, blocks),
    }
}

/// The first `N` rows of `stride` elements in `data`, as slices of `stride`. Written as a loop,
/// not `array::from_fn`: a closure made inside a `#[target_feature]` kernel takes on its
/// features, so `from_fn` (which has none) cannot inline it and is not inlined itself; the
/// call then handed the slices back through the stack, a store-forwarding stall every group.
#[inline(always)]
fn row_slices<T, const N: usize>(data: &[T], stride: usize) -> [&[T]; N] {
    let mut rows: [&[T]; N] = [&[]; N];
    for (i, row) in rows.iter_mut().enumerate() {
        *row = &data[i * stride..(i + 1) * stride];
    }
    rows
}

/// Where each of the first `N` rows of `stride` elements in `data` starts, for kernels that
/// address rows by pointer (a loop, as [`row_slices`] says why). A start past `data` is never
/// read: the kernels read rows their callers hold.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn row_starts<T, const N: usize>(data: &[T], stride: usize) -> [*const T; N] {
    let mut starts = [std::ptr::null(); N];
    for (i, start) in starts.iter_mut().enumerate() {
        *start = data.as_ptr().wrapping_add(i * stride);
    }
    starts
}

/// The input of a product: `rows` rows of `inner` floats, one after another in `x`.
#[derive(Debug, Clone, Copy)]
struct Rows<'a> {
    x: &'a [f32],
    rows: usize,
    inner: usize,
}

/// Where the kernels put the product of input row `r` and weight row `j`: `out[j·col + r·row]`
/// (row-major `[rows × outs]` is `col` 1, `row` outs; transposed is `col` rows, `row` 1).
#[derive(Debug, Clone, Copy)]
struct OutLayout {
    col: usize,
    row: usize,
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
        let mean_sq = sum_of_squares(xr) / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// Σ v² over `x` in one fixed order on every ISA: [`SUM_LANES`] partial sums (element i into
/// lane i mod `SUM_LANES`), the lanes halved pairwise, then the tail in order. A single running
/// sum is a chain of dependent adds, each waiting on the last (a norm that ran on the caller
/// thread four times per layer and row); partial sums are one vector register's adds, which
/// the compiler emits on any ISA without changing a bit (Rust never contracts to FMA).
fn sum_of_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; SUM_LANES];
    let chunks = x.chunks_exact(SUM_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += v * v;
        }
    }
    let mut width = SUM_LANES;
    while width > 1 {
        width /= 2;
        let (low, high) = lanes.split_at_mut(width);
        for (l, h) in low.iter_mut().zip(&*high) {
            *l += h;
        }
    }
    tail.iter().fold(lanes[0], |sum, v| sum + v * v)
}

/// Partial sums in [`sum_of_squares`]: one AVX-512 register, two AVX2 ones.
const SUM_LANES: usize = 16;

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

/// Numerically stable softmax, in place.
#[inline(always)]
pub fn softmax_in_place(x: &mut [f32]) {
    match detected_isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { avx2::softmax(x) },
        _ => portable::softmax(x),
    }
}

/// `Σ e^(x[i] − shift)`: a softmax's denominator for display (the probabilities in events),
/// through the vector exp where there is one (a scalar exp over a 4096-token vocabulary per
/// read-out row was a visible share of `spex generate`'s time). Decoding never depends on it.
pub fn sum_exp(x: &[f32], shift: f32) -> f32 {
    match detected_isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2` holds only after AVX2 and FMA were detected at run time.
        i if i.has_avx2() => unsafe { avx2::sum_exp(x, shift) },
        _ => x.iter().map(|&v| (v - shift).exp()).sum(),
    }
}

/// SiLU(gate) · up, element-wise, into `gate` (the CPU's best instruction set; a model's
/// `Kernels::silu_mul` runs its own).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    silu_mul_on(detected_isa(), gate, up);
}

/// [`silu_mul`] with the kernels of `isa`, which the CPU must run.
fn silu_mul_on(isa: Isa, gate: &mut [f32], up: &[f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is the detected ISA or one `Isa::checked` let through: with AVX2 the
        // CPU has FMA.
        i if i.has_avx2() => unsafe { avx2::silu_mul(gate, up) },
        _ => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        }
    }
}
