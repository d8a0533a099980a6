//! The engine's error type. Every variant renders as one line that names the file, field or key
//! at fault, so that the CLI and the dashboard can show it as-is.

use std::path::PathBuf;

/// Errors raised by the engine: checkpoint loading, decoding, training.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file that is missing, unreadable or malformed.
    #[error("{path}: {message}")]
    File {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it, one line.
        message: String,
    },
    /// A field of a config file with a missing, mistyped or out-of-bounds value.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The field's name, as the file spells it.
        field: String,
        /// What is wrong with its value.
        message: String,
    },
    /// A tensor of a checkpoint that is missing or has the wrong shape or type.
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        /// The weight file (or the checkpoint directory, when sharded).
        path: PathBuf,
        /// The tensor's name (`?` where candle's message names none).
        name: String,
        /// What is wrong with it.
        message: String,
    },
    /// A prompt that cannot be decoded: empty, or too long for the context.
    #[error("prompt: {0}")]
    Prompt(String),
    /// A write to the KV cache past its last position.
    #[error("kv cache: position {position} is past the capacity of {capacity} (raise --context)")]
    CacheFull {
        /// The position written.
        position: usize,
        /// The positions the cache holds.
        capacity: usize,
    },
    /// The tokenizer library failed: encoding a text, or building and training a tokenizer.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An option or a combination of options the engine cannot run with; the message says
    /// which.
    #[error("{0}")]
    Invalid(String),
    /// An error from candle, the tensor library (device ops, safetensors reads).
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
