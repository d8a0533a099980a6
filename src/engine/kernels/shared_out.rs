//! [`SharedOut`]: an output the decode threads write at disjoint elements.

use std::sync::atomic::{AtomicU32, Ordering};

/// An output that the decode threads write at disjoint elements (each its own columns of
/// every row), shared instead of split: a thread's columns are not one slice. Stores are
/// relaxed atomics, plain stores on x86-64 and aarch64; `pool::Pool::run` returning is the
/// synchronisation that makes them visible to the caller.
#[derive(Debug, Clone, Copy)]
pub struct SharedOut<'a>(&'a [AtomicU32]);

const _: () = assert!(
    std::mem::size_of::<AtomicU32>() == std::mem::size_of::<f32>()
        && std::mem::align_of::<AtomicU32>() == std::mem::align_of::<f32>()
);

impl<'a> SharedOut<'a> {
    /// `out`, writable by every thread that holds a copy while the borrow lasts.
    pub fn new(out: &'a mut [f32]) -> Self {
        let len = out.len();
        // SAFETY: AtomicU32 has f32's size and alignment (asserted above) and every bit
        // pattern is valid for both; the exclusive borrow of `out` for 'a makes this view the
        // only access to those elements while it lives (what `AtomicU32::from_mut_slice`
        // does).
        Self(unsafe { std::slice::from_raw_parts(out.as_mut_ptr() as *const AtomicU32, len) })
    }

    /// The elements from `start` on.
    pub fn from(self, start: usize) -> Self {
        Self(&self.0[start..])
    }

    /// Element `i` := `v`.
    #[inline(always)]
    pub fn set(self, i: usize, v: f32) {
        self.0[i].store(v.to_bits(), Ordering::Relaxed);
    }

    /// Elements `at..at + len`, checked to exist, as a pointer a kernel stores a vector
    /// through (this thread's elements, as for [`Self::set`]).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn span(self, at: usize, len: usize) -> *mut f32 {
        // AtomicU32 is an UnsafeCell: writing through a pointer to it is allowed.
        self.0[at..at + len].as_ptr() as *mut f32
    }

    /// `values` := the first `values.len()` elements (this thread's own writes, or ones
    /// published to it by the pool's rendezvous).
    #[inline]
    pub fn get_all(self, values: &mut [f32]) {
        for (v, o) in values.iter_mut().zip(self.0) {
            *v = f32::from_bits(o.load(Ordering::Relaxed));
        }
    }

    /// Elements `at..at + values.len()` := `values`.
    #[inline]
    pub fn set_all(self, at: usize, values: &[f32]) {
        for (o, v) in self.0[at..at + values.len()].iter().zip(values) {
            o.store(v.to_bits(), Ordering::Relaxed);
        }
    }
}
