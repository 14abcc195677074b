//! The 32-weight block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (ggml's `block_q4_0` ..
//! `block_q8_0`). Every block starts with its f16 scale `d`; then:
//!
//! | type | after `d`                  | weight `i`                    |
//! |------|----------------------------|-------------------------------|
//! | Q4_0 | `qs[16]`                   | `d * (nib(i) - 8)`            |
//! | Q4_1 | f16 `m`, `qs[16]`          | `d * nib(i) + m`              |
//! | Q5_0 | u32 `qh`, `qs[16]`         | `d * (nib(i) + 16 hb(i) - 16)`|
//! | Q5_1 | f16 `m`, u32 `qh`, `qs[16]`| `d * (nib(i) + 16 hb(i)) + m` |
//! | Q8_0 | `qs[32]` (i8)              | `d * qs[i]`                   |
//!
//! `nib(i)` is the low nibble of `qs[i]` for `i < 16` and the high nibble of `qs[i - 16]`
//! after; `hb(i)` is bit `i` of the little-endian `qh`.

use super::{f16_at, put_f16, round_i, QuantType, Unpacked};

/// Byte offset of `qs` in a block, and of `qh` (Q5 types).
fn layout(ty: QuantType) -> (usize, usize) {
    match ty {
        QuantType::Q4_0 | QuantType::Q8_0 => (2, 0),
        QuantType::Q4_1 => (4, 0),
        QuantType::Q5_0 => (6, 2),
        QuantType::Q5_1 => (8, 4),
        _ => unreachable!("not a 32-weight legacy type: {ty:?}"),
    }
}

/// The block's integers with their offset applied (Q4_0: -8 .. 7), `d`, and `m` (Q4_1, Q5_1).
pub(super) fn unpack(ty: QuantType, b: &[u8], u: &mut Unpacked) {
    let (qs, qh) = layout(ty);
    u.d = f16_at(b, 0);
    u.m = if ty.has_min() { f16_at(b, 2) } else { 0.0 };
    if ty == QuantType::Q8_0 {
        for (q, &v) in u.q[..32].iter_mut().zip(&b[2..34]) {
            *q = v as i8;
        }
        return;
    }
    let high = if qh > 0 {
        u32::from_le_bytes([b[qh], b[qh + 1], b[qh + 2], b[qh + 3]])
    } else {
        0
    };
    let offset = match ty {
        QuantType::Q4_0 => 8,
        QuantType::Q5_0 => 16,
        _ => 0,
    };
    for j in 0..16 {
        let v = b[qs + j];
        let lo = (v & 15) as i32 + 16 * ((high >> j) & 1) as i32;
        let hi = (v >> 4) as i32 + 16 * ((high >> (j + 16)) & 1) as i32;
        u.q[j] = (lo - offset) as i8;
        u.q[j + 16] = (hi - offset) as i8;
    }
}

/// Quantizes 32 values into one block. Symmetric types (Q4_0, Q5_0) map the value of largest
/// magnitude to the most negative level (-8 or -16), as ggml does, which gives one more level
/// on that side; the types with a minimum span `[min, max]`; Q8_0 maps `max |x|` to 127.
pub(super) fn quantize(ty: QuantType, x: &[f32], b: &mut [u8]) {
    debug_assert_eq!(x.len(), 32);
    b.fill(0);
    let (qs, qh) = layout(ty);
    let mut q = [0i32; 32];
    match ty {
        QuantType::Q8_0 => {
            let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let d = put_f16(b, 0, amax / 127.0);
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (o, &v) in b[2..34].iter_mut().zip(x) {
                *o = round_i(v * id).clamp(-127, 127) as i8 as u8;
            }
            return;
        }
        QuantType::Q4_0 | QuantType::Q5_0 => {
            let levels = if ty == QuantType::Q4_0 { 8 } else { 16 };
            let max = x
                .iter()
                .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
            let d = put_f16(b, 0, max / -(levels as f32));
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (o, &v) in q.iter_mut().zip(x) {
                *o = (round_i(v * id) + levels).clamp(0, 2 * levels - 1);
            }
        }
        QuantType::Q4_1 | QuantType::Q5_1 => {
            let top = if ty == QuantType::Q4_1 { 15 } else { 31 };
            let min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
            let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            let d = put_f16(b, 0, (max - min) / top as f32);
            let m = put_f16(b, 2, min);
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (o, &v) in q.iter_mut().zip(x) {
                *o = round_i((v - m) * id).clamp(0, top);
            }
        }
        _ => unreachable!("not a 32-weight legacy type: {ty:?}"),
    }
    let mut high = 0u32;
    for j in 0..16 {
        let (lo, hi) = (q[j] as u32, q[j + 16] as u32);
        b[qs + j] = ((lo & 15) | ((hi & 15) << 4)) as u8;
        high |= ((lo >> 4) & 1) << j | ((hi >> 4) & 1) << (j + 16);
    }
    if qh > 0 {
        b[qh..qh + 4].copy_from_slice(&high.to_le_bytes());
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

    /// Blocks built by hand, values worked out from the layout in the module doc.
    #[test]
    fn dequantize_known_blocks() {
        let mut out = [0f32; 32];
        // Q4_0: d = 0.5; byte j = (j & 15) | (15 - j) << 4 -> x[j] = (j - 8) / 2,
        // x[j + 16] = (7 - j) / 2.
        let mut b = Vec::from(h(0.5));
        b.extend((0..16u8).map(|j| j | (15 - j) << 4));
        dequantize_row(QuantType::Q4_0, &b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], (7.0 - j as f32) * 0.5);
        }
        // Q4_1: d = 2, m = -1: x = 2 * nib - 1.
        let mut b = Vec::from(h(2.0));
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| j | (15 - j) << 4));
        dequantize_row(QuantType::Q4_1, &b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 2.0 * j as f32 - 1.0);
            assert_eq!(out[j + 16], 2.0 * (15 - j) as f32 - 1.0);
        }
        // Q5_0: d = 0.25, nibbles all 3, qh = bits 1 and 17: x = 0.25 * (3 + 16 hb - 16).
        let mut b = Vec::from(h(0.25));
        b.extend((1u32 << 1 | 1 << 17).to_le_bytes());
        b.extend([0x33u8; 16]);
        dequantize_row(QuantType::Q5_0, &b, &mut out);
        for (i, &v) in out.iter().enumerate() {
            let hb = if i == 1 || i == 17 { 16.0 } else { 0.0 };
            assert_eq!(v, 0.25 * (3.0 + hb - 16.0), "{i}");
        }
        // Q5_1: d = 1, m = 0.5, nibbles 0x21 (lo 1, hi 2), qh = bit 31: x = nib + 16 hb + 0.5.
        let mut b = Vec::from(h(1.0));
        b.extend(h(0.5));
        b.extend((1u32 << 31).to_le_bytes());
        b.extend([0x21u8; 16]);
        dequantize_row(QuantType::Q5_1, &b, &mut out);
        for (i, &v) in out.iter().enumerate() {
            let want = if i < 16 {
                1.5
            } else if i == 31 {
                18.5
            } else {
                2.5
            };
            assert_eq!(v, want, "{i}");
        }
        // Q8_0: d = 0.125, qs[i] = i - 16.
        let mut b = Vec::from(h(0.125));
        b.extend((0..32i32).map(|i| (i - 16) as i8 as u8));
        dequantize_row(QuantType::Q8_0, &b, &mut out);
        for (i, &v) in out.iter().enumerate() {
            assert_eq!(v, 0.125 * (i as f32 - 16.0));
        }
    }

    /// Round trip on random rows: every value within half a step of the block's scale (plus
    /// the f16 rounding of the scale and minimum), and the scale about what the range implies.
    #[test]
    fn quantize_round_trip_error_bounds() {
        let mut rng = Rng(11);
        for ty in [
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q8_0,
        ] {
            for scale in [1.0f32, 1e-3, 300.0] {
                let x: Vec<f32> = rng.vec(32 * 8).iter().map(|v| v * scale).collect();
                let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
                quantize_row(ty, &x, &mut q);
                let mut y = vec![0f32; x.len()];
                dequantize_row(ty, &q, &mut y);
                for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
                    let amax = bx.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let range = if ty.has_min() {
                        bx.iter().fold(f32::MIN, |a, &v| a.max(v))
                            - bx.iter().fold(f32::MAX, |a, &v| a.min(v))
                    } else {
                        2.0 * amax
                    };
                    let levels = match ty {
                        QuantType::Q8_0 => 254.0,
                        QuantType::Q4_0 | QuantType::Q4_1 => 15.0,
                        _ => 31.0,
                    };
                    // Half a step, the clamp at the far end of Q4_0/Q5_0 (one more step), and
                    // the f16 rounding of d and m (relative 2^-11 of the range).
                    let step = range / levels;
                    let bound = 0.5 * step
                        + if ty.has_min() || ty == QuantType::Q8_0 {
                            0.0
                        } else {
                            step
                        }
                        + range * 2e-3;
                    for (a, b) in bx.iter().zip(by) {
                        assert!((a - b).abs() <= bound, "{ty:?}: {a} -> {b}, bound {bound}");
                    }
                }
            }
            // Zeros stay zeros.
            let x = vec![0f32; 32];
            let mut q = vec![0u8; ty.block_bytes()];
            quantize_row(ty, &x, &mut q);
            let mut y = vec![1f32; 32];
            dequantize_row(ty, &q, &mut y);
            assert!(y.iter().all(|&v| v == 0.0), "{ty:?}");
        }
    }
}
