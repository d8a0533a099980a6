//! What a what-if needs of a recorded run: its committed tokens, and for each committed
//! token the readouts its own instance made at every pass it read out (the instance that
//! survived to be committed, whose every ancestor was committed too), plus the step costs the
//! run measured. Read from a trace's speculative lane.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::engine::error::{EngineError, Result};
use crate::engine::events::{DecodeEvent, FinishReason, Prediction, StepEvent};
use crate::engine::looped::LoopedConfig;
use crate::engine::pass::Pass;
use crate::engine::policy::PolicyKind;
use crate::harness::race::{Lane, RaceEvent};
use crate::harness::trace::Trace;

/// A recorded greedy run, as the what-if oracle replays it.
#[derive(Debug, Clone)]
pub struct RecordedRun {
    /// The trace it was read from, for errors.
    pub path: PathBuf,
    /// The speculative lane's policy.
    pub policy: PolicyKind,
    pub config: LoopedConfig,
    pub prompt_tokens: usize,
    /// The prompt as typed, for a draft model to read again.
    pub prompt: String,
    /// Committed token ids, in order (the first at position `prompt_tokens`).
    pub output: Vec<u32>,
    /// Why the run stopped; `None` for a trace cut short.
    pub finish: Option<FinishReason>,
    pub max_tokens: usize,
    pub context: usize,
    /// Each lane's steps.
    pub steps: HashMap<Lane, u64>,
    /// Each lane's decode compute, where the trace has the lane's finish.
    pub decode: HashMap<Lane, Duration>,
    /// (rows that ran, compute) of every recorded step of either lane.
    pub step_samples: Vec<(usize, Duration)>,
    /// The committed instance's readout at (its position, pass).
    pub readouts: HashMap<(usize, Pass), Prediction>,
}

impl RecordedRun {
    /// The run recorded in `trace` (read from `path`, named in errors). Errors unless the run
    /// was greedy.
    pub fn of(trace: &Trace, path: &Path) -> Result<Self> {
        let header = &trace.header;
        if header.policy.is_lossy() {
            return Err(EngineError::file(
                path,
                format!(
                    "what-if re-simulates lossless runs only (this run is {}, a lossy early exit: its text is not the model's)",
                    header.policy
                ),
            ));
        }
        if !header.sampling.is_greedy() {
            return Err(EngineError::file(
                path,
                "what-if re-simulates greedy runs only (this run sampled: its proposals and commits depend on the draws)",
            ));
        }
        let config = LoopedConfig::from_ouro_json(&header.model.config, path)?;
        // The re-simulation holds a few rows of logits over the vocabulary and a flag for
        // every (pass, position) of the context: sized by the trace, so checked first.
        let bytes = (config.vocab.saturating_mul(4 * 8))
            .saturating_add(config.passes.saturating_mul(header.context));
        crate::engine::memory::check_host_room(
            &format!("{}: what-if's state", path.display()),
            bytes,
        )?;
        let mut run = Self {
            path: path.to_path_buf(),
            policy: header.policy,
            config,
            prompt_tokens: 0,
            prompt: header.prompt.clone(),
            output: Vec::new(),
            finish: None,
            max_tokens: header.max_tokens,
            context: header.context,
            steps: HashMap::new(),
            decode: HashMap::new(),
            step_samples: Vec::new(),
            readouts: HashMap::new(),
        };
        let mut steps = Vec::new();
        for event in &trace.events {
            let RaceEvent::Decode { lane, event } = event else {
                continue;
            };
            run.take(*lane, event, &mut steps);
        }
        if run.output.is_empty() {
            return Err(EngineError::file(
                path,
                "the trace holds no speculative run (no prefill event)",
            ));
        }
        run.readouts = survivors(&steps, run.prompt_tokens, &run.output);
        run.check_ids(path)?;
        Ok(run)
    }

    /// Takes one event of `lane`; keeps the speculative lane's steps in `steps`.
    fn take<'a>(&mut self, lane: Lane, event: &'a DecodeEvent, steps: &mut Vec<&'a StepEvent>) {
        let speculative = lane == Lane::Speculative;
        match event {
            DecodeEvent::Prefill(p) if speculative => {
                self.prompt_tokens = p.prompt_tokens;
                self.output.push(p.first.token.id);
            }
            DecodeEvent::Step(step) => {
                self.step_samples.push((rows_run(step), step.compute));
                self.steps.insert(lane, step.step);
                if speculative {
                    self.output
                        .extend(step.committed.iter().map(|c| c.token.id));
                    steps.push(step);
                }
            }
            DecodeEvent::Finished(f) => {
                self.decode.insert(lane, f.decode_compute);
                if speculative {
                    self.finish = Some(f.reason);
                }
            }
            DecodeEvent::Prefill(_) => {}
        }
    }

    /// Errors if a token id is outside the vocabulary (a damaged trace).
    fn check_ids(&self, path: &Path) -> Result<()> {
        let vocab = self.config.vocab;
        let readouts = self
            .readouts
            .values()
            .flat_map(|p| std::iter::once(p.token.id).chain(p.top.iter().map(|r| r.token.id)));
        match self
            .output
            .iter()
            .copied()
            .chain(readouts)
            .find(|&id| id as usize >= vocab)
        {
            Some(id) => Err(EngineError::file(
                path,
                format!("token id {id} is outside the model's vocabulary of {vocab}"),
            )),
            None => Ok(()),
        }
    }

    /// The output's length in tokens.
    pub fn tokens(&self) -> usize {
        self.output.len()
    }
}

/// (rows that ran, compute) of every step `trace` recorded, in either lane, whatever its
/// policy and sampling: what `StepCosts::fit` takes.
pub fn step_samples(trace: &Trace) -> Vec<(usize, Duration)> {
    (trace.events.iter())
        .filter_map(|event| match event {
            RaceEvent::Decode {
                event: DecodeEvent::Step(step),
                ..
            } => Some((rows_run(step), step.compute)),
            _ => None,
        })
        .collect()
}

/// The rows that ran in a recorded step: those it reports, plus the tokens a flush removed
/// before the walk reached them (each ran the step). Side candidates of flushed tokens are
/// not reported and not counted.
fn rows_run(step: &StepEvent) -> usize {
    let flushed: usize = (step.flushes.iter())
        .map(|f| f.last_pos + 1 - f.first_pos)
        .sum();
    step.rows.len() + flushed
}

/// For each committed position, the readouts of the instance that was committed: its pass-1
/// row is the last pass-1 row of that token at that position (an instance is only ever
/// replaced after a flush, and its side sibling holds another token), and its later rows
/// carry the same token. Rows of other instances, dropped rows and rows without a readout
/// are skipped.
fn survivors(
    steps: &[&StepEvent],
    prompt_tokens: usize,
    output: &[u32],
) -> HashMap<(usize, Pass), Prediction> {
    let mut by_pos: HashMap<usize, Vec<(Pass, &Prediction)>> = HashMap::new();
    for row in steps.iter().flat_map(|s| &s.rows).filter(|r| !r.dropped) {
        let Some(committed) = row
            .pos
            .checked_sub(prompt_tokens)
            .and_then(|i| output.get(i))
        else {
            continue;
        };
        if row.token.id != *committed {
            continue;
        }
        let instance = by_pos.entry(row.pos).or_default();
        if row.pass == Pass::FIRST {
            instance.clear();
        }
        instance.extend(row.prediction.as_ref().map(|p| (row.pass, p)));
    }
    (by_pos.into_iter())
        .flat_map(|(pos, readouts)| {
            (readouts.into_iter()).map(move |(pass, p)| ((pos, pass), p.clone()))
        })
        .collect()
}
