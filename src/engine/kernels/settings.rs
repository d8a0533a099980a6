//! [`Kernels`]: one host model's kernel settings as a value — its instruction set (checked
//! against the CPU when made), its prefetch plan and its decode threads — and the safe API
//! that runs the kernels with them. Chosen through `model::LoadOptions` when a model loads;
//! held by `model::host`.

use std::sync::Arc;

use super::prefetch::Plans;
use super::{
    Input, Isa, POOL_MIN_ELEMENTS, Prefetch, Rows, SharedOut, Weight, detected_isa, gated_t_on,
    matmul_t_pooled, pool, product_columns, silu_mul_on,
};

/// How one host model's kernels run, chosen when it loads (`model::LoadOptions`): each unset
/// field takes the machine's best (the CPU's ISA; a prefetch plan timed on the model's own
/// steps; one thread).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelOptions {
    /// An instruction set at most the CPU's best (`--isa`).
    pub isa: Option<Isa>,
    /// A fixed prefetch plan (`--prefetch`) instead of timing each candidate.
    pub prefetch: Option<Prefetch>,
    /// The decode threads, the caller's included (`--threads`).
    pub threads: Option<usize>,
}

/// What every kernel call carries: the instruction set, checked against the CPU when its
/// [`Kernels`] was made (every `unsafe` dispatch below rests on that), and the prefetch plan
/// of its product's row count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tuning {
    pub(super) isa: Isa,
    pub(super) prefetch: Prefetch,
}

/// One host model's kernels: its instruction set, prefetch plans and decode threads. Two
/// models with different settings in one process run each on its own.
#[derive(Debug, Clone)]
pub struct Kernels {
    isa: Isa,
    plans: Plans,
    pool: Arc<pool::Pool>,
}

impl Kernels {
    /// The kernels `options` ask for: an error where the CPU cannot run the ISA asked, the
    /// thread count is 0, or the threads cannot start. An unset plan is [`Prefetch::L1`] until
    /// the loader times the candidates ([`Kernels::with_prefetch`]).
    pub fn new(options: KernelOptions) -> Result<Self, String> {
        let isa = match options.isa {
            Some(isa) => isa.checked()?,
            None => detected_isa(),
        };
        let threads = options.threads.unwrap_or(1);
        if threads == 0 {
            return Err("--threads: must be at least 1".into());
        }
        let pool = pool::Pool::new(threads)
            .map_err(|e| format!("--threads {threads}: cannot start the threads: {e}"))?;
        Ok(Self {
            isa,
            plans: Plans::both(options.prefetch.unwrap_or(Prefetch::L1)),
            pool: Arc::new(pool),
        })
    }

    /// The CPU's best ISA and the default plan, on the calling thread alone (tests, tools).
    pub fn single_threaded() -> Self {
        Self {
            isa: detected_isa(),
            plans: Plans::both(Prefetch::L1),
            pool: Arc::new(pool::Pool::serial()),
        }
    }

    /// The same kernels and threads with `prefetch` for every product.
    pub fn with_prefetch(&self, prefetch: Prefetch) -> Self {
        self.with_plans(Plans::both(prefetch))
    }

    /// The same kernels and threads with other prefetch plans.
    pub fn with_plans(&self, plans: Plans) -> Self {
        Self {
            plans,
            pool: self.pool.clone(),
            ..*self
        }
    }

    /// The same instruction set and plan on `other`'s decode threads: two models that take
    /// turns in one decode (a model and its draft model) share one pool, because two pools of
    /// spinning workers on the same cores starve each other.
    pub fn on_threads_of(&self, other: &Kernels) -> Self {
        Self {
            pool: other.pool.clone(),
            ..*self
        }
    }

    /// The instruction set they run.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// What a product of `rows` rows runs with.
    pub(super) fn tuning(&self, rows: usize) -> Tuning {
        Tuning {
            isa: self.isa,
            prefetch: self.plans.for_rows(rows),
        }
    }

    /// The integer dot products GGUF's quantized matrices take on this ISA and CPU, as the
    /// headers name them: `VNNI`, `AVX2`, `NEON sdot` or `portable`.
    pub fn integer_products(&self) -> &'static str {
        match super::q8_0::Q8Isa::for_isa(self.isa) {
            super::q8_0::Q8Isa::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            super::q8_0::Q8Isa::Avx2 => "AVX2",
            #[cfg(target_arch = "x86_64")]
            super::q8_0::Q8Isa::Avx512Vnni => "VNNI",
            #[cfg(target_arch = "aarch64")]
            super::q8_0::Q8Isa::NeonDot => "NEON sdot",
        }
    }

    /// The prefetch plans they run.
    pub fn plans(&self) -> Plans {
        self.plans
    }

    /// Their decode threads.
    pub fn pool(&self) -> &pool::Pool {
        &self.pool
    }

    /// `out[m][j] = Σ_k x[m][k] · w[j][k]` for `x: [rows × inner]`, `w: [outs × inner]` (a
    /// linear layer's weight as stored: no transpose, and bf16 or f16 read as such), `out:
    /// [rows × outs]`.
    pub fn matmul_t(&self, x: &[f32], w: Weight<'_>, rows: usize, inner: usize, out: &mut [f32]) {
        if self.pool.threads() > 1 && w.len() >= POOL_MIN_ELEMENTS {
            return matmul_t_pooled(
                &self.pool,
                self.tuning(rows),
                Rows { x, rows, inner },
                &mut [(w, out)],
            );
        }
        let (outs, t) = (w.len() / inner.max(1), self.tuning(rows));
        let input = Input::new(t, Rows { x, rows, inner }, &[w]);
        product_columns(t, &input, w, SharedOut::new(out), 0..outs);
    }

    /// Products of one input `x: [rows × inner]` with several weights, `outᵢ = x · wᵢᵀ` (the
    /// Q, K and V projections; gate and up): one job of the decode threads for all of them, so
    /// that the threads meet once instead of once per weight.
    pub fn matmuls_t(
        &self,
        x: &[f32],
        rows: usize,
        inner: usize,
        products: &mut [(Weight<'_>, &mut [f32])],
    ) {
        let pooled = products.iter().all(|(w, _)| w.len() >= POOL_MIN_ELEMENTS);
        if self.pool.threads() > 1 && pooled {
            let t = self.tuning(rows);
            return matmul_t_pooled(&self.pool, t, Rows { x, rows, inner }, products);
        }
        for (w, out) in products.iter_mut() {
            self.matmul_t(x, *w, rows, inner, out);
        }
    }

    /// The MLP's first half, `gate := silu(x · gateᵀ) ⊙ (x · upᵀ)` (`up` receives `x · upᵀ`):
    /// on several decode threads, one job in which each thread applies SiLU to its own columns
    /// right after computing them, instead of the caller applying it to every row alone. SiLU
    /// is elementwise with the same arithmetic on every lane, so the bits do not depend on the
    /// split.
    pub fn gated_t(
        &self,
        x: &[f32],
        rows: usize,
        inner: usize,
        weights: (Weight<'_>, Weight<'_>),
        outs: (&mut [f32], &mut [f32]),
    ) {
        gated_t_on(
            self,
            Rows { x, rows, inner },
            weights.0,
            weights.1,
            outs.0,
            outs.1,
        );
    }

    /// SiLU(gate) · up, element-wise, into `gate`, with these kernels' instruction set.
    pub fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        silu_mul_on(self.isa, gate, up);
    }
}
