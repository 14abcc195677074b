//! Kernel benchmarks: decode-shaped linears (bandwidth bound, reported as GB/s of weights and
//! activations read), prefill-shaped linears, decode and prefill paged attention, whole
//! prefill steps of a smollm-135m-shaped bf16 model, the quantized-weight linears (GB/s of
//! weights at n = 1, MACs/s at n = 512) and a plain read of the same bytes (the ceiling).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::{bf16, f16};
use std::hint::black_box;
use std::time::Duration;
use strata_rs::device::memory_pool::MemoryPool;
use strata_rs::engine::runner::ModelRunner;
use strata_rs::kv::blocks::KvDtype;
use strata_rs::model::forward::{LogitsWanted, SeqChunk};
use strata_rs::model::kernels::cpu::attention::{
    k_index, paged_attention, AttnRow, AttnScratch, KvData, KvLayer,
};
use strata_rs::model::kernels::cpu::kv_q8;
use strata_rs::model::kernels::cpu::matmul::{linear, MatmulScratch};
use strata_rs::model::kernels::cpu::quant::linear::{
    linear_quant, Layout, QuantMatRef, QuantScratch,
};
use strata_rs::model::kernels::cpu::quant::{quantize_row, QuantType};
use strata_rs::model::kernels::cpu::{MatRef, WeightData};
use strata_rs::model::testing::TestModel;
use strata_rs::model::weights::DType;
use strata_rs::model::Model;

fn values(n: usize, seed: u32) -> Vec<f32> {
    // Deterministic, cheap, bounded: a scrambled counter.
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn bench_linear(c: &mut Criterion) {
    let mut g = c.benchmark_group("linear_bf16");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let threads = rayon::current_num_threads();
    for &(n, m, k) in &[
        (1usize, 1536usize, 576usize),
        (1, 576, 1536),
        (1, 49152, 576),
        (8, 1536, 576),
        (8, 576, 1536),
        (8, 49152, 576),
        (68, 1536, 576),
        (68, 576, 1536),
        (512, 1536, 576),
        (512, 576, 1536),
    ] {
        let w: Vec<bf16> = values(m * k, 1).into_iter().map(bf16::from_f32).collect();
        let x = values(n * k, 2);
        let mut y = vec![0.0f32; n * m];
        let mut scratch = MatmulScratch::new(threads, k, 512);
        let mat = MatRef {
            data: WeightData::Bf16(&w),
            rows: m,
            cols: k,
        };
        g.throughput(Throughput::Bytes((m * k * 2 + n * k * 4) as u64));
        g.bench_function(format!("n{n}_{m}x{k}"), |b| {
            b.iter(|| linear(black_box(&x), n, mat, None, &mut y, &mut scratch))
        });
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("paged_attention_decode");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let (n_heads, kv_heads, head_dim, block_size) = (9usize, 3usize, 64usize, 16usize);
    let threads = rayon::current_num_threads();
    for &ctx in &[512usize, 2048, 8192] {
        let blocks = ctx.div_ceil(block_size);
        let len = blocks * block_size * kv_heads * head_dim;
        let (k, v) = (values(len, 3), values(len, 4));
        let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
        let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let (kq, vq) = q8_0_kv(&k, &v, block_size, kv_heads, head_dim);
        // Reversed block order: a non-contiguous table like a real pool's.
        let tables: Vec<u32> = (0..blocks as u32).rev().collect();
        let q8_row = kv_q8::row_bytes(head_dim) as f64 / head_dim as f64;
        for (name, kd, vd, size) in [
            ("f32", KvData::F32(&k), KvData::F32(&v), 4.0),
            ("f16", KvData::F16(&k16), KvData::F16(&v16), 2.0),
            ("bf16", KvData::Bf16(&kb), KvData::Bf16(&vb), 2.0),
            ("q8_0", KvData::Q8_0(&kq), KvData::Q8_0(&vq), q8_row),
        ] {
            let kv = KvLayer {
                k: kd,
                v: vd,
                block_size,
                kv_heads,
                head_dim,
            };
            let rows = [AttnRow {
                pos: (ctx - 1) as u32,
                table_start: 0,
                table_len: blocks as u32,
            }];
            let q = values(n_heads * head_dim, 5);
            let mut out = vec![0.0f32; n_heads * head_dim];
            let mut scratch = AttnScratch::new(1, n_heads, head_dim, threads);
            let scale = 1.0 / (head_dim as f32).sqrt();
            g.throughput(Throughput::Bytes(
                (2.0 * (ctx * kv_heads * head_dim) as f64 * size) as u64,
            ));
            g.bench_function(format!("ctx{ctx}_{name}"), |b| {
                b.iter(|| {
                    paged_attention(
                        black_box(&q),
                        &rows,
                        &tables,
                        &kv,
                        n_heads,
                        scale,
                        None,
                        &mut out,
                        &mut scratch,
                    )
                })
            });
        }
    }
    g.finish();
}

/// f32 K/V (the kernel's f32 layouts) quantized to q8_0 token by token, as the pool writes it.
fn q8_0_kv(k: &[f32], v: &[f32], bs: usize, kvh: usize, hd: usize) -> (Vec<u8>, Vec<u8>) {
    let slots = k.len() / (kvh * hd);
    let bytes = slots * kvh * kv_q8::row_bytes(hd);
    let (mut kq, mut vq) = (vec![0u8; bytes], vec![0u8; bytes]);
    for slot in 0..slots {
        let kr: Vec<f32> = (0..kvh * hd)
            .map(|e| k[k_index(slot, e / hd, e % hd, bs, kvh, hd)])
            .collect();
        kv_q8::write_k(&mut kq, slot, &kr, bs, kvh, hd);
        kv_q8::write_v(
            &mut vq,
            slot,
            &v[slot * kvh * hd..(slot + 1) * kvh * hd],
            kvh,
            hd,
        );
    }
    (kq, vq)
}

/// A 512-row prefill chunk of one sequence (positions `ctx - 512..ctx`), f16 K/V.
fn bench_attention_prefill(c: &mut Criterion) {
    let mut g = c.benchmark_group("paged_attention_prefill");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let (n_heads, kv_heads, head_dim, block_size) = (9usize, 3usize, 64usize, 16usize);
    let threads = rayon::current_num_threads();
    for &ctx in &[512usize, 2048] {
        let blocks = ctx.div_ceil(block_size);
        let len = blocks * block_size * kv_heads * head_dim;
        let k16: Vec<f16> = values(len, 3).into_iter().map(f16::from_f32).collect();
        let v16: Vec<f16> = values(len, 4).into_iter().map(f16::from_f32).collect();
        let tables: Vec<u32> = (0..blocks as u32).rev().collect();
        let kv = KvLayer {
            k: KvData::F16(&k16),
            v: KvData::F16(&v16),
            block_size,
            kv_heads,
            head_dim,
        };
        let rows: Vec<AttnRow> = (ctx - 512..ctx)
            .map(|p| AttnRow {
                pos: p as u32,
                table_start: 0,
                table_len: blocks as u32,
            })
            .collect();
        let q = values(rows.len() * n_heads * head_dim, 5);
        let mut out = vec![0.0f32; q.len()];
        let mut scratch = AttnScratch::new(rows.len(), n_heads, head_dim, threads);
        let scale = 1.0 / (head_dim as f32).sqrt();
        g.throughput(Throughput::Elements(rows.len() as u64));
        g.bench_function(format!("rows512_ctx{ctx}_f16"), |b| {
            b.iter(|| {
                paged_attention(
                    black_box(&q),
                    &rows,
                    &tables,
                    &kv,
                    n_heads,
                    scale,
                    None,
                    &mut out,
                    &mut scratch,
                )
            })
        });
    }
    g.finish();
}

/// Whole prefill steps of smollm-135m bf16 (random weights, f16 K/V): the first 512 tokens of
/// a prompt, 512 tokens at positions 1536..2048, and the 68 new tokens of a returning
/// conversation after a 2,432-token history (the conversation benchmark's returning turn).
/// Throughput in tokens.
fn bench_prefill_step(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    TestModel::smollm_135m(DType::Bf16)
        .write(dir.path())
        .expect("write model");
    let context = 2500;
    let model = Model::load(dir.path(), context).expect("load model");
    let vocab = model.config.vocab_size;
    let threads = rayon::current_num_threads();
    let kv_dtype = KvDtype::for_weights(model.dtype);
    let mut runner = ModelRunner::new(
        &MemoryPool::new("cpu", None),
        model,
        context.div_ceil(16) + 1,
        16,
        512,
        threads,
        kv_dtype,
    )
    .expect("runner");
    let table = runner.allocate(context).expect("blocks");
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919) % vocab as u32)
        .collect();
    let mut out = vec![0.0f32; vocab];
    // The history's K/V as bounded pseudo-random rows rather than a prefill: a step costs the
    // same over any values, and a 2,500-token prefill takes minutes in CI's dev-profile run.
    let (layers, kv_dim) = (runner.model.config.num_layers, runner.model.config.kv_dim());
    for layer in 0..layers {
        for pos in 0..context {
            let k = values(kv_dim, (layer * context + pos) as u32);
            let v = values(kv_dim, !((layer * context + pos) as u32));
            let slot = runner.kv.slot(&table, pos);
            runner.kv.write(layer, slot, &k, &v);
        }
    }
    let mut g = c.benchmark_group("prefill_step");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_secs(1));
    for (start, n) in [(0usize, 512usize), (1536, 512), (2432, 68)] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(
            format!("smollm-135m bf16, tokens {start}..{}", start + n),
            |b| {
                b.iter(|| {
                    // Recomputes the same positions each time: same work, K/V rewritten in place.
                    let batch = [SeqChunk {
                        tokens: &prompt[start..start + n],
                        start_pos: start,
                        block_table: &table,
                        logits: LogitsWanted::Last,
                    }];
                    runner.step(&batch, &mut out).expect("step")
                })
            },
        );
    }
    g.finish();
}

/// Quantized weights of `ty` for `[m, k]`: rows quantized from bounded pseudo-random values.
fn quant_matrix(ty: QuantType, m: usize, k: usize) -> Vec<u8> {
    let rb = ty.row_bytes(k).expect("whole blocks");
    let mut data = vec![0u8; m * rb];
    for (r, row) in data.chunks_exact_mut(rb).enumerate() {
        quantize_row(ty, &values(k, r as u32), row);
    }
    data
}

/// The quantized linear at decode (n = 1: bandwidth bound, GB/s of weights) and prefill
/// (n = 512: compute bound, multiply-adds per second as "elements"), Q4_K and Q6_K (the
/// Q4_K_M files), Q8_0 and Q4_1 (the SmolLM2 Q4_1 file and its embedding), at [2048, 2048]
/// and [8192, 2048]; and a plain parallel read of each matrix's bytes.
fn bench_linear_quant(c: &mut Criterion) {
    let threads = rayon::current_num_threads();
    let types = [
        QuantType::Q4_K,
        QuantType::Q6_K,
        QuantType::Q8_0,
        QuantType::Q4_1,
    ];
    let shapes = [(2048usize, 2048usize), (8192, 2048)];
    let mut scratch = QuantScratch::new(threads, 512, 2048);
    let mut g = c.benchmark_group("linear_quant_decode");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for ty in types {
        for &(m, k) in &shapes {
            let data = quant_matrix(ty, m, k);
            let w = QuantMatRef {
                ty,
                layout: Layout::Rows,
                data: &data,
                rows: m,
                cols: k,
            };
            let x = values(k, 2);
            let mut y = vec![0.0f32; m];
            g.throughput(Throughput::Bytes(data.len() as u64));
            g.bench_function(format!("{}_n1_{m}x{k}", ty.name()), |b| {
                b.iter(|| linear_quant(black_box(&x), 1, w, None, &mut y, &mut scratch))
            });
            // The ceiling: every byte of the same matrix read once, on the same threads.
            g.bench_function(format!("read_{}_{m}x{k}", ty.name()), |b| {
                b.iter(|| read_bytes(black_box(&data)))
            });
        }
    }
    g.finish();
    let mut g = c.benchmark_group("linear_quant_prefill");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_millis(300));
    let n = 512;
    for ty in types {
        for &(m, k) in &shapes {
            let data = quant_matrix(ty, m, k);
            let w = QuantMatRef {
                ty,
                layout: Layout::Rows,
                data: &data,
                rows: m,
                cols: k,
            };
            let x = values(n * k, 3);
            let mut y = vec![0.0f32; n * m];
            g.throughput(Throughput::Elements((n * m * k) as u64));
            g.bench_function(format!("{}_n{n}_{m}x{k}", ty.name()), |b| {
                b.iter(|| linear_quant(black_box(&x), n, w, None, &mut y, &mut scratch))
            });
        }
    }
    g.finish();
}

/// A plain parallel read of `data` (8 u64 lanes summed per 64-byte line): memory bandwidth
/// with the kernels' thread count and chunking.
fn read_bytes(data: &[u8]) -> u64 {
    use rayon::prelude::*;
    data.par_chunks(1 << 16)
        .map(|c| {
            let mut acc = [0u64; 8];
            for line in c.chunks_exact(64) {
                for (l, a) in acc.iter_mut().enumerate() {
                    let word: [u8; 8] = line[8 * l..8 * l + 8].try_into().expect("8 bytes");
                    *a = a.wrapping_add(u64::from_le_bytes(word));
                }
            }
            acc.iter().fold(0u64, |a, &v| a.wrapping_add(v))
        })
        .reduce(|| 0, |a, b| a.wrapping_add(b))
}

criterion_group!(
    benches,
    bench_linear,
    bench_attention,
    bench_attention_prefill,
    bench_prefill_step,
    bench_linear_quant
);
criterion_main!(benches);
