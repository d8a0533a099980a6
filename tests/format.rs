//! Every checkpoint spex writes or ships holds exactly the Ouro format's tensor set, exit gate
//! included (so strict loaders such as mlx-lm's accept it); and streamed text ends like the
//! finish event's text, U+FFFD included where the output ends inside a character.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use candle_core::{DType, Device};
use spex::engine::events::DecodeEvent;
use spex::engine::format::{self, NEUTRAL_EXIT_GATE_BIAS};
use spex::engine::{DecodeOptions, Decoder, OuroConfig, PolicyKind};

/// The tensor names in `dir/model.safetensors` and the names the format asks for.
fn names_in(dir: &Path) -> (BTreeSet<String>, BTreeSet<String>) {
    let config = OuroConfig::load(&dir.join("config.json"))
        .expect("config.json")
        .looped();
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
        .expect("model.safetensors");
    let want = format::checkpoint_tensors(&config)
        .into_iter()
        .map(|t| {
            let shape = tensors.get(&t.name).map(|x| x.dims().to_vec());
            assert_eq!(
                shape.as_ref(),
                Some(&t.shape),
                "{}: {}",
                dir.display(),
                t.name
            );
            t.name
        })
        .collect();
    (tensors.into_keys().collect(), want)
}

/// The exit gate in `dir` is the neutral one: zero weight, bias −10.
fn assert_neutral_gate(dir: &Path) {
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
        .expect("model.safetensors");
    let values = |name: &str| -> Vec<f32> {
        tensors[name]
            .flatten_all()
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.to_vec1())
            .expect("a float tensor")
    };
    assert!(values(format::EXIT_GATE_WEIGHT).iter().all(|&w| w == 0.0));
    assert_eq!(values(format::EXIT_GATE_BIAS), [NEUTRAL_EXIT_GATE_BIAS]);
}

#[test]
fn shipped_checkpoints_hold_exactly_the_format_tensors() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
    for dir in [
        "models/shakespeare-r4k6-sync",
        "models/shakespeare-r4k6",
        "models/shakespeare-r4k4",
        "models/shakespeare-r1k6",
        "train/run",
    ] {
        let dir = root.join(dir);
        let (have, want) = names_in(&dir);
        assert_eq!(have, want, "{}", dir.display());
        // The default's gate is trained (`spex train-gate`, its model card); the others'
        // are neutral.
        if !dir.ends_with("shakespeare-r4k6-sync") {
            assert_neutral_gate(&dir);
        }
    }
}

#[test]
fn random_checkpoints_hold_exactly_the_format_tensors() {
    let tmp = tempfile::TempDir::new().expect("temp dir");
    // Untied in bf16, as Ouro's released checkpoints are stored.
    for (untied, dtype, stored, torch_dtype) in [
        (false, "f32", DType::F32, "float32"),
        (true, "bf16", DType::BF16, "bfloat16"),
    ] {
        let out = tmp.path().join(format!("untied-{untied}"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_spex"));
        cmd.args(["random-checkpoint", "--hidden", "32", "--layers", "2"])
            .args(["--heads", "2", "--vocab", "300", "--dtype", dtype, "--out"])
            .arg(&out);
        if untied {
            cmd.arg("--untied");
        }
        let status = cmd.status().expect("spex runs");
        assert!(status.success());
        let (have, want) = names_in(&out);
        assert_eq!(have, want, "untied {untied}");
        assert_neutral_gate(&out);
        let tensors = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu)
            .expect("model.safetensors");
        assert!(tensors.values().all(|t| t.dtype() == stored), "{dtype}");
        let config = OuroConfig::load(&out.join("config.json")).expect("config.json");
        assert_eq!(config.torch_dtype, torch_dtype);
        let generated = Command::new(env!("CARGO_BIN_EXE_spex"))
            .args(["generate", "--max-tokens", "4", "--prompt", "To be"])
            .arg("--model")
            .arg(&out)
            .output()
            .expect("spex runs");
        assert!(generated.status.success(), "{dtype}: {generated:?}");
    }
    for spec in [
        common::spec(2, 3, common::Variant::Untied, 4),
        common::spec(1, 2, common::Variant::Gqa, 5),
    ] {
        let (dir, _) = common::random_model(&spec);
        let (have, want) = names_in(dir.path());
        assert_eq!(have, want);
    }
}

/// Streams every committed token's delta and the finish event's tail.
fn streamed(decoder: &mut Decoder) -> (String, String) {
    let mut text = String::new();
    loop {
        match decoder.next_event().expect("decodes") {
            Some(DecodeEvent::Prefill(p)) => text.push_str(&p.first.text_delta),
            Some(DecodeEvent::Step(s)) => s.committed.iter().for_each(|c| {
                text.push_str(&c.text_delta);
            }),
            Some(DecodeEvent::Finished(f)) => {
                text.push_str(&f.text_tail);
                return (text, f.text);
            }
            None => unreachable!("the finish event comes before the end"),
        }
    }
}

#[test]
fn streamed_text_ends_like_the_finish_text_even_mid_character() {
    let (_dir, loaded) = common::random_model(&common::spec(2, 3, common::Variant::Tied, 7));
    let mut mid_character = 0;
    for prompt in common::PROMPTS {
        for max_tokens in 1..=12 {
            let options = DecodeOptions {
                max_tokens,
                context: 128,
                sampling: spex::engine::Sampling::GREEDY,
                exit_threshold: None,
            };
            let policy = PolicyKind::Speed.build();
            let mut decoder = Decoder::new(&loaded, policy, prompt, options).expect("decoder");
            let (streamed, finished) = streamed(&mut decoder);
            assert_eq!(streamed, finished, "{prompt:?}, {max_tokens} tokens");
            mid_character += usize::from(finished.ends_with('\u{FFFD}'));
        }
    }
    assert!(
        mid_character > 0,
        "some run ends inside a multi-byte character"
    );
}

/// A shard index's names, each once and in order; one outside the checkpoint's folder is an
/// error naming the index (the loader and `spex pull` read it the same way).
#[test]
fn a_shard_index_names_its_shards_inside_its_folder() {
    use spex::engine::checkpoint::{SHARD_INDEX, shard_names};
    let dir = tempfile::TempDir::new().unwrap();
    let index = dir.path().join(SHARD_INDEX);
    let write = |map: &str| {
        let text = format!(r#"{{"metadata": {{}}, "weight_map": {map}}}"#);
        std::fs::write(&index, text).unwrap();
    };
    write(
        r#"{"b": "model-2.safetensors", "a": "model-1.safetensors", "c": "model-2.safetensors"}"#,
    );
    assert_eq!(
        shard_names(&index).unwrap(),
        ["model-1.safetensors", "model-2.safetensors"]
    );
    for bad in [
        "../x.safetensors",
        "/etc/x.safetensors",
        "a/../../x.safetensors",
    ] {
        write(&format!(r#"{{"a": "{bad}"}}"#));
        let err = shard_names(&index).unwrap_err().to_string();
        assert!(
            err.contains(SHARD_INDEX) && err.contains("outside") && !err.contains('\n'),
            "{err}"
        );
    }
    write("[]");
    let err = shard_names(&index).unwrap_err().to_string();
    assert!(err.contains("weight_map"), "{err}");
}

/// Ouro's exit gate is evaluated after every pass of every row: the λ a verified row reports
/// equals σ(w · h + b) on the reference forward's normed state at that pass and position.
/// (The checkpoints of every exactness test hold a random gate, so they also show that
/// evaluating it changes no token.)
#[test]
fn every_row_reports_the_reference_exit_probability() {
    use spex::engine::exit_gate::sigmoid;
    use spex::engine::model::reference::ComposedF16Kv;
    let (_dir, loaded) = common::random_model(&common::spec(2, 4, common::Variant::Untied, 11));
    let model = loaded.model();
    let gate = model
        .weights
        .exit_gate
        .clone()
        .expect("the checkpoint's gate");
    let (w, b) = (
        gate.weight.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        gate.bias.to_vec1::<f32>().unwrap()[0],
    );
    let options = DecodeOptions {
        max_tokens: 12,
        context: 128,
        sampling: spex::engine::Sampling::GREEDY,
        exit_threshold: None,
    };
    for policy in [PolicyKind::Baseline, PolicyKind::Speed] {
        let (rows, tokens) = common::decoded_rows(&loaded, policy, "To be", options);
        let mut ids = loaded.tokenizer.encode("To be").unwrap();
        ids.extend(&tokens);
        let input = candle_core::Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let hidden =
            (model.hidden_per_pass_with(&input.unsqueeze(0).unwrap(), &ComposedF16Kv)).unwrap();
        let mut compared = 0;
        for row in rows.iter().filter(|r| r.verified && !r.dropped) {
            let h = hidden[row.pass.index()]
                .squeeze(0)
                .unwrap()
                .get(row.pos)
                .unwrap();
            let h = h.to_vec1::<f32>().unwrap();
            let want = sigmoid(h.iter().zip(&w).map(|(x, w)| x * w).sum::<f32>() + b);
            let got = row.exit_probability.expect("a gate for every row");
            assert!(
                (got - want).abs() < 1e-4,
                "{policy} {row:?}: {got} vs {want}"
            );
            compared += 1;
        }
        assert!(compared >= 12, "{policy}: {compared} rows compared");
    }
}
