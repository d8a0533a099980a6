//! [`HubSettings`]: the environment a hub client honours, read once into a value. The
//! variables and their defaults are those of the hub's own command-line client, so that a
//! mirror, a cache directory or a token set up for it works for spex unchanged.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::HubError;

/// The hub's address when `HF_ENDPOINT` is unset.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The hub client's default for both timeouts.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Retries of a request that made no progress, before a pull gives up.
const DEFAULT_RETRIES: u32 = 5;

/// Where the hub is, where its cache is, and how to talk to it.
#[derive(Debug, Clone, PartialEq)]
pub struct HubSettings {
    /// The hub's base URL, without a trailing slash (`HF_ENDPOINT`).
    pub endpoint: String,
    /// The cache's root: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub cache_root: PathBuf,
    /// The access token: `HF_TOKEN`, else the file at `HF_TOKEN_PATH`, else `HF_HOME/token`.
    pub token: Option<String>,
    /// Where a token file is looked for (named by the error a gated repo gives).
    pub token_file: PathBuf,
    /// Use the local cache only (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// How long to wait for a connection or for a response's headers (`HF_HUB_ETAG_TIMEOUT`).
    pub metadata_timeout: Duration,
    /// How long a download may wait for its next bytes (`HF_HUB_DOWNLOAD_TIMEOUT`).
    pub download_timeout: Duration,
    /// Retries of a request that made no progress (a request that brought bytes is resumed
    /// and not counted).
    pub max_retries: u32,
}

impl HubSettings {
    /// The settings this process's environment gives.
    pub fn from_env() -> Result<Self, HubError> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// The settings the variables `var` returns give (`None`: unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, HubError> {
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let home = var("HOME").unwrap_or_else(|| ".".into());
            Path::new(&home).join(".cache/huggingface")
        });
        let cache_root = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token_file = var("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("token"));
        let token = var("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(&token_file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
            .trim_end_matches('/')
            .to_string();
        Ok(Self {
            endpoint,
            cache_root,
            token,
            token_file,
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| is_true(&v)),
            metadata_timeout: seconds(&var, "HF_HUB_ETAG_TIMEOUT")?,
            download_timeout: seconds(&var, "HF_HUB_DOWNLOAD_TIMEOUT")?,
            max_retries: DEFAULT_RETRIES,
        })
    }
}

/// How the hub client reads a boolean variable.
fn is_true(value: &str) -> bool {
    matches!(
        value.to_ascii_lowercase().as_str(),
        "1" | "on" | "yes" | "true"
    )
}

/// A timeout variable in seconds (fractions allowed), or the default when unset.
fn seconds(
    var: &impl Fn(&str) -> Option<String>,
    name: &'static str,
) -> Result<Duration, HubError> {
    let Some(value) = var(name) else {
        return Ok(DEFAULT_TIMEOUT);
    };
    value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or(HubError::Setting {
            variable: name,
            value,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<HubSettings, HubError> {
        HubSettings::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn defaults_are_the_hub_clients() {
        let s = settings(&[("HOME", "/home/u")]).unwrap();
        assert_eq!(s.endpoint, DEFAULT_ENDPOINT);
        assert_eq!(s.cache_root, Path::new("/home/u/.cache/huggingface/hub"));
        assert_eq!(s.token_file, Path::new("/home/u/.cache/huggingface/token"));
        assert_eq!((s.token, s.offline), (None, false));
        assert_eq!(s.download_timeout, Duration::from_secs(10));
    }

    #[test]
    fn variables_override_in_the_hub_clients_order() {
        let s = settings(&[
            ("HF_HOME", "/h"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_TOKEN", "hf_x"),
            ("HF_HUB_OFFLINE", "True"),
            ("HF_HUB_DOWNLOAD_TIMEOUT", "0.5"),
        ])
        .unwrap();
        assert_eq!(s.endpoint, "http://127.0.0.1:9");
        assert_eq!(s.cache_root, Path::new("/h/hub"));
        assert_eq!(s.token.as_deref(), Some("hf_x"));
        assert!(s.offline);
        assert_eq!(s.download_timeout, Duration::from_millis(500));
        let s = settings(&[("HF_HOME", "/h"), ("HF_HUB_CACHE", "/c")]).unwrap();
        assert_eq!(s.cache_root, Path::new("/c"));
        assert_eq!(s.token_file, Path::new("/h/token"));
    }

    #[test]
    fn a_bad_timeout_names_the_variable() {
        let e = settings(&[("HF_HUB_ETAG_TIMEOUT", "soon")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "HF_HUB_ETAG_TIMEOUT: `soon` is not a number of seconds"
        );
    }
}
