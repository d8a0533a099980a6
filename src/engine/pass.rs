//! The one pass convention: a pass of the K shared layers is numbered 1 to R, as in
//! the papers (`engine::pipeline`, "Looped models"). Events, policies, the scheduler, the step and the KV cache
//! all take a [`Pass`]; only per-pass arrays and buffers see its 0-based [`Pass::index`].

use std::fmt;

use serde::{Deserialize, Serialize};

/// A pass number, 1-based: pass 1 is the first application of the K layers, pass R the last.
/// Serialises as its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "usize", try_from = "usize")]
pub struct Pass(usize);

impl From<Pass> for usize {
    fn from(pass: Pass) -> Self {
        pass.0
    }
}

impl TryFrom<usize> for Pass {
    type Error = &'static str;

    /// Pass numbers start at 1.
    fn try_from(number: usize) -> Result<Self, Self::Error> {
        Self::new(number).ok_or("a pass number is 1 or more")
    }
}

impl Pass {
    /// Pass 1.
    pub const FIRST: Self = Self(1);

    /// Pass `number`, or `None` for 0 (there is no pass 0).
    pub fn new(number: usize) -> Option<Self> {
        (number > 0).then_some(Self(number))
    }

    /// The pass stored at 0-based `index` of a per-pass array.
    pub fn from_index(index: usize) -> Self {
        Self(index + 1)
    }

    /// Its number, 1 to R.
    pub fn number(self) -> usize {
        self.0
    }

    /// Its 0-based slot in per-pass arrays and KV buffers.
    pub fn index(self) -> usize {
        self.0 - 1
    }

    /// The pass after this one.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// Whether this is pass R of a model with `passes` passes.
    pub fn is_last(self, passes: usize) -> bool {
        self.0 == passes
    }

    /// Pass R of a model with `passes` passes (at least 1).
    pub fn last(passes: usize) -> Self {
        Self(passes.max(1))
    }

    /// Passes 1 to `passes`, in order.
    pub fn all(passes: usize) -> impl DoubleEndedIterator<Item = Self> {
        (1..=passes).map(Self)
    }
}

impl fmt::Display for Pass {
    /// Its number, with the formatter's width and alignment.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_indices_are_one_apart() {
        assert_eq!(Pass::FIRST.number(), 1);
        assert_eq!(Pass::FIRST.index(), 0);
        assert_eq!(Pass::from_index(3), Pass::new(4).expect("pass 4"));
        assert_eq!(Pass::new(0), None);
        assert!(Pass::new(4).expect("pass 4").is_last(4));
        assert_eq!(
            Pass::all(3).map(Pass::number).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!(
            serde_json::to_string(&Pass::FIRST.next()).expect("json"),
            "2"
        );
    }
}
