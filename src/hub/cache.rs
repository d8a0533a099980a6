//! The local hub cache, laid out as every hub client lays it out:
//!
//! ```text
//! ROOT/models--ORG--NAME/blobs/ETAG             a file's bytes, named by its etag
//!                                               (the SHA-256 for weights)
//! ROOT/models--ORG--NAME/blobs/ETAG.incomplete  a download in progress, resumed from its length
//! ROOT/models--ORG--NAME/snapshots/COMMIT/FILE  a relative link to the blob
//! ROOT/models--ORG--NAME/refs/BRANCH            the commit the branch named when last pulled
//! ROOT/models--ORG--NAME/.no_exist/COMMIT/FILE  an optional file the commit lacks
//! ROOT/.locks/models--ORG--NAME/ETAG.lock       held while one process downloads the blob
//! ```
//!
//! Loading reads `refs` and `snapshots` only ([`snapshot_dir`]), with no network.

use std::fs::File;
use std::path::{Path, PathBuf};

use hf_hub::Repo;

use super::HubError;
use crate::engine::EngineError;

/// Whether `s` looks like a hub repo id, ORG/NAME.
pub fn is_repo_id(s: &str) -> bool {
    let mut parts = s.split('/');
    matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() && !a.starts_with('.'))
}

/// Whether `revision` is a full commit hash (which pins a snapshot) rather than a branch.
pub fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// One repository's part of the cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    dir: PathBuf,
    locks: PathBuf,
}

impl RepoCache {
    /// `repo`'s part of the cache under `root`.
    pub fn new(root: &Path, repo: &str) -> Self {
        let folder = Repo::model(repo.to_string()).folder_name();
        Self {
            dir: root.join(&folder),
            locks: root.join(".locks").join(folder),
        }
    }

    /// The repository's directory, `ROOT/models--ORG--NAME`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The snapshot directory of `commit`.
    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// The commit `revision` names here: itself when it is one, else its ref's content.
    pub fn commit_of(&self, revision: &str) -> Option<String> {
        if is_commit(revision) {
            return Some(revision.to_string());
        }
        let text = std::fs::read_to_string(self.dir.join("refs").join(revision)).ok()?;
        Some(text.trim().to_string())
    }

    fn blob(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// Where the download of the blob `etag` is written until it is checked.
    pub fn partial(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(format!("{etag}.incomplete"))
    }

    /// Whether the blob `etag` is here, `size_bytes` long.
    pub fn has_blob(&self, etag: &str, size_bytes: u64) -> bool {
        std::fs::metadata(self.blob(etag)).is_ok_and(|m| m.len() == size_bytes)
    }

    /// Whether `commit`'s snapshot links `file` to a blob that is here.
    pub fn linked(&self, commit: &str, file: &str) -> bool {
        self.snapshot(commit).join(file).is_file()
    }

    /// Whether an earlier pull found that `commit` has no `file`.
    pub fn known_absent(&self, commit: &str, file: &str) -> bool {
        self.dir.join(".no_exist").join(commit).join(file).is_file()
    }

    /// Records that `commit` has no `file`, so that a later pull of it does not ask again.
    pub fn mark_absent(&self, commit: &str, file: &str) -> Result<(), HubError> {
        let marker = self.dir.join(".no_exist").join(commit).join(file);
        create_parent(&marker)?;
        File::create(&marker).map_err(|e| HubError::io(&marker, e))?;
        Ok(())
    }

    /// Takes the download lock of blob `etag` for `file`; held until the value drops.
    pub fn lock(&self, file: &str, etag: &str) -> Result<File, HubError> {
        let path = self.locks.join(format!("{etag}.lock"));
        create_parent(&path)?;
        let handle = File::create(&path).map_err(|e| HubError::io(&path, e))?;
        match handle.try_lock() {
            Ok(()) => Ok(handle),
            Err(std::fs::TryLockError::WouldBlock) => Err(HubError::Busy {
                file: file.to_string(),
                lock: path,
            }),
            Err(std::fs::TryLockError::Error(e)) => Err(HubError::io(&path, e)),
        }
    }

    /// Moves a checked download into place as the blob `etag`.
    pub fn commit_blob(&self, partial: &Path, etag: &str) -> Result<(), HubError> {
        std::fs::rename(partial, self.blob(etag)).map_err(|e| HubError::io(partial, e))
    }

    /// Links `file` in `commit`'s snapshot to the blob `etag`, with a relative link so that
    /// the cache can move.
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<(), HubError> {
        let pointer = self.snapshot(commit).join(file);
        create_parent(&pointer)?;
        let depth = file.split('/').count() + 1;
        let target = Path::new(&"../".repeat(depth)).join("blobs").join(etag);
        let _ = std::fs::remove_file(&pointer);
        symlink(&target, &pointer).map_err(|e| HubError::io(&pointer, e))
    }

    /// Points the branch `revision` at `commit`.
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<(), HubError> {
        let path = self.dir.join("refs").join(revision);
        create_parent(&path)?;
        std::fs::write(&path, commit).map_err(|e| HubError::io(&path, e))
    }
}

fn create_parent(path: &Path) -> Result<(), HubError> {
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    let blob = link.parent().unwrap_or(Path::new(".")).join(target);
    std::fs::copy(blob, link).map(|_| ())
}

/// The snapshot directory of `repo` at `revision` in the local cache under `root`, where a
/// finished pull left `marker` (`PullFiles::marker`). `pull_hint` is the `spex pull`
/// argument that an error suggests when it is missing.
pub fn snapshot_dir(
    root: &Path,
    repo: &str,
    revision: &str,
    marker: &str,
    pull_hint: &str,
) -> Result<PathBuf, EngineError> {
    let cache = RepoCache::new(root, repo);
    let missing = |what: String| {
        EngineError::file(cache.dir(), format!("{what}: run `spex pull {pull_hint}`"))
    };
    if !cache.dir().is_dir() {
        return Err(missing(format!("{repo} is not in the local hub cache")));
    }
    let Some(commit) = cache.commit_of(revision) else {
        return Err(missing(format!(
            "revision `{revision}` is not in the local hub cache"
        )));
    };
    let snap = cache.snapshot(&commit);
    if !snap.join(marker).is_file() {
        return Err(missing(match is_commit(revision) {
            true => format!("commit {commit} is not in the local hub cache"),
            false => {
                format!("revision `{revision}` (commit {commit}) is not in the local hub cache")
            }
        }));
    }
    Ok(snap)
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
