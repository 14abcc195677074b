//! What this CPU can run, detected once: the one place the kernels ask. Each kernel maps these
//! levels onto its own paths (which it may lack for some levels, and which its tests force one
//! by one).

use std::sync::OnceLock;

/// The instruction-set levels the CPU kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuLevels {
    /// AVX2 with FMA and F16C.
    pub avx2: bool,
    /// `avx2` and AVX-VNNI (`vpdpbusd` on 256-bit vectors, VEX-encoded: Intel's cores without
    /// AVX-512 since Alder Lake, AMD's since Zen 5).
    pub avx_vnni: bool,
    /// AVX-512 F, BW and VL, with FMA and F16C.
    pub avx512: bool,
    /// `avx512` and AVX-512 VNNI (`vpdpbusd`).
    pub avx512_vnni: bool,
    /// `avx512` and AVX-512 BF16 (`vdpbf16ps`).
    pub avx512_bf16: bool,
    /// The vendor is Intel (`GenuineIntel`): for a kernel whose best form was measured to
    /// differ between Intel's cores and AMD's. Not a level: [`CpuLevels::names`] leaves it out.
    pub intel: bool,
}

impl CpuLevels {
    /// The levels present, by name (`avx2`, `avx_vnni`, `avx512`, `avx512_vnni`,
    /// `avx512_bf16`): what the kernels may dispatch to on this CPU (none: the portable paths
    /// only).
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.avx2, "avx2"),
            (self.avx_vnni, "avx_vnni"),
            (self.avx512, "avx512"),
            (self.avx512_vnni, "avx512_vnni"),
            (self.avx512_bf16, "avx512_bf16"),
        ]
        .into_iter()
        .filter_map(|(has, name)| has.then_some(name))
        .collect()
    }
}

/// This CPU's levels (the first call detects them).
pub fn cpu() -> CpuLevels {
    static LEVELS: OnceLock<CpuLevels> = OnceLock::new();
    *LEVELS.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuLevels {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    CpuLevels {
        avx2,
        avx_vnni: avx2 && is_x86_feature_detected!("avxvnni"),
        avx512,
        avx512_vnni: avx512 && is_x86_feature_detected!("avx512vnni"),
        avx512_bf16: avx512 && is_x86_feature_detected!("avx512bf16"),
        intel: vendor() == *b"GenuineIntel",
    }
}

/// The CPU's vendor string (CPUID leaf 0: EBX, EDX, ECX).
#[cfg(target_arch = "x86_64")]
fn vendor() -> [u8; 12] {
    // `__cpuid` is a safe function in newer Rust and unsafe in the oldest this crate builds
    // with (1.89).
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
    let r = unsafe { std::arch::x86_64::__cpuid(0) };
    let mut v = [0u8; 12];
    for (i, word) in [r.ebx, r.edx, r.ecx].into_iter().enumerate() {
        v[4 * i..4 * i + 4].copy_from_slice(&word.to_le_bytes());
    }
    v
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuLevels {
    CpuLevels {
        avx2: false,
        avx_vnni: false,
        avx512: false,
        avx512_vnni: false,
        avx512_bf16: false,
        intel: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The levels nest: each AVX-512 level implies AVX-512, and (on every CPU that has it) AVX2.
    #[test]
    fn levels_nest() {
        let c = cpu();
        assert!(!c.avx512_vnni || c.avx512);
        assert!(!c.avx512_bf16 || c.avx512);
        assert!(!c.avx_vnni || c.avx2);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            c.avx2,
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        );
        assert_eq!(cpu(), c, "detected once");
        let names = c.names();
        assert_eq!(names.contains(&"avx512_vnni"), c.avx512_vnni);
        assert_eq!(
            names.len(),
            [c.avx2, c.avx_vnni, c.avx512, c.avx512_vnni, c.avx512_bf16]
                .iter()
                .filter(|&&x| x)
                .count()
        );
    }

    /// The vendor read by CPUID is the one the kernel reports.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn intel_is_the_vendor_linux_reports() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let vendor = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .and_then(|l| l.split(':').nth(1))
            .map(str::trim)
            .expect("a vendor_id line");
        assert_eq!(cpu().intel, vendor == "GenuineIntel", "vendor_id {vendor}");
    }
}
