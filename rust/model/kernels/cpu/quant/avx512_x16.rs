//! AVX-512 VNNI path on the interleaved layout ([`super::interleave`]): 16 rows in the 16 lanes.
//!
//! A record holds one super-block of 16 rows with row `i` in 4-byte lane `i` of each 64-byte
//! vector. `vpdpbusd` of a weight vector (4 levels per lane, unsigned) with 4 activation bytes
//! broadcast to every lane adds each row's 4 products to its own lane, so a sub-block's integer
//! sum arrives per row with no reduction; the sub-block scales (and Q4_K's minimums) multiply
//! it lane by lane. The integers are the scalar path's (exact, whatever their order), and the
//! float step per super-block is [`super::linear`]'s, so the outputs are the scalar path's bits.
//!
//! - Q4_K: a vector holds 8 levels per lane, low nibbles (4 weights) and high nibbles (the 4
//!   weights 16 on). The high ones go in as `v & 0xF0` (16 times the level, still a byte): the
//!   sum is then 16 times theirs, and one exact shift per sub-block takes it back.
//! - Q5_K: Q4_K's record with each sub-block's 5th bits after its vectors, a byte per row and
//!   vector; `vpshufb` puts a row's byte in all 4 bytes of its lane, `vptestmb` picks weight
//!   j's bit in byte j, and a masked add puts 16 on those levels (the high nibbles go in
//!   shifted down: 16 times a level up to 31 is no byte).
//! - Q6_K: the level is a low nibble of `ql` with two bits of `qh` above it (one `vpternlogd`
//!   merges them), and the -32 offset is taken with the activation sums of 16.
//!
//! Tiles: one group of 16 rows x `T` tokens (`T` <= 4), the group's records read once per tile
//! from memory (as one stream) and from cache for the next token tiles.

use super::activation::Act;
use super::avx2_x16::PREFETCH_BYTES;
use super::interleave::GROUP;
use super::linear::{Out, QuantMatRef};
use super::QuantType;
use std::arch::x86_64::*;

/// Rows `r0..r1` (`r0` a multiple of [`GROUP`]) of the interleaved `w` for all tokens of `act`.
///
/// # Safety
/// As `linear::rows_dispatch` (the CPU has AVX-512 F/BW/VL/VNNI); `w` is interleaved.
pub(super) unsafe fn rows(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) {
    // A group starting elsewhere would read past the (padded) data: a caller bug, checked.
    assert!(
        r0.is_multiple_of(GROUP),
        "interleaved rows start at a group"
    );
    // Software prefetch of the group's stream on Intel's cores only: there it read the
    // weights from DRAM faster, on AMD's Zen 4 slower (docs/benchmarks.md, "First run on an
    // Intel Xeon").
    match (w.ty, super::super::isa::cpu().intel) {
        (QuantType::Q4_K, false) => drive::<K4, false>(w, r0, r1, act, out),
        (QuantType::Q5_K, false) => drive::<K5, false>(w, r0, r1, act, out),
        (QuantType::Q6_K, false) => drive::<K6, false>(w, r0, r1, act, out),
        (QuantType::Q4_K, true) => drive::<K4, true>(w, r0, r1, act, out),
        (QuantType::Q5_K, true) => drive::<K5, true>(w, r0, r1, act, out),
        (QuantType::Q6_K, true) => drive::<K6, true>(w, r0, r1, act, out),
        (ty, _) => unreachable!("no interleaved kernel for {ty:?}"),
    }
}

// The types as const generic parameters.
const K4: u8 = 4;
const K5: u8 = 5;
const K6: u8 = 6;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn drive<const TY: u8, const PF: bool>(
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
            let vt = (act.n - t).min(4);
            match vt {
                1 => tile::<TY, 1, PF>(group, act, t, out, r, vr),
                2 => tile::<TY, 2, PF>(group, act, t, out, r, vr),
                3 => tile::<TY, 3, PF>(group, act, t, out, r, vr),
                _ => tile::<TY, 4, PF>(group, act, t, out, r, vr),
            }
            t += vt;
        }
        r += GROUP;
    }
}

/// One group x tokens `t0 .. t0 + T`: the accumulators, then stored for the group's `vr` rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile<const TY: u8, const T: usize, const PF: bool>(
    group: *const u8,
    act: &Act,
    t0: usize,
    out: Out,
    r0: usize,
    vr: usize,
) {
    let acc = match TY {
        K4 => group_q4_k::<false, T, PF>(group, act, t0),
        K5 => group_q4_k::<true, T, PF>(group, act, t0),
        _ => group_q6_k::<T, PF>(group, act, t0),
    };
    store(&acc, out, t0, r0, vr);
}

/// Stores a tile's accumulators (`[token]`, lane `i`: row `r0 + i`) for its `vr` valid rows:
/// one masked vector store per token (a token's rows are adjacent in `y`), `acc + bias` lane
/// by lane as [`Out::put`] computes it.
///
/// # Safety
/// As [`rows`]: those outputs belong to the caller.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn store(acc: &[__m512], out: Out, t0: usize, r0: usize, vr: usize) {
    let valid: __mmask16 = if vr >= GROUP { !0 } else { (1 << vr) - 1 };
    let bias = out
        .bias
        .map(|b| _mm512_maskz_loadu_ps(valid, b.as_ptr().add(r0)));
    for (t, &a) in acc.iter().enumerate() {
        let v = bias.map_or(a, |b| _mm512_add_ps(a, b));
        _mm512_mask_storeu_ps(out.at(t0 + t, r0), valid, v);
    }
}

/// `linear::step` on 16 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn step(
    acc: __m512,
    dw: __m512,
    mw: Option<__m512>,
    dx: __m512,
    i1: __m512i,
    i2: __m512i,
) -> __m512 {
    let p = _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(i1));
    let p = match mw {
        Some(mw) => _mm512_add_ps(
            p,
            _mm512_mul_ps(_mm512_mul_ps(mw, dx), _mm512_cvtepi32_ps(i2)),
        ),
        None => p,
    };
    _mm512_add_ps(acc, p)
}

/// Four activation bytes of token row `x` at `off`, in every lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn bcast(x: *const i8, off: usize) -> __m512i {
    _mm512_set1_epi32((x.add(off) as *const i32).read_unaligned())
}

/// 128-bit lane `L` of `v` (16 bytes: one value per row) as 16 i32 lanes, zero-extended.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn rows_u8(v: __m512i, lane: usize) -> __m512i {
    let x = match lane {
        0 => _mm512_castsi512_si128(v),
        1 => _mm512_extracti32x4_epi32::<1>(v),
        2 => _mm512_extracti32x4_epi32::<2>(v),
        _ => _mm512_extracti32x4_epi32::<3>(v),
    };
    _mm512_cvtepu8_epi32(x)
}

/// The f16 values at `p` (16 of them, one per row), widened.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn rows_f16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}

/// A Q4_K group's 16 rows x `T` tokens, over all super-blocks; `Q5`: a Q5_K group's (its
/// levels' 5th bits from the record's `qh`). `PF`: prefetch the stream [`PREFETCH_BYTES`]
/// ahead into L2 (into L1 measured slower on the Intel core that wants it).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn group_q4_k<const Q5: bool, const T: usize, const PF: bool>(
    group: *const u8,
    act: &Act,
    t0: usize,
) -> [__m512; T] {
    let (k, nb) = (act.k, act.nb);
    let xs: [*const i8; T] = std::array::from_fn(|t| act.qs.as_ptr().add((t0 + t) * k));
    let m63 = _mm512_set1_epi8(63);
    let m0f = _mm512_set1_epi8(15);
    let mf0 = _mm512_set1_epi8(-16);
    let m30 = _mm512_set1_epi8(0x30);
    // Q5_K: a `vpshufb` index of dword `d`'s first byte in all its 4 bytes (plus kq: its
    // byte kq), and the bits of weights j and 16 + j in byte j.
    let dwords = _mm512_set4_epi32(0x0c0c_0c0c, 0x0808_0808, 0x0404_0404, 0);
    let bit_lo = _mm512_set1_epi32(0x0804_0201);
    let bit_hi = _mm512_set1_epi32(0x8040_2010_u32 as i32);
    let m10 = _mm512_set1_epi8(16);
    let mut acc = [_mm512_setzero_ps(); T];
    for sb in 0..nb {
        let p = group.add(sb * GROUP * if Q5 { 176 } else { 144 });
        // Where sub-block s's vectors start, after 256 bytes of scales (Q5_K: its qh after).
        let stride = if Q5 { 320 } else { 256 };
        // The 6-bit scales and minimums of the 16 rows, byte [j][row] (ggml's get_scale_min_k4
        // on 16 rows at once): sc[0..4], mn[0..4], sc[4..8], mn[4..8].
        let a = _mm512_loadu_si512(p.add(64).cast());
        let b = _mm512_loadu_si512(p.add(128).cast());
        let c = _mm512_loadu_si512(p.add(192).cast());
        let sc_lo = _mm512_and_si512(a, m63);
        let mn_lo = _mm512_and_si512(b, m63);
        let sc_hi = _mm512_or_si512(
            _mm512_and_si512(c, m0f),
            _mm512_and_si512(_mm512_srli_epi16::<2>(a), m30),
        );
        let mn_hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(c), m0f),
            _mm512_and_si512(_mm512_srli_epi16::<2>(b), m30),
        );
        // The activation sums of 32 (the minimums' sub-blocks), per token. (Loops, not
        // `array::from_fn`: a closure left out of line here made the kernel a third slower.)
        let mut bs32 = [[0i32; T]; 8];
        for t in 0..T {
            let bs = act.block_bsums(t0 + t, sb);
            for (j, sums) in bs32.iter_mut().enumerate() {
                sums[t] = bs[2 * j] as i32 + bs[2 * j + 1] as i32;
            }
        }
        let mut i1 = [_mm512_setzero_si512(); T];
        let mut i2 = [_mm512_setzero_si512(); T];
        for (s, xsums) in bs32.iter().enumerate() {
            // (A prefetch never faults: the address may lie past the data.)
            for l in 0..if PF { stride / 64 } else { 0 } {
                let ahead = p.wrapping_add(256 + stride * s + 64 * l + PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T1>(ahead.cast());
            }
            let (scv, mnv) = if s < 4 {
                (sc_lo, mn_lo)
            } else {
                (sc_hi, mn_hi)
            };
            let sc = rows_u8(scv, s % 4);
            let mn = rows_u8(mnv, s % 4);
            let mut lo = [_mm512_setzero_si512(); T];
            let mut hi = [_mm512_setzero_si512(); T];
            // Q5_K: the 5th bits of sub-block s, a byte per row and vector.
            let qh = if Q5 {
                _mm512_loadu_si512(p.add(256 + 320 * s + 256).cast())
            } else {
                _mm512_setzero_si512()
            };
            for kq in 0..4 {
                let v = _mm512_loadu_si512(p.add(256 + stride * s + 64 * kq).cast());
                let (wl, wh) = if Q5 {
                    // Vector kq's byte of each lane in all 4 of its bytes; byte j takes bit j
                    // (weight j's) and bit 4 + j (weight 16 + j's) as 16.
                    let at = _mm512_add_epi8(dwords, _mm512_set1_epi8(kq as i8));
                    let b = _mm512_shuffle_epi8(qh, at);
                    let ml = _mm512_test_epi8_mask(b, bit_lo);
                    let mh = _mm512_test_epi8_mask(b, bit_hi);
                    let wl = _mm512_and_si512(v, m0f);
                    let wh = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f);
                    (
                        _mm512_mask_add_epi8(wl, ml, wl, m10),
                        _mm512_mask_add_epi8(wh, mh, wh, m10),
                    )
                } else {
                    (_mm512_and_si512(v, m0f), _mm512_and_si512(v, mf0))
                };
                let off = 256 * sb + 32 * s + 4 * kq;
                for t in 0..T {
                    lo[t] = _mm512_dpbusd_epi32(lo[t], wl, bcast(xs[t], off));
                    hi[t] = _mm512_dpbusd_epi32(hi[t], wh, bcast(xs[t], off + 16));
                }
            }
            for t in 0..T {
                // Q4_K's high nibbles went in as 16 times their levels (`v & 0xF0`).
                let dot = if Q5 {
                    _mm512_add_epi32(lo[t], hi[t])
                } else {
                    _mm512_add_epi32(lo[t], _mm512_srai_epi32::<4>(hi[t]))
                };
                i1[t] = _mm512_add_epi32(i1[t], _mm512_mullo_epi32(sc, dot));
                let xsum = _mm512_set1_epi32(xsums[t]);
                i2[t] = _mm512_add_epi32(i2[t], _mm512_mullo_epi32(mn, xsum));
            }
        }
        let dw = rows_f16(p);
        // The minimum's scale is -dmin (the scalar path's `m`; a sign flip, exact).
        let mw = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(rows_f16(p.add(32))),
            _mm512_set1_epi32(i32::MIN),
        ));
        for t in 0..T {
            let dx = _mm512_set1_ps(act.d[act.at(t0 + t, sb)]);
            acc[t] = step(acc[t], dw, Some(mw), dx, i1[t], i2[t]);
        }
    }
    acc
}

/// A Q6_K group's 16 rows x `T` tokens, over all super-blocks (`PF` as in [`group_q4_k`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn group_q6_k<const T: usize, const PF: bool>(
    group: *const u8,
    act: &Act,
    t0: usize,
) -> [__m512; T] {
    let (k, nb) = (act.k, act.nb);
    let xs: [*const i8; T] = std::array::from_fn(|t| act.qs.as_ptr().add((t0 + t) * k));
    let m0f = _mm512_set1_epi8(15);
    let m30 = _mm512_set1_epi8(0x30);
    let mut acc = [_mm512_setzero_ps(); T];
    for sb in 0..nb {
        let p = group.add(sb * GROUP * 210);
        let mut i1 = [_mm512_setzero_si512(); T];
        for s in 0..16 {
            for l in 0..if PF { 3 } else { 0 } {
                let ahead = p.wrapping_add(288 + 192 * s + 64 * l + PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T1>(ahead.cast());
            }
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(32 + 16 * s).cast()));
            let sub = p.add(288 + 192 * s);
            let ql0 = _mm512_loadu_si512(sub.cast());
            let ql1 = _mm512_loadu_si512(sub.add(64).cast());
            let qh = _mm512_loadu_si512(sub.add(128).cast());
            // Level of weight 16s + 4g + j: nibble of ql | top bits at 4-5. 0xEA: (a & b) | c.
            let q = [
                _mm512_ternarylogic_epi32::<0xEA>(
                    _mm512_slli_epi16::<4>(qh),
                    m30,
                    _mm512_and_si512(ql0, m0f),
                ),
                _mm512_ternarylogic_epi32::<0xEA>(
                    _mm512_slli_epi16::<2>(qh),
                    m30,
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql0), m0f),
                ),
                _mm512_ternarylogic_epi32::<0xEA>(qh, m30, _mm512_and_si512(ql1, m0f)),
                _mm512_ternarylogic_epi32::<0xEA>(
                    _mm512_srli_epi16::<2>(qh),
                    m30,
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), m0f),
                ),
            ];
            for t in 0..T {
                let off = 256 * sb + 16 * s;
                let mut dot = _mm512_setzero_si512();
                for (g, qg) in q.iter().enumerate() {
                    dot = _mm512_dpbusd_epi32(dot, *qg, bcast(xs[t], off + 4 * g));
                }
                // The levels carry +32: take 32 times the activation sum of the 16.
                let bs = act.bsums[(t0 + t) * k / 16 + 16 * sb + s] as i32;
                let dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(32 * bs));
                i1[t] = _mm512_add_epi32(i1[t], _mm512_mullo_epi32(sc, dot));
            }
        }
        let dw = rows_f16(p);
        for t in 0..T {
            let dx = _mm512_set1_ps(act.d[act.at(t0 + t, sb)]);
            acc[t] = step(acc[t], dw, None, dx, i1[t], _mm512_setzero_si512());
        }
    }
    acc
}
