//! The terminal kept whole whatever reaches spex: signals restore it before exit, control
//! bytes in text never reach it, a paste is one edit, and traces recorded within one second
//! keep a file each.

use std::time::{Duration, Instant};

use super::{Tmux, exit_status, quit, start_with};
use crate::common::{Variant, random_model, spec};

/// tmux's format `flag` of the pane (`alternate_on`, `cursor_flag`, `mouse_any_flag`).
fn pane_flag(tmux: &Tmux, flag: &str) -> String {
    let format = format!("#{{{flag}}}");
    let out = tmux.run(&["display-message", "-p", "-t", "spex", &format]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The pid of spex in the pane: the child of the pane's shell (Linux's `children` list).
fn spex_pid(tmux: &Tmux) -> i32 {
    let shell = pane_flag(tmux, "pane_pid");
    let children = std::fs::read_to_string(format!("/proc/{shell}/task/{shell}/children"));
    let children = children.unwrap();
    let pid = children
        .split_whitespace()
        .next()
        .expect("spex runs in the pane");
    pid.parse().unwrap()
}

#[test]
fn sigterm_and_sighup_restore_the_terminal_and_exit_with_the_signal() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 9));
    for (signal, number, status) in [("TERM", libc::SIGTERM, "143"), ("HUP", libc::SIGHUP, "129")] {
        let exit_file = dir.path().join(format!("exit-{signal}"));
        let args = format!("tui --model {} --max-tokens 4000", dir.path().display());
        let tmux = start_with(&args, &exit_file, &format!("sig{signal}"));
        tmux.wait_for("the dashboard", Duration::from_secs(20), |s| {
            s.contains("pipeline")
        });
        assert_eq!(pane_flag(&tmux, "alternate_on"), "1");
        // SAFETY: kill(2) sends a signal to the test's own grandchild; no memory is touched.
        let sent = unsafe { libc::kill(spex_pid(&tmux), number) };
        assert_eq!(sent, 0, "kill -{signal}");
        assert_eq!(
            exit_status(&exit_file),
            status,
            "SIG{signal}'s conventional status"
        );
        assert_eq!(
            pane_flag(&tmux, "alternate_on"),
            "0",
            "the alternate screen left"
        );
        assert_eq!(pane_flag(&tmux, "cursor_flag"), "1", "the cursor shown");
        assert_eq!(
            pane_flag(&tmux, "mouse_any_flag"),
            "0",
            "mouse reporting off"
        );
    }
}

#[test]
fn control_bytes_in_a_prompt_never_reach_the_terminal() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 9));
    let exit_file = dir.path().join("exit-code");
    let args = format!(
        "tui --model {} --max-tokens 8 --prompt \"$(printf '\\033[31mRED\\033[2J\\007')\"",
        dir.path().display()
    );
    let tmux = start_with(&args, &exit_file, "control");
    let screen = tmux.wait_for("both lanes", Duration::from_secs(30), |s| {
        s.matches("· done").count() == 2
    });
    assert!(screen.contains("?[31mRED?[2J?"), "{screen}");
    // Every panel's border is intact: the top line of the screen and the lanes' corners.
    let first = screen.lines().next().unwrap_or_default();
    assert!(first.starts_with('╭') && first.ends_with('╮'), "{screen}");
    let prompt = screen.lines().nth(1).unwrap_or_default();
    assert!(prompt.starts_with('│') && prompt.ends_with('│'), "{screen}");
    quit(&tmux, &exit_file);
}

#[test]
fn a_long_paste_is_one_edit() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 9));
    let exit_file = dir.path().join("exit-code");
    let args = format!("tui --model {}", dir.path().display());
    let tmux = start_with(&args, &exit_file, "paste");
    tmux.wait_for("the dashboard", Duration::from_secs(20), |s| {
        s.contains("Enter runs this sample")
    });
    let text = format!("{}END", "abcdefghij".repeat(1500));
    tmux.run(&["set-buffer", "-b", "p", &text]);
    let started = Instant::now();
    // -p: bracketed, as a terminal sends a paste to a program that asked for it.
    tmux.run(&["paste-buffer", "-p", "-b", "p", "-t", "spex"]);
    tmux.run(&["send-keys", "-t", "spex", "Home"]);
    tmux.wait_for("the pasted prompt", Duration::from_secs(10), |s| {
        s.contains("abcdefghijabcdefghij") && !s.contains("To be, or not to be")
    });
    assert!(started.elapsed() < Duration::from_secs(10));
    tmux.run(&["send-keys", "-t", "spex", "Escape"]);
    quit(&tmux, &exit_file);
}

#[test]
fn traces_recorded_within_one_second_keep_a_file_each() {
    let (dir, _) = random_model(&spec(1, 2, Variant::Tied, 9));
    let work = tempfile::TempDir::new().unwrap();
    let exit_file = dir.path().join("exit-code");
    let args = format!(
        "tui --model {} --max-tokens 200 --prompt 'To be'",
        dir.path().display()
    );
    let cd = format!("cd {} &&", work.path().display());
    let tmux = super::start_with_env(&cd, &args, &exit_file, "names");
    tmux.wait_for("the dashboard", Duration::from_secs(20), |s| {
        s.contains("pipeline")
    });
    for key in ["w", "r", "r", "r", "r"] {
        tmux.run(&["send-keys", "-t", "spex", key]);
    }
    std::thread::sleep(Duration::from_millis(500));
    quit(&tmux, &exit_file);
    let traces: Vec<_> = std::fs::read_dir(work.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    assert_eq!(traces.len(), 5, "one trace a run: {traces:?}");
    for trace in &traces {
        let t = spex::harness::trace::Trace::read(trace).unwrap();
        assert_eq!(t.header.prompt, "To be", "{}", trace.display());
    }
}
