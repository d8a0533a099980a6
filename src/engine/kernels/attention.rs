//! Causal attention of decode rows over one pass's K/V cache, a group of rows at a time.
//! Called by `model::host`'s attention (every decode step, every layer).
//!
//! Why groups: at hidden 256 a decode step is bound by the bytes it streams from L3, and a
//! row's cache (1.5 MB over six layers at position 128 in f32, half that in f16: the cache's
//! element type is `kv_element::KvElement`, widened to f32 in registers) is the one part of
//! those bytes that grows with the rows. Rows at the same pass read the same cache: a second candidate and
//! its first (`dual`: `engine::pipeline`, "Second candidates"), and the prompt's rows. A group walks the cache in
//! blocks, one head's tile of positions each, and every row of the group reads a block while
//! it is in L1, so the group streams the cache once instead of once per row. The host cache
//! lies in tiles ([`KvLayout::Tiles`]), so a block is one contiguous run and the blocks in
//! the walk's order one stream.
//!
//! Exactness: a row's result does not depend on its group. Every (row, position) score is
//! the same dot product (see `avx2::head_scores`, `avx512_attention::head_scores`), each row's
//! softmax is its own, and each row's output sums the positions in order, carried from tile
//! to tile in memory, which rounds nothing. A row alone (`attend_row`) is a group of one.

use std::ops::Range;

use super::kv_element::KvElement;
use super::{Isa, Kernels, detected_isa, portable, softmax_in_place};

/// Positions per tile: one head's keys of a tile (`TILE · head_dim` floats, 8 KB at 64)
/// stay in L1 while every row of the group reads them.
const TILE: usize = 64;

/// Shapes for one row's attention over its pass's cache.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (each serves heads / kv_heads query heads).
    pub kv_heads: usize,
    /// Each head's width.
    pub head_dim: usize,
}

/// How one pass's cache lies in memory: where the entry of (position `s`, kv head `j`),
/// `head_dim` elements, starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayout {
    /// `[positions × kv_heads·head_dim]`: at `s·kv_dim + j·head_dim`, a position's entry whole,
    /// as a step computes it.
    Rows,
    /// `[tiles × kv_heads × TILE × head_dim]`: positions in tiles of 64 (`TILE`), each tile every
    /// kv head's 64 entries, one head after another (the host cache). A block of the walk
    /// (one head's tile) is then one contiguous run, and the walk's blocks in order are one
    /// stream: the first positions of every head, whatever the capacity, lie together. With
    /// each head's positions contiguous over the whole capacity instead (a head's run of 16 KB
    /// at Ouro-1.4B's shape and position 64, then a jump of the capacity), the hardware
    /// prefetchers restarted at every run, and one row's attention over a layer's positions
    /// from DRAM took markedly longer that way than in tiles.
    Tiles,
}

/// One pass's keys and values (f32 or f16) as the attention reads them.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a, E> {
    /// The pass's keys, laid out as `layout` says.
    pub keys: &'a [E],
    /// Its values, laid out the same way.
    pub values: &'a [E],
    /// How both lie in memory.
    pub layout: KvLayout,
}

impl<'a, E> From<(&'a [E], &'a [E])> for KvView<'a, E> {
    /// Keys and values in [`KvLayout::Rows`].
    fn from((keys, values): (&'a [E], &'a [E])) -> Self {
        Self {
            keys,
            values,
            layout: KvLayout::Rows,
        }
    }
}

impl KvLayout {
    /// Its strides for kv heads of `head_dim` elements: the one definition of where an entry
    /// lies, for the attention's reads and the host cache's writes (`model::host_kv`).
    pub fn strides(self, kv_heads: usize, head_dim: usize) -> KvStrides {
        let kv_dim = kv_heads * head_dim;
        match self {
            Self::Rows => KvStrides {
                pos: kv_dim,
                head: head_dim,
                tile: TILE * kv_dim,
                extent_head: kv_heads - 1,
                head_dim,
            },
            Self::Tiles => KvStrides {
                pos: head_dim,
                head: TILE * head_dim,
                tile: TILE * kv_dim,
                extent_head: kv_heads - 1,
                head_dim,
            },
        }
    }

    /// Elements a cache of `capacity` positions holds in this layout (whole tiles in
    /// [`KvLayout::Tiles`]).
    pub fn elements(self, capacity: usize, kv_heads: usize, head_dim: usize) -> usize {
        let positions = match self {
            Self::Rows => capacity,
            Self::Tiles => capacity.next_multiple_of(TILE),
        };
        positions * kv_heads * head_dim
    }
}

/// Element strides of a cache in one layout ([`KvLayout::strides`]).
#[derive(Debug, Clone, Copy)]
pub struct KvStrides {
    /// From one position's entry of a kv head to the next position's, within a tile.
    pos: usize,
    /// From kv head j's entry of a position to kv head j + 1's.
    head: usize,
    /// From a tile's first position to the next tile's.
    tile: usize,
    /// The kv head whose entries lie last in a tile.
    extent_head: usize,
    head_dim: usize,
}

impl KvStrides {
    /// Where kv head `head`'s entry at position `pos` starts.
    pub fn offset(self, head: usize, pos: usize) -> usize {
        pos / TILE * self.tile + pos % TILE * self.pos + head * self.head
    }

    /// Elements from the start that hold the first `len` positions of every kv head.
    pub fn extent(self, len: usize) -> usize {
        match len {
            0 => 0,
            _ => self.offset(self.extent_head, len - 1) + self.head_dim,
        }
    }
}

/// One row of a group: its query, how many cache entries it reads, and its own K/V entry
/// when that is kept outside the cache.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// `[heads · head_dim]`, rotated.
    pub q: &'a [f32],
    /// The row reads the cache's positions `0..cached`.
    pub cached: usize,
    /// Its own (K, V) row (`[kv_heads · head_dim]` each), read as position `cached`: a
    /// second candidate's entry, which shares its position with its first candidate's.
    pub own: Option<(&'a [f32], &'a [f32])>,
}

impl Query<'_> {
    /// Positions the row attends to.
    fn len(&self) -> usize {
        self.cached + usize::from(self.own.is_some())
    }
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
    let query = Query {
        q,
        cached: len,
        own: None,
    };
    attend_group_on(
        detected_isa(),
        &[query],
        (keys, values),
        HeadSpan::all(shape),
        out,
        scores,
    );
}

impl Kernels {
    /// The attention of every row in `queries` over `keys`/`values` (one pass's cache,
    /// `[positions × kv_heads·head_dim]` in f32 or f16, covering the largest `cached`; a row's
    /// `own` entry must hold what the cache's element type would read back) for the heads in
    /// `heads`, into `out` (`[rows × heads.len()·head_dim]`). `scores` is scratch space. The
    /// heads are independent: the decode threads split a group by heads where the groups alone
    /// would leave one idle (a one-row step, three rows on two threads).
    pub fn attend_group<'a, E: KvElement>(
        &self,
        queries: &[Query<'_>],
        cache: impl Into<KvView<'a, E>>,
        heads: HeadSpan,
        out: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        attend_group_on(self.isa(), queries, cache.into(), heads, out, scores);
    }
}

/// The query heads one attention call computes (`heads`, of `shape.heads`): the decode
/// threads split a group by heads.
#[derive(Debug, Clone)]
pub struct HeadSpan {
    /// The layer's attention shape.
    pub shape: AttnShape,
    /// The query heads attended, a range of `0..shape.heads`.
    pub heads: Range<usize>,
}

impl HeadSpan {
    /// Every query head of `shape`.
    pub fn all(shape: AttnShape) -> Self {
        Self {
            shape,
            heads: 0..shape.heads,
        }
    }
}

/// [`Kernels::attend_group`] with the kernels of `isa` (the tests compare instruction sets).
pub(super) fn attend_group_on<'a, E: KvElement>(
    isa: Isa,
    queries: &[Query<'_>],
    cache: impl Into<KvView<'a, E>>,
    span: HeadSpan,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let HeadSpan { shape, heads } = span;
    let cache = cache.into();
    let count = heads.len();
    let starts: Vec<usize> = (queries.iter())
        .scan(0, |at, query| {
            let start = *at;
            *at += count * query.len();
            Some(start)
        })
        .collect();
    scores.clear();
    scores.resize(count * queries.iter().map(Query::len).sum::<usize>(), 0.0);
    let walk = Walk {
        isa,
        queries,
        starts: &starts,
        shape,
        strides: cache.layout.strides(shape.kv_heads, shape.head_dim),
        heads,
    };
    // No prefetch of the walk's own: in `KvLayout::Tiles` its blocks are one stream the
    // hardware prefetchers follow, and the kernels prefetch a few positions ahead into L1.
    // Asking for all the keys up front (and each next block of values as the walk reached a
    // block) made one row's attention over a layer's positions from DRAM slower, not faster.
    walk.scores(cache.keys, scores);
    for (query, &start) in queries.iter().zip(&starts) {
        let len = query.len();
        for head in scores[start..start + count * len].chunks_exact_mut(len.max(1)) {
            softmax_in_place(head);
        }
    }
    out.fill(0.0);
    walk.values(cache.values, scores, out);
}

/// One group's walk over the cache in tiles (the scores, then the outputs).
struct Walk<'a> {
    isa: Isa,
    queries: &'a [Query<'a>],
    /// Where each row's scores start: a run of its `len()` scores per head.
    starts: &'a [usize],
    shape: AttnShape,
    /// The cache's layout.
    strides: KvStrides,
    /// The heads it computes.
    heads: Range<usize>,
}

impl Walk<'_> {
    /// Head `h`'s kv head.
    fn kv_head(&self, h: usize) -> usize {
        h / (self.shape.heads / self.shape.kv_heads)
    }

    /// Where head `h` reads position `pos` in the cache.
    fn kv_offset(&self, h: usize, pos: usize) -> usize {
        self.strides.offset(self.kv_head(h), pos)
    }

    /// Where head `h` reads its K/V row within a row's own entry (`[kv_heads·head_dim]`).
    fn own_offset(&self, h: usize) -> usize {
        self.kv_head(h) * self.shape.head_dim
    }

    /// The walk's blocks, (head, a tile's first position): every head's block of a tile, then
    /// the next tile's, the order in which `KvLayout::Tiles` lays them out. Every row of the
    /// group reads a block while it is in L1. Each head still meets its tiles in order, so its
    /// output sums the positions in order whatever the walk's order across heads.
    fn blocks(&self, cached: usize) -> impl Iterator<Item = (usize, usize)> + use<> {
        let heads = self.heads.clone();
        (0..cached)
            .step_by(TILE)
            .flat_map(move |s0| heads.clone().map(move |h| (h, s0)))
    }

    /// Each row's `heads` runs of scores, `q_h · k_s / √head_dim`.
    fn scores<E: KvElement>(&self, keys: &[E], scores: &mut [f32]) {
        let (stride, head_dim) = (self.strides.pos, self.shape.head_dim);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let cached = self.queries.iter().map(|q| q.cached).max().unwrap_or(0);
        for (h, s0) in self.blocks(cached) {
            let kh = &keys[self.kv_offset(h, s0)..];
            for (query, &start) in self.queries.iter().zip(self.starts) {
                let end = (s0 + TILE).min(query.cached);
                if end > s0 {
                    let row = start + (h - self.heads.start) * query.len();
                    let qh = &query.q[h * head_dim..(h + 1) * head_dim];
                    head_scores(self.isa, qh, kh, stride, scale, &mut scores[row..][s0..end]);
                }
            }
        }
        for (query, &start) in self.queries.iter().zip(self.starts) {
            let Some((own_k, _)) = query.own else {
                continue;
            };
            for h in self.heads.clone() {
                let row = start + (h - self.heads.start) * query.len();
                let qh = &query.q[h * head_dim..];
                let at = row + query.cached;
                let kh = &own_k[self.own_offset(h)..];
                head_scores::<f32>(
                    self.isa,
                    &qh[..head_dim],
                    kh,
                    head_dim,
                    scale,
                    &mut scores[at..=at],
                );
            }
        }
    }

    /// Each row's output, `Σ_s p_s · v_s` per head, the positions in order.
    fn values<E: KvElement>(&self, values: &[E], probs: &[f32], out: &mut [f32]) {
        let (stride, head_dim) = (self.strides.pos, self.shape.head_dim);
        let width = self.heads.len() * head_dim;
        let cached = self.queries.iter().map(|q| q.cached).max().unwrap_or(0);
        for (h, s0) in self.blocks(cached) {
            let vh = &values[self.kv_offset(h, s0)..];
            for (n, (query, &start)) in self.queries.iter().zip(self.starts).enumerate() {
                let end = (s0 + TILE).min(query.cached);
                if end > s0 {
                    let row = start + (h - self.heads.start) * query.len();
                    let oh = &mut out[n * width + (h - self.heads.start) * head_dim..][..head_dim];
                    head_values(self.isa, &probs[row..][s0..end], vh, stride, oh);
                }
            }
        }
        for (n, (query, &start)) in self.queries.iter().zip(self.starts).enumerate() {
            let Some((_, own_v)) = query.own else {
                continue;
            };
            for h in self.heads.clone() {
                let at = start + (h - self.heads.start) * query.len() + query.cached;
                let oh = &mut out[n * width + (h - self.heads.start) * head_dim..][..head_dim];
                head_values::<f32>(
                    self.isa,
                    &probs[at..=at],
                    &own_v[self.own_offset(h)..],
                    head_dim,
                    oh,
                );
            }
        }
    }
}

/// `scores[s] = (q · keys[s·stride ..][..head_dim]) · scale`, `q` one head.
fn head_scores<E: KvElement>(
    isa: Isa,
    q: &[f32],
    keys: &[E],
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) {
    match (isa, q.len()) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is the detected ISA or a `Kernels`' checked one: with AVX-512F the CPU
        // has AVX2, FMA and F16C. (Heads of 64 stay on AVX2, which holds them without spills.)
        (i, 128) if i.has_avx512() => unsafe {
            super::avx512_attention::head_scores::<8, E>(q, keys, stride, scale, scores)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is the detected ISA or a `Kernels`' checked one: with AVX2 the CPU has
        // FMA and F16C.
        (i, 64) if i.has_avx2() => unsafe {
            super::avx2::head_scores::<8, E>(q, keys, stride, scale, scores)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (i, 128) if i.has_avx2() => unsafe {
            super::avx2::head_scores::<16, E>(q, keys, stride, scale, scores)
        },
        _ => portable::head_scores(q, keys, stride, scale, scores),
    }
}

/// `out += Σ_s probs[s] · values[s·stride ..][..out.len()]`, the positions in order.
fn head_values<E: KvElement>(
    isa: Isa,
    probs: &[f32],
    values: &[E],
    stride: usize,
    out: &mut [f32],
) {
    match (isa, out.len()) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is the detected ISA or a `Kernels`' checked one: with AVX-512F the CPU
        // has AVX2, FMA and F16C. (Heads of 64 stay on AVX2, as in `head_scores`.)
        (i, 128) if i.has_avx512() => unsafe {
            super::avx512_attention::head_values::<8, E>(probs, values, stride, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is the detected ISA or a `Kernels`' checked one: with AVX2 the CPU has
        // FMA and F16C.
        (i, 64) if i.has_avx2() => unsafe {
            super::avx2::head_values::<8, E>(probs, values, stride, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (i, 128) if i.has_avx2() => unsafe {
            super::avx2::head_values::<16, E>(probs, values, stride, out)
        },
        _ => portable::head_values(probs, values, stride, out),
    }
}
