//! Bad input gets one clear error line naming the file, field or key, a non-zero exit and no
//! panic. Each case runs the real binary.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::path::Path;

use common::{Variant, assert_clean_error, random_model, spec, spex, spex_ok};

/// What `spex bench` reports on good input.
#[path = "bad_input/bench_reports.rs"]
mod bench_reports;

/// What a loaded model holds in memory.
#[path = "bad_input/load_memory.rs"]
mod load_memory;

/// Sizes checked before allocating, files read only when regular, outputs kept apart.
#[path = "bad_input/limits.rs"]
mod limits;

fn generate_args(dir: &Path) -> Vec<String> {
    vec![
        "generate".into(),
        "--model".into(),
        dir.display().to_string(),
        "--prompt".into(),
        "To be".into(),
        "--max-tokens".into(),
        "4".into(),
    ]
}

fn run_with(dir: &Path, needle: &str) {
    let args = generate_args(dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(&args, needle);
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn a_good_checkpoint_generates() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let args = generate_args(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, stderr) = spex(&args);
    assert!(ok, "{stderr}");
}

#[test]
fn missing_directory_and_missing_files() {
    assert_clean_error(
        &[
            "generate",
            "--model",
            "/nonexistent/spex-model",
            "--prompt",
            "x",
        ],
        "/nonexistent/spex-model",
    );
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    run_with(dir.path(), "tokenizer.json: missing");
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    run_with(dir.path(), "model.safetensors: missing");
}

/// More decode threads than the machine has cores: a one-line note, then the capped count
/// decodes (a thread beyond the cores would only wait for one).
#[test]
fn more_threads_than_cores_are_capped_with_a_note() {
    let cores = spex::engine::kernels::pool::available_cores();
    let asked = (cores + 1).to_string();
    let args = [
        "generate",
        "--prompt",
        "To be",
        "--max-tokens",
        "3",
        "--threads",
        &asked,
    ];
    let (ok, stderr) = spex(&args);
    assert!(ok, "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let note =
        format!("--threads {asked}: this machine has {cores} core(s) free for spex; using {cores}");
    assert!(stderr.contains(&note), "{stderr}");
}

/// A checkpoint whose weights outgrow the machine's available memory is refused before a byte
/// is read, naming both sizes.
#[test]
fn a_checkpoint_larger_than_the_available_memory_is_one_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    edit_config(dir.path(), |c| {
        c.insert("intermediate_size".into(), 100_000_000_000u64.into());
    });
    run_with(dir.path(), "GB of memory available");
}

/// A chat template that does not compile names tokenizer_config.json and the field; a
/// checkpoint's own template wraps the prompt (its system turn shows in the prompt's tokens).
#[test]
fn a_bad_chat_template_is_one_line_and_a_good_one_is_used() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let config = dir.path().join("tokenizer_config.json");
    std::fs::write(&config, r#"{"chat_template": "{% if messages %}"}"#).unwrap();
    let mut args = generate_args(dir.path());
    args.push("--chat".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(&args, "tokenizer_config.json: field `chat_template`");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    std::fs::copy(fixture.join("tokenizer_config.json"), &config).unwrap();
    let (ok, stderr) = spex(&args);
    assert!(ok, "{stderr}");
}

/// A tensor stored in a type spex cannot read names the tensor and the type.
#[test]
fn a_tensor_of_an_unreadable_type_names_itself_and_its_type() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
    let name = "model.layers.0.self_attn.q_proj.weight";
    let mut json: serde_json::Value = serde_json::from_str(header).unwrap();
    // The same bytes as booleans, one an element: four times the rows.
    json[name]["dtype"] = "BOOL".into();
    let rows = json[name]["shape"][0].as_u64().unwrap();
    json[name]["shape"][0] = (rows * 4).into();
    let mut header = serde_json::to_vec(&json).unwrap();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&bytes[8 + header_len..]);
    std::fs::write(&path, file).unwrap();
    run_with(
        dir.path(),
        &format!("tensor `{name}`: {name} is stored as BOOL"),
    );
}

#[test]
fn truncated_safetensors() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    run_with(dir.path(), "model.safetensors");
}

#[test]
fn tensor_of_the_wrong_shape() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let path = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    tensors.insert(
        "model.norm.weight".into(),
        candle_core::Tensor::ones(7, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &path).unwrap();
    run_with(dir.path(), "model.norm.weight");
}

#[test]
fn unknown_model_type_and_missing_field() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    edit_config(dir.path(), |c| {
        c.insert("model_type".into(), "llama".into());
    });
    run_with(dir.path(), "field `model_type`");
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    edit_config(dir.path(), |c| {
        c.remove("hidden_size");
    });
    run_with(dir.path(), "config.json: field `hidden_size`: missing");
}

#[test]
fn prompt_longer_than_context_and_empty_prompt() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let d = dir.path().display().to_string();
    let long = "To be, or not to be, that is the question. ".repeat(20);
    assert_clean_error(
        &[
            "generate",
            "--model",
            &d,
            "--context",
            "32",
            "--prompt",
            &long,
        ],
        "do not fit the context of 32",
    );
    assert_clean_error(
        &["generate", "--model", &d, "--prompt", ""],
        "prompt: empty",
    );
}

#[test]
fn bad_arguments_get_one_line() {
    assert_clean_error(&["bench", "--runs", "0"], "--runs");
    for turn in ["-1", "nan", "1e9", "two"] {
        let arg = format!("--turn-ms={turn}");
        assert_clean_error(&["bench", &arg], "--turn-ms");
    }
    assert_clean_error(&["generate", "--no-such-flag"], "--no-such-flag");
    assert_clean_error(&["bench", "--max-tokens", "many"], "--max-tokens");
    for command in ["bench", "generate", "tui"] {
        assert_clean_error(&[command, "--max-tokens", "0"], "must be at least 1");
    }
    assert_clean_error(
        &["bench", "--policy", "fastest"],
        "expected speed, dual[:MARGIN], loopspec[:d1=N][:d2=M], self-draft[:d=N][:g=M], draft[:g=M], \
         exit:gate[=T], exit:confidence=P, exit:pass=N or baseline",
    );
    assert_clean_error(
        &["bench", "--policy", "dual:0"],
        "the dual margin must be a positive number of logits",
    );
    assert_clean_error(
        &["bench", "--policy", "self-draft:g=0"],
        "policy `self-draft:g=0`: `g=0`: γ, the tokens drafted per round, is 1 or more",
    );
}

/// A draft depth at or past R, and a draft longer than the context.
#[test]
fn self_draft_that_cannot_run_is_one_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let d = dir.path().display().to_string();
    let run = |policy: &str, expected: &str| {
        let args = [
            "generate", "--model", &d, "--prompt", "To be", "--policy", policy,
        ];
        assert_clean_error(&args, expected);
    };
    run(
        "self-draft:d=2",
        "self-draft drafts at depth 2, but the model has only 2 passes (the draft depth must be below R)",
    );
    run(
        "self-draft:g=600",
        "self-draft drafts γ = 600 tokens per round, above the context of",
    );
    run(
        "draft",
        "policy `draft` drafts with a draft model, and none is loaded beside this one (--draft-model NAME)",
    );
}

/// A draft model whose tokenizer differs names both tokenizer files.
#[test]
fn a_draft_model_with_another_tokenizer_is_one_line() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let other = tempfile::TempDir::new().unwrap();
    let mut other_spec = spex::engine::random_checkpoint::RandomSpec::default();
    other_spec.shape.vocab = 384;
    spex::engine::random_checkpoint::write_random_checkpoint(other.path(), &other_spec).unwrap();
    let (d, o) = (dir.path().display().to_string(), other.path().display());
    let draft = o.to_string();
    let args = [
        "generate",
        "--model",
        &d,
        "--prompt",
        "To be",
        "--draft-model",
        &draft,
    ];
    assert_clean_error(
        &[&args[..], &["--policy", "draft"]].concat(),
        &format!(
            "the draft model's tokenizer {o}/tokenizer.json differs from the model's {d}/tokenizer.json"
        ),
    );
}

#[test]
fn bench_against_itself_is_refused() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let d = dir.path().display().to_string();
    let args = [
        "bench",
        "--model",
        &d,
        "--policy",
        "baseline",
        "--max-tokens",
        "4",
    ];
    assert_clean_error(
        &args,
        "against the other policies: speed, dual[:MARGIN], loopspec[:d1=N][:d2=M], \
         self-draft[:d=N][:g=M], draft[:g=M], exit:gate[=T], exit:confidence=P or exit:pass=N",
    );
}

#[test]
fn non_utf8_prompts_file() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, b"To be\n\xff\xfe or not\n").unwrap();
    let d = dir.path().display().to_string();
    let p = prompts.display().to_string();
    assert_clean_error(
        &["bench", "--model", &d, "--prompts", &p, "--max-tokens", "4"],
        "prompts.txt: not UTF-8",
    );
}

#[test]
fn generate_json_streams_one_object_per_event() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let d = dir.path().display().to_string();
    let out = spex_ok(
        &[
            "generate",
            "--model",
            &d,
            "--prompt",
            "To be",
            "--max-tokens",
            "5",
            "--json",
        ],
        &[],
        Path::new("."),
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["event"], "prefill");
    assert_eq!(lines.last().unwrap()["event"], "finished");
    assert_eq!(lines.last().unwrap()["tokens"].as_array().unwrap().len(), 5);
    assert!(
        lines
            .iter()
            .any(|l| l["event"] == "step" && l["rows"][0]["token"]["id"].is_u64())
    );
}

#[test]
fn embedded_model_runs_anywhere_and_matches_the_shipped_files() {
    let run = |envs: &[(&str, &str)], dir: &Path| {
        spex_ok(
            &["generate", "--prompt", "ROMEO.", "--max-tokens", "12"],
            envs,
            dir,
        )
    };
    let elsewhere = tempfile::TempDir::new().unwrap();
    let embedded = run(
        &[("SPEX_MODELS", "/nonexistent/models.toml")],
        elsewhere.path(),
    );
    let from_files = run(&[], Path::new(env!("CARGO_MANIFEST_DIR")));
    assert_eq!(embedded, from_files);
}

#[test]
fn an_instruction_set_the_cpu_lacks_or_that_does_not_exist_is_one_line() {
    assert_clean_error(&["generate", "--prompt", "a", "--isa", "sse9"], "--isa");
    #[cfg(target_arch = "x86_64")]
    if !std::arch::is_x86_feature_detected!("avx512f") {
        assert_clean_error(&["generate", "--prompt", "a", "--isa", "avx512"], "--isa");
    }
}

#[test]
fn a_prefetch_plan_that_does_not_exist_is_one_line() {
    assert_clean_error(
        &["generate", "--prompt", "a", "--prefetch", "l3"],
        "--prefetch",
    );
    assert_clean_error(
        &["generate", "--prompt", "a", "--threads", "0"],
        "--threads 0: must be at least 1",
    );
}

#[test]
fn bad_sampling_settings_are_one_line_each() {
    for (flag, value) in [
        ("--temperature", "-1"),
        ("--temperature", "NaN"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--top-k", "0"),
    ] {
        assert_clean_error(
            &[
                "generate",
                "--prompt",
                "a",
                "--max-tokens",
                "2",
                flag,
                value,
            ],
            flag,
        );
    }
}

#[test]
fn replaying_what_is_not_a_trace_is_one_line() {
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "hello\n").unwrap();
    let f = file.display().to_string();
    assert_clean_error(&["replay", &f], "notes.txt: not a spex trace");
    let missing = dir.path().join("missing.jsonl").display().to_string();
    assert_clean_error(&["replay", &missing], "missing.jsonl");
    assert_clean_error(&["explain", &f], "notes.txt: not a spex trace");
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = empty.display().to_string();
    assert_clean_error(&["explain", &e], "no .jsonl traces");
}

#[test]
fn replay_with_another_model_names_what_differs() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 5));
    let (other, _) = random_model(&spec(1, 2, Variant::Tied, 6));
    let trace = dir.path().join("run.jsonl");
    let t = trace.display().to_string();
    let mut record = generate_args(dir.path());
    record.extend(["--record".to_string(), t.clone()]);
    let record: Vec<&str> = record.iter().map(String::as_str).collect();
    spex_ok(&record, &[], Path::new("."));
    let o = other.path().display().to_string();
    assert_clean_error(&["replay", &t, "--model", &o], "differs: weights sha256");
    // The same weights with a tokenizer file that differs (by a trailing newline): only the
    // tokenizer is named.
    let copy = tempfile::TempDir::new().unwrap();
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(dir.path().join(file), copy.path().join(file)).unwrap();
    }
    let tokenizer = copy.path().join("tokenizer.json");
    let mut bytes = std::fs::read(&tokenizer).unwrap();
    bytes.push(b'\n');
    std::fs::write(&tokenizer, bytes).unwrap();
    let c = copy.path().display().to_string();
    assert_clean_error(&["replay", &t, "--model", &c], "differs: tokenizer sha256");
}

#[test]
fn a_run_cut_short_by_its_context_says_so_on_stderr() {
    let args = ["generate", "--prompt", "To be", "--max-tokens", "40"];
    let (ok, stderr) = spex(&[&args[..], &["--context", "16"]].concat());
    assert!(ok, "a full context ends the run, not in an error: {stderr}");
    assert_eq!(
        stderr.trim(),
        "spex: stopped after 15 of 40 tokens: the context of 16 positions is full (--context)"
    );
    let (ok, stderr) = spex(&args);
    assert!(ok && stderr.is_empty(), "nothing to say: {stderr}");
}
