//! The engine's error type. Every variant renders as one line that names the file, field or key
//! at fault, so that the CLI and the dashboard can show it as-is.

use std::path::PathBuf;

/// Errors raised by the engine: checkpoint loading, decoding, training.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        path: PathBuf,
        name: String,
        message: String,
    },
    #[error("prompt: {0}")]
    Prompt(String),
    #[error("kv cache: position {position} is past the capacity of {capacity} (raise --context)")]
    CacheFull { position: usize, capacity: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Invalid(String),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl EngineError {
    /// An error about one file, with a message that says what is wrong with it.
    pub fn file(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        Self::File {
            path: path.into(),
            message: one_line(&message.to_string()),
        }
    }
}

/// `message` with its control characters escaped, so that it stays one line: serde quotes a
/// bad string from a file decoded, and an escaped newline in it (`"basel\ne"`) would split
/// the error.
pub fn one_line(message: &str) -> String {
    message
        .chars()
        .flat_map(|c| match c.is_control() {
            true => c.escape_default().collect::<Vec<_>>(),
            false => vec![c],
        })
        .collect()
}

/// A TOML parse error as one line: `FILE:LINE: message`.
pub fn toml_error(path: &std::path::Path, text: &str, e: &toml::de::Error) -> EngineError {
    let line = e
        .span()
        .map_or(0, |s| text[..s.start].matches('\n').count() + 1);
    // toml's messages can run over lines; one line keeps them readable, not `\n`-escaped.
    let message = (e.message().lines())
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    EngineError::file(format!("{}:{line}", path.display()), message)
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_errors_stay_one_line_whatever_the_message_holds() {
        let e = EngineError::file("model.safetensors", "unknown variant `F\n32`\r\tx");
        assert_eq!(e.to_string().lines().count(), 1, "{e}");
        assert_eq!(
            e.to_string(),
            "model.safetensors: unknown variant `F\\n32`\\r\\tx"
        );
    }
}
