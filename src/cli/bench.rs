//! `spex bench`: baseline and SPEED on every prompt in one process; a table or JSON report;
//! a non-zero exit when any output differs.

use std::path::Path;

use serde_json::json;

use super::{BenchArgs, load_model};
use crate::engine::bench::{PromptResult, bench_prompt};
use crate::engine::metrics::RunStats;
use crate::engine::metrics::speedup;
use crate::engine::policy::PolicyKind;
use crate::engine::{DecodeOptions, EngineError};

/// Prompts used when `--prompts` is not given.
pub const DEFAULT_PROMPTS: &str = include_str!("../../assets/prompts.txt");

/// Reads one prompt per non-empty line; the file must be UTF-8.
pub fn read_prompts(path: Option<&Path>) -> Result<Vec<String>, EngineError> {
    let text = match path {
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| EngineError::file(p, e))?;
            String::from_utf8(bytes).map_err(|e| {
                EngineError::file(
                    p,
                    format!(
                        "not UTF-8 text (invalid byte at offset {})",
                        e.utf8_error().valid_up_to()
                    ),
                )
            })?
        }
        None => DEFAULT_PROMPTS.to_string(),
    };
    let prompts: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if prompts.is_empty() {
        let name = path.map_or("built-in prompts".into(), |p| p.display().to_string());
        return Err(EngineError::file(name, "no prompts (one per line)"));
    }
    Ok(prompts)
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let prompts = read_prompts(args.prompts.as_deref())?;
    let session = load_model(&args.model)?;
    let loaded = &session.loaded;
    let options = DecodeOptions {
        max_tokens: args.max_tokens,
        context: args.model.context,
        sampling: args.sampling.resolve(&session)?,
    };
    let policy = session.speculative_policy(args.policy);
    if !args.json {
        println!(
            "{} on {} ({}), kernels {:?}; {policy} against baseline, {}, {} interleaved runs per prompt",
            session.name,
            cpu_model().unwrap_or_else(|| "an unknown CPU".into()),
            session.device,
            crate::engine::kernels::isa(),
            options.sampling,
            args.runs
        );
    }
    let mut results = Vec::new();
    for prompt in &prompts {
        let lane = (policy, args.runs as usize);
        let mut r = bench_prompt(loaded, &session.prompt(prompt), options, lane)?;
        r.prompt.clone_from(prompt);
        if !args.json {
            print_row(&r, results.is_empty(), loaded.model().passes());
        }
        results.push(r);
    }
    let (base, speed) = totals(&results, loaded.model().passes());
    let spread = run_speedups(&results, loaded.model().passes());
    let ceiling =
        results.iter().map(|r| r.step_times.ceiling()).sum::<f64>() / results.len() as f64;
    let mismatches = results.iter().filter(|r| r.mismatch.is_some()).count();
    if args.json {
        let report = json_report(
            &session,
            &results,
            (&base, &speed, &spread),
            ceiling,
            (policy, args.runs, options.sampling),
        );
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let counts = (mismatches, results.len());
        print_overall((&base, &speed, &spread), policy, ceiling, counts);
    }
    if mismatches > 0 {
        anyhow::bail!(
            "{mismatches} of {} prompts: {} output differs from baseline",
            results.len(),
            policy
        );
    }
    Ok(())
}

/// The whole run as one JSON object (the `--json` output).
fn json_report(
    session: &super::Session,
    results: &[PromptResult],
    (base, speed, spread): (&RunStats, &RunStats, &[f64]),
    ceiling: f64,
    (policy, runs, sampling): (PolicyKind, u64, crate::engine::Sampling),
) -> serde_json::Value {
    let mismatches = results.iter().filter(|r| r.mismatch.is_some()).count();
    json!({
        "model": session.name,
        "device": session.device,
        "dtype": session.dtype,
        "passes": session.loaded.model().passes(),
        "layers": session.loaded.model().config.num_hidden_layers,
        "kernel_isa": format!("{:?}", crate::engine::kernels::isa()),
        "cpu": cpu_model(),
        "runs_per_lane": runs,
        "policy": policy,
        "sampling": sampling,
        "peak_memory_bytes": peak_memory_bytes(),
        "prompts": results.iter().map(|r| json!({
            "prompt": r.prompt,
            "identical": r.mismatch.is_none(),
            "mismatch": r.mismatch,
            "baseline": r.baseline.stats,
            "speculative": r.speculative.stats,
            "speedup": r.speedup(),
            "run_speedups": r.runs.iter().map(|(b, s)| speedup(b, s)).collect::<Vec<_>>(),
            "ceiling": r.step_times.ceiling(),
            "step_times": r.step_times,
            "gamma": r.speculative.stats.gamma(),
        })).collect::<Vec<_>>(),
        "overall": {
            "baseline_tokens_per_sec": base.tokens_per_sec(),
            "speed_tokens_per_sec": speed.tokens_per_sec(),
            "speedup": speedup(base, speed),
            "run_speedups": spread,
            "ceiling": ceiling,
            "gamma": speed.gamma(),
            "flip_rate_per_pass": speed.flip_rates(),
            "wasted_row_slots": speed.wasted_fraction(),
            "second_proposals": speed.second_proposals,
            "accepted_second": speed.accepted_second,
            "identical": mismatches == 0,
        }
    })
}

/// The CPU's model name (Linux `/proc/cpuinfo`), if known.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// The process's peak resident memory in bytes (Linux `VmHWM`), if known.
pub fn peak_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Baseline and speculative statistics summed over prompts.
fn summed<'a>(
    pairs: impl Iterator<Item = (&'a RunStats, &'a RunStats)>,
    passes: usize,
) -> (RunStats, RunStats) {
    let (mut base, mut speculative) = (RunStats::new(passes), RunStats::new(passes));
    for (b, s) in pairs {
        base.add(b);
        speculative.add(s);
    }
    (base, speculative)
}

/// Every prompt's shown (median) run, summed.
fn totals(results: &[PromptResult], passes: usize) -> (RunStats, RunStats) {
    summed(
        results
            .iter()
            .map(|r| (&r.baseline.stats, &r.speculative.stats)),
        passes,
    )
}

/// The overall speedup of each run (every prompt's k-th run together), sorted.
fn run_speedups(results: &[PromptResult], passes: usize) -> Vec<f64> {
    let runs = results.iter().map(|r| r.runs.len()).min().unwrap_or(0);
    let mut speedups: Vec<f64> = (0..runs)
        .map(|k| {
            let (base, speculative) =
                summed(results.iter().map(|r| (&r.runs[k].0, &r.runs[k].1)), passes);
            speedup(&base, &speculative)
        })
        .collect();
    speedups.sort_by(f64::total_cmp);
    speedups
}

/// min–median–max of sorted values.
fn spread(sorted: &[f64]) -> String {
    match (sorted.first(), sorted.last()) {
        (Some(min), Some(max)) => {
            let median = sorted[(sorted.len() - 1) / 2];
            format!("{min:.2}–{median:.2}–{max:.2}×")
        }
        _ => "—".into(),
    }
}

fn flip_rates(s: &RunStats) -> String {
    s.flip_rates()
        .iter()
        .map(|r| format!("{:.0}%", 100.0 * r))
        .collect::<Vec<_>>()
        .join(" ")
}

fn print_row(r: &PromptResult, header: bool, passes: usize) {
    if header {
        println!(
            "{:<28} {:>9} {:>9} {:>8} {:>8} {:>6} {:>7}  {:<w$}  same",
            "prompt",
            "base t/s",
            format!("{} t/s", r.speculative.policy),
            "speedup",
            "ceiling",
            "γ",
            "wasted",
            "flips/pass",
            w = passes * 4
        );
    }
    let mut p: String = r.prompt.chars().take(27).collect();
    if r.prompt.chars().count() > 27 {
        p.pop();
        p.push('…');
    }
    let same = match r.mismatch {
        None => "✓".to_string(),
        Some((i, margin)) => format!("✗ at token {i} (baseline margin {margin:.3})"),
    };
    println!(
        "{:<28} {:>9.1} {:>9.1} {:>7.2}× {:>7.2}× {:>6.2} {:>6.1}%  {:<w$}  {same}",
        p,
        r.baseline.stats.tokens_per_sec(),
        r.speculative.stats.tokens_per_sec(),
        r.speedup(),
        r.step_times.ceiling(),
        r.speculative.stats.gamma(),
        100.0 * r.speculative.stats.wasted_fraction(),
        flip_rates(&r.speculative.stats),
        w = passes * 4
    );
}

fn print_overall(
    (base, speed, runs): (&RunStats, &RunStats, &[f64]),
    policy: PolicyKind,
    ceiling: f64,
    (mismatches, n): (usize, usize),
) {
    let peak = peak_memory_bytes().map_or("?".into(), |b| format!("{:.0} MB", b as f64 / 1e6));
    let second = if speed.second_proposals > 0 {
        format!(
            ", second proposals {} ({} committed)",
            speed.second_proposals, speed.accepted_second
        )
    } else {
        String::new()
    };
    println!(
        "overall: baseline {:.1} tok/s, {policy} {:.1} tok/s, speedup {:.2}× (runs {}), ceiling {:.2}×, γ {:.2}, wasted {:.1}%, flips/pass {}{second}, identical {}/{}, peak memory {peak}",
        base.tokens_per_sec(),
        speed.tokens_per_sec(),
        speedup(base, speed),
        spread(runs),
        ceiling,
        speed.gamma(),
        100.0 * speed.wasted_fraction(),
        flip_rates(speed),
        n - mismatches,
        n
    );
}
