//! The device ops (src/engine/model/device_ops): their CUDA kernels (kernels.cu), compiled for
//! the host with tests/kernels_host/shim.h and run by tests/kernels_host/harness.cpp, against
//! spex's CPU twins of the same ops on the same inputs, in every dtype; and the attention's
//! batch invariance, bit for bit, in the kernel and in the twin. Where no GPU is lent, this is how the kernels' own
//! code is checked (indices, chunks, reductions, the extra column, padding rows); the GPU run
//! (`tests/exactness_cuda.rs`) checks the same against the device.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use spex::engine::model::device_ops::fixtures::{
    AttentionCase, AttentionShape, DTYPES, assert_close, flat, randn, rounded,
};
use spex::engine::model::device_ops::{
    NO_ROW, RowSpan, rope_split, silu_mul, spans_tensor, write_rows,
};

/// The harness, built once per test binary into a temporary folder (`None`: no C++ compiler).
fn harness() -> Option<PathBuf> {
    static BUILT: std::sync::OnceLock<Option<(tempfile::TempDir, PathBuf)>> =
        std::sync::OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let dir = tempfile::TempDir::new().expect("temp dir");
        let exe = dir.path().join("harness");
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let status = Command::new(&compiler)
            .args(["-std=c++20", "-O2", "-pthread", "-I"])
            .arg(root.join("src/engine/model/device_ops"))
            .arg("-include")
            .arg(root.join("tests/kernels_host/shim.h"))
            .arg(root.join("tests/kernels_host/harness.cpp"))
            .arg("-o")
            .arg(&exe)
            .status();
        match status {
            Ok(s) if s.success() => Some((dir, exe)),
            Ok(s) => panic!("{compiler} could not build the kernel harness ({s})"),
            Err(e) => {
                eprintln!("no C++ compiler ({compiler}: {e}): the kernels are not checked here");
                None
            }
        }
    });
    built.as_ref().map(|(_, exe)| exe.clone())
}

/// An operand as the harness reads it.
enum Operand<'a> {
    Floats(&'a Tensor),
    Indices(&'a [u32]),
}

/// Runs kernel `op` on the host in `dtype` with `sizes`, then `operands`; its output as f32.
fn on_host(exe: &Path, op: &str, dtype: DType, sizes: &[u32], operands: &[Operand]) -> Vec<f32> {
    let mut bytes: Vec<u8> = sizes.iter().flat_map(|x| x.to_le_bytes()).collect();
    for operand in operands {
        match operand {
            Operand::Floats(t) => {
                let v: Vec<f32> = t.flatten_all().and_then(|t| t.to_vec1()).expect("f32");
                bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
            }
            Operand::Indices(v) => bytes.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        }
    }
    let dir = tempfile::TempDir::new().expect("temp dir");
    let (input, output) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::write(&input, bytes).expect("write input");
    let name = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    };
    let out = Command::new(exe)
        .args([op, name])
        .arg(&input)
        .arg(&output)
        .output()
        .expect("run the harness");
    assert!(
        out.status.success(),
        "harness {op} {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&output).expect("read output");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn cast(t: &Tensor, dtype: DType) -> Tensor {
    t.to_dtype(dtype).expect("cast")
}

/// The shared attention case at the harness's size.
fn attention(dtype: DType) -> AttentionCase {
    AttentionCase::new(AttentionShape::SMALL, dtype)
}

/// The attention case as the host harness runs it.
trait OnHost {
    fn flat_spans(&self) -> Vec<u32>;
    fn kernel(&self, exe: &Path, dtype: DType) -> Vec<f32>;
    fn twin(&self, dtype: DType) -> Vec<f32>;
}

impl OnHost for AttentionCase {
    /// The spans as the op encodes them ([`spans_tensor`]).
    fn flat_spans(&self) -> Vec<u32> {
        let spans = spans_tensor(&self.spans, &Device::Cpu).expect("spans");
        (spans.flatten_all().and_then(|t| t.to_vec1())).expect("spans")
    }

    fn kernel(&self, exe: &Path, dtype: DType) -> Vec<f32> {
        let rows = self.spans.len() as u32;
        let AttentionShape {
            heads,
            kv_heads,
            head_dim,
            capacity,
        } = self.shape;
        let sizes = [
            rows,
            heads as u32,
            kv_heads as u32,
            2 * capacity as u32,
            head_dim as u32,
            self.scale().to_bits(),
        ];
        let spans = self.flat_spans();
        let operands = [
            &self.q,
            &self.keys,
            &self.values,
            &self.k_step,
            &self.v_step,
        ]
        .map(Operand::Floats);
        let mut operands: Vec<Operand> = operands.into_iter().collect();
        operands.push(Operand::Indices(&spans));
        on_host(exe, "decode_attention", dtype, &sizes, &operands)
    }

    fn twin(&self, dtype: DType) -> Vec<f32> {
        flat(&self.attend(&Device::Cpu, dtype).expect("decode attention"))
    }
}

#[test]
fn the_attention_kernel_matches_its_cpu_twin() {
    let Some(exe) = harness() else { return };
    for dtype in DTYPES {
        let a = attention(dtype);
        let kernel = a.kernel(&exe, dtype);
        assert_close("decode attention", dtype, &a.twin(dtype), &kernel);
        let width = a.shape.heads * a.shape.head_dim;
        assert!(
            kernel[3 * width..].iter().all(|&x| x == 0.0),
            "a padding row is zeros"
        );
    }
}

/// `attend`'s bits for a row alone equal its bits beside other rows, and a second candidate's
/// extra column gives the bits of its entry in the cache at its position.
fn assert_batch_invariant(what: &str, attend: &dyn Fn(&AttentionCase, DType) -> Vec<f32>) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for dtype in DTYPES {
        let full = attention(dtype);
        let width = full.shape.heads * full.shape.head_dim;
        let all = attend(&full, dtype);
        for row in 0..3 {
            let one = |t: &Tensor| {
                t.narrow(1, row, 1)
                    .and_then(|t| t.contiguous())
                    .expect("row")
            };
            let span = full.spans[row];
            let alone = AttentionCase {
                q: one(&full.q),
                k_step: one(&full.k_step),
                v_step: one(&full.v_step),
                spans: vec![RowSpan {
                    extra: span.extra.map(|_| 0),
                    ..span
                }],
                ..full.clone()
            };
            let beside = &all[row * width..(row + 1) * width];
            assert_eq!(
                bits(&attend(&alone, dtype)),
                bits(beside),
                "{what} {dtype:?} row {row}"
            );
        }
        let from_cache = attend(&extra_column_cached(&full), dtype);
        let row = 2 * width..3 * width;
        assert_eq!(
            bits(&from_cache[row.clone()]),
            bits(&all[row]),
            "{what} {dtype:?}: extra column"
        );
    }
}

/// `full` with row 2's extra column (step row 2) written into the cache at its position and
/// attended to from there, as the baseline does.
fn extra_column_cached(full: &AttentionCase) -> AttentionCase {
    let span = full.spans[2];
    let put = |cache: &Tensor, step: &Tensor| {
        let cache = cache.copy().expect("copy");
        let entry = step
            .narrow(1, 2, 1)
            .and_then(|t| t.contiguous())
            .expect("entry");
        cache
            .slice_set(&entry, 1, span.start + span.len)
            .expect("slice_set");
        cache
    };
    let mut spans = full.spans.clone();
    spans[2] = RowSpan {
        len: span.len + 1,
        extra: None,
        ..span
    };
    AttentionCase {
        keys: put(&full.keys, &full.k_step),
        values: put(&full.values, &full.v_step),
        spans,
        ..full.clone()
    }
}

#[test]
fn the_attention_kernel_is_batch_invariant() {
    let Some(exe) = harness() else { return };
    assert_batch_invariant("kernel", &|a, dtype| a.kernel(&exe, dtype));
}

#[test]
fn the_attention_cpu_twin_is_batch_invariant() {
    assert_batch_invariant("CPU twin", &|a, dtype| a.twin(dtype));
}

#[test]
fn the_elementwise_kernels_match_their_cpu_twins() {
    let Some(exe) = harness() else { return };
    let (rows, heads, kv, dim, cache_rows) = (5usize, 4usize, 2usize, 16usize, 9usize);
    for dtype in DTYPES {
        let r = |shape: &[usize]| rounded(&randn(shape), dtype);
        let (q, k, v) = (
            r(&[rows, heads * dim]),
            r(&[rows, kv * dim]),
            r(&[rows, kv * dim]),
        );
        let angles = randn(&[rows, dim / 2]);
        let (cos, sin) = (
            rounded(&angles.cos().expect("cos"), dtype),
            rounded(&angles.sin().expect("sin"), dtype),
        );
        let sizes = [rows, heads, kv, dim].map(|x| x as u32);
        let operands = [&q, &k, &v, &cos, &sin].map(Operand::Floats);
        let kernel = on_host(&exe, "rope_split", dtype, &sizes, &operands);
        let c = |t: &Tensor| cast(t, dtype);
        let twin = rope_split(&c(&q), &c(&k), &c(&v), &c(&cos), &c(&sin)).expect("rope split");
        assert_close("rope split", dtype, &flat(&twin), &kernel);

        let (gate, up) = (r(&[rows, 40]), r(&[rows, 40]));
        let operands = [&gate, &up].map(Operand::Floats);
        let kernel = on_host(&exe, "silu_mul", dtype, &[(rows * 40) as u32], &operands);
        let twin = silu_mul(&c(&gate), &c(&up)).expect("silu mul");
        assert_close("silu mul", dtype, &flat(&twin), &kernel);

        let (cache, src) = (r(&[kv, cache_rows, dim]), r(&[kv, rows, dim]));
        let to = [3, NO_ROW, 8, 0, NO_ROW];
        let sizes = [rows, kv, cache_rows, dim].map(|x| x as u32);
        let operands = [
            Operand::Floats(&cache),
            Operand::Floats(&src),
            Operand::Indices(&to),
        ];
        let kernel = on_host(&exe, "write_rows", dtype, &sizes, &operands);
        let twin = c(&cache);
        let to = Tensor::new(&to, &Device::Cpu).expect("to");
        write_rows(&twin, &c(&src), &to).expect("write rows");
        assert_eq!(flat(&twin), kernel, "write rows {dtype:?}");
    }
}
