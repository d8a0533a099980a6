//! Causal attention of decode rows over one pass's K/V cache, a group of rows at a time.
//! Called by `model::host`'s attention (every decode step, every layer).
//!
//! Why groups: at hidden 256 a decode step is bound by the bytes it streams from L3, and a
//! row's cache (1.5 MB over six layers at position 128 in f32, half that in f16: the cache's
//! element type is `kv_element::KvElement`, widened to f32 in registers) is the one part of
//! those bytes that grows with the rows. Rows at the same pass read the same cache: a second candidate and
//! its first (`dual`, speculation.md §3), and the prompt's rows. A group walks the cache in
//! tiles and every row of the group reads a tile while it is in L1, so the group streams the
//! cache once instead of once per row.
//!
//! Exactness: a row's result does not depend on its group. Every (row, position) score is
//! the same dot product (see `avx2::head_scores`), each row's softmax is its own, and each
//! row's output sums the positions in order, carried from tile to tile in memory, which
//! rounds nothing. A row alone (`attend_row`) is a group of one.

use std::ops::Range;

use super::kv_element::KvElement;
use super::{Isa, isa, portable, prefetch, softmax_in_place};

/// Positions per tile: one head's keys of a tile (`TILE · head_dim` floats, 8 KB at 64)
/// stay in L1 while every row of the group reads them.
const TILE: usize = 64;

/// Shapes for one row's attention over its pass's cache.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
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
    attend_group(
        &[query],
        (keys, values),
        (shape, 0..shape.heads),
        out,
        scores,
    );
}

/// The attention of every row in `queries` over `keys`/`values` (one pass's cache,
/// `[positions × kv_heads·head_dim]` in f32 or f16, covering the largest `cached`; a row's
/// `own` entry must hold what the cache's element type would read back) for the heads in
/// `heads`, into `out` (`[rows × heads.len()·head_dim]`). `scores` is scratch space. The
/// heads are independent: the decode threads split a group by heads where the groups alone
/// would leave one idle (a one-row step, three rows on two threads).
pub fn attend_group<E: KvElement>(
    queries: &[Query<'_>],
    cache: (&[E], &[E]),
    heads: (AttnShape, Range<usize>),
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    attend_group_on(isa(), queries, cache, heads, out, scores);
}

/// [`attend_group`] with the kernels of `isa` (the tests compare instruction sets).
pub(super) fn attend_group_on<E: KvElement>(
    isa: Isa,
    queries: &[Query<'_>],
    (keys, values): (&[E], &[E]),
    (shape, heads): (AttnShape, Range<usize>),
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
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
        heads,
    };
    // Under the L2 plan the cache rows come from DRAM: ask for all the keys and the first
    // tile of values now, and each next tile of values as the walk reaches a tile
    // (`Walk::values`). On an AMD EPYC Zen 4, 4-row steps 2–6 % faster in one process.
    let far = prefetch::far_enabled();
    if far {
        let cached = queries.iter().map(|q| q.cached).max().unwrap_or(0);
        let kv_dim = shape.kv_heads * shape.head_dim;
        prefetch::into_l2(&keys[..(cached * kv_dim).min(keys.len())]);
        prefetch::into_l2(&values[..(cached.min(TILE) * kv_dim).min(values.len())]);
    }
    walk.scores(keys, scores);
    for (query, &start) in queries.iter().zip(&starts) {
        let len = query.len();
        for head in scores[start..start + count * len].chunks_exact_mut(len.max(1)) {
            softmax_in_place(head);
        }
    }
    out.fill(0.0);
    walk.values(values, scores, out, far);
}

/// One group's walk over the cache in tiles (the scores, then the outputs).
struct Walk<'a> {
    isa: Isa,
    queries: &'a [Query<'a>],
    /// Where each row's scores start: a run of its `len()` scores per head.
    starts: &'a [usize],
    shape: AttnShape,
    /// The heads it computes.
    heads: Range<usize>,
}

impl Walk<'_> {
    fn kv_dim(&self) -> usize {
        self.shape.kv_heads * self.shape.head_dim
    }

    /// Where head `h` reads its K/V row within an entry.
    fn kv_offset(&self, h: usize) -> usize {
        (h / (self.shape.heads / self.shape.kv_heads)) * self.shape.head_dim
    }

    /// Each row's `heads` runs of scores, `q_h · k_s / √head_dim`.
    fn scores<E: KvElement>(&self, keys: &[E], scores: &mut [f32]) {
        let (kv_dim, head_dim) = (self.kv_dim(), self.shape.head_dim);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let cached = self.queries.iter().map(|q| q.cached).max().unwrap_or(0);
        for s0 in (0..cached).step_by(TILE) {
            for h in self.heads.clone() {
                let kh = &keys[s0 * kv_dim + self.kv_offset(h)..];
                for (query, &start) in self.queries.iter().zip(self.starts) {
                    let end = (s0 + TILE).min(query.cached);
                    if end > s0 {
                        let row = start + (h - self.heads.start) * query.len();
                        let qh = &query.q[h * head_dim..(h + 1) * head_dim];
                        head_scores(self.isa, qh, kh, kv_dim, scale, &mut scores[row..][s0..end]);
                    }
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
                let kh = &own_k[self.kv_offset(h)..];
                head_scores::<f32>(
                    self.isa,
                    &qh[..head_dim],
                    kh,
                    kv_dim,
                    scale,
                    &mut scores[at..=at],
                );
            }
        }
    }

    /// Each row's output, `Σ_s p_s · v_s` per head, the positions in order; with `far`, each
    /// tile first prefetches the next into L2.
    fn values<E: KvElement>(&self, values: &[E], probs: &[f32], out: &mut [f32], far: bool) {
        let (kv_dim, head_dim) = (self.kv_dim(), self.shape.head_dim);
        let width = self.heads.len() * head_dim;
        let cached = self.queries.iter().map(|q| q.cached).max().unwrap_or(0);
        for s0 in (0..cached).step_by(TILE) {
            if far {
                let next = (s0 + TILE).min(cached) * kv_dim..(s0 + 2 * TILE).min(cached) * kv_dim;
                prefetch::into_l2(
                    &values[next.start.min(values.len())..next.end.min(values.len())],
                );
            }
            for h in self.heads.clone() {
                let vh = &values[s0 * kv_dim + self.kv_offset(h)..];
                for (n, (query, &start)) in self.queries.iter().zip(self.starts).enumerate() {
                    let end = (s0 + TILE).min(query.cached);
                    if end > s0 {
                        let row = start + (h - self.heads.start) * query.len();
                        let oh =
                            &mut out[n * width + (h - self.heads.start) * head_dim..][..head_dim];
                        head_values(self.isa, &probs[row..][s0..end], vh, kv_dim, oh);
                    }
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
                    &own_v[self.kv_offset(h)..],
                    kv_dim,
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
        // SAFETY: `has_avx2` holds only after AVX2, FMA and F16C were detected at run time.
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
        // SAFETY: `has_avx2` holds only after AVX2, FMA and F16C were detected at run time.
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
