//! `spex pull` and `--model ORG/NAME` end to end against the loopback hub: the cache layout,
//! a second pull that downloads nothing, resumed downloads, checksums, refusals, tokens,
//! timeouts and pinning. Every failure is one line, a non-zero exit and no panic, and leaves
//! nothing in the cache that a load would trust.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::Digest;
use tempfile::TempDir;

use super::common::{PROMPTS, Variant, spec};
use super::loopback::{Faults, HubRepo, LoopbackHub};
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use spex::engine::{DecodeOptions, LoadedModel, Sampling};
use spex::harness::bench::run_lane;

const REPO: &str = "test-org/tiny-ouro";
const COMMIT: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678";

/// A random checkpoint (sharded or not) and a hub that serves it as [`REPO`].
fn served(sharded: bool) -> (TempDir, LoopbackHub) {
    let ckpt = TempDir::new().unwrap();
    let s = RandomSpec {
        sharded,
        ..spec(2, 4, Variant::Gqa, 21)
    };
    write_random_checkpoint(ckpt.path(), &s).unwrap();
    let hub = LoopbackHub::start(vec![HubRepo::from_dir(REPO, COMMIT, ckpt.path())]);
    (ckpt, hub)
}

/// spex against `hub`, caching under `home`, with `envs` besides.
fn spex(
    hub: &LoopbackHub,
    home: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
) -> (bool, String, String) {
    let mut all = vec![
        ("HF_ENDPOINT", hub.endpoint.as_str().as_ref()),
        ("HF_HOME", home.as_os_str()),
    ];
    all.extend(envs.iter().map(|(k, v)| (*k, v.as_ref())));
    super::spex_with(args, &all)
}

fn fails_in_one_line(result: (bool, String, String), needle: &str) {
    let (ok, _, err) = result;
    assert!(!ok, "expected a failure naming {needle:?}");
    super::one_clean_line(&err, needle);
}

fn repo_dir(home: &Path) -> PathBuf {
    home.join("hub/models--test-org--tiny-ouro")
}

fn sha256_hex(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Bytes of the checkpoint's weight files.
fn weight_bytes(ckpt: &Path) -> u64 {
    std::fs::read_dir(ckpt)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum()
}

/// Every file of `ckpt` is in the snapshot, linked into a blob, byte for byte; weights are
/// named by their SHA-256.
fn assert_snapshot_matches(ckpt: &Path, home: &Path) {
    let snapshot = repo_dir(home).join("snapshots").join(COMMIT);
    for entry in std::fs::read_dir(ckpt).unwrap() {
        let source = entry.unwrap().path();
        let name = source.file_name().unwrap();
        let link = snapshot.join(name);
        assert!(link.symlink_metadata().unwrap().is_symlink(), "{link:?}");
        let bytes = std::fs::read(&source).unwrap();
        assert_eq!(std::fs::read(&link).unwrap(), bytes, "{name:?}");
        if source.extension().is_some_and(|e| e == "safetensors") {
            let blob = std::fs::canonicalize(&link).unwrap();
            assert_eq!(
                blob.file_name().unwrap().to_str(),
                Some(sha256_hex(&bytes).as_str())
            );
        }
    }
}

/// The snapshot has no weights, and a load of the repo asks for a pull.
fn no_load_trusts(hub: &LoopbackHub, home: &Path) {
    let snapshot = repo_dir(home).join("snapshots").join(COMMIT);
    assert!(!snapshot.join("model.safetensors").exists());
    let args = ["generate", "--model", REPO, "--offline", "--prompt", "x"];
    fails_in_one_line(
        spex(hub, home, &args, &[]),
        &format!("run `spex pull {REPO}`"),
    );
}

#[test]
fn a_pull_lands_in_the_cache_and_a_second_downloads_nothing() {
    let (ckpt, hub) = served(true);
    let home = TempDir::new().unwrap();
    let (ok, out, err) = spex(&hub, home.path(), &["pull", REPO], &[]);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("is commit {COMMIT}")), "{out}");
    assert!(out.contains("to pin it"), "{out}");
    assert_eq!(
        std::fs::read_to_string(repo_dir(home.path()).join("refs/main")).unwrap(),
        COMMIT
    );
    assert_snapshot_matches(ckpt.path(), home.path());
    let weights = weight_bytes(ckpt.path());
    assert_eq!(hub.served().lfs_bytes, weights);

    let (ok, out, err) = spex(&hub, home.path(), &["pull", REPO], &[]);
    assert!(ok, "{err}");
    assert!(out.contains("0.0 MB downloaded"), "{out}");
    assert_eq!(
        hub.served().lfs_bytes,
        weights,
        "the second pull downloaded"
    );
    let asked = hub.served().requests;
    let (ok, out, err) = spex(
        &hub,
        home.path(),
        &["pull", REPO, "--revision", COMMIT],
        &[],
    );
    assert!(ok, "{err}");
    assert!(!out.contains("to pin it"), "{out}");
    assert_eq!(
        hub.served().requests,
        asked,
        "a cached pinned commit needs no request"
    );
}

#[test]
fn the_pulled_snapshot_decodes_as_the_checkpoint_does() {
    let (ckpt, hub) = served(true);
    let home = TempDir::new().unwrap();
    let (ok, _, err) = spex(&hub, home.path(), &["pull", REPO], &[]);
    assert!(ok, "{err}");
    let snapshot = repo_dir(home.path()).join("snapshots").join(COMMIT);
    let loaded = LoadedModel::load(
        &snapshot,
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    let opts = DecodeOptions {
        max_tokens: 12,
        context: 96,
        sampling: Sampling::GREEDY,
        exit_threshold: None,
    };
    for prompt in PROMPTS.iter().take(4) {
        let base = run_lane(&loaded, PolicyKind::Baseline, prompt, opts).unwrap();
        let speed = run_lane(&loaded, PolicyKind::Speed, prompt, opts).unwrap();
        assert_eq!(base.tokens, speed.tokens, "{prompt:?}");
    }
    let generate = |model: &str, home: &Path, offline: bool| {
        let mut args = vec!["generate", "--model", model, "--prompt", "To be"];
        args.extend(["--max-tokens", "8", "--context", "64"]);
        args.extend(offline.then_some("--offline"));
        let (ok, out, err) = spex(&hub, home, &args, &[]);
        assert!(ok, "{err}");
        out
    };
    let from_dir = generate(&ckpt.path().display().to_string(), home.path(), true);
    assert_eq!(generate(REPO, home.path(), true), from_dir);

    // Without the cache, `--model ORG/NAME` pulls first, then decodes the same.
    let fresh = TempDir::new().unwrap();
    assert_eq!(generate(REPO, fresh.path(), false), from_dir);
    assert_snapshot_matches(ckpt.path(), fresh.path());
}

#[test]
fn a_dropped_connection_resumes_and_the_file_is_byte_identical() {
    let (ckpt, hub) = served(false);
    let weights = weight_bytes(ckpt.path());
    hub.set_faults(Faults {
        drops: 2,
        drop_after_bytes: weights / 3,
        ..Faults::default()
    });
    let home = TempDir::new().unwrap();
    let (ok, _, err) = spex(&hub, home.path(), &["pull", REPO], &[]);
    assert!(ok, "{err}");
    assert_snapshot_matches(ckpt.path(), home.path());
    assert_eq!(hub.served().lfs_bytes, weights, "a retry sent bytes again");
}

/// A server that ignores Range and drops at the same byte every time: the file restarts
/// once, then the pull ends in one line after a handful of requests instead of looping; a
/// server that ignores Range but sends whole bodies still delivers after one restart.
#[test]
fn a_server_that_ignores_range_restarts_once_then_is_refused() {
    let (ckpt, hub) = served(false);
    let weights = weight_bytes(ckpt.path());
    hub.set_faults(Faults {
        drops: 10_000,
        drop_after_bytes: weights / 2,
        ignores_range: true,
        ..Faults::default()
    });
    let home = TempDir::new().unwrap();
    let before = hub.served().requests;
    fails_in_one_line(
        spex(&hub, home.path(), &["pull", REPO], &[]),
        "it ignores Range",
    );
    let requests = hub.served().requests - before;
    assert!(requests < 20, "{requests} requests");
    hub.set_faults(Faults {
        drops: 1,
        drop_after_bytes: weights / 2,
        ignores_range: true,
        ..Faults::default()
    });
    let fresh = TempDir::new().unwrap();
    let (ok, _, err) = spex(&hub, fresh.path(), &["pull", REPO], &[]);
    assert!(ok, "{err}");
    assert_snapshot_matches(ckpt.path(), fresh.path());
}

#[test]
fn an_interrupted_pull_is_resumed_by_the_next_and_trusted_by_no_load() {
    let (ckpt, hub) = served(false);
    let weights = weight_bytes(ckpt.path());
    hub.set_faults(Faults {
        drops: 1,
        drop_after_bytes: weights / 2,
        down_after_drops: true,
        ..Faults::default()
    });
    let home = TempDir::new().unwrap();
    fails_in_one_line(
        spex(&hub, home.path(), &["pull", REPO], &[]),
        "HTTP 503, 6 tries: run the pull again to resume",
    );
    let blobs = repo_dir(home.path()).join("blobs");
    let partial: Vec<_> = std::fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "incomplete"))
        .collect();
    assert_eq!(partial.len(), 1, "{partial:?}");
    assert_eq!(std::fs::metadata(&partial[0]).unwrap().len(), weights / 2);
    assert!(!repo_dir(home.path()).join("refs/main").exists());
    no_load_trusts(&hub, home.path());
    hub.set_faults(Faults::default());
    let (ok, _, err) = spex(&hub, home.path(), &["pull", REPO], &[]);
    assert!(ok, "{err}");
    assert_snapshot_matches(ckpt.path(), home.path());
    assert_eq!(
        hub.served().lfs_bytes,
        weights,
        "the second pull started over"
    );
}

#[test]
fn corrupt_bytes_are_one_line_and_leave_nothing_a_load_would_trust() {
    let (_ckpt, hub) = served(false);
    hub.set_faults(Faults {
        corrupt: true,
        ..Faults::default()
    });
    let home = TempDir::new().unwrap();
    fails_in_one_line(
        spex(&hub, home.path(), &["pull", REPO], &[]),
        "model.safetensors: checksum mismatch",
    );
    let blobs = repo_dir(home.path()).join("blobs");
    for blob in std::fs::read_dir(&blobs).unwrap() {
        let blob = blob.unwrap().path();
        let len = std::fs::metadata(&blob).unwrap().len();
        assert!(len < 100_000, "a weights blob or partial stayed: {blob:?}");
    }
    no_load_trusts(&hub, home.path());
}

/// A hub serving [`REPO`] and `test-org/gated`, which needs the token `hf_secret`.
fn gated() -> (TempDir, LoopbackHub) {
    let ckpt = TempDir::new().unwrap();
    write_random_checkpoint(ckpt.path(), &spec(1, 2, Variant::Tied, 5)).unwrap();
    let mut gated = HubRepo::from_dir("test-org/gated", COMMIT, ckpt.path());
    gated.token = Some("hf_secret".into());
    let open = HubRepo::from_dir(REPO, COMMIT, ckpt.path());
    (ckpt, LoopbackHub::start(vec![open, gated]))
}

#[test]
fn refusals_and_bad_settings_are_one_line_each() {
    let (_ckpt, hub) = gated();
    let home = TempDir::new().unwrap();
    let h = home.path();
    for (args, envs, needle) in [
        (
            &["pull", "test-org/none"][..],
            &[][..],
            "test-org/none: no such repo at http://127.0.0.1:",
        ),
        (
            &["pull", REPO, "--revision", "v9"],
            &[],
            "no revision `v9` (404)",
        ),
        (
            &["pull", "test-org/gated"],
            &[],
            "answered 401 (a gated or private repo): set HF_TOKEN or write a token to",
        ),
        (
            &["pull", "test-org/gated"],
            &[("HF_TOKEN", "hf_wrong")],
            "refused the token (401)",
        ),
        (
            &["pull", REPO],
            &[("HF_HUB_OFFLINE", "1")],
            "HF_HUB_OFFLINE is set",
        ),
        (
            &["pull", REPO],
            &[("HF_HUB_DOWNLOAD_TIMEOUT", "soon")],
            "HF_HUB_DOWNLOAD_TIMEOUT: `soon` is not a number of seconds",
        ),
    ] {
        fails_in_one_line(spex(&hub, h, args, envs), needle);
    }
}

#[test]
fn the_token_and_the_cache_come_from_where_the_hub_client_looks() {
    let (_ckpt, hub) = gated();
    let home = TempDir::new().unwrap();
    let (ok, _, err) = spex(
        &hub,
        home.path(),
        &["pull", "test-org/gated"],
        &[("HF_TOKEN", "hf_secret")],
    );
    assert!(ok, "HF_TOKEN: {err}");
    let other = TempDir::new().unwrap();
    std::fs::write(other.path().join("token"), "hf_secret\n").unwrap();
    let (ok, _, err) = spex(&hub, other.path(), &["pull", "test-org/gated"], &[]);
    assert!(ok, "the token file: {err}");
    let cache = TempDir::new().unwrap();
    let cache_dir = cache.path().display().to_string();
    let envs = [("HF_HUB_CACHE", cache_dir.as_str())];
    let (ok, _, err) = spex(&hub, other.path(), &["pull", REPO], &envs);
    assert!(ok, "{err}");
    assert!(
        cache
            .path()
            .join("models--test-org--tiny-ouro/refs/main")
            .is_file()
    );
}

#[test]
fn a_pinned_commit_not_in_the_cache_names_the_pull() {
    let (_ckpt, hub) = gated();
    let home = TempDir::new().unwrap();
    let h = home.path();
    let (ok, _, err) = spex(&hub, h, &["pull", REPO], &[]);
    assert!(ok, "{err}");
    let models = h.join("models.toml");
    let pinned = "0000000000000000000000000000000000000abc";
    let entry = format!("[models.tiny]\nrepo = \"{REPO}\"\nrevision = \"{pinned}\"\n");
    std::fs::write(&models, format!("default = \"tiny\"\n{entry}")).unwrap();
    let models = models.display().to_string();
    let offline = [("SPEX_MODELS", models.as_str()), ("HF_HUB_OFFLINE", "1")];
    fails_in_one_line(
        spex(&hub, h, &["generate", "--prompt", "x"], &offline),
        &format!("commit {pinned} is not in the local hub cache: run `spex pull tiny`"),
    );
    fails_in_one_line(
        spex(&hub, h, &["pull", "tiny"], &[("SPEX_MODELS", &models)]),
        "no revision `0000",
    );
}

#[test]
fn a_server_that_stops_answering_ends_in_one_line_and_a_stalled_body_resumes() {
    let (ckpt, hub) = served(false);
    let home = TempDir::new().unwrap();
    let fast = [
        ("HF_HUB_ETAG_TIMEOUT", "0.2"),
        ("HF_HUB_DOWNLOAD_TIMEOUT", "0.2"),
    ];
    hub.set_faults(Faults {
        stalls: 1,
        ..Faults::default()
    });
    let (ok, _, err) = spex(&hub, home.path(), &["pull", REPO], &fast);
    assert!(ok, "{err}");
    assert_snapshot_matches(ckpt.path(), home.path());
    hub.set_faults(Faults {
        silent: true,
        ..Faults::default()
    });
    let other = TempDir::new().unwrap();
    let started = Instant::now();
    fails_in_one_line(
        spex(&hub, other.path(), &["pull", REPO], &fast),
        "config.json from http://127.0.0.1:",
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}
