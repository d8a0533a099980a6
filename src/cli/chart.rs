//! Line charts for the sweeps, drawn with plotters as SVG at slide size (1280 × 720): one
//! dashed grey line for a bound or a ceiling, coloured lines with dots for what was measured,
//! against an x axis of powers of two (tokens, hidden sizes) or of a percentage (agreement).

use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// One line of a chart.
pub struct Series {
    pub name: String,
    /// (x, y) points; on a [`XAxis::Log2`] chart x is a power of two.
    pub points: Vec<(f64, f64)>,
    /// A bound or a ceiling: dashed grey, no dots.
    pub dashed: bool,
}

/// What a chart shows.
pub struct Chart {
    pub title: String,
    pub x_desc: &'static str,
    pub y_desc: &'static str,
    pub x_axis: XAxis,
    pub series: Vec<Series>,
}

/// How a chart's x axis is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XAxis {
    /// Powers of two (tokens, hidden sizes), evenly spaced.
    Log2,
    /// A percentage, 0 to 100, drawn linearly.
    Percent,
}

impl XAxis {
    /// Where `x` is drawn.
    fn place(self, x: f64) -> f64 {
        match self {
            Self::Log2 => x.log2(),
            Self::Percent => x,
        }
    }

    /// The label at a drawn position.
    fn label(self, x: f64) -> String {
        match self {
            Self::Log2 => format!("{}", 2f64.powf(x).round()),
            Self::Percent => format!("{x:.0} %"),
        }
    }
}

/// The measured lines' colours, in order (then again): Okabe and Ito's, told apart by
/// colour-blind readers.
const COLOURS: [RGBColor; 5] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
];

const GREY: RGBColor = RGBColor(90, 90, 90);

type Axes<'a> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Writes `chart` to `path` (through a temporary file renamed into place, so an interrupted
/// write leaves no cut chart); an error names the file.
pub fn draw(chart: &Chart, path: &Path) -> anyhow::Result<()> {
    through_temporary(path, |temp| draw_to(chart, path, temp))
}

/// Runs `draw` on a temporary path beside `path`, then renames it to `path`.
fn through_temporary(
    path: &Path,
    draw: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut failed = None;
    let written = crate::engine::files::write_via_temporary(path, |temp| {
        draw(temp).map_err(|e| std::io::Error::other(failed.insert(e).to_string()))
    });
    match (written, failed) {
        (_, Some(e)) => Err(e),
        (result, None) => Ok(result?),
    }
}

/// [`draw`] into the file `target`; errors name `path`.
fn draw_to(chart: &Chart, path: &Path, target: &Path) -> anyhow::Result<()> {
    let error = |e: &dyn std::fmt::Display| anyhow::anyhow!("{}: {e}", path.display());
    let axis = chart.x_axis;
    let xs: Vec<f64> = (chart.series.iter())
        .flat_map(|s| s.points.iter().map(|p| axis.place(p.0)))
        .collect();
    let (x0, x1) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (pad, labels) = match axis {
        XAxis::Log2 => (0.25, (x1 - x0) as usize + 1),
        XAxis::Percent => ((x1 - x0).max(1.0) * 0.05, 11),
    };
    let top = (chart.series.iter())
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0f64, f64::max)
        * 1.1;
    let root = SVGBackend::new(target, (1280, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(&e))?;
    let mut axes = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 32))
        .margin(24)
        .x_label_area_size(64)
        .y_label_area_size(80)
        .build_cartesian_2d(x0 - pad..x1 + pad, 0.0..top)
        .map_err(|e| error(&e))?;
    axes.configure_mesh()
        .x_desc(chart.x_desc)
        .y_desc(chart.y_desc)
        .x_labels(labels)
        .x_label_formatter(&|x| axis.label(*x))
        .axis_desc_style(("sans-serif", 24))
        .label_style(("sans-serif", 20))
        .draw()
        .map_err(|e| error(&e))?;
    draw_series(&mut axes, axis, &chart.series).map_err(|e| error(&e))?;
    // Agreement charts put the lossless points at 100 %, lower right.
    let legend = match axis {
        XAxis::Log2 => SeriesLabelPosition::LowerRight,
        XAxis::Percent => SeriesLabelPosition::UpperRight,
    };
    finish(axes, &root, legend).map_err(|e| error(&e))
}

/// Draws the legend at `legend` and writes the file.
fn finish(
    axes: Axes,
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    legend: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let mut axes = axes;
    axes.configure_series_labels()
        .position(legend)
        .label_font(("sans-serif", 22))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()
}

/// Every line with its legend entry.
fn draw_series(
    axes: &mut Axes,
    axis: XAxis,
    series: &[Series],
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let mut colours = COLOURS.iter().cycle();
    for s in series {
        let points: Vec<(f64, f64)> = (s.points.iter())
            .map(|&(x, y)| (axis.place(x), y))
            .collect();
        if s.dashed {
            let style = GREY.stroke_width(3);
            axes.draw_series(DashedLineSeries::new(points, 10, 6, style))?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
            continue;
        }
        let colour = *colours.next().expect("the colours cycle");
        let style = colour.stroke_width(4);
        axes.draw_series(LineSeries::new(points.clone(), style))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
        axes.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 6, colour.filled())),
        )?;
    }
    Ok(())
}

/// A grouped bar chart: one group per model, one bar per policy, a dashed mark per group.
pub struct BarChart {
    pub title: String,
    pub y_desc: &'static str,
    /// The groups' names, along the x axis.
    pub groups: Vec<String>,
    /// The bars' names, in each group, in the legend.
    pub bars: Vec<String>,
    /// `values[group][bar]`.
    pub values: Vec<Vec<f64>>,
    /// A bound over each group (the ceiling): a dashed grey line across its bars.
    pub marks: Vec<f64>,
    pub mark_name: &'static str,
}

/// The share of a group's unit width its bars take.
const GROUP_FILL: f64 = 0.8;

/// Writes the bar chart `chart` to `path`, as [`draw`] writes a line chart.
pub fn draw_bars(chart: &BarChart, path: &Path) -> anyhow::Result<()> {
    through_temporary(path, |temp| draw_bars_to(chart, path, temp))
}

/// [`draw_bars`] into the file `target`; errors name `path`.
fn draw_bars_to(chart: &BarChart, path: &Path, target: &Path) -> anyhow::Result<()> {
    let error = |e: &dyn std::fmt::Display| anyhow::anyhow!("{}: {e}", path.display());
    let top =
        (chart.values.iter().flatten().chain(&chart.marks)).fold(1.0f64, |a, &b| a.max(b)) * 1.6;
    let groups = chart.groups.len();
    let root = SVGBackend::new(target, (1280, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(&e))?;
    // Groups centred on the integers, so that the axis's labels fall on them.
    let mut axes = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 32))
        .margin(24)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5..groups as f64 - 0.5, 0.0..top)
        .map_err(|e| error(&e))?;
    let name_at = |x: &f64| {
        let i = x.round();
        let on_group = (x - i).abs() < 1e-6 && i >= 0.0;
        (chart.groups.get(i as usize).filter(|_| on_group)).map_or(String::new(), Clone::clone)
    };
    axes.configure_mesh()
        .disable_x_mesh()
        .y_desc(chart.y_desc)
        .x_labels(groups)
        .x_label_formatter(&name_at)
        .axis_desc_style(("sans-serif", 24))
        .label_style(("sans-serif", 20))
        .draw()
        .map_err(|e| error(&e))?;
    draw_bar_series(&mut axes, chart).map_err(|e| error(&e))?;
    finish(axes, &root, SeriesLabelPosition::UpperRight).map_err(|e| error(&e))
}

/// Each bar series with its legend entry, then the marks.
fn draw_bar_series(
    axes: &mut Axes,
    chart: &BarChart,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let width = GROUP_FILL / chart.bars.len().max(1) as f64;
    for (b, (name, colour)) in chart.bars.iter().zip(COLOURS.iter().cycle()).enumerate() {
        let left = |g: usize| g as f64 - GROUP_FILL / 2.0 + b as f64 * width;
        let bars = (chart.values.iter().enumerate()).filter_map(|(g, values)| {
            let v = *values.get(b)?;
            let corners = [(left(g) + 0.01, 0.0), (left(g) + width - 0.01, v)];
            Some(Rectangle::new(corners, colour.filled()))
        });
        axes.draw_series(bars)?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 8), (x + 20, y + 8)], colour.filled()));
    }
    let style = GREY.stroke_width(3);
    for (g, &mark) in chart.marks.iter().enumerate() {
        let half = GROUP_FILL / 2.0;
        let line = [(g as f64 - half, mark), (g as f64 + half, mark)];
        let series = axes.draw_series(DashedLineSeries::new(line, 10, 6, style))?;
        if g == 0 {
            series
                .label(chart.mark_name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
        }
    }
    Ok(())
}

/// A sweep's output once its chart is drawn: its JSON, or its table and where the chart
/// went; then an error naming the lanes (`failed`) whose text differed where it must not.
pub fn report_sweep<T: serde::Serialize>(
    sweep: &T,
    json: bool,
    svg: &std::path::Path,
    print: impl FnOnce(),
    failed: &[String],
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(sweep)?);
    } else {
        print();
        println!("chart: {}", svg.display());
    }
    if !failed.is_empty() {
        anyhow::bail!("{} output differs from baseline", failed.join(", "));
    }
    Ok(())
}
