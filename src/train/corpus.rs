//! The training corpus: text files read, tokenized into a training and a held-out stream
//! (whole plays held out), the tokenizer trained on the training plays only, and the windows a
//! batch is cut from.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::config::TrainConfig;
use crate::engine::error::{EngineError, Result};
use crate::engine::tokenizer::{TextTokenizer, train_bpe};

/// Token streams of the corpus: training files and held-out files.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub train: Vec<u32>,
    pub validation: Vec<u32>,
}

/// Reads the corpus files; errors name a missing or empty file.
pub fn read_corpus(files: &[PathBuf]) -> Result<Vec<(PathBuf, String)>> {
    if files.is_empty() {
        return Err(EngineError::Invalid("corpus: no files given".into()));
    }
    let texts = files
        .iter()
        .map(|f| {
            let text = crate::engine::files::read_text(f, crate::engine::files::FileKind::Corpus)?;
            if text.trim().is_empty() {
                return Err(EngineError::file(f, "empty corpus file"));
            }
            Ok((f.clone(), text))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(texts)
}

/// Trains a byte-level BPE on the training plays (not the held-out ones) into `out`.
pub(super) fn fresh_tokenizer(
    config: &TrainConfig,
    texts: &[(PathBuf, String)],
    out: &Path,
) -> Result<PathBuf> {
    std::fs::create_dir_all(out).map_err(|e| EngineError::file(out, e))?;
    let path = out.join("tokenizer.json");
    let train_texts = texts
        .iter()
        .filter(|(p, _)| !is_validation(config, p))
        .map(|(_, t)| t.as_str());
    train_bpe(
        train_texts.flat_map(|t| t.lines()),
        config.model.vocab,
        &path,
    )?;
    Ok(path)
}

pub(super) fn is_validation(config: &TrainConfig, path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| config.train.validation_files.iter().any(|v| v == n))
}

/// Tokenizes every file (documents separated by `<|endoftext|>`), split into training and
/// held-out streams; without named held-out files the last tenth is held out.
pub(super) fn tokenize_corpus(
    config: &TrainConfig,
    tokenizer: &TextTokenizer,
    texts: &[(PathBuf, String)],
) -> Result<Corpus> {
    let (mut train, mut validation) = (Vec::new(), Vec::new());
    for (path, text) in texts {
        let ids = tokenizer.encode(text)?;
        let into = if is_validation(config, path) {
            &mut validation
        } else {
            &mut train
        };
        into.extend(ids);
        into.push(0);
    }
    if validation.is_empty() {
        let cut = train.len() - train.len() / 10;
        validation = train.split_off(cut);
    }
    let need = config.train.seq_len + 2;
    if train.len() < need || validation.len() < need {
        return Err(EngineError::Invalid(format!(
            "corpus: {} training and {} held-out tokens; each needs at least seq_len + 2 = {need}",
            train.len(),
            validation.len()
        )));
    }
    Ok(Corpus { train, validation })
}

/// Inputs `[batch, seq]` and next-token targets from windows at `starts`.
pub(super) fn windows(tokens: &[u32], starts: &[usize], seq: usize) -> Result<(Tensor, Tensor)> {
    let mut inputs = Vec::with_capacity(starts.len() * seq);
    let mut targets = Vec::with_capacity(starts.len() * seq);
    for &s in starts {
        inputs.extend_from_slice(&tokens[s..s + seq]);
        targets.extend_from_slice(&tokens[s + 1..s + seq + 1]);
    }
    Ok((
        Tensor::from_vec(inputs, (starts.len(), seq), &Device::Cpu)?,
        Tensor::from_vec(targets, (starts.len(), seq), &Device::Cpu)?,
    ))
}
