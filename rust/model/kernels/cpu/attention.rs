//! Grouped-query attention for one batch of query rows over a paged K/V cache.

use super::swiglu::fast_exp;
use rayon::prelude::*;

/// Largest supported head dimension (stack accumulators are sized for it).
pub const MAX_HEAD_DIM: usize = 256;
/// Largest supported query heads per K/V head.
pub const MAX_GROUP: usize = 16;
/// Keys scored per online-softmax step: one rescale of the accumulators per tile.
const TILE: usize = 32;

/// The K/V cache of one layer: `k`, `v` are each `[num_blocks, block_size, kv_heads, head_dim]`.
pub struct KvLayer<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One query row of the batch: its absolute position and where its sequence's block table sits
/// in `tables`.
#[derive(Clone, Copy, Debug)]
pub struct AttnRow {
    pub pos: u32,
    pub table_start: u32,
    pub table_len: u32,
}

/// `out[t]` = softmax over visible `j` of `(q[t,h]·k[j,g]) * scale`, applied to `v[j,g]`, with
/// `g = h / (n_heads / kv_heads)`. Visible: `j <= pos`, and `pos - j < window` when a sliding
/// window is given. `q`, `out` are `[rows.len(), n_heads * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    rows: &[AttnRow],
    tables: &[u32],
    kv: &KvLayer,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    paged_attention_with(
        q,
        rows,
        tables,
        kv,
        n_heads,
        scale,
        window,
        out,
        attend_dispatch,
    );
}

#[allow(clippy::too_many_arguments)]
fn paged_attention_with(
    q: &[f32],
    rows: &[AttnRow],
    tables: &[u32],
    kv: &KvLayer,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
    kernel: fn(&Group, &mut [f32]),
) {
    let (hd, kvh, bs) = (kv.head_dim, kv.kv_heads, kv.block_size);
    assert!(
        kvh > 0 && bs > 0 && hd > 0,
        "attention: empty cache geometry"
    );
    assert!(
        n_heads.is_multiple_of(kvh),
        "attention: n_heads not a multiple of kv_heads"
    );
    let group = n_heads / kvh;
    assert!(
        hd <= MAX_HEAD_DIM,
        "attention: head_dim {hd} > {MAX_HEAD_DIM}"
    );
    assert!(group <= MAX_GROUP, "attention: group {group} > {MAX_GROUP}");
    assert_eq!(q.len(), rows.len() * n_heads * hd, "attention: q shape");
    assert_eq!(out.len(), q.len(), "attention: out shape");
    assert_eq!(kv.k.len(), kv.v.len(), "attention: k and v differ");
    assert_eq!(kv.k.len() % (bs * kvh * hd), 0, "attention: cache shape");
    if let Some(w) = window {
        assert!(w > 0, "attention: window must be positive");
    }
    for r in rows {
        let (s, l) = (r.table_start as usize, r.table_len as usize);
        assert!(s + l <= tables.len(), "attention: block table out of range");
        assert!(
            (r.pos as usize) / bs < l,
            "attention: position beyond block table"
        );
    }
    // One task per (row, kv head): its query heads are contiguous in q and out.
    out.par_chunks_mut(group * hd)
        .enumerate()
        .for_each(|(i, o)| {
            let (t, g) = (i / kvh, i % kvh);
            let row = rows[t];
            let qg = &q[t * n_heads * hd + g * group * hd..][..group * hd];
            let table =
                &tables[row.table_start as usize..(row.table_start + row.table_len) as usize];
            let pos = row.pos as usize;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let args = Group {
                q: qg,
                table,
                kv,
                g,
                group,
                lo,
                pos,
                scale,
            };
            kernel(&args, o);
        });
}

struct Group<'a> {
    q: &'a [f32],
    table: &'a [u32],
    kv: &'a KvLayer<'a>,
    g: usize,
    group: usize,
    lo: usize,
    pos: usize,
    scale: f32,
}

fn attend_dispatch(a: &Group, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: feature detected.
            unsafe { attend_avx512(a, out) };
            return;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: features detected.
            unsafe { attend_avx2(a, out) };
            return;
        }
    }
    attend_plain(a, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_avx512(a: &Group, out: &mut [f32]) {
    attend::<Avx512>(a, out)
}
// The plain helpers compiled with AVX2: the compiler vectorises the fixed-lane loops.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(a: &Group, out: &mut [f32]) {
    attend::<Plain>(a, out)
}
fn attend_plain(a: &Group, out: &mut [f32]) {
    attend::<Plain>(a, out)
}

/// The vector primitives of the attention loop, per ISA.
trait Vops {
    /// `s[h] = q[h*hd..][..hd] · kr` for every `h < s.len()`.
    ///
    /// # Safety
    /// The CPU supports the implementation's ISA.
    unsafe fn dots(q: &[f32], kr: &[f32], s: &mut [f32]);
    /// `acc += sum_j p[j] * v[offs[j]..][..acc.len()]`.
    ///
    /// # Safety
    /// As for `dots`; every `offs[j] + acc.len() <= v.len()`.
    unsafe fn tile_axpy(acc: &mut [f32], p: &[f32], v: &[f32], offs: &[usize]);
}

/// Portable dot with 16 independent partial sums (vectorisable without fast-math).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ac = a.chunks_exact(16);
    let mut bc = b.chunks_exact(16);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        s += x * y;
    }
    s
}

struct Plain;
impl Vops for Plain {
    #[inline(always)]
    unsafe fn dots(q: &[f32], kr: &[f32], s: &mut [f32]) {
        let hd = kr.len();
        for (h, sv) in s.iter_mut().enumerate() {
            *sv = dot(&q[h * hd..(h + 1) * hd], kr);
        }
    }
    #[inline(always)]
    unsafe fn tile_axpy(acc: &mut [f32], p: &[f32], v: &[f32], offs: &[usize]) {
        let hd = acc.len();
        for (&pj, &o) in p.iter().zip(offs) {
            for (x, &vv) in acc.iter_mut().zip(&v[o..o + hd]) {
                *x += pj * vv;
            }
        }
    }
}

/// Explicit AVX-512: the auto-vectorised dot ended in a serial 16-lane sum per key, which made
/// scoring latency-bound. Here the K row is loaded once for all heads of the group.
#[cfg(target_arch = "x86_64")]
struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Vops for Avx512 {
    #[inline(always)]
    unsafe fn dots(q: &[f32], kr: &[f32], s: &mut [f32]) {
        use std::arch::x86_64::*;
        let hd = kr.len();
        let g = s.len();
        debug_assert!(q.len() >= g * hd && g <= MAX_GROUP);
        let mut acc = [_mm512_setzero_ps(); MAX_GROUP];
        let (kp, qp) = (kr.as_ptr(), q.as_ptr());
        let mut c = 0;
        while c < hd {
            let mask: __mmask16 = if hd - c >= 16 {
                0xffff
            } else {
                ((1u32 << (hd - c)) - 1) as __mmask16
            };
            let kv = _mm512_maskz_loadu_ps(mask, kp.add(c));
            for (h, a) in acc[..g].iter_mut().enumerate() {
                let qv = _mm512_maskz_loadu_ps(mask, qp.add(h * hd + c));
                *a = _mm512_fmadd_ps(qv, kv, *a);
            }
            c += 16;
        }
        for (sv, a) in s.iter_mut().zip(&acc[..g]) {
            *sv = _mm512_reduce_add_ps(*a);
        }
    }
    /// 64 output floats per pass held in 4 registers across the whole tile of keys, so the
    /// accumulators do not round-trip through memory once per key.
    #[inline(always)]
    unsafe fn tile_axpy(acc: &mut [f32], p: &[f32], v: &[f32], offs: &[usize]) {
        use std::arch::x86_64::*;
        let hd = acc.len();
        let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
        let mask_at = |c: usize| -> __mmask16 {
            if c >= hd {
                0
            } else if hd - c >= 16 {
                0xffff
            } else {
                ((1u32 << (hd - c)) - 1) as __mmask16
            }
        };
        let mut c = 0;
        while c < hd {
            let m = [
                mask_at(c),
                mask_at(c + 16),
                mask_at(c + 32),
                mask_at(c + 48),
            ];
            let mut a = [_mm512_setzero_ps(); 4];
            for i in 0..4 {
                // Masked-off lanes are never touched, so no access past the row.
                a[i] = _mm512_maskz_loadu_ps(m[i], ap.wrapping_add(c + 16 * i));
            }
            for (&pj, &o) in p.iter().zip(offs) {
                let pv = _mm512_set1_ps(pj);
                let row = vp.wrapping_add(o + c);
                for i in 0..4 {
                    let y = _mm512_maskz_loadu_ps(m[i], row.wrapping_add(16 * i));
                    a[i] = _mm512_fmadd_ps(pv, y, a[i]);
                }
            }
            for i in 0..4 {
                _mm512_mask_storeu_ps(ap.wrapping_add(c + 16 * i), m[i], a[i]);
            }
            c += 64;
        }
    }
}

/// Streaming (online) softmax over the visible keys, TILE keys at a time: scores for the tile
/// go to a small stack buffer, the running max/sum and the output accumulators are rescaled once
/// per tile. Each K and V row is read once for all query heads of the group.
// Scores are indexed [head][key] from both loop orders; index loops read clearest here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn attend<V: Vops>(a: &Group, out: &mut [f32]) {
    let kv = a.kv;
    let (hd, kvh, bs) = (kv.head_dim, kv.kv_heads, kv.block_size);
    let group = a.group;
    let mut acc = [[0f32; MAX_HEAD_DIM]; MAX_GROUP];
    let mut mx = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0f32; MAX_GROUP];
    let mut s = [[0f32; TILE]; MAX_GROUP];
    let row_off = |j: usize| -> usize {
        let block = a.table[j / bs] as usize;
        ((block * bs + j % bs) * kvh + a.g) * hd
    };
    let mut j0 = a.lo;
    while j0 <= a.pos {
        let cnt = TILE.min(a.pos + 1 - j0);
        // Row offsets once per tile (K and V share the layout).
        let mut offs = [0usize; TILE];
        for (jj, o) in offs[..cnt].iter_mut().enumerate() {
            *o = row_off(j0 + jj);
        }
        for jj in 0..cnt {
            let kr = &kv.k[offs[jj]..][..hd];
            let mut sc = [0f32; MAX_GROUP];
            // SAFETY: `V` was chosen by run-time feature detection (attend_dispatch).
            unsafe { V::dots(a.q, kr, &mut sc[..group]) };
            for h in 0..group {
                s[h][jj] = sc[h] * a.scale;
            }
        }
        for h in 0..group {
            let tile_max = s[h][..cnt].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let new_max = mx[h].max(tile_max);
            // First tile: nothing accumulated yet, so no rescale (avoids exp(-inf - -inf)).
            let corr = if mx[h] == f32::NEG_INFINITY {
                0.0
            } else {
                fast_exp(mx[h] - new_max)
            };
            mx[h] = new_max;
            // Exponentials first (vectorisable), then the sum.
            for v in s[h][..cnt].iter_mut() {
                *v = fast_exp(*v - new_max);
            }
            let tile_sum: f32 = s[h][..cnt].iter().sum();
            sum[h] = sum[h] * corr + tile_sum;
            if corr != 1.0 {
                for x in acc[h][..hd].iter_mut() {
                    *x *= corr;
                }
            }
        }
        for h in 0..group {
            // SAFETY: as above; each offset was bounds-checked when its K row was sliced, and
            // V has the same length as K.
            unsafe { V::tile_axpy(&mut acc[h][..hd], &s[h][..cnt], kv.v, &offs[..cnt]) };
        }
        j0 += cnt;
    }
    for h in 0..group {
        // pos itself is always visible, so sum >= 1.
        let inv = 1.0 / sum[h];
        for (o, &x) in out[h * hd..(h + 1) * hd].iter_mut().zip(&acc[h][..hd]) {
            *o = x * inv;
        }
    }
}

/// Naive reference: dense scores and softmax in f64.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    q: &[f32],
    rows: &[AttnRow],
    tables: &[u32],
    kv: &KvLayer,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    let (hd, kvh, bs) = (kv.head_dim, kv.kv_heads, kv.block_size);
    let group = n_heads / kvh;
    for (t, r) in rows.iter().enumerate() {
        let pos = r.pos as usize;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..n_heads {
            let g = h / group;
            let qh = &q[(t * n_heads + h) * hd..][..hd];
            let off = |j: usize| {
                let b = tables[r.table_start as usize + j / bs] as usize;
                ((b * bs + j % bs) * kvh + g) * hd
            };
            let scores: Vec<f64> = (lo..=pos)
                .map(|j| {
                    let kr = &kv.k[off(j)..][..hd];
                    qh.iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let mut acc = 0.0;
                for (idx, j) in (lo..=pos).enumerate() {
                    acc += e[idx] * kv.v[off(j) + d] as f64;
                }
                out[(t * n_heads + h) * hd + d] = (acc / z) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next_u(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn next(&mut self) -> f32 {
            ((self.next_u() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// Builds a cache with `seq_lens.len()` sequences on shuffled blocks, queries the given
    /// (sequence, position) rows, and compares with the reference.
    #[allow(clippy::too_many_arguments)]
    fn run(
        n_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        bs: usize,
        seq_lens: &[usize],
        queries: &[(usize, usize)],
        window: Option<usize>,
        seed: u64,
    ) {
        let mut rng = Rng(seed);
        let blocks_per: Vec<usize> = seq_lens.iter().map(|l| l.div_ceil(bs)).collect();
        let num_blocks: usize = blocks_per.iter().sum::<usize>() + 3; // a few unused blocks
                                                                      // Shuffled physical block ids, so tables are non-contiguous.
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            let j = (rng.next_u() % (i as u64 + 1)) as usize;
            ids.swap(i, j);
        }
        let mut tables = Vec::new();
        let mut starts = Vec::new();
        for &b in &blocks_per {
            starts.push(tables.len());
            let st = tables.len();
            tables.extend_from_slice(&ids[st..st + b]);
        }
        let n = num_blocks * bs * kv_heads * head_dim;
        let k: Vec<f32> = (0..n).map(|_| rng.next() * 2.0).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.next()).collect();
        let kv = KvLayer {
            k: &k,
            v: &v,
            block_size: bs,
            kv_heads,
            head_dim,
        };
        let rows: Vec<AttnRow> = queries
            .iter()
            .map(|&(sq, pos)| AttnRow {
                pos: pos as u32,
                table_start: starts[sq] as u32,
                table_len: blocks_per[sq] as u32,
            })
            .collect();
        let q: Vec<f32> = (0..rows.len() * n_heads * head_dim)
            .map(|_| rng.next() * 2.0)
            .collect();
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut got = vec![f32::NAN; q.len()];
        let mut want = vec![0.0; q.len()];
        paged_attention(&q, &rows, &tables, &kv, n_heads, scale, window, &mut got);
        reference(&q, &rows, &tables, &kv, n_heads, scale, window, &mut want);
        // Also the portable (non-dispatched) code path.
        let mut portable = vec![f32::NAN; q.len()];
        paged_attention_with(
            &q,
            &rows,
            &tables,
            &kv,
            n_heads,
            scale,
            window,
            &mut portable,
            attend_plain,
        );
        for i in 0..q.len() {
            assert!((portable[i] - want[i]).abs() <= 2e-5, "portable i={i}");
            // Outputs are convex combinations of values in [-1, 1]: absolute tolerance.
            assert!(
                (got[i] - want[i]).abs() <= 2e-5,
                "i={i}: {} vs {}",
                got[i],
                want[i]
            );
        }
    }

    #[test]
    fn gqa_block16_several_sequences() {
        run(
            6,
            2,
            32,
            16,
            &[100, 37, 1],
            &[(0, 99), (1, 36), (2, 0), (0, 50), (1, 16)],
            None,
            1,
        );
    }

    #[test]
    fn gqa_block4_odd_positions() {
        run(
            6,
            2,
            32,
            4,
            &[70, 9],
            &[(0, 69), (1, 8), (0, 3), (1, 4)],
            None,
            2,
        );
    }

    #[test]
    fn mha_and_odd_head_dim() {
        run(
            4,
            4,
            32,
            16,
            &[45, 80],
            &[(0, 44), (1, 79), (1, 31)],
            None,
            3,
        );
        run(3, 1, 67, 4, &[33], &[(0, 32), (0, 0)], None, 4);
    }

    #[test]
    fn sliding_window() {
        run(
            6,
            2,
            32,
            16,
            &[120, 40],
            &[(0, 119), (1, 39), (0, 10), (0, 64)],
            Some(33),
            5,
        );
        run(4, 4, 16, 4, &[50], &[(0, 49), (0, 5)], Some(1), 6);
        run(6, 3, 32, 4, &[50], &[(0, 49), (0, 47)], Some(48), 7);
    }

    #[test]
    fn long_context_many_tiles() {
        // Many tiles with a rising running max exercise the rescaling.
        run(2, 1, 8, 4, &[200], &[(0, 199)], None, 8);
    }
}

/// Speed check (not run by default): `cargo test --release -- --ignored --nocapture timing`.
#[cfg(test)]
mod timing {
    use super::*;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn timing_decode_attention() {
        let (n_heads, kvh, hd, bs) = (9usize, 3usize, 64usize, 16usize);
        for &ctx in &[512usize, 2048] {
            let blocks = ctx / bs;
            let len = blocks * bs * kvh * hd;
            let k: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 0.01).collect();
            let v = k.clone();
            let tables: Vec<u32> = (0..blocks as u32).rev().collect();
            let kv = KvLayer {
                k: &k,
                v: &v,
                block_size: bs,
                kv_heads: kvh,
                head_dim: hd,
            };
            let rows = [AttnRow {
                pos: ctx as u32 - 1,
                table_start: 0,
                table_len: blocks as u32,
            }];
            let q = vec![0.1f32; n_heads * hd];
            let mut out = vec![0.0f32; n_heads * hd];
            let mut best = f64::INFINITY;
            for _ in 0..300 {
                let t = Instant::now();
                paged_attention(&q, &rows, &tables, &kv, n_heads, 0.125, None, &mut out);
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "attention ctx {ctx}: {:.1} us, {:.1} GB/s of K/V",
                best * 1e6,
                (2 * len * 4) as f64 / best / 1e9
            );
        }
    }
}
