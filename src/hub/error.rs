//! The hub's errors. Each renders as one line that says what failed and what to do about it,
//! so that the CLI shows it as-is.

use std::path::{Path, PathBuf};

use crate::engine::EngineError;

/// Errors of resolving or pulling a hub checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("HF_HUB_OFFLINE is set: pulling from the hub needs the network")]
    Offline,
    #[error("{variable}: `{value}` is not a number of seconds")]
    Setting {
        variable: &'static str,
        value: String,
    },
    #[error(
        "{repo}: the hub answered {status} (a gated or private repo): set HF_TOKEN or write a token to {token_file}"
    )]
    NeedsToken {
        repo: String,
        status: u16,
        token_file: PathBuf,
    },
    #[error(
        "{repo}: the hub refused the token ({status}): ask for access on the repo's page, or check HF_TOKEN"
    )]
    TokenRefused { repo: String, status: u16 },
    #[error("{repo}: no such repo at {endpoint} (404)")]
    NoRepo { repo: String, endpoint: String },
    #[error("{repo}: no revision `{revision}` (404)")]
    NoRevision { repo: String, revision: String },
    #[error("{repo}@{revision}: no file `{file}` (404)")]
    NoFile {
        repo: String,
        revision: String,
        file: String,
    },
    #[error(
        "{repo}@{revision}: no file `{file}` (404); its .{extension} files: {}",
        list_or_none(have)
    )]
    NoFileAmong {
        repo: String,
        revision: String,
        file: String,
        extension: String,
        have: Vec<String>,
    },
    #[error("{url}: {message}")]
    Protocol { url: String, message: String },
    #[error("{file} from {endpoint}: {message}, {attempts} tries: run the pull again to resume")]
    Network {
        file: String,
        endpoint: String,
        message: String,
        attempts: u32,
    },
    #[error(
        "{file}: checksum mismatch (sha256 {actual}, the hub says {expected}): nothing was kept; run the pull again"
    )]
    Checksum {
        file: String,
        expected: String,
        actual: String,
    },
    #[error("{file}: another pull is downloading it ({lock})")]
    Busy { file: String, lock: PathBuf },
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// `names` joined by commas, or "none".
fn list_or_none(names: &[String]) -> String {
    match names.is_empty() {
        true => "none".into(),
        false => names.join(", "),
    }
}

impl HubError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, e: impl std::fmt::Display) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }
}

impl From<HubError> for EngineError {
    fn from(e: HubError) -> Self {
        EngineError::Invalid(crate::engine::error::one_line(&e.to_string()))
    }
}
