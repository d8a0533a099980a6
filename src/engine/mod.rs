//! The inference engine's core: the looped model, its KV cache, CPU kernels, the SPEED
//! scheduler, policies, sampling, events, the checkpoint format and its I/O. Imports nothing
//! from the harness that measures and replays it (`crate::harness`), the dashboard, the CLI or
//! training.

#![warn(missing_docs)]

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod custom_op;
pub mod decoder;
pub mod drafter;
pub mod error;
pub mod events;
pub mod exit_gate;
pub mod files;
pub mod format;
pub mod gguf;
pub mod kernels;
pub mod kv_cache;
pub mod looped;
pub mod memory;
pub mod mlx;
pub mod model;
pub mod pass;
pub mod pipeline;
pub mod policy;
pub mod quantize;
pub mod random_checkpoint;
pub mod rng;
pub mod sampling;
pub(crate) mod tensor_files;
pub mod tokenizer;
pub mod units;
pub mod zeroed_pages;

pub use checkpoint::{Checkpoint, CheckpointBytes, LoadedModel};
pub use config::OuroConfig;
pub use decoder::{DecodeOptions, Decoder};
pub use error::{EngineError, Result};
pub use events::DecodeEvent;
pub use pass::Pass;
pub use policy::{Policy, PolicyKind};
pub use sampling::Sampling;
