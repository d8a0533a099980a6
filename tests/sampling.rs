//! Seed-coupled sampling (`engine::sampling`): every policy reproduces the baseline's sampled
//! text token for token for the same seed, on many prompts, shapes, seeds, temperatures and
//! filters; and the baseline's samples follow softmax(l / T) of the reference forward, with
//! top-k and top-p applied (chi-square tests over fixed seeds).
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::collections::{BTreeMap, HashSet};

use common::{PROMPTS, Variant, random_model, spec, with_f32_readouts};
use spex::engine::policy::PolicyKind;
use spex::engine::{DecodeOptions, LoadedModel, Sampling};
use spex::harness::bench::run_lane;
use spex::harness::metrics::RunStats;

/// Every combination of three seeds, T ∈ {0.7, 1.0, 1.5} and (no filter, top-k 20, top-p 0.9).
fn combinations() -> Vec<Sampling> {
    let mut all = Vec::new();
    for seed in [1, 2, 3] {
        for temperature in [0.7, 1.0, 1.5] {
            for (top_k, top_p) in [(None, None), (Some(20), None), (None, Some(0.9))] {
                all.push(Sampling {
                    temperature,
                    top_k,
                    top_p,
                    seed,
                });
            }
        }
    }
    all
}

#[test]
fn every_policy_reproduces_the_baselines_sampled_text() {
    let combos = combinations();
    let mut used = HashSet::new();
    let (mut runs, mut unlike_greedy, mut loopspec_differs) = (0, 0, 0);
    for (v, variant) in [Variant::Tied, Variant::Untied, Variant::Gqa]
        .into_iter()
        .enumerate()
    {
        for passes in 1..=4 {
            let (_dir, loaded) = random_model(&spec(2, passes, variant, 40 + passes as u64));
            let reference = with_f32_readouts(&loaded);
            for (i, prompt) in PROMPTS.iter().enumerate() {
                let at = (i + 7 * passes + 3 * v) % combos.len();
                used.insert(at);
                let sampling = combos[at];
                let options = DecodeOptions {
                    max_tokens: 24,
                    context: 128,
                    sampling,
                    exit_threshold: None,
                };
                let base = run_lane(&reference, PolicyKind::Baseline, prompt, options).unwrap();
                let greedy = DecodeOptions::greedy(24, 128);
                let greedy = run_lane(&reference, PolicyKind::Baseline, prompt, greedy).unwrap();
                unlike_greedy += usize::from(greedy.tokens != base.tokens);
                let wide = PolicyKind::Dual { margin_below: 4.0 };
                for policy in [PolicyKind::Speed, PolicyKind::DUAL, wide] {
                    let lane = run_lane(&loaded, policy, prompt, options).unwrap();
                    assert_eq!(
                        base.tokens, lane.tokens,
                        "{variant:?} R={passes} {policy} {sampling}: prompt {prompt:?}"
                    );
                    runs += 1;
                }
                // LoopSpec keeps the distribution, not the sample: its text is its own, and
                // the same seed gives it again.
                if passes >= 3 {
                    let loopspec = "loopspec:d2=2".parse().unwrap();
                    let once = run_lane(&loaded, loopspec, prompt, options).unwrap();
                    let again = run_lane(&loaded, loopspec, prompt, options).unwrap();
                    assert_eq!(once.tokens, again.tokens, "loopspec {sampling}: {prompt:?}");
                    loopspec_differs += usize::from(once.tokens != base.tokens);
                }
            }
        }
    }
    assert_eq!(used.len(), combos.len(), "every combination ran");
    assert!(runs >= 700, "{runs} runs");
    assert!(
        loopspec_differs > 0,
        "loopspec drew the baseline's text every time"
    );
    assert!(
        unlike_greedy > runs / 6,
        "sampling changed the text in {unlike_greedy} runs"
    );
}

/// The kept set of softmax(l / T) under top-k and top-p, and its renormalised probabilities,
/// computed here independently of spex's own filter.
fn target(l: &[f32], s: &Sampling) -> BTreeMap<u32, f64> {
    let t = f64::from(s.temperature);
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    order.truncate(s.top_k.unwrap_or(l.len()));
    let max = f64::from(l[order[0]]);
    let w: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(l[i]) - max) / t).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = order.len();
    if let Some(p) = s.top_p {
        let mut cumulative = 0.0;
        keep = w
            .iter()
            .take_while(|&&x| {
                let before = cumulative;
                cumulative += x / total;
                before < f64::from(p)
            })
            .count()
            .max(1);
    }
    let kept_total: f64 = w[..keep].iter().sum();
    order[..keep]
        .iter()
        .zip(&w)
        .map(|(&i, &x)| (i as u32, x / kept_total))
        .collect()
}

/// Pass-R logits of the reference forward at the last position of `ids` (its keys and values
/// rounded as `loaded`'s KV cache stores them).
fn reference_last(loaded: &LoadedModel, ids: &[u32]) -> Vec<f32> {
    let mut passes = common::reference_logits(loaded, ids);
    let mut last = passes.pop().expect("a pass");
    last.swap_remove(ids.len() - 1)
}

/// Pearson's chi-square of `observed` against `expected` probabilities over `n` draws, cells
/// with an expected count below 5 pooled; asserts it is below the 1 − 10⁻⁴ quantile
/// (Wilson–Hilferty), so a correct sampler fails with probability below 10⁻⁴.
fn assert_follows<K: Ord + Copy + std::fmt::Debug>(
    observed: &BTreeMap<K, usize>,
    expected: &BTreeMap<K, f64>,
    n: usize,
    what: &str,
) {
    for key in observed.keys() {
        assert!(
            expected.contains_key(key),
            "{what}: {key:?} is outside the kept set"
        );
    }
    let (mut cells, mut pooled_e, mut pooled_o) = (Vec::new(), 0.0, 0usize);
    for (key, &p) in expected {
        let e = p * n as f64;
        let o = observed.get(key).copied().unwrap_or(0);
        if e < 5.0 {
            (pooled_e, pooled_o) = (pooled_e + e, pooled_o + o);
        } else {
            cells.push((o, e));
        }
    }
    if pooled_e > 0.0 {
        cells.push((pooled_o, pooled_e));
    }
    let chi2: f64 = cells.iter().map(|&(o, e)| (o as f64 - e).powi(2) / e).sum();
    let df = (cells.len() - 1).max(1) as f64;
    let z = 3.719;
    let h = 2.0 / (9.0 * df);
    let critical = df * (1.0 - h + z * h.sqrt()).powi(3);
    assert!(
        chi2 < critical,
        "{what}: chi-square {chi2:.1} ≥ {critical:.1} (df {df})"
    );
}

const DRAWS: u64 = 2000;

#[test]
fn the_first_sampled_token_follows_the_filtered_softmax() {
    let (_dir, loaded) = random_model(&spec(2, 3, Variant::Untied, 8));
    let prompt = "Shall I compare thee";
    let ids = loaded.tokenizer.encode(prompt).unwrap();
    let logits = reference_last(&loaded, &ids);
    for (temperature, top_k, top_p) in [
        (1.0, None, None),
        (0.8, Some(20), None),
        (1.2, None, Some(0.9)),
    ] {
        let mut observed = BTreeMap::new();
        let base = Sampling {
            temperature,
            top_k,
            top_p,
            seed: 0,
        };
        for seed in 0..DRAWS {
            let sampling = Sampling { seed, ..base };
            let options = DecodeOptions {
                max_tokens: 1,
                context: 64,
                sampling,
                exit_threshold: None,
            };
            let lane = run_lane(&loaded, PolicyKind::Baseline, prompt, options).unwrap();
            *observed.entry(lane.tokens[0]).or_insert(0) += 1;
        }
        let expected = target(&logits, &base);
        assert_follows(&observed, &expected, DRAWS as usize, &base.to_string());
    }
}

/// Over `DRAWS` seeds, `policy`'s first two sampled tokens on a random model with `passes`
/// passes, against the joint filtered softmax of the reference forward; `max_tokens` of 3
/// makes the second token a speculated one (the last never is). Returns the runs' statistics.
fn assert_first_two_follow(policy: PolicyKind, passes: usize, max_tokens: usize) -> RunStats {
    let (_dir, loaded) = random_model(&spec(1, passes, Variant::Tied, 12));
    assert_first_two_follow_on(&loaded, policy, passes, max_tokens)
}

/// [`assert_first_two_follow`] on `loaded`.
fn assert_first_two_follow_on(
    loaded: &LoadedModel,
    policy: PolicyKind,
    passes: usize,
    max_tokens: usize,
) -> RunStats {
    let loaded = loaded.clone();
    let prompt = "To be";
    let ids = loaded.tokenizer.encode(prompt).unwrap();
    let base = Sampling {
        temperature: 0.9,
        top_k: Some(12),
        top_p: None,
        seed: 0,
    };
    let first = target(&reference_last(&loaded, &ids), &base);
    let mut expected = BTreeMap::new();
    for (&x1, &p1) in &first {
        if loaded.tokenizer.is_eos(x1) {
            expected.insert((x1, u32::MAX), p1);
            continue;
        }
        let mut longer = ids.clone();
        longer.push(x1);
        for (x2, p2) in target(&reference_last(&loaded, &longer), &base) {
            expected.insert((x1, x2), p1 * p2);
        }
    }
    let mut observed = BTreeMap::new();
    let mut stats = RunStats::new(passes);
    for seed in 0..DRAWS {
        let options = DecodeOptions {
            max_tokens,
            context: 64,
            sampling: Sampling { seed, ..base },
            exit_threshold: None,
        };
        let lane = run_lane(&loaded, policy, prompt, options).unwrap();
        stats.add(&lane.stats);
        let second = lane.tokens.get(1).copied().unwrap_or(u32::MAX);
        *observed.entry((lane.tokens[0], second)).or_insert(0) += 1;
    }
    assert_follows(
        &observed,
        &expected,
        DRAWS as usize,
        &format!("{policy}, two tokens"),
    );
    stats
}

#[test]
fn the_first_two_sampled_tokens_follow_the_filtered_softmax_jointly() {
    assert_first_two_follow(PolicyKind::Baseline, 2, 2);
}

/// LoopSpec's cascade is lossless in distribution: over many seeds, its
/// first two sampled tokens follow the model's filtered softmax jointly, with first proposals
/// from pass 1 and gated second proposals from pass 2 both in play.
#[test]
fn loopspec_samples_follow_the_filtered_softmax_jointly() {
    let stats = assert_first_two_follow("loopspec:d1=1:d2=2".parse().unwrap(), 3, 3);
    // Every path of the cascade ran: first proposals kept, seconds kept, restarts.
    let a = stats.acceptance();
    assert!(a.first > 0.05 && a.second > 0.0 && a.restart > 0.0, "{a:?}");
    assert!(stats.gate_opens > 0, "the gate never opened");
}

/// Self-draft's verification is Leviathan's rejection rule, lossless in distribution: the
/// first two sampled tokens follow the filtered softmax jointly, the second drafted from
/// pass 1 and checked at pass 3 in a round of two drafts.
#[test]
fn self_draft_samples_follow_the_filtered_softmax_jointly() {
    let stats = assert_first_two_follow("self-draft:g=2".parse().unwrap(), 3, 3);
    let a = stats.acceptance();
    assert!(a.first > 0.05 && a.restart > 0.0, "{a:?}");
}

/// Draft-then-verify with a draft model keeps the distribution too: the second token drafted
/// by another model (a random one of another shape, whose drafts are often rejected) and
/// checked by Leviathan's rejection rule at pass R.
#[test]
fn draft_model_samples_follow_the_filtered_softmax_jointly() {
    let (_dir, loaded) = random_model(&spec(1, 2, Variant::Tied, 12));
    let (_draft_dir, draft) = random_model(&spec(2, 1, Variant::Tied, 13));
    let loaded = loaded.with_draft(draft).unwrap();
    let stats = assert_first_two_follow_on(&loaded, "draft:g=2".parse().unwrap(), 2, 3);
    let a = stats.acceptance();
    assert!(a.first > 0.05 && a.restart > 0.05, "{a:?}");
}
