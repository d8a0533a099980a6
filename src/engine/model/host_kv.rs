//! The host backend's K/V buffers (`model::host`): per layer, one pair of buffers holding
//! every pass's cache one after another, each in `kernels::KvLayout::Tiles` (tiles of
//! positions, every kv head's entries of a tile together: the stream the attention walks), in
//! f32 or f16 ([`KvDtype`], chosen when the model is loaded), and the K/V rows set
//! aside for second candidates. The step writes rows in f32 and the attention kernels read
//! the element type they find (`kernels::KvElement`); `KvCache` (engine::kv_cache) keeps
//! the fill levels and drives `swap_aside`/`forget_aside` through [`KvStore`].

use std::collections::HashMap;
use std::ops::Range;

use half::f16;

use super::LoopedModel;
use crate::engine::error::Result;
use crate::engine::kernels::{KvElement, KvLayout, KvStrides, KvView};
use crate::engine::kv_cache::{AsideSlot, KvStore};
use crate::engine::looped::LoopedConfig;
use crate::engine::pass::Pass;
use crate::engine::zeroed_pages::ZeroedPages;

/// The element type of the host KV cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvDtype {
    /// Half the bytes per attention row (`kernels::kv_element`); entries round to the nearest
    /// f16 when written, the same for every row, so speculation stays exact.
    #[default]
    F16,
    /// The projections' f32 values as computed: equal to a full-precision forward.
    F32,
}

/// Host K/V buffers in one element type.
#[derive(Debug, Clone)]
pub enum HostKv {
    /// An f32 cache.
    F32(KvBuffers<f32>),
    /// An f16 cache.
    F16(KvBuffers<f16>),
}

/// Runs `$body` with `$b` bound to the buffers, whatever their element type.
macro_rules! with_buffers {
    ($kv:expr, $b:ident => $body:expr) => {
        match $kv {
            HostKv::F32($b) => $body,
            HostKv::F16($b) => $body,
        }
    };
}

impl HostKv {
    /// Empty buffers for `capacity` positions of every pass of `model`.
    /// Errors, naming the size, where the machine lacks the memory.
    pub(super) fn new(model: &LoopedModel, capacity: usize, dtype: KvDtype) -> Result<Self> {
        Ok(match dtype {
            KvDtype::F32 => Self::F32(KvBuffers::new(&model.config, capacity)?),
            KvDtype::F16 => Self::F16(KvBuffers::new(&model.config, capacity)?),
        })
    }

    /// Stores one row's K/V at (`layer`, `pass`, `pos`): in the cache, or aside for a
    /// second candidate (where [`KvStore::swap_aside`] around its row would leave it). For a
    /// second candidate, leaves in `k`/`v` what the cache reads back, so that attending to its
    /// own entry outside the cache it sees what it would see in it; a first candidate's rows
    /// are read only from the cache, so they are left as they are (widening them back cost
    /// every step serial time for each row, on the calling thread).
    pub(super) fn store(&mut self, at: AsideSlot, second: bool, k: &mut [f32], v: &mut [f32]) {
        with_buffers!(self, b => b.store(at, second, k, v))
    }
}

/// Where entries lie in a layer's buffer ([`KvLayout::Tiles`] for every pass, one after
/// another).
#[derive(Debug, Clone, Copy)]
struct Geometry {
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Geometry {
    const LAYOUT: KvLayout = KvLayout::Tiles;

    /// Elements of one pass's cache.
    fn pass_size(self) -> usize {
        Self::LAYOUT.elements(self.capacity, self.kv_heads, self.head_dim)
    }

    fn strides(self) -> KvStrides {
        Self::LAYOUT.strides(self.kv_heads, self.head_dim)
    }

    /// Where kv head `head`'s entry at (`pass`, `pos`) starts: `pass`'s buffer, then
    /// [`KvLayout::Tiles`] within it.
    fn offset(self, pass: Pass, head: usize, pos: usize) -> usize {
        pass.index() * self.pass_size() + self.strides().offset(head, pos)
    }
}

/// One element type's buffers. A row's K/V arrives and leaves (`store`, `entries`, the aside
/// rows) as `[kv_heads · head_dim]`, and lies in the buffers one head at a time.
#[derive(Debug)]
pub struct KvBuffers<E> {
    geometry: Geometry,
    keys: Vec<ZeroedPages<E>>,
    values: Vec<ZeroedPages<E>>,
    aside: HashMap<AsideSlot, (Vec<E>, Vec<E>)>,
    /// A row's K or V narrowed, before it is placed head by head.
    narrowed: Vec<E>,
}

impl<E: KvElement> Clone for KvBuffers<E> {
    fn clone(&self) -> Self {
        Self {
            geometry: self.geometry,
            keys: self.keys.clone(),
            values: self.values.clone(),
            aside: self.aside.clone(),
            narrowed: self.narrowed.clone(),
        }
    }
}

impl<E: KvElement> KvBuffers<E> {
    fn new(cfg: &LoopedConfig, capacity: usize) -> Result<Self> {
        let (layers, kv_dim) = (cfg.layers, cfg.kv_dim());
        let geometry = Geometry {
            capacity,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
        };
        let size = cfg.passes.saturating_mul(geometry.pass_size());
        let bytes = [size, layers, 2, std::mem::size_of::<E>()]
            .into_iter()
            .fold(1usize, usize::saturating_mul);
        crate::engine::memory::check_kv_cache_room(capacity, bytes)?;
        // Pages the kernel zeroes on first touch (`ZeroedPages`): a decoder starts without
        // writing a cache it has not used yet, and a run's memory holds what it reached.
        let zeroed = || (0..layers).map(|_| ZeroedPages::new(size)).collect();
        Ok(Self {
            geometry,
            keys: zeroed(),
            values: zeroed(),
            aside: HashMap::new(),
            narrowed: vec![E::default(); kv_dim],
        })
    }

    fn kv_dim(&self) -> usize {
        self.geometry.kv_heads * self.geometry.head_dim
    }

    /// Each kv head's span of a row's `[kv_heads · head_dim]` and where it lies in a layer's
    /// buffer at (`pass`, `pos`).
    fn heads(
        &self,
        pass: Pass,
        pos: usize,
    ) -> impl Iterator<Item = (Range<usize>, usize)> + Clone + use<E> {
        let g = self.geometry;
        (0..g.kv_heads).map(move |j| (j * g.head_dim..(j + 1) * g.head_dim, g.offset(pass, j, pos)))
    }

    /// The first `len` positions of `pass` in `layer`.
    pub(super) fn pass(&self, layer: usize, pass: Pass, len: usize) -> KvView<'_, E> {
        let g = self.geometry;
        let start = g.offset(pass, 0, 0);
        let range = start..start + g.strides().extent(len);
        KvView {
            keys: &self.keys[layer][range.clone()],
            values: &self.values[layer][range],
            layout: Geometry::LAYOUT,
        }
    }

    fn store(&mut self, at: AsideSlot, second: bool, k: &mut [f32], v: &mut [f32]) {
        let (layer, pass, pos) = at;
        if second {
            let kv_dim = self.kv_dim();
            let (keys, values) = (self.aside.entry(at))
                .or_insert_with(|| (vec![E::default(); kv_dim], vec![E::default(); kv_dim]));
            for (row, stored) in [(k, keys), (v, values)] {
                E::narrow(row, stored);
                E::widen(stored, row);
            }
            return;
        }
        // Narrowed whole, then placed head by head: one conversion call per row, not one per
        // head, whose short calls (64 elements each) took more of a 4-row step's time in `perf`
        // than one call over the row.
        let heads = self.heads(pass, pos);
        let narrowed = &mut self.narrowed;
        for (row, buffer) in [(&*k, &mut self.keys[layer]), (&*v, &mut self.values[layer])] {
            E::narrow(row, narrowed);
            for (span, at) in heads.clone() {
                buffer[at..at + span.len()].copy_from_slice(&narrowed[span]);
            }
        }
    }
}

impl KvStore for HostKv {
    fn swap_aside(&mut self, layer: usize, pass: Pass, pos: usize) -> Result<()> {
        with_buffers!(self, b => {
            let kv_dim = b.kv_dim();
            let heads = b.heads(pass, pos);
            let empty = || (vec![Default::default(); kv_dim], vec![Default::default(); kv_dim]);
            let (k, v) = b.aside.entry((layer, pass, pos)).or_insert_with(empty);
            for (span, at) in heads {
                let stored = at..at + span.len();
                b.keys[layer][stored.clone()].swap_with_slice(&mut k[span.clone()]);
                b.values[layer][stored].swap_with_slice(&mut v[span]);
            }
        });
        Ok(())
    }

    fn forget_aside(&mut self, pos: usize) {
        with_buffers!(self, b => b.aside.retain(|&(_, _, p), _| p != pos))
    }

    fn copy_entry(&mut self, layer: usize, from: Pass, to: Pass, pos: usize) -> Result<()> {
        with_buffers!(self, b => {
            let pairs: Vec<(usize, usize, usize)> = (b.heads(from, pos).zip(b.heads(to, pos)))
                .map(|((span, at), (_, to))| (at, to, span.len()))
                .collect();
            for (at, to, len) in pairs {
                b.keys[layer].copy_within(at..at + len, to);
                b.values[layer].copy_within(at..at + len, to);
            }
        });
        Ok(())
    }

    fn entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        with_buffers!(self, b => {
            let kv_dim = b.kv_dim();
            let widen = |buffer: &[_]| {
                let mut out = vec![0f32; len * kv_dim];
                for (pos, row) in out.chunks_exact_mut(kv_dim).enumerate() {
                    for (span, at) in b.heads(pass, pos) {
                        KvElement::widen(&buffer[at..at + span.len()], &mut row[span]);
                    }
                }
                out
            };
            Ok((widen(&b.keys[layer]), widen(&b.values[layer])))
        })
    }

    fn layers(&self) -> usize {
        with_buffers!(self, b => b.keys.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::config::ModelShape;

    /// A row's K (or V, `which` 1) at (`layer`, `pass`, `pos`): every element its own value.
    fn row(layer: usize, pass: Pass, pos: usize, which: usize) -> Vec<f32> {
        let base = (layer * 100_000 + pass.index() * 10_000 + pos * 10 + which) as f32;
        (0..16).map(|i| base + i as f32 / 64.0).collect()
    }

    /// Rows stored at every (layer, pass, position) read back whole from `entries`, lie in
    /// tiles in the pass's view (two of them here), and a position swapped aside and back is
    /// restored.
    #[test]
    fn rows_stored_in_tiles_read_back_whole() {
        let shape = ModelShape {
            hidden: 32,
            layers: 2,
            passes: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            intermediate: 64,
            vocab: 16,
            context: 16,
            tied: true,
        };
        let (capacity, filled) = (70, 67);
        let mut kv = HostKv::F32(
            KvBuffers::new(&shape.looped(16, candle_core::DType::F32), capacity).unwrap(),
        );
        for (layer, pass, pos) in
            (0..2).flat_map(|l| Pass::all(3).flat_map(move |p| (0..filled).map(move |s| (l, p, s))))
        {
            let (mut k, mut v) = (row(layer, pass, pos, 0), row(layer, pass, pos, 1));
            kv.store((layer, pass, pos), false, &mut k, &mut v);
        }
        let HostKv::F32(buffers) = &kv else {
            unreachable!("built as f32")
        };
        for layer in 0..2 {
            for pass in Pass::all(3) {
                let (k, v) = kv.entries(layer, pass, filled).expect("entries");
                let view = buffers.pass(layer, pass, filled);
                assert_eq!(view.layout, KvLayout::Tiles);
                for pos in 0..filled {
                    assert_eq!(k[pos * 16..][..16], row(layer, pass, pos, 0));
                    assert_eq!(v[pos * 16..][..16], row(layer, pass, pos, 1));
                    for (j, d) in (0..2).flat_map(|j| (0..8).map(move |d| (j, d))) {
                        // Tiles of 64 positions, each every kv head's 64 entries in turn.
                        let at = (pos / 64 * 2 * 64 + j * 64 + pos % 64) * 8 + d;
                        assert_eq!(view.keys[at], row(layer, pass, pos, 0)[j * 8 + d]);
                    }
                }
            }
        }
        let pass = Pass::all(3).nth(1).expect("pass 2");
        kv.swap_aside(1, pass, 4).expect("aside");
        let (k, _) = kv.entries(1, pass, filled).expect("entries");
        assert!(
            k[4 * 16..][..16].iter().all(|&x| x == 0.0),
            "an empty entry swapped in"
        );
        kv.swap_aside(1, pass, 4).expect("back");
        let (k, _) = kv.entries(1, pass, filled).expect("entries");
        assert_eq!(k[4 * 16..][..16], row(1, pass, 4, 0));
    }
}
