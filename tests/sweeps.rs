//! The sweeps end to end (`spex sweep lengths|sizes|policies`): each point measured with
//! identical outputs, a chart at slide size, and bad arguments as one line; and the bench's
//! bandwidth figures at a size whose passes read DRAM.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::path::Path;

use candle_core::DType;
use common::{Variant, assert_clean_error, random_model, spec, spex_ok};
use spex::engine::random_checkpoint::write_random_checkpoint;

/// `spex sweep lengths`: the bench at each length, identical at every one, a chart at slide
/// size, and a length past the context is one line.
#[test]
fn a_length_sweep_reports_every_length_and_draws_its_chart() {
    let (dir, _) = random_model(&spec(1, 3, Variant::Tied, 6));
    let d = dir.path().display().to_string();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "To be, or not to be\nShall I compare thee\n").unwrap();
    let p = prompts.display().to_string();
    let chart = dir.path().join("lengths.svg");
    let c = chart.display().to_string();
    let args = [
        "sweep",
        "lengths",
        "--model",
        &d,
        "--prompts",
        &p,
        "--svg",
        &c,
    ];
    let out = spex_ok(
        &[
            &args[..],
            &[
                "--lengths",
                "4,8",
                "--policy",
                "speed,loopspec",
                "--runs",
                "1",
                "--json",
            ],
        ]
        .concat(),
        &[],
        Path::new("."),
    );
    let sweep: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(sweep["prompts"], 2);
    let points = sweep["points"].as_array().unwrap();
    let lengths: Vec<u64> = points
        .iter()
        .map(|p| p["max_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(lengths, [4, 8]);
    for point in points {
        assert!(point["ceiling"].as_f64().unwrap() > 0.0, "{point}");
        let policies = point["policies"].as_array().unwrap();
        let names: Vec<&str> = policies
            .iter()
            .map(|q| q["policy"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["speed", "loopspec"]);
        assert!(policies.iter().all(|q| q["identical"] == true), "{point}");
    }
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(
        svg.starts_with(r#"<svg width="1280" height="720""#),
        "{svg:.80}"
    );
    assert!(svg.contains("loopspec") && svg.contains("ceiling"));
    assert_clean_error(
        &["sweep", "lengths", "--model", &d, "--lengths", "8,600"],
        "--lengths: 600 tokens do not fit the context",
    );
}

/// `spex sweep sizes`: every size measured beside its bound and the bandwidth probed over its
/// weights, the machine's arithmetic named, a chart; a size that is not a multiple of the
/// heads' 128 is one line.
#[test]
fn a_size_sweep_measures_every_size_beside_its_bound() {
    let dir = tempfile::TempDir::new().unwrap();
    let chart = dir.path().join("sizes.svg");
    let c = chart.display().to_string();
    let args = ["sweep", "sizes", "--hidden", "256,128", "--threads", "1"];
    let out = spex_ok(
        &[&args[..], &["--svg", &c, "--json"]].concat(),
        &[],
        Path::new("."),
    );
    let sweep: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert!(sweep["multiply_adds_per_sec"][1].as_f64().unwrap() > 0.0);
    let points = sweep["points"].as_array().unwrap();
    let hidden: Vec<u64> = points
        .iter()
        .map(|p| p["hidden"].as_u64().unwrap())
        .collect();
    assert_eq!(hidden, [128, 256], "sorted");
    for p in points {
        let (ceiling, bound) = (
            p["ceiling"].as_f64().unwrap(),
            p["ceiling_bound"].as_f64().unwrap(),
        );
        // The bound comes from rates timed on this machine a moment earlier, which other
        // processes can slow (CI runs its checks side by side: there hidden 128's bound came
        // out at 0.73, where alone it is about 1.5). The range catches a wrong unit or
        // formula, not a slow probe.
        assert!(ceiling > 0.0 && (0.25..=16.0).contains(&bound), "{p}");
        assert!(p["read_bytes_per_sec"].as_f64().unwrap() > 0.0, "{p}");
    }
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.contains("roofline bound") && svg.contains("measured"));
    assert_clean_error(
        &["sweep", "sizes", "--hidden", "100"],
        "--hidden: 100 is not a multiple of the heads' 128",
    );
}

/// `spex sweep sizes --dtype`: each size also quantized as `spex quantize` writes it, measured
/// beside bf16 and named by the types it stores; the roofline bound (timed with bf16 weights)
/// only for bf16. An unknown type is one line.
#[test]
fn a_size_sweep_measures_quantized_weights_beside_bf16() {
    let dir = tempfile::TempDir::new().unwrap();
    let chart = dir.path().join("sizes.svg");
    let c = chart.display().to_string();
    let args = [
        "sweep",
        "sizes",
        "--hidden",
        "128",
        "--dtype",
        "bf16,q8_0,mlx-4bit",
        "--threads",
        "1",
        "--svg",
        &c,
        "--json",
    ];
    let sweep: serde_json::Value =
        serde_json::from_slice(&spex_ok(&args, &[], Path::new("."))).unwrap();
    let points = sweep["points"].as_array().unwrap();
    let types: Vec<(&str, &str)> = (points.iter())
        .map(|p| {
            (
                p["weights"].as_str().unwrap(),
                p["stored"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        types,
        [("bf16", "bf16"), ("q8_0", "Q8_0"), ("mlx-4bit", "mlx4/g64")]
    );
    assert!(points[0]["ceiling_bound"].as_f64().is_some());
    assert!(points[1]["ceiling_bound"].is_null());
    assert!(points[1]["ceiling"].as_f64().unwrap() > 0.0);
    assert!(points[1]["bytes_per_pass"].as_u64() < points[0]["bytes_per_pass"].as_u64());
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.contains("measured (q8_0)") && svg.contains("roofline bound (bf16)"));
    assert_clean_error(
        &["sweep", "sizes", "--dtype", "q5_k"],
        "\"q5_k\" is not a type spex writes (q8_0, q4_0, q4_k_s, q4_k_m, q5_k_m, mlx-4bit, mlx-8bit;",
    );
}

/// `spex sweep policies`: every policy on every model, identical outputs, a bar chart; a
/// `--model` instead of `--models` is one line.
#[test]
fn a_policy_sweep_benches_every_policy_on_every_model() {
    let (first, _) = random_model(&spec(1, 3, Variant::Tied, 6));
    let (second, _) = random_model(&spec(2, 2, Variant::Untied, 7));
    let models = format!("{},{}", first.path().display(), second.path().display());
    let prompts = first.path().join("prompts.txt");
    std::fs::write(&prompts, "To be, or not to be\nShall I compare thee\n").unwrap();
    let p = prompts.display().to_string();
    let chart = first.path().join("policies.svg");
    let c = chart.display().to_string();
    let args = ["sweep", "policies", "--models", &models, "--prompts", &p];
    let more = [
        "--max-tokens",
        "8",
        "--policy",
        "speed,self-draft:g=2",
        "--runs",
        "1",
    ];
    let out = spex_ok(
        &[&args[..], &more, &["--svg", &c, "--json"]].concat(),
        &[],
        Path::new("."),
    );
    let points: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let points = points.as_array().unwrap();
    assert_eq!(points.len(), 2);
    for point in points {
        assert!(point["ceiling"].as_f64().unwrap() > 0.0, "{point}");
        let policies = point["policies"].as_array().unwrap();
        let names: Vec<&str> = (policies.iter())
            .map(|q| q["policy"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["speed", "self-draft:g=2"]);
        assert!(policies.iter().all(|q| q["identical"] == true), "{point}");
    }
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with(r#"<svg width="1280" height="720""#));
    assert!(svg.contains("self-draft:g=2") && svg.contains("ceiling"));
    assert_clean_error(
        &["sweep", "policies", "--model", "x"],
        "--model: the policy sweep names its models with --models",
    );
}

/// `spex bench` on a model whose passes read DRAM (100 MB of bf16 weights a pass) probes the
/// read bandwidth over those weights before the first prompt and after each, and sets each
/// prompt's baseline against the probes either side of it.
#[test]
fn a_bench_at_real_size_probes_the_bandwidth_around_every_prompt() {
    let dir = tempfile::TempDir::new().unwrap();
    let mut s = spec(4, 2, Variant::Untied, 8);
    (s.shape.hidden, s.shape.heads, s.shape.kv_heads) = (1024, 8, 8);
    (s.shape.head_dim, s.shape.intermediate, s.dtype) = (128, 2816, DType::BF16);
    write_random_checkpoint(dir.path(), &s).unwrap();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "To be, or not to be\nShall I compare thee\n").unwrap();
    let (d, p) = (dir.path().display(), prompts.display());
    let args = [
        "bench",
        "--model",
        &d.to_string(),
        "--prompts",
        &p.to_string(),
    ];
    let out = spex_ok(
        &[&args[..], &["--max-tokens", "2", "--runs", "1", "--json"]].concat(),
        &[],
        Path::new("."),
    );
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let overall = &report["overall"];
    let numbers = |key: &str| -> Vec<f64> {
        let values = overall[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key}: {overall}"));
        values.iter().map(|v| v.as_f64().unwrap()).collect()
    };
    let (probes, shares) = (
        numbers("read_bytes_per_sec_probes"),
        numbers("baseline_bandwidth_share_per_prompt"),
    );
    assert_eq!((probes.len(), shares.len()), (3, 2), "{overall}");
    assert!(probes.iter().chain(&shares).all(|&v| v > 0.0), "{overall}");
    let median = overall["baseline_bandwidth_share"].as_f64().unwrap();
    assert!(shares.contains(&median), "{overall}");
}

/// `spex sweep exits`: every fixed depth below R, each confidence and each gate threshold, as
/// lossy points of speedup against agreement, beside the lossless policy at 100 %; the chart
/// names them lossy; a lossy `--policy` is one line.
#[test]
fn an_exit_sweep_draws_lossy_exits_beside_a_lossless_policy() {
    let (dir, _) = random_model(&spec(1, 3, Variant::Tied, 6));
    let d = dir.path().display().to_string();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "To be, or not to be\nShall I compare thee\n").unwrap();
    let p = prompts.display().to_string();
    let chart = dir.path().join("exits.svg");
    let c = chart.display().to_string();
    let args = [
        "sweep",
        "exits",
        "--model",
        &d,
        "--prompts",
        &p,
        "--svg",
        &c,
        "--max-tokens",
        "12",
        "--runs",
        "1",
        "--confidence",
        "0.5,0.9",
        "--gate",
        "0.5",
        "--json",
    ];
    let out = spex_ok(&args, &[], Path::new("."));
    let sweep: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let points = sweep["points"].as_array().unwrap();
    let names: Vec<&str> = (points.iter())
        .map(|q| q["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "exit:pass=1",
            "exit:pass=2",
            "exit:confidence=0.5",
            "exit:confidence=0.9",
            "exit:gate=0.5",
            "speed"
        ]
    );
    for point in &points[..5] {
        assert_eq!(point["lossy"], true, "{point}");
        let agreement = point["agreement"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&agreement), "{point}");
    }
    let passes_1 = points[0]["passes_per_token"].as_f64().unwrap();
    assert!((passes_1 - 1.0).abs() < 1e-9, "{passes_1}");
    assert_eq!(points[5]["lossy"], false);
    assert_eq!(points[5]["agreement"], 1.0);
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.contains("exit:pass (lossy)") && svg.contains("speed (lossless)"));
    assert_clean_error(
        &["sweep", "exits", "--model", &d, "--policy", "exit:pass=1"],
        "--policy exit:pass=1: the exit sweep draws a lossless policy",
    );
}
