//! Hugging Face hub checkpoints: resolving a repo id and revision to a snapshot directory in
//! the local cache (laid out as the hub client lays it out: `models--ORG--NAME/refs/…`,
//! `snapshots/<commit>/…`, `blobs/…`), and `spex pull`, a resumable download with a progress
//! bar per file and a checksum check. Loading never touches the network when offline.

use std::io::Read;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};
use sha2::{Digest, Sha256};

use crate::engine::EngineError;

/// The hub cache root: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_root() -> PathBuf {
    if let Ok(p) = std::env::var("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    if let Ok(home) = std::env::var("HF_HOME") {
        return Path::new(&home).join("hub");
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    Path::new(&home).join(".cache/huggingface/hub")
}

/// Whether `HF_HUB_OFFLINE` asks for the local cache only (the hub client does not read it).
pub fn offline_from_env() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.as_str(), "1" | "true" | "TRUE" | "yes" | "ON" | "on"))
}

/// Whether `s` looks like a hub repo id, ORG/NAME.
pub fn is_repo_id(s: &str) -> bool {
    let mut parts = s.split('/');
    matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() && !a.starts_with('.'))
}

fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// The snapshot directory of `repo` at `revision` in the local cache. `pull_hint` is the
/// `spex pull` argument to suggest when it is missing.
pub fn snapshot_dir(
    root: &Path,
    repo: &str,
    revision: &str,
    pull_hint: &str,
) -> Result<PathBuf, EngineError> {
    let repo_dir = root.join(format!("models--{}", repo.replace('/', "--")));
    let missing =
        |what: String| EngineError::file(&repo_dir, format!("{what}: run `spex pull {pull_hint}`"));
    if !repo_dir.is_dir() {
        return Err(missing(format!("{repo} is not in the local hub cache")));
    }
    let commit = if is_commit(revision) {
        revision.to_string()
    } else {
        let r = repo_dir.join("refs").join(revision);
        std::fs::read_to_string(&r)
            .map_err(|_| {
                missing(format!(
                    "revision `{revision}` is not in the local hub cache"
                ))
            })?
            .trim()
            .to_string()
    };
    let snap = repo_dir.join("snapshots").join(&commit);
    if !snap.is_dir() {
        return Err(missing(format!(
            "revision `{revision}` (commit {commit}) is not in the local hub cache"
        )));
    }
    Ok(snap)
}

/// Downloads a checkpoint's files into the cache (resuming partial downloads) and checks each
/// LFS file's SHA-256 against the hub's etag. Returns the snapshot directory.
pub fn pull(root: &Path, repo: &str, revision: &str) -> Result<PathBuf, EngineError> {
    let net = |e: hf_hub::api::sync::ApiError| {
        EngineError::Invalid(format!("hub: {repo}@{revision}: {e}"))
    };
    let api = ApiBuilder::from_cache(Cache::new(root.to_path_buf()))
        .with_progress(true)
        .build()
        .map_err(net)?;
    let hub = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let mut files = vec!["config.json".to_string(), "tokenizer.json".to_string()];
    let _ = hub.get("tokenizer_config.json");
    match hub.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index).map_err(|e| EngineError::file(&index, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| EngineError::file(&index, e))?;
            let mut shards: Vec<String> = json["weight_map"]
                .as_object()
                .map(|m| {
                    m.values()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            files.extend(shards);
        }
        Err(_) => files.push("model.safetensors".into()),
    }
    let mut snapshot = None;
    for file in &files {
        let path = hub.get(file).map_err(net)?;
        verify(&path)?;
        snapshot = path.parent().map(Path::to_path_buf);
    }
    snapshot.ok_or_else(|| EngineError::Invalid(format!("hub: {repo}: nothing downloaded")))
}

/// Checks a cached file against its blob name when that is a SHA-256 (LFS files).
pub fn verify(path: &Path) -> Result<(), EngineError> {
    let blob = std::fs::canonicalize(path).map_err(|e| EngineError::file(path, e))?;
    let name = blob
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    if name.len() != 64 || !name.chars().all(|c| c.is_ascii_hexdigit()) {
        return Ok(());
    }
    let mut file = std::fs::File::open(&blob).map_err(|e| EngineError::file(&blob, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| EngineError::file(&blob, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != name {
        return Err(EngineError::file(
            path,
            format!("checksum mismatch (sha256 {digest}): delete it and run `spex pull` again"),
        ));
    }
    Ok(())
}

/// Bytes on disk of the files in a snapshot (following the links into blobs).
pub fn snapshot_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| std::fs::metadata(e.path()).ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
