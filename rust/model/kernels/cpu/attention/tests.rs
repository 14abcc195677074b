use super::*;

use crate::model::kernels::cpu::test_rng::{thread_pools, Rng};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dt {
    F32,
    F16,
    Bf16,
    Q8_0,
}

const DTS: [Dt; 4] = [Dt::F32, Dt::F16, Dt::Bf16, Dt::Q8_0];

/// The timing module's K/V in every format.
pub(super) fn stored(k: Vec<f32>, v: Vec<f32>, bs: usize, kvh: usize, hd: usize) -> Stored {
    Stored::new(k, v, bs, kvh, hd)
}

/// K/V in every format, from the same f32 values in the f32 layouts.
pub(super) struct Stored {
    k: Vec<f32>,
    v: Vec<f32>,
    k16: Vec<f16>,
    v16: Vec<f16>,
    kb: Vec<bf16>,
    vb: Vec<bf16>,
    kq: Vec<u8>,
    vq: Vec<u8>,
    bs: usize,
    kvh: usize,
    hd: usize,
}

impl Stored {
    fn new(k: Vec<f32>, v: Vec<f32>, bs: usize, kvh: usize, hd: usize) -> Stored {
        let (kq, vq) = quantized(&k, &v, bs, kvh, hd);
        Stored {
            k16: k.iter().map(|&x| f16::from_f32(x)).collect(),
            v16: v.iter().map(|&x| f16::from_f32(x)).collect(),
            kb: k.iter().map(|&x| bf16::from_f32(x)).collect(),
            vb: v.iter().map(|&x| bf16::from_f32(x)).collect(),
            k,
            v,
            kq,
            vq,
            bs,
            kvh,
            hd,
        }
    }

    /// Format `i` of [`DTS`] (f32, f16, bf16, q8_0).
    pub(super) fn layer_of(&self, i: usize) -> KvLayer<'_> {
        self.layer(DTS[i])
    }

    fn layer(&self, dt: Dt) -> KvLayer<'_> {
        let (k, v) = match dt {
            Dt::F32 => (KvData::F32(&self.k), KvData::F32(&self.v)),
            Dt::F16 => (KvData::F16(&self.k16), KvData::F16(&self.v16)),
            Dt::Bf16 => (KvData::Bf16(&self.kb), KvData::Bf16(&self.vb)),
            Dt::Q8_0 => (KvData::Q8_0(&self.kq), KvData::Q8_0(&self.vq)),
        };
        KvLayer {
            k,
            v,
            block_size: self.bs,
            kv_heads: self.kvh,
            head_dim: self.hd,
        }
    }
}

/// f32 K/V (the f32 layouts) quantized to q8_0 row by row, as the pool writes them.
fn quantized(k: &[f32], v: &[f32], bs: usize, kvh: usize, hd: usize) -> (Vec<u8>, Vec<u8>) {
    let slots = k.len() / (kvh * hd);
    let f = KvLayer {
        k: KvData::F32(k),
        v: KvData::F32(v),
        block_size: bs,
        kv_heads: kvh,
        head_dim: hd,
    };
    let bytes = slots * kvh * kv_q8::row_bytes(hd);
    let (mut kq, mut vq) = (vec![0u8; bytes], vec![0u8; bytes]);
    for slot in 0..slots {
        let kr: Vec<f32> = (0..kvh * hd)
            .map(|e| f.k_at(slot, e / hd, e % hd))
            .collect();
        let vr: Vec<f32> = (0..kvh * hd)
            .map(|e| f.v_at(slot, e / hd, e % hd))
            .collect();
        kv_q8::write_k(&mut kq, slot, &kr, bs, kvh, hd);
        kv_q8::write_v(&mut vq, slot, &vr, kvh, hd);
    }
    (kq, vq)
}

/// The values a cache holds, as f32 K/V in the f32 layouts.
fn dequantized(kv: &KvLayer) -> (Vec<f32>, Vec<f32>) {
    let (bs, kvh, hd) = (kv.block_size, kv.kv_heads, kv.head_dim);
    let slots = kv.k.bytes() / kv.k.row_bytes(hd) / kvh;
    let mut k = vec![0f32; slots * kvh * hd];
    let mut v = k.clone();
    for slot in 0..slots {
        for g in 0..kvh {
            for d in 0..hd {
                k[k_index(slot, g, d, bs, kvh, hd)] = kv.k_at(slot, g, d);
                v[kv.v_index(slot, g, d)] = kv.v_at(slot, g, d);
            }
        }
    }
    (k, v)
}

/// Every ISA this CPU can run.
fn isas() -> Vec<Isa> {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut v = vec![Isa::Plain];
    #[cfg(target_arch = "x86_64")]
    {
        if super::super::isa::cpu().avx2 {
            v.push(Isa::Avx2);
        }
        if detect_isa() == Isa::Avx512 {
            v.push(Isa::Avx512);
        }
    }
    v
}

/// Builds a cache with `seq_lens.len()` sequences on shuffled blocks, queries the given
/// (sequence, position) rows, and compares with the f64 reference on the stored (rounded or
/// quantized) values: every ISA, split-K planned for 1, 2 and 8 threads and never split.
/// Returns how many of the runs used split-K.
#[allow(clippy::too_many_arguments)]
fn run_dt(
    dt: Dt,
    n_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    bs: usize,
    seq_lens: &[usize],
    queries: &[(usize, usize)],
    window: Option<usize>,
    seed: u64,
) -> usize {
    let mut rng = Rng(seed);
    let blocks_per: Vec<usize> = seq_lens.iter().map(|l| l.div_ceil(bs)).collect();
    // A few unused blocks.
    let num_blocks: usize = blocks_per.iter().sum::<usize>() + 3;
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
    let k: Vec<f32> = (0..n).map(|_| rng.signed() * 2.0).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.signed()).collect();
    let stored = Stored::new(k, v, bs, kv_heads, head_dim);
    let kv = stored.layer(dt);
    let rows: Vec<AttnRow> = queries
        .iter()
        .map(|&(sq, pos)| AttnRow {
            pos: pos as u32,
            table_start: starts[sq] as u32,
            table_len: blocks_per[sq] as u32,
        })
        .collect();
    let q: Vec<f32> = (0..rows.len() * n_heads * head_dim)
        .map(|_| rng.signed() * 2.0)
        .collect();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut want = vec![0.0; q.len()];
    reference(&q, &rows, &tables, &kv, n_heads, scale, window, &mut want);

    let mut got = vec![f32::NAN; q.len()];
    let mut scratch = AttnScratch::new(rows.len(), n_heads, head_dim, 2);
    paged_attention(
        &q,
        &rows,
        &tables,
        &kv,
        n_heads,
        scale,
        window,
        &mut got,
        &mut scratch,
    );
    let check = |got: &[f32], what: &str| {
        for i in 0..q.len() {
            // Outputs are convex combinations of values in [-1, 1]: absolute tolerance.
            assert!(
                (got[i] - want[i]).abs() <= 2e-5,
                "{what} i={i}: {} vs {}",
                got[i],
                want[i]
            );
        }
    };
    check(&got, "dispatched");

    let mut splits = 0;
    for isa in isas() {
        let mut unsplit = vec![f32::NAN; q.len()];
        paged_attention_with(
            &q,
            &rows,
            &tables,
            &kv,
            n_heads,
            scale,
            window,
            &mut unsplit,
            &mut scratch,
            isa,
            Split::Never,
        );
        check(&unsplit, &format!("{isa:?} unsplit"));
        for threads in [1, 2, 8] {
            let mut scratch = AttnScratch::new(rows.len(), n_heads, head_dim, threads);
            let mut split = vec![f32::NAN; q.len()];
            paged_attention_with(
                &q,
                &rows,
                &tables,
                &kv,
                n_heads,
                scale,
                window,
                &mut split,
                &mut scratch,
                isa,
                Split::Auto,
            );
            let planned = {
                let c = Ctx {
                    q: &q,
                    rows: &rows,
                    tables: &tables,
                    kv: Elems::<f32> { k: &[], v: &[] },
                    bs,
                    kvh: kv_heads,
                    hd: head_dim,
                    n_heads,
                    group: n_heads / kv_heads,
                    scale,
                    window,
                };
                plan_row_blocks(&c, &mut scratch.blocks);
                plan_segments(&c, &mut scratch, isa)
            };
            splits += planned as usize;
            check(&split, &format!("{isa:?} split-K for {threads} threads"));
            // Split and unsplit agree to the bit.
            for i in 0..q.len() {
                assert_eq!(
                    split[i].to_bits(),
                    unsplit[i].to_bits(),
                    "{isa:?} {threads} threads: split {} vs unsplit {} at {i}",
                    split[i],
                    unsplit[i]
                );
            }
        }
    }
    splits
}

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
    for dt in DTS {
        run_dt(
            dt, n_heads, kv_heads, head_dim, bs, seq_lens, queries, window, seed,
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
    run(2, 1, 40, 16, &[60], &[(0, 59)], None, 9);
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

#[test]
fn split_k_long_contexts() {
    for dt in DTS {
        // Decode-shaped GQA (smollm: 9 heads on 3 K/V heads, head_dim 64), 3000 keys.
        let n = run_dt(dt, 9, 3, 64, 16, &[3000], &[(0, 2999)], None, 11);
        assert!(n > 0, "split-K never planned");
        // Two decode rows of different lengths, block size 4.
        let n = run_dt(
            dt,
            6,
            2,
            32,
            4,
            &[3000, 700],
            &[(0, 2999), (1, 699)],
            None,
            12,
        );
        assert!(n > 0);
        // Sliding window with split-K: 1000 of 3000 keys visible.
        let n = run_dt(dt, 9, 3, 64, 16, &[3000], &[(0, 2999)], Some(1000), 13);
        assert!(n > 0);
        // MHA, odd head_dim.
        let n = run_dt(dt, 4, 4, 40, 16, &[1500], &[(0, 1499)], None, 14);
        assert!(n > 0);
    }
}

/// Attention over q8_0 K/V gives the bits of attention over its dequantized f32 copy (the
/// widening is exact), on every ISA, split-K or not, for block sizes on each tile path (16,
/// 32: a tile inside a block; 4: key by key), head dims with a short last group (16, 40),
/// and a window; and its error against f32 K/V is what 8 bits allow.
#[test]
fn q8_0_attention_is_the_attention_of_its_dequantized_values() {
    // (n_heads, kv_heads, head_dim, block_size, sequence lengths, window)
    type Case = (usize, usize, usize, usize, &'static [usize], Option<usize>);
    let cases: [Case; 5] = [
        (9, 3, 64, 16, &[3000, 37], None),
        (6, 2, 40, 4, &[300, 70], Some(50)),
        (4, 2, 16, 32, &[700], None),
        (8, 1, 128, 16, &[129, 1], None),
        (2, 2, 67, 16, &[200], Some(17)),
    ];
    for (seed, (n_heads, kvh, hd, bs, seq_lens, window)) in cases.into_iter().enumerate() {
        let mut rng = Rng(90 + seed as u64);
        let num_blocks: usize = seq_lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 1;
        let mut tables: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..tables.len()).rev() {
            let j = (rng.next_u() % (i as u64 + 1)) as usize;
            tables.swap(i, j);
        }
        let n = num_blocks * bs * kvh * hd;
        let k: Vec<f32> = (0..n).map(|_| rng.signed() * 3.0).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.signed()).collect();
        let stored = Stored::new(k, v, bs, kvh, hd);
        let q8 = stored.layer(Dt::Q8_0);
        let (dk, dv) = dequantized(&q8);
        let deq = KvLayer {
            k: KvData::F32(&dk),
            v: KvData::F32(&dv),
            ..stored.layer(Dt::F32)
        };
        // Every position of each sequence's last tiles, and a few early ones.
        let mut rows = Vec::new();
        let mut start = 0;
        for &len in seq_lens {
            let table_len = len.div_ceil(bs) as u32;
            for pos in (0..len).rev().take(20).chain([0, len / 3]) {
                rows.push(AttnRow {
                    pos: pos as u32,
                    table_start: start,
                    table_len,
                });
            }
            start += table_len;
        }
        let q: Vec<f32> = (0..rows.len() * n_heads * hd)
            .map(|_| rng.signed() * 2.0)
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let attend = |kv: &KvLayer, isa: Isa, split: Split, threads: usize| {
            let mut out = vec![f32::NAN; q.len()];
            let mut scratch = AttnScratch::new(rows.len(), n_heads, hd, threads);
            paged_attention_with(
                &q,
                &rows,
                &tables,
                kv,
                n_heads,
                scale,
                window,
                &mut out,
                &mut scratch,
                isa,
                split,
            );
            out
        };
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let want = bits(&attend(&deq, Isa::Plain, Split::Never, 1));
        for isa in isas() {
            for (split, threads) in [(Split::Never, 2), (Split::Auto, 8)] {
                let what = format!("case {seed}, {isa:?}, {split:?}");
                assert_eq!(bits(&attend(&q8, isa, split, threads)), want, "{what}");
                assert_eq!(bits(&attend(&deq, isa, split, threads)), want, "{what}");
            }
        }
        // Against f32 K/V: outputs are convex combinations of V in [-1, 1], each off by
        // at most amax/254 <= 1/254 in V, plus what the rounded keys move the weights.
        let exact = attend(&stored.layer(Dt::F32), Isa::Plain, Split::Never, 1);
        let got = attend(&q8, Isa::Plain, Split::Never, 1);
        let worst = exact
            .iter()
            .zip(&got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < 0.03, "case {seed}: q8_0 off by {worst}");
    }
}

#[test]
fn split_k_plans_cover_the_keys() {
    let rows = [
        AttnRow {
            pos: 2999,
            table_start: 0,
            table_len: 188,
        },
        AttnRow {
            pos: 99,
            table_start: 0,
            table_len: 188,
        },
    ];
    let c = Ctx {
        q: &[],
        rows: &rows,
        tables: &[],
        kv: Elems::<f32> { k: &[], v: &[] },
        bs: 16,
        kvh: 3,
        hd: 64,
        n_heads: 9,
        group: 3,
        scale: 1.0,
        window: None,
    };
    let mut scratch = AttnScratch::new(4, 9, 64, 2);
    plan_row_blocks(&c, &mut scratch.blocks);
    assert!(plan_segments(&c, &mut scratch, Isa::Plain));
    // 6 tasks for 2 threads: the long row in its fixed segments of 128 keys (the last one
    // partial); the short one whole.
    let mut long: Vec<(u32, u32)> = (0..23).map(|j| (128 * j, 128 * j + 127)).collect();
    long.push((2944, 2999));
    for g in 0..3u32 {
        let segs: Vec<_> = scratch
            .segments
            .iter()
            .filter(|s| s.t == 0 && s.g == g)
            .map(|s| (s.lo, s.hi))
            .collect();
        assert_eq!(segs, long);
        let short: Vec<_> = scratch
            .segments
            .iter()
            .filter(|s| s.t == 1 && s.g == g)
            .map(|s| (s.lo, s.hi))
            .collect();
        assert_eq!(short, vec![(0, 99)]);
    }
    // A sliding window cuts the first segment, not the grid.
    let c = Ctx {
        window: Some(1000),
        ..c
    };
    plan_row_blocks(&c, &mut scratch.blocks);
    assert!(plan_segments(&c, &mut scratch, Isa::Plain));
    let segs: Vec<_> = scratch
        .segments
        .iter()
        .filter(|s| s.t == 0 && s.g == 0)
        .map(|s| (s.lo, s.hi))
        .collect();
    assert_eq!(segs[..2], [(2000, 2047), (2048, 2175)]);
    assert_eq!(segs.last(), Some(&(2944, 2999)));
    // Enough tasks already: no split.
    let mut scratch = AttnScratch::new(4, 9, 64, 1);
    plan_row_blocks(&c, &mut scratch.blocks);
    assert!(!plan_segments(&c, &mut scratch, Isa::Plain));
    // A row block (a verification's 5 rows at 2995..=2999) is one task per K/V head unsplit:
    // split, each segment is a task for all 5 rows, their parts end to end in the scratch.
    let rows: Vec<AttnRow> = (2995..3000)
        .map(|pos| AttnRow {
            pos,
            table_start: 0,
            table_len: 188,
        })
        .collect();
    let c = Ctx {
        rows: &rows,
        window: None,
        ..c
    };
    let mut scratch = AttnScratch::new(5, 9, 64, 2);
    plan_row_blocks(&c, &mut scratch.blocks);
    assert!(plan_segments(&c, &mut scratch, Isa::Plain));
    assert_eq!(scratch.segments.len(), 3 * 24);
    let slot = 3 * (64 + 2);
    for (i, s) in scratch.segments.iter().enumerate() {
        assert_eq!((s.t, s.n, s.g), (0, 5, i as u32 / 24));
        assert_eq!((s.lo, s.hi), long[i % 24]);
        assert_eq!(s.at as usize, i * 5 * slot);
    }
    // Rows that read their tiles in place take all their K/V heads in one task (a segment
    // reads its blocks whole), as many as fit ROW_BLOCK (head, row) pairs, even where the
    // unsplit plan has enough tasks: the decode rows at 2999 and 99 on one thread.
    let c = Ctx {
        rows: &rows_pair(),
        ..c
    };
    for isa in isas().into_iter().filter(|&i| i != Isa::Plain) {
        let mut scratch = AttnScratch::new(4, 9, 64, 1);
        plan_row_blocks(&c, &mut scratch.blocks);
        assert!(plan_segments(&c, &mut scratch, isa), "{isa:?}");
        // 24 segments of the long row, then the short row's one, 3 heads each.
        assert_eq!(scratch.segments.len(), 25, "{isa:?}");
        for (i, s) in scratch.segments.iter().enumerate() {
            let (t, lohi) = if i < 24 { (0, long[i]) } else { (1, (0, 99)) };
            assert_eq!((s.t, s.n, s.g, s.gn), (t, 1, 0, 3), "{isa:?} {i}");
            assert_eq!((s.lo, s.hi), lohi, "{isa:?} {i}");
            assert_eq!(s.at as usize, i * 3 * slot, "{isa:?} {i}");
        }
        // The verification's 5 rows: 3 heads of 5 rows fit 16 (head, row) pairs.
        let c = Ctx { rows: &rows, ..c };
        let mut scratch = AttnScratch::new(5, 9, 64, 2);
        plan_row_blocks(&c, &mut scratch.blocks);
        assert!(plan_segments(&c, &mut scratch, isa), "{isa:?}");
        assert_eq!(scratch.segments.len(), 24, "{isa:?}");
        for (i, s) in scratch.segments.iter().enumerate() {
            assert_eq!((s.t, s.n, s.g, s.gn), (0, 5, 0, 3), "{isa:?} {i}");
            assert_eq!(s.at as usize, i * 3 * 5 * slot, "{isa:?} {i}");
        }
        // A decode row at 200 keys has 2 segments: one head per task, so that 2 threads get 6
        // tasks, not 2.
        let row = [AttnRow {
            pos: 199,
            table_start: 0,
            table_len: 188,
        }];
        let c = Ctx { rows: &row, ..c };
        let mut scratch = AttnScratch::new(1, 9, 64, 2);
        plan_row_blocks(&c, &mut scratch.blocks);
        assert!(plan_segments(&c, &mut scratch, isa), "{isa:?}");
        let plan: Vec<_> = scratch.segments.iter().map(|s| (s.g, s.gn, s.lo)).collect();
        let want: Vec<_> = (0..3).flat_map(|g| [(g, 1, 0), (g, 1, 128)]).collect();
        assert_eq!(plan, want, "{isa:?}");
    }
}

/// The decode rows of [`split_k_plans_cover_the_keys`]: positions 2999 and 99 of one table.
fn rows_pair() -> [AttnRow; 2] {
    [2999, 99].map(|pos| AttnRow {
        pos,
        table_start: 0,
        table_len: 188,
    })
}

/// A row's output is bitwise the same alone and in batches of 1 to 40 rows (decode rows of
/// other sequences and runs of consecutive prefill rows, short and long, which share tiles
/// in row blocks), whichever way the segments run (split-K planned for 1, 2 or 8 threads, or
/// never) and on 1 to 3 threads, and on every ISA the same as in the portable build: long
/// (3000-key) and short target rows, with and without a sliding window, K/V in every
/// format (f32, f16, bf16, q8_0).
#[test]
fn attention_rows_are_batch_invariant() {
    // Other rows to mix in: decode rows of every sequence, then a prefill run of sequence 1.
    let mut others: Vec<(usize, usize)> = vec![(0, 2500), (1, 699), (2, 299), (3, 44)];
    others.extend((600..640).map(|p| (1, p)));
    // (1, 640): a position at a tile's first key, so that in the last tile it sees one key
    // (a lanes path's edge).
    let targets = [(0usize, 2999usize), (2, 130), (3, 40), (1, 640)];
    batch_invariance(&[3000, 700, 300, 45], &targets, &others, &DTS, Some(1000));
}

/// The same at long context: a decode row at 16,400 keys (129 segments of split-K), with
/// rows of a short sequence and a prefill run beside it, in the K/V formats long contexts
/// use (f16, q8_0), without a window (the segments are the same code at any length).
#[test]
fn attention_rows_are_batch_invariant_at_16k() {
    let mut others: Vec<(usize, usize)> = vec![(0, 2000), (1, 699)];
    others.extend((600..620).map(|p| (1, p)));
    batch_invariance(
        &[16_400, 700],
        &[(0, 16_399)],
        &others,
        &[Dt::F16, Dt::Q8_0],
        None,
    );
}

/// Rows read in place (a decode row; 2 and 5 consecutive rows, a verification of drafts) give
/// the portable build's bits for every group size the kernels unroll (1 to 4 heads, and 5,
/// which is 4 and 1), head dimensions that are and are not a multiple of 8 (the AVX2 kernel's
/// condition), blocks of 16 and 32 keys, with and without split-K, in every K/V format.
#[test]
fn in_place_rows_equal_the_portable_build() {
    let mut rng = Rng(77);
    for (group, hd, bs) in [
        (1, 64, 16),
        (2, 128, 32),
        (4, 64, 16),
        (5, 40, 16),
        (5, 72, 32),
    ] {
        let (kvh, len) = (2usize, 700usize);
        let n_heads = group * kvh;
        let blocks = len.div_ceil(bs);
        // The blocks in reverse: the table is not the identity.
        let tables: Vec<u32> = (0..blocks as u32).rev().collect();
        let n = blocks * bs * kvh * hd;
        let k: Vec<f32> = (0..n).map(|_| rng.signed() * 2.0).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.signed()).collect();
        let stored = Stored::new(k, v, bs, kvh, hd);
        let scale = 1.0 / (hd as f32).sqrt();
        for (n_rows, dt) in [1, 2, 5].into_iter().flat_map(|n| DTS.map(|dt| (n, dt))) {
            let q: Vec<f32> = (0..n_rows * n_heads * hd)
                .map(|_| rng.signed() * 2.0)
                .collect();
            // The last row inside a tile, so the last tile has invisible lanes, and each row
            // sees one key more than the row before.
            let rows: Vec<AttnRow> = (len - 5 - n_rows..len - 5)
                .map(|pos| AttnRow {
                    pos: pos as u32,
                    table_start: 0,
                    table_len: blocks as u32,
                })
                .collect();
            let kv = stored.layer(dt);
            let run = |isa: Isa, split: Split| {
                let mut out = vec![f32::NAN; q.len()];
                let mut scratch = AttnScratch::new(n_rows, n_heads, hd, 2);
                paged_attention_with(
                    &q,
                    &rows,
                    &tables,
                    &kv,
                    n_heads,
                    scale,
                    None,
                    &mut out,
                    &mut scratch,
                    isa,
                    split,
                );
                out
            };
            let portable = run(Isa::Plain, Split::Never);
            for isa in isas() {
                for split in [Split::Never, Split::Auto] {
                    let got = run(isa, split);
                    for (i, (a, b)) in portable.iter().zip(&got).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{isa:?} {split:?} {dt:?} group {group} hd {hd} bs {bs}, {n_rows} \
                             rows, at {i}: {b} vs the portable {a}"
                        );
                    }
                }
            }
        }
    }
}

fn batch_invariance(
    seq_lens: &[usize],
    targets: &[(usize, usize)],
    others: &[(usize, usize)],
    dts: &[Dt],
    window: Option<usize>,
) {
    let (n_heads, kvh, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let mut rng = Rng(31);
    let blocks_per: Vec<usize> = seq_lens.iter().map(|l| l.div_ceil(bs)).collect();
    let num_blocks: usize = blocks_per.iter().sum();
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        let j = (rng.next_u() % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    let mut starts = Vec::new();
    let mut st = 0;
    for &b in &blocks_per {
        starts.push(st);
        st += b;
    }
    let len = num_blocks * bs * kvh * hd;
    let k: Vec<f32> = (0..len).map(|_| rng.signed() * 2.0).collect();
    let v: Vec<f32> = (0..len).map(|_| rng.signed()).collect();
    let stored = Stored::new(k, v, bs, kvh, hd);
    let row = |sq: usize, pos: usize| AttnRow {
        pos: pos as u32,
        table_start: starts[sq] as u32,
        table_len: blocks_per[sq] as u32,
    };
    // Queries are drawn per (sequence, position): a row brings the same q into any batch.
    let qrow = |sq: usize, pos: usize| -> Vec<f32> {
        let mut r = Rng(1000 * sq as u64 + pos as u64 + 1);
        (0..n_heads * hd).map(|_| r.signed() * 2.0).collect()
    };
    let pools = thread_pools(&[1, 2, 3]);
    let scale = 1.0 / (hd as f32).sqrt();
    for &dt in dts {
        let kv = stored.layer(dt);
        // bf16 widens as f16 does (one more exact conversion): no window, to save time.
        let windows = match (dt, window) {
            (Dt::Bf16, _) | (_, None) => vec![None],
            (_, Some(w)) => vec![None, Some(w)],
        };
        for window in windows {
            for isa in isas() {
                for &target in targets {
                    let tq = qrow(target.0, target.1);
                    let solo = |isa: Isa, split: Split| {
                        let mut out = vec![f32::NAN; tq.len()];
                        paged_attention_with(
                            &tq,
                            &[row(target.0, target.1)],
                            &ids,
                            &kv,
                            n_heads,
                            scale,
                            window,
                            &mut out,
                            &mut AttnScratch::new(1, n_heads, hd, 2),
                            isa,
                            split,
                        );
                        out
                    };
                    let alone = solo(isa, Split::Auto);
                    // The instruction set changes speed, not bits: the portable build
                    // gives the same row.
                    let portable = solo(Isa::Plain, Split::Never);
                    assert!(
                        portable
                            .iter()
                            .zip(&alone)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} {dt:?} K/V, window {window:?}: row {target:?} differs from \
                         the portable build"
                    );
                    // The target at a varying place among size - 1 others.
                    let mut batches: Vec<(Vec<(usize, usize)>, usize)> = Vec::new();
                    for (bi, &size) in [1usize, 2, 3, 5, 8, 13, 24, 40].iter().enumerate() {
                        let at = (bi * 7) % size;
                        let mut batch: Vec<(usize, usize)> = others
                            .iter()
                            .cycle()
                            .skip(bi)
                            .take(size - 1)
                            .copied()
                            .collect();
                        batch.insert(at, target);
                        batches.push((batch, at));
                    }
                    // In a run of consecutive rows of its own sequence (a prefill chunk),
                    // sharing every tile with its neighbours in a row block, at each place.
                    let (sq, pos) = target;
                    for before in [1usize, 3, 7, 8, 12] {
                        let first = pos.saturating_sub(before);
                        let last = (pos + 5).min(seq_lens[sq] - 1);
                        batches.push(((first..=last).map(|p| (sq, p)).collect(), pos - first));
                    }
                    for (batch, at) in batches {
                        let size = batch.len();
                        let rows: Vec<AttnRow> = batch.iter().map(|&(sq, p)| row(sq, p)).collect();
                        let q: Vec<f32> = batch.iter().flat_map(|&(sq, p)| qrow(sq, p)).collect();
                        let runs = [(1, Split::Auto), (2, Split::Auto), (8, Split::Auto)]
                            .into_iter()
                            .chain([(2, Split::Never)]);
                        for (pi, (threads, split)) in runs.enumerate() {
                            let mut got = vec![f32::NAN; q.len()];
                            let mut scratch = AttnScratch::new(size, n_heads, hd, threads);
                            pools[pi % 3].install(|| {
                                paged_attention_with(
                                    &q,
                                    &rows,
                                    &ids,
                                    &kv,
                                    n_heads,
                                    scale,
                                    window,
                                    &mut got,
                                    &mut scratch,
                                    isa,
                                    split,
                                )
                            });
                            let w = n_heads * hd;
                            let same = got[at * w..(at + 1) * w]
                                .iter()
                                .zip(&alone)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(
                                same,
                                "{isa:?} {dt:?} K/V, window {window:?}: row {target:?} \
                                 differs in a batch of {size} (at {at}), split-K for \
                                 {threads} threads, {split:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
