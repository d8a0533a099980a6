//! What a loaded model holds in memory: its weights, its KV cache and little else, at the
//! peak of the whole run, load included. Part of the `bad_input` test binary, beside the
//! case of a checkpoint larger than the available memory.

use std::path::Path;
use std::process::{Command, Stdio};

use super::common::spex_ok;

/// The peak resident bytes of `spex args…`, run to a successful end (`wait4`'s
/// `ru_maxrss`: this child's own, not the test binary's other children's).
#[cfg(target_os = "linux")]
fn peak_resident_bytes(args: &[&str]) -> u64 {
    let (succeeded, peak) = exit_and_peak(args);
    assert!(succeeded, "{args:?} failed");
    peak
}

/// Whether `spex args…` succeeded, and its peak resident bytes (as [`peak_resident_bytes`]).
#[cfg(target_os = "linux")]
#[expect(
    clippy::zombie_processes,
    reason = "wait4 reaps the child: std's wait would not report its peak"
)]
pub(super) fn exit_and_peak(args: &[&str]) -> (bool, u64) {
    let child = (Command::new(env!("CARGO_BIN_EXE_spex")).args(args))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run spex");
    let pid = i32::try_from(child.id()).expect("a pid fits an i32");
    let mut status = 0;
    // SAFETY: `rusage` is plain integers and timevals, for which all zeros is a value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for this test's own child, which nothing else waits for or has reaped.
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(waited, pid, "wait4");
    assert!(
        libc::WIFEXITED(status),
        "{args:?}: status {status} (killed?)"
    );
    let peak = u64::try_from(usage.ru_maxrss).expect("a peak is not negative") * 1024;
    (libc::WEXITSTATUS(status) == 0, peak)
}

/// `spex generate` on a bf16 checkpoint of 16 layers (107 MB) with a context of 64 positions
/// peaks within its weights and its KV cache plus 10 %, and [`PROCESS_BYTES`]. Measured on an
/// AMD EPYC Zen 3: 154 MB. When the prefetch plan was timed over two KV caches of the default
/// context (512 positions, 67 MB each), the peak was 258 MB.
#[cfg(target_os = "linux")]
#[test]
fn a_run_holds_its_weights_and_kv_cache_and_little_else() {
    let dir = tempfile::TempDir::new().unwrap();
    let d = dir.path().display().to_string();
    let shape = [
        "--hidden",
        "512",
        "--layers",
        "16",
        "--heads",
        "8",
        "--kv-heads",
        "8",
        "--passes",
        "4",
    ];
    let rest = [
        "--intermediate",
        "1408",
        "--vocab",
        "4096",
        "--dtype",
        "bf16",
    ];
    let out = [&["random-checkpoint", "--out", &d][..], &shape, &rest].concat();
    spex_ok(&out, &[], Path::new("."));
    let weights = std::fs::metadata(dir.path().join("model.safetensors"))
        .unwrap()
        .len();
    // K and V, 512 wide in f16, at 64 positions of 16 layers × 4 passes.
    let kv_bytes = 2 * 512 * 2 * 64 * 16 * 4;
    let mut run = super::generate_args(dir.path());
    run.extend(["--context".into(), "64".into()]);
    let run: Vec<&str> = run.iter().map(String::as_str).collect();
    let peak = peak_resident_bytes(&run);
    let bound = (weights + kv_bytes) * 11 / 10 + PROCESS_BYTES;
    assert!(
        peak <= bound,
        "peak {peak} bytes, weights {weights}, KV cache {kv_bytes}: over {bound}"
    );
}

/// What a run holds besides its weights and KV cache: the binary, the tokenizer, the decode
/// threads, the allocator's own, and the prefetch plan's timing over two caches of the
/// positions its steps read. Measured: 15 MB with the plan forced (`--prefetch l1`), 39 MB
/// with it timed, on the checkpoint above.
const PROCESS_BYTES: u64 = 48 << 20;
