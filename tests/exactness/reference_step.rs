//! The batched step against the unbatched reference forward: the staggered SPEED pattern
//! of rows at different passes and positions, second candidates beside them, every readout
//! within a tolerance of the reference's logits. Part of the `exactness` test binary.

use spex::engine::LoadedModel;
use spex::engine::kv_cache::KvCache;
use spex::engine::model::{Backend, KvDtype, ReadoutKind, RowInput, RowSlot, StepBackend, StepRow};

use super::common::{
    Variant, random_model, reference_last_logits, reference_logits, spec, with_device_backend,
    with_kv_dtype,
};
use super::max_abs_diff;

/// Runs the staggered SPEED pattern on a fixed sequence: token p runs pass r at step p + r,
/// so every step mixes rows of different passes and positions. Beside each pass-1 row from
/// position 1 on runs a second candidate (another token at the same position), dropped after
/// its step. Every readout is compared with the reference (the second's with the reference of
/// its own sequence).
///
/// Against an f16 KV cache the reference rounds its keys and values alike, but a value within
/// an f32 rounding error of a midpoint between two f16s can round the other way there than
/// in the step: one f16 ulp (at most 2⁻¹⁰ relative) in an entry, and every layer and pass
/// after it carries it on. So the tolerance there is one f16 ulp of the row's largest logit,
/// at most 2⁻¹⁰ of it (`f16::EPSILON`). Seen: on aarch64 3·10⁻⁴ in the logits; on an AMD
/// EPYC Zen 3 (AVX2), GQA with 4 layers × 4 passes, 3.6·10⁻³ where the largest logit was
/// 13.2 (0.28 of that row's tolerance). A wrong entry, position or tile moves logits by whole
/// units. (A step that read unrounded entries anywhere would differ from baseline decoding,
/// which the exactness tests compare bit for bit.)
fn check_pipelined_steps(loaded: &LoadedModel, references: &References) {
    let f32_tolerance = Tolerance {
        absolute: 1e-4,
        of_largest: 0.0,
    };
    match &loaded.backend {
        Backend::Host(b) if b.options().kv_dtype == KvDtype::F16 => {
            let one_f16_ulp = Tolerance {
                absolute: 0.0,
                of_largest: f32::from(half::f16::EPSILON),
            };
            check_pipelined_steps_on(&**b, loaded, references, one_f16_ulp)
        }
        Backend::Host(b) => check_pipelined_steps_on(&**b, loaded, references, f32_tolerance),
        Backend::Device(b) => check_pipelined_steps_on(&**b, loaded, references, f32_tolerance),
    }
}

/// How far a step's logits may lie from the reference's: `absolute`, plus `of_largest` times
/// the largest magnitude among the reference row's logits.
#[derive(Debug, Clone, Copy)]
struct Tolerance {
    absolute: f32,
    of_largest: f32,
}

impl Tolerance {
    fn of(self, want: &[f32]) -> f32 {
        let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        self.absolute + self.of_largest * largest
    }
}

/// The reference's logits for the tile-crossing sequence ([`tile_crossing_ids`]) at every
/// pass and position, and each second candidate's token and pass-1 logits. They depend on the
/// weights and on how the reference rounds keys and values ([`reference_logits`]), not on the
/// backend: the host's f32 cache and the device backend share one set.
struct References {
    ids: Vec<u32>,
    logits: Vec<Vec<Vec<f32>>>,
    seconds: Vec<Option<(u32, Vec<f32>)>>,
}

impl References {
    fn of(loaded: &LoadedModel) -> Self {
        let ids = tile_crossing_ids(loaded);
        let logits = reference_logits(loaded, &ids);
        let seconds = (0..ids.len())
            .map(|pos| has_second(pos).then(|| second_candidate(loaded, &ids, pos)))
            .collect();
        References {
            ids,
            logits,
            seconds,
        }
    }
}

/// The token a second candidate at `pos` of `ids` runs, and its pass-1 reference logits.
fn second_candidate(loaded: &LoadedModel, ids: &[u32], pos: usize) -> (u32, Vec<f32>) {
    let vocab = loaded.model().config.vocab as u32;
    let mut alt = ids[..=pos].to_vec();
    alt[pos] = (ids[pos] + 7) % vocab;
    (alt[pos], reference_last_logits(loaded, &alt, 0))
}

/// Whether position `pos` gets a second candidate beside its pass-1 row: the first position
/// after the prompt's first, every sixth, and the three about the cache's tile boundary (64).
/// Each costs a reference forward over the positions before it, so a second at every
/// position would make the test quadratic in the sequence; a second's rows are the same code
/// at any position.
fn has_second(pos: usize) -> bool {
    pos > 0 && (pos % 6 == 1 || (63..=65).contains(&pos))
}

/// The rows of step `step` of the staggered pattern: (position, pass index, second).
fn step_members(step: usize, positions: usize, passes: usize) -> Vec<(usize, usize, bool)> {
    (0..passes)
        .filter_map(|r| {
            step.checked_sub(r)
                .filter(|&p| p < positions)
                .map(|p| (p, r))
        })
        .flat_map(|(p, r)| {
            let second = (r == 0 && has_second(p)).then_some((p, r, true));
            std::iter::once((p, r, false)).chain(second)
        })
        .collect()
}

/// The row that came nearest its tolerance (or passed it furthest): its distance from the
/// reference beyond the f16 head's allowance, and its tolerance.
struct Worst {
    beyond: f32,
    tolerance: f32,
}

impl Worst {
    fn note(&mut self, beyond: f32, tolerance: f32) {
        if beyond - tolerance > self.beyond - self.tolerance {
            (self.beyond, self.tolerance) = (beyond, tolerance);
        }
    }
}

/// The slot of a row of the staggered pattern: proposals before pass R, an argmax at pass R.
fn slot(pos: usize, pass: usize, passes: usize, second: bool) -> RowSlot {
    RowSlot {
        pos,
        pass: spex::engine::Pass::from_index(pass),
        readout: match pass + 1 == passes {
            true => ReadoutKind::Argmax,
            false => ReadoutKind::Proposal,
        },
        second,
    }
}

/// More positions than one tile of the host cache (`kernels::KvLayout::Tiles`: 64); the
/// caller's cache holds a few more, so its capacity is not a whole number of tiles.
fn tile_crossing_ids(loaded: &LoadedModel) -> Vec<u32> {
    let ids = loaded
        .tokenizer
        .encode(
            "Shall I compare thee to a summer's day? Thou art more lovely and more \
             temperate: rough winds do shake the darling buds of May",
        )
        .unwrap();
    assert!(ids.len() > 64, "{} positions", ids.len());
    ids
}

fn check_pipelined_steps_on<B: StepBackend>(
    backend: &B,
    loaded: &LoadedModel,
    references: &References,
    tolerance: Tolerance,
) {
    let (ids, reference) = (&references.ids, &references.logits);
    let passes = loaded.model().passes();
    let second_at = |pos: usize| {
        references.seconds[pos]
            .as_ref()
            .expect("a second at this position")
    };
    let capacity = ids.len() + 5;
    let mut cache = KvCache::new(backend.new_store(capacity).unwrap(), passes, capacity);
    let mut hidden: Vec<Option<RowInput<B::Hidden>>> =
        ids.iter().map(|&id| Some(RowInput::Token(id))).collect();
    let mut worst = Worst {
        beyond: f32::NEG_INFINITY,
        tolerance: tolerance.of(&[]),
    };
    for step in 0..ids.len() + passes - 1 {
        let members = step_members(step, ids.len(), passes);
        let rows: Vec<StepRow<B::Hidden>> = members
            .iter()
            .map(|&(pos, pass, second)| StepRow {
                slot: slot(pos, pass, passes, second),
                input: match second {
                    true => RowInput::Token(second_at(pos).0),
                    false => hidden[pos].take().unwrap(),
                },
            })
            .collect();
        let out = spex::engine::model::step(backend, rows, &mut cache).unwrap();
        for ((&(pos, pass, second), h), logits) in members.iter().zip(out.hidden).zip(out.logits) {
            let want = match second {
                true => &second_at(pos).1,
                false => &reference[pass][pos],
            };
            // Readouts may come from the f16 head, within its bound (at pass R only the logits
            // that could be the argmax are recomputed exactly).
            let allowed = backend.proposal_error_bound(&h).unwrap_or(0.0);
            worst.note(
                max_abs_diff(&logits.unwrap(), want) - allowed as f32,
                tolerance.of(want),
            );
            if second {
                cache.drop_second(pos);
            } else {
                hidden[pos] = Some(RowInput::Hidden(h));
            }
        }
    }
    assert!(
        worst.beyond < worst.tolerance,
        "batched step logits differ from the reference by {} (tolerance {})",
        worst.beyond,
        worst.tolerance
    );
}

#[test]
fn batched_step_matches_reference_forward() {
    for variant in [Variant::Tied, Variant::Untied, Variant::Gqa] {
        for (layers, passes) in [(1, 1), (2, 3), (4, 4)] {
            let (_dir, loaded) = random_model(&spec(layers, passes, variant, 3));
            let f32_kv = with_kv_dtype(&loaded, KvDtype::F32);
            let composed = References::of(&f32_kv);
            check_pipelined_steps(&loaded, &References::of(&loaded));
            check_pipelined_steps(&f32_kv, &composed);
            check_pipelined_steps(&with_device_backend(&loaded), &composed);
        }
    }
}
