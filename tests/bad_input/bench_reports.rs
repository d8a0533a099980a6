//! What `spex bench` reports on good input: identical outputs, interleaved runs, the
//! coupled policies under sampling, the stored weight type. Part of the `bad_input` test
//! binary, beside the bench's bad-input cases.

use std::path::Path;

use super::common::{Variant, random_model, spec, spex_ok};

#[test]
fn bench_reports_identical_outputs() {
    let (dir, _) = random_model(&spec(2, 3, Variant::Gqa, 1));
    let d = dir.path().display().to_string();
    let out = spex_ok(
        &[
            "bench",
            "--model",
            &d,
            "--max-tokens",
            "12",
            "--runs",
            "2",
            "--policy",
            "dual:2.5,loopspec:d2=2",
            "--turn-ms",
            "0.5",
            "--json",
        ],
        &[],
        Path::new("."),
    );
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(report["runs_per_lane"], 2);
    assert_eq!(report["turn_ms"], 0.5);
    assert_eq!(
        report["policies"],
        serde_json::json!(["dual:2.5", "loopspec:d2=2"])
    );
    let [dual, loopspec] = [0, 1].map(|k| &report["overall"]["policies"][k]);
    assert!(dual["second_proposals"].as_u64().unwrap() > 0);
    assert!(loopspec["gate_open_rate"].as_f64().unwrap() > 0.0);
    for policy in [dual, loopspec] {
        assert_eq!(policy["identical"], true, "{policy}");
        let a = &policy["acceptance"];
        let total: f64 = ["first", "second", "restart"]
            .map(|k| a[k].as_f64().unwrap())
            .iter()
            .sum();
        assert!((total - 1.0).abs() < 1e-9, "{a}");
    }
    assert!(report["overall"]["ceiling"].as_f64().unwrap() > 0.0);
    assert_eq!(report["prompts"].as_array().unwrap().len(), 8);
}

#[test]
fn bench_under_sampling_compares_coupled_policies_and_not_loopspec() {
    let (dir, _) = random_model(&spec(2, 3, Variant::Gqa, 1));
    let d = dir.path().display().to_string();
    let args = ["bench", "--model", &d, "--max-tokens", "12", "--runs", "1"];
    let sampled = [
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--policy",
        "speed,loopspec",
        "--json",
    ];
    let out = spex_ok(&[&args[..], &sampled].concat(), &[], Path::new("."));
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let [speed, loopspec] = [0, 1].map(|k| &report["overall"]["policies"][k]);
    assert_eq!(speed["identical"], true);
    assert_eq!(loopspec["same_distribution"], true);
    for prompt in report["prompts"].as_array().unwrap() {
        assert_eq!(prompt["policies"][0]["comparison"], "identical");
        assert_eq!(prompt["policies"][1]["comparison"], "same_distribution");
    }
}

/// A random checkpoint (2 layers × 3 passes) and a file of two prompts beside it: the
/// checkpoint's folder and the file's path.
fn bench_model() -> (tempfile::TempDir, String, String) {
    let (dir, _) = random_model(&spec(2, 3, Variant::Tied, 2));
    let d = dir.path().display().to_string();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "To be, or not to be\nShall I compare thee\n").unwrap();
    let p = prompts.display().to_string();
    (dir, d, p)
}

#[test]
fn bench_interleaves_its_runs_and_reports_each_one() {
    let (_dir, d, p) = bench_model();
    let args = ["bench", "--model", &d, "--max-tokens", "10", "--runs", "3"];
    let out = spex_ok(
        &[&args[..], &["--prompts", &p, "--isa", "portable", "--json"]].concat(),
        &[],
        Path::new("."),
    );
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(report["kernel_isa"], "Portable");
    assert_eq!(report["backend"], "host kernels");
    assert!(report["step_rows"].is_null());
    // The portable loops prefetch nothing: the default plan stands, untimed.
    let plan = report["prefetch"].as_str().unwrap();
    assert_eq!(plan, "l1");
    let overall: Vec<f64> = report["overall"]["policies"][0]["run_speedups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(overall.len(), 3);
    assert!(overall.windows(2).all(|w| w[0] <= w[1]) && overall[0] > 0.0);
    for prompt in report["prompts"].as_array().unwrap() {
        let lane = &prompt["policies"][0];
        assert_eq!(lane["run_speedups"].as_array().unwrap().len(), 3);
        assert_eq!(lane["comparison"], "identical");
    }
    let table = spex_ok(
        &[&args[..], &["--prompts", &p, "--prefetch", "l2"]].concat(),
        &[],
        Path::new("."),
    );
    let table = String::from_utf8(table).unwrap();
    assert!(
        table.contains("3 runs per prompt interleaved in turns of 2 ms"),
        "{table}"
    );
    assert!(table.contains("prefetch l2 (forced)"), "{table}");
    assert!(table.contains("runs min–med–max"), "{table}");
}

/// bf16 decodes on spex's kernels, its weights read as stored, and says so; with
/// --candle-ops on candle's ops, every decode step padded to 2·R rows.
#[test]
fn bench_names_the_stored_type_and_the_candle_ops_padding() {
    let (_dir, d, p) = bench_model();
    let bf16 = [
        "bench",
        "--model",
        &d,
        "--max-tokens",
        "4",
        "--runs",
        "1",
        "--dtype",
        "bf16",
    ];
    let table = spex_ok(
        &[&bf16[..], &["--prompts", &p]].concat(),
        &[],
        Path::new("."),
    );
    let table = String::from_utf8(table).unwrap();
    assert!(table.contains("thread(s), bf16 weights"), "{table}");
    let candle = [&bf16[..], &["--prompts", &p, "--candle-ops"]].concat();
    let table = String::from_utf8(spex_ok(&candle, &[], Path::new("."))).unwrap();
    assert!(
        table.contains("candle ops in bf16, each decode step padded to 6 rows"),
        "{table}"
    );
}

/// Where the passes after the first flip nearly every prediction (a random checkpoint of 12
/// layers: 98–100 % at each), the table says to read the ceiling, not the speedup; where
/// they flip fewer (2 layers: about 60 %), it says nothing.
#[test]
fn bench_says_when_nearly_every_prediction_flipped() {
    let dir = tempfile::TempDir::new().unwrap();
    let d = dir.path().join("deep");
    let d = d.to_str().unwrap();
    let shape = [
        "--hidden",
        "128",
        "--layers",
        "12",
        "--heads",
        "4",
        "--kv-heads",
        "2",
    ];
    let args = [
        &["random-checkpoint", "--out", d][..],
        &shape,
        &["--intermediate", "128"],
    ];
    spex_ok(&args.concat(), &[], Path::new("."));
    let bench = ["--max-tokens", "12", "--runs", "1"];
    let table = spex_ok(
        &[&["bench", "--model", d][..], &bench].concat(),
        &[],
        Path::new("."),
    );
    let table = String::from_utf8(table).unwrap();
    let note = table
        .lines()
        .find(|l| l.starts_with("speed: passes 2–4 changed"));
    let note = note.unwrap_or_else(|| panic!("no note: {table}"));
    assert!(
        note.contains("read the ceiling (") && note.ends_with("not the speedup"),
        "{note}"
    );
    let (_dir, shallow, p) = bench_model();
    let args = ["bench", "--model", &shallow, "--prompts", &p];
    let table = spex_ok(&[&args[..], &bench].concat(), &[], Path::new("."));
    let table = String::from_utf8(table).unwrap();
    assert!(!table.contains("read the ceiling"), "{table}");
}
