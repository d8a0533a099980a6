//! `--record`: the trace header of this session (the model's fingerprint, the machine) and
//! the names of the files a bench or a dashboard session records to.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::Session;
use super::bench::cpu_model;
use super::models::EMBEDDED;
use crate::engine::policy::PolicyKind;
use crate::engine::trace::{FORMAT_VERSION, ModelRecord, TraceHeader};
use crate::engine::{DecodeOptions, EngineError};

/// The header of every trace this session writes; `prompt` and `policy` are set per trace.
pub fn header(session: &Session, options: DecodeOptions) -> Result<TraceHeader, EngineError> {
    let model = session.loaded.model();
    let (weights_sha256, tokenizer_sha256) = fingerprint(&session.loaded.source)?;
    Ok(TraceHeader {
        spex_trace: FORMAT_VERSION,
        spex_version: env!("CARGO_PKG_VERSION").into(),
        model: ModelRecord {
            name: session.name.clone(),
            config: model.config.to_json(),
            passes: model.passes(),
            layers: model.config.num_hidden_layers,
            weights_sha256,
            tokenizer_sha256,
        },
        policy: PolicyKind::Baseline,
        sampling: options.sampling,
        max_tokens: options.max_tokens,
        context: options.context,
        device: session.device.clone(),
        dtype: session.dtype.clone(),
        cpu: cpu_model(),
        prompt: String::new(),
    })
}

/// SHA-256 of the weights (every `.safetensors` file of the checkpoint, in name order) and
/// of the tokenizer; `source` is the checkpoint's directory, or "embedded".
fn fingerprint(source: &str) -> Result<(String, String), EngineError> {
    let hex = |hasher: Sha256| format!("{:x}", hasher.finalize());
    if source == "embedded" {
        let weights = Sha256::new_with_prefix(EMBEDDED.weights);
        return Ok((
            hex(weights),
            hex(Sha256::new_with_prefix(EMBEDDED.tokenizer)),
        ));
    }
    let dir = Path::new(source);
    let listing = std::fs::read_dir(dir).map_err(|e| EngineError::file(dir, e))?;
    let mut shards: Vec<PathBuf> = listing
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    let mut weights = Sha256::new();
    for shard in &shards {
        let mut file = std::fs::File::open(shard).map_err(|e| EngineError::file(shard, e))?;
        std::io::copy(&mut file, &mut weights).map_err(|e| EngineError::file(shard, e))?;
    }
    let tokenizer = dir.join("tokenizer.json");
    let bytes = std::fs::read(&tokenizer).map_err(|e| EngineError::file(&tokenizer, e))?;
    Ok((hex(weights), hex(Sha256::new_with_prefix(bytes))))
}

/// The file of one prompt and policy in a bench's `--record` directory.
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
