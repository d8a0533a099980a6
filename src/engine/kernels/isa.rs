//! Which instruction sets this CPU runs: the best, detected once per process
//! ([`detected_isa`]), and whether it runs a lower one asked for (`--isa`, [`Isa::checked`]).
//! Each model's `Kernels` holds one checked ISA; `super`'s dispatch, and each kernel's safety
//! argument, rest on that check.

use std::sync::OnceLock;

/// An instruction set of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// [`Isa::Avx512`], and AVX-512 BF16's `vdpbf16ps` for bf16 weights: twice the
    /// multiply-adds an instruction, the activations rounded to bf16 (`avx512_bf16`).
    Avx512Bf16,
    /// AVX-512F, BW and VL for the matmul (16 lanes, 32 registers; BW loads 16-bit weights
    /// under a mask), AVX2 + FMA for everything else.
    Avx512,
    /// AVX2, FMA and F16C for everything (8 lanes, 16 registers).
    Avx2Fma,
    /// aarch64's NEON for the matmul (every aarch64 CPU has it), portable loops elsewhere.
    Neon,
    /// Plain Rust loops, which the compiler vectorises as it can: any CPU.
    Portable,
}

impl Isa {
    /// Whether the AVX2 + FMA (+ F16C) kernels may run (true for every x86 level above the
    /// fallback).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2Fma)
    }

    /// Whether the AVX-512 kernels may run (AVX-512F, BW and VL were detected).
    pub fn has_avx512(self) -> bool {
        matches!(self, Isa::Avx512Bf16 | Isa::Avx512)
    }

    /// Portable 0, AVX2 + FMA 1, AVX-512 2, AVX-512 BF16 3: a CPU runs every level up to its
    /// own.
    pub(super) fn level(self) -> u8 {
        match self {
            Isa::Portable => 0,
            Isa::Avx2Fma | Isa::Neon => 1,
            Isa::Avx512 => 2,
            Isa::Avx512Bf16 => 3,
        }
    }
}

/// The CPU's best, detected once (a fact of the machine, not a setting).
static DETECTED: OnceLock<Isa> = OnceLock::new();

/// The best instruction set this CPU runs.
pub fn detected_isa() -> Isa {
    *DETECTED.get_or_init(detect)
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    // F16C (every AVX2 CPU has it) widens an f16 KV cache in the attention kernels.
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            if std::arch::is_x86_feature_detected!("avx512bf16") {
                return Isa::Avx512Bf16;
            }
            return Isa::Avx512;
        }
        return Isa::Avx2Fma;
    }
    #[cfg(target_arch = "aarch64")]
    return Isa::Neon;
    #[allow(unreachable_code)]
    Isa::Portable
}

impl Isa {
    /// `self`, where this CPU runs it (a lower one than its best measures it on this machine);
    /// an error naming the best otherwise.
    pub fn checked(self) -> Result<Isa, String> {
        let detected = detected_isa();
        // NEON and the x86 extensions are different machines: neither runs the other's kernels.
        let other_family = (self == Isa::Neon) != (detected == Isa::Neon) && self != Isa::Portable;
        if other_family || self.level() > detected.level() {
            return Err(format!("this CPU runs {detected:?} at best, not {self:?}"));
        }
        Ok(self)
    }
}
