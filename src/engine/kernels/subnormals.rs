//! Subnormal floats flushed to zero while a decode step runs (FTZ/DAZ): a guard that the host
//! step holds for its duration, and training for its own.

/// MXCSR bits: flush subnormal results to zero (FTZ, bit 15), read subnormal inputs as zero
/// (DAZ, bit 6).
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);

/// While alive, this thread's float operations flush subnormals to zero (FTZ and DAZ); the
/// previous mode comes back on drop. Decoding needs it: a trained model's activations go
/// subnormal (attention probabilities of scores far below the row's maximum and SiLU of very
/// negative gates can), and every vector operation that meets a subnormal takes a microcode
/// assist, many times the operation's own cost; random-weight benchmarks never show it. On the
/// shipped model this guard in the host step made baseline and SPEED decoding faster, SPEED
/// the more, with the generated text unchanged (`spex bench`). The values lost are below
/// 1.2·10⁻³⁸, far under the rounding differences between any two Ouro implementations.
#[derive(Debug)]
pub struct SubnormalsFlushed {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl SubnormalsFlushed {
    /// Sets FTZ and DAZ on this thread until the guard drops (a no-op off x86-64).
    pub fn enter() -> Self {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: reads this thread's MXCSR and sets only its FTZ and DAZ flags; the rounding
        // mode and exception masks are kept.
        #[allow(deprecated)]
        unsafe {
            use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
            let saved = _mm_getcsr();
            _mm_setcsr(saved | FTZ_DAZ);
            Self { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self {}
    }
}

impl Drop for SubnormalsFlushed {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: restores the MXCSR value this thread had when the guard was made.
        #[allow(deprecated)]
        unsafe {
            std::arch::x86_64::_mm_setcsr(self.saved);
        }
    }
}
