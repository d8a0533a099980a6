//! The decoder callers hold (the CLI, the benchmark, the dashboard's race thread): one run of
//! a policy on a loaded model. It hides which backend the model was loaded with; the run
//! itself is `pipeline::Pipeline` on that backend.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::checkpoint::LoadedModel;
use super::drafter::model_drafter;
use super::error::Result;
use super::events::DecodeEvent;
pub use super::kv_cache::DEFAULT_CONTEXT;
use super::model::{Backend, StepBackend};
use super::pass::Pass;
pub use super::pipeline::DecodeOptions;
use super::pipeline::Pipeline;
use super::policy::{DraftSource, Policy};

/// What callers ask of a run, whatever its backend.
trait Run: Send + fmt::Debug {
    fn next_event(&mut self) -> Result<Option<DecodeEvent>>;
    fn cancel(&mut self);
    fn policy_name(&self) -> &'static str;
    fn output(&self) -> &[u32];
    fn prompt(&self) -> &[u32];
    fn decode_compute(&self) -> Duration;
    fn kv_entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)>;
}

impl<B: StepBackend> Run for Pipeline<B> {
    fn next_event(&mut self) -> Result<Option<DecodeEvent>> {
        Pipeline::next_event(self)
    }
    fn cancel(&mut self) {
        Pipeline::cancel(self)
    }
    fn policy_name(&self) -> &'static str {
        Pipeline::policy_name(self)
    }
    fn output(&self) -> &[u32] {
        Pipeline::output(self)
    }
    fn prompt(&self) -> &[u32] {
        Pipeline::prompt(self)
    }
    fn decode_compute(&self) -> Duration {
        Pipeline::decode_compute(self)
    }
    fn kv_entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.cache().entries(layer, pass, len)
    }
}

/// A run on backend `B`, boxed, with `loaded`'s draft model as its drafter where the policy
/// drafts with one.
fn boxed<B: StepBackend>(
    backend: Arc<B>,
    loaded: &LoadedModel,
    policy: Box<dyn Policy>,
    prompt: Vec<u32>,
    options: DecodeOptions,
) -> Result<Box<dyn Run>> {
    let tokenizer = loaded.tokenizer.clone();
    let wants_model = (policy.drafting()).is_some_and(|d| d.source == DraftSource::Model);
    let drafter = match &loaded.draft {
        Some(draft) if wants_model => Some(model_drafter(draft, options.context)?),
        _ => None,
    };
    Ok(Box::new(Pipeline::new(
        backend, drafter, tokenizer, policy, prompt, options,
    )?))
}

/// One decoding run: pull its events with [`Decoder::next_event`]: a prefill event first,
/// then one event per step, then the finish.
#[derive(Debug)]
pub struct Decoder {
    run: Box<dyn Run>,
}

impl Decoder {
    /// Tokenizes `prompt` and checks it fits the context; no compute yet.
    pub fn new(
        loaded: &LoadedModel,
        policy: Box<dyn Policy>,
        prompt: &str,
        options: DecodeOptions,
    ) -> Result<Self> {
        let ids = loaded.tokenizer.encode(prompt)?;
        Self::from_ids(loaded, policy, ids, options)
    }

    /// As [`Decoder::new`], from token ids.
    pub fn from_ids(
        loaded: &LoadedModel,
        policy: Box<dyn Policy>,
        prompt: Vec<u32>,
        options: DecodeOptions,
    ) -> Result<Self> {
        let run = match &loaded.backend {
            Backend::Host(b) => boxed(b.clone(), loaded, policy, prompt, options)?,
            Backend::Device(b) => boxed(b.clone(), loaded, policy, prompt, options)?,
        };
        Ok(Self { run })
    }

    /// The next event: prefill, then steps, then one finish event; `None` after that.
    pub fn next_event(&mut self) -> Result<Option<DecodeEvent>> {
        self.run.next_event()
    }

    /// Stops the run early; the next event is the finish.
    pub fn cancel(&mut self) {
        self.run.cancel()
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.run.policy_name()
    }

    /// Committed output ids so far.
    pub fn output(&self) -> &[u32] {
        self.run.output()
    }

    /// The prompt's ids.
    pub fn prompt(&self) -> &[u32] {
        self.run.prompt()
    }

    /// Compute time of the decode steps so far (prefill excluded).
    pub fn decode_compute(&self) -> Duration {
        self.run.decode_compute()
    }

    /// Copies of the K and V cache entries at (`layer`, `pass`) for positions `0..len`, as
    /// f32 (tests compare them between policies).
    pub fn kv_entries(&self, layer: usize, pass: Pass, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.run.kv_entries(layer, pass, len)
    }
}
