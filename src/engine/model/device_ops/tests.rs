//! The device ops' CPU twins against candle's composed ops (or f64 softmax attention);
//! tests/device_ops.rs holds the kernels to the twins and both to batch invariance.

use candle_core::{DType, Device, IndexOp, Tensor};

use super::fixtures::{AttentionCase, AttentionShape, DTYPES, flat, randn, rounded};
use super::{NO_ROW, decode_attention, rope_split, silu_mul, spans_tensor, write_rows};

fn case() -> AttentionCase {
    AttentionCase::new(AttentionShape::SMALL, DType::F32)
}

fn run(c: &AttentionCase, dtype: DType) -> Vec<Vec<f32>> {
    let out = c.attend(&Device::Cpu, dtype).expect("decode attention");
    (out.to_dtype(DType::F32).and_then(|t| t.to_vec2())).expect("out")
}

/// Softmax attention in f64 over the columns a span names.
fn reference(c: &AttentionCase, row: usize, head: usize) -> Vec<f32> {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        ..
    } = c.shape;
    let kv = head / (heads / kv_heads);
    let span = c.spans[row];
    let vec = |t: &Tensor, i: usize| -> Vec<f64> {
        let v: Vec<f32> = t.i((kv, i)).and_then(|t| t.to_vec1()).expect("row");
        v.into_iter().map(f64::from).collect()
    };
    let mut cols: Vec<(Vec<f64>, Vec<f64>)> = (0..span.len)
        .map(|j| (vec(&c.keys, span.start + j), vec(&c.values, span.start + j)))
        .collect();
    if let Some(e) = span.extra {
        cols.push((vec(&c.k_step, e), vec(&c.v_step, e)));
    }
    if cols.is_empty() {
        return vec![0.0; head_dim];
    }
    let q: Vec<f32> = c.q.i((head, row)).and_then(|t| t.to_vec1()).expect("q");
    let scores: Vec<f64> = (cols.iter())
        .map(|(k, _)| {
            q.iter().zip(k).map(|(&a, b)| f64::from(a) * b).sum::<f64>() / (head_dim as f64).sqrt()
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = p.iter().sum();
    (0..head_dim)
        .map(|d| (p.iter().zip(&cols).map(|(p, (_, v))| p * v[d]).sum::<f64>() / sum) as f32)
        .collect()
}

/// One rounding of `dtype`, relative; f32's is tighter than `fixtures::one_rounding`'s,
/// which allows for the kernels' different sum orders.
fn ulp(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => 1e-6,
    }
}

/// How far the op's output strays past one rounding of `dtype` from the f64 reference on the
/// same (rounded) inputs.
fn worst_excess(c: &AttentionCase, dtype: DType) -> f32 {
    let r = |t: &Tensor| rounded(t, dtype);
    let c = AttentionCase {
        q: r(&c.q),
        keys: r(&c.keys),
        values: r(&c.values),
        k_step: r(&c.k_step),
        v_step: r(&c.v_step),
        ..c.clone()
    };
    let out = run(&c, dtype);
    let (heads, dim) = (c.shape.heads, c.shape.head_dim);
    let mut worst = 0f32;
    for (row, got) in out.iter().enumerate() {
        for head in 0..heads {
            let want = reference(&c, row, head);
            let got = &got[head * dim..(head + 1) * dim];
            worst = (got.iter().zip(&want)).fold(worst, |w, (a, b)| {
                w.max((a - b).abs() - ulp(dtype) * b.abs())
            });
        }
    }
    worst
}

#[test]
fn matches_softmax_attention_across_chunks_groups_and_extra_columns() {
    let c = case();
    for dtype in DTYPES {
        let excess = worst_excess(&c, dtype);
        assert!(excess < 1e-5, "{dtype:?}: {excess} past one rounding");
    }
    assert!(
        run(&c, DType::F32)[3].iter().all(|&x| x == 0.0),
        "a padding row is zeros"
    );
}

#[test]
fn mismatched_shapes_are_an_error() {
    let c = case();
    let spans = spans_tensor(&c.spans[..2], &Device::Cpu).expect("spans");
    let err = decode_attention(&c.q, &c.keys, &c.values, &c.k_step, &c.v_step, &spans, 1.0)
        .expect_err("spans for 2 of 4 rows");
    assert!(
        err.to_string().contains("decode attention: shapes"),
        "{err}"
    );
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a.to_dtype(DType::F32).expect("a") - b.to_dtype(DType::F32).expect("b")).expect("sub");
    (d.abs().and_then(|d| d.flatten_all()).and_then(|d| d.max(0)))
        .and_then(|m| m.to_scalar::<f32>())
        .expect("max")
}

/// `rope_split` equals candle's rope on the head-major transposes, and V's transpose.
#[test]
fn rope_split_matches_candles_rope_and_transposes() {
    let (rows, heads, kv_heads, head_dim) = (5, 4, 2, 16);
    let rand = |cols: usize| randn(&[rows, cols]);
    let (q, k, v) = (
        rand(heads * head_dim),
        rand(kv_heads * head_dim),
        rand(kv_heads * head_dim),
    );
    let angles = randn(&[rows, head_dim / 2]);
    let (cos, sin) = (angles.cos().expect("cos"), angles.sin().expect("sin"));
    let head_major = |x: &Tensor, n: usize| {
        (x.reshape((1, rows, n, head_dim))
            .and_then(|x| x.transpose(1, 2)))
        .and_then(|x| x.contiguous())
        .expect("head-major")
    };
    let rotated = |x: &Tensor, n: usize| {
        candle_nn::rotary_emb::rope(&head_major(x, n), &cos, &sin)
            .and_then(|x| x.reshape((n, rows, head_dim)))
            .expect("rope")
    };
    let want = Tensor::cat(
        &[
            rotated(&q, heads),
            rotated(&k, kv_heads),
            head_major(&v, kv_heads)
                .reshape((kv_heads, rows, head_dim))
                .expect("v"),
        ],
        0,
    )
    .expect("cat");
    let got = rope_split(&q, &k, &v, &cos, &sin).expect("rope split");
    assert_eq!(got.dims(), want.dims());
    assert!(max_diff(&got, &want) < 1e-6, "{}", max_diff(&got, &want));
    // A row's results are its own: the first two rows alone give the same bits.
    let two = |t: &Tensor| t.narrow(0, 0, 2).expect("two rows");
    let alone = rope_split(&two(&q), &two(&k), &two(&v), &two(&cos), &two(&sin)).expect("alone");
    let beside = got.narrow(1, 0, 2).expect("narrow");
    assert_eq!(max_diff(&alone, &beside), 0.0);
}

/// `write_rows` writes each row at its cache row in every head, and skips `NO_ROW`.
#[test]
fn write_rows_writes_the_named_rows_only() {
    let (kv_heads, rows, cache_rows, head_dim) = (2, 3, 6, 4);
    let cache =
        Tensor::zeros((kv_heads, cache_rows, head_dim), DType::F32, &Device::Cpu).expect("zeros");
    let src = Tensor::arange(1f32, (kv_heads * rows * head_dim + 1) as f32, &Device::Cpu)
        .and_then(|t| t.reshape((kv_heads, rows, head_dim)))
        .expect("src");
    let to = Tensor::new(&[4u32, NO_ROW, 0], &Device::Cpu).expect("to");
    write_rows(&cache, &src, &to).expect("write rows");
    for head in 0..kv_heads {
        let row = |t: &Tensor, i: usize| {
            t.i((head, i))
                .and_then(|r| r.to_vec1::<f32>())
                .expect("row")
        };
        assert_eq!(row(&cache, 4), row(&src, 0));
        assert_eq!(row(&cache, 0), row(&src, 2));
        for untouched in [1, 2, 3, 5] {
            assert_eq!(
                row(&cache, untouched),
                vec![0.0; head_dim],
                "head {head} row {untouched}"
            );
        }
    }
    let past = Tensor::new(&[6u32, NO_ROW, 0], &Device::Cpu).expect("to");
    let err = write_rows(&cache, &src, &past).expect_err("a row past the cache");
    assert!(err.to_string().contains("past 6 rows"), "{err}");
}

#[test]
fn silu_mul_matches_candles_silu_times_up() {
    let rand = || Tensor::randn(0f32, 2.0, (8, 40), &Device::Cpu).expect("randn");
    let (gate, up) = (rand(), rand());
    for dtype in DTYPES {
        let (gate, up) = (rounded(&gate, dtype), rounded(&up, dtype));
        let want = (candle_nn::ops::silu(&gate).expect("silu") * &up).expect("mul");
        let cast = |t: &Tensor| t.to_dtype(dtype).expect("cast");
        let got = silu_mul(&cast(&gate), &cast(&up)).expect("silu mul");
        let (got, want) = (flat(&got), flat(&want));
        for (a, b) in got.iter().zip(&want) {
            let bound = 1e-5 + ulp(dtype) * b.abs();
            assert!((a - b).abs() <= bound, "{dtype:?}: {a} against {b}");
        }
    }
}
