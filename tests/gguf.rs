//! GGUF checkpoints in llama.cpp's Ouro layout: what `spex quantize` writes loads back with
//! the same shape, tokenizer and (within Q8_0's step) weights; the host kernels' quantized
//! logits lie near the dequantized model's.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};
use common::{Variant, quantized_pair};
use spex::engine::LoadedModel;
use spex::engine::gguf::write::FileType;
use spex::engine::model::LoadOptions;

#[test]
fn a_quantized_checkpoint_keeps_its_shape_and_its_tokenizer() {
    for variant in [Variant::Tied, Variant::Untied, Variant::Gqa] {
        let (dir, _out, file) = quantized_pair(variant, 2, 3, 4, FileType::Q8_0);
        let original = LoadedModel::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
        let quantized = LoadedModel::load_gguf(
            &file,
            &Device::Cpu,
            DType::F32,
            LoadOptions::default(),
            &mut |_| {},
        )
        .unwrap();
        let (mut a, b) = (
            original.model().config.clone(),
            quantized.model().config.clone(),
        );
        a.rms_norm_eps = f64::from(a.rms_norm_eps as f32);
        assert_eq!(a, b, "{variant:?}");
        for text in common::PROMPTS
            .iter()
            .chain(&["ROMEO:\n  1234 ünïcødé\t<|im_start|>x"])
        {
            assert_eq!(
                original.tokenizer.encode(text).unwrap(),
                quantized.tokenizer.encode(text).unwrap(),
                "{text:?}"
            );
        }
        // Dequantized, every matrix lies within a block's step of the checkpoint's, in spex's
        // row order (a Q/K row left in llama.cpp's order would be off by whole values).
        let candle = LoadOptions {
            candle_ops: true,
            ..LoadOptions::default()
        };
        let deq = LoadedModel::load_gguf(&file, &Device::Cpu, DType::F32, candle, &mut |_| {});
        let deq = deq.unwrap();
        let (w, d) = (&original.model().weights, &deq.model().weights);
        let mut pairs = vec![(&w.embed_tokens, &d.embed_tokens), (&w.lm_head, &d.lm_head)];
        for (lw, ld) in w.layers.iter().zip(&d.layers) {
            pairs.extend(lw.projections().into_iter().zip(ld.projections()));
        }
        for (a, b) in pairs {
            let (a, b) = (a.flatten_all().unwrap(), b.flatten_all().unwrap());
            let (a, b) = (a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
            for (xa, xb) in a.chunks_exact(32).zip(b.chunks_exact(32)) {
                let step = xa.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                let off = xa
                    .iter()
                    .zip(xb)
                    .fold(0f32, |m, (u, v)| m.max((u - v).abs()));
                assert!(off <= step, "{variant:?}: off by {off}, step {step}");
            }
        }
    }
}

/// The host kernels' quantized baseline against the dequantized model's reference forward
/// (f32 weights equal to the blocks' values, f32 activations, both with an f32 KV cache): every
/// readout's token has a reference logit within `BEHIND` of the largest's magnitude of the
/// best, and a probability within `PROBABILITY` of the reference's. The difference is the
/// activations' rounding alone (8 bits a block of 32, each value off by at most 1/254 of its
/// block's largest), carried through every layer and pass; the bounds are twice the worst
/// seen (the commit that set them has the figures).
#[test]
fn quantized_logits_lie_near_the_dequantized_models() {
    quantized_logits_near(FileType::Q8_0, 0.02, 0.15);
}

/// The same for Q4_0, whose activations round as Q8_0's do.
#[test]
fn q4_0_logits_lie_near_the_dequantized_models() {
    quantized_logits_near(FileType::Q4_0, BEHIND_Q4_0, PROBABILITY_Q4_0);
}

/// Twice the worst seen, as for Q8_0.
const BEHIND_Q4_0: f32 = 0.007;
/// Twice the worst seen.
const PROBABILITY_Q4_0: f32 = 0.23;

/// The same for Q4_K_M, whose activations round per 256 values (`block_q8_K`).
#[test]
fn q4_k_m_logits_lie_near_the_dequantized_models() {
    quantized_logits_near(FileType::Q4KM, BEHIND_Q4_K_M, PROBABILITY_Q4_K_M);
}

/// Twice the worst seen, as for Q8_0.
const BEHIND_Q4_K_M: f32 = 0.004;
/// Twice the worst seen.
const PROBABILITY_Q4_K_M: f32 = 0.21;

/// The same for Q4_K_S and Q5_K_M, whose Q5_K matrices lie beside Q4_K or Q6_K ones.
#[test]
fn q4_k_s_and_q5_k_m_logits_lie_near_the_dequantized_models() {
    quantized_logits_near(FileType::Q4KS, BEHIND_Q4_K_S, PROBABILITY_Q4_K_S);
    quantized_logits_near(FileType::Q5KM, BEHIND_Q5_K_M, PROBABILITY_Q5_K_M);
}

/// Twice the worst seen, as for Q8_0.
const BEHIND_Q4_K_S: f32 = 0.04;
/// Twice the worst seen.
const PROBABILITY_Q4_K_S: f32 = 0.35;
/// Twice the worst seen, as for Q8_0.
const BEHIND_Q5_K_M: f32 = 0.03;
/// Twice the worst seen.
const PROBABILITY_Q5_K_M: f32 = 0.19;

fn quantized_logits_near(file_type: FileType, behind_bound: f32, probability_bound: f32) {
    use spex::engine::model::KvDtype;
    let (mut compared, mut worst, mut worst_behind) = (0, 0f32, 0f32);
    for (variant, seed) in [
        (Variant::Tied, 9),
        (Variant::Untied, 10),
        (Variant::Gqa, 11),
    ] {
        let (_dir, _out, file) = quantized_pair(variant, 2, 3, seed, file_type);
        let options = LoadOptions {
            kv_dtype: KvDtype::F32,
            ..LoadOptions::default()
        };
        let host =
            LoadedModel::load_gguf(&file, &Device::Cpu, DType::F32, options, &mut |_| {}).unwrap();
        let candle = LoadOptions {
            candle_ops: true,
            ..LoadOptions::default()
        };
        let deq =
            LoadedModel::load_gguf(&file, &Device::Cpu, DType::F32, candle, &mut |_| {}).unwrap();
        for gap in common::readout_gaps(&host, &deq) {
            worst_behind = worst_behind.max(gap.behind);
            worst = worst.max(gap.probability.abs());
            compared += 1;
        }
    }
    assert!(worst <= probability_bound, "probabilities off by {worst}");
    assert!(
        worst_behind <= behind_bound,
        "a choice {worst_behind} of the largest logit behind the best"
    );
    assert!(compared >= 100, "{compared} readouts compared");
}

/// The GGUF at `src` rewritten to `dst` with `edit` applied to its metadata and tensors.
fn rewrite(
    src: &std::path::Path,
    dst: &std::path::Path,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>),
) {
    let mut file = std::fs::File::open(src).unwrap();
    let content = Content::read(&mut file).unwrap();
    let mut metadata: Vec<(String, Value)> = content.metadata.clone().into_iter().collect();
    let mut tensors: Vec<(String, QTensor)> = (content.tensor_infos.keys())
        .map(|name| {
            (
                name.clone(),
                content.tensor(&mut file, name, &Device::Cpu).unwrap(),
            )
        })
        .collect();
    edit(&mut metadata, &mut tensors);
    let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).unwrap();
    candle_core::quantized::gguf_file::write(&mut out, &meta, &ts).unwrap();
}

fn generate(model: &std::path::Path) -> Vec<String> {
    let model = model.display().to_string();
    [
        "generate",
        "--model",
        &model,
        "--prompt",
        "To be",
        "--max-tokens",
        "3",
    ]
    .map(String::from)
    .to_vec()
}

fn assert_generate_fails(model: &std::path::Path, needle: &str) {
    let args = generate(model);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    common::assert_clean_error(&args, needle);
}

#[test]
fn a_quantized_file_generates_and_bad_ones_are_one_line() {
    let (_dir, out, file) = quantized_pair(Variant::Tied, 1, 2, 3, FileType::Q8_0);
    let args = generate(&file);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, stderr) = common::spex(&args);
    assert!(ok, "{stderr}");

    let other = out.path().join("llama.gguf");
    rewrite(&file, &other, |meta, _| {
        for (k, v) in meta.iter_mut() {
            if k == "general.architecture" {
                *v = Value::String("llama".into());
            }
        }
    });
    assert_generate_fails(
        &other,
        "general.architecture`: \"llama\" is not a looped model",
    );

    let q4 = out.path().join("q4_1.gguf");
    rewrite(&file, &q4, |_, tensors| {
        for (name, t) in tensors.iter_mut() {
            if name == "blk.0.ffn_up.weight" {
                let wide = t.dequantize(&Device::Cpu).unwrap();
                *t = QTensor::quantize(&wide, GgmlDType::Q4_1).unwrap();
            }
        }
    });
    assert_generate_fails(
        &q4,
        "tensor `blk.0.ffn_up.weight`: Q4_1 is a type spex cannot read yet",
    );

    let bytes = std::fs::read(&file).unwrap();
    let truncated = out.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() - 1000]).unwrap();
    assert_generate_fails(&truncated, "truncated");
    std::fs::write(&truncated, &bytes[..40]).unwrap();
    assert_generate_fails(&truncated, "not a readable GGUF file");

    let mute = out.path().join("no-tokenizer.gguf");
    rewrite(&file, &mute, |meta, _| {
        meta.retain(|(k, _)| !k.starts_with("tokenizer."))
    });
    assert_generate_fails(
        &mute,
        "tokenizer.ggml.model`: missing, and there is no tokenizer.json beside the file",
    );

    let f = file.display().to_string();
    common::assert_clean_error(
        &["quantize", "--type", "q5_k", "--out", "x.gguf"],
        "is not a type spex writes (q8_0, q4_0, q4_k_s, q4_k_m, q5_k_m, mlx-4bit, mlx-8bit;",
    );
    common::assert_clean_error(
        &["quantize", "--model", &f, "--out", "/tmp/never.gguf"],
        "already a GGUF file",
    );
}

/// The bench header names a GGUF file's block types and the integer products they take:
/// `--isa portable` takes the portable loops on any CPU.
#[test]
fn bench_names_the_block_types_and_their_integer_products() {
    let (_dir, out, file) = quantized_pair(Variant::Tied, 1, 2, 3, FileType::Q8_0);
    let prompts = out.path().join("prompts.txt");
    std::fs::write(&prompts, "To be, or not to be\n").unwrap();
    let (file, prompts) = (file.display().to_string(), prompts.display().to_string());
    let args = [
        "bench",
        "--model",
        &file,
        "--max-tokens",
        "2",
        "--runs",
        "1",
    ];
    let args = [&args[..], &["--prompts", &prompts, "--isa", "portable"]].concat();
    let table = common::spex_ok(&args, &[], std::path::Path::new("."));
    let table = String::from_utf8(table).unwrap();
    assert!(
        table.contains("Q8_0 weights (portable integer products)"),
        "{table}"
    );
    let json = [&args[..], &["--json"]].concat();
    let report = common::spex_ok(&json, &[], std::path::Path::new("."));
    let report: serde_json::Value = serde_json::from_slice(&report).unwrap();
    assert_eq!(report["weight_type"], "Q8_0");
    assert_eq!(report["integer_products"], "portable");
}
