//! How a readout's logits become a token: greedy (T = 0) or seed-coupled sampling
//! (Daliri, Musco and Suresh, arXiv 2408.07978). Coupled sampling is Gumbel-max with noise keyed only by (seed,
//! position, token id): x_p = argmax over the kept set S_p of (l_i / T + G(seed, p, i)). With
//! pass R's logits that is an exact sample of softmax(l / T) restricted to S_p, and a
//! deterministic function of (logits, seed, p), so every policy that commits only pass-R
//! decisions reproduces the baseline's sampled text token for token for the same seed.

use std::cmp::Ordering;
use std::fmt;

use super::rng::SplitMix;

/// Temperature, filters and seed of a run. A temperature of 0 (or below
/// [`Sampling::MIN_TEMPERATURE`]) is greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampling {
    /// T: the logits are divided by it before sampling; 0 is greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: Option<f32>,
    /// Keys the Gumbel noise and the rejection tests' uniforms: the same seed, the same text.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self::GREEDY
    }
}

/// A readout's choice, and the runner-up a second candidate may start from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// The chosen token: the highest score among the kept tokens.
    pub best: u32,
    /// The second-highest score among the kept tokens and how far below the best it is
    /// (in logits when greedy, in perturbed scores l/T + G when sampling).
    pub runner_up: Option<(u32, f32)>,
}

impl Sampling {
    /// Greedy decoding: the argmax, the first on ties.
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
    };

    /// The smallest temperature that samples: below it, l / T leaves f32's range for any
    /// logit (1e-40 turned every score infinite and the text to `!"!"`), and long before that
    /// the noise can no longer move the argmax but for exact ties. Such a temperature decodes
    /// greedily ([`Sampling::is_greedy`]).
    pub const MIN_TEMPERATURE: f32 = 1e-4;

    /// Whether this is greedy decoding: temperature 0, or one below [`Self::MIN_TEMPERATURE`].
    pub fn is_greedy(&self) -> bool {
        self.temperature < Self::MIN_TEMPERATURE
    }

    /// The note a user is owed when the temperature asked for is above 0 but decodes
    /// greedily.
    pub fn greedy_note(&self) -> Option<String> {
        (self.temperature > 0.0 && self.is_greedy()).then(|| {
            format!(
                "--temperature {:e}: below {:e}, decoding greedily",
                self.temperature,
                Self::MIN_TEMPERATURE
            )
        })
    }

    /// A one-line complaint about the first bad setting, if any.
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "--temperature {}: must be a number ≥ 0 (0 is greedy)",
                self.temperature
            ));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(format!("--top-p {p}: must be in (0, 1]"));
        }
        if self.top_k == Some(0) {
            return Err("--top-k 0: must be at least 1".into());
        }
        Ok(())
    }

    /// The token the logits `l` for position `pos` choose; the runner-up only where
    /// `runner_up` asks (a second scan).
    pub fn choose(&self, l: &[f32], pos: usize, runner_up: bool) -> Choice {
        match (self.is_greedy(), runner_up) {
            (true, false) => Choice {
                best: argmax(l),
                runner_up: None,
            },
            (true, true) => top_two(l.iter().copied().enumerate(), true),
            _ if self.top_k.is_none() && self.top_p.is_none() => {
                self.perturbed_top_two(l, pos, 0..l.len(), runner_up)
            }
            _ => self.perturbed_top_two(l, pos, self.kept(l).into_iter(), runner_up),
        }
    }

    /// The top two of l_i / T + G(seed, pos, i) over `candidates`, in id order. The noise's
    /// two logarithms are taken only for tokens that could still place: a token whose logit
    /// plus an upper bound on its noise (from its uniform's exponent, no logarithm) is below
    /// the score to beat cannot change the result. The argmax logit's own score seeds that
    /// bar, since the best score is at least it.
    fn perturbed_top_two(
        &self,
        l: &[f32],
        pos: usize,
        candidates: impl Iterator<Item = usize> + Clone,
        runner_up: bool,
    ) -> Choice {
        let t = self.temperature;
        let score = |i: usize| l[i] / t + gumbel_of(uniform(self.seed, pos, i as u32));
        let leader = candidates
            .clone()
            .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)));
        let floor = leader.map_or(f32::NEG_INFINITY, score);
        let mut top = TopTwo::default();
        for i in candidates {
            let u = uniform(self.seed, pos, i as u32);
            let bar = if runner_up {
                top.second_score()
            } else {
                top.best_score().max(floor)
            };
            // The margin covers f32 rounding of the score against the f64 bound.
            if l[i] / t + noise_bound(u) + 1e-3 < bar {
                continue;
            }
            top.push(i, l[i] / t + gumbel_of(u), runner_up);
        }
        top.choice()
    }

    /// S_p under a filter: the tokens top-k and top-p keep from softmax(l / T), in id order.
    /// (With no filter S_p is every token; `choose` does not build that list.) Most likely
    /// first, equal logits by id, so the set is a function of the logits. Only as much of the
    /// vocabulary is sorted as the set needs: top-k by selection, then the nucleus sorted in
    /// growing chunks until it reaches P (a full sort per readout made a step much dearer).
    fn kept(&self, l: &[f32]) -> Vec<usize> {
        let likelier = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
        let mut order: Vec<usize> = (0..l.len()).collect();
        let k = self.top_k.unwrap_or(l.len()).clamp(1, l.len());
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, likelier);
            order.truncate(k);
        }
        if let Some(p) = self.top_p {
            let keep = self.nucleus(l, &mut order, f64::from(p), likelier);
            order.truncate(keep.max(1));
        }
        order.sort_unstable();
        order
    }

    /// Sorts the most likely of `candidates` to the front until their probability (among the
    /// candidates) reaches `p`; returns how many that takes: every token whose preceding
    /// tokens' mass is below `p`.
    fn nucleus(
        &self,
        l: &[f32],
        candidates: &mut [usize],
        p: f64,
        likelier: impl Fn(&usize, &usize) -> Ordering + Copy,
    ) -> usize {
        let t = self.temperature;
        let max = candidates
            .iter()
            .map(|&i| l[i])
            .fold(f32::NEG_INFINITY, f32::max)
            / t;
        let weight = |i: usize| f64::from(l[i] / t - max).exp();
        // Summed in id order: a function of the logits, whatever order selection left.
        let mut ids: Vec<usize> = candidates.to_vec();
        ids.sort_unstable();
        let total: f64 = ids.iter().map(|&i| weight(i)).sum();
        let (n, mut sorted, mut chunk, mut cumulative) = (candidates.len(), 0, 32, 0.0);
        while sorted < n {
            let end = (sorted + chunk).min(n);
            let rest = &mut candidates[sorted..];
            if end < n {
                rest.select_nth_unstable_by(end - sorted - 1, likelier);
            }
            rest[..end - sorted].sort_by(likelier);
            for (j, &i) in candidates[sorted..end].iter().enumerate() {
                if cumulative >= p {
                    return sorted + j;
                }
                cumulative += weight(i) / total;
            }
            (sorted, chunk) = (end, chunk * 4);
        }
        n
    }
}

/// The uniforms a rejection-sampling policy (LoopSpec: `policy::loopspec`) draws at one
/// position, one independent stream each. Keyed like the Gumbel noise by (seed, position) and
/// a stream number no token id reaches, so reruns draw the same numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draw {
    /// Drawing a first proposal from its pass's distribution.
    FirstProposal,
    /// Drawing a gated second proposal from the residual.
    SecondProposal,
    /// The test at pass R that accepts the first proposal.
    AcceptFirst,
    /// The test at pass R that accepts the second proposal.
    AcceptSecond,
    /// Drawing the token pass R commits: from the residual when every proposal is rejected,
    /// from pass R's distribution when nothing was in flight.
    Residual,
}

impl Sampling {
    /// The uniform in (0, 1) for `draw` at position `pos`.
    pub fn uniform(&self, pos: usize, draw: Draw) -> f64 {
        uniform(self.seed, pos, u32::MAX - draw as u32)
    }

    /// The distribution sampling draws from: softmax(l / T) over the tokens top-k and top-p
    /// keep, zero elsewhere, summing to 1 (T > 0).
    pub fn distribution(&self, l: &[f32]) -> Vec<f32> {
        let kept = match (self.top_k, self.top_p) {
            (None, None) => (0..l.len()).collect(),
            _ => self.kept(l),
        };
        let t = self.temperature;
        let max = kept.iter().map(|&i| l[i]).fold(f32::NEG_INFINITY, f32::max) / t;
        let mut probs = vec![0f32; l.len()];
        let mut total = 0f64;
        for &i in &kept {
            let w = f64::from(l[i] / t - max).exp();
            probs[i] = w as f32;
            total += w;
        }
        let scale = (1.0 / total) as f32;
        probs.iter_mut().for_each(|p| *p *= scale);
        probs
    }
}

/// A draw from `probs` (summing to about 1) by its inverse CDF at `u` in (0, 1); the last
/// token with probability above zero if rounding leaves `u` beyond the total.
pub fn draw(probs: &[f32], u: f64) -> u32 {
    let mut cumulative = 0f64;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cumulative += f64::from(p);
            last = i;
            if u < cumulative {
                break;
            }
        }
    }
    last as u32
}

/// normalise(max(a − b, 0)), the residual rejection sampling falls back to (Leviathan et al.
/// 2023); `None` when nothing is left (a and b equal up to rounding).
pub fn residual(a: &[f32], b: &[f32]) -> Option<Vec<f32>> {
    let mut rest: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x - y).max(0.0)).collect();
    let total: f64 = rest.iter().map(|&r| f64::from(r)).sum();
    if total <= 1e-9 {
        return None;
    }
    let scale = (1.0 / total) as f32;
    rest.iter_mut().for_each(|r| *r *= scale);
    Some(rest)
}

impl fmt::Display for Sampling {
    /// `greedy`, or `T 0.8 · top-k 20 · top-p 0.9 · seed 7`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_greedy() {
            return f.write_str("greedy");
        }
        write!(f, "T {}", self.temperature)?;
        if let Some(k) = self.top_k {
            write!(f, " · top-k {k}")?;
        }
        if let Some(p) = self.top_p {
            write!(f, " · top-p {p}")?;
        }
        write!(f, " · seed {}", self.seed)
    }
}

/// The greedy decision: the id of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The highest-scoring id (the first on ties) and, if asked, the runner-up with its gap.
fn top_two(scores: impl Iterator<Item = (usize, f32)>, runner_up: bool) -> Choice {
    let mut top = TopTwo::default();
    for (i, s) in scores {
        top.push(i, s, runner_up);
    }
    top.choice()
}

/// The best and second-best (id, score) seen so far; the first on ties.
#[derive(Debug, Default)]
struct TopTwo {
    best: Option<(usize, f32)>,
    second: Option<(usize, f32)>,
}

impl TopTwo {
    fn push(&mut self, i: usize, s: f32, runner_up: bool) {
        match self.best {
            Some((_, b)) if s.partial_cmp(&b) != Some(Ordering::Greater) => {
                if runner_up && self.second.is_none_or(|(_, t)| s > t) {
                    self.second = Some((i, s));
                }
            }
            _ => {
                if runner_up {
                    self.second = self.best;
                }
                self.best = Some((i, s));
            }
        }
    }

    fn best_score(&self) -> f32 {
        self.best.map_or(f32::NEG_INFINITY, |(_, s)| s)
    }

    fn second_score(&self) -> f32 {
        self.second.map_or(f32::NEG_INFINITY, |(_, s)| s)
    }

    fn choice(&self) -> Choice {
        let (best_id, best_score) = self.best.unwrap_or((0, f32::NEG_INFINITY));
        Choice {
            best: best_id as u32,
            runner_up: self.second.map(|(i, s)| (i as u32, best_score - s)),
        }
    }
}

/// Standard Gumbel noise −ln(−ln U), U uniform in (0, 1), from a counter-based generator keyed
/// by (seed, position, token) only: batching, lanes and steps cannot change it.
pub fn gumbel(seed: u64, pos: usize, token: u32) -> f32 {
    gumbel_of(uniform(seed, pos, token))
}

/// The uniform behind `gumbel(seed, pos, token)`: U in (0, 1).
fn uniform(seed: u64, pos: usize, token: u32) -> f64 {
    let key = seed
        ^ (pos as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(token)
            .wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
            .rotate_left(31);
    let bits = SplitMix(key).next_u64() >> 11;
    (bits as f64 + 0.5) / (1u64 << 53) as f64
}

fn gumbel_of(u: f64) -> f32 {
    (-(-u.ln()).ln()) as f32
}

/// An upper bound on `gumbel_of(u)` without a logarithm: −ln U ≥ 1 − U, so
/// G = −ln(−ln U) ≤ −ln(1 − U) ≤ −e·ln 2, where 2^e ≤ 1 − U (e from the float's exponent).
fn noise_bound(u: f64) -> f32 {
    let exponent = ((1.0 - u).to_bits() >> 52) as i64 - 1023;
    (-(exponent as f64) * std::f64::consts::LN_2) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(t: f32, top_k: Option<usize>, top_p: Option<f32>) -> Sampling {
        Sampling {
            temperature: t,
            top_k,
            top_p,
            seed: 9,
        }
    }

    #[test]
    fn greedy_is_the_argmax_with_the_first_on_ties_and_the_runner_up_gap_in_logits() {
        let c = Sampling::GREEDY.choose(&[0.0, 3.0, 3.0, 2.5], 5, true);
        assert_eq!(c.best, 1);
        assert_eq!(c.runner_up, Some((2, 0.0)));
        let c = Sampling::GREEDY.choose(&[0.0, 3.0, 1.0, 2.5], 5, true);
        assert_eq!(c.runner_up, Some((3, 0.5)));
        assert_eq!(Sampling::GREEDY.choose(&[1.0], 0, true).runner_up, None);
    }

    #[test]
    fn filters_keep_what_top_k_and_top_p_say() {
        let l = [1.0, 4.0, 3.0, 2.0];
        assert_eq!(sampling(1.0, Some(2), None).kept(&l), [1, 2]);
        // softmax(l): 0.032, 0.644, 0.237, 0.087: 0.644 < 0.7, so the second is needed.
        assert_eq!(sampling(1.0, None, Some(0.7)).kept(&l), [1, 2]);
        assert_eq!(sampling(1.0, None, Some(0.5)).kept(&l), [1]);
        assert_eq!(sampling(1.0, None, Some(1.0)).kept(&l), [0, 1, 2, 3]);
        assert_eq!(sampling(1.0, Some(3), Some(0.99)).kept(&l), [1, 2, 3]);
        for seed in 0..50 {
            let s = Sampling {
                seed,
                ..sampling(1.0, Some(2), None)
            };
            assert!([1, 2].contains(&s.choose(&l, 3, false).best));
        }
    }

    #[test]
    fn noise_depends_on_seed_position_and_token_only() {
        assert_eq!(gumbel(1, 2, 3), gumbel(1, 2, 3));
        assert_ne!(gumbel(1, 2, 3), gumbel(2, 2, 3));
        assert_ne!(gumbel(1, 2, 3), gumbel(1, 3, 3));
        assert_ne!(gumbel(1, 2, 3), gumbel(1, 2, 4));
        let mean: f64 = (0..20_000).map(|i| f64::from(gumbel(7, i, 0))).sum::<f64>() / 20_000.0;
        // The standard Gumbel's mean is the Euler–Mascheroni constant, 0.5772.
        assert!((mean - 0.5772).abs() < 0.03, "{mean}");
    }

    #[test]
    fn pruned_choices_equal_the_full_scan() {
        let mut rng = SplitMix(3);
        for case in 0..300 {
            let spread = [1.0, 10.0, 60.0][case % 3];
            let l: Vec<f32> = (0..500).map(|_| spread * rng.uniform()).collect();
            let s = Sampling {
                seed: case as u64,
                ..sampling(0.8, None, None)
            };
            for runner_up in [false, true] {
                let full = top_two(
                    (0..l.len()).map(|i| (i, l[i] / 0.8 + gumbel(s.seed, 7, i as u32))),
                    runner_up,
                );
                assert_eq!(s.choose(&l, 7, runner_up), full, "case {case}");
            }
        }
        for u in [1e-12, 0.1, 0.5, 0.9, 0.999, 1.0 - 1e-15] {
            assert!(
                f64::from(gumbel_of(u)) <= f64::from(noise_bound(u)) + 1e-6,
                "{u}"
            );
        }
    }

    /// A temperature too small to sample decodes greedily, with a note, instead of scores
    /// that overflow f32 (1e-40 made every score infinite); at the floor it still samples.
    #[test]
    fn a_temperature_below_the_floor_is_greedy_with_a_note() {
        let mut rng = SplitMix(5);
        let l: Vec<f32> = (0..500).map(|_| 30.0 * rng.uniform()).collect();
        let greedy = Sampling::GREEDY.choose(&l, 3, true);
        for t in [1e-40, 1e-38, 1e-20, 5e-5] {
            let s = sampling(t, None, None);
            assert!(s.check().is_ok() && s.is_greedy(), "{t}");
            assert_eq!(s.choose(&l, 3, true), greedy, "{t}");
            assert!(
                s.greedy_note()
                    .is_some_and(|n| n.contains("decoding greedily"))
            );
        }
        assert_eq!(Sampling::GREEDY.greedy_note(), None);
        let floor = sampling(Sampling::MIN_TEMPERATURE, None, None);
        assert!(!floor.is_greedy() && floor.greedy_note().is_none());
    }

    #[test]
    fn bad_settings_are_named() {
        for (s, needle) in [
            (sampling(-1.0, None, None), "--temperature"),
            (sampling(f32::NAN, None, None), "--temperature"),
            (sampling(1.0, Some(0), None), "--top-k"),
            (sampling(1.0, None, Some(0.0)), "--top-p"),
            (sampling(1.0, None, Some(1.5)), "--top-p"),
        ] {
            assert!(s.check().expect_err("bad").contains(needle));
        }
        assert!(sampling(0.7, Some(20), Some(0.9)).check().is_ok());
    }

    #[test]
    fn distributions_draws_and_residuals_are_what_rejection_sampling_needs() {
        let s = sampling(1.0, Some(2), None);
        let p = s.distribution(&[0.0, 1.0, 2.0]);
        assert_eq!(p[0], 0.0, "top-k drops the least likely");
        assert!((p[1] + p[2] - 1.0).abs() < 1e-6 && p[2] > p[1]);
        assert_eq!(draw(&p, 0.01), 1);
        assert_eq!(draw(&p, 0.99), 2);
        assert_eq!(draw(&[0.5, 0.5, 0.0], 1.0), 1, "rounding past the total");
        let r = residual(&[0.2, 0.5, 0.3], &[0.4, 0.4, 0.2]).expect("mass left");
        assert!((r[0]).abs() < 1e-6 && (r[1] - 0.5).abs() < 1e-6 && (r[2] - 0.5).abs() < 1e-6);
        assert_eq!(residual(&[0.5, 0.5], &[0.5, 0.5]), None);
        let streams = [Draw::FirstProposal, Draw::AcceptFirst, Draw::Residual];
        let u: Vec<f64> = streams.iter().map(|&d| s.uniform(7, d)).collect();
        assert!(u[0] != u[1] && u[1] != u[2] && u.iter().all(|&x| x > 0.0 && x < 1.0));
    }

    /// The filter as a full sort: most likely first, top-k, then the nucleus.
    fn kept_by_full_sort(s: &Sampling, l: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        order.truncate(s.top_k.unwrap_or(l.len()).max(1));
        if let Some(p) = s.top_p {
            let max = l[order[0]] / s.temperature;
            let w: Vec<f64> = (order.iter())
                .map(|&i| f64::from(l[i] / s.temperature - max).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let mut cumulative = 0.0;
            let keep = w
                .iter()
                .take_while(|&&x| {
                    let before = cumulative;
                    cumulative += x / total;
                    before < f64::from(p)
                })
                .count();
            order.truncate(keep.max(1));
        }
        order.sort_unstable();
        order
    }

    #[test]
    fn the_partial_sort_keeps_what_a_full_sort_keeps() {
        let mut rng = SplitMix(11);
        for case in 0..300 {
            let vocab = [7, 100, 4096][case % 3];
            let spread = [0.5, 3.0, 12.0][case / 3 % 3];
            // Coarse logits make ties; every ninth case is all ties.
            let l: Vec<f32> = (0..vocab)
                .map(|_| (rng.uniform() * spread * 4.0).round() / 4.0)
                .map(|x| if case % 9 == 0 { 1.0 } else { x })
                .collect();
            let top_k = [None, Some(1), Some(5), Some(50)][case % 4];
            let top_p = [None, Some(0.3), Some(0.9), Some(0.999), Some(1.0)][case % 5];
            let s = sampling([0.7, 1.0, 1.5][case % 3], top_k, top_p);
            if top_k.is_none() && top_p.is_none() {
                continue;
            }
            assert_eq!(s.kept(&l), kept_by_full_sort(&s, &l), "case {case}: {s}");
        }
    }
}
