//! Q4_K's and Q5_K's vector kernels: `k_quants`' one definition over a [`GroupQ4K`](super::GroupQ4K)'s 8 rows
//! at once (a Q5_K group is one with fifth bits beside it, `q5k`). Called through
//! `k_quants_simd::Groups` for whole groups.
//!
//! The layout puts 8 weights of each row in every 64 bytes, a 4-byte lane for each row and
//! half, so one `vpdpbusd` (AVX-512 VNNI, 16 lanes) or two `vpmaddubsw` (AVX2, 8 lanes) take 64
//! weights against 8 activation bytes broadcast to every lane pair. A weight row's 32-weight
//! sub-block sum thus lies in two lanes, and the layout keeps those two adjacent:
//! - **VNNI**: a lane's 16 Q4_K products are under 2¹⁵ in magnitude (16 · 15 · 127 = 30480),
//!   so `vpackssdw` packs two sub-blocks' lanes to 16 bits without saturating, and one
//!   `vpdpwssd` against each lane's scale pair both multiplies by the sub-block scale and adds
//!   the two halves: no `vpmulld`, and one multiply-accumulate per two sub-blocks and row.
//!   Q5_K's 16 (16 · 31 · 127) are not, so its lanes are packed as two sums of 8 products,
//!   the low nibbles' and the high's, and take two `vpdpwssd`.
//! - **AVX2**: `vpmaddubsw`'s pairs (≤ 2 · 31 · 127) add four to a 16-bit lane (≤ 31496), and
//!   one `vpmaddwd` against the scale pair gives the lane's scaled sum.
//!
//! Q5_K's fifth bits join the nibbles as 16 where set (a byte mask, then a masked add on
//! AVX-512). The mins are `vpmaddwd` (AVX2) or `vpdpwssd` (VNNI) of the 32-value activation
//! sums against each row's min pairs: a lane takes two sub-blocks, an instruction four of each
//! row. Every sum is the exact integer of the one definition, and the float part is its two
//! FMAs, so the results are the portable loops' bits.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::k_quants::{KBlock, KRowsView};
#[cfg(target_arch = "x86_64")]
use super::packed::GROUP_ROWS;
#[cfg(target_arch = "x86_64")]
use super::q5k::NibbleGroup;
#[cfg(target_arch = "x86_64")]
use super::q8_0::{prefetch, store8};
#[cfg(target_arch = "x86_64")]
use super::{OutLayout, Prefetch, SharedOut};

/// A `vpshufb` control word from its 4 byte indices (`None`: a zero byte).
#[cfg(target_arch = "x86_64")]
const fn control(bytes: [Option<u8>; 4]) -> i32 {
    let mut word = [0x80u8; 4];
    let mut i = 0;
    while i < 4 {
        if let Some(b) = bytes[i] {
            word[i] = b;
        }
        i += 1;
    }
    i32::from_le_bytes(word)
}

/// A scale's 16-bit pair: both halves of a 32-bit lane the byte at `at`.
#[cfg(target_arch = "x86_64")]
const fn pair(at: u8) -> i32 {
    control([Some(at), None, Some(at), None])
}

/// The scales' and mins' 6-bit values, one byte an entry (`k_quants::q4k_entry`), from the
/// group's 96 packed bytes: 64 low-nibble bytes and 32 bytes of high bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn entries(lo: __m256i, hi: __m256i) -> (__m256i, __m256i) {
    let (nib, three, twelve) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(12),
    );
    let sc = _mm256_or_si256(
        _mm256_and_si256(lo, nib),
        _mm256_slli_epi16::<4>(_mm256_and_si256(hi, three)),
    );
    let m = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16::<4>(lo), nib),
        _mm256_slli_epi16::<2>(_mm256_and_si256(hi, twelve)),
    );
    (sc, m)
}

/// [`entries`] for the group's two halves (entries 0..32: rows 0..4; 32..64: rows 4..8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn entries_by_half(scales: &[u8; 96]) -> [(__m256i, __m256i); 2] {
    let p = scales.as_ptr();
    // SAFETY: the feature; `scales` holds 96 bytes.
    let (lo0, lo1, hi) = unsafe {
        (
            _mm256_loadu_si256(p.cast()),
            _mm256_loadu_si256(p.add(32).cast()),
            _mm256_loadu_si256(p.add(64).cast()),
        )
    };
    let nib = _mm256_set1_epi8(0x0F);
    let hi1 = _mm256_and_si256(_mm256_srli_epi16::<4>(hi), nib);
    [entries(lo0, _mm256_and_si256(hi, nib)), entries(lo1, hi1)]
}

/// 8 bytes at `p` in every 64-bit lane.
///
/// # Safety
/// The CPU must have AVX2; `p` holds 8 readable bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn broadcast8(p: *const i8) -> __m256i {
    // SAFETY: the caller's.
    unsafe { _mm256_set1_epi64x(std::ptr::read_unaligned(p.cast())) }
}

/// Each row's two lanes summed, rows in order: `v[0]` holds rows 0..4 and `v[1]` rows 4..8, a
/// lane per row and half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn rows_in_order(v: [__m256i; 2]) -> __m256i {
    _mm256_permute4x64_epi64::<0xD8>(_mm256_hadd_epi32(v[0], v[1]))
}

/// Each byte's bit `bit` of `h` as 16 (AVX2): Q5_K's fifth bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn fifth_avx2(h: __m256i, bit: u8) -> __m256i {
    let one = _mm256_set1_epi8(1 << bit);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, one), one);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// Sub-block `s`'s `vpshufb` control over a half's scale entries (`entries_by_half`): lane
/// (row j, half h) takes row j's scale of sub-block s, twice. A table, one load: where the
/// sub-block loop is not unrolled (more rows), building the control in the kernel takes three
/// instructions a sub-block and half, one on the port that moves integers into vectors.
#[cfg(target_arch = "x86_64")]
static SCALE_CONTROLS: [[i32; 8]; 8] = {
    let mut t = [[0; 8]; 8];
    let mut s = 0;
    while s < 8 {
        let at = 4 * (s as u8 / 2) + 2 * (s as u8 % 2);
        let (even, odd) = (pair(at), pair(at + 1));
        t[s] = [even, even, odd, odd, even, even, odd, odd];
        s += 1;
    }
    t
};

/// Sub-block `s` of half `q` (rows 0..4 or 4..8) of a group's super-block, for every row:
/// the weights' nibbles (and Q5_K's fifth bits), each row's four `vpmaddubsw` added in 16
/// bits, then scaled by `vpmaddwd` against the sub-block's scale pairs (from the half's
/// entries `sc8`) into `isum[r][q]` (module docs).
///
/// # Safety
/// The CPU must have AVX2; `s` < 8 and `q` < 2; `x` holds a super-block of each row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn sub_block<const R: usize, G: NibbleGroup>(
    whole: &G,
    s: u8,
    q: usize,
    sc8: __m256i,
    x: &[KBlock<'_>; R],
    isum: &mut [[__m256i; 2]; R],
) {
    let (item, nib) = (whole.low(), _mm256_set1_epi8(0x0F));
    // SAFETY: the features; s < 8 and each control is 32 bytes.
    let ctl = unsafe { _mm256_loadu_si256(SCALE_CONTROLS[usize::from(s)].as_ptr().cast()) };
    let sc = _mm256_shuffle_epi8(sc8, ctl);
    let base = 128 * usize::from(s) + 32 * q;
    // SAFETY: the features; sub-block s's two 64-byte halves are readable.
    let (v0, v1) = unsafe {
        (
            _mm256_loadu_si256(item.qs.as_ptr().add(base).cast()),
            _mm256_loadu_si256(item.qs.as_ptr().add(base + 64).cast()),
        )
    };
    let mut w = [
        _mm256_and_si256(v0, nib),
        _mm256_and_si256(v1, nib),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v0), nib),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v1), nib),
    ];
    if G::FIFTH {
        // Runs 2s and 2s + 1 are runs 4t + c and 4t + c + 1 (`q5k`).
        let at = 64 * usize::from(s / 2) + 32 * q;
        // SAFETY: the features; the fifth bits hold 64 bytes from `64 (s / 2)`.
        let h = unsafe { _mm256_loadu_si256(whole.fifth()[at..].as_ptr().cast()) };
        let c = 2 * (s % 2);
        for (w, bit) in w.iter_mut().zip([2 * c, 2 * c + 2, 2 * c + 1, 2 * c + 3]) {
            *w = _mm256_or_si256(*w, fifth_avx2(h, bit));
        }
    }
    for (x, isum) in x.iter().zip(isum.iter_mut()) {
        // SAFETY: `x.x` holds a super-block's 256 values (`KRowsView::blocks`)
        // and s < 8: sub-block s is 32 bytes from 32s.
        let xp = unsafe { x.x.as_ptr().add(32 * usize::from(s)) };
        // SAFETY: the features; `xp` holds the sub-block's 32 bytes.
        let pairs =
            unsafe { [0, 1, 2, 3].map(|i| _mm256_maddubs_epi16(w[i], broadcast8(xp.add(8 * i)))) };
        let sum = _mm256_add_epi16(
            _mm256_add_epi16(pairs[0], pairs[1]),
            _mm256_add_epi16(pairs[2], pairs[3]),
        );
        isum[q] = _mm256_add_epi32(isum[q], _mm256_madd_epi16(sum, sc));
    }
}

/// Q4_K's and Q5_K's one definition for `R` rows over whole groups, with AVX2 (module docs).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `xs` holds `R` rows of `xs.blocks` super-blocks and
/// `groups` whole groups of as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_avx2<const R: usize, G: NibbleGroup>(
    plan: Prefetch,
    xs: KRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let b = xs.blocks;
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, whole) in group.iter().enumerate() {
            prefetch(plan, whole);
            let item = whole.low();
            let x: [KBlock<'_>; R] = xs.blocks(k);
            let halves = entries_by_half(&item.scales);
            let mut isum = [[_mm256_setzero_si256(); 2]; R];
            let mut msum = [[_mm256_setzero_si256(); 2]; R];
            // One row: a sub-block's 4 activation broadcasts serve both halves back to back.
            // More rows: a half's accumulators stay in registers for its 8 sub-blocks.
            if R == 1 {
                for s in 0..8u8 {
                    for (q, &(sc8, _)) in halves.iter().enumerate() {
                        // SAFETY: the features; s < 8 and q < 2.
                        unsafe { sub_block(whole, s, q, sc8, &x, &mut isum) };
                    }
                }
            } else {
                for (q, &(sc8, _)) in halves.iter().enumerate() {
                    for s in 0..8u8 {
                        // SAFETY: the features; s < 8 and q < 2.
                        unsafe { sub_block(whole, s, q, sc8, &x, &mut isum) };
                    }
                }
            }
            for (q, &(_, m8)) in halves.iter().enumerate() {
                for t in 0..2u8 {
                    // Lane (row j, half h): row j's mins of sub-blocks 4t + 2h and 4t + 2h + 1.
                    let at = |h: u8, odd: u8| 4 * (2 * t + h) + odd;
                    let ctl =
                        |h, odd| control([Some(at(h, odd)), None, Some(at(h, odd) + 2), None]);
                    let ctl = _mm256_setr_epi32(
                        ctl(0, 0),
                        ctl(1, 0),
                        ctl(0, 1),
                        ctl(1, 1),
                        ctl(0, 0),
                        ctl(1, 0),
                        ctl(0, 1),
                        ctl(1, 1),
                    );
                    let m = _mm256_shuffle_epi8(m8, ctl);
                    for (x, msum) in x.iter().zip(msum.iter_mut()) {
                        // SAFETY: the features; `x.sum32` holds a super-block's 8 sums and
                        // t < 2: the 4 from 4t on are readable.
                        let sums =
                            unsafe { broadcast8(x.sum32.as_ptr().add(4 * usize::from(t)).cast()) };
                        msum[q] = _mm256_add_epi32(msum[q], _mm256_madd_epi16(m, sums));
                    }
                }
            }
            // SAFETY: the features; `d` and `dmin` are 16 bytes each.
            let (d, dmin) = unsafe {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(item.d.as_ptr().cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(item.dmin.as_ptr().cast())),
                )
            };
            for r in 0..R {
                let (i, m) = (rows_in_order(isum[r]), rows_in_order(msum[r]));
                let up = _mm256_mul_ps(d, _mm256_set1_ps(x[r].dx));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), up, acc[r]);
                let down = _mm256_mul_ps(dmin, _mm256_set1_ps(-x[r].dx));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), down, acc[r]);
            }
        }
        let at = out.from(g * GROUP_ROWS * to.col);
        for (r, a) in acc.into_iter().enumerate() {
            // SAFETY: the features.
            unsafe { store8(a, at, to, first + r) };
        }
    }
}

/// The scales' and mins' entries of a group in one 64-byte register each (entry `e` in byte
/// `e`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
#[inline]
fn entries_512(scales: &[u8; 96]) -> (__m512i, __m512i) {
    let [(sc0, m0), (sc1, m1)] = entries_by_half(scales);
    (
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(sc0), sc1),
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(m0), m1),
    )
}

/// 8 bytes at `p` in every 64-bit lane of a 64-byte register.
///
/// # Safety
/// The CPU must have AVX-512F; `p` holds 8 readable bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn broadcast8_512(p: *const i8) -> __m512i {
    // SAFETY: the caller's.
    unsafe { _mm512_set1_epi64(std::ptr::read_unaligned(p.cast())) }
}

/// Each row's two lanes of each 4-lane run summed and the 8 rows gathered: the first 8 lanes
/// from `i` (rows in lanes `[a, b, a, b]`: `a + a`, `b + b`), the next 8 from `m` (rows in
/// lanes `[a, a, b, b]`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn gather_rows(i: __m512i, m: __m512i) -> __m512i {
    let i = _mm512_add_epi32(i, _mm512_shuffle_epi32::<0x4E>(i));
    let m = _mm512_add_epi32(m, _mm512_shuffle_epi32::<0xB1>(m));
    let idx = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_permutex2var_epi32(i, idx, m)
}

/// `w` with 16 added where `h`'s bytes have bit `bit` set (AVX-512): Q5_K's fifth bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn with_fifth_512(w: __m512i, h: __m512i, bit: u8) -> __m512i {
    let set = _mm512_test_epi8_mask(h, _mm512_set1_epi8(1 << bit));
    _mm512_mask_add_epi8(w, set, w, _mm512_set1_epi8(16))
}

/// `q4k_vnni`'s `vpshufb` controls over a group's scale and min entries (`entries_512`) for
/// each of a super-block's four steps t, loaded there: built in the loop, each took an add
/// on a vector pipe the multiplies could use.
/// - `scales[t]`: lane c of each 4-lane run takes the packed sub-block sums (row parity
///   c % 2, sub-block parity c / 2) of sub-blocks 2t and 2t + 1 against the scale twice.
/// - `mins[q]`: the mins take 4 sub-blocks a `vpdpwssd` (4q..4q + 4, against their 4
///   activation sums in every 64-bit lane): lane c holds row parity c / 2's mins of sub-blocks
///   4q + 2(c % 2) and the next, entry bytes 4u + (row parity) and 4u + 2 + (row parity)
///   where u = 2q + c % 2. Two sub-blocks a lane, not one: half the `vpdpwssd`, which compete
///   with the `vpdpbusd` for the multiply pipes.
#[cfg(target_arch = "x86_64")]
struct VnniControls {
    scales: [[i32; 16]; 4],
    mins: [[i32; 16]; 2],
}

#[cfg(target_arch = "x86_64")]
static VNNI_CONTROLS: VnniControls = {
    let mut scales = [[0; 16]; 4];
    let mut mins = [[0; 16]; 2];
    let mut lane = 0;
    while lane < 16 {
        let c = (lane % 4) as u8;
        let mut t = 0;
        while t < 4 {
            scales[t][lane] = pair(4 * t as u8 + c);
            t += 1;
        }
        let mut q = 0;
        while q < 2 {
            let at = 4 * (2 * q as u8 + c % 2) + c / 2;
            mins[q][lane] = control([Some(at), None, Some(at + 2), None]);
            q += 1;
        }
        lane += 1;
    }
    VnniControls { scales, mins }
};

/// Q4_K's and Q5_K's one definition for `R` rows over whole groups, with AVX-512 VNNI (module
/// docs).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, AVX2, FMA and F16C; `xs` holds `R` rows of
/// `xs.blocks` super-blocks and `groups` whole groups of as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4k_vnni<const R: usize, G: NibbleGroup>(
    plan: Prefetch,
    xs: KRowsView<'_>,
    groups: &[G],
    out: SharedOut<'_>,
    to: OutLayout,
    first: usize,
) {
    let (b, nib) = (xs.blocks, _mm512_set1_epi8(0x0F));
    let sign_high = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1);
    let sign_high = _mm512_and_si512(sign_high, _mm512_set1_epi32(i32::MIN));
    for (g, group) in groups.chunks_exact(b).enumerate() {
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, whole) in group.iter().enumerate() {
            prefetch(plan, whole);
            let item = whole.low();
            let x: [KBlock<'_>; R] = xs.blocks(k);
            let (sc8, m8) = entries_512(&item.scales);
            let mut isum = [_mm512_setzero_si512(); R];
            let mut msum = [_mm512_setzero_si512(); R];
            for t in 0..4 {
                // SAFETY: the features; each control is 64 bytes.
                let (sc_ctl, m_ctl) = unsafe {
                    (
                        _mm512_loadu_si512(VNNI_CONTROLS.scales[t].as_ptr().cast()),
                        _mm512_loadu_si512(VNNI_CONTROLS.mins[t / 2].as_ptr().cast()),
                    )
                };
                let sc = _mm512_shuffle_epi8(sc8, sc_ctl);
                // Read at odd t only: quad t / 2's mins.
                let m = _mm512_shuffle_epi8(m8, m_ctl);
                let mut w: [[__m512i; 4]; 2] = std::array::from_fn(|odd| {
                    let base = 128 * (2 * t + odd);
                    // SAFETY: the features; sub-block 2t + odd's 128 bytes are readable.
                    let (v0, v1) = unsafe {
                        (
                            _mm512_loadu_si512(item.qs.as_ptr().add(base).cast()),
                            _mm512_loadu_si512(item.qs.as_ptr().add(base + 64).cast()),
                        )
                    };
                    [
                        _mm512_and_si512(v0, nib),
                        _mm512_and_si512(v1, nib),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v0), nib),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v1), nib),
                    ]
                });
                if G::FIFTH {
                    // SAFETY: the features; the fifth bits hold 64 bytes from `64t`.
                    let h = unsafe { _mm512_loadu_si512(whole.fifth()[64 * t..].as_ptr().cast()) };
                    for (odd, w) in w.iter_mut().enumerate() {
                        // Runs 4t + 2·odd and 4t + 2·odd + 1 (`q5k`).
                        let c = 4 * odd as u8;
                        for (w, bit) in w.iter_mut().zip([c, c + 2, c + 1, c + 3]) {
                            *w = with_fifth_512(*w, h, bit);
                        }
                    }
                }
                for (r, x) in x.iter().enumerate() {
                    // SAFETY: `x.x` holds a super-block's 256 values (`KRowsView::blocks`) and
                    // t < 4: sub-blocks 2t and 2t + 1 are its 64 bytes from 64t. (Pointers, not
                    // slices: a bounds check for each t and row stayed in the loop.)
                    let xp = unsafe { x.x.as_ptr().add(64 * t) };
                    // Sub-block 2t + odd's products, each lane's 16 in one sum (Q4_K).
                    let part = |odd: usize| {
                        let mut part = _mm512_setzero_si512();
                        for (i, &w) in w[odd].iter().enumerate() {
                            // SAFETY: the features; `xp` holds both sub-blocks' 64 bytes.
                            let xb = unsafe { broadcast8_512(xp.add(32 * odd + 8 * i)) };
                            part = _mm512_dpbusd_epi32(part, w, xb);
                        }
                        part
                    };
                    // The same, its low nibbles' 8 (`high`: its high nibbles') alone (Q5_K).
                    let half = |odd: usize, high: usize| {
                        let mut part = _mm512_setzero_si512();
                        for (i, &w) in w[odd].iter().enumerate().skip(2 * high).take(2) {
                            // SAFETY: as above.
                            let xb = unsafe { broadcast8_512(xp.add(32 * odd + 8 * i)) };
                            part = _mm512_dpbusd_epi32(part, w, xb);
                        }
                        part
                    };
                    if G::FIFTH {
                        for high in 0..2 {
                            let packed = _mm512_packs_epi32(half(0, high), half(1, high));
                            isum[r] = _mm512_dpwssd_epi32(isum[r], packed, sc);
                        }
                    } else {
                        let packed = _mm512_packs_epi32(part(0), part(1));
                        isum[r] = _mm512_dpwssd_epi32(isum[r], packed, sc);
                    }
                    if t % 2 == 1 {
                        let quad = t / 2;
                        // SAFETY: the features; `x.sum32` holds a super-block's 8 sums
                        // (`KRowsView::blocks`) and quad < 2: sums 4·quad.. are 8 bytes.
                        let sums = unsafe { broadcast8_512(x.sum32.as_ptr().add(4 * quad).cast()) };
                        msum[r] = _mm512_dpwssd_epi32(msum[r], m, sums);
                    }
                }
            }
            // SAFETY: the features; `d` and `dmin` lie together, 32 bytes.
            let scales = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(item.d.as_ptr().cast())) };
            // d and −dmin for the 8 rows, once for every row of activations: (−dmin)·dx is
            // dmin·(−dx) bit for bit, a product's sign apart from its rounding.
            let scales =
                _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(scales), sign_high));
            for r in 0..R {
                let sums = _mm512_cvtepi32_ps(gather_rows(isum[r], msum[r]));
                // d·dx for the 8 rows, then dmin·(−dx): the definition's two products.
                let dx = _mm512_set1_ps(x[r].dx);
                let mul = _mm512_mul_ps(scales, dx);
                let high =
                    |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                let low = _mm512_castps512_ps256;
                acc[r] = _mm256_fmadd_ps(low(sums), low(mul), acc[r]);
                acc[r] = _mm256_fmadd_ps(high(sums), high(mul), acc[r]);
            }
        }
        let at = out.from(g * GROUP_ROWS * to.col);
        for (r, a) in acc.into_iter().enumerate() {
            // SAFETY: the features.
            unsafe { store8(a, at, to, first + r) };
        }
    }
}
