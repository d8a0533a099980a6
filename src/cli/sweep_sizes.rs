//! `spex sweep sizes`: the ceiling against model size. Each size is a random bf16 checkpoint
//! of Ouro's proportions written to a temporary folder (and, for `--dtype q8_0|q4_0|q4_k_m`,
//! that checkpoint quantized as `spex quantize` writes it), loaded on the CPU, its steps timed
//! (`harness::sweep::size_point`) beside the roofline's bound from the bandwidth probed over
//! its own weights, and deleted; a table (or `--json`) and a chart.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use candle_core::DType;
use clap::Args;

use super::ModelArgs;
use super::chart::{Chart, Series, draw};
use super::device::{DTypeSpec, DeviceSpec};
use crate::engine::checkpoint::Origin;
use crate::engine::config::ModelShape;
use crate::engine::quantize::{QuantizeTarget, quantize_checkpoint};
use crate::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use crate::harness::sweep::{SizePoint, SizeSweep, machine_limits, size_point};

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
    /// The weight types measured at every size, comma-separated: bf16, and any type `spex
    /// quantize` writes (q8_0, q4_0, q4_k_m, mlx-4bit, …: the bf16 checkpoint quantized by it).
    #[arg(long, value_delimiter = ',', default_value = "bf16", value_parser = parse_weights)]
    pub dtype: Vec<SweptWeights>,
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

/// A weight type the size sweep measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweptWeights {
    /// The random checkpoint as written.
    Bf16,
    /// It quantized as `spex quantize` writes it.
    Quantized(QuantizeTarget),
}

impl SweptWeights {
    /// Its name, as `--dtype` takes it.
    fn name(self) -> String {
        match self {
            Self::Bf16 => "bf16".to_string(),
            Self::Quantized(t) => t.name(),
        }
    }
}

fn parse_weights(s: &str) -> Result<SweptWeights, String> {
    match s {
        "bf16" => Ok(SweptWeights::Bf16),
        _ => super::quantize::parse_target(s)
            .map(SweptWeights::Quantized)
            .map_err(|e| format!("{e}, or bf16")),
    }
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

/// `path` (a checkpoint folder, or a GGUF file, whose weights load as stored) on the CPU.
fn model_args(path: &Path, bf16: bool, threads: Option<usize>) -> ModelArgs {
    ModelArgs {
        context: CONTEXT,
        device: Some(DeviceSpec::Cpu),
        dtype: bf16.then_some(DTypeSpec(DType::BF16)),
        offline: true,
        threads,
        ..ModelArgs::named(&path.display().to_string())
    }
}

/// The checkpoint in `dir` as `weights` stores it: the folder, or a GGUF file or mlx folder
/// quantized from it inside the folder.
fn weights_file(dir: &Path, weights: SweptWeights, threads: usize) -> anyhow::Result<PathBuf> {
    let SweptWeights::Quantized(target) = weights else {
        return Ok(dir.to_path_buf());
    };
    let out = match target {
        QuantizeTarget::Gguf(_) => dir.join("model.gguf"),
        QuantizeTarget::Mlx(_) => dir.join(target.name()),
    };
    let origin = Origin::Dir(dir.to_path_buf());
    quantize_checkpoint(&origin, "sweep", target, &out, threads)?;
    Ok(out)
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
    let threads = (args.threads).unwrap_or_else(crate::engine::kernels::pool::available_cores);
    let terminal = std::io::stderr().is_terminal();
    let mut limits = None;
    let mut points = Vec::with_capacity(hidden.len() * args.dtype.len());
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
        for &weights in &args.dtype {
            let path = weights_file(&dir.0, weights, threads)?;
            let bf16 = weights == SweptWeights::Bf16;
            let session = super::load_model(&model_args(&path, bf16, args.threads), &[])?;
            let machine = match limits {
                Some(l) => l,
                None => *limits.insert(machine_limits(&session.loaded)?),
            };
            let point = size_point(&session.loaded, &weights.name(), TIMED_AT, machine)?;
            points.push(point);
        }
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

/// The ceiling against hidden size: measured for each weight type, and for bf16 its roofline
/// bound and the ceiling with no overlap.
fn size_chart(sweep: &SizeSweep, machine: &str) -> Chart {
    let mut types: Vec<&str> = Vec::new();
    for p in &sweep.points {
        if !types.contains(&p.weights.as_str()) {
            types.push(&p.weights);
        }
    }
    let line = |weights: &str, f: &dyn Fn(&SizePoint) -> Option<f64>| -> Vec<(f64, f64)> {
        (sweep.points.iter())
            .filter(|p| p.weights == weights)
            .filter_map(|p| Some((p.hidden as f64, f(p)?)))
            .collect()
    };
    let mut series = Vec::new();
    for &weights in &types {
        type Of = fn(&SizePoint) -> Option<f64>;
        let bounds: [(&str, bool, Of); 2] = [
            ("roofline bound", true, |p| p.ceiling_bound),
            ("no overlap: memory, then arithmetic", false, |p| {
                p.ceiling_serial
            }),
        ];
        for (name, dashed, f) in bounds {
            let points = line(weights, &f);
            if !points.is_empty() {
                series.push(Series {
                    name: format!("{name} ({weights})"),
                    points,
                    dashed,
                });
            }
        }
        series.push(Series {
            name: format!("measured ({weights})"),
            points: line(weights, &|p| Some(p.ceiling)),
            dashed: false,
        });
    }
    Chart {
        title: format!(
            "The ceiling against model size on {machine}, {}",
            types.join(", ")
        ),
        x_desc: "hidden size (24 layers × 4 passes; 2048 is Ouro-1.4B)",
        y_desc: "ceiling: R · t(1 row) / t(R rows) (×)",
        x_axis: super::chart::XAxis::Log2,
        series,
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
        "{:>7} {:>14} {:>10} {:>8} {:>11} {:>11} {:>8} {:>8} {:>7} {:>11}",
        "hidden",
        "weights",
        "MB/pass",
        "GB/s",
        "1 row ms",
        "R rows ms",
        "ceiling",
        "bound",
        "of it",
        "no overlap"
    );
    let times = |x: Option<f64>| x.map_or("—".into(), |x| format!("{x:.2}×"));
    for p in &sweep.points {
        let of_bound = p
            .ceiling_bound
            .map_or("—".into(), |b| format!("{:.0}%", 100.0 * p.ceiling / b));
        println!(
            "{:>7} {:>14} {:>10.0} {:>8.1} {:>11.2} {:>11.2} {:>7.2}× {:>8} {:>7} {:>11}",
            p.hidden,
            p.stored,
            p.bytes_per_pass as f64 / 1e6,
            p.read_bytes_per_sec / 1e9,
            p.one_row_ms,
            p.full_ms,
            p.ceiling,
            times(p.ceiling_bound),
            of_bound,
            times(p.ceiling_serial)
        );
    }
    println!("chart: {}", args.svg.display());
    Ok(())
}
