//! spex: speculative pipelined decoding (SPEED) on looped language models, with a live
//! terminal dashboard. `engine` decodes, `tui` renders, `cli` parses,
//! `train` trains.

pub mod cli;
pub mod engine;
pub mod train;
pub mod tui;
