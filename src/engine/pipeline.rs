//! The SPEED scheduler (speculation.md §3; Hooper et al., arXiv 2310.12072 §3), shared by every
//! policy: a window of in-flight tokens, oldest first, each at its own pass; one batched step
//! per call, then the walk from oldest to newest. The policy answers the walk's questions
//! (`engine::policy`): what a readout decides, where it starts children, and how it settles
//! the candidates in flight (keep one, or reject them all). Baseline decoding is the same
//! machine with a policy that never speculates.
//!
//! A readout may start a second candidate (policy `dual`: pass 1's runner-up when it is nearly
//! a tie), at the same position right after the first in the window. Both run pass 1 in the
//! next step; the parent's next readout settles them before anything younger exists, so the
//! window stays a chain.
//!
//! Generic over the step backend; callers hold it as an `engine::Decoder` and pull events with
//! [`Pipeline::next_event`]: a prefill event first, then one event per step, then the finish.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::decoder::DecodeOptions;
use super::error::{EngineError, Result};
use super::events::{
    Committed, DecodeEvent, FinishEvent, FinishReason, Flip, Flush, Prediction, PrefillEvent,
    RowEvent, StepEvent, Token,
};
use super::kv_cache::KvCache;
use super::model::{ReadoutKind, RowInput, RowSlot, StepBackend, StepRow, step};
use super::pass::Pass;
use super::policy::{Decision, Policy, Readout, Verdict};
use super::tokenizer::{Detokenizer, TextTokenizer};

/// A token in the pipeline window.
#[derive(Debug)]
struct InFlight<H> {
    pos: usize,
    token: u32,
    /// Its id is committed (its parent finished all R passes and agreed).
    verified: bool,
    /// Passes completed so far (a count: the rows computed for this token).
    passes_done: usize,
    hidden: Option<H>,
    /// The pass of the parent's readout that proposed this guess (speculation.md §5, γ).
    proposed_at: Pass,
    /// Proposed as the parent's runner-up (policy `dual`), for acceptance by source.
    second: bool,
    /// A second candidate not yet chosen between: it shares its position with the token
    /// before it in the window, and its KV entries are set aside.
    unchosen: bool,
}

impl<H> InFlight<H> {
    /// The pass this token runs in the next step.
    fn next_pass(&self) -> Pass {
        Pass::from_index(self.passes_done)
    }

    /// The pass it ran last, whose readout the walk is looking at.
    fn last_pass(&self) -> Pass {
        Pass::new(self.passes_done).expect("asked only of a token that ran a pass: this is a bug")
    }
}

/// Where a run is: each call of `next_event` emits the event of its phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Next: all R passes over the prompt.
    Prefill,
    /// Next: one batched step.
    Decoding,
    /// Next: the finish event, for this reason.
    Finishing(FinishReason),
    /// Every event has been emitted.
    Done,
}

/// A walked row's event, and whether the walk goes on to younger rows.
#[derive(Debug)]
enum Walked {
    GoOn(RowEvent),
    /// A flush removed the younger rows, or the run ended.
    Stop(RowEvent),
}

/// A row's logits with the policy's decision on them.
type Decided = (Vec<f32>, Decision);

/// One decoding run on backend `B`: prompt, policy, KV cache and the in-flight window.
#[derive(Debug)]
pub struct Pipeline<B: StepBackend> {
    backend: Arc<B>,
    tokenizer: Arc<TextTokenizer>,
    policy: Box<dyn Policy>,
    options: DecodeOptions,
    prompt: Vec<u32>,
    cache: KvCache<B::Kv>,
    window: VecDeque<InFlight<B::Hidden>>,
    output: Vec<u32>,
    detokenizer: Detokenizer,
    steps: u64,
    decode_compute: Duration,
    phase: Phase,
}

impl<B: StepBackend> Pipeline<B> {
    /// A run of `prompt` (token ids) on `backend`, checked to fit the context; no compute yet.
    pub fn new(
        backend: Arc<B>,
        tokenizer: Arc<TextTokenizer>,
        policy: Box<dyn Policy>,
        prompt: Vec<u32>,
        options: DecodeOptions,
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(EngineError::Prompt(
                "empty: type at least one character".into(),
            ));
        }
        let model = backend.model();
        let context = options.context.min(model.config.max_position_embeddings);
        if prompt.len() >= context {
            return Err(EngineError::Prompt(format!(
                "{} tokens do not fit the context of {context} positions",
                prompt.len()
            )));
        }
        if options.max_tokens == 0 {
            return Err(EngineError::Invalid("max tokens must be at least 1".into()));
        }
        options.sampling.check().map_err(EngineError::Invalid)?;
        let cache = KvCache::new(backend.new_store(context)?, model.passes(), context);
        Ok(Self {
            cache,
            backend,
            tokenizer,
            policy,
            options,
            prompt,
            window: VecDeque::new(),
            output: Vec::new(),
            detokenizer: Detokenizer::default(),
            steps: 0,
            decode_compute: Duration::ZERO,
            phase: Phase::Prefill,
        })
    }

    /// R, the passes.
    fn passes(&self) -> usize {
        self.backend.model().passes()
    }

    /// The policy's decision on a readout after `pass` that predicts position `pos`.
    fn decide(&self, logits: &[f32], pass: Pass, pos: usize) -> Decision {
        self.policy.decide(&Readout {
            logits,
            pass,
            pos,
            sampling: &self.options.sampling,
        })
    }

    /// The readout a commit needs: its argmax exact when greedy, every logit when sampling.
    fn commit_readout(&self) -> ReadoutKind {
        if self.options.sampling.is_greedy() {
            ReadoutKind::Argmax
        } else {
            ReadoutKind::Exact
        }
    }

    /// The readout a token needs after `pass`: a commit at pass R, a proposal where the
    /// policy speculates, none elsewhere.
    fn readout_after(&self, pass: Pass) -> ReadoutKind {
        let passes = self.passes();
        if pass.is_last(passes) {
            self.commit_readout()
        } else if self.policy.speculates_at(pass, passes) {
            ReadoutKind::Proposal
        } else {
            ReadoutKind::None
        }
    }

    /// Whether the run still decodes (it has not begun to finish).
    fn is_running(&self) -> bool {
        matches!(self.phase, Phase::Prefill | Phase::Decoding)
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Committed output ids so far.
    pub fn output(&self) -> &[u32] {
        &self.output
    }

    /// The prompt's ids.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The KV cache (tests compare it between policies).
    pub fn cache(&self) -> &KvCache<B::Kv> {
        &self.cache
    }

    /// Compute time of the decode steps so far (prefill excluded).
    pub fn decode_compute(&self) -> Duration {
        self.decode_compute
    }

    /// The next event: prefill, then steps, then one finish event; `None` after that.
    pub fn next_event(&mut self) -> Result<Option<DecodeEvent>> {
        Ok(Some(match self.phase {
            Phase::Prefill => DecodeEvent::Prefill(self.prefill()?),
            Phase::Decoding => DecodeEvent::Step(self.step()?),
            Phase::Finishing(reason) => {
                self.phase = Phase::Done;
                DecodeEvent::Finished(self.finish_event(reason))
            }
            Phase::Done => return Ok(None),
        }))
    }

    /// Stops the run early; the next event is the finish.
    pub fn cancel(&mut self) {
        if self.is_running() {
            self.phase = Phase::Finishing(FinishReason::Cancelled);
        }
    }

    fn finish_event(&mut self, reason: FinishReason) -> FinishEvent {
        FinishEvent {
            reason,
            tokens: self.output.clone(),
            text: self.tokenizer.decode(&self.output),
            text_tail: self.detokenizer.finish(&self.tokenizer),
            decode_compute: self.decode_compute,
            steps: self.steps,
        }
    }

    fn token(&self, id: u32) -> Token {
        Token {
            id,
            text: self.tokenizer.token_text(id),
        }
    }

    /// All R passes over the prompt, one batched step per pass; the last position's pass-R
    /// readout is the first output token, verified, which enters the window at pass 1.
    fn prefill(&mut self) -> Result<PrefillEvent> {
        let started = Instant::now();
        let passes = self.passes();
        let n = self.prompt.len();
        let mut inputs: Vec<RowInput<B::Hidden>> =
            self.prompt.iter().map(|&id| RowInput::Token(id)).collect();
        let mut last_logits = None;
        for pass in Pass::all(passes) {
            let rows: Vec<StepRow<B::Hidden>> = inputs
                .drain(..)
                .enumerate()
                .map(|(pos, input)| StepRow {
                    slot: RowSlot {
                        pos,
                        pass,
                        readout: match pass.is_last(passes) && pos + 1 == n {
                            true => self.commit_readout(),
                            false => ReadoutKind::None,
                        },
                        second: false,
                    },
                    input,
                })
                .collect();
            let out = step(&*self.backend, rows, &mut self.cache)?;
            inputs = out.hidden.into_iter().map(RowInput::Hidden).collect();
            last_logits = out.logits.into_iter().next_back().flatten();
        }
        let logits =
            last_logits.expect("prefill reads out the last position at pass R: this is a bug");
        let last = Pass::last(passes);
        let first = self.decide(&logits, last, n).best;
        self.phase = Phase::Decoding;
        let committed = self.commit(n, first, last, None);
        Ok(PrefillEvent {
            prompt_tokens: n,
            first: committed,
            kv: self.cache.occupancy(),
            compute: started.elapsed(),
        })
    }

    /// Appends a verified token to the output; ends the run on EOS, the token budget or a
    /// full context, else makes sure the window holds it as a verified token.
    fn commit(
        &mut self,
        pos: usize,
        id: u32,
        accepted_depth: Pass,
        child: Option<usize>,
    ) -> Committed {
        self.output.push(id);
        self.cache
            .set_committed(self.prompt.len() + self.output.len());
        let ending = if self.tokenizer.is_eos(id) {
            Some(FinishReason::EndOfText)
        } else if self.output.len() >= self.options.max_tokens {
            Some(FinishReason::MaxTokens)
        } else if pos >= self.cache.capacity() {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        if let Some(reason) = ending {
            self.phase = Phase::Finishing(reason);
        }
        let from_second = child.is_some_and(|index| self.window[index].second);
        match child {
            Some(index) => self.window[index].verified = true,
            None if self.is_running() => self.spawn(pos, id, true, accepted_depth),
            None => {}
        }
        let text_delta = self
            .detokenizer
            .push(&self.tokenizer, id)
            .unwrap_or_default();
        Committed {
            pos,
            token: self.token(id),
            accepted_depth,
            from_second,
            text_delta,
        }
    }

    /// Starts a token at `pos`; it runs pass 1 in the next step.
    fn spawn(&mut self, pos: usize, token: u32, verified: bool, proposed_at: Pass) {
        self.window.push_back(InFlight {
            pos,
            token,
            verified,
            passes_done: 0,
            hidden: None,
            proposed_at,
            second: false,
            unchosen: false,
        });
    }

    /// Starts the runner-up as a second candidate for the position just spawned.
    fn spawn_second(&mut self, pos: usize, token: u32, proposed_at: Pass) {
        self.spawn(pos, token, false, proposed_at);
        let t = self.window.back_mut().expect("just pushed: this is a bug");
        (t.second, t.unchosen) = (true, true);
    }

    /// Whether a speculative child at `pos` could ever matter: inside the context, and its own
    /// readout still needed for the token budget.
    fn may_speculate(&self, pos: usize) -> bool {
        pos < self.cache.capacity() && pos + 1 - self.prompt.len() < self.options.max_tokens
    }

    /// Drops the window from `index` on and rolls their KV entries back in every pass.
    fn flush_from(&mut self, index: usize) -> Flush {
        let flushed: Vec<InFlight<B::Hidden>> = self.window.drain(index..).collect();
        let first_pos = flushed
            .first()
            .expect("flush of an empty tail: this is a bug")
            .pos;
        Flush {
            first_pos,
            last_pos: flushed.last().map_or(first_pos, |t| t.pos),
            rows_wasted: flushed.iter().map(|t| t.passes_done).sum(),
            kv_freed_per_pass: self.cache.rollback(first_pos),
        }
    }

    /// One batched step over the whole window, then the walk from oldest to newest.
    fn step(&mut self) -> Result<StepEvent> {
        let passes = self.passes();
        let readouts: Vec<ReadoutKind> = self
            .window
            .iter()
            .map(|t| self.readout_after(t.next_pass()))
            .collect();
        let rows: Vec<StepRow<B::Hidden>> = self
            .window
            .iter_mut()
            .zip(readouts)
            .map(|(t, readout)| StepRow {
                slot: RowSlot {
                    pos: t.pos,
                    pass: t.next_pass(),
                    readout,
                    second: t.unchosen,
                },
                input: match t.hidden.take() {
                    Some(h) => RowInput::Hidden(h),
                    None => RowInput::Token(t.token),
                },
            })
            .collect();
        let slots: Vec<RowSlot> = rows.iter().map(|r| r.slot).collect();
        let started = Instant::now();
        let out = step(&*self.backend, rows, &mut self.cache)?;
        let decisions: Vec<Option<Decision>> = out
            .logits
            .iter()
            .zip(&slots)
            .map(|(l, s)| l.as_deref().map(|l| self.decide(l, s.pass, s.pos + 1)))
            .collect();
        let compute = started.elapsed();
        self.decode_compute += compute;
        self.steps += 1;
        let mut event = StepEvent {
            step: self.steps,
            rows: Vec::with_capacity(slots.len()),
            flips: Vec::new(),
            flushes: Vec::new(),
            committed: Vec::new(),
            kv: Vec::new(),
            compute,
        };
        for (t, hidden) in self.window.iter_mut().zip(out.hidden) {
            t.hidden = Some(hidden);
            t.passes_done += 1;
        }
        let readouts = out.logits.into_iter().zip(decisions);
        self.walk(readouts.map(|(l, d)| l.zip(d)).collect(), &mut event)?;
        if self.window.front().is_some_and(|t| t.passes_done == passes) {
            self.window.pop_front();
        }
        event.kv = self.cache.occupancy();
        Ok(event)
    }

    /// Step 3 of speculation.md §3: every row that ran, oldest first, until a flush removes
    /// the younger ones. `readouts` stays aligned with the window.
    fn walk(&mut self, mut readouts: Vec<Option<Decided>>, event: &mut StepEvent) -> Result<()> {
        let mut index = 0;
        while index < readouts.len() {
            let readout = readouts[index].take();
            match self.walk_row(index, readout, &mut readouts, event)? {
                Walked::GoOn(row) => event.rows.push(row),
                Walked::Stop(row) => {
                    event.rows.push(row);
                    break;
                }
            }
            index += 1;
        }
        Ok(())
    }

    /// Step 3 of speculation.md §3 for the row at `index`, which just finished its pass.
    /// Returns its event and whether the walk goes on to younger rows (not after a flush,
    /// which removed them, nor after the run ended). A candidate dropped here loses its
    /// entry in `readouts` too.
    fn walk_row(
        &mut self,
        index: usize,
        readout: Option<Decided>,
        readouts: &mut Vec<Option<Decided>>,
        event: &mut StepEvent,
    ) -> Result<Walked> {
        let passes = self.passes();
        let t = &self.window[index];
        let (pos, pass) = (t.pos, t.last_pass());
        let mut row = self.row_event(t, false);
        let Some((logits, decision)) = readout else {
            return Ok(Walked::GoOn(row));
        };
        row.prediction = Some(Prediction::describe(
            &self.tokenizer,
            &logits,
            decision.best,
        ));
        let candidates = self.candidates_of(index);
        row.checked_child = !candidates.is_empty();
        let mut go_on = true;
        if !candidates.is_empty() {
            let verdict = self.policy.settle(&decision, &candidates);
            go_on = self.apply(index, verdict, &decision, &candidates, readouts, event)?;
        }
        let surviving = self.child_of(index).map(|_| index + 1);
        if pass.is_last(passes) {
            let (token, depth) = match surviving {
                Some(child) => (self.window[child].token, self.window[child].proposed_at),
                None => (decision.best, pass),
            };
            event
                .committed
                .push(self.commit(pos + 1, token, depth, surviving));
            go_on &= self.is_running();
        } else if surviving.is_none()
            && self.policy.speculates_at(pass, passes)
            && self.may_speculate(pos + 1)
        {
            self.spawn(pos + 1, decision.best, false, pass);
            if let Some(second) = decision.second {
                self.spawn_second(pos + 1, second, pass);
            }
        }
        Ok(if go_on {
            Walked::GoOn(row)
        } else {
            Walked::Stop(row)
        })
    }

    /// Carries out the policy's verdict on the candidates of the token at `index`: a first
    /// candidate found wrong is a flip (pass < R) or a misprediction found at commit (pass
    /// R); of two candidates one leaves the window; a rejection flushes everything younger,
    /// which was computed from a wrong token. Returns whether the walk goes on.
    fn apply(
        &mut self,
        index: usize,
        verdict: Verdict,
        decision: &Decision,
        candidates: &[u32],
        readouts: &mut Vec<Option<Decided>>,
        event: &mut StepEvent,
    ) -> Result<bool> {
        let t = &self.window[index];
        if verdict != Verdict::Keep(0) {
            let new = match verdict {
                Verdict::Keep(i) => candidates[i],
                Verdict::Reject => decision.best,
            };
            event.flips.push(Flip {
                pos: t.pos + 1,
                pass: t.last_pass(),
                old: self.token(candidates[0]),
                new: self.token(new),
            });
        }
        if candidates.len() > 1 {
            self.choose_candidate(index, verdict == Verdict::Keep(1), readouts, event)?;
        }
        if verdict == Verdict::Reject {
            event.flushes.push(self.flush_from(index + 1));
            readouts.truncate(index + 1);
            return Ok(false);
        }
        Ok(true)
    }

    /// The tokens in flight for the position after the one at `index`: its child, then an
    /// unchosen second candidate.
    fn candidates_of(&self, index: usize) -> Vec<u32> {
        let first = self.child_of(index).map(|c| c.token);
        let second = self.second_candidate_of(index).map(|c| c.token);
        first.into_iter().chain(second).collect()
    }

    /// The in-flight token at the position after the one at `index`, if any.
    fn child_of(&self, index: usize) -> Option<&InFlight<B::Hidden>> {
        let pos = self.window[index].pos;
        self.window.get(index + 1).filter(|c| c.pos == pos + 1)
    }

    /// The unchosen second candidate beside the child of the token at `index`, if any.
    fn second_candidate_of(&self, index: usize) -> Option<&InFlight<B::Hidden>> {
        self.child_of(index)?;
        self.window.get(index + 2).filter(|c| c.unchosen)
    }

    /// Of the two candidates of the token at `index` keeps the second if `second_wins`,
    /// else the first (which a rejection then flushes). The other leaves the window as a
    /// dropped row.
    fn choose_candidate(
        &mut self,
        index: usize,
        second_wins: bool,
        readouts: &mut Vec<Option<Decided>>,
        event: &mut StepEvent,
    ) -> Result<()> {
        let dropped = if second_wins { index + 1 } else { index + 2 };
        if second_wins {
            self.cache.promote_second()?;
        } else {
            self.cache.drop_second();
        }
        let t = self
            .window
            .remove(dropped)
            .expect("the candidate exists: this is a bug");
        readouts.remove(dropped);
        self.window[index + 1].unchosen = false;
        event.rows.push(self.row_event(&t, true));
        Ok(())
    }

    /// The event of an in-flight token's row, before its readout is described.
    fn row_event(&self, t: &InFlight<B::Hidden>, dropped: bool) -> RowEvent {
        RowEvent {
            pos: t.pos,
            pass: t.last_pass(),
            token: self.token(t.token),
            verified: t.verified,
            second: t.second,
            dropped,
            prediction: None,
            checked_child: false,
        }
    }
}
