//! K-quant weights (GGUF's `block_q4_K`, `block_q5_K` and `block_q6_K`, the types Q4_K_M,
//! Q4_K_S and Q5_K_M files hold: super-blocks of 256 weights with 6- or 8-bit sub-block
//! scales, 4.5, 5.5 and 6.56 bits a weight) multiplied as stored, with integer dot products.
//! Called by the matmul dispatch (`super::product_columns`) for [`Weight::Q4K`](super::Weight),
//! [`Weight::Q5K`](super::Weight) and [`Weight::Q6K`](super::Weight) matrices, in `packed`'s
//! layout ([`GroupQ4K`], [`GroupQ5K`](super::GroupQ5K), [`GroupQ6K`]).
//!
//! Why integers: as for Q8_0 (`q8_0`), a stream 3× thinner than bf16 leaves no room for f32
//! arithmetic over R rows under the weight reads (SPEED, arXiv 2310.12072, §3). Each
//! activation row is quantized per super-block of 256 to 8 bits with the sums of its 16-value
//! runs ([`KRows`], llama.cpp's `block_q8_K`), so a super-block's products and its sub-block
//! scales are all integer arithmetic and only one or two FMAs a super-block are float.
//!
//! # One result on every ISA
//!
//! For activation row `r` (scale `dx`, values `x`, 16- and 32-value sums `sum16`, `sum32`) and
//! one weight row, over the super-blocks in order from `acc = 0`:
//! - **Q4_K and Q5_K** (weights `d·sc[s]·q − dmin·m[s]`, `q` in 0..16 or 0..32, 8 sub-blocks
//!   of 32): `isum = Σₛ sc[s]·Σᵢ q·x`, `msum = Σₛ m[s]·sum32[s]`, then
//!   `acc = fma(isum, d·dx, acc)` and `acc = fma(msum, dmin·(−dx), acc)`.
//! - **Q6_K** (weights `d·sc[s]·(q − 32)`, `q` in 0..64, 16 sub-blocks of 16):
//!   `isum = Σₛ sc[s]·(Σᵢ q·x − 32·sum16[s])`, then `acc = fma(isum, d·dx, acc)`.
//!
//! The sums are exact integers on any ISA (the bounds are under 2³¹: 8·63·32·31·127 for Q5_K,
//! 16·128·16·32·127 for Q6_K) and the float part is one sequence of roundings, so the portable
//! loops and every vector kernel agree bit for bit, and a row's result depends on nothing but
//! its own inputs: speculative output on these weights equals the baseline's.

use half::f16;

use super::act_quant::{block_scale, push_rounded};
use super::packed::{GROUP_ROWS, Interleave, Located, Packed};
use super::q8_0::Q8Isa;
use super::weight_element::QuantKind;
use super::{OutLayout, Prefetch, Rows, SharedOut};

/// Weights a K-quant super-block holds.
pub const QK_K: usize = 256;

/// GGUF's `block_q4_K`: 8 sub-blocks of 32 weights `d·sc·q − dmin·m`, their 6-bit scales and
/// mins packed in `scales` (llama.cpp's `get_scale_min_k4`), `q` 4 bits in `qs`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4K {
    /// The scales' scale.
    pub d: f16,
    /// The mins' scale.
    pub dmin: f16,
    /// 8 scales and 8 mins, 6 bits each.
    pub scales: [u8; 12],
    /// Weight `64c + l` is `qs[32c + l]`'s low nibble for `l < 32`, else `qs[32c + l − 32]`'s
    /// high one.
    pub qs: [u8; QK_K / 2],
}

/// GGUF's `block_q6_K`: 16 sub-blocks of 16 weights `d·sc·(q − 32)`, `q`'s low 4 bits in `ql`
/// and high 2 in `qh` (llama.cpp's `dequantize_row_q6_K` order).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ6K {
    /// The weights' low 4 bits.
    pub ql: [u8; QK_K / 2],
    /// Their high 2 bits.
    pub qh: [u8; QK_K / 4],
    /// The sub-blocks' scales.
    pub scales: [i8; QK_K / 16],
    /// The scales' scale.
    pub d: f16,
}

/// One Q4_K super-block of each of 8 rows, interleaved for 64-byte vectors (`q4k_simd`). Row
/// `j`'s sub-block `s` has its scale and min at entry `q4k_entry(j, s)` of `scales`: their
/// low 4 bits in byte `e` (the scale's low), their high 2 bits in nibble `e / 32` of byte
/// `64 + e % 32` (the scale's low). Byte `128s + 64(n / 8) + 8j + n % 8` of `qs` holds weight
/// `32s + n` (low nibble) and `32s + 16 + n` (high), for `n < 16`: each 64 bytes hold 8 weights
/// of each row, a 4-byte lane per row and half.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupQ4K {
    /// The rows' `d`.
    pub d: [f16; GROUP_ROWS],
    /// The rows' `dmin`.
    pub dmin: [f16; GROUP_ROWS],
    /// Scales and mins.
    pub scales: [u8; 96],
    /// The weights.
    pub qs: [u8; QK_K / 2 * GROUP_ROWS],
}

/// Row `j`'s sub-block `s` scale and min in a [`GroupQ4K`].
pub fn q4k_scale_min(g: &GroupQ4K, j: usize, s: usize) -> (u8, u8) {
    let e = q4k_entry(j, s);
    let (lo, hi) = (g.scales[e], g.scales[64 + e % 32] >> (4 * (e / 32)));
    ((lo & 15) | (hi & 3) << 4, (lo >> 4) | ((hi >> 2) & 3) << 4)
}

/// The entry of row `j`'s sub-block `s` in a [`GroupQ4K`]'s scales: a 16-entry run for each
/// pair of rows, in it a 4-entry run for each pair of sub-blocks, sub-block parity then row
/// parity, the order in which `q4k_simd`'s packed sub-block sums lie.
pub const fn q4k_entry(j: usize, s: usize) -> usize {
    16 * (j / 2) + 4 * (s / 2) + 2 * (s % 2) + j % 2
}

/// One Q6_K super-block of each of 8 rows, interleaved for 64-byte vectors (`k_quants_simd`).
/// Sub-block `s`, row `j`: its scale is `scales[s][j]`; byte `8j + i` of [`low(s)`](Self::low)
/// holds the low 4 bits of weights `16s + i` (low nibble) and `16s + 8 + i` (high), for
/// `i < 8`; byte `8j + i` of [`high(p)`](Self::high) the high 2 bits of sub-block `2p`'s
/// weights `i` and `8 + i` (bits 0 and 2) and of sub-block `2p + 1`'s (bits 4 and 6). Each 64
/// bytes hold 8 weights of each row, a 4-byte lane per row and half, as Q4_K's layout.
///
/// A pair of sub-blocks' low and high bits lie together ([`RunQ6K`]), so a kernel reads the
/// group as one ascending stream, which the CPU's prefetchers follow. With all the high bits a
/// kilobyte after all the low bits, two streams in one page, they may not: a one-row product
/// then waits on memory line by line.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupQ6K {
    /// The rows' `d`.
    pub d: [f16; GROUP_ROWS],
    /// The scales, by sub-block.
    pub scales: [[i8; GROUP_ROWS]; 16],
    /// The weights' bits, by pair of sub-blocks.
    pub runs: [RunQ6K; 8],
}

/// A pair of sub-blocks' weight bits in a [`GroupQ6K`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunQ6K {
    /// The low 4 bits of sub-blocks `2p` and `2p + 1`.
    pub low: [[u8; 64]; 2],
    /// Their high 2 bits.
    pub high: [u8; 64],
}

impl GroupQ6K {
    /// Sub-block `s`'s low 4 bits.
    pub fn low(&self, s: usize) -> &[u8; 64] {
        &self.runs[s / 2].low[s % 2]
    }

    /// Sub-blocks `2p`'s and `2p + 1`'s high 2 bits.
    pub fn high(&self, p: usize) -> &[u8; 64] {
        &self.runs[p].high
    }
}

const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);
const _: () = assert!(std::mem::size_of::<GroupQ4K>() == 8 * 144);
const _: () = assert!(std::mem::size_of::<RunQ6K>() == 192);
const _: () = assert!(std::mem::size_of::<GroupQ6K>() == 8 * 210);

// Each block and group is a `repr(C)` struct of f16s (align 2) and byte arrays, whose sizes
// the asserts above show add up with no padding; every bit pattern is a valid f16, u8 and i8;
// all are `Copy` and `'static`.
// SAFETY: above.
unsafe impl bytemuck::Zeroable for BlockQ4K {}
// SAFETY: above.
unsafe impl bytemuck::Pod for BlockQ4K {}
// SAFETY: above.
unsafe impl bytemuck::Zeroable for BlockQ6K {}
// SAFETY: above.
unsafe impl bytemuck::Pod for BlockQ6K {}
// SAFETY: above.
unsafe impl bytemuck::Zeroable for GroupQ4K {}
// SAFETY: above.
unsafe impl bytemuck::Pod for GroupQ4K {}
// SAFETY: above.
unsafe impl bytemuck::Zeroable for GroupQ6K {}
// SAFETY: above.
unsafe impl bytemuck::Pod for GroupQ6K {}

/// A super-block's integers, unpacked: what the one definition and dequantization read.
#[derive(Debug, Clone, Copy)]
pub struct Decoded {
    /// The scales' scale.
    pub d: f16,
    /// The mins' scale (Q4_K; zero for Q6_K).
    pub dmin: f16,
    /// Each 16-weight run's scale (a Q4_K sub-block's twice).
    pub sc: [i32; 16],
    /// Each Q4_K sub-block's min (zero for Q6_K).
    pub m: [i32; 8],
    /// The weights' integers, unsigned.
    pub q: [u8; QK_K],
}

impl Decoded {
    /// A super-block with these scales' scales and every integer zero.
    fn new(d: f16, dmin: f16) -> Self {
        Self {
            d,
            dmin,
            sc: [0; 16],
            m: [0; 8],
            q: [0; QK_K],
        }
    }
}

/// A K-quant type: its blocks, their group and the one definition's integers.
pub trait KQuant: Interleave {
    /// A stored block's integers.
    fn decode(b: &Self::Block) -> Decoded;
    /// Row `j`'s integers of a group.
    fn decode_row(g: &Self::Group, j: usize) -> Decoded;

    /// The block's weights in f32, as llama.cpp's `dequantize_row_*` computes them.
    fn dequantize(b: &Decoded, out: &mut [f32]);

    /// One super-block's step of the one definition (module docs): `acc` after it.
    fn step(b: &Decoded, x: KBlock<'_>, acc: f32) -> f32;
}

/// Q4_K's marker.
#[derive(Debug, Clone, Copy)]
pub struct Q4K;
/// Q6_K's marker.
#[derive(Debug, Clone, Copy)]
pub struct Q6K;

/// llama.cpp's `get_scale_min_k4`: sub-block `j`'s 6-bit scale and min.
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The exact integer dot product of `q` and `x`.
#[inline(always)]
fn idot(q: &[u8], x: &[i8]) -> i32 {
    q.iter()
        .zip(x)
        .map(|(&q, &x)| i32::from(q) * i32::from(x))
        .sum()
}

impl Interleave for Q4K {
    const KIND: QuantKind = QuantKind::Q4K;
    type Block = BlockQ4K;
    type Group = GroupQ4K;

    fn pack(rows: &[BlockQ4K; GROUP_ROWS]) -> GroupQ4K {
        let mut g: GroupQ4K = bytemuck::Zeroable::zeroed();
        for (j, b) in rows.iter().enumerate() {
            pack_q4k_row(&mut g, j, &Self::decode(b));
        }
        g
    }
}

/// Puts a super-block's scales, mins and the low 4 bits of its integers into row `j` of a
/// [`GroupQ4K`] (Q4_K's whole integers; Q5_K's low bits, `q5k` adding the fifth).
pub(super) fn pack_q4k_row(g: &mut GroupQ4K, j: usize, u: &Decoded) {
    (g.d[j], g.dmin[j]) = (u.d, u.dmin);
    for s in 0..8 {
        let (sc, m) = (u.sc[2 * s] as u8, u.m[s] as u8);
        let e = q4k_entry(j, s);
        g.scales[e] = (sc & 15) | (m & 15) << 4;
        g.scales[64 + e % 32] |= ((sc >> 4) | (m >> 4) << 2) << (4 * (e / 32));
        for n in 0..16 {
            let w = 32 * s + n;
            g.qs[q4k_byte(j, s, n)] = (u.q[w] & 15) | (u.q[w + 16] & 15) << 4;
        }
    }
}

/// The byte of a [`GroupQ4K`]'s `qs` holding row `j`'s weights `32s + n` (low nibble) and
/// `32s + 16 + n` (high), for `n < 16`.
pub(super) const fn q4k_byte(j: usize, s: usize, n: usize) -> usize {
    128 * s + 64 * (n / 8) + 8 * j + n % 8
}

impl KQuant for Q4K {
    fn decode(b: &BlockQ4K) -> Decoded {
        let mut u = Decoded::new(b.d, b.dmin);
        for s in 0..8 {
            let (sc, m) = scale_min_k4(s, &b.scales);
            (u.sc[2 * s], u.sc[2 * s + 1], u.m[s]) = (sc.into(), sc.into(), m.into());
        }
        // Each 32 bytes hold 64 weights: the first 32 in their low nibbles, the next in the
        // high. (Loops over whole runs, not an index per weight: they vectorize, and loading
        // a file decodes every block.)
        for (q, qs) in u.q.chunks_exact_mut(64).zip(b.qs.chunks_exact(32)) {
            let (low, high) = q.split_at_mut(32);
            for ((low, high), &byte) in low.iter_mut().zip(high).zip(qs) {
                (*low, *high) = (byte & 0xF, byte >> 4);
            }
        }
        u
    }

    fn decode_row(g: &GroupQ4K, j: usize) -> Decoded {
        let mut u = Decoded::new(g.d[j], g.dmin[j]);
        for s in 0..8 {
            let (sc, m) = q4k_scale_min(g, j, s);
            (u.sc[2 * s], u.sc[2 * s + 1]) = (sc.into(), sc.into());
            u.m[s] = m.into();
            for n in 0..16 {
                let byte = g.qs[q4k_byte(j, s, n)];
                (u.q[32 * s + n], u.q[32 * s + 16 + n]) = (byte & 0xF, byte >> 4);
            }
        }
        u
    }

    fn dequantize(b: &Decoded, out: &mut [f32]) {
        dequantize_with_mins(b, out);
    }

    #[inline(always)]
    fn step(b: &Decoded, x: KBlock<'_>, acc: f32) -> f32 {
        step_with_mins(b, x, acc)
    }
}

/// `dequantize` of the types with mins (Q4_K, Q5_K): weight `d·sc·q − dmin·m`, 8 sub-blocks of
/// 32, as llama.cpp's `dequantize_row_q4_K` and `_q5_K` compute it.
pub(super) fn dequantize_with_mins(b: &Decoded, out: &mut [f32]) {
    let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
    for (i, o) in out.iter_mut().enumerate().take(QK_K) {
        let s = i / 32;
        *o = d * b.sc[2 * s] as f32 * f32::from(b.q[i]) - dmin * b.m[s] as f32;
    }
}

/// `step` of the types with mins (Q4_K, Q5_K; module docs).
#[inline(always)]
pub(super) fn step_with_mins(b: &Decoded, x: KBlock<'_>, acc: f32) -> f32 {
    let (mut isum, mut msum) = (0i32, 0i32);
    for s in 0..8 {
        let run = 32 * s..32 * s + 32;
        isum += b.sc[2 * s] * idot(&b.q[run.clone()], &x.x[run]);
        msum += b.m[s] * i32::from(x.sum32[s]);
    }
    let acc = (isum as f32).mul_add(b.d.to_f32() * x.dx, acc);
    (msum as f32).mul_add(b.dmin.to_f32() * -x.dx, acc)
}

impl Interleave for Q6K {
    const KIND: QuantKind = QuantKind::Q6K;
    type Block = BlockQ6K;
    type Group = GroupQ6K;

    fn pack(rows: &[BlockQ6K; GROUP_ROWS]) -> GroupQ6K {
        let mut g: GroupQ6K = bytemuck::Zeroable::zeroed();
        for (j, b) in rows.iter().enumerate() {
            let u = Self::decode(b);
            g.d[j] = b.d;
            for s in 0..16 {
                g.scales[s][j] = b.scales[s];
                for i in 0..8 {
                    let (a, c) = (u.q[16 * s + i], u.q[16 * s + 8 + i]);
                    let run = &mut g.runs[s / 2];
                    run.low[s % 2][8 * j + i] = (a & 15) | (c & 15) << 4;
                    run.high[8 * j + i] |= ((a >> 4) | (c >> 4) << 2) << (4 * (s % 2));
                }
            }
        }
        g
    }
}

impl KQuant for Q6K {
    fn decode(b: &BlockQ6K) -> Decoded {
        let mut u = Decoded {
            sc: b.scales.map(i32::from),
            ..Decoded::new(b.d, f16::ZERO)
        };
        // Each half of 128 weights: run k of 32 takes the low 4 bits from 32 bytes of `ql`
        // (the low nibbles for k < 2, then the high) and bits 2k, 2k + 1 of 32 bytes of `qh`.
        let halves = (b.ql.chunks_exact(64)).zip(b.qh.chunks_exact(32));
        for (q, (ql, qh)) in u.q.chunks_exact_mut(128).zip(halves) {
            for (k, q) in q.chunks_exact_mut(32).enumerate() {
                let (low, shift) = (&ql[32 * (k % 2)..][..32], 4 * (k / 2));
                for ((q, &low), &high) in q.iter_mut().zip(low).zip(qh) {
                    *q = ((low >> shift) & 0xF) | ((high >> (2 * k)) & 3) << 4;
                }
            }
        }
        u
    }

    fn decode_row(g: &GroupQ6K, j: usize) -> Decoded {
        let mut u = Decoded::new(g.d[j], f16::ZERO);
        for s in 0..16 {
            u.sc[s] = g.scales[s][j].into();
            for i in 0..8 {
                let low = g.low(s)[8 * j + i];
                let high = g.high(s / 2)[8 * j + i] >> (4 * (s % 2));
                u.q[16 * s + i] = (low & 15) | (high & 3) << 4;
                u.q[16 * s + 8 + i] = (low >> 4) | ((high >> 2) & 3) << 4;
            }
        }
        u
    }

    fn dequantize(b: &Decoded, out: &mut [f32]) {
        let d = b.d.to_f32();
        for (i, o) in out.iter_mut().enumerate().take(QK_K) {
            *o = d * b.sc[i / 16] as f32 * (i32::from(b.q[i]) - 32) as f32;
        }
    }

    #[inline(always)]
    fn step(b: &Decoded, x: KBlock<'_>, acc: f32) -> f32 {
        let mut isum = 0i32;
        for (s, (&sc, &sum)) in b.sc.iter().zip(x.sum16).enumerate() {
            let run = 16 * s..16 * s + 16;
            isum += sc * (idot(&b.q[run.clone()], &x.x[run]) - 32 * i32::from(sum));
        }
        (isum as f32).mul_add(b.d.to_f32() * x.dx, acc)
    }
}

/// A K-quant matrix in the kernels' layout.
pub type KMatrix<'a, K> = Packed<'a, K>;

/// Row `row`'s super-block `k` of `w`, unpacked.
pub fn decoded<K: KQuant>(w: KMatrix<'_, K>, row: usize, k: usize) -> Decoded {
    match w.locate(row, k) {
        Located::Group(g, j) => K::decode_row(g, j),
        Located::Tail(b) => K::decode(b),
    }
}

/// Activation rows quantized per super-block of 256 (llama.cpp's `block_q8_K`, with an f32
/// scale `d = max|x| / 127` as `q8_0` rounds, values in −127..=127): `qs` (`rows × inner`
/// bytes), one scale a super-block and the sums of every 16 and every 32 values (`sums16`,
/// `sums32`, which fit in 16 bits: 32 · 127 < 2¹⁵), and where a Q6_K product reads them, its
/// lane offsets ([`q6k_offsets`]).
///
/// Stored super-block by super-block, every row's super-block `k` before any row's `k + 1`:
/// a kernel over R rows reads super-block `k` of all of them from one place, at fixed offsets
/// ([`KRowsView::blocks`]), instead of holding a pointer a row.
#[derive(Debug, Default)]
pub struct KRows {
    qs: Vec<i8>,
    scales: Vec<f32>,
    sums16: Vec<i16>,
    sums32: Vec<i16>,
    offsets6: Vec<i32>,
    blocks: usize,
}

/// Sums of 16 values a super-block.
const RUNS16: usize = QK_K / 16;
/// Sums of 32 values a super-block.
const RUNS32: usize = QK_K / 32;
/// Q6_K lane offsets a super-block: one a sub-block and half.
const OFFSETS6: usize = 2 * QK_K / 16;

/// Q6_K's `−32` for each 4-byte lane of its AVX-512 kernel (`k_quants_simd`), from a
/// super-block's 256 values: lane (sub-block `s`, half `h`) takes values `16s + 4h..` and
/// `16s + 8 + 4h..`, 4 of each, and is offset by −32 times their sum, so its 8 products
/// `(q − 32)·x` (|·| ≤ 8 · 32 · 127 < 2¹⁵) start from it and fit 16 bits.
pub fn q6k_offsets(x: &[i8; QK_K]) -> [i32; OFFSETS6] {
    // The sums of every 4 values first (a loop that vectorizes), then each lane's two.
    let mut fours = [0i32; QK_K / 4];
    for (sum, four) in fours.iter_mut().zip(x.chunks_exact(4)) {
        *sum = four.iter().map(|&v| i32::from(v)).sum();
    }
    std::array::from_fn(|k| {
        let at = 4 * (k / 2) + k % 2;
        -32 * (fours[at] + fours[at + 2])
    })
}

impl KRows {
    /// Quantizes `input`'s rows, reusing this value's buffers; with Q6_K's lane offsets
    /// where `q6k` (a Q6_K product will read the rows) and `isa`'s kernel reads them.
    pub fn quantize(&mut self, isa: Q8Isa, input: &Rows<'_>, q6k: bool) {
        let q6k = q6k && super::k_quants_simd::reads_q6k_offsets(isa);
        debug_assert_eq!(input.inner % QK_K, 0);
        self.blocks = input.inner / QK_K;
        self.qs.clear();
        self.scales.clear();
        self.sums16.clear();
        self.sums32.clear();
        self.offsets6.clear();
        let blocks = (0..self.blocks).flat_map(|k| {
            (0..input.rows).map(move |r| &input.x[r * input.inner + k * QK_K..][..QK_K])
        });
        for block in blocks {
            let (d, id) = block_scale(block);
            self.scales.push(d);
            let at = self.qs.len();
            push_rounded(isa, block, id, &mut self.qs);
            let sums = self.qs[at..]
                .chunks_exact(16)
                .map(|run| run.iter().map(|&q| i16::from(q)).sum::<i16>());
            self.sums16.extend(sums);
            let sums_at = self.sums16.len() - RUNS16;
            for p in 0..RUNS32 {
                self.sums32
                    .push(self.sums16[sums_at + 2 * p] + self.sums16[sums_at + 2 * p + 1]);
            }
            if let Some(x) = self.qs[at..].first_chunk().filter(|_| q6k) {
                self.offsets6.extend(q6k_offsets(x));
            }
        }
    }

    /// Rows `range` of it.
    fn rows(&self, range: std::ops::Range<usize>) -> KRowsView<'_> {
        // The views share the whole buffers: a row past the end would read another
        // super-block's rows, not fail a slice.
        assert!(range.end <= self.len(), "rows {range:?} of {}", self.len());
        KRowsView {
            qs: &self.qs,
            scales: &self.scales,
            sums16: &self.sums16,
            sums32: &self.sums32,
            #[cfg(target_arch = "x86_64")]
            offsets6: &self.offsets6,
            blocks: self.blocks,
            stride: self.len(),
            first: range.start,
            rows: range.len(),
        }
    }

    /// Its rows.
    fn len(&self) -> usize {
        self.scales.len() / self.blocks.max(1)
    }
}

/// Some rows of a [`KRows`].
#[derive(Debug, Clone, Copy)]
pub(super) struct KRowsView<'a> {
    qs: &'a [i8],
    scales: &'a [f32],
    sums16: &'a [i16],
    sums32: &'a [i16],
    /// Read by the x86 Q6_K kernel alone.
    #[cfg(target_arch = "x86_64")]
    offsets6: &'a [i32],
    /// Super-blocks a row.
    pub(super) blocks: usize,
    /// The rows of the whole [`KRows`]: super-block `k` of its row `i` is entry `k·stride + i`.
    stride: usize,
    /// The view's first row there, and its rows.
    first: usize,
    rows: usize,
}

/// One activation row's super-block as the kernels read it.
#[derive(Debug, Clone, Copy)]
pub struct KBlock<'a> {
    /// Its 256 values.
    pub x: &'a [i8],
    /// The sums of its 16-value runs.
    pub sum16: &'a [i16],
    /// The sums of its 32-value runs (Q4_K's sub-blocks).
    pub sum32: &'a [i16],
    /// Its scale.
    pub dx: f32,
}

impl KRowsView<'_> {
    pub(super) fn rows(&self) -> usize {
        self.rows
    }

    /// Row `r`'s super-block `k`.
    #[inline(always)]
    pub(super) fn block(&self, r: usize, k: usize) -> KBlock<'_> {
        assert!(r < self.rows && k < self.blocks);
        let at = k * self.stride + self.first + r;
        KBlock {
            x: &self.qs[at * QK_K..(at + 1) * QK_K],
            sum16: &self.sums16[at * RUNS16..(at + 1) * RUNS16],
            sum32: &self.sums32[at * RUNS32..(at + 1) * RUNS32],
            dx: self.scales[at],
        }
    }

    /// Super-block `k` of rows `0..R`, sliced once: the rows lie together
    /// ([`KRows`]), so each row's slices are at fixed offsets in the one slice, with no check
    /// a row. (The x86 kernels' rows are a constant; NEON's take [`Self::block`] a row.)
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn blocks<const R: usize>(&self, k: usize) -> [KBlock<'_>; R] {
        assert!(R <= self.rows && k < self.blocks);
        let at = k * self.stride + self.first;
        let qs = &self.qs[at * QK_K..(at + R) * QK_K];
        let sums16 = &self.sums16[at * RUNS16..(at + R) * RUNS16];
        let sums32 = &self.sums32[at * RUNS32..(at + R) * RUNS32];
        let scales = &self.scales[at..at + R];
        std::array::from_fn(|r| KBlock {
            x: &qs[r * QK_K..(r + 1) * QK_K],
            sum16: &sums16[r * RUNS16..(r + 1) * RUNS16],
            sum32: &sums32[r * RUNS32..(r + 1) * RUNS32],
            dx: scales[r],
        })
    }

    /// Super-block `k`'s Q6_K lane offsets ([`q6k_offsets`]) of rows `0..R` (quantized for a
    /// Q6_K product), apart from [`Self::blocks`]: only the Q6_K kernel reads them, and a
    /// fifth slice a row there made the Q4_K and Q5_K kernels slower.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn offsets6<const R: usize>(&self, k: usize) -> [&[i32]; R] {
        assert!(R <= self.rows && k < self.blocks);
        let at = k * self.stride + self.first;
        let offsets6 = &self.offsets6[at * OFFSETS6..(at + R) * OFFSETS6];
        std::array::from_fn(|r| &offsets6[r * OFFSETS6..(r + 1) * OFFSETS6])
    }
}

/// `out[j·to.col + r·to.row]` = activation row `r` of `x` · weight row `j` of `w`: in runs of
/// weight groups, each run times every block of up to `row_block` rows; the tail rows by the
/// portable loops.
pub(super) fn product<K: super::k_quants_simd::Groups>(
    isa: Q8Isa,
    plan: Prefetch,
    x: &KRows,
    w: KMatrix<'_, K>,
    out: SharedOut<'_>,
    to: OutLayout,
) {
    let rows = x.len();
    let most = super::k_quants_simd::row_block(isa);
    w.runs_by_rows(rows, most, |start, run, range| {
        let at = out.from(start * GROUP_ROWS * to.col);
        K::groups(isa, plan, x.rows(range.clone()), run, at, to, range.start);
    });
    let tail = KMatrix::<K> {
        groups: &[],
        tail: w.tail,
        blocks: w.blocks,
    };
    let tail_out = out.from(w.grouped_rows() * to.col);
    portable(x.rows(0..rows), tail, tail_out, to, 0);
}

/// The one definition's loops over every row of `w` (groups and tail alike).
pub(super) fn portable<K: KQuant>(
    xs: KRowsView<'_>,
    w: KMatrix<'_, K>,
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    for row in 0..w.rows() {
        let blocks: Vec<Decoded> = (0..w.blocks).map(|k| decoded(w, row, k)).collect();
        for r in 0..xs.rows() {
            let mut acc = 0f32;
            for (k, b) in blocks.iter().enumerate() {
                acc = K::step(b, xs.block(r, k), acc);
            }
            out.set(row * to.col + (first + r) * to.row, acc);
        }
    }
}
