//! The host backend's K/V buffers (`model::host`): one `[passes, capacity, kv_dim]` pair per
//! layer, in f32 or f16 ([`KvDtype`], chosen when the model is loaded), and the K/V rows set
//! aside for second candidates. The step writes rows in f32 and the attention kernels read
//! the element type they find (`kernels::KvElement`); `KvCache` (engine::kv_cache) keeps
//! the fill levels and drives `swap_aside`/`forget_aside` through [`KvStore`].

use std::collections::HashMap;

use half::f16;

use super::LoopedModel;
use crate::engine::error::Result;
use crate::engine::kernels::KvElement;
use crate::engine::kv_cache::{AsideSlot, KvStore};
use crate::engine::pass::Pass;

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
    F32(KvBuffers<f32>),
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
    pub(super) fn new(model: &LoopedModel, capacity: usize, dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F32 => Self::F32(KvBuffers::new(model, capacity)),
            KvDtype::F16 => Self::F16(KvBuffers::new(model, capacity)),
        }
    }

    /// Stores one row's K/V at (`layer`, `pass`, `pos`): in the cache, or aside for a
    /// second candidate (where [`KvStore::swap_aside`] around its row would leave it). For a
    /// second candidate, leaves in `k`/`v` what the cache reads back, so that attending to its
    /// own entry outside the cache it sees what it would see in it; a first candidate's rows
    /// are read only from the cache, so they are left as they are (widening them back cost a
    /// two-thread step ~1.5 µs a row, on the calling thread).
    pub(super) fn store(&mut self, at: AsideSlot, second: bool, k: &mut [f32], v: &mut [f32]) {
        with_buffers!(self, b => b.store(at, second, k, v))
    }
}

/// One element type's buffers.
#[derive(Debug, Clone)]
pub struct KvBuffers<E> {
    capacity: usize,
    kv_dim: usize,
    keys: Vec<Vec<E>>,
    values: Vec<Vec<E>>,
    aside: HashMap<AsideSlot, (Vec<E>, Vec<E>)>,
}

impl<E: KvElement> KvBuffers<E> {
    fn new(model: &LoopedModel, capacity: usize) -> Self {
        let cfg = &model.config;
        let (layers, kv_dim) = (cfg.num_hidden_layers, cfg.kv_dim());
        let size = cfg.total_ut_steps * capacity * kv_dim;
        Self {
            capacity,
            kv_dim,
            keys: vec![vec![E::default(); size]; layers],
            values: vec![vec![E::default(); size]; layers],
            aside: HashMap::new(),
        }
    }

    fn offset(&self, pass: Pass, pos: usize) -> usize {
        (pass.index() * self.capacity + pos) * self.kv_dim
    }

    /// The first `len` entries of `pass` in `layer`: (keys, values).
    pub(super) fn pass(&self, layer: usize, pass: Pass, len: usize) -> (&[E], &[E]) {
        let range = self.offset(pass, 0)..self.offset(pass, len);
        (&self.keys[layer][range.clone()], &self.values[layer][range])
    }

    fn store(&mut self, at: AsideSlot, second: bool, k: &mut [f32], v: &mut [f32]) {
        let (layer, pass, pos) = at;
        let kv_dim = self.kv_dim;
        let (keys, values): (&mut [E], &mut [E]) = if second {
            let (keys, values) = (self.aside.entry(at))
                .or_insert_with(|| (vec![E::default(); kv_dim], vec![E::default(); kv_dim]));
            (keys, values)
        } else {
            let at = self.offset(pass, pos);
            let range = at..at + kv_dim;
            (
                &mut self.keys[layer][range.clone()],
                &mut self.values[layer][range],
            )
        };
        for (row, stored) in [(k, keys), (v, values)] {
            E::narrow(row, stored);
            if second {
                E::widen(stored, row);
            }
        }
    }
}

impl KvStore for HostKv {
    fn swap_aside(&mut self, layer: usize, pass: Pass, pos: usize) -> Result<()> {
        with_buffers!(self, b => {
            let at = b.offset(pass, pos);
            let kv_dim = b.kv_dim;
            let empty = || (vec![Default::default(); kv_dim], vec![Default::default(); kv_dim]);
            let (k, v) = b.aside.entry((layer, pass, pos)).or_insert_with(empty);
            b.keys[layer][at..at + kv_dim].swap_with_slice(k);
            b.values[layer][at..at + kv_dim].swap_with_slice(v);
        });
        Ok(())
    }

    fn forget_aside(&mut self, pos: usize) {
        with_buffers!(self, b => b.aside.retain(|&(_, _, p), _| p != pos))
    }

    fn entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        with_buffers!(self, b => {
            let (k, v) = b.pass(layer, pass, len);
            let widen = |x: &[_]| {
                let mut out = vec![0f32; x.len()];
                KvElement::widen(x, &mut out);
                out
            };
            Ok((widen(k), widen(v)))
        })
    }

    fn layers(&self) -> usize {
        with_buffers!(self, b => b.keys.len())
    }
}
