//! A fair race between SPEED and the baseline on one thread: whichever lane has used less
//! compute so far runs its next step, so both have always used (nearly) equal compute and the
//! SPEED lane runs ahead by exactly the measured speedup. Each lane times only its own steps.
//! The dashboard starts one race per run; it controls it with [`RaceControl`] messages and
//! receives every decoder event tagged with its lane.

use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use super::lanes::Lanes;
use crate::engine::checkpoint::LoadedModel;
use crate::engine::decoder::DecodeOptions;
use crate::engine::error::Result;
use crate::engine::events::DecodeEvent;
use crate::engine::model::timing::StepTimes;
use crate::engine::policy::PolicyKind;

/// The two lanes of a race.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    Speculative,
    Baseline,
}

impl Lane {
    /// The lanes in the order the race builds them.
    const ORDER: [Self; 2] = [Self::Speculative, Self::Baseline];
}

/// What the race thread sends out.
#[derive(Debug, Clone, PartialEq)]
pub enum RaceEvent {
    /// One decoder event of one lane.
    Decode { lane: Lane, event: DecodeEvent },
    /// Step compute for 1 and R rows, measured before the lanes start (the ceiling).
    StepTimes(StepTimes),
    /// A lane failed; the race stops.
    Error(String),
    /// Both lanes finished (or the race was stopped).
    Done,
}

/// Control messages from the dashboard.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RaceControl {
    Pause,
    Resume,
    /// While paused: advance the SPEED lane by one step (and the baseline to equal compute).
    Step,
    /// SPEED-lane steps per second; `None` runs flat out.
    Rate(Option<f64>),
    Stop,
}

/// Runs a race of `policy` against the baseline to the end on the calling thread, both
/// decoding under `options`. `sink` receives every event and returns false when nobody
/// listens any more (the race then stops).
pub fn run_race(
    loaded: &LoadedModel,
    prompt: &str,
    policy: PolicyKind,
    options: DecodeOptions,
    control: Receiver<RaceControl>,
    mut sink: impl FnMut(RaceEvent) -> bool,
) {
    let mut lanes = match Lanes::new(loaded, prompt, &[policy, PolicyKind::Baseline], options) {
        Ok(lanes) => lanes,
        Err(e) => {
            sink(RaceEvent::Error(e.to_string()));
            sink(RaceEvent::Done);
            return;
        }
    };
    match loaded.backend.step_times(lanes.prompt_tokens(), 8) {
        Ok(times) => sink(RaceEvent::StepTimes(times)),
        Err(e) => sink(RaceEvent::Error(e.to_string())),
    };
    if let Err(e) = race_loop(&mut lanes, &control, &mut sink) {
        sink(RaceEvent::Error(e.to_string()));
    }
    sink(RaceEvent::Done);
}

/// The pacing state the control messages change.
struct Pace {
    paused: bool,
    single_steps: usize,
    rate: Option<f64>,
    last_speed_step: Instant,
}

fn race_loop(
    lanes: &mut Lanes,
    control: &Receiver<RaceControl>,
    sink: &mut impl FnMut(RaceEvent) -> bool,
) -> Result<()> {
    let mut pace = Pace {
        paused: false,
        single_steps: 0,
        rate: None,
        last_speed_step: Instant::now(),
    };
    loop {
        if !apply_controls(&mut pace, control)? {
            return Ok(());
        }
        // The lane with less compute so far goes next: equal compute at every moment.
        let Some(next) = lanes.next_turn() else {
            return Ok(());
        };
        if !lanes.is_behind(next) {
            // The leading lane's steps are what pause, single-step and the rate govern.
            if pace.paused && pace.single_steps == 0 {
                continue;
            }
            if let Some(rate) = pace.rate {
                let wait = Duration::from_secs_f64(1.0 / rate)
                    .saturating_sub(pace.last_speed_step.elapsed());
                if !wait.is_zero() {
                    std::thread::sleep(wait.min(Duration::from_millis(20)));
                    continue;
                }
            }
            pace.single_steps = pace.single_steps.saturating_sub(1);
            pace.last_speed_step = Instant::now();
        }
        if let Some(event) = lanes.advance(next)? {
            let lane = Lane::ORDER[next];
            if !sink(RaceEvent::Decode { lane, event }) {
                return Ok(());
            }
        }
    }
}

/// Applies pending control messages; blocks while paused with nothing to do. False on Stop.
fn apply_controls(pace: &mut Pace, control: &Receiver<RaceControl>) -> Result<bool> {
    loop {
        let msg = if pace.paused && pace.single_steps == 0 {
            match control.recv_timeout(Duration::from_millis(20)) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => return Ok(true),
                Err(RecvTimeoutError::Disconnected) => return Ok(false),
            }
        } else {
            match control.try_recv() {
                Ok(m) => Some(m),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => return Ok(false),
            }
        };
        match msg {
            None => return Ok(true),
            Some(RaceControl::Pause) => pace.paused = true,
            Some(RaceControl::Resume) => pace.paused = false,
            Some(RaceControl::Step) => pace.single_steps += 1,
            Some(RaceControl::Rate(r)) => pace.rate = r,
            Some(RaceControl::Stop) => return Ok(false),
        }
    }
}
