//! The interleaved layout of quantized matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
//! Q6_K):
//! the same blocks, the same bits per weight, stored so that a group of 16 rows is one
//! sequential stream with its rows in vector lanes.
//!
//! In ggml's row-major layout a register tile of 16 rows reads block by block with a stride of
//! one row between reads (16 short streams the hardware prefetcher does not follow) and must
//! reduce each row's vector of partial sums across lanes. Interleaved, rows `16g .. 16g + 16`
//! are stored block by block (`record(g, b)`: block `b` of all 16 rows together), and inside a
//! record every field of the 16 blocks is laid out with row `i` in the 4-byte lane `i` of a
//! 64-byte vector: an integer dot product (`vpdpbusd`) against 4 activation bytes broadcast to
//! all lanes then gives each row's sum in its own lane, with no reduction. The AVX-512 VNNI
//! kernels that read it are [`super::avx512_x16`] (Q4_K, Q5_K, Q6_K) and
//! [`super::avx512_x16_b32`] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); the AVX2 ones,
//! [`super::avx2_x16`] (Q4_K, Q5_K, Q6_K) and [`super::avx2_x16_b32`] (Q4_0, Q4_1, Q8_0), read
//! each record's vectors as two halves of 8 rows (32 bytes, one 4-byte lane per row). The scalar
//! path reads a block back in ggml's layout ([`block_of`]) and computes the same bits.
//!
//! A matrix whose row count is not a multiple of 16 is padded with zero rows (never stored to
//! an output). Only the CPU's kernels read this layout, and only for the types their
//! instruction set has an interleaved kernel for ([`supported`]): the weights are interleaved
//! at load for those ([`wanted`]).
//!
//! Records, `16 * block_bytes` bytes (`i`: row within the group, `j`: byte within the lane):
//!
//! ```text
//! Q4_K (2304 bytes)                       Q6_K (3360 bytes)
//!    0  d[16] (f16)                          0  d[16] (f16)
//!   32  dmin[16] (f16)                      32  scales[16 sub-blocks][16 rows] (i8)
//!   64  scales[12 bytes][16 rows]          288  sub-block s (16 weights) at 288 + 192s:
//!  256  qs: sub-block s (32 weights),             ql vector v (v = 0, 1) at + 64v: byte
//!       vector k: byte 4i + j =                   4i + j = q[16s + 8v + j] (low nibble)
//!       q[32s + 4k + j] (low nibble)              | q[16s + 8v + 4 + j] (high nibble);
//!       | q[32s + 16 + 4k + j] (high)             qh at + 128: byte 4i + j holds the top
//!                                                 2 bits of q[16s + 4t + j] at bits 2t
//!
//! Q5_K (2816 bytes): Q4_K's first 256 bytes, then sub-block s at 256 + 320s: Q4_K's qs
//!       vectors of the levels' low 4 bits, then at + 256 its qh: byte 4i + k holds the 5th
//!       bits of vector k's weights, bit j of q[32s + 4k + j], bit 4 + j of q[32s + 16 + 4k + j]
//!       (next to its vectors: a record reads front to back)
//!
//! Q4_0 (288 bytes), Q4_1 (320 bytes)      Q8_0 (544 bytes)
//!    0  d[16] (f16)                          0  d[16] (f16)
//!   32  Q4_1: m[16] (f16)                   32  qs: vector k (k = 0..7) at 32 + 64k:
//!   qs (Q4_0: at 32, Q4_1: at 64):                byte 4i + j = q[4k + j] (i8)
//!       vector k (k = 0..3) at + 64k:
//!       byte 4i + j = q[4k + j] (low nibble)
//!       | q[16 + 4k + j] (high nibble)
//!
//! Q5_0 (352 bytes), Q5_1 (384 bytes)
//!    0  d[16] (f16)
//!   32  Q5_1: m[16] (f16)
//!   qh (Q5_0: at 32, Q5_1: at 64): byte 4i + j = qh[j] (bit l: 5th bit of weight 8j + l)
//!   qs (Q5_0: at 96, Q5_1: at 128): as Q4_0's
//! ```
//!
//! (A Q4_0 / Q4_1 lane byte is ggml's own byte `qs[4k + j]`: ggml packs weights `l` and
//! `l + 16` into one byte already.) Each record reads front to back: one stream per group,
//! which the hardware prefetches.

use super::linear::Isa;
use super::QuantType;

/// Rows per group.
pub const GROUP: usize = 16;

/// Whether `ty` has an interleaved layout ([`interleave`] and [`block_of`] read and write it).
pub fn has_layout(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
    )
}

/// Whether `isa` has a kernel for `ty` interleaved. AVX-512 VNNI reads every type with a
/// layout; AVX2 (with or without AVX-VNNI) all but Q5_0 and Q5_1 (it has no kernel for them:
/// they stay row-major, read by its row-major kernel). Any other would read the layout block
/// by block, rebuilt, slower than ggml's.
pub(super) fn supported(ty: QuantType, isa: Isa) -> bool {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ty;
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => has_layout(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni => avx2_has_kernel(ty),
        #[cfg(all(test, target_arch = "x86_64"))]
        Isa::AvxVnniEvex => avx2_has_kernel(ty),
        Isa::Scalar => false,
    }
}

/// The types the AVX2 interleaved kernels read (with or without AVX-VNNI).
#[cfg(target_arch = "x86_64")]
fn avx2_has_kernel(ty: QuantType) -> bool {
    use QuantType::*;
    matches!(ty, Q4_0 | Q4_1 | Q8_0 | Q4_K | Q5_K | Q6_K)
}

/// Whether this CPU's kernels read `ty` interleaved (the matrices of `ty` are interleaved at
/// load then).
pub fn wanted(ty: QuantType) -> bool {
    supported(ty, Isa::detect())
}

/// Bytes of a `[rows, cols]` matrix of `ty`, interleaved: the rows padded to whole groups.
pub fn interleaved_len(ty: QuantType, rows: usize, cols: usize) -> Option<usize> {
    ty.row_bytes(cols)?
        .checked_mul(rows.div_ceil(GROUP) * GROUP)
}

/// Byte offset of the record holding block `b` of the group of row `r`.
#[inline(always)]
pub fn record_offset(ty: QuantType, cols: usize, r: usize, b: usize) -> usize {
    let bb = ty.block_bytes();
    (r / GROUP) * GROUP * (cols / ty.block_elems()) * bb + b * GROUP * bb
}

/// `src` (`rows` rows of ggml blocks of `ty`, `has_layout(ty)`) in the interleaved layout, into
/// `dst` (`interleaved_len` bytes).
pub fn interleave(ty: QuantType, src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    use rayon::prelude::*;
    assert!(
        has_layout(ty),
        "interleave: no interleaved layout for {ty:?}"
    );
    let (bb, rb) = (ty.block_bytes(), ty.row_bytes(cols).expect("whole blocks"));
    assert_eq!(
        src.len(),
        rows * rb,
        "interleave: src is not [rows, row_bytes]"
    );
    let group_bytes = GROUP * rb;
    assert_eq!(
        dst.len(),
        rows.div_ceil(GROUP) * group_bytes,
        "interleave: dst size"
    );
    let zero = vec![0u8; bb];
    dst.par_chunks_mut(group_bytes)
        .enumerate()
        .for_each(|(g, group)| {
            for (b, rec) in group.chunks_exact_mut(GROUP * bb).enumerate() {
                let blocks: [&[u8]; GROUP] = std::array::from_fn(|i| {
                    let r = GROUP * g + i;
                    if r < rows {
                        &src[r * rb + b * bb..r * rb + (b + 1) * bb]
                    } else {
                        &zero[..]
                    }
                });
                match ty {
                    QuantType::Q4_K => record_q4_k(&blocks, rec),
                    QuantType::Q5_K => record_q5_k(&blocks, rec),
                    QuantType::Q6_K => record_q6_k(&blocks, rec),
                    _ => record_b32(ty, &blocks, rec),
                }
            }
        });
}

/// Block `b` of row `r` of an interleaved matrix, in ggml's layout, into `out` (`block_bytes`).
pub fn block_of(ty: QuantType, data: &[u8], cols: usize, r: usize, b: usize, out: &mut [u8]) {
    let off = record_offset(ty, cols, r, b);
    let rec = &data[off..off + GROUP * ty.block_bytes()];
    let i = r % GROUP;
    match ty {
        QuantType::Q4_K => block_q4_k(rec, i, out),
        QuantType::Q5_K => block_q5_k(rec, i, out),
        QuantType::Q6_K => block_q6_k(rec, i, out),
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q8_0 => {
            block_b32(ty, rec, i, out)
        }
        _ => panic!("block_of: no interleaved layout for {ty:?}"),
    }
}

/// Where a 32-weight type's fields are, as (in the block, in the record) offsets.
struct FieldsB32 {
    /// `m` (Q4_1, Q5_1).
    m: Option<(usize, usize)>,
    /// `qh` (Q5_0, Q5_1): 4 bytes per row, one 64-byte vector.
    qh: Option<(usize, usize)>,
    /// `qs`, 4 bytes per row and quant vector of 64 bytes.
    qs: (usize, usize),
    /// The record's quant vectors.
    vectors: usize,
}

fn fields_b32(ty: QuantType) -> FieldsB32 {
    let (m, qh, qs, vectors) = match ty {
        QuantType::Q4_0 => (None, None, (2, 32), 4),
        QuantType::Q4_1 => (Some((2, 32)), None, (4, 64), 4),
        QuantType::Q5_0 => (None, Some((2, 32)), (6, 96), 4),
        QuantType::Q5_1 => (Some((2, 32)), Some((4, 64)), (8, 128), 4),
        QuantType::Q8_0 => (None, None, (2, 32), 8),
        _ => unreachable!("not an interleaved 32-weight type: {ty:?}"),
    };
    FieldsB32 { m, qh, qs, vectors }
}

/// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: the f16 fields 2 bytes per row, `qh` and the quant bytes 4
/// per row and vector.
fn record_b32(ty: QuantType, blocks: &[&[u8]; GROUP], rec: &mut [u8]) {
    let FieldsB32 {
        m,
        qh,
        qs: (qb, qr),
        vectors,
    } = fields_b32(ty);
    for (i, blk) in blocks.iter().enumerate() {
        rec[2 * i..2 * i + 2].copy_from_slice(&blk[0..2]);
        if let Some((mb, mr)) = m {
            rec[mr + 2 * i..mr + 2 * i + 2].copy_from_slice(&blk[mb..mb + 2]);
        }
        if let Some((hb, hr)) = qh {
            rec[hr + 4 * i..hr + 4 * i + 4].copy_from_slice(&blk[hb..hb + 4]);
        }
        for k in 0..vectors {
            let at = qr + 64 * k + 4 * i;
            rec[at..at + 4].copy_from_slice(&blk[qb + 4 * k..qb + 4 * k + 4]);
        }
    }
}

fn block_b32(ty: QuantType, rec: &[u8], i: usize, out: &mut [u8]) {
    let FieldsB32 {
        m,
        qh,
        qs: (qb, qr),
        vectors,
    } = fields_b32(ty);
    out[0..2].copy_from_slice(&rec[2 * i..2 * i + 2]);
    if let Some((mb, mr)) = m {
        out[mb..mb + 2].copy_from_slice(&rec[mr + 2 * i..mr + 2 * i + 2]);
    }
    if let Some((hb, hr)) = qh {
        out[hb..hb + 4].copy_from_slice(&rec[hr + 4 * i..hr + 4 * i + 4]);
    }
    for k in 0..vectors {
        let at = qr + 64 * k + 4 * i;
        out[qb + 4 * k..qb + 4 * k + 4].copy_from_slice(&rec[at..at + 4]);
    }
}

/// The 256 levels (0..15) of a Q4_K block.
fn levels_q4_k(blk: &[u8]) -> [u8; 256] {
    let mut q = [0u8; 256];
    for c in 0..4 {
        for l in 0..32 {
            let v = blk[16 + 32 * c + l];
            q[64 * c + l] = v & 15;
            q[64 * c + 32 + l] = v >> 4;
        }
    }
    q
}

/// The 256 levels (0..63) of a Q6_K block.
fn levels_q6_k(blk: &[u8]) -> [u8; 256] {
    let mut q = [0u8; 256];
    for h in 0..2 {
        for g in 0..4 {
            for l in 0..32 {
                let ql = blk[64 * h + 32 * (g % 2) + l];
                let nib = if g < 2 { ql & 15 } else { ql >> 4 };
                let top = (blk[128 + 32 * h + l] >> (2 * g)) & 3;
                q[128 * h + 32 * g + l] = nib | top << 4;
            }
        }
    }
    q
}

/// The 256 levels (0..31) of a Q5_K block: Q4_K's nibbles (at 48) with `qh`'s bits (at 16).
fn levels_q5_k(blk: &[u8]) -> [u8; 256] {
    let mut q = [0u8; 256];
    for c in 0..4 {
        for l in 0..32 {
            let (v, h) = (blk[48 + 32 * c + l], blk[16 + l]);
            q[64 * c + l] = (v & 15) | ((h >> (2 * c)) & 1) << 4;
            q[64 * c + 32 + l] = (v >> 4) | ((h >> (2 * c + 1)) & 1) << 4;
        }
    }
    q
}

/// Q4_K's and Q5_K's scale fields (`d`, `dmin`, the 12 scale bytes: the block's first 16
/// bytes) and the levels' low 4 bits, row `i` of the record; a sub-block's vectors at
/// `256 + stride * s` (Q4_K: 256, Q5_K: 320, its `qh` after them).
fn record_k4_fields(blk: &[u8], q: &[u8; 256], i: usize, stride: usize, rec: &mut [u8]) {
    rec[2 * i..2 * i + 2].copy_from_slice(&blk[0..2]);
    rec[32 + 2 * i..32 + 2 * i + 2].copy_from_slice(&blk[2..4]);
    for p in 0..12 {
        rec[64 + 16 * p + i] = blk[4 + p];
    }
    for s in 0..8 {
        for k in 0..4 {
            for j in 0..4 {
                let w = 32 * s + 4 * k + j;
                rec[256 + stride * s + 64 * k + 4 * i + j] = (q[w] & 15) | (q[w + 16] & 15) << 4;
            }
        }
    }
}

/// [`record_k4_fields`] read back: the first 16 bytes into `out`, the low 4 bits into `q`.
fn block_k4_fields(rec: &[u8], i: usize, stride: usize, out: &mut [u8], q: &mut [u8; 256]) {
    out[0..2].copy_from_slice(&rec[2 * i..2 * i + 2]);
    out[2..4].copy_from_slice(&rec[32 + 2 * i..32 + 2 * i + 2]);
    for p in 0..12 {
        out[4 + p] = rec[64 + 16 * p + i];
    }
    for s in 0..8 {
        for k in 0..4 {
            for j in 0..4 {
                let w = 32 * s + 4 * k + j;
                let v = rec[256 + stride * s + 64 * k + 4 * i + j];
                q[w] = v & 15;
                q[w + 16] = v >> 4;
            }
        }
    }
}

fn record_q4_k(blocks: &[&[u8]; GROUP], rec: &mut [u8]) {
    for (i, blk) in blocks.iter().enumerate() {
        record_k4_fields(blk, &levels_q4_k(blk), i, 256, rec);
    }
}

fn block_q4_k(rec: &[u8], i: usize, out: &mut [u8]) {
    let mut q = [0u8; 256];
    block_k4_fields(rec, i, 256, out, &mut q);
    for c in 0..4 {
        for l in 0..32 {
            out[16 + 32 * c + l] = q[64 * c + l] | q[64 * c + 32 + l] << 4;
        }
    }
}

fn record_q5_k(blocks: &[&[u8]; GROUP], rec: &mut [u8]) {
    for (i, blk) in blocks.iter().enumerate() {
        let q = levels_q5_k(blk);
        record_k4_fields(blk, &q, i, 320, rec);
        for s in 0..8 {
            for k in 0..4 {
                let mut bits = 0u8;
                for j in 0..4 {
                    let w = 32 * s + 4 * k + j;
                    bits |= (q[w] >> 4) << j | (q[w + 16] >> 4) << (4 + j);
                }
                rec[256 + 320 * s + 256 + 4 * i + k] = bits;
            }
        }
    }
}

fn block_q5_k(rec: &[u8], i: usize, out: &mut [u8]) {
    let mut q = [0u8; 256];
    block_k4_fields(rec, i, 320, out, &mut q);
    for s in 0..8 {
        for k in 0..4 {
            let bits = rec[256 + 320 * s + 256 + 4 * i + k];
            for j in 0..4 {
                let w = 32 * s + 4 * k + j;
                q[w] |= ((bits >> j) & 1) << 4;
                q[w + 16] |= ((bits >> (4 + j)) & 1) << 4;
            }
        }
    }
    out[16..48].fill(0);
    for c in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (q[64 * c + l], q[64 * c + 32 + l]);
            out[48 + 32 * c + l] = (lo & 15) | (hi & 15) << 4;
            out[16 + l] |= (lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1);
        }
    }
}

fn record_q6_k(blocks: &[&[u8]; GROUP], rec: &mut [u8]) {
    for (i, blk) in blocks.iter().enumerate() {
        rec[2 * i..2 * i + 2].copy_from_slice(&blk[208..210]);
        for s in 0..16 {
            rec[32 + 16 * s + i] = blk[192 + s];
        }
        let q = levels_q6_k(blk);
        for s in 0..16 {
            for j in 0..4 {
                for v in 0..2 {
                    let w = 16 * s + 8 * v + j;
                    rec[288 + 192 * s + 64 * v + 4 * i + j] = (q[w] & 15) | (q[w + 4] & 15) << 4;
                }
                let mut top = 0u8;
                for t in 0..4 {
                    top |= (q[16 * s + 4 * t + j] >> 4) << (2 * t);
                }
                rec[288 + 192 * s + 128 + 4 * i + j] = top;
            }
        }
    }
}

fn block_q6_k(rec: &[u8], i: usize, out: &mut [u8]) {
    out[208..210].copy_from_slice(&rec[2 * i..2 * i + 2]);
    for s in 0..16 {
        out[192 + s] = rec[32 + 16 * s + i];
    }
    let mut q = [0u8; 256];
    for s in 0..16 {
        for j in 0..4 {
            for v in 0..2 {
                let w = 16 * s + 8 * v + j;
                let b = rec[288 + 192 * s + 64 * v + 4 * i + j];
                q[w] = b & 15;
                q[w + 4] = b >> 4;
            }
            let top = rec[288 + 192 * s + 128 + 4 * i + j];
            for t in 0..4 {
                q[16 * s + 4 * t + j] |= ((top >> (2 * t)) & 3) << 4;
            }
        }
    }
    out[..192].fill(0);
    for h in 0..2 {
        for g in 0..4 {
            for l in 0..32 {
                let v = q[128 * h + 32 * g + l];
                let ql = &mut out[64 * h + 32 * (g % 2) + l];
                *ql |= if g < 2 { v & 15 } else { (v & 15) << 4 };
                out[128 + 32 * h + l] |= (v >> 4) << (2 * g);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;

    const TYPES: [QuantType; 8] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
    ];

    /// Random bytes are valid blocks of every type here (every bit pattern is), so a round
    /// trip of random data checks every bit of every field.
    #[test]
    fn every_block_reads_back_as_it_was() {
        let mut rng = Rng(7);
        assert!(TYPES.into_iter().all(has_layout));
        assert!(!has_layout(QuantType::Q3_K) && !has_layout(QuantType::IQ4_NL));
        for ty in TYPES {
            for &(rows, cols) in &[
                (16usize, 256usize),
                (37, 512),
                (5, 768),
                (48, 256),
                (21, 96),
                (16, 32),
            ] {
                let Some(rb) = ty.row_bytes(cols) else {
                    continue;
                };
                let src: Vec<u8> = (0..rows * rb).map(|_| rng.next_u() as u8).collect();
                let mut dst = vec![0xAAu8; interleaved_len(ty, rows, cols).unwrap()];
                interleave(ty, &src, rows, cols, &mut dst);
                let bb = ty.block_bytes();
                let mut out = vec![0u8; bb];
                for r in 0..rows.div_ceil(GROUP) * GROUP {
                    for b in 0..cols / ty.block_elems() {
                        block_of(ty, &dst, cols, r, b, &mut out);
                        if r < rows {
                            let want = &src[r * rb + b * bb..r * rb + (b + 1) * bb];
                            assert_eq!(out, want, "{ty:?} {rows}x{cols} row {r} block {b}");
                        } else {
                            assert!(out.iter().all(|&v| v == 0), "padding row {r} is zero");
                        }
                    }
                }
            }
        }
    }

    /// The record fields sit where the kernel reads them (one hand-checked weight per field).
    #[test]
    fn fields_sit_where_the_kernel_reads_them() {
        let cols = 256;
        let mut rng = Rng(3);
        // Q4_K: row 5, weight 32 * 2 + 16 + 4 * 1 + 3 = 87 is the high nibble of sub-block 2,
        // vector 1, lane 5, byte 3.
        let ty = QuantType::Q4_K;
        let src: Vec<u8> = (0..16 * 144).map(|_| rng.next_u() as u8).collect();
        let mut dst = vec![0u8; interleaved_len(ty, 16, cols).unwrap()];
        interleave(ty, &src, 16, cols, &mut dst);
        let blk = &src[5 * 144..6 * 144];
        assert_eq!(
            dst[256 + 256 * 2 + 64 + 4 * 5 + 3] >> 4,
            levels_q4_k(blk)[87]
        );
        assert_eq!(dst[64 + 16 * 7 + 5], blk[4 + 7]);
        assert_eq!(dst[32 + 10..32 + 12], blk[2..4]);
        // Q5_K: row 11, weight 32 * 6 + 4 * 2 + 1 = 201 is the low nibble of sub-block 6,
        // vector 2, lane 11, byte 1; its 5th bit is bit 1 of qh byte 4 * 11 + 2 of sub-block 6,
        // and weight 201 + 16's bit 5 there.
        let ty = QuantType::Q5_K;
        let src: Vec<u8> = (0..16 * 176).map(|_| rng.next_u() as u8).collect();
        let mut dst = vec![0u8; interleaved_len(ty, 16, cols).unwrap()];
        interleave(ty, &src, 16, cols, &mut dst);
        let blk = &src[11 * 176..12 * 176];
        let q = levels_q5_k(blk);
        let lane = dst[256 + 320 * 6 + 64 * 2 + 4 * 11 + 1];
        let bits = dst[256 + 320 * 6 + 256 + 4 * 11 + 2];
        assert_eq!(lane & 15 | ((bits >> 1) & 1) << 4, q[201]);
        assert_eq!(lane >> 4 | ((bits >> 5) & 1) << 4, q[217]);
        assert_eq!(dst[64 + 16 * 3 + 11], blk[4 + 3]);
        // Q6_K: row 9, weight 16 * 3 + 4 * 2 + 1 = 57: low nibble of sub-block 3, vector 1,
        // lane 9, byte 1; its top bits at bits 4-5 of the qh byte.
        let ty = QuantType::Q6_K;
        let src: Vec<u8> = (0..16 * 210).map(|_| rng.next_u() as u8).collect();
        let mut dst = vec![0u8; interleaved_len(ty, 16, cols).unwrap()];
        interleave(ty, &src, 16, cols, &mut dst);
        let blk = &src[9 * 210..10 * 210];
        let q = levels_q6_k(blk)[57];
        assert_eq!(dst[288 + 192 * 3 + 64 + 4 * 9 + 1] & 15, q & 15);
        assert_eq!((dst[288 + 192 * 3 + 128 + 4 * 9 + 1] >> 4) & 3, q >> 4);
        assert_eq!(dst[32 + 16 * 11 + 9], blk[192 + 11]);
        // Q4_0 / Q4_1: row 5, weight 16 + 4 * 2 + 3 = 27 is the high nibble of vector 2, lane
        // 5, byte 3 (ggml's byte 11); Q4_1's m of row 5 after the 16 d.
        for (ty, qs, qb) in [(QuantType::Q4_0, 32, 2), (QuantType::Q4_1, 64, 4)] {
            let bb = ty.block_bytes();
            let src: Vec<u8> = (0..16 * bb).map(|_| rng.next_u() as u8).collect();
            let mut dst = vec![0u8; interleaved_len(ty, 16, 32).unwrap()];
            interleave(ty, &src, 16, 32, &mut dst);
            let blk = &src[5 * bb..6 * bb];
            let mut u = super::super::Unpacked::new();
            super::super::unpack(ty, blk, &mut u);
            let offset = if ty == QuantType::Q4_0 { 8 } else { 0 };
            let v = dst[qs + 64 * 2 + 4 * 5 + 3];
            assert_eq!((v >> 4) as i8 - offset, u.q[27]);
            assert_eq!(v, blk[qb + 11]);
            assert_eq!(dst[10..12], blk[0..2]);
            if ty == QuantType::Q4_1 {
                assert_eq!(dst[32 + 10..32 + 12], blk[2..4]);
            }
        }
        // Q8_0: row 9, weight 4 * 6 + 1 = 25 is vector 6, lane 9, byte 1.
        let ty = QuantType::Q8_0;
        let src: Vec<u8> = (0..16 * 34).map(|_| rng.next_u() as u8).collect();
        let mut dst = vec![0u8; interleaved_len(ty, 16, 32).unwrap()];
        interleave(ty, &src, 16, 32, &mut dst);
        let blk = &src[9 * 34..10 * 34];
        assert_eq!(dst[32 + 64 * 6 + 4 * 9 + 1], blk[2 + 25]);
        assert_eq!(dst[18..20], blk[0..2]);
        // Q5_0 / Q5_1: row 7, weight 16 + 4 * 3 + 2 = 30: the high nibble of vector 3, lane 7,
        // byte 2; its 5th bit is bit 6 of the lane's `qh` byte 3 (bit 30 of ggml's `qh`).
        for (ty, qh, qs) in [(QuantType::Q5_0, 32, 96), (QuantType::Q5_1, 64, 128)] {
            let bb = ty.block_bytes();
            let src: Vec<u8> = (0..16 * bb).map(|_| rng.next_u() as u8).collect();
            let mut dst = vec![0u8; interleaved_len(ty, 16, 32).unwrap()];
            interleave(ty, &src, 16, 32, &mut dst);
            let blk = &src[7 * bb..8 * bb];
            let mut u = super::super::Unpacked::new();
            super::super::unpack(ty, blk, &mut u);
            let offset = if ty == QuantType::Q5_0 { 16 } else { 0 };
            let level = (dst[qs + 64 * 3 + 4 * 7 + 2] >> 4) | ((dst[qh + 4 * 7 + 3] >> 6) & 1) << 4;
            assert_eq!(level as i8 - offset, u.q[30]);
            assert_eq!(dst[14..16], blk[0..2]);
            if ty == QuantType::Q5_1 {
                assert_eq!(dst[32 + 14..32 + 16], blk[2..4]);
            }
        }
    }
}
