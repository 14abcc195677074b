//! The non-linear 4-bit formats: each 4-bit index picks one of 16 fixed levels
//! ([`LEVELS`], denser near zero, where most weights are).
//!
//! - **IQ4_NL** (18 bytes / 32 weights): `d`, `qs[16]`; weight `i` = `d * LEVELS[nib(i)]`, the
//!   nibbles laid out as Q4_0's (low nibbles: weights 0-15, high: 16-31).
//! - **IQ4_XS** (136 bytes / 256 weights): `d`, u16 `scales_h`, `scales_l[4]`, `qs[128]`; eight
//!   sub-blocks of 32, each an IQ4_NL block's nibbles with a 6-bit scale `ls` (low 4 bits: nibble
//!   `j % 2` of `scales_l[j / 2]`; top 2: bits `2j` of `scales_h`): weight = `d (ls - 32) LEVELS`.

use super::search::{fit_table, nearest_level};
use super::{f16_at, put_f16, round_i, QuantType, Unpacked};

/// The 16 levels of ggml's `kvalues_iq4nl`.
pub const LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

pub(super) fn unpack(ty: QuantType, b: &[u8], u: &mut Unpacked) {
    u.d = f16_at(b, 0);
    u.m = 0.0;
    let nibbles = |qs: &[u8], q: &mut [i8]| {
        for j in 0..16 {
            q[j] = LEVELS[(qs[j] & 15) as usize];
            q[j + 16] = LEVELS[(qs[j] >> 4) as usize];
        }
    };
    match ty {
        QuantType::IQ4_NL => nibbles(&b[2..18], &mut u.q[..32]),
        QuantType::IQ4_XS => {
            let high = u16::from_le_bytes([b[2], b[3]]);
            for j in 0..8 {
                let ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) as i16
                    | (((high >> (2 * j)) & 3) as i16) << 4;
                u.sc[2 * j] = ls - 32;
                u.sc[2 * j + 1] = ls - 32;
                nibbles(&b[8 + 16 * j..24 + 16 * j], &mut u.q[32 * j..32 * j + 32]);
            }
        }
        _ => unreachable!("not an IQ4 type: {ty:?}"),
    }
}

/// Packs 32 level indices as Q4_0 nibbles.
fn pack_nibbles(idx: &[u8], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = idx[j] | idx[j + 16] << 4;
    }
}

/// Quantizes one block: a scale search per 32 weights (weights `x^2`), then (IQ4_XS) the
/// sub-block scales quantized to 6 bits against the largest, and the indices recomputed from
/// the stored scales.
pub(super) fn quantize(ty: QuantType, x: &[f32], b: &mut [u8]) {
    b.fill(0);
    let fit = |xs: &[f32]| {
        let mut w = [0f32; 32];
        for (wi, &v) in w.iter_mut().zip(xs) {
            *wi = v * v;
        }
        fit_table(xs, &w, &LEVELS)
    };
    let indices = |xs: &[f32], d: f32, idx: &mut [u8; 32]| {
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (o, &v) in idx.iter_mut().zip(xs) {
            *o = nearest_level(&LEVELS, v * id) as u8;
        }
    };
    let mut idx = [0u8; 32];
    match ty {
        QuantType::IQ4_NL => {
            let d = put_f16(b, 0, fit(x));
            indices(x, d, &mut idx);
            pack_nibbles(&idx, &mut b[2..18]);
        }
        QuantType::IQ4_XS => {
            let scales: [f32; 8] = std::array::from_fn(|j| fit(&x[32 * j..32 * j + 32]));
            let max = scales
                .iter()
                .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
            // The largest-magnitude scale maps to -32 (6-bit signed: -32 ..= 31).
            let d = put_f16(b, 0, max / -32.0);
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut high = 0u16;
            for j in 0..8 {
                let ls = round_i(scales[j] * id).clamp(-32, 31);
                let l = (ls + 32) as u16;
                b[4 + j / 2] |= ((l & 15) as u8) << (4 * (j % 2));
                high |= (l >> 4) << (2 * j);
                indices(&x[32 * j..32 * j + 32], d * ls as f32, &mut idx);
                pack_nibbles(&idx, &mut b[8 + 16 * j..24 + 16 * j]);
            }
            b[2..4].copy_from_slice(&high.to_le_bytes());
        }
        _ => unreachable!("not an IQ4 type: {ty:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{dequantize_row, round_trip_rel_rms};
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;
    use half::f16;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn dequantize_known_blocks() {
        // IQ4_NL: d = 0.5, byte j = j | (15 - j) << 4.
        let mut b = Vec::from(h(0.5));
        b.extend((0..16u8).map(|j| j | (15 - j) << 4));
        let mut y = [0f32; 32];
        dequantize_row(QuantType::IQ4_NL, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 * LEVELS[j] as f32);
            assert_eq!(y[j + 16], 0.5 * LEVELS[15 - j] as f32);
        }
        // IQ4_XS: d = 0.25, ls_j = 32 + 3j - 10 (low nibble / top bits split), sub-block j's
        // nibbles all j (low) and 15 - j (high).
        let ls: [u16; 8] = std::array::from_fn(|j| 32 + 3 * j as u16 - 10);
        let mut b = Vec::from(h(0.25));
        let high = (0..8).fold(0u16, |a, j| a | (ls[j] >> 4) << (2 * j));
        b.extend(high.to_le_bytes());
        b.extend((0..4).map(|i| (ls[2 * i] & 15) as u8 | ((ls[2 * i + 1] & 15) as u8) << 4));
        for j in 0..8u8 {
            b.extend([j | (15 - j) << 4; 16]);
        }
        let mut y = [0f32; 256];
        dequantize_row(QuantType::IQ4_XS, &b, &mut y);
        for (i, &v) in y.iter().enumerate() {
            let j = i / 32;
            let nib = if i % 32 < 16 { j } else { 15 - j };
            let want = (0.25 * (ls[j] as f32 - 32.0)) * LEVELS[nib] as f32;
            assert_eq!(v, want, "{i}");
        }
    }

    #[test]
    fn quantize_round_trip_error_bounds() {
        let mut rng = Rng(9);
        for ty in [QuantType::IQ4_NL, QuantType::IQ4_XS] {
            for scale in [1.0f32, 1e-3, 50.0] {
                let x: Vec<f32> = (0..256 * 8)
                    .map(|_| (rng.signed() + rng.signed() + rng.signed()) * scale)
                    .collect();
                let rel = round_trip_rel_rms(ty, &x);
                // Measured 0.072 (IQ4_NL) and 0.073 (IQ4_XS): Q4_K's quality in 4.25-4.5 bits.
                assert!(rel < 0.11, "{ty:?} x{scale}: relative RMS error {rel}");
            }
        }
    }
}
