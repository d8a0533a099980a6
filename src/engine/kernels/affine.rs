//! mlx's affine quantization, as mlx-community's 4-bit and 8-bit checkpoints store it: each
//! group of `group` consecutive weights of a row holds unsigned `bits`-bit integers `q` and one
//! scale `s` and bias `b`, and the weight is `s·q + b`. Called by `super::product_columns` for
//! [`Weight::Affine`](super::Weight) matrices and by `Weight::widen_into` (a quantized
//! embedding's rows); `engine::mlx` reads and writes the files.
//!
//! The kernels' layout is one block per (row, group): `s` and `b` as f32 (widened exactly from
//! the file's bf16, f16 or f32) and then the group's packed integers as mlx packs them (4-bit:
//! weight `2i` in byte `i`'s low nibble, `2i + 1` in its high one). One stream of blocks is one
//! stream of reads.
//!
//! Why float activations, unlike Q8_0 and the K-quants: mlx multiplies the activations as they
//! are, in the model's float type, and mlx-lm's output is the oracle these files are held to
//! (`tests/reference/mlx_quant.py`). So each weight is dequantized in registers (`s·q + b`, one
//! FMA) and multiplied like an f32 weight; the activations are never quantized.
//!
//! Row invariance: every (input row, weight row) pair has 16 lanes fed in the order of k, each
//! step `lane = x·(s·q + b) + lane` with both products fused, and the lanes are summed by
//! [`hsum16`]. At 8 bits lane `l` takes weights `l`, `l + 16`, …; at 4 bits each 32 weights are
//! 16 bytes and lane `l` takes byte `l`'s two, `2l` then `2l + 1`, so that a vector kernel splits
//! the nibbles with one AND and one shift (the activations reordered to match once a call).
//! Every ISA (AVX-512's one register, AVX2's two, NEON's four, the portable loops) computes
//! exactly that, so a result has the same bits whatever the rows, the grouping, the thread split or the
//! ISA.

#[cfg(target_arch = "x86_64")]
use super::Isa;
use super::{OutLayout, SharedOut};

/// An affine quantization's integer width and group size: bits 4 or 8, groups of 32, 64 or
/// 128 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffineKind {
    bits: u32,
    group: usize,
}

impl AffineKind {
    /// The integer widths the kernels read.
    pub const BITS: [u32; 2] = [4, 8];
    /// The group sizes they read.
    pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

    /// The kind of `bits` and `group`, if the kernels read it.
    pub fn new(bits: u32, group: usize) -> Option<Self> {
        (Self::BITS.contains(&bits) && Self::GROUP_SIZES.contains(&group))
            .then_some(Self { bits, group })
    }

    /// Bits an integer.
    pub fn bits(self) -> u32 {
        self.bits
    }

    /// Weights a group.
    pub fn group(self) -> usize {
        self.group
    }

    /// Bytes a group's packed integers take.
    pub fn packed_bytes(self) -> usize {
        self.group * self.bits as usize / 8
    }

    /// Bytes a block takes: the f32 scale and bias, then the packed integers.
    pub fn block_bytes(self) -> usize {
        8 + self.packed_bytes()
    }

    /// The last two dimensions of a host tensor of these blocks, `[rows, groups, bits,
    /// group / 8 + 8 / bits]` of `U8`: their product is the block's bytes, and the pair names
    /// the kind, which no GGUF block (`[rows, blocks, block bytes]`) is mistaken for.
    pub fn dims(self) -> [usize; 2] {
        let bits = self.bits as usize;
        [bits, self.group / 8 + 8 / bits]
    }

    /// The kind whose [`Self::dims`] are `dims`.
    pub fn from_dims(dims: [usize; 2]) -> Option<Self> {
        let [bits, last] = dims;
        let bits = u32::try_from(bits)
            .ok()
            .filter(|b| Self::BITS.contains(b))?;
        let group = last.checked_sub(8 / bits as usize)? * 8;
        Self::new(bits, group)
    }

    /// Its name in headers: `mlx4/g64`.
    pub fn name(self) -> String {
        format!("mlx{}/g{}", self.bits, self.group)
    }
}

/// A matrix of affine blocks in the kernels' layout: `rows` rows of `groups` blocks.
#[derive(Debug, Clone, Copy)]
pub struct AffineMatrix<'a> {
    blocks: &'a [u8],
    rows: usize,
    groups: usize,
    kind: AffineKind,
}

impl<'a> AffineMatrix<'a> {
    /// The matrix in `blocks`, or why they do not hold `rows` rows of `groups` blocks.
    pub fn new(
        blocks: &'a [u8],
        rows: usize,
        groups: usize,
        kind: AffineKind,
    ) -> Result<Self, String> {
        if blocks.len() != rows * groups * kind.block_bytes() {
            return Err(format!(
                "{} bytes of {} blocks, expected {rows} rows of {groups} ({} bytes)",
                blocks.len(),
                kind.name(),
                rows * groups * kind.block_bytes()
            ));
        }
        Ok(Self {
            blocks,
            rows,
            groups,
            kind,
        })
    }

    /// Its kind.
    pub fn kind(self) -> AffineKind {
        self.kind
    }

    /// Its rows.
    pub fn rows(self) -> usize {
        self.rows
    }

    /// Weights a row.
    pub fn inner(self) -> usize {
        self.groups * self.kind.group
    }

    /// Its blocks' bytes: what a product streams.
    pub fn as_bytes(self) -> &'a [u8] {
        self.blocks
    }

    /// Rows `range`.
    pub fn slice_rows(self, range: std::ops::Range<usize>) -> Self {
        let row_bytes = self.groups * self.kind.block_bytes();
        Self {
            blocks: &self.blocks[range.start * row_bytes..range.end * row_bytes],
            rows: range.len(),
            ..self
        }
    }

    /// Row `r`'s blocks.
    pub(super) fn row(self, r: usize) -> &'a [u8] {
        let row_bytes = self.groups * self.kind.block_bytes();
        &self.blocks[r * row_bytes..(r + 1) * row_bytes]
    }

    /// Elements `range` dequantized (`s·q + b`, fused as the kernels compute it) onto `out`.
    pub fn widen_into(self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let inner = self.inner();
        for at in range.clone() {
            let (row, k) = (at / inner, at % inner);
            let block = Block::of(self.row(row), self.kind, k / self.kind.group);
            out.push(block.weight(k % self.kind.group));
        }
    }
}

/// One block, read.
struct Block<'a> {
    scale: f32,
    bias: f32,
    packed: &'a [u8],
    bits: u32,
}

impl<'a> Block<'a> {
    /// Block `g` of `row`.
    #[inline(always)]
    fn of(row: &'a [u8], kind: AffineKind, g: usize) -> Self {
        let bytes = &row[g * kind.block_bytes()..(g + 1) * kind.block_bytes()];
        let f = |at: usize| {
            f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        Self {
            scale: f(0),
            bias: f(4),
            packed: &bytes[8..],
            bits: kind.bits,
        }
    }

    /// Integer `i` of the group.
    #[inline(always)]
    fn q(&self, i: usize) -> u8 {
        match self.bits {
            4 => (self.packed[i / 2] >> (4 * (i % 2))) & 0x0F,
            _ => self.packed[i],
        }
    }

    /// Weight `i` of the group.
    #[inline(always)]
    fn weight(&self, i: usize) -> f32 {
        weight(self.scale, self.q(i), self.bias)
    }
}

/// A weight: `scale·q + bias` with one rounding (the vector kernels' one FMA).
#[inline(always)]
pub fn weight(scale: f32, q: u8, bias: f32) -> f32 {
    scale.mul_add(f32::from(q), bias)
}

/// Writes a block: `scale`, `bias` and the integers `q` (each below `2^bits`) packed (the
/// tests' blocks; a file's are copied as stored, `mlx::Stored::blocks`).
#[cfg(test)]
pub(super) fn write_block(kind: AffineKind, scale: f32, bias: f32, q: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&scale.to_le_bytes());
    out.extend_from_slice(&bias.to_le_bytes());
    pack(kind, q, out);
}

/// The integers `q` (each below `2^bits`) packed as mlx packs them into its `uint32` words,
/// read as little-endian bytes: 4-bit `2i` in byte `i`'s low nibble, `2i + 1` in its high one.
pub fn pack(kind: AffineKind, q: &[u8], out: &mut Vec<u8>) {
    match kind.bits {
        4 => out.extend(q.chunks_exact(2).map(|p| p[0] | (p[1] << 4))),
        _ => out.extend_from_slice(q),
    }
}

/// [`pack`]'s inverse: a group's packed bytes, one integer a byte into `q`.
pub fn unpack(kind: AffineKind, bytes: &[u8], q: &mut [u8]) {
    match kind.bits {
        4 => {
            for (pair, &byte) in q.chunks_exact_mut(2).zip(bytes) {
                pair[0] = byte & 0x0F;
                pair[1] = byte >> 4;
            }
        }
        _ => q.copy_from_slice(bytes),
    }
}

/// The sum of 16 lanes in the one tree every ISA's kernel reduces by: lane `i` and `i + 8`
/// first, then the 8 by halves.
#[inline(always)]
pub(super) fn hsum16(l: &[f32; 16]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]))
}

/// Row `r` of `x` times weight row `j`, the portable way (the kernels' definition).
fn dot(x: &[f32], w: AffineMatrix<'_>, j: usize) -> f32 {
    let (row, kind) = (w.row(j), w.kind);
    let mut lanes = [0f32; 16];
    for g in 0..w.groups {
        let block = Block::of(row, kind, g);
        let xg = &x[g * kind.group..(g + 1) * kind.group];
        if kind.bits == 4 {
            // A chunk of 32 is 16 bytes: lane l takes byte l's two weights, 2l then 2l + 1,
            // whose activations `x` holds at l and 16 + l ([`deinterleave`]).
            for (c, xc) in xg.chunks_exact(32).enumerate() {
                for half in 0..2 {
                    for (l, lane) in lanes.iter_mut().enumerate() {
                        let weight = block.weight(c * 32 + 2 * l + half);
                        *lane = xc[16 * half + l].mul_add(weight, *lane);
                    }
                }
            }
            continue;
        }
        for (c, xc) in xg.chunks_exact(16).enumerate() {
            for (l, (lane, &xv)) in lanes.iter_mut().zip(xc).enumerate() {
                *lane = xv.mul_add(block.weight(c * 16 + l), *lane);
            }
        }
    }
    hsum16(&lanes)
}

/// Rows of `x` (`inner` each) with every 32 values reordered as 4-bit chunks are read: the 16
/// even-indexed first, then the 16 odd-indexed (byte l of a chunk holds weights 2l and 2l + 1,
/// whose nibbles split into an even and an odd vector with one AND and one shift). Done once
/// a product, for every thread and 4-bit matrix (`super::Input`).
pub(super) fn deinterleave(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    for chunk in x.chunks_exact(32) {
        out.extend(chunk.iter().step_by(2));
        out.extend(chunk.iter().skip(1).step_by(2));
    }
}

/// `out[j·to.col + r·to.row]` = row `r` of `x` (rows of `w.inner()`, [`deinterleave`]d for a
/// 4-bit `w`) · weight row `j` of `w`, for every row and weight row, on `isa`'s kernel.
pub(super) fn product(
    isa: super::Isa,
    x: &[f32],
    w: AffineMatrix<'_>,
    out: SharedOut<'_>,
    to: OutLayout,
) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx2Fma) {
        return super::affine_simd::product(isa, x, w, out, to);
    }
    #[cfg(target_arch = "aarch64")]
    if isa == super::Isa::Neon {
        return super::affine_neon::product(x, w, out, to);
    }
    let _ = isa;
    portable(x, w, out, to);
}

/// [`product`] in plain loops.
pub(super) fn portable(x: &[f32], w: AffineMatrix<'_>, out: SharedOut<'_>, to: OutLayout) {
    let inner = w.inner();
    for j in 0..w.rows {
        for (r, xr) in x.chunks_exact(inner).enumerate() {
            out.set(j * to.col + r * to.row, dot(xr, w, j));
        }
    }
}
