//! Every CUDA kernel against its CPU twin, on random inputs. These need a GPU, so cargo reports
//! them as ignored unless run with `--include-ignored`; then, without a GPU, they print why and
//! return (`STRATA_REQUIRE_GPU=1`, the GPU bundle's, makes that a failure). The tolerance of each
//! comparison is stated where it is made, with the reason. What can run without a GPU does:
//! `attention_cases_are_sound_on_the_cpu` checks the attention harness (caches, tables, rows)
//! against the f64 reference.

use cudarc::driver::CudaSlice;
use half::{bf16, f16};

use super::kernels::{attention_rows, DeviceRopeTable, KvElem, KvLayout, SLOT_SKIP};
use super::test_support::{gpu_or_skip, Gpu};
use crate::kv::blocks::{BlockPool, KvDtype};
use crate::model::kernels::cpu::attention::{paged_attention, AttnRow, AttnScratch, KvData};
use crate::model::kernels::cpu::test_rng::Rng;
use crate::model::kernels::cpu::{embedding, rmsnorm, rope, swiglu, MatRef, WeightData};

fn upload<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, host: &[T]) -> CudaSlice<T> {
    gpu.stream.clone_htod(host).expect("a host-to-device copy")
}

fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    gpu: &Gpu,
    dev: &CudaSlice<T>,
) -> Vec<T> {
    let host = gpu.stream.clone_dtoh(dev).expect("a device-to-host copy");
    gpu.stream.synchronize().expect("the stream finishes");
    host
}

/// `|got - want| <= rel * |want| + abs` everywhere, NaN never.
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs() + abs,
            "{what}: element {i}: GPU {g} vs CPU {w}"
        );
    }
}

fn assert_same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}: element {i}: GPU {g} vs CPU {w}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn rmsnorm_matches_the_cpu() {
    let Some(gpu) = gpu_or_skip("rmsnorm_matches_the_cpu") else {
        return;
    };
    let mut rng = Rng(5);
    for &(rows, d) in &[(1usize, 576usize), (3, 67), (5, 1), (300, 64), (7, 4096)] {
        let x = rng.scaled(rows * d, 4.0);
        let w: Vec<f32> = (0..d).map(|_| rng.signed() + 1.0).collect();
        let mut want = vec![0.0; rows * d];
        rmsnorm::rmsnorm(&x, &w, 1e-6, &mut want);
        let (dx, dw) = (upload(&gpu, &x), upload(&gpu, &w));
        let mut dout = gpu
            .stream
            .alloc_zeros::<f32>(rows * d)
            .expect("an allocation");
        gpu.kernels
            .rmsnorm(
                &gpu.stream,
                &dx.as_view(),
                &dw.as_view(),
                1e-6,
                &mut dout.as_view_mut(),
            )
            .expect("rmsnorm launches");
        // f32 sums of squares in a different order (a tree vs 16 lanes): ~1e-6 relative in
        // the scale typically, 1e-5 at worst for d = 4096; 3e-5 relative plus 1e-6 for outputs
        // near zero. A wrong mean or a missed element is off by 1e-4 or more.
        assert_close("rmsnorm", &download(&gpu, &dout), &want, 3e-5, 1e-6);
        let mut dx = dx;
        gpu.kernels
            .rmsnorm_inplace(&gpu.stream, &mut dx.as_view_mut(), &dw.as_view(), 1e-6)
            .expect("rmsnorm_inplace launches");
        assert_close("rmsnorm_inplace", &download(&gpu, &dx), &want, 3e-5, 1e-6);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn rope_matches_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu_or_skip("rope_matches_the_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(11);
    let scaling = rope::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64.0,
    };
    for (head_dim, n_heads) in [(64usize, 9usize), (34, 3), (128, 2)] {
        let table = rope::RopeTable::try_new(head_dim, 10000.0, &scaling, 300).expect("a table");
        let dtable = DeviceRopeTable::upload(&gpu.stream, &table).expect("the table uploads");
        let positions: Vec<u32> = vec![0, 1, 17, 63, 64, 65, 200, 299];
        let x = rng.scaled(positions.len() * n_heads * head_dim, 1.0);
        let mut want = x.clone();
        for (t, &pos) in positions.iter().enumerate() {
            let row = &mut want[t * n_heads * head_dim..(t + 1) * n_heads * head_dim];
            table.apply(row, n_heads, pos as usize);
        }
        let mut dx = upload(&gpu, &x);
        let dpos = upload(&gpu, &positions);
        gpu.kernels
            .rope(
                &gpu.stream,
                &mut dx.as_view_mut(),
                n_heads,
                &dpos.as_view(),
                &dtable,
            )
            .expect("rope launches");
        // The same table, and the kernel rounds each product and sum as the CPU does (no FMA):
        // tolerance 0.
        assert_same_bits("rope", &download(&gpu, &dx), &want);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn rope_past_the_table_is_nan() {
    let Some(gpu) = gpu_or_skip("rope_past_the_table_is_nan") else {
        return;
    };
    let table = rope::RopeTable::try_new(8, 10000.0, &rope::RopeScaling::None, 4).expect("a table");
    let dtable = DeviceRopeTable::upload(&gpu.stream, &table).expect("the table uploads");
    let mut dx = upload(&gpu, &[1.0f32; 16]);
    let dpos = upload(&gpu, &[3u32, 4]);
    gpu.kernels
        .rope(
            &gpu.stream,
            &mut dx.as_view_mut(),
            1,
            &dpos.as_view(),
            &dtable,
        )
        .expect("rope launches");
    let got = download(&gpu, &dx);
    assert!(got[..8].iter().all(|v| v.is_finite()));
    assert!(got[8..].iter().all(|v| v.is_nan()));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn silu_mul_matches_the_cpu() {
    let Some(gpu) = gpu_or_skip("silu_mul_matches_the_cpu") else {
        return;
    };
    let mut rng = Rng(9);
    // Odd lengths, and one past ELEMENTWISE_MAX_BLOCKS * 256 so the grid-stride loop wraps.
    for &len in &[1usize, 15, 17, 1000, 65_536 * 256 + 5] {
        let gate = rng.scaled(len, 30.0);
        let up = rng.scaled(len, 3.0);
        let mut want = gate.clone();
        swiglu::silu_mul(&mut want, &up);
        let mut dgate = upload(&gpu, &gate);
        let dup = upload(&gpu, &up);
        gpu.kernels
            .silu_mul(&gpu.stream, &mut dgate.as_view_mut(), &dup.as_view())
            .expect("silu_mul launches");
        // The CPU's polynomial exp is within 2e-7 relative and CUDA's expf within 2 ulp; one
        // division and one product each: 1e-5 relative, and 1e-7 absolute for silu(g) ~ 0.
        assert_close("silu_mul", &download(&gpu, &dgate), &want, 1e-5, 1e-7);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn residual_add_is_exact() {
    let Some(gpu) = gpu_or_skip("residual_add_is_exact") else {
        return;
    };
    let mut rng = Rng(3);
    for &len in &[1usize, 1000, 70_001] {
        let (x, y) = (rng.scaled(len, 10.0), rng.scaled(len, 10.0));
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let mut dx = upload(&gpu, &x);
        let dy = upload(&gpu, &y);
        gpu.kernels
            .add_inplace(&gpu.stream, &mut dx.as_view_mut(), &dy.as_view())
            .expect("add launches");
        // One IEEE addition per element on both: tolerance 0.
        assert_same_bits("add_inplace", &download(&gpu, &dx), &want);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn embedding_matches_the_cpu_exactly_for_every_dtype() {
    let Some(gpu) = gpu_or_skip("embedding_matches_the_cpu_exactly_for_every_dtype") else {
        return;
    };
    let mut rng = Rng(42);
    for &(vocab, hidden) in &[(7usize, 33usize), (50, 64), (3, 1), (1000, 896)] {
        let wf = rng.scaled(vocab * hidden, 100.0);
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let tokens: Vec<u32> = vec![0, vocab as u32 / 2, vocab as u32 - 1, vocab as u32 / 3];
        for data in [
            WeightData::F32(&wf),
            WeightData::F16(&wh),
            WeightData::Bf16(&wb),
        ] {
            let matrix = MatRef {
                data,
                rows: vocab,
                cols: hidden,
            };
            let mut want = vec![0.0; tokens.len() * hidden];
            for (t, &tok) in tokens.iter().enumerate() {
                embedding::embed(matrix, tok, &mut want[t * hidden..(t + 1) * hidden]);
            }
            let dtokens = upload(&gpu, &tokens);
            let mut dout = gpu
                .stream
                .alloc_zeros::<f32>(want.len())
                .expect("an allocation");
            let launched = match data {
                WeightData::F32(w) => gpu.kernels.embedding(
                    &gpu.stream,
                    &upload(&gpu, w).as_view(),
                    vocab,
                    &dtokens.as_view(),
                    &mut dout.as_view_mut(),
                ),
                WeightData::F16(w) => gpu.kernels.embedding(
                    &gpu.stream,
                    &upload(&gpu, w).as_view(),
                    vocab,
                    &dtokens.as_view(),
                    &mut dout.as_view_mut(),
                ),
                WeightData::Bf16(w) => gpu.kernels.embedding(
                    &gpu.stream,
                    &upload(&gpu, w).as_view(),
                    vocab,
                    &dtokens.as_view(),
                    &mut dout.as_view_mut(),
                ),
                WeightData::Quant(..) | WeightData::Interleaved(..) => {
                    unreachable!("the tables here are f32, f16, bf16")
                }
            };
            launched.expect("embedding launches");
            // (The temporary table is freed after the launch in stream order: cudarc's drop uses
            // cuMemFreeAsync on the same stream, or synchronizes the stream before cuMemFree.)
            // Widening f16 and bf16 to f32 is exact: tolerance 0.
            assert_same_bits("embedding", &download(&gpu, &dout), &want);
        }
    }
}

/// The CPU pool's layer as one buffer (its K array, then its V array: `KvLayout::per_layer`).
fn concat<T: Copy>(k: &[T], v: &[T]) -> Vec<T> {
    [k, v].concat()
}

/// The same layer in a block-major buffer of `layers` layers, at `layer`: block by block, each
/// layer's K then V (`KvLayout::block_major`); the other layers' parts hold `fill`.
fn block_major<T: Copy>(
    k: &[T],
    v: &[T],
    elems: usize,
    layers: usize,
    layer: usize,
    fill: T,
) -> Vec<T> {
    let blocks = k.len() / elems;
    let mut out = vec![fill; blocks * layers * 2 * elems];
    for b in 0..blocks {
        let at = (b * layers + layer) * 2 * elems;
        out[at..at + elems].copy_from_slice(&k[b * elems..(b + 1) * elems]);
        out[at + elems..at + 2 * elems].copy_from_slice(&v[b * elems..(b + 1) * elems]);
    }
    out
}

/// Writes `k`/`v` rows at `slots` through the GPU into a zeroed cache of `len` elements laid out
/// as `layout`, and returns the cache.
fn gpu_kv_write<T: KvElem + cudarc::driver::ValidAsZeroBits + Default + Clone>(
    gpu: &Gpu,
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    layout: KvLayout,
    len: usize,
) -> Vec<T> {
    let (dk, dv, dslots) = (upload(gpu, k), upload(gpu, v), upload(gpu, slots));
    let mut cache = gpu.stream.alloc_zeros::<T>(len).expect("an allocation");
    gpu.kernels
        .kv_write(
            &gpu.stream,
            &dk.as_view(),
            &dv.as_view(),
            &dslots.as_view(),
            layout,
            &mut cache.as_view_mut(),
        )
        .expect("kv_write launches");
    download(gpu, &cache)
}

/// K/V caches written by the GPU equal the block pool's, bit for bit, for f32 and f16, in the
/// CPU pool's layout and in the engine's block-major device layout.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn kv_write_matches_the_block_pool_bit_for_bit() {
    let Some(gpu) = gpu_or_skip("kv_write_matches_the_block_pool_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(17);
    let (num_blocks, block_size, kv_heads, head_dim) = (6usize, 16usize, 2usize, 64usize);
    let width = kv_heads * head_dim;
    let elems = block_size * width;
    let per_layer = KvLayout::per_layer(block_size, kv_heads, head_dim, num_blocks);
    // Layer 1 of 3 in the device pool's layout.
    let device = KvLayout::block_major(block_size, kv_heads, head_dim, num_blocks, 3, 1);
    // Rows at scattered slots, one padded row that must not be written.
    let slots: Vec<u32> = vec![0, 17, 5 * 16 + 15, 3 * 16 + 2, SLOT_SKIP, 2 * 16 + 9];
    // Values beyond f16's range and below its precision too: the rounding must agree.
    let mut k = rng.scaled(slots.len() * width, 4.0);
    let v = rng.scaled(slots.len() * width, 4.0);
    k[3] = 1e6;
    k[4] = 1e-9;
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut pool =
            BlockPool::new(1, num_blocks, block_size, kv_heads, head_dim, dtype).expect("a pool");
        for (t, &slot) in slots.iter().enumerate() {
            if slot != SLOT_SKIP {
                let r = t * width..(t + 1) * width;
                pool.write(0, slot as usize, &k[r.clone()], &v[r]);
            }
        }
        let layer = pool.layer(0);
        match (layer.k, layer.v) {
            (KvData::F32(want_k), KvData::F32(want_v)) => {
                let got: Vec<f32> =
                    gpu_kv_write(&gpu, &k, &v, &slots, per_layer, 2 * num_blocks * elems);
                assert_same_bits("cache f32", &got, &concat(want_k, want_v));
                let got: Vec<f32> =
                    gpu_kv_write(&gpu, &k, &v, &slots, device, 3 * 2 * num_blocks * elems);
                let want = block_major(want_k, want_v, elems, 3, 1, 0.0);
                assert_same_bits("block-major cache f32", &got, &want);
            }
            (KvData::F16(want_k), KvData::F16(want_v)) => {
                // Both round to nearest even: the same bits (tolerance 0).
                let bits = |x: &[f16]| x.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
                let got: Vec<f16> =
                    gpu_kv_write(&gpu, &k, &v, &slots, per_layer, 2 * num_blocks * elems);
                assert_eq!(bits(&got), bits(&concat(want_k, want_v)), "cache f16");
                let got: Vec<f16> =
                    gpu_kv_write(&gpu, &k, &v, &slots, device, 3 * 2 * num_blocks * elems);
                let want = block_major(want_k, want_v, elems, 3, 1, f16::ZERO);
                assert_eq!(bits(&got), bits(&want), "block-major cache f16");
            }
            _ => panic!("the pool's K and V differ in dtype"),
        }
    }
}

/// One attention case: sequences given as (start position of the new rows, new rows), each with
/// a shuffled block table, over a cache filled with random K/V.
struct AttentionCase {
    n_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    window: Option<usize>,
    /// (first new position, new rows): a decode row is (pos, 1), a prefill chunk (start, n).
    sequences: Vec<(usize, usize)>,
}

/// A case's inputs, and the CPU kernel's output for them.
struct AttentionInputs {
    pool: BlockPool,
    tables: Vec<u32>,
    rows: Vec<AttnRow>,
    q: Vec<f32>,
    scale: f32,
    want: Vec<f32>,
}

fn attention_inputs(case: &AttentionCase, dtype: KvDtype, seed: u64) -> AttentionInputs {
    let mut rng = Rng(seed);
    let AttentionCase {
        n_heads,
        kv_heads,
        head_dim,
        block_size,
        window,
        ..
    } = *case;
    let width = kv_heads * head_dim;
    let blocks_per_seq: Vec<usize> = case
        .sequences
        .iter()
        .map(|&(start, n)| (start + n).div_ceil(block_size))
        .collect();
    // Two spare blocks that no table uses.
    let num_blocks = blocks_per_seq.iter().sum::<usize>() + 2;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let mut pool =
        BlockPool::new(1, num_blocks, block_size, kv_heads, head_dim, dtype).expect("a pool");
    let mut tables = Vec::new();
    let mut rows = Vec::new();
    let mut next_id = 0;
    for (&(start, n), &blocks) in case.sequences.iter().zip(&blocks_per_seq) {
        let table = &ids[next_id..next_id + blocks];
        next_id += blocks;
        // The history and the new rows' own K/V, as the forward pass writes them first.
        for pos in 0..start + n {
            let slot = pool.slot(table, pos);
            pool.write(0, slot, &rng.scaled(width, 1.0), &rng.scaled(width, 1.0));
        }
        let table_start = tables.len() as u32;
        tables.extend_from_slice(table);
        for pos in start..start + n {
            rows.push(AttnRow {
                pos: pos as u32,
                table_start,
                table_len: table.len() as u32,
            });
        }
    }
    // Queries up to 3 in magnitude, so that softmax is far from uniform.
    let q = rng.scaled(rows.len() * n_heads * head_dim, 3.0);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut want = vec![0.0; q.len()];
    let mut scratch = AttnScratch::new(rows.len(), n_heads, head_dim, 2);
    paged_attention(
        &q,
        &rows,
        &tables,
        &pool.layer(0),
        n_heads,
        scale,
        window,
        &mut want,
        &mut scratch,
    );
    AttentionInputs {
        pool,
        tables,
        rows,
        q,
        scale,
        want,
    }
}

/// Runs the GPU's attention over `cache` (laid out as `layout`) and returns its output.
#[allow(clippy::too_many_arguments)]
fn gpu_attention<T: KvElem>(
    gpu: &Gpu,
    q: &[f32],
    rows: &[AttnRow],
    tables: &[u32],
    cache: &[T],
    layout: KvLayout,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
) -> Vec<f32> {
    let (dq, drows, dtables, dcache) = (
        upload(gpu, q),
        upload(gpu, &attention_rows(rows)),
        upload(gpu, tables),
        upload(gpu, cache),
    );
    let mut dout = gpu
        .stream
        .alloc_zeros::<f32>(q.len())
        .expect("an allocation");
    gpu.kernels
        .paged_attention(
            &gpu.stream,
            &dq.as_view(),
            &drows.as_view(),
            &dtables.as_view(),
            &dcache.as_view(),
            layout,
            n_heads,
            scale,
            window,
            &mut dout.as_view_mut(),
        )
        .expect("attention launches");
    download(gpu, &dout)
}

fn check_attention(gpu: &Gpu, case: &AttentionCase, dtype: KvDtype, seed: u64) {
    let AttentionCase {
        n_heads,
        kv_heads,
        head_dim,
        block_size,
        window,
        ..
    } = *case;
    let AttentionInputs {
        pool,
        tables,
        rows,
        q,
        scale,
        want,
    } = attention_inputs(case, dtype, seed);
    let layer = pool.layer(0);
    let num_blocks = pool.num_blocks();
    let per_layer = KvLayout::per_layer(block_size, kv_heads, head_dim, num_blocks);
    // The same layer as the engine's device pool holds it: layer 1 of 3 of contiguous blocks,
    // the other layers' parts filled with 1e4, which would show if they were read.
    let device = KvLayout::block_major(block_size, kv_heads, head_dim, num_blocks, 3, 1);
    let elems = per_layer.block_elems();
    let run = |cache_layout| match (layer.k, layer.v, cache_layout) {
        (KvData::F32(k), KvData::F32(v), false) => gpu_attention(
            gpu,
            &q,
            &rows,
            &tables,
            &concat(k, v),
            per_layer,
            n_heads,
            scale,
            window,
        ),
        (KvData::F32(k), KvData::F32(v), true) => {
            let cache = block_major(k, v, elems, 3, 1, 1e4f32);
            gpu_attention(
                gpu, &q, &rows, &tables, &cache, device, n_heads, scale, window,
            )
        }
        (KvData::F16(k), KvData::F16(v), false) => gpu_attention(
            gpu,
            &q,
            &rows,
            &tables,
            &concat(k, v),
            per_layer,
            n_heads,
            scale,
            window,
        ),
        (KvData::F16(k), KvData::F16(v), true) => {
            let cache = block_major(k, v, elems, 3, 1, f16::from_f32(1e4));
            gpu_attention(
                gpu, &q, &rows, &tables, &cache, device, n_heads, scale, window,
            )
        }
        _ => panic!("the pool's K and V differ in dtype"),
    };
    // Both twins read the same stored values (f16 widened exactly) and compute in f32; only
    // the order of the sums and the exp differ. Outputs are weighted means of V in [-1, 1]:
    // 5e-5 absolute (~400 ulp of 1) is well above that rounding (a few 1e-6) and far below any
    // indexing or masking error, which moves outputs by 1e-3 or more.
    let what = format!(
        "attention {dtype:?} heads {n_heads}/{kv_heads} x {head_dim}, block {block_size}, window {window:?}"
    );
    let got = run(false);
    assert_close(&what, &got, &want, 0.0, 5e-5);
    // The same arithmetic over the same values, only addressed differently: the same bits.
    assert_same_bits(&format!("{what}, block-major"), &run(true), &got);
}

/// Decode rows and prefill chunks, GQA and MHA, with and without a sliding window.
fn attention_cases() -> Vec<AttentionCase> {
    vec![
        // SmolLM-like: 9 heads over 3 K/V heads of 64; decode rows of several lengths, one of
        // them long enough for every warp to take many tiles, and a prefill chunk.
        AttentionCase {
            n_heads: 9,
            kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            window: None,
            sequences: vec![(0, 1), (5, 1), (31, 1), (32, 1), (1000, 1), (40, 24)],
        },
        // Qwen-like head_dim 128, group 7, a prefill from position 0 (the causal mask inside
        // one chunk) and a returning conversation's chunk after a long history.
        AttentionCase {
            n_heads: 14,
            kv_heads: 2,
            head_dim: 128,
            block_size: 16,
            window: None,
            sequences: vec![(0, 37), (700, 9)],
        },
        // A sliding window (Mistral), smaller than and larger than a tile, odd block size and
        // head_dim, MHA (group 1).
        AttentionCase {
            n_heads: 4,
            kv_heads: 4,
            head_dim: 40,
            block_size: 7,
            window: Some(20),
            sequences: vec![(0, 30), (90, 1), (300, 5)],
        },
        AttentionCase {
            n_heads: 8,
            kv_heads: 2,
            head_dim: 256,
            block_size: 32,
            window: Some(100),
            sequences: vec![(250, 3), (10, 1)],
        },
    ]
}

/// The harness itself, on the CPU, runs here: the cases build valid caches, tables and rows, and
/// the CPU kernel agrees with the f64 reference on them (as its own tests require, 2e-5).
#[test]
fn attention_cases_are_sound_on_the_cpu() {
    for (i, case) in attention_cases().iter().enumerate() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let inputs = attention_inputs(case, dtype, 100 + i as u64);
            let mut reference = vec![0.0; inputs.q.len()];
            crate::model::kernels::cpu::attention::reference(
                &inputs.q,
                &inputs.rows,
                &inputs.tables,
                &inputs.pool.layer(0),
                case.n_heads,
                inputs.scale,
                case.window,
                &mut reference,
            );
            assert_close(
                &format!("case {i} {dtype:?}: CPU kernel vs reference"),
                &inputs.want,
                &reference,
                0.0,
                2e-5,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn paged_attention_matches_the_cpu() {
    let Some(gpu) = gpu_or_skip("paged_attention_matches_the_cpu") else {
        return;
    };
    for (i, case) in attention_cases().iter().enumerate() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            check_attention(&gpu, case, dtype, 100 + i as u64);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn paged_attention_with_a_bad_block_id_is_nan_not_a_fault() {
    let Some(gpu) = gpu_or_skip("paged_attention_with_a_bad_block_id_is_nan_not_a_fault") else {
        return;
    };
    let layout = KvLayout::per_layer(4, 1, 8, 2);
    let cache = upload(&gpu, &vec![0.5f32; 2 * 2 * 4 * 8]);
    // Row 0 reads blocks [1, 0]: fine. Row 1's table names block 7 of 2.
    let tables = upload(&gpu, &[1u32, 0, 7]);
    let rows = upload(&gpu, &[5u32, 0, 2, 0, 2, 1]);
    let q = upload(&gpu, &[1.0f32; 16]);
    let mut out = gpu.stream.alloc_zeros::<f32>(16).expect("an allocation");
    gpu.kernels
        .paged_attention(
            &gpu.stream,
            &q.as_view(),
            &rows.as_view(),
            &tables.as_view(),
            &cache.as_view(),
            layout,
            1,
            1.0,
            None,
            &mut out.as_view_mut(),
        )
        .expect("attention launches");
    let got = download(&gpu, &out);
    assert!(got[..8].iter().all(|&v| (v - 0.5).abs() < 1e-6), "{got:?}");
    assert!(got[8..].iter().all(|v| v.is_nan()), "{got:?}");
}

/// The greedy sampler's argmax semantics, written plainly: the first index of the largest
/// non-NaN value; 0 when nothing is above -inf.
fn first_argmax(row: &[f32]) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &x) in row.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0 as u32
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn argmax_matches_the_greedy_samplers() {
    let Some(gpu) = gpu_or_skip("argmax_matches_the_greedy_samplers") else {
        return;
    };
    let mut rng = Rng(23);
    for vocab in [1usize, 31, 257, 151_936] {
        let rows = 6;
        let mut logits = rng.scaled(rows * vocab, 20.0);
        let at = |r: usize, i: usize| r * vocab + i.min(vocab - 1);
        // Row 1: the maximum twice, late then early: the earlier index wins.
        logits[at(1, vocab - 1)] = 100.0;
        logits[at(1, vocab / 3)] = 100.0;
        // Row 2: NaNs, one where the maximum would otherwise be.
        logits[at(2, 0)] = f32::NAN;
        logits[at(2, vocab / 2)] = f32::NAN;
        // Row 3: nothing above -inf: index 0.
        for i in 0..vocab {
            logits[at(3, i)] = f32::NEG_INFINITY;
        }
        // Row 4: all NaN: index 0.
        for i in 0..vocab {
            logits[at(4, i)] = f32::NAN;
        }
        // Row 5: +inf wins.
        logits[at(5, vocab / 5)] = f32::INFINITY;
        let want: Vec<u32> = logits.chunks(vocab).map(first_argmax).collect();
        let dlogits = upload(&gpu, &logits);
        let mut dout = gpu.stream.alloc_zeros::<u32>(rows).expect("an allocation");
        gpu.kernels
            .argmax(
                &gpu.stream,
                &dlogits.as_view(),
                vocab,
                &mut dout.as_view_mut(),
            )
            .expect("argmax launches");
        // Comparisons only, no arithmetic: exact.
        assert_eq!(download(&gpu, &dout), want, "vocab {vocab}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn wrappers_refuse_mismatched_shapes_before_launching() {
    let Some(gpu) = gpu_or_skip("wrappers_refuse_mismatched_shapes_before_launching") else {
        return;
    };
    let x = upload(&gpu, &[1.0f32; 10]);
    let w = upload(&gpu, &[1.0f32; 3]);
    let mut out = gpu.stream.alloc_zeros::<f32>(10).expect("an allocation");
    let e = gpu
        .kernels
        .rmsnorm(
            &gpu.stream,
            &x.as_view(),
            &w.as_view(),
            1e-6,
            &mut out.as_view_mut(),
        )
        .expect_err("10 is not rows of 3");
    assert!(e.to_string().starts_with("rmsnorm: "), "{e}");
}

/// f32 to bf16 and f16 on the GPU round as the `half` crate does, bit for bit, the edges
/// included (ties, subnormals, overflow, infinities, NaN).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn cast_rounds_as_the_half_crate() {
    let Some(gpu) = gpu_or_skip("cast_rounds_as_the_half_crate") else {
        return;
    };
    let mut rng = Rng(29);
    let mut x = rng.scaled(4096, 100.0);
    x.extend_from_slice(&[
        0.0,
        -0.0,
        1.0 + f32::EPSILON * 64.0,
        // bf16 ties: half an ulp above 1 (rounds down to even) and above 1 + 2^-7 (rounds up).
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        1e-40,
        -1e-42,
        6.0e-8,
        65_504.0,
        65_520.0, // rounds to f16 infinity
        3.0e38,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]);
    let dx = upload(&gpu, &x);
    let mut b = gpu
        .stream
        .alloc_zeros::<bf16>(x.len())
        .expect("an allocation");
    gpu.kernels
        .cast(&gpu.stream, &dx.as_view(), &mut b.as_view_mut())
        .expect("cast to bf16 launches");
    let got: Vec<u16> = download(&gpu, &b).iter().map(|v| v.to_bits()).collect();
    let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    assert_eq!(got, want, "bf16");
    let mut h = gpu
        .stream
        .alloc_zeros::<f16>(x.len())
        .expect("an allocation");
    gpu.kernels
        .cast(&gpu.stream, &dx.as_view(), &mut h.as_view_mut())
        .expect("cast to f16 launches");
    let got: Vec<u16> = download(&gpu, &h).iter().map(|v| v.to_bits()).collect();
    let want: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    assert_eq!(got, want, "f16");
    // NaN stays NaN (its payload may differ between the two).
    let dnan = upload(&gpu, &[f32::NAN]);
    let mut b = gpu.stream.alloc_zeros::<bf16>(1).expect("an allocation");
    gpu.kernels
        .cast(&gpu.stream, &dnan.as_view(), &mut b.as_view_mut())
        .expect("cast launches");
    assert!(download(&gpu, &b)[0].is_nan());
}

/// The bias add and the gathered final norm, against the CPU's arithmetic: exact for the add;
/// the norm as `rmsnorm_matches_the_cpu` states, and a bad index gives NaN.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn add_bias_and_rmsnorm_rows_match_the_cpu() {
    let Some(gpu) = gpu_or_skip("add_bias_and_rmsnorm_rows_match_the_cpu") else {
        return;
    };
    let mut rng = Rng(31);
    let (rows, cols) = (7usize, 300usize);
    let y = rng.scaled(rows * cols, 3.0);
    let bias = rng.scaled(cols, 1.0);
    let want: Vec<f32> = y
        .iter()
        .enumerate()
        .map(|(i, &v)| v + bias[i % cols])
        .collect();
    let mut dy = upload(&gpu, &y);
    gpu.kernels
        .add_bias(
            &gpu.stream,
            &mut dy.as_view_mut(),
            &upload(&gpu, &bias).as_view(),
        )
        .expect("add_bias launches");
    assert_same_bits("add_bias", &download(&gpu, &dy), &want);

    let w: Vec<f32> = (0..cols).map(|_| rng.signed() + 1.0).collect();
    let index = [6u32, 0, 3, 3, 99];
    let mut want = vec![0.0; (index.len() - 1) * cols];
    for (r, &i) in index[..index.len() - 1].iter().enumerate() {
        let i = i as usize;
        rmsnorm::rmsnorm(
            &y[i * cols..(i + 1) * cols],
            &w,
            1e-5,
            &mut want[r * cols..(r + 1) * cols],
        );
    }
    let mut out = gpu
        .stream
        .alloc_zeros::<f32>(index.len() * cols)
        .expect("an allocation");
    gpu.kernels
        .rmsnorm_rows(
            &gpu.stream,
            &upload(&gpu, &y).as_view(),
            &upload(&gpu, &w).as_view(),
            &upload(&gpu, &index).as_view(),
            1e-5,
            &mut out.as_view_mut(),
        )
        .expect("rmsnorm_rows launches");
    let got = download(&gpu, &out);
    assert_close("rmsnorm_rows", &got[..want.len()], &want, 3e-5, 1e-6);
    assert!(
        got[want.len()..].iter().all(|v| v.is_nan()),
        "index 99 of 7 rows"
    );
}

/// cuBLAS products against the CPU's `linear`, for each weight dtype and a range of row counts
/// (one decode row, a decode batch, a prefill chunk). For half weights the GPU multiplies the
/// activations rounded to the weights' type, so the CPU reference takes the same rounded
/// activations: what is left is the order of f32 accumulation, at most 333 terms x 2^-24 = 2e-5
/// of the sum of |terms| here, 4e-5 allowed (a wrong transpose, stride or dtype is off by the
/// size of the terms).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --include-ignored"]
fn cublas_products_match_the_cpu_linear() {
    use super::blas::{DeviceMatrix, Scratch};
    use crate::model::kernels::cpu::matmul::{linear, MatmulScratch};
    use crate::model::weights::DType;
    let Some(gpu) = gpu_or_skip("cublas_products_match_the_cpu_linear") else {
        return;
    };
    let blas = super::blas::Blas::new(&gpu.stream).expect("cuBLAS starts");
    let mut rng = Rng(37);
    for &(n, rows, cols) in &[(1usize, 96usize, 64usize), (8, 576, 192), (70, 129, 333)] {
        let w32 = rng.scaled(rows * cols, 1.0);
        let x = rng.scaled(n * cols, 2.0);
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            // The weights as stored, the CPU's view of them, and the activations the GPU
            // multiplies (rounded for half weights).
            let (bytes, x_used): (Vec<u8>, Vec<f32>) = match dtype {
                DType::F32 => (
                    w32.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    x.clone(),
                ),
                DType::Bf16 => (
                    w32.iter()
                        .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
                        .collect(),
                    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                ),
                DType::F16 => (
                    w32.iter()
                        .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
                        .collect(),
                    x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
                ),
                DType::Quant(_) => unreachable!("the matrices here are f32, f16, bf16"),
            };
            let w_bf16: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            let w_f16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let data = match dtype {
                DType::F32 => WeightData::F32(&w32),
                DType::Bf16 => WeightData::Bf16(&w_bf16),
                DType::F16 => WeightData::F16(&w_f16),
                DType::Quant(_) => unreachable!("the matrices here are f32, f16, bf16"),
            };
            let mut want = vec![0.0f32; n * rows];
            let mut mm = MatmulScratch::new(2, cols, 64);
            linear(
                &x_used,
                n,
                MatRef { data, rows, cols },
                None,
                &mut want,
                &mut mm,
            );
            // Each output's |terms| summed, for the tolerance.
            let widened: Vec<f32> = match data {
                WeightData::F32(w) => w.to_vec(),
                WeightData::Bf16(w) => w.iter().map(|v| v.to_f32()).collect(),
                WeightData::F16(w) => w.iter().map(|v| v.to_f32()).collect(),
                WeightData::Quant(..) | WeightData::Interleaved(..) => {
                    unreachable!("the matrices here are f32, f16, bf16")
                }
            };
            let magnitude: Vec<f32> = (0..n * rows)
                .map(|i| {
                    let (t, r) = (i / rows, i % rows);
                    (0..cols)
                        .map(|c| (x_used[t * cols + c] * widened[r * cols + c]).abs())
                        .sum()
                })
                .collect();
            let w = DeviceMatrix {
                data: upload(&gpu, &bytes),
                dtype,
                rows,
                cols,
            };
            let mut scratch = Scratch::new(&gpu.stream, n * cols).expect("scratch");
            let dx = upload(&gpu, &x);
            let mut dy = gpu
                .stream
                .alloc_zeros::<f32>(n * rows)
                .expect("an allocation");
            blas.linear(
                &gpu.kernels,
                &dx.as_view(),
                n,
                &w,
                &mut scratch,
                &mut dy.as_view_mut(),
            )
            .expect("the product runs");
            let got = download(&gpu, &dy);
            for (i, ((&g, &e), &m)) in got.iter().zip(&want).zip(&magnitude).enumerate() {
                assert!(
                    (g - e).abs() <= 4e-5 * m + 1e-6,
                    "{dtype:?} n {n} [{rows}, {cols}]: element {i}: GPU {g} vs CPU {e}"
                );
            }
            // A group of two products of one input (q/k/v share theirs) writes both outputs,
            // each with the bits of the lone product.
            let mut pair = [0, 1].map(|_| {
                gpu.stream
                    .alloc_zeros::<f32>(n * rows)
                    .expect("an allocation")
            });
            let [a, b] = &mut pair;
            blas.linear_group(
                &gpu.kernels,
                &dx.as_view(),
                n,
                &mut [(&w, &mut a.as_view_mut()), (&w, &mut b.as_view_mut())],
                &mut scratch,
            )
            .expect("the products run");
            for y in &pair {
                let same = download(&gpu, y)
                    .iter()
                    .zip(&got)
                    .all(|(p, g)| p.to_bits() == g.to_bits());
                assert!(
                    same,
                    "{dtype:?} n {n}: a grouped product differs from the lone one"
                );
            }
        }
    }
}
