//! `models.toml`: named model entries (a local `path`, or an hf-hub `repo` at a pinned
//! `revision`) with their dtype, device, chat flag and policy, and the default entry. Resolves
//! `--model` (an entry name, a directory or an ORG/NAME repo id) to a checkpoint directory.
//! Read by every command that loads a model, and by `spex models` / `spex pull`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::device::{DTypeSpec, DeviceSpec};
use crate::engine::checkpoint::Origin;
use crate::engine::error::toml_error;
use crate::engine::policy::PolicyKind;
use crate::engine::{CheckpointBytes, EngineError};
use crate::hub::{self, HubSettings, PullFiles, PullProgress};

/// The parsed `models.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsFile {
    /// The entry used when no `--model` is given.
    pub default: String,
    #[serde(default)]
    pub models: BTreeMap<String, ModelEntry>,
}

/// One named model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// A checkpoint directory, relative to models.toml.
    pub path: Option<PathBuf>,
    /// An hf-hub repository id (ORG/NAME).
    pub repo: Option<String>,
    /// The pinned revision (commit hash or branch) of `repo`.
    pub revision: Option<String>,
    /// The one `.gguf` file of `repo` (or of the `path` directory) to load, where it holds
    /// one per quantization.
    pub file: Option<String>,
    pub dtype: Option<DTypeSpec>,
    pub device: Option<DeviceSpec>,
    /// Wrap prompts in the chat template and stop at the end-of-turn token.
    #[serde(default)]
    pub chat: bool,
    /// The policy `spex generate` uses by default.
    pub policy: Option<PolicyKind>,
    /// The draft model (an entry or a checkpoint directory) of the `draft` policy.
    pub draft: Option<String>,
    /// Sampling defaults (`--temperature`, `--top-k`, `--top-p`, `--seed` override them).
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    /// The sample prompt the dashboard opens with.
    pub prompt: Option<String>,
    pub description: Option<String>,
}

impl ModelEntry {
    /// The hub revision (`main` when unset).
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// Which of its repo's files a pull fetches.
    pub fn pull_files(&self) -> PullFiles<'_> {
        self.file
            .as_deref()
            .map_or(PullFiles::Checkpoint, PullFiles::File)
    }

    /// Where the entry's files are on this machine: under its `path` (relative to
    /// `models_file`), or in its snapshot in the local hub cache under `cache_root` (an error
    /// naming `spex pull NAME` when absent). A `file`, or a `path` that names a `.gguf`, is a
    /// GGUF checkpoint.
    pub fn local_origin(
        &self,
        models_file: &Path,
        name: &str,
        cache_root: &Path,
    ) -> Result<Origin, EngineError> {
        let dir = match (&self.path, &self.repo) {
            (Some(path), _) => models_file.parent().unwrap_or(Path::new(".")).join(path),
            (None, Some(repo)) => {
                let marker = self.pull_files();
                hub::snapshot_dir(cache_root, repo, self.revision(), marker.marker(), name)?
            }
            (None, None) => {
                return Err(EngineError::file(
                    models_file,
                    format!("entry `{name}` needs exactly one of `path` or `repo`"),
                ));
            }
        };
        Ok(self.origin_in(dir))
    }

    /// The checkpoint the entry names in `dir`, its directory or snapshot.
    fn origin_in(&self, dir: PathBuf) -> Origin {
        match &self.file {
            Some(file) => Origin::Gguf(dir.join(file)),
            None if is_gguf(&dir) => Origin::Gguf(dir),
            None => Origin::Dir(dir),
        }
    }

    /// The entry's source as `spex models` shows it.
    pub fn source(&self) -> String {
        let place = match (&self.path, &self.repo) {
            (Some(path), _) => path.display().to_string(),
            (None, Some(repo)) => format!("{repo}@{}", self.revision()),
            (None, None) => String::new(),
        };
        match &self.file {
            Some(file) => format!("{place} {file}"),
            None => place,
        }
    }
}

/// Whether `path` names a GGUF file (by its extension).
fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|x| x == "gguf")
}

/// Where models.toml is: `$SPEX_MODELS`, else `./models.toml`, else the one in the source tree.
pub fn models_file_path() -> PathBuf {
    if let Ok(p) = std::env::var("SPEX_MODELS") {
        return PathBuf::from(p);
    }
    let local = PathBuf::from("models.toml");
    if local.is_file() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models.toml")
}

impl ModelsFile {
    /// Parses models.toml; errors carry the file and the line.
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        let text = crate::engine::files::read_text(path, crate::engine::files::FileKind::Settings)?;
        let parsed: Self = toml::from_str(&text).map_err(|e| toml_error(path, &text, &e))?;
        for (name, entry) in &parsed.models {
            let fault = match (&entry.path, &entry.repo, &entry.file) {
                (Some(_), Some(_), _) | (None, None, _) => "needs exactly one of `path` or `repo`",
                (_, _, Some(file)) if !is_gguf(Path::new(file)) => {
                    "`file` names a weights file of the repo: a `.gguf`"
                }
                _ => continue,
            };
            let line = text
                .lines()
                .position(|l| {
                    l.contains(&format!("[models.{name}]"))
                        || l.contains(&format!("[models.\"{name}\"]"))
                })
                .map_or(0, |i| i + 1);
            return Err(EngineError::file(
                format!("{}:{line}", path.display()),
                format!("entry `{name}` {fault}"),
            ));
        }
        Ok(parsed)
    }
}

/// spex's own model, built into the binary so that `spex` runs anywhere, offline, even
/// without the source tree's `assets/` and `models.toml`.
pub const EMBEDDED: CheckpointBytes = CheckpointBytes {
    config: include_bytes!("../../assets/models/shakespeare-r4k6-sync/config.json"),
    weights: include_bytes!("../../assets/models/shakespeare-r4k6-sync/model.safetensors"),
    tokenizer: include_bytes!("../../assets/models/shakespeare-r4k6-sync/tokenizer.json"),
};

/// The dashboard's sample prompt for a model whose entry names none (the shipped models were
/// trained on Shakespeare).
pub const DEFAULT_SAMPLE_PROMPT: &str = "To be, or not to be, that is the question:";

/// The entry name of the embedded model.
pub const EMBEDDED_NAME: &str = "shakespeare-r4k6-sync";

/// A model ready to load: where it is and the settings its entry asks for.
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    pub name: String,
    pub source: Origin,
    pub entry: Option<ModelEntry>,
}

/// Resolves `--model`: a directory, an entry of models.toml (the default when `None`), or an
/// ORG/NAME hub repo at `main`. Hub checkpoints come from the local cache; when missing they
/// are downloaded (telling `progress`) unless `hub` is offline, in which case the error names
/// the `spex pull` to run.
pub fn resolve(
    model: Option<&str>,
    hub: &HubSettings,
    progress: &mut dyn FnMut(PullProgress),
) -> Result<ResolvedModel, EngineError> {
    if let Some(m) = model {
        let p = PathBuf::from(m);
        if p.is_file() && is_gguf(&p) {
            let name = p
                .file_stem()
                .map_or(m.to_string(), |n| n.to_string_lossy().into_owned());
            return Ok(ResolvedModel {
                name,
                source: Origin::Gguf(p),
                entry: None,
            });
        }
        if p.is_dir() {
            let name = p
                .file_name()
                .map_or(m.to_string(), |n| n.to_string_lossy().into_owned());
            return Ok(ResolvedModel {
                name,
                source: Origin::Dir(p),
                entry: None,
            });
        }
        if m.starts_with(['/', '.', '~']) || m.ends_with('/') || m.matches('/').count() > 1 {
            return Err(EngineError::file(p, "no such checkpoint directory"));
        }
    }
    let file = models_file_path();
    let wants_embedded = model.is_none_or(|m| m == EMBEDDED_NAME);
    if wants_embedded && !file.exists() {
        // A models.toml the user named and spex cannot find is worth a word: the embedded
        // model may not be the one they meant.
        if let Ok(named) = std::env::var("SPEX_MODELS") {
            eprintln!("spex: SPEX_MODELS: {named} does not exist; using the embedded model");
        }
        return Ok(embedded(None));
    }
    let models = ModelsFile::load(&file)?;
    let name = model.unwrap_or(&models.default).to_string();
    let Some(entry) = models.models.get(&name).cloned() else {
        if hub::is_repo_id(&name) {
            let dir = hub_dir(&name, "main", PullFiles::Checkpoint, &name, hub, progress)?;
            return Ok(ResolvedModel {
                name,
                source: Origin::Dir(dir),
                entry: None,
            });
        }
        let known = models.models.keys().cloned().collect::<Vec<_>>().join(", ");
        return Err(EngineError::file(
            &file,
            format!("no model entry `{name}` and no such directory (entries: {known})"),
        ));
    };
    let source = match &entry.repo {
        Some(repo) => {
            let files = entry.pull_files();
            entry.origin_in(hub_dir(
                repo,
                entry.revision(),
                files,
                &name,
                hub,
                progress,
            )?)
        }
        None => entry.local_origin(&file, &name, &hub.cache_root)?,
    };
    if name == EMBEDDED_NAME && !source.is_present() {
        return Ok(embedded(Some(entry)));
    }
    Ok(ResolvedModel {
        name,
        source,
        entry: Some(entry),
    })
}

fn embedded(entry: Option<ModelEntry>) -> ResolvedModel {
    ResolvedModel {
        name: EMBEDDED_NAME.into(),
        source: Origin::Embedded(EMBEDDED),
        entry,
    }
}

/// The snapshot of `files` of `repo` at `revision` in the local cache, pulled first when it
/// is not there and `hub` is not offline.
fn hub_dir(
    repo: &str,
    revision: &str,
    files: PullFiles,
    pull_hint: &str,
    hub: &HubSettings,
    progress: &mut dyn FnMut(PullProgress),
) -> Result<PathBuf, EngineError> {
    match hub::snapshot_dir(&hub.cache_root, repo, revision, files.marker(), pull_hint) {
        Ok(dir) => Ok(dir),
        Err(_) if !hub.offline => Ok(hub::pull(hub, repo, revision, files, progress)?.snapshot),
        Err(e) => Err(e),
    }
}

/// `spex models`: every entry of `models.toml`, whether it is here, its weight type and size.
pub(super) fn list() -> anyhow::Result<()> {
    let file = models_file_path();
    let models = ModelsFile::load(&file)?;
    let cache_root = crate::hub::HubSettings::from_env()?.cache_root;
    println!(
        "{:<24} {:<8} {:<8} {:>10}  source",
        "name", "local", "weights", "size"
    );
    for (name, entry) in &models.models {
        let origin = entry.local_origin(&file, name, &cache_root);
        let (local, weights, size) = match &origin {
            Ok(o) if o.is_present() => (
                "yes",
                o.weight_type().unwrap_or_else(|| "?".into()),
                format!("{:.1} MB", stored_bytes(o) as f64 / 1e6),
            ),
            _ => ("no", "-".into(), "-".into()),
        };
        let source = entry.source();
        let default = if *name == models.default {
            " (default)"
        } else {
            ""
        };
        println!("{name:<24} {local:<8} {weights:<8} {size:>10}  {source}{default}");
    }
    Ok(())
}

/// Bytes on disk of a checkpoint's files: a directory's, or the one GGUF file.
fn stored_bytes(origin: &Origin) -> u64 {
    match origin {
        Origin::Dir(dir) => crate::hub::snapshot_size(dir),
        Origin::Gguf(path) => std::fs::metadata(path).map_or(0, |m| m.len()),
        Origin::Embedded(bytes) => bytes.weights.len() as u64,
    }
}
