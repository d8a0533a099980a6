//! The terminal's progress bar while a checkpoint's weights load (`cli::load_model`): bytes
//! read into the host kernels' arena and the rate, then a line while the first host model
//! times its steps. Drawn on stderr, only for checkpoints large enough to keep a user
//! waiting, and not at all where stderr is not a terminal (indicatif hides it there).

use indicatif::{ProgressBar, ProgressStyle};

use crate::engine::checkpoint::LoadProgress;

/// Weights below this load in well under a second: no bar.
const SHOWN_FROM_BYTES: u64 = 256 << 20;

/// A bar that appears on the first report of a large enough load.
pub struct LoadBar {
    name: String,
    downloading: Option<ProgressBar>,
    bar: Option<ProgressBar>,
}

/// The bars' look: what, how far, how much of how much, how fast.
pub fn bytes_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
        .expect("static progress template: this is a bug")
}

impl LoadBar {
    /// A bar for loading the model named `name`.
    pub fn new(name: String) -> Self {
        Self {
            name,
            downloading: None,
            bar: None,
        }
    }

    /// Shows `progress`.
    pub fn show(&mut self, progress: LoadProgress) {
        match progress {
            LoadProgress::Reading {
                read_bytes,
                total_bytes,
            } if total_bytes >= SHOWN_FROM_BYTES => {
                if let Some(done) = self.downloading.take() {
                    done.finish_and_clear();
                }
                let bar = self.bar.get_or_insert_with(|| {
                    let bar = ProgressBar::new(total_bytes);
                    bar.set_style(bytes_style());
                    bar.set_prefix(format!("loading {}", self.name));
                    bar
                });
                bar.set_position(read_bytes);
            }
            LoadProgress::Downloading {
                done_bytes,
                total_bytes,
            } if total_bytes >= SHOWN_FROM_BYTES => {
                let bar = self.downloading.get_or_insert_with(|| {
                    let bar = ProgressBar::new(total_bytes);
                    bar.set_style(bytes_style());
                    bar.set_prefix(format!("downloading {}", self.name));
                    bar
                });
                bar.set_length(total_bytes);
                bar.set_position(done_bytes);
            }
            LoadProgress::TimingSteps => {
                if let Some(bar) = &self.bar {
                    bar.set_message("read; timing the kernels' steps");
                }
            }
            LoadProgress::Reading { .. } | LoadProgress::Downloading { .. } => {}
        }
    }

    /// Clears the bar (the dashboard or the output follows).
    pub fn finish(self) {
        if let Some(bar) = self.downloading {
            bar.finish_and_clear();
        }
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
