//! The x86 widenings of stored K/V to f32 (`Widen` for AVX2 and AVX-512): exact, so every
//! ISA computes on the values the portable `Plain` widening gives.

use super::*;

pub(super) struct Avx2;
impl Widen for Avx2 {
    const QUERY_LANES: usize = 8;

    #[inline(always)]
    unsafe fn widen<E: KvElem>(src: *const E, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        if E::KIND == ElemKind::F32 {
            std::ptr::copy_nonoverlapping(src as *const f32, dst, n);
            return;
        }
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.add(i) as *const __m128i);
            let x = if E::KIND == ElemKind::F16 {
                _mm256_cvtph_ps(h)
            } else {
                // bf16: the upper half of an f32.
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            };
            _mm256_storeu_ps(dst.add(i), x);
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = (*src.add(j)).to_f32();
        }
    }

    #[inline(always)]
    unsafe fn widen_q8(q: *const i8, scales: *const f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                q.add(i) as *const __m128i
            )));
            _mm256_storeu_ps(dst.add(i), _mm256_mul_ps(x, _mm256_loadu_ps(scales.add(i))));
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = *q.add(j) as f32 * *scales.add(j);
        }
    }

    #[inline(always)]
    unsafe fn widen_q8_group(q: *const i8, scale: f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let s = _mm256_set1_ps(scale);
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                q.add(i) as *const __m128i
            )));
            _mm256_storeu_ps(dst.add(i), _mm256_mul_ps(x, s));
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = *q.add(j) as f32 * scale;
        }
    }

    #[inline(always)]
    unsafe fn widen_f16_bytes(src: *const u8, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
            _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = f16_at(src.add(2 * j));
        }
    }
}

pub(super) struct Avx512;
impl Widen for Avx512 {
    const QUERY_LANES: usize = 16;

    #[inline(always)]
    unsafe fn widen<E: KvElem>(src: *const E, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        if E::KIND == ElemKind::F32 {
            std::ptr::copy_nonoverlapping(src as *const f32, dst, n);
            return;
        }
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let h = _mm256_maskz_loadu_epi16(m, src.add(i) as *const i16);
            let x = if E::KIND == ElemKind::F16 {
                _mm512_cvtph_ps(h)
            } else {
                // bf16: the upper half of an f32.
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            };
            _mm512_mask_storeu_ps(dst.add(i), m, x);
            i += 16;
        }
    }

    #[inline(always)]
    unsafe fn widen_q8(q: *const i8, scales: *const f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q.add(i))));
            let s = _mm512_maskz_loadu_ps(m, scales.add(i));
            _mm512_mask_storeu_ps(dst.add(i), m, _mm512_mul_ps(x, s));
            i += 16;
        }
    }

    #[inline(always)]
    unsafe fn widen_q8_group(q: *const i8, scale: f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let s = _mm512_set1_ps(scale);
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q.add(i))));
            _mm512_mask_storeu_ps(dst.add(i), m, _mm512_mul_ps(x, s));
            i += 16;
        }
    }

    #[inline(always)]
    unsafe fn widen_f16_bytes(src: *const u8, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let h = _mm256_maskz_loadu_epi16(m, src.add(2 * i) as *const i16);
            _mm512_mask_storeu_ps(dst.add(i), m, _mm512_cvtph_ps(h));
            i += 16;
        }
    }
}

/// The mask of the first `min(left, 16)` lanes.
#[inline(always)]
pub(super) fn mask16(left: usize) -> u16 {
    if left >= 16 {
        0xffff
    } else {
        ((1u32 << left) - 1) as u16
    }
}
