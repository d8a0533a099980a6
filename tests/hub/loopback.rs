//! A loopback hub: a small HTTP/1.1 server on 127.0.0.1 that serves checkpoints the tests
//! made the way the hub serves them, with faults on request.
//!
//! - `HEAD|GET /ORG/NAME/resolve/REVISION/FILE` (REVISION: `main` or the commit) answers
//!   with `x-repo-commit` and an `etag`. A `.safetensors` file is an LFS file: the answer is a
//!   302 to `/lfs/SHA256` with `x-linked-etag` (the SHA-256) and `x-linked-size`. Errors carry
//!   the hub's `x-error-code`: `RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, and 401
//!   `GatedRepo` for a gated repo asked without its token.
//!   A `.gguf` file is an LFS file too.
//! - `GET /api/models/ORG/NAME/revision/REVISION` lists the repo's files (`siblings`).
//! - `GET /lfs/SHA256` serves the bytes, honouring `Range: bytes=N-`.
//!
//! Every connection is answered once and closed. [`Faults`] bend the LFS answers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::Digest;

/// One repo the hub serves.
pub struct HubRepo {
    pub id: String,
    pub commit: String,
    pub files: BTreeMap<String, Vec<u8>>,
    /// A gated repo answers only requests that carry this token.
    pub token: Option<String>,
}

impl HubRepo {
    /// The files of the checkpoint directory `dir`, as repo `id` at `commit`.
    pub fn from_dir(id: &str, commit: &str, dir: &Path) -> Self {
        let files = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&p).unwrap())
            })
            .collect();
        Self {
            id: id.into(),
            commit: commit.into(),
            files,
            token: None,
        }
    }
}

/// What the LFS answers do wrong.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// The next this many LFS answers send `drop_after_bytes` of their body and close.
    pub drops: u32,
    pub drop_after_bytes: u64,
    /// Once the drops are spent, LFS answers are 503s.
    pub down_after_drops: bool,
    /// LFS answers send one byte changed.
    pub corrupt: bool,
    /// Every request is read and never answered (the connection is held open).
    pub silent: bool,
    /// The next this many LFS answers send half their body, then stall without closing.
    pub stalls: u32,
    /// LFS answers ignore `Range`: a 200 with the whole body, as some servers send.
    pub ignores_range: bool,
}

/// What the hub has served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Served {
    pub requests: u32,
    /// Bytes of LFS bodies written.
    pub lfs_bytes: u64,
}

#[derive(Default)]
struct State {
    repos: Vec<HubRepo>,
    faults: Faults,
    served: Served,
}

/// The running server; it lives as long as the test process.
pub struct LoopbackHub {
    pub endpoint: String,
    state: Arc<Mutex<State>>,
}

impl LoopbackHub {
    /// Serves `repos` on a free port of 127.0.0.1.
    pub fn start(repos: Vec<HubRepo>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State {
            repos,
            ..State::default()
        }));
        let shared = Arc::clone(&state);
        let base = endpoint.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (state, base) = (Arc::clone(&shared), base.clone());
                std::thread::spawn(move || answer(stream, &state, &base));
            }
        });
        Self { endpoint, state }
    }

    pub fn set_faults(&self, faults: Faults) {
        self.state.lock().unwrap().faults = faults;
    }

    pub fn served(&self) -> Served {
        self.state.lock().unwrap().served
    }
}

struct Request {
    method: String,
    path: String,
    headers: BTreeMap<String, String>,
}

fn read_request(stream: &TcpStream) -> Option<Request> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
    }
    Some(Request {
        method,
        path,
        headers,
    })
}

fn sha256(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An answer: status, headers, body (cut short or stalled by a fault).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    cut_after: Option<u64>,
    stall_after: Option<u64>,
}

impl Answer {
    fn new(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            cut_after: None,
            stall_after: None,
        }
    }

    fn header(mut self, k: &str, v: impl ToString) -> Self {
        self.headers.push((k.into(), v.to_string()));
        self
    }
}

fn answer(mut stream: TcpStream, state: &Mutex<State>, base: &str) {
    let Some(request) = read_request(&stream) else {
        return;
    };
    let (answer, is_lfs) = {
        let mut state = state.lock().unwrap();
        state.served.requests += 1;
        if state.faults.silent {
            drop(state);
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        route(&request, &mut state, base)
    };
    let head = request.method == "HEAD";
    let mut out = format!("HTTP/1.1 {} X\r\n", answer.status);
    for (k, v) in &answer.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str(&format!(
        "content-length: {}\r\nconnection: close\r\n\r\n",
        answer.body.len()
    ));
    if stream.write_all(out.as_bytes()).is_err() || head {
        return;
    }
    let limit = answer
        .cut_after
        .or(answer.stall_after)
        .unwrap_or(u64::MAX)
        .min(answer.body.len() as u64) as usize;
    let written = stream.write_all(&answer.body[..limit]).map_or(0, |_| limit);
    if is_lfs {
        state.lock().unwrap().served.lfs_bytes += written as u64;
    }
    if answer.stall_after.is_some() {
        let _ = stream.flush();
        std::thread::sleep(Duration::from_secs(120));
    }
}

fn route(request: &Request, state: &mut State, base: &str) -> (Answer, bool) {
    if let Some(sha) = request.path.strip_prefix("/lfs/") {
        return (lfs(request, state, sha), true);
    }
    if let Some(rest) = request.path.strip_prefix("/api/models/") {
        return (listing(state, rest), false);
    }
    let parts: Vec<&str> = request
        .path
        .trim_start_matches('/')
        .splitn(5, '/')
        .collect();
    let [org, name, "resolve", revision, file] = parts[..] else {
        return (Answer::new(400), false);
    };
    let id = format!("{org}/{name}");
    let error = |status: u16, code: &str| (Answer::new(status).header("x-error-code", code), false);
    let Some(repo) = state.repos.iter().find(|r| r.id == id) else {
        return error(404, "RepoNotFound");
    };
    if let Some(token) = &repo.token
        && request.headers.get("authorization") != Some(&format!("Bearer {token}"))
    {
        return error(401, "GatedRepo");
    }
    if revision != "main" && revision != repo.commit {
        return error(404, "RevisionNotFound");
    }
    let Some(bytes) = repo.files.get(file) else {
        return error(404, "EntryNotFound");
    };
    let sha = sha256(bytes);
    let answer = Answer::new(200)
        .header("x-repo-commit", &repo.commit)
        .header("etag", format!("\"{}\"", &sha[..40]));
    if file.ends_with(".safetensors") || file.ends_with(".gguf") {
        let mut answer = answer
            .header("location", format!("{base}/lfs/{sha}"))
            .header("x-linked-etag", format!("\"{sha}\""))
            .header("x-linked-size", bytes.len());
        answer.status = 302;
        return (answer, false);
    }
    (ranged(answer, bytes, request), false)
}

/// The hub's listing of a repo's files at a revision: `ORG/NAME/revision/REVISION`.
fn listing(state: &State, rest: &str) -> Answer {
    let parts: Vec<&str> = rest.splitn(4, '/').collect();
    let [org, name, "revision", revision] = parts[..] else {
        return Answer::new(400);
    };
    let id = format!("{org}/{name}");
    let Some(repo) = state.repos.iter().find(|r| r.id == id) else {
        return Answer::new(404).header("x-error-code", "RepoNotFound");
    };
    if revision != "main" && revision != repo.commit {
        return Answer::new(404).header("x-error-code", "RevisionNotFound");
    }
    let siblings: Vec<_> = (repo.files.keys())
        .map(|f| serde_json::json!({ "rfilename": f }))
        .collect();
    let body = serde_json::json!({ "id": id, "sha": repo.commit, "siblings": siblings });
    Answer {
        body: body.to_string().into_bytes(),
        ..Answer::new(200)
    }
}

fn lfs(request: &Request, state: &mut State, sha: &str) -> Answer {
    let Some(bytes) = state
        .repos
        .iter()
        .flat_map(|r| r.files.values())
        .find(|b| sha256(b) == sha)
        .cloned()
    else {
        return Answer::new(404);
    };
    let faults = &mut state.faults;
    if faults.drops == 0 && faults.down_after_drops {
        return Answer::new(503);
    }
    let mut bytes = bytes;
    if faults.corrupt {
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x5a;
    }
    let mut answer = match faults.ignores_range {
        true => Answer {
            body: bytes,
            ..Answer::new(200)
        },
        false => ranged(Answer::new(200), &bytes, request),
    };
    if faults.drops > 0 {
        faults.drops -= 1;
        answer.cut_after = Some(faults.drop_after_bytes);
    } else if faults.stalls > 0 {
        faults.stalls -= 1;
        answer.stall_after = Some(answer.body.len() as u64 / 2);
    }
    answer
}

/// `answer` with the body `bytes`, or the range of it the request asks for.
fn ranged(mut answer: Answer, bytes: &[u8], request: &Request) -> Answer {
    let start = request
        .headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse::<usize>().ok());
    match start {
        Some(start) if start < bytes.len() => {
            answer.status = 206;
            answer.body = bytes[start..].to_vec();
            answer.header(
                "content-range",
                format!("bytes {start}-{}/{}", bytes.len() - 1, bytes.len()),
            )
        }
        Some(_) => Answer::new(416),
        None => {
            answer.body = bytes.to_vec();
            answer
        }
    }
}
