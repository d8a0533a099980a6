//! The misprediction explorer over recorded traces (`spex explain`): where the early passes'
//! readouts disagree with the token the run committed, gathered over any number of traces.
//! For each position it takes the speculative lane's last readout at every pass before R (the
//! one of the instance that survived: a flushed instance's readouts come earlier) and
//! compares it with the committed token. Reads traces only; prints nothing itself.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::events::{DecodeEvent, Prediction, Token};
use super::race::{Lane, RaceEvent};
use super::trace::Trace;

/// What kind of text a token is, for disagreement by class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenClass {
    /// A capitalised speaker name (`HAMLET`): two or more capitals, nothing else.
    SpeakerName,
    /// Starts with a space, then a letter.
    WordStart,
    /// Letters only, no leading space: the middle or end of a word.
    WordPiece,
    Newline,
    Number,
    Punctuation,
    Other,
}

impl TokenClass {
    /// The class of a token's text.
    pub fn of(text: &str) -> Self {
        let trimmed = text.trim_start_matches(' ');
        let letters = |s: &str| !s.is_empty() && s.chars().all(char::is_alphabetic);
        if text.contains('\n') {
            Self::Newline
        } else if trimmed.chars().count() >= 2 && trimmed.chars().all(|c| c.is_uppercase()) {
            Self::SpeakerName
        } else if text.starts_with(' ') && trimmed.starts_with(char::is_alphabetic) {
            Self::WordStart
        } else if letters(text) {
            Self::WordPiece
        } else if !trimmed.is_empty() && trimmed.chars().all(|c| c.is_ascii_digit()) {
            Self::Number
        } else if !trimmed.is_empty() && trimmed.chars().all(|c| c.is_ascii_punctuation()) {
            Self::Punctuation
        } else {
            Self::Other
        }
    }
}

/// Readouts and how many disagreed with the committed token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Tally {
    pub readouts: usize,
    pub disagreed: usize,
}

impl Tally {
    fn add(&mut self, disagreed: bool) {
        self.readouts += 1;
        self.disagreed += usize::from(disagreed);
    }

    /// Disagreements over readouts.
    pub fn rate(&self) -> f64 {
        if self.readouts == 0 {
            0.0
        } else {
            self.disagreed as f64 / self.readouts as f64
        }
    }
}

/// Mean margin (logits, best over runner-up) and probability of a set of readouts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Confidence {
    pub readouts: usize,
    pub mean_margin: f64,
    pub mean_prob: f64,
}

impl Confidence {
    fn add(&mut self, p: &Prediction) {
        let n = self.readouts as f64;
        self.mean_margin = (self.mean_margin * n + f64::from(p.margin)) / (n + 1.0);
        self.mean_prob = (self.mean_prob * n + f64::from(p.prob)) / (n + 1.0);
        self.readouts += 1;
    }
}

/// "Pass r said X, the committed token was Y", with how often.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pair {
    pub pass: usize,
    pub said: Token,
    pub committed: Token,
    pub count: usize,
}

/// What `spex explain` reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Explanation {
    pub traces: usize,
    /// Committed positions with at least one early readout.
    pub positions: usize,
    /// Disagreement by pass (pass 1 first), readouts before pass R only.
    pub by_pass: Vec<Tally>,
    /// Disagreement by the committed token's class.
    pub by_class: BTreeMap<TokenClass, Tally>,
    /// Readouts that disagreed and those that agreed.
    pub disagreeing: Confidence,
    pub agreeing: Confidence,
    /// The most frequent disagreements, most frequent first.
    pub pairs: Vec<Pair>,
}

impl Explanation {
    /// Gathers `traces`, keeping the `top` most frequent pairs.
    pub fn of(traces: &[Trace], top: usize) -> Self {
        let mut e = Self {
            traces: traces.len(),
            ..Self::default()
        };
        let mut pairs: HashMap<(usize, u32, u32), Pair> = HashMap::new();
        for trace in traces {
            e.add(trace, &mut pairs);
        }
        let mut pairs: Vec<Pair> = pairs.into_values().collect();
        pairs.sort_by(|a, b| {
            (b.count, a.pass, a.said.id, a.committed.id).cmp(&(
                a.count,
                b.pass,
                b.said.id,
                b.committed.id,
            ))
        });
        pairs.truncate(top);
        e.pairs = pairs;
        e
    }

    fn add(&mut self, trace: &Trace, pairs: &mut HashMap<(usize, u32, u32), Pair>) {
        let passes = trace.header.model.passes;
        if self.by_pass.len() < passes.saturating_sub(1) {
            self.by_pass.resize(passes - 1, Tally::default());
        }
        let (readouts, committed) = speculative_readouts(&trace.events, passes);
        let mut positions = std::collections::HashSet::new();
        for ((pos, pass), prediction) in readouts {
            let Some(token) = committed.get(&pos) else {
                continue; // never committed: the run ended first
            };
            positions.insert(pos);
            let disagreed = prediction.token.id != token.id;
            self.by_pass[pass - 1].add(disagreed);
            let class = TokenClass::of(&token.text);
            self.by_class.entry(class).or_default().add(disagreed);
            if disagreed {
                self.disagreeing.add(&prediction);
                let key = (pass, prediction.token.id, token.id);
                pairs
                    .entry(key)
                    .or_insert_with(|| Pair {
                        pass,
                        said: prediction.token.clone(),
                        committed: token.clone(),
                        count: 0,
                    })
                    .count += 1;
            } else {
                self.agreeing.add(&prediction);
            }
        }
        self.positions += positions.len();
    }
}

/// The speculative lane's last readout at each (predicted position, pass before R), and its
/// committed token at each position.
fn speculative_readouts(
    events: &[RaceEvent],
    passes: usize,
) -> (BTreeMap<(usize, usize), Prediction>, HashMap<usize, Token>) {
    let mut readouts = BTreeMap::new();
    let mut committed = HashMap::new();
    for event in events {
        let RaceEvent::Decode {
            lane: Lane::Speculative,
            event,
        } = event
        else {
            continue;
        };
        match event {
            DecodeEvent::Prefill(p) => {
                committed.insert(p.first.pos, p.first.token.clone());
            }
            DecodeEvent::Step(step) => {
                for row in step.rows.iter().filter(|r| !r.dropped) {
                    let pass = row.pass.number();
                    if let Some(p) = row.prediction.as_ref().filter(|_| pass < passes) {
                        readouts.insert((row.pos + 1, pass), p.clone());
                    }
                }
                for c in &step.committed {
                    committed.insert(c.pos, c.token.clone());
                }
            }
            DecodeEvent::Finished(_) => {}
        }
    }
    (readouts, committed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_classes_follow_the_text() {
        for (text, class) in [
            ("HAMLET", TokenClass::SpeakerName),
            (" KING", TokenClass::SpeakerName),
            (" the", TokenClass::WordStart),
            ("ing", TokenClass::WordPiece),
            (".\n", TokenClass::Newline),
            ("42", TokenClass::Number),
            (",", TokenClass::Punctuation),
            ("A", TokenClass::WordPiece),
            (" ", TokenClass::Other),
        ] {
            assert_eq!(TokenClass::of(text), class, "{text:?}");
        }
    }
}
