//! LoopSpec (Cho et al., arXiv 2609.17184): a first proposal drawn at depth
//! d1, a gated second proposal from the residual at depth d2, and a cascade of rejection tests
//! at depth R with a residual fallback. Lossless in distribution for any proposals (Leviathan
//! et al. 2023): the committed token is a sample of the model's pass-R distribution under the
//! run's temperature and filters, though not the baseline's sample for the same seed. Greedy,
//! it reduces to argmax checks at pass R and reproduces the baseline's text.
//!
//! Unlike SPEED, candidates are checked only at pass R, not after every pass.

use std::sync::Arc;

use super::{Action, Policy, Proposal, Readout, Verdict};
use crate::engine::pass::Pass;
use crate::engine::sampling::{Draw, draw, residual};

/// LoopSpec with first proposals at depth `d1` and, if set, gated second proposals at `d2`.
#[derive(Debug, Clone, Copy)]
pub struct LoopSpec {
    /// The depth first proposals are drawn at (below R).
    pub d1: Pass,
    /// The depth gated second proposals are drawn at (below R); `None`: no second proposals.
    pub d2: Option<Pass>,
}

impl Policy for LoopSpec {
    fn name(&self) -> &'static str {
        "loopspec"
    }

    fn check(&self, passes: usize) -> Result<(), String> {
        let deepest = self.d2.unwrap_or(self.d1);
        if deepest.number() >= passes {
            return Err(format!(
                "loopspec proposes at depth {deepest}, but the model has only {passes} passes (depths must be below R)"
            ));
        }
        Ok(())
    }

    fn reads_out(&self, pass: Pass, _passes: usize, in_flight: usize) -> bool {
        match in_flight {
            0 => pass >= self.d1,
            1 => Some(pass) == self.d2,
            _ => false,
        }
    }

    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        if r.sampling.is_greedy() {
            self.greedy(r, candidates)
        } else {
            self.sampled(r, candidates)
        }
    }

    fn keeps_baseline_sample(&self) -> bool {
        false
    }
}

impl LoopSpec {
    /// Speculation.md §4, greedy: x1 == argmax p_R? else x2 == argmax p_R? else commit argmax
    /// p_R and restart. The gate opens when pass d2's argmax is not x1 (a one-hot q1's
    /// residual is pass d2's argmax).
    fn greedy(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        let best = r.sampling.choose(r.logits, r.pos, false).best;
        match candidates {
            [] if r.is_last() => Action::Commit(best),
            [] => Action::Propose {
                first: Proposal::chosen(best),
                second: None,
                gated: false,
            },
            _ if r.is_last() => Action::Settle(
                candidates
                    .iter()
                    .position(|c| c.token == best)
                    .map_or(Verdict::Reject(Proposal::chosen(best)), Verdict::Keep),
            ),
            [first] if Some(r.pass) == self.d2 => {
                Action::Gate((first.token != best).then(|| Proposal::chosen(best)))
            }
            _ => Action::Nothing,
        }
    }

    /// Speculation.md §4 under sampling: proposals drawn from their pass's distribution,
    /// the gate and the second proposal from the residual, the cascade at pass R.
    fn sampled(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        let s = r.sampling;
        let p = s.distribution(r.logits);
        match candidates {
            [] if r.is_last() => Action::Commit(draw(&p, s.uniform(r.pos, Draw::Residual))),
            [] => Action::Propose {
                first: drawn(p, s.uniform(r.pos, Draw::FirstProposal)),
                second: None,
                gated: false,
            },
            _ if r.is_last() => Action::Settle(cascade(r, &p, candidates)),
            [first] if Some(r.pass) == self.d2 => {
                // Gate: only if p_d2(x1) < q1(x1); then x2 ~ normalise(max(p_d2 − q1, 0)).
                let q1 = distribution_of(first, p.len());
                let x1 = first.token as usize;
                let second = (p[x1] < q1[x1])
                    .then(|| residual(&p, &q1))
                    .flatten()
                    .map(|q2| drawn(q2, s.uniform(r.pos, Draw::SecondProposal)));
                Action::Gate(second)
            }
            _ => Action::Nothing,
        }
    }
}

/// The cascade of rejection tests at pass R: accept x1 with probability
/// min(1, p(x1)/q1(x1)); else accept x2 against ρ1 = normalise(max(p − q1, 0)) with
/// probability min(1, ρ1(x2)/q2(x2)); else draw from normalise(max(ρ1 − q2, 0)), or from ρ1
/// when there was no second proposal.
fn cascade(r: &Readout, p: &[f32], candidates: &[Proposal]) -> Verdict {
    let s = r.sampling;
    let first = &candidates[0];
    let q1 = distribution_of(first, p.len());
    let x1 = first.token as usize;
    if s.uniform(r.pos, Draw::AcceptFirst) * f64::from(q1[x1]) < f64::from(p[x1]) {
        return Verdict::Keep(0);
    }
    let rho1 = residual(p, &q1).unwrap_or_else(|| p.to_vec());
    let rest = match candidates.get(1) {
        Some(second) => {
            let q2 = distribution_of(second, p.len());
            let x2 = second.token as usize;
            if s.uniform(r.pos, Draw::AcceptSecond) * f64::from(q2[x2]) < f64::from(rho1[x2]) {
                return Verdict::Keep(1);
            }
            residual(&rho1, &q2).unwrap_or(rho1)
        }
        None => rho1,
    };
    Verdict::Reject(Proposal::chosen(draw(
        &rest,
        s.uniform(r.pos, Draw::Residual),
    )))
}

/// A token drawn from `q` at `u`, carrying `q` for its verification.
fn drawn(q: Vec<f32>, u: f64) -> Proposal {
    Proposal {
        token: draw(&q, u),
        drawn_from: Some(Arc::from(q)),
    }
}

/// The distribution a proposal was drawn from; a deterministic choice's is one-hot.
fn distribution_of(proposal: &Proposal, vocab: usize) -> Arc<[f32]> {
    proposal.drawn_from.clone().unwrap_or_else(|| {
        let mut one_hot = vec![0f32; vocab];
        one_hot[proposal.token as usize] = 1.0;
        Arc::from(one_hot)
    })
}

/// Reads `d1=N` and `d2=M` (either, both or neither, separated by `:`): d1 ≥ 1 (default 1),
/// d2 > d1 if given.
pub(super) fn parse_depths(params: &str) -> Result<(Pass, Option<Pass>), String> {
    let (mut d1, mut d2) = (None, None);
    for part in params.split(':').filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}`: expected d1=N or d2=M"))?;
        let depth = value
            .parse::<usize>()
            .ok()
            .and_then(Pass::new)
            .ok_or_else(|| format!("`{part}`: a depth is a pass number, 1 or more"))?;
        let slot = match key {
            "d1" => &mut d1,
            "d2" => &mut d2,
            _ => return Err(format!("`{key}`: expected d1 or d2")),
        };
        if slot.replace(depth).is_some() {
            return Err(format!("`{key}` given twice"));
        }
    }
    let d1 = d1.unwrap_or(Pass::FIRST);
    match d2 {
        Some(d2) if d2 <= d1 => Err(format!(
            "the second proposal's depth d2={d2} must be deeper than d1={d1}"
        )),
        _ => Ok((d1, d2)),
    }
}
