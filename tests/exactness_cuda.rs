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
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::{PROMPTS, Variant, spec};
use spex::engine::bench::run_lane;
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::write_random_checkpoint;
use spex::engine::{DecodeOptions, LoadedModel};

const OPTIONS: DecodeOptions = DecodeOptions {
    max_tokens: 24,
    context: 128,
    sampling: spex::engine::Sampling::GREEDY,
};

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
    let device = match Device::new_cuda(0) {
        Ok(device) => device,
        Err(e) => {
            eprintln!("no CUDA device ({e}): nothing checked");
            return;
        }
    };
    for dtype in [DType::F32, DType::BF16] {
        for (variant, seed) in [(Variant::Tied, 7), (Variant::Untied, 8), (Variant::Gqa, 9)] {
            let dir = tempfile::TempDir::new().expect("temp dir");
            write_random_checkpoint(dir.path(), &spec(2, 4, variant, seed)).expect("checkpoint");
            let loaded = LoadedModel::load(dir.path(), &device, dtype).expect("load on the GPU");
            check(&loaded, &format!("cuda {dtype:?} {variant:?}"));
        }
    }
}

/// The decode-attention kernel against its CPU implementation on the same inputs: a span that
/// crosses a chunk, grouped heads, a second candidate's extra column and a padding row, in
/// every dtype (f32 to within its rounding, bf16 and f16 to within theirs).
#[test]
fn decode_attention_kernel_matches_the_cpu() {
    use spex::engine::model::decode_attention::{RowSpan, decode_attention, spans_tensor};
    let gpu = match Device::new_cuda(0) {
        Ok(device) => device,
        Err(e) => {
            eprintln!("no CUDA device ({e}): nothing checked");
            return;
        }
    };
    let (heads, kv_heads, head_dim, capacity, rows) = (8, 2, 128, 1500, 4);
    let randn = |shape: (usize, usize, usize)| Tensor::randn(0f32, 1.0, shape, &Device::Cpu);
    let q = randn((heads, rows, head_dim)).expect("q");
    let cache = (randn((kv_heads, 2 * capacity, head_dim)).expect("keys"))
        .broadcast_mul(&Tensor::new(0.5f32, &Device::Cpu).expect("scalar"))
        .expect("scaled");
    let values = randn((kv_heads, 2 * capacity, head_dim)).expect("values");
    let (k_step, v_step) = (
        randn((kv_heads, rows, head_dim)).expect("k"),
        randn((kv_heads, rows, head_dim)).expect("v"),
    );
    let spans = [
        RowSpan {
            start: 0,
            len: 7,
            extra: None,
        },
        RowSpan {
            start: capacity,
            len: 1400,
            extra: None,
        },
        RowSpan {
            start: capacity,
            len: 3,
            extra: Some(2),
        },
        RowSpan::EMPTY,
    ];
    for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 0.02), (DType::F16, 4e-3)] {
        let run = |device: &Device| -> Vec<Vec<f32>> {
            let on = |t: &Tensor| {
                t.to_dtype(dtype)
                    .and_then(|t| t.to_device(device))
                    .expect("operand")
            };
            let spans = spans_tensor(&spans, device).expect("spans");
            decode_attention(
                &on(&q),
                (&on(&cache), &on(&values)),
                (&on(&k_step), &on(&v_step)),
                &spans,
                1.0 / (head_dim as f32).sqrt(),
            )
            .and_then(|t| Ok(t.to_dtype(DType::F32)?.to_vec2::<f32>()?))
            .expect("decode attention")
        };
        let (want, got) = (run(&Device::Cpu), run(&gpu));
        let worst = (want.iter().flatten().zip(got.iter().flatten()))
            .fold(0f32, |w, (a, b)| w.max((a - b).abs()));
        assert!(
            worst <= tolerance,
            "{dtype:?}: the kernel differs from the CPU by {worst}"
        );
        assert!(
            got[3].iter().all(|&x| x == 0.0),
            "{dtype:?}: a padding row is zeros"
        );
    }
}
