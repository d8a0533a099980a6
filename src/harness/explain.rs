//! The misprediction explorer over recorded traces (`spex explain`): where the early passes'
//! readouts disagree with the token the run committed, gathered over any number of traces.
//! For each position it takes the speculative lane's last readout at every pass before R (the
//! one of the instance that survived: a flushed instance's readouts come earlier) and
//! compares it with the committed token. Reads traces only; prints nothing itself.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::race::{Lane, RaceEvent};
use super::trace::Trace;
use crate::engine::events::{DecodeEvent, Prediction, Token};

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

/// "Pass r said X, the committed token was Y", with how often and where.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pair {
    pub pass: usize,
    pub said: Token,
    pub committed: Token,
    pub count: usize,
    /// Every time it happened, in trace and step order.
    pub occurrences: Vec<Occurrence>,
}

/// Where a pair happened: the trace (its index among those explained), the step whose readout
/// said it, and the position it predicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Occurrence {
    pub trace: usize,
    pub step: u64,
    pub pos: usize,
}

/// One early readout of a committed position: what pass `pass` said about position `pos` at
/// step `step` of trace `trace`, and the token committed there.
#[derive(Debug, Clone, Copy)]
pub struct Sighting<'a> {
    pub trace: usize,
    pub pos: usize,
    pub pass: usize,
    pub step: u64,
    pub said: &'a Prediction,
    pub committed: &'a Token,
    /// The exit gate's λ after that pass, where the trace recorded one.
    pub exit_probability: Option<f32>,
}

/// The edges of the exit-gate buckets: λ in `[EDGES[i], EDGES[i + 1])`, the last closed.
pub const EXIT_GATE_EDGES: [f32; 7] = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0];

/// Early readouts whose exit gate's λ fell in `low..high`, and how many disagreed with the
/// committed token: what a lossy exit at that pass, taken at that confidence, would get wrong.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GateBucket {
    /// λ from (inclusive).
    pub low: f32,
    /// λ to (exclusive, but for the last bucket).
    pub high: f32,
    /// Its readouts and disagreements.
    #[serde(flatten)]
    pub tally: Tally,
}

/// The bucket of `lambda` among [`EXIT_GATE_EDGES`].
fn gate_bucket(lambda: f32) -> usize {
    let inner = &EXIT_GATE_EDGES[1..EXIT_GATE_EDGES.len() - 1];
    inner.iter().take_while(|&&edge| lambda >= edge).count()
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
    /// Disagreement by the exit gate's λ after the readout's pass (Ouro's gate,
    /// `engine::exit_gate`): whether the gate's confidence predicts a deeper pass changing the
    /// token. Empty where no readout recorded a λ.
    pub by_exit_gate: Vec<GateBucket>,
}

impl Explanation {
    /// Gathers `traces`, keeping the `top` most frequent pairs.
    pub fn of(traces: &[Trace], top: usize) -> Self {
        let passes = traces.iter().map(|t| t.header.model.passes).max();
        let mut readouts = Vec::with_capacity(traces.len());
        for trace in traces {
            readouts.push(speculative_readouts(
                &trace.events,
                trace.header.model.passes,
            ));
        }
        let sightings = readouts
            .iter()
            .enumerate()
            .flat_map(|(i, (r, c))| sightings(i, r, c));
        let mut e = Self::of_sightings(passes.unwrap_or(1), sightings, top);
        e.traces = traces.len();
        e
    }

    /// Gathers `sightings` of a model with `passes` passes (readouts at pass R are left out),
    /// keeping the `top` most frequent pairs; one trace unless [`Explanation::of`] says more.
    pub fn of_sightings<'a>(
        passes: usize,
        sightings: impl IntoIterator<Item = Sighting<'a>>,
        top: usize,
    ) -> Self {
        let mut e = Self {
            traces: 1,
            by_pass: vec![Tally::default(); passes.saturating_sub(1)],
            ..Self::default()
        };
        let mut pairs: HashMap<(usize, u32, u32), Pair> = HashMap::new();
        let mut positions = std::collections::HashSet::new();
        for s in sightings.into_iter().filter(|s| s.pass < passes) {
            positions.insert((s.trace, s.pos));
            let disagreed = s.said.token.id != s.committed.id;
            e.by_pass[s.pass - 1].add(disagreed);
            let class = TokenClass::of(&s.committed.text);
            e.by_class.entry(class).or_default().add(disagreed);
            if let Some(lambda) = s.exit_probability {
                if e.by_exit_gate.is_empty() {
                    e.by_exit_gate = (EXIT_GATE_EDGES.windows(2))
                        .map(|w| GateBucket {
                            low: w[0],
                            high: w[1],
                            tally: Tally::default(),
                        })
                        .collect();
                }
                e.by_exit_gate[gate_bucket(lambda)].tally.add(disagreed);
            }
            if !disagreed {
                e.agreeing.add(s.said);
                continue;
            }
            e.disagreeing.add(s.said);
            let pair = pairs
                .entry((s.pass, s.said.token.id, s.committed.id))
                .or_insert_with(|| Pair {
                    pass: s.pass,
                    said: s.said.token.clone(),
                    committed: s.committed.clone(),
                    count: 0,
                    occurrences: Vec::new(),
                });
            pair.count += 1;
            pair.occurrences.push(Occurrence {
                trace: s.trace,
                step: s.step,
                pos: s.pos,
            });
        }
        e.positions = positions.len();
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
        for pair in &mut pairs {
            pair.occurrences.sort_unstable();
        }
        e.pairs = pairs;
        e
    }
}

/// A trace's early readouts of its committed positions, as sightings.
fn sightings<'a>(
    trace: usize,
    readouts: &'a BTreeMap<(usize, usize), EarlyReadout>,
    committed: &'a HashMap<usize, Token>,
) -> impl Iterator<Item = Sighting<'a>> {
    readouts.iter().filter_map(move |(&(pos, pass), r)| {
        Some(Sighting {
            trace,
            pos,
            pass,
            step: r.step,
            said: &r.said,
            committed: committed.get(&pos)?,
            exit_probability: r.exit_probability,
        })
    })
}

/// One early readout as a trace recorded it.
#[derive(Debug, Clone)]
struct EarlyReadout {
    step: u64,
    said: Prediction,
    exit_probability: Option<f32>,
}

/// The speculative lane's last readout at each (predicted position, pass before R), and its
/// committed token at each position.
type Readouts = (
    BTreeMap<(usize, usize), EarlyReadout>,
    HashMap<usize, Token>,
);

fn speculative_readouts(events: &[RaceEvent], passes: usize) -> Readouts {
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
                        let readout = EarlyReadout {
                            step: step.step,
                            said: p.clone(),
                            exit_probability: row.exit_probability,
                        };
                        readouts.insert((row.pos + 1, pass), readout);
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

    /// Readouts with a λ land in its bucket (the last closed at 1), and each bucket counts its
    /// disagreements; readouts without one are in no bucket.
    #[test]
    fn disagreement_is_tallied_by_the_exit_gate_bucket() {
        let token = |id: u32| Token {
            id,
            text: format!("t{id}"),
        };
        let said = |id| Prediction {
            token: token(id),
            prob: 0.5,
            margin: 1.0,
            top: Vec::new(),
        };
        let (yes, no, committed) = (said(1), said(2), token(1));
        let sighting = |said, exit_probability| Sighting {
            trace: 0,
            pos: 3,
            pass: 1,
            step: 1,
            said,
            committed: &committed,
            exit_probability,
        };
        let e = Explanation::of_sightings(
            4,
            [
                sighting(&yes, Some(0.05)),
                sighting(&no, Some(0.05)),
                sighting(&no, Some(0.95)),
                sighting(&yes, Some(1.0)),
                sighting(&no, None),
            ],
            5,
        );
        let counts: Vec<(usize, usize)> = (e.by_exit_gate.iter())
            .map(|b| (b.tally.readouts, b.tally.disagreed))
            .collect();
        assert_eq!(counts, [(2, 1), (0, 0), (0, 0), (0, 0), (0, 0), (2, 1)]);
        assert_eq!(e.by_pass[0].readouts, 5);
        assert_eq!(gate_bucket(0.1), 1);
        assert_eq!(gate_bucket(0.0999), 0);
    }

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
