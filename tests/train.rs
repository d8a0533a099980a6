//! `spex train`: a tiny config trains deterministically and its loss falls; a saved checkpoint
//! reloads to identical logits; bad input is a clear error that overwrites nothing.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use spex::engine::LoadedModel;
use spex::engine::model::LoopedModel;
use spex::engine::random_checkpoint::SAMPLE_TEXT;
use spex::train::Trainer;

const TINY: &str = r#"
[model]
hidden = 32
layers = 1
passes = 2
heads = 2
kv_heads = 2
head_dim = 16
intermediate = 64
vocab = 300
context = 64
tied = true

[train]
seq_len = 16
batch = 4
steps = 30
lr = 1e-2
min_lr = 1e-3
warmup_steps = 3
weight_decay = 0.0
grad_clip = 1.0
seed = 7
pass_weights = [0.5, 1.0]
agreement_weight = 0.5
last_pass_agreement_weight = 0.3
agreement_temperature = 0.8
validation_files = []
eval_every = 15
eval_batches = 1
checkpoint_minutes = 10.0
"#;

fn setup(config: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::TempDir::new().unwrap();
    let cfg = dir.path().join("tiny.toml");
    std::fs::write(&cfg, config).unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, SAMPLE_TEXT.repeat(3)).unwrap();
    (dir, cfg, corpus)
}

fn train(cfg: &Path, corpus: &Path, out: &Path) -> (Vec<Vec<f64>>, Trainer) {
    let mut trainer = Trainer::prepare(cfg, &[corpus.to_path_buf()], out, false).unwrap();
    let mut losses = Vec::new();
    trainer
        .run(|p| losses.push(p.loss_per_pass.clone()), || false)
        .unwrap();
    (losses, trainer)
}

/// Every pass's logits of `a` and `b` on one prompt are bit-for-bit equal.
fn assert_same_logits(a: &LoopedModel, b: &LoopedModel, why: &str) {
    let ids = Tensor::new(&[[1u32, 50, 60, 70, 80, 90]], &Device::Cpu).unwrap();
    let x = a.forward_sequence(&ids).unwrap();
    let y = b.forward_sequence(&ids).unwrap();
    for (p, q) in x.iter().zip(&y) {
        let diff = (p - q)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0, "{why}");
    }
}

#[test]
fn tiny_run_learns_deterministically_and_reloads_exactly() {
    let (dir, cfg, corpus) = setup(TINY);
    let (a, trainer) = train(&cfg, &corpus, &dir.path().join("a"));
    let (b, _) = train(&cfg, &corpus, &dir.path().join("b"));
    assert_eq!(a, b, "two runs from one seed give the same losses");
    let first: f64 = a[0].iter().sum();
    let last: f64 = a[a.len() - 1].iter().sum();
    assert!(last < first * 0.8, "loss falls: {first} → {last}");
    let loaded = LoadedModel::load(&dir.path().join("a"), &Device::Cpu, DType::F32).unwrap();
    assert_same_logits(
        trainer.model(),
        loaded.model(),
        "reloaded logits are identical",
    );
    let saved =
        candle_core::safetensors::load(dir.path().join("a/model.safetensors"), &Device::Cpu)
            .unwrap();
    let have: std::collections::BTreeSet<&String> = saved.keys().collect();
    let want = spex::engine::format::checkpoint_tensors(&loaded.model().config);
    let want: std::collections::BTreeSet<&String> = want.iter().map(|t| &t.name).collect();
    assert_eq!(
        have, want,
        "a trained checkpoint holds exactly the format's tensors"
    );
}

fn spex_train(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_spex"))
        .arg("train")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_fails(args: &[&str], needle: &str) {
    let (ok, err) = spex_train(args);
    assert!(!ok, "{args:?} should fail");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(needle), "expected {needle:?} in {err:?}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `spex train`'s arguments: `--config`, `--corpus` and `--out`, then `extra`.
fn train_args(cfg: &Path, corpus: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let paths = [("--config", cfg), ("--corpus", corpus), ("--out", out)];
    (paths.iter())
        .flat_map(|(flag, path)| [flag.to_string(), path.display().to_string()])
        .chain(extra.iter().map(|a| a.to_string()))
        .collect()
}

/// [`assert_fails`] on [`train_args`].
fn assert_train_fails(paths: (&Path, &Path, &Path), extra: &[&str], needle: &str) {
    let args = train_args(paths.0, paths.1, paths.2, extra);
    assert_fails(&args.iter().map(String::as_str).collect::<Vec<_>>(), needle);
}

/// [`spex_train`] on [`train_args`], which must succeed.
fn assert_trains(paths: (&Path, &Path, &Path), extra: &[&str]) {
    let args = train_args(paths.0, paths.1, paths.2, extra);
    let (ok, err) = spex_train(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{args:?}: {err}");
}

#[test]
fn a_missing_or_empty_corpus_is_a_clear_error_and_writes_nothing() {
    let (dir, cfg, _) = setup(TINY);
    let out = dir.path().join("out");
    let missing = Path::new("/nonexistent/corpus.txt");
    assert_train_fails((&cfg, missing, &out), &[], "/nonexistent/corpus.txt");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "  \n").unwrap();
    assert_train_fails((&cfg, &empty, &out), &[], "empty corpus file");
    assert!(!out.exists(), "nothing written");
}

#[test]
fn a_bad_config_value_is_a_clear_error_naming_its_key() {
    let (dir, _, corpus) = setup(TINY);
    let out = dir.path().join("out");
    for (from, to, needle) in [
        ("passes = 2", "passes = 0", "K·R"),
        ("layers = 1", "layers = 0", "K·R"),
        (
            "heads = 2\nkv_heads = 2",
            "heads = 3\nkv_heads = 3",
            "model.hidden",
        ),
        (
            "\nagreement_weight = 0.5",
            "\nagreement_weight = 1.5",
            "train.agreement_weight",
        ),
        (
            "last_pass_agreement_weight = 0.3",
            "last_pass_agreement_weight = -0.1",
            "train.last_pass_agreement_weight",
        ),
        (
            "agreement_temperature = 0.8",
            "agreement_temperature = 0",
            "train.agreement_temperature",
        ),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, TINY.replace(from, to)).unwrap();
        assert_train_fails((&bad, &corpus, &out), &[], needle);
    }
    assert!(!out.exists(), "nothing written");
}

/// Settings that would train to NaN or allocate past the memory are refused before a step:
/// one line naming the key, and nothing written.
#[test]
fn non_finite_out_of_range_or_oversized_settings_are_refused() {
    let (dir, _, corpus) = setup(TINY);
    let out = dir.path().join("out");
    for (from, to, needle) in [
        ("lr = 1e-2", "lr = nan", "train.lr"),
        ("lr = 1e-2", "lr = -1.0", "train.lr"),
        ("grad_clip = 1.0", "grad_clip = -1.0", "train.grad_clip"),
        (
            "pass_weights = [0.5, 1.0]",
            "pass_weights = [-1.0, 1.0]",
            "train.pass_weights",
        ),
        ("batch = 4", "batch = 0", "train.batch"),
        ("steps = 30", "steps = 0", "train.steps"),
        ("hidden = 32", "hidden = 1000000000", "model.hidden"),
        (
            "vocab = 300",
            "vocab = 1000000000",
            "the model's weights needs",
        ),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, TINY.replace(from, to)).unwrap();
        assert_train_fails((&bad, &corpus, &out), &[], needle);
    }
    assert!(!out.exists(), "nothing written");
}

#[test]
fn a_finished_run_is_refused_another_shape_and_overwritten_by_nothing() {
    let (dir, cfg, corpus) = setup(TINY);
    let out = dir.path().join("out");
    assert_trains((&cfg, &corpus, &out), &["--max-steps-now", "2"]);
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    let other = dir.path().join("other.toml");
    std::fs::write(&other, TINY.replace("hidden = 32", "hidden = 64")).unwrap();
    assert_train_fails(
        (&other, &corpus, &out),
        &["--resume"],
        "resume: checkpoint has shape",
    );
    assert_train_fails((&cfg, &corpus, &out), &[], "already holds a checkpoint");
    assert_eq!(
        before,
        std::fs::read(out.join("model.safetensors")).unwrap(),
        "nothing overwritten"
    );
    assert_trains((&cfg, &corpus, &out), &["--resume", "--max-steps-now", "2"]);
}

#[test]
fn a_grown_model_starts_as_the_trained_one() {
    let (dir, cfg, corpus) = setup(TINY);
    let (_, trained) = train(&cfg, &corpus, &dir.path().join("a"));
    let grown_cfg = dir.path().join("grown.toml");
    init_config(
        &grown_cfg,
        "layers = 1",
        "layers = 3",
        &dir.path().join("a"),
    );
    let out = dir.path().join("grown");
    let grown = Trainer::prepare(&grown_cfg, &[corpus], &out, false).unwrap();
    assert_eq!(grown.model_config().layers, 3);
    assert_same_logits(
        trained.model(),
        grown.model(),
        "identity layers leave every pass's logits unchanged",
    );
    let tokenizer = |d: &Path| std::fs::read(d.join("tokenizer.json")).unwrap();
    assert_eq!(tokenizer(&dir.path().join("a")), tokenizer(&out));
}

/// Writes TINY with `from → to` and `init_from = init` as `path`.
fn init_config(path: &Path, from: &str, to: &str, init: &Path) {
    let text = TINY.replace(from, to).replace(
        "validation_files = []",
        &format!(
            "validation_files = []\ninit_from = {:?}",
            init.display().to_string()
        ),
    );
    std::fs::write(path, text).unwrap();
}

#[test]
fn bad_init_sources_are_clear_errors_and_write_nothing() {
    let (dir, _, corpus) = setup(TINY);
    // A trained K=2 checkpoint, then configs that cannot start from it (or from nothing).
    let (deep, cfg) = (dir.path().join("deep"), dir.path().join("cfg.toml"));
    std::fs::write(&cfg, TINY.replace("layers = 1", "layers = 2")).unwrap();
    assert_trains((&cfg, &corpus, &deep), &["--max-steps-now", "1"]);
    let fresh = dir.path().join("fresh");
    for (from, to, init, needle) in [
        (
            "layers = 1",
            "layers = 2",
            Path::new("/nonexistent/run"),
            "/nonexistent/run/model.safetensors",
        ),
        (
            "hidden = 32\nlayers = 1",
            "hidden = 64\nlayers = 2",
            deep.as_path(),
            "train.init_from: tensor model.embed_tokens.weight has shape",
        ),
        // Deeper than the config: the extra layer would be dropped silently.
        (
            "layers = 1",
            "layers = 1",
            deep.as_path(),
            "train.init_from: tensor model.layers.1.",
        ),
    ] {
        init_config(&cfg, from, to, init);
        assert_train_fails((&cfg, &corpus, &fresh), &[], needle);
        assert!(!fresh.exists(), "nothing written for {needle}");
    }
}
