//! The dashboard as an SVG picture, for slides (`spex snapshot`): a drawn ratatui buffer
//! becomes monospace text in the dashboard's colours on a dark background, one `<text>` per
//! run of equally styled cells, at a size that reads well at 1080p.

use std::fmt::Write;

use ratatui::buffer::Buffer;
use ratatui::style::{Color, Modifier};

/// Pixels per cell: 16 px monospace text.
const CELL_W: f32 = 9.6;
const CELL_H: f32 = 20.0;
const BACKGROUND: &str = "#1e1e1e";
const FOREGROUND: &str = "#d4d4d4";

/// The buffer as a standalone SVG document.
pub fn to_svg(buffer: &Buffer) -> String {
    let area = buffer.area;
    let (w, h) = (
        f32::from(area.width) * CELL_W,
        f32::from(area.height) * CELL_H,
    );
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"{BACKGROUND}\"/>\n\
         <g font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\" font-size=\"16\" xml:space=\"preserve\">\n"
    );
    for y in area.top()..area.bottom() {
        let mut x = area.left();
        while x < area.right() {
            let style = buffer[(x, y)].style();
            let start = x;
            let mut text = String::new();
            while x < area.right() && buffer[(x, y)].style() == style {
                text.push_str(buffer[(x, y)].symbol());
                x += 1;
            }
            let (px, py) = (
                f32::from(start - area.left()) * CELL_W,
                f32::from(y - area.top()) * CELL_H,
            );
            let cells = f32::from(x - start);
            if let Some(bg) = style.bg.and_then(hex) {
                let _ = writeln!(
                    svg,
                    "<rect x=\"{px}\" y=\"{py}\" width=\"{}\" height=\"{CELL_H}\" fill=\"{bg}\"/>",
                    cells * CELL_W
                );
            }
            if text.trim().is_empty() {
                continue;
            }
            let fill = style.fg.and_then(hex).unwrap_or_else(|| FOREGROUND.into());
            let bold = if style.add_modifier.contains(Modifier::BOLD) {
                " font-weight=\"bold\""
            } else {
                ""
            };
            let _ = writeln!(
                svg,
                "<text x=\"{px}\" y=\"{}\" fill=\"{fill}\"{bold} textLength=\"{}\">{}</text>",
                py + CELL_H * 0.75,
                cells * CELL_W,
                escape(&text)
            );
        }
    }
    svg.push_str("</g>\n</svg>\n");
    svg
}

/// A terminal colour as the hex the SVG draws it in; `None` for the default.
fn hex(color: Color) -> Option<String> {
    let named = match color {
        Color::Reset => return None,
        Color::Black => "#000000",
        Color::Red => "#e05252",
        Color::Green => "#5fd35f",
        Color::Yellow => "#e5c07b",
        Color::Blue => "#61afef",
        Color::Magenta => "#c678dd",
        Color::Cyan => "#56d4dd",
        Color::Gray => "#abb2bf",
        Color::DarkGray => "#6b7280",
        Color::LightRed => "#ff7b7b",
        Color::LightGreen => "#98e698",
        Color::LightYellow => "#f5e18a",
        Color::LightBlue => "#8cc8ff",
        Color::LightMagenta => "#e0a0f0",
        Color::LightCyan => "#9aeff5",
        Color::White => "#ffffff",
        Color::Rgb(r, g, b) => return Some(format!("#{r:02x}{g:02x}{b:02x}")),
        Color::Indexed(i) => return Some(format!("#{i:02x}{i:02x}{i:02x}")),
    };
    Some(named.into())
}

/// Text made safe inside an XML element.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c if (c as u32) < 0x20 => out.push(' '),
            c => out.push(c),
        }
    }
    out
}
