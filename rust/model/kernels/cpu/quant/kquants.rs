//! The K-quant super-blocks: 256 weights in sub-blocks of 16 or 32, each sub-block with a small
//! integer scale (and minimum) relative to the block's f16 `d` (and `dmin`). Layouts (bytes):
//!
//! - **Q2_K** (84): `scales[16]` (low nibble scale, high nibble min, per 16), `qs[64]`, `d`,
//!   `dmin`. Weight = `d * sc * q - dmin * m`, `q` 2 bits.
//! - **Q3_K** (110): `hmask[32]`, `qs[64]`, `scales[12]` (16 x 6 bits, minus 32), `d`. Weight =
//!   `d * sc * (q - 4)` with `q` = 2 low bits + 4 x the hmask bit.
//! - **Q4_K** (144): `d`, `dmin`, `scales[12]` (8 scales, 8 mins, 6 bits), `qs[128]`. Weight =
//!   `d * sc * q - dmin * m` per 32, `q` 4 bits.
//! - **Q5_K** (176): as Q4_K with `qh[32]` before `qs`: the fifth bit.
//! - **Q6_K** (210): `ql[128]`, `qh[64]`, `scales[16]` (i8, per 16), `d`. Weight =
//!   `d * sc * (q - 32)`, `q` 6 bits.
//!
//! Where the bits of weight `i` sit (2-bit fields: 32-byte runs of `qs` read at shifts 0, 2, 4,
//! 6; 4-bit fields: 32-byte runs of low then high nibbles) is written out in [`unpack`].

use super::search::{fit_affine, fit_symmetric};
use super::{f16_at, put_f16, round_i, QuantType, Unpacked};

/// The 6-bit scales and mins of Q4_K / Q5_K: bytes 0-3 hold scales 0-3 (low 6 bits) and the top
/// 2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low 4 bits of scale
/// (low nibble) and min (high nibble) 4-7.
pub(super) fn scales_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (sc, mn) = scales_k4_u64(s);
    (sc.to_le_bytes(), mn.to_le_bytes())
}

/// [`scales_k4`] as two u64 of 8 bytes each, computed four bytes at a time (what the SIMD
/// paths move into a vector register without a trip through memory).
#[inline]
pub(super) fn scales_k4_u64(s: &[u8]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let sc_lo = a & 0x3F3F_3F3F;
    let mn_lo = b & 0x3F3F_3F3F;
    let sc_hi = (c & 0x0F0F_0F0F) | ((a >> 6) & 0x0303_0303) << 4;
    let mn_hi = ((c >> 4) & 0x0F0F_0F0F) | ((b >> 6) & 0x0303_0303) << 4;
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        mn_lo as u64 | (mn_hi as u64) << 32,
    )
}

fn pack_scales_k4(sc: &[u8; 8], mn: &[u8; 8], s: &mut [u8]) {
    for j in 0..4 {
        s[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        s[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
        s[j + 8] = (sc[j + 4] & 15) | (mn[j + 4] & 15) << 4;
    }
}

/// The 16 signed 6-bit scales of Q3_K: low 4 bits of scale `s` in byte `s % 8` (low nibble for
/// `s < 8`, high after), top 2 bits in byte `8 + s % 4` at shift `2 (s / 4)`; minus 32.
pub(super) fn scales_q3k(s: &[u8]) -> [i8; 16] {
    let (a, b) = scales_q3k_u64(s);
    let mut out = [0i8; 16];
    for (o, v) in out
        .iter_mut()
        .zip(a.to_le_bytes().into_iter().chain(b.to_le_bytes()))
    {
        *o = v as i8 - 32;
    }
    out
}

/// [`scales_q3k`] before the -32, as two u64 of 8 bytes (scales 0-7, 8-15).
#[inline]
pub(super) fn scales_q3k_u64(s: &[u8]) -> (u64, u64) {
    let a = u64::from_le_bytes(s[..8].try_into().unwrap());
    let h = u32::from_le_bytes(s[8..12].try_into().unwrap()) as u64;
    let m2 = 0x0303_0303u64;
    let hi0 = (h & m2) | ((h >> 2) & m2) << 32;
    let hi1 = ((h >> 4) & m2) | ((h >> 6) & m2) << 32;
    let m4 = 0x0F0F_0F0F_0F0F_0F0Fu64;
    ((a & m4) | hi0 << 4, ((a >> 4) & m4) | hi1 << 4)
}

fn pack_scales_q3k(sc: &[i8; 16], s: &mut [u8]) {
    s[..12].fill(0);
    for (i, &v) in sc.iter().enumerate() {
        let u = (v as i32 + 32) as u8;
        s[i % 8] |= (u & 15) << (4 * (i / 8));
        s[8 + i % 4] |= (u >> 4) << (2 * (i / 4));
    }
}

pub(super) fn unpack(ty: QuantType, b: &[u8], u: &mut Unpacked) {
    match ty {
        QuantType::Q2_K => {
            u.d = f16_at(b, 80);
            u.m = -f16_at(b, 82);
            for (s, &v) in b[..16].iter().enumerate() {
                u.sc[s] = (v & 15) as i16;
                u.mn[s] = (v >> 4) as i16;
            }
            // Half h, run g: weight 128h + 32g + l is bits 2g of qs[32h + l].
            for h in 0..2 {
                for g in 0..4 {
                    for l in 0..32 {
                        u.q[128 * h + 32 * g + l] = ((b[16 + 32 * h + l] >> (2 * g)) & 3) as i8;
                    }
                }
            }
        }
        QuantType::Q3_K => {
            u.d = f16_at(b, 108);
            u.m = 0.0;
            for (o, v) in u.sc.iter_mut().zip(scales_q3k(&b[96..108])) {
                *o = v as i16;
            }
            // As Q2_K for the low bits; the high bit of weight 32g' + l is bit g' of hmask[l],
            // and a clear bit means -4.
            for h in 0..2 {
                for g in 0..4 {
                    for l in 0..32 {
                        let lo = (b[32 + 32 * h + l] >> (2 * g)) & 3;
                        let hb = (b[l] >> (4 * h + g)) & 1;
                        u.q[128 * h + 32 * g + l] = (lo + 4 * hb) as i8 - 4;
                    }
                }
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            u.d = f16_at(b, 0);
            u.m = -f16_at(b, 2);
            let (sc, mn) = scales_k4(&b[4..16]);
            for s in 0..16 {
                u.sc[s] = sc[s / 2] as i16;
                u.mn[s] = mn[s / 2] as i16;
            }
            let five = ty == QuantType::Q5_K;
            let qs = if five { 48 } else { 16 };
            // Run c of 32 bytes: weights 64c + l (low nibbles) and 64c + 32 + l (high); Q5_K's
            // fifth bit of weight 32j + l is bit j of qh[l].
            for c in 0..4 {
                for l in 0..32 {
                    let v = b[qs + 32 * c + l];
                    let (mut lo, mut hi) = (v & 15, v >> 4);
                    if five {
                        let h = b[16 + l];
                        lo |= ((h >> (2 * c)) & 1) << 4;
                        hi |= ((h >> (2 * c + 1)) & 1) << 4;
                    }
                    u.q[64 * c + l] = lo as i8;
                    u.q[64 * c + 32 + l] = hi as i8;
                }
            }
        }
        QuantType::Q6_K => {
            u.d = f16_at(b, 208);
            u.m = 0.0;
            for s in 0..16 {
                u.sc[s] = b[192 + s] as i8 as i16;
            }
            // Half h: weight 128h + 32g + l takes a nibble of ql (g = 0, 1: low nibble of
            // ql[64h + 32g + l]; g = 2, 3: high nibble of ql[64h + 32(g - 2) + l]) and bits 2g
            // of qh[32h + l] above it.
            for h in 0..2 {
                for g in 0..4 {
                    for l in 0..32 {
                        let ql = b[64 * h + 32 * (g % 2) + l];
                        let nib = if g < 2 { ql & 15 } else { ql >> 4 };
                        let top = (b[128 + 32 * h + l] >> (2 * g)) & 3;
                        u.q[128 * h + 32 * g + l] = (nib | top << 4) as i8 - 32;
                    }
                }
            }
        }
        _ => unreachable!("not a K-quant: {ty:?}"),
    }
}

/// Quantizes 256 values into one super-block: per sub-block, a scale (and minimum) search;
/// then the sub-block scales quantized against the largest; then the levels recomputed from
/// the stored (rounded) scales.
pub(super) fn quantize(ty: QuantType, x: &[f32], b: &mut [u8]) {
    debug_assert_eq!(x.len(), 256);
    b.fill(0);
    match ty {
        QuantType::Q2_K => quantize_affine(x, b, 16, 3, 15),
        QuantType::Q4_K => quantize_affine(x, b, 32, 15, 63),
        QuantType::Q5_K => quantize_affine(x, b, 32, 31, 63),
        QuantType::Q3_K => quantize_symmetric(x, b, 4, 32),
        QuantType::Q6_K => quantize_symmetric(x, b, 32, 128),
        _ => unreachable!("not a K-quant: {ty:?}"),
    }
}

/// Q2_K, Q4_K, Q5_K: sub-blocks of `sub` weights, levels `0..=nmax`, scales and mins stored in
/// `0..=smax`.
fn quantize_affine(x: &[f32], b: &mut [u8], sub: usize, nmax: i32, smax: i32) {
    let nsub = 256 / sub;
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    for j in 0..nsub {
        let xs = &x[sub * j..sub * (j + 1)];
        // Weights: the larger values matter more, plus a floor at the sub-block's RMS (Q2_K:
        // |x| alone), as ggml weighs them.
        let rms = (xs.iter().map(|v| v * v).sum::<f32>() / sub as f32).sqrt();
        let mut w = [0f32; 32];
        for (wi, &v) in w.iter_mut().zip(xs) {
            *wi = if sub == 16 { v.abs() } else { rms + v.abs() };
        }
        (scales[j], mins[j]) = fit_affine(xs, &w[..sub], nmax);
    }
    let max_scale = scales[..nsub].iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins[..nsub].iter().fold(0f32, |a, &v| a.max(v));
    let quant = |v: f32, max: f32| -> u8 {
        if max > 0.0 {
            round_i(v * smax as f32 / max).clamp(0, smax) as u8
        } else {
            0
        }
    };
    let (mut sc, mut mn) = ([0u8; 16], [0u8; 16]);
    for j in 0..nsub {
        sc[j] = quant(scales[j], max_scale);
        mn[j] = quant(mins[j], max_min);
    }
    // Where d and dmin go, and the levels' packing.
    let (d_off, m_off) = if sub == 16 { (80, 82) } else { (0, 2) };
    let d = put_f16(b, d_off, max_scale / smax as f32);
    let dmin = put_f16(b, m_off, max_min / smax as f32);
    let mut q = [0u8; 256];
    for j in 0..nsub {
        let ds = d * sc[j] as f32;
        let dm = dmin * mn[j] as f32;
        for l in 0..sub {
            let i = sub * j + l;
            q[i] = if ds > 0.0 {
                round_i((x[i] + dm) / ds).clamp(0, nmax) as u8
            } else {
                0
            };
        }
    }
    match nmax {
        3 => {
            for (o, (&s, &m)) in b[..16].iter_mut().zip(sc.iter().zip(&mn)) {
                *o = s | m << 4;
            }
            for h in 0..2 {
                for l in 0..32 {
                    let mut v = 0;
                    for g in 0..4 {
                        v |= q[128 * h + 32 * g + l] << (2 * g);
                    }
                    b[16 + 32 * h + l] = v;
                }
            }
        }
        _ => {
            let sc8: [u8; 8] = sc[..8].try_into().unwrap();
            let mn8: [u8; 8] = mn[..8].try_into().unwrap();
            pack_scales_k4(&sc8, &mn8, &mut b[4..16]);
            let five = nmax == 31;
            let qs = if five { 48 } else { 16 };
            for c in 0..4 {
                for l in 0..32 {
                    let (lo, hi) = (q[64 * c + l], q[64 * c + 32 + l]);
                    b[qs + 32 * c + l] = (lo & 15) | (hi & 15) << 4;
                    if five {
                        b[16 + l] |= (lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1);
                    }
                }
            }
        }
    }
}

/// Q3_K (levels -4..=3, scales 6-bit signed) and Q6_K (levels -32..=31, scales i8): sub-blocks
/// of 16, weights `x^2` (the large values dominate the error that matters).
fn quantize_symmetric(x: &[f32], b: &mut [u8], nmax: i32, smax: i32) {
    let mut scales = [0f32; 16];
    for (j, s) in scales.iter_mut().enumerate() {
        let xs = &x[16 * j..16 * j + 16];
        let mut w = [0f32; 16];
        for (wi, &v) in w.iter_mut().zip(xs) {
            *wi = v * v;
        }
        *s = fit_symmetric(xs, &w, nmax);
    }
    // The largest-magnitude scale lands on -smax (one more level on the negative side).
    let max = scales
        .iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    let mut sc = [0i8; 16];
    let d = if max != 0.0 {
        let iscale = -(smax as f32) / max;
        for (o, &s) in sc.iter_mut().zip(&scales) {
            *o = round_i(iscale * s).clamp(-smax, smax - 1) as i8;
        }
        1.0 / iscale
    } else {
        0.0
    };
    let d_off = if nmax == 4 { 108 } else { 208 };
    let d = put_f16(b, d_off, d);
    let mut q = [0u8; 256];
    for (j, &s) in sc.iter().enumerate() {
        let ds = d * s as f32;
        for i in 16 * j..16 * j + 16 {
            let v = if ds != 0.0 {
                round_i(x[i] / ds).clamp(-nmax, nmax - 1)
            } else {
                0
            };
            q[i] = (v + nmax) as u8;
        }
    }
    if nmax == 4 {
        pack_scales_q3k(&sc, &mut b[96..108]);
        for h in 0..2 {
            for l in 0..32 {
                let mut v = 0;
                for g in 0..4 {
                    let qi = q[128 * h + 32 * g + l];
                    v |= (qi & 3) << (2 * g);
                    b[l] |= (qi >> 2) << (4 * h + g);
                }
                b[32 + 32 * h + l] = v;
            }
        }
    } else {
        for (o, &s) in b[192..208].iter_mut().zip(&sc) {
            *o = s as u8;
        }
        for h in 0..2 {
            for l in 0..32 {
                let qv = |g: usize| q[128 * h + 32 * g + l];
                b[64 * h + l] = (qv(0) & 15) | (qv(2) & 15) << 4;
                b[64 * h + 32 + l] = (qv(1) & 15) | (qv(3) & 15) << 4;
                b[128 + 32 * h + l] =
                    (qv(0) >> 4) | (qv(1) >> 4) << 2 | (qv(2) >> 4) << 4 | (qv(3) >> 4) << 6;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{dequantize_row, quantize_row};
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;
    use half::f16;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    fn deq(ty: QuantType, b: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; 256];
        dequantize_row(ty, b, &mut out);
        out
    }

    /// Blocks built by hand, each weight worked out from the layout in the module doc.
    #[test]
    fn dequantize_known_blocks() {
        // Q4_K: d = 0.5, dmin = 0.25; scales[j] = j + 1, mins[j] = 2j (6 bits, packed);
        // nibbles: weight i has q = i % 16.
        let mut b = Vec::from(h(0.5));
        b.extend(h(0.25));
        let sc: [u8; 8] = std::array::from_fn(|j| j as u8 + 1 + if j >= 4 { 40 } else { 0 });
        let mn: [u8; 8] = std::array::from_fn(|j| 2 * j as u8 + if j >= 6 { 40 } else { 0 });
        let mut s = [0u8; 12];
        pack_scales_k4(&sc, &mn, &mut s);
        assert_eq!(scales_k4(&s), (sc, mn));
        b.extend(s);
        for c in 0..4 {
            for l in 0..32 {
                b.push((l % 16) as u8 | (((32 + l) % 16) as u8) << 4);
                let _ = c;
            }
        }
        let y = deq(QuantType::Q4_K, &b);
        for (i, &v) in y.iter().enumerate() {
            let j = i / 32;
            let want = 0.5 * sc[j] as f32 * (i % 16) as f32 - 0.25 * mn[j] as f32;
            assert_eq!(v, want, "Q4_K {i}");
        }
        // Q5_K: the same plus qh: every weight of sub-blocks 1 and 6 gets +16.
        let mut b5 = b[..16].to_vec();
        b5.extend([(1u8 << 1) | (1 << 6); 32]);
        b5.extend(&b[16..]);
        let y = deq(QuantType::Q5_K, &b5);
        for (i, &v) in y.iter().enumerate() {
            let j = i / 32;
            let q = (i % 16) as f32 + if j == 1 || j == 6 { 16.0 } else { 0.0 };
            let want = 0.5 * sc[j] as f32 * q - 0.25 * mn[j] as f32;
            assert_eq!(v, want, "Q5_K {i}");
        }
        // Q6_K: ql = 0x21 everywhere (low nibble 1, high 2), qh = 0b11_10_01_00 (run g gets
        // top bits g), scales[s] = s - 8, d = 0.125. q = nib + 16 g - 32.
        let mut b = vec![0x21u8; 128];
        b.extend([0b1110_0100u8; 64]);
        b.extend((0..16).map(|s| (s as i8 - 8) as u8));
        b.extend(h(0.125));
        let y = deq(QuantType::Q6_K, &b);
        for (i, &v) in y.iter().enumerate() {
            let g = (i % 128) / 32;
            let nib = if g < 2 { 1.0 } else { 2.0 };
            let q = nib + 16.0 * g as f32 - 32.0;
            let want = 0.125 * ((i / 16) as f32 - 8.0) * q;
            assert_eq!(v, want, "Q6_K {i}");
        }
        // Q3_K: hmask bit g' set for even g' only; qs = 0b11_10_01_00 (run g has low bits g);
        // scales s -> s - 32 + 40 = s + 8; d = 0.5. q = g + 4 hb - 4.
        let mut b = vec![0b0101_0101u8; 32];
        b.extend([0b1110_0100u8; 64]);
        let sc: [i8; 16] = std::array::from_fn(|s| s as i8 + 8);
        let mut s = [0u8; 12];
        pack_scales_q3k(&sc, &mut s);
        assert_eq!(scales_q3k(&s), sc);
        b.extend(s);
        b.extend(h(0.5));
        let y = deq(QuantType::Q3_K, &b);
        for (i, &v) in y.iter().enumerate() {
            let gg = i / 32;
            let q = (gg % 4) as f32 + if gg % 2 == 0 { 4.0 } else { 0.0 } - 4.0;
            let want = 0.5 * sc[i / 16] as f32 * q;
            assert_eq!(v, want, "Q3_K {i}");
        }
        // Q2_K: scales[s] = s % 16 | (15 - s) << 4; qs = 0b11_10_01_00; d = 1, dmin = 0.5.
        let mut b: Vec<u8> = (0..16u8).map(|s| s | (15 - s) << 4).collect();
        b.extend([0b1110_0100u8; 64]);
        b.extend(h(1.0));
        b.extend(h(0.5));
        let y = deq(QuantType::Q2_K, &b);
        for (i, &v) in y.iter().enumerate() {
            let s = i / 16;
            let q = ((i % 128) / 32) as f32;
            let want = s as f32 * q - 0.5 * (15 - s) as f32;
            assert_eq!(v, want, "Q2_K {i}");
        }
    }

    /// Root-mean-square round-trip error relative to the data's RMS, on Gaussian-like rows at
    /// three magnitudes: the bounds sit about 1.5x above what the searches reach (measured:
    /// Q2_K 0.28, Q3_K 0.145, Q4_K 0.068, Q5_K 0.034, Q6_K 0.017; 0.021 at x0.001, where d
    /// is an f16 subnormal).
    #[test]
    fn quantize_round_trip_error_bounds() {
        let mut rng = Rng(5);
        for (ty, bound) in [
            (QuantType::Q2_K, 0.45),
            (QuantType::Q3_K, 0.22),
            (QuantType::Q4_K, 0.10),
            (QuantType::Q5_K, 0.05),
            (QuantType::Q6_K, 0.03),
        ] {
            for scale in [1.0f32, 1e-3, 50.0] {
                // Sums of uniforms: roughly Gaussian, with occasional larger values.
                let x: Vec<f32> = (0..256 * 16)
                    .map(|_| (rng.signed() + rng.signed() + rng.signed()) * scale)
                    .collect();
                let rel = super::super::round_trip_rel_rms(ty, &x);
                assert!(rel < bound, "{ty:?} x{scale}: relative RMS error {rel}");
            }
            let x = vec![0f32; 256];
            let mut q = vec![0u8; ty.block_bytes()];
            quantize_row(ty, &x, &mut q);
            assert!(deq(ty, &q).iter().all(|&v| v == 0.0), "{ty:?}");
        }
    }
}
