//! The KV cache of a looped model: one K and one V buffer per (pass, layer), stacked per layer
//! (`[kv_heads, passes · capacity, head_dim]` on a device; on the host each pass in tiles of
//! positions, `kernels::KvLayout::Tiles`) so that the rows of one step, each at its own pass,
//! read their pass's slice of one buffer. [`KvCache`] keeps the bookkeeping every backend shares
//! (fill levels, the committed prefix, the slot of a second candidate); the buffers are the
//! step backend's own [`KvStore`] (host memory, or candle tensors on a device). Written by
//! `model`'s step; rolled back by the decoder when speculative tokens are flushed.

use std::collections::BTreeSet;
use std::fmt;

use super::error::{EngineError, Result};
use super::pass::Pass;

/// The KV cache capacity in positions a run gets unless told otherwise (`--context`).
pub const DEFAULT_CONTEXT: usize = 512;

/// Entries held in one pass's cache, split by whether their token is verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PassOccupancy {
    /// Entries of verified tokens (prompt and committed output).
    pub committed: usize,
    /// Entries of tokens still guessed.
    pub speculative: usize,
    /// The positions the cache holds.
    pub capacity: usize,
}

/// Where a second candidate's K/V row waits aside: (layer, pass, position).
pub type AsideSlot = (usize, Pass, usize);

/// A step backend's K/V buffers, with K/V rows set aside for second candidates.
pub trait KvStore: Send + fmt::Debug {
    /// Exchanges `layer`'s entry at (`pass`, `pos`) with the entry set aside for that slot.
    fn swap_aside(&mut self, layer: usize, pass: Pass, pos: usize) -> Result<()>;
    /// Forgets every entry set aside at position `pos`.
    fn forget_aside(&mut self, pos: usize);
    /// Copies `layer`'s K and V entries at (`from`, `pos`) into (`to`, `pos`).
    fn copy_entry(&mut self, layer: usize, from: Pass, to: Pass, pos: usize) -> Result<()>;
    /// Copies of `layer`'s K and V entries at `pass` for positions `0..len`, as f32.
    fn entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)>;
    /// The layers it holds buffers for.
    fn layers(&self) -> usize;
}

/// Per-(pass, layer) KV buffers with per-pass fill levels. Pass `r` holds its positions
/// `0..len(r)` contiguously: a token at pass r has every older token's pass-r entry before it.
///
/// A second proposal (policies `dual` and `loopspec:d2=M`) puts two candidate tokens at one
/// position. The first candidate's entries sit in the buffers; the second's wait aside, one
/// K/V row per (layer, pass it ran), until its parent's readout picks one
/// ([`KvCache::promote_second`] or [`KvCache::drop_second`]). Several positions can hold a
/// second candidate at once.
#[derive(Debug, Clone)]
pub struct KvCache<S> {
    capacity: usize,
    lens: Vec<usize>,
    committed: usize,
    /// The (position, pass) slots whose second candidate's entries are set aside.
    seconds: BTreeSet<(usize, Pass)>,
    store: S,
}

impl<S: KvStore> KvCache<S> {
    /// An empty cache of `capacity` positions per pass over `store`.
    pub fn new(store: S, passes: usize, capacity: usize) -> Self {
        Self {
            capacity,
            lens: vec![0; passes],
            committed: 0,
            seconds: BTreeSet::new(),
            store,
        }
    }

    /// Positions each pass can hold (the context length).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Filled positions of pass `pass`.
    pub fn len(&self, pass: Pass) -> usize {
        self.lens[pass.index()]
    }

    /// True when no pass holds any entry.
    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|&l| l == 0)
    }

    /// The backend's buffers.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The backend's buffers, for a step to write.
    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    /// Errors unless every (pass, position) slot of one step may be written: inside the
    /// capacity, and each pass's entries stay contiguous (a slot at most one past the pass's
    /// last entry, counting the step's own earlier positions).
    pub fn check_slots(&self, slots: &[(Pass, usize)]) -> Result<()> {
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        let mut frontier = self.lens.clone();
        for (pass, pos) in sorted {
            if pos >= self.capacity {
                return Err(EngineError::CacheFull {
                    position: pos,
                    capacity: self.capacity,
                });
            }
            let filled = &mut frontier[pass.index()];
            if pos > *filled {
                return Err(EngineError::Invalid(format!(
                    "kv cache: pass {pass} has {filled} entries, cannot write position {pos}: this is a bug"
                )));
            }
            *filled = (*filled).max(pos + 1);
        }
        Ok(())
    }

    /// Records that `pos` at `pass` now holds an entry (after all layers wrote it).
    pub fn mark_written(&mut self, pass: Pass, pos: usize) {
        let len = &mut self.lens[pass.index()];
        *len = (*len).max(pos + 1);
    }

    /// Fills the entries a token at `pos` skipped by stopping after pass `exited_at` (a lossy
    /// early exit, `policy::exit`): every deeper pass gets a copy of its pass-`exited_at` K/V
    /// entries in every layer, so later tokens find an entry for it at every pass. Each deeper
    /// pass must hold exactly the positions before `pos`; nothing is written unless all do.
    pub fn fill_skipped(&mut self, pos: usize, exited_at: Pass) -> Result<()> {
        let deeper = exited_at.number()..self.lens.len();
        if let Some(index) = deeper.clone().find(|&index| self.lens[index] != pos) {
            return Err(EngineError::Invalid(format!(
                "kv cache: pass {} has {} entries, cannot fill position {pos}: this is a bug",
                Pass::from_index(index),
                self.lens[index]
            )));
        }
        for index in deeper {
            let to = Pass::from_index(index);
            for layer in 0..self.store.layers() {
                self.store.copy_entry(layer, exited_at, to, pos)?;
            }
            self.lens[index] = pos + 1;
        }
        Ok(())
    }

    /// Declares positions `0..positions` verified (prompt plus committed tokens).
    pub fn set_committed(&mut self, positions: usize) {
        self.committed = positions;
    }

    /// Frees every entry at position `from` or later, in every pass (a flush of speculative
    /// tokens). Returns the entries freed per pass.
    pub fn rollback(&mut self, from: usize) -> Vec<usize> {
        let dropped: BTreeSet<usize> = self
            .seconds
            .range((from, Pass::FIRST)..)
            .map(|&(pos, _)| pos)
            .collect();
        for pos in dropped {
            self.drop_second(pos);
        }
        self.lens
            .iter_mut()
            .map(|len| {
                let freed = len.saturating_sub(from);
                *len -= freed;
                freed
            })
            .collect()
    }

    /// Exchanges `layer`'s entry at (`pass`, `pos`) with the entry set aside for a second
    /// candidate there. The what-if oracle calls it around a second candidate's row, so that
    /// the row sees its own entry in place and the first candidate's is back afterwards (the
    /// step backends write a second candidate's entry aside and call [`KvCache::note_second`]).
    pub(crate) fn swap_second(&mut self, layer: usize, pass: Pass, pos: usize) -> Result<()> {
        self.seconds.insert((pos, pass));
        self.store.swap_aside(layer, pass, pos)
    }

    /// Records that the second candidate at (`pass`, `pos`) has entries set aside, for a store
    /// that wrote them aside itself (the device step writes a second candidate's K/V straight
    /// to the aside slot instead of swapping it around the row).
    pub(crate) fn note_second(&mut self, pass: Pass, pos: usize) {
        self.seconds.insert((pos, pass));
    }

    /// The second candidate at `pos`, which ran `passes_done` passes, won: its entries replace
    /// the first candidate's in every layer, and what the first candidate's branch wrote
    /// beyond them (later positions, deeper passes at `pos`) is freed. Returns the entries
    /// freed per pass.
    pub fn promote_second(&mut self, pos: usize, passes_done: usize) -> Result<Vec<usize>> {
        let freed = self
            .lens
            .iter_mut()
            .enumerate()
            .map(|(index, len)| {
                let keep = if index < passes_done { pos + 1 } else { pos };
                let freed = len.saturating_sub(keep);
                *len -= freed;
                freed
            })
            .collect();
        let passes: Vec<Pass> = self
            .seconds
            .range((pos, Pass::FIRST)..(pos + 1, Pass::FIRST))
            .map(|&(_, pass)| pass)
            .collect();
        for pass in passes {
            for layer in 0..self.store.layers() {
                self.store.swap_aside(layer, pass, pos)?;
            }
        }
        self.drop_second(pos);
        Ok(freed)
    }

    /// The first candidate at `pos` won (or both were flushed): the second's entries are
    /// forgotten.
    pub fn drop_second(&mut self, pos: usize) {
        self.seconds.retain(|&(p, _)| p != pos);
        self.store.forget_aside(pos);
    }

    /// Committed and speculative entries per pass.
    pub fn occupancy(&self) -> Vec<PassOccupancy> {
        self.lens
            .iter()
            .map(|&len| PassOccupancy {
                committed: len.min(self.committed),
                speculative: len.saturating_sub(self.committed),
                capacity: self.capacity,
            })
            .collect()
    }

    /// Copies of the K and V entries at (`layer`, `pass`) for positions `0..len`, as f32.
    pub fn entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.store.entries(layer, pass, len)
    }
}
