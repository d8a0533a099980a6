//! The live dashboard's event source: the race of the current run on a thread of its own,
//! restarted and steered by the app's commands, and its trace when recording.
//!
//! A trace's header names the model's weights by their SHA-256, which reads every weight:
//! seconds at real size (2.8 GB at Ouro-1.4B's shape). A thread of its own computes it, so
//! the dashboard keeps drawing; the run's events wait in its history until the trace opens,
//! and a trace still waiting when the run is replaced or the user quits is finished first.

use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;

use tokio::sync::mpsc;

use super::DashboardOptions;
use super::Source;
use super::app::{Command, Msg};
use crate::engine::checkpoint::Origin;
use crate::engine::policy::PolicyKind;
use crate::engine::{DecodeOptions, LoadedModel, Sampling};
use crate::harness::race::{RaceControl, RaceEvent, run_race};
use crate::harness::trace::{ModelFingerprint, TraceHeader, TraceWriter};

/// The race thread of the current run and its control channel.
struct RaceHandle {
    control: std_mpsc::Sender<RaceControl>,
    thread: JoinHandle<()>,
}

impl RaceHandle {
    fn start(
        loaded: &LoadedModel,
        prompt: String,
        policy: PolicyKind,
        options: DecodeOptions,
        events: mpsc::UnboundedSender<RaceEvent>,
    ) -> anyhow::Result<Self> {
        let (control, control_rx) = std_mpsc::channel();
        let loaded = loaded.clone();
        let thread = std::thread::Builder::new()
            .name("spex-race".into())
            .spawn(move || {
                run_race(&loaded, &prompt, policy, options, control_rx, |ev| {
                    events.send(ev).is_ok()
                })
            })
            .map_err(|e| anyhow::anyhow!("could not start the race thread: {e}"))?;
        Ok(Self { control, thread })
    }

    /// Stops the race and joins its thread.
    fn stop(self) {
        let _ = self.control.send(RaceControl::Stop);
        drop(self.control);
        let _ = self.thread.join();
    }
}

/// The weights' and tokenizer's SHA-256, or the one-line error of reading them.
type Hashes = Result<ModelFingerprint, String>;

/// The model's fingerprint for trace headers, computed once, off the UI thread.
enum Fingerprint {
    NotStarted,
    Hashing(std_mpsc::Receiver<Hashes>),
    Ready(ModelFingerprint),
}

impl Fingerprint {
    /// Starts hashing `origin` on a thread of its own, unless begun already.
    fn begin(&mut self, origin: &Origin) {
        if let Self::NotStarted = self {
            let (tx, rx) = std_mpsc::channel();
            let (origin, failed) = (origin.clone(), tx.clone());
            let spawned = std::thread::Builder::new()
                .name("spex-fingerprint".into())
                .spawn(move || {
                    let hashes = crate::harness::trace::fingerprint(&origin);
                    let _ = tx.send(hashes.map_err(|e| e.to_string()));
                });
            if let Err(e) = spawned {
                let _ = failed.send(Err(format!("could not start the fingerprint thread: {e}")));
            }
            *self = Self::Hashing(rx);
        }
    }

    /// The hashes once known (waiting for them if `wait`); `None` while hashing goes on.
    fn poll(&mut self, wait: bool) -> Option<Hashes> {
        let result = match self {
            Self::NotStarted => return None,
            Self::Ready(hashes) => return Some(Ok(hashes.clone())),
            Self::Hashing(rx) if wait => rx.recv().map_err(|_| ()),
            Self::Hashing(rx) => match rx.try_recv() {
                Err(std_mpsc::TryRecvError::Empty) => return None,
                other => other.map_err(|_| ()),
            },
        };
        let hashes = result
            .unwrap_or_else(|()| Err("the fingerprint thread stopped before its hashes".into()));
        // A failed read is tried again by the next recording.
        *self = match &hashes {
            Ok(h) => Self::Ready(h.clone()),
            Err(_) => Self::NotStarted,
        };
        Some(hashes)
    }
}

/// The race of the current run, restarted and steered by the app's commands.
pub(super) struct Races<'a> {
    loaded: &'a LoadedModel,
    options: &'a DashboardOptions,
    /// The sampling rule of the next race (the dashboard's keys change it).
    sampling: Sampling,
    events: mpsc::UnboundedSender<RaceEvent>,
    pending: mpsc::UnboundedReceiver<RaceEvent>,
    current: Option<RaceHandle>,
    /// The current run's trace, when recording.
    recorder: Option<TraceWriter>,
    /// Whether runs are recorded.
    pub(super) recording: bool,
    fingerprint: Fingerprint,
    /// The current run is to be recorded once the fingerprint is known.
    trace_waiting: bool,
    /// The current run's prompt and every event it sent so far (a recording started midway,
    /// or waiting for the fingerprint, writes them first).
    prompt: String,
    history: Vec<RaceEvent>,
    /// Runs started so far.
    runs: usize,
}

impl<'a> Races<'a> {
    pub(super) fn new(loaded: &'a LoadedModel, options: &'a DashboardOptions) -> Self {
        let (events, pending) = mpsc::unbounded_channel::<RaceEvent>();
        Self {
            loaded,
            options,
            sampling: options.decode.sampling,
            events,
            pending,
            current: None,
            recorder: None,
            recording: options.record.is_some(),
            fingerprint: Fingerprint::NotStarted,
            trace_waiting: false,
            prompt: String::new(),
            history: Vec::new(),
            runs: 0,
        }
    }

    /// Records the current run: at once where the fingerprint is known, else once it is.
    fn want_trace(&mut self) -> anyhow::Result<()> {
        self.fingerprint.begin(&self.loaded.origin);
        self.trace_waiting = true;
        self.settle_trace(false)
    }

    /// Opens the waiting trace if the fingerprint is known (waiting for it if `wait`).
    fn settle_trace(&mut self, wait: bool) -> anyhow::Result<()> {
        if !self.trace_waiting {
            return Ok(());
        }
        match self.fingerprint.poll(wait) {
            None => Ok(()),
            Some(hashes) => {
                self.trace_waiting = false;
                self.open_trace(hashes.map_err(anyhow::Error::msg)?)
            }
        }
    }

    /// Opens the current run's trace and writes what the run sent so far.
    fn open_trace(&mut self, fingerprint: ModelFingerprint) -> anyhow::Result<()> {
        let mut header = TraceHeader {
            prompt: self.prompt.clone(),
            policy: self.options.policy,
            sampling: self.sampling,
            ..self.options.trace.clone()
        };
        header.model.set_fingerprint(fingerprint);
        // Names the dashboard makes up never replace a file: a taken one moves to the next
        // free `NAME-N.jsonl`, so runs recorded within one second keep a file each.
        let path = match &self.options.record {
            Some(path) => crate::engine::files::numbered(path, self.runs),
            None => {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                format!("spex-{}.jsonl", now.map_or(0, |d| d.as_secs())).into()
            }
        };
        let mut writer = TraceWriter::create_unique(&path, &header)?;
        for event in &self.history {
            writer.record(event)?;
        }
        self.recorder = Some(writer);
        Ok(())
    }

    /// Stops the current race, if one runs, and joins its thread.
    fn stop_race(&mut self) {
        if let Some(r) = self.current.take() {
            r.stop();
        }
    }

    /// Stops the current race, finishes its waiting trace, and starts a race of `prompt`.
    fn start_race(&mut self, prompt: String) -> anyhow::Result<()> {
        self.stop_race();
        // The run being replaced keeps its trace: what it sent so far.
        let settled = self.settle_trace(true);
        // Events of the stopped race must not reach the new run.
        while self.pending.try_recv().is_ok() {}
        self.runs += 1;
        (self.prompt, self.recorder) = (prompt.clone(), None);
        self.history.clear();
        if self.recording {
            self.want_trace()?;
        }
        let prompt = if self.options.chat {
            self.loaded.tokenizer.chat_prompt(&prompt)?
        } else {
            prompt
        };
        let options = DecodeOptions {
            sampling: self.sampling,
            ..self.options.decode
        };
        let events = self.events.clone();
        let policy = self.options.policy;
        let race = RaceHandle::start(self.loaded, prompt, policy, options, events)?;
        self.current = Some(race);
        settled
    }
}

impl Source for Races<'_> {
    fn execute(&mut self, commands: Vec<Command>) -> anyhow::Result<()> {
        for command in commands {
            match command {
                Command::StartRace { prompt } => self.start_race(prompt)?,
                Command::Control(c) => {
                    if let Some(r) = &self.current {
                        let _ = r.control.send(c);
                    }
                }
                Command::SetSampling(sampling) => self.sampling = sampling,
                Command::Record(on) => {
                    self.recording = on;
                    (self.recorder, self.trace_waiting) = (None, false);
                    if on && self.runs > 0 {
                        self.want_trace()?;
                    }
                }
                Command::Seek(_) | Command::Quit => {}
            }
        }
        Ok(())
    }

    fn frame(&mut self) -> anyhow::Result<Option<Msg>> {
        let mut batch = Vec::new();
        if let Err(e) = self.settle_trace(false) {
            batch.push(RaceEvent::Error(format!("recording stopped: {e}")));
        }
        // Everything the engine sent since the last frame, in one update.
        while let Ok(event) = self.pending.try_recv() {
            if let Some(Err(e)) = self.recorder.as_mut().map(|r| r.record(&event)) {
                // The run goes on unrecorded; the error line says why.
                self.recorder = None;
                batch.push(RaceEvent::Error(format!("recording stopped: {e}")));
            }
            self.history.push(event.clone());
            batch.push(event);
        }
        Ok((!batch.is_empty()).then_some(Msg::Engine(batch)))
    }

    fn stop(&mut self) -> anyhow::Result<()> {
        self.stop_race();
        // A trace still waiting for the fingerprint is written before the dashboard closes,
        // with every event the run sent.
        if self.trace_waiting {
            while let Ok(event) = self.pending.try_recv() {
                self.history.push(event);
            }
            self.settle_trace(true)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_is_hashed_on_its_own_thread_once() {
        let dir = tempfile::TempDir::new().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"weights").unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
        let origin = Origin::Dir(dir.path().to_path_buf());
        let mut fingerprint = Fingerprint::NotStarted;
        assert!(fingerprint.poll(false).is_none(), "nothing begun");
        fingerprint.begin(&origin);
        let hashes = fingerprint.poll(true).unwrap().unwrap();
        assert_eq!(hashes, crate::harness::trace::fingerprint(&origin).unwrap());
        assert!(matches!(fingerprint, Fingerprint::Ready(_)));
        // Known from now on, without another thread.
        fingerprint.begin(&origin);
        assert_eq!(fingerprint.poll(false).unwrap().unwrap(), hashes);
    }

    #[test]
    fn a_failed_fingerprint_is_one_line_and_tried_again() {
        let dir = tempfile::TempDir::new().unwrap();
        let origin = Origin::Dir(dir.path().join("gone"));
        let mut fingerprint = Fingerprint::NotStarted;
        fingerprint.begin(&origin);
        let error = fingerprint.poll(true).unwrap().unwrap_err();
        assert!(error.contains("gone") && !error.contains('\n'), "{error}");
        assert!(matches!(fingerprint, Fingerprint::NotStarted));
    }
}
