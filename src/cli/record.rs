//! `--record`: the trace header of this session (the model's fingerprint, the machine) and
//! the names of the files a bench or a dashboard session records to.

use std::path::{Path, PathBuf};

use super::Session;
use super::device::cpu_model;
use crate::engine::policy::PolicyKind;
use crate::engine::{DecodeOptions, EngineError};
use crate::harness::trace::{FORMAT_VERSION, ModelRecord, TraceHeader, fingerprint};

/// The header of every trace this session writes, the model's fingerprint included; `prompt`
/// and `policy` are set per trace.
pub fn header(session: &Session, options: DecodeOptions) -> Result<TraceHeader, EngineError> {
    let mut header = template(session, options);
    header
        .model
        .set_fingerprint(fingerprint(&session.loaded.origin)?);
    Ok(header)
}

/// [`header`] without the fingerprint, which reads every weight: the dashboard fills it in
/// when it first records.
pub fn template(session: &Session, options: DecodeOptions) -> TraceHeader {
    let model = session.loaded.model();
    TraceHeader {
        spex_trace: FORMAT_VERSION,
        spex_version: env!("CARGO_PKG_VERSION").into(),
        model: ModelRecord {
            name: session.name.clone(),
            config: model.config.to_json(),
            passes: model.passes(),
            layers: model.config.layers,
            weights_sha256: String::new(),
            tokenizer_sha256: String::new(),
        },
        policy: PolicyKind::Baseline,
        sampling: options.sampling,
        max_tokens: options.max_tokens,
        context: options.context,
        device: session.device.clone(),
        dtype: session.dtype.clone(),
        cpu: cpu_model(),
        prompt: String::new(),
    }
}

/// Errors unless a trace can be written at `path` before the run starts, and `path` is none
/// of the files of the session's checkpoint: a recording never replaces what it records.
pub fn check_target(path: &Path, session: &Session) -> Result<(), EngineError> {
    use crate::engine::checkpoint::Origin;
    use crate::engine::files;
    if let Origin::Gguf(file) = &session.loaded.origin {
        files::refuse_same_file(path, file, "--record")?;
    }
    if let Origin::Dir(dir) = &session.loaded.origin {
        let listing = std::fs::read_dir(dir).map_err(|e| EngineError::file(dir, e))?;
        for entry in listing.flatten() {
            files::refuse_same_file(path, &entry.path(), "--record")?;
        }
    }
    files::check_writable(path, "--record")
}

/// The file of one prompt and policy in a bench's `--record-dir`.
pub fn bench_trace(dir: &Path, prompt_index: usize, policy: PolicyKind) -> PathBuf {
    let name: String = policy
        .to_string()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '=' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("{:02}-{name}.jsonl", prompt_index + 1))
}
