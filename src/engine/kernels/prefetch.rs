//! How far ahead the kernels that stream weights prefetch them: the x86 matmuls (`avx2`,
//! `avx512`, `avx512_bf16`), the quantized ones (`q8_0`) and the f16 LM head (`f16`). Each
//! host model's `Kernels` carries one [`Prefetch`] plan for its one-row products and one for
//! its products of several rows ([`Plans`]), forced (`--prefetch`, one for both) or chosen by
//! timing every candidate on the model's own decode steps when it loads ([`choose`], called by
//! `model::timing`).
//!
//! Why measured and not fixed: where a step's weights come from differs between machines, and
//! so does the best plan. Where the default model's weights stay in an L3 larger than them,
//! one prefetch into L1 16 KB ahead is best, and a second level into L2 made the 1-row step
//! slower. Where they come mostly from DRAM (a VM's share of an L3 that other tenants use, say),
//! a prefetch 16 KB ahead into L1 keeps too few misses in flight, and adding one 64 KB ahead
//! into L2 made the 1-row and the 4-row step much faster (`cargo bench --bench step -- --only
//! rows`, both plans alternating; `spex bench` prints the timings it chose by). Where the
//! CPU's own prefetchers keep a stream from DRAM ahead by themselves, any software prefetch
//! made the one-row products slower, and no prefetch at all is best for them ([`Plans`]). And
//! where the products of several rows keep the load ports busy (the K-quants'), a prefetch
//! into L2 alone keeps the stream ahead at the least cost ([`Prefetch::FAR`]).
//! A plan changes no result: prefetches only move data between caches.

use std::time::Duration;

/// A prefetch plan: every weight stream is prefetched `near_bytes` ahead into L1 and
/// `far_bytes` ahead into L2, each where it is not zero. With both zero the kernels issue no
/// prefetch and leave the streams to the CPU's own prefetchers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// How far ahead each stream is prefetched into L1, in bytes (0: not at all).
    pub near_bytes: usize,
    /// How far ahead it is also prefetched into L2, in bytes (0: not at all).
    pub far_bytes: usize,
}

impl Prefetch {
    /// 16 KB ahead into L1: best where the weights stay in L3. A matmul's next group of weight
    /// rows (2–8 KB at hidden 256) was too close: 16 KB made the default model's 4-row step
    /// faster under AVX-512 and AVX2 alike, and 8, 12, 20 and 24 KB timed in between.
    pub const L1: Self = Self {
        near_bytes: 16 << 10,
        far_bytes: 0,
    };
    /// 8 KB ahead into L1 and 64 KB ahead into L2: best where they come from DRAM.
    pub const L2: Self = Self {
        near_bytes: 8 << 10,
        far_bytes: 64 << 10,
    };
    /// 64 KB ahead into L2 only: best for the K-quants' products of several rows where the
    /// weights come from DRAM. Those kernels' loads fill their cycles (a broadcast activation
    /// for each weight vector), and an L1 prefetch as well, one more load a line, made Q6_K's
    /// 4-row products slower than no prefetch at all, where this plan made them faster.
    pub const FAR: Self = Self {
        near_bytes: 0,
        far_bytes: 64 << 10,
    };
    /// No software prefetch: the CPU's own prefetchers alone. Best where they keep a stream
    /// from DRAM ahead of the kernels by themselves: there a prefetch instruction
    /// only takes a load slot, and prefetches far ahead compete with the stream they serve.
    pub const NONE: Self = Self {
        near_bytes: 0,
        far_bytes: 0,
    };
    /// The plans [`choose`] times, the first the default.
    pub const CANDIDATES: [Self; 4] = [Self::L1, Self::L2, Self::FAR, Self::NONE];

    /// Its name for `--prefetch` and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::L1 => "l1",
            Self::L2 => "l2",
            Self::FAR => "far",
            Self::NONE => "none",
            _ => "custom",
        }
    }

    /// What it does, in a few words, for `--help`: read from its distances.
    pub fn about(self) -> String {
        match (self.near_bytes >> 10, self.far_bytes >> 10) {
            (0, 0) => "the CPU's own prefetchers alone".to_string(),
            (near, 0) => format!("{near} KB ahead into L1"),
            (0, far) => format!("{far} KB ahead into L2 only"),
            (near, far) => format!("{near} KB ahead into L1 and {far} KB into L2"),
        }
    }
}

/// The plans a model's kernels run: one for products of one row (a baseline step's), one for
/// products of several (a pipeline step's). Why two: a one-row product is bound by the weight
/// stream and a many-row one by its arithmetic, and the best plan can differ between them:
/// where the CPU's own prefetchers keep up with a one-row product, no prefetch at all made the
/// one-row step of Ouro-1.4B's shape the fastest and the 4-row step far slower than under
/// [`Prefetch::L2`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plans {
    /// The plan of one-row products.
    pub one_row: Prefetch,
    /// The plan of products of several rows.
    pub many_rows: Prefetch,
}

impl Plans {
    /// `plan` for every product.
    pub const fn both(plan: Prefetch) -> Self {
        Self {
            one_row: plan,
            many_rows: plan,
        }
    }

    /// The plan of a product of `rows` rows.
    pub fn for_rows(self, rows: usize) -> Prefetch {
        match rows {
            1 => self.one_row,
            _ => self.many_rows,
        }
    }

    /// Their names for reports: one name where both are the same plan, else the one-row
    /// plan's and the many-row plan's, as `none/l2`.
    pub fn name(self) -> String {
        match self.one_row == self.many_rows {
            true => self.one_row.name().to_string(),
            false => format!("{}/{}", self.one_row.name(), self.many_rows.name()),
        }
    }
}

/// How a model's plans were fixed: forced, or chosen by timing, with the timings.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// Forced (`--prefetch`), one plan for every product.
    Forced(Prefetch),
    /// Chosen by timing every candidate (none timed where the kernels prefetch nothing).
    Measured {
        /// The fastest candidate of each step.
        chosen: Plans,
        /// Every candidate's timings, in the order of [`Prefetch::CANDIDATES`].
        trials: Vec<Trial>,
    },
}

impl Choice {
    /// The plans it fixed.
    pub fn plans(&self) -> Plans {
        match self {
            Self::Forced(plan) => Plans::both(*plan),
            Self::Measured { chosen, .. } => *chosen,
        }
    }
}

/// One candidate's median step compute when the plan was chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trial {
    /// The candidate timed.
    pub plan: Prefetch,
    /// Its median one-row step compute.
    pub one_row: Duration,
    /// Its median R-row step compute.
    pub many_rows: Duration,
}

/// The plans of the candidates' trials: each timed with `measure` (its median one-row and
/// R-row step compute, the candidates taking turns inside it, in the order of
/// [`Prefetch::CANDIDATES`]), the fastest at each kept for its step. Where the kernels of
/// `isa` prefetch nothing (the portable loops, NEON) nothing is timed: the default stands,
/// with no trials.
pub fn choose<E>(
    isa: super::Isa,
    measure: impl FnOnce(&[Prefetch]) -> Result<Vec<(Duration, Duration)>, E>,
) -> Result<Choice, E> {
    if !isa.has_avx2() {
        return Ok(Choice::Measured {
            chosen: Plans::both(Prefetch::L1),
            trials: Vec::new(),
        });
    }
    let times = measure(&Prefetch::CANDIDATES)?;
    let trials: Vec<Trial> = (Prefetch::CANDIDATES.iter())
        .zip(times)
        .map(|(&plan, (one_row, many_rows))| Trial {
            plan,
            one_row,
            many_rows,
        })
        .collect();
    let chosen = fastest(&trials);
    Ok(Choice::Measured { chosen, trials })
}

/// The plan of the fastest one-row step and that of the fastest R-row step (the default where
/// there are no trials; the earlier candidate on a tie). Plans that time within a few percent
/// are a close call either way.
fn fastest(trials: &[Trial]) -> Plans {
    let best = |step: fn(&Trial) -> Duration| {
        (trials.iter())
            .min_by_key(|t| step(t))
            .map_or(Prefetch::L1, |t| t.plan)
    };
    Plans {
        one_row: best(|t| t.one_row),
        many_rows: best(|t| t.many_rows),
    }
}

impl Prefetch {
    /// The near distance in elements of `bytes_per_element`, at least `least` (a matmul's
    /// next group of weight rows); `None` for no near prefetch.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn near(self, bytes_per_element: usize, least: usize) -> Option<usize> {
        (self.near_bytes > 0).then(|| (self.near_bytes / bytes_per_element).max(least))
    }

    /// The far distance in elements of `bytes_per_element`; zero for none.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn far(self, bytes_per_element: usize) -> usize {
        self.far_bytes / bytes_per_element
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trial(plan: Prefetch, one_row_us: u64, many_rows_us: u64) -> Trial {
        Trial {
            plan,
            one_row: Duration::from_micros(one_row_us),
            many_rows: Duration::from_micros(many_rows_us),
        }
    }

    #[test]
    fn each_step_takes_the_plan_it_timed_fastest_under() {
        let trials = [
            trial(Prefetch::L1, 500, 900),
            trial(Prefetch::L2, 440, 1300),
            trial(Prefetch::NONE, 460, 1000),
        ];
        let plans = fastest(&trials);
        assert_eq!(plans.one_row, Prefetch::L2);
        assert_eq!(plans.many_rows, Prefetch::L1);
        assert_eq!(
            (plans.for_rows(1), plans.for_rows(4)),
            (Prefetch::L2, Prefetch::L1)
        );
        assert_eq!(plans.name(), "l2/l1");
        assert_eq!(fastest(&[]), Plans::both(Prefetch::L1));
        assert_eq!(Plans::both(Prefetch::NONE).name(), "none");
    }

    #[test]
    fn a_tie_goes_to_the_earlier_candidate() {
        let trials = [trial(Prefetch::L1, 500, 900), trial(Prefetch::L2, 500, 900)];
        assert_eq!(fastest(&trials), Plans::both(Prefetch::L1));
    }

    #[test]
    fn every_plan_gives_the_same_products_bit_for_bit() {
        let (rows, inner, outs) = (5, 256, 3 * 64 + 5);
        let x: Vec<f32> = (0..rows * inner)
            .map(|i| (i % 17) as f32 / 17.0 - 0.4)
            .collect();
        let w: Vec<f32> = (0..outs * inner)
            .map(|i| (i % 29) as f32 / 29.0 - 0.5)
            .collect();
        let product = |plan: Prefetch| {
            let kernels = super::super::Kernels::single_threaded().with_prefetch(plan);
            let mut out = vec![0f32; rows * outs];
            kernels.matmul_t(&x, (&w).into(), rows, inner, &mut out);
            out
        };
        let l1 = product(Prefetch::L1);
        for plan in Prefetch::CANDIDATES {
            let other = product(plan);
            assert!(
                l1.iter()
                    .zip(&other)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
    }
}
