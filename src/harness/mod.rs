//! The engine's harness: what runs decoders side by side, measures them and keeps their
//! runs. `lanes` interleaves decoders on one thread by compute used; `race` (the dashboard's
//! two lanes) and `bench` (the baseline and every listed policy) drive it; `metrics` folds
//! events into every figure, and `report` computes a bench's once (`bandwidth`, its share of
//! the read bandwidth); `trace` writes and reads runs; `explain` and `what_if` study recorded
//! runs; `roofline` measures the machine's read bandwidth. It imports the engine's core (`crate::engine`); the core never imports it.

pub mod bandwidth;
pub mod bench;
pub mod exit_loss;
pub mod explain;
pub mod lanes;
pub mod metrics;
pub mod race;
pub mod report;
pub mod roofline;
pub mod sweep;
pub mod trace;
mod trace_check;
pub mod what_if;
