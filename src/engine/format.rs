//! The Ouro checkpoint format, the one format spex reads and writes, and its tensors: one
//! table of names, shapes and roles. Loading (`model::Weights`), random checkpoints
//! (`random_checkpoint`) and training's saves and growth (`train`) all read it; no other file
//! spells a tensor name.
//!
//! # Files
//!
//! A checkpoint is a directory (or a hub repo) holding `config.json`, the weights in one
//! `model.safetensors` or in shards named by `model.safetensors.index.json`, and
//! `tokenizer.json`; a chat model's `tokenizer_config.json` carries its chat template. The
//! config fields spex reads are `config::OuroConfig`'s, turned once into the engine's
//! [`LoopedConfig`] (`engine::looped`): `num_hidden_layers` is K, the shared layers (`layers`),
//! and `total_ut_steps` is R, the passes (`passes`).
//!
//! # Tensors
//!
//! Every linear layer is bias-free. Per shared layer `i` (the constants below spell them):
//! the attention's `q_proj` `[heads·head_dim, hidden]`, `k_proj` and `v_proj`
//! `[kv_heads·head_dim, hidden]` (grouped-query attention when `kv_heads < heads`) and
//! `o_proj` `[hidden, heads·head_dim]`; the MLP's `gate_proj` and `up_proj`
//! `[intermediate, hidden]` and `down_proj` `[hidden, intermediate]`; and four RMSNorm gains
//! `[hidden]`. Beside the layers: the embedding, the final norm, the LM head (absent when tied
//! to the embedding) and Ouro's early-exit gate, which spex does not use.
//!
//! # The forward pass
//!
//! ```text
//! h = embed(ids)
//! for pass in 1..=R:
//!     for layer i in 0..K:                       (KV cache: one per (pass, layer))
//!         a = input_layernorm(h);  a = attention(a);  a = input_layernorm_2(a);  h = h + a
//!         m = post_attention_layernorm(h);  m = down(silu(gate(m)) · up(m))
//!         m = post_attention_layernorm_2(m);  h = h + m
//!     h = norm(h)                                (carried into the next pass)
//!     readout[pass] = lm_head(h)                 (the embedding's transpose when tied)
//! ```
//!
//! The second norm after each sublayer is Ouro's "sandwich" (`model::step` is its one
//! implementation). RMSNorm is x / sqrt(mean(x²) + eps) · gain. Attention is causal with scale
//! 1/sqrt(head_dim); the rotary embedding uses the rotate-half (NeoX) layout with base
//! `rope_theta` at the token's absolute position; key/value heads repeat for GQA.
//!
//! # The released models
//!
//! ByteDance's Ouro-1.4B and Ouro-2.6B (and their chat-tuned `-Thinking` twins) are hidden
//! 2048, 16 heads of 128 (no GQA), intermediate 5632, vocabulary 49152, untied, R = 4, with
//! K = 24 and K = 48 layers; bf16 weights of 2.9 GB and 5.3 GB. `spex random-checkpoint` writes
//! any shape in this format, and spex's own trained models use it, so any Ouro implementation
//! can read them.

use candle_core::{DType, Device, Tensor};

use super::looped::LoopedConfig;

/// The name of a sharded checkpoint's index, which maps every tensor to its shard.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";
/// The token embedding, `[vocab, hidden]`.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// The norm after the last layer of every pass, `[hidden]`.
pub const FINAL_NORM: &str = "model.norm.weight";
/// The LM head, `[vocab, hidden]`; absent when the checkpoint ties it to the embedding.
pub const LM_HEAD: &str = "lm_head.weight";
/// Ouro's early-exit gate, `[1, hidden]` weight and `[1]` bias (unused by spex's decoding).
pub const EXIT_GATE_WEIGHT: &str = "model.early_exit_gate.weight";
/// The exit gate's bias, `[1]`.
pub const EXIT_GATE_BIAS: &str = "model.early_exit_gate.bias";
const LAYER_PREFIX: &str = "model.layers.";

/// The exit gate's bias in every checkpoint spex writes: with a zero weight, every pass's
/// exit probability is sigmoid(−10) ≈ 4.5e-5, so an Ouro implementation that honours the gate
/// runs all R passes at any threshold above ~2e-4 (and at Ouro's default 1.0, as spex
/// does): it computes the R-pass model spex trained. spex's training has no exit loss.
pub const NEUTRAL_EXIT_GATE_BIAS: f32 = -10.0;

/// One of the eleven tensors of a shared layer, in file and creation order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerTensor {
    /// The query projection, `[heads × head_dim, hidden]`.
    QProj,
    /// The key projection, `[kv_heads × head_dim, hidden]`.
    KProj,
    /// The value projection, `[kv_heads × head_dim, hidden]`.
    VProj,
    /// The attention's output projection, `[hidden, heads × head_dim]`.
    OProj,
    /// The MLP's gate projection, `[intermediate, hidden]`.
    GateProj,
    /// The MLP's up projection, `[intermediate, hidden]`.
    UpProj,
    /// The MLP's down projection, `[hidden, intermediate]`.
    DownProj,
    /// The norm before attention, `[hidden]`.
    InputNorm,
    /// The norm on attention's output, before the residual add, `[hidden]`.
    InputNorm2,
    /// The norm before the MLP, `[hidden]`.
    PostAttentionNorm,
    /// The norm on the MLP's output, before the residual add, `[hidden]`.
    PostAttentionNorm2,
}

impl LayerTensor {
    /// Every layer tensor, projections first, then the four sandwich norms.
    pub const ALL: [Self; 11] = [
        Self::QProj,
        Self::KProj,
        Self::VProj,
        Self::OProj,
        Self::GateProj,
        Self::UpProj,
        Self::DownProj,
        Self::InputNorm,
        Self::InputNorm2,
        Self::PostAttentionNorm,
        Self::PostAttentionNorm2,
    ];

    /// The name after `model.layers.{i}.`.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::QProj => "self_attn.q_proj.weight",
            Self::KProj => "self_attn.k_proj.weight",
            Self::VProj => "self_attn.v_proj.weight",
            Self::OProj => "self_attn.o_proj.weight",
            Self::GateProj => "mlp.gate_proj.weight",
            Self::UpProj => "mlp.up_proj.weight",
            Self::DownProj => "mlp.down_proj.weight",
            Self::InputNorm => "input_layernorm.weight",
            Self::InputNorm2 => "input_layernorm_2.weight",
            Self::PostAttentionNorm => "post_attention_layernorm.weight",
            Self::PostAttentionNorm2 => "post_attention_layernorm_2.weight",
        }
    }

    /// The full name of this tensor in layer `layer`.
    pub fn name(self, layer: usize) -> String {
        format!("{LAYER_PREFIX}{layer}.{}", self.suffix())
    }

    /// Its shape (`[out, in]` for projections) and role.
    pub fn shape_and_role(self, c: &LoopedConfig) -> (Vec<usize>, Role) {
        let (h, i) = (c.hidden, c.intermediate);
        let (q, kv) = (c.heads * c.head_dim, c.kv_dim());
        let linear = |out: usize, fan_in: usize| (vec![out, fan_in], Role::Linear { fan_in });
        match self {
            Self::QProj => linear(q, h),
            Self::KProj | Self::VProj => linear(kv, h),
            Self::OProj => linear(h, q),
            Self::GateProj | Self::UpProj => linear(i, h),
            Self::DownProj => linear(h, i),
            _ => (vec![h], Role::Norm),
        }
    }

    /// The gains of the norms on a layer's two outputs into the residual stream (Ouro's
    /// sandwich norms): at zero, the layer adds nothing.
    pub fn is_output_gain(self) -> bool {
        matches!(self, Self::InputNorm2 | Self::PostAttentionNorm2)
    }
}

/// What a tensor is, for initialising it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The token embedding.
    Embedding,
    /// The untied LM head, `[vocab, fan_in]`.
    LmHead {
        /// Its input width (hidden).
        fan_in: usize,
    },
    /// A projection stored `[out, in]`.
    Linear {
        /// Its input width.
        fan_in: usize,
    },
    /// A norm's gain.
    Norm,
    /// Ouro's early-exit gate, weight or bias.
    ExitGate,
}

/// One tensor of a checkpoint: its name, shape and role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Its name in the safetensors file.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// What it is.
    pub role: Role,
}

/// Every tensor a checkpoint of `config` holds, the exit gate included, in file order.
pub fn checkpoint_tensors(config: &LoopedConfig) -> Vec<TensorSpec> {
    let (h, v) = (config.hidden, config.vocab);
    let spec = |name: &str, shape: Vec<usize>, role| TensorSpec {
        name: name.to_string(),
        shape,
        role,
    };
    let mut out = vec![
        spec(EMBED_TOKENS, vec![v, h], Role::Embedding),
        spec(FINAL_NORM, vec![h], Role::Norm),
    ];
    if !config.tied {
        out.push(spec(LM_HEAD, vec![v, h], Role::LmHead { fan_in: h }));
    }
    out.push(spec(EXIT_GATE_WEIGHT, vec![1, h], Role::ExitGate));
    out.push(spec(EXIT_GATE_BIAS, vec![1], Role::ExitGate));
    for layer in 0..config.layers {
        for t in LayerTensor::ALL {
            let (shape, role) = t.shape_and_role(config);
            out.push(TensorSpec {
                name: t.name(layer),
                shape,
                role,
            });
        }
    }
    out
}

/// The layer a tensor belongs to (`model.layers.{i}.…`), if any.
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix(LAYER_PREFIX)?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Which layer tensor `name` is, if it is one.
pub fn layer_tensor_of(name: &str) -> Option<LayerTensor> {
    let layer = layer_of(name)?;
    LayerTensor::ALL.into_iter().find(|t| t.name(layer) == name)
}

/// Whether `name` is one of the exit gate's two tensors.
pub fn is_exit_gate(name: &str) -> bool {
    name == EXIT_GATE_WEIGHT || name == EXIT_GATE_BIAS
}

/// The exit gate spex writes into its checkpoints: zero weight, bias
/// [`NEUTRAL_EXIT_GATE_BIAS`] (never exits early), in `dtype`.
pub fn neutral_exit_gate(
    config: &LoopedConfig,
    dtype: DType,
) -> candle_core::Result<[(String, Tensor); 2]> {
    let weight = Tensor::zeros((1, config.hidden), dtype, &Device::Cpu)?;
    let bias = Tensor::new(&[NEUTRAL_EXIT_GATE_BIAS], &Device::Cpu)?.to_dtype(dtype)?;
    Ok([
        (EXIT_GATE_WEIGHT.to_string(), weight),
        (EXIT_GATE_BIAS.to_string(), bias),
    ])
}
