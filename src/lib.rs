//! spex: speculative pipelined decoding (SPEED) on looped language models, with a live
//! terminal dashboard. `engine` decodes, `harness` races, measures and records it, `tui` renders, `cli` parses,
//! `train` trains, `hub` pulls checkpoints into the local hub cache.

pub mod cli;
pub mod engine;
pub mod harness;
pub mod hub;
pub mod train;
pub mod tui;

#[cfg(test)]
mod architecture_tests;
