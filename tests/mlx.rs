//! mlx-community's quantized checkpoints: what `spex quantize --type mlx-…` writes has mlx-lm's
//! layout and loads back with the same shape and tokenizer, its weights within a step of the
//! source's; the host kernels' logits equal the dequantized model's up to f32 summation; every
//! lane equals the baseline on 8-bit and 128-group files; bad files are one line.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::{Variant, mlx_pair};
use spex::engine::kernels::AffineKind;
use spex::engine::model::{KvDtype, LoadOptions};
use spex::engine::{DecodeOptions, LoadedModel, PolicyKind, Sampling};

fn kind(bits: u32, group: usize) -> AffineKind {
    AffineKind::new(bits, group).unwrap()
}

#[test]
fn a_quantized_checkpoint_has_mlx_lms_layout_and_loads_back() {
    for (variant, k) in [
        (Variant::Tied, kind(4, 64)),
        (Variant::Untied, kind(8, 32)),
        (Variant::Gqa, kind(4, 32)),
    ] {
        let (dir, out) = mlx_pair(variant, 2, 3, 4, k);
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.path().join("config.json")).unwrap())
                .unwrap();
        let block = &config["quantization"];
        assert_eq!(block["bits"], k.bits(), "{variant:?}");
        assert_eq!(block["group_size"], k.group());
        assert_eq!(config["quantization_config"], *block);
        // mlx-lm's Ouro quantizes its exit gate at 8 bits in groups of 64.
        assert_eq!(block["model.early_exit_gate"]["bits"], 8);
        let tensors =
            candle_core::safetensors::load(out.path().join("model.safetensors"), &Device::Cpu)
                .unwrap();
        let q = &tensors["model.layers.0.self_attn.q_proj.weight"];
        assert_eq!(q.dtype(), DType::U32);
        assert_eq!(q.dims(), [64, 64 * k.bits() as usize / 32]);
        assert_eq!(
            tensors["model.layers.0.self_attn.q_proj.scales"].dtype(),
            DType::BF16
        );
        // A 96-wide row holds no whole group of 64: mlx-lm leaves it dense.
        let down = &tensors["model.layers.0.mlp.down_proj.weight"];
        assert_eq!(
            down.dtype() == DType::BF16,
            k.group() == 64,
            "{variant:?} {k:?}"
        );

        let original = LoadedModel::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
        let quantized = LoadedModel::load(out.path(), &Device::Cpu, DType::F32).unwrap();
        assert_eq!(
            original.model().config,
            quantized.model().config,
            "{variant:?}"
        );
        assert_eq!(quantized.model().weight_type(), k.name());
        for text in common::PROMPTS.iter().take(4) {
            assert_eq!(
                original.tokenizer.encode(text).unwrap(),
                quantized.tokenizer.encode(text).unwrap()
            );
        }
        // Dequantized (the candle path), every weight lies within half a step of the
        // source's, the step being its group's (max − min) / (2^bits − 1), plus the scale's
        // and bias's bf16 rounding.
        let deq = LoadedModel::load_with(out.path(), &Device::Cpu, DType::F32, candle()).unwrap();
        let (w, d) = (&original.model().weights, &deq.model().weights);
        let mut pairs = vec![(&w.embed_tokens, &d.embed_tokens), (&w.lm_head, &d.lm_head)];
        for (lw, ld) in w.layers.iter().zip(&d.layers) {
            pairs.extend(lw.projections().into_iter().zip(ld.projections()));
        }
        for (a, b) in pairs {
            let (a, b) = (flat(a), flat(b));
            for (xa, xb) in a.chunks_exact(k.group()).zip(b.chunks_exact(k.group())) {
                let (lo, hi) = xa
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
                let step = (hi - lo) / ((1u32 << k.bits()) - 1) as f32;
                let bound = 0.5 * step * 1.02 + (hi.abs().max(lo.abs())) / 128.0;
                let off = xa
                    .iter()
                    .zip(xb)
                    .fold(0f32, |m, (u, v)| m.max((u - v).abs()));
                assert!(
                    off <= bound,
                    "{variant:?} {k:?}: off by {off}, bound {bound}"
                );
            }
        }
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Options for the candle path: every matrix dequantized to f32.
fn candle() -> LoadOptions {
    LoadOptions {
        candle_ops: true,
        ..LoadOptions::default()
    }
}

/// The host kernels on the blocks against the dequantized model's reference forward (both
/// with an f32 KV cache): the activations are not rounded, so the two differ by the order of
/// f32 sums alone. Every readout's probability lies within `1e-4` of the reference's and its
/// token is the reference's best or within `1e-5` of it.
#[test]
fn logits_equal_the_dequantized_models_up_to_summation_order() {
    let mut compared = 0;
    for (variant, seed, k) in [
        (Variant::Tied, 9, kind(4, 64)),
        (Variant::Untied, 10, kind(8, 64)),
        (Variant::Gqa, 11, kind(4, 128)),
    ] {
        let (_dir, out) = mlx_pair(variant, 2, 3, seed, k);
        let f32_kv = LoadOptions {
            kv_dtype: KvDtype::F32,
            ..LoadOptions::default()
        };
        let host = LoadedModel::load_with(out.path(), &Device::Cpu, DType::F32, f32_kv).unwrap();
        let deq = LoadedModel::load_with(out.path(), &Device::Cpu, DType::F32, candle()).unwrap();
        for gap in common::readout_gaps(&host, &deq) {
            assert!(
                gap.behind <= 1e-5,
                "{variant:?} {k:?}: {} behind the best",
                gap.behind
            );
            assert!(
                gap.probability.abs() <= 1e-4,
                "{variant:?}: probability off by {}",
                gap.probability
            );
            compared += 1;
        }
    }
    assert!(compared >= 100, "{compared} readouts compared");
}

/// Every pipelined and drafting lane equals the baseline on 8-bit and 128-group files, on a
/// few shapes (the full grid runs at 4 bits in `tests/exactness`).
#[test]
fn every_lane_equals_the_baseline_on_8_bit_and_wide_groups() {
    for (variant, layers, passes, k) in [
        (Variant::Tied, 2, 4, kind(8, 64)),
        (Variant::Gqa, 1, 3, kind(8, 32)),
        (Variant::Untied, 2, 4, kind(4, 32)),
    ] {
        let (_dir, out) = mlx_pair(variant, layers, passes, 5, k);
        let loaded = LoadedModel::load(out.path(), &Device::Cpu, DType::F32).unwrap();
        for prompt in common::PROMPTS.iter().take(3) {
            let decode = DecodeOptions {
                max_tokens: 24,
                context: 128,
                sampling: Sampling::GREEDY,
                exit_threshold: None,
            };
            let (_, want) = common::decoded_rows(&loaded, PolicyKind::Baseline, prompt, decode);
            for policy in ["speed", "dual", "loopspec", "self-draft"] {
                let kind: PolicyKind = policy.parse().unwrap();
                let (_, got) = common::decoded_rows(&loaded, kind, prompt, decode);
                assert_eq!(got, want, "{policy} {variant:?} {k:?} {prompt:?}");
            }
        }
    }
}

/// `out`'s config.json with `edit` applied.
fn edit_config(out: &std::path::Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = out.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
}

fn assert_generate_fails(model: &std::path::Path, needle: &str) {
    let model = model.display().to_string();
    let args = [
        "generate",
        "--model",
        &model,
        "--prompt",
        "To be",
        "--max-tokens",
        "3",
    ];
    common::assert_clean_error(&args, needle);
}

#[test]
fn a_quantized_checkpoint_generates_and_bad_ones_are_one_line() {
    let (_dir, out) = mlx_pair(Variant::Tied, 1, 2, 3, kind(4, 64));
    let quantized = out.path().display().to_string();
    let (ok, stderr) = common::spex(&["generate", "--model", &quantized, "--prompt", "To be"]);
    assert!(ok, "{stderr}");

    for (edit, needle) in [
        (
            ("bits", serde_json::json!(3)),
            "quantization.bits`: 3 is not a width spex reads (4, 8)",
        ),
        (
            ("group_size", serde_json::json!(48)),
            "quantization.group_size`: 48 is not a group size spex reads (32, 64, 128)",
        ),
        (
            ("mode", serde_json::json!("mxfp4")),
            "quantization.mode`: \"mxfp4\" is not a mode",
        ),
    ] {
        let (_d, bad) = mlx_pair(Variant::Tied, 1, 2, 3, kind(4, 64));
        edit_config(bad.path(), |c| c["quantization"][edit.0] = edit.1.clone());
        assert_generate_fails(bad.path(), needle);
    }
    // The file says 8 bits where the words hold 4: the tensor is named.
    let (_d, bad) = mlx_pair(Variant::Tied, 1, 2, 3, kind(4, 64));
    edit_config(bad.path(), |c| c["quantization"]["bits"] = 8.into());
    assert_generate_fails(
        bad.path(),
        "q_proj.weight: 8 words a row are 32 weights of 8 bits",
    );

    common::assert_clean_error(
        &[
            "quantize",
            "--model",
            &quantized,
            "--type",
            "mlx-4bit",
            "--out",
            "/tmp/never",
        ],
        "already quantized (mlx)",
    );
    common::assert_clean_error(
        &["quantize", "--type", "mlx-4bit-g48", "--out", "/tmp/never"],
        "\"mlx-4bit-g48\" is not a type spex writes (q8_0, q4_0, q4_k_s, q4_k_m, q5_k_m, mlx-4bit, mlx-8bit; mlx types \
         take -g32 or -g128",
    );
    // The other group sizes are written by name.
    let out = tempfile::TempDir::new().unwrap();
    let g32 = out.path().join("g32").display().to_string();
    let model = _dir.path().display().to_string();
    let args = [
        "quantize",
        "--model",
        &model,
        "--type",
        "mlx-8bit-g32",
        "--out",
        &g32,
    ];
    let (ok, stderr) = common::spex(&args);
    assert!(ok, "{stderr}");
    let loaded = LoadedModel::load(std::path::Path::new(&g32), &Device::Cpu, DType::F32).unwrap();
    assert_eq!(loaded.model().weight_type(), "mlx8/g32");
}
