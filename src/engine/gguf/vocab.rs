//! The tokenizer in a GGUF file's `tokenizer.ggml.*` keys, as llama.cpp's converter writes a
//! GPT-2-style byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the tokens in id order, their
//! types, the merges, the pre-tokenizer's name and the special ids. [`metadata`] writes them
//! from a `tokenizer.json`; [`tokenizer`] builds a `tokenizers::Tokenizer` from them that
//! tokenizes as that `tokenizer.json` does (a test holds the two to it).

use candle_core::quantized::gguf_file::Value;
use serde_json::{Value as Json, json};

use super::load::GgufFile;
use crate::engine::error::{EngineError, Result};

/// llama.cpp's token types: a normal token, a control (special) token, a user-defined one.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// GPT-2's byte-level pre-tokenizer, by llama.cpp's name (not the model's, `gpt2`).
const GPT2: &str = "gpt-2";

/// The pre-tokenizers spex writes and reads, by llama.cpp's names (`tokenizer.ggml.pre`, as
/// its `llama-vocab.cpp` knows them): GPT-2's byte-level split (spex's own tokenizers), and
/// SmolLM's digits-then-byte-level split (Ouro's).
fn pre_tokenizer(name: &str) -> Option<Json> {
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    match name {
        // `gpt2`: the name spex wrote before it took llama.cpp's.
        GPT2 | "gpt2" => Some(byte_level),
        "smollm" => Some(json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level]})),
        _ => None,
    }
}

/// The `tokenizer.ggml.*` keys of the tokenizer in `tokenizer.json` (parsed: `tokenizer`,
/// from `path`), with `bos` and `eos` as its special ids, its tokens padded to `rows` (the
/// embedding's rows: llama.cpp takes the token list's length for them) with `[PADn]` tokens of
/// type unused, as llama.cpp's converter pads them.
pub fn metadata(
    tokenizer: &Json,
    path: &std::path::Path,
    bos: Option<u32>,
    eos: Option<u32>,
    rows: usize,
) -> Result<Vec<(String, Value)>> {
    let err = |m: &str| EngineError::file(path, m);
    let model = &tokenizer["model"];
    if model["type"] != "BPE" {
        return Err(err("only a BPE tokenizer can be written to GGUF"));
    }
    let pre = ([GPT2, "smollm"].into_iter())
        .find(|name| pre_tokenizer(name).as_ref() == Some(&tokenizer["pre_tokenizer"]))
        .ok_or_else(|| err("its pre_tokenizer is neither GPT-2's byte level nor SmolLM's"))?;
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| err("model.vocab is not an object"))?;
    let added = tokenizer["added_tokens"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut entries: Vec<(usize, String, i32)> = Vec::new();
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| err("model.vocab holds a non-integer id"))?;
        entries.push((id as usize, token.clone(), NORMAL));
    }
    for a in &added {
        let (Some(id), Some(content)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(err("added_tokens holds an entry without id or content"));
        };
        let kind = if a["special"] == true {
            CONTROL
        } else {
            USER_DEFINED
        };
        entries.retain(|e| e.0 != id as usize);
        entries.push((id as usize, content.to_string(), kind));
    }
    let size = entries.iter().map(|e| e.0 + 1).max().unwrap_or(0).max(rows);
    let mut tokens: Vec<(String, i32)> = (0..size).map(|i| (format!("[PAD{i}]"), UNUSED)).collect();
    for (id, token, kind) in entries {
        tokens[id] = (token, kind);
    }
    let merges = (model["merges"].as_array().into_iter().flatten())
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(pair) => match (
                pair.first().and_then(Json::as_str),
                pair.get(1).and_then(Json::as_str),
            ) {
                (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                _ => Err(err("model.merges holds a pair that is not two strings")),
            },
            _ => Err(err(
                "model.merges holds an entry that is neither a string nor a pair",
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let mut keys = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            strings(tokens.iter().map(|t| t.0.clone()).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(tokens.iter().map(|t| Value::I32(t.1)).collect()),
        ),
        ("tokenizer.ggml.merges".into(), strings(merges)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    if let Some(bos) = bos {
        keys.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)));
    }
    if let Some(eos) = eos {
        keys.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
    }
    Ok(keys)
}

/// The tokenizer in `file`'s `tokenizer.ggml.*` keys; an error names the key that is missing
/// or that spex cannot build a tokenizer from.
pub fn tokenizer(file: &GgufFile) -> Result<tokenizers::Tokenizer> {
    let strings = |key: &str| -> Result<Vec<String>> {
        match file.metadata().get(key) {
            Some(Value::Array(items)) => (items.iter())
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(file.key_error(key, "must be an array of strings")),
                })
                .collect(),
            Some(_) => Err(file.key_error(key, "must be an array of strings")),
            None => Err(file.key_error(
                key,
                "missing, and there is no tokenizer.json beside the file",
            )),
        }
    };
    if !file.metadata().contains_key("tokenizer.ggml.model") {
        return Err(file.key_error(
            "tokenizer.ggml.model",
            "missing, and there is no tokenizer.json beside the file",
        ));
    }
    let model = file.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(file.key_error(
            "tokenizer.ggml.model",
            &format!("\"{model}\": spex builds GPT-2-style BPE tokenizers (\"gpt2\")"),
        ));
    }
    let pre = file
        .string("tokenizer.ggml.pre")
        .unwrap_or_else(|_| GPT2.into());
    let pre_tokenizer = pre_tokenizer(&pre).ok_or_else(|| {
        file.key_error(
            "tokenizer.ggml.pre",
            &format!("\"{pre}\" is not a pre-tokenizer spex builds ({GPT2}, smollm)"),
        )
    })?;
    let tokens = strings("tokenizer.ggml.tokens")?;
    let types: Vec<i32> = match file.metadata().get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| if let Value::I32(t) = v { *t } else { NORMAL })
            .collect(),
        _ => vec![NORMAL; tokens.len()],
    };
    let merges: Vec<Json> = (strings("tokenizer.ggml.merges")?.iter())
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| {
                    file.key_error(
                        "tokenizer.ggml.merges",
                        &format!("\"{m}\" is not two tokens"),
                    )
                })
        })
        .collect::<Result<_>>()?;
    let vocab: serde_json::Map<String, Json> = (tokens.iter().enumerate())
        .map(|(i, t)| (t.clone(), i.into()))
        .collect();
    let added: Vec<Json> = (tokens.iter().zip(&types).enumerate())
        .filter(|(_, (_, t))| **t == CONTROL || **t == USER_DEFINED)
        .map(|(id, (content, t))| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": *t == CONTROL})
        })
        .collect();
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    spec.to_string()
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| {
            file.key_error(
                "tokenizer.ggml.tokens",
                &format!("no tokenizer can be built: {e}"),
            )
        })
}
