//! The host kernels' settings belong to each model (`LoadOptions::kernels`): decode steps split
//! across two threads give the one-thread tokens for every policy, and two models loaded in
//! one process with different instruction sets, prefetch plans and thread counts decode side
//! by side, on threads of their own, exactly as each does alone.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use std::path::Path;

use candle_core::{DType, Device};
use common::{OPTIONS, PROMPTS, Variant, spec};
use spex::engine::LoadedModel;
use spex::engine::kernels::prefetch::Choice;
use spex::engine::kernels::{Isa, KernelOptions, Prefetch};
use spex::engine::model::LoadOptions;
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use spex::harness::bench::run_lane;

/// `spec` wide enough that every matmul is split across the threads (hidden 128, head_dim 64).
fn wide(mut spec: RandomSpec) -> RandomSpec {
    let gqa = spec.shape.kv_heads < spec.shape.heads;
    spec.shape.hidden = 128;
    spec.shape.head_dim = 64;
    spec.shape.heads = 2;
    spec.shape.kv_heads = if gqa { 1 } else { 2 };
    spec.shape.intermediate = 256;
    spec
}

fn load(dir: &Path, kernels: KernelOptions) -> LoadedModel {
    let options = LoadOptions {
        kernels,
        ..LoadOptions::default()
    };
    LoadedModel::load_with(dir, &Device::Cpu, DType::F32, options).expect("load")
}

fn threads(n: usize) -> KernelOptions {
    KernelOptions {
        threads: Some(n),
        ..KernelOptions::default()
    }
}

/// Every fourth prompt's tokens under `policy`.
fn tokens(loaded: &LoadedModel, policy: PolicyKind) -> Vec<Vec<u32>> {
    (PROMPTS.iter().step_by(4))
        .map(|prompt| {
            run_lane(loaded, policy, prompt, OPTIONS)
                .expect("a run")
                .tokens
        })
        .collect()
}

#[test]
fn two_threads_decode_the_one_thread_tokens_for_every_policy() {
    for (variant, layers, passes) in [(Variant::Tied, 2, 4), (Variant::Gqa, 1, 3)] {
        let dir = tempfile::TempDir::new().unwrap();
        let s = wide(spec(layers, passes, variant, 21 + passes as u64));
        write_random_checkpoint(dir.path(), &s).unwrap();
        let (one, two) = (load(dir.path(), threads(1)), load(dir.path(), threads(2)));
        let host = two.backend.info().host.expect("host kernels");
        assert_eq!(host.threads, 2);
        let baseline = tokens(&one, PolicyKind::Baseline);
        let policies = [
            PolicyKind::Baseline,
            PolicyKind::Speed,
            PolicyKind::DUAL,
            PolicyKind::LOOPSPEC,
        ];
        for policy in policies {
            assert_eq!(
                tokens(&two, policy),
                baseline,
                "{variant:?} K={layers} R={passes} {policy}"
            );
        }
    }
}

#[test]
fn two_models_with_different_kernels_do_not_disturb_each_other() {
    let dir = tempfile::TempDir::new().unwrap();
    write_random_checkpoint(dir.path(), &wide(spec(2, 4, Variant::Gqa, 5))).unwrap();
    let fast = KernelOptions {
        isa: None,
        prefetch: Some(Prefetch::L2),
        threads: Some(2),
    };
    let portable = KernelOptions {
        isa: Some(Isa::Portable),
        prefetch: Some(Prefetch::L1),
        threads: Some(1),
    };
    let alone = [fast, portable].map(|k| tokens(&load(dir.path(), k), PolicyKind::Speed));
    let models = [fast, portable].map(|k| load(dir.path(), k));
    let infos = models
        .each_ref()
        .map(|m| m.backend.info().host.expect("host kernels"));
    assert_eq!(infos[0].isa, spex::engine::kernels::detected_isa());
    assert_eq!((infos[0].threads, infos[1].threads), (2, 1));
    assert_eq!(infos[1].isa, Isa::Portable);
    assert_eq!(infos[0].prefetch, Some(Choice::Forced(Prefetch::L2)));
    assert_eq!(infos[1].prefetch, Some(Choice::Forced(Prefetch::L1)));
    let together = std::thread::scope(|s| {
        let runs = models
            .each_ref()
            .map(|m| s.spawn(move || tokens(m, PolicyKind::Speed)));
        runs.map(|r| r.join().expect("a decoding thread"))
    });
    assert_eq!(together, alone);
}
