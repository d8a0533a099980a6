//! GGUF checkpoints in llama.cpp's Ouro layout: what `spex quantize` writes loads back with
//! the same shape, tokenizer and (within Q8_0's step) weights; the host kernels' quantized
//! logits lie near the dequantized model's.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use candle_core::{DType, Device};
use common::{Variant, quantized_pair};
use spex::engine::LoadedModel;
use spex::engine::model::LoadOptions;

#[test]
fn a_quantized_checkpoint_keeps_its_shape_and_its_tokenizer() {
    for variant in [Variant::Tied, Variant::Untied, Variant::Gqa] {
        let (dir, _out, file) = quantized_pair(variant, 2, 3, 4);
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
    }
}

#[test]
fn quantized_logits_lie_near_the_dequantized_models() {
    let (dir, _out, file) = quantized_pair(Variant::Untied, 2, 3, 9);
    let deq = LoadedModel::load_gguf(
        &file,
        &Device::Cpu,
        DType::F32,
        LoadOptions {
            candle_ops: true,
            ..LoadOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    let original = LoadedModel::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
    let ids = original.tokenizer.encode("To be, or not to be").unwrap();
    let a = common::reference_logits(&original, &ids);
    let b = common::reference_logits(&deq, &ids);
    for (p, (x, y)) in a.iter().zip(&b).enumerate() {
        let d = x
            .iter()
            .flatten()
            .zip(y.iter().flatten())
            .map(|(u, v)| (u - v).abs())
            .fold(0f32, f32::max);
        let scale = x.iter().flatten().map(|u| u.abs()).fold(0f32, f32::max);
        eprintln!("pass {p}: max |Δ| {d} of max |logit| {scale}");
    }
}
