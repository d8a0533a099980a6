//! Shares of a pooled job that even out as it runs: each part starts on its static share
//! (`pool::share`) and takes its pieces front first; a part done with its own takes the other
//! parts' last pieces, back first. On a VM whose cores are shared with other tenants, one
//! decode thread often runs slower than the other for a while, and a static split then leaves
//! the faster one waiting at every matmul's end.
//!
//! Which thread computes a piece changes no result: every job splits work by output element
//! and each element is computed the same way wherever it runs (`pool`). A part's own pieces
//! are contiguous and taken in order, so its weight stream and its prefetches stay
//! sequential; only the last pieces of a share can move.

use std::sync::atomic::{AtomicU64, Ordering};

use super::pool::{Padded, share};

/// Pieces a part's static share is cut into at most: enough that the last ones even out a
/// slow core, few enough that each is long against the prefetch distance.
const PIECES_PER_PART: usize = 8;

/// `align`s a piece spans at least: a small model's matmul of a few microseconds keeps about
/// its static split, where a claim's cache-line round trip would be a share of its time.
const MIN_ALIGNS_PER_PIECE: usize = 4;

/// One job's claims: for each part, the pieces `front..back` of its share still unclaimed,
/// packed in one word so that owner and thief agree with one compare-and-swap.
pub(super) struct Claims {
    parts: Vec<Padded<AtomicU64>>,
    /// Pieces in all, and the units (`align` each) of the work.
    pieces: usize,
    n: usize,
    align: usize,
}

/// `front` and `back` in one word.
fn pack(front: usize, back: usize) -> u64 {
    ((front as u64) << 32) | back as u64
}

/// The word's `front` and `back`.
fn unpack(word: u64) -> (usize, usize) {
    ((word >> 32) as usize, (word & u64::from(u32::MAX)) as usize)
}

impl Claims {
    /// `n` units of work in pieces whose bounds are multiples of `align`, for `parts` parts.
    pub(super) fn new(n: usize, parts: usize, align: usize) -> Self {
        let pieces = (parts * PIECES_PER_PART)
            .min(n / (align * MIN_ALIGNS_PER_PIECE))
            .max(parts);
        let parts = (0..parts)
            .map(|p| {
                let own = share(pieces, parts, p, 1);
                Padded(AtomicU64::new(pack(own.start, own.end)))
            })
            .collect();
        Self {
            parts,
            pieces,
            n,
            align,
        }
    }

    /// The next range of units for part `part`: its own next piece, or another part's last
    /// one; `None` once every piece is claimed.
    pub(super) fn next(&self, part: usize) -> Option<std::ops::Range<usize>> {
        let count = self.parts.len();
        let piece = self
            .take(part, true)
            .or_else(|| (1..count).find_map(|k| self.take((part + k) % count, false)))?;
        Some(share(self.n, self.pieces, piece, self.align))
    }

    /// Claims the front (`own`) or the back piece of part `of`'s remaining ones.
    fn take(&self, of: usize, own: bool) -> Option<usize> {
        let slot = &self.parts[of];
        let mut word = slot.load(Ordering::Relaxed);
        loop {
            let (front, back) = unpack(word);
            if front >= back {
                return None;
            }
            let (next, piece) = match own {
                true => (pack(front + 1, back), front),
                false => (pack(front, back - 1), back - 1),
            };
            match slot.compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(piece),
                Err(seen) => word = seen,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_is_claimed_once_and_bounds_stay_aligned() {
        for (n, parts, align) in [
            (2048, 2, 16),
            (5632, 2, 16),
            (100, 3, 16),
            (7, 4, 16),
            (0, 2, 16),
        ] {
            let claims = Claims::new(n, parts, align);
            let mut seen = vec![0u8; n];
            // One part takes everything: its own pieces first, then the others' from the back.
            while let Some(range) = claims.next(parts - 1) {
                assert!(range.start % align == 0, "{range:?} starts aligned");
                assert!(
                    range.end % align == 0 || range.end == n,
                    "{range:?} ends aligned"
                );
                range.for_each(|i| seen[i] += 1);
            }
            assert!(seen.iter().all(|&c| c == 1), "n {n}, parts {parts}");
        }
    }

    #[test]
    fn parts_racing_claim_each_unit_once() {
        let (n, parts) = (49152, 2);
        let claims = Claims::new(n, parts, 16);
        let seen: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
        std::thread::scope(|s| {
            for part in 0..parts {
                let (claims, seen) = (&claims, &seen);
                s.spawn(move || {
                    while let Some(range) = claims.next(part) {
                        range.for_each(|i| {
                            seen[i].fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }
}
