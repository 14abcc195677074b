//! Where one tile of one K/V head lies in the cache, for the kernels that read a row's tiles in
//! place ([`super::row_avx512`], [`super::row_avx2`]; each reads these locations with its own
//! vectors), and the prefetch that brings a tile into L2 ahead of its use.

use std::arch::x86_64::*;

use super::{KvElem, LANES};
use crate::model::kernels::cpu::kv_q8::QK;

/// A tile's location, whatever its format.
pub(super) trait TileLocation: Copy {
    /// Brings the tile (its K, the 16 value rows) into L2 ahead of its use: the tiles of a
    /// segment lie in blocks scattered over the pool, which the hardware prefetcher does not
    /// follow across.
    ///
    /// # Safety
    /// None beyond the addresses being computed in bounds (prefetches never fault).
    unsafe fn prefetch(self, hd: usize);
}

/// Where one tile of one K/V head of f32, f16 or bf16 lies in the cache: element `d` of its 16
/// keys at `k + d * k_stride` (contiguous), the value row of its key `l` at `v + l * v_stride`.
#[derive(Clone, Copy)]
pub(super) struct TileAt<E> {
    pub k: *const E,
    pub k_stride: usize,
    pub v: *const E,
    pub v_stride: usize,
}

impl<E: KvElem> TileLocation for TileAt<E> {
    #[inline(always)]
    unsafe fn prefetch(self, hd: usize) {
        let size = std::mem::size_of::<E>();
        // K: one 16-key vector per element d; a line holds 64 / (16 * size) of them when
        // contiguous.
        let step = if self.k_stride == LANES {
            (64 / (LANES * size)).max(1)
        } else {
            1
        };
        let mut d = 0;
        while d < hd {
            _mm_prefetch::<_MM_HINT_T1>(self.k.add(d * self.k_stride).cast());
            d += step;
        }
        prefetch_rows(self.v.cast(), self.v_stride * size, hd * size);
    }
}

/// Where one tile of one K/V head of q8_0 lies in the cache (`kv_q8`'s layouts): the int8s of
/// its 16 keys' element `d` at `k_q + d * k_stride`, the f16 scales of their group `j` at byte
/// `k_scales + j * scale_stride`, the value row of key `l` (ggml's `[scale][32 x int8]` groups)
/// at byte `v + l * v_stride`.
#[derive(Clone, Copy)]
pub(super) struct Q8TileAt {
    pub k_q: *const i8,
    pub k_stride: usize,
    pub k_scales: *const u8,
    pub scale_stride: usize,
    pub v: *const u8,
    pub v_stride: usize,
}

impl TileLocation for Q8TileAt {
    #[inline(always)]
    unsafe fn prefetch(self, hd: usize) {
        // K: 16 int8s per element d (4 vectors to a line), then 32 bytes of scales per group.
        let mut d = 0;
        while d < hd {
            _mm_prefetch::<_MM_HINT_T1>(self.k_q.add(d * self.k_stride).cast());
            d += if self.k_stride == LANES { 4 } else { 1 };
        }
        let mut j = 0;
        while j * QK < hd {
            _mm_prefetch::<_MM_HINT_T1>(self.k_scales.add(j * self.scale_stride).cast());
            j += 1;
        }
        prefetch_rows(self.v.cast(), self.v_stride, hd + 2 * hd.div_ceil(QK));
    }
}

/// Prefetches 16 rows of `row_bytes` bytes, `stride` bytes apart from `at`, into L2.
#[inline(always)]
unsafe fn prefetch_rows(at: *const i8, stride: usize, row_bytes: usize) {
    for l in 0..LANES {
        let row = at.add(l * stride);
        let mut o = 0;
        while o < row_bytes {
            _mm_prefetch::<_MM_HINT_T1>(row.add(o));
            o += 64;
        }
    }
}
