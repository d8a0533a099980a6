//! The misprediction explorer in the dashboard (key `x`): `spex explain`'s view of one run.
//! In a replay it covers the whole trace, computed once when the replay starts, with the
//! what-if forecasts of other policies (`harness::what_if`); live, the run so far, from the
//! inspector's per-position state. `{` / `}` select a pair, `g` jumps the replay to its next
//! occurrence (`App` turns that into a seek). Drawn by [`draw`] from `App` state alone.

use ratatui::Frame;
use ratatui::layout::{Rect, Size};
use ratatui::style::{Color, Style, Stylize};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, BorderType, Borders, Clear, Paragraph, Wrap};

use super::run_view::RunView;
use crate::engine::policy::PolicyKind;
use crate::harness::explain::{Explanation, Sighting};
use crate::harness::trace::Trace;
use crate::harness::what_if::{RecordedRun, WhatIf};

/// How many pairs the explorer lists.
pub const PAIRS: usize = 8;

/// The explorer's cursor: the selected pair, and which of its occurrences `g` goes to next.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExplorerCursor {
    pub pair: usize,
    pub occurrence: usize,
}

/// What a replay knows about its whole trace: the explanation, and what other policies would
/// have done (or why that cannot be said of this trace).
#[derive(Debug, Clone, PartialEq)]
pub struct Analysis {
    pub explanation: Explanation,
    pub what_if: Result<WhatIf, String>,
}

impl Analysis {
    /// Explains `trace` (read from `file`) and replays it under the policies a looped model of
    /// its depth can run.
    pub fn of(trace: &Trace, file: &str) -> Self {
        let explanation = Explanation::of(std::slice::from_ref(trace), PAIRS);
        let passes = trace.header.model.passes;
        let policies: Vec<PolicyKind> = ["speed", "dual", "loopspec", "loopspec:d2=2"]
            .iter()
            .filter_map(|name| name.parse::<PolicyKind>().ok())
            .filter(|p| p.build().check(passes).is_ok())
            .collect();
        let what_if = RecordedRun::of(trace, std::path::Path::new(file))
            .and_then(|run| WhatIf::of(vec![run], &policies))
            .map_err(|e| e.to_string());
        Self {
            explanation,
            what_if,
        }
    }
}

/// The explanation of a live run so far, from the inspector's state: each committed
/// position's last readout at every pass before R.
pub fn of_run(run: &RunView, passes: usize) -> Explanation {
    let sightings = run.positions.iter().flat_map(|(&pos, view)| {
        let committed = view.committed.as_ref().map(|c| &c.1);
        (view.readouts.iter().enumerate()).filter_map(move |(index, readout)| {
            let (step, said) = readout.as_ref()?;
            Some(Sighting {
                trace: 0,
                pos,
                pass: index + 1,
                step: *step,
                said,
                committed: committed?,
                exit_probability: None,
            })
        })
    });
    Explanation::of_sightings(passes, sightings, PAIRS)
}

/// What the explorer explains.
#[derive(Debug, Clone, Copy)]
pub enum Explained<'a> {
    /// A replay's analysis of its whole trace.
    Replay(&'a Analysis),
    /// The live run so far (none yet: an empty explanation), on a model of R `passes`.
    Live {
        /// The run, once one started.
        run: Option<&'a RunView>,
        /// R.
        passes: usize,
    },
}

/// Draws the explorer over the dashboard.
pub fn draw(frame: &mut Frame, area: Rect, explained: Explained<'_>, cursor: ExplorerCursor) {
    let live;
    let explanation = match explained {
        Explained::Replay(a) => &a.explanation,
        Explained::Live { run, passes } => {
            let empty = RunView::default();
            live = of_run(run.unwrap_or(&empty), passes);
            &live
        }
    };
    let mut lines = summary(explanation);
    lines.push(Line::from(
        "most frequent: pass r said X, the committed token was Y".bold(),
    ));
    for (i, p) in explanation.pairs.iter().enumerate() {
        let selected = i == cursor.pair;
        let text = format!(
            "{} {:>4}×  pass {}  {:<14} → {:<14}",
            if selected { "▶" } else { " " },
            p.count,
            p.pass,
            format!("{:?}", p.said.text),
            format!("{:?}", p.committed.text)
        );
        let style = match selected {
            true => Style::new().fg(Color::Black).bg(Color::Cyan),
            false => Style::new(),
        };
        lines.push(Line::styled(text, style));
    }
    if let Some(p) = explanation.pairs.get(cursor.pair) {
        let steps: Vec<String> = (p.occurrences.iter().take(12))
            .map(|o| o.step.to_string())
            .collect();
        lines.push(Line::from(format!("  at steps {}", steps.join(", "))).dark_gray());
    }
    if let Explained::Replay(a) = explained {
        lines.extend(what_if_lines(&a.what_if));
    }
    let popup = super::centered(area, Size::new(84, lines.len() as u16 + 2));
    let title = match explained {
        Explained::Replay(_) => "explorer: the whole trace · { } select · g go to it · x closes",
        Explained::Live { .. } => "explorer: this run so far · { } select · x closes",
    };
    let block = Block::default()
        .borders(Borders::ALL)
        .border_type(BorderType::Rounded)
        .border_style(Style::new().fg(Color::Cyan))
        .title(title);
    frame.render_widget(Clear, popup);
    let text = Paragraph::new(lines).wrap(Wrap { trim: false });
    frame.render_widget(text.block(block), popup);
}

/// Disagreement by pass, and the confidence of disagreeing and agreeing readouts.
fn summary(e: &Explanation) -> Vec<Line<'static>> {
    let by_pass: Vec<String> = (e.by_pass.iter().enumerate())
        .map(|(i, t)| format!("{} {:.1}%", i + 1, 100.0 * t.rate()))
        .collect();
    vec![
        Line::from(format!(
            "disagree by pass: {} · {} positions",
            by_pass.join(" · "),
            e.positions,
        )),
        Line::from(format!(
            "mean margin {:.2} logits when they disagree, {:.2} when they agree",
            e.disagreeing.mean_margin, e.agreeing.mean_margin
        )),
    ]
}

/// The what-if table's lines: each policy's steps and predicted speedup.
fn what_if_lines(what_if: &Result<WhatIf, String>) -> Vec<Line<'static>> {
    let w = match what_if {
        Ok(w) => w,
        Err(e) => return vec![Line::from(format!("what-if: {e}")).dark_gray()],
    };
    let mut lines = vec![Line::from(
        "what-if, from this run's readouts and step costs:".bold(),
    )];
    for f in &w.forecasts {
        let recorded = f
            .recorded_steps
            .map_or(String::new(), |r| format!(" (recorded {r})"));
        lines.push(Line::from(vec![
            Span::raw(format!(
                "  {:<16} {:>6} steps{recorded}  ",
                f.policy, f.steps
            )),
            Span::styled(
                format!("{:.2}×", f.speedup),
                Style::new().fg(Color::Cyan).bold(),
            ),
        ]));
    }
    lines
}
