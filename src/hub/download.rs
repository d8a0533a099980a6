//! The hub's file protocol, as its own client speaks it:
//!
//! 1. **Metadata.** `HEAD ENDPOINT/ORG/NAME/resolve/REVISION/FILE` answers with the commit the
//!    revision names (`x-repo-commit`), the file's etag and its size. A large (LFS) file
//!    answers with a redirect to where its bytes are, an `x-linked-etag` that is their SHA-256
//!    and an `x-linked-size`. Relative redirects (a renamed repo) are followed; an absolute
//!    one is where the bytes are downloaded from, without the token.
//! 2. **Bytes.** `GET` with `Range: bytes=N-` appends to the partial file from its length, so
//!    an interrupted download resumes where it stopped, in this pull or a later one.
//! 3. **Retries.** A request that fails (a refused or dropped connection, a timeout, a 5xx or
//!    429) is retried after a backoff that doubles. A request that took the file past the
//!    furthest byte any earlier one reached is resumed at once and not counted; a pull gives
//!    up after `max_retries` requests in a row that did not, so a connection that breaks at
//!    the same byte every time ends the pull instead of looping. A server that ignores `Range`
//!    (a 200 to a resume) restarts the file once; a second time, resuming is refused. A
//!    refusal (401, 403, 404) is final.
//! 4. **Check.** The bytes are hashed as they arrive (a resumed file's first part when it is
//!    reopened). A file whose SHA-256 is not its etag is deleted, never linked.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::{HubError, HubSettings, PullProgress};

/// Relative redirects followed before a metadata request gives up.
const MAX_RELATIVE_REDIRECTS: usize = 5;
/// The first retry's wait; each later one doubles it, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(4);
/// Bytes read from the network per write to the partial file.
const CHUNK_BYTES: usize = 1 << 20;

/// Where a file's bytes are and what they must be.
#[derive(Debug, Clone)]
pub(super) struct Remote {
    /// Where the bytes are downloaded from.
    pub url: String,
    /// The commit the revision named.
    pub commit: String,
    /// The file's etag: the SHA-256 of its bytes for a large file, a git hash otherwise.
    pub etag: String,
    pub size_bytes: u64,
}

/// The part of the hub's answer about a repo revision that lists its files.
#[derive(serde::Deserialize)]
struct Listing {
    siblings: Vec<Sibling>,
}

/// One file of a [`Listing`].
#[derive(serde::Deserialize)]
struct Sibling {
    rfilename: String,
}

/// Where an attempt reports its bytes.
type Report<'r> = &'r mut dyn FnMut(PullProgress);

/// How one request failed.
enum Failure {
    /// Worth another try: the network, a timeout, the server's own error.
    Transient(String),
    /// Final: a refusal, a protocol error, the disk.
    Fatal(HubError),
}

/// A connection to one repo on the hub.
pub(super) struct Client<'a> {
    agent: ureq::Agent,
    settings: &'a HubSettings,
    repo: String,
}

impl<'a> Client<'a> {
    /// A client for `repo` with `settings`' endpoint, token and timeouts.
    pub fn new(settings: &'a HubSettings, repo: &str) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .max_redirects_will_error(false)
            .timeout_connect(Some(settings.metadata_timeout))
            .timeout_recv_response(Some(settings.metadata_timeout))
            .timeout_per_read(Some(settings.download_timeout))
            .user_agent(concat!("spex/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Self {
            agent,
            settings,
            repo: repo.to_string(),
        }
    }

    /// The repo this client asks about.
    pub fn repo(&self) -> &str {
        &self.repo
    }

    /// The names of every file the repo has at `revision`, from the hub's listing
    /// (`GET ENDPOINT/api/models/ORG/NAME/revision/REVISION`, its `siblings`).
    pub fn list_files(
        &self,
        revision: &str,
        progress: &mut dyn FnMut(PullProgress),
    ) -> Result<Vec<String>, HubError> {
        let url = format!(
            "{}/api/models/{}/revision/{revision}",
            self.settings.endpoint, self.repo
        );
        let text = self.retrying("the file listing", progress, &mut |_| {
            let response = self.call("GET", &url, None).map_err(Failure::Transient)?;
            match response.status().as_u16() {
                200 => response
                    .into_body()
                    .read_to_string()
                    .map_err(|e| Failure::Transient(e.to_string())),
                s @ (429 | 500..=599) => Err(Failure::Transient(format!("HTTP {s}"))),
                s => Err(Failure::Fatal(self.refusal(s, &response, revision, ""))),
            }
        })?;
        let bad = |message: String| HubError::Protocol {
            url: url.clone(),
            message,
        };
        let listing: Listing =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a file listing: {e}")))?;
        Ok(listing.siblings.into_iter().map(|s| s.rfilename).collect())
    }

    /// `file`'s metadata at `revision`; an error when the repo has no such file.
    pub fn require(
        &self,
        revision: &str,
        file: &str,
        progress: &mut dyn FnMut(PullProgress),
    ) -> Result<Remote, HubError> {
        self.metadata(revision, file, progress)?
            .ok_or_else(|| HubError::NoFile {
                repo: self.repo.clone(),
                revision: revision.to_string(),
                file: file.to_string(),
            })
    }

    /// `file`'s metadata at `revision`, or `None` when the repo has no such file.
    pub fn metadata(
        &self,
        revision: &str,
        file: &str,
        progress: &mut dyn FnMut(PullProgress),
    ) -> Result<Option<Remote>, HubError> {
        let mut url = format!(
            "{}/{}/resolve/{revision}/{file}",
            self.settings.endpoint, self.repo
        );
        for _ in 0..MAX_RELATIVE_REDIRECTS {
            let response = self.retrying(file, progress, &mut |_| {
                self.call("HEAD", &url, None).map_err(Failure::Transient)
            })?;
            let status = response.status().as_u16();
            let location = header(&response, "location");
            match (status, location) {
                (300..=399, Some(to)) if to.starts_with('/') => {
                    url = format!("{}{to}", origin(&self.settings.endpoint));
                }
                (200..=399, location) => {
                    let download = location.unwrap_or_else(|| url.clone());
                    return remote(&response, &url, download).map(Some);
                }
                (404, _) => {
                    return match self.refusal(status, &response, revision, file) {
                        HubError::NoFile { .. } => Ok(None),
                        e => Err(e),
                    };
                }
                _ => return Err(self.refusal(status, &response, revision, file)),
            }
        }
        Err(HubError::Protocol {
            url,
            message: "too many redirects".into(),
        })
    }

    /// Downloads `remote` into `partial`, resuming what is there, and checks it. Returns the
    /// bytes this call downloaded.
    pub fn download(
        &self,
        file: &str,
        remote: &Remote,
        partial: &Path,
        progress: &mut dyn FnMut(PullProgress),
    ) -> Result<u64, HubError> {
        let mut sink = Sink::open(partial, remote.size_bytes)?;
        let resumed_from = sink.have;
        while sink.have < remote.size_bytes {
            self.retrying(file, progress, &mut |progress: &mut dyn FnMut(
                PullProgress,
            )| {
                self.fetch(file, remote, &mut sink, progress)
            })?;
        }
        let downloaded = sink.have - resumed_from;
        sink.check(file, &remote.etag)?;
        Ok(downloaded)
    }

    /// One request for the bytes from `sink.have` on. Ok when it ended with all of them.
    fn fetch(
        &self,
        file: &str,
        remote: &Remote,
        sink: &mut Sink,
        progress: &mut dyn FnMut(PullProgress),
    ) -> Result<(), Failure> {
        let response = self
            .call("GET", &remote.url, Some(sink.have))
            .map_err(Failure::Transient)?;
        match response.status().as_u16() {
            206 => {
                let range = header(&response, "content-range").unwrap_or_default();
                if !range.starts_with(&format!("bytes {}-", sink.have)) {
                    return Err(Failure::Fatal(HubError::Protocol {
                        url: remote.url.clone(),
                        message: format!("asked for bytes {}-, got `{range}`", sink.have),
                    }));
                }
            }
            200 if sink.have > 0 && sink.restarts > 0 => {
                return Err(Failure::Fatal(HubError::Protocol {
                    url: remote.url.clone(),
                    message: format!(
                        "answered a resume from byte {} with the whole file again (it ignores \
                         Range), after its connection broke: cannot resume",
                        sink.have
                    ),
                }));
            }
            200 if sink.have > 0 => sink.restart().map_err(Failure::Fatal)?,
            200 => {}
            s @ (429 | 500..=599) => return Err(Failure::Transient(format!("HTTP {s}"))),
            s => return Err(Failure::Fatal(self.refusal(s, &response, "", file))),
        }
        let mut body = response
            .into_body()
            .into_with_config()
            .limit(u64::MAX)
            .reader();
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            let n = body
                .read(&mut buf)
                .map_err(|e| Failure::Transient(e.to_string()))?;
            if n == 0 {
                break;
            }
            sink.append(file, &buf[..n], remote.size_bytes)
                .map_err(Failure::Fatal)?;
            progress(PullProgress::Downloading {
                file,
                done_bytes: sink.have,
                total_bytes: remote.size_bytes,
            });
        }
        match sink.have < remote.size_bytes {
            true => Err(Failure::Transient(format!(
                "the connection closed at byte {} of {}",
                sink.have, remote.size_bytes
            ))),
            false => Ok(()),
        }
    }

    /// Runs `attempt` until it succeeds, a failure is final, or `max_retries` attempts in a
    /// row fail without `progress` hearing of a byte past the furthest reached before.
    fn retrying<T>(
        &self,
        file: &str,
        progress: &mut dyn FnMut(PullProgress),
        attempt: &mut dyn FnMut(Report) -> Result<T, Failure>,
    ) -> Result<T, HubError> {
        let (mut idle_failures, mut furthest) = (0u32, 0u64);
        loop {
            let mut moved = false;
            let result = attempt(&mut |p| {
                if let PullProgress::Downloading { done_bytes, .. } = p
                    && done_bytes > furthest
                {
                    (moved, furthest) = (true, done_bytes);
                }
                progress(p)
            });
            let reason = match result {
                Ok(value) => return Ok(value),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Transient(reason)) => reason,
            };
            idle_failures = if moved { 0 } else { idle_failures + 1 };
            if idle_failures > self.settings.max_retries {
                return Err(HubError::Network {
                    file: file.to_string(),
                    endpoint: self.settings.endpoint.clone(),
                    message: crate::engine::error::one_line(&reason),
                    attempts: idle_failures,
                });
            }
            if idle_failures > 0 {
                progress(PullProgress::Retrying {
                    file,
                    attempt: idle_failures + 1,
                    max_attempts: self.settings.max_retries + 1,
                    reason: &reason,
                });
                std::thread::sleep(backoff(idle_failures));
            }
        }
    }

    /// One request; the token goes only to the hub itself, never to where it redirects.
    fn call(
        &self,
        method: &str,
        url: &str,
        from_byte: Option<u64>,
    ) -> Result<ureq::http::Response<ureq::Body>, String> {
        let mut request = ureq::http::Request::builder()
            .method(method)
            .uri(url)
            .header("accept-encoding", "identity");
        if let Some(start) = from_byte {
            request = request.header("range", format!("bytes={start}-"));
        }
        if let Some(token) = &self.settings.token
            && url.starts_with(&self.settings.endpoint)
        {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let request = request.body(()).map_err(|e| format!("{url}: {e}"))?;
        self.agent.run(request).map_err(|e| e.to_string())
    }

    /// The error a refusing status gives, read with the hub's `x-error-code`.
    fn refusal(
        &self,
        status: u16,
        response: &ureq::http::Response<ureq::Body>,
        revision: &str,
        file: &str,
    ) -> HubError {
        let repo = self.repo.clone();
        let code = header(response, "x-error-code").unwrap_or_default();
        match (status, code.as_str(), &self.settings.token) {
            (401 | 403, _, None) => HubError::NeedsToken {
                repo,
                status,
                token_file: self.settings.token_file.clone(),
            },
            (401 | 403, _, Some(_)) => HubError::TokenRefused { repo, status },
            (404, "RepoNotFound" | "RepositoryNotFound", _) => HubError::NoRepo {
                repo,
                endpoint: self.settings.endpoint.clone(),
            },
            (404, "RevisionNotFound", _) => HubError::NoRevision {
                repo,
                revision: revision.to_string(),
            },
            (404, _, _) => HubError::NoFile {
                repo,
                revision: revision.to_string(),
                file: file.to_string(),
            },
            _ => HubError::Protocol {
                url: format!("{}/{repo}", self.settings.endpoint),
                message: format!("{file}: unexpected HTTP {status}"),
            },
        }
    }
}

/// The metadata a resolve response carries.
fn remote(
    response: &ureq::http::Response<ureq::Body>,
    url: &str,
    download: String,
) -> Result<Remote, HubError> {
    let missing = |name: &str| HubError::Protocol {
        url: url.to_string(),
        message: format!("no `{name}` header: is HF_ENDPOINT a hub?"),
    };
    let commit = header(response, "x-repo-commit").ok_or_else(|| missing("x-repo-commit"))?;
    let etag = header(response, "x-linked-etag")
        .or_else(|| header(response, "etag"))
        .ok_or_else(|| missing("etag"))?;
    let etag = etag.trim_start_matches("W/").trim_matches('"').to_string();
    let size_bytes = header(response, "x-linked-size")
        .or_else(|| header(response, "content-length"))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| missing("content-length"))?;
    if etag.is_empty() || etag.contains(['/', '\\', '.']) || !super::is_commit(&commit) {
        return Err(HubError::Protocol {
            url: url.to_string(),
            message: format!("bad etag `{etag}` or commit `{commit}`"),
        });
    }
    Ok(Remote {
        url: download,
        commit,
        etag,
        size_bytes,
    })
}

fn header(response: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    let value = response.headers().get(name)?;
    value.to_str().ok().map(str::to_string)
}

/// `scheme://host[:port]` of `url`.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(i) => &url[..after_scheme + i],
        None => url,
    }
}

fn backoff(failures: u32) -> Duration {
    let doubled = FIRST_BACKOFF.saturating_mul(1 << failures.saturating_sub(1).min(16));
    doubled.min(MAX_BACKOFF)
}

/// The partial file and the hash of what it holds.
struct Sink {
    file: File,
    path: std::path::PathBuf,
    hasher: Sha256,
    have: u64,
    /// Times the file was emptied for a server that sent it whole instead of the range.
    restarts: u32,
}

impl Sink {
    /// Opens `path` for appending and hashes what an earlier try left in it (dropped when it
    /// is longer than the file can be).
    fn open(path: &Path, size_bytes: u64) -> Result<Self, HubError> {
        let io = |e: std::io::Error| HubError::io(path, e);
        std::fs::create_dir_all(path.parent().unwrap_or(Path::new("."))).map_err(io)?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        let mut sink = Self {
            have: file.metadata().map_err(io)?.len(),
            file: file.try_clone().map_err(io)?,
            path: path.to_path_buf(),
            hasher: Sha256::new(),
            restarts: 0,
        };
        if sink.have > size_bytes {
            sink.restart()?;
            sink.restarts = 0;
            return Ok(sink);
        }
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            let n = file.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            sink.hasher.update(&buf[..n]);
        }
        Ok(sink)
    }

    /// Empties the file, for a server that sent the whole file instead of the range asked.
    fn restart(&mut self) -> Result<(), HubError> {
        self.file
            .set_len(0)
            .map_err(|e| HubError::io(&self.path, e))?;
        self.hasher = Sha256::new();
        self.have = 0;
        self.restarts += 1;
        Ok(())
    }

    fn append(&mut self, file: &str, bytes: &[u8], size_bytes: u64) -> Result<(), HubError> {
        if self.have + bytes.len() as u64 > size_bytes {
            let _ = std::fs::remove_file(&self.path);
            return Err(HubError::Invalid(format!(
                "{file}: the server sent more than the {size_bytes} bytes it announced; nothing was kept"
            )));
        }
        self.file
            .write_all(bytes)
            .map_err(|e| HubError::io(&self.path, e))?;
        self.hasher.update(bytes);
        self.have += bytes.len() as u64;
        Ok(())
    }

    /// Checks the whole file against `etag` when that is a SHA-256; deletes it when it fails.
    fn check(self, file: &str, etag: &str) -> Result<(), HubError> {
        let actual: String = self
            .hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let is_sha256 = etag.len() == 64 && etag.chars().all(|c| c.is_ascii_hexdigit());
        if is_sha256 && actual != etag.to_ascii_lowercase() {
            let _ = std::fs::remove_file(&self.path);
            return Err(HubError::Checksum {
                file: file.to_string(),
                expected: etag.to_string(),
                actual,
            });
        }
        Ok(())
    }
}
