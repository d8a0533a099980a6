//! GGUF checkpoints in llama.cpp's Ouro layout: the second file format of the same model
//! (`engine::format` is the first), read by `load` and written by `write` (`spex quantize`).
//!
//! # The layout
//!
//! One `.gguf` file (GGUF v3, 32-byte alignment) with `general.architecture = "ouro"`. The
//! shape is in `ouro.*` keys ([`CONFIG_KEYS`]; R, the passes, is `ouro.num_loops`), the
//! tokenizer in `tokenizer.ggml.*` keys (`vocab`). Tensors are named `token_embd`,
//! `output_norm`, `output` (absent when tied) and `blk.{i}.{name}.weight` ([`layer_name`]); the
//! exit gate is not stored. Two differences from spex's own format matter:
//! - llama.cpp rotates interleaved pairs (its "norm" rope) where Ouro rotates halves, so the
//!   converter permutes each head's rows of `attn_q` and `attn_k` ([`gguf_row`]); a reader that
//!   rotates halves, as spex does, undoes it. Whole rows move, so quantized rows move as
//!   stored.
//! - Matrices may be quantized: spex's host kernels read Q8_0, Q4_K and Q6_K as stored
//!   (`kernels::Weight`); F32, F16 and BF16 are read as dense weights.
//!
//! A host model keeps each quantized matrix as a `U8` tensor of shape `[rows, blocks, block
//! bytes]` in the kernels' layout (`kernels::repack`), in the weight arena
//! (`model::block_kind_of` tells its kind from the block bytes, which differ for every GGUF
//! block type); a GPU model gets the matrices dequantized.

pub mod load;
pub mod vocab;
pub mod write;

use candle_core::quantized::GgmlDType;

use super::format::{self, LayerTensor};
use super::kernels::QuantKind;

/// The architecture this reader and writer handle.
pub const ARCHITECTURE: &str = "ouro";

/// The tensor of `LayerTensor` `t` in layer `layer`, as llama.cpp's Ouro converter names it.
pub fn layer_name(t: LayerTensor, layer: usize) -> String {
    let name = match t {
        LayerTensor::QProj => "attn_q",
        LayerTensor::KProj => "attn_k",
        LayerTensor::VProj => "attn_v",
        LayerTensor::OProj => "attn_output",
        LayerTensor::GateProj => "ffn_gate",
        LayerTensor::UpProj => "ffn_up",
        LayerTensor::DownProj => "ffn_down",
        LayerTensor::InputNorm => "attn_norm",
        LayerTensor::InputNorm2 => "post_attention_norm",
        LayerTensor::PostAttentionNorm => "ffn_norm",
        LayerTensor::PostAttentionNorm2 => "post_ffw_norm",
    };
    format!("blk.{layer}.{name}.weight")
}

/// The GGUF name of spex's tensor `name` (`engine::format`), if the GGUF layout stores it.
pub fn gguf_name(name: &str) -> Option<String> {
    match name {
        format::EMBED_TOKENS => Some("token_embd.weight".into()),
        format::FINAL_NORM => Some("output_norm.weight".into()),
        format::LM_HEAD => Some("output.weight".into()),
        _ => {
            let layer = format::layer_of(name)?;
            format::layer_tensor_of(name).map(|t| layer_name(t, layer))
        }
    }
}

/// The config fields spex reads and the GGUF keys (after `ouro.`) that hold them, with whether
/// a file may leave the key out (the field then takes its default, or the value `load` derives).
pub const CONFIG_KEYS: [(&str, &str, bool); 11] = [
    ("hidden_size", "embedding_length", false),
    ("num_hidden_layers", "block_count", false),
    ("total_ut_steps", "num_loops", false),
    ("num_attention_heads", "attention.head_count", false),
    ("num_key_value_heads", "attention.head_count_kv", true),
    ("head_dim", "attention.key_length", true),
    ("intermediate_size", "feed_forward_length", false),
    ("vocab_size", "vocab_size", true),
    ("max_position_embeddings", "context_length", false),
    ("rope_theta", "rope.freq_base", true),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon", false),
];

/// The full key of config key `suffix`.
pub fn config_key(suffix: &str) -> String {
    format!("{ARCHITECTURE}.{suffix}")
}

/// Which row of a head's `head_dim` rows of `attn_q`/`attn_k` in the GGUF holds row `row` of
/// spex's (rotate-half) order: llama.cpp's converter moves row `s · head_dim/2 + i` (half `s`,
/// pair `i`) to `2i + s`, so that its interleaved-pair rope rotates the same pairs.
pub fn gguf_row(row: usize, head_dim: usize) -> usize {
    let (head, within) = (row / head_dim, row % head_dim);
    let half = head_dim / 2;
    head * head_dim + 2 * (within % half) + within / half
}

/// Whether tensor `t`'s rows are permuted in the GGUF ([`gguf_row`]).
pub fn is_permuted(t: LayerTensor) -> bool {
    matches!(t, LayerTensor::QProj | LayerTensor::KProj)
}

/// The GGML type of block kind `kind`.
pub fn ggml_type(kind: QuantKind) -> GgmlDType {
    match kind {
        QuantKind::Q8_0 => GgmlDType::Q8_0,
        QuantKind::Q4_0 => GgmlDType::Q4_0,
        QuantKind::Q4K => GgmlDType::Q4K,
        QuantKind::Q5K => GgmlDType::Q5K,
        QuantKind::Q6K => GgmlDType::Q6K,
    }
}

/// The block kind of GGML type `t`, if the host kernels read it as stored.
pub fn quant_kind(t: GgmlDType) -> Option<QuantKind> {
    QuantKind::ALL.into_iter().find(|&k| ggml_type(k) == t)
}

/// llama.cpp's `general.file_type` codes (`LLAMA_FTYPE_MOSTLY_*`) with the names its
/// quantizer and the hub's file names give them.
pub const FILE_TYPES: [(u32, &str); 17] = [
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (7, "Q8_0"),
    (8, "Q5_0"),
    (9, "Q5_1"),
    (10, "Q2_K"),
    (11, "Q3_K_S"),
    (12, "Q3_K_M"),
    (13, "Q3_K_L"),
    (14, "Q4_K_S"),
    (15, "Q4_K_M"),
    (16, "Q5_K_S"),
    (17, "Q5_K_M"),
    (18, "Q6_K"),
    (32, "BF16"),
];

/// The name of `general.file_type` code `code`, if llama.cpp defines it ([`FILE_TYPES`]).
pub fn file_type_name(code: u32) -> Option<&'static str> {
    FILE_TYPES.iter().find(|(c, _)| *c == code).map(|(_, n)| *n)
}

/// The GGML type's name as llama.cpp prints it (`Q8_0`, `Q4_K`), for messages and headers.
pub fn ggml_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_permutation_is_llama_cpps_and_a_bijection() {
        // llama.cpp: reshape(heads, 2, d/2, in).swapaxes(1, 2): new row (h, i, s) = old (h, s, i).
        let d = 8;
        let want = [0, 2, 4, 6, 1, 3, 5, 7];
        for (row, &at) in want.iter().enumerate() {
            assert_eq!(gguf_row(row, d), at);
            assert_eq!(gguf_row(row + d, d), at + d);
        }
        let mut seen: Vec<usize> = (0..3 * d).map(|r| gguf_row(r, d)).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..3 * d).collect::<Vec<_>>());
    }

    #[test]
    fn every_tensor_of_a_checkpoint_but_the_exit_gate_has_a_gguf_name() {
        let shape = crate::engine::config::ModelShape {
            hidden: 64,
            layers: 2,
            passes: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 96,
            vocab: 300,
            context: 64,
            tied: false,
        };
        let config = shape.looped(300, candle_core::DType::F32);
        for t in format::checkpoint_tensors(&config) {
            assert_eq!(
                gguf_name(&t.name).is_some(),
                !format::is_exit_gate(&t.name),
                "{}",
                t.name
            );
        }
    }
}
