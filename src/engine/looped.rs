//! A looped model's shape as the engine uses it, apart from any file's names for it.
//!
//! Every module past the loader reads a [`LoopedConfig`]: the passes R, the shared layers K,
//! the attention and MLP widths, the vocabulary and positions, and the few numbers the
//! forward pass needs. A checkpoint format's own config (Ouro's `config.json`, in Hugging
//! Face's names, which only `engine::config` and `engine::format` spell) is parsed by its
//! loader and turned into one here, once (`config::OuroConfig::looped`).
//!
//! What a new looped family must provide, in one place:
//! 1. a [`Family`] variant;
//! 2. a config mapping: its file's config parsed and turned into a [`LoopedConfig`] (as
//!    `config::OuroConfig` does for Ouro), with the bounds of `config::FIELD_LIMITS`;
//! 3. a tensor table: the names and shapes of its weights (`format::checkpoint_tensors`);
//! 4. a layer, if its layer differs from Ouro's sandwich-norm block (`model::step`).

use candle_core::DType;

/// The looped model families spex runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Family {
    /// ByteDance's Ouro: one stack of K layers with sandwich norms, applied R times.
    #[default]
    Ouro,
}

/// A looped model's shape and constants, whatever file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopedConfig {
    /// Which family's tensor table and layer the weights follow.
    pub family: Family,
    /// The residual stream's width.
    pub hidden: usize,
    /// K: the shared layers applied on every pass.
    pub layers: usize,
    /// R: the passes.
    pub passes: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (fewer than `heads` under grouped-query attention).
    pub kv_heads: usize,
    /// Each head's width.
    pub head_dim: usize,
    /// The MLP's inner width.
    pub intermediate: usize,
    /// Rows of the embedding and the LM head.
    pub vocab: usize,
    /// The positions the rotary tables and the model support.
    pub positions: usize,
    /// RoPE's base.
    pub rope_theta: f64,
    /// The RMSNorms' epsilon.
    pub rms_norm_eps: f64,
    /// Whether the LM head is the embedding's transpose.
    pub tied: bool,
    /// The token a prompt starts with, where the tokenizer adds one.
    pub bos_token_id: Option<u32>,
    /// The tokens that end a generation.
    pub eos_token_ids: Vec<u32>,
    /// The element type the weights are stored in.
    pub stored_dtype: DType,
    /// Where the exit gate's threshold rule stops a token: the checkpoint's
    /// `early_exit_threshold` (a run may override it: `DecodeOptions::exit_threshold`).
    pub exit_threshold: crate::engine::exit_gate::ExitThreshold,
}

impl LoopedConfig {
    /// Width of one K (or V) cache row: kv_heads × head_dim.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
