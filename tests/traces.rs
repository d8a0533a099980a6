//! Traces: a recorded race reads back event for event; a replay shows at every step what the
//! live dashboard showed; bad files get one-line errors and never a panic.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::path::Path;
use std::sync::mpsc;

use common::{Variant, random_model, recorded_race, spec, spex_ok};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use spex::engine::policy::PolicyKind;
use spex::engine::rng::SplitMix;
use spex::engine::{DecodeOptions, LoadedModel, Sampling};
use spex::harness::race::{RaceEvent, run_race};
use spex::harness::trace::{FORMAT_VERSION, ModelRecord, Trace, TraceHeader, TraceWriter};
use spex::tui::app::{App, Focus, ModelInfo, Msg};
use spex::tui::replay::{Replayer, model_info};
use spex::tui::ui::draw;

fn race(loaded: &LoadedModel, prompt: &str, policy: PolicyKind) -> Vec<RaceEvent> {
    let (_control, control_rx) = mpsc::channel();
    let mut events = Vec::new();
    let options = DecodeOptions {
        max_tokens: 16,
        context: 128,
        sampling: Sampling::GREEDY,
        exit_threshold: None,
    };
    run_race(loaded, prompt, policy, options, control_rx, |e| {
        events.push(e);
        true
    });
    events
}

fn header(prompt: &str, policy: PolicyKind) -> TraceHeader {
    TraceHeader {
        spex_trace: FORMAT_VERSION,
        spex_version: "test".into(),
        model: ModelRecord {
            name: "random".into(),
            config: serde_json::json!({}),
            passes: 4,
            layers: 2,
            weights_sha256: "0".repeat(64),
            tokenizer_sha256: "0".repeat(64),
        },
        policy,
        sampling: Sampling::GREEDY,
        max_tokens: 16,
        context: 128,
        device: "cpu".into(),
        dtype: "f32".into(),
        cpu: None,
        prompt: prompt.into(),
    }
}

/// Records `events` to `path` through the writer, as the dashboard does.
fn record(path: &Path, header: &TraceHeader, events: &[RaceEvent]) {
    let mut writer = TraceWriter::create(path, header).unwrap();
    for e in events {
        writer.record(e).unwrap();
    }
}

fn screen(app: &App) -> Vec<String> {
    let mut terminal = Terminal::new(TestBackend::new(120, 36)).unwrap();
    terminal.draw(|f| draw(f, app)).unwrap();
    let text = terminal.backend().to_string();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    // The footer differs by design: a replay names its file and step.
    lines.truncate(lines.len().saturating_sub(2));
    lines
}

fn live_app(info: ModelInfo, prompt: &str) -> App {
    let mut app = App::new(info, Some(prompt.into()), (120, 36));
    app.start();
    app
}

#[test]
fn a_replay_shows_at_every_step_what_the_live_dashboard_showed() {
    let (dir, loaded) = random_model(&spec(2, 4, Variant::Tied, 5));
    for (prompt, policy) in [
        ("To be, or not to be", PolicyKind::Speed),
        ("Shall I compare thee", PolicyKind::DUAL),
        ("HAMLET.", "loopspec:d2=2".parse().unwrap()),
    ] {
        let events = race(&loaded, prompt, policy);
        let path = dir.path().join("run.jsonl");
        let header = header(prompt, policy);
        record(&path, &header, &events);
        let trace = Trace::read(&path).unwrap();
        assert_eq!(trace.events, events, "the trace reads back event for event");
        assert_eq!((trace.header.clone(), trace.cut_line), (header, None));
        let info = model_info(&trace);
        let steps = trace.steps();
        assert!(steps > 3, "{steps} steps");
        let mut replay = App::new(info.clone(), None, (120, 36));
        replay.prompt = prompt.into();
        replay.focus = Focus::Speculative;
        let mut replayer = Replayer::new(trace, "run.jsonl".into(), 0);
        // Forward through every step, then back through a few: each position against a live
        // app fed the same events in one go.
        let order: Vec<usize> = (0..=steps).chain((0..steps).rev().step_by(3)).collect();
        for step in order {
            replayer.go_to(step);
            if let Some(msg) = replayer.message() {
                replay.update(msg);
            }
            let shown = replay.replay.as_ref().unwrap().step;
            assert_eq!(shown, step);
            let mut live = live_app(info.clone(), prompt);
            live.focus = Focus::Speculative;
            let end = events_through(&events, step, steps);
            live.update(Msg::Engine(events[..end].to_vec()));
            assert_eq!(screen(&replay), screen(&live), "{policy} step {step}");
        }
    }
}

#[test]
fn the_explorer_jumps_a_replay_to_each_occurrence_and_shows_the_what_if() {
    use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    use spex::tui::app::{Command, Seek};
    let (_dir, loaded) = random_model(&spec(2, 4, Variant::Tied, 5));
    let prompt = "To be, or not to be";
    let options = DecodeOptions {
        max_tokens: 16,
        context: 128,
        sampling: Sampling::GREEDY,
        exit_threshold: None,
    };
    let trace = recorded_race(&loaded, prompt, PolicyKind::Speed, options);
    let steps = trace.steps();
    let mut app = App::new(model_info(&trace), None, (120, 36));
    app.focus = Focus::Speculative;
    let mut replayer = Replayer::explained(trace, "run.jsonl".into(), steps);
    app.update(replayer.message().unwrap());
    let analysis = app.replay.as_ref().unwrap().analysis.clone().unwrap();
    let what_if = analysis.what_if.as_ref().expect("a greedy speed trace");
    let speed = &what_if.forecasts[1];
    assert_eq!(
        (speed.policy.as_str(), speed.recorded_steps),
        ("speed", Some(steps as u64))
    );
    assert_eq!(speed.steps, steps as u64);
    let pair = analysis
        .explanation
        .pairs
        .first()
        .expect("random models mispredict");
    let key = |c| Msg::Key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    app.update(key('x'));
    assert!(screen(&app).iter().any(|l| l.contains("what-if")));
    for occurrence in pair.occurrences.iter().chain(&pair.occurrences[..1]) {
        let commands = app.update(key('g'));
        let to = occurrence.step as usize;
        assert_eq!(commands.last(), Some(&Command::Seek(Seek::To(to))));
        replayer.go_to(to);
        app.update(replayer.message().unwrap());
        assert_eq!(app.replay.as_ref().unwrap().step, to);
    }
}

/// How many events the live run had sent when its speculative lane finished step `step`.
fn events_through(events: &[RaceEvent], step: usize, steps: usize) -> usize {
    if step == steps {
        return events.len();
    }
    let mut seen = 0;
    for (i, e) in events.iter().enumerate() {
        if spex::harness::trace::is_speculative_step(e) {
            if seen == step {
                return i;
            }
            seen += 1;
        }
    }
    events.len()
}

fn small_trace(dir: &Path) -> Vec<u8> {
    let (_d, loaded) = random_model(&spec(1, 2, Variant::Tied, 3));
    let mut events = race(&loaded, "To be", PolicyKind::Speed);
    events.truncate(12);
    let path = dir.join("small.jsonl");
    record(&path, &header("To be", PolicyKind::Speed), &events);
    std::fs::read(&path).unwrap()
}

#[test]
fn bad_traces_get_one_line_errors() {
    let dir = tempfile::TempDir::new().unwrap();
    let good = small_trace(dir.path());
    let text = String::from_utf8(good.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // A recording killed mid-line: the valid prefix, and the cut line named.
    let cut = &good[..good.len() - 40];
    let trace = Trace::parse(cut).expect("a cut trace reads up to its last whole line");
    assert_eq!(trace.cut_line, Some(lines.len()));
    assert_eq!(trace.events.len(), lines.len() - 2);
    // A corrupt line in the middle is an error naming it.
    let mut corrupt: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    corrupt[3] = corrupt[3].replace("\"record\"", "\"rekord\"");
    let err = Trace::parse((corrupt.join("\n") + "\n").as_bytes()).unwrap_err();
    assert!(err.starts_with("line 4: not a trace record"), "{err}");
    // A value with an escaped newline, which serde quotes decoded: still one line.
    let mut escaped: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let line = (escaped.iter().enumerate().skip(1))
        .find(|(_, l)| l.contains("\"baseline\""))
        .map(|(i, _)| i)
        .expect("a baseline record");
    escaped[line] = escaped[line].replacen("\"baseline\"", "\"basel\\ne\"", 1);
    let err = Trace::parse((escaped.join("\n") + "\n").as_bytes()).unwrap_err();
    assert!(err.contains("basel\\ne"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // A newer format names both versions.
    let newer = text.replacen("\"spex_trace\":1", "\"spex_trace\":7", 1);
    let err = Trace::parse(newer.as_bytes()).unwrap_err();
    assert!(
        err.contains("version 7") && err.contains("version 1"),
        "{err}"
    );
    for not_a_trace in [&b""[..], b"{}", b"hello\n", b"\xff\xfe", b"[1,2,3]\n"] {
        let err = Trace::parse(not_a_trace).unwrap_err();
        assert!(err.contains("not a spex trace"), "{err}");
        assert_eq!(err.lines().count(), 1);
    }
}

#[test]
fn a_hundred_thousand_mutated_traces_never_panic_the_reader() {
    let dir = tempfile::TempDir::new().unwrap();
    let good = small_trace(dir.path());
    let mut rng = SplitMix(1);
    let (mut read, mut refused) = (0, 0);
    for _ in 0..100_000 {
        let mut bytes = good.clone();
        let r = rng.next_u64();
        match r % 4 {
            0 => bytes.truncate((r >> 8) as usize % bytes.len()),
            1 => {
                for _ in 0..1 + (r >> 8) % 4 {
                    let at = rng.next_u64() as usize % bytes.len();
                    bytes[at] = rng.next_u64() as u8;
                }
            }
            2 => {
                let at = (r >> 8) as usize % bytes.len();
                let len = (rng.next_u64() as usize % 64).min(bytes.len() - at);
                bytes.drain(at..at + len);
            }
            _ => {
                let at = (r >> 8) as usize % bytes.len();
                let from = rng.next_u64() as usize % bytes.len();
                let chunk: Vec<u8> = bytes[from..(from + 32).min(bytes.len())].to_vec();
                bytes.splice(at..at, chunk);
            }
        }
        match Trace::parse(&bytes) {
            Ok(_) => read += 1,
            Err(e) => {
                assert_eq!(e.lines().count(), 1, "{e}");
                refused += 1;
            }
        }
    }
    assert!(
        read > 1000 && refused > 1000,
        "{read} read, {refused} refused"
    );
}

#[test]
fn generate_records_a_trace_that_reads_back() {
    let (dir, _) = random_model(&spec(2, 3, Variant::Gqa, 4));
    let d = dir.path().display().to_string();
    let file = dir.path().join("gen.jsonl");
    let f = file.display().to_string();
    let args = ["--model", &d, "--max-tokens", "8"];
    spex_ok(
        &[
            &["generate", "--prompt", "To be", "--record", &f],
            &args[..],
        ]
        .concat(),
        &[],
        Path::new("."),
    );
    let trace = Trace::read(&file).unwrap();
    assert_eq!(trace.header.prompt, "To be");
    assert_eq!(trace.header.model.weights_sha256.len(), 64);
    assert!(trace.steps() > 0 && matches!(trace.events.last(), Some(RaceEvent::Done)));
}

#[test]
fn bench_records_a_trace_a_run_that_what_if_replays() {
    let (dir, _) = random_model(&spec(2, 3, Variant::Gqa, 4));
    let traces = record_bench_traces(dir.path());
    let trace = Trace::read(&traces.join("02-dual_2.jsonl")).unwrap();
    assert_eq!(trace.header.policy, PolicyKind::Dual { margin_below: 2.0 });
    assert_eq!(trace.header.prompt, "Shall I");
    let lanes: std::collections::HashSet<String> = (trace.events.iter())
        .filter_map(|e| match e {
            RaceEvent::Decode { lane, .. } => Some(format!("{lane:?}")),
            _ => None,
        })
        .collect();
    assert_eq!(lanes.len(), 2, "both lanes recorded");
    assert!(
        trace
            .events
            .iter()
            .any(|e| matches!(e, RaceEvent::StepTimes(_)))
    );
    // What-if from the speed traces predicts the steps the dual traces recorded, and each
    // policy's own replay its recorded steps.
    let (from_speed, from_dual) = (what_if(&traces, "speed"), what_if(&traces, "dual_2"));
    let names: Vec<&str> = (0..3)
        .map(|i| from_speed[i]["policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["baseline", "speed", "dual:2"]);
    for i in 0..3 {
        assert_eq!(from_speed[i]["steps"], from_dual[i]["steps"], "{i}");
    }
    assert_eq!(from_speed[0]["steps"], from_speed[0]["recorded_steps"]);
    assert_eq!(from_speed[1]["steps"], from_speed[1]["recorded_steps"]);
    assert_eq!(from_dual[2]["steps"], from_dual[2]["recorded_steps"]);
    assert!(from_speed[2]["recorded_steps"].is_null());
}

/// `spex bench --record-dir DIR/traces` over two prompts, two runs each, speed and dual:2 on the
/// checkpoint in `dir`; checks the file names and returns the folder.
fn record_bench_traces(dir: &Path) -> std::path::PathBuf {
    let d = dir.display().to_string();
    let traces = dir.join("traces");
    let t = traces.display().to_string();
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "To be\nShall I\n").unwrap();
    let p = prompts.display().to_string();
    let bench = [
        "bench",
        "--runs",
        "2",
        "--policy",
        "speed,dual:2",
        "--prompts",
        &p,
    ];
    let args = ["--model", &d, "--max-tokens", "8", "--record-dir", &t];
    spex_ok(&[&bench[..], &args[..]].concat(), &[], Path::new("."));
    let mut names: Vec<String> = std::fs::read_dir(&traces)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "01-dual_2.jsonl",
            "01-speed.jsonl",
            "02-dual_2.jsonl",
            "02-speed.jsonl"
        ]
    );
    traces
}

/// `spex explain --what-if speed,dual:2` over `policy`'s two traces: its forecasts.
fn what_if(traces: &Path, policy: &str) -> serde_json::Value {
    let files = [1, 2].map(|n| traces.join(format!("0{n}-{policy}.jsonl")));
    let files = files.map(|f| f.display().to_string());
    let args = ["explain", &files[0], &files[1], "--json"];
    let out = spex_ok(
        &[&args[..], &["--what-if", "speed,dual:2"]].concat(),
        &[],
        Path::new("."),
    );
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    report["what_if"]["forecasts"].clone()
}

#[path = "traces/explorer.rs"]
mod explorer;

/// Whether `xml` is well-formed as far as an SVG of text needs: every tag closed in order,
/// and every `&` an entity.
fn well_formed(xml: &str) -> Result<(), String> {
    let mut stack: Vec<&str> = Vec::new();
    let mut rest = xml;
    while let Some(open) = rest.find('<') {
        let text = &rest[..open];
        for (i, _) in text.match_indices('&') {
            let entity = &text[i..];
            if !["&amp;", "&lt;", "&gt;", "&quot;"]
                .iter()
                .any(|e| entity.starts_with(e))
            {
                return Err(format!("a bare & in {text:?}"));
            }
        }
        let close = rest[open..].find('>').ok_or("an unclosed tag")? + open;
        let tag = &rest[open + 1..close];
        if let Some(name) = tag.strip_prefix('/') {
            let top = stack.pop().ok_or(format!("</{name}> closes nothing"))?;
            if top != name {
                return Err(format!("</{name}> closes <{top}>"));
            }
        } else if !tag.ends_with('/') {
            stack.push(tag.split_whitespace().next().ok_or("an empty tag")?);
        }
        rest = &rest[close + 1..];
    }
    match stack.is_empty() {
        true => Ok(()),
        false => Err(format!("unclosed {stack:?}")),
    }
}

#[test]
fn a_snapshot_is_an_svg_of_the_dashboard_at_its_step() {
    let (dir, loaded) = random_model(&spec(2, 4, Variant::Tied, 5));
    let events = race(&loaded, "To be, or not to be", PolicyKind::Speed);
    let path = dir.path().join("run.jsonl");
    record(
        &path,
        &header("To be, or not to be", PolicyKind::Speed),
        &events,
    );
    let steps = Trace::read(&path).unwrap().steps();
    let out = dir.path().join("frame.svg");
    let (o, p) = (out.display().to_string(), path.display().to_string());
    spex_ok(
        &["snapshot", "--step", "5", "--svg", &o, &p],
        &[],
        Path::new("."),
    );
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    well_formed(&svg).unwrap();
    assert!(
        svg.contains(&format!("step 5/{steps}")),
        "the footer names the step"
    );
    for pass in 1..=4 {
        assert!(svg.contains(&format!("pass {pass}")), "pipeline row {pass}");
    }
    assert!(svg.contains("To be, or not to be"), "the lanes' text");
    assert!(well_formed("<a><b></a></b>").is_err() && well_formed("<a>&</a>").is_err());
    // A step past the trace's end is one line naming the last step, and writes nothing.
    std::fs::remove_file(&out).unwrap();
    let past = (steps + 1).to_string();
    let failed = std::process::Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(["snapshot", "--step", &past, "--svg", &o, &p])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(
        !failed.status.success() && stderr.trim().lines().count() == 1,
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("the trace's last step is {steps}")),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing written");
}
