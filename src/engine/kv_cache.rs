//! The KV cache of a looped model: one K and one V buffer per (pass, layer), stacked per layer
//! as `[passes, capacity, kv_dim]` so that the rows of one step, each at its own pass, read
//! their pass's slice of one buffer. Written by `model` during a step; rolled back by the
//! decoder when speculative tokens are flushed.

use candle_core::{DType, Device, Tensor};

use super::config::OuroConfig;
use super::error::{EngineError, Result};

/// Entries held in one pass's cache, split by whether their token is verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PassOccupancy {
    pub committed: usize,
    pub speculative: usize,
    pub capacity: usize,
}

/// Where the buffers live: host memory for the CPU kernels, or candle tensors on a device.
#[derive(Debug, Clone)]
enum Store {
    Host {
        keys: Vec<Vec<f32>>,
        values: Vec<Vec<f32>>,
    },
    Device {
        keys: Vec<Tensor>,
        values: Vec<Tensor>,
    },
}

/// Per-(pass, layer) KV buffers with per-pass fill levels. Pass `r` holds its positions
/// `0..len(r)` contiguously: a token at pass r has every older token's pass-r entry before it.
///
/// A second proposal (policy `dual`) puts two candidate tokens at one (pass, position). The
/// first candidate's entries sit in the buffers; the second's wait aside, one K/V row per
/// layer, until the parent's next readout picks one ([`KvCache::promote_alternate`] or
/// [`KvCache::drop_alternate`]).
#[derive(Debug, Clone)]
pub struct KvCache {
    capacity: usize,
    kv_dim: usize,
    lens: Vec<usize>,
    committed: usize,
    store: Store,
    alternate: Alternate,
}

/// The entries set aside for a second candidate: where they belong and one K/V row per layer.
#[derive(Debug, Clone)]
enum AltRows {
    Host(Vec<(Vec<f32>, Vec<f32>)>),
    Device(Vec<Option<(Tensor, Tensor)>>),
}

#[derive(Debug, Clone)]
struct Alternate {
    slot: Option<(usize, usize)>,
    rows: AltRows,
}

impl KvCache {
    /// An empty cache in host memory (f32) for the CPU kernels.
    pub fn new_host(config: &OuroConfig, capacity: usize) -> Self {
        let size = config.total_ut_steps * capacity * config.kv_dim();
        let layers = config.num_hidden_layers;
        Self::with_store(
            config,
            capacity,
            Store::Host {
                keys: vec![vec![0f32; size]; layers],
                values: vec![vec![0f32; size]; layers],
            },
        )
    }

    /// An empty cache of candle tensors `[passes·capacity, kv_dim]` per layer on `device`.
    pub fn new_device(
        config: &OuroConfig,
        capacity: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let shape = (config.total_ut_steps * capacity, config.kv_dim());
        let zeros = |_| Tensor::zeros(shape, dtype, device);
        let keys = (0..config.num_hidden_layers)
            .map(zeros)
            .collect::<candle_core::Result<_>>()?;
        let values = (0..config.num_hidden_layers)
            .map(zeros)
            .collect::<candle_core::Result<_>>()?;
        Ok(Self::with_store(
            config,
            capacity,
            Store::Device { keys, values },
        ))
    }

    fn with_store(config: &OuroConfig, capacity: usize, store: Store) -> Self {
        let (layers, kv_dim) = (config.num_hidden_layers, config.kv_dim());
        let rows = match &store {
            Store::Host { .. } => {
                AltRows::Host(vec![(vec![0.0; kv_dim], vec![0.0; kv_dim]); layers])
            }
            Store::Device { .. } => AltRows::Device(vec![None; layers]),
        };
        Self {
            capacity,
            kv_dim,
            lens: vec![0; config.total_ut_steps],
            committed: 0,
            store,
            alternate: Alternate { slot: None, rows },
        }
    }

    /// Positions each pass can hold (the context length).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Filled positions of pass `pass` (0-based).
    pub fn len(&self, pass: usize) -> usize {
        self.lens[pass]
    }

    /// True when no pass holds any entry.
    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|&l| l == 0)
    }

    /// Errors unless every (pass, position) slot of one step may be written: inside the
    /// capacity, and each pass's entries stay contiguous (a slot at most one past the pass's
    /// last entry, counting the step's own earlier positions).
    pub fn check_slots(&self, slots: &[(usize, usize)]) -> Result<()> {
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
            if pos > frontier[pass] {
                return Err(EngineError::Invalid(format!(
                    "kv cache: pass {} has {} entries, cannot write position {pos}: this is a bug",
                    pass + 1,
                    frontier[pass]
                )));
            }
            frontier[pass] = frontier[pass].max(pos + 1);
        }
        Ok(())
    }

    /// Records that `pos` at `pass` now holds an entry (after all layers wrote it).
    pub fn mark_written(&mut self, pass: usize, pos: usize) {
        self.lens[pass] = self.lens[pass].max(pos + 1);
    }

    /// Declares positions `0..positions` verified (prompt plus committed tokens).
    pub fn set_committed(&mut self, positions: usize) {
        self.committed = positions;
    }

    /// Frees every entry at position `from` or later, in every pass (a flush of speculative
    /// tokens). Returns the entries freed per pass.
    pub fn rollback(&mut self, from: usize) -> Vec<usize> {
        if self.alternate.slot.is_some_and(|(_, pos)| pos >= from) {
            self.drop_alternate();
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
    /// candidate there. The step calls it around the second candidate's row in every layer, so
    /// that the row writes and attends to its own entry in place and the first candidate's
    /// entry is back in the buffers afterwards.
    pub(crate) fn swap_alternate(&mut self, layer: usize, pass: usize, pos: usize) -> Result<()> {
        self.alternate.slot = Some((pass, pos));
        let at = self.offset(pass, pos);
        let kv_dim = self.kv_dim;
        match (&mut self.store, &mut self.alternate.rows) {
            (Store::Host { keys, values }, AltRows::Host(rows)) => {
                let (k, v) = &mut rows[layer];
                keys[layer][at..at + kv_dim].swap_with_slice(k);
                values[layer][at..at + kv_dim].swap_with_slice(v);
            }
            (Store::Device { keys, values }, AltRows::Device(rows)) => {
                let row = pass * self.capacity + pos;
                let current = (
                    keys[layer].narrow(0, row, 1)?.copy()?,
                    values[layer].narrow(0, row, 1)?.copy()?,
                );
                if let Some((k, v)) = rows[layer].take() {
                    keys[layer].slice_set(&k, 0, row)?;
                    values[layer].slice_set(&v, 0, row)?;
                }
                rows[layer] = Some(current);
            }
            _ => unreachable!("the aside rows match the store they were made for: this is a bug"),
        }
        Ok(())
    }

    /// The second candidate won: its entries replace the first's in every layer.
    pub fn promote_alternate(&mut self) -> Result<()> {
        if let Some((pass, pos)) = self.alternate.slot {
            for layer in 0..self.layers() {
                self.swap_alternate(layer, pass, pos)?;
            }
            self.drop_alternate();
        }
        Ok(())
    }

    /// The first candidate won (or both were flushed): the second's entries are forgotten.
    pub fn drop_alternate(&mut self) {
        self.alternate.slot = None;
    }

    fn layers(&self) -> usize {
        match &self.store {
            Store::Host { keys, .. } => keys.len(),
            Store::Device { keys, .. } => keys.len(),
        }
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

    fn offset(&self, pass: usize, pos: usize) -> usize {
        (pass * self.capacity + pos) * self.kv_dim
    }

    /// Host buffers of `layer`: (keys, values), each `[passes, capacity, kv_dim]`.
    pub(crate) fn host_layer(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match &self.store {
            Store::Host { keys, values } => Some((&keys[layer], &values[layer])),
            Store::Device { .. } => None,
        }
    }

    /// The first `len` host entries of `pass` in `layer`: (keys, values).
    pub(crate) fn host_pass(&self, layer: usize, pass: usize, len: usize) -> (&[f32], &[f32]) {
        let (keys, values) = self
            .host_layer(layer)
            .expect("host_pass on a device cache: this is a bug");
        let range = self.offset(pass, 0)..self.offset(pass, len);
        (&keys[range.clone()], &values[range])
    }

    /// Writes one host K/V row at (`layer`, `pass`, `pos`).
    pub(crate) fn write_host(
        &mut self,
        layer: usize,
        pass: usize,
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let at = self.offset(pass, pos);
        let kv_dim = self.kv_dim;
        match &mut self.store {
            Store::Host { keys, values } => {
                keys[layer][at..at + kv_dim].copy_from_slice(k);
                values[layer][at..at + kv_dim].copy_from_slice(v);
            }
            Store::Device { .. } => panic!("write_host on a device cache: this is a bug"),
        }
    }

    /// Device buffers of `layer`: (keys, values), each `[passes·capacity, kv_dim]`.
    pub(crate) fn device_layer(&self, layer: usize) -> Option<(&Tensor, &Tensor)> {
        match &self.store {
            Store::Device { keys, values } => Some((&keys[layer], &values[layer])),
            Store::Host { .. } => None,
        }
    }

    /// Writes one device K/V row (`[1, kv_dim]` tensors) at (`layer`, `pass`, `pos`).
    pub(crate) fn write_device(
        &mut self,
        layer: usize,
        pass: usize,
        pos: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let row = pass * self.capacity + pos;
        let (keys, values) = self
            .device_layer(layer)
            .expect("write_device on a host cache: this is a bug");
        keys.slice_set(&k.contiguous()?, 0, row)?;
        values.slice_set(&v.contiguous()?, 0, row)?;
        Ok(())
    }

    /// Copies of the K and V entries at (`layer`, `pass`) for positions `0..len`, as f32.
    pub fn entries(&self, layer: usize, pass: usize, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        match &self.store {
            Store::Host { .. } => {
                let (k, v) = self.host_pass(layer, pass, len);
                Ok((k.to_vec(), v.to_vec()))
            }
            Store::Device { keys, values } => {
                let read = |t: &Tensor| -> Result<Vec<f32>> {
                    Ok(t.narrow(0, pass * self.capacity, len)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1()?)
                };
                Ok((read(&keys[layer])?, read(&values[layer])?))
            }
        }
    }
}
