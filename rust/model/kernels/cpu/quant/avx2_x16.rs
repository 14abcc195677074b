//! AVX2 path on the interleaved layout ([`super::interleave`]): a group of 16 rows as two
//! halves of 8, each row in its own 4-byte lane of a 32-byte vector.
//!
//! A record stores row `i` in 4-byte lane `i` of each 64-byte vector, so its first 32 bytes
//! are rows 0-7 and the next 32 rows 8-15: the layout [`super::avx512_x16`] reads, read here
//! half by half. Without VNNI the 4-byte dot product of a lane is `vpmaddubsw` (pairs into
//! i16) and `vpmaddwd` (pairs into i32). A sub-block's i16 sums are added up before the
//! `vpmaddwd`, which then multiplies by the sub-block scale as well, so a sub-block costs one
//! `vpmaddwd` per half and token, and each row's sum arrives in its own lane with no
//! reduction tree and no shuffled scales (what the row-major AVX2 kernel in [`super::avx2`]
//! pays per block). The integers are the scalar path's (exact, whatever their order; the
//! bounds that keep the i16 sums from overflowing are at each sum), and the float step per
//! super-block is [`super::linear`]'s, so the outputs are the scalar path's bits.
//!
//! Tiles: one group of 16 rows x `T` tokens, the group's records read once per tile from
//! memory (one stream, prefetched [`PREFETCH_BYTES`] ahead) and from cache for the next token
//! tiles. The 32-weight types' kernel, [`super::avx2_x16_b32`], shares these.

use super::activation::Act;
use super::avx2::step;
use super::interleave::GROUP;
use super::linear::{Out, QuantMatRef};
use super::QuantType;
use std::arch::x86_64::*;

/// How far ahead of its reads a tile prefetches its group's stream: with one stream per
/// thread the hardware prefetcher alone left the decode short of the read bandwidth (figures
/// in docs/benchmarks.md).
pub(super) const PREFETCH_BYTES: usize = 4096;

/// Tokens per tile.
pub(super) const TILE_TOKENS: usize = 4;

/// How a lane's 4-byte dot products are summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dot {
    /// AVX2: `vpmaddubsw` into i16 pairs, `vpmaddwd` with ones into i32.
    Maddubs,
    /// AVX-VNNI: `vpdpbusd`, VEX-encoded.
    AvxVnni,
    /// The same `vpdpbusd` EVEX-encoded (AVX-512 VNNI and VL): what the tests run the
    /// AVX-VNNI arithmetic with on a CPU that has AVX-512 VNNI but not AVX-VNNI.
    #[cfg(test)]
    Avx512VnniYmm,
}

// `Dot` as const generic parameters.
pub(super) const MADDUBS: u8 = 0;
pub(super) const AVX_VNNI: u8 = 1;
#[cfg(test)]
pub(super) const AVX512_VNNI_YMM: u8 = 2;

/// Rows `r0..r1` (`r0` a multiple of [`GROUP`]) of the interleaved `w` for all tokens of `act`,
/// the dot products summed by `dot`.
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
    let ty = match w.ty {
        QuantType::Q4_K => K4,
        QuantType::Q5_K => K5,
        QuantType::Q6_K => K6,
        ty => unreachable!("no interleaved kernel for {ty:?}"),
    };
    match (dot, ty) {
        (Dot::Maddubs, K4) => drive::<K4>(w, r0, r1, act, out),
        (Dot::Maddubs, K5) => drive::<K5>(w, r0, r1, act, out),
        (Dot::Maddubs, _) => drive::<K6>(w, r0, r1, act, out),
        (Dot::AvxVnni, K4) => drive_vnni::<K4>(w, r0, r1, act, out),
        (Dot::AvxVnni, K5) => drive_vnni::<K5>(w, r0, r1, act, out),
        (Dot::AvxVnni, _) => drive_vnni::<K6>(w, r0, r1, act, out),
        #[cfg(test)]
        (Dot::Avx512VnniYmm, K4) => drive_evex::<K4>(w, r0, r1, act, out),
        #[cfg(test)]
        (Dot::Avx512VnniYmm, K5) => drive_evex::<K5>(w, r0, r1, act, out),
        #[cfg(test)]
        (Dot::Avx512VnniYmm, _) => drive_evex::<K6>(w, r0, r1, act, out),
    }
}

// The types as const generic parameters.
const K4: u8 = 4;
const K5: u8 = 5;
const K6: u8 = 6;

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
    let mut r = r0;
    while r < r1 {
        let group = w.data.as_ptr().add(r * rb);
        let vr = (r1 - r).min(GROUP);
        let mut t = 0;
        while t < act.n {
            let vt = (act.n - t).min(TILE_TOKENS);
            match vt {
                1 => tile::<TY, DOT, 1>(group, act, t, out, r, vr),
                2 => tile::<TY, DOT, 2>(group, act, t, out, r, vr),
                3 => tile::<TY, DOT, 3>(group, act, t, out, r, vr),
                _ => tile::<TY, DOT, 4>(group, act, t, out, r, vr),
            }
            t += vt;
        }
        r += GROUP;
    }
}

/// One group x tokens `t0 .. t0 + T`: the accumulators, then stored for the group's `vr` rows.
#[inline(always)]
unsafe fn tile<const TY: u8, const DOT: u8, const T: usize>(
    group: *const u8,
    act: &Act,
    t0: usize,
    out: Out,
    r0: usize,
    vr: usize,
) {
    let acc = match TY {
        K4 => group_q4_k::<false, DOT, T>(group, act, t0),
        K5 => group_q4_k::<true, DOT, T>(group, act, t0),
        _ => group_q6_k::<DOT, T>(group, act, t0),
    };
    store(&acc, out, t0, r0, vr);
}

/// A group's accumulators (`[token][half]`, tokens from `t0`), stored for its `vr` rows.
///
/// # Safety
/// As [`rows`]: those outputs belong to the caller.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn store(acc: &[[__m256; 2]], out: Out, t0: usize, r0: usize, vr: usize) {
    if vr == GROUP {
        // A whole group: two vector stores per token (a token's rows are adjacent in `y`),
        // `acc + bias` lane by lane as `Out::put` computes it.
        let bias = out.bias.map(|b| {
            let b = b.as_ptr().add(r0);
            [_mm256_loadu_ps(b), _mm256_loadu_ps(b.add(8))]
        });
        for (t, halves) in acc.iter().enumerate() {
            let y = out.at(t0 + t, r0);
            for (h, &a) in halves.iter().enumerate() {
                let v = bias.map_or(a, |b| _mm256_add_ps(a, b[h]));
                _mm256_storeu_ps(y.add(8 * h), v);
            }
        }
        return;
    }
    for (t, halves) in acc.iter().enumerate() {
        let mut lanes = [0f32; GROUP];
        _mm256_storeu_ps(lanes.as_mut_ptr(), halves[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), halves[1]);
        for (i, &v) in lanes.iter().enumerate().take(vr) {
            out.put(t0 + t, r0 + i, v);
        }
    }
}

/// Four activation bytes of token row `x` at `off`, in every lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn bcast(x: *const i8, off: usize) -> __m256i {
    _mm256_set1_epi32((x.add(off) as *const i32).read_unaligned())
}

/// The 8 bytes at `a` (one per row) and the 8 at `b`, as i16 pairs: lane `i` holds
/// `(a[i], b[i])`, zero-extended (`SIGNED`: sign-extended).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pairs<const SIGNED: bool>(a: *const u8, b: *const u8) -> __m256i {
    let ab = _mm_unpacklo_epi8(_mm_loadl_epi64(a.cast()), _mm_loadl_epi64(b.cast()));
    if SIGNED {
        _mm256_cvtepi8_epi16(ab)
    } else {
        _mm256_cvtepu8_epi16(ab)
    }
}

/// The f16 values at `p` (8 of them, one per row), widened.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn rows_f16(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// Vector `kq` of a Q4_K / Q5_K sub-block, half at `v`: the levels of its low and its high
/// nibbles (`Q5`: with their 5th bits from the half's `qh` bytes at `qh`, as 16).
#[inline(always)]
unsafe fn levels_k4<const Q5: bool>(v: *const u8, qh: *const u8, kq: usize) -> (__m256i, __m256i) {
    let m0f = _mm256_set1_epi8(15);
    let v = _mm256_loadu_si256(v.cast());
    let wl = _mm256_and_si256(v, m0f);
    let wh = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f);
    if !Q5 {
        return (wl, wh);
    }
    // Byte kq of each lane in all 4 of its bytes (`vpshufb` indexes within 128 bits), then
    // byte j's bit j (weight j) and bit 4 + j (weight 16 + j), each as 16.
    let dwords = _mm256_set_epi32(
        0x0c0c_0c0c,
        0x0808_0808,
        0x0404_0404,
        0,
        0x0c0c_0c0c,
        0x0808_0808,
        0x0404_0404,
        0,
    );
    let at = _mm256_add_epi8(dwords, _mm256_set1_epi8(kq as i8));
    let b = _mm256_shuffle_epi8(_mm256_loadu_si256(qh.cast()), at);
    // (No closure: it would not get the caller's target features.)
    let (lo, hi) = (
        _mm256_set1_epi32(0x0804_0201),
        _mm256_set1_epi32(0x8040_2010_u32 as i32),
    );
    let lo = _mm256_cmpeq_epi8(_mm256_and_si256(b, lo), lo);
    let hi = _mm256_cmpeq_epi8(_mm256_and_si256(b, hi), hi);
    let m10 = _mm256_set1_epi8(16);
    (
        _mm256_or_si256(wl, _mm256_and_si256(lo, m10)),
        _mm256_or_si256(wh, _mm256_and_si256(hi, m10)),
    )
}

/// A Q6_K level: `lo`'s low nibble, with bits 4-5 from `hi`. (A function, not a closure:
/// closures do not get their caller's target features.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn level(lo: __m256i, hi: __m256i, m0f: __m256i, m30: __m256i) -> __m256i {
    _mm256_or_si256(_mm256_and_si256(lo, m0f), _mm256_and_si256(hi, m30))
}

/// 32-byte aligned scratch for the unpacked scales (read back by 8-byte loads, each inside
/// one earlier 32-byte store, which the store buffer forwards).
#[repr(C, align(32))]
struct Bytes128([u8; 128]);

/// A Q4_K group's 16 rows x `T` tokens, over all super-blocks: `[token][half]`. (Indexed
/// loops: the register tile's accumulators are named by token and half.)
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn group_q4_k<const Q5: bool, const DOT: u8, const T: usize>(
    group: *const u8,
    act: &Act,
    t0: usize,
) -> [[__m256; 2]; T] {
    let (k, nb) = (act.k, act.nb);
    let xs: [*const i8; T] = std::array::from_fn(|t| act.qs.as_ptr().add((t0 + t) * k));
    let m63 = _mm256_set1_epi8(63);
    let m0f = _mm256_set1_epi8(15);
    let m30 = _mm256_set1_epi8(0x30);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    let mut sc = Bytes128([0; 128]);
    let mut mn = Bytes128([0; 128]);
    for sb in 0..nb {
        let p = group.add(sb * GROUP * if Q5 { 176 } else { 144 });
        // Where sub-block s's vectors start, after 256 bytes of scales (Q5_K: its qh after).
        let stride = if Q5 { 320 } else { 256 };
        // The 6-bit scales and minimums (ggml's get_scale_min_k4 on 16 rows at once): byte
        // `16 s + i` of `sc` / `mn` is sub-block `s`'s of row `i`. The record holds byte `j` of
        // the 12 of row `i` at 64 + 16 j + i; each 32-byte piece is bytes j, j + 1 of 16 rows.
        for piece in 0..2 {
            let a = _mm256_loadu_si256(p.add(64 + 32 * piece).cast());
            let b = _mm256_loadu_si256(p.add(128 + 32 * piece).cast());
            let c = _mm256_loadu_si256(p.add(192 + 32 * piece).cast());
            let sc_lo = _mm256_and_si256(a, m63);
            let mn_lo = _mm256_and_si256(b, m63);
            let sc_hi = _mm256_or_si256(
                _mm256_and_si256(c, m0f),
                _mm256_and_si256(_mm256_srli_epi16::<2>(a), m30),
            );
            let mn_hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(c), m0f),
                _mm256_and_si256(_mm256_srli_epi16::<2>(b), m30),
            );
            let at = sc.0.as_mut_ptr().add(32 * piece);
            _mm256_store_si256(at.cast(), sc_lo);
            _mm256_store_si256(at.add(64).cast(), sc_hi);
            let at = mn.0.as_mut_ptr().add(32 * piece);
            _mm256_store_si256(at.cast(), mn_lo);
            _mm256_store_si256(at.add(64).cast(), mn_hi);
        }
        // The minimums' part: each row's sum over s of mn[s] times the token's activation sum
        // over sub-block s (32 values, |sum| <= 32 * 127: an i16), two sub-blocks per
        // `vpmaddwd`. `bs32[t][p]` is the i16 pair (sum of 2p, sum of 2p + 1).
        let mut bs32 = [[0i32; 4]; T];
        for (t, pairs_t) in bs32.iter_mut().enumerate() {
            let v = _mm256_loadu_si256(act.block_bsums(t0 + t, sb).as_ptr().cast());
            let s = _mm256_madd_epi16(v, ones);
            let s = _mm256_packs_epi32(s, s);
            let s = _mm_unpacklo_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            _mm_storeu_si128(pairs_t.as_mut_ptr().cast(), s);
        }
        let mut i2 = [[_mm256_setzero_si256(); 2]; T];
        for h in 0..2 {
            for pair in 0..4 {
                let m = pairs::<false>(
                    mn.0.as_ptr().add(32 * pair + 8 * h),
                    mn.0.as_ptr().add(32 * pair + 16 + 8 * h),
                );
                for t in 0..T {
                    let x = _mm256_set1_epi32(bs32[t][pair]);
                    i2[t][h] = _mm256_add_epi32(i2[t][h], _mm256_madd_epi16(m, x));
                }
            }
        }
        let mut i1 = [[_mm256_setzero_si256(); 2]; T];
        for s in 0..8 {
            // (A prefetch never faults: the address may lie past the data.)
            for l in 0..stride / 64 {
                let ahead = p.wrapping_add(256 + stride * s + 64 * l + PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            }
            let at = sc.0.as_ptr().add(16 * s);
            // Q5_K: the 5th bits of sub-block s, a byte per row and vector (half h: 32 bytes).
            let qh = p.add(256 + stride * s + 256);
            if DOT != MADDUBS {
                // Per lane, the sub-block's 32 products summed in i32 by `vpdpbusd`, then
                // times the scale (|sum| <= 32 * 31 * 127, times 63, over 8 sub-blocks: i32).
                let mut dot = [[_mm256_setzero_si256(); 2]; T];
                for kq in 0..4 {
                    let off = 256 * sb + 32 * s + 4 * kq;
                    for h in 0..2 {
                        let v = p.add(256 + stride * s + 64 * kq + 32 * h);
                        let (wl, wh) = levels_k4::<Q5>(v, qh.add(32 * h), kq);
                        for t in 0..T {
                            let lo = dpbusd::<DOT>(dot[t][h], wl, bcast(xs[t], off));
                            dot[t][h] = dpbusd::<DOT>(lo, wh, bcast(xs[t], off + 16));
                        }
                    }
                }
                for h in 0..2 {
                    let scale = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at.add(8 * h).cast()));
                    for t in 0..T {
                        let d = _mm256_mullo_epi32(dot[t][h], scale);
                        i1[t][h] = _mm256_add_epi32(i1[t][h], d);
                    }
                }
                continue;
            }
            let scale = [pairs::<false>(at, at), pairs::<false>(at.add(8), at.add(8))];
            // Per lane, 8 products of levels <= 15 and |x| <= 127 per `vpmaddubsw` pair, 8
            // pairs: |sum| <= 8 * 2 * 15 * 127 = 30480, inside i16; Q5_K's levels <= 31 allow
            // 4 pairs (31496), so its i16 sums go to i32 every two vectors.
            let mut d16 = [[_mm256_setzero_si256(); 2]; T];
            for kq in 0..4 {
                let off = 256 * sb + 32 * s + 4 * kq;
                let mut xl = [_mm256_setzero_si256(); T];
                let mut xh = [_mm256_setzero_si256(); T];
                for t in 0..T {
                    xl[t] = bcast(xs[t], off);
                    xh[t] = bcast(xs[t], off + 16);
                }
                for h in 0..2 {
                    let v = p.add(256 + stride * s + 64 * kq + 32 * h);
                    let (wl, wh) = levels_k4::<Q5>(v, qh.add(32 * h), kq);
                    for t in 0..T {
                        let lo = _mm256_maddubs_epi16(wl, xl[t]);
                        let hi = _mm256_maddubs_epi16(wh, xh[t]);
                        d16[t][h] = _mm256_add_epi16(d16[t][h], _mm256_add_epi16(lo, hi));
                    }
                }
                if kq == 3 || (Q5 && kq == 1) {
                    for t in 0..T {
                        for h in 0..2 {
                            let d = _mm256_madd_epi16(d16[t][h], scale[h]);
                            i1[t][h] = _mm256_add_epi32(i1[t][h], d);
                            d16[t][h] = _mm256_setzero_si256();
                        }
                    }
                }
            }
        }
        for h in 0..2 {
            let dw = rows_f16(p.add(16 * h));
            // The minimum's scale is -dmin (the scalar path's `m`; a sign flip, exact).
            let mw = _mm256_xor_ps(rows_f16(p.add(32 + 16 * h)), _mm256_set1_ps(-0.0));
            for t in 0..T {
                let dx = _mm256_set1_ps(act.d[act.at(t0 + t, sb)]);
                acc[t][h] = step(true, acc[t][h], dw, mw, dx, i1[t][h], i2[t][h]);
            }
        }
    }
    acc
}

/// A Q6_K group's 16 rows x `T` tokens, over all super-blocks: `[token][half]`.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn group_q6_k<const DOT: u8, const T: usize>(
    group: *const u8,
    act: &Act,
    t0: usize,
) -> [[__m256; 2]; T] {
    let (k, nb) = (act.k, act.nb);
    let xs: [*const i8; T] = std::array::from_fn(|t| act.qs.as_ptr().add((t0 + t) * k));
    let m0f = _mm256_set1_epi8(15);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    for sb in 0..nb {
        let p = group.add(sb * GROUP * 210);
        let scales = p.add(32);
        // The levels carry +32: take 32 times each row's sum over s of sc[s] times the token's
        // activation sum over sub-block s, two sub-blocks per `vpmaddwd` (the activation sums
        // of 16 are i16 pairs as stored).
        let mut side = [[_mm256_setzero_si256(); 2]; T];
        for h in 0..2 {
            for pair in 0..8 {
                let sc = pairs::<true>(
                    scales.add(32 * pair + 8 * h),
                    scales.add(32 * pair + 16 + 8 * h),
                );
                for t in 0..T {
                    let bs = act.block_bsums(t0 + t, sb).as_ptr().add(2 * pair);
                    let x = _mm256_set1_epi32((bs as *const i32).read_unaligned());
                    side[t][h] = _mm256_add_epi32(side[t][h], _mm256_madd_epi16(sc, x));
                }
            }
        }
        let mut i1 = [[_mm256_setzero_si256(); 2]; T];
        for s in 0..16 {
            for l in 0..3 {
                let ahead = p.wrapping_add(288 + 192 * s + 64 * l + PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            }
            let at = scales.add(16 * s);
            let scale = [pairs::<true>(at, at), pairs::<true>(at.add(8), at.add(8))];
            let sub = p.add(288 + 192 * s);
            let off = 256 * sb + 16 * s;
            let mut x = [[_mm256_setzero_si256(); 4]; T];
            for t in 0..T {
                for (g, xg) in x[t].iter_mut().enumerate() {
                    *xg = bcast(xs[t], off + 4 * g);
                }
            }
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(sub.add(32 * h).cast());
                let ql1 = _mm256_loadu_si256(sub.add(64 + 32 * h).cast());
                let qh = _mm256_loadu_si256(sub.add(128 + 32 * h).cast());
                // Level of weight 16s + 4g + j: nibble of ql | the top bits at 4-5.
                let q = [
                    level(ql0, _mm256_slli_epi16::<4>(qh), m0f, m30),
                    level(
                        _mm256_srli_epi16::<4>(ql0),
                        _mm256_slli_epi16::<2>(qh),
                        m0f,
                        m30,
                    ),
                    level(ql1, qh, m0f, m30),
                    level(
                        _mm256_srli_epi16::<4>(ql1),
                        _mm256_srli_epi16::<2>(qh),
                        m0f,
                        m30,
                    ),
                ];
                if DOT != MADDUBS {
                    // The sub-block's 16 products summed in i32, then times the (signed)
                    // scale: |sum| <= 16 * 63 * 127 * 128 per sub-block, 16 of them: i32.
                    let scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64(at.add(8 * h).cast()));
                    for t in 0..T {
                        let mut d = _mm256_setzero_si256();
                        for g in 0..4 {
                            d = dpbusd::<DOT>(d, q[g], x[t][g]);
                        }
                        i1[t][h] = _mm256_add_epi32(i1[t][h], _mm256_mullo_epi32(d, scale));
                    }
                    continue;
                }
                for t in 0..T {
                    // Two `vpmaddubsw` of levels <= 63 and |x| <= 127: |sum| <= 4 * 63 * 127
                    // = 32004 per lane, inside i16; then times the scale into i32.
                    let a = _mm256_add_epi16(
                        _mm256_maddubs_epi16(q[0], x[t][0]),
                        _mm256_maddubs_epi16(q[1], x[t][1]),
                    );
                    let b = _mm256_add_epi16(
                        _mm256_maddubs_epi16(q[2], x[t][2]),
                        _mm256_maddubs_epi16(q[3], x[t][3]),
                    );
                    let d = _mm256_add_epi32(
                        _mm256_madd_epi16(a, scale[h]),
                        _mm256_madd_epi16(b, scale[h]),
                    );
                    i1[t][h] = _mm256_add_epi32(i1[t][h], d);
                }
            }
        }
        for h in 0..2 {
            let dw = rows_f16(p.add(16 * h));
            for t in 0..T {
                let i = _mm256_sub_epi32(i1[t][h], _mm256_slli_epi32::<5>(side[t][h]));
                let dx = _mm256_set1_ps(act.d[act.at(t0 + t, sb)]);
                let (mw, i2) = (_mm256_setzero_ps(), _mm256_setzero_si256());
                acc[t][h] = step(false, acc[t][h], dw, mw, dx, i, i2);
            }
        }
    }
    acc
}

/// `acc` plus each lane's 4 products of unsigned `u` and signed `s` bytes: `vpdpbusd` in the
/// encoding `DOT` names (never [`MADDUBS`]).
#[inline(always)]
pub(super) unsafe fn dpbusd<const DOT: u8>(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    #[cfg(test)]
    if DOT == AVX512_VNNI_YMM {
        return _mm256_dpbusd_epi32(acc, u, s);
    }
    debug_assert_eq!(DOT, AVX_VNNI);
    _mm256_dpbusd_avx_epi32(acc, u, s)
}
