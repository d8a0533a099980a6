//! How close decoding runs to the machine's memory bandwidth, the limit of a step at real size
//! (every pass reads every layer's weights once, whatever its rows): the machine's read
//! bandwidth over the weights as the decode threads see it, the kernels' multiply-add rate,
//! and the weight bytes a baseline token reads. Called by `spex bench` (the baseline's share
//! of the bandwidth) and `harness::sweep` (the size sweep's roofline bound).

use std::time::{Duration, Instant};

use crate::engine::LoadedModel;
use crate::engine::error::Result;
use crate::engine::kernels::{Kernels, Matrix, Weight, pool};
use crate::engine::model::LoopedModel;

/// Weight bytes per pass from which the figures mean something: smaller models' weights stay
/// in the caches, where no step reads DRAM.
pub const MEANINGFUL_FROM_BYTES: u64 = 64 << 20;

/// Sweeps timed; the best counts (the machine's limit, not its noise).
pub const SWEEPS: usize = 5;

/// Weight bytes one pass reads: every layer's projections, as stored (quantized blocks'
/// bytes for a quantized model).
pub fn layer_bytes_per_pass(model: &LoopedModel) -> u64 {
    (model.weights.layers.iter())
        .flat_map(|layer| layer.projections())
        .map(stored_bytes)
        .sum()
}

/// Weight bytes of the LM head, which a readout reads.
pub fn head_bytes(model: &LoopedModel) -> u64 {
    stored_bytes(&model.weights.lm_head)
}

/// The bytes `t` holds in its stored type.
fn stored_bytes(t: &candle_core::Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Weight bytes a baseline token reads: every pass's layers, and the LM head once (its
/// readout at the last pass).
pub fn weight_bytes_per_token(model: &LoopedModel) -> u64 {
    layer_bytes_per_pass(model) * model.passes() as u64 + head_bytes(model)
}

/// Sweeps of [`weights_read_bytes_per_sec`] timed; the best counts.
pub const WEIGHT_SWEEPS: usize = 3;

/// The read bandwidth over `matrices` themselves, in bytes per second: the pages a decode step
/// streams, so that the probe and the step read the same memory with nothing allocated. The
/// faster of two reads, each the best of [`WEIGHT_SWEEPS`] after one: a plain sum
/// ([`summed_bytes_per_sec`]) and the kernels' own one-row products
/// ([`multiplied_bytes_per_sec`]), whichever reads these pages faster on this machine.
///
/// Why two: neither read is the faster everywhere, and a probe slower than the decoding it is
/// set against would have a baseline read more than "the bandwidth". Over Ouro-1.4B's shape,
/// probes of each read taken one moment after the next overlapped: each was the faster of the
/// pair in some probes, on one thread and on two.
///
/// On a VM whose bandwidth moves from second to second (one buffer can read at very different
/// rates seconds apart), only a probe taken beside the decoding it is compared with means
/// anything: `spex bench` takes one around every prompt.
pub fn weights_read_bytes_per_sec(kernels: &Kernels, matrices: &[Matrix<'_>]) -> f64 {
    let summed = summed_bytes_per_sec(kernels.pool(), matrices);
    summed.max(multiplied_bytes_per_sec(kernels, matrices))
}

/// The bytes a second of a plain read of `matrices`: each thread sums its share of every
/// matrix's words, as a matmul splits them, all in one job.
pub fn summed_bytes_per_sec(pool: &pool::Pool, matrices: &[Matrix<'_>]) -> f64 {
    let bytes: usize = matrices.iter().map(|m| 8 * m.weight.words().len()).sum();
    let parts = pool.threads();
    let best = best_sweep(WEIGHT_SWEEPS, || {
        pool.run(&|part| {
            let total = matrices.iter().fold(0u64, |total, m| {
                let words = m.weight.words();
                let range = pool::share(words.len(), parts, part, 64);
                total.wrapping_add(sum(&words[range]))
            });
            std::hint::black_box(total);
        });
    });
    bytes as f64 / best.as_secs_f64()
}

/// The bytes a second the kernels stream `matrices` at in one-row products (one row of
/// ones against each, on the kernels' threads, with their prefetch plan): every weight read
/// once, with a multiply-add each, which a one-row step is too little arithmetic to be held
/// back by.
pub fn multiplied_bytes_per_sec(kernels: &Kernels, matrices: &[Matrix<'_>]) -> f64 {
    let bytes: usize = (matrices.iter()).map(|m| m.weight.bytes()).sum();
    let widest = |f: fn(&Matrix<'_>) -> usize| matrices.iter().map(f).max().unwrap_or(0);
    let x = vec![1f32; widest(|m| m.inner)];
    let mut out = vec![0f32; widest(|m| m.outs())];
    let best = best_sweep(WEIGHT_SWEEPS, || {
        for m in matrices {
            kernels.matmul_t(&x[..m.inner], m.weight, 1, m.inner, &mut out[..m.outs()]);
        }
        std::hint::black_box(&mut out);
    });
    bytes as f64 / best.as_secs_f64()
}

/// [`weights_read_bytes_per_sec`] over `loaded`'s own layer weights, on its decode threads;
/// `None` where candle's ops decode it (no host kernels). What `spex bench` probes around
/// each prompt and `harness::sweep` beside each size's steps.
pub fn loaded_weights_read_bytes_per_sec(loaded: &LoadedModel) -> Option<Result<f64>> {
    let kernels = loaded.backend.kernels()?;
    (loaded.backend).with_layer_matrices(|matrices| weights_read_bytes_per_sec(kernels, matrices))
}

/// The shortest of `sweeps` timed runs of `sweep`, after one untimed.
fn best_sweep(sweeps: usize, mut sweep: impl FnMut()) -> Duration {
    sweep();
    (0..sweeps)
        .map(|_| {
            let started = Instant::now();
            sweep();
            started.elapsed()
        })
        .min()
        .unwrap_or(Duration::MAX)
}

/// The wrapping sum of `words` in 16 lanes, which the compiler keeps in vector registers: a
/// load per lane group and no chain longer than the loads.
fn sum(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 16];
    let chunks = words.chunks_exact(16);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &w| a.wrapping_add(w));
    for chunk in chunks {
        for (lane, w) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(*w);
        }
    }
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}

/// The share of `read_bytes_per_sec` that decoding at `tokens_per_sec` baseline tokens a second
/// reads as weights.
pub fn bandwidth_share(model: &LoopedModel, tokens_per_sec: f64, read_bytes_per_sec: f64) -> f64 {
    weight_bytes_per_token(model) as f64 * tokens_per_sec / read_bytes_per_sec
}

/// The kernels' multiply-add rate, per second, for products of `rows` rows with bf16 weights
/// that stay in each thread's L2 cache (256 × 1024 elements, 512 KB, per decode thread): the
/// arithmetic a step can do when memory does not hold it back. The best of [`SWEEPS`] timed
/// rounds of [`PRODUCTS_PER_SWEEP`] products, after one.
pub fn multiply_adds_per_sec(kernels: &Kernels, rows: usize) -> f64 {
    const INNER: usize = 1024;
    let outs = 256 * kernels.pool().threads();
    let weight: Vec<half::bf16> = (0..outs * INNER)
        .map(|i| half::bf16::from_f32(((i % 13) as f32 - 6.0) / 8.0))
        .collect();
    let x: Vec<f32> = (0..rows * INNER).map(|i| (i % 7) as f32 / 7.0).collect();
    let mut out = vec![0f32; rows * outs];
    let best = best_sweep(SWEEPS, || {
        for _ in 0..PRODUCTS_PER_SWEEP {
            kernels.matmul_t(&x, Weight::Bf16(&weight), rows, INNER, &mut out);
            std::hint::black_box(&mut out);
        }
    });
    (PRODUCTS_PER_SWEEP * rows * outs * INNER) as f64 / best.as_secs_f64()
}

/// Products a timed round of [`multiply_adds_per_sec`] runs: a few milliseconds, so that a
/// round times the kernels and not a decode thread still waking. Rounds of 20 read the rate
/// several times too low against rounds of 200, at 1–4 rows alike, and made two threads look
/// slower than one.
pub const PRODUCTS_PER_SWEEP: usize = 200;

/// The roofline's two bounds on a step's time, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepBound {
    /// Memory and arithmetic overlapped: the longer of the two.
    pub overlapped_secs: f64,
    /// Memory, then arithmetic: their sum.
    pub serial_secs: f64,
}

/// The two machine rates a roofline is drawn from: a step is bound by whichever of its
/// memory reads and its arithmetic takes longer at these rates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// The read bandwidth over the weights, in bytes per second.
    pub read_bytes_per_sec: f64,
    /// The kernels' multiply-add rate at the step's rows, per second.
    pub multiply_adds_per_sec: f64,
}

/// The roofline of a step as `timing::StepTimes` measures it, at `roofline`'s rates: each
/// pass reads every layer's weights once and does a multiply-add per weight and row. The LM
/// head is read once per token: a fourth of it in a one-row step (`rows` = 1, the mean of a
/// token's R steps), all of it, for every row, in an R-row step (every row read out).
/// Attention over the context is left out: small at short context.
pub fn step_bound(model: &LoopedModel, rows: usize, roofline: Roofline) -> StepBound {
    let Roofline {
        read_bytes_per_sec,
        multiply_adds_per_sec,
    } = roofline;
    let size = model.dtype.size_in_bytes() as f64;
    let layers = layer_bytes_per_pass(model) as f64;
    let head = head_bytes(model) as f64;
    let head_share = if rows == 1 {
        1.0 / model.passes() as f64
    } else {
        1.0
    };
    let bytes = layers + head * head_share;
    let memory = bytes / read_bytes_per_sec;
    let arithmetic = rows as f64 * (bytes / size) / multiply_adds_per_sec;
    StepBound {
        overlapped_secs: memory.max(arithmetic),
        serial_secs: memory + arithmetic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_reads_matrices_of_every_shape_through_both_reads() {
        // Rows of 64 and 256 elements, with more and fewer rows than the other: the products'
        // input and output buffers are sized by the widest of each.
        let (wide, tall) = (
            vec![half::bf16::ONE; 256 * 8],
            vec![half::bf16::ONE; 64 * 48],
        );
        let matrices = [
            Matrix {
                weight: Weight::Bf16(&wide),
                inner: 256,
            },
            Matrix {
                weight: Weight::Bf16(&tall),
                inner: 64,
            },
        ];
        for threads in [1, 2] {
            let kernels = Kernels::new(crate::engine::kernels::KernelOptions {
                threads: Some(threads),
                ..Default::default()
            })
            .expect("kernels");
            let summed = summed_bytes_per_sec(kernels.pool(), &matrices);
            let multiplied = multiplied_bytes_per_sec(&kernels, &matrices);
            assert!(summed.is_finite() && summed > 0.0, "{summed}");
            assert!(multiplied.is_finite() && multiplied > 0.0, "{multiplied}");
            let probe = weights_read_bytes_per_sec(&kernels, &matrices);
            assert!(probe.is_finite() && probe > 0.0, "{probe}");
        }
    }
}
