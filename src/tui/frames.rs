//! The dashboard's own frame clock: how many frames it drew per second, over the whole
//! session and while a race was decoding, and its slowest draw. `spex tui --frame-stats`
//! prints it on quit, after the terminal is restored; it is how the dashboard's frame rate
//! on a busy machine (a GPU decoding beside it) is measured.

use std::time::{Duration, Instant};

/// Frames drawn over some span of time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FrameTally {
    pub frames: u64,
    /// The wall time the frames cover: the intervals that ended in a draw.
    pub elapsed: Duration,
    /// The longest single draw.
    pub slowest_draw: Duration,
}

impl FrameTally {
    fn add(&mut self, interval: Duration, draw: Duration) {
        self.frames += 1;
        self.elapsed += interval;
        self.slowest_draw = self.slowest_draw.max(draw);
    }

    /// Frames per second over `elapsed`; `None` before any time has passed.
    pub fn frames_per_sec(&self) -> Option<f64> {
        let seconds = self.elapsed.as_secs_f64();
        (seconds > 0.0).then(|| self.frames as f64 / seconds)
    }
}

/// Counts the draws of the dashboard's frame timer.
#[derive(Debug, Clone)]
pub struct FrameClock {
    last_draw: Instant,
    /// Every frame of the session.
    pub total: FrameTally,
    /// The frames drawn while a race was decoding (the interval before each counts).
    pub decoding: FrameTally,
}

impl FrameClock {
    /// A clock whose first interval starts now.
    pub fn start() -> Self {
        Self {
            last_draw: Instant::now(),
            total: FrameTally::default(),
            decoding: FrameTally::default(),
        }
    }

    /// Counts a draw that took `draw` and ended now; `decoding` says whether a race ran.
    pub fn record(&mut self, decoding: bool, draw: Duration) {
        let now = Instant::now();
        self.record_at(now, decoding, draw);
    }

    fn record_at(&mut self, now: Instant, decoding: bool, draw: Duration) {
        let interval = now.saturating_duration_since(self.last_draw);
        self.last_draw = now;
        self.total.add(interval, draw);
        if decoding {
            self.decoding.add(interval, draw);
        }
    }

    /// One line: frames per second while decoding and in all, and the slowest draw.
    pub fn summary(&self) -> String {
        let rate = |t: &FrameTally| {
            t.frames_per_sec()
                .map_or("—".to_string(), |r| format!("{r:.1} frames/s"))
        };
        format!(
            "dashboard: {} while decoding ({} frames over {:.1} s), {} in all ({} frames over {:.1} s); slowest draw {:.1} ms",
            rate(&self.decoding),
            self.decoding.frames,
            self.decoding.elapsed.as_secs_f64(),
            rate(&self.total),
            self.total.frames,
            self.total.elapsed.as_secs_f64(),
            self.total.slowest_draw.as_secs_f64() * 1e3,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_frames_are_counted_apart() {
        let mut clock = FrameClock::start();
        let t0 = clock.last_draw;
        let ms = Duration::from_millis;
        clock.record_at(t0 + ms(50), false, ms(1));
        clock.record_at(t0 + ms(100), true, ms(3));
        clock.record_at(t0 + ms(150), true, ms(2));
        assert_eq!(clock.total.frames, 3);
        assert_eq!(clock.decoding.frames, 2);
        assert_eq!(clock.decoding.elapsed, ms(100));
        assert_eq!(clock.total.slowest_draw, ms(3));
        let rate = clock.decoding.frames_per_sec().expect("time passed");
        assert!((rate - 20.0).abs() < 1e-9, "{rate}");
        assert!(clock.summary().contains("20.0 frames/s while decoding"));
    }

    #[test]
    fn no_frames_no_rate() {
        let clock = FrameClock::start();
        assert_eq!(clock.decoding.frames_per_sec(), None);
        assert!(clock.summary().starts_with("dashboard: — while decoding"));
    }
}
