//! insta snapshots of every panel and of the whole screen, drawn with ratatui's TestBackend
//! from hand-made state: the too-small message and the help overlay included.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

use std::collections::VecDeque;
use std::time::Duration;

use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::layout::Rect;
use spex::engine::events::FinishReason;
use spex::engine::kv_cache::PassOccupancy;
use spex::harness::metrics::RunStats;
use spex::tui::app::{
    App, Cell, CellKind, FlipEntry, Focus, LaneView, ModelInfo, RunView, StepColumn,
};
use spex::tui::ui::{Panel, draw, draw_panel};

fn stats(
    tokens: usize,
    millis: u64,
    flips: Vec<usize>,
    checks: Vec<usize>,
    depth: Vec<usize>,
) -> RunStats {
    RunStats {
        passes: 4,
        tokens,
        decode_compute: Duration::from_millis(millis),
        steps: tokens as u64 * 2,
        rows: tokens * 4,
        rows_wasted: tokens / 2,
        flips_per_pass: flips,
        checks_per_pass: checks,
        accepted_by_depth: depth,
        gate_checks: 0,
        gate_opens: 0,
        second_proposals: 0,
        accepted_second: 0,
    }
}

fn cell(text: &str, pos: usize, kind: CellKind) -> Option<Cell> {
    Some(Cell {
        text: text.into(),
        pos,
        kind,
        tokens: 1,
        gate_exit: false,
    })
}

/// Twelve steps of four rows, a flip and its flush every fifth, a row missing every seventh.
fn columns() -> VecDeque<StepColumn> {
    let words = [" that", " is", " the", " question", ":"];
    (0..12u64)
        .map(|s| {
            let p = 10 + s as usize;
            let w = |i: usize| words[(s as usize + i) % words.len()];
            let mut cells = vec![
                cell(w(0), p, CellKind::Speculative),
                cell(w(1), p - 1, CellKind::Speculative),
                cell(w(2), p - 2, CellKind::Speculative),
                cell(w(3), p - 3, CellKind::Verified),
            ];
            if s % 5 == 3 {
                cells[1] = cell(
                    w(1),
                    p - 1,
                    CellKind::Flipped {
                        old: " is".into(),
                        new: " was".into(),
                    },
                );
                cells[0] = cell(w(0), p, CellKind::Flushed);
            }
            if s % 7 == 6 {
                cells[3] = None;
            }
            StepColumn {
                step: 40 + s,
                cells,
            }
        })
        .collect()
}

fn app() -> App {
    let info = ModelInfo {
        name: "shakespeare-r4k4".into(),
        passes: 4,
        layers: 4,
        device: "cpu".into(),
        dtype: "f32".into(),
        policy: spex::engine::PolicyKind::Speed,
    };
    let mut app = App::new(info, Some("To be, or not to be".into()), (100, 32));
    app.focus = Focus::Speculative;
    let columns = columns();
    let flips = (0..5)
        .map(|i| FlipEntry {
            step: 40 + i * 5,
            pos: 12 + i as usize,
            pass: 2 + (i as usize % 3),
            old: " is".into(),
            new: " was".into(),
            context: "or not to be".into(),
        })
        .collect();
    app.run = Some(RunView {
        prompt: "To be, or not to be".into(),
        speculative: LaneView {
            text: ", that is the question:\nWhether 'tis nobler in the mind to suffer".into(),
            tokens: (0..30).collect(),
            stats: stats(
                29,
                120,
                vec![0, 3, 2, 1],
                vec![0, 28, 29, 29],
                vec![22, 4, 2, 1],
            ),
            finished: None,
            scroll: 0,
        },
        baseline: LaneView {
            text: ", that is the question:".into(),
            tokens: (0..12).collect(),
            stats: stats(11, 118, vec![0; 4], vec![0; 4], vec![0, 0, 0, 11]),
            finished: Some(FinishReason::MaxTokens),
            scroll: 0,
        },
        columns,
        flips,
        kv: (0..4)
            .map(|p| PassOccupancy {
                committed: 36 - p,
                speculative: 3 - p.min(3),
                capacity: 512,
            })
            .collect(),
        speedup_history: (0..60).map(|i| 1.0 + (i as f64 / 20.0).min(1.6)).collect(),
        ceiling: Some(2.71),
        done: false,
        ..RunView::default()
    });
    app
}

fn render(width: u16, height: u16, f: impl FnOnce(&mut ratatui::Frame)) -> String {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
    terminal.draw(f).unwrap();
    terminal.backend().to_string()
}

#[test]
fn whole_screen() {
    let app = app();
    insta::assert_snapshot!(render(100, 32, |f| draw(f, &app)));
}

#[test]
fn every_panel() {
    let app = app();
    for (panel, w, h) in [
        (Panel::Prompt, 60, 3),
        (Panel::Speculative, 50, 7),
        (Panel::Baseline, 50, 7),
        (Panel::Pipeline, 100, 7),
        (Panel::Flips, 50, 9),
        (Panel::Kv, 30, 9),
        (Panel::Stats, 45, 9),
        (Panel::Footer, 100, 1),
    ] {
        let out = render(w, h, |f| draw_panel(f, Rect::new(0, 0, w, h), &app, panel));
        insta::assert_snapshot!(format!("panel_{panel:?}").to_lowercase(), out);
    }
}

/// A draft-then-verify run in the pipeline panel: one-row drafting steps at pass 1, then the
/// group of five at each deeper pass as one cell (`5×…`); at pass 4 the first group keeps
/// every draft, the second is cut by a rejection.
#[test]
fn draft_groups_in_the_pipeline() {
    let mut app = app();
    let group = |text: &str, kind: CellKind| cell(text, 20, kind).map(|c| Cell { tokens: 5, ..c });
    let mut columns = VecDeque::new();
    for round in 0..2u64 {
        let first = 40 + round * 8;
        for (k, word) in [" that", " is", " the", " question", ":"]
            .iter()
            .enumerate()
        {
            let mut cells = vec![cell(word, 20 + k, CellKind::Speculative), None, None, None];
            if k == 0 {
                cells[0] = cell(word, 20, CellKind::Verified);
            }
            columns.push_back(StepColumn {
                step: first + k as u64,
                cells,
            });
        }
        for pass in 1..4 {
            let last = pass == 3;
            let kind = match (last, round) {
                (true, 0) => CellKind::Verified,
                (true, _) => CellKind::Flipped {
                    old: " is".into(),
                    new: " was".into(),
                },
                _ => CellKind::Speculative,
            };
            let mut cells = vec![None; 4];
            cells[pass] = group(" that", kind);
            columns.push_back(StepColumn {
                step: first + 4 + pass as u64,
                cells,
            });
        }
    }
    app.run.as_mut().expect("a run").columns = columns;
    let out = render(140, 7, |f| {
        draw_panel(f, Rect::new(0, 0, 140, 7), &app, Panel::Pipeline)
    });
    insta::assert_snapshot!(out);
}

#[test]
fn too_small_message() {
    let app = app();
    insta::assert_snapshot!(render(60, 12, |f| draw(f, &app)));
}

/// The first screen: the sample prompt ready in the editor, and the hint that says so.
#[test]
fn first_screen() {
    let info = app().info;
    let app = App::new(info, None, (100, 12))
        .with_sample_prompt("To be, or not to be, that is the question:");
    insta::assert_snapshot!(render(100, 3, |f| draw_panel(
        f,
        Rect::new(0, 0, 100, 3),
        &app,
        Panel::Prompt
    )));
}

/// The loading screen a large checkpoint shows before the dashboard opens: the model, the
/// bytes read and the rate, and the gauge.
#[test]
fn loading_screen() {
    use spex::engine::checkpoint::LoadProgress;
    use spex::tui::loading::draw_loading;
    let reading = LoadProgress::Reading {
        read_bytes: 1_250_000_000,
        total_bytes: 2_500_000_000,
    };
    let elapsed = Duration::from_millis(2500);
    insta::assert_snapshot!(render(80, 9, |f| draw_loading(
        f,
        "ouro-1.4b",
        Some(reading),
        elapsed
    )));
}

/// The same screen while a hub checkpoint that was not cached downloads first.
#[test]
fn downloading_screen() {
    use spex::engine::checkpoint::LoadProgress;
    use spex::tui::loading::draw_loading;
    let downloading = LoadProgress::Downloading {
        done_bytes: 700_000_000,
        total_bytes: 2_800_000_000,
    };
    insta::assert_snapshot!(render(80, 9, |f| draw_loading(
        f,
        "ByteDance/Ouro-1.4B",
        Some(downloading),
        Duration::from_secs(30)
    )));
}

#[test]
fn help_overlay() {
    let mut app = app();
    app.show_help = true;
    insta::assert_snapshot!(render(100, 32, |f| draw(f, &app)));
}

#[test]
fn error_line_and_editing() {
    let mut app = app();
    app.focus = Focus::Prompt;
    app.error = Some("prompt: 900 tokens do not fit the context of 512 positions".into());
    insta::assert_snapshot!(render(100, 3, |f| draw_panel(
        f,
        Rect::new(0, 0, 100, 3),
        &app,
        Panel::Prompt
    )));
}

#[test]
fn dual_lane_with_two_candidates_in_one_cell() {
    let mut app = app();
    app.info.policy = spex::engine::PolicyKind::DUAL;
    let run = app.run.as_mut().unwrap();
    let last = run.columns.back_mut().unwrap();
    last.cells[0] = cell(" the| a", 21, CellKind::Speculative);
    run.speculative.stats.second_proposals = 12;
    run.speculative.stats.accepted_second = 4;
    for (panel, w, h) in [
        (Panel::Speculative, 50, 7),
        (Panel::Pipeline, 100, 7),
        (Panel::Stats, 60, 9),
    ] {
        let out = render(w, h, |f| draw_panel(f, Rect::new(0, 0, w, h), &app, panel));
        insta::assert_snapshot!(format!("dual_{panel:?}").to_lowercase(), out);
    }
}

/// A lossy early-exit lane says so where the others say identical: where its text departs
/// and how much of it agrees.
#[test]
fn a_lossy_lane_is_marked_lossy_in_the_stats() {
    let mut app = app();
    app.info.policy = "exit:pass=1".parse().unwrap();
    let run = app.run.as_mut().unwrap();
    run.speculative.tokens = vec![0, 1, 2, 9, 4, 5, 9, 7, 8, 9, 10, 11, 12];
    let out = render(60, 9, |f| {
        draw_panel(f, Rect::new(0, 0, 60, 9), &app, Panel::Stats)
    });
    assert!(
        out.contains("≠ LOSSY: departs at token 3, 83% agree"),
        "{out}"
    );
    insta::assert_snapshot!(out);
}

#[test]
fn footer_names_the_sampling_rule() {
    let mut app = app();
    app.sampling = spex::engine::Sampling {
        temperature: 0.8,
        top_k: None,
        top_p: Some(0.9),
        seed: 7,
    };
    let out = render(130, 1, |f| {
        draw_panel(f, Rect::new(0, 0, 130, 1), &app, Panel::Footer)
    });
    assert!(out.contains("T 0.8 · top-p 0.9 · seed 7"), "{out}");
    insta::assert_snapshot!(out);
}

/// The inspector over a hand-made position: four passes' readouts, a flip, the commit, and the
/// pass where the gate stops the token at the run's threshold (0.5: pass 3).
/// The snapshot app with per-position readouts at position 16: pass 1 said " a", the
/// deeper passes and the commit " the".
fn inspected_app() -> App {
    use spex::engine::Pass;
    use spex::engine::events::{Prediction, Ranked, Token};
    use spex::tui::inspector::PositionView;
    let id = |text: &str| {
        [" a", " the", " my", " thy"]
            .iter()
            .position(|&t| t == text)
    };
    let token = |id: u32, text: &str| Token {
        id,
        text: text.into(),
    };
    let word = |text: &str| token(id(text).map_or(9, |i| i as u32 + 1), text);
    let readout = |step: u64, tops: &[(&str, f32)]| {
        let top: Vec<Ranked> = (tops.iter())
            .map(|&(t, prob)| Ranked {
                token: word(t),
                prob,
            })
            .collect();
        let p = Prediction {
            token: top[0].token.clone(),
            prob: top[0].prob,
            margin: 0.4,
            top,
        };
        Some((step, p))
    };
    let mut app = app();
    let run = app.run.as_mut().unwrap();
    run.first_pos = 14;
    for (i, word) in [" that", " is", " the", " question", ":"]
        .iter()
        .enumerate()
    {
        let view = run.positions.entry(14 + i).or_default();
        view.committed = Some((20 + i as u64, token(9, word), Pass::FIRST, false));
    }
    let view = PositionView {
        readouts: vec![
            readout(21, &[(" a", 0.31), (" the", 0.29), (" my", 0.1)]),
            readout(22, &[(" the", 0.45), (" a", 0.2), (" thy", 0.05)]),
            readout(23, &[(" the", 0.62), (" a", 0.11)]),
            readout(24, &[(" the", 0.7), (" a", 0.09)]),
        ],
        exit_probabilities: vec![Some(0.05), Some(0.2), Some(0.6), Some(0.9)],
        flips: vec![(22, Pass::FIRST.next(), word(" a"), word(" the"))],
        committed: Some((24, word(" the"), Pass::FIRST.next(), false)),
    };
    run.positions.insert(16, view);
    run.exit_threshold = spex::engine::exit_gate::ExitThreshold::new(0.5);
    app
}

#[test]
fn inspector_overlay() {
    let mut app = inspected_app();
    app.inspect = Some(2);
    insta::assert_snapshot!(render(100, 32, |f| draw(f, &app)));
}

#[test]
fn explorer_overlay_of_a_live_run() {
    let mut app = inspected_app();
    app.explorer = Some(Default::default());
    insta::assert_snapshot!(render(100, 32, |f| draw(f, &app)));
}

#[test]
fn presenter_mode() {
    let mut app = app().presenting();
    app.rate_index = spex::tui::app::RATES
        .iter()
        .position(|&r| r == Some(2.0))
        .unwrap();
    insta::assert_snapshot!("presenter_tall", render(100, 32, |f| draw(f, &app)));
    insta::assert_snapshot!("presenter_short", render(80, 18, |f| draw(f, &app)));
}
