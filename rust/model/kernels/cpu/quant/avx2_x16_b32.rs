//! AVX2 path on the interleaved layout ([`super::interleave`]) of the 32-weight types Q4_0,
//! Q4_1 and Q8_0: a group of 16 rows as two halves of 8, each row in its own 4-byte lane.
//!
//! As [`super::avx2_x16`] (its tiles of 16 rows x up to 4 tokens, its prefetched stream, its
//! halves): per block, half and token, `vpmaddubsw` of a weight vector (4 weights per lane)
//! with 4 activation bytes broadcast to every lane, then `vpmaddwd` with ones, leaves each
//! row's integer sum in its own lane, with no reduction tree and no gathered row scales (what
//! the row-major kernel [`super::avx2`] pays per block): the 8 f16 scales of a half are one
//! load.
//!
//! - Q4_0, Q4_1: unsigned nibbles; a vector holds 4 weights per lane in its low nibbles and
//!   the 4 weights 16 on in its high ones. A block's 8 `vpmaddubsw` are added in i16, then one
//!   `vpmaddwd`. Q4_0's offset of 8 goes through the activation block sum
//!   (`i1 - 8 * sum(x)`), as in [`super::avx2`].
//! - Q8_0: signed weights, through the sign trick (`|w|` times `x` with `w`'s sign). One
//!   `vpmaddubsw` can reach the i16 range, so each has its own `vpmaddwd` and they add in i32.
//!
//! With AVX-VNNI (Intel's cores since Alder Lake have it without AVX-512) one `vpdpbusd`
//! adds a lane's 4 products to its i32 sum, in place of `vpmaddubsw`, the i16 add and
//! `vpmaddwd`: a third of the integer instructions for Q4_0 and Q4_1, half for Q8_0 (its
//! `|w|`, up to 128, is unsigned to `vpdpbusd`, and a lane's 4 products cannot overflow i32).
//! The tests also run that arithmetic through the EVEX form of the instruction (AVX-512 VNNI
//! on 256-bit vectors, [`Dot`]), so a CPU without AVX-VNNI checks it too.
//!
//! The integers are the scalar path's (exact, whatever their order), and the float step per
//! block is [`super::linear`]'s ([`super::avx2::step`] with the scalar operands), so the
//! outputs are the scalar path's bits, whichever dot product summed them.

use super::activation::Act;
use super::avx2::step;
#[cfg(test)]
use super::avx2_x16::AVX512_VNNI_YMM;
use super::avx2_x16::{
    bcast, dpbusd, rows_f16, store, Dot, AVX_VNNI, MADDUBS, PREFETCH_BYTES, TILE_TOKENS,
};
use super::interleave::GROUP;
use super::linear::{Out, QuantMatRef};
use super::x86::{Q4_0, Q4_1, Q8_0};
use super::QuantType;
use std::arch::x86_64::*;

/// Rows `r0..r1` (`r0` a multiple of [`GROUP`]) of the interleaved `w` (Q4_0, Q4_1 or Q8_0)
/// for all tokens of `act`, the dot products summed by `dot`.
///
/// # Safety
/// As `linear::rows_dispatch` (the CPU has AVX2, FMA and F16C, and what `dot` needs); `w` is
/// interleaved.
pub(super) unsafe fn rows(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out, dot: Dot) {
    // A group starting elsewhere would read past the (padded) data: a caller bug, checked.
    assert!(
        r0.is_multiple_of(GROUP),
        "interleaved rows start at a group"
    );
    match (dot, w.ty) {
        (Dot::Maddubs, QuantType::Q4_0) => drive::<Q4_0>(w, r0, r1, act, out),
        (Dot::Maddubs, QuantType::Q4_1) => drive::<Q4_1>(w, r0, r1, act, out),
        (Dot::Maddubs, QuantType::Q8_0) => drive::<Q8_0>(w, r0, r1, act, out),
        (Dot::AvxVnni, QuantType::Q4_0) => drive_vnni::<Q4_0>(w, r0, r1, act, out),
        (Dot::AvxVnni, QuantType::Q4_1) => drive_vnni::<Q4_1>(w, r0, r1, act, out),
        (Dot::AvxVnni, QuantType::Q8_0) => drive_vnni::<Q8_0>(w, r0, r1, act, out),
        #[cfg(test)]
        (Dot::Avx512VnniYmm, QuantType::Q4_0) => drive_evex::<Q4_0>(w, r0, r1, act, out),
        #[cfg(test)]
        (Dot::Avx512VnniYmm, QuantType::Q4_1) => drive_evex::<Q4_1>(w, r0, r1, act, out),
        #[cfg(test)]
        (Dot::Avx512VnniYmm, QuantType::Q8_0) => drive_evex::<Q8_0>(w, r0, r1, act, out),
        (_, ty) => unreachable!("no interleaved 32-weight kernel for {ty:?}"),
    }
}

/// A record of `ty` (one block of 16 rows): its bytes, and where its quant vectors start.
const fn record(ty: u8) -> (usize, usize) {
    match ty {
        Q4_0 => (GROUP * 18, 32),
        Q4_1 => (GROUP * 20, 64),
        _ => (GROUP * 34, 32),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn drive<const TY: u8>(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) {
    tiles::<TY, MADDUBS>(w, r0, r1, act, out)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn drive_vnni<const TY: u8>(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) {
    tiles::<TY, AVX_VNNI>(w, r0, r1, act, out)
}

#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn drive_evex<const TY: u8>(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) {
    tiles::<TY, AVX512_VNNI_YMM>(w, r0, r1, act, out)
}

/// The tiles of rows `r0..r1`; inlined into each `drive`, so compiled with its features.
#[inline(always)]
unsafe fn tiles<const TY: u8, const DOT: u8>(
    w: &QuantMatRef,
    r0: usize,
    r1: usize,
    act: &Act,
    out: Out,
) {
    let rb = w.ty.row_bytes(w.cols).expect("whole blocks");
    debug_assert_eq!(record(TY).0, GROUP * w.ty.block_bytes());
    let mut r = r0;
    while r < r1 {
        let group = w.data.as_ptr().add(r * rb);
        let vr = (r1 - r).min(GROUP);
        let mut t = 0;
        while t < act.n {
            let vt = (act.n - t).min(TILE_TOKENS);
            match vt {
                1 => store(&group_b32::<TY, DOT, 1>(group, act, t), out, t, r, vr),
                2 => store(&group_b32::<TY, DOT, 2>(group, act, t), out, t, r, vr),
                3 => store(&group_b32::<TY, DOT, 3>(group, act, t), out, t, r, vr),
                _ => store(&group_b32::<TY, DOT, 4>(group, act, t), out, t, r, vr),
            }
            t += vt;
        }
        r += GROUP;
    }
}

/// A group's 16 rows x `T` tokens from `t0`, over all blocks: `[token][half]`. (Indexed loops:
/// the register tile's accumulators are named by token and half.)
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn group_b32<const TY: u8, const DOT: u8, const T: usize>(
    group: *const u8,
    act: &Act,
    t0: usize,
) -> [[__m256; 2]; T] {
    let (rec_bytes, qs) = record(TY);
    let xs: [*const i8; T] = std::array::from_fn(|t| act.qs.as_ptr().add((t0 + t) * act.k));
    let m0f = _mm256_set1_epi8(15);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    for b in 0..act.nb {
        let p = group.add(b * rec_bytes);
        // (A prefetch never faults: the address may lie past the data.)
        for l in 0..rec_bytes.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * l + PREFETCH_BYTES).cast());
        }
        let mut dx = [0f32; T];
        let mut xsum = [0i32; T];
        for t in 0..T {
            let at = act.at(t0 + t, b);
            (dx[t], xsum[t]) = (act.d[at], act.sums[at]);
        }
        let xb = 32 * b;
        for h in 0..2 {
            let mut isum = [_mm256_setzero_si256(); T];
            if TY == Q8_0 {
                for k in 0..8 {
                    let w = _mm256_loadu_si256(p.add(qs + 64 * k + 32 * h).cast());
                    let aw = _mm256_abs_epi8(w);
                    for t in 0..T {
                        let x = _mm256_sign_epi8(bcast(xs[t], xb + 4 * k), w);
                        isum[t] = if DOT == MADDUBS {
                            // |w| <= 128 and |x| <= 127: a pair of products fits in i16, two
                            // pairs may not, so each `vpmaddubsw` widens to i32 on its own.
                            let d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones);
                            _mm256_add_epi32(isum[t], d)
                        } else {
                            dpbusd::<DOT>(isum[t], aw, x)
                        };
                    }
                }
            } else if DOT != MADDUBS {
                for k in 0..4 {
                    let v = _mm256_loadu_si256(p.add(qs + 64 * k + 32 * h).cast());
                    let wl = _mm256_and_si256(v, m0f);
                    let wh = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f);
                    for t in 0..T {
                        let lo = dpbusd::<DOT>(isum[t], wl, bcast(xs[t], xb + 4 * k));
                        isum[t] = dpbusd::<DOT>(lo, wh, bcast(xs[t], xb + 16 + 4 * k));
                    }
                }
            } else {
                // Per lane, 8 `vpmaddubsw` of pairs of levels <= 15 times |x| <= 127:
                // |sum| <= 8 * 2 * 15 * 127 = 30480, inside i16.
                let mut d16 = [_mm256_setzero_si256(); T];
                for k in 0..4 {
                    let v = _mm256_loadu_si256(p.add(qs + 64 * k + 32 * h).cast());
                    let wl = _mm256_and_si256(v, m0f);
                    let wh = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f);
                    for t in 0..T {
                        let lo = _mm256_maddubs_epi16(wl, bcast(xs[t], xb + 4 * k));
                        let hi = _mm256_maddubs_epi16(wh, bcast(xs[t], xb + 16 + 4 * k));
                        d16[t] = _mm256_add_epi16(d16[t], _mm256_add_epi16(lo, hi));
                    }
                }
                for t in 0..T {
                    isum[t] = _mm256_madd_epi16(d16[t], ones);
                }
            }
            let dw = rows_f16(p.add(16 * h));
            let mw = if TY == Q4_1 {
                rows_f16(p.add(32 + 16 * h))
            } else {
                _mm256_setzero_ps()
            };
            for t in 0..T {
                // The scalar path's levels are Q4_0's nibbles minus 8.
                let i1 = if TY == Q4_0 {
                    _mm256_sub_epi32(isum[t], _mm256_set1_epi32(8 * xsum[t]))
                } else {
                    isum[t]
                };
                let (dxv, i2) = (_mm256_set1_ps(dx[t]), _mm256_set1_epi32(xsum[t]));
                acc[t][h] = step(TY == Q4_1, acc[t][h], dw, mw, dxv, i1, i2);
            }
        }
    }
    acc
}
