//! `--threads`: decode steps split across threads give the same tokens as on one thread, and
//! speculation still equals baseline. This test binary runs every decode on 2 threads (the
//! pool is per process), and compares with `spex generate --threads 1` in a child process.

mod common;

use std::path::Path;

use common::{PROMPTS, Variant, random_model, spec, spex_ok};
use spex::engine::kernels::pool;
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::RandomSpec;
use spex::engine::{DecodeOptions, Sampling};
use spex::harness::bench::run_lane;

const OPTIONS: DecodeOptions = DecodeOptions {
    max_tokens: 24,
    context: 128,
    sampling: Sampling::GREEDY,
};

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

#[test]
fn two_threads_decode_the_one_thread_tokens_for_every_policy() {
    pool::set_threads(2).expect("the first to set the threads");
    assert_eq!(pool::pool().threads(), 2);
    for (variant, layers, passes) in [(Variant::Tied, 2, 4), (Variant::Gqa, 1, 3)] {
        let (dir, loaded) = random_model(&wide(spec(layers, passes, variant, 21 + passes as u64)));
        let d = dir.path().display().to_string();
        for prompt in PROMPTS.iter().step_by(4) {
            let args = [
                "generate",
                "--model",
                &d,
                "--prompt",
                prompt,
                "--max-tokens",
                "24",
            ];
            let json = spex_ok(
                &[&args[..], &["--json", "--threads", "1"]].concat(),
                &[],
                Path::new("."),
            );
            let last = String::from_utf8(json).unwrap();
            let finish: serde_json::Value =
                serde_json::from_str(last.lines().last().unwrap()).unwrap();
            let one_thread: Vec<u32> = serde_json::from_value(finish["tokens"].clone()).unwrap();
            let policies = [
                PolicyKind::Baseline,
                PolicyKind::Speed,
                PolicyKind::DUAL,
                PolicyKind::LOOPSPEC,
            ];
            for policy in policies {
                let lane = run_lane(&loaded, policy, prompt, OPTIONS).expect("a run");
                assert_eq!(
                    lane.tokens, one_thread,
                    "{variant:?} K={layers} R={passes} {policy} {prompt:?}"
                );
            }
        }
    }
}
