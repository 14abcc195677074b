//! AVX-512 VNNI path: 64 weights per vector step, the scalar path's integers and float steps.
//!
//! A register tile is `R` weight rows x `T` tokens with `R * T <= 16`: (16, 1) at decode,
//! (8, 2) for two tokens, (4, 4) for more. Each (row, token) pair owns one 16-lane i32
//! accumulator of partial sums for the current block; the 16 accumulators are then reduced
//! together by a transposing tree (`red16`, `red_pairs`) into one vector whose lane
//! `t * R + r` holds the block's exact integer sum for row `r`, token `t`, and the float step
//! of [`super::linear`] runs on those 16 lanes at once: the same operations, in the same order,
//! as the scalar path per output, hence the same bits. A tile's rows and tokens past the end are
//! clamped copies of the last ones (computed, not stored), so one instantiation serves all
//! shapes.
//!
//! Integer parts by family:
//! - 32-weight types: weights as unsigned bytes (Q8_0 with +128, Q4_0 / Q5_0 / IQ4_NL as stored:
//!   0..15, 0..31, level + 128) times the signed activations with `vpdpbusd`, two blocks per
//!   64-byte vector; the offset (-128, -8, -16, -128 times the activation block sum) is
//!   subtracted after the reduction.
//! - K-quants: `vpmaddubsw` (levels are at most 63, so pairs never saturate) then `vpdpwssd`
//!   with the sub-block scales as i16; the offsets (Q3_K, Q6_K) and minimums (Q2_K, Q4_K, Q5_K)
//!   are one `vpmaddwd` of the 16 scales (or mins) with the activation's 16 sums of 16.
//! - IQ4_XS: levels + 128 through a byte shuffle, `vpdpbusd`, times the 32-weight scales.

use super::activation::Act;
use super::avx2::scales_k4_vec;
use super::iq4::LEVELS;
use super::kquants::scales_q3k_u64;
use super::linear::{Out, QuantMatRef};
use super::x86::*;
use super::QuantType;
use std::arch::x86_64::*;

/// Rows `r0..r1` of `w` for all tokens of `act`; every type has a kernel here.
///
/// # Safety
/// As `linear::rows_dispatch` (the CPU has AVX-512 F/BW/VL/VNNI).
pub(super) unsafe fn rows(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) -> bool {
    macro_rules! go {
        ($ty:expr) => {
            match act.n {
                1 => drive::<{ $ty }, 16, 1>(w, r0, r1, act, out),
                2 => drive::<{ $ty }, 8, 2>(w, r0, r1, act, out),
                _ => drive::<{ $ty }, 4, 4>(w, r0, r1, act, out),
            }
        };
    }
    match w.ty {
        QuantType::Q4_0 => go!(Q4_0),
        QuantType::Q4_1 => go!(Q4_1),
        QuantType::Q5_0 => go!(Q5_0),
        QuantType::Q5_1 => go!(Q5_1),
        QuantType::Q8_0 => go!(Q8_0),
        QuantType::IQ4_NL => go!(IQ4_NL),
        QuantType::Q2_K => go!(Q2_K),
        QuantType::Q3_K => go!(Q3_K),
        QuantType::Q4_K => go!(Q4_K),
        QuantType::Q5_K => go!(Q5_K),
        QuantType::Q6_K => go!(Q6_K),
        QuantType::IQ4_XS => go!(IQ4_XS),
    }
    true
}

/// Index and level tables, built at compile time: vectors built from scalar stores in a hot
/// loop cost a store-forwarding stall each (measured: 10x slower kernels).
#[repr(C, align(64))]
struct Tables {
    /// `vpshufb` index: i16 lanes of 128-bit quarter `q` <- scale `2c + q / 2` (chunk `c` of 64
    /// weights, per-32 scales: eight i16 in every quarter of the source).
    k32: [[i8; 64]; 4],
    /// The same for per-16 scales: quarter `q` <- scale `4 (c % 2) + q` of the source's eight
    /// (the half `c / 2` of the 16).
    k16: [[i8; 64]; 2],
    /// i32 lane `l` -> per-32 scale `2c + l / 8`.
    x32: [[i32; 16]; 4],
    /// `red_pairs`' final permutes (block b, block b + 1).
    pairs: [[i32; 16]; 2],
    /// i16 lane `s` -> `s / 2`.
    dup: [i16; 16],
    /// The IQ4 levels + 128, as bytes.
    levels: [u8; 16],
}

static TABLES: Tables = {
    let mut t = Tables {
        k32: [[0; 64]; 4],
        k16: [[0; 64]; 2],
        x32: [[0; 16]; 4],
        pairs: [[0; 16]; 2],
        dup: [0; 16],
        levels: [0; 16],
    };
    let mut c = 0;
    while c < 4 {
        let mut l = 0;
        while l < 64 {
            // Byte l: quarter q = l / 16, low or high byte of the i16.
            let (q, hi) = (l / 16, l % 2);
            t.k32[c][l] = (2 * (2 * c + q / 2) + hi) as i8;
            if c < 2 {
                t.k16[c][l] = (2 * (4 * c + q) + hi) as i8;
            }
            if l < 16 {
                t.x32[c][l] = (2 * c + l / 8) as i32;
            }
            l += 1;
        }
        c += 1;
    }
    // Lane 4q + j of `red_pairs`' lo (hi): item v[2j + q / 2] (v[8 + ..]) of block q % 2.
    let mut i = 0;
    while i < 16 {
        let mut blk = 0;
        while blk < 2 {
            t.pairs[blk][i] = ((i / 8) * 16 + 8 * (i % 2) + 4 * blk + (i % 8) / 2) as i32;
            blk += 1;
        }
        t.dup[i] = (i / 2) as i16;
        t.levels[i] = (LEVELS[i] as i32 + 128) as u8;
        i += 1;
    }
    t
};

const fn has_min(ty: u8) -> bool {
    matches!(ty, Q4_1 | Q5_1 | Q2_K | Q4_K | Q5_K)
}

/// What every tile of one call shares.
struct Ctx<'a> {
    w: *const u8,
    rb: usize,
    bb: usize,
    act: &'a Act<'a>,
}

/// Rows in tiles of `R`, tokens in tiles of `T` (rows outer: a row group's weights stay in L1
/// while the token tiles pass).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn drive<const TY: u8, const R: usize, const T: usize>(
    w: &QuantMatRef,
    r0: usize,
    r1: usize,
    act: &Act,
    out: Out,
) {
    let ctx = Ctx {
        w: w.data.as_ptr(),
        rb: w.ty.row_bytes(w.cols).expect("whole blocks"),
        bb: w.ty.block_bytes(),
        act,
    };
    debug_assert!(TY < Q2_K || k_block_bytes(TY) == ctx.bb);
    // The first groups' bytes (later groups are prefetched by the tiles before them).
    prefetch(ctx.w.add(r0 * ctx.rb), (r1 - r0).min(AHEAD * R) * ctx.rb);
    let mut r = r0;
    while r < r1 {
        let vr = (r1 - r).min(R);
        let mut t = 0;
        while t < act.n {
            let vt = (act.n - t).min(T);
            if TY >= Q2_K {
                tile_k::<TY, R, T>(&ctx, r, vr, t, vt, out);
            } else {
                tile_b32::<TY, R, T>(&ctx, r, vr, t, vt, out);
            }
            t += T;
        }
        r += R;
    }
}

/// Per-tile index vectors: byte offset of lane `i`'s row (`i % R`, clamped) from the tile's
/// first row, and lane `i`'s token (`i / R`, clamped) within its group of 4 (`t0 % 4 + ..`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn lane_indices<const R: usize, const T: usize>(
    rb: usize,
    vr: usize,
    t0: usize,
    vt: usize,
) -> (__m512i, __m512i) {
    let rows: [i32; 16] = std::array::from_fn(|i| ((i % R).min(vr - 1) * rb) as i32);
    let toks: [i32; 16] = std::array::from_fn(|i| (t0 % 4 + (i / R).min(vt - 1)) as i32);
    (
        _mm512_loadu_si512(rows.as_ptr().cast()),
        _mm512_loadu_si512(toks.as_ptr().cast()),
    )
}

/// Lane `t * R + r` of the block's activation scales (`act.d`, grouped by 4 tokens).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn token_scales(act: &Act, t0: usize, b: usize, tidx: __m512i) -> __m512 {
    let p = act.d.as_ptr().add(act.at(t0 - t0 % 4, b));
    _mm512_permutexvar_ps(tidx, _mm512_castps128_ps512(_mm_loadu_ps(p)))
}

/// Lane `t * R + r` of the block's activation sums (B32).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn token_sums(act: &Act, t0: usize, b: usize, tidx: __m512i) -> __m512i {
    let p = act.sums.as_ptr().add(act.at(t0 - t0 % 4, b));
    _mm512_permutexvar_epi32(tidx, _mm512_castsi128_si512(_mm_loadu_si128(p.cast())))
}

/// The f16 pair at byte `off` of each lane's block (rows by `ridx`): (low half, high half),
/// widened.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn row_scales(base: *const u8, ridx: __m512i) -> (__m512, __m512) {
    let g = _mm512_i32gather_epi32::<1>(ridx, base.cast());
    let lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    let hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)));
    (lo, hi)
}

/// The float step of `super::linear::step`, on 16 lanes (`min` is a constant per type).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn step(
    min: bool,
    acc: __m512,
    dw: __m512,
    mw: __m512,
    dx: __m512,
    i1: __m512i,
    i2: __m512i,
) -> __m512 {
    let p = _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(i1));
    let p = if min {
        _mm512_add_ps(
            p,
            _mm512_mul_ps(_mm512_mul_ps(mw, dx), _mm512_cvtepi32_ps(i2)),
        )
    } else {
        p
    };
    _mm512_add_ps(acc, p)
}

/// Stores lane `t * R + r` for the tile's valid rows and tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn store<const R: usize>(acc: __m512, out: Out, r0: usize, vr: usize, t0: usize, vt: usize) {
    let mut lanes = [0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
    for t in 0..vt {
        for r in 0..vr {
            out.put(t0 + t, r0 + r, lanes[t * R + r]);
        }
    }
}

// ---- Reductions: exact i32 sums, any tree gives the same integers. ----

/// Per 128-bit quarter `q` of four vectors each holding four 4-lane partial sums (one item per
/// quarter): lane `4q + j` of the result is the total of `u[j]`'s quarter `q`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn quads4(u0: __m512i, u1: __m512i, u2: __m512i, u3: __m512i) -> __m512i {
    let w0 = _mm512_add_epi32(_mm512_unpacklo_epi64(u0, u1), _mm512_unpackhi_epi64(u0, u1));
    let w1 = _mm512_add_epi32(_mm512_unpacklo_epi64(u2, u3), _mm512_unpackhi_epi64(u2, u3));
    let (a, b) = (_mm512_castsi512_ps(w0), _mm512_castsi512_ps(w1));
    _mm512_add_epi32(
        _mm512_castps_si512(_mm512_shuffle_ps::<0x88>(a, b)),
        _mm512_castps_si512(_mm512_shuffle_ps::<0xDD>(a, b)),
    )
}

/// From 16 vectors holding 8-lane items in their halves (`h[j]`: items `2j` and `2j + 1`) to
/// lane `i` = total of item `4 (i % 4) + i / 4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn halves_to_lanes(h: &[__m512i; 8]) -> __m512i {
    // Each item's two 128-bit quarters added: quarter q of B_i is item 4i + q.
    let mut b = [_mm512_setzero_si512(); 4];
    for (i, o) in b.iter_mut().enumerate() {
        let (c, d) = (h[2 * i], h[2 * i + 1]);
        *o = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(c, d),
            _mm512_shuffle_i32x4::<0xDD>(c, d),
        );
    }
    quads4(b[0], b[1], b[2], b[3])
}

/// Lane `i` = the sum of the 16 lanes of `v[i]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn red16(v: &[__m512i; 16]) -> __m512i {
    // Items fed in transposed order (`halves_to_lanes` transposes back).
    let mut h = [_mm512_setzero_si512(); 8];
    for (j, o) in h.iter_mut().enumerate() {
        let (a, b) = (v[tr(2 * j)], v[tr(2 * j + 1)]);
        *o = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x44>(a, b),
            _mm512_shuffle_i32x4::<0xEE>(a, b),
        );
    }
    halves_to_lanes(&h)
}

/// Lane `i` = the sum of the 8 lanes of `v[i]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn red16x8(v: &[__m256i; 16]) -> __m512i {
    let mut h = [_mm512_setzero_si512(); 8];
    for (j, o) in h.iter_mut().enumerate() {
        *o = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v[tr(2 * j)]), v[tr(2 * j + 1)]);
    }
    halves_to_lanes(&h)
}

/// The 4x4 transposition of item indices.
#[inline(always)]
const fn tr(i: usize) -> usize {
    4 * (i % 4) + i / 4
}

/// Two blocks per vector (lanes 0-7 block b, 8-15 block b + 1): lane `i` of the results = the
/// sum of `v[i]`'s lanes 0-7, and of its lanes 8-15.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn red_pairs(v: &[__m512i; 16]) -> (__m512i, __m512i) {
    // Quarters of U_j: (v[2j], b), (v[2j], b+1), (v[2j+1], b), (v[2j+1], b+1).
    let mut u = [_mm512_setzero_si512(); 8];
    for (j, o) in u.iter_mut().enumerate() {
        let (a, b) = (v[2 * j], v[2 * j + 1]);
        *o = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(a, b),
            _mm512_shuffle_i32x4::<0xDD>(a, b),
        );
    }
    let lo = quads4(u[0], u[1], u[2], u[3]);
    let hi = quads4(u[4], u[5], u[6], u[7]);
    let i0 = _mm512_load_si512(TABLES.pairs[0].as_ptr().cast());
    let i1 = _mm512_load_si512(TABLES.pairs[1].as_ptr().cast());
    (
        _mm512_permutex2var_epi32(lo, i0, hi),
        _mm512_permutex2var_epi32(lo, i1, hi),
    )
}

// ---- 32-weight types ----

/// `[a, a, b, b]` by 128-bit quarter: two 16-byte nibble arrays, each twice.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn nibble_pairs(a: *const u8, b: Option<*const u8>) -> __m512i {
    let z = _mm512_broadcast_i32x4(_mm_loadu_si128(a.cast()));
    let hi = match b {
        Some(b) => _mm_loadu_si128(b.cast()),
        None => _mm_setzero_si128(),
    };
    let z = _mm512_mask_broadcast_i32x4(z, 0xFF00, hi);
    // Quarters 0, 2: low nibbles (weights 0-15); 1, 3: high nibbles (16-31).
    let shifts = _mm512_set_epi64(
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
    );
    _mm512_and_si512(_mm512_srlv_epi16(z, shifts), _mm512_set1_epi8(15))
}

/// Blocks `b` and `b + 1` (if `pair`) of one row as 64 unsigned bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn load_b32<const TY: u8>(p: *const u8, bb: usize, pair: bool) -> __m512i {
    let next = pair.then(|| p.add(bb));
    match TY {
        Q8_0 => {
            let lo = _mm256_loadu_si256(p.add(2).cast());
            let hi = match next {
                Some(q) => _mm256_loadu_si256(q.add(2).cast()),
                None => _mm256_setzero_si256(),
            };
            let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            _mm512_xor_si512(z, _mm512_set1_epi8(-128))
        }
        Q4_0 | IQ4_NL => {
            let z = nibble_pairs(p.add(2), next.map(|q| q.add(2)));
            if TY == IQ4_NL {
                _mm512_shuffle_epi8(level_table(), z)
            } else {
                z
            }
        }
        Q4_1 => nibble_pairs(p.add(4), next.map(|q| q.add(4))),
        Q5_0 | Q5_1 => {
            let (qh, qs) = if TY == Q5_0 { (2, 6) } else { (4, 8) };
            let z = nibble_pairs(p.add(qs), next.map(|q| q.add(qs)));
            let h0 = (p.add(qh) as *const u32).read_unaligned() as u64;
            let h1 = next.map_or(0, |q| (q.add(qh) as *const u32).read_unaligned() as u64);
            _mm512_mask_add_epi8(z, h0 | h1 << 32, z, _mm512_set1_epi8(16))
        }
        _ => unreachable!(),
    }
}

/// The IQ4 levels + 128 (as unsigned bytes), in every 128-bit quarter (for `vpshufb`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn level_table() -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(TABLES.levels.as_ptr().cast()))
}

/// One tile of a 32-weight type, two blocks per step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_b32<const TY: u8, const R: usize, const T: usize>(
    ctx: &Ctx,
    r0: usize,
    vr: usize,
    t0: usize,
    vt: usize,
    out: Out,
) {
    let act = ctx.act;
    let (k, nb, bb) = (act.k, act.nb, ctx.bb);
    let wt = ctx.w.add(r0 * ctx.rb);
    let rows: [*const u8; R] = std::array::from_fn(|r| wt.add(r.min(vr - 1) * ctx.rb));
    let xs: [*const i8; T] = std::array::from_fn(|t| act.qs.as_ptr().add((t0 + t.min(vt - 1)) * k));
    let (ridx, tidx) = lane_indices::<R, T>(ctx.rb, vr, t0, vt);
    // The offset the stored weights carry, removed through the activation sums.
    let offset = match TY {
        Q8_0 | IQ4_NL => 128,
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    };
    let mut acc = _mm512_setzero_ps();
    let mut b = 0;
    while b < nb {
        let pair = b + 1 < nb;
        let mut xv = [_mm512_setzero_si512(); T];
        for (t, x) in xv.iter_mut().enumerate() {
            let p = xs[t].add(32 * b);
            *x = if pair {
                _mm512_loadu_si512(p.cast())
            } else {
                _mm512_zextsi256_si512(_mm256_loadu_si256(p.cast()))
            };
        }
        let mut v = [_mm512_setzero_si512(); 16];
        for (r, row) in rows.iter().enumerate() {
            if t0 == 0 {
                // A later group in address order (`prefetch_ahead`): the pair's last byte's
                // line covers what the previous pair's prefetch did not.
                prefetch_ahead(wt, R * ctx.rb, (b * R + 2 * r + 2) * bb - 1, 1);
            }
            let wv = load_b32::<TY>(row.add(b * bb), bb, pair);
            for (t, x) in xv.iter().enumerate() {
                v[t * R + r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, *x);
            }
        }
        let (s0, s1) = red_pairs(&v);
        for (j, isum) in [(0, s0), (1, s1)] {
            if j == 1 && !pair {
                break;
            }
            let bj = b + j;
            let (dw, mw) = row_scales(wt.add(bj * bb), ridx);
            let dx = token_scales(act, t0, bj, tidx);
            let xsum = token_sums(act, t0, bj, tidx);
            let i1 = if offset > 0 {
                _mm512_sub_epi32(isum, _mm512_mullo_epi32(xsum, _mm512_set1_epi32(offset)))
            } else {
                isum
            };
            acc = step(has_min(TY), acc, dw, mw, dx, i1, xsum);
        }
        b += 2;
    }
    store::<R>(acc, out, r0, vr, t0, vt);
}

// ---- K-quants and IQ4_XS ----

/// A 32-byte run in both halves, shifted right per 16-bit lane by `lo` (low half) and `hi`
/// (high half), masked to `mask`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn run2(p: *const u8, lo: i16, hi: i16, mask: i8) -> __m512i {
    let z = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.cast()));
    let s = _mm512_inserti64x4::<1>(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi));
    _mm512_and_si512(_mm512_srlv_epi16(z, s), _mm512_set1_epi8(mask))
}

/// Weights `64c .. 64c + 64` of one super-block as unsigned bytes (levels, offsets not taken).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn load_k<const TY: u8>(p: *const u8, c: usize) -> __m512i {
    let (h, g) = (c / 2, 2 * (c % 2) as i16);
    match TY {
        Q2_K => run2(p.add(16 + 32 * h), 2 * g, 2 * g + 2, 3),
        Q3_K => {
            let lo = run2(p.add(32 + 32 * h), 2 * g, 2 * g + 2, 3);
            let hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.cast()));
            let bit = 4 * h as u32 + g as u32;
            let (b0, b1) = ((1u32 << bit) as u8 as i8, (1u32 << (bit + 1)) as u8 as i8);
            let sel = _mm512_inserti64x4::<1>(_mm512_set1_epi8(b0), _mm256_set1_epi8(b1));
            let k = _mm512_test_epi8_mask(hm, sel);
            _mm512_mask_add_epi8(lo, k, lo, _mm512_set1_epi8(4))
        }
        Q4_K => run2(p.add(16 + 32 * c), 0, 4, 15),
        Q5_K => {
            let lo = run2(p.add(48 + 32 * c), 0, 4, 15);
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16).cast()));
            let (b0, b1) = (1u8 << (2 * c), 1u8 << (2 * c + 1));
            let sel =
                _mm512_inserti64x4::<1>(_mm512_set1_epi8(b0 as i8), _mm256_set1_epi8(b1 as i8));
            let k = _mm512_test_epi8_mask(qh, sel);
            _mm512_mask_add_epi8(lo, k, lo, _mm512_set1_epi8(16))
        }
        Q6_K => {
            // Runs g, g + 1 of half h: nibbles of ql[64h ..], low (c even) or high; 2-bit
            // tops of qh[32h ..] at shifts 2g, 2g + 2.
            let ql = _mm512_loadu_si512(p.add(64 * h).cast());
            let ql = if c.is_multiple_of(2) {
                ql
            } else {
                _mm512_srli_epi16::<4>(ql)
            };
            let lo = _mm512_and_si512(ql, _mm512_set1_epi8(15));
            let s = 4 * (c % 2) as i16;
            let top = run2(p.add(128 + 32 * h), s, s + 2, 3);
            _mm512_or_si512(lo, _mm512_slli_epi16::<4>(top))
        }
        IQ4_XS => {
            let q = p.add(8 + 32 * c);
            _mm512_shuffle_epi8(level_table(), nibble_pairs(q, Some(q.add(16))))
        }
        _ => unreachable!(),
    }
}

/// Sixteen i16 as two vectors holding eight each in every 128-bit quarter.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn halves(v: __m256i) -> [__m512i; 2] {
    [
        _mm512_broadcast_i32x4(_mm256_castsi256_si128(v)),
        _mm512_broadcast_i32x4(_mm256_extracti128_si256::<1>(v)),
    ]
}

/// Per-16 lanes of eight per-32 values: lane `s` = `v8[s / 2]`. (A function, not a closure:
/// closures do not get their caller's target features.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dup(v8: __m128i) -> __m256i {
    let idx = _mm256_loadu_si256(TABLES.dup.as_ptr().cast());
    _mm256_permutexvar_epi16(idx, _mm256_castsi128_si256(v8))
}

/// One row's super-block scales as vectors.
struct KScales {
    /// Scales as i16, eight in every 128-bit quarter (for an in-lane `vpshufb` per chunk): the
    /// 8 per-32 scales (Q4_K, Q5_K, IQ4_XS: `sc[0]`), or the per-16 scales 0-7 and 8-15.
    sc: [__m512i; 2],
    /// Per 16, i16: minimums (Q2_K, Q4_K, Q5_K) or `offset * scale` (Q3_K, Q6_K, IQ4_XS), for
    /// one `vpmaddwd` with the activation's 16 sums.
    side: __m256i,
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn k_scales<const TY: u8>(p: *const u8) -> KScales {
    match TY {
        Q4_K | Q5_K => {
            let v = scales_k4_vec(p);
            KScales {
                sc: [_mm512_broadcast_i32x4(_mm_cvtepu8_epi16(v)); 2],
                side: dup(_mm_cvtepu8_epi16(_mm_srli_si128::<8>(v))),
            }
        }
        Q2_K => {
            let raw = _mm_loadu_si128(p.cast());
            let m4 = _mm_set1_epi8(15);
            let sc = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
            let mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw), m4));
            KScales {
                sc: halves(sc),
                side: mn,
            }
        }
        Q3_K | Q6_K => {
            let sc = if TY == Q3_K {
                let (a, b) = scales_q3k_u64(std::slice::from_raw_parts(p.add(96), 12));
                let u = _mm256_cvtepu8_epi16(_mm_set_epi64x(b as i64, a as i64));
                _mm256_sub_epi16(u, _mm256_set1_epi16(32))
            } else {
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192).cast()))
            };
            let off = if TY == Q3_K { -4 } else { -32 };
            KScales {
                sc: halves(sc),
                side: _mm256_mullo_epi16(sc, _mm256_set1_epi16(off)),
            }
        }
        IQ4_XS => {
            // ls_j: nibble j of scales_l (a u32) below bits 2j of scales_h.
            let high = (p.add(2) as *const u16).read_unaligned() as u64;
            let low = (p.add(4) as *const u32).read_unaligned() as u64;
            let mut ls = 0u64;
            for j in 0..8 {
                ls |= (((low >> (4 * j)) & 15) | ((high >> (2 * j)) & 3) << 4) << (8 * j);
            }
            let ls = _mm_sub_epi16(
                _mm_cvtepu8_epi16(_mm_cvtsi64_si128(ls as i64)),
                _mm_set1_epi16(32),
            );
            KScales {
                sc: [_mm512_castsi128_si512(ls); 2],
                side: dup(_mm_mullo_epi16(ls, _mm_set1_epi16(-128))),
            }
        }
        _ => unreachable!(),
    }
}

/// The scale vector of chunk `c` (64 weights) as `vpdpwssd` (i16 pairs) or, for IQ4_XS,
/// `vpmulld` (i32 lanes) wants it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn chunk_scales<const TY: u8>(s: &KScales, c: usize) -> __m512i {
    match TY {
        // i16 lane l covers weights 2l, 2l + 1: per-32 scale 2c + l / 16.
        Q4_K | Q5_K => {
            let idx = _mm512_load_si512(TABLES.k32[c].as_ptr().cast());
            _mm512_shuffle_epi8(s.sc[0], idx)
        }
        // Per-16 scale 4c + l / 8.
        Q2_K | Q3_K | Q6_K => {
            let idx = _mm512_load_si512(TABLES.k16[c % 2].as_ptr().cast());
            _mm512_shuffle_epi8(s.sc[c / 2], idx)
        }
        // i32 lane l covers weights 4l .. 4l + 3: per-32 scale 2c + l / 8.
        IQ4_XS => {
            let sc32 = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(s.sc[0]));
            let idx = _mm512_load_si512(TABLES.x32[c].as_ptr().cast());
            _mm512_permutexvar_epi32(idx, sc32)
        }
        _ => unreachable!(),
    }
}

/// One tile of a 256-weight type, one super-block per step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_k<const TY: u8, const R: usize, const T: usize>(
    ctx: &Ctx,
    r0: usize,
    vr: usize,
    t0: usize,
    vt: usize,
    out: Out,
) {
    let act = ctx.act;
    let (k, nb, bb) = (act.k, act.nb, ctx.bb);
    let wt = ctx.w.add(r0 * ctx.rb);
    let rows: [*const u8; R] = std::array::from_fn(|r| wt.add(r.min(vr - 1) * ctx.rb));
    let toks: [usize; T] = std::array::from_fn(|t| t0 + t.min(vt - 1));
    let (ridx, tidx) = lane_indices::<R, T>(ctx.rb, vr, t0, vt);
    // Where the f16 d (and dmin) sit: in the low half of the dword gathered, or the high.
    let (doff, d_high) = match TY {
        Q2_K => (80, false),
        Q3_K => (106, true),
        Q6_K => (206, true),
        _ => (0, false),
    };
    let mut acc = _mm512_setzero_ps();
    for sb in 0..nb {
        let mut v = [_mm512_setzero_si512(); 16];
        let mut side = [_mm256_setzero_si256(); 16];
        let mut bs = [_mm256_setzero_si256(); T];
        for (b, &tok) in bs.iter_mut().zip(&toks) {
            *b = _mm256_loadu_si256(act.block_bsums(tok, sb).as_ptr().cast());
        }
        for (r, row) in rows.iter().enumerate() {
            let p = row.add(sb * bb);
            if t0 == 0 {
                // (The first token tile reads the rows from memory.)
                prefetch_ahead(wt, R * ctx.rb, (sb * R + r) * bb, k_block_bytes(TY));
            }
            let sc = k_scales::<TY>(p);
            // This row's accumulators in registers over the four chunks; stored once.
            let mut a = [_mm512_setzero_si512(); T];
            for c in 0..4 {
                let wv = load_k::<TY>(p, c);
                let cs = chunk_scales::<TY>(&sc, c);
                for (at, &tok) in a.iter_mut().zip(&toks) {
                    let xp = act.qs.as_ptr().add(tok * k + 256 * sb + 64 * c);
                    let xv = _mm512_loadu_si512(xp.cast());
                    *at = if TY == IQ4_XS {
                        let d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
                        _mm512_add_epi32(*at, _mm512_mullo_epi32(d, cs))
                    } else {
                        _mm512_dpwssd_epi32(*at, _mm512_maddubs_epi16(wv, xv), cs)
                    };
                }
            }
            for t in 0..T {
                v[t * R + r] = a[t];
                side[t * R + r] = _mm256_madd_epi16(sc.side, bs[t]);
            }
        }
        let (i1, i2) = if has_min(TY) {
            (red16(&v), red16x8(&side))
        } else {
            // The offsets belong to i1: add them in before the reduction (exact).
            for (a, s) in v.iter_mut().zip(&side) {
                *a = _mm512_add_epi32(*a, _mm512_zextsi256_si512(*s));
            }
            (red16(&v), _mm512_setzero_si512())
        };
        let (lo, hi) = row_scales(wt.add(sb * bb + doff), ridx);
        let dw = if d_high { hi } else { lo };
        // The minimum's scale is -dmin (sign flipped: exact, as the scalar path's negation).
        let mw = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(hi),
            _mm512_set1_epi32(i32::MIN),
        ));
        let dx = token_scales(act, t0, sb, tidx);
        acc = step(has_min(TY), acc, dw, mw, dx, i1, i2);
    }
    store::<R>(acc, out, r0, vr, t0, vt);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;

    fn avx512() -> bool {
        super::super::linear::Isa::detect() == super::super::linear::Isa::Avx512Vnni
    }

    /// The reduction trees give each item's exact total in the lane the kernels expect.
    #[test]
    fn reductions_put_each_total_in_its_lane() {
        if !avx512() {
            return;
        }
        let mut rng = Rng(1);
        let vals: Vec<i32> = (0..256)
            .map(|_| (rng.next_u() % 2001) as i32 - 1000)
            .collect();
        // SAFETY: AVX-512 F/BW/VL/VNNI detected; every load reads 16 (or 8) of the 256 values.
        unsafe {
            let v: [__m512i; 16] =
                std::array::from_fn(|i| _mm512_loadu_si512(vals[16 * i..].as_ptr().cast()));
            let y: [__m256i; 16] =
                std::array::from_fn(|i| _mm256_loadu_si256(vals[16 * i..].as_ptr().cast()));
            let mut got = [0i32; 16];
            _mm512_storeu_si512(got.as_mut_ptr().cast(), red16(&v));
            let mut got8 = [0i32; 16];
            _mm512_storeu_si512(got8.as_mut_ptr().cast(), red16x8(&y));
            let (p0, p1) = red_pairs(&v);
            let (mut g0, mut g1) = ([0i32; 16], [0i32; 16]);
            _mm512_storeu_si512(g0.as_mut_ptr().cast(), p0);
            _mm512_storeu_si512(g1.as_mut_ptr().cast(), p1);
            for i in 0..16 {
                let item = &vals[16 * i..16 * i + 16];
                assert_eq!(got[i], item.iter().sum::<i32>(), "red16 {i}");
                assert_eq!(got8[i], item[..8].iter().sum::<i32>(), "red16x8 {i}");
                assert_eq!(g0[i], item[..8].iter().sum::<i32>(), "red_pairs lo {i}");
                assert_eq!(g1[i], item[8..].iter().sum::<i32>(), "red_pairs hi {i}");
            }
        }
    }
}
