//! AVX-512 VNNI path on the interleaved layout ([`super::interleave`]) of the 32-weight types
//! Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: a group of 16 rows in the 16 lanes of one vector.
//!
//! The row-major kernel [`super::avx512`] reads these types with a stride of one row between
//! blocks and reduces 16 vectors of partial sums per block (its transposing tree), which is
//! most of its prefill time. Here, as in [`super::avx512_x16`], a record is one block of 16
//! rows with row `i` in the 4-byte lane `i` of each 64-byte vector: `vpdpbusd` of a weight
//! vector (4 weights per lane, as unsigned bytes) with 4 activation bytes broadcast to every
//! lane adds each row's 4 products to its own lane, so a block's integer sum arrives per row
//! with no reduction, and the 16 f16 scales of a block are one load. Tiles are one group x up
//! to 8 tokens ([`TILE_TOKENS`]); the group's records are read once per tile from memory (one
//! stream, prefetched [`PREFETCH_BYTES`] ahead as in [`super::avx2_x16_b32`]) and from cache
//! for the next token tiles.
//!
//! - Q4_0, Q4_1: a vector holds 4 weights per lane in its low nibbles and the 4 weights 16 on
//!   in its high ones: two `vpdpbusd` per vector, each on its own accumulator (two chains).
//! - Q5_0, Q5_1: as Q4, plus the 5th bit of weight `j` of a lane's block, bit `j` of the lane's
//!   `qh` (u32): `vpshufb` copies the `qh` byte a vector needs into the 4 bytes of each lane,
//!   `vptestmb` against one bit per byte picks the weights whose bit is set, and a masked add
//!   of 16 sets it (the nibble is below 16: the add is an OR).
//! - Q8_0: signed weights, made unsigned with `+128` (an XOR of the sign bit).
//!
//! The offsets the stored weights carry (Q4_0: 8, Q5_0: 16, Q8_0: 128) go through the
//! activation block sum (`i1 - offset * sum(x)`), as in [`super::avx512`]. The integers are the
//! scalar path's (exact, whatever their order), and the float step per block is
//! [`super::linear`]'s on 16 lanes ([`super::avx512::step`]), so the outputs are the scalar
//! path's bits.

use super::activation::Act;
use super::avx2_x16::PREFETCH_BYTES;
use super::avx512::step;
use super::avx512_x16::{bcast, rows_f16, store};
use super::interleave::GROUP;
use super::linear::{Out, QuantMatRef};
use super::x86::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::QuantType;
use std::arch::x86_64::*;

/// Most tokens per tile: 8 tokens' two accumulator chains and sums are 24 of the 32 vector
/// registers.
const TILE_TOKENS: usize = 8;

/// Rows `r0..r1` (`r0` a multiple of [`GROUP`]) of the interleaved `w` (Q4_0, Q4_1, Q5_0, Q5_1
/// or Q8_0) for all tokens of `act`.
///
/// # Safety
/// As `linear::rows_dispatch` (the CPU has AVX-512 F/BW/VL/VNNI); `w` is interleaved.
pub(super) unsafe fn rows(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) {
    // A group starting elsewhere would read past the (padded) data: a caller bug, checked.
    assert!(
        r0.is_multiple_of(GROUP),
        "interleaved rows start at a group"
    );
    match w.ty {
        QuantType::Q4_0 => drive::<Q4_0>(w, r0, r1, act, out),
        QuantType::Q4_1 => drive::<Q4_1>(w, r0, r1, act, out),
        QuantType::Q5_0 => drive::<Q5_0>(w, r0, r1, act, out),
        QuantType::Q5_1 => drive::<Q5_1>(w, r0, r1, act, out),
        QuantType::Q8_0 => drive::<Q8_0>(w, r0, r1, act, out),
        ty => unreachable!("no interleaved 32-weight kernel for {ty:?}"),
    }
}

/// A record of `ty` (one block of 16 rows): its bytes, and where its `qh` vector (Q5 types)
/// and its quant vectors start (as [`super::interleave`]'s table).
const fn record(ty: u8) -> (usize, usize, usize) {
    match ty {
        Q4_0 => (GROUP * 18, 0, 32),
        Q4_1 => (GROUP * 20, 0, 64),
        Q5_0 => (GROUP * 22, 32, 96),
        Q5_1 => (GROUP * 24, 64, 128),
        _ => (GROUP * 34, 0, 32),
    }
}

/// Whether `ty` has a minimum (`m`, after the 16 `d` of a record).
const fn has_min(ty: u8) -> bool {
    matches!(ty, Q4_1 | Q5_1)
}

/// The offset the stored weights of `ty` carry, taken through the activation block sum.
const fn offset(ty: u8) -> i32 {
    match ty {
        Q4_0 => 8,
        Q5_0 => 16,
        Q8_0 => 128,
        _ => 0,
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn drive<const TY: u8>(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) {
    let rb = w.ty.row_bytes(w.cols).expect("whole blocks");
    debug_assert_eq!(record(TY).0, GROUP * w.ty.block_bytes());
    let mut r = r0;
    while r < r1 {
        let group = w.data.as_ptr().add(r * rb);
        let vr = (r1 - r).min(GROUP);
        // As few tiles as `TILE_TOKENS` allows, of even sizes (9 tokens: 5 + 4, not 8 + 1: a
        // short tile pays the weights' unpacking for few products).
        let mut t = 0;
        let mut tiles = act.n.div_ceil(TILE_TOKENS);
        while t < act.n {
            let vt = (act.n - t).div_ceil(tiles);
            match vt {
                1 => store(&group_b32::<TY, 1>(group, act, t), out, t, r, vr),
                2 => store(&group_b32::<TY, 2>(group, act, t), out, t, r, vr),
                3 => store(&group_b32::<TY, 3>(group, act, t), out, t, r, vr),
                4 => store(&group_b32::<TY, 4>(group, act, t), out, t, r, vr),
                5 => store(&group_b32::<TY, 5>(group, act, t), out, t, r, vr),
                6 => store(&group_b32::<TY, 6>(group, act, t), out, t, r, vr),
                7 => store(&group_b32::<TY, 7>(group, act, t), out, t, r, vr),
                _ => store(&group_b32::<TY, 8>(group, act, t), out, t, r, vr),
            }
            t += vt;
            tiles -= 1;
        }
        r += GROUP;
    }
}

/// `v` with 16 added to the bytes whose 5th bit is set in `qh` (a lane's u32 `qh` in each
/// lane): byte `j` of lane `i` is weight `8c + 4h + j` of row `i` (`C` = `c`, the `qh` byte;
/// `bits` = `h`'s bit per byte), so its bit is bit `4h + j` of that byte.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn fifth_bit<const C: i32>(v: __m512i, qh: __m512i, bits: __m512i) -> __m512i {
    // Byte `4i + j` of each 128-bit quarter takes byte `4i + C` (the lane's `qh` byte `C`).
    let idx = _mm512_add_epi8(
        _mm512_set_epi32(
            0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
            0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
        ),
        _mm512_set1_epi8(C as i8),
    );
    let set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, idx), bits);
    _mm512_mask_add_epi8(v, set, v, _mm512_set1_epi8(16))
}

/// A group's 16 rows x `T` tokens from `t0`, over all blocks: `[token]`. (Indexed loops: the
/// register tile's accumulators are named by token.)
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn group_b32<const TY: u8, const T: usize>(
    group: *const u8,
    act: &Act,
    t0: usize,
) -> [__m512; T] {
    let (rec_bytes, qh_at, qs) = record(TY);
    let xs: [*const i8; T] = std::array::from_fn(|t| act.qs.as_ptr().add((t0 + t) * act.k));
    let m0f = _mm512_set1_epi8(15);
    let sign = _mm512_set1_epi8(-128);
    // Per byte `j` of a lane, bit `j` (vectors `k` even) or `4 + j` (odd) of a `qh` byte.
    let bits = [
        _mm512_set1_epi32(0x08040201),
        _mm512_set1_epi32(0x80402010u32 as i32),
    ];
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..act.nb {
        let p = group.add(b * rec_bytes);
        // (A prefetch never faults: the address may lie past the data.)
        for l in 0..rec_bytes.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * l + PREFETCH_BYTES).cast());
        }
        let xb = 32 * b;
        // Two chains per token (independent `vpdpbusd` latencies), added at the end.
        let mut lo = [_mm512_setzero_si512(); T];
        let mut hi = [_mm512_setzero_si512(); T];
        if TY == Q8_0 {
            for k in 0..8 {
                let v = _mm512_loadu_si512(p.add(qs + 64 * k).cast());
                let wv = _mm512_xor_si512(v, sign);
                for t in 0..T {
                    let x = bcast(xs[t], xb + 4 * k);
                    if k % 2 == 0 {
                        lo[t] = _mm512_dpbusd_epi32(lo[t], wv, x);
                    } else {
                        hi[t] = _mm512_dpbusd_epi32(hi[t], wv, x);
                    }
                }
            }
        } else {
            let qh = if TY == Q5_0 || TY == Q5_1 {
                _mm512_loadu_si512(p.add(qh_at).cast())
            } else {
                _mm512_setzero_si512()
            };
            for k in 0..4 {
                let v = _mm512_loadu_si512(p.add(qs + 64 * k).cast());
                let mut wl = _mm512_and_si512(v, m0f);
                let mut wh = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f);
                if TY == Q5_0 || TY == Q5_1 {
                    // Weights 4k + j: `qh` byte k / 2; weights 16 + 4k + j: byte 2 + k / 2.
                    let bit = bits[k % 2];
                    (wl, wh) = if k < 2 {
                        (fifth_bit::<0>(wl, qh, bit), fifth_bit::<2>(wh, qh, bit))
                    } else {
                        (fifth_bit::<1>(wl, qh, bit), fifth_bit::<3>(wh, qh, bit))
                    };
                }
                for t in 0..T {
                    lo[t] = _mm512_dpbusd_epi32(lo[t], wl, bcast(xs[t], xb + 4 * k));
                    hi[t] = _mm512_dpbusd_epi32(hi[t], wh, bcast(xs[t], xb + 16 + 4 * k));
                }
            }
        }
        let dw = rows_f16(p);
        let mw = if has_min(TY) {
            rows_f16(p.add(32))
        } else {
            _mm512_setzero_ps()
        };
        for t in 0..T {
            let at = act.at(t0 + t, b);
            let (dx, xsum) = (act.d[at], act.sums[at]);
            let isum = _mm512_add_epi32(lo[t], hi[t]);
            // The scalar path's levels are the stored ones minus the type's offset.
            let i1 = if offset(TY) > 0 {
                _mm512_sub_epi32(isum, _mm512_set1_epi32(offset(TY) * xsum))
            } else {
                isum
            };
            let (dxv, i2) = (_mm512_set1_ps(dx), _mm512_set1_epi32(xsum));
            acc[t] = step(has_min(TY), acc[t], dw, mw, dxv, i1, i2);
        }
    }
    acc
}
