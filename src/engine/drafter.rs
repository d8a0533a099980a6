//! The draft model of draft-then-verify decoding (`policy::draft_model`): a separate model
//! with the looped model's tokenizer, decoding ordinarily (all of its own passes per token)
//! with its own KV cache. The scheduler (`engine::pipeline`) asks it for a round's γ drafts
//! before the round's first step and counts its time in that step. It keeps the cache
//! entries of the text it has read; when the text it is given departs from that (a rejected
//! draft, a corrected token) it rolls back to where they part and reads on from there.

use std::fmt;
use std::sync::Arc;

use super::checkpoint::LoadedModel;
use super::error::Result;
use super::kv_cache::KvCache;
use super::model::{Backend, ReadoutKind, StepModel};
use super::policy::Proposal;
use super::sampling::{Draw, Sampling, draw};

/// A source of drafts for the scheduler.
pub trait Drafter: Send + fmt::Debug {
    /// `tokens` tokens continuing `text` (the prompt and every committed token, not empty),
    /// each with the distribution it was drawn from when sampling.
    fn draft(&mut self, text: &[u32], tokens: usize, sampling: &Sampling) -> Result<Vec<Proposal>>;
}

/// `draft` as a drafter with a cache of `context` positions, on its own backend.
pub fn model_drafter(draft: &LoadedModel, context: usize) -> Result<Box<dyn Drafter>> {
    Ok(match &draft.backend {
        Backend::Host(b) => Box::new(ModelDrafter::new(b.clone(), context)?),
        Backend::Device(b) => Box::new(ModelDrafter::new(b.clone(), context)?),
    })
}

/// A loaded model as a drafter, on its own step backend.
#[derive(Debug)]
pub struct ModelDrafter<B: StepModel> {
    backend: Arc<B>,
    cache: KvCache<B::Kv>,
    /// The tokens whose entries the cache holds, in every pass.
    read: Vec<u32>,
}

impl<B: StepModel> ModelDrafter<B> {
    /// A drafter with an empty cache of `context` positions (capped at the model's).
    pub fn new(backend: Arc<B>, context: usize) -> Result<Self> {
        let context = context.min(backend.positions());
        let cache = KvCache::new(backend.empty_kv(context)?, backend.passes(), context);
        Ok(Self {
            backend,
            cache,
            read: Vec::new(),
        })
    }

    /// Reads `tokens` on from the text read so far, through every pass; returns the last
    /// token's final readout (a proposal's: drafts may be approximate).
    fn read_on(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let logits = (self.backend).read_tokens(
            &mut self.cache,
            self.read.len(),
            tokens,
            ReadoutKind::Proposal,
        )?;
        self.read.extend_from_slice(tokens);
        self.cache.set_committed(self.read.len());
        Ok(logits)
    }
}

impl<B: StepModel> Drafter for ModelDrafter<B> {
    fn draft(&mut self, text: &[u32], tokens: usize, sampling: &Sampling) -> Result<Vec<Proposal>> {
        // Keep the entries of the text read before; the last token is read again if need be,
        // for its readout.
        let kept = (self.read.iter().zip(text))
            .take_while(|(a, b)| a == b)
            .count()
            .min(text.len().saturating_sub(1));
        self.cache.rollback(kept);
        self.read.truncate(kept);
        let mut logits = self.read_on(&text[kept..])?;
        let mut drafts: Vec<Proposal> = Vec::with_capacity(tokens);
        for i in 0..tokens {
            let proposal = propose(&logits, text.len() + i, sampling);
            if i + 1 < tokens {
                logits = self.read_on(&[proposal.token])?;
            }
            drafts.push(proposal);
        }
        Ok(drafts)
    }
}

/// The draft for position `pos`: the argmax when greedy; under sampling a draw from the
/// draft model's distribution, which it carries for the rejection test at pass R.
fn propose(logits: &[f32], pos: usize, sampling: &Sampling) -> Proposal {
    if sampling.is_greedy() {
        return Proposal::chosen(sampling.choose(logits, pos, false).best);
    }
    let q = sampling.distribution(logits);
    Proposal {
        token: draw(&q, sampling.uniform(pos, Draw::FirstProposal)),
        drawn_from: Some(Arc::from(q)),
    }
}
