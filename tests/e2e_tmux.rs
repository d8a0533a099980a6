//! End-to-end: the real binary in a real terminal (tmux). Type a prompt, press Enter, wait for
//! both lanes, check the pipeline rows, the speedup and the ✓, quit, and check that the
//! terminal was restored. tmux comes from Debian's package (.ci/run installs it).
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;
#[path = "hub/loopback.rs"]
mod loopback;
/// Signals, control bytes, pastes and trace names.
#[path = "e2e_tmux/terminal.rs"]
mod terminal;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{Variant, random_model, spec, spex_ok};

struct Tmux {
    socket: String,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux must be installed (apt-get install tmux; .ci/run does this)")
    }

    fn capture(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "spex"]).stdout)
            .into_owned()
    }

    fn wait_for(&self, what: &str, timeout: Duration, done: impl Fn(&str) -> bool) -> String {
        let started = Instant::now();
        loop {
            let screen = self.capture();
            if done(&screen) {
                return screen;
            }
            assert!(
                started.elapsed() < timeout,
                "timed out waiting for {what}; screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// Presses q and waits for spex to exit cleanly (exit code 0 in `exit_file`).
fn quit(tmux: &Tmux, exit_file: &Path) {
    tmux.run(&["send-keys", "-t", "spex", "q"]);
    assert_eq!(exit_status(exit_file), "0", "clean exit code");
}

/// Waits (up to 10 s) for spex to exit and returns the status the shell wrote to `exit_file`.
fn exit_status(exit_file: &Path) -> String {
    let started = Instant::now();
    while !exit_file.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "spex did not exit"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::read_to_string(exit_file)
        .unwrap()
        .trim()
        .to_string()
}

fn start(model: &Path, exit_file: &Path) -> Tmux {
    let args = format!("tui --model {} --max-tokens 40", model.display());
    start_with(&args, exit_file, "e2e")
}

/// spex with `args` in a fresh tmux session; its exit code goes to `exit_file`.
fn start_with(args: &str, exit_file: &Path, name: &str) -> Tmux {
    start_with_env("", args, exit_file, name)
}

/// [`start_with`], with the shell's `VAR=value …` prefix `env`.
fn start_with_env(env: &str, args: &str, exit_file: &Path, name: &str) -> Tmux {
    let tmux = Tmux {
        socket: format!("spex-{name}-{}", std::process::id()),
    };
    let cmd = format!(
        "{env} {} {args}; echo $? > {exit}.tmp && mv {exit}.tmp {exit}; sleep 30",
        env!("CARGO_BIN_EXE_spex"),
        exit = exit_file.display()
    );
    let out = tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "spex",
        "-x",
        "120",
        "-y",
        "40",
        &cmd,
    ]);
    assert!(
        out.status.success(),
        "tmux new-session: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    tmux
}

#[test]
fn dashboard_runs_a_prompt_and_quits_cleanly() {
    let (dir, _) = random_model(&spec(2, 4, Variant::Tied, 9));
    let exit_file = dir.path().join("exit-code");
    let tmux = start(dir.path(), &exit_file);
    let first = tmux.wait_for("the dashboard", Duration::from_secs(20), |s| {
        s.contains("prompt") && s.contains("pipeline")
    });
    assert!(
        first.contains("Enter runs this sample")
            && first.contains("To be, or not to be, that is the question:"),
        "the first screen's sample prompt and hint:\n{first}"
    );
    tmux.run(&["send-keys", "-t", "spex", "-l", "To be, or not to be 🎭"]);
    tmux.run(&["send-keys", "-t", "spex", "Enter"]);
    let screen = tmux.wait_for("both lanes to finish", Duration::from_secs(60), |s| {
        s.matches("· done").count() == 2 && s.contains("✓ identical")
    });
    for pass in 1..=4 {
        assert!(
            screen.contains(&format!("pass {pass}")),
            "pipeline row {pass} missing:\n{screen}"
        );
    }
    assert!(
        screen.contains("To be, or not to be 🎭"),
        "prompt shown in the lanes:\n{screen}"
    );
    let speedup_line = screen
        .lines()
        .find(|l| l.contains("speedup "))
        .expect("a speedup line");
    assert!(speedup_line.contains('×'), "speedup figure: {speedup_line}");
    assert!(screen.contains("✓ identical (40 tokens)"), "{screen}");
    quit(&tmux, &exit_file);
    let alternate = tmux.run(&["display-message", "-p", "-t", "spex", "#{alternate_on}"]);
    assert_eq!(
        String::from_utf8_lossy(&alternate.stdout).trim(),
        "0",
        "alternate screen left"
    );
    let after = tmux.capture();
    assert!(
        !after.contains("pipeline"),
        "the dashboard is gone from the restored screen:\n{after}"
    );
}

/// A lossy early exit raced in the real terminal: the stats say LOSSY, never identical, and
/// its pipeline never reaches pass 4 where every token stops after pass 1.
#[test]
fn an_exit_lane_is_shown_lossy_in_the_dashboard() {
    let (dir, _) = random_model(&spec(2, 4, Variant::Tied, 9));
    let exit_file = dir.path().join("exit-code");
    let args = format!(
        "tui --model {} --max-tokens 24 --policy exit:pass=1 --prompt 'To be'",
        dir.path().display()
    );
    let tmux = start_with(&args, &exit_file, "exit");
    tmux.wait_for("the dashboard", Duration::from_secs(20), |s| {
        s.contains("pipeline")
    });
    tmux.run(&["send-keys", "-t", "spex", "Enter"]);
    let screen = tmux.wait_for("both lanes to finish", Duration::from_secs(60), |s| {
        s.matches("· done").count() == 2
    });
    assert!(screen.contains("≠ LOSSY"), "{screen}");
    assert!(!screen.contains("✓ identical"), "{screen}");
    assert!(
        screen.contains("exit:pass=1"),
        "the lane names its rule:\n{screen}"
    );
    quit(&tmux, &exit_file);
}

#[test]
fn no_tty_points_to_generate() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 1));
    let out = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(["tui", "--model", &dir.path().display().to_string()])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("spex generate"), "{stderr}");
}

#[test]
fn replay_steps_forward_and_back_through_a_recorded_run_and_quits_cleanly() {
    let (dir, _) = random_model(&spec(2, 4, Variant::Tied, 9));
    let traces = dir.path().join("traces");
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "To be, or not to be\n").unwrap();
    let (m, p, t) = (
        dir.path().display().to_string(),
        prompts.display().to_string(),
        traces.display().to_string(),
    );
    let bench = ["bench", "--runs", "1", "--max-tokens", "12", "--model", &m];
    spex_ok(
        &[&bench[..], &["--prompts", &p, "--record-dir", &t]].concat(),
        &[],
        dir.path(),
    );
    let trace = traces.join("01-speed.jsonl");
    let steps = spex::harness::trace::Trace::read(&trace).unwrap().steps();
    let exit_file = dir.path().join("exit-code");
    let tmux = start_with(&format!("replay {}", trace.display()), &exit_file, "replay");
    let at = |step: usize| format!("step {step}/{steps}");
    tmux.wait_for("the replay at step 0", Duration::from_secs(20), |s| {
        s.contains("REPLAY 01-speed.jsonl") && s.contains(&at(0))
    });
    for (key, step) in [
        ("End", steps),
        ("Left", steps - 1),
        ("Home", 0),
        ("Right", 1),
    ] {
        tmux.run(&["send-keys", "-t", "spex", key]);
        let screen = tmux.wait_for(key, Duration::from_secs(10), |s| s.contains(&at(step)));
        if step == steps {
            assert!(screen.contains("✓ identical"), "{screen}");
            assert!(
                screen.contains("pass 4"),
                "the pipeline is drawn:\n{screen}"
            );
        }
    }
    // Presenter mode and back.
    tmux.run(&["send-keys", "-t", "spex", "p"]);
    let screen = tmux.wait_for("presenter mode", Duration::from_secs(10), |s| {
        s.contains("faster than ordinary decoding") && s.contains("step 1/")
    });
    assert!(
        screen.contains("pass 4"),
        "the pipeline is drawn:\n{screen}"
    );
    tmux.run(&["send-keys", "-t", "spex", "p"]);
    tmux.wait_for("the full dashboard", Duration::from_secs(10), |s| {
        s.contains("REPLAY 01-speed.jsonl")
    });
    quit(&tmux, &exit_file);
}

#[test]
fn the_dashboard_records_each_run_and_w_toggles_recording() {
    let (dir, _) = random_model(&spec(2, 4, Variant::Tied, 9));
    let trace = dir.path().join("a.jsonl");
    let args = format!(
        "tui --model {} --max-tokens 12 --prompt 'To be' --record {}",
        dir.path().display(),
        trace.display()
    );
    let exit_file = dir.path().join("exit-code");
    let tmux = start_with(&args, &exit_file, "record");
    let done = |what: &str| {
        tmux.wait_for(what, Duration::from_secs(30), |s| {
            s.matches("· done").count() == 2
        })
    };
    let screen = done("the first run");
    assert!(screen.contains("● REC"), "{screen}");
    // A rerun records to a-2.jsonl; `w` stops, so the third run is not recorded until `w`
    // starts again, and then from its beginning.
    for keys in [&["r"][..], &["w", "r"], &["w"]] {
        for key in keys {
            tmux.run(&["send-keys", "-t", "spex", key]);
        }
        std::thread::sleep(Duration::from_millis(300));
        done("a run");
    }
    quit(&tmux, &exit_file);
    for name in ["a.jsonl", "a-2.jsonl", "a-3.jsonl"] {
        let t = spex::harness::trace::Trace::read(&dir.path().join(name)).unwrap();
        assert_eq!(t.header.prompt, "To be", "{name}");
        assert!(t.steps() > 0, "{name}");
        assert!(
            matches!(t.events.last(), Some(spex::harness::race::RaceEvent::Done)),
            "{name} ends with its run"
        );
    }
}

#[test]
fn spex_pull_draws_a_bar_with_bytes_and_rate_on_a_terminal() {
    let (ckpt, _) = random_model(&spec(1, 2, Variant::Tied, 9));
    let mut repo = loopback::HubRepo::from_dir("test-org/bar", &"b".repeat(40), ckpt.path());
    let weights: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    repo.files.insert("model.safetensors".into(), weights);
    let hub = loopback::LoopbackHub::start(vec![repo]);
    let home = tempfile::TempDir::new().unwrap();
    let exit = home.path().join("exit");
    let env = format!(
        "HF_ENDPOINT={} HF_HOME={}",
        hub.endpoint,
        home.path().display()
    );
    let tmux = start_with_env(&env, "pull test-org/bar", &exit, "pull");
    let screen = tmux.wait_for("the pull", Duration::from_secs(20), |s| {
        s.contains("is commit")
    });
    assert!(screen.contains("model.safetensors"), "{screen}");
    assert!(screen.contains("3.00 MiB/3.00 MiB"), "{screen}");
    assert!(screen.contains("iB/s"), "{screen}");
    let started = Instant::now();
    while !exit.exists() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(std::fs::read_to_string(&exit).unwrap().trim(), "0");
}

#[test]
fn quitting_mid_run_keeps_the_trace_and_prints_the_frame_clock() {
    let (dir, _) = random_model(&spec(2, 4, Variant::Tied, 9));
    let trace = dir.path().join("q.jsonl");
    let args = format!(
        "tui --model {} --max-tokens 400 --prompt 'To be' --record {} --frame-stats",
        dir.path().display(),
        trace.display()
    );
    let exit_file = dir.path().join("exit-code");
    let tmux = start_with(&args, &exit_file, "quit-mid-run");
    tmux.wait_for("the run", Duration::from_secs(30), |s| s.contains("● REC"));
    quit(&tmux, &exit_file);
    // The terminal is restored, so the frame clock's line is on the shell's screen.
    let screen = tmux.wait_for("the frame clock", Duration::from_secs(5), |s| {
        s.contains("dashboard:") && s.contains("slowest")
    });
    let line = screen.replace('\n', "");
    assert!(
        line.contains("while decoding") && line.contains("in all"),
        "{screen}"
    );
    let t = spex::harness::trace::Trace::read(&trace).unwrap();
    assert_eq!(t.header.prompt, "To be");
}
