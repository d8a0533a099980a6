//! Unit tests of `App::update`: every key, every engine event, and a long random sequence of
//! keys, resizes and engine events that must never panic.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

/// The keys: random ones never panic, and every bound key is listed and acts.
#[path = "tui_app/keys.rs"]
mod keys;

use std::sync::mpsc;

use common::{Variant, random_model, spec};
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers, MouseEvent, MouseEventKind};
use spex::engine::DecodeOptions;
use spex::engine::exit_gate::ExitThreshold;
use spex::engine::policy::PolicyKind;
use spex::engine::rng::SplitMix;
use spex::harness::race::{Lane, RaceControl, RaceEvent, run_race};
use spex::tui::app::{Agreement, App, Cell, CellKind, Command, Focus, ModelInfo, Msg, RATES, Seek};

fn info() -> ModelInfo {
    ModelInfo {
        name: "test".into(),
        passes: 4,
        layers: 2,
        device: "cpu".into(),
        dtype: "f32".into(),
        policy: spex::engine::PolicyKind::Speed,
    }
}

fn key(code: KeyCode) -> Msg {
    Msg::Key(KeyEvent::new(code, KeyModifiers::NONE))
}

/// A finished race's events, from a real random checkpoint.
fn race_events(prompt: &str) -> Vec<RaceEvent> {
    race_events_with(prompt, PolicyKind::Speed)
}

fn race_events_with(prompt: &str, policy: PolicyKind) -> Vec<RaceEvent> {
    race_events_sampled(prompt, policy, spex::engine::Sampling::GREEDY)
}

fn race_events_sampled(
    prompt: &str,
    policy: PolicyKind,
    sampling: spex::engine::Sampling,
) -> Vec<RaceEvent> {
    let options = DecodeOptions {
        max_tokens: 20,
        context: 128,
        sampling,
        exit_threshold: None,
    };
    race_events_options(prompt, policy, options)
}

fn race_events_options(prompt: &str, policy: PolicyKind, options: DecodeOptions) -> Vec<RaceEvent> {
    let (_dir, loaded) = random_model(&spec(2, 4, Variant::Tied, 5));
    let (_control_tx, control_rx) = mpsc::channel();
    let mut events = Vec::new();
    run_race(&loaded, prompt, policy, options, control_rx, |e| {
        events.push(e);
        true
    });
    events
}

fn running_app() -> App {
    let mut app = App::new(info(), None, (120, 40));
    for c in "To be".chars() {
        app.update(key(KeyCode::Char(c)));
    }
    let cmds = app.update(key(KeyCode::Enter));
    assert_eq!(
        cmds[0],
        Command::StartRace {
            prompt: "To be".into()
        }
    );
    app
}

#[test]
fn typing_and_editing_the_prompt() {
    let mut app = App::new(info(), None, (120, 40));
    assert_eq!(app.focus, Focus::Prompt);
    for c in "héllo 🎭".chars() {
        app.update(key(KeyCode::Char(c)));
    }
    assert_eq!(app.prompt, "héllo 🎭");
    app.update(key(KeyCode::Left));
    app.update(key(KeyCode::Backspace));
    assert_eq!(app.prompt, "héllo🎭");
    app.update(key(KeyCode::Home));
    app.update(key(KeyCode::Delete));
    assert_eq!(app.prompt, "éllo🎭");
    app.update(key(KeyCode::End));
    app.update(key(KeyCode::Char('!')));
    assert_eq!(app.prompt, "éllo🎭!");
    app.update(key(KeyCode::Right));
    assert_eq!(app.cursor, 6);
    // q types while editing; it does not quit.
    app.update(key(KeyCode::Char('q')));
    assert!(!app.should_quit);
}

const SAMPLE: &str = "To be, or not to be, that is the question:";

/// A paste is one update at the cursor, whatever its length: it replaces a sample prompt,
/// keeps its lines (CRLF or CR as newlines), and does nothing outside the editor.
#[test]
fn a_paste_is_one_edit_at_the_cursor() {
    let mut app = App::new(info(), None, (120, 40)).with_sample_prompt(SAMPLE);
    let long = "x".repeat(15_000);
    assert!(app.update(Msg::Paste(long.clone())).is_empty());
    assert_eq!((app.prompt.len(), app.cursor), (15_000, 15_000));
    assert!(!app.prompt_is_sample);
    app.update(key(KeyCode::Home));
    app.update(Msg::Paste("a\r\nb\rc ".into()));
    assert_eq!(app.prompt, format!("a\nb\nc {long}"));
    assert_eq!(app.cursor, 6);
    app.update(key(KeyCode::Esc));
    app.update(Msg::Paste("ignored".into()));
    assert!(!app.prompt.contains("ignored"));
}

#[test]
fn the_sample_prompt_runs_on_enter() {
    let mut app = App::new(info(), None, (120, 40)).with_sample_prompt(SAMPLE);
    assert!(app.prompt_is_sample);
    let cmds = app.update(key(KeyCode::Enter));
    assert_eq!(
        cmds[0],
        Command::StartRace {
            prompt: SAMPLE.into()
        }
    );
    assert!(!app.prompt_is_sample);
}

#[test]
fn typing_or_deleting_replaces_the_sample_and_moving_keeps_it() {
    let typed = |first: KeyCode| {
        let mut app = App::new(info(), None, (120, 40)).with_sample_prompt(SAMPLE);
        app.update(key(first));
        app
    };
    let app = typed(KeyCode::Char('H'));
    assert_eq!((app.prompt.as_str(), app.cursor), ("H", 1));
    assert!(!app.prompt_is_sample);
    for delete in [KeyCode::Backspace, KeyCode::Delete] {
        assert_eq!(typed(delete).prompt, "");
    }
    let mut app = typed(KeyCode::Left);
    assert!(!app.prompt_is_sample);
    app.update(key(KeyCode::Char('!')));
    assert_eq!(app.prompt, "To be, or not to be, that is the question!:");
    // Outside the editor, Enter runs the prompt too.
    let mut app = App::new(info(), None, (120, 40)).with_sample_prompt(SAMPLE);
    app.update(key(KeyCode::Esc));
    assert_ne!(app.focus, Focus::Prompt);
    let cmds = app.update(key(KeyCode::Enter));
    assert!(matches!(cmds[0], Command::StartRace { .. }));
}

#[test]
fn empty_prompt_is_an_error_line_not_a_run() {
    let mut app = App::new(info(), None, (120, 40));
    let cmds = app.update(key(KeyCode::Enter));
    assert!(cmds.is_empty());
    assert!(app.error.as_deref().unwrap().contains("empty"));
    assert!(app.run.is_none());
}

#[test]
fn control_keys_send_race_controls() {
    let mut app = running_app();
    assert_eq!(app.focus, Focus::Speculative);
    assert_eq!(
        app.update(key(KeyCode::Char(' '))),
        vec![Command::Control(RaceControl::Pause)]
    );
    assert!(app.paused);
    assert_eq!(
        app.update(key(KeyCode::Char(' '))),
        vec![Command::Control(RaceControl::Resume)]
    );
    assert_eq!(
        app.update(key(KeyCode::Char('n'))),
        vec![
            Command::Control(RaceControl::Pause),
            Command::Control(RaceControl::Step)
        ]
    );
    let last = RATES.len() - 1;
    assert_eq!(app.rate_index, last);
    assert_eq!(
        app.update(key(KeyCode::Char('-'))),
        vec![Command::Control(RaceControl::Rate(RATES[last - 1]))]
    );
    for _ in 0..20 {
        app.update(key(KeyCode::Char('-')));
    }
    assert_eq!(app.rate(), Some(1.0));
    app.update(key(KeyCode::Char('+')));
    assert_eq!(app.rate(), Some(2.0));
    let cmds = app.update(key(KeyCode::Char('r')));
    assert!(matches!(cmds[0], Command::StartRace { .. }));
    assert_eq!(cmds[1], Command::Control(RaceControl::Rate(Some(2.0))));
}

#[test]
fn focus_scroll_help_and_quit() {
    let mut app = running_app();
    app.update(key(KeyCode::Tab));
    assert_eq!(app.focus, Focus::Baseline);
    app.update(key(KeyCode::PageDown));
    app.update(key(KeyCode::Down));
    assert_eq!(app.run.as_ref().unwrap().baseline.scroll, 11);
    app.update(key(KeyCode::Up));
    app.update(Msg::Mouse(MouseEvent {
        kind: MouseEventKind::ScrollDown,
        column: 0,
        row: 0,
        modifiers: KeyModifiers::NONE,
    }));
    assert_eq!(app.run.as_ref().unwrap().baseline.scroll, 13);
    app.update(key(KeyCode::PageUp));
    app.update(key(KeyCode::PageUp));
    assert_eq!(app.run.as_ref().unwrap().baseline.scroll, 0);
    app.update(key(KeyCode::Tab));
    assert_eq!(app.focus, Focus::Flips);
    app.update(key(KeyCode::Tab));
    assert_eq!(app.focus, Focus::Prompt);
    app.update(key(KeyCode::Esc));
    assert_eq!(app.focus, Focus::Speculative);
    app.update(key(KeyCode::Char('?')));
    assert!(app.show_help);
    app.update(key(KeyCode::Char('q')));
    assert!(
        !app.show_help && !app.should_quit,
        "a key closes help first"
    );
    app.update(key(KeyCode::Char('e')));
    assert_eq!(app.focus, Focus::Prompt);
    app.update(Msg::Resize(50, 10));
    assert_eq!(app.size, (50, 10));
    let cmds = app.update(Msg::Key(KeyEvent::new(
        KeyCode::Char('c'),
        KeyModifiers::CONTROL,
    )));
    assert_eq!(cmds, vec![Command::Quit]);
    assert!(app.should_quit);
    let mut app = running_app();
    assert_eq!(app.update(key(KeyCode::Char('q'))), vec![Command::Quit]);
}

#[test]
fn engine_events_fill_lanes_pipeline_flips_and_kv() {
    let mut app = running_app();
    let events = race_events("To be");
    assert!(matches!(events.last(), Some(RaceEvent::Done)));
    app.update(Msg::Engine(events));
    let run = app.run.as_ref().unwrap();
    assert!(run.done);
    assert_eq!(run.speculative.tokens.len(), 20);
    assert_eq!(run.speculative.tokens, run.baseline.tokens);
    assert_eq!(run.agreement(), Agreement::Same(20));
    assert!(run.speculative.finished.is_some() && run.baseline.finished.is_some());
    assert!(run.speedup().unwrap() > 0.0);
    assert!(!run.columns.is_empty());
    assert_eq!(run.kv.len(), 4);
    assert!(!run.flips.is_empty(), "random weights flip");
    let kinds: Vec<&CellKind> = run
        .columns
        .iter()
        .flat_map(|c| c.cells.iter().flatten().map(|cell| &cell.kind))
        .collect();
    assert!(kinds.iter().any(|k| matches!(k, CellKind::Flipped { .. })));
    assert!(kinds.iter().any(|k| matches!(k, CellKind::Verified)));
    assert!(!run.speedup_history.is_empty());
}

#[test]
fn a_dual_race_shows_both_candidates_and_counts_second_proposals() {
    let mut app = running_app();
    app.update(Msg::Engine(race_events_with("To be", PolicyKind::DUAL)));
    let run = app.run.as_ref().unwrap();
    assert_eq!(run.agreement(), Agreement::Same(20));
    assert!(
        run.speculative.stats.second_proposals > 0,
        "random weights are near ties"
    );
    let both = run
        .columns
        .iter()
        .flat_map(|c| c.cells.iter().flatten())
        .filter(|cell| cell.text.contains('|'))
        .count();
    assert!(
        both > 0,
        "a step with two candidates shows both in one cell"
    );
}

/// A self-draft race: drafting steps run one row at a time, verification steps run the whole
/// group at one pass (one cell that counts its tokens), and a rejection at pass R shows as a
/// flipped group cell followed by flushed drafts.
#[test]
fn a_self_draft_race_draws_its_groups_and_where_a_rejection_cut() {
    let mut app = running_app();
    let policy = "self-draft:d=1:g=3".parse().expect("a valid policy");
    app.update(Msg::Engine(race_events_with("To be", policy)));
    let run = app.run.as_ref().unwrap();
    assert_eq!(run.agreement(), Agreement::Same(20));
    let cells: Vec<&Cell> = (run.columns.iter())
        .flat_map(|c| c.cells.iter().flatten())
        .collect();
    let groups = cells.iter().filter(|c| c.tokens > 1).count();
    assert!(groups > 0, "a verification step runs a group at one pass");
    assert!(cells.iter().all(|c| c.tokens <= 4), "γ + 1 tokens at most");
    let cut = (cells.iter())
        .filter(|c| c.tokens > 1 && matches!(c.kind, CellKind::Flipped { .. }))
        .count();
    assert!(cut > 0, "random weights reject drafts");
    let group = cells.iter().find(|c| c.tokens > 1).expect("a group");
    assert!(group.label().starts_with(&format!("{}×", group.tokens)));
}

#[test]
fn an_error_event_is_shown_and_ends_nothing_else() {
    let mut app = running_app();
    app.update(Msg::Engine(vec![
        RaceEvent::Error("prompt: 900 tokens do not fit".into()),
        RaceEvent::Done,
    ]));
    assert!(app.error.as_deref().unwrap().contains("do not fit"));
    assert!(app.run.as_ref().unwrap().done);
    assert!(!app.should_quit);
}

#[test]
fn lanes_that_differ_are_reported() {
    let mut app = running_app();
    let mut events = race_events("Shall");
    // Tamper with one SPEED commit to check the comparison itself.
    for e in &mut events {
        if let RaceEvent::Decode {
            lane: Lane::Speculative,
            event: spex::engine::DecodeEvent::Step(s),
        } = e
            && let Some(c) = s.committed.first_mut()
        {
            c.token.id += 1;
            break;
        }
    }
    app.update(Msg::Engine(events));
    assert!(matches!(
        app.run.as_ref().unwrap().agreement(),
        Agreement::Differ(_)
    ));
}

#[test]
fn temperature_and_seed_keys_change_the_rule_and_rerun() {
    let mut app = running_app();
    let cmds = app.update(key(KeyCode::Char('t')));
    let Command::SetSampling(hot) = cmds[0] else {
        panic!("{cmds:?}")
    };
    assert_eq!(hot.temperature, 0.3);
    assert!(matches!(cmds[1], Command::StartRace { .. }));
    app.update(key(KeyCode::Char('t')));
    assert_eq!(app.sampling.temperature, 0.5);
    let seed = app.sampling.seed;
    let cmds = app.update(key(KeyCode::Char('s')));
    assert_ne!(app.sampling.seed, seed);
    assert_eq!(cmds[0], Command::SetSampling(app.sampling));
    for _ in 0..20 {
        app.update(key(KeyCode::Char('T')));
    }
    assert!(
        app.sampling.is_greedy(),
        "T steps down to greedy and stays there"
    );
    for _ in 0..20 {
        app.update(key(KeyCode::Char('t')));
    }
    assert_eq!(app.sampling.temperature, 1.5);
}

#[test]
fn a_sampled_loopspec_race_claims_the_same_distribution_not_the_same_text() {
    let sampling = spex::engine::Sampling {
        temperature: 1.0,
        top_k: None,
        top_p: None,
        seed: 9,
    };
    for (policy, greedy_like) in [(PolicyKind::LOOPSPEC, false), (PolicyKind::Speed, true)] {
        let mut app = running_app();
        app.info.policy = policy;
        app.sampling = sampling;
        app.update(Msg::Engine(race_events_sampled("To be", policy, sampling)));
        let run = app.run.as_ref().unwrap();
        assert!(run.done);
        match app.agreement(run) {
            Agreement::Same(n) => assert!(greedy_like && n == 20, "{policy}: {n}"),
            Agreement::SameDistribution => assert!(!greedy_like, "{policy}"),
            Agreement::Differ(i) => panic!("{policy} differs at {i}"),
            Agreement::Lossy(d) => panic!("{policy} is not lossy: {d:?}"),
        }
    }
}

/// A lossy early exit's race is compared as lossy, never as identical, even where its text
/// happens to keep to the baseline's.
#[test]
fn an_exit_race_is_lossy_not_identical() {
    for rule in ["exit:pass=1", "exit:pass=4"] {
        let policy: PolicyKind = rule.parse().unwrap();
        let mut app = running_app();
        app.info.policy = policy;
        app.update(Msg::Engine(race_events_with("To be", policy)));
        let run = app.run.as_ref().unwrap();
        assert!(run.done);
        let Agreement::Lossy(d) = app.agreement(run) else {
            panic!("{rule}: {:?}", app.agreement(run));
        };
        assert_eq!(d.of, 20, "{rule}");
        if rule == "exit:pass=4" {
            assert_eq!(
                (d.departs_at, d.agreeing),
                (None, 20),
                "pass R is the baseline"
            );
        }
    }
}

#[test]
fn replay_keys_seek_in_a_replay_and_explain_themselves_live() {
    let mut app = running_app();
    assert!(app.update(key(KeyCode::Left)).is_empty());
    assert!(app.error.as_deref().unwrap_or("").contains("spex replay"));
    app.replay = Some(spex::tui::app::ReplayStatus {
        file: "t.jsonl".into(),
        step: 3,
        steps: 9,
        analysis: None,
    });
    for (code, seek) in [
        (KeyCode::Left, Seek::Back),
        (KeyCode::Home, Seek::Start),
        (KeyCode::End, Seek::End),
    ] {
        let cmds = app.update(key(code));
        assert_eq!(cmds.last(), Some(&Command::Seek(seek)), "{code:?}");
        assert!(app.paused);
    }
    let cmds = app.update(key(KeyCode::Right));
    assert_eq!(cmds.last(), Some(&Command::Control(RaceControl::Step)));
}

#[test]
fn the_inspector_opens_at_the_last_token_and_moves_within_the_output() {
    let mut app = running_app();
    app.update(Msg::Engine(race_events("To be")));
    let n = app.run.as_ref().unwrap().speculative.tokens.len();
    app.update(key(KeyCode::Char('i')));
    assert_eq!(app.inspect, Some(n - 1));
    app.update(key(KeyCode::Char(']')));
    assert_eq!(app.inspect, Some(n - 1), "clamped at the last token");
    for _ in 0..3 {
        app.update(key(KeyCode::Char('[')));
    }
    assert_eq!(app.inspect, Some(n - 4));
    let run = app.run.as_ref().unwrap();
    let view = &run.positions[&(run.first_pos + n - 4)];
    let (_, token, _, _) = view
        .committed
        .as_ref()
        .expect("an output token is committed");
    assert_eq!(token.id, run.speculative.tokens[n - 4]);
    assert!(
        view.readouts
            .iter()
            .flatten()
            .all(|(_, p)| p.top.len() == 5)
    );
    assert!(
        view.readouts.last().unwrap().is_some(),
        "pass R read it out"
    );
    app.update(key(KeyCode::Char('i')));
    assert_eq!(app.inspect, None);
}

#[test]
fn p_switches_presenter_mode_and_presenting_starts_at_two_steps_a_second() {
    let mut app = running_app();
    assert!(!app.present);
    app.update(key(KeyCode::Char('p')));
    assert!(app.present);
    app.update(key(KeyCode::Char('p')));
    assert!(!app.present);
    let app = App::new(info(), Some("To be".into()), (100, 32)).presenting();
    assert!(app.present);
    assert_eq!(app.rate(), Some(2.0));
}

/// Races "To be" greedily with `--exit-threshold` at `threshold` (`None`: the checkpoint's).
fn gate_marks(threshold: Option<f32>) -> (App, usize) {
    let threshold = threshold.map(|t| ExitThreshold::new(t).unwrap());
    let options = DecodeOptions {
        exit_threshold: threshold,
        ..DecodeOptions::greedy(20, 128)
    };
    let mut app = running_app();
    app.update(Msg::Engine(race_events_options(
        "To be",
        PolicyKind::Speed,
        options,
    )));
    let run = app.run.as_ref().unwrap();
    let threshold = run
        .exit_threshold
        .expect("the random checkpoint has a gate");
    let mut marked = 0;
    for column in &run.columns {
        for (index, cell) in column.cells.iter().enumerate() {
            let Some(cell) = cell else { continue };
            let gate = run.positions[&(cell.pos + 1)].gate_exit(threshold);
            let early = gate.filter(|p| p.number() < run.kv.len());
            let here = early == Some(spex::engine::Pass::from_index(index));
            assert_eq!(
                cell.gate_exit,
                here,
                "step {} pass {}",
                column.step,
                index + 1
            );
            marked += usize::from(here);
        }
    }
    (app, marked)
}

/// The pipeline marks the cell where Ouro's exit gate would stop each token early (the first
/// pass before R whose chance of having exited reaches the run's threshold), from the λ the
/// rows report. At `--exit-threshold 0.5` the random checkpoint's gate stops some tokens
/// early; at its config's own threshold, 1.0, every token runs every pass and none is marked.
#[test]
fn the_pipeline_marks_where_the_gate_would_exit() {
    let (app, marked) = gate_marks(Some(0.5));
    assert_eq!(
        app.run.as_ref().unwrap().exit_threshold,
        ExitThreshold::new(0.5)
    );
    assert!(marked > 0, "no cell marked");
    let (app, marked) = gate_marks(None);
    assert_eq!(
        app.run.as_ref().unwrap().exit_threshold,
        Some(ExitThreshold::EVERY_PASS),
        "the checkpoint's early_exit_threshold"
    );
    assert_eq!(marked, 0);
}
