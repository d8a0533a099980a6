//! The what-if oracle: a step model that answers the scheduler from a recorded greedy run
//! instead of from the weights. Each row carries whether its computation is the recorded
//! one: a row is, when its own token is the committed one (pass 1) or its previous pass was
//! (later passes), and every entry it attends to in its pass was too. That is exactly when
//! the real model would compute the committed instance's state (the step is row-invariant,
//! `harness::metrics`), so such a row reads out the recorded readout. Any other row is on a
//! branch a flush will remove; its readouts can only start or keep tokens that are flushed
//! with it, and the oracle gives them a fixed answer. Step counts under any greedy policy are
//! therefore those of a real run; rows on flushed branches may differ.

use std::collections::HashMap;

use super::recorded::RecordedRun;
use crate::engine::error::{EngineError, Result};
use crate::engine::events::Prediction;
use crate::engine::kv_cache::{KvCache, KvStore};
use crate::engine::model::{RowInput, StepModel, StepOutput, StepRow};
use crate::engine::pass::Pass;

/// Whether a row's computation so far is the recorded run's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lineage {
    pub recorded: bool,
}

/// The oracle's "K/V buffers": whether each (pass, position) entry is the recorded one, the
/// entries set aside for second candidates, and the rows of every step it ran.
#[derive(Debug, Default)]
pub struct LineageStore {
    entries: Vec<Vec<bool>>,
    aside: HashMap<(Pass, usize), bool>,
    /// Rows of each step, in order (the prefill's steps included).
    pub rows_per_step: Vec<usize>,
}

impl KvStore for LineageStore {
    fn swap_aside(&mut self, _layer: usize, pass: Pass, pos: usize) -> Result<()> {
        let aside = self.aside.entry((pass, pos)).or_insert(false);
        std::mem::swap(aside, &mut self.entries[pass.index()][pos]);
        Ok(())
    }

    fn forget_aside(&mut self, pos: usize) {
        self.aside.retain(|&(_, p), _| p != pos);
    }

    fn copy_entry(&mut self, _layer: usize, from: Pass, to: Pass, pos: usize) -> Result<()> {
        let recorded = self.entries[from.index()][pos];
        self.entries[to.index()][pos] = recorded;
        Ok(())
    }

    fn entries(&self, _layer: usize, _pass: Pass, _len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        Err(EngineError::Invalid(
            "the what-if oracle holds no K/V values".into(),
        ))
    }

    fn layers(&self) -> usize {
        1
    }
}

/// A recorded run as a step model.
#[derive(Debug)]
pub struct Oracle {
    run: RecordedRun,
}

impl Oracle {
    pub fn new(run: RecordedRun) -> Self {
        Self { run }
    }

    /// The recorded run it answers from.
    pub fn run(&self) -> &RecordedRun {
        &self.run
    }

    /// Whether the token at `pos` is the prompt's or the committed one.
    fn is_recorded(&self, pos: usize, id: u32) -> bool {
        match pos.checked_sub(self.run.prompt_tokens) {
            None => true,
            Some(i) => self.run.output.get(i) == Some(&id),
        }
    }

    /// The logits of a row at `pos` after `pass`: the recorded readout's where the row is the
    /// recorded one, a fixed answer where nothing it decides can last.
    fn logits(&self, pos: usize, pass: Pass, recorded: bool) -> Result<Vec<f32>> {
        let vocab = self.run.config.vocab;
        let next = (pos + 1).saturating_sub(self.run.prompt_tokens);
        let Some(&committed) = self.run.output.get(next).filter(|_| recorded) else {
            return Ok(one_hot(vocab, 0));
        };
        if let Some(p) = self.run.readouts.get(&(pos, pass)) {
            return Ok(logits_of(p, vocab));
        }
        if pass.is_last(self.run.config.passes) {
            return Ok(one_hot(vocab, committed));
        }
        if next + 1 >= self.run.output.len() {
            return Ok(one_hot(vocab, 0)); // the last token: nothing is proposed after it
        }
        Err(EngineError::Invalid(format!(
            "the recorded run has no pass-{pass} readout of position {pos} (policy {} does not read out there): record the run with speed or dual, which read out every pass",
            self.run.policy
        )))
    }
}

impl StepModel for Oracle {
    type Hidden = Lineage;
    type Kv = LineageStore;

    fn passes(&self) -> usize {
        self.run.config.passes
    }

    fn positions(&self) -> usize {
        self.run.config.positions
    }

    fn empty_kv(&self, capacity: usize) -> Result<LineageStore> {
        Ok(LineageStore {
            entries: vec![vec![false; capacity]; self.passes()],
            ..LineageStore::default()
        })
    }

    /// Rows in position order, so that a row sees the entries older rows of its pass write
    /// in the same step, as the real step's attention does; a second candidate's entry is
    /// written aside, as the host step writes it.
    fn run_step(
        &self,
        rows: Vec<StepRow<Lineage>>,
        cache: &mut KvCache<LineageStore>,
    ) -> Result<StepOutput<Lineage>> {
        let slots: Vec<(Pass, usize)> = rows.iter().map(|r| (r.slot.pass, r.slot.pos)).collect();
        cache.check_slots(&slots)?;
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&i| rows[i].slot.pos);
        let mut hidden = vec![Lineage { recorded: false }; rows.len()];
        let mut logits = vec![None; rows.len()];
        for i in order {
            let StepRow { slot, input } = &rows[i];
            let input_recorded = match input {
                RowInput::Token(id) => self.is_recorded(slot.pos, *id),
                RowInput::Hidden(h) => h.recorded,
            };
            if slot.second {
                cache.swap_second(0, slot.pass, slot.pos)?;
            }
            let store = cache.store_mut();
            let pass_entries = &mut store.entries[slot.pass.index()];
            let prefix = self.run.prompt_tokens.min(slot.pos)..slot.pos;
            let recorded = input_recorded && pass_entries[prefix].iter().all(|&e| e);
            pass_entries[slot.pos] = recorded;
            if slot.second {
                cache.swap_second(0, slot.pass, slot.pos)?;
            }
            hidden[i] = Lineage { recorded };
            if slot.readout.wanted() {
                logits[i] = Some(self.logits(slot.pos, slot.pass, recorded)?);
            }
        }
        for &(pass, pos) in &slots {
            cache.mark_written(pass, pos);
        }
        cache.store_mut().rows_per_step.push(rows.len());
        Ok(StepOutput {
            hidden,
            logits,
            exit_probabilities: None,
        })
    }
}

/// Logits where `id` is the argmax by a wide margin.
fn one_hot(vocab: usize, id: u32) -> Vec<f32> {
    let mut logits = vec![0.0; vocab];
    logits[id as usize] = 100.0;
    logits
}

/// Logits with a recorded readout's argmax, runner-up margin and top tokens: the best at 0,
/// the runner-up exactly `margin` below (the `dual` gate compares that difference), the rest
/// of the top at their log-probability ratios, every other token below them all.
fn logits_of(p: &Prediction, vocab: usize) -> Vec<f32> {
    let p0 = p
        .top
        .first()
        .map_or(p.prob, |r| r.prob)
        .max(f32::MIN_POSITIVE);
    let mut top = Vec::with_capacity(p.top.len());
    let mut floor = -p.margin;
    for (rank, r) in p.top.iter().enumerate().skip(1) {
        let l = match rank {
            1 => -p.margin,
            _ => (r.prob.max(f32::MIN_POSITIVE) / p0).ln().min(floor),
        };
        floor = l;
        top.push((r.token.id, l));
    }
    let mut logits = vec![floor - 1.0; vocab];
    for (id, l) in top {
        logits[id as usize] = l;
    }
    logits[p.token.id as usize] = 0.0;
    logits
}
