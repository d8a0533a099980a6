//! Self-drafting, draft-then-verify decoding (Leviathan et al., arXiv 2211.17192, with the
//! looped model's own first passes as the draft model, as in self-speculation): the verified
//! token runs passes 1..=d and its pass-d readout drafts the next token; that one runs
//! passes 1..=d and drafts the one after, until γ drafts follow the verified token. Then the
//! γ + 1 tokens run passes d+1..=R together, one batched step per pass, and pass R checks
//! every draft at once: each kept draft is committed, the first rejected one is replaced by
//! pass R's choice and everything after it flushed, and when all γ are kept the last
//! token's pass-R readout is a bonus token.
//!
//! The draft's passes are not thrown away: a kept draft's rows 1..=d are exactly what its
//! verification needs, so a round costs γ + 1 one-row steps (the drafting) and R − d steps
//! of γ + 1 rows, and commits between 1 and γ + 1 tokens.
//!
//! The scheduler paces the window from [`Drafting`]; the proposals and the checks at pass R
//! are LoopSpec's (`policy::loopspec`) with its first depth at d: argmax checks when greedy,
//! which reproduce the baseline's text, and Leviathan's rejection rule under sampling, which
//! keeps the baseline's distribution.

use super::{Action, DraftSource, Drafting, LoopSpec, Policy, Proposal, Readout};
use crate::engine::pass::Pass;

/// Drafts `tokens` tokens (γ) from pass `depth` (d), then verifies them together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelfDraft {
    /// d: the pass whose readout drafts the next token (below R).
    pub depth: Pass,
    /// γ: drafts per round, 1 or more.
    pub tokens: usize,
}

impl SelfDraft {
    /// The draft length when a name gives none: measured fastest on the shipped model, among
    /// γ of 2, 3, 4, 6 and 8.
    pub const DEFAULT_TOKENS: usize = 3;

    /// The proposals and checks: LoopSpec's with its first proposal at the draft depth.
    fn checks(&self) -> LoopSpec {
        LoopSpec {
            d1: self.depth,
            d2: None,
        }
    }
}

impl Policy for SelfDraft {
    fn name(&self) -> &'static str {
        "self-draft"
    }

    fn check(&self, passes: usize) -> Result<(), String> {
        let depth = self.depth;
        if depth.number() >= passes {
            return Err(format!(
                "self-draft drafts at depth {depth}, but the model has only {passes} passes (the draft depth must be below R)"
            ));
        }
        Ok(())
    }

    fn reads_out(&self, pass: Pass, _passes: usize, in_flight: usize) -> bool {
        in_flight == 0 && pass == self.depth
    }

    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        self.checks().act(r, candidates)
    }

    fn keeps_baseline_sample(&self) -> bool {
        false
    }

    fn drafting(&self) -> Option<Drafting> {
        Some(Drafting {
            source: DraftSource::Passes(self.depth),
            tokens: self.tokens,
        })
    }
}

/// Reads `d=N` and `g=M` (either, both or neither, separated by `:`): the draft depth
/// (default 1) and the draft length γ (default [`SelfDraft::DEFAULT_TOKENS`]), γ ≥ 1.
pub(super) fn parse_drafting(params: &str) -> Result<(Pass, usize), String> {
    let (mut depth, mut tokens) = (None, None);
    for part in params.split(':').filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}`: expected d=N or g=M"))?;
        let duplicate = match key {
            "d" => {
                let d = value.parse::<usize>().ok().and_then(Pass::new);
                let d = d.ok_or_else(|| {
                    format!("`{part}`: the draft depth is a pass number, 1 or more")
                })?;
                depth.replace(d).is_some()
            }
            "g" => tokens.replace(draft_length(part, value)?).is_some(),
            _ => return Err(format!("`{key}`: expected d or g")),
        };
        if duplicate {
            return Err(format!("`{key}` given twice"));
        }
    }
    Ok((
        depth.unwrap_or(Pass::FIRST),
        tokens.unwrap_or(SelfDraft::DEFAULT_TOKENS),
    ))
}

/// γ from `g=M` (`part`), 1 or more.
pub(super) fn draft_length(part: &str, value: &str) -> Result<usize, String> {
    (value.parse::<usize>().ok().filter(|&n| n >= 1))
        .ok_or_else(|| format!("`{part}`: γ, the tokens drafted per round, is 1 or more"))
}
