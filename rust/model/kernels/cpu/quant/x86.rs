//! What the x86 kernel paths (`avx2.rs`, `avx512.rs`) share: the type codes of their const
//! generic parameter, and the prefetching of a register tile's row groups.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};

// Type codes for the const generic parameter (so each kernel is compiled per type).
pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q5_0: u8 = 2;
pub(super) const Q5_1: u8 = 3;
pub(super) const Q8_0: u8 = 4;
pub(super) const IQ4_NL: u8 = 5;
pub(super) const Q2_K: u8 = 10;
pub(super) const Q3_K: u8 = 11;
pub(super) const Q4_K: u8 = 12;
pub(super) const Q5_K: u8 = 13;
pub(super) const Q6_K: u8 = 14;
pub(super) const IQ4_XS: u8 = 15;

/// Prefetches the `len` bytes at `p` (every line they touch) into L2.
#[inline(always)]
pub(super) fn prefetch(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len + 63 {
        // SAFETY: a prefetch never faults; the address may lie past the data.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off.min(len - 1)).cast()) };
        off += 64;
    }
}

/// How many row groups ahead the tiles prefetch.
pub(super) const AHEAD: usize = 2;

/// Prefetches bytes `off .. off + len` of the row group [`AHEAD`] groups on, in address
/// order. A tile reads its rows block by block across the group (a stride of one row between
/// reads): to the hardware prefetcher and the DRAM those are 16 (AVX2: 8) short streams it
/// does not follow, so the tile streams a later group in at the pace it reads its own (`off`
/// grows by what the tile has read of its group), a pattern memory serves at full speed, and
/// into L2 (a group can outgrow L1). Figures in docs/benchmarks.md.
#[inline(always)]
pub(super) fn prefetch_ahead(group: *const u8, group_bytes: usize, off: usize, len: usize) {
    // One prefetch per 64 bytes from `off`: that covers `off .. off + len` (a line is fetched
    // whole), and with a constant `len` the loop unrolls to a few instructions.
    let p = group.wrapping_add(AHEAD * group_bytes + off);
    let mut o = 0;
    while o < len {
        // SAFETY: a prefetch never faults; the address may lie past the data.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o).cast()) };
        o += 64;
    }
}

/// Bytes of one block of a 256-weight type, as a constant of the kernel's type parameter.
pub(super) const fn k_block_bytes(ty: u8) -> usize {
    match ty {
        Q2_K => 84,
        Q3_K => 110,
        Q4_K => 144,
        Q5_K => 176,
        Q6_K => 210,
        IQ4_XS => 136,
        _ => 0,
    }
}
