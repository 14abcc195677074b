use super::*;
use crate::model::kernels::cpu::test_rng::best_of;

/// smollm's K/V shape (3 K/V heads of 64, blocks of 16): a cache of `ctx` keys in every
/// format, and its block table (blocks in reverse order).
fn smollm_cache(ctx: usize) -> (tests::Stored, Vec<u32>) {
    let (kvh, hd, bs) = (3, 64, 16);
    let blocks = ctx / bs;
    let len = blocks * bs * kvh * hd;
    let k: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
    let v: Vec<f32> = (0..len).map(|i| (i % 7) as f32 * 0.02 - 0.06).collect();
    (
        tests::stored(k, v, bs, kvh, hd),
        (0..blocks as u32).rev().collect(),
    )
}

/// The last `n` rows of a sequence of `ctx` keys whose block table is `tables`: a decode row,
/// or a verification of `n - 1` drafts.
fn last_rows(ctx: usize, n: usize, tables: &[u32]) -> Vec<AttnRow> {
    (ctx - n..ctx)
        .map(|pos| AttnRow {
            pos: pos as u32,
            table_start: 0,
            table_len: tables.len() as u32,
        })
        .collect()
}

#[test]
#[ignore]
fn timing_decode_attention() {
    let (n_heads, hd) = (9usize, 64usize);
    let threads = rayon::current_num_threads();
    for &ctx in &[512usize, 2048, 8192] {
        let (stored, tables) = smollm_cache(ctx);
        let rows = last_rows(ctx, 1, &tables);
        let q = vec![0.1f32; n_heads * hd];
        let mut out = vec![0.0f32; n_heads * hd];
        let mut scratch = AttnScratch::new(1, n_heads, hd, threads);
        let names = ["f32", "f16", "bf16", "q8_0"];
        let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        for _ in 0..15 {
            for (f, round) in rounds.iter_mut().enumerate() {
                let kv = stored.layer_of(f);
                round.push(best_of(40, || {
                    paged_attention(
                        &q,
                        &rows,
                        &tables,
                        &kv,
                        n_heads,
                        0.125,
                        None,
                        &mut out,
                        &mut scratch,
                    )
                }));
            }
        }
        for (f, round) in rounds.iter_mut().enumerate() {
            round.sort_by(f64::total_cmp);
            let kv = stored.layer_of(f);
            let bytes = kv.k.bytes() + kv.v.bytes();
            println!(
                "attention ctx {ctx} {}: {:.1} us (median of rounds {:.1} us), {:.1} GB/s of \
                 K/V",
                names[f],
                round[0] * 1e6,
                round[round.len() / 2] * 1e6,
                bytes as f64 / round[0] / 1e9
            );
        }
    }
}

/// A verification of 4 drafts (5 consecutive rows of one sequence), smollm's heads, f16 K/V:
/// split-K over the row block's segments against one task per K/V head.
#[test]
#[ignore]
fn timing_row_block_attention() {
    let (n_heads, hd, n) = (9usize, 64usize, 5usize);
    let threads = rayon::current_num_threads();
    for &ctx in &[512usize, 2048, 8192] {
        let (stored, tables) = smollm_cache(ctx);
        let kv = stored.layer_of(1);
        let rows = last_rows(ctx, n, &tables);
        let q = vec![0.1f32; n * n_heads * hd];
        let mut out = vec![0.0f32; n * n_heads * hd];
        let mut scratch = AttnScratch::new(n, n_heads, hd, threads);
        let mut rounds = [Vec::new(), Vec::new()];
        for _ in 0..15 {
            for (round, split) in rounds.iter_mut().zip([Split::Auto, Split::Never]) {
                round.push(best_of(40, || {
                    paged_attention_with(
                        &q,
                        &rows,
                        &tables,
                        &kv,
                        n_heads,
                        0.125,
                        None,
                        &mut out,
                        &mut scratch,
                        detect_isa(),
                        split,
                    )
                }));
            }
        }
        let median = |r: &mut Vec<f64>| {
            r.sort_by(f64::total_cmp);
            r[r.len() / 2] * 1e6
        };
        let [auto, never] = &mut rounds;
        println!(
            "{n} rows at ctx {ctx}, f16, {threads} threads: split-K {:.1} us, one task per K/V \
             head {:.1} us (medians of rounds)",
            median(auto),
            median(never)
        );
    }
}

/// A verification of 0 to 15 drafts (1 to 16 consecutive rows of one sequence) at a long
/// context, smollm's heads, f16 K/V: what a step's attention costs by its rows.
#[test]
#[ignore]
fn timing_verification_rows() {
    let (n_heads, hd, ctx) = (9usize, 64usize, 4096usize);
    let threads = rayon::current_num_threads();
    let (stored, tables) = smollm_cache(ctx);
    let kv = stored.layer_of(1);
    for n in 1..=16usize {
        let rows = last_rows(ctx, n, &tables);
        let q = vec![0.1f32; n * n_heads * hd];
        let mut out = vec![0.0f32; n * n_heads * hd];
        let mut scratch = AttnScratch::new(n, n_heads, hd, threads);
        let mut rounds = Vec::new();
        for _ in 0..9 {
            rounds.push(best_of(20, || {
                paged_attention(
                    &q,
                    &rows,
                    &tables,
                    &kv,
                    n_heads,
                    0.125,
                    None,
                    &mut out,
                    &mut scratch,
                )
            }));
        }
        rounds.sort_by(f64::total_cmp);
        println!(
            "{n} rows at ctx {ctx}, f16, {threads} threads: {:.1} us (median of rounds)",
            rounds[rounds.len() / 2] * 1e6
        );
    }
}

/// One decode row through 16 layers of a 1B llama's K/V (8 K/V heads of 64, 32 query heads,
/// blocks of 16, f16) at `ATTN_CTX` keys (default 7,680): 16 distinct caches in turn, so K/V
/// comes from DRAM as in a decode step, not from a cache that one layer left warm.
/// `ATTN_SAME=1` reads the first layer's cache 16 times instead (from L2 at short contexts:
/// the arithmetic alone).
#[test]
#[ignore]
fn timing_decode_attention_from_memory() {
    let ctx: usize = std::env::var("ATTN_CTX")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7680);
    let (kvh, n_heads, hd, bs, layers) = (8usize, 32usize, 64usize, 16usize, 16usize);
    let threads = rayon::current_num_threads();
    let len = ctx * kvh * hd;
    let caches: Vec<(Vec<f16>, Vec<f16>)> = (0..layers)
        .map(|l| {
            let k = (0..len)
                .map(|i| f16::from_f32(((i + l) % 13) as f32 * 0.01 - 0.06))
                .collect();
            let v = (0..len)
                .map(|i| f16::from_f32(((i + l) % 7) as f32 * 0.02 - 0.06))
                .collect();
            (k, v)
        })
        .collect();
    let tables: Vec<u32> = (0..(ctx / bs) as u32).collect();
    let rows = last_rows(ctx, 1, &tables);
    let q = vec![0.1f32; n_heads * hd];
    let mut out = vec![0.0f32; n_heads * hd];
    let mut scratch = AttnScratch::new(1, n_heads, hd, threads);
    let mut step = || {
        let same = std::env::var("ATTN_SAME").is_ok();
        for l in 0..layers {
            let (k, v) = &caches[if same { 0 } else { l }];
            let kv = KvLayer {
                k: KvData::F16(k),
                v: KvData::F16(v),
                block_size: bs,
                kv_heads: kvh,
                head_dim: hd,
            };
            paged_attention(
                &q,
                &rows,
                &tables,
                &kv,
                n_heads,
                0.125,
                None,
                &mut out,
                &mut scratch,
            );
        }
    };
    let mut rounds: Vec<f64> = (0..7).map(|_| best_of(5, &mut step)).collect();
    rounds.sort_by(f64::total_cmp);
    let bytes = (layers * 2 * len * 2) as f64;
    println!(
        "decode attention, 16 layers of 1B K/V at ctx {ctx} (f16, {:.0} MB): {:.2} ms (median of \
         rounds {:.2} ms), {:.1} GB/s of K/V",
        bytes / 1e6,
        rounds[0] * 1e3,
        rounds[rounds.len() / 2] * 1e3,
        bytes / rounds[rounds.len() / 2] / 1e9
    );
}
