//! A draft model in the what-if (`policy::draft_model`): the real draft model drafts during
//! the replay, reading the recorded run's text (its prompt tokenized again from the trace,
//! then the committed tokens), so its drafts are the ones a real run makes; each draft is
//! timed by the draft model's cost per token, measured here when it is loaded.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::recorded::RecordedRun;
use crate::engine::LoadedModel;
use crate::engine::drafter::{Drafter, model_drafter};
use crate::engine::error::{EngineError, Result};
use crate::engine::policy::Proposal;
use crate::engine::sampling::Sampling;

/// Tokens drafted to time the draft model.
const TIMED_DRAFTS: usize = 16;

/// The draft model a what-if drafts with, and its measured cost.
#[derive(Debug)]
pub struct WhatIfDraft {
    loaded: LoadedModel,
    /// Compute per drafted token, µs, on this machine.
    pub token_us: f64,
}

impl WhatIfDraft {
    /// `loaded` as the what-if's draft model, its cost per token measured now: the best of
    /// three rounds of drafting 16 tokens after a one-token text.
    pub fn measured(loaded: LoadedModel) -> Result<Self> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let mut drafter = model_drafter(&loaded, TIMED_DRAFTS + 2)?;
            let started = Instant::now();
            drafter.draft(&[0], TIMED_DRAFTS, &Sampling::GREEDY)?;
            best = best.min(started.elapsed().as_secs_f64() * 1e6 / TIMED_DRAFTS as f64);
        }
        Ok(Self {
            loaded,
            token_us: best,
        })
    }

    /// The prompt's ids under the draft model's tokenizer; an error unless it makes as many
    /// tokens as the run recorded.
    pub(super) fn prompt(&self, run: &RecordedRun) -> Result<Vec<u32>> {
        let ids = self.loaded.tokenizer.encode(&run.prompt)?;
        if ids.len() != run.prompt_tokens {
            return Err(EngineError::Invalid(format!(
                "the draft model's tokenizer makes {} tokens of the recorded prompt, the run had {}",
                ids.len(),
                run.prompt_tokens
            )));
        }
        Ok(ids)
    }

    /// A drafter for a run of `context` positions, and the count of the drafts it makes.
    pub(super) fn drafter(&self, context: usize) -> Result<(Box<dyn Drafter>, DraftCount)> {
        let count = DraftCount::default();
        let inner = model_drafter(&self.loaded, context)?;
        let counted = Counted {
            inner,
            count: count.clone(),
        };
        Ok((Box::new(counted), count))
    }
}

/// Drafts made, shared between a replay's drafter and the what-if that times them.
#[derive(Debug, Clone, Default)]
pub(super) struct DraftCount(Arc<AtomicUsize>);

impl DraftCount {
    pub(super) fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// A drafter that counts its drafts.
#[derive(Debug)]
struct Counted {
    inner: Box<dyn Drafter>,
    count: DraftCount,
}

impl Drafter for Counted {
    fn draft(&mut self, text: &[u32], tokens: usize, sampling: &Sampling) -> Result<Vec<Proposal>> {
        self.count.0.fetch_add(tokens, Ordering::Relaxed);
        self.inner.draft(text, tokens, sampling)
    }
}
