//! Decoding policies: where a token's readouts start children and get re-checked. The
//! scheduler in `pipeline` is the same for every policy; a policy only answers questions.

use std::fmt;

/// What a policy decides for the scheduler.
pub trait Policy: Send + Sync + fmt::Debug {
    /// Its name in the CLI, events and the dashboard.
    fn name(&self) -> &'static str;

    /// Whether a token's readout after `pass` (1-based, < `passes`) starts or re-checks its
    /// child. Pass `passes` (R) always commits and needs no permission.
    fn speculates_at(&self, pass: usize, passes: usize) -> bool;
}

/// Ordinary greedy decoding: one token at a time through all R passes, then commit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Baseline;

impl Policy for Baseline {
    fn name(&self) -> &'static str {
        "baseline"
    }

    fn speculates_at(&self, _pass: usize, _passes: usize) -> bool {
        false
    }
}

/// SPEED (Hooper et al., arXiv 2310.12072; speculation.md §3): a child starts from the first
/// readout at or after `first_pass` and is re-checked after every deeper pass.
#[derive(Debug, Clone, Copy)]
pub struct Speed {
    pub first_pass: usize,
}

impl Default for Speed {
    fn default() -> Self {
        Self { first_pass: 1 }
    }
}

impl Policy for Speed {
    fn name(&self) -> &'static str {
        "speed"
    }

    fn speculates_at(&self, pass: usize, passes: usize) -> bool {
        pass >= self.first_pass && pass < passes
    }
}

/// The policies the CLI and the dashboard can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    Speed,
    Baseline,
}

impl PolicyKind {
    /// A boxed policy with its default parameters.
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            Self::Speed => Box::new(Speed::default()),
            Self::Baseline => Box::new(Baseline),
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "speed" => Ok(Self::Speed),
            "baseline" => Ok(Self::Baseline),
            other => Err(format!(
                "unknown policy `{other}` (expected speed or baseline)"
            )),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.build().name())
    }
}
