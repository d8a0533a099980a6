//! Fuzzed readers: thousands of mutated traces, configs and safetensors headers, seeded and
//! bounded in time, through what reads them — the trace parser, `explain`, the replay's
//! loader with its explorer, `snapshot`; the config parser; the checkpoint loader. No case
//! may panic, allocate more than [`ALLOCATION_BOUND_BYTES`] at once (the allocator below
//! refuses, which aborts the test), or refuse in more than one line. An abort names no
//! case: `SPEX_FUZZ_TRACE=1 cargo test --release --test fuzz -- --nocapture` prints each
//! case's seed first.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use common::{OPTIONS, Variant, random_model, recorded_race, spec};
use serde_json::Value;
use spex::engine::LoadedModel;
use spex::engine::config::OuroConfig;
use spex::engine::policy::PolicyKind;
use spex::engine::rng::SplitMix;
use spex::harness::explain::Explanation;
use spex::harness::trace::{Trace, TraceWriter};
use spex::tui::app::App;
use spex::tui::replay::{Replayer, model_info};

/// The largest single allocation any case may make: far above what a small trace or model
/// needs, far below what a size trusted from a file would ask for.
const ALLOCATION_BOUND_BYTES: usize = 512 << 20;

/// The system allocator, refusing any one allocation above the bound: a reader that sized a
/// buffer by a hostile field aborts the test, naming the size.
struct Bounded;

// SAFETY: every call is forwarded to `System` with the same layout and pointer, or refused
// with a null pointer, which the allocation API allows.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match layout.size() > ALLOCATION_BOUND_BYTES {
            true => std::ptr::null_mut(),
            // SAFETY: forwarded as received.
            false => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match layout.size() > ALLOCATION_BOUND_BYTES {
            true => std::ptr::null_mut(),
            // SAFETY: forwarded as received.
            false => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        match new_size > ALLOCATION_BOUND_BYTES {
            true => std::ptr::null_mut(),
            // SAFETY: forwarded as received.
            false => unsafe { System.realloc(ptr, layout, new_size) },
        }
    }
}

#[global_allocator]
static ALLOCATOR: Bounded = Bounded;

/// Values a mutation puts where a number or a string stood.
fn hostile_value(rng: &mut SplitMix) -> Value {
    let values = [
        Value::from(0),
        Value::from(-1),
        Value::from(99),
        Value::from(1.5),
        Value::from(1_000_000_000u64),
        Value::from(1_000_000_000_000u64),
        Value::from(u64::MAX),
        Value::from(-1e300),
        Value::Null,
        Value::from("x"),
        Value::from("\u{1b}[2J\u{7}\n"),
        Value::Array(Vec::new()),
        Value::Object(serde_json::Map::new()),
    ];
    values[pick(rng, values.len())].clone()
}

fn pick(rng: &mut SplitMix, n: usize) -> usize {
    (rng.next_u64() % n.max(1) as u64) as usize
}

/// Every leaf of `v`, as a path of keys and indices.
fn leaves(v: &Value, path: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    match v {
        Value::Object(map) => map.iter().for_each(|(k, v)| {
            path.push(Value::from(k.as_str()));
            leaves(v, path, out);
            path.pop();
        }),
        Value::Array(items) => items.iter().enumerate().for_each(|(i, v)| {
            path.push(Value::from(i));
            leaves(v, path, out);
            path.pop();
        }),
        _ => out.push(path.clone()),
    }
}

fn at<'v>(v: &'v mut Value, path: &[Value]) -> Option<&'v mut Value> {
    path.iter().try_fold(v, |v, key| match key {
        Value::String(k) => v.get_mut(k.as_str()),
        _ => v.get_mut(key.as_u64()? as usize),
    })
}

/// `v` with one leaf replaced by a hostile value, or one key of an object removed.
fn mutate_json(v: &mut Value, rng: &mut SplitMix) {
    let mut all = Vec::new();
    leaves(v, &mut Vec::new(), &mut all);
    if all.is_empty() {
        return;
    }
    let path = all[pick(rng, all.len())].clone();
    if rng.next_u64().is_multiple_of(5)
        && let Some((Value::String(key), parent)) = path.split_last()
        && let Some(Value::Object(map)) = at(v, parent)
    {
        map.remove(key);
        return;
    }
    if let Some(leaf) = at(v, &path) {
        *leaf = hostile_value(rng);
    }
}

/// A mutation of a trace's lines: a value, a line moved, doubled or dropped, or bytes.
fn mutate_trace(lines: &[String], rng: &mut SplitMix) -> Vec<u8> {
    let mut lines = lines.to_vec();
    for _ in 0..1 + pick(rng, 3) {
        let i = pick(rng, lines.len());
        match pick(rng, 6) {
            0 | 1 => {
                if let Ok(mut v) = serde_json::from_str::<Value>(&lines[i]) {
                    mutate_json(&mut v, rng);
                    lines[i] = v.to_string();
                }
            }
            2 => {
                let line = lines[i].clone();
                lines.insert(pick(rng, lines.len()), line);
            }
            3 if lines.len() > 1 => {
                lines.remove(i);
            }
            4 => {
                let j = pick(rng, lines.len());
                lines.swap(i, j);
            }
            _ => {}
        }
    }
    let mut bytes = lines.join("\n").into_bytes();
    bytes.push(b'\n');
    if rng.next_u64().is_multiple_of(4) {
        let at = pick(rng, bytes.len());
        match pick(rng, 3) {
            0 => bytes[at] ^= 1 << pick(rng, 8),
            1 => bytes.truncate(at),
            _ => bytes.insert(at, (rng.next_u64() & 0xff) as u8),
        }
    }
    bytes
}

/// Asserts that `message` is one line.
fn one_line(case: &str, message: &str) {
    assert!(
        !message.contains('\n'),
        "{case}: a refusal of more than one line: {message}"
    );
}

/// What a trace's readers do with `bytes`: parse, explain, load for replay with its
/// explorer, draw a step. True where the trace parsed and went past the parser.
fn read_trace(case: &str, bytes: &[u8]) -> bool {
    let trace = match Trace::parse(bytes) {
        Ok(trace) => trace,
        Err(message) => {
            one_line(case, &message);
            return false;
        }
    };
    let _ = Explanation::of(std::slice::from_ref(&trace), 20);
    let steps = trace.steps();
    let mut app = App::new(model_info(&trace), None, (120, 36));
    let mut replayer = Replayer::explained(trace.clone(), "fuzz.jsonl".into(), steps / 2);
    if let Some(msg) = replayer.message() {
        app.update(msg);
    }
    let size = ratatui::layout::Size::new(120, 36);
    match spex::tui::replay::snapshot(trace, "fuzz.jsonl".into(), steps / 2, size, false) {
        Ok(svg) => assert!(svg.starts_with("<svg"), "{case}"),
        Err(e) => one_line(case, &e.to_string()),
    }
    true
}

/// Runs `case` on `seed`s from 0 until `count` cases or `budget` pass; returns the cases run
/// and the seeds that panicked.
fn fuzz(count: u64, budget: Duration, mut case: impl FnMut(u64)) -> (u64, Vec<u64>) {
    let started = Instant::now();
    let mut panicked = Vec::new();
    let mut ran = 0;
    while ran < count && started.elapsed() < budget {
        if std::env::var_os("SPEX_FUZZ_TRACE").is_some() {
            eprintln!("fuzz case {ran}");
        }
        if catch_unwind(AssertUnwindSafe(|| case(ran))).is_err() {
            panicked.push(ran);
        }
        ran += 1;
    }
    (ran, panicked)
}

/// The lines of a real recorded race, as its trace file holds them.
fn trace_lines(policy: PolicyKind) -> Vec<String> {
    let (dir, loaded) = random_model(&spec(1, 4, Variant::Tied, 3));
    let options = spex::engine::DecodeOptions {
        max_tokens: 8,
        ..OPTIONS
    };
    let trace = recorded_race(&loaded, "To be, or not", policy, options);
    let path = dir.path().join("t.jsonl");
    let mut writer = TraceWriter::create(&path, &trace.header).unwrap();
    trace.events.iter().for_each(|e| writer.record(e).unwrap());
    drop(writer);
    let text = std::fs::read_to_string(&path).unwrap();
    text.lines().map(String::from).collect()
}

#[test]
fn mutated_traces_never_panic_or_allocate_past_the_bound() {
    let lines = [
        trace_lines(PolicyKind::Speed),
        trace_lines(PolicyKind::DUAL),
    ];
    assert!(read_trace(
        "the unmutated trace",
        (lines[0].join("\n") + "\n").as_bytes()
    ));
    let mut parsed = 0;
    let (ran, panicked) = fuzz(10_000, Duration::from_secs(40), |seed| {
        let mut rng = SplitMix(seed);
        let bytes = mutate_trace(&lines[(seed % 2) as usize], &mut rng);
        parsed += usize::from(read_trace(&format!("trace case {seed}"), &bytes));
    });
    assert!(
        panicked.is_empty(),
        "{} of {ran} cases panicked: seeds {panicked:?}",
        panicked.len()
    );
    assert!(ran >= 2_000, "only {ran} cases ran in the time");
    // The mutations must reach the readers behind the parser, not only its refusals.
    assert!(
        parsed * 10 >= ran as usize,
        "only {parsed} of {ran} mutated traces parsed"
    );
    eprintln!("{ran} mutated traces, {parsed} parsed and read");
}

#[test]
fn mutated_configs_never_panic_and_refuse_in_one_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Gqa, 4));
    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    let config: Value = serde_json::from_str(&text).unwrap();
    let path = Path::new("config.json");
    let (ran, panicked) = fuzz(10_000, Duration::from_secs(20), |seed| {
        let mut rng = SplitMix(seed);
        let mut v = config.clone();
        for _ in 0..1 + pick(&mut rng, 3) {
            mutate_json(&mut v, &mut rng);
        }
        match OuroConfig::from_json(&v, path) {
            Ok(c) => {
                let c = c.looped();
                let _ = spex::engine::memory::weight_bytes(&c, DType::BF16);
                let _ = spex::engine::memory::kv_cache_bytes(&c, c.positions, 4);
            }
            Err(e) => one_line(&format!("config case {seed}"), &e.to_string()),
        }
    });
    assert!(
        panicked.is_empty(),
        "{} of {ran} cases panicked: seeds {panicked:?}",
        panicked.len()
    );
}

/// The safetensors header of `file`: its JSON, and the bytes after it.
fn split_safetensors(bytes: &[u8]) -> (Value, Vec<u8>) {
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    (header, bytes[8 + len..].to_vec())
}

#[test]
fn mutated_safetensors_headers_never_panic_and_refuse_in_one_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 5));
    let weights = dir.path().join("model.safetensors");
    let (header, data) = split_safetensors(&std::fs::read(&weights).unwrap());
    let (ran, panicked) = fuzz(400, Duration::from_secs(30), |seed| {
        let mut rng = SplitMix(seed);
        let mut h = header.clone();
        mutate_json(&mut h, &mut rng);
        let json = h.to_string().into_bytes();
        let mut len = json.len() as u64;
        if rng.next_u64().is_multiple_of(8) {
            len = [0, 1, len + 1, u64::MAX, 1 << 40][pick(&mut rng, 5)];
        }
        let bytes = [&len.to_le_bytes()[..], &json, &data].concat();
        std::fs::write(&weights, bytes).unwrap();
        if let Err(e) = LoadedModel::load(dir.path(), &Device::Cpu, DType::F32) {
            one_line(&format!("safetensors case {seed}"), &e.to_string());
        }
    });
    assert!(
        panicked.is_empty(),
        "{} of {ran} cases panicked: seeds {panicked:?}",
        panicked.len()
    );
}
