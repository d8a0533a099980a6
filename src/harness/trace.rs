//! Traces: a run recorded as JSON Lines, for replay and explanation without the model. The
//! first line is a [`TraceHeader`] (format version, model fingerprint, policy, sampling,
//! machine, prompt); every later line one [`Record`]: a race event of one lane, the step
//! times, an error or the end. [`TraceWriter`] flushes every line, so a killed process leaves
//! a file that is valid up to its last complete line; [`Trace::parse`] reads such a file back
//! (a cut last line is dropped and reported), and names the line of anything else it cannot
//! read. Written by the CLI's `--record`, read by `spex replay`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::race::{Lane, RaceEvent};
use super::trace_check::RecordCheck;
use crate::engine::checkpoint::Origin;
use crate::engine::config::{FIELD_LIMITS, MOST_LAYERS, MOST_PASSES, MOST_POSITIONS};
use crate::engine::error::{EngineError, Result, one_line};
use crate::engine::events::DecodeEvent;
use crate::engine::files::{self, FileKind};
use crate::engine::model::timing::StepTimes;
use crate::engine::policy::PolicyKind;
use crate::engine::sampling::Sampling;

/// The trace format this spex writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// What a trace says about its model: enough to name it and to tell whether another
/// checkpoint is the same one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    pub name: String,
    /// The checkpoint's `config.json` as spex reads it.
    pub config: serde_json::Value,
    pub passes: usize,
    pub layers: usize,
    /// SHA-256 of the weights (every `.safetensors` file, in name order) and the tokenizer.
    pub weights_sha256: String,
    pub tokenizer_sha256: String,
}

/// A trace's first line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// The trace format's version; its name marks a file as a spex trace.
    pub spex_trace: u32,
    pub spex_version: String,
    pub model: ModelRecord,
    /// The speculative lane's policy.
    pub policy: PolicyKind,
    pub sampling: Sampling,
    pub max_tokens: usize,
    pub context: usize,
    pub device: String,
    pub dtype: String,
    pub cpu: Option<String>,
    /// The prompt as typed (before any chat template).
    pub prompt: String,
}

/// One line after the header: what the race sent, in the order it sent it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Decode { lane: Lane, event: DecodeEvent },
    StepTimes { times: StepTimes },
    Error { message: String },
    Done,
}

/// A [`Record`] borrowed from the event it writes: the same JSON, without copying the event
/// (a step's readouts are most of a trace) before serializing it.
#[derive(Serialize)]
#[serde(tag = "record", rename_all = "snake_case")]
enum RecordRef<'a> {
    Decode { lane: Lane, event: &'a DecodeEvent },
    StepTimes { times: &'a StepTimes },
    Error { message: &'a str },
    Done,
}

impl<'a> From<&'a RaceEvent> for RecordRef<'a> {
    fn from(event: &'a RaceEvent) -> Self {
        match event {
            RaceEvent::Decode { lane, event } => Self::Decode { lane: *lane, event },
            RaceEvent::StepTimes(times) => Self::StepTimes { times },
            RaceEvent::Error(message) => Self::Error { message },
            RaceEvent::Done => Self::Done,
        }
    }
}

impl From<Record> for RaceEvent {
    fn from(record: Record) -> Self {
        match record {
            Record::Decode { lane, event } => Self::Decode { lane, event },
            Record::StepTimes { times } => Self::StepTimes(times),
            Record::Error { message } => Self::Error(message),
            Record::Done => Self::Done,
        }
    }
}

/// Writes a trace line by line, each flushed as it is written.
#[derive(Debug)]
pub struct TraceWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TraceWriter {
    /// Creates (or truncates) `path`, a file the user named, and writes the header line.
    pub fn create(path: &Path, header: &TraceHeader) -> Result<Self> {
        let file = File::create(path).map_err(|e| EngineError::file(path, e))?;
        Self::start(file, path.to_path_buf(), header)
    }

    /// Creates a new file at `path`, or beside it where that name is taken
    /// (`files::create_unique`: `NAME-2.EXT`, …), and writes the header line: for names
    /// spex makes up, which must never replace an earlier trace.
    pub fn create_unique(path: &Path, header: &TraceHeader) -> Result<Self> {
        let (file, path) = files::create_unique(path)?;
        Self::start(file, path, header)
    }

    fn start(file: File, path: PathBuf, header: &TraceHeader) -> Result<Self> {
        let mut writer = Self {
            path,
            out: BufWriter::new(file),
        };
        writer.line(header)?;
        Ok(writer)
    }

    /// Where it writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one race event.
    pub fn record(&mut self, event: &RaceEvent) -> Result<()> {
        self.line(&RecordRef::from(event))
    }

    fn line(&mut self, value: &impl Serialize) -> Result<()> {
        let fail = |e: &dyn std::fmt::Display| EngineError::file(&self.path, e);
        serde_json::to_writer(&mut self.out, value).map_err(|e| fail(&e))?;
        self.out.write_all(b"\n").map_err(|e| fail(&e))?;
        self.out.flush().map_err(|e| fail(&e))
    }
}

/// A trace read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub header: TraceHeader,
    pub events: Vec<RaceEvent>,
    /// The number of a last line that was cut short (a killed recording) and left out.
    pub cut_line: Option<usize>,
}

impl Trace {
    /// Reads the trace at `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = files::read_capped(path, FileKind::Trace)?;
        Self::parse(&bytes).map_err(|message| EngineError::file(path, message))
    }

    /// Parses a trace's bytes; the error is one line naming what is wrong and where.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Self, String> {
        let text = std::str::from_utf8(bytes).map_err(|e| {
            format!(
                "not a spex trace (invalid UTF-8 at byte {})",
                e.valid_up_to()
            )
        })?;
        let ends_whole = text.ends_with('\n');
        let lines: Vec<&str> = text.lines().collect();
        let header = header(lines.first().copied().unwrap_or(""))?;
        let mut events = Vec::new();
        let mut cut_line = None;
        let last = lines.len();
        let vocab = (header.model.config.get("vocab_size")).and_then(|v| v.as_u64());
        let mut check = RecordCheck::new(header.model.passes, vocab, header.context);
        for (index, line) in lines.iter().enumerate().skip(1) {
            match serde_json::from_str::<Record>(line) {
                Ok(record) => {
                    let event = RaceEvent::from(record);
                    check.check(index + 1, &event)?;
                    events.push(event);
                }
                Err(_) if index + 1 == last && !ends_whole => cut_line = Some(index + 1),
                Err(e) => {
                    let e = one_line(&e.to_string());
                    return Err(format!("line {}: not a trace record: {e}", index + 1));
                }
            }
        }
        Ok(Self {
            header,
            events,
            cut_line,
        })
    }

    /// The speculative lane's steps in the trace.
    pub fn steps(&self) -> usize {
        self.events
            .iter()
            .filter(|e| is_speculative_step(e))
            .count()
    }
}

/// Whether `event` is a step of the speculative lane (a replay's unit of time).
pub fn is_speculative_step(event: &RaceEvent) -> bool {
    matches!(
        event,
        RaceEvent::Decode {
            lane: Lane::Speculative,
            event: DecodeEvent::Step(_),
        }
    )
}

/// The header line, checked to be one and of a version this spex reads.
fn header(line: &str) -> std::result::Result<TraceHeader, String> {
    #[derive(Deserialize)]
    struct Version {
        spex_trace: u32,
    }
    let not_a_trace = "not a spex trace (its first line is not a trace header)";
    let version = serde_json::from_str::<Version>(line).map_err(|_| not_a_trace.to_string())?;
    if version.spex_trace > FORMAT_VERSION {
        return Err(format!(
            "trace format version {} is newer than this spex reads (version {FORMAT_VERSION}): use a newer spex",
            version.spex_trace
        ));
    }
    if version.spex_trace == 0 {
        return Err("line 1: trace format version 0 is not one spex wrote".into());
    }
    let header: TraceHeader = serde_json::from_str(line)
        .map_err(|e| format!("line 1: not a trace header: {}", one_line(&e.to_string())))?;
    header.check_sizes()?;
    Ok(header)
}

impl TraceHeader {
    /// Errors unless every size the header gives is within what a checkpoint may hold
    /// (`config::FIELD_LIMITS`), before a reader sizes anything by it: the passes and layers,
    /// the context and token budget, and each size field its config holds.
    fn check_sizes(&self) -> std::result::Result<(), String> {
        let sizes = [
            ("model.passes", self.model.passes, MOST_PASSES),
            ("model.layers", self.model.layers, MOST_LAYERS),
            ("context", self.context, MOST_POSITIONS),
            ("max_tokens", self.max_tokens, MOST_POSITIONS),
        ];
        for (field, value, most) in sizes {
            if value > most {
                return Err(format!(
                    "line 1: `{field}` of {value} is more than a model holds (at most {most})"
                ));
            }
        }
        if self.model.passes == 0 {
            return Err("line 1: `model.passes` must be positive".into());
        }
        for field in FIELD_LIMITS {
            let (most, field) = (field.most, field.name);
            let Some(value) = self.model.config.get(field) else {
                continue;
            };
            if !value.as_u64().is_some_and(|v| v > 0 && v <= most as u64) {
                return Err(format!(
                    "line 1: `model.config.{field}` of {value} is not a size a model holds (1 to {most})"
                ));
            }
        }
        Ok(())
    }
}

/// What tells one checkpoint from another: the hashes a trace's [`ModelRecord`] keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFingerprint {
    /// SHA-256 of the weights, as hex.
    pub weights_sha256: String,
    /// SHA-256 of the tokenizer, as hex.
    pub tokenizer_sha256: String,
}

impl ModelRecord {
    /// Sets the hashes of the model this record names.
    pub fn set_fingerprint(&mut self, fingerprint: ModelFingerprint) {
        self.weights_sha256 = fingerprint.weights_sha256;
        self.tokenizer_sha256 = fingerprint.tokenizer_sha256;
    }
}

/// SHA-256 of a model's weights (every `.safetensors` file of its directory, in name order,
/// or the embedded bytes) and of its tokenizer, as hex.
pub fn fingerprint(origin: &Origin) -> Result<ModelFingerprint> {
    let hex = |hasher: Sha256| format!("{:x}", hasher.finalize());
    let dir = match origin {
        Origin::Embedded(bytes) => {
            return Ok(ModelFingerprint {
                weights_sha256: hex(Sha256::new_with_prefix(bytes.weights)),
                tokenizer_sha256: hex(Sha256::new_with_prefix(bytes.tokenizer)),
            });
        }
        Origin::Gguf(path) => return gguf_fingerprint(path),
        Origin::Dir(dir) => dir,
    };
    let listing = std::fs::read_dir(dir).map_err(|e| EngineError::file(dir, e))?;
    let mut shards: Vec<PathBuf> = listing
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    let mut weights = Sha256::new();
    for shard in &shards {
        let mut file = File::open(shard).map_err(|e| EngineError::file(shard, e))?;
        std::io::copy(&mut file, &mut weights).map_err(|e| EngineError::file(shard, e))?;
    }
    let tokenizer = dir.join("tokenizer.json");
    let bytes = files::read_capped(&tokenizer, FileKind::Tokenizer)?;
    Ok(ModelFingerprint {
        weights_sha256: hex(weights),
        tokenizer_sha256: hex(Sha256::new_with_prefix(bytes)),
    })
}

/// [`fingerprint`] of a GGUF file: the whole file (its tokenizer metadata included) for the
/// weights, and the `tokenizer.json` beside it where there is one, else the file again.
fn gguf_fingerprint(path: &Path) -> Result<ModelFingerprint> {
    let hex = |hasher: Sha256| format!("{:x}", hasher.finalize());
    let hash_file = |p: &Path| -> Result<Sha256> {
        let mut hasher = Sha256::new();
        let mut file = File::open(p).map_err(|e| EngineError::file(p, e))?;
        std::io::copy(&mut file, &mut hasher).map_err(|e| EngineError::file(p, e))?;
        Ok(hasher)
    };
    let weights = hex(hash_file(path)?);
    let tokenizer = match crate::engine::checkpoint::gguf_tokenizer_file(path) {
        Some(beside) => hex(hash_file(&beside)?),
        None => weights.clone(),
    };
    Ok(ModelFingerprint {
        weights_sha256: weights,
        tokenizer_sha256: tokenizer,
    })
}
