//! Helpers shared by the integration tests: random Ouro checkpoints in temp directories.
#![allow(dead_code)]

use candle_core::{DType, Device};
use spex::engine::DecodeOptions;
use spex::engine::LoadedModel;
use spex::engine::config::ModelShape;
use spex::engine::model::device::DeviceBackend;
use spex::engine::model::host::HostBackend;
use spex::engine::model::{Backend, KvDtype, LoadOptions};
use spex::engine::policy::PolicyKind;
use spex::engine::random_checkpoint::{RandomSpec, write_random_checkpoint};
use spex::harness::race::run_race;
use spex::harness::trace::{FORMAT_VERSION, ModelRecord, Trace, TraceHeader};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use tempfile::TempDir;

/// What the exactness tests decode: 24 greedy tokens in a cache of 128 positions.
pub const OPTIONS: DecodeOptions = DecodeOptions {
    max_tokens: 24,
    context: 128,
    sampling: spex::engine::Sampling::GREEDY,
    exit_threshold: None,
};

/// Twenty prompts of different lengths and characters.
pub const PROMPTS: [&str; 20] = [
    "To be, or not to be",
    "Shall I compare thee",
    "From fairest creatures we desire increase,",
    "When forty winters shall besiege thy brow",
    "Look in thy glass",
    "a",
    "The slings and arrows of outrageous fortune, or to take arms against a sea of troubles",
    "HAMLET.",
    "Thou art more lovely and more temperate:",
    "Rough winds do shake the darling buds of May,",
    "Die single and thine image dies with thee.",
    "So long as men can breathe or eyes can see,",
    "  spaces  ",
    "Pity the world, or else this glutton be",
    "1234 5678",
    "Ay, there's the rub",
    "naïve café — ünïcödé",
    "Must give us pause.",
    "To die, to sleep; to sleep, perchance to dream.",
    "Whether 'tis nobler in the mind to suffer",
];

/// Indices into [`PROMPTS`] that differ the most (the longest, non-ASCII, the first, spaces
/// only at the ends, one letter): the order [`exactness_prompts`] takes them in under
/// emulation.
const MOST_VARIED: [usize; 5] = [6, 16, 0, 12, 5];

/// The prompts an exactness suite decodes where it would decode the first `most` of
/// [`PROMPTS`]: those, or a quarter as many of [`MOST_VARIED`] (at least one) where
/// `SPEX_EXACTNESS_PROMPTS=quarter`. `.ci/aarch64-check` sets it: under qemu, which checks
/// the NEON kernels' rows and not the scheduling (the same on every ISA, checked natively on
/// every prompt), the whole suite took 31 minutes of a CI run.
pub fn exactness_prompts(most: usize) -> Vec<&'static str> {
    match std::env::var("SPEX_EXACTNESS_PROMPTS").as_deref() {
        Ok("quarter") => (MOST_VARIED.iter())
            .take(most.div_ceil(4))
            .map(|&i| PROMPTS[i])
            .collect(),
        _ => PROMPTS[..most].to_vec(),
    }
}

/// A random checkpoint written to a fresh temp dir and loaded on the CPU in f32.
pub fn random_model(spec: &RandomSpec) -> (TempDir, LoadedModel) {
    let dir = TempDir::new().expect("temp dir");
    write_random_checkpoint(dir.path(), spec).expect("write random checkpoint");
    let loaded = LoadedModel::load(dir.path(), &Device::Cpu, DType::F32).expect("load checkpoint");
    (dir, loaded)
}

/// The same checkpoint, its steps forced onto candle ops (the GPU code path).
pub fn with_device_backend(loaded: &LoadedModel) -> LoadedModel {
    let backend = DeviceBackend::new(loaded.model().clone());
    LoadedModel {
        backend: Backend::Device(Arc::new(backend)),
        ..loaded.clone()
    }
}

/// The same checkpoint with every readout on the f32 head (no f16 proposal head), its KV
/// cache's element type kept.
pub fn with_f32_readouts(loaded: &LoadedModel) -> LoadedModel {
    with_host_options(loaded, |o| LoadOptions {
        f32_proposals: true,
        ..o
    })
}

/// The same checkpoint with its host KV cache in `kv_dtype`.
pub fn with_kv_dtype(loaded: &LoadedModel, kv_dtype: KvDtype) -> LoadedModel {
    with_host_options(loaded, |o| LoadOptions { kv_dtype, ..o })
}

/// The same checkpoint's host backend rebuilt with `change(its options)`; a device backend
/// is kept as it is.
fn with_host_options(
    loaded: &LoadedModel,
    change: impl Fn(LoadOptions) -> LoadOptions,
) -> LoadedModel {
    let backend = match &loaded.backend {
        Backend::Host(b) => {
            let host = HostBackend::new(loaded.model().clone(), change(b.options()))
                .expect("host backend");
            Backend::Host(Arc::new(host))
        }
        device => device.clone(),
    };
    LoadedModel {
        backend,
        ..loaded.clone()
    }
}

/// Reference logits `[passes][pos][vocab]` of the full-sequence forward over `ids`, its keys
/// and values rounded as `loaded`'s KV cache stores them (f16 on the host by default).
pub fn reference_logits(loaded: &LoadedModel, ids: &[u32]) -> Vec<Vec<Vec<f32>>> {
    let hidden = reference_hidden(loaded, ids);
    (loaded
        .model()
        .readouts(&hidden)
        .expect("readouts")
        .into_iter())
    .map(|t| {
        t.squeeze(0)
            .and_then(|t| t.to_vec2::<f32>())
            .expect("logits")
    })
    .collect()
}

/// [`reference_logits`] of pass index `pass` at the last position of `ids` alone: the one
/// readout a second candidate needs, without the head's product at every other position.
pub fn reference_last_logits(loaded: &LoadedModel, ids: &[u32], pass: usize) -> Vec<f32> {
    let hidden = reference_hidden(loaded, ids);
    let last = (hidden[pass].narrow(1, ids.len() - 1, 1)).expect("the last position");
    let logits = loaded.model().readouts(&[last]).expect("readout");
    (logits[0].flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("logits")
}

/// The reference forward's normed hidden state after every pass, `[1, seq, hidden]` each.
fn reference_hidden(loaded: &LoadedModel, ids: &[u32]) -> Vec<candle_core::Tensor> {
    use spex::engine::model::reference::{Composed, ComposedF16Kv, SequenceOps};
    let input = candle_core::Tensor::new(ids, &Device::Cpu)
        .and_then(|t| t.unsqueeze(0))
        .expect("ids");
    let ops: &dyn SequenceOps = match &loaded.backend {
        Backend::Host(b) if b.options().kv_dtype == KvDtype::F16 => &ComposedF16Kv,
        _ => &Composed,
    };
    (loaded.model().hidden_per_pass_with(&input, ops)).expect("reference")
}

/// Which random checkpoint a quantized test file is made from, and how: its variant, layers,
/// passes and seed ([`spec`]), the file's type, and whether its rows are whole K-quant
/// super-blocks (256 wide) or 64 wide: the narrow shape holds a twentieth of the MLP's
/// weights, and there a Q4_0 file's LM head falls back to Q8_0.
#[derive(Debug, Clone, Copy)]
pub struct QuantizedSpec {
    pub variant: Variant,
    pub layers: usize,
    pub passes: usize,
    pub seed: u64,
    pub file_type: spex::engine::gguf::write::FileType,
    pub wide: bool,
}

/// A random checkpoint whose matrices' rows are whole blocks of `file_type`, and its GGUF (in another
/// folder: no tokenizer.json beside it): rows of whole K-quant super-blocks but for Q8_0, so
/// that Q4_0's LM head is Q6_K, as llama.cpp writes it.
pub fn quantized_pair(
    variant: Variant,
    layers: usize,
    passes: usize,
    seed: u64,
    file_type: spex::engine::gguf::write::FileType,
) -> (TempDir, TempDir, PathBuf) {
    quantized_pair_with(&QuantizedSpec {
        variant,
        layers,
        passes,
        seed,
        file_type,
        wide: file_type != spex::engine::gguf::write::FileType::Q8_0,
    })
}

/// The checkpoint of `q` and its GGUF, as [`quantized_pair`] makes them.
pub fn quantized_pair_with(q: &QuantizedSpec) -> (TempDir, TempDir, PathBuf) {
    let mut spec = spec(q.layers, q.passes, q.variant, q.seed);
    (
        spec.shape.hidden,
        spec.shape.head_dim,
        spec.shape.intermediate,
    ) = match q.wide {
        true => (256, 64, 512),
        false => (64, 16, 96),
    };
    let dir = TempDir::new().expect("temp dir");
    write_random_checkpoint(dir.path(), &spec).expect("checkpoint");
    let out = TempDir::new().expect("temp dir");
    let file = out.path().join("model.gguf");
    let origin = spex::engine::checkpoint::Origin::Dir(dir.path().to_path_buf());
    let threads = spex::engine::kernels::pool::available_cores();
    spex::engine::quantize::quantize_checkpoint(
        &origin,
        "test",
        q.file_type.into(),
        &file,
        threads,
    )
    .expect("quantize");
    (dir, out, file)
}

/// A GGUF of [`quantized_pair_with`], and the temp folders that hold it while the test needs
/// it (none where it was made before).
pub struct Quantized {
    pub file: PathBuf,
    _dirs: Vec<TempDir>,
}

/// The GGUF of [`quantized_pair_with`] alone. Where `SPEX_TEST_FILES` names a folder, it is
/// read from there when the folder holds one made with these arguments, and copied there
/// otherwise. `.ci/aarch64-check` gives it a fresh folder, makes the files natively and hands
/// them to the run under qemu, where candle's K-quant quantizer (scalar float rounding) took
/// most of the Q4_K_M suite's time. The folder is for one build: a file made by another
/// build's quantizer would be read as it is.
pub fn quantized_file(q: &QuantizedSpec) -> Quantized {
    let QuantizedSpec {
        variant,
        layers,
        passes,
        seed,
        file_type,
        wide,
    } = q;
    let name = format!("{variant:?}-K{layers}-R{passes}-s{seed}-{file_type:?}-wide{wide}.gguf");
    let kept = std::env::var_os("SPEX_TEST_FILES").map(|dir| PathBuf::from(dir).join(name));
    if let Some(file) = kept.as_ref().filter(|f| f.exists()) {
        return Quantized {
            file: file.clone(),
            _dirs: Vec::new(),
        };
    }
    let (dir, out, file) = quantized_pair_with(q);
    if let Some(kept) = kept {
        // Copied whole, then renamed: a run that reads the folder never sees half a file.
        let part = kept.with_extension("part");
        std::fs::copy(&file, &part).expect("copy the GGUF to SPEX_TEST_FILES");
        std::fs::rename(&part, &kept).expect("rename the GGUF in SPEX_TEST_FILES");
    }
    Quantized {
        file,
        _dirs: vec![dir, out],
    }
}

/// A random checkpoint (its float weights in `dtype`) and its mlx quantization in `kind`
/// (`spex quantize --type mlx-…`), in another folder: rows of 64 and a 96-wide MLP, so that a
/// group of 64 leaves `down_proj` dense, as mlx-lm would.
pub fn mlx_pair(
    variant: Variant,
    layers: usize,
    passes: usize,
    seed: u64,
    kind: spex::engine::kernels::AffineKind,
) -> (TempDir, TempDir) {
    let mut spec = spec(layers, passes, variant, seed);
    (
        spec.shape.hidden,
        spec.shape.head_dim,
        spec.shape.intermediate,
    ) = (64, 16, 96);
    spec.dtype = DType::BF16;
    let dir = TempDir::new().expect("temp dir");
    write_random_checkpoint(dir.path(), &spec).expect("checkpoint");
    let out = TempDir::new().expect("temp dir");
    let origin = spex::engine::checkpoint::Origin::Dir(dir.path().to_path_buf());
    let target = spex::engine::quantize::QuantizeTarget::Mlx(kind);
    let threads = spex::engine::kernels::pool::available_cores();
    spex::engine::quantize::quantize_checkpoint(&origin, "test", target, out.path(), threads)
        .expect("quantize");
    (dir, out)
}

/// Decodes `prompt` on `loaded` with `policy`: every step's rows, and the tokens committed.
pub fn decoded_rows(
    loaded: &LoadedModel,
    policy: PolicyKind,
    prompt: &str,
    options: DecodeOptions,
) -> (Vec<spex::engine::events::RowEvent>, Vec<u32>) {
    use spex::engine::events::DecodeEvent;
    let mut decoder =
        spex::engine::Decoder::new(loaded, policy.build(), prompt, options).expect("decoder");
    let mut rows = Vec::new();
    loop {
        match decoder.next_event().expect("a step") {
            Some(DecodeEvent::Step(s)) => rows.extend(s.rows),
            Some(DecodeEvent::Finished(f)) => return (rows, f.tokens),
            _ => {}
        }
    }
}

/// One baseline readout against the reference forward's logits: how far its token's logit lies
/// behind the largest (relative to it), and its probability less the reference's.
#[derive(Debug, Clone, Copy)]
pub struct ReadoutGap {
    /// `(top − logit) / max(|top|, 1)`.
    pub behind: f32,
    /// The readout's probability less the reference's softmax probability of its token.
    pub probability: f32,
}

/// Every verified readout of `host`'s greedy baseline over the first four prompts (12 tokens
/// each) against `reference`'s full-sequence logits (`reference_logits`): the quantized
/// kernels' results beside a dequantize-to-f32 model of the same file.
pub fn readout_gaps(host: &LoadedModel, reference: &LoadedModel) -> Vec<ReadoutGap> {
    let decode = DecodeOptions {
        max_tokens: 12,
        context: 128,
        sampling: spex::engine::Sampling::GREEDY,
        exit_threshold: None,
    };
    let mut gaps = Vec::new();
    for prompt in PROMPTS.iter().take(4) {
        let (rows, tokens) = decoded_rows(host, PolicyKind::Baseline, prompt, decode);
        let mut ids = host.tokenizer.encode(prompt).expect("encode");
        ids.extend(&tokens);
        let logits_by_pass = reference_logits(reference, &ids);
        for row in rows.iter().filter(|r| r.verified && !r.dropped) {
            let Some(p) = &row.prediction else { continue };
            let logits = &logits_by_pass[row.pass.index()][row.pos];
            let top = logits.iter().copied().fold(f32::MIN, f32::max);
            let logit = logits[p.token.id as usize];
            let z: f32 = logits.iter().map(|l| (l - top).exp()).sum();
            gaps.push(ReadoutGap {
                behind: (top - logit) / top.abs().max(1.0),
                probability: p.prob - (logit - top).exp() / z,
            });
        }
    }
    gaps
}

/// A small spec with the given shape.
pub fn spec(layers: usize, passes: usize, variant: Variant, seed: u64) -> RandomSpec {
    let (tied, kv_heads) = match variant {
        Variant::Tied => (true, 4),
        Variant::Untied => (false, 4),
        Variant::Gqa => (true, 2),
    };
    let shape = ModelShape {
        hidden: 48,
        layers,
        passes,
        heads: 4,
        kv_heads,
        head_dim: 12,
        intermediate: 80,
        vocab: 300,
        context: 256,
        tied,
    };
    RandomSpec {
        shape,
        seed,
        ..RandomSpec::default()
    }
}

/// The three weight layouts the exactness tests cover.
#[derive(Debug, Clone, Copy)]
pub enum Variant {
    Tied,
    Untied,
    Gqa,
}

/// Runs spex with `envs` in `dir`, asserts it succeeded, and returns its stdout.
pub fn spex_ok(args: &[&str], envs: &[(&str, &str)], dir: &Path) -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(dir)
        .output()
        .expect("run spex");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A race of `policy` against baseline on `prompt`, as the trace `--record` would write: the
/// header names the loaded model's config (hashes left as zeros) and the run's options.
pub fn recorded_race(
    loaded: &LoadedModel,
    prompt: &str,
    policy: PolicyKind,
    options: DecodeOptions,
) -> Trace {
    let (_control, control_rx) = std::sync::mpsc::channel();
    let mut events = Vec::new();
    run_race(loaded, prompt, policy, options, control_rx, |e| {
        events.push(e);
        true
    });
    let model = loaded.model();
    let header = TraceHeader {
        spex_trace: FORMAT_VERSION,
        spex_version: "test".into(),
        model: ModelRecord {
            name: "random".into(),
            config: model.config.to_json(),
            passes: model.passes(),
            layers: model.config.layers,
            weights_sha256: "0".repeat(64),
            tokenizer_sha256: "0".repeat(64),
        },
        policy,
        sampling: options.sampling,
        max_tokens: options.max_tokens,
        context: options.context,
        device: "cpu".into(),
        dtype: "f32".into(),
        cpu: None,
        prompt: prompt.into(),
    };
    Trace {
        header,
        events,
        cut_line: None,
    }
}

/// Runs spex; returns (success, stderr).
pub fn spex(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(args)
        .output()
        .expect("run spex");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that spex fails with one line of stderr that contains `needle`, and no panic.
pub fn assert_clean_error(args: &[&str], needle: &str) {
    let (ok, stderr) = spex(args);
    assert!(!ok, "{args:?} should fail");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    assert!(
        stderr.contains(needle),
        "{args:?}: expected {needle:?} in {stderr:?}"
    );
}
