//! Zeroed buffers whose pages the kernel zeroes when they are first touched: on Unix an
//! anonymous mapping of their own, so a large buffer that nothing has written yet costs
//! neither time nor resident memory. A decoder's KV cache is one: at Ouro-1.4B's shape and the
//! default context it is 384 MB, of which a short run writes a few percent.
//!
//! Why not a zeroed `Vec` (`calloc`): glibc serves a request from its heap wherever the heap's
//! top has room (spex keeps a large top pad, `tune_malloc` in `main`), and then clears the
//! whole block itself, touching every page before the first token.

use std::ops::{Deref, DerefMut};

/// `len` zeroed elements of `T`, in pages of their own where the system maps them (else a
/// zeroed vector).
pub struct ZeroedPages<T> {
    storage: Storage<T>,
}

enum Storage<T> {
    /// An anonymous private mapping of `len` elements, unmapped on drop.
    #[cfg(unix)]
    Mapped {
        ptr: std::ptr::NonNull<T>,
        len: usize,
    },
    /// Empty buffers, systems without `mmap`, and a failed mapping.
    Heap(Vec<T>),
}

// SAFETY: a `ZeroedPages` owns its mapping alone, as a `Vec` owns its buffer: sending or
// sharing it is sound exactly where sending or sharing the elements is.
unsafe impl<T: Send> Send for ZeroedPages<T> {}
// SAFETY: as above; `&ZeroedPages` gives only `&[T]`.
unsafe impl<T: Sync> Sync for ZeroedPages<T> {}

impl<T: bytemuck::Zeroable + Copy> ZeroedPages<T> {
    /// `len` zeroed elements.
    pub fn new(len: usize) -> Self {
        let storage = Self::mapped(len).unwrap_or_else(|| Storage::Heap(bytemuck::zeroed_vec(len)));
        Self { storage }
    }

    /// A mapping of `len` elements; `None` where there is none to make.
    #[cfg(unix)]
    fn mapped(len: usize) -> Option<Storage<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        if bytes == 0 {
            return None;
        }
        // SAFETY: a new private anonymous mapping, at an address the kernel picks: no existing
        // memory is affected. Its pages read as zeros until written.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        let ptr = std::ptr::NonNull::new(ptr.cast::<T>())?;
        Some(Storage::Mapped { ptr, len })
    }

    #[cfg(not(unix))]
    fn mapped(_: usize) -> Option<Storage<T>> {
        None
    }
}

impl<T> Deref for ZeroedPages<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.storage {
            // SAFETY: the mapping holds `len` elements, page aligned (past any `T`'s
            // alignment), zeroed or written since (only `new`, for a `Zeroable` `T`, makes one:
            // all-zero bits are a valid `T`), and lives as long as `self`.
            #[cfg(unix)]
            Storage::Mapped { ptr, len } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
            Storage::Heap(v) => v,
        }
    }
}

impl<T> DerefMut for ZeroedPages<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
            #[cfg(unix)]
            Storage::Mapped { ptr, len } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
            Storage::Heap(v) => v,
        }
    }
}

impl<T> Drop for ZeroedPages<T> {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Storage::Mapped { ptr, len } = self.storage {
            // SAFETY: the mapping `mapped` made, of this many bytes, unmapped once; no slice
            // of it outlives `self`. An error would leave the pages mapped, nothing worse.
            unsafe {
                libc::munmap(ptr.as_ptr().cast(), len * std::mem::size_of::<T>());
            }
        }
    }
}

impl<T: bytemuck::Zeroable + Copy> Clone for ZeroedPages<T> {
    fn clone(&self) -> Self {
        let mut copy = Self::new(self.len());
        copy.copy_from_slice(self);
        copy
    }
}

impl<T> std::fmt::Debug for ZeroedPages<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ZeroedPages({} elements)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_reads_zeros_keeps_what_is_written_and_clones_it() {
        for len in [0, 1, 1000, 3 << 20] {
            let mut buf = ZeroedPages::<f32>::new(len);
            assert_eq!(buf.len(), len);
            assert!(buf.iter().all(|&x| x == 0.0));
            if len > 1 {
                buf[len - 1] = 2.5;
                buf[0] = -1.0;
                let copy = buf.clone();
                assert_eq!((copy[0], copy[len - 1]), (-1.0, 2.5));
                assert_eq!(&*copy, &*buf);
            }
        }
    }
}
