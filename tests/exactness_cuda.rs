//! The exactness suite on a CUDA GPU, built only with `--features cuda`: every speculative
//! lane equals the baseline token for token on random checkpoints, in f32 and in bf16, with
//! the whole step on the GPU. Where the build finds no GPU (no driver: `.ci/cuda-env`'s stub
//! libcuda answers), it says so and checks nothing; `.ci/cuda-check` compiles it.
//!
//! A difference fails the test in f32 and in bf16 alike: every step's matrices have one shape
//! (the device step pads its rows) and the attention reduces each row over its own span in a
//! fixed order (`decode_attention`'s kernel), so a token's pass has the same bits beside other
//! rows as alone. The failure names pass R's logit margin at that position, which tells a
//! near-tie (a reduction that still depends on the rows beside it) from a wrong step.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::{OPTIONS, PROMPTS, Variant, spec};
use spex::engine::LoadedModel;
use spex::engine::model::device_ops::fixtures;
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::write_random_checkpoint;
use spex::harness::bench::run_lane;

/// Pass R's top-1 − top-2 logit margin after `ids`, from the full-sequence forward.
fn last_pass_margin(loaded: &LoadedModel, ids: &[u32]) -> f32 {
    let device = loaded.model().weights.norm.device().clone();
    let input = Tensor::new(ids, &device)
        .and_then(|t| t.unsqueeze(0))
        .expect("ids tensor");
    let logits = loaded.model().forward_sequence(&input).expect("forward");
    let last = logits.last().expect("at least one pass");
    let (_, seq, _) = last.dims3().expect("[batch, seq, vocab]");
    let mut row: Vec<f32> = last
        .i((0, seq - 1))
        .and_then(|r| r.to_dtype(DType::F32))
        .and_then(|r| r.to_vec1())
        .expect("logits");
    row.sort_by(|a, b| b.total_cmp(a));
    row[0] - row[1]
}

/// Runs every policy against the baseline on every prompt.
fn check(loaded: &LoadedModel, label: &str) {
    for prompt in PROMPTS {
        let base = run_lane(loaded, PolicyKind::Baseline, prompt, OPTIONS).expect("baseline");
        for policy in [PolicyKind::Speed, PolicyKind::DUAL, PolicyKind::LOOPSPEC] {
            let lane = run_lane(loaded, policy, prompt, OPTIONS).expect("speculative lane");
            let Some(at) = base
                .tokens
                .iter()
                .zip(&lane.tokens)
                .position(|(a, b)| a != b)
            else {
                assert_eq!(base.tokens, lane.tokens, "{label} {policy}: {prompt:?}");
                continue;
            };
            let mut ids = loaded.tokenizer.encode(prompt).expect("encode");
            ids.extend(&base.tokens[..at]);
            let margin = last_pass_margin(loaded, &ids);
            panic!(
                "{label} {policy} {prompt:?}: token {at} differs ({} vs {}), pass R margin {margin}",
                base.tokens[at], lane.tokens[at]
            );
        }
    }
}

#[test]
fn speculative_equals_baseline_on_a_cuda_gpu() {
    let Some(device) = cuda_device() else { return };
    for dtype in [DType::F32, DType::BF16] {
        for (variant, seed) in [(Variant::Tied, 7), (Variant::Untied, 8), (Variant::Gqa, 9)] {
            let dir = tempfile::TempDir::new().expect("temp dir");
            write_random_checkpoint(dir.path(), &spec(2, 4, variant, seed)).expect("checkpoint");
            let loaded = LoadedModel::load(dir.path(), &device, dtype).expect("load on the GPU");
            check(&loaded, &format!("cuda {dtype:?} {variant:?}"));
        }
    }
}

/// The GPU, or `None` (said on stderr) where there is none.
fn cuda_device() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(device) => Some(device),
        Err(e) => {
            eprintln!("no CUDA device ({e}): nothing checked");
            None
        }
    }
}

/// A kernel's output against its CPU twin's, both tensors (`fixtures::assert_close`).
fn assert_close(what: &str, dtype: DType, want: &Tensor, got: &Tensor) {
    fixtures::assert_close(what, dtype, &fixtures::flat(want), &fixtures::flat(got));
}

/// Each device op's kernel against its CPU twin on the same inputs, in every dtype. Attention:
/// a span that crosses a chunk, grouped heads, a second candidate's extra column and a
/// padding row (zeros).
#[test]
fn device_op_kernels_match_their_cpu_twins() {
    use fixtures::{AttentionCase, AttentionShape, DTYPES, randn};
    use spex::engine::model::device_ops::{NO_ROW, rope_split, silu_mul, write_rows};
    let Some(gpu) = cuda_device() else { return };
    let case = AttentionCase::new(AttentionShape::WIDE, DType::F32);
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        capacity,
    } = case.shape;
    let rows = case.spans.len();
    let (q_lin, k_lin, v_lin) = (
        randn(&[rows, heads * head_dim]),
        randn(&[rows, kv_heads * head_dim]),
        randn(&[rows, kv_heads * head_dim]),
    );
    let angles = randn(&[rows, head_dim / 2]);
    let (cos, sin) = (angles.cos().expect("cos"), angles.sin().expect("sin"));
    let (gate, up) = (randn(&[rows, 512]), randn(&[rows, 512]));
    for dtype in DTYPES {
        let on = |t: &Tensor, device: &Device| {
            t.to_dtype(dtype)
                .and_then(|t| t.to_device(device))
                .expect("operand")
        };
        let attention = |d: &Device| case.attend(d, dtype).expect("decode attention");
        let got = attention(&gpu);
        assert_close("decode attention", dtype, &attention(&Device::Cpu), &got);
        let padding = fixtures::flat(&got.narrow(0, 3, 1).expect("row 3"));
        assert!(
            padding.iter().all(|&x| x == 0.0),
            "{dtype:?}: a padding row is zeros"
        );
        let split = |d: &Device| {
            rope_split(
                &on(&q_lin, d),
                &on(&k_lin, d),
                &on(&v_lin, d),
                &on(&cos, d),
                &on(&sin, d),
            )
            .expect("rope split")
        };
        assert_close("rope split", dtype, &split(&Device::Cpu), &split(&gpu));
        let silu = |d: &Device| silu_mul(&on(&gate, d), &on(&up, d)).expect("silu mul");
        assert_close("silu mul", dtype, &silu(&Device::Cpu), &silu(&gpu));
        let written = |d: &Device| {
            let cache = on(&case.keys, d);
            let to = Tensor::new(&[5u32, NO_ROW, 2 * capacity as u32 - 1, 0], d).expect("to");
            write_rows(&cache, &on(&case.k_step, d), &to).expect("write rows");
            cache
        };
        assert_close("write rows", dtype, &written(&Device::Cpu), &written(&gpu));
    }
}
