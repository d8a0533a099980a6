//! Speculative output equals baseline output token for token, on many prompts and shapes, and
//! the batched step equals the unbatched reference forward.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    OPTIONS, PROMPTS, Variant, exactness_prompts, random_model, spec, with_device_backend,
    with_f32_readouts, with_kv_dtype,
};
use spex::engine::LoadedModel;
use spex::engine::gguf::write::FileType;
use spex::engine::kernels;
use spex::engine::kernels::AffineKind;
use spex::engine::model::{Backend, KvDtype, LoadOptions};
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::write_random_checkpoint;
use spex::harness::bench::run_lane;

/// The batched step against the unbatched reference forward.
#[path = "exactness/reference_step.rs"]
mod reference_step;

/// What the speculative lanes did over all prompts: runs, flips, and the second candidates
/// `dual` started and committed.
#[derive(Default)]
struct Tally {
    runs: usize,
    loopspec_runs: usize,
    self_draft_runs: usize,
    flips: usize,
    second_proposals: usize,
    accepted_second: usize,
}

/// Which policies a suite runs: SPEED's pipelined ones (baseline, speed, dual, loopspec), the
/// self-drafting ones, or both. The drafting suite runs natively only (`.ci/aarch64-check`):
/// its rows are the kernels' rows, which the pipelined suite and the kernels' unit tests
/// check under qemu.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Suite {
    Pipelined,
    Drafting,
    All,
}

/// Every policy of `suite` that can run on a model with `passes` passes: loopspec's depths
/// and self-draft's must be below R.
fn policies(passes: usize, suite: Suite) -> Vec<PolicyKind> {
    let parse = |name: &str| name.parse::<PolicyKind>().expect("a valid policy");
    let mut pipelined = vec![PolicyKind::Baseline, PolicyKind::Speed, PolicyKind::DUAL];
    let mut drafting = Vec::new();
    if passes >= 2 {
        pipelined.push(PolicyKind::LOOPSPEC);
        drafting.push(parse("self-draft"));
    }
    if passes >= 3 {
        pipelined.push(parse("loopspec:d1=1:d2=2"));
        drafting.push(parse("self-draft:d=2:g=2"));
    }
    match suite {
        Suite::Pipelined => pipelined,
        Suite::Drafting => drafting,
        Suite::All => [pipelined, drafting].concat(),
    }
}

/// Every lane on `loaded` (its proposal readouts from the f16 head where the CPU has one)
/// against ordinary greedy decoding with the f32 head.
fn assert_lanes_equal(loaded: &LoadedModel, label: &str, tally: &mut Tally) {
    let prompts = exactness_prompts(PROMPTS.len());
    assert_lanes_equal_on(loaded, &prompts, Suite::All, label, tally);
}

/// [`assert_lanes_equal`] on `prompts`, with the policies of `suite`.
fn assert_lanes_equal_on(
    loaded: &LoadedModel,
    prompts: &[&str],
    suite: Suite,
    label: &str,
    tally: &mut Tally,
) {
    let greedy = with_f32_readouts(loaded);
    for &prompt in prompts {
        let base = run_lane(&greedy, PolicyKind::Baseline, prompt, OPTIONS).expect("baseline");
        assert!(!base.tokens.is_empty());
        for policy in policies(loaded.model().passes(), suite) {
            let lane = run_lane(loaded, policy, prompt, OPTIONS).expect("speculative lane");
            assert_eq!(
                base.tokens, lane.tokens,
                "{label} {policy}: prompt {prompt:?}"
            );
            tally.runs += 1;
            tally.loopspec_runs += usize::from(matches!(policy, PolicyKind::LoopSpec { .. }));
            tally.self_draft_runs += usize::from(matches!(policy, PolicyKind::SelfDraft { .. }));
            tally.flips += lane.stats.flips_per_pass.iter().sum::<usize>();
            tally.second_proposals += lane.stats.second_proposals;
            tally.accepted_second += lane.stats.accepted_second;
        }
    }
}

/// Every lane of `suite` against the ordinary greedy baseline on every shape of one variant:
/// K = 1, 2, 4 layers and R = 1–4 passes, each with the f16 and the f32 KV cache. One test per
/// variant, so that the test threads share the shapes (most of the suite's time, most of all
/// under qemu).
fn every_shape(variant: Variant, suite: Suite) -> Tally {
    let mut tally = Tally::default();
    let prompts = exactness_prompts(PROMPTS.len());
    for layers in [1, 2, 4] {
        for passes in [1, 2, 3, 4] {
            let seed = (layers * 10 + passes) as u64;
            let (_dir, loaded) = random_model(&spec(layers, passes, variant, seed));
            for kv in [KvDtype::F16, KvDtype::F32] {
                let label = format!("{variant:?} K={layers} R={passes} KV {kv:?}");
                let loaded = with_kv_dtype(&loaded, kv);
                assert_lanes_equal_on(&loaded, &prompts, suite, &label, &mut tally);
            }
        }
    }
    tally
}

/// The pipelined policies on every shape of `variant`: 3 policies on 12 shapes, loopspec on
/// the 9 with R ≥ 2 and loopspec:d2=2 on the 6 with R ≥ 3, per prompt and KV element type.
fn pipelined_on_every_shape(variant: Variant) {
    let tally = every_shape(variant, Suite::Pipelined);
    let prompts = exactness_prompts(PROMPTS.len()).len();
    assert_eq!(tally.runs, 2 * prompts * (36 + 9 + 6));
    assert_eq!(tally.loopspec_runs, 2 * prompts * (9 + 6));
    // Per prompt: 5 flips, 5 second candidates started, one of them committed.
    assert!(
        tally.flips > 5 * prompts,
        "random models should flip often, saw {}",
        tally.flips
    );
    // Random models' readouts are near ties: second candidates start often and win often.
    assert!(
        tally.second_proposals > 5 * prompts,
        "{} second proposals",
        tally.second_proposals
    );
    assert!(
        tally.accepted_second > prompts,
        "{} accepted",
        tally.accepted_second
    );
}

#[test]
fn speed_equals_baseline_on_every_tied_shape() {
    pipelined_on_every_shape(Variant::Tied);
}

#[test]
fn speed_equals_baseline_on_every_untied_shape() {
    pipelined_on_every_shape(Variant::Untied);
}

#[test]
fn speed_equals_baseline_on_every_gqa_shape() {
    pipelined_on_every_shape(Variant::Gqa);
}

/// Self-draft on every shape of every variant: self-draft on the 9 shapes with R ≥ 2 and
/// self-draft:d=2:g=2 on the 6 with R ≥ 3, per prompt and KV element type.
#[test]
fn self_draft_equals_baseline_on_every_shape() {
    for variant in [Variant::Tied, Variant::Untied, Variant::Gqa] {
        let tally = every_shape(variant, Suite::Drafting);
        let prompts = exactness_prompts(PROMPTS.len()).len();
        assert_eq!(tally.runs, 2 * prompts * (9 + 6));
        assert_eq!(tally.self_draft_runs, 2 * prompts * (9 + 6));
    }
}

/// The shapes of the suites over stored weights: every variant with K = 1, 2, 4 layers and
/// R = 1–4 passes.
fn stored_shapes() -> impl Iterator<Item = (Variant, usize, usize)> {
    [Variant::Tied, Variant::Untied, Variant::Gqa]
        .into_iter()
        .flat_map(|v| {
            [1, 2, 4]
                .into_iter()
                .flat_map(move |k| (1..=4).map(move |r| (v, k, r)))
        })
}

/// Weights the host kernels read as stored, in bf16 or f16, on every shape of every variant:
/// every lane equals the baseline, and where the kernels widen the weights (every ISA but
/// AVX-512 BF16's bf16 products, which round the activations to bf16) the baseline equals,
/// token for token, the same checkpoint widened to f32 (a widened bf16 or f16 is exact).
fn every_shape_stored(dtype: DType, suite: Suite) -> Tally {
    let mut tally = Tally::default();
    let prompts = &exactness_prompts(6)[..];
    for (variant, layers, passes) in stored_shapes() {
        let mut spec = spec(layers, passes, variant, (layers * 10 + passes) as u64);
        spec.dtype = dtype;
        let dir = tempfile::TempDir::new().expect("temp dir");
        write_random_checkpoint(dir.path(), &spec).expect("checkpoint");
        let stored = LoadedModel::load(dir.path(), &Device::Cpu, dtype).expect("load");
        assert!(matches!(stored.backend, Backend::Host(_)), "host kernels");
        let label = format!("{dtype:?} {variant:?} K={layers} R={passes}");
        assert_lanes_equal_on(&stored, prompts, suite, &label, &mut tally);
        let fused = dtype == DType::BF16 && kernels::detected_isa() == kernels::Isa::Avx512Bf16;
        if fused || suite == Suite::Drafting {
            continue;
        }
        let widened = LoadedModel::load(dir.path(), &Device::Cpu, DType::F32).expect("load");
        let widened = with_f32_readouts(&widened);
        for &prompt in prompts {
            let a = run_lane(&stored, PolicyKind::Baseline, prompt, OPTIONS).expect("lane");
            let b = run_lane(&widened, PolicyKind::Baseline, prompt, OPTIONS).expect("lane");
            assert_eq!(
                a.tokens, b.tokens,
                "{label}: stored and widened, {prompt:?}"
            );
        }
    }
    tally
}

/// The pipelined policies with weights as stored in `dtype`.
fn pipelined_on_every_shape_stored(dtype: DType) {
    let tally = every_shape_stored(dtype, Suite::Pipelined);
    // Per prompt (of at most 6): 17 flips, and 5 committed second candidates over 3 prompts.
    let prompts = exactness_prompts(6).len();
    assert!(
        tally.flips > 17 * prompts,
        "{dtype:?}: {} flips",
        tally.flips
    );
    assert!(
        3 * tally.accepted_second > 5 * prompts,
        "{dtype:?}: {}",
        tally.accepted_second
    );
}

#[test]
fn speed_equals_baseline_on_every_shape_with_bf16_weights() {
    pipelined_on_every_shape_stored(DType::BF16);
}

#[test]
fn speed_equals_baseline_on_every_shape_with_f16_weights() {
    pipelined_on_every_shape_stored(DType::F16);
}

/// Self-draft with bf16 and f16 weights as stored, on every shape of every variant.
#[test]
fn self_draft_equals_baseline_with_stored_weights() {
    for dtype in [DType::BF16, DType::F16] {
        let tally = every_shape_stored(dtype, Suite::Drafting);
        let prompts = exactness_prompts(6).len();
        assert_eq!(tally.self_draft_runs, prompts * 3 * (9 + 6), "{dtype:?}");
    }
}

/// Every lane of `suite` on quantized weights (a GGUF of `spex quantize` in `file_type`) on
/// every shape of every variant, with the activations quantized per row.
fn every_shape_quantized(suite: Suite, file_type: FileType) -> Tally {
    let mut tally = Tally::default();
    let prompts = &exactness_prompts(6)[..];
    for (variant, layers, passes) in stored_shapes() {
        let seed = (layers * 10 + passes) as u64;
        // Q4_0 on narrow rows (a twentieth of the wide shape's MLP): its blocks are Q8_0's
        // size, and the Q6_K head the wide shape would give it is the Q4_K_M suite's.
        let wide = matches!(file_type, FileType::Q4KM | FileType::Q5KM);
        let quantized = common::quantized_file(&common::QuantizedSpec {
            variant,
            layers,
            passes,
            seed,
            file_type,
            wide,
        });
        let loaded = LoadedModel::load_gguf(
            &quantized.file,
            &Device::Cpu,
            DType::F32,
            LoadOptions::default(),
            &mut |_| {},
        )
        .expect("load the GGUF");
        assert!(matches!(loaded.backend, Backend::Host(_)), "host kernels");
        let stored = loaded.model().weight_type();
        let want = match file_type {
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_0 => "Q4_0",
            FileType::Q4KS => "Q4_K+Q5_K",
            FileType::Q4KM => "Q4_K+Q6_K",
            FileType::Q5KM => "Q5_K+Q6_K",
        };
        assert_eq!(stored, want, "{file_type:?} K={layers}");
        let label = format!("{stored} {variant:?} K={layers} R={passes}");
        assert_lanes_equal_on(&loaded, prompts, suite, &label, &mut tally);
    }
    tally
}

/// Every lane of `suite` on mlx-quantized weights (`spex quantize --type mlx-…` of a bf16
/// checkpoint) on every shape of every variant: float activations against affine groups.
fn every_shape_mlx(suite: Suite, kind: AffineKind) -> Tally {
    let mut tally = Tally::default();
    let prompts = &exactness_prompts(6)[..];
    for (variant, layers, passes) in stored_shapes() {
        let seed = (layers * 10 + passes) as u64;
        let (_dir, out) = common::mlx_pair(variant, layers, passes, seed, kind);
        let loaded = LoadedModel::load(out.path(), &Device::Cpu, DType::F32).expect("load");
        assert!(matches!(loaded.backend, Backend::Host(_)), "host kernels");
        let stored = loaded.model().weight_type();
        assert_eq!(stored, kind.name(), "K={layers}");
        let label = format!("{stored} {variant:?} K={layers} R={passes}");
        assert_lanes_equal_on(&loaded, prompts, suite, &label, &mut tally);
    }
    tally
}

/// The pipelined policies on mlx's 4-bit groups of 64 (mlx-community's usual files).
#[test]
fn speed_equals_baseline_on_every_shape_with_mlx_4bit_weights() {
    let kind = AffineKind::new(4, 64).unwrap();
    let tally = every_shape_mlx(Suite::Pipelined, kind);
    let prompts = exactness_prompts(6).len();
    assert!(tally.flips > 17 * prompts, "{} flips", tally.flips);
}

/// The pipelined policies on Q8_0 weights: every lane equals the baseline, token for token.
#[test]
fn speed_equals_baseline_on_every_shape_with_q8_0_weights() {
    let tally = every_shape_quantized(Suite::Pipelined, FileType::Q8_0);
    let prompts = exactness_prompts(6).len();
    assert!(tally.flips > 17 * prompts, "{} flips", tally.flips);
}

/// The pipelined policies on Q4_K_M weights (Q4_K and Q6_K matrices).
#[test]
fn speed_equals_baseline_on_every_shape_with_q4_k_m_weights() {
    let tally = every_shape_quantized(Suite::Pipelined, FileType::Q4KM);
    let prompts = exactness_prompts(6).len();
    assert!(tally.flips > 17 * prompts, "{} flips", tally.flips);
}

/// The pipelined policies on Q5_K_M weights (Q5_K and Q6_K matrices).
#[test]
fn speed_equals_baseline_on_every_shape_with_q5_k_m_weights() {
    let tally = every_shape_quantized(Suite::Pipelined, FileType::Q5KM);
    let prompts = exactness_prompts(6).len();
    assert!(tally.flips > 17 * prompts, "{} flips", tally.flips);
}

/// The pipelined policies on Q4_0 weights (its LM head in Q8_0 on these narrow rows).
#[test]
fn speed_equals_baseline_on_every_shape_with_q4_0_weights() {
    let tally = every_shape_quantized(Suite::Pipelined, FileType::Q4_0);
    let prompts = exactness_prompts(6).len();
    assert!(tally.flips > 17 * prompts, "{} flips", tally.flips);
}

/// Self-draft on Q8_0 weights (natively only, as every drafting suite: `.ci/aarch64-check`).
#[test]
fn self_draft_equals_baseline_with_q8_0_weights() {
    let tally = every_shape_quantized(Suite::Drafting, FileType::Q8_0);
    let prompts = exactness_prompts(6).len();
    assert_eq!(tally.self_draft_runs, prompts * 3 * (9 + 6));
}

/// Self-draft on Q4_K_M weights (natively only).
#[test]
fn self_draft_equals_baseline_with_q4_k_m_weights() {
    let tally = every_shape_quantized(Suite::Drafting, FileType::Q4KM);
    let prompts = exactness_prompts(6).len();
    assert_eq!(tally.self_draft_runs, prompts * 3 * (9 + 6));
}

#[test]
fn speed_equals_baseline_on_the_device_code_path() {
    let mut tally = Tally::default();
    for variant in [Variant::Tied, Variant::Untied, Variant::Gqa] {
        let (_dir, loaded) = random_model(&spec(2, 4, variant, 7));
        let device = with_device_backend(&loaded);
        assert_lanes_equal(&device, &format!("device {variant:?}"), &mut tally);
        // The device path keeps f32 keys and values, like the host's f32 cache.
        let host = with_kv_dtype(&loaded, KvDtype::F32);
        let host = run_lane(&host, PolicyKind::Baseline, PROMPTS[0], OPTIONS).unwrap();
        let dev = run_lane(&device, PolicyKind::Baseline, PROMPTS[0], OPTIONS).unwrap();
        assert_eq!(host.tokens, dev.tokens, "host and device paths agree");
    }
    assert!(
        tally.accepted_second > 0,
        "no second candidate won on the device path"
    );
    // A draft group wider than the device step's one padded shape would not be exact.
    let (_dir, loaded) = random_model(&spec(1, 2, Variant::Tied, 7));
    let wide = "self-draft:g=4".parse().expect("a valid policy");
    let err = run_lane(&with_device_backend(&loaded), wide, PROMPTS[0], OPTIONS)
        .expect_err("5 rows on a 4-row device step");
    assert!(
        err.to_string()
            .contains("this device keeps a step exact up to 4 rows"),
        "{err}"
    );
}

/// bf16 through candle's ops (the GPU's code path, here on the CPU), where a token's pass
/// computed beside other rows used to round differently from the baseline's one-row step (3–7
/// of 8 prompts identical): the device step pads every decode step to one shape, so the lanes
/// agree bit for bit, near-ties included.
#[test]
fn speed_equals_baseline_on_the_device_code_path_in_bf16() {
    let mut tally = Tally::default();
    for (variant, seed) in [(Variant::Tied, 5), (Variant::Gqa, 6)] {
        // Hidden 256 and 4096 logits (`spex random-checkpoint`'s defaults), where bf16's
        // near-ties come often; the test shapes' hidden 48 and 300 logits saw none.
        let mut spec = spec(2, 4, variant, seed);
        spec.shape.hidden = 256;
        spec.shape.head_dim = 256 / spec.shape.heads;
        spec.shape.intermediate = 704;
        spec.shape.vocab = 4096;
        spec.pad_vocab_to = Some(4096);
        let dir = tempfile::TempDir::new().expect("temp dir");
        write_random_checkpoint(dir.path(), &spec).expect("checkpoint");
        let candle = LoadOptions {
            candle_ops: true,
            ..LoadOptions::default()
        };
        let loaded =
            LoadedModel::load_with(dir.path(), &Device::Cpu, DType::BF16, candle).expect("load");
        assert!(
            matches!(loaded.backend, Backend::Device(_)),
            "--candle-ops runs bf16 on candle's ops"
        );
        let label = format!("device bf16 {variant:?}");
        assert_lanes_equal_on(
            &loaded,
            &exactness_prompts(8),
            Suite::All,
            &label,
            &mut tally,
        );
    }
    assert!(tally.flips > 0, "no flip on the bf16 device path");
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn kv_cache_after_flushes_equals_baseline_bit_for_bit() {
    use spex::engine::Decoder;
    let (mut promoted, mut loopspec_promoted, mut total_flushes) = (0, 0, 0);
    for ((variant, kv), prompt) in [Variant::Tied, Variant::Gqa]
        .into_iter()
        .flat_map(|v| [(v, KvDtype::F16), (v, KvDtype::F32)])
        .flat_map(|vk| {
            exactness_prompts(PROMPTS.len())
                .into_iter()
                .map(move |p| (vk, p))
        })
    {
        let (_dir, loaded) = random_model(&spec(2, 4, variant, 11));
        let loaded = with_kv_dtype(&loaded, kv);
        let run = |policy: PolicyKind| {
            let mut d = Decoder::new(&loaded, policy.build(), prompt, OPTIONS).unwrap();
            let (mut flushes, mut promotions) = (0, 0);
            while let Some(ev) = d.next_event().unwrap() {
                if let spex::engine::DecodeEvent::Step(s) = ev {
                    flushes += s.flushes.len();
                    // A committed second candidate was promoted first.
                    promotions += s.committed.iter().filter(|c| c.from_second).count();
                }
            }
            (d, flushes, promotions)
        };
        let (base, _, _) = run(PolicyKind::Baseline);
        // `dual` also checks the second candidates' entries: promoted ones must be exactly
        // what baseline wrote at that position.
        let wide_gate = PolicyKind::Dual { margin_below: 4.0 };
        let loopspec = "loopspec:d2=2".parse().expect("a valid policy");
        for policy in [PolicyKind::Speed, PolicyKind::DUAL, wide_gate, loopspec] {
            let (spec_run, flushes, promotions) = run(policy);
            total_flushes += flushes;
            promoted += promotions;
            loopspec_promoted += promotions * usize::from(policy == loopspec);
            assert_eq!(base.output(), spec_run.output());
            let verified = base.prompt().len() + base.output().len() - 1;
            for layer in 0..loaded.model().config.layers {
                for pass in spex::engine::Pass::all(4) {
                    let a = base.kv_entries(layer, pass, verified).unwrap();
                    let b = spec_run.kv_entries(layer, pass, verified).unwrap();
                    let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let at = format!("{policy}, layer {layer}, pass {pass}");
                    assert_eq!(bits(&a.0), bits(&b.0), "keys, {at}");
                    assert_eq!(bits(&a.1), bits(&b.1), "values, {at}");
                }
            }
        }
    }
    assert!(total_flushes > 0, "the runs must flush to test rollback");
    assert!(
        promoted > 0 && loopspec_promoted > 0,
        "a second candidate must win to test promotion ({promoted}, loopspec {loopspec_promoted})"
    );
}

#[test]
fn fused_training_ops_match_composed_ops_on_the_whole_model() {
    use spex::engine::model::reference::Composed;
    use spex::train::Fused;
    for variant in [Variant::Tied, Variant::Untied, Variant::Gqa] {
        let (_dir, loaded) = random_model(&spec(2, 3, variant, 5));
        let ids = loaded
            .tokenizer
            .encode("Now is the winter of our discontent made glorious summer")
            .unwrap();
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let fused = loaded.model().hidden_per_pass_with(&input, &Fused).unwrap();
        let composed = loaded
            .model()
            .hidden_per_pass_with(&input, &Composed)
            .unwrap();
        for (f, c) in fused.iter().zip(&composed) {
            let f = f.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let c = c.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(
                max_abs_diff(&f, &c) < 1e-4,
                "{variant:?}: {}",
                max_abs_diff(&f, &c)
            );
        }
    }
}

/// Draft-then-verify with a draft model leaves the output unchanged: drafted by a random
/// model of another shape (its drafts mostly rejected) and by the model itself (mostly kept),
/// γ of 1 and 3, on every shape of every variant (K = 1, 2, 4; R = 1–4), and both KV element
/// types.
#[test]
fn a_draft_model_leaves_the_output_unchanged() {
    let policies: [PolicyKind; 2] = ["draft:g=1", "draft:g=3"].map(|p| p.parse().expect("valid"));
    let (mut kept, mut runs) = (Vec::new(), 0);
    for variant in [Variant::Tied, Variant::Untied, Variant::Gqa] {
        let (_other_dir, other) = random_model(&spec(1, 2, variant, 99));
        let shapes = [1, 2, 4]
            .into_iter()
            .flat_map(|k| (1..=4).map(move |r| (k, r)));
        for (layers, passes) in shapes {
            let seed = (layers * 10 + passes) as u64;
            let (_dir, loaded) = random_model(&spec(layers, passes, variant, seed));
            for (kv, draft) in [(KvDtype::F16, &other), (KvDtype::F32, &loaded)] {
                let target = with_kv_dtype(&loaded, kv);
                let greedy = with_f32_readouts(&target);
                let drafted = target.with_draft(draft.clone()).expect("one tokenizer");
                for &prompt in &PROMPTS[..10] {
                    let base = run_lane(&greedy, PolicyKind::Baseline, prompt, OPTIONS);
                    let base = base.expect("baseline");
                    for policy in policies {
                        let lane = run_lane(&drafted, policy, prompt, OPTIONS).expect("lane");
                        let label = format!("{variant:?} K={layers} R={passes} {kv:?} {policy}");
                        assert_eq!(base.tokens, lane.tokens, "{label}: {prompt:?}");
                        runs += 1;
                        if passes > 1 {
                            kept.push(lane.stats.acceptance().first);
                        }
                    }
                }
            }
        }
    }
    assert_eq!(runs, 3 * 12 * 2 * 10 * 2);
    let most = kept.iter().copied().fold(0.0, f64::max);
    let least = kept.iter().copied().fold(1.0, f64::min);
    assert!(most > 0.5 && least < 0.3, "drafts kept: {least}..{most}");
}
