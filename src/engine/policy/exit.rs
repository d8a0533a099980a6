//! Lossy early exit: a token stops at the first pass where a rule says it is done and commits
//! that pass's choice, so its deeper passes are never computed. This is what "why not just exit
//! early?" means on a looped model, and spex races it beside the lossless policies so the cost
//! can be seen: its text leaves the baseline's wherever an early pass disagrees with pass R.
//!
//! Three rules decide where a token stops ([`ExitRule`]):
//!
//! - **The checkpoint's gate** (`exit:gate[=T]`): Ouro's learned exit gate gives λ_r after every
//!   pass; the token stops at the first pass whose cumulative exit probability reaches T, the
//!   threshold rule of Ouro's adaptive computation (`engine::exit_gate::threshold_exit`, as
//!   mlx-lm's `_threshold_exit`). Without `=T`, T is the run's: the checkpoint's
//!   `early_exit_threshold`, or `--exit-threshold` ([`Readout::exit_threshold`]).
//! - **Confidence** (`exit:confidence=P`): the readout's top-1 softmax probability is at least
//!   P (Schuster et al., "Confident Adaptive Language Modeling", arXiv 2207.07061: the
//!   softmax-response confidence measure). It needs no trained gate.
//! - **A fixed depth** (`exit:pass=N`): every token stops after pass N (mlx-lm's
//!   `exit_at_step`).
//!
//! # The skipped passes' KV entries
//!
//! A later token still attends, at every pass, to an entry for every earlier position. A token
//! that stopped at pass p has none for passes p+1..R, and there are two ways to fill them
//! ([`KvFill`]):
//!
//! - **Copy** (the default): its pass-p K/V entries are copied into the deeper passes' slots, in
//!   every layer (`KvCache::fill_skipped`). It reads no weights.
//! - **Project** (`:fill=project`): its exit state is taken as every skipped layer's input, as
//!   CALM propagates an exited state to the layers it skipped (arXiv 2207.07061), and
//!   each layer's K/V projections of it are written (`model::step::project_skipped`). For the
//!   next pass's first layer that is the exact entry. It reads the attention weights of every
//!   layer once more, about a quarter of a pass's weights at Ouro's proportions.
//!
//! Copy is the default: it reads no weights, and raced against the projection on the shipped
//! model (the commit that added the projection gives the figures) it was, under the gate, the
//! checkpoint's own rule, both the faster and as close to the baseline's text; the projection
//! is there to be raced against it. A fixed depth (`exit:pass=N`) never reads the filled
//! entries at all: every token stops at N and attends only at passes up to N, so both fills
//! give the same text there.
//!
//! Nothing here is exact: the text is compared with the baseline's as *lossy* (where it first
//! departs, how much of it agrees), never as identical.

use super::{Action, Policy, Proposal, Readout};
use crate::engine::exit_gate::{self, ExitThreshold};
use crate::engine::pass::Pass;

/// Where a lossy early exit stops a token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExitRule {
    /// The checkpoint's exit gate: the first pass whose cumulative exit probability reaches
    /// `threshold`.
    Gate {
        /// The cumulative exit probability that stops a token; `None`: the run's
        /// ([`Readout::exit_threshold`]).
        threshold: Option<ExitThreshold>,
    },
    /// The readout's top-1 softmax probability reaches `min_probability`, in (0, 1].
    Confidence {
        /// The top-1 probability that stops a token.
        min_probability: f32,
    },
    /// Every token stops after this pass.
    Pass(Pass),
}

/// How the K/V entries a stopped token skipped are filled (see "The skipped passes' KV
/// entries" above).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvFill {
    /// Copies of its exit pass's entries, in every layer.
    #[default]
    Copy,
    /// Its exit state projected through every layer's input norm and K/V weights once, the
    /// result written into every deeper pass (`exit:…:fill=project`).
    Project,
}

/// What the scheduler must provide a lossy early exit with. Its readouts before pass R are
/// commits' (`ReadoutKind::Argmax` when greedy: the argmax exact, the other logits within the
/// f16 head's bound, which is all the confidence rule's softmax needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EarlyExit {
    /// The rule reads the checkpoint's exit gate.
    pub needs_gate: bool,
    /// How a stopped token's skipped entries are filled.
    pub fill: KvFill,
}

/// The lossy early-exit policy: one token at a time, as the baseline, but it commits at the
/// first pass its rule accepts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Exit {
    /// Where a token stops.
    pub rule: ExitRule,
    /// How its skipped passes' entries are filled.
    pub fill: KvFill,
}

impl Exit {
    /// Whether a readout after `r.pass` (< R) stops its token; `lambdas` are the gate's λ after
    /// each of the token's passes so far, this one included.
    fn stops(&self, r: &Readout) -> bool {
        match self.rule {
            ExitRule::Pass(pass) => r.pass >= pass,
            ExitRule::Gate { threshold } => {
                let threshold = threshold.unwrap_or(r.exit_threshold);
                exit_gate::known_exit(r.lambdas, r.passes, threshold) == Some(r.pass)
            }
            ExitRule::Confidence { min_probability } => {
                top_probability(r.logits) >= min_probability
            }
        }
    }
}

/// The largest softmax probability of `logits`: 1 / Σ exp(lᵢ − max). A scalar `exp`, not
/// the display's vector one (`kernels::sum_exp`): where a token stops must not depend on the
/// CPU's instruction set.
pub fn top_probability(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return 0.0;
    }
    1.0 / logits.iter().map(|&l| (l - max).exp()).sum::<f32>()
}

impl Policy for Exit {
    fn name(&self) -> &'static str {
        "exit"
    }

    fn check(&self, passes: usize) -> Result<(), String> {
        match self.rule {
            ExitRule::Pass(pass) if pass.number() > passes => Err(format!(
                "exit:pass={pass}: the model has {passes} passes (N must be 1 to {passes})"
            )),
            _ => Ok(()),
        }
    }

    fn reads_out(&self, pass: Pass, _passes: usize, _in_flight: usize) -> bool {
        match self.rule {
            ExitRule::Pass(depth) => pass == depth,
            ExitRule::Gate { .. } | ExitRule::Confidence { .. } => true,
        }
    }

    /// Commits the run's choice (greedy or seed-coupled, `engine::sampling`) from this pass
    /// where the rule stops the token or at pass R; nothing otherwise.
    fn act(&self, r: &Readout, candidates: &[Proposal]) -> Action {
        debug_assert!(candidates.is_empty(), "an exit lane never speculates");
        let best = r.sampling.choose(r.logits, r.pos, false).best;
        match (r.is_last(), self.stops(r)) {
            (true, _) => Action::Commit(best),
            (false, true) => Action::Exit(best),
            (false, false) => Action::Nothing,
        }
    }

    fn keeps_baseline_sample(&self) -> bool {
        false
    }

    fn early_exit(&self) -> Option<EarlyExit> {
        Some(EarlyExit {
            needs_gate: matches!(self.rule, ExitRule::Gate { .. }),
            fill: self.fill,
        })
    }
}

/// Reads a rule ([`parse_rule`]) and an optional `:fill=copy|project`.
pub(super) fn parse_exit(params: &str) -> Result<(ExitRule, KvFill), String> {
    let (rule, fill) = match params.split_once(":fill=") {
        Some((rule, "copy")) => (rule, KvFill::Copy),
        Some((rule, "project")) => (rule, KvFill::Project),
        Some((_, other)) => {
            return Err(format!(
                "fill=`{other}`: expected fill=copy or fill=project"
            ));
        }
        None => (params, KvFill::Copy),
    };
    parse_rule(rule).map(|rule| (rule, fill))
}

/// How [`parse_exit`] writes a lane back.
pub(super) fn write_exit(
    rule: ExitRule,
    fill: KvFill,
    f: &mut std::fmt::Formatter<'_>,
) -> std::fmt::Result {
    write_rule(rule, f)?;
    match fill {
        KvFill::Copy => Ok(()),
        KvFill::Project => f.write_str(":fill=project"),
    }
}

/// Reads `gate[=T]`, `confidence=P` or `pass=N`.
fn parse_rule(params: &str) -> Result<ExitRule, String> {
    let (key, value) = match params.split_once('=') {
        Some((key, value)) => (key, Some(value)),
        None => (params, None),
    };
    let probability = |what: &str| -> Result<f32, String> {
        let v =
            value.ok_or_else(|| format!("{what} needs a value: exit:{key}=P with P in (0, 1]"))?;
        match v.parse::<f32>() {
            Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
            _ => Err(format!("{what} `{v}` must be a probability in (0, 1]")),
        }
    };
    match key {
        "gate" if value.is_none() => Ok(ExitRule::Gate { threshold: None }),
        "gate" => (value.unwrap_or_default().parse::<ExitThreshold>())
            .map(|t| ExitRule::Gate { threshold: Some(t) })
            .map_err(|e| format!("the gate threshold {e}")),
        "confidence" => probability("the confidence")
            .map(|min_probability| ExitRule::Confidence { min_probability }),
        "pass" => value
            .and_then(|v| v.parse::<usize>().ok())
            .and_then(Pass::new)
            .map(ExitRule::Pass)
            .ok_or_else(|| "pass=N: N is the pass a token stops after, 1 to R".to_string()),
        "" => Err("expected gate[=T], confidence=P or pass=N after `exit:`".into()),
        _ => Err(format!(
            "`{key}`: expected gate[=T], confidence=P or pass=N"
        )),
    }
}

/// How [`parse_rule`] writes a rule back.
fn write_rule(rule: ExitRule, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    match rule {
        ExitRule::Gate { threshold: None } => f.write_str("exit:gate"),
        ExitRule::Gate {
            threshold: Some(threshold),
        } => write!(f, "exit:gate={threshold}"),
        ExitRule::Confidence { min_probability } => write!(f, "exit:confidence={min_probability}"),
        ExitRule::Pass(pass) => write!(f, "exit:pass={pass}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampling::Sampling;

    fn readout<'a>(logits: &'a [f32], pass: usize, lambdas: &'a [f32]) -> Readout<'a> {
        Readout {
            logits,
            pass: Pass::new(pass).unwrap(),
            passes: 4,
            pos: 3,
            sampling: &Sampling::GREEDY,
            lambdas,
            exit_threshold: ExitThreshold::EVERY_PASS,
        }
    }

    #[test]
    fn each_rule_stops_where_it_says_and_pass_r_always_commits() {
        let peaked = [0.0, 9.0, 0.0];
        let flat = [0.0, 0.1, 0.0];
        let at = |rule, logits: &[f32], pass, lambdas: &[f32]| {
            Exit {
                rule,
                fill: KvFill::Copy,
            }
            .act(&readout(logits, pass, lambdas), &[])
        };
        let pass2 = ExitRule::Pass(Pass::new(2).unwrap());
        assert_eq!(at(pass2, &flat, 1, &[]), Action::Nothing);
        assert_eq!(at(pass2, &flat, 2, &[]), Action::Exit(1));
        let confident = ExitRule::Confidence {
            min_probability: 0.9,
        };
        assert_eq!(at(confident, &peaked, 1, &[]), Action::Exit(1));
        assert_eq!(at(confident, &flat, 1, &[]), Action::Nothing);
        assert_eq!(at(confident, &flat, 4, &[]), Action::Commit(1));
        let gate = ExitRule::Gate {
            threshold: ExitThreshold::new(0.5),
        };
        // Cumulative exit probability 0.3, then 0.3 + 0.7·0.4 = 0.58.
        assert_eq!(at(gate, &flat, 1, &[0.3]), Action::Nothing);
        assert_eq!(at(gate, &flat, 2, &[0.3, 0.4]), Action::Exit(1));
        // No λ for this pass (a model without a gate): never stops early.
        assert_eq!(at(gate, &flat, 2, &[0.9]), Action::Nothing);
    }

    #[test]
    fn the_gate_rule_stops_where_the_threshold_rule_does() {
        let lambdas = [0.1f32, 0.35, 0.2, 0.9];
        for threshold in [0.05f32, 0.1, 0.3, 0.42, 0.5, 0.7, 1.0] {
            let threshold = ExitThreshold::new(threshold).unwrap();
            let expected = exit_gate::threshold_exit(&lambdas, threshold);
            let rule = ExitRule::Gate {
                threshold: Some(threshold),
            };
            let stopped = (1..=4)
                .find(|&pass| {
                    let r = readout(&[0.0, 1.0], pass, &lambdas[..pass]);
                    let lane = Exit {
                        rule,
                        fill: KvFill::Copy,
                    };
                    !matches!(lane.act(&r, &[]), Action::Nothing)
                })
                .unwrap();
            assert_eq!(stopped, expected.number(), "threshold {threshold}");
        }
    }

    #[test]
    fn top_probability_is_the_softmax_maximum() {
        assert!((top_probability(&[0.0, 0.0]) - 0.5).abs() < 1e-6);
        assert!((top_probability(&[1000.0, 0.0]) - 1.0).abs() < 1e-6);
        assert_eq!(top_probability(&[]), 0.0);
    }
}
