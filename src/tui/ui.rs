//! Draws the dashboard from [`App`] state alone: prompt, the two lanes, the pipeline view, the
//! flip log, KV-cache gauges, statistics and the footer; a help overlay; a too-small message.

use ratatui::Frame;
use ratatui::layout::{Alignment, Constraint, Layout, Rect, Size};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::{Line, Span, Text};
use ratatui::widgets::{Block, BorderType, Borders, Clear, Paragraph, Sparkline, Wrap};

use super::app::{Agreement, App, CellKind, Focus, LaneView, RunView};
use super::keymap::BINDINGS;
use super::run_view::PositionView;
use crate::engine::Pass;

/// Width of one pipeline column (token text plus a space).
const CELL_WIDTH: u16 = 9;
const MIN_WIDTH: u16 = 80;

/// The smallest terminal the layout fits, for a model with `passes` passes.
pub fn min_size(passes: usize) -> Size {
    Size::new(MIN_WIDTH, 3 + 5 + (passes as u16 + 3) + 9 + 1)
}

/// The panels of the screen, each drawable on its own (the snapshot tests do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Panel {
    Prompt,
    Speculative,
    Baseline,
    Pipeline,
    Flips,
    Kv,
    Stats,
    Footer,
}

/// The speculative lane's title: the paper's name for SPEED, the policy's otherwise.
fn lane_title(policy: &str) -> &str {
    if policy == "speed" { "SPEED" } else { policy }
}

/// Draws one panel into `area`.
pub fn draw_panel(frame: &mut Frame, area: Rect, app: &App, panel: Panel) {
    let empty = RunView::default();
    let run = app.run.as_ref().unwrap_or(&empty);
    match panel {
        Panel::Prompt => draw_prompt(frame, area, app),
        Panel::Speculative => draw_lane(
            frame,
            area,
            lane_title(&app.info.policy.to_string()),
            &run.speculative,
            run,
            app.focus == Focus::Speculative,
        ),
        Panel::Baseline => draw_lane(
            frame,
            area,
            "baseline",
            &run.baseline,
            run,
            app.focus == Focus::Baseline,
        ),
        Panel::Pipeline => draw_pipeline(frame, area, app, run),
        Panel::Flips => draw_flips(frame, area, run, app.focus == Focus::Flips),
        Panel::Kv => draw_kv(frame, area, run),
        Panel::Stats => draw_stats(frame, area, run, app),
        Panel::Footer => draw_footer(frame, area, app),
    }
}

/// Draws the whole screen.
pub fn draw(frame: &mut Frame, app: &App) {
    let area = frame.area();
    let least = match app.present {
        true => super::present::min_size(app.info.passes),
        false => min_size(app.info.passes),
    };
    if area.width < least.width || area.height < least.height {
        draw_too_small(frame, area, least);
        return;
    }
    if app.present {
        super::present::draw(frame, app);
        draw_overlays(frame, area, app);
        return;
    }
    let [prompt, lanes, pipeline, bottom, footer] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Min(5),
        Constraint::Length(app.info.passes as u16 + 3),
        Constraint::Length(9),
        Constraint::Length(1),
    ])
    .areas(area);
    let [left, right] = Layout::horizontal([Constraint::Percentage(50); 2]).areas(lanes);
    let [flips, kv, stats] = Layout::horizontal([
        Constraint::Percentage(40),
        Constraint::Percentage(25),
        Constraint::Percentage(35),
    ])
    .areas(bottom);
    for (panel, area) in [
        (Panel::Prompt, prompt),
        (Panel::Speculative, left),
        (Panel::Baseline, right),
        (Panel::Pipeline, pipeline),
        (Panel::Flips, flips),
        (Panel::Kv, kv),
        (Panel::Stats, stats),
        (Panel::Footer, footer),
    ] {
        draw_panel(frame, area, app, panel);
    }
    draw_overlays(frame, area, app);
}

/// The token inspector and the help, over either layout.
fn draw_overlays(frame: &mut Frame, area: Rect, app: &App) {
    if let (Some(at), Some(run)) = (app.inspect, &app.run) {
        draw_inspector(frame, area, run, at);
    }
    if let Some(cursor) = app.explorer {
        use super::explorer::Explained;
        let explained = match app.replay.as_ref().and_then(|r| r.analysis.as_deref()) {
            Some(analysis) => Explained::Replay(analysis),
            None => Explained::Live {
                run: app.run.as_ref(),
                passes: app.info.passes,
            },
        };
        super::explorer::draw(frame, area, explained, cursor);
    }
    if app.show_help {
        draw_help(frame, area);
    }
}

/// The token inspector over the dashboard: the output token at index `at` of the speculative
/// lane, with each pass's top readouts, the step each ran, its flips and how it was committed.
fn draw_inspector(frame: &mut Frame, area: Rect, run: &RunView, at: usize) {
    let pos = run.first_pos + at;
    let view = run.positions.get(&pos).cloned().unwrap_or_default();
    let passes = run.kv.len().max(view.readouts.len());
    // Borders, the context and commit lines, a line per pass, the flips (or "no flips").
    let h = passes as u16 + 4 + view.flips.len().clamp(1, 3) as u16;
    let popup = super::centered(area, Size::new(120, h));
    let mut lines = vec![context_line(run, pos), commit_line(&view, passes)];
    let gates = view.gate_at_passes();
    let stop = (run.exit_threshold).and_then(|t| Some((t, view.gate_exit(t)?)));
    for (i, readout) in view.readouts.iter().enumerate().take(passes) {
        // The gate's exit probability at the pass and by it, before pass R (whose λ is unused),
        // and the pass where the run's threshold stops the token.
        let mut gate = match gates.get(i).filter(|_| i + 1 < passes) {
            Some(g) => format!(
                " · exit {:>3.0}% (by now {:>3.0}%)",
                100.0 * g.exit,
                100.0 * g.by_now
            ),
            None => String::new(),
        };
        if let Some((threshold, _)) = stop.filter(|(_, p)| p.index() == i) {
            gate.push_str(&format!(" · gate stops (T {threshold})"));
        }
        let text = match readout {
            Some((step, p)) => {
                let top: Vec<String> = (p.top.iter())
                    .map(|r| format!("{:?} {:.0}%", r.token.text, 100.0 * r.prob))
                    .collect();
                format!(
                    "pass {} · step {step:>4}{gate} │ {}",
                    i + 1,
                    top.join(" · ")
                )
            }
            None => format!("pass {}{gate} · no readout", i + 1),
        };
        lines.push(Line::from(text));
    }
    if view.flips.is_empty() {
        lines.push(Line::from("no flips"));
    }
    for (step, pass, old, new) in view.flips.iter().take(3) {
        lines.push(Line::from(Span::styled(
            format!(
                "flip at step {step}, pass {pass}: {:?} → {:?}",
                old.text, new.text
            ),
            Style::new().fg(Color::Yellow),
        )));
    }
    let title = format!(
        "inspector: token {} of {} · position {pos} · [ ] move · i closes",
        at + 1,
        run.speculative.tokens.len()
    );
    frame.render_widget(Clear, popup);
    frame.render_widget(Paragraph::new(lines).block(block(&title, true)), popup);
}

/// The inspected token among its neighbours: up to four committed tokens either side.
fn context_line(run: &RunView, pos: usize) -> Line<'static> {
    let text_at = |p: usize| {
        run.positions
            .get(&p)
            .and_then(|v| v.committed.as_ref())
            .map_or(String::new(), |c| c.1.text.clone())
    };
    let before: String = (pos.saturating_sub(4).max(run.first_pos)..pos)
        .map(text_at)
        .collect();
    let after: String = (pos + 1..pos + 5).map(text_at).collect();
    Line::from(vec![
        Span::raw(format!("…{before}")),
        Span::styled(
            format!("[{}]", text_at(pos)),
            Style::new().fg(Color::Cyan).bold(),
        ),
        Span::raw(format!("{after}…")),
    ])
}

/// How the inspected token was committed: at which step, from which proposal.
fn commit_line(view: &PositionView, passes: usize) -> Line<'static> {
    Line::from(match &view.committed {
        Some((step, token, depth, second)) => {
            let source = if *second {
                format!("a second proposal from pass {depth}")
            } else if depth.number() == passes {
                "no proposal survived: committed from pass R".to_string()
            } else {
                format!("the proposal from pass {depth}")
            };
            format!("committed {:?} at step {step}: {source}", token.text)
        }
        None => "not committed yet".to_string(),
    })
}

fn block(title: &str, focused: bool) -> Block<'static> {
    let style = if focused {
        Style::new().fg(Color::Cyan)
    } else {
        Style::new().fg(Color::DarkGray)
    };
    Block::new()
        .borders(Borders::ALL)
        .border_type(BorderType::Rounded)
        .border_style(style)
        .title(Span::styled(
            format!(" {title} "),
            Style::new().add_modifier(Modifier::BOLD),
        ))
}

/// What shows instead of the dashboard while `area` is smaller than `least`.
fn draw_too_small(frame: &mut Frame, area: Rect, least: Size) {
    let text = format!(
        "spex needs a terminal of at least {}×{}; this one is {}×{}. Enlarge it, or press q to quit.",
        least.width, least.height, area.width, area.height
    );
    let p = Paragraph::new(text)
        .wrap(Wrap { trim: true })
        .alignment(Alignment::Center);
    frame.render_widget(p, area);
}

fn draw_prompt(frame: &mut Frame, area: Rect, app: &App) {
    let editing = app.focus == Focus::Prompt;
    let title = match (editing, app.prompt_is_sample) {
        (true, true) => {
            "prompt — Enter runs this sample · type to replace it · Esc, then ? for help"
        }
        (true, false) => "prompt — Enter runs, Tab leaves",
        (false, _) => "prompt — Enter runs it · e edits · ? help",
    };
    let mut b = block(title, editing);
    if let Some(err) = &app.error {
        let err = super::printable(err);
        b = b.title_bottom(Line::from(format!(" {err} ").red().bold()));
    }
    // One line: a pasted newline shows as '?' like the other control characters.
    let prompt = super::printable(&app.prompt).replace('\n', "?");
    let text = match app.prompt_is_sample {
        true => Line::from(prompt.as_str().dark_gray().italic()),
        false => Line::from(prompt.as_str()),
    };
    let p = Paragraph::new(text).block(b);
    frame.render_widget(p, area);
    if editing {
        let before: String = prompt.chars().take(app.cursor).collect();
        let x = area.x + 1 + ratatui::text::Line::from(before).width() as u16;
        frame.set_cursor_position((x.min(area.right().saturating_sub(2)), area.y + 1));
    }
}

fn seconds(d: std::time::Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn draw_lane(
    frame: &mut Frame,
    area: Rect,
    name: &str,
    lane: &LaneView,
    run: &RunView,
    focused: bool,
) {
    let status = if lane.finished.is_some() {
        " · done"
    } else {
        ""
    };
    let title = format!(
        "{name} · {:.1} tok/s · {} · {} tok{status}",
        lane.stats.tokens_per_sec(),
        seconds(lane.stats.decode_compute),
        lane.tokens.len()
    );
    // Prompt (dim) then output, split into lines at newlines.
    let mut lines: Vec<Line> = Vec::new();
    let mut current: Vec<Span> = Vec::new();
    for (chunk, style) in [
        (&run.prompt, Style::new().fg(Color::DarkGray)),
        (&lane.text, Style::new()),
    ] {
        for (i, part) in chunk.split('\n').enumerate() {
            if i > 0 {
                lines.push(Line::from(std::mem::take(&mut current)));
            }
            current.push(Span::styled(super::printable(part), style));
        }
    }
    lines.push(Line::from(current));
    let text = Text::from(lines);
    let p = Paragraph::new(text)
        .wrap(Wrap { trim: false })
        .scroll((lane.scroll, 0))
        .block(block(&title, focused));
    frame.render_widget(p, area);
}

/// Token text made visible in a fixed-width cell: spaces as '·', newlines as '⏎'.
fn cell_text(text: &str, width: usize) -> String {
    let mut out: String = super::visible(text).chars().take(width).collect();
    let used = Line::from(out.clone()).width();
    out.extend(std::iter::repeat_n(' ', width.saturating_sub(used)));
    out
}

fn cell_style(kind: &CellKind) -> Style {
    match kind {
        CellKind::Verified => Style::new().fg(Color::Green),
        CellKind::Speculative => Style::new().fg(Color::Yellow),
        CellKind::Flipped { .. } => Style::new()
            .fg(Color::White)
            .bg(Color::Red)
            .add_modifier(Modifier::BOLD),
        CellKind::Flushed => Style::new()
            .fg(Color::DarkGray)
            .add_modifier(Modifier::CROSSED_OUT),
    }
}

fn draw_pipeline(frame: &mut Frame, area: Rect, app: &App, run: &RunView) {
    let legend = Line::from(vec![
        " verified ".green(),
        "speculative ".yellow(),
        "flipped old→new ".white().on_red(),
        "flushed ".dark_gray().crossed_out(),
        "gate exits ".underlined(),
    ]);
    let b = block("pipeline — token in flight at each pass, per step", false).title_bottom(legend);
    let inner = b.inner(area);
    frame.render_widget(b, area);
    let label_width = 8u16;
    let n = ((inner.width.saturating_sub(label_width)) / CELL_WIDTH) as usize;
    let shown: Vec<_> = run
        .columns
        .iter()
        .skip(run.columns.len().saturating_sub(n))
        .collect();
    let w = (CELL_WIDTH - 1) as usize;
    let mut lines = Vec::with_capacity(app.info.passes + 1);
    let mut header = vec![Span::styled(
        format!("{:<8}", "step"),
        Style::new().fg(Color::DarkGray),
    )];
    header.extend(
        shown
            .iter()
            .map(|c| Span::styled(format!("{:<9}", c.step), Style::new().fg(Color::DarkGray))),
    );
    lines.push(Line::from(header));
    for pass in Pass::all(app.info.passes).rev() {
        let mut spans = vec![Span::styled(format!("pass {pass:<3}"), Style::new().bold())];
        for col in &shown {
            let span = match col.cells.get(pass.index()).and_then(|c| c.as_ref()) {
                Some(cell) => {
                    let text = match &cell.kind {
                        CellKind::Flipped { old, new } => format!(
                            "{}→{}",
                            cell_text(old, 3).trim_end(),
                            cell_text(new, 4).trim_end()
                        ),
                        _ => cell.label(),
                    };
                    let style = match cell.gate_exit {
                        true => cell_style(&cell.kind).add_modifier(Modifier::UNDERLINED),
                        false => cell_style(&cell.kind),
                    };
                    Span::styled(cell_text(&text, w), style)
                }
                None => Span::raw(" ".repeat(w)),
            };
            spans.push(span);
            spans.push(Span::raw(" "));
        }
        lines.push(Line::from(spans));
    }
    frame.render_widget(Paragraph::new(lines), inner);
}

fn draw_flips(frame: &mut Frame, area: Rect, run: &RunView, focused: bool) {
    let b = block(&format!("flips · {}", run.flips.len()), focused);
    let rows = area.height.saturating_sub(2) as usize;
    let lines: Vec<Line> = run
        .flips
        .iter()
        .rev()
        .take(rows)
        .map(|f| {
            Line::from(vec![
                Span::styled(
                    format!("s{:<4} p{:<4} pass {} ", f.step, f.pos, f.pass),
                    Style::new().fg(Color::DarkGray),
                ),
                Span::styled(
                    cell_text(&f.old, 6).trim_end().to_string(),
                    Style::new().fg(Color::Red),
                ),
                Span::raw(" → "),
                Span::styled(
                    cell_text(&f.new, 6).trim_end().to_string(),
                    Style::new().fg(Color::Green),
                ),
                Span::styled(
                    format!("  …{}", f.context),
                    Style::new().fg(Color::DarkGray),
                ),
            ])
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).block(b), area);
}

fn draw_kv(frame: &mut Frame, area: Rect, run: &RunView) {
    let b = block("KV cache", false);
    let inner = b.inner(area);
    frame.render_widget(b, area);
    let mut lines = Vec::new();
    for (pass, occ) in Pass::all(run.kv.len()).zip(&run.kv) {
        let label = format!("pass {pass} ");
        let numbers = format!(" {}+{}/{}", occ.committed, occ.speculative, occ.capacity);
        let bar = (inner.width as usize)
            .saturating_sub(label.len() + numbers.len())
            .max(1);
        let scale = |n: usize| (n * bar).div_ceil(occ.capacity.max(1)).min(bar);
        let committed = scale(occ.committed);
        let speculative = scale(occ.committed + occ.speculative).saturating_sub(committed);
        lines.push(Line::from(vec![
            Span::raw(label),
            Span::styled("█".repeat(committed), Style::new().fg(Color::Green)),
            Span::styled("█".repeat(speculative), Style::new().fg(Color::Yellow)),
            Span::styled(
                "░".repeat(bar - committed - speculative),
                Style::new().fg(Color::DarkGray),
            ),
            Span::raw(numbers),
        ]));
    }
    lines.push(Line::from(vec![
        "committed ".green(),
        "speculative".yellow(),
    ]));
    frame.render_widget(Paragraph::new(lines), inner);
}

fn draw_stats(frame: &mut Frame, area: Rect, run: &RunView, app: &App) {
    let b = block("stats", false);
    let inner = b.inner(area);
    frame.render_widget(b, area);
    let [spark, text] = Layout::vertical([Constraint::Length(2), Constraint::Min(1)]).areas(inner);
    // The sparkline shows the speedup's history, scaled to its own maximum.
    let data: Vec<u64> = run
        .speedup_history
        .iter()
        .map(|s| (s * 100.0) as u64)
        .collect();
    let shown = &data[data.len().saturating_sub(spark.width as usize)..];
    frame.render_widget(
        Sparkline::default()
            .data(shown)
            .style(Style::new().fg(Color::Cyan)),
        spark,
    );
    let lines = stats_lines(run, &app.info.policy.to_string(), app.agreement(run));
    frame.render_widget(Paragraph::new(lines), text);
}

/// The stats panel's text: speedup, rates, flips per pass, waste and whether the lanes agree.
fn stats_lines(run: &RunView, run_policy: &str, agreement: Agreement) -> Vec<Line<'static>> {
    // The figures `spex bench` reports, computed by the same function.
    let f = run.figures();
    let speedup = run
        .speedup()
        .map_or("—".to_string(), |x| format!("{x:.2}×"));
    let flips: Vec<String> = (f.flip_rates.iter())
        .map(|r| format!("{:.0}%", 100.0 * r))
        .collect();
    let (check, colour) = match agreement {
        Agreement::Same(n) => (format!("✓ identical ({n} tokens)"), Color::Green),
        Agreement::Differ(i) => (format!("✗ lanes differ at token {i}"), Color::Red),
        Agreement::SameDistribution => ("≈ same distribution (own sample)".into(), Color::Green),
        Agreement::Lossy(d) => (format!("≠ LOSSY: {}", d.describe()), Color::Yellow),
    };
    let style = match agreement {
        Agreement::SameDistribution => Style::new().fg(colour),
        _ => Style::new().fg(colour).bold(),
    };
    let agreement = Span::styled(check, style);
    let ceiling = run.ceiling.map_or("—".to_string(), |c| format!("{c:.2}×"));
    // Acceptance by source: which guess each committed token came from.
    let accepted = f.acceptance;
    vec![
        Line::from(vec![
            "speedup ".into(),
            Span::styled(speedup, Style::new().fg(Color::Cyan).bold()),
            format!(" · ceiling {ceiling} · γ {:.2}", f.gamma).into(),
        ]),
        Line::from(format!(
            "tok/s {} {:.1} · base {:.1}",
            run_policy, f.tokens_per_sec, f.baseline_tokens_per_sec
        )),
        Line::from(format!("flips/pass {}", flips.join(" "))),
        Line::from(format!(
            "1st/2nd/restart {:.0}/{:.0}/{:.0}%{} · wasted {:.0}%",
            100.0 * accepted.first,
            100.0 * accepted.second,
            100.0 * accepted.restart,
            f.gate_open_rate.map_or(String::new(), |rate| format!(
                " · gate {:.0}%",
                100.0 * rate
            )),
            100.0 * f.wasted,
        )),
        Line::from(agreement),
    ]
}

fn draw_footer(frame: &mut Frame, area: Rect, app: &App) {
    let rate = app.rate().map_or("max".to_string(), |r| format!("{r}"));
    let state = if app.paused { " PAUSED ·" } else { "" };
    let i = &app.info;
    let sampling = match app.sampling.is_greedy() {
        true => String::new(),
        false => format!(" · {}", app.sampling),
    };
    let recording = if app.recording { " ● REC ·" } else { "" };
    let replay = match &app.replay {
        Some(r) => format!(" REPLAY {} · step {}/{} ·", r.file, r.step, r.steps),
        None => String::new(),
    };
    let text = format!(
        "{state}{recording}{replay} {} · R×K {}×{} · {} · {} · {} vs baseline{sampling} · {rate} steps/s · ? help · q quit",
        i.name, i.passes, i.layers, i.device, i.dtype, i.policy
    );
    frame.render_widget(
        Paragraph::new(text).style(Style::new().fg(Color::Black).bg(Color::Gray)),
        area,
    );
}

/// The keymap's lines over the dashboard, any key closing it.
fn draw_help(frame: &mut Frame, area: Rect) {
    let popup = super::centered(area, Size::new(66, BINDINGS.len() as u16 + 4));
    let lines: Vec<Line> = BINDINGS
        .iter()
        .map(|b| {
            Line::from(vec![
                Span::styled(
                    format!("{:>14}  ", b.label),
                    Style::new().fg(Color::Cyan).bold(),
                ),
                Span::raw(b.help),
            ])
        })
        .collect();
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(lines).block(block("keys — any key closes", true)),
        popup,
    );
}
