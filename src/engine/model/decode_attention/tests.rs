//! [`super::decode_attention`] against softmax attention in f64, and its batch invariance.

use candle_core::{Device, IndexOp};

use candle_core::{DType, Tensor};

use super::{RowSpan, decode_attention, spans_tensor};

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 32;
/// Two passes' spans, long enough that one crosses a chunk.
const CAPACITY: usize = 1300;

struct Case {
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    k_step: Tensor,
    v_step: Tensor,
    spans: Vec<RowSpan>,
}

fn randn(shape: (usize, usize, usize)) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).expect("randn")
}

fn case() -> Case {
    let rows = 4;
    Case {
        q: randn((HEADS, rows, HEAD_DIM)),
        keys: randn((KV_HEADS, 2 * CAPACITY, HEAD_DIM)),
        values: randn((KV_HEADS, 2 * CAPACITY, HEAD_DIM)),
        k_step: randn((KV_HEADS, rows, HEAD_DIM)),
        v_step: randn((KV_HEADS, rows, HEAD_DIM)),
        spans: vec![
            RowSpan {
                start: 0,
                len: 5,
                extra: None,
            },
            RowSpan {
                start: CAPACITY,
                len: 1200,
                extra: None,
            },
            RowSpan {
                start: 0,
                len: 4,
                extra: Some(2),
            },
            RowSpan::EMPTY,
        ],
    }
}

fn run(c: &Case, dtype: DType) -> Vec<Vec<f32>> {
    let cast = |t: &Tensor| t.to_dtype(dtype).expect("cast");
    let spans = spans_tensor(&c.spans, &Device::Cpu).expect("spans");
    let out = decode_attention(
        &cast(&c.q),
        (&cast(&c.keys), &cast(&c.values)),
        (&cast(&c.k_step), &cast(&c.v_step)),
        &spans,
        1.0 / (HEAD_DIM as f32).sqrt(),
    )
    .expect("decode attention");
    (out.to_dtype(DType::F32).and_then(|t| t.to_vec2())).expect("out")
}

/// Softmax attention in f64 over the columns a span names.
fn reference(c: &Case, row: usize, head: usize) -> Vec<f32> {
    let kv = head / (HEADS / KV_HEADS);
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
        return vec![0.0; HEAD_DIM];
    }
    let q: Vec<f32> = c.q.i((head, row)).and_then(|t| t.to_vec1()).expect("q");
    let scores: Vec<f64> = (cols.iter())
        .map(|(k, _)| {
            q.iter().zip(k).map(|(&a, b)| f64::from(a) * b).sum::<f64>() / (HEAD_DIM as f64).sqrt()
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = p.iter().sum();
    (0..HEAD_DIM)
        .map(|d| (p.iter().zip(&cols).map(|(p, (_, v))| p * v[d]).sum::<f64>() / sum) as f32)
        .collect()
}

fn worst_error(c: &Case, dtype: DType) -> f32 {
    let out = run(c, dtype);
    let mut worst = 0f32;
    for (row, got) in out.iter().enumerate() {
        for head in 0..HEADS {
            let want = reference(c, row, head);
            let got = &got[head * HEAD_DIM..(head + 1) * HEAD_DIM];
            worst = (got.iter().zip(&want)).fold(worst, |w, (a, b)| w.max((a - b).abs()));
        }
    }
    worst
}

#[test]
fn matches_softmax_attention_across_chunks_groups_and_extra_columns() {
    let c = case();
    assert!(
        worst_error(&c, DType::F32) < 1e-5,
        "{}",
        worst_error(&c, DType::F32)
    );
    assert!(
        worst_error(&c, DType::BF16) < 0.05,
        "{}",
        worst_error(&c, DType::BF16)
    );
    assert!(
        run(&c, DType::F32)[3].iter().all(|&x| x == 0.0),
        "a padding row is zeros"
    );
}

/// A row's bits do not depend on the rows beside it, and a second candidate's extra column
/// gives the bits its entry gives in the cache at its position (the baseline's view).
#[test]
fn a_row_has_the_same_bits_alone_beside_others_and_from_the_cache() {
    let full = case();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let all = run(&full, dtype);
        for (row, want) in all.iter().enumerate().take(3) {
            let one_row = |t: &Tensor| {
                t.narrow(1, row, 1)
                    .and_then(|t| t.contiguous())
                    .expect("row")
            };
            let alone = Case {
                q: one_row(&full.q),
                k_step: one_row(&full.k_step),
                v_step: one_row(&full.v_step),
                keys: full.keys.clone(),
                values: full.values.clone(),
                spans: vec![RowSpan {
                    extra: full.spans[row].extra.map(|_| 0),
                    ..full.spans[row]
                }],
            };
            assert_eq!(&run(&alone, dtype)[0], want, "{dtype:?} row {row}");
        }
        // Row 2's extra column (step row 2) written at its position in the cache instead.
        let span = full.spans[2];
        let put = |cache: &Tensor, step: &Tensor| {
            let entry = step
                .narrow(1, 2, 1)
                .and_then(|t| t.contiguous())
                .expect("entry");
            let cache = cache.copy().expect("copy");
            cache
                .slice_set(&entry, 1, span.start + span.len)
                .expect("slice_set");
            cache
        };
        let cached = Case {
            keys: put(&full.keys, &full.k_step),
            values: put(&full.values, &full.v_step),
            spans: vec![
                full.spans[0],
                full.spans[1],
                RowSpan {
                    len: span.len + 1,
                    extra: None,
                    ..span
                },
                RowSpan::EMPTY,
            ],
            q: full.q.clone(),
            k_step: full.k_step.clone(),
            v_step: full.v_step.clone(),
        };
        assert_eq!(
            run(&cached, dtype)[2],
            all[2],
            "{dtype:?}: extra column vs cache"
        );
    }
}

#[test]
fn mismatched_shapes_are_an_error() {
    let c = case();
    let spans = spans_tensor(&c.spans[..2], &Device::Cpu).expect("spans");
    let err = decode_attention(
        &c.q,
        (&c.keys, &c.values),
        (&c.k_step, &c.v_step),
        &spans,
        1.0,
    )
    .expect_err("spans for 2 of 4 rows");
    assert!(
        err.to_string().contains("decode attention: shapes"),
        "{err}"
    );
}
