//! How far ahead the kernels that stream weights prefetch them: the x86 matmuls (`avx2`,
//! `avx512`, `avx512_bf16`) and the f16 LM head (`f16`). Each host
//! model's `Kernels` carries one [`Prefetch`] plan, forced (`--prefetch`) or chosen by timing
//! every candidate on the model's own decode steps when it loads ([`choose`], called by
//! `model::timing`).
//!
//! Why measured and not fixed: where a step's weights come from differs between machines, and
//! so does the best plan. Where the default model's weights stay in an L3 larger than them,
//! one prefetch into L1 16 KB ahead is best, and a second level into L2 made the 1-row step
//! slower. Where they come mostly from DRAM (a VM's share of an L3 that other tenants use, say),
//! a prefetch 16 KB ahead into L1 keeps too few misses in flight, and adding one 64 KB ahead
//! into L2 made the 1-row and the 4-row step much faster (`cargo bench --bench step -- --only
//! rows`, both plans alternating; `spex bench` prints the timings it chose by).
//! A plan changes no result: prefetches only move data between caches.

use std::time::Duration;

/// A prefetch plan: every weight stream is prefetched `near_bytes` ahead into L1 and, where
/// `far_bytes` is not zero, also `far_bytes` ahead into L2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// How far ahead each stream is prefetched into L1, in bytes.
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
    /// The plans [`choose`] times, the first the default.
    pub const CANDIDATES: [Self; 2] = [Self::L1, Self::L2];

    /// Its name for `--prefetch` and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::L1 => "l1",
            Self::L2 => "l2",
            _ => "custom",
        }
    }
}

/// How a model's plan was fixed: forced, or chosen by timing, with the timings.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// Forced (`--prefetch`).
    Forced(Prefetch),
    /// Chosen by timing every candidate (none timed where the kernels prefetch nothing).
    Measured {
        /// The cheapest candidate.
        chosen: Prefetch,
        /// Every candidate's timings, in the order of [`Prefetch::CANDIDATES`].
        trials: Vec<Trial>,
    },
}

impl Choice {
    /// The plan it fixed.
    pub fn plan(&self) -> Prefetch {
        match self {
            Self::Forced(plan) | Self::Measured { chosen: plan, .. } => *plan,
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

impl Trial {
    /// What a plan is chosen by: a baseline token's compute (R one-row steps) plus a full
    /// pipeline's (one R-row step), so that neither lane is sped up at the other's expense.
    fn cost(&self, passes: u32) -> Duration {
        self.one_row * passes + self.many_rows
    }
}

/// The plan of the candidates' trials: each timed with `measure` (its median one-row and
/// R-row step compute, the candidates taking turns inside it, in the order of
/// [`Prefetch::CANDIDATES`]), the cheapest by `Trial::cost` kept. Where the kernels of `isa`
/// prefetch nothing (the portable loops, NEON) nothing is timed: the default stands, with no
/// trials.
pub fn choose<E>(
    isa: super::Isa,
    passes: usize,
    measure: impl FnOnce(&[Prefetch]) -> Result<Vec<(Duration, Duration)>, E>,
) -> Result<Choice, E> {
    if !isa.has_avx2() {
        return Ok(Choice::Measured {
            chosen: Prefetch::L1,
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
    let chosen = cheapest(&trials, passes);
    Ok(Choice::Measured { chosen, trials })
}

/// The plan of the cheapest trial by `Trial::cost` (the default where there are none). Plans
/// that time within a few percent are a close call either way: where the shipped model's
/// steps time alike under both, `spex bench` (`--prefetch l1|l2`, 8 rounds each, alternating)
/// ran the speculative lane as fast under `l1` and the baseline a little faster, while at
/// Ouro-1.4B's shape `l2` took far less time for a 1-row and a 4-row step.
fn cheapest(trials: &[Trial], passes: usize) -> Prefetch {
    let passes = u32::try_from(passes).unwrap_or(u32::MAX);
    (trials.iter())
        .min_by_key(|t| t.cost(passes))
        .map_or(Prefetch::L1, |t| t.plan)
}

impl Prefetch {
    /// The near distance in elements of `bytes_per_element`, at least `least` (a matmul's
    /// next group of weight rows).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn near(self, bytes_per_element: usize, least: usize) -> usize {
        (self.near_bytes / bytes_per_element).max(least)
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
    fn the_plan_is_the_one_with_the_least_baseline_token_plus_full_step() {
        // L1: 4 · 500 + 900 = 2900 µs; L2: 4 · 440 + 1300 = 3060 µs.
        let trials = [
            trial(Prefetch::L1, 500, 900),
            trial(Prefetch::L2, 440, 1300),
        ];
        assert_eq!(cheapest(&trials, 4), Prefetch::L1);
        // A one-row step counts R times: at R = 8 the cheaper one-row step wins (4900 µs
        // against 4820).
        assert_eq!(cheapest(&trials, 8), Prefetch::L2);
        assert_eq!(cheapest(&[], 4), Prefetch::L1);
    }

    #[test]
    fn a_close_call_goes_to_the_cheaper_plan() {
        // L1: 2900 µs; L2: 2980 µs.
        let trials = [trial(Prefetch::L1, 500, 900), trial(Prefetch::L2, 510, 940)];
        assert_eq!(cheapest(&trials, 4), Prefetch::L1);
        let trials = [trial(Prefetch::L1, 510, 940), trial(Prefetch::L2, 500, 900)];
        assert_eq!(cheapest(&trials, 4), Prefetch::L2);
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
        let l2 = product(Prefetch::L2);
        assert!(l1.iter().zip(&l2).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
