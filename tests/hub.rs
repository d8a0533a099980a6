//! Hub checkpoints. Offline: a random checkpoint laid out under a temp HF_HOME exactly as the
//! hub client caches it, loaded by repo id and by models.toml entry through the CLI's own
//! resolution code; sharded against unsharded; and the errors of models.toml and devices.
//! Online against a loopback hub on 127.0.0.1 (`hub/loopback.rs`): `spex pull` end to end,
//! with dropped connections, corrupt bytes, refusals and a server that stops answering.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;
#[path = "hub/loopback.rs"]
mod loopback;
#[path = "hub/pull.rs"]
mod pull;
#[path = "hub/pull_gguf.rs"]
mod pull_gguf;

use std::path::Path;
use std::process::Command;

use common::{Variant, random_model, spec};
use spex::engine::DecodeOptions;
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::write_random_checkpoint;
use spex::harness::bench::run_lane;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Copies the checkpoint in `src` into `hf_home/hub` as the hub client lays out `repo`:
/// blobs named by SHA-256, snapshot links, and refs/main.
fn lay_out_hub_cache(src: &Path, hf_home: &Path, repo: &str) -> std::path::PathBuf {
    use sha2::Digest;
    let repo_dir = hf_home
        .join("hub")
        .join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = repo_dir.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(repo_dir.join("blobs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), COMMIT).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let sha: String = sha2::Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let blob = repo_dir.join("blobs").join(&sha);
        std::fs::write(&blob, &bytes).unwrap();
        std::os::unix::fs::symlink(&blob, snapshot.join(path.file_name().unwrap())).unwrap();
    }
    repo_dir
}

fn spex(args: &[&str], envs: &[(&str, &Path)]) -> (bool, String, String) {
    let envs: Vec<_> = envs.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    spex_with(args, &envs)
}

/// spex with `args` in a clean hub environment (none of the hub client's variables of the
/// machine running the tests, no proxy) plus `envs`: success, stdout, stderr.
fn spex_with(args: &[&str], envs: &[(&str, &std::ffi::OsStr)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spex"));
    cmd.args(args);
    for var in [
        "HF_ENDPOINT",
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_HUB_ETAG_TIMEOUT",
        "HF_HUB_DOWNLOAD_TIMEOUT",
        "http_proxy",
        "HTTP_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(envs.iter().copied());
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn one_clean_line(stderr: &str, needle: &str) {
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in {stderr:?}");
}

#[test]
fn loads_by_repo_id_and_by_entry_from_the_hub_cache_offline() {
    let (ckpt, loaded) = random_model(&spec(2, 3, Variant::Untied, 4));
    let home = tempfile::TempDir::new().unwrap();
    lay_out_hub_cache(ckpt.path(), home.path(), "test-org/tiny-ouro");
    let expected = run_lane(
        &loaded,
        PolicyKind::Baseline,
        "To be",
        DecodeOptions {
            max_tokens: 8,
            context: 64,
            sampling: spex::engine::Sampling::GREEDY,
            exit_threshold: None,
        },
    )
    .unwrap();
    let expected_text = loaded.tokenizer.decode(&expected.tokens);
    let hf = [("HF_HOME", home.path())];
    let (ok, out, err) = spex(
        &[
            "generate",
            "--model",
            "test-org/tiny-ouro",
            "--offline",
            "--prompt",
            "To be",
            "--max-tokens",
            "8",
            "--context",
            "64",
        ],
        &hf,
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim_end_matches('\n'), format!("To be{expected_text}"));
    let models = home.path().join("models.toml");
    std::fs::write(&models, format!("default = \"tiny\"\n[models.tiny]\nrepo = \"test-org/tiny-ouro\"\nrevision = \"{COMMIT}\"\ndtype = \"f32\"\ndevice = \"cpu\"\n")).unwrap();
    let envs = [("HF_HOME", home.path()), ("SPEX_MODELS", models.as_path())];
    let (ok, out2, err) = spex(
        &[
            "generate",
            "--prompt",
            "To be",
            "--max-tokens",
            "8",
            "--context",
            "64",
        ],
        &envs,
    );
    assert!(ok, "{err}");
    assert_eq!(out, out2);
    let (ok, listing, _) = spex(&["models"], &envs);
    assert!(
        ok && listing.contains("tiny") && listing.contains("yes"),
        "{listing}"
    );
}

#[test]
fn hub_errors_name_what_to_do() {
    let (ckpt, _) = random_model(&spec(1, 2, Variant::Tied, 4));
    let home = tempfile::TempDir::new().unwrap();
    let repo_dir = lay_out_hub_cache(ckpt.path(), home.path(), "test-org/tiny-ouro");
    let models = home.path().join("models.toml");
    std::fs::write(
        &models,
        "default = \"tiny\"\n[models.tiny]\nrepo = \"test-org/tiny-ouro\"\nrevision = \"v2\"\n",
    )
    .unwrap();
    let envs = [
        ("HF_HOME", home.path()),
        ("SPEX_MODELS", models.as_path()),
        ("HF_HUB_OFFLINE", Path::new("1")),
    ];
    let (ok, _, err) = spex(&["generate", "--prompt", "x"], &envs);
    assert!(!ok);
    one_clean_line(
        &err,
        "revision `v2` is not in the local hub cache: run `spex pull tiny`",
    );
    let (ok, _, err) = spex(
        &["generate", "--model", "other-org/missing", "--prompt", "x"],
        &envs,
    );
    assert!(!ok);
    one_clean_line(&err, "run `spex pull other-org/missing`");
    let (ok, _, err) = spex(
        &["generate", "--model", "no-such-entry", "--prompt", "x"],
        &envs,
    );
    assert!(!ok);
    one_clean_line(&err, "no model entry `no-such-entry`");
    // A truncated blob.
    let blob = std::fs::read_dir(repo_dir.join("blobs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| std::fs::metadata(p).unwrap().len() > 100_000)
        .unwrap();
    let bytes = std::fs::read(&blob).unwrap();
    std::fs::write(&blob, &bytes[..bytes.len() / 3]).unwrap();
    let (ok, _, err) = spex(
        &["generate", "--model", "test-org/tiny-ouro", "--prompt", "x"],
        &envs,
    );
    assert!(!ok);
    one_clean_line(&err, "model.safetensors");
}

#[test]
fn models_toml_errors_carry_file_and_line() {
    let home = tempfile::TempDir::new().unwrap();
    let models = home.path().join("models.toml");
    for (text, needle) in [
        (
            "default = \"a\"\n[models.a]\npath = \"x\"\ncolour = \"red\"\n",
            "models.toml:4",
        ),
        (
            "default = \"a\"\n[models.a]\npath = \"x\"\ndtype = \"f64\"\n",
            "models.toml:4",
        ),
        (
            "default = \"a\"\n[models.a]\npath = \"x\"\ndevice = \"tpu\"\n",
            "unknown device `tpu`",
        ),
        (
            "default = \"a\"\n\n[models.a]\ndtype = \"f32\"\n",
            "models.toml:3: entry `a` needs exactly one of `path` or `repo`",
        ),
        (
            "default = \"a\"\n[models.a]\nrepo = \"o/n\"\nfile = \"model.bin\"\n",
            "models.toml:2: entry `a` `file` names a weights file of the repo: a `.gguf`",
        ),
    ] {
        std::fs::write(&models, text).unwrap();
        let (ok, _, err) = spex(
            &["generate", "--prompt", "x"],
            &[("SPEX_MODELS", models.as_path())],
        );
        assert!(!ok);
        one_clean_line(&err, needle);
        assert!(!err.contains("\\n"), "a literal \\n in {err}");
    }
}

#[test]
fn devices_this_build_lacks_are_one_line_errors() {
    let (ckpt, _) = random_model(&spec(1, 2, Variant::Tied, 4));
    let d = ckpt.path().display().to_string();
    if !cfg!(feature = "cuda") {
        let (ok, _, err) = spex(
            &[
                "generate", "--model", &d, "--device", "cuda", "--prompt", "x",
            ],
            &[],
        );
        assert!(!ok);
        one_clean_line(
            &err,
            "--device cuda: this spex was built without cuda support (cargo build --release --features cuda)",
        );
    }
    if !cfg!(feature = "metal") {
        let (ok, _, err) = spex(
            &[
                "generate", "--model", &d, "--device", "metal", "--dtype", "bf16", "--prompt", "x",
            ],
            &[],
        );
        assert!(!ok);
        one_clean_line(&err, "--device metal");
    }
    let (ok, _, err) = spex(
        &["generate", "--model", &d, "--dtype", "f64", "--prompt", "x"],
        &[],
    );
    assert!(!ok);
    assert!(err.contains("unknown dtype `f64`"), "{err}");
    for dtype in ["bf16", "f16"] {
        let (ok, _, err) = spex(
            &[
                "generate",
                "--model",
                &d,
                "--dtype",
                dtype,
                "--device",
                "cpu",
                "--prompt",
                "x",
                "--max-tokens",
                "3",
            ],
            &[],
        );
        assert!(
            ok,
            "{dtype} on the CPU runs spex's kernels on stored weights: {err}"
        );
    }
}

#[test]
fn sharded_checkpoint_decodes_like_the_unsharded_one() {
    let s = spec(2, 4, Variant::Gqa, 8);
    let (one, whole) = random_model(&s);
    let two = tempfile::TempDir::new().unwrap();
    write_random_checkpoint(
        two.path(),
        &spex::engine::random_checkpoint::RandomSpec { sharded: true, ..s },
    )
    .unwrap();
    assert!(two.path().join("model.safetensors.index.json").is_file());
    assert!(!two.path().join("model.safetensors").exists());
    let sharded = spex::engine::LoadedModel::load(
        two.path(),
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    for prompt in common::PROMPTS.iter().take(5) {
        let opts = DecodeOptions {
            max_tokens: 16,
            context: 128,
            sampling: spex::engine::Sampling::GREEDY,
            exit_threshold: None,
        };
        let a = run_lane(&whole, PolicyKind::Speed, prompt, opts).unwrap();
        let b = run_lane(&sharded, PolicyKind::Speed, prompt, opts).unwrap();
        assert_eq!(a.tokens, b.tokens);
    }
    drop(one);
}
