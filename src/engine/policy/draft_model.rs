//! Draft-then-verify decoding with a separate draft model (Leviathan et al., arXiv
//! 2211.17192): a smaller model with the same tokenizer drafts γ tokens one after another
//! (`engine::drafter`), the looped model runs the verified token and the γ drafts through all
//! R passes together, one batched step per pass, and pass R checks every draft at once, as
//! in self-drafting (`policy::self_draft`): argmax checks when greedy, which reproduce the
//! baseline's text, and Leviathan's rejection rule under sampling, which keeps the baseline's
//! distribution. The draft model is attached to the loaded model (`LoadedModel::with_draft`).

use super::self_draft::draft_length;
use super::{Action, DraftSource, Drafting, LoopSpec, Policy, Proposal, Readout};
use crate::engine::pass::Pass;

/// Drafts `tokens` tokens (γ) with the draft model, then verifies them together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftModel {
    /// γ: drafts per round, 1 or more.
    pub tokens: usize,
}

impl DraftModel {
    /// The draft length when a name gives none: measured fastest on the shipped model with
    /// its shallow twin drafting, among γ of 1, 2, 3, 4 and 6. The twin agrees with the
    /// model's next token too rarely for a longer draft to pay for its drafting.
    pub const DEFAULT_TOKENS: usize = 1;
}

impl Policy for DraftModel {
    fn name(&self) -> &'static str {
        "draft"
    }

    /// Only pass R reads out: the drafts come from the other model.
    fn reads_out(&self, _pass: Pass, _passes: usize, _in_flight: usize) -> bool {
        false
    }

    /// LoopSpec's checks at pass R (its proposals are never asked for: nothing reads out
    /// before R).
    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        let checks = LoopSpec {
            d1: Pass::FIRST,
            d2: None,
        };
        checks.act(r, candidates)
    }

    fn keeps_baseline_sample(&self) -> bool {
        false
    }

    fn drafting(&self) -> Option<Drafting> {
        Some(Drafting {
            source: DraftSource::Model,
            tokens: self.tokens,
        })
    }
}

/// Reads `g=M` or nothing: γ, default [`DraftModel::DEFAULT_TOKENS`].
pub(super) fn parse_tokens(params: &str) -> Result<usize, String> {
    match params.split_once('=') {
        None if params.is_empty() => Ok(DraftModel::DEFAULT_TOKENS),
        Some(("g", value)) => draft_length(params, value),
        _ => Err(format!("`{params}`: expected g=M")),
    }
}
