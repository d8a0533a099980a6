//! `models.toml`: named model entries and the default. Resolves `--model` (an entry name or a
//! checkpoint directory) to a directory. Read by every command that loads a model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::engine::EngineError;

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
    pub revision: Option<String>,
    pub dtype: Option<String>,
    pub device: Option<String>,
    #[serde(default)]
    pub chat: bool,
    pub description: Option<String>,
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
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::file(path, e))?;
        toml::from_str(&text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start].lines().count().max(1))
                .unwrap_or(0);
            EngineError::file(
                format!("{}:{line}", path.display()),
                e.message().to_string(),
            )
        })
    }
}

/// Resolves `--model`: an existing directory, or an entry of models.toml (the default entry
/// when `None`).
pub fn resolve(model: Option<&str>) -> Result<PathBuf, EngineError> {
    if let Some(m) = model {
        let p = PathBuf::from(m);
        if p.is_dir() {
            return Ok(p);
        }
        if m.starts_with(['/', '.', '~']) || m.ends_with('/') || m.matches('/').count() > 1 {
            return Err(EngineError::file(p, "no such checkpoint directory"));
        }
    }
    let file = models_file_path();
    let models = ModelsFile::load(&file)?;
    let name = model.unwrap_or(&models.default);
    let entry = models.models.get(name).ok_or_else(|| {
        EngineError::file(
            &file,
            format!(
                "no model entry `{name}` and no such directory (entries: {})",
                models.models.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        )
    })?;
    match (&entry.path, &entry.repo) {
        (Some(path), _) => {
            let base = file.parent().unwrap_or(Path::new("."));
            Ok(base.join(path))
        }
        (None, Some(repo)) => Err(EngineError::file(
            &file,
            format!("entry `{name}` is the hub repo {repo}: hub downloads are not built yet"),
        )),
        (None, None) => Err(EngineError::Config {
            path: file.clone(),
            field: format!("models.{name}"),
            message: "needs `path` or `repo`".into(),
        }),
    }
}
