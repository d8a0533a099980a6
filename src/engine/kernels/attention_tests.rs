//! Attention kernel tests: every ISA this CPU runs agrees closely with the portable loops,
//! and a group of rows, heads or cache tiles attends as each alone, bit for bit.

use super::tests::{lcg, supported_isas};
use super::*;

#[test]
fn attention_kernels_agree_closely_with_the_portable_loops() {
    let mut seed = 13;
    for head_dim in [64, 128, 32] {
        for (heads, kv_heads) in [(4, 4), (4, 2)] {
            for len in [1, 7, 8, 9, 33] {
                let shape = AttnShape {
                    heads,
                    kv_heads,
                    head_dim,
                };
                let mut random = |n: usize| (0..n).map(|_| 4.0 * lcg(&mut seed)).collect();
                let q: Vec<f32> = random(heads * head_dim);
                let keys: Vec<f32> = random(len * kv_heads * head_dim);
                let values: Vec<f32> = random(len * kv_heads * head_dim);
                let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                let query = [attention::Query {
                    q: &q,
                    cached: len,
                    own: None,
                }];
                let cache = (&keys[..], &values[..]);
                let mut scores = Vec::new();
                attention::attend_group_on(
                    Isa::Portable,
                    &query,
                    cache,
                    HeadSpan {
                        shape,
                        heads: 0..heads,
                    },
                    &mut a,
                    &mut scores,
                );
                attend_row(&q, &keys, &values, len, shape, &mut b, &mut Vec::new());
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() < 1e-5, "{shape:?} len {len}: {x} vs {y}");
                }
                for isa in supported_isas() {
                    let all_heads = HeadSpan {
                        shape,
                        heads: 0..heads,
                    };
                    attention::attend_group_on(isa, &query, cache, all_heads, &mut b, &mut scores);
                    for (x, y) in a.iter().zip(&b) {
                        assert!(
                            (x - y).abs() < 1e-5,
                            "{isa:?} {shape:?} len {len}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

/// A group of rows over one cache, some with their own entry after it (second candidates),
/// gives each row the bits it gets alone over the cache with its entry written in place; in
/// an f32 and an f16 cache (whose own entries are rounded as the cache stores them).
#[test]
fn a_group_attends_as_its_rows_alone_bit_for_bit() {
    let mut seed = 29;
    for isa in supported_isas() {
        for (head_dim, heads, kv_heads) in [(64, 4, 4), (64, 4, 2), (128, 2, 1), (32, 2, 2)] {
            let shape = AttnShape {
                heads,
                kv_heads,
                head_dim,
            };
            group_attends_as_alone::<f32>(isa, shape, &mut seed);
            group_attends_as_alone::<half::f16>(isa, shape, &mut seed);
        }
    }
}

/// Random values of `E`, as f32 (exactly what an `E` cache reads back).
fn random_kv<E: KvElement>(n: usize, seed: &mut u64) -> Vec<f32> {
    let x: Vec<f32> = (0..n).map(|_| 4.0 * lcg(seed)).collect();
    let mut stored = vec![E::default(); n];
    E::narrow(&x, &mut stored);
    let mut back = vec![0f32; n];
    E::widen(&stored, &mut back);
    back
}

fn narrowed<E: KvElement>(x: &[f32]) -> Vec<E> {
    let mut out = vec![E::default(); x.len()];
    E::narrow(x, &mut out);
    out
}

fn group_attends_as_alone<E: KvElement>(isa: Isa, shape: AttnShape, seed: &mut u64) {
    let (heads, head_dim) = (shape.heads, shape.head_dim);
    let kv_dim = shape.kv_heads * head_dim;
    let (keys, values) = (
        random_kv::<E>(70 * kv_dim, seed),
        random_kv::<E>(70 * kv_dim, seed),
    );
    let rows: Vec<(usize, bool)> = vec![
        (70, false),
        (33, true),
        (1, false),
        (0, true),
        (64, true),
        (15, true),
    ];
    let qs: Vec<Vec<f32>> = (rows.iter())
        .map(|_| (0..heads * head_dim).map(|_| 4.0 * lcg(seed)).collect())
        .collect();
    let owns: Vec<(Vec<f32>, Vec<f32>)> = (rows.iter())
        .map(|_| (random_kv::<E>(kv_dim, seed), random_kv::<E>(kv_dim, seed)))
        .collect();
    let queries: Vec<attention::Query> = (rows.iter().zip(&qs).zip(&owns))
        .map(|((&(cached, own), q), (k, v))| attention::Query {
            q,
            cached,
            own: own.then_some((&k[..], &v[..])),
        })
        .collect();
    let q_dim = heads * head_dim;
    let mut group = vec![0f32; rows.len() * q_dim];
    let (keys_e, values_e) = (narrowed::<E>(&keys), narrowed::<E>(&values));
    let cache = (&keys_e[..], &values_e[..]);
    let all_heads = all_heads_of(shape);
    attention::attend_group_on(isa, &queries, cache, all_heads, &mut group, &mut Vec::new());
    tiled_layout_gives_the_same_bits(isa, shape, &queries, &keys_e, &values_e, &group);
    heads_alone_give_the_same_bits(isa, shape, &queries, cache, &group);
    rows_alone_give_the_same_bits::<E>(isa, shape, &queries, &keys, &values, &group);
}

/// The group's cache laid out in tiles, with room for more positions, gives the same bits.
fn tiled_layout_gives_the_same_bits<E: KvElement>(
    isa: Isa,
    shape: AttnShape,
    queries: &[attention::Query],
    keys_e: &[E],
    values_e: &[E],
    group: &[f32],
) {
    let (head_dim, kv_dim) = (shape.head_dim, shape.kv_heads * shape.head_dim);
    let strides = KvLayout::Tiles.strides(shape.kv_heads, head_dim);
    let by_tiles = |rows: &[E]| {
        let mut tiles = vec![E::default(); KvLayout::Tiles.elements(75, shape.kv_heads, head_dim)];
        for (s, row) in rows.chunks_exact(kv_dim).enumerate() {
            for (j, entry) in row.chunks_exact(head_dim).enumerate() {
                tiles[strides.offset(j, s)..][..head_dim].copy_from_slice(entry);
            }
        }
        tiles
    };
    let (keys_t, values_t) = (by_tiles(keys_e), by_tiles(values_e));
    let view = KvView {
        keys: &keys_t,
        values: &values_t,
        layout: KvLayout::Tiles,
    };
    let mut tiled = vec![0f32; group.len()];
    let all_heads = all_heads_of(shape);
    attention::attend_group_on(isa, queries, view, all_heads, &mut tiled, &mut Vec::new());
    let same_bits = (tiled.iter().zip(group)).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same_bits,
        "{isa:?} {shape:?}: the tiled layout gave other bits"
    );
}

/// Each head alone gives the bits it gave among all heads.
fn heads_alone_give_the_same_bits<E: KvElement>(
    isa: Isa,
    shape: AttnShape,
    queries: &[attention::Query],
    cache: (&[E], &[E]),
    group: &[f32],
) {
    let (heads, head_dim) = (shape.heads, shape.head_dim);
    let q_dim = heads * head_dim;
    for h in 0..heads {
        let mut one = vec![0f32; queries.len() * head_dim];
        let head = HeadSpan {
            shape,
            heads: h..h + 1,
        };
        attention::attend_group_on(isa, queries, cache, head, &mut one, &mut Vec::new());
        for (n, o) in one.chunks_exact(head_dim).enumerate() {
            let whole = &group[n * q_dim + h * head_dim..][..head_dim];
            assert_eq!(o, whole, "{isa:?} {shape:?} row {n} head {h}");
        }
    }
}

/// Each row alone, its own entry (if any) appended to the cache, gives the bits it gave in
/// the group.
fn rows_alone_give_the_same_bits<E: KvElement>(
    isa: Isa,
    shape: AttnShape,
    queries: &[attention::Query],
    keys: &[f32],
    values: &[f32],
    group: &[f32],
) {
    let (q_dim, kv_dim) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    for (n, query) in queries.iter().enumerate() {
        let (mut k, mut v) = (
            keys[..query.cached * kv_dim].to_vec(),
            values[..query.cached * kv_dim].to_vec(),
        );
        if let Some((own_k, own_v)) = query.own {
            k.extend_from_slice(own_k);
            v.extend_from_slice(own_v);
        }
        let alone = [attention::Query {
            q: query.q,
            cached: k.len() / kv_dim,
            own: None,
        }];
        let mut out = vec![0f32; q_dim];
        let cache = (&narrowed::<E>(&k)[..], &narrowed::<E>(&v)[..]);
        attention::attend_group_on(
            isa,
            &alone,
            cache,
            all_heads_of(shape),
            &mut out,
            &mut Vec::new(),
        );
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&out),
            bits(&group[n * q_dim..(n + 1) * q_dim]),
            "{isa:?} {shape:?} row {n}"
        );
    }
}

fn all_heads_of(shape: AttnShape) -> HeadSpan {
    HeadSpan::all(shape)
}

/// An f16 cache gives the bits of the same values widened to an f32 cache, on every ISA: the
/// kernels widen exactly and then do the f32 arithmetic.
#[test]
fn an_f16_cache_attends_as_its_values_in_f32_bit_for_bit() {
    let mut seed = 31;
    for isa in supported_isas() {
        for (head_dim, heads, kv_heads) in [(64, 4, 4), (128, 4, 2), (32, 2, 2)] {
            let shape = AttnShape {
                heads,
                kv_heads,
                head_dim,
            };
            let kv_dim = kv_heads * head_dim;
            let keys = random_kv::<half::f16>(45 * kv_dim, &mut seed);
            let values = random_kv::<half::f16>(45 * kv_dim, &mut seed);
            let q: Vec<f32> = (0..heads * head_dim)
                .map(|_| 4.0 * lcg(&mut seed))
                .collect();
            let query = [attention::Query {
                q: &q,
                cached: 45,
                own: None,
            }];
            let (mut wide, mut half) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            let f32_cache = (&keys[..], &values[..]);
            let (k16, v16) = (narrowed::<half::f16>(&keys), narrowed::<half::f16>(&values));
            let heads = all_heads_of(shape);
            attention::attend_group_on(
                isa,
                &query,
                f32_cache,
                heads.clone(),
                &mut wide,
                &mut Vec::new(),
            );
            attention::attend_group_on(
                isa,
                &query,
                (&k16[..], &v16[..]),
                heads,
                &mut half,
                &mut Vec::new(),
            );
            assert_eq!(wide, half, "{isa:?} {shape:?}");
        }
    }
}

#[test]
fn attention_over_one_position_returns_its_value() {
    let shape = AttnShape {
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let q = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
    let k = [0.5, 0.5, 0.5, 0.5];
    let v = [1.0, 2.0, 3.0, 4.0];
    let mut out = [0f32; 8];
    attend_row(&q, &k, &v, 1, shape, &mut out, &mut Vec::new());
    assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
}
