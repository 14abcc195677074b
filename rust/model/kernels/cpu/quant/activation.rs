//! Activation rows quantized to 8 bits, once per linear call, so that the dot products with the
//! weights' small integers are integer dot products (exact, whatever their order).
//!
//! Two formats, by the weight type they meet:
//! - **B32** (32-weight types): per block of 32, an f32 scale `d = amax / 127`, the 32 values
//!   `round(x / d)` as i8, and their i32 sum (what the offsets and minimums of Q4_0 .. Q5_1
//!   multiply).
//! - **K256** (K-quants, IQ4_XS): per block of 256, one f32 scale, 256 i8, and 16 i16 sums of 16
//!   (a sub-block's minimum or offset costs one multiply-add per 16, not one per weight).
//!
//! Layout, made for the SIMD tiles: the i8 values of token `t` are `qs[t*k .. (t+1)*k]`; scales
//! (and B32 sums) are grouped by 4 tokens, `d[((t / 4) * nb + b) * 4 + t % 4]`, so that a tile of
//! up to 4 tokens reads one block's scales with one load; the K256 sums are `bsums[t*k/16 + s]`.
//!
//! The rounding is round-to-nearest-even through the 1.5 * 2^23 trick (exact, vectorizes on
//! every target): all instruction sets share this code, so they see the same integers.

use rayon::prelude::*;

/// Which activation format a weight type meets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    B32,
    K256,
}

impl ActFormat {
    pub fn block(self) -> usize {
        match self {
            ActFormat::B32 => 32,
            ActFormat::K256 => 256,
        }
    }
}

/// Owned buffers for up to `max_tokens` rows of up to `max_cols` values (allocated once).
pub struct ActBuf {
    fmt: ActFormat,
    qs: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i32>,
    bsums: Vec<i16>,
}

/// A quantized activation matrix of `n` rows of `k` values.
#[derive(Clone, Copy)]
pub struct Act<'a> {
    pub fmt: ActFormat,
    pub n: usize,
    pub k: usize,
    /// Blocks per row.
    pub nb: usize,
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub sums: &'a [i32],
    pub bsums: &'a [i16],
}

impl Act<'_> {
    /// Index of token `t`, block `b` in `d` and `sums`.
    #[inline(always)]
    pub fn at(&self, t: usize, b: usize) -> usize {
        ((t / 4) * self.nb + b) * 4 + t % 4
    }

    /// The i8 values of token `t`, block `b`.
    #[inline(always)]
    pub fn block_qs(&self, t: usize, b: usize) -> &[i8] {
        let be = self.fmt.block();
        &self.qs[t * self.k + b * be..t * self.k + (b + 1) * be]
    }

    /// The 16 sums of 16 of token `t`, super-block `b` (K256).
    #[inline(always)]
    pub fn block_bsums(&self, t: usize, b: usize) -> &[i16] {
        let s = t * self.k / 16 + b * 16;
        &self.bsums[s..s + 16]
    }
}

impl ActBuf {
    pub fn new(fmt: ActFormat, max_tokens: usize, max_cols: usize) -> Self {
        let k = max_cols.next_multiple_of(fmt.block());
        let groups = max_tokens.div_ceil(4);
        let scales = groups * 4 * (k / fmt.block());
        ActBuf {
            fmt,
            qs: vec![0; max_tokens * k],
            d: vec![0.0; scales],
            sums: if fmt == ActFormat::B32 {
                vec![0; scales]
            } else {
                Vec::new()
            },
            bsums: if fmt == ActFormat::K256 {
                vec![0; max_tokens * k / 16]
            } else {
                Vec::new()
            },
        }
    }

    pub fn bytes(&self) -> usize {
        self.qs.capacity()
            + 4 * self.d.capacity()
            + 4 * self.sums.capacity()
            + 2 * self.bsums.capacity()
    }

    /// Whether `n` rows of `k` values fit.
    pub fn fits(&self, n: usize, k: usize) -> bool {
        let nb = k / self.fmt.block();
        n * k <= self.qs.len() && n.div_ceil(4) * 4 * nb <= self.d.len()
    }

    /// Quantizes `x` (`n` rows of `k`, `k` a multiple of the block) into the buffers.
    pub fn quantize(&mut self, x: &[f32], n: usize, k: usize) -> Act<'_> {
        let be = self.fmt.block();
        assert!(
            k.is_multiple_of(be),
            "activation: k = {k} is not whole blocks"
        );
        assert!(
            self.fits(n, k),
            "activation buffer too small for [{n}, {k}]"
        );
        assert_eq!(x.len(), n * k);
        let nb = k / be;
        let groups = n.div_ceil(4);
        let fmt = self.fmt;
        let ptrs = Ptrs {
            qs: self.qs.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
            bsums: self.bsums.as_mut_ptr(),
        };
        // One work item per group of 4 tokens: its values, scales and sums are contiguous.
        let work = |g: usize| {
            // The whole struct (Sync), not its pointer fields (closures capture fields).
            let out = ptrs;
            let tn = (n - 4 * g).min(4);
            // SAFETY: `fits` checked the lengths; group g alone writes tokens 4g .. 4g + tn
            // (their values and sums) and its own 4 * nb scales.
            let (qs, d) = unsafe {
                (
                    std::slice::from_raw_parts_mut(out.qs.add(4 * g * k), tn * k),
                    std::slice::from_raw_parts_mut(out.d.add(4 * g * nb), 4 * nb),
                )
            };
            for tt in 0..tn {
                let xr = &x[(4 * g + tt) * k..(4 * g + tt + 1) * k];
                let qr = &mut qs[tt * k..(tt + 1) * k];
                for b in 0..nb {
                    let qb = &mut qr[b * be..(b + 1) * be];
                    d[b * 4 + tt] = quantize_block(&xr[b * be..(b + 1) * be], qb);
                    // SAFETY: as above (B32: this group's sums; K256: this token's bsums).
                    unsafe {
                        match fmt {
                            ActFormat::B32 => {
                                *out.sums.add(4 * g * nb + b * 4 + tt) =
                                    qb.iter().map(|&v| v as i32).sum()
                            }
                            ActFormat::K256 => {
                                for (s, q16) in qb.chunks_exact(16).enumerate() {
                                    *out.bsums.add((4 * g + tt) * k / 16 + b * 16 + s) =
                                        q16.iter().map(|&v| v as i16).sum();
                                }
                            }
                        }
                    }
                }
            }
        };
        // Rayon's fork and join cost more than a few rows take.
        if n > 16 {
            (0..groups).into_par_iter().for_each(work);
        } else {
            (0..groups).for_each(work);
        }
        Act {
            fmt,
            n,
            k,
            nb,
            qs: &self.qs[..n * k],
            d: &self.d[..groups * 4 * nb],
            sums: if fmt == ActFormat::B32 {
                &self.sums[..groups * 4 * nb]
            } else {
                &[]
            },
            bsums: if fmt == ActFormat::K256 {
                &self.bsums[..n * k / 16]
            } else {
                &[]
            },
        }
    }
}

/// The buffers' pointers, for the work items that fill disjoint parts of them.
#[derive(Clone, Copy)]
struct Ptrs {
    qs: *mut i8,
    d: *mut f32,
    sums: *mut i32,
    bsums: *mut i16,
}
// SAFETY: each work item writes its own group's elements only.
unsafe impl Send for Ptrs {}
unsafe impl Sync for Ptrs {}

/// `q = round(x * 127 / amax)` for one block; returns the scale `amax / 127` (0 for a zero
/// block, whose values are all 0).
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    // Eight lanes of running maxima: vectorizes without reassociating anything that matters
    // (max is exact in any order).
    let mut m = [0f32; 8];
    for c in x.chunks_exact(8) {
        for l in 0..8 {
            m[l] = m[l].max(c[l].abs());
        }
    }
    let amax = m.iter().fold(0f32, |a, &v| a.max(v));
    let d = amax / 127.0;
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        // |v * id| <= 127 (up to rounding): well inside the trick's range; the clamp only
        // guards against that rounding.
        let r = (v * id + MAGIC) - MAGIC;
        *o = r.clamp(-127.0, 127.0) as i8;
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;

    /// Every value is within half a step of its block's scale; sums are the sums; the layout
    /// puts each token's scales where `Act::at` says; odd token counts and zero blocks work.
    #[test]
    fn quantized_rows_are_close_and_laid_out() {
        let mut rng = Rng(3);
        for fmt in [ActFormat::B32, ActFormat::K256] {
            let k = 512;
            let mut buf = ActBuf::new(fmt, 37, k);
            for n in [1usize, 5, 37] {
                let mut x = rng.vec(n * k);
                x[..fmt.block()].fill(0.0);
                let act = buf.quantize(&x, n, k);
                for t in 0..n {
                    for b in 0..act.nb {
                        let d = act.d[act.at(t, b)];
                        let q = act.block_qs(t, b);
                        let xb = &x[t * k + b * fmt.block()..][..fmt.block()];
                        for (&qv, &xv) in q.iter().zip(xb) {
                            assert!((qv as f32 * d - xv).abs() <= 0.5 * d * 1.0001 + 1e-30);
                        }
                        match fmt {
                            ActFormat::B32 => assert_eq!(
                                act.sums[act.at(t, b)],
                                q.iter().map(|&v| v as i32).sum::<i32>()
                            ),
                            ActFormat::K256 => {
                                for (s, &bs) in act.block_bsums(t, b).iter().enumerate() {
                                    let want: i32 =
                                        q[16 * s..16 * s + 16].iter().map(|&v| v as i32).sum();
                                    assert_eq!(bs as i32, want);
                                }
                            }
                        }
                    }
                }
                assert_eq!(act.d[act.at(0, 0)], 0.0);
            }
        }
    }
}
