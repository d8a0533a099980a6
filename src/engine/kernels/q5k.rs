//! GGUF's `block_q5_K` (the type of Q5_K_* files, and of a Q4_K_S file's first `attn_v` and
//! `ffn_down` matrices): Q4_K's super-block with a fifth bit on every weight, `q` in 0..32.
//! Its one definition is Q4_K's (`k_quants` module docs); its group is Q4_K's
//! ([`GroupQ4K`], the low 4 bits) followed by the fifth bits laid beside them, so Q4_K's
//! vector kernels (`q4k_simd`, `k_quants_neon`) read both types through [`NibbleGroup`].

use super::QK_K;
use super::k_quants::{
    BlockQ4K, Decoded, GroupQ4K, KBlock, KQuant, Q4K, dequantize_with_mins, pack_q4k_row, q4k_byte,
    step_with_mins,
};
use super::packed::{GROUP_ROWS, Interleave};
use super::weight_element::QuantKind;
use half::f16;

/// GGUF's `block_q5_K`: Q4_K's scales and nibbles (`d·sc·q − dmin·m`, 8 sub-blocks of 32)
/// with weight `i`'s fifth bit (16) in bit `i / 32` of `qh[i % 32]` (llama.cpp's
/// `dequantize_row_q5_K` order).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ5K {
    /// The scales' scale.
    pub d: f16,
    /// The mins' scale.
    pub dmin: f16,
    /// 8 scales and 8 mins, 6 bits each (Q4_K's packing).
    pub scales: [u8; 12],
    /// The weights' fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Their low 4 bits, as Q4_K's `qs`.
    pub qs: [u8; QK_K / 2],
}

/// Bytes of fifth bits in a [`GroupQ5K`].
const FIFTH_BYTES: usize = QK_K / 8 * GROUP_ROWS;

/// One Q5_K super-block of each of 8 rows: the fifth bits, then Q4_K's group of the low 4
/// bits. The fifth bits come first because a kernel reads them a 64-byte run at a time beside
/// the low bits' runs: after the Q4_K group they were a second stream a kilobyte ahead of the
/// first, which the CPU's prefetchers can lose (as `GroupQ6K`'s were); before it, they are the
/// group's first lines, fetched as its stream begins.
///
/// Byte `64t + p` of `fifth` holds those of byte `p` of `low.qs`'s 64-byte runs `4t..4t + 4`:
/// run `4t + c`'s low nibble in bit `2c`, its high nibble in bit `2c + 1`. So the 64 bytes
/// beside a pair of sub-blocks (`2t`, `2t + 1`: runs `4t..4t + 4`) are one vector load, as the
/// weights' own are.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupQ5K {
    /// The fifth bits.
    pub fifth: [u8; FIFTH_BYTES],
    /// The scales, mins and low 4 bits, as a Q4_K group holds them.
    pub low: GroupQ4K,
}

const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<GroupQ5K>() == 8 * 176);

// Both are `repr(C)` structs of f16s (align 2) and byte arrays (and a `GroupQ4K`, itself
// `Pod`), whose sizes the asserts above show add up with no padding; every bit pattern is a
// valid f16 and u8; both are `Copy` and `'static`.
// SAFETY: above.
unsafe impl bytemuck::Zeroable for BlockQ5K {}
// SAFETY: above.
unsafe impl bytemuck::Pod for BlockQ5K {}
// SAFETY: above.
unsafe impl bytemuck::Zeroable for GroupQ5K {}
// SAFETY: above.
unsafe impl bytemuck::Pod for GroupQ5K {}

/// The place of the fifth bit of the weight in `low.qs[at]`'s low nibble (`high`: its high
/// nibble): the byte of `fifth` and the bit.
const fn fifth_bit(at: usize, high: bool) -> (usize, usize) {
    let run = at / 64;
    (64 * (run / 4) + at % 64, 2 * (run % 4) + high as usize)
}

/// Q5_K's marker.
#[derive(Debug, Clone, Copy)]
pub struct Q5K;

impl Interleave for Q5K {
    const KIND: QuantKind = QuantKind::Q5K;
    type Block = BlockQ5K;
    type Group = GroupQ5K;

    fn pack(rows: &[BlockQ5K; GROUP_ROWS]) -> GroupQ5K {
        let mut g: GroupQ5K = bytemuck::Zeroable::zeroed();
        for (j, b) in rows.iter().enumerate() {
            let u = Self::decode(b);
            pack_q4k_row(&mut g.low, j, &u);
            // Weights 32s + n and 32s + 16 + n share a byte of `low.qs` (`q4k_byte`); their
            // fifth bits lie as `fifth_bit` places that byte's, 8 bytes (n % 8) at a time.
            for s in 0..8 {
                for half in 0..2 {
                    let n = 8 * half;
                    let (byte, bit) = fifth_bit(q4k_byte(j, s, n), false);
                    let (low, high) = (&u.q[32 * s + n..][..8], &u.q[32 * s + 16 + n..][..8]);
                    let fifth = &mut g.fifth[byte..byte + 8];
                    for ((f, &low), &high) in fifth.iter_mut().zip(low).zip(high) {
                        *f |= (low >> 4) << bit | (high >> 4) << (bit + 1);
                    }
                }
            }
        }
        g
    }
}

impl KQuant for Q5K {
    fn decode(b: &BlockQ5K) -> Decoded {
        let (d, dmin, scales, qs) = (b.d, b.dmin, b.scales, b.qs);
        let mut u = Q4K::decode(&BlockQ4K {
            d,
            dmin,
            scales,
            qs,
        });
        // Run t of 32 weights takes bit t of each of the 32 bytes.
        for (t, q) in u.q.chunks_exact_mut(32).enumerate() {
            for (q, &high) in q.iter_mut().zip(&b.qh) {
                *q |= ((high >> t) & 1) << 4;
            }
        }
        u
    }

    fn decode_row(g: &GroupQ5K, j: usize) -> Decoded {
        let mut u = Q4K::decode_row(&g.low, j);
        for s in 0..8 {
            for n in 0..16 {
                let (w, at) = (32 * s + n, q4k_byte(j, s, n));
                for (high, w) in [(false, w), (true, w + 16)] {
                    let (byte, bit) = fifth_bit(at, high);
                    u.q[w] |= ((g.fifth[byte] >> bit) & 1) << 4;
                }
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

/// A group in Q4_K's layout, as Q4_K's vector kernels read it: Q4_K's own, or Q5_K's with its
/// fifth bits.
pub trait NibbleGroup: bytemuck::Pod {
    /// Whether its weights have a fifth bit.
    const FIFTH: bool;
    /// The scales, mins and low 4 bits.
    fn low(&self) -> &GroupQ4K;
    /// The fifth bits ([`GroupQ5K`]'s layout; all zero where there are none).
    fn fifth(&self) -> &[u8; FIFTH_BYTES];
}

/// Q4_K's (absent) fifth bits.
static NO_FIFTH: [u8; FIFTH_BYTES] = [0; FIFTH_BYTES];

impl NibbleGroup for GroupQ4K {
    const FIFTH: bool = false;
    #[inline(always)]
    fn low(&self) -> &GroupQ4K {
        self
    }
    #[inline(always)]
    fn fifth(&self) -> &[u8; FIFTH_BYTES] {
        &NO_FIFTH
    }
}

impl NibbleGroup for GroupQ5K {
    const FIFTH: bool = true;
    #[inline(always)]
    fn low(&self) -> &GroupQ4K {
        &self.low
    }
    #[inline(always)]
    fn fifth(&self) -> &[u8; FIFTH_BYTES] {
        &self.fifth
    }
}
