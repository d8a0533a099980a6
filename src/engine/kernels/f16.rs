//! `x · wᵀ` with f16 weights widened to f32 in registers: half the bytes of an f32 matrix, for
//! the proposal readouts of `model::half_head` (which bounds the error and screens commits).
//!
//! The weights are repacked in panels of 64 output columns, `[inner × 64]` each, so a panel is
//! one contiguous stream and each input element, broadcast, feeds 4 × 16 output lanes at once:
//! no horizontal sums (one per output made a first row-major version slower than f32).

use half::f16;

/// Output columns per panel: 4 AVX-512 registers.
const PANEL: usize = 64;
/// f16 values in 64 bytes: the most the buffer's start can be from a 64-byte boundary.
const ALIGN_F16: usize = 32;
/// Input rows per block: 6 × 4 accumulators plus 4 weight registers fit in 32 (a `dual`
/// step's 5 readouts widen each panel once, not twice).
const ROWS: usize = 6;

/// Whether `PackedF16::matmul` runs vectorised with `kernels`' instruction set.
pub fn fast(kernels: &super::Kernels) -> bool {
    kernels.isa().has_avx512()
}

/// A `[outs × inner]` matrix in f16, packed in column panels (the last one zero-padded).
#[derive(Debug, Clone)]
pub struct PackedF16 {
    /// The panels start at `offset`, the first 64-byte boundary of the buffer: a panel row
    /// is then two cache lines, and no 32-byte load straddles two.
    buffer: Vec<f16>,
    offset: usize,
    inner: usize,
    outs: usize,
}

impl PackedF16 {
    /// Packs `w: [outs × inner]` (row-major f32), rounding every weight to the nearest f16.
    pub fn new(w: &[f32], inner: usize) -> Self {
        let outs = w.len() / inner;
        let len = outs.div_ceil(PANEL) * PANEL * inner;
        let mut buffer = vec![f16::ZERO; len + ALIGN_F16];
        let offset = buffer.as_ptr().align_offset(64).min(ALIGN_F16);
        let panels = &mut buffer[offset..offset + len];
        for (j, row) in w.chunks_exact(inner).enumerate() {
            let (p, c) = (j / PANEL, j % PANEL);
            for (k, &v) in row.iter().enumerate() {
                panels[(p * inner + k) * PANEL + c] = f16::from_f32(v);
            }
        }
        Self {
            buffer,
            offset,
            inner,
            outs,
        }
    }

    fn panels(&self) -> &[f16] {
        let len = self.buffer.len() - ALIGN_F16;
        &self.buffer[self.offset..self.offset + len]
    }

    /// `out[m][j] = Σ_k x[m][k] · w[j][k]` for `x: [rows × inner]`, `out: [rows × outs]`.
    /// Each output sums its products in order of k; callers use a bound, not these bits.
    /// Split by panels across `kernels`' decode threads where there are several, each
    /// writing its panels' columns of every row in place.
    pub fn matmul(&self, kernels: &super::Kernels, x: &[f32], rows: usize, out: &mut [f32]) {
        debug_assert_eq!(x.len(), rows * self.inner);
        debug_assert_eq!(out.len(), rows * self.outs);
        let (pool, t) = (kernels.pool(), kernels.tuning(rows));
        let parts = pool.threads();
        let panels = self.outs.div_ceil(PANEL);
        let out = super::SharedOut::new(out);
        if parts == 1 || panels < 2 * parts {
            return self.panels_into(t, x, 0..panels, out);
        }
        pool.run(&|part| {
            self.panels_into(t, x, super::pool::share(panels, parts, part, 1), out);
        });
    }

    /// The products with the weight rows of `panels`, into their columns of `out: [rows ×
    /// outs]`.
    fn panels_into(
        &self,
        t: super::Tuning,
        x: &[f32],
        panels: std::ops::Range<usize>,
        out: super::SharedOut<'_>,
    ) {
        let mut tile = [0f32; ROWS * PANEL];
        let stream = self.panels().chunks_exact(self.inner * PANEL);
        for (p, panel) in stream.enumerate().take(panels.end).skip(panels.start) {
            let cols = PANEL.min(self.outs - p * PANEL);
            for (b, block) in x.chunks(ROWS * self.inner).enumerate() {
                let n = block.len() / self.inner;
                self.panel_tile(t, block, panel, &mut tile);
                for r in 0..n {
                    let at = (b * ROWS + r) * self.outs + p * PANEL;
                    out.set_all(at, &tile[r * PANEL..r * PANEL + cols]);
                }
            }
        }
    }

    /// Up to `ROWS` rows of `x` times one panel, into `tile: [ROWS × PANEL]`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn panel_tile(
        &self,
        t: super::Tuning,
        x: &[f32],
        panel: &[f16],
        tile: &mut [f32; ROWS * PANEL],
    ) {
        #[cfg(target_arch = "x86_64")]
        if t.isa.has_avx512() {
            // SAFETY: a `Tuning`'s AVX-512 was checked against the CPU (`Kernels::new`);
            // `panel` is `inner × PANEL` and `x` whole rows.
            unsafe { avx512::panel_tile(t.prefetch, x, panel, self.inner, tile) };
            return;
        }
        for (r, xr) in x.chunks_exact(self.inner).enumerate() {
            let acc = &mut tile[r * PANEL..(r + 1) * PANEL];
            acc.fill(0.0);
            for (&xk, wk) in xr.iter().zip(panel.chunks_exact(PANEL)) {
                for (a, w) in acc.iter_mut().zip(wk) {
                    *a += xk * w.to_f32();
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::super::Prefetch;
    use super::{PANEL, ROWS};

    /// One panel's products with up to `ROWS` rows of `x` into `tile`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `panel` holds `inner × PANEL` values and `x` whole rows
    /// of `inner`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn panel_tile(
        plan: Prefetch,
        x: &[f32],
        panel: &[f16],
        inner: usize,
        tile: &mut [f32; ROWS * PANEL],
    ) {
        // SAFETY: the caller's features and shapes.
        unsafe { with_rows!(x.len() / inner, R => rows::<R>(plan, x, panel, inner, tile)) }
    }

    /// # Safety
    /// As [`panel_tile`], and `x` holds at least `R` rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const R: usize>(
        plan: Prefetch,
        x: &[f32],
        panel: &[f16],
        inner: usize,
        tile: &mut [f32; ROWS * PANEL],
    ) {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let wp = panel.as_ptr();
        // The matmuls' distances (`kernels::prefetch`). The panels are one contiguous stream,
        // so the prefetch runs on into the next panel. The near one made the default model's
        // 1-row and 4-row steps (every row read out) a little faster.
        let size = std::mem::size_of::<f16>();
        let (near, far) = (plan.near(size, 0), plan.far(size));
        for k in 0..inner {
            // A panel row is two cache lines (the panels start on a 64-byte boundary); a
            // prefetch never faults, even past the end.
            if let Some(near) = near {
                let ahead = wp.wrapping_add(k * PANEL + near).cast::<i8>();
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
            }
            if far > 0 {
                let ahead = wp.wrapping_add(k * PANEL + far).cast::<i8>();
                _mm_prefetch::<_MM_HINT_T1>(ahead);
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64));
            }
            // SAFETY: row k of the panel holds PANEL = 4 × 16 f16 values (two bytes each, as
            // the 32-byte loads read); x has R rows of `inner`.
            unsafe {
                let w: [__m512; 4] = std::array::from_fn(|c| {
                    _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(k * PANEL + c * 16).cast()))
                });
                for (r, a) in acc.iter_mut().enumerate() {
                    let xk = _mm512_set1_ps(*x.get_unchecked(r * inner + k));
                    for c in 0..4 {
                        a[c] = _mm512_fmadd_ps(xk, w[c], a[c]);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (c, v) in a.iter().enumerate() {
                // SAFETY: r < ROWS and c < 4, so the 16 floats lie inside the tile.
                unsafe { _mm512_storeu_ps(tile.as_mut_ptr().add(r * PANEL + c * 16), *v) };
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX-512 panel kernel gives, for every output, the FMA chain over k in order
    /// (`f32::mul_add` is the fused multiply-add), bit for bit, for 1–6 rows: the order the
    /// `matmul` doc promises.
    #[test]
    fn the_avx512_panel_kernel_is_the_fma_chain_in_order_bit_for_bit() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        for inner in [37, 256] {
            let w: Vec<f32> = (0..PANEL * inner)
                .map(|i| ((i * 7919) % 997) as f32 / 500.0 - 1.0)
                .collect();
            let packed = PackedF16::new(&w, inner);
            let panel = &packed.panels()[..inner * PANEL];
            for rows in 1..=ROWS {
                let x: Vec<f32> = (0..rows * inner)
                    .map(|i| ((i * 104_729) % 1009) as f32 / 300.0 - 1.5)
                    .collect();
                let chain = |r: usize, j: usize| {
                    (0..inner).fold(0f32, |a, k| {
                        x[r * inner + k].mul_add(panel[k * PANEL + j].to_f32(), a)
                    })
                };
                let mut tile = [f32::NAN; ROWS * PANEL];
                // SAFETY: AVX-512F was detected; the panel and the rows are whole.
                unsafe {
                    avx512::panel_tile(super::super::Prefetch::L1, &x, panel, inner, &mut tile)
                };
                for (at, got) in tile.iter().enumerate().take(rows * PANEL) {
                    let (r, j) = (at / PANEL, at % PANEL);
                    let expected = chain(r, j);
                    assert_eq!(
                        got.to_bits(),
                        expected.to_bits(),
                        "{rows} rows, inner {inner}, output ({r}, {j})"
                    );
                }
            }
        }
    }
}
