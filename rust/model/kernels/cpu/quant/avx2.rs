//! AVX2 path: 32 weights per vector step, the scalar path's integers and float steps.
//!
//! As the AVX-512 path (see there), with 8-lane vectors: register tiles of `R` rows x `T`
//! tokens with `R * T = 8` ((8, 1) at decode, (4, 2), (2, 4)); per block, each (row, token)
//! pair's i32 partial sums are reduced by a transposing tree into lane `t * R + r`, and the
//! float step runs on the 8 lanes.
//!
//! Integer parts: `vpmaddubsw` then `vpmaddwd` (with ones, or with the sub-block scales).
//! Signed weights (Q8_0, the IQ4 levels) go through the sign trick (`|w|` times `x` with `w`'s
//! sign), so they need no offset; Q4_0 / Q5_0 weights are stored unsigned and lose their offset
//! through the activation block sums, as on AVX-512.

use super::activation::Act;
use super::iq4::LEVELS;
use super::kquants::scales_q3k_u64;
use super::linear::{Out, QuantMatRef};
use super::x86::*;
use super::QuantType;
use std::arch::x86_64::*;

/// Rows `r0..r1` of `w` for all tokens of `act`; every type has a kernel here.
///
/// # Safety
/// As `linear::rows_dispatch` (the CPU has AVX2, FMA and F16C).
pub(super) unsafe fn rows(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) -> bool {
    macro_rules! go {
        ($ty:expr) => {
            match act.n {
                1 => drive::<{ $ty }, 8, 1>(w, r0, r1, act, out),
                2 => drive::<{ $ty }, 4, 2>(w, r0, r1, act, out),
                _ => drive::<{ $ty }, 2, 4>(w, r0, r1, act, out),
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

const fn has_min(ty: u8) -> bool {
    matches!(ty, Q4_1 | Q5_1 | Q2_K | Q4_K | Q5_K)
}

/// Index and level tables (vectors built from scalar stores in a hot loop stall).
#[repr(C, align(32))]
struct Tables {
    /// `vpshufb` index: byte `i` of each 128-bit lane <- byte `i / 8` (+ 2 in the high lane).
    spread: [i8; 32],
    /// Bit `i % 8` of each byte.
    bits: [u8; 32],
    /// The IQ4 levels as signed bytes, twice.
    levels: [i8; 32],
    /// Low (then high) 16 bits of each dword, packed into the first 8 bytes of a lane.
    low16: [i8; 32],
    high16: [i8; 32],
}

static TABLES: Tables = {
    let mut t = Tables {
        spread: [0; 32],
        bits: [0; 32],
        levels: [0; 32],
        low16: [-1; 32],
        high16: [-1; 32],
    };
    let mut i = 0;
    while i < 32 {
        t.spread[i] = ((i % 16) / 8 + 2 * (i / 16)) as i8;
        t.bits[i] = 1 << (i % 8);
        t.levels[i] = LEVELS[i % 16];
        i += 1;
    }
    let mut lane = 0;
    while lane < 2 {
        let mut j = 0;
        while j < 4 {
            t.low16[16 * lane + 2 * j] = (4 * j) as i8;
            t.low16[16 * lane + 2 * j + 1] = (4 * j + 1) as i8;
            t.high16[16 * lane + 2 * j] = (4 * j + 2) as i8;
            t.high16[16 * lane + 2 * j + 1] = (4 * j + 3) as i8;
            j += 1;
        }
        lane += 1;
    }
    t
};

struct Ctx<'a> {
    w: *const u8,
    rb: usize,
    bb: usize,
    act: &'a Act<'a>,
}

#[target_feature(enable = "avx2,fma,f16c")]
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

/// Lane `i`'s row byte offset (`i % R`, clamped) and token within its group of 4.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lane_indices<const R: usize, const T: usize>(
    rb: usize,
    vr: usize,
    t0: usize,
    vt: usize,
) -> (__m256i, __m256i) {
    let rows: [i32; 8] = std::array::from_fn(|i| ((i % R).min(vr - 1) * rb) as i32);
    let toks: [i32; 8] = std::array::from_fn(|i| (t0 % 4 + (i / R).min(vt - 1)) as i32);
    (
        _mm256_loadu_si256(rows.as_ptr().cast()),
        _mm256_loadu_si256(toks.as_ptr().cast()),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn token_scales(act: &Act, t0: usize, b: usize, tidx: __m256i) -> __m256 {
    let p = act.d.as_ptr().add(act.at(t0 - t0 % 4, b));
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), tidx)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn token_sums(act: &Act, t0: usize, b: usize, tidx: __m256i) -> __m256i {
    let p = act.sums.as_ptr().add(act.at(t0 - t0 % 4, b));
    _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_loadu_si128(p.cast())), tidx)
}

/// The f16 pair at each lane's block (rows by `ridx`): (low half, high half), widened.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn row_scales(base: *const u8, ridx: __m256i) -> (__m256, __m256) {
    let g = _mm256_i32gather_epi32::<1>(base.cast(), ridx);
    (
        _mm256_cvtph_ps(pack16(g, &TABLES.low16)),
        _mm256_cvtph_ps(pack16(g, &TABLES.high16)),
    )
}

/// The 16-bit halves of 8 dwords picked by `idx`, packed into 8 u16. (Functions, not closures:
/// closures do not get their caller's target features.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pack16(g: __m256i, idx: &[i8; 32]) -> __m128i {
    let s = _mm256_shuffle_epi8(g, _mm256_load_si256(idx.as_ptr().cast()));
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(s))
}

/// Bits `2g` of a 32-byte run (the 2-bit fields of Q2_K, Q3_K and Q6_K's tops).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn two_bits(run: *const u8, g: i32) -> __m256i {
    let q = _mm256_loadu_si256(run.cast());
    _mm256_and_si256(
        _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * g)),
        _mm256_set1_epi8(3),
    )
}

/// `add` where bit `j` of each byte of the 32-byte run at `p` is set, else 0.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bit_j(p: *const u8, j: usize, add: i8) -> __m256i {
    let h = _mm256_loadu_si256(p.cast());
    let bit = _mm256_set1_epi8((1u32 << j) as u8 as i8);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(add))
}

/// `linear::step` on 8 lanes (also [`super::avx2_x16`]'s).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn step(
    min: bool,
    acc: __m256,
    dw: __m256,
    mw: __m256,
    dx: __m256,
    i1: __m256i,
    i2: __m256i,
) -> __m256 {
    let p = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(i1));
    let p = if min {
        _mm256_add_ps(
            p,
            _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(i2)),
        )
    } else {
        p
    };
    _mm256_add_ps(acc, p)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store<const R: usize>(acc: __m256, out: Out, r0: usize, vr: usize, t0: usize, vt: usize) {
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    for t in 0..vt {
        for r in 0..vr {
            out.put(t0 + t, r0 + r, lanes[t * R + r]);
        }
    }
}

/// Lane `i` = the sum of the 8 lanes of `v[i]` (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn red8(v: &[__m256i; 8]) -> __m256i {
    let mut w = [_mm256_setzero_si256(); 4];
    for (j, o) in w.iter_mut().enumerate() {
        let (a, b) = (v[2 * j], v[2 * j + 1]);
        *o = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    }
    // Per 128-bit half: the half's totals of v[4j .. 4j + 4].
    let x0 = _mm256_add_epi32(
        _mm256_unpacklo_epi64(w[0], w[1]),
        _mm256_unpackhi_epi64(w[0], w[1]),
    );
    let x1 = _mm256_add_epi32(
        _mm256_unpacklo_epi64(w[2], w[3]),
        _mm256_unpackhi_epi64(w[2], w[3]),
    );
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(x0, x1),
        _mm256_permute2x128_si256::<0x31>(x0, x1),
    )
}

/// Byte `i` = 0xFF where bit `i` of `bits` is set.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bit_bytes(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_load_si256(TABLES.spread.as_ptr().cast()),
    );
    let sel = _mm256_load_si256(TABLES.bits.as_ptr().cast());
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel)
}

/// 16 bytes of nibbles as 32 bytes: low nibbles (weights 0-15), then high (16-31).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p.cast());
    let z = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_and_si256(z, _mm256_set1_epi8(15))
}

/// `w` as IQ4 levels (signed bytes).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn levels(idx: __m256i) -> __m256i {
    _mm256_shuffle_epi8(_mm256_load_si256(TABLES.levels.as_ptr().cast()), idx)
}

/// Signed weights `w` times signed activations `x`: pairs summed into i16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_signed(w: __m256i, x: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
}

/// One block of a 32-weight type as 32 bytes (unsigned, or signed for Q8_0 / IQ4_NL).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_b32<const TY: u8>(p: *const u8) -> __m256i {
    match TY {
        Q8_0 => _mm256_loadu_si256(p.add(2).cast()),
        Q4_0 => nibbles(p.add(2)),
        IQ4_NL => levels(nibbles(p.add(2))),
        Q4_1 => nibbles(p.add(4)),
        Q5_0 | Q5_1 => {
            let (qh, qs) = if TY == Q5_0 { (2, 6) } else { (4, 8) };
            let hb = bit_bytes((p.add(qh) as *const u32).read_unaligned());
            _mm256_or_si256(
                nibbles(p.add(qs)),
                _mm256_and_si256(hb, _mm256_set1_epi8(16)),
            )
        }
        _ => unreachable!(),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
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
    let offset = match TY {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    };
    let signed = matches!(TY, Q8_0 | IQ4_NL);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let mut xv = [_mm256_setzero_si256(); T];
        for (t, x) in xv.iter_mut().enumerate() {
            *x = _mm256_loadu_si256(xs[t].add(32 * b).cast());
        }
        let mut v = [_mm256_setzero_si256(); 8];
        for (r, row) in rows.iter().enumerate() {
            if t0 == 0 && b % 2 == 0 {
                // A later group in address order (`prefetch_ahead`): the pair's last byte's
                // line covers what the previous pair's prefetch did not.
                prefetch_ahead(wt, R * ctx.rb, (b * R + 2 * r + 2) * bb - 1, 1);
            }
            let wv = load_b32::<TY>(row.add(b * bb));
            for (t, x) in xv.iter().enumerate() {
                let p16 = if signed {
                    dot_signed(wv, *x)
                } else {
                    _mm256_maddubs_epi16(wv, *x)
                };
                v[t * R + r] = _mm256_madd_epi16(p16, ones);
            }
        }
        let isum = red8(&v);
        let (dw, mw) = row_scales(wt.add(b * bb), ridx);
        let dx = token_scales(act, t0, b, tidx);
        let xsum = token_sums(act, t0, b, tidx);
        let i1 = if offset > 0 {
            _mm256_sub_epi32(isum, _mm256_mullo_epi32(xsum, _mm256_set1_epi32(offset)))
        } else {
            isum
        };
        acc = step(has_min(TY), acc, dw, mw, dx, i1, xsum);
    }
    store::<R>(acc, out, r0, vr, t0, vt);
}

/// Weights `32j .. 32j + 32` of one super-block as bytes (unsigned levels; IQ4_XS: signed).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_k<const TY: u8>(p: *const u8, j: usize) -> __m256i {
    let (h, g) = (j / 4, (j % 4) as i32);
    let m15 = _mm256_set1_epi8(15);
    match TY {
        Q2_K => two_bits(p.add(16 + 32 * h), g),
        Q3_K => _mm256_or_si256(two_bits(p.add(32 + 32 * h), g), bit_j(p, j, 4)),
        Q4_K | Q5_K => {
            let qs = if TY == Q4_K { 16 } else { 48 };
            let q = _mm256_loadu_si256(p.add(qs + 32 * (j / 2)).cast());
            let q = if j.is_multiple_of(2) {
                q
            } else {
                _mm256_srli_epi16::<4>(q)
            };
            let lo = _mm256_and_si256(q, m15);
            if TY == Q4_K {
                lo
            } else {
                _mm256_or_si256(lo, bit_j(p.add(16), j, 16))
            }
        }
        Q6_K => {
            let ql = _mm256_loadu_si256(p.add(64 * h + 32 * (j % 2)).cast());
            let ql = if g < 2 {
                ql
            } else {
                _mm256_srli_epi16::<4>(ql)
            };
            let top = two_bits(p.add(128 + 32 * h), g);
            _mm256_or_si256(_mm256_and_si256(ql, m15), _mm256_slli_epi16::<4>(top))
        }
        IQ4_XS => levels(nibbles(p.add(8 + 16 * j))),
        _ => unreachable!(),
    }
}

/// One row's super-block scales: what each 32-weight chunk's scale vector is built from, and
/// the per-16 side vector (as on AVX-512).
struct KScales {
    /// Q4_K, Q5_K: the 8 per-32 scales as i16 (one 16-byte store: reading them back one by one
    /// forwards from the store, unlike a vector load of values stored one by one).
    sc32: [i16; 8],
    /// Q3_K: the 16 scales before their -32, 8 bytes each (`kquants::scales_q3k_u64`).
    q3: (u64, u64),
    side: __m256i,
}

/// Lanes 0-7 `a`, 8-15 `b`. (A function, not a closure: closures do not get their caller's
/// target features.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pair(a: i16, b: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))
}

/// Q4_K / Q5_K: bytes 0-7 the 8 scales, 8-15 the 8 mins (6 bits each), unpacked in a register
/// (what `kquants::scales_k4` computes; SSSE3 only, so the AVX-512 path uses it too).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn scales_k4_vec(p: *const u8) -> __m128i {
    // Bytes 4..20 of the block: the 12 scale bytes q0..q11, then 4 bytes not used.
    let q = _mm_loadu_si128(p.add(4).cast());
    // Low bits: sc0-3 = q0-3 & 63, sc4-7 = q8-11 & 15, m0-3 = q4-7 & 63, m4-7 = q8-11 >> 4.
    let a = _mm_shuffle_epi8(
        q,
        _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11),
    );
    let low = _mm_or_si128(
        _mm_and_si128(
            a,
            _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0),
        ),
        _mm_and_si128(
            _mm_srli_epi16::<4>(a),
            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15),
        ),
    );
    // Top bits of sc4-7 and m4-7: bits 6-7 of q0-3 and q4-7, moved to bits 4-5.
    let b = _mm_shuffle_epi8(
        q,
        _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7),
    );
    _mm_or_si128(
        low,
        _mm_and_si128(_mm_srli_epi16::<2>(b), _mm_set1_epi8(0x30)),
    )
}

/// Eight per-32 values as 16 per-16 lanes (`s / 2`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dup(v8: __m128i) -> __m256i {
    _mm256_set_m128i(_mm_unpackhi_epi16(v8, v8), _mm_unpacklo_epi16(v8, v8))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn k_scales<const TY: u8>(p: *const u8) -> KScales {
    let mut sc32 = [0i16; 8];
    let mut q3 = (0, 0);
    let side = match TY {
        Q4_K | Q5_K => {
            let v = scales_k4_vec(p);
            _mm_storeu_si128(sc32.as_mut_ptr().cast(), _mm_cvtepu8_epi16(v));
            dup(_mm_cvtepu8_epi16(_mm_srli_si128::<8>(v)))
        }
        Q2_K => {
            let raw = _mm_loadu_si128(p.cast());
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw), _mm_set1_epi8(15)))
        }
        Q3_K => {
            let (a, b) = scales_q3k_u64(std::slice::from_raw_parts(p.add(96), 12));
            q3 = (a, b);
            let u = _mm256_cvtepu8_epi16(_mm_set_epi64x(b as i64, a as i64));
            let s = _mm256_sub_epi16(u, _mm256_set1_epi16(32));
            _mm256_mullo_epi16(s, _mm256_set1_epi16(-4))
        }
        Q6_K => {
            let s = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192).cast()));
            _mm256_mullo_epi16(s, _mm256_set1_epi16(-32))
        }
        IQ4_XS => _mm256_setzero_si256(),
        _ => unreachable!(),
    };
    KScales { sc32, q3, side }
}

/// The scale vector of chunk `j` (32 weights): i16 lanes 0-7 the first 16 weights' scale,
/// 8-15 the second's.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn chunk_scales<const TY: u8>(p: *const u8, s: &KScales, j: usize) -> __m256i {
    match TY {
        Q4_K | Q5_K => _mm256_set1_epi16(s.sc32[j]),
        Q6_K => pair(
            *p.add(192 + 2 * j) as i8 as i16,
            *p.add(193 + 2 * j) as i8 as i16,
        ),
        Q2_K => pair((*p.add(2 * j) & 15) as i16, (*p.add(2 * j + 1) & 15) as i16),
        Q3_K => {
            let v = if j < 4 { s.q3.0 } else { s.q3.1 };
            let at = |i: usize| ((v >> (8 * i)) & 0xFF) as i16 - 32;
            pair(at(2 * (j % 4)), at(2 * (j % 4) + 1))
        }
        IQ4_XS => {
            let high = (p.add(2) as *const u16).read_unaligned();
            let lo = ((*p.add(4 + j / 2) >> (4 * (j % 2))) & 15) as i16;
            _mm256_set1_epi16((lo | (((high >> (2 * j)) & 3) as i16) << 4) - 32)
        }
        _ => unreachable!(),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
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
    let (doff, d_high) = match TY {
        Q2_K => (80, false),
        Q3_K => (106, true),
        Q6_K => (206, true),
        _ => (0, false),
    };
    let mut acc = _mm256_setzero_ps();
    for sb in 0..nb {
        let mut v = [_mm256_setzero_si256(); 8];
        let mut side = [_mm256_setzero_si256(); 8];
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
            let mut a = [_mm256_setzero_si256(); T];
            for j in 0..8 {
                let wv = load_k::<TY>(p, j);
                let cs = chunk_scales::<TY>(p, &sc, j);
                for (at, &tok) in a.iter_mut().zip(&toks) {
                    let xp = act.qs.as_ptr().add(tok * k + 256 * sb + 32 * j);
                    let xv = _mm256_loadu_si256(xp.cast());
                    let p16 = if TY == IQ4_XS {
                        dot_signed(wv, xv)
                    } else {
                        _mm256_maddubs_epi16(wv, xv)
                    };
                    *at = _mm256_add_epi32(*at, _mm256_madd_epi16(p16, cs));
                }
            }
            for t in 0..T {
                v[t * R + r] = a[t];
                side[t * R + r] = _mm256_madd_epi16(sc.side, bs[t]);
            }
        }
        let (i1, i2) = if has_min(TY) {
            (red8(&v), red8(&side))
        } else {
            for (a, s) in v.iter_mut().zip(&side) {
                *a = _mm256_add_epi32(*a, *s);
            }
            (red8(&v), _mm256_setzero_si256())
        };
        let (lo, hi) = row_scales(wt.add(sb * bb + doff), ridx);
        let dw = if d_high { hi } else { lo };
        let mw = _mm256_xor_ps(hi, _mm256_set1_ps(-0.0));
        let dx = token_scales(act, t0, sb, tidx);
        acc = step(has_min(TY), acc, dw, mw, dx, i1, i2);
    }
    store::<R>(acc, out, r0, vr, t0, vt);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;

    #[test]
    fn reduction_puts_each_total_in_its_lane() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let mut rng = Rng(2);
        let vals: Vec<i32> = (0..64)
            .map(|_| (rng.next_u() % 2001) as i32 - 1000)
            .collect();
        // SAFETY: AVX2 detected; every load reads 8 of the 64 values.
        unsafe {
            let v: [__m256i; 8] =
                std::array::from_fn(|i| _mm256_loadu_si256(vals[8 * i..].as_ptr().cast()));
            let mut got = [0i32; 8];
            _mm256_storeu_si256(got.as_mut_ptr().cast(), red8(&v));
            for (i, g) in got.iter().enumerate() {
                assert_eq!(*g, vals[8 * i..8 * i + 8].iter().sum::<i32>(), "{i}");
            }
            let mut b = [0u8; 32];
            _mm256_storeu_si256(b.as_mut_ptr().cast(), bit_bytes(0x8000_0005));
            for (i, &v) in b.iter().enumerate() {
                let want = if [0, 2, 31].contains(&i) { 0xFF } else { 0 };
                assert_eq!(v, want, "bit_bytes {i}");
            }
        }
    }
}
