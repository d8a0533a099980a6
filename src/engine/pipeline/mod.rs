//! The SPEED scheduler (Hooper et al., arXiv 2310.12072 §3), shared by every policy: a window
//! of in-flight tokens, oldest first, each at its own pass; one batched step per call, then the
//! walk from oldest to newest. The policy answers the walk's questions (`engine::policy`): what
//! a readout decides, where it starts children, and how it settles the candidates in flight
//! (keep one, or reject them all). Baseline decoding is the same machine with a policy that
//! never speculates.
//!
//! # Looped models
//!
//! A looped model applies one stack of K shared layers R times. Each application is a *pass*
//! ([`Pass`], numbered 1 to R); after every pass the final norm and the LM head give a
//! *readout*, a distribution over the next token. Pass R's readout is the model's prediction;
//! an earlier pass's is an early guess, which models trained with a loss on every pass make
//! agree with pass R most of the time. Each (pass, layer) has its own KV cache: a token at pass
//! r attends to the pass-r entries of every earlier position and its own.
//!
//! Baseline decoding runs a token through all R passes, commits pass R's choice and only then
//! starts the next token: every weight is read R times per token, and at batch 1 that reading,
//! not arithmetic, is the cost.
//!
//! # The step
//!
//! SPEED starts token t+1 from token t's *early* readout, so that up to R tokens are in flight
//! at once, token t at pass r, t+1 at pass r−1, and so on. One step:
//!
//! 1. **One batched step.** One row per in-flight token (at most R, plus second candidates)
//!    goes through the K layers together, so the shared weights are read once for all of them.
//!    Each row uses its own position for the rotary embedding and attends to its own pass's
//!    cache up to its position (`model::step`).
//! 2. **Readouts.** Each row reads out its prediction for the next position. Rows that do not
//!    need one (a token whose child already runs) skip it.
//! 3. **The walk**, oldest row first (`Pipeline::walk`). The policy turns each readout into
//!    an [`Action`]:
//!    - *pass R*: the readout is final. The next token is committed. If the child in flight was
//!      started from another guess, that is a misprediction: the child and everything younger
//!      are flushed, their KV entries rolled back in every pass, and a new child starts from
//!      the committed token.
//!    - *pass r < R, no child yet*: a child starts from the readout's guess (normally at r = 1).
//!    - *pass r < R, a child exists, and the guess changed*: a **flip**. The child and
//!      everything younger are flushed at once and a new child starts from the deeper, better
//!      guess.
//! 4. Children enter at pass 1 in the next step.
//!
//! With no flips the window holds R tokens and one commits per step, so the ideal speedup is
//! R · t(1-row step) / t(R-row step): the *ceiling* (`harness::metrics`).
//!
//! # Exactness
//!
//! Under every lossless policy a committed token is pass R's choice computed over the
//! committed prefix, so the output equals baseline decoding token for token: greedy, and
//! under seed-coupled sampling for the same seed (`engine::sampling`). That holds bit for
//! bit only if a row's arithmetic does not depend on the other rows of its step (*batch
//! invariance*): every step backend computes each output element the same way whatever the
//! number of rows (`engine::kernels`). LoopSpec verifies by rejection sampling instead and
//! is exact in distribution (`policy::loopspec`).
//! A lossy early exit (`policy::exit`) is the one exception, by design: its readout at an
//! earlier pass commits, the token's deeper passes are skipped and their KV entries filled
//! with copies, and its text is compared with the baseline's as lossy.
//!
//! # Second candidates
//!
//! A readout may start a second candidate for the next position beside the first (`dual`:
//! pass 1's near-tie runner-up; `loopspec`: the gated proposal at depth d2). It rides on its
//! parent as a side candidate, runs its passes with its KV entries set aside, and starts no
//! children; when the parent's readout keeps it, it takes the first's place and the first's
//! branch is flushed. So the window stays a chain: LoopSpec's tree of branches cut to one
//! level.
//!
//! # Draft then verify
//!
//! A drafting policy ([`Drafting`](super::policy::Drafting): γ drafts per round; Leviathan
//! et al.'s draft-then-verify) changes only which tokens run in a step and where the drafts
//! come from:
//!
//! - *From the model's own first d passes* (`self-draft`): while a token is below pass d, it
//!   alone runs and the older tokens wait; its pass-d readout drafts the next token, until γ
//!   drafts follow the verified one. The drafts' first d passes are kept, so drafting costs
//!   no extra rows.
//! - *From a draft model* (`draft`, `engine::drafter`): when the verified token waits alone
//!   at pass 1, the draft model decodes γ tokens after it, timed as part of the step, and
//!   they join it in the window.
//!
//! Then every token of the group runs the remaining passes together, γ + 1 rows at the same
//! pass, each attending to the entries its elders write in the same step, as in the
//! prefill. At pass R the walk is the one above: each readout keeps or rejects its child, a
//! rejection flushes the rest of the group, and the last token's readout commits a bonus
//! token.
//!
//! # Callers
//!
//! Generic over the step model: every step backend, and the what-if oracle that answers from
//! a recorded run (`harness::what_if`). Callers hold it as an `engine::Decoder` (or a what-if)
//! and pull events with [`Pipeline::next_event`]: a prefill event first, then one event per
//! step, then the finish.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod exit;
mod in_flight;
mod options;
mod pacing;
mod prefill;
mod report;
mod verdict;

pub use options::DecodeOptions;

use in_flight::{Decided, InFlight, Readouts};

use super::drafter::Drafter;
use super::error::{EngineError, Result};
use super::events::{Committed, DecodeEvent, FinishReason, Flush, Prediction, RowEvent, StepEvent};
use super::kv_cache::KvCache;
use super::model::{ReadoutKind, RowSlot, StepModel};
use super::pass::Pass;
use super::policy::{Action, Policy, Proposal, Readout};
use super::sampling::argmax;
use super::tokenizer::{Detokenizer, TextTokenizer};

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

impl Walked {
    /// `row`, and whether the walk goes on.
    fn after(go_on: bool, row: RowEvent) -> Self {
        match go_on {
            true => Self::GoOn(row),
            false => Self::Stop(row),
        }
    }
}

/// One decoding run on backend `B`: prompt, policy, KV cache and the in-flight window.
#[derive(Debug)]
pub struct Pipeline<B: StepModel> {
    backend: Arc<B>,
    tokenizer: Arc<TextTokenizer>,
    policy: Box<dyn Policy>,
    /// The draft model of a policy that drafts with one.
    drafter: Option<Box<dyn Drafter>>,
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

impl<B: StepModel> Pipeline<B> {
    /// A run of `prompt` (token ids) on `backend`, checked to fit the context; no compute yet.
    /// `drafter` is the draft model of a policy that drafts with one (`DraftSource::Model`).
    pub fn new(
        backend: Arc<B>,
        drafter: Option<Box<dyn Drafter>>,
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
        let context = options.context.min(backend.positions());
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
        policy
            .check(backend.passes())
            .map_err(EngineError::Invalid)?;
        exit::check_gate(policy.as_ref(), backend.has_exit_gate())?;
        if let Some(drafting) = policy.drafting() {
            let (name, rows) = (policy.name(), backend.invariant_rows());
            pacing::check_drafting(name, drafting, context, rows, drafter.is_some())?;
        }
        let cache = KvCache::new(backend.empty_kv(context)?, backend.passes(), context);
        Ok(Self {
            cache,
            backend,
            tokenizer,
            policy,
            drafter,
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
    pub(super) fn passes(&self) -> usize {
        self.backend.passes()
    }

    /// The policy's action on a readout after `pass` that predicts position `pos`, where
    /// the candidates `c` are in flight for it and the token's gate gave `lambdas` so far.
    fn act(
        &self,
        logits: &[f32],
        pass: Pass,
        pos: usize,
        c: &[Proposal],
        lambdas: &[f32],
    ) -> Action {
        let readout = Readout {
            logits,
            pass,
            passes: self.passes(),
            pos,
            sampling: &self.options.sampling,
            lambdas,
            exit_threshold: self.exit_threshold(),
        };
        self.policy.act(&readout, c)
    }

    /// The readout a commit needs: its argmax exact when greedy, every logit when sampling.
    fn commit_readout(&self) -> ReadoutKind {
        if self.options.sampling.is_greedy() {
            ReadoutKind::Argmax
        } else {
            ReadoutKind::Exact
        }
    }

    /// The readout a token needs after `pass` with `in_flight` candidates for its next
    /// position: a commit at pass R, a proposal where the policy reads out, none elsewhere.
    fn readout_after(&self, pass: Pass, in_flight: usize) -> ReadoutKind {
        let passes = self.passes();
        if pass.is_last(passes) {
            self.commit_readout()
        } else if !self.policy.reads_out(pass, passes, in_flight) {
            ReadoutKind::None
        } else if self.policy.early_exit().is_some() {
            self.commit_readout()
        } else {
            ReadoutKind::Proposal
        }
    }

    /// Whether the run still decodes (it has not begun to finish).
    fn is_running(&self) -> bool {
        matches!(self.phase, Phase::Prefill | Phase::Decoding)
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
            None if self.is_running() => {
                self.spawn(pos, Proposal::chosen(id), true, accepted_depth);
            }
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
            gate_exit: None,
        }
    }

    /// Starts a token at `pos`; it runs pass 1 in the next step.
    fn spawn(&mut self, pos: usize, proposal: Proposal, verified: bool, proposed_at: Pass) {
        let t = InFlight::new(pos, proposal, verified, proposed_at);
        self.window.push_back(t);
    }

    /// Starts a second candidate beside the first for the position after the token at
    /// `index`; it runs pass 1 in the next step.
    fn spawn_side(&mut self, index: usize, proposal: Proposal, proposed_at: Pass) {
        let pos = self.window[index].pos + 1;
        let mut side = InFlight::new(pos, proposal, false, proposed_at);
        side.second = true;
        self.window[index].side = Some(Box::new(side));
    }

    /// Whether a speculative child at `pos` could ever matter: inside the context, and its own
    /// readout still needed for the token budget.
    fn may_speculate(&self, pos: usize) -> bool {
        pos < self.cache.capacity() && pos + 1 - self.prompt.len() < self.options.max_tokens
    }

    /// Drops the window from `index` on and rolls their KV entries back in every pass: the
    /// flush, or `None` where nothing lay there.
    fn flush_from(&mut self, index: usize) -> Option<Flush> {
        let flushed: Vec<InFlight<B::Hidden>> =
            self.window.drain(index.min(self.window.len())..).collect();
        let (first, last) = (flushed.first()?.pos, flushed.last()?.pos);
        Some(Flush {
            first_pos: first,
            last_pos: last,
            rows_wasted: flushed.iter().map(InFlight::rows_done).sum(),
            kv_freed_per_pass: self.cache.rollback(first),
        })
    }

    /// One batched step over the window's tokens that run (each token's row, then the side
    /// candidates'), then the walk from oldest to newest.
    fn step(&mut self) -> Result<StepEvent> {
        let drafted = self.draft_round()?;
        let running = self.running();
        let candidates: Vec<Vec<Proposal>> = (0..self.window.len())
            .map(|i| self.candidates_of(i))
            .collect();
        let rows = self.rows(&running, &candidates);
        let slots: Vec<RowSlot> = rows.iter().map(|r| r.slot).collect();
        // The candidates each row's readout settles: its token's, by the order rows run in.
        let by_row: Vec<&[Proposal]> = (candidates.iter().zip(&running))
            .filter(|&(_, &runs)| runs)
            .map(|(c, _)| c.as_slice())
            .collect();
        let started = Instant::now();
        let out = self.backend.run_step(rows, &mut self.cache)?;
        if out.hidden.len() != slots.len() || out.logits.len() != slots.len() {
            return Err(EngineError::Invalid(format!(
                "the model's step returned {} hidden states and {} readouts for {} rows",
                out.hidden.len(),
                out.logits.len(),
                slots.len()
            )));
        }
        let lambdas = self.lambdas_by_row(&running, out.exit_probabilities.as_deref());
        let actions: Vec<Option<Action>> = (out.logits.iter().zip(&slots).enumerate())
            .map(|(k, (logits, s))| {
                let c = by_row.get(k).copied().unwrap_or_default();
                let l = lambdas.get(k).map_or(&[][..], Vec::as_slice);
                logits
                    .as_deref()
                    .map(|logits| self.act(logits, s.pass, s.pos + 1, c, l))
            })
            .collect();
        let compute = started.elapsed() + drafted;
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
        let gates = out.exit_probabilities;
        let readouts = self.take_outputs(&running, out.hidden, gates, out.logits, actions);
        self.walk(readouts, &mut event)?;
        // A verification step finishes a whole draft group at pass R; an early exit, its token.
        while self
            .window
            .front()
            .is_some_and(|t| t.is_done(self.passes()))
        {
            self.window.pop_front();
        }
        event.kv = self.cache.occupancy();
        Ok(event)
    }

    /// Hands each row's new hidden state and exit probability back to its token (in the order
    /// the step ran them: the window, then the side candidates) and returns the readouts by
    /// window entry. `hidden`, `logits` and `actions` hold one entry a row.
    fn take_outputs(
        &mut self,
        running: &[bool],
        hidden: Vec<B::Hidden>,
        gates: Option<Vec<f32>>,
        logits: Vec<Option<Vec<f32>>>,
        actions: Vec<Option<Action>>,
    ) -> Vec<Readouts> {
        let mut gates = gates.into_iter().flatten();
        let mut outputs = hidden
            .into_iter()
            .zip(logits.into_iter().zip(actions).map(|(l, a)| l.zip(a)));
        let mut take = |t: &mut InFlight<B::Hidden>, (h, readout): (B::Hidden, Option<Decided>)| {
            t.hidden = Some(h);
            t.lambdas.extend(gates.next());
            t.passes_done += 1;
            readout
        };
        let mut readouts: Vec<Readouts> = running.iter().map(|_| Readouts::default()).collect();
        let ran = (self.window.iter_mut().zip(&mut readouts).zip(running))
            .filter_map(|(t_r, &ran)| ran.then_some(t_r));
        for ((t, r), out) in ran.zip(&mut outputs) {
            r.ran = Some(t.next_pass());
            r.main = take(t, out);
        }
        let sides = (self.window.iter_mut().zip(&mut readouts))
            .filter(|(_, r)| r.ran.is_some())
            .filter_map(|(t, r)| Some((t.side.as_deref_mut()?, r)));
        for ((side, r), out) in sides.zip(&mut outputs) {
            r.side = take(side, out);
        }
        readouts
    }

    /// Step 3, the walk (module docs): every row that ran, oldest first, until a flush removes
    /// the younger ones. `readouts` stays aligned with the window. A side candidate still
    /// waiting for its parent's choice reports its row after its parent's.
    fn walk(&mut self, mut readouts: Vec<Readouts>, event: &mut StepEvent) -> Result<()> {
        let mut index = 0;
        while index < readouts.len() {
            let Some(pass) = readouts[index].ran else {
                index += 1; // a token waiting for a draft: no row, nothing to walk
                continue;
            };
            let walked = self.walk_row(index, pass, &mut readouts, event)?;
            let (Walked::GoOn(row) | Walked::Stop(row)) = &walked;
            event.rows.push(row.clone());
            let waiting = self.window.get(index).and_then(|t| t.side.as_deref());
            event
                .rows
                .extend(waiting.and_then(|side| self.last_row_event(side, false)));
            if matches!(walked, Walked::Stop(_)) {
                break;
            }
            index += 1;
        }
        Ok(())
    }

    /// The walk (module docs, step 3) for the token at `index`, which just finished `pass`:
    /// the policy's action on its readout settles, starts or commits what follows it.
    /// Returns its event and whether the walk goes on to younger rows (not after a flush,
    /// which removed them, nor after the run ended).
    fn walk_row(
        &mut self,
        index: usize,
        pass: Pass,
        readouts: &mut Vec<Readouts>,
        event: &mut StepEvent,
    ) -> Result<Walked> {
        let passes = self.passes();
        let Readouts { main, side, .. } = std::mem::take(&mut readouts[index]);
        let t = &self.window[index];
        let pos = t.pos;
        let mut row = self.row_event(t, pass, false);
        let Some((logits, action)) = main else {
            return Ok(Walked::GoOn(row));
        };
        let candidates = self.candidates_of(index);
        let shown = action.shown(&candidates).unwrap_or_else(|| argmax(&logits));
        row.prediction = Some(Prediction::describe(&self.tokenizer, &logits, shown));
        row.gate = action.gate();
        row.checked_child = matches!(action, Action::Settle(_));
        let (mut go_on, mut next) = (true, None);
        let exits = matches!(action, Action::Exit(_));
        match action {
            Action::Nothing => {}
            Action::Commit(token) | Action::Exit(token) => {
                next = Some((Proposal::chosen(token), None));
            }
            Action::Propose { first, second, .. } => next = Some((first, second)),
            Action::Gate(second) => {
                if let Some(second) = second.filter(|_| self.may_speculate(pos + 1)) {
                    self.spawn_side(index, second, pass);
                }
            }
            Action::Settle(verdict) => {
                event
                    .flips
                    .extend(self.flip(index, pass, &verdict, &candidates)?);
                let rejected_for;
                (go_on, rejected_for) = self.settle(index, verdict, side, readouts, event)?;
                next = rejected_for.map(|p| (p, None));
            }
        }
        let surviving = self.child_of(index).map(|_| index + 1);
        if exits {
            self.exit_early(index, pos, pass, event)?;
        }
        if pass.is_last(passes) || exits {
            let chosen = next.map(|(first, _)| first);
            let committed = self.commit_final(index, pass, surviving, chosen)?;
            event.committed.push(committed);
            go_on &= self.is_running();
        } else if let Some((first, second)) = next.filter(|_| surviving.is_none())
            && self.may_speculate(pos + 1)
        {
            self.spawn(pos + 1, first, false, pass);
            if let Some(second) = second {
                self.spawn_side(index, second, pass);
            }
        }
        Ok(Walked::after(go_on, row))
    }

    /// The candidates in flight for the position after the token at `index`: its child,
    /// then its side candidate.
    fn candidates_of(&self, index: usize) -> Vec<Proposal> {
        let first = self.child_of(index).map(|c| c.proposal.clone());
        let side = self.window[index].side.as_ref();
        let second = side.map(|s| s.proposal.clone());
        first.into_iter().chain(second).collect()
    }

    /// The in-flight token at the position after the one at `index`, if any.
    fn child_of(&self, index: usize) -> Option<&InFlight<B::Hidden>> {
        let pos = self.window[index].pos;
        self.window.get(index + 1).filter(|c| c.pos == pos + 1)
    }
}
