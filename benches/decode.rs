//! One decode step of a smollm-135m-shaped bf16 model (random weights) at context 512: the whole
//! forward pass as generation runs it, for 1 and for 8 sequences (one token and its logits each);
//! and at context 8192 for 4 sequences with f16 and with q8_0 K/V, where the K/V read per step
//! (4 x 189 MB in f16) outweighs the weights (269 MB).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use strata_rs::device::memory_pool::MemoryPool;
use strata_rs::engine::runner::ModelRunner;
use strata_rs::kv::blocks::KvDtype;
use strata_rs::model::forward::{LogitsWanted, SeqChunk};
use strata_rs::model::testing::TestModel;
use strata_rs::model::weights::DType;
use strata_rs::model::Model;

fn decode_step(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    TestModel::smollm_135m(DType::Bf16)
        .write(dir.path())
        .expect("write model");
    let model = Model::load(dir.path(), 1024).expect("load model");
    let weight_bytes = model.decode_weight_bytes;
    let vocab = model.config.vocab_size;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kv_dtype = KvDtype::for_weights(model.dtype);
    let mut runner = ModelRunner::new(
        &MemoryPool::new("cpu", None),
        model,
        8 * 33,
        16,
        512,
        threads,
        kv_dtype,
    )
    .expect("runner");

    let context = 512;
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919) % vocab as u32)
        .collect();
    let mut out = vec![0.0f32; vocab * 8];
    // Eight sequences with the same history: batch 1 decodes the first, batch 8 all of them.
    let mut tables = Vec::new();
    for _ in 0..8 {
        let table = runner.allocate(context + 1).expect("blocks");
        runner
            .prefill(&prompt, 0, &table, LogitsWanted::Last, &mut out[..vocab])
            .expect("prefill");
        tables.push(table);
    }

    let mut group = c.benchmark_group("decode_step");
    group.sample_size(20);
    group.measurement_time(std::time::Duration::from_secs(4));
    for batch in [1usize, 8] {
        // Throughput in weight bytes per step: batch 8 reads the weights once for 8 tokens.
        group.throughput(Throughput::Bytes(weight_bytes as u64));
        group.bench_function(
            format!("smollm-135m bf16, context 512, batch {batch}"),
            |b| {
                // Re-decodes position `context` each time: same work, and the K/V stays bounded.
                let chunks: Vec<SeqChunk> = tables[..batch]
                    .iter()
                    .map(|table| SeqChunk {
                        tokens: &[42],
                        start_pos: context,
                        block_table: table,
                        logits: LogitsWanted::Last,
                    })
                    .collect();
                b.iter(|| {
                    runner
                        .step(&chunks, &mut out[..vocab * batch])
                        .expect("step")
                })
            },
        );
    }
    group.finish();
}

/// Decode steps of 4 sequences at context 8192, f16 against q8_0 K/V. The histories' K/V are
/// bounded pseudo-random rows written into the pool (a step costs the same over any values; a
/// 32k-token prefill would take minutes), each sequence on blocks of its own.
fn decode_step_long_context(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    TestModel::smollm_135m(DType::Bf16)
        .write(dir.path())
        .expect("write model");
    let (context, batch) = (8192usize, 4usize);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut group = c.benchmark_group("decode_step_kv");
    group.sample_size(10);
    group.measurement_time(std::time::Duration::from_secs(6));
    for kv_dtype in [KvDtype::F16, KvDtype::Q8_0] {
        let model = Model::load(dir.path(), context + 1).expect("load model");
        let vocab = model.config.vocab_size;
        let (layers, kv_dim) = (model.config.num_layers, model.config.kv_dim());
        let mut runner = ModelRunner::new(
            &MemoryPool::new("cpu", None),
            model,
            batch * (context / 16 + 1),
            16,
            512,
            threads,
            kv_dtype,
        )
        .expect("runner");
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|_| runner.allocate(context + 1).expect("blocks"))
            .collect();
        let mut seed = 1u32;
        let mut row = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
                })
                .collect()
        };
        for table in &tables {
            for layer in 0..layers {
                for pos in 0..context {
                    let (k, v) = (row(kv_dim), row(kv_dim));
                    let slot = runner.kv.slot(table, pos);
                    runner.kv.write(layer, slot, &k, &v);
                }
            }
        }
        let mut out = vec![0.0f32; vocab * batch];
        let kv_bytes = batch * context * runner.kv.bytes_per_block() / 16;
        group.throughput(Throughput::Bytes(kv_bytes as u64));
        group.bench_function(
            format!(
                "smollm-135m bf16, context {context}, batch {batch}, {} K/V",
                kv_dtype.name()
            ),
            |b| {
                let chunks: Vec<SeqChunk> = tables
                    .iter()
                    .map(|table| SeqChunk {
                        tokens: &[42],
                        start_pos: context,
                        block_table: table,
                        logits: LogitsWanted::Last,
                    })
                    .collect();
                b.iter(|| runner.step(&chunks, &mut out).expect("step"))
            },
        );
    }
    group.finish();
}

criterion_group!(benches, decode_step, decode_step_long_context);
criterion_main!(benches);
