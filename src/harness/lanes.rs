//! Several decoders of one prompt on one thread, interleaved by compute: the lane that has
//! used the least compute so far runs its next event, so at every moment all lanes have used
//! (nearly) equal compute and a machine whose speed drifts slows them alike. The benchmark
//! (`bench`) and the dashboard's race (`race`) both drive their lanes through this.
//!
//! A lane may keep its turn for a while ([`Lanes::with_turn`]): lanes that alternate every
//! step share the caches, and a decoder running alone does not. In interleaved pairs of
//! benches, turns of 2–50 ms measured lower speedups than step-by-step turns: the memory-bound
//! baseline lost more to the other lane's cache traffic than the speculative lane did. Turns of
//! a second agreed with 2 ms but moved with the machine's drift, which short turns cancel.

use std::time::Duration;

use crate::engine::checkpoint::LoadedModel;
use crate::engine::decoder::{DecodeOptions, Decoder};
use crate::engine::error::Result;
use crate::engine::events::DecodeEvent;
use crate::engine::policy::PolicyKind;

/// One decoder and the compute it has used.
struct Lane {
    decoder: Decoder,
    /// Compute used so far, prefill included.
    used: Duration,
    done: bool,
}

/// The lanes of one prompt, one per policy, in the order given.
pub struct Lanes {
    lanes: Vec<Lane>,
    /// Compute a lane runs before another takes its turn (zero: a step at a time).
    turn: Duration,
    /// The lane whose turn it is.
    current: Option<usize>,
}

impl Lanes {
    /// One lane per policy on `prompt`; no compute yet.
    pub fn new(
        loaded: &LoadedModel,
        prompt: &str,
        policies: &[PolicyKind],
        options: DecodeOptions,
    ) -> Result<Self> {
        let lanes = policies
            .iter()
            .map(|policy| {
                Ok(Lane {
                    decoder: Decoder::new(loaded, policy.build(), prompt, options)?,
                    used: Duration::ZERO,
                    done: false,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            lanes,
            turn: Duration::ZERO,
            current: None,
        })
    }

    /// Lets a lane keep running until it is `turn` of compute ahead of the others (zero, the
    /// default: the lane behind always goes next).
    pub fn with_turn(mut self, turn: Duration) -> Self {
        self.turn = turn;
        self
    }

    /// The prompt's length in tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.lanes.first().map_or(0, |l| l.decoder.prompt().len())
    }

    /// The lane whose turn it still is, else the unfinished lane that has used the least
    /// compute, if any is unfinished.
    pub fn next_turn(&mut self) -> Option<usize> {
        let unfinished = || (self.lanes.iter().enumerate()).filter(|(_, l)| !l.done);
        if let Some(current) = self.current.filter(|&c| !self.lanes[c].done) {
            let others = unfinished().filter(|&(i, _)| i != current);
            let least = others.map(|(_, l)| l.used).min();
            if least.is_none_or(|least| self.lanes[current].used < least + self.turn) {
                return Some(current);
            }
        }
        self.current = unfinished().min_by_key(|(_, l)| l.used).map(|(i, _)| i);
        self.current
    }

    /// Whether another unfinished lane has used more compute than lane `i`: its next event
    /// only catches up.
    pub fn is_behind(&self, i: usize) -> bool {
        let used = self.lanes[i].used;
        self.lanes.iter().any(|l| !l.done && l.used > used)
    }

    /// Runs lane `i`'s next event and charges its compute; `None` once the lane has ended.
    pub fn advance(&mut self, i: usize) -> Result<Option<DecodeEvent>> {
        let lane = &mut self.lanes[i];
        let event = lane.decoder.next_event()?;
        match &event {
            Some(DecodeEvent::Prefill(p)) => lane.used += p.compute,
            Some(DecodeEvent::Step(s)) => lane.used += s.compute,
            Some(DecodeEvent::Finished(_)) => {}
            None => lane.done = true,
        }
        Ok(event)
    }
}
