//! Presenter mode (`--present`, key `p`): the dashboard for a room. Only the speedup in large
//! digits, the generated text and the pipeline with large cells, in high contrast (bold
//! white, green, yellow and red on black). Drawn from [`App`] state alone, like `ui`.

use ratatui::Frame;
use ratatui::layout::{Alignment, Constraint, Layout, Rect, Size};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, BorderType, Borders, Paragraph};

use super::app::{Agreement, App, CellKind, RunView};
use crate::engine::Pass;

/// Width of one pipeline cell, its border included.
const CELL_WIDTH: u16 = 14;
/// Rows of the big digits.
const DIGIT_ROWS: u16 = 3;

/// The smallest terminal presenter mode fits, for a model with `passes` passes (the pipeline
/// falls back to one-row cells where three-row ones do not fit).
pub fn min_size(passes: usize) -> Size {
    Size::new(60, DIGIT_ROWS + 2 + 4 + passes as u16 + 3 + 1)
}

fn base() -> Style {
    Style::new().fg(Color::White).bg(Color::Black)
}

fn block(title: String) -> Block<'static> {
    Block::default()
        .borders(Borders::ALL)
        .border_type(BorderType::Thick)
        .title(Span::styled(title, base().add_modifier(Modifier::BOLD)))
        .style(base())
}

/// Draws the presenter screen.
pub fn draw(frame: &mut Frame, app: &App) {
    let area = frame.area();
    frame.render_widget(Block::default().style(base()), area);
    let empty = RunView::default();
    let run = app.run.as_ref().unwrap_or(&empty);
    let passes = app.info.passes as u16;
    // Boxed cells where the text keeps at least 4 rows inside its border.
    let (top_rows, text_rows, footer_rows) = (DIGIT_ROWS + 2, 6, 1);
    let tall = area.height >= top_rows + text_rows + (3 * passes + 3) + footer_rows;
    let pipeline_rows = if tall { 3 * passes + 3 } else { passes + 3 };
    let [top, text, pipeline, footer] = Layout::vertical([
        Constraint::Length(top_rows),
        Constraint::Min(4),
        Constraint::Length(pipeline_rows),
        Constraint::Length(footer_rows),
    ])
    .areas(area);
    draw_speedup(frame, top, app, run);
    draw_text(frame, text, run);
    draw_pipeline(frame, pipeline, app, run, tall);
    draw_footer(frame, footer, app);
}

/// The speedup in large digits, with the policy and whether the texts agree.
fn draw_speedup(frame: &mut Frame, area: Rect, app: &App, run: &RunView) {
    let policy = app.info.policy.to_string();
    let b = block(format!(" {policy} vs baseline "));
    let inner = b.inner(area);
    frame.render_widget(b, area);
    let speedup = run.speedup().map_or("-".into(), |x| format!("{x:.2}x"));
    let digits = big(&speedup);
    let width = digits.first().map_or(0, |l| l.chars().count()) as u16;
    let [left, right] =
        Layout::horizontal([Constraint::Length(width + 2), Constraint::Min(1)]).areas(inner);
    let cyan = base().fg(Color::Cyan).add_modifier(Modifier::BOLD);
    let lines: Vec<Line> = digits.into_iter().map(|l| Line::styled(l, cyan)).collect();
    frame.render_widget(Paragraph::new(lines).alignment(Alignment::Right), left);
    let (check, style) = match app.agreement(run) {
        Agreement::Same(n) => (format!("✓ identical text ({n} tokens)"), Color::Green),
        Agreement::Differ(i) => (format!("✗ differs at token {i}"), Color::Red),
        Agreement::SameDistribution => ("≈ same distribution".into(), Color::Green),
        Agreement::Lossy(d) => (format!("≠ LOSSY: {}", d.describe()), Color::Yellow),
    };
    let s = &run.speculative.stats;
    let info = vec![
        Line::styled(" faster than ordinary decoding", base().bold()),
        Line::styled(
            format!(
                " {:.0} vs {:.0} tokens/s",
                s.tokens_per_sec(),
                run.baseline.stats.tokens_per_sec()
            ),
            base(),
        ),
        Line::styled(format!(" {check}"), base().fg(style).bold()),
    ];
    frame.render_widget(Paragraph::new(info), right);
}

/// The speculative lane's text: the prompt, then the output in bold.
fn draw_text(frame: &mut Frame, area: Rect, run: &RunView) {
    let b = block(" text ".into());
    let inner = b.inner(area);
    let mut lines: Vec<Line> = Vec::new();
    let mut current: Vec<Span> = Vec::new();
    let dim = base().fg(Color::Gray);
    for (chunk, style) in [(&run.prompt, dim), (&run.speculative.text, base().bold())] {
        for (i, part) in chunk.split('\n').enumerate() {
            if i > 0 {
                lines.push(Line::from(std::mem::take(&mut current)));
            }
            current.push(Span::styled(super::printable(part), style));
        }
    }
    lines.push(Line::from(current));
    // Keep the end in view: wrap by characters, show the last rows that fit.
    let rows = wrap(&lines, usize::from(inner.width.max(1)));
    let start = rows.len().saturating_sub(usize::from(inner.height));
    frame.render_widget(Paragraph::new(rows[start..].to_vec()).block(b), area);
}

/// `lines` cut into rows of at most `width` columns, each character keeping its style.
fn wrap(lines: &[Line<'static>], width: usize) -> Vec<Line<'static>> {
    let mut rows = Vec::new();
    for line in lines {
        let mut row: Vec<Span> = Vec::new();
        let mut used = 0;
        for span in &line.spans {
            for c in span.content.chars() {
                let c = Span::styled(c.to_string(), span.style);
                let w = c.width();
                if used + w > width {
                    rows.push(Line::from(std::mem::take(&mut row)));
                    used = 0;
                }
                row.push(c);
                used += w;
            }
        }
        rows.push(Line::from(row));
    }
    rows
}

/// The pipeline: a row per pass (deepest on top), a column per step, each cell a boxed token
/// (`tall`) or a one-row one.
fn draw_pipeline(frame: &mut Frame, area: Rect, app: &App, run: &RunView, tall: bool) {
    let b = block(" pipeline: the token at each pass, per step ".into());
    let inner = b.inner(area);
    frame.render_widget(b, area);
    let label = 8;
    let n = (inner.width.saturating_sub(label) / CELL_WIDTH) as usize;
    let shown: Vec<_> = (run.columns.iter())
        .skip(run.columns.len().saturating_sub(n))
        .collect();
    let cell_h = if tall { 3 } else { 1 };
    let mut y = inner.y;
    let steps = Line::from(
        std::iter::once(Span::styled(
            format!("{:<8}", "step"),
            base().fg(Color::Gray),
        ))
        .chain(shown.iter().map(|c| {
            let step = format!("{:^w$}", c.step, w = CELL_WIDTH as usize);
            Span::styled(step, base().fg(Color::Gray))
        }))
        .collect::<Vec<_>>(),
    );
    frame.render_widget(Paragraph::new(steps), Rect { height: 1, ..inner });
    y += 1;
    for pass in Pass::all(app.info.passes).rev() {
        let row = Rect {
            y,
            height: cell_h.min(inner.bottom().saturating_sub(y)),
            ..inner
        };
        let name = Rect {
            width: label,
            ..row
        };
        let middle = Rect {
            y: row.y + row.height / 2,
            height: 1,
            ..name
        };
        frame.render_widget(
            Paragraph::new(format!("pass {pass}")).style(base().bold()),
            middle,
        );
        for (i, col) in shown.iter().enumerate() {
            let cell = col.cells.get(pass.index()).and_then(Option::as_ref);
            let Some(cell) = cell else { continue };
            let at = Rect {
                x: row.x + label + i as u16 * CELL_WIDTH,
                width: CELL_WIDTH - 1,
                ..row
            };
            draw_cell(frame, at, &cell.label(), &cell.kind, tall);
        }
        y += cell_h;
    }
}

/// One token cell, boxed when `tall`.
fn draw_cell(frame: &mut Frame, area: Rect, text: &str, kind: &CellKind, tall: bool) {
    let (shown, style) = match kind {
        CellKind::Verified => (super::visible(text), base().fg(Color::Green)),
        CellKind::Speculative => (super::visible(text), base().fg(Color::Yellow)),
        CellKind::Flipped { old, new } => (
            format!("{}→{}", super::visible(old), super::visible(new)),
            Style::new().fg(Color::White).bg(Color::Red),
        ),
        CellKind::Flushed => (super::visible(text), base().fg(Color::DarkGray)),
    };
    let style = style.add_modifier(Modifier::BOLD);
    let p = Paragraph::new(shown)
        .alignment(Alignment::Center)
        .style(style);
    if tall {
        let b = Block::default()
            .borders(Borders::ALL)
            .border_type(BorderType::Rounded)
            .border_style(style);
        frame.render_widget(p.block(b), area);
    } else {
        frame.render_widget(p, area);
    }
}

fn draw_footer(frame: &mut Frame, area: Rect, app: &App) {
    let step = match &app.replay {
        Some(r) => format!(" step {}/{} ·", r.step, r.steps),
        None => String::new(),
    };
    let rate = app.rate().map_or("max".into(), |r| format!("{r}"));
    let text = format!(
        "{step} {} · {rate} steps/s · p full dashboard · ? help · q quit",
        app.info.name
    );
    frame.render_widget(
        Paragraph::new(text).style(Style::new().fg(Color::Black).bg(Color::White)),
        area,
    );
}

/// `text` in a 3-row block font (digits, '.', 'x', '-'), each glyph 3 columns and a space.
fn big(text: &str) -> Vec<String> {
    let mut rows = vec![String::new(); DIGIT_ROWS as usize];
    for c in text.chars() {
        let Some(bitmap) = glyph(c) else { continue };
        for (r, row) in rows.iter_mut().enumerate() {
            let top = bitmap.get(2 * r).copied().unwrap_or(0);
            let bottom = bitmap.get(2 * r + 1).copied().unwrap_or(0);
            for bit in [4, 2, 1] {
                row.push(match (top & bit != 0, bottom & bit != 0) {
                    (true, true) => '█',
                    (true, false) => '▀',
                    (false, true) => '▄',
                    (false, false) => ' ',
                });
            }
            row.push(' ');
        }
    }
    rows
}

/// A glyph's 3-pixel rows, top first (bit 4 the left pixel).
fn glyph(c: char) -> Option<&'static [u8]> {
    Some(match c {
        '0' => &[7, 5, 5, 5, 7],
        '1' => &[2, 6, 2, 2, 7],
        '2' => &[7, 1, 7, 4, 7],
        '3' => &[7, 1, 7, 1, 7],
        '4' => &[5, 5, 7, 1, 1],
        '5' => &[7, 4, 7, 1, 7],
        '6' => &[7, 4, 7, 5, 7],
        '7' => &[7, 1, 1, 1, 1],
        '8' => &[7, 5, 7, 5, 7],
        '9' => &[7, 5, 7, 1, 7],
        '.' => &[0, 0, 0, 0, 2],
        'x' => &[0, 5, 2, 5, 0],
        '-' => &[0, 0, 7, 0, 0],
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_digits_are_three_rows_of_four_columns_a_glyph() {
        let rows = big("2.5x");
        assert_eq!(rows.len(), 3);
        assert!(rows.iter().all(|r| r.chars().count() == 16));
        assert_eq!(rows[0], "▀▀█     █▀▀ ▄ ▄ ");
    }
}
