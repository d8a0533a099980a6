//! Training (`spex train`), a room of its own: the inference engine imports nothing from here.
//!
//! `spex train`: trains a looped model in the Ouro format with a weighted cross-entropy on the
//! readout after every pass (SPEED §4's per-layer-group loss; Ouro's per-step loss), so that
//! early passes already predict what pass R will. AdamW (our own, so its moments can be saved
//! and resumed), warm-up + cosine schedule, gradient clipping, a fixed seed, whole held-out
//! plays for validation, and resumable checkpoints; a fresh run may start from a trained
//! checkpoint and grow its K (`train.init_from`). The CLI renders progress; this module
//! reports it through a callback.
//!
//! One file per role: `config`, `corpus`, `optimiser`, `init` (seeded init and growth from a
//! checkpoint), `loss`, `trainer`, and `fused` (the CPU training ops with backward passes).

mod config;
mod corpus;
pub mod fused;
pub mod gate;
mod init;
mod loss;
mod optimiser;
mod trainer;

pub use config::{ModelShape, TrainConfig, TrainSettings};
pub use corpus::{Corpus, read_corpus};
pub use fused::Fused;
pub use trainer::{Progress, Trainer, Validation};
