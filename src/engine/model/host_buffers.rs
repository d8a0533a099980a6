//! The host backend's activation buffers, recycled on the decoding thread: a step makes about
//! a dozen buffers a layer (each norm's, projection's and MLP half's output), and a kernel
//! writes every element of each, so a buffer need not be zeroed first, only be the right
//! length. Used by `model::host` alone: [`take`] where a kernel is about to overwrite a whole
//! output, [`give`] where an activation is dropped (`HostRows`' `Drop`).
//!
//! Why: `vec![0.0; n]` zeroed every output on the caller thread, where nothing else runs in
//! parallel, and the lines it zeroed had been pushed out of the caches by the weight stream
//! since their last use. On an AMD EPYC Zen 4 (2 threads, `perf record` of 4-row steps of the
//! default model) glibc's `memset` was the largest piece of the caller's serial work, about
//! 4 % of its time, and `malloc`/`free` another 1 %.
//!
//! A recycled buffer's old values never reach a result: only outputs that a kernel writes in
//! full are taken from here, and the exactness suite (`tests/exactness.rs`, `tests/threads.rs`)
//! checks every lane and row count against buffers that were used before.

use std::cell::RefCell;

/// Buffers kept per thread: more than a step has alive at once (a layer's activations and
/// the readout's), few enough that a long prompt's large buffers are not kept long.
const MOST_SPARE: usize = 16;

/// The longest buffer kept, in floats (4 MB): every decode step's fit, Ouro-1.4B's readouts
/// included; a long prompt's prefill buffers are freed, not held for the rest of the run.
const LONGEST_SPARE: usize = 1 << 20;

thread_local! {
    static SPARE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer of `len` floats whose values are left from an earlier use (or zero): for an
/// output that the caller overwrites whole. The shortest spare at least `len` long, truncated
/// (no element is written), else a new zeroed one.
pub(super) fn take(len: usize) -> Vec<f32> {
    let spare = SPARE.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        let best = (spare.iter().enumerate())
            .filter(|(_, v)| v.len() >= len)
            .min_by_key(|(_, v)| v.len())
            .map(|(i, _)| i)?;
        Some(spare.swap_remove(best))
    });
    match spare.ok().flatten() {
        Some(mut buffer) => {
            buffer.truncate(len);
            buffer
        }
        None => vec![0.0; len],
    }
}

/// Keeps `buffer` for a later [`take`] on this thread, its length restored to its capacity
/// (zeros written only past its length: nothing for a buffer that [`take`] fitted exactly).
/// Where the thread already keeps [`MOST_SPARE`], the shortest is freed; one longer than
/// [`LONGEST_SPARE`] is freed at once.
pub(super) fn give(mut buffer: Vec<f32>) {
    if buffer.capacity() == 0 || buffer.capacity() > LONGEST_SPARE {
        return;
    }
    buffer.resize(buffer.capacity(), 0.0);
    // A thread that is exiting has no spares any more: the buffer is freed.
    let _ = SPARE.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        spare.push(buffer);
        if spare.len() > MOST_SPARE {
            let shortest = (spare.iter().enumerate())
                .min_by_key(|(_, v)| v.len())
                .map(|(i, _)| i)
                .expect("the list holds MOST_SPARE + 1 buffers: this is a bug");
            spare.swap_remove(shortest);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_comes_back_at_the_length_asked_without_new_zeros() {
        give(vec![7.0; 32]);
        give(vec![5.0; 8]);
        let small = take(6);
        assert_eq!(
            (small.len(), small.capacity()),
            (6, 8),
            "the shortest that fits"
        );
        assert!(small.iter().all(|&v| v == 5.0), "left as it was");
        give(small);
        let again = take(8);
        assert_eq!(again.len(), 8, "given back at its capacity's length");
        let large = take(32);
        assert_eq!(large.len(), 32);
        let fresh = take(64);
        assert!(
            fresh.len() == 64 && fresh.iter().all(|&v| v == 0.0),
            "none fits: new zeros"
        );
    }

    #[test]
    fn a_thread_keeps_at_most_the_limit_and_drops_the_shortest() {
        for len in 1..=MOST_SPARE + 4 {
            give(vec![0.0; len]);
        }
        let kept = SPARE.with_borrow(|spare| spare.iter().map(Vec::len).collect::<Vec<_>>());
        assert_eq!(kept.len(), MOST_SPARE);
        assert!(
            kept.iter().all(|&len| len > 4),
            "the four shortest went: {kept:?}"
        );
        give(vec![0.0; LONGEST_SPARE + 1]);
        assert!(SPARE.with_borrow(|spare| spare.iter().all(|v| v.len() <= LONGEST_SPARE)));
    }
}
