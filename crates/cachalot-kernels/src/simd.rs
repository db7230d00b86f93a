//! Runtime SIMD dispatch.
//!
//! The instruction set is detected once per process ([`simd_level`]) and every dispatched kernel
//! matches on it. Each SIMD kernel has a scalar twin that is the reference in tests and the
//! fallback on other CPUs and architectures. `CACHALOT_SIMD=scalar` forces the scalar path (for
//! tests and benchmarks); `CACHALOT_SIMD=avx2` caps the level at AVX2, `CACHALOT_SIMD=avx512`
//! asks for AVX-512, `CACHALOT_SIMD=neon` NEON on aarch64; anything else (or a level of another
//! architecture), or unset, picks the best level the CPU supports.
//!
//! Each architecture has its own chain of levels, [`SimdLevel::ALL`]: x86-64 Scalar < Avx2 <
//! Avx512, aarch64 Scalar < Neon. Within a chain a CPU supporting a level supports every lower
//! one, and a kernel family without its own code at a level runs the next lower level's
//! (AVX-512 → AVX2 for the transposed product, W4A8 and the vector kernels but the
//! latent-attention ones).
//!
//! `Avx512` requires AVX2 + FMA + F16C and AVX-512 F, BW, VL and VNNI. VNNI (`vpdpbusd`, used by
//! W8A8) is part of the level rather than checked separately: every AVX-512 CPU from Cascade
//! Lake, Ice Lake and Zen 4 on has it, and one level per CPU keeps dispatch a single `match`.
//! Skylake-SP/X (AVX-512 without VNNI, and with a 512-bit clock penalty) runs the AVX2 level.
//!
//! `Neon` requires Advanced SIMD, which every AArch64 CPU has: the float products run NEON
//! everywhere. The W8A8 and W4A8 products also need the dot-product extension (`sdot`,
//! Armv8.2-A+: Neoverse N1/V1/V2 — Graviton 2-4 —, Apple M1 on, Ampere Altra), checked on its
//! own (`matrix::neon_dotprod_supported`); Cortex-A72-class cores (Graviton 1, Raspberry Pi 4)
//! run those two scalar, with the same bits. `sdot` is issued through `asm!` because its
//! intrinsic is not yet stable Rust.
//!
//! Every level gives the same bits. The scalar twins do the SIMD kernels' operations lane by
//! lane (AVX2's 8-lane accumulators, fused multiply-adds, `hsum` order and Cephes `exp`), AVX-512
//! and NEON repeat AVX2's operations in wider or narrower registers, and the integer products
//! are exact; the tests hold every level to the scalar bits, and `tools/cross_aarch64.sh` checks
//! the shipped model's log-probabilities on aarch64 against x86-64's. (One exception:
//! `--bf16-dot` on AVX-512 BF16, whose `vdpbf16ps` flushes subnormals.)
//!
//! Adding a level: a variant here, its detection in [`SimdLevel::supported`], its place in its
//! architecture's `ALL`, and one more arm in each dispatching `match`.

use std::sync::OnceLock;

/// An instruction-set level with its own kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust; the reference for every SIMD kernel.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (Haswell, Zen and later).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/VNNI on top of `Avx2` (Ice Lake, Sapphire Rapids, Zen 4/5).
    Avx512,
    /// aarch64 Advanced SIMD with the dot-product extension (`sdot`).
    Neon,
}

impl SimdLevel {
    /// This architecture's levels, lowest first.
    #[cfg(target_arch = "x86_64")]
    pub const ALL: &'static [SimdLevel] = &[SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];
    /// This architecture's levels, lowest first.
    #[cfg(target_arch = "aarch64")]
    pub const ALL: &'static [SimdLevel] = &[SimdLevel::Scalar, SimdLevel::Neon];
    /// This architecture's levels, lowest first.
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub const ALL: &'static [SimdLevel] = &[SimdLevel::Scalar];

    /// Whether this CPU can run this level's kernels.
    pub fn supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            SimdLevel::Avx2 => avx2_supported(),
            SimdLevel::Avx512 => avx2_supported() && avx512_supported(),
            SimdLevel::Neon => neon_supported(),
        }
    }

    /// The best level this CPU supports, ignoring `CACHALOT_SIMD`.
    pub fn best_supported() -> SimdLevel {
        SimdLevel::ALL
            .iter()
            .rev()
            .copied()
            .find(|l| l.supported())
            .unwrap_or(SimdLevel::Scalar)
    }

    /// The best supported level not above `self` (what a request for `self` gets on this CPU).
    pub fn clamp_to_supported(self) -> SimdLevel {
        SimdLevel::ALL
            .iter()
            .rev()
            .copied()
            .find(|l| *l <= self && l.supported())
            .unwrap_or(SimdLevel::Scalar)
    }

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Neon => "neon",
        }
    }

    /// The level named by a `CACHALOT_SIMD` value, clamped to what this CPU supports; `None`
    /// for an unknown name (including "auto").
    pub fn from_name(name: &str) -> Option<SimdLevel> {
        let wanted = SimdLevel::ALL
            .iter()
            .copied()
            .find(|l| l.name().eq_ignore_ascii_case(name.trim()))?;
        Some(wanted.clamp_to_supported())
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}

#[cfg(target_arch = "aarch64")]
fn neon_supported() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

#[cfg(not(target_arch = "aarch64"))]
fn neon_supported() -> bool {
    false
}

/// The level the dispatched kernels use in this process: `CACHALOT_SIMD` if set to a known
/// level name (clamped to what the CPU supports), otherwise the best supported level.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        std::env::var("CACHALOT_SIMD")
            .ok()
            .and_then(|v| SimdLevel::from_name(&v))
            .unwrap_or_else(SimdLevel::best_supported)
    })
}

/// What this process's products run on, for reports: the level's name, plus `amx-int8` where
/// W8A8/W4A8 products of many tokens take AMX tiles and `avx-vnni` where the AVX2 level's
/// integer products use it (e.g. "avx512+amx-int8", "avx2+avx-vnni", "avx2", "neon").
pub fn kernel_isa() -> String {
    let level = simd_level();
    #[allow(unused_mut)]
    let mut isa = level.name().to_string();
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 && crate::matrix::amx_supported() {
            isa.push_str("+amx-int8");
        }
        if level == SimdLevel::Avx2 && crate::matrix::avx_vnni_supported() {
            isa.push_str("+avx-vnni");
        }
    }
    #[cfg(target_arch = "aarch64")]
    if level == SimdLevel::Neon && crate::matrix::neon_dotprod_supported() {
        isa.push_str("+dotprod");
    }
    isa
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_isa_names_the_level_and_its_extras() {
        let isa = kernel_isa();
        let mut parts = isa.split('+');
        assert_eq!(parts.next(), Some(simd_level().name()));
        for extra in parts {
            assert!(
                ["amx-int8", "avx-vnni", "dotprod"].contains(&extra),
                "{isa}"
            );
        }
        eprintln!("kernels: {isa}");
    }

    #[test]
    fn names_and_clamping() {
        assert_eq!(SimdLevel::from_name("scalar"), Some(SimdLevel::Scalar));
        assert_eq!(SimdLevel::from_name(" SCALAR "), Some(SimdLevel::Scalar));
        assert_eq!(SimdLevel::from_name("auto"), None);
        #[cfg(target_arch = "x86_64")]
        {
            assert!(SimdLevel::from_name("avx2").unwrap().supported());
            assert!(SimdLevel::from_name("avx2").unwrap() <= SimdLevel::Avx2);
            let avx512 = SimdLevel::from_name("AVX512").unwrap();
            assert!(avx512.supported());
            assert_eq!(avx512 == SimdLevel::Avx512, SimdLevel::Avx512.supported());
            // Another architecture's level is an unknown name here.
            assert_eq!(SimdLevel::from_name("neon"), None);
            assert!(!SimdLevel::Neon.supported());
        }
        #[cfg(target_arch = "aarch64")]
        {
            let neon = SimdLevel::from_name("neon").unwrap();
            assert_eq!(neon == SimdLevel::Neon, SimdLevel::Neon.supported());
            assert_eq!(SimdLevel::from_name("avx2"), None);
            assert!(!SimdLevel::Avx2.supported() && !SimdLevel::Avx512.supported());
        }
        // A supported level implies every lower one.
        for pair in SimdLevel::ALL.windows(2) {
            assert!(!pair[1].supported() || pair[0].supported());
        }
        assert!(simd_level().supported());
        assert!(SimdLevel::best_supported() >= simd_level());
    }
}
