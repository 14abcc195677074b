//! One decode step of a smollm-135m-shaped bf16 model (random weights) at context 512: the whole
//! forward pass as generation runs it, one token, logits of that token.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
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
    let mut runner = ModelRunner::new(model, 64, 16, 512, threads, kv_dtype).expect("runner");

    let context = 512;
    let table = runner.allocate(context + 1).expect("blocks");
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919) % vocab as u32)
        .collect();
    let mut out = vec![0.0f32; vocab];
    runner
        .prefill(&prompt, 0, &table, LogitsWanted::Last, &mut out)
        .expect("prefill");

    let mut group = c.benchmark_group("decode_step");
    group.sample_size(20);
    group.measurement_time(std::time::Duration::from_secs(4));
    group.throughput(Throughput::Bytes(weight_bytes as u64));
    group.bench_function("smollm-135m bf16, context 512", |b| {
        b.iter(|| {
            // Re-decodes position `context` each time: same work, and the K/V stays bounded.
            let batch = [SeqChunk {
                tokens: &[42],
                start_pos: context,
                block_table: &table,
                logits: LogitsWanted::Last,
            }];
            runner.step(&batch, &mut out).expect("step")
        })
    });
    group.finish();
}

criterion_group!(benches, decode_step);
criterion_main!(benches);
