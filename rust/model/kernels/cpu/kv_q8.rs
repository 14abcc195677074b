//! 8-bit K/V (`q8_0`): each head's vector of `head_dim` values is cut into groups of [`QK`] (32)
//! consecutive elements, each stored as 32 int8 `q` and one f16 scale `d` (value = q * d), as
//! ggml's `block_q8_0` (34 bytes per 32 values, 53% of f16). A head_dim that is not a multiple
//! of 32 ends in a shorter group with a scale of its own (head_dim 16: 18 bytes a head).
//!
//! **Quantization** (the K/V write): `d = amax / 127` rounded *up* to an f16 (so that `|x| / d <=
//! 127` and nothing clips), `q = round(x / d)` to nearest (ties away from zero, as ggml's
//! `roundf`): the round trip is within `d / 2`, i.e. `amax / 254` times `1 + 2^-10` at most (the
//! rounding of `d` to f16; below f16's normal range, 6.1e-5, within half an f16 step more).
//!
//! **Dequantization** is `q as f32 * d as f32`, exact in f32 (8 by 11 significant bits): every
//! ISA, and a dequantized f32 copy of the cache, give the attention kernel the same values, so
//! its batch invariance and bit-for-bit agreement across ISAs hold as for f16.
//!
//! **Layout** (per layer, as the f16 cache's: K transposed per block, V row-major; `rb =
//! row_bytes(hd)`, `G = groups(hd)`):
//! - V `[num_blocks, block_size, kv_heads]` rows of `rb` bytes, each ggml's blocks in order:
//!   `[d: f16][q: 32 x i8]` per group (the last group shorter when `hd % 32 != 0`).
//! - K: per (block, K/V head) a chunk of `block_size * rb` bytes: the `q` transposed,
//!   `[hd][block_size]` i8 (element `d` of consecutive keys contiguous, as the kernel scores 16
//!   keys at a time), then the scales `[G][block_size]` f16 (group `j` of consecutive keys
//!   contiguous). The bytes per block are ggml's (`kv_heads * block_size * rb`); only the order
//!   differs: ggml's per-key blocks would make the kernel gather 16 keys' element `d` from 16
//!   places (and their 16 scales from 16 more) for every `d` of every tile, where this layout
//!   gives it one 16-byte load of `q` per `d` and one 32-byte load of scales per group.
//!
//! Scales sit at any byte offset (an odd head_dim makes odd rows): they are read unaligned.

use half::f16;

/// Elements per group (ggml's QK8_0).
pub const QK: usize = 32;

/// Groups (scales) of one head's vector.
pub fn groups(head_dim: usize) -> usize {
    head_dim.div_ceil(QK)
}

/// Bytes of one head's vector of `head_dim` values: the int8s and one f16 scale per group.
pub fn row_bytes(head_dim: usize) -> usize {
    head_dim + 2 * groups(head_dim)
}

/// The scale of a group whose largest magnitude is `amax`: `amax / 127` rounded up to an f16
/// (the largest finite one at most). 0 for a group of zeros (or NaNs).
pub fn scale(amax: f32) -> f16 {
    let d = amax / 127.0;
    if d.is_nan() || d <= 0.0 {
        return f16::ZERO;
    }
    if d >= f16::MAX.to_f32() {
        return f16::MAX;
    }
    let s = f16::from_f32(d);
    if s.to_f32() < d {
        // The next f16 up (d is positive and finite, below f16::MAX: its bits + 1).
        f16::from_bits(s.to_bits() + 1)
    } else {
        s
    }
}

/// `round(x / d)` as an int8 (0 when `d` is 0).
#[inline(always)]
fn quantize(x: f32, d: f32) -> i8 {
    if d == 0.0 {
        return 0;
    }
    // `as` saturates (and maps NaN to 0); |x| / d <= 127 by the choice of d anyway.
    (x / d).round().clamp(-127.0, 127.0) as i8
}

/// Reads the f16 at byte `at` of `b` (any alignment).
#[inline(always)]
pub fn f16_at(b: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn put_f16(b: &mut [u8], at: usize, x: f16) {
    b[at..at + 2].copy_from_slice(&x.to_bits().to_le_bytes());
}

/// Where the chunk of (block, K/V head `g`) starts in a layer's K bytes.
#[inline(always)]
pub fn k_chunk(block: usize, g: usize, bs: usize, kvh: usize, hd: usize) -> usize {
    (block * kvh + g) * bs * row_bytes(hd)
}

/// Where the q of element `d` of K/V head `g` at cache row `slot` lies in a layer's K bytes.
#[inline(always)]
pub fn k_q_at(slot: usize, g: usize, d: usize, bs: usize, kvh: usize, hd: usize) -> usize {
    k_chunk(slot / bs, g, bs, kvh, hd) + d * bs + slot % bs
}

/// Where the scale of group `j` of K/V head `g` at cache row `slot` lies in a layer's K bytes.
#[inline(always)]
pub fn k_scale_at(slot: usize, g: usize, j: usize, bs: usize, kvh: usize, hd: usize) -> usize {
    k_chunk(slot / bs, g, bs, kvh, hd) + hd * bs + 2 * (j * bs + slot % bs)
}

/// Where the row of K/V head `g` at cache row `slot` starts in a layer's V bytes.
#[inline(always)]
pub fn v_row_at(slot: usize, g: usize, kvh: usize, hd: usize) -> usize {
    (slot * kvh + g) * row_bytes(hd)
}

/// The values of group `j` of a head: `j * QK..min((j + 1) * QK, hd)`.
#[inline(always)]
fn group_range(j: usize, hd: usize) -> std::ops::Range<usize> {
    j * QK..((j + 1) * QK).min(hd)
}

/// The scale of each group of `x` (one head's vector).
fn group_scales(x: &[f32], j: usize) -> f16 {
    let amax = x[group_range(j, x.len())]
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()));
    scale(amax)
}

/// Quantizes one token's K (`kv_heads * head_dim` values) into cache row `slot` of a layer's K
/// bytes (transposed, see the module docs).
pub fn write_k(k: &mut [u8], slot: usize, row: &[f32], bs: usize, kvh: usize, hd: usize) {
    for g in 0..kvh {
        let x = &row[g * hd..(g + 1) * hd];
        for j in 0..groups(hd) {
            let s = group_scales(x, j);
            put_f16(k, k_scale_at(slot, g, j, bs, kvh, hd), s);
            let d = s.to_f32();
            for e in group_range(j, hd) {
                k[k_q_at(slot, g, e, bs, kvh, hd)] = quantize(x[e], d) as u8;
            }
        }
    }
}

/// Quantizes one token's V (`kv_heads * head_dim` values) into cache row `slot` of a layer's V
/// bytes (ggml's blocks, see the module docs).
pub fn write_v(v: &mut [u8], slot: usize, row: &[f32], kvh: usize, hd: usize) {
    for g in 0..kvh {
        let x = &row[g * hd..(g + 1) * hd];
        let at = v_row_at(slot, g, kvh, hd);
        for j in 0..groups(hd) {
            let s = group_scales(x, j);
            let base = at + j * (QK + 2);
            put_f16(v, base, s);
            let d = s.to_f32();
            for (i, e) in group_range(j, hd).enumerate() {
                v[base + 2 + i] = quantize(x[e], d) as u8;
            }
        }
    }
}

/// Element `d` of K/V head `g` at cache row `slot`, dequantized, from a layer's K bytes.
pub fn k_get(k: &[u8], slot: usize, g: usize, d: usize, bs: usize, kvh: usize, hd: usize) -> f32 {
    let q = k[k_q_at(slot, g, d, bs, kvh, hd)] as i8;
    q as f32 * f16_at(k, k_scale_at(slot, g, d / QK, bs, kvh, hd)).to_f32()
}

/// Element `d` of K/V head `g` at cache row `slot`, dequantized, from a layer's V bytes.
pub fn v_get(v: &[u8], slot: usize, g: usize, d: usize, kvh: usize, hd: usize) -> f32 {
    let base = v_row_at(slot, g, kvh, hd) + d / QK * (QK + 2);
    let q = v[base + 2 + d % QK] as i8;
    q as f32 * f16_at(v, base).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;

    #[test]
    fn sizes_are_ggmls() {
        assert_eq!((groups(64), row_bytes(64)), (2, 68), "34 bytes per 32");
        assert_eq!((groups(128), row_bytes(128)), (4, 136));
        assert_eq!((groups(16), row_bytes(16)), (1, 18), "a short group");
        assert_eq!((groups(67), row_bytes(67)), (3, 73));
    }

    #[test]
    fn scales_round_up_to_an_f16() {
        for amax in [1.0f32, 0.3, 7.77, 1e-3, 1e-7, 3e6, 1e30] {
            let s = scale(amax).to_f32();
            let d = amax / 127.0;
            assert!(s >= d.min(f16::MAX.to_f32()), "{amax}: {s} < {d}");
            if (6.1e-5..65504.0).contains(&d) {
                assert!(s <= d * (1.0 + 2f32.powi(-10)), "{amax}: {s} vs {d}");
            }
        }
        assert_eq!(scale(0.0), f16::ZERO);
        assert_eq!(scale(f32::NAN), f16::ZERO);
        assert_eq!(scale(f32::INFINITY), f16::MAX);
    }

    /// Every element of K and V comes back within amax/254 of its group (times 1 + 2^-10, the
    /// f16 rounding of the scale), for head dims with and without a short last group, values
    /// of every magnitude, and only its own row is written.
    #[test]
    fn write_and_read_round_trip_within_half_a_step() {
        let mut rng = Rng(7);
        for (kvh, hd, bs) in [
            (2usize, 64usize, 16usize),
            (3, 16, 4),
            (1, 67, 16),
            (2, 128, 8),
        ] {
            let rb = row_bytes(hd);
            let blocks = 3;
            let (mut k, mut v) = (
                vec![0u8; blocks * bs * kvh * rb],
                vec![0u8; blocks * bs * kvh * rb],
            );
            let mut rows = Vec::new();
            for slot in 0..blocks * bs {
                // Magnitudes from 1e-3 to 1e3 by row, one outlier per row.
                let m = 10f32.powi((slot % 7) as i32 - 3);
                let mut kr: Vec<f32> = (0..kvh * hd).map(|_| rng.signed() * m).collect();
                let vr: Vec<f32> = (0..kvh * hd).map(|_| rng.signed() * m).collect();
                kr[slot % (kvh * hd)] = 5.0 * m;
                write_k(&mut k, slot, &kr, bs, kvh, hd);
                write_v(&mut v, slot, &vr, kvh, hd);
                rows.push((kr, vr));
            }
            for (slot, (kr, vr)) in rows.iter().enumerate() {
                for g in 0..kvh {
                    for j in 0..groups(hd) {
                        let r = group_range(j, hd);
                        for is_k in [true, false] {
                            let x = if is_k { kr } else { vr };
                            let x = &x[g * hd..(g + 1) * hd];
                            let amax = x[r.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
                            // Half a step of d = amax / 127 (rounded up to an f16: a relative
                            // 2^-10 above it, or one subnormal step, 2^-24, below 6.1e-5).
                            let bound =
                                amax as f64 / 254.0 * (1.0 + 2f64.powi(-10)) + 2f64.powi(-25);
                            for e in r.clone() {
                                let got = if is_k {
                                    k_get(&k, slot, g, e, bs, kvh, hd)
                                } else {
                                    v_get(&v, slot, g, e, kvh, hd)
                                };
                                let err = (got as f64 - x[e] as f64).abs();
                                assert!(
                                    err <= bound,
                                    "hd {hd} slot {slot} g {g} e {e} (K: {is_k}): {got} vs {} \
                                     (amax {amax})",
                                    x[e]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_largest_magnitude_is_exact_and_zeros_stay_zero() {
        let (bs, kvh, hd) = (4, 1, 40);
        let mut k = vec![0u8; bs * kvh * row_bytes(hd)];
        let mut row = vec![0.0f32; hd];
        row[3] = -2.54;
        row[35] = 0.5;
        write_k(&mut k, 1, &row, bs, kvh, hd);
        // q = -127 at the group's amax: -127 * d with d >= 2.54 / 127 (rounded up).
        let s = scale(2.54).to_f32();
        assert_eq!(k_get(&k, 1, 0, 3, bs, kvh, hd), -127.0 * s);
        assert_eq!(
            k_get(&k, 1, 0, 35, bs, kvh, hd),
            127.0 * scale(0.5).to_f32()
        );
        assert_eq!(k_get(&k, 1, 0, 0, bs, kvh, hd), 0.0);
        // Other rows untouched.
        assert!((0..hd).all(|d| k_get(&k, 0, 0, d, bs, kvh, hd) == 0.0));
        assert!((0..hd).all(|d| k_get(&k, 2, 0, d, bs, kvh, hd) == 0.0));
    }
}
