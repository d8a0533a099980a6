//! Sizes from a file or a flag are checked before anything is allocated, files are read only
//! when they are regular and of a size their kind holds, and no output replaces an input or
//! an existing checkpoint unasked. Each case runs the real binary.

use std::path::Path;
use std::time::{Duration, Instant};

use super::{edit_config, run_with};
use crate::common::{Variant, assert_clean_error, random_model, spec, spex, spex_ok};

/// The arguments of a bench run of one prompt that records its traces into `dir`.
fn record_one_trace(model: &Path, dir: &Path) -> std::path::PathBuf {
    let trace = dir.join("run.jsonl");
    let args = [
        "generate",
        "--model",
        &model.display().to_string(),
        "--prompt",
        "To be",
        "--max-tokens",
        "4",
        "--record",
        &trace.display().to_string(),
    ]
    .map(String::from);
    spex_ok(&args.each_ref().map(String::as_str), &[], Path::new("."));
    trace
}

/// A trace recorded from the model in `dir`: its header as JSON, and the lines after it.
fn recorded_header(dir: &Path) -> (serde_json::Value, String) {
    let text = std::fs::read_to_string(record_one_trace(dir, dir)).unwrap();
    let (first, rest) = text.split_once('\n').unwrap();
    (serde_json::from_str(first).unwrap(), rest.to_string())
}

/// A config's sizes beyond what spex reads are one line naming the field, whatever buffer
/// they would have sized (the passes size the KV cache and the step timing, not the weights).
#[test]
fn config_sizes_past_their_bounds_name_the_field() {
    for (field, value) in [
        ("total_ut_steps", 1_000_000u64),
        ("total_ut_steps", 10_000),
        ("num_hidden_layers", 1 << 40),
        ("vocab_size", 1_000_000_000_000),
        ("hidden_size", 1 << 40),
    ] {
        let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
        edit_config(dir.path(), |c| {
            c.insert(field.into(), value.into());
        });
        run_with(
            dir.path(),
            &format!("field `{field}`: {value} is more than spex reads"),
        );
    }
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    edit_config(dir.path(), |c| {
        c.insert("rms_norm_eps".into(), (-1.0).into());
    });
    run_with(
        dir.path(),
        "field `rms_norm_eps`: must be a positive number",
    );
    for (field, value, needle) in [
        ("torch_dtype", "float8_e4m3", "is not a type spex reads"),
        ("hidden_act", "gelu", "spex runs Ouro's \"silu\""),
    ] {
        let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
        edit_config(dir.path(), |c| {
            c.insert(field.into(), value.into());
        });
        run_with(dir.path(), &format!("field `{field}`: \"{value}\""));
        run_with(dir.path(), needle);
    }
}

/// A context whose KV cache outgrows the machine is one line naming the size, before the
/// cache is allocated (the context is capped at the model's positions: here the most a
/// config may give).
#[test]
fn a_kv_cache_larger_than_the_memory_is_one_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    edit_config(dir.path(), |c| {
        c.insert("max_position_embeddings".into(), (1u64 << 32).into());
    });
    let mut args = super::generate_args(dir.path());
    args.extend(["--context".into(), "100000000000".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(&args, "a KV cache of 4294967296 positions needs");
}

/// config.json or tokenizer.json that is a device or a FIFO is refused by what it is, at once:
/// not read whole, not waited on, not called missing.
#[test]
fn special_files_are_refused_by_type_without_reading_or_blocking() {
    for file in ["config.json", "tokenizer.json"] {
        let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
        let path = dir.path().join(file);
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        run_with(
            dir.path(),
            &format!("{file}: a character device, not a regular file"),
        );
        std::fs::remove_file(&path).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.unwrap().success());
        let started = Instant::now();
        run_with(dir.path(), &format!("{file}: a FIFO, not a regular file"));
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "a FIFO blocked the load"
        );
    }
}

/// A trace header sized past any model (passes, vocabulary) is one line from `explain`,
/// `snapshot` and `replay`, which reads the trace before it opens the terminal.
#[test]
fn a_trace_header_past_any_model_is_one_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let (header, rest) = recorded_header(dir.path());
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 4] = [
        (
            "passes",
            |h| h["model"]["passes"] = 1_000_000_000u64.into(),
            "`model.passes` of 1000000000",
        ),
        (
            "steps",
            |h| h["model"]["config"]["total_ut_steps"] = 1_000_000_000u64.into(),
            "model.config.total_ut_steps",
        ),
        (
            "vocab",
            |h| h["model"]["config"]["vocab_size"] = 1_000_000_000_000u64.into(),
            "model.config.vocab_size",
        ),
        (
            "version",
            |h| h["spex_trace"] = 0.into(),
            "trace format version 0",
        ),
    ];
    for (name, edit, needle) in cases {
        let mut bad = header.clone();
        edit(&mut bad);
        let path = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&path, format!("{bad}\n{rest}")).unwrap();
        let p = path.display().to_string();
        let svg = dir.path().join("out.svg").display().to_string();
        assert_clean_error(&["explain", &p], needle);
        assert_clean_error(&["snapshot", &p, "--step", "1", "--svg", &svg], needle);
        assert_clean_error(&["replay", &p], needle);
    }
}

/// `snapshot --svg` naming its own trace is refused and the trace kept; an SVG too small to
/// draw the dashboard is refused rather than drawn as the "too small" screen.
#[test]
fn snapshot_never_replaces_its_trace_and_refuses_a_size_it_cannot_draw() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let trace = record_one_trace(dir.path(), dir.path());
    let before = std::fs::read(&trace).unwrap();
    let t = trace.display().to_string();
    let same = dir.path().join(".").join("run.jsonl").display().to_string();
    assert_clean_error(
        &["snapshot", &t, "--step", "1", "--svg", &same],
        "--svg names the input file",
    );
    assert_eq!(std::fs::read(&trace).unwrap(), before, "the trace is whole");
    let svg = dir.path().join("a.svg").display().to_string();
    assert_clean_error(
        &["snapshot", &t, "--step", "1", "--svg", &svg, "--width", "0"],
        "--width",
    );
    assert!(!Path::new(&svg).exists(), "nothing written");
}

/// `random-checkpoint` refuses a shape it could not load and an --out holding a checkpoint
/// (unless --force), and checks a shape's memory before drawing it.
#[test]
fn random_checkpoint_refuses_bad_shapes_and_existing_checkpoints() {
    let out = tempfile::TempDir::new().unwrap();
    let o = out.path().join("ckpt").display().to_string();
    let base = ["random-checkpoint", "--out", o.as_str()];
    for (flags, needle) in [
        (&["--hidden", "0"][..], "field `--hidden`: must be positive"),
        (
            &["--hidden", "64", "--heads", "3"],
            "--hidden 64 must be a positive multiple of --heads 3",
        ),
        (&["--vocab", "1000000000000"], "--vocab"),
        (&["--hidden", "1000000000", "--heads", "1"], "--hidden"),
        (
            &["--layers", "100", "--intermediate", "100000000000"],
            "the model's weights needs",
        ),
    ] {
        assert_clean_error(&[&base[..], flags].concat(), needle);
    }
    assert!(!out.path().join("ckpt").exists(), "nothing written");
    let small = [
        "--hidden",
        "32",
        "--layers",
        "1",
        "--vocab",
        "300",
        "--positions",
        "64",
    ];
    spex_ok(&[&base[..], &small].concat(), &[], Path::new("."));
    let config = std::fs::read(out.path().join("ckpt/config.json")).unwrap();
    assert_clean_error(
        &[&base[..], &small].concat(),
        "already holds a checkpoint: pass --force",
    );
    assert_eq!(
        std::fs::read(out.path().join("ckpt/config.json")).unwrap(),
        config
    );
    let (ok, stderr) = spex(&[&base[..], &small, &["--seed", "2", "--force"]].concat());
    assert!(ok, "{stderr}");
}

/// A temperature too small to sample decodes the greedy text, with one note, instead of
/// overflowing to `!"!"`.
#[test]
fn a_vanishing_temperature_decodes_greedily_with_a_note() {
    let args = ["generate", "--prompt", "To be", "--max-tokens", "12"];
    let greedy = spex_ok(&args, &[], Path::new("."));
    for t in ["1e-40", "1e-38"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_spex"))
            .args([&args[..], &["--temperature", t]].concat())
            .output()
            .unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout, greedy, "--temperature {t}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            stderr.trim(),
            format!("spex: --temperature {t}: below 1e-4, decoding greedily")
        );
    }
}

/// Records a reader cannot trust (a step twice, a pass past the model's, a token id past its
/// vocabulary) are one line naming the line, from `explain` and `snapshot` alike.
#[test]
fn damaged_trace_records_are_one_line_naming_the_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let trace = record_one_trace(dir.path(), dir.path());
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let step_at = (lines.iter())
        .position(|l| l.contains(r#""event":"step""#))
        .expect("a step line");
    let edit_row = |edit: fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(lines[step_at]).unwrap();
        edit(&mut v["event"]["rows"][0]);
        let mut edited: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        edited[step_at] = v.to_string();
        edited.join("\n") + "\n"
    };
    let mut doubled: Vec<&str> = lines.clone();
    doubled.insert(step_at, lines[step_at]);
    let line = step_at + 1;
    let cases = [
        (
            doubled.join("\n") + "\n",
            format!(
                "line {}: step 1 of the Speculative lane follows its step 1",
                line + 1
            ),
        ),
        (
            edit_row(|r| r["pass"] = 99.into()),
            format!("line {line}: step 1: pass 99 is past the model's 2 passes"),
        ),
        (
            edit_row(|r| r["token"]["id"] = 1_000_000_000u64.into()),
            format!("line {line}: step 1: token id 1000000000 is outside the vocabulary"),
        ),
    ];
    for (text, needle) in cases {
        let path = dir.path().join("damaged.jsonl");
        std::fs::write(&path, text).unwrap();
        let p = path.display().to_string();
        let svg = dir.path().join("out.svg").display().to_string();
        assert_clean_error(&["explain", &p], &needle);
        assert_clean_error(&["snapshot", &p, "--step", "1", "--svg", &svg], &needle);
    }
}

/// Outputs that cannot be written are refused before the run, not after it; a policy with
/// an empty parameter list is refused, not read as the bare policy; a models.toml that
/// SPEX_MODELS names and that does not exist is worth a note.
#[test]
fn outputs_are_checked_before_the_run_and_half_written_policies_refused() {
    let started = Instant::now();
    let chart = [
        "sweep",
        "lengths",
        "--lengths",
        "8,16",
        "--svg",
        "/proc/spex-x.svg",
    ];
    assert_clean_error(&chart, "/proc/spex-x.svg: --svg: cannot write here");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "refused only after the sweep"
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    let f = file.path().display().to_string();
    assert_clean_error(
        &["bench", "--record-dir", &f, "--max-tokens", "2"],
        "--record-dir: cannot make this folder",
    );
    for policy in ["speed:", "dual:", "loopspec:"] {
        assert_clean_error(
            &["generate", "--prompt", "a", "--policy", policy],
            "nothing after `:`",
        );
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(["generate", "--prompt", "To be", "--max-tokens", "2"])
        .env("SPEX_MODELS", "/nonexistent/models.toml")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("SPEX_MODELS: /nonexistent/models.toml does not exist"),
        "{stderr}"
    );
}

/// Every refusal of a size is made before the size is allocated: each peaks under 100 MB.
#[cfg(target_os = "linux")]
#[test]
fn refusals_of_sizes_peak_under_100_mb() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let (mut header, rest) = recorded_header(dir.path());
    header["model"]["passes"] = 1_000_000_000u64.into();
    let huge_trace = dir.path().join("huge.jsonl");
    std::fs::write(&huge_trace, format!("{header}\n{rest}")).unwrap();
    edit_config(dir.path(), |c| {
        c.insert("total_ut_steps".into(), 1_000_000u64.into());
    });
    let out = tempfile::TempDir::new().unwrap();
    let (d, t) = (
        dir.path().display().to_string(),
        huge_trace.display().to_string(),
    );
    let o = out.path().join("r").display().to_string();
    let cases: [&[&str]; 4] = [
        &["generate", "--model", &d, "--prompt", "a"],
        &["explain", &t],
        &["random-checkpoint", "--out", &o, "--vocab", "1000000000000"],
        &[
            "random-checkpoint",
            "--out",
            &o,
            "--hidden",
            "65536",
            "--heads",
            "16",
            "--layers",
            "4000",
        ],
    ];
    for args in cases {
        let (succeeded, peak) = super::load_memory::exit_and_peak(args);
        assert!(!succeeded, "{args:?} should be refused");
        assert!(
            peak < 100 << 20,
            "{args:?} peaked at {:.0} MB",
            peak as f64 / 1e6
        );
    }
}

/// NaN weights are one line at the first step, not an instant `<|endoftext|>` and exit 0.
#[test]
fn nan_weights_are_one_line_at_the_first_step() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let weights = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    // All ones: a NaN in every f32.
    bytes[header..].fill(0xff);
    std::fs::write(&weights, bytes).unwrap();
    run_with(dir.path(), "prefill: the logits are not finite");
}

/// A recording never replaces a file of the checkpoint it records; a weight stored as an
/// integer type is refused by name instead of read as numbers it does not mean.
#[test]
fn a_record_target_inside_the_checkpoint_and_integer_weights_are_refused() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let config = dir.path().join("config.json");
    let before = std::fs::read(&config).unwrap();
    let mut args = super::generate_args(dir.path());
    args.extend(["--record".into(), config.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(&args, "--record names the input file itself");
    assert_eq!(std::fs::read(&config).unwrap(), before, "config.json kept");
    let weights = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    // The same width (4 bytes an element), another meaning.
    header["model.embed_tokens.weight"]["dtype"] = "I32".into();
    let header = header.to_string().into_bytes();
    let data = bytes.split_off(8 + len);
    let bytes = [&(header.len() as u64).to_le_bytes()[..], &header, &data].concat();
    std::fs::write(&weights, bytes).unwrap();
    run_with(dir.path(), "a type spex cannot read as weights");
}

/// The dashboard's flags before a subcommand are refused in one line, not ignored (`spex
/// --model X bench` benched the default model).
#[test]
fn flags_before_a_subcommand_are_refused_not_ignored() {
    assert_clean_error(
        &["--model", "/nonexistent/x", "bench", "--max-tokens", "2"],
        "cannot be used with '--model <MODEL>'",
    );
    assert_clean_error(
        &["--max-tokens", "3", "generate", "--prompt", "a"],
        "cannot be used with",
    );
}
