//! Quantized weight formats: the block layouts of ggml (what GGUF files hold), read in place.
//!
//! A quantized matrix row is a run of blocks; each block packs `block_elems` weights into
//! `block_bytes` bytes (small integers and one or two scales). The types are the ones inside
//! the GGUF files people download (Q4_0, Q4_K_M, Q5_K_M, Q6_K and Q8_0 files).
//!
//! One file per format family, each with its scalar reference (unpack, dequantize, quantize,
//! integer block dot) and its tests: [`legacy`] (the 32-weight blocks Q4_0 .. Q8_0), [`kquants`]
//! (the 256-weight super-blocks Q2_K .. Q6_K), [`iq4`] (IQ4_NL, IQ4_XS). [`linear`] is the
//! linear-layer kernel on quantized weights; [`activation`] the 8-bit activation rows it uses;
//! [`interleave`] the layout of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K matrices that
//! the x86 kernels read fastest.

pub mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_x16;
#[cfg(target_arch = "x86_64")]
mod avx2_x16_b32;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_x16;
#[cfg(target_arch = "x86_64")]
mod avx512_x16_b32;
pub mod interleave;
pub mod iq4;
pub mod kquants;
pub mod legacy;
pub mod linear;
mod search;
#[cfg(target_arch = "x86_64")]
mod x86;

/// A ggml block format, by its GGUF name.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
}

impl QuantType {
    pub const ALL: [QuantType; 12] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
        QuantType::IQ4_NL,
        QuantType::IQ4_XS,
    ];

    /// The type's number in ggml's `ggml_type` enum (as GGUF tensor infos store it).
    pub fn ggml_id(self) -> u32 {
        match self {
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q8_0 => 8,
            QuantType::Q2_K => 10,
            QuantType::Q3_K => 11,
            QuantType::Q4_K => 12,
            QuantType::Q5_K => 13,
            QuantType::Q6_K => 14,
            QuantType::IQ4_NL => 20,
            QuantType::IQ4_XS => 23,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<QuantType> {
        QuantType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// The GGUF name ("Q4_K").
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q2_K => "Q2_K",
            QuantType::Q3_K => "Q3_K",
            QuantType::Q4_K => "Q4_K",
            QuantType::Q5_K => "Q5_K",
            QuantType::Q6_K => "Q6_K",
            QuantType::IQ4_NL => "IQ4_NL",
            QuantType::IQ4_XS => "IQ4_XS",
        }
    }

    /// The lowercase name ("q4_k"), as options and `engine.info` spell it.
    pub fn lower_name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q5_1 => "q5_1",
            QuantType::Q8_0 => "q8_0",
            QuantType::Q2_K => "q2_k",
            QuantType::Q3_K => "q3_k",
            QuantType::Q4_K => "q4_k",
            QuantType::Q5_K => "q5_k",
            QuantType::Q6_K => "q6_k",
            QuantType::IQ4_NL => "iq4_nl",
            QuantType::IQ4_XS => "iq4_xs",
        }
    }

    /// By GGUF name, case-insensitive ("q4_k", "Q8_0").
    pub fn from_name(name: &str) -> Option<QuantType> {
        QuantType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Weights per block.
    pub fn block_elems(self) -> usize {
        match self {
            QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::IQ4_NL => 32,
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
            | QuantType::IQ4_XS => 256,
        }
    }

    /// Bytes per block (ggml's `block_*` structs).
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q5_1 => 24,
            QuantType::Q8_0 => 34,
            QuantType::Q2_K => 84,
            QuantType::Q3_K => 110,
            QuantType::Q4_K => 144,
            QuantType::Q5_K => 176,
            QuantType::Q6_K => 210,
            QuantType::IQ4_NL => 18,
            QuantType::IQ4_XS => 136,
        }
    }

    /// Bytes of a row of `cols` weights; `None` unless `cols` is a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_elems()) {
            return None;
        }
        (cols / self.block_elems()).checked_mul(self.block_bytes())
    }
}

/// The weights of one block as small integers and integer scales, what both the dequantizer
/// and the integer dot products read: weight `i` is `d * sc[i / 16] * q[i] + m * mn[i / 16]`
/// (the second term only for the types with a minimum, see [`QuantType::has_min`]). The
/// 32-weight types have no sub-block scales: `sc` and `mn` are 1 there.
#[derive(Clone, Debug)]
pub struct Unpacked {
    pub q: [i8; 256],
    pub sc: [i16; 16],
    pub mn: [i16; 16],
    /// The block's scale (f16 widened, exact).
    pub d: f32,
    /// The scale of the minimum term: `m` (Q4_1, Q5_1) or `-dmin` (Q2_K, Q4_K, Q5_K); 0 else.
    pub m: f32,
}

impl Unpacked {
    fn new() -> Self {
        Unpacked {
            q: [0; 256],
            sc: [1; 16],
            mn: [1; 16],
            d: 0.0,
            m: 0.0,
        }
    }
}

impl QuantType {
    /// Whether a weight is `scale * q + min` (two terms per dot product) rather than `scale * q`.
    pub fn has_min(self) -> bool {
        matches!(
            self,
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q2_K | QuantType::Q4_K | QuantType::Q5_K
        )
    }

    /// Whether the type is a 256-weight super-block (the activation rows it meets carry one
    /// scale per 256 and sums per 16; the 32-weight types meet one scale and one sum per 32).
    pub fn is_k(self) -> bool {
        self.block_elems() == 256
    }
}

/// The integers and scales of one block of type `ty` (`block.len() == ty.block_bytes()`).
pub fn unpack(ty: QuantType, block: &[u8], u: &mut Unpacked) {
    debug_assert_eq!(block.len(), ty.block_bytes());
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q8_0 => {
            legacy::unpack(ty, block, u)
        }
        QuantType::Q2_K | QuantType::Q3_K | QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K => {
            kquants::unpack(ty, block, u)
        }
        QuantType::IQ4_NL | QuantType::IQ4_XS => iq4::unpack(ty, block, u),
    }
}

/// Dequantizes one row: `src` holds `ty.row_bytes(dst.len())` bytes. Each weight is computed as
/// ggml (and the `gguf` Python package) computes it, in f32: `(d * sc) * q` then `+ m * mn` (or
/// `- dmin * mn`), so the values are the same to the bit.
///
/// Panics unless `dst.len()` is a whole number of blocks and `src` is that many blocks.
pub fn dequantize_row(ty: QuantType, src: &[u8], dst: &mut [f32]) {
    let want = ty.row_bytes(dst.len());
    assert_eq!(
        Some(src.len()),
        want,
        "dequantize_row: {} row of {} values needs {want:?} bytes, got {}",
        ty.name(),
        dst.len(),
        src.len()
    );
    let (bb, be) = (ty.block_bytes(), ty.block_elems());
    let mut u = Unpacked::new();
    for (block, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
        unpack(ty, block, &mut u);
        if ty.is_k() {
            for (s, o16) in out.chunks_exact_mut(16).enumerate() {
                let dl = u.d * u.sc[s] as f32;
                let ml = u.m * u.mn[s] as f32;
                let q = &u.q[16 * s..16 * s + 16];
                for (o, &qv) in o16.iter_mut().zip(q) {
                    *o = if ty.has_min() {
                        dl * qv as f32 + ml
                    } else {
                        dl * qv as f32
                    };
                }
            }
        } else {
            for (o, &qv) in out.iter_mut().zip(&u.q[..32]) {
                *o = if ty.has_min() {
                    u.d * qv as f32 + u.m
                } else {
                    u.d * qv as f32
                };
            }
        }
    }
}

/// Quantizes one row: `dst` gets `ty.row_bytes(src.len())` bytes. The K-quants and IQ4 types
/// search their scales (weighted least squares over a grid of candidate scales, as ggml's
/// reference quantizers do) rather than take the block's range; the values are close to
/// ggml's, not bit-equal.
///
/// Panics unless `src.len()` is a whole number of blocks and `dst` has the row's bytes.
pub fn quantize_row(ty: QuantType, src: &[f32], dst: &mut [u8]) {
    let want = ty.row_bytes(src.len());
    assert_eq!(
        Some(dst.len()),
        want,
        "quantize_row: {} row of {} values needs {want:?} bytes, got {}",
        ty.name(),
        src.len(),
        dst.len()
    );
    let (bb, be) = (ty.block_bytes(), ty.block_elems());
    for (x, block) in src.chunks_exact(be).zip(dst.chunks_exact_mut(bb)) {
        match ty {
            QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0 => legacy::quantize(ty, x, block),
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K => kquants::quantize(ty, x, block),
            QuantType::IQ4_NL | QuantType::IQ4_XS => iq4::quantize(ty, x, block),
        }
    }
}

/// The f16 at `b[off..off + 2]`, widened (exact).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Stores `v` rounded to f16 at `b[off..off + 2]`; returns the stored value, widened.
#[inline(always)]
pub(crate) fn put_f16(b: &mut [u8], off: usize, v: f32) -> f32 {
    let h = half::f16::from_f32(v);
    b[off..off + 2].copy_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

/// Round to nearest (ties to even) for the quantizers, through the 1.5 * 2^23 trick: `round()`
/// is a libm call on baseline x86-64, and quantize-on-load rounds every weight of a model.
/// Inputs are clamped first (the trick needs |v| < 2^22); NaN gives 0.
#[inline(always)]
pub(crate) fn round_i(v: f32) -> i32 {
    round_f(v) as i32
}

/// [`round_i`] as a float (the same integer, exactly): no float-to-int conversion, so the
/// quantizers' search loops over a block vectorize.
#[inline(always)]
pub(crate) fn round_f(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    let v = if v.is_nan() {
        0.0
    } else {
        v.clamp(-4.0e6, 4.0e6)
    };
    (v + MAGIC) - MAGIC
}

/// Relative RMS error of `x` quantized to `ty` and read back (the quantizers' tests).
#[cfg(test)]
pub(crate) fn round_trip_rel_rms(ty: QuantType, x: &[f32]) -> f64 {
    let mut q = vec![0u8; ty.row_bytes(x.len()).expect("whole blocks")];
    quantize_row(ty, x, &mut q);
    let mut y = vec![0f32; x.len()];
    dequantize_row(ty, &q, &mut y);
    let err: f64 = x
        .iter()
        .zip(&y)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (err / norm).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for t in QuantType::ALL {
            assert_eq!(QuantType::from_ggml_id(t.ggml_id()), Some(t));
            assert_eq!(QuantType::from_name(&t.name().to_lowercase()), Some(t));
        }
        assert_eq!(QuantType::from_ggml_id(0), None); // F32 is not a block format
        assert_eq!(QuantType::Q4_K.row_bytes(2048), Some(8 * 144));
        assert_eq!(QuantType::Q4_K.row_bytes(2050), None);
    }
}
