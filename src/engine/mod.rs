//! The inference engine: the looped model, its KV cache, CPU kernels, the SPEED scheduler,
//! policies, events, metrics and checkpoint I/O. Imports nothing from the dashboard or from
//! training (`crate::train`).

pub mod bench;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod decoder;
pub mod error;
pub mod events;
pub mod explain;
pub mod format;
pub mod kernels;
pub mod kv_cache;
pub mod lanes;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod pass;
pub mod pipeline;
pub mod policy;
pub mod race;
pub mod random_checkpoint;
pub mod rng;
pub mod roofline;
pub mod sampling;
mod tensor_files;
pub mod tokenizer;
pub mod trace;
pub mod units;
pub mod what_if;

pub use checkpoint::{Checkpoint, CheckpointBytes, LoadedModel};
pub use config::OuroConfig;
pub use decoder::{DecodeOptions, Decoder};
pub use error::{EngineError, Result};
pub use events::DecodeEvent;
pub use pass::Pass;
pub use policy::{Policy, PolicyKind};
pub use sampling::Sampling;
