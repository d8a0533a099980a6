//! A GGUF repo on the loopback hub, which holds one file per quantization: `spex pull
//! ORG/NAME --file`, a models.toml entry's `file`, the weight type `spex models` shows, and a
//! file the repo lacks, which lists the `.gguf` files it has.

use std::path::Path;

use tempfile::TempDir;

use super::common::{Variant, quantized_pair};
use super::loopback::{HubRepo, LoopbackHub};
use spex::engine::gguf::write::FileType;

const REPO: &str = "test-org/tiny-ouro-GGUF";
const COMMIT: &str = "b1b2c3d4e5f60718293a4b5c6d7e8f9012345678";
const Q8: &str = "tiny-ouro.Q8_0.gguf";
const Q4: &str = "tiny-ouro.Q4_K_M.gguf";

/// Two quantizations of random checkpoints, served as [`REPO`] with a README beside them;
/// and the Q8_0 file's path here.
fn served() -> (Vec<TempDir>, std::path::PathBuf, LoopbackHub) {
    let (d8, o8, q8) = quantized_pair(Variant::Gqa, 1, 2, 5, FileType::Q8_0);
    let (d4, o4, q4) = quantized_pair(Variant::Tied, 1, 2, 6, FileType::Q4KM);
    let files = [
        (Q8, std::fs::read(&q8).unwrap()),
        (Q4, std::fs::read(&q4).unwrap()),
        ("README.md", b"# tiny ouro\n".to_vec()),
    ];
    let repo = HubRepo {
        id: REPO.into(),
        commit: COMMIT.into(),
        files: files.into_iter().map(|(n, b)| (n.to_string(), b)).collect(),
        token: None,
    };
    (vec![d8, o8, d4, o4], q8, LoopbackHub::start(vec![repo]))
}

fn spex(hub: &LoopbackHub, home: &Path, args: &[&str], models: &Path) -> (bool, String, String) {
    let envs = [
        ("HF_ENDPOINT", hub.endpoint.as_ref()),
        ("HF_HOME", home.as_os_str()),
        ("SPEX_MODELS", models.as_os_str()),
    ];
    super::spex_with(args, &envs)
}

/// A models.toml with an entry for each file of [`REPO`].
fn models_toml(dir: &Path) -> std::path::PathBuf {
    let entry = |name: &str, file: &str| {
        format!("[models.{name}]\nrepo = \"{REPO}\"\nrevision = \"{COMMIT}\"\nfile = \"{file}\"\n")
    };
    let text = format!(
        "default = \"tiny-q8\"\n{}{}",
        entry("tiny-q8", Q8),
        entry("tiny-q4", Q4)
    );
    let path = dir.join("models.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn generated(hub: &LoopbackHub, home: &Path, model: &str, models: &Path) -> String {
    let args = [
        "generate",
        "--model",
        model,
        "--prompt",
        "To be",
        "--max-tokens",
        "6",
    ];
    let (ok, out, err) = spex(hub, home, &args, models);
    assert!(ok, "{model}: {err}");
    out
}

#[test]
fn one_gguf_of_a_repo_is_pulled_listed_and_loaded_by_its_entry() {
    let (_keep, q8, hub) = served();
    let home = TempDir::new().unwrap();
    let models = models_toml(home.path());
    let pull = |args: &[&str]| spex(&hub, home.path(), args, &models);

    let (ok, _, err) = pull(&["pull", REPO, "--file", "tiny-ouro.Q5_K_M.gguf"]);
    assert!(!ok);
    super::one_clean_line(
        &err,
        &format!("no file `tiny-ouro.Q5_K_M.gguf` (404); its .gguf files: {Q4}, {Q8}"),
    );
    let (ok, _, err) = pull(&["pull", REPO, "--file", "../x.gguf"]);
    assert!(!ok);
    super::one_clean_line(&err, "a file to pull is a path inside the repo");

    let (ok, out, err) = pull(&["pull", REPO, "--file", Q8]);
    assert!(ok, "{err}");
    let snapshot = home
        .path()
        .join("hub/models--test-org--tiny-ouro-GGUF/snapshots")
        .join(COMMIT);
    assert!(
        out.contains(&snapshot.join(Q8).display().to_string()),
        "{out}"
    );
    assert_eq!(
        std::fs::read(snapshot.join(Q8)).unwrap(),
        std::fs::read(&q8).unwrap()
    );
    assert!(
        !snapshot.join(Q4).exists(),
        "only the named file is fetched"
    );
    assert_eq!(
        hub.served().lfs_bytes,
        std::fs::metadata(&q8).unwrap().len()
    );

    let (ok, out, err) = pull(&["pull", "tiny-q8"]);
    assert!(ok, "{err}");
    assert!(out.contains("0.0 MB downloaded"), "{out}");

    let (ok, out, err) = pull(&["models"]);
    assert!(ok, "{err}");
    let line = |name: &str| {
        let line = out.lines().find(|l| l.starts_with(name));
        line.unwrap_or_else(|| panic!("{name} in {out}"))
            .to_string()
    };
    let q8_line = line("tiny-q8 ");
    assert!(
        q8_line.contains(" yes ") && q8_line.contains(" Q8_0 "),
        "{q8_line}"
    );
    assert!(q8_line.contains(Q8), "{q8_line}");
    assert!(line("tiny-q4 ").contains(" no "), "{out}");

    let by_entry = generated(&hub, home.path(), "tiny-q8", &models);
    let by_path = generated(&hub, home.path(), &q8.display().to_string(), &models);
    assert_eq!(by_entry, by_path);

    // An entry not pulled yet is fetched by its first load, its file alone.
    let before = hub.served().lfs_bytes;
    generated(&hub, home.path(), "tiny-q4", &models);
    assert!(snapshot.join(Q4).is_file());
    assert!(hub.served().lfs_bytes > before);
}
