//! The timing harness behind `strata-rs bench`: prefill and decode speed of a loaded model, and
//! the machine's memory read bandwidth measured in the same run (decode is bound by it).

use std::time::Instant;

use rayon::prelude::*;

use crate::engine::runner::ModelRunner;
use crate::error::Result;
use crate::model::forward::{LogitsWanted, SeqChunk};
use crate::rng::Rng;

#[derive(Clone, Debug)]
pub struct BenchSpec {
    /// Prompt lengths to prefill from a cold K/V state.
    pub prefill_lens: Vec<usize>,
    /// Context lengths at which to time single-token decode steps.
    pub decode_contexts: Vec<usize>,
    /// Decode steps timed at each context.
    pub decode_steps: usize,
    /// Repeats of each prefill (the median is reported).
    pub repeats: usize,
}

#[derive(Clone, Debug, Default)]
pub struct BenchReport {
    /// (prompt tokens, median tokens per second)
    pub prefill: Vec<(usize, f64)>,
    /// (context tokens, median tokens per second)
    pub decode: Vec<(usize, f64)>,
    /// Bytes of weights one decode step reads.
    pub decode_weight_bytes: usize,
    /// (buffer bytes, median GB/s) of a parallel streaming read on the compute threads.
    pub read_bandwidth: Vec<(usize, f64)>,
}

/// Deterministic token ids in the model's vocabulary.
fn token_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng(seed);
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(runner: &mut ModelRunner, spec: &BenchSpec) -> Result<BenchReport> {
    let vocab = runner.model.config.vocab_size;
    let mut report = BenchReport {
        decode_weight_bytes: runner.model.decode_weight_bytes,
        ..Default::default()
    };
    let mut out = vec![0.0f32; vocab];

    for &len in &spec.prefill_lens {
        let ids = token_ids(len, vocab, 0x5eed + len as u64);
        let mut rates = Vec::new();
        for _ in 0..spec.repeats.max(1) {
            let table = runner.allocate(len)?;
            let t = Instant::now();
            let r = runner.prefill(&ids, 0, &table, LogitsWanted::Last, &mut out);
            let secs = t.elapsed().as_secs_f64();
            runner.kv.release(&table);
            r?;
            rates.push(len as f64 / secs);
        }
        report.prefill.push((len, median(rates)));
    }

    for &ctx in &spec.decode_contexts {
        let ids = token_ids(ctx, vocab, 0xdec0de + ctx as u64);
        let table = runner.allocate(ctx + spec.decode_steps)?;
        let result = (|| -> Result<f64> {
            runner.prefill(&ids, 0, &table, LogitsWanted::Last, &mut out)?;
            let mut times = Vec::with_capacity(spec.decode_steps);
            for i in 0..spec.decode_steps {
                // Greedy: feed back the argmax, as generation would.
                let next = argmax(&out);
                runner.window_slots(&table, ctx + i, ctx + i + 1)?;
                let t = Instant::now();
                let batch = [SeqChunk {
                    tokens: &[next],
                    start_pos: ctx + i,
                    block_table: &table,
                    logits: LogitsWanted::Last,
                }];
                runner.step(&batch, &mut out)?;
                times.push(t.elapsed().as_secs_f64());
            }
            Ok(1.0 / median(times))
        })();
        runner.kv.release(&table);
        report.decode.push((ctx, result?));
    }

    let weights = runner.model.decode_weight_bytes;
    for bytes in [weights.max(1 << 20), 1 << 30] {
        report
            .read_bandwidth
            .push((bytes, runner.install(|| read_bandwidth(bytes))));
    }
    Ok(report)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Median GB/s of a parallel sum over a buffer of `bytes` (after one warm-up pass).
pub fn read_bandwidth(bytes: usize) -> f64 {
    let n = bytes / 4;
    // On huge pages where the OS allows, as the weights the kernels read (the same owner).
    let mut owned = crate::model::huge_pages::OwnedBytes::zeroed(n * 4);
    // SAFETY: any bit pattern is an f32, and the bytes start 4-aligned (a map at a 2 MiB
    // boundary or a vector of words), so all of them are in the middle slice.
    let (_, buf, _) = unsafe { owned.bytes_mut().align_to_mut::<f32>() };
    debug_assert_eq!(buf.len(), n);
    buf.iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i % 7) as f32);
    let threads = rayon::current_num_threads().max(1);
    let chunk = n.div_ceil(threads * 8).max(4096);
    let mut rates = Vec::new();
    for pass in 0..6 {
        let t = Instant::now();
        let s: f32 = buf.par_chunks(chunk).map(sum_lanes).sum();
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        if pass > 0 {
            rates.push(bytes as f64 / secs / 1e9);
        }
    }
    median(rates)
}

/// A sum with independent lanes so the compiler vectorizes it: the loop is bound by loads.
fn sum_lanes(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}
