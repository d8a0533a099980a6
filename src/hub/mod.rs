//! Checkpoints from a Hugging Face hub: where the local cache is, and `pull`, which downloads
//! a repository's checkpoint files into that cache.
//!
//! The cache is laid out as every hub client lays it out ([`cache`]), so a checkpoint pulled
//! by spex is found by other tools and the reverse. [`HubSettings`] reads the environment the
//! hub's own command-line client reads (`HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN`,
//! `HF_HUB_OFFLINE`, the timeouts) once, at the edge, into a value that is passed down.
//!
//! A pull ([`pull`]) asks the hub which commit the revision names, then fetches each file
//! from that one commit (`download`): resumed where a partial file stopped, retried with
//! backoff, checked against its SHA-256 before it enters the cache. Nothing unchecked is
//! ever linked into a snapshot, so a load never trusts a corrupt or partial file.
//!
//! Called by the CLI (`spex pull`, and `--model` when a hub checkpoint is not cached yet).

pub mod cache;
mod download;
mod error;
mod settings;

pub use cache::{RepoCache, is_commit, is_repo_id, snapshot_dir, snapshot_size};
pub use error::HubError;
pub use settings::HubSettings;

use std::path::PathBuf;

use download::{Client, Remote};

/// What a pull reports while it runs, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullProgress<'a> {
    /// `file`'s bytes are arriving: `done_bytes` of `total_bytes` are on disk.
    Downloading {
        file: &'a str,
        done_bytes: u64,
        total_bytes: u64,
    },
    /// A request for `file` failed with `reason`; try `attempt` of `max_attempts` follows.
    Retrying {
        file: &'a str,
        attempt: u32,
        max_attempts: u32,
        reason: &'a str,
    },
    /// `file` is in the snapshot (downloaded now or already in the cache).
    Done { file: &'a str },
}

/// What a finished pull holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// The snapshot directory of the commit, in the local cache.
    pub snapshot: PathBuf,
    /// The commit the revision named when pulled.
    pub commit: String,
    /// Bytes downloaded by this pull (0 when everything was cached).
    pub downloaded_bytes: u64,
}

/// Which of a repo's files a pull fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullFiles<'a> {
    /// A safetensors checkpoint: the config, the tokenizer files and the weights (one file,
    /// or the shards an index names).
    Checkpoint,
    /// One weights file of a repo that holds many (a GGUF repo holds one per quantization),
    /// and the `tokenizer.json` beside it where the repo has one.
    File(&'a str),
}

impl PullFiles<'_> {
    /// The file a pull fetches first, whose presence in a snapshot says it was pulled: a
    /// checkpoint's config, or the weights file itself.
    pub fn marker(&self) -> &str {
        match self {
            Self::Checkpoint => REQUIRED[0],
            Self::File(file) => file,
        }
    }
}

/// Files a checkpoint may have beside its weights; only the first two are required.
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
const OPTIONAL: [&str; 2] = ["tokenizer_config.json", "generation_config.json"];
const INDEX: &str = crate::engine::checkpoint::SHARD_INDEX;
const WEIGHTS: &str = "model.safetensors";

/// Downloads `files` of `repo` at `revision` (a branch, tag or 40-hex commit) into the local
/// cache. Every file comes from the one commit the revision named when the pull began. A
/// branch's ref is written last, so an interrupted pull leaves the previous snapshot in
/// force. A [`PullFiles::File`] the repo lacks is an error that lists the files it has of
/// that extension.
pub fn pull(
    settings: &HubSettings,
    repo: &str,
    revision: &str,
    files: PullFiles,
    progress: &mut dyn FnMut(PullProgress),
) -> Result<Pulled, HubError> {
    if settings.offline {
        return Err(HubError::Offline);
    }
    if let PullFiles::File(file) = files {
        check_file_name(file)?;
    }
    let cache = RepoCache::new(&settings.cache_root, repo);
    let client = Client::new(settings, repo);
    let marker = files.marker();
    // A pinned commit whose first file is here needs no request to name its commit.
    let first = match is_commit(revision) && cache.linked(revision, marker) {
        true => None,
        false => match files {
            PullFiles::Checkpoint => Some(client.require(revision, marker, progress)?),
            PullFiles::File(file) => match client.metadata(revision, file, progress)? {
                Some(remote) => Some(remote),
                None => return Err(absent_file(&client, revision, file, progress)),
            },
        },
    };
    let commit = first
        .as_ref()
        .map_or_else(|| revision.to_string(), |f| f.commit.clone());
    let mut fetcher = Fetcher {
        client: &client,
        cache: &cache,
        commit: &commit,
        downloaded_bytes: 0,
        progress,
    };
    match first {
        Some(remote) => fetcher.place(marker, remote)?,
        None => fetcher.fetch(marker, true).map(|_| ())?,
    }
    match files {
        PullFiles::Checkpoint => fetcher.rest_of_checkpoint()?,
        PullFiles::File(file) => {
            fetcher.fetch(&tokenizer_beside(file), false)?;
        }
    }
    let downloaded_bytes = fetcher.downloaded_bytes;
    if !is_commit(revision) {
        cache.write_ref(revision, &commit)?;
    }
    Ok(Pulled {
        snapshot: cache.snapshot(&commit),
        commit,
        downloaded_bytes,
    })
}

/// One pull's walk over its files, all at `commit`.
struct Fetcher<'a> {
    client: &'a Client<'a>,
    cache: &'a RepoCache,
    commit: &'a str,
    downloaded_bytes: u64,
    progress: &'a mut dyn FnMut(PullProgress),
}

impl Fetcher<'_> {
    /// The checkpoint's files after its config: the tokenizer files and the weights.
    fn rest_of_checkpoint(&mut self) -> Result<(), HubError> {
        self.fetch(REQUIRED[1], true)?;
        for file in OPTIONAL {
            self.fetch(file, false)?;
        }
        if self.fetch(INDEX, false)? {
            for shard in shards(&self.cache.snapshot(self.commit).join(INDEX))? {
                self.fetch(&shard, true)?;
            }
            return Ok(());
        }
        self.fetch(WEIGHTS, true).map(|_| ())
    }

    /// Puts `file` in the snapshot; false when the repo has no such file and it is optional.
    /// A file already in this commit's snapshot, or known absent from it, costs no request.
    fn fetch(&mut self, file: &str, required: bool) -> Result<bool, HubError> {
        if self.cache.linked(self.commit, file) {
            (self.progress)(PullProgress::Done { file });
            return Ok(true);
        }
        if !required && self.cache.known_absent(self.commit, file) {
            return Ok(false);
        }
        let remote = match required {
            true => self
                .client
                .require(self.commit, file, &mut *self.progress)?,
            false => match self
                .client
                .metadata(self.commit, file, &mut *self.progress)?
            {
                Some(remote) => remote,
                None => {
                    self.cache.mark_absent(self.commit, file)?;
                    return Ok(false);
                }
            },
        };
        self.place(file, remote)?;
        Ok(true)
    }

    /// Downloads `remote` into its blob unless the cache has it, and links it as `file`.
    fn place(&mut self, file: &str, remote: Remote) -> Result<(), HubError> {
        if !self.cache.has_blob(&remote.etag, remote.size_bytes) {
            let _lock = self.cache.lock(file, &remote.etag)?;
            let partial = self.cache.partial(&remote.etag);
            self.downloaded_bytes +=
                self.client
                    .download(file, &remote, &partial, &mut *self.progress)?;
            self.cache.commit_blob(&partial, &remote.etag)?;
        }
        self.cache.link(self.commit, file, &remote.etag)?;
        (self.progress)(PullProgress::Done { file });
        Ok(())
    }
}

/// A file name to pull must stay inside the snapshot: relative, with no `..` or empty part.
fn check_file_name(file: &str) -> Result<(), HubError> {
    let bad = file.starts_with('/') || file.split(['/', '\\']).any(|p| p.is_empty() || p == "..");
    match bad {
        true => Err(HubError::Invalid(format!(
            "`{file}`: a file to pull is a path inside the repo, like `NAME.gguf`"
        ))),
        false => Ok(()),
    }
}

/// The `tokenizer.json` in the same folder of the repo as `file`, where a GGUF's load looks
/// for one (`engine::checkpoint::gguf_tokenizer_file`).
fn tokenizer_beside(file: &str) -> String {
    match file.rsplit_once('/') {
        Some((folder, _)) => format!("{folder}/{}", REQUIRED[1]),
        None => REQUIRED[1].to_string(),
    }
}

/// The error for a weights `file` the repo lacks at `revision`: the files it has of that
/// extension, asked of the hub's file listing, or the plain missing-file error where the
/// listing cannot be had.
fn absent_file(
    client: &Client,
    revision: &str,
    file: &str,
    progress: &mut dyn FnMut(PullProgress),
) -> HubError {
    let (repo, revision, file) = (
        client.repo().to_string(),
        revision.to_string(),
        file.to_string(),
    );
    let extension = |name: &str| std::path::Path::new(name).extension().map(|x| x.to_owned());
    match client.list_files(&revision, progress) {
        Ok(names) => HubError::NoFileAmong {
            extension: extension(&file).map_or(String::new(), |x| x.to_string_lossy().into()),
            have: (names.into_iter())
                .filter(|n| extension(n) == extension(&file))
                .collect(),
            repo,
            revision,
            file,
        },
        Err(_) => HubError::NoFile {
            repo,
            revision,
            file,
        },
    }
}

/// The shard files a `model.safetensors.index.json` names, each once
/// (`engine::checkpoint::shard_names`).
fn shards(index: &std::path::Path) -> Result<Vec<String>, HubError> {
    crate::engine::checkpoint::shard_names(index).map_err(|e| HubError::Invalid(e.to_string()))
}
