//! Ouro's early-exit gate, evaluated: after every pass a linear map of the normed state to one
//! logit gives λ_r = σ(w · h_r + b), the probability of stopping at pass r given the token got
//! there. Its exit distribution is p_r = λ_r · Π_{j<r} (1 − λ_j) for r < R, the rest at pass R
//! (pass R's own λ is unused), and a threshold rule stops a token at the first pass where the
//! cumulative probability reaches the threshold (mlx-lm's `ouro.py`, `_threshold_exit`).
//!
//! spex evaluates the gate beside decoding and, under every lossless policy, changes no
//! committed token by it: the gate is shown next to where SPEED's proposals settled, and only
//! the lossy `exit:gate` lane (`policy::exit`) stops tokens by it.

use candle_core::{DType, Tensor};

use super::pass::Pass;

/// The gate's weight `[1, hidden]` and bias `[1]`, as the checkpoint stores them (the host
/// kernels read them as f32).
#[derive(Debug, Clone)]
pub struct ExitGate {
    /// `[1, hidden]`.
    pub weight: Tensor,
    /// `[1]`.
    pub bias: Tensor,
}

impl ExitGate {
    /// The same gate in f32 (the host backend's norms and gate are read as f32).
    pub fn to_f32(&self) -> candle_core::Result<Self> {
        Ok(Self {
            weight: self.weight.to_dtype(DType::F32)?,
            bias: self.bias.to_dtype(DType::F32)?,
        })
    }
}

/// A cumulative exit probability in (0, 1]: where the threshold rule stops a token. A
/// checkpoint's `early_exit_threshold` gives one and `--exit-threshold` overrides it.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "f32", into = "f32")]
pub struct ExitThreshold(f32);

// The value is never NaN (`ExitThreshold::new` refuses it), so equality is total.
impl Eq for ExitThreshold {}

impl ExitThreshold {
    /// Ouro's own default (its configs' `early_exit_threshold` is 1.0): the cumulative exit
    /// probability reaches 1 only at pass R, so every token runs every pass.
    pub const EVERY_PASS: Self = Self(1.0);

    /// `probability` as a threshold, if it lies in (0, 1].
    pub fn new(probability: f32) -> Option<Self> {
        (probability > 0.0 && probability <= 1.0).then_some(Self(probability))
    }

    /// The probability.
    pub fn get(self) -> f32 {
        self.0
    }
}

impl std::fmt::Display for ExitThreshold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<ExitThreshold> for f32 {
    fn from(t: ExitThreshold) -> f32 {
        t.0
    }
}

impl TryFrom<f32> for ExitThreshold {
    type Error = String;

    fn try_from(p: f32) -> Result<Self, String> {
        Self::new(p).ok_or_else(|| format!("{p} must be a probability in (0, 1]"))
    }
}

impl std::str::FromStr for ExitThreshold {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        (s.trim().parse::<f32>().ok())
            .and_then(Self::new)
            .ok_or_else(|| format!("`{s}` must be a probability in (0, 1]"))
    }
}

/// σ(x), the gate logit's probability.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The probability of exiting at each pass whose λ is given (`lambdas[r]` after pass r + 1),
/// `λ_r · Π_{j<r} (1 − λ_j)`, in the order mlx-lm's `_compute_exit_distribution` multiplies.
pub fn exits_at(lambdas: &[f32]) -> Vec<f32> {
    let mut remaining = 1.0f32;
    (lambdas.iter())
        .map(|&lambda| {
            let exit = lambda * remaining;
            remaining *= 1.0 - lambda;
            exit
        })
        .collect()
}

/// The exit distribution over the R passes from each pass's λ (the last is unused): [`exits_at`]
/// before pass R, the rest, `Π_{j<R} (1 − λ_j)`, at pass R.
pub fn exit_distribution(lambdas: &[f32]) -> Vec<f32> {
    let Some((_, before)) = lambdas.split_last() else {
        return Vec::new();
    };
    let mut pdf = exits_at(before);
    pdf.push(
        before
            .iter()
            .fold(1.0f32, |rest, lambda| rest * (1.0 - lambda)),
    );
    pdf
}

/// The pass a threshold exit stops at: the first whose cumulative exit probability reaches
/// `threshold`, else pass R (mlx-lm's `_threshold_exit`).
pub fn threshold_exit(lambdas: &[f32], threshold: ExitThreshold) -> Pass {
    // Every pass's λ is in: the rule has decided (pass R holds the rest of the distribution).
    known_exit(lambdas, lambdas.len(), threshold)
        .unwrap_or(Pass::from_index(lambdas.len().saturating_sub(1)))
}

/// The pass the threshold rule stops a token at, from the λ of the passes it has run so far
/// (of `passes`): the first before R whose cumulative exit probability reaches `threshold`,
/// else pass R once every pass's λ is in; `None` while it is still open.
pub fn known_exit(lambdas: &[f32], passes: usize, threshold: ExitThreshold) -> Option<Pass> {
    let before_last = &lambdas[..lambdas.len().min(passes.saturating_sub(1))];
    // `exits_at`'s products, summed as they come: this runs on every commit.
    let (mut cumulative, mut remaining) = (0.0f32, 1.0f32);
    for (r, &lambda) in before_last.iter().enumerate() {
        cumulative += lambda * remaining;
        remaining *= 1.0 - lambda;
        if cumulative >= threshold.get() {
            return Some(Pass::from_index(r));
        }
    }
    (passes > 0 && lambdas.len() >= passes).then(|| Pass::last(passes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_distribution_sums_to_one_and_the_threshold_picks_the_first_pass_reaching_it() {
        let lambdas = [0.5, 0.5, 0.5, 0.9];
        let pdf = exit_distribution(&lambdas);
        assert_eq!(pdf, vec![0.5, 0.25, 0.125, 0.125]);
        let at = |t| threshold_exit(&lambdas, ExitThreshold::new(t).unwrap());
        assert_eq!(at(0.5), Pass::FIRST);
        assert_eq!(at(0.7), Pass::from_index(1));
        assert_eq!(at(0.875), Pass::from_index(2));
        assert_eq!(at(1.0), Pass::from_index(3));
        // A neutral gate (λ ≈ 4.5e-5) runs every pass.
        let neutral = [sigmoid(-10.0); 4];
        let half = ExitThreshold::new(0.5).unwrap();
        assert_eq!(threshold_exit(&neutral, half), Pass::from_index(3));
        assert!((exit_distribution(&neutral).iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn a_known_exit_is_the_threshold_rule_once_decided() {
        let lambdas = [0.1f32, 0.35, 0.2, 0.9];
        for t in [0.05f32, 0.3, 0.42, 0.7, 1.0] {
            let t = ExitThreshold::new(t).unwrap();
            let rule = threshold_exit(&lambdas, t);
            assert_eq!(known_exit(&lambdas, 4, t), Some(rule));
            for seen in 0..4 {
                let known = known_exit(&lambdas[..seen], 4, t);
                let decided = rule.number() <= seen && rule.number() < 4;
                assert_eq!(known, decided.then_some(rule), "{t} after {seen} passes");
            }
        }
    }

    #[test]
    fn a_threshold_is_a_probability_in_the_half_open_unit_interval() {
        assert_eq!(
            "0.5".parse::<ExitThreshold>().map(ExitThreshold::get),
            Ok(0.5)
        );
        assert_eq!("1".parse::<ExitThreshold>(), Ok(ExitThreshold::EVERY_PASS));
        for bad in ["0", "-0.1", "1.01", "NaN", "half"] {
            let err = bad.parse::<ExitThreshold>().unwrap_err();
            assert!(err.contains("(0, 1]"), "{bad}: {err}");
        }
    }
}
