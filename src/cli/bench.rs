//! `spex bench`: baseline and every listed policy on every prompt in one process, interleaved;
//! one table (or a JSON report) that formats the harness's report (`harness::report`), which
//! computes every figure once; a non-zero exit when any output differs where it must not.

use std::path::{Path, PathBuf};

use serde_json::json;

use super::device::cpu_model;
use super::{BenchArgs, load_model};
use crate::engine::events::DecodeEvent;
use crate::engine::policy::PolicyKind;
use crate::engine::{DecodeOptions, EngineError};
use crate::harness::bandwidth::{self, Bandwidth};
use crate::harness::bench::{Comparison, Lineup, PromptResult, bench_prompt};
use crate::harness::exit_loss::{self, HeldOutLoss, held_out_windows};
use crate::harness::race::{Lane, RaceEvent};
use crate::harness::report::{BenchReport, Figures, PromptReport, Spread, peak_memory_bytes};
use crate::harness::trace::{TraceHeader, TraceWriter};

/// Prompts used when `--prompts` is not given.
pub const DEFAULT_PROMPTS: &str = include_str!("../../assets/prompts.txt");

/// Reads one prompt per non-empty line; the file must be UTF-8.
pub fn read_prompts(path: Option<&Path>) -> Result<Vec<String>, EngineError> {
    let text = match path {
        Some(p) => crate::engine::files::read_text(p, crate::engine::files::FileKind::Settings)?,
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

/// What decodes: spex's kernels (their instruction set and threads), or candle's ops (the
/// dtype, and the rows every decode step is padded to, which a CPU pays for in full).
fn backend_note(loaded: &crate::engine::LoadedModel) -> String {
    let dtype = super::device::dtype_name(loaded.model().dtype);
    let info = loaded.backend.info();
    match info.host {
        Some(host) => format!(
            "kernels {:?} on {} thread(s), {} weights{}",
            host.isa,
            host.threads,
            loaded.model().weight_type(),
            host.integer_products
                .map_or(String::new(), |p| format!(" ({p} integer products)"))
        ),
        None => format!(
            "candle ops in {dtype}, each decode step padded to {} rows",
            info.step_rows.unwrap_or_default()
        ),
    }
}

/// ", f16 KV cache" where the host kernels decode (the device path keeps its dtype).
fn kv_cache_note(loaded: &crate::engine::LoadedModel) -> &'static str {
    use crate::engine::model::KvDtype;
    match loaded.backend.info().host.map(|h| h.kv_dtype) {
        Some(KvDtype::F16) => ", f16 KV cache",
        Some(KvDtype::F32) => ", f32 KV cache",
        None => "",
    }
}

/// ", prefetch l2 (…)" where the host kernels decode: the plan and, where it was timed, each
/// candidate's one-row and R-row step.
fn prefetch_note(loaded: &crate::engine::LoadedModel) -> String {
    use crate::engine::kernels::prefetch::Choice;
    let Some(choice) = loaded.backend.info().host.and_then(|h| h.prefetch) else {
        return String::new();
    };
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    match choice {
        Choice::Forced(plan) => format!(", prefetch {} (forced)", plan.name()),
        Choice::Measured { chosen, trials } if trials.is_empty() => {
            format!(
                ", prefetch {} (not timed: these kernels prefetch nothing)",
                chosen.name()
            )
        }
        Choice::Measured { chosen, trials } => {
            let timed: Vec<String> = (trials.iter())
                .map(|t| {
                    let (one, many) = (ms(t.one_row), ms(t.many_rows));
                    format!("{} {one:.2}/{many:.2} ms", t.plan.name())
                })
                .collect();
            let passes = loaded.model().passes();
            format!(
                ", prefetch {} (1-row/{passes}-row step: {})",
                chosen.name(),
                timed.join(", ")
            )
        }
    }
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let prompts = args.lanes.read_prompts()?;
    // Checked before the model loads: a bench can run for an hour.
    if let Some(dir) = &args.record_dir {
        std::fs::create_dir_all(dir).map_err(|e| {
            EngineError::file(dir, format!("--record-dir: cannot make this folder: {e}"))
        })?;
    }
    let session = load_model(&args.model, &args.policy)?;
    let passes = session.loaded.model().passes();
    let options = (args.model).decode_options(args.max_tokens, args.sampling.resolve(&session)?);
    let policies = session.bench_policies(&args.policy);
    if !args.json {
        print_header(args, &session, options, &policies);
    }
    let held_out = held_out_losses(args, &session, options, &policies)?;
    let (results, probes) = bench_prompts(args, &session, options, &prompts, &policies)?;
    let mut report = BenchReport::of(&results, passes);
    for (p, held_out) in report.policies.iter_mut().zip(held_out) {
        if let Some(loss) = p.lossy.as_mut() {
            loss.held_out = held_out;
        }
    }
    let bandwidth = Bandwidth::of(session.loaded.model(), &results, &report, probes);
    if args.json {
        let json = json_report(
            &session,
            &report,
            bandwidth.as_ref(),
            args,
            options.sampling,
        );
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        print_overall(&report, passes);
        print_bandwidth(bandwidth.as_ref());
    }
    let failed = report.failed();
    if !failed.is_empty() {
        anyhow::bail!(
            "{} output differs from baseline (see the table's last column)",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Each lane's exit rule scored on `--held-out` (`None` for the lossless lanes, and for all
/// without the flag); a flag with no lossy lane to score is one line.
fn held_out_losses(
    args: &BenchArgs,
    session: &super::Session,
    options: DecodeOptions,
    policies: &[PolicyKind],
) -> anyhow::Result<Vec<Option<HeldOutLoss>>> {
    if args.held_out.is_empty() {
        return Ok(vec![None; policies.len()]);
    }
    if !policies.iter().any(|p| p.is_lossy()) {
        anyhow::bail!(
            "--held-out scores the lossy lanes' exit rules, and none is raced (add --policy exit:…)"
        );
    }
    let model = session.loaded.model();
    let windows = held_out_windows(
        &args.held_out,
        &session.loaded.tokenizer,
        model.config.positions,
    )?;
    let threshold = options.exit_threshold_or(model.config.exit_threshold);
    Ok(exit_loss::held_out_losses(
        model, policies, threshold, &windows,
    )?)
}

/// The line above the table: the model, the machine, the kernels and the method.
fn print_header(
    args: &BenchArgs,
    session: &super::Session,
    options: DecodeOptions,
    policies: &[PolicyKind],
) {
    let names: Vec<String> = policies.iter().map(ToString::to_string).collect();
    println!(
        "{} on {} ({}), {}{}{}; {} against baseline, {}, {} runs per prompt interleaved in turns of {} ms",
        session.name,
        super::device::machine_name(&session.loaded),
        session.device,
        backend_note(&session.loaded),
        kv_cache_note(&session.loaded),
        prefetch_note(&session.loaded),
        names.join(", "),
        options.sampling,
        args.lanes.runs,
        args.lanes.turn_ms
    );
}

/// Every prompt's race of the baseline and `policies`, each printed as it ends (unless
/// `--json`) and recorded where `--record-dir` asks; with the read bandwidth probed before the
/// first prompt and after each, where it means something ([`bandwidth::probe`]).
fn bench_prompts(
    args: &BenchArgs,
    session: &super::Session,
    options: DecodeOptions,
    prompts: &[String],
    policies: &[PolicyKind],
) -> anyhow::Result<(Vec<PromptResult>, Vec<f64>)> {
    let passes = session.loaded.model().passes();
    let mut recorder = match &args.record_dir {
        Some(dir) => Some(BenchRecorder::new(
            dir,
            super::record::header(session, options)?,
        )),
        None => None,
    };
    let turns = args.lanes.turns();
    let mut results = Vec::new();
    let mut probes: Vec<f64> = bandwidth::probe(&session.loaded)?.into_iter().collect();
    for (index, prompt) in prompts.iter().enumerate() {
        let mut traces = match recorder.as_mut() {
            Some(r) => r.open(index, prompt, policies)?,
            None => Vec::new(),
        };
        let mut observe = |lane: usize, event: &DecodeEvent| record_event(&mut traces, lane, event);
        let lineup = Lineup { policies, turns };
        let mut r = bench_prompt(
            &session.loaded,
            &session.prompt(prompt)?,
            options,
            lineup,
            &mut observe,
        )?;
        for trace in &mut traces {
            trace.record(&RaceEvent::StepTimes(r.step_times))?;
            trace.record(&RaceEvent::Done)?;
        }
        r.prompt.clone_from(prompt);
        if !args.json {
            print_prompt(&PromptReport::of(&r), results.is_empty(), passes);
        }
        results.push(r);
        probes.extend(bandwidth::probe(&session.loaded)?);
    }
    Ok((results, probes))
}

/// Where `--record-dir` writes: one trace per prompt and policy, each with the policy's lane and
/// the baseline's.
struct BenchRecorder {
    dir: PathBuf,
    header: TraceHeader,
}

impl BenchRecorder {
    /// Traces into `dir`, which `run` made before the model loaded.
    fn new(dir: &Path, header: TraceHeader) -> Self {
        Self {
            dir: dir.to_path_buf(),
            header,
        }
    }

    /// The traces of prompt `index`, one per policy, headers written.
    fn open(
        &self,
        index: usize,
        prompt: &str,
        policies: &[PolicyKind],
    ) -> Result<Vec<TraceWriter>, EngineError> {
        (policies.iter())
            .map(|&policy| {
                let header = TraceHeader {
                    policy,
                    prompt: prompt.to_string(),
                    ..self.header.clone()
                };
                TraceWriter::create(
                    &super::record::bench_trace(&self.dir, index, policy),
                    &header,
                )
            })
            .collect()
    }
}

/// Writes a bench lane's event to its traces: the baseline's (lane 0) to every one, policy
/// k's (lane k) to the k-th as its speculative lane.
fn record_event(
    traces: &mut [TraceWriter],
    lane: usize,
    event: &DecodeEvent,
) -> Result<(), EngineError> {
    let record = |lane| RaceEvent::Decode {
        lane,
        event: event.clone(),
    };
    match lane {
        0 => (traces.iter_mut()).try_for_each(|t| t.record(&record(Lane::Baseline))),
        k => match traces.get_mut(k - 1) {
            Some(t) => t.record(&record(Lane::Speculative)),
            None => Ok(()),
        },
    }
}

/// The whole run as one JSON object (the `--json` output): the report, with what ran it.
fn json_report(
    session: &super::Session,
    report: &BenchReport,
    bandwidth: Option<&Bandwidth>,
    args: &BenchArgs,
    sampling: crate::engine::Sampling,
) -> serde_json::Value {
    let info = session.loaded.backend.info();
    let host = info.host.as_ref();
    json!({
        "model": session.name,
        "device": session.device,
        "dtype": session.dtype,
        "passes": session.loaded.model().passes(),
        "layers": session.loaded.model().config.layers,
        "backend": info.name,
        "step_rows": info.step_rows,
        "kernel_isa": host.map(|h| format!("{:?}", h.isa)),
        "weight_type": session.loaded.model().weight_type(),
        "integer_products": host.and_then(|h| h.integer_products),
        "threads": host.map(|h| h.threads),
        "prefetch": host.and_then(|h| h.prefetch.as_ref()).map(|c| c.plans().name()),
        "cpu": cpu_model(),
        "gpu": info.accelerator,
        "runs_per_lane": args.lanes.runs,
        "turn_ms": args.lanes.turn_ms,
        "policies": report.policies.iter().map(|p| &p.policy).collect::<Vec<_>>(),
        "sampling": sampling,
        "peak_memory_bytes": peak_memory_bytes(),
        "prompts": report.prompts,
        "overall": {
            "ceiling": report.ceiling,
            "read_bytes_per_sec": bandwidth.map(|b| b.probed.median),
            "read_bytes_per_sec_probes": bandwidth.map(|b| &b.probes),
            "weight_bytes_per_token": crate::harness::roofline::weight_bytes_per_token(session.loaded.model()),
            "baseline_bandwidth_share": bandwidth.map(|b| b.share.median),
            "baseline_bandwidth_share_per_prompt": bandwidth.map(|b| &b.shares),
            "policies": report.policies,
        }
    })
}

/// A spread as min–median–max, or a dash where there was nothing to spread.
fn spread(s: Spread, count: usize) -> String {
    match count {
        0 => "—".into(),
        _ => format!("{:.2}–{:.2}–{:.2}×", s.low, s.median, s.high),
    }
}

fn flip_rates(f: &Figures) -> String {
    (f.flip_rates.iter())
        .map(|r| format!("{:.0}%", 100.0 * r))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Acceptance by source as `first/second/restart %`.
fn acceptance(f: &Figures) -> String {
    let a = &f.acceptance;
    let pct = |x: f64| format!("{:.0}", 100.0 * x);
    format!("{}/{}/{}%", pct(a.first), pct(a.second), pct(a.restart))
}

/// The gate-open rate, or a dash for a policy without a gate.
fn gate(f: &Figures) -> String {
    f.gate_open_rate
        .map_or("—".into(), |rate| format!("{:.0}%", 100.0 * rate))
}

/// The prompt cut to `width` characters, with an ellipsis where it was cut.
fn cut(prompt: &str, width: usize) -> String {
    let mut p: String = prompt.chars().take(width).collect();
    if prompt.chars().count() > width {
        p.pop();
        p.push('…');
    }
    p
}

fn print_prompt(r: &PromptReport, header: bool, passes: usize) {
    if header {
        println!(
            "{:<28} {:<16} {:>8} {:>8} {:>8} {:>8} {:>5} {:>13} {:>5}  {:<w$}  same",
            "prompt",
            "policy",
            "base t/s",
            "t/s",
            "speedup",
            "ceiling",
            "γ",
            "1st/2nd/rest",
            "gate",
            "flips/pass",
            w = passes * 4
        );
    }
    for (k, p) in r.policies.iter().enumerate() {
        let same = match p.comparison {
            Comparison::Identical => "✓".to_string(),
            Comparison::SameDistribution => "same distribution".to_string(),
            Comparison::Differs { index, margin } => {
                format!("✗ at token {index} (baseline margin {margin:.3})")
            }
            Comparison::Lossy(d) => format!("lossy: {}", d.describe()),
        };
        let prompt = if k == 0 {
            cut(&r.prompt, 27)
        } else {
            String::new()
        };
        let f = &p.figures;
        println!(
            "{:<28} {:<16} {:>8.1} {:>8.1} {:>7.2}× {:>7.2}× {:>5.2} {:>13} {:>5}  {:<w$}  {same}",
            prompt,
            p.policy.to_string(),
            f.baseline_tokens_per_sec,
            f.tokens_per_sec,
            f.speedup,
            r.ceiling,
            f.gamma,
            acceptance(f),
            gate(f),
            flip_rates(f),
            w = passes * 4
        );
    }
}

fn print_overall(report: &BenchReport, passes: usize) {
    let prompts = report.prompts.len();
    let peak = peak_memory_bytes().map_or("?".into(), |b| format!("{:.0} MB", b as f64 / 1e6));
    println!(
        "\noverall, {prompts} prompts: ceiling {:.2}×, peak memory {peak}",
        report.ceiling
    );
    println!(
        "{:<16} {:>8} {:>8} {:>7} {:>20} {:>5} {:>13} {:>5}  {:<w$}  {:>6}  same",
        "policy",
        "base t/s",
        "t/s",
        "speedup",
        "runs min–med–max",
        "γ",
        "1st/2nd/rest",
        "gate",
        "flips/pass",
        "wasted",
        w = passes * 4
    );
    for p in &report.policies {
        let same = if let Some(loss) = &p.lossy {
            let held_out = loss.held_out.map_or(String::new(), |h| {
                format!(
                    ", held-out CE {:+.3} nats ({:.3} vs {:.3})",
                    h.excess_nats(),
                    h.nats,
                    h.baseline_nats
                )
            });
            format!(
                "lossy: {:.1} % agree, departed on {}/{prompts}, {:.2} passes/token{held_out}",
                100.0 * loss.agreement,
                loss.departed(),
                loss.passes_per_token
            )
        } else if p.compared < prompts {
            format!("same distribution ({} compared)", p.compared)
        } else {
            format!("identical {}/{prompts}", prompts - p.mismatches)
        };
        let f = &p.figures;
        println!(
            "{:<16} {:>8.1} {:>8.1} {:>6.2}× {:>20} {:>5.2} {:>13} {:>5}  {:<w$}  {:>5.1}%  {same}",
            p.policy,
            f.baseline_tokens_per_sec,
            f.tokens_per_sec,
            f.speedup,
            spread(p.run_speedup_spread, p.run_speedups.len()),
            f.gamma,
            acceptance(f),
            gate(f),
            flip_rates(f),
            100.0 * f.wasted,
            w = passes * 4
        );
    }
    for p in &report.policies {
        if let Some((low, high)) = p.figures.nearly_all_flipped() {
            println!(
                "{}: passes 2–{passes} changed {:.0}–{:.0} % of the predictions (as random weights do), so almost no guess was kept: read the ceiling ({:.2}×), not the speedup",
                p.policy,
                100.0 * low,
                100.0 * high,
                report.ceiling
            );
        }
    }
}

/// The line under the table at real size: the bandwidth probed, a baseline token's weight
/// bytes, and the share of the bandwidth the baseline read around each prompt.
fn print_bandwidth(bandwidth: Option<&Bandwidth>) {
    let Some(b) = bandwidth else {
        return;
    };
    let gb = |bytes: f64| bytes / 1e9;
    println!(
        "read bandwidth over the weights {:.1}–{:.1} GB/s, probed around every prompt; a \
         baseline token reads {:.2} GB of weights, so {:.2} tok/s reads {:.1} GB/s; around \
         each prompt the baseline read {:.0} % of the bandwidth (median; {:.0}–{:.0} %)",
        gb(b.probed.low),
        gb(b.probed.high),
        gb(b.weight_bytes_per_token as f64),
        b.baseline_tokens_per_sec,
        gb(b.baseline_read_bytes_per_sec),
        100.0 * b.share.median,
        100.0 * b.share.low,
        100.0 * b.share.high,
    );
}
