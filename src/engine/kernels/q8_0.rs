//! Q8_0 weights (GGUF's `block_q8_0`: 32 signed bytes and one f16 scale a block, 8.5 bits a
//! weight) multiplied as stored, with integer dot products. Called by the matmul dispatch
//! (`super::product_columns`) for [`Weight::Q8_0`](super::Weight) matrices, which a quantized
//! checkpoint's loader hands the host backend in `packed`'s layout.
//!
//! Why integers: at real size a bf16 step already streams its weights at the memory's pace, so
//! the next gain is fewer bytes; but on a stream half as thick, an f32 product over widened
//! weights no longer hides the extra rows of a speculative step under the weight reads (SPEED,
//! arXiv 2310.12072, §3: a step of R rows must cost about one row's weight reads). So, as
//! llama.cpp does, each activation row is quantized per block of 32 to 8 bits
//! ([`QuantizedRows`]), and a block's 32 products are integer multiply-adds.
//!
//! # Eight weight rows interleaved
//!
//! `packed::repack` lays each group of 8 weight rows out block by block ([`BlockQ8_0x8`]): the
//! 8 rows' scales, then their bytes 4 at a time, row after row. One 32-byte load then holds 4
//! bytes of each of the 8 rows, and one `vpdpbusd` (AVX-512 VNNI) of it with an activation's 4
//! bytes broadcast adds 4 products into each row's lane: 8 of them make each lane a whole
//! block's integer sum, and one FMA a block scales 8 outputs. Without the layout every block's
//! lanes had to be scaled apart (8 lanes of 4 products each), which left a 4-row step
//! computing twice as long as a 1-row step read its weights. (llama.cpp's CPU backend repacks
//! Q8_0 alike.) The layout keeps the rows' bytes, each offset by 128 to an unsigned byte:
//! `vpdpbusd` takes one operand unsigned, and with the weights as that operand the offset's
//! product `128 · Σx` is the activations' (once a row and block for every weight row), not
//! each weight block's (once a block, paid again at every step).
//!
//! # One result on every ISA
//!
//! The product of activation row `r` and weight row `j` is defined as
//! `acc = fma(isum(b), dw(b) · dx(b), acc)` over the blocks `b` in order, from 0, where
//! `isum(b)` is the block's exact integer sum of its 32 products and `dw`, `dx` are the
//! weight's and the activation's block scales. The integer part is exact on any ISA and the
//! float part is one sequence of roundings, so the portable loops, AVX2 and AVX-512 VNNI agree
//! bit for bit (the tests hold them to it), and a row's result depends on nothing but its own
//! inputs: not on the other rows of its step, nor on how the threads split the weight rows.
//! Speculative output on quantized weights therefore equals the baseline's, token for token.

use half::f16;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::act_quant::block_scale;
use super::packed::{GROUP_ROWS, Interleave, Located, Packed};
pub(super) use super::q8_rows::{QuantRowsView, QuantizedRows};
use super::weight_element::QuantKind;
use super::{OutLayout, Prefetch, SharedOut};

/// Weights a Q8_0 block holds.
pub const QK8_0: usize = 32;

/// GGUF's `block_q8_0`: `qs[i] · d` is weight `i` of the block.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ8_0 {
    /// The block's scale.
    pub d: f16,
    /// The quantized weights.
    pub qs: [i8; QK8_0],
}

/// One block of each of 8 weight rows, interleaved ([`KindQ8_0::pack`]): `d[j]` is row `j`'s
/// scale and `qu[32k + 4j + t]` its weight `4k + t` plus 128, unsigned: `vpdpbusd`'s unsigned
/// operand as stored, the activations its signed one.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ8_0x8 {
    /// The 8 rows' scales.
    pub d: [f16; GROUP_ROWS],
    /// Their weights plus 128, 4 bytes of each row in turn.
    pub qu: [u8; QK8_0 * GROUP_ROWS],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ8_0x8>() == 8 * 34);

// SAFETY: `repr(C)` of an f16 (2 bytes, align 2) and 32 i8 at offset 2: 34 bytes, no padding,
// and every bit pattern is a valid f16 and i8.
unsafe impl bytemuck::Zeroable for BlockQ8_0 {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for BlockQ8_0 {}
// SAFETY: `repr(C)` of 8 f16 (16 bytes, align 2) and 256 u8 at offset 16: 272 bytes, no
// padding, every bit pattern valid.
unsafe impl bytemuck::Zeroable for BlockQ8_0x8 {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for BlockQ8_0x8 {}

impl BlockQ8_0 {
    /// The block nearest `x` (32 floats), as llama.cpp's `quantize_row_q8_0_ref` makes it:
    /// `d = max|x| / 127` in f32, stored in f16, and each weight `round(x / d)` (half away
    /// from zero) with the unrounded f32 reciprocal.
    pub fn quantize(x: &[f32]) -> Self {
        let (d, id) = block_scale(x);
        let mut qs = [0i8; QK8_0];
        for (q, v) in qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        Self {
            d: f16::from_f32(d),
            qs,
        }
    }

    /// Its 32 weights in f32 (exact: an f16 times a byte has at most 19 significant bits).
    pub fn dequantize_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, q) in out.iter_mut().zip(self.qs) {
            *o = f32::from(q) * d;
        }
    }
}

/// GGUF's Q8_0 as [`Interleave`]s it: [`BlockQ8_0`]s in [`BlockQ8_0x8`] groups.
#[derive(Debug, Clone, Copy)]
pub struct KindQ8_0;

impl Interleave for KindQ8_0 {
    const KIND: QuantKind = QuantKind::Q8_0;
    type Block = BlockQ8_0;
    type Group = BlockQ8_0x8;

    fn pack(rows: &[BlockQ8_0; GROUP_ROWS]) -> BlockQ8_0x8 {
        let mut item = BlockQ8_0x8 {
            d: [f16::ZERO; GROUP_ROWS],
            qu: [0; QK8_0 * GROUP_ROWS],
        };
        for (j, b) in rows.iter().enumerate() {
            item.d[j] = b.d;
            for k4 in 0..QK8_0 / 4 {
                let at = 32 * k4 + 4 * j;
                for t in 0..4 {
                    item.qu[at + t] = (b.qs[4 * k4 + t] as u8) ^ 0x80;
                }
            }
        }
        item
    }
}

/// A Q8_0 matrix in the kernels' layout (`packed`).
pub type Q8Matrix<'a> = Packed<'a, KindQ8_0>;

/// A block type of 32 weights that the one definition (module docs) multiplies against
/// `QuantizedRows`: Q8_0, and Q4_0 (`q4_0`), whose weights are its nibbles less 8.
pub trait Blocks32: Interleave {
    /// Row `j`'s scale and 32 weights in a group's block.
    fn group_row(item: &Self::Group, j: usize) -> (f16, [i8; QK8_0]);
    /// A block's scale and 32 weights as stored.
    fn block_row(b: &Self::Block) -> (f16, [i8; QK8_0]);
}

impl Blocks32 for KindQ8_0 {
    fn group_row(item: &BlockQ8_0x8, j: usize) -> (f16, [i8; QK8_0]) {
        let mut qs = [0i8; QK8_0];
        for (k4, four) in qs.chunks_exact_mut(4).enumerate() {
            let at = 32 * k4 + 4 * j;
            for (q, &u) in four.iter_mut().zip(&item.qu[at..at + 4]) {
                *q = (u ^ 0x80) as i8;
            }
        }
        (item.d[j], qs)
    }

    fn block_row(b: &BlockQ8_0) -> (f16, [i8; QK8_0]) {
        (b.d, b.qs)
    }
}

impl<K: Blocks32> Packed<'_, K> {
    /// Row `row`'s block `k`: its scale and its 32 weights.
    pub fn block(self, row: usize, k: usize) -> (f16, [i8; QK8_0]) {
        match self.locate(row, k) {
            Located::Tail(b) => K::block_row(b),
            Located::Group(item, j) => K::group_row(item, j),
        }
    }

    /// Elements `range`, widened to f32: each weight times its block's scale (exact).
    pub fn widen_into(self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let inner = self.inner();
        for row in range.start / inner..range.end.div_ceil(inner) {
            for k in 0..self.blocks {
                let (d, qs) = self.block(row, k);
                let at = row * inner + k * QK8_0;
                let (lo, hi) = (range.start.max(at), range.end.min(at + QK8_0));
                let d = d.to_f32();
                out.extend(
                    qs[lo.saturating_sub(at)..hi.saturating_sub(at)]
                        .iter()
                        .map(|&q| f32::from(q) * d),
                );
            }
        }
    }
}

/// A group of 8 rows' blocks that this architecture's shared kernels take: VNNI's
/// (`q8_vnni`) on x86, `sdot`'s (`q8_neon`) on aarch64.
#[cfg(target_arch = "x86_64")]
pub(super) trait SimdGroup: super::q8_vnni::VnniGroup {}
#[cfg(target_arch = "x86_64")]
impl<G: super::q8_vnni::VnniGroup> SimdGroup for G {}
#[cfg(target_arch = "aarch64")]
pub(super) trait SimdGroup: super::q8_neon::SdotGroup {}
#[cfg(target_arch = "aarch64")]
impl<G: super::q8_neon::SdotGroup> SimdGroup for G {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub(super) trait SimdGroup {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
impl<G> SimdGroup for G {}

/// [`Blocks32`]'s vector kernels ([`groups_dispatch`]): the shared VNNI and `sdot` ones through
/// [`SimdGroup`], and the one that differs by block type, AVX2's.
pub(super) trait Groups32: Blocks32<Group: SimdGroup> {
    /// AVX2's products of `R` rows and every group of `groups`, into `out` as [`product`] lays
    /// it (`first`: the block's first row).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `xs` holds `R` rows of `xs.blocks` blocks and
    /// `groups` whole groups of as many.
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_groups<const R: usize>(
        plan: Prefetch,
        xs: QuantRowsView<'_>,
        groups: &[Self::Group],
        out: SharedOut<'_>,
        to: OutLayout,
        first: usize,
    );
}

/// Rows a kernel call takes at most: their accumulators and the group's 8 weight vectors stay
/// in registers (AVX2's 16 also hold the weights' magnitudes; AVX-512's 32 take a `dual`
/// step's 5 rows and a sixth in one block).
fn row_block(isa: Q8Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Q8Isa::Avx512Vnni => 6,
        _ => 4,
    }
}

/// Which kernel runs: chosen once per product from the model's instruction set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Q8Isa {
    /// Plain loops with `f32::mul_add`.
    Portable,
    /// AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 VNNI on 256-bit registers (with AVX-512VL), AVX2 + FMA + F16C besides.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// NEON with the dot-product extension (`sdot`, `q8_neon`).
    #[cfg(target_arch = "aarch64")]
    NeonDot,
}

impl Q8Isa {
    /// The kernel for `isa` on this CPU (VNNI where detected beside AVX-512).
    pub(super) fn for_isa(isa: super::Isa) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if isa.has_avx512()
                && std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Self::Avx512Vnni;
            }
            if isa.has_avx2() {
                return Self::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        if isa == super::Isa::Neon && std::arch::is_aarch64_feature_detected!("dotprod") {
            return Self::NeonDot;
        }
        let _ = isa;
        Self::Portable
    }
}

/// `out[j·to.col + r·to.row]` = activation row `r` of `x` · weight row `j` of `w`, for every
/// row and weight row: in runs of weight groups, each run times every block of up to
/// [`row_block`] rows; the tail rows by the portable loops.
pub(super) fn product<K: Groups32>(
    isa: Q8Isa,
    plan: Prefetch,
    x: &QuantizedRows,
    w: Packed<'_, K>,
    out: SharedOut<'_>,
    to: OutLayout,
) {
    let rows = x.len();
    w.runs_by_rows(rows, row_block(isa), |start, run, range| {
        let at = out.from(start * GROUP_ROWS * to.col);
        groups_dispatch::<K>(isa, plan, x.rows(range.clone()), run, at, to, range.start);
    });
    let tail_out = out.from(w.grouped_rows() * to.col);
    portable_rows::<K>(x.rows(0..rows), w.tail, tail_out, to);
}

impl Groups32 for KindQ8_0 {
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_groups<const R: usize>(
        plan: Prefetch,
        xs: QuantRowsView<'_>,
        groups: &[BlockQ8_0x8],
        out: SharedOut<'_>,
        to: OutLayout,
        first: usize,
    ) {
        // SAFETY: the caller's.
        unsafe { avx2_groups::<R>(plan, xs, groups, out, to, first) }
    }
}

/// `K`'s block of rows times every group of `groups`, on `isa`'s kernels.
fn groups_dispatch<K: Groups32>(
    isa: Q8Isa,
    plan: Prefetch,
    xs: QuantRowsView<'_>,
    groups: &[K::Group],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let _ = plan; // The portable loops leave prefetching to the hardware.
    match isa {
        Q8Isa::Portable => portable_groups::<K>(xs, groups, out, to, first),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Q8Isa::Avx2` is made only where the model's instruction set has AVX2, FMA
        // and F16C (`Kernels::new` checked the CPU); `xs` holds whole rows of blocks and
        // `groups` whole groups of as many.
        Q8Isa::Avx2 => unsafe {
            with_rows!(xs.rows(), R => K::avx2_groups::<R>(plan, xs, groups, out, to, first))
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Q8Isa::Avx512Vnni` is made only where AVX-512 (F, BW, VL) was checked and
        // VNNI detected; as above otherwise.
        Q8Isa::Avx512Vnni => unsafe {
            with_rows!(xs.rows(), R => super::q8_vnni::groups::<_, R>(plan, xs, groups, out, to, first))
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: `Q8Isa::NeonDot` is made only where the dot-product extension was detected;
        // `xs` holds whole rows of blocks and `groups` whole groups of as many.
        Q8Isa::NeonDot => unsafe { super::q8_neon::sdot_groups(xs, groups, out, to, first) },
    }
}

/// The one definition (module docs) for activation row `x` (`xs`' row `r`) and one weight
/// row's blocks, each given by `block(k)`.
#[inline(always)]
fn portable_dot(
    xs: QuantRowsView<'_>,
    r: usize,
    block: impl Fn(usize) -> (f16, [i8; QK8_0]),
) -> f32 {
    let b = xs.blocks;
    let mut acc = 0f32;
    for k in 0..b {
        let (d, qs) = block(k);
        let xq = &xs.qs[(r * b + k) * QK8_0..(r * b + k + 1) * QK8_0];
        let isum: i32 = qs
            .iter()
            .zip(xq)
            .map(|(&w, &x)| i32::from(w) * i32::from(x))
            .sum();
        acc = (isum as f32).mul_add(d.to_f32() * xs.scales[r * b + k], acc);
    }
    acc
}

/// The portable loops over whole groups.
fn portable_groups<K: Blocks32>(
    xs: QuantRowsView<'_>,
    groups: &[K::Group],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks.max(1);
    let m = Packed::<K> {
        groups,
        tail: &[],
        blocks: b,
    };
    for row in 0..m.rows() {
        for r in 0..xs.rows() {
            let sum = portable_dot(xs, r, |k| m.block(row, k));
            out.set(row * to.col + (first + r) * to.row, sum);
        }
    }
}

/// The portable loops over rows as stored (a matrix's tail).
fn portable_rows<K: Blocks32>(
    xs: QuantRowsView<'_>,
    rows: &[K::Block],
    out: SharedOut<'_>,
    to: OutLayout,
) {
    let b = xs.blocks.max(1);
    for (j, w_row) in rows.chunks_exact(b).enumerate() {
        for r in 0..xs.rows() {
            let sum = portable_dot(xs, r, |k| K::block_row(&w_row[k]));
            out.set(j * to.col + r * to.row, sum);
        }
    }
}

/// Prefetches the weight stream at `item` `plan`'s distances ahead, into L1 and L2, every line
/// of a group's block (a prefetch never faults, even past the end). Shared by every quantized
/// kernel (`k_quants_simd`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch<T>(plan: Prefetch, item: &T) {
    let at = (item as *const T).cast::<i8>();
    if plan == Prefetch::NONE {
        return;
    }
    for line in (0..std::mem::size_of::<T>()).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe {
            if plan.near_bytes > 0 {
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(plan.near_bytes + line));
            }
            if plan.far_bytes > 0 {
                _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(plan.far_bytes + line));
            }
        }
    }
}

/// The 8 rows' scales of a group's block, widened.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn scales8(d: &[f16; GROUP_ROWS]) -> __m256 {
    // SAFETY: the caller's features; `d` is 16 bytes.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().cast())) }
}

/// Four activation bytes at `p`, broadcast to every 32-bit lane: `vbroadcastss` from memory,
/// a load alone (a scalar load and `vpbroadcastd` from a general register would take the one
/// port that moves integers into vectors, 8 times a block and row).
///
/// # Safety
/// Four bytes must be readable at `p`; the CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn broadcast4<T>(p: *const T) -> __m256i {
    // SAFETY: the caller's bounds; `vbroadcastss` has no alignment requirement.
    unsafe { _mm256_castps_si256(_mm256_broadcast_ss(&*p.cast::<f32>())) }
}

/// Stores 8 outputs (a group's rows) of activation row `row`.
///
/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn store8(acc: __m256, out: SharedOut<'_>, to: OutLayout, row: usize) {
    let mut sums = [0f32; GROUP_ROWS];
    // SAFETY: the caller's features; `sums` holds 8 floats.
    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), acc) };
    for (j, s) in sums.into_iter().enumerate() {
        out.set(j * to.col + row * to.row, s);
    }
}

/// AVX2's products of the one definition: per group block and row, 8 × (`|w| · sign(x, w)`
/// with `vpmaddubsw`, no pair overflowing as 128 · 127 · 2 < 2¹⁵, then `vpmaddwd` by ones)
/// summed into each weight row's lane (the weights' offset of 128 undone once a block).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `xs` holds `R` rows of `xs.blocks` blocks and
/// `groups` whole groups of as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_groups<const R: usize>(
    plan: Prefetch,
    xs: QuantRowsView<'_>,
    groups: &[BlockQ8_0x8],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    let (ones, offset) = (_mm256_set1_epi16(1), _mm256_set1_epi8(i8::MIN));
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, item) in group.iter().enumerate() {
            prefetch(plan, item);
            let mut wq = [_mm256_setzero_si256(); 8];
            let mut aw = [_mm256_setzero_si256(); 8];
            for (k4, (w, a)) in wq.iter_mut().zip(&mut aw).enumerate() {
                // SAFETY: the features; the block's 256 bytes are readable.
                let stored = unsafe { _mm256_loadu_si256(item.qu.as_ptr().add(32 * k4).cast()) };
                *w = _mm256_xor_si256(stored, offset);
                *a = _mm256_sign_epi8(*w, *w);
            }
            // SAFETY: the features.
            let dw = unsafe { scales8(&item.d) };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xp = xs.qs[(r * b + k) * QK8_0..].as_ptr();
                let mut isum = _mm256_setzero_si256();
                for k4 in 0..8 {
                    // SAFETY: row `r` holds block `k`'s 32 bytes at `xp`.
                    let x4 = unsafe { broadcast4(xp.add(4 * k4)) };
                    let pairs = _mm256_maddubs_epi16(aw[k4], _mm256_sign_epi8(x4, wq[k4]));
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
                }
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xs.scales[r * b + k]));
                *acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc_r);
            }
        }
        let at = out.from(g * GROUP_ROWS * to.col);
        for (r, a) in acc.into_iter().enumerate() {
            // SAFETY: the features.
            unsafe { store8(a, at, to, first + r) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl super::q8_vnni::VnniGroup for BlockQ8_0x8 {
    const SHIFT: u32 = 4;

    fn scales(&self) -> &[f16; GROUP_ROWS] {
        &self.d
    }

    #[inline(always)]
    unsafe fn weights(&self) -> [__m256i; 8] {
        // SAFETY: the caller's feature; the block's 256 bytes are readable.
        std::array::from_fn(|k4| unsafe {
            _mm256_loadu_si256(self.qu.as_ptr().add(32 * k4).cast())
        })
    }
}
