//! The host backend's activation buffers, recycled on the decoding thread: a step makes about
//! a dozen buffers a layer (each norm's, projection's and MLP half's output), and a kernel
//! writes every element of each, so a buffer need not be zeroed first, only be the right
//! length. Used by `model::host` and `model::half_head`: [`take`] where a kernel is about to
//! overwrite a whole output, [`give`] where an activation is dropped (`HostRows`' `Drop`) or
//! a buffer is done with.
//!
//! Why: `vec![0.0; n]` zeroed every output on the caller thread, where nothing else runs in
//! parallel, and the lines it zeroed had been pushed out of the caches by the weight stream
//! since their last use. In `perf record` of the default model's 4-row steps, glibc's `memset`
//! was the largest piece of the caller's serial work, and `malloc`/`free` added to it.
//!
//! A recycled buffer's old values never reach a result: only outputs that a kernel writes in
//! full are taken from here, and the exactness suite (`tests/exactness.rs`, `tests/threads.rs`)
//! checks every lane and row count against buffers that were used before.

use std::cell::RefCell;

/// Buffers kept per thread: what a layer has alive at once (about eight) for each of the
/// step shapes a speculative lane alternates between (1, 4 and 5 rows), with room to spare.
const MOST_SPARE: usize = 32;

/// The longest buffer kept, in floats (1 MB): every decode step's, Ouro-1.4B's 5-row
/// readouts included; a long prompt's prefill buffers are freed, not held for the run.
const LONGEST_SPARE: usize = 1 << 18;

thread_local! {
    static SPARE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer of `len` floats whose values are left from an earlier use (or zero): for an
/// output that the caller overwrites whole. The spare of exactly that length given back last
/// (its lines the likeliest still cached), else a new zeroed one. Only an exact length is
/// reused: a longer spare cut short would have to be zeroed back to its length when given
/// back, and the next output of that length would then find none.
pub(super) fn take(len: usize) -> Vec<f32> {
    let spare = SPARE.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        let last = spare.iter().rposition(|v| v.len() == len)?;
        Some(spare.remove(last))
    });
    spare.ok().flatten().unwrap_or_else(|| vec![0.0; len])
}

/// Keeps `buffer` for a later [`take`] of its length on this thread. Where the thread
/// already keeps [`MOST_SPARE`], the one given back longest ago is freed; one longer than
/// [`LONGEST_SPARE`] is freed at once.
pub(super) fn give(buffer: Vec<f32>) {
    if buffer.is_empty() || buffer.len() > LONGEST_SPARE {
        return;
    }
    // A thread that is exiting has no spares any more: the buffer is freed.
    let _ = SPARE.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        spare.push(buffer);
        if spare.len() > MOST_SPARE {
            spare.remove(0);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_of_the_length_asked_comes_back_as_it_was() {
        give(vec![7.0; 32]);
        give(vec![5.0; 8]);
        give(vec![6.0; 8]);
        let eight = take(8);
        assert!(
            eight.len() == 8 && eight.iter().all(|&v| v == 6.0),
            "the last given back"
        );
        let six = take(6);
        assert!(
            six.len() == 6 && six.iter().all(|&v| v == 0.0),
            "no exact fit: new zeros"
        );
        assert_eq!(take(32).len(), 32);
        assert_eq!(
            SPARE.with_borrow(|spare| spare.len()),
            1,
            "the other 8 is still kept"
        );
    }

    #[test]
    fn a_thread_keeps_at_most_the_limit_and_frees_the_oldest() {
        for len in 1..=MOST_SPARE + 4 {
            give(vec![0.0; len]);
        }
        give(vec![0.0; LONGEST_SPARE + 1]);
        let kept = SPARE.with_borrow(|spare| spare.iter().map(Vec::len).collect::<Vec<_>>());
        assert_eq!(kept, (5..=MOST_SPARE + 4).collect::<Vec<_>>());
    }
}
