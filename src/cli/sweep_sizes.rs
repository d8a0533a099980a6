//! `spex sweep sizes`: the ceiling against model size. Each size is a random bf16 checkpoint
//! of Ouro's proportions written to a temporary folder, loaded on the CPU, its steps timed
//! (`harness::sweep::size_point`) beside the roofline's bound from the bandwidth probed over
//! its own weights, and deleted; a table (or `--json`) and a chart.

use std::io::IsTerminal;
use std::path::PathBuf;

use candle_core::DType;
use clap::Args;

use super::ModelArgs;
use super::chart::{Chart, Series, draw};
use super::device::{DTypeSpec, DeviceSpec};
use crate::engine::config::ModelShape;
use crate::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use crate::harness::sweep::{SizeSweep, machine_limits, size_point};

/// Ouro's vocabulary, the same at every size.
const VOCAB: usize = 49152;
/// The context each model is loaded with (its KV cache's size) and the position its steps
/// are timed at.
const CONTEXT: usize = 512;
const TIMED_AT: usize = 64;

/// `spex sweep sizes`.
#[derive(Debug, Args)]
pub struct SizeArgs {
    /// The hidden sizes, comma-separated; each model has Ouro-1.4B's 24 layers, 4 passes,
    /// heads of 128, an MLP of 2.75 × hidden and a vocabulary of 49152 (2048: its exact shape).
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048", value_parser = super::parse_count::<usize>)]
    pub hidden: Vec<usize>,
    /// Decode threads (default: the physical cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the chart is written (an SVG).
    #[arg(long, value_name = "FILE", default_value = "sweep-sizes.svg")]
    pub svg: PathBuf,
    /// Print one JSON report instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A checkpoint's temporary folder, deleted when dropped (also on an error).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Ouro-1.4B's proportions at `hidden`: 24 layers, 4 passes, heads of 128, untied.
fn shape(hidden: usize) -> ModelShape {
    let heads = (hidden / 128).max(1);
    ModelShape {
        hidden,
        layers: 24,
        passes: 4,
        heads,
        kv_heads: heads,
        head_dim: hidden / heads,
        intermediate: hidden * 11 / 4,
        vocab: VOCAB,
        context: CONTEXT,
        tied: false,
    }
}

fn model_args(dir: &std::path::Path, threads: Option<usize>) -> ModelArgs {
    ModelArgs {
        context: CONTEXT,
        device: Some(DeviceSpec::Cpu),
        dtype: Some(DTypeSpec(DType::BF16)),
        offline: true,
        threads,
        ..ModelArgs::named(&dir.display().to_string())
    }
}

pub fn run(args: &SizeArgs) -> anyhow::Result<()> {
    let mut hidden = args.hidden.clone();
    hidden.sort_unstable();
    hidden.dedup();
    if hidden.is_empty() {
        anyhow::bail!("--hidden: no size given");
    }
    if let Some(&bad) = hidden.iter().find(|&&h| h < 128 || h % 128 != 0) {
        anyhow::bail!("--hidden: {bad} is not a multiple of the heads' 128");
    }
    let terminal = std::io::stderr().is_terminal();
    let mut limits = None;
    let mut points = Vec::with_capacity(hidden.len());
    for (i, &h) in hidden.iter().enumerate() {
        if terminal {
            eprint!("\rspex sweep: size {}/{} (hidden {h})", i + 1, hidden.len());
        }
        let dir =
            Scratch(std::env::temp_dir().join(format!("spex-sweep-{}-{h}", std::process::id())));
        let spec = RandomSpec {
            shape: shape(h),
            pad_vocab_to: Some(VOCAB),
            dtype: DType::BF16,
            ..RandomSpec::default()
        };
        write_random_checkpoint(&dir.0, &spec)?;
        let session = super::load_model(&model_args(&dir.0, args.threads), &[])?;
        let machine = match limits {
            Some(l) => l,
            None => *limits.insert(machine_limits(&session.loaded)?),
        };
        points.push(size_point(&session.loaded, TIMED_AT, machine)?);
    }
    if terminal {
        eprintln!();
    }
    let sweep = SizeSweep {
        limits: limits.expect("at least one size was measured: this is a bug"),
        points,
    };
    report(&sweep, args)
}

/// The ceiling against hidden size: measured, its roofline bound, and with no overlap.
fn size_chart(sweep: &SizeSweep, machine: &str) -> Chart {
    let line = |f: &dyn Fn(&crate::harness::sweep::SizePoint) -> f64| -> Vec<(f64, f64)> {
        (sweep.points.iter())
            .map(|p| (p.hidden as f64, f(p)))
            .collect()
    };
    Chart {
        title: format!("The ceiling against model size on {machine}, bf16"),
        x_desc: "hidden size (24 layers × 4 passes; 2048 is Ouro-1.4B)",
        y_desc: "ceiling: R · t(1 row) / t(R rows) (×)",
        x_axis: super::chart::XAxis::Log2,
        series: vec![
            Series {
                name: "roofline bound".into(),
                points: line(&|p| p.ceiling_bound),
                dashed: true,
            },
            Series {
                name: "no overlap: memory, then arithmetic".into(),
                points: line(&|p| p.ceiling_serial),
                dashed: false,
            },
            Series {
                name: "measured".into(),
                points: line(&|p| p.ceiling),
                dashed: false,
            },
        ],
    }
}

/// The sweep's chart, then its table (or JSON).
fn report(sweep: &SizeSweep, args: &SizeArgs) -> anyhow::Result<()> {
    // The sizes load on the CPU (`model_args`), so the CPU is the machine.
    let machine = super::device::cpu_name();
    let chart = size_chart(sweep, &machine);
    draw(&chart, &args.svg)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(sweep)?);
        return Ok(());
    }
    let (one, full) = sweep.limits.multiply_adds_per_sec;
    println!(
        "{machine}: multiply-adds {:.1} G/s at 1 row, {:.1} G/s at R rows; read bandwidth probed over each model's weights",
        one / 1e9,
        full / 1e9
    );
    println!(
        "{:>7} {:>10} {:>8} {:>11} {:>11} {:>8} {:>8} {:>7} {:>11}",
        "hidden",
        "MB/pass",
        "GB/s",
        "1 row ms",
        "R rows ms",
        "ceiling",
        "bound",
        "of it",
        "no overlap"
    );
    for p in &sweep.points {
        println!(
            "{:>7} {:>10.0} {:>8.1} {:>11.2} {:>11.2} {:>7.2}× {:>7.2}× {:>6.0}% {:>10.2}×",
            p.hidden,
            p.bytes_per_pass as f64 / 1e6,
            p.read_bytes_per_sec / 1e9,
            p.one_row_ms,
            p.full_ms,
            p.ceiling,
            p.ceiling_bound,
            100.0 * p.ceiling / p.ceiling_bound,
            p.ceiling_serial
        );
    }
    println!("chart: {}", args.svg.display());
    Ok(())
}
