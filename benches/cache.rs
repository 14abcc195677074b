//! Cache moves for smollm-135m-shaped K/V (30 layers, 3 K/V heads of 64, f16: 360 KiB a block),
//! beside the machine's memcpy of the same bytes: a restore of a 2.4K-token history (150 blocks)
//! from the host tier, the block copies it is made of, and one block written to and read from
//! the disk tier (write includes its fsync; read verifies the checksums, from the page cache).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use strata_rs::cache::disk::{BlockLayout, DiskOptions, DiskTier};
use strata_rs::cache::ram_gate::RamGate;
use strata_rs::cache::{CacheOptions, ConversationCache, DevicePart};
use strata_rs::device::memory_pool::MemoryPool;
use strata_rs::kv::blocks::{BlockPool, KvDtype};
use strata_rs::kv::prefix::extend_hashes;

const LAYERS: usize = 30;
const HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const BS: usize = 16;
const HISTORY_BLOCKS: usize = 150;

fn layout(block_bytes: usize) -> BlockLayout {
    BlockLayout {
        salt: 42,
        kv_dtype: 2,
        block_size: BS as u32,
        num_layers: LAYERS as u32,
        kv_heads: HEADS as u32,
        head_dim: HEAD_DIM as u32,
        block_bytes: block_bytes as u64,
    }
}

fn moves(c: &mut Criterion) {
    let mut pool = BlockPool::new(
        LAYERS,
        2 * HISTORY_BLOCKS,
        BS,
        HEADS,
        HEAD_DIM,
        KvDtype::F16,
    )
    .expect("pool");
    let block_bytes = pool.bytes_per_block();
    let history_bytes = (HISTORY_BLOCKS * block_bytes) as u64;

    let mut group = c.benchmark_group("cache_moves");
    group.sample_size(10);
    group.measurement_time(std::time::Duration::from_secs(2));

    // The ceiling: one memcpy of a history's bytes.
    let src = vec![1u8; HISTORY_BLOCKS * block_bytes];
    let mut dst = vec![0u8; src.len()];
    group.throughput(Throughput::Bytes(history_bytes));
    group.bench_function("memcpy 150 blocks", |b| {
        b.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
    });

    // The copies a restore is made of (device block <- bytes), and the other way.
    let mut bytes = vec![0u8; block_bytes];
    group.throughput(Throughput::Bytes(block_bytes as u64));
    group.bench_function("read_block (device -> bytes)", |b| {
        b.iter(|| pool.read_block(3, &mut bytes).expect("a host read"))
    });
    group.bench_function("write_block (bytes -> device)", |b| {
        b.iter(|| pool.write_block(3, &bytes).expect("a host write"))
    });

    // A whole restore from the host tier: probe, then onload into fresh device blocks.
    let tokens: Vec<u32> = (0..(HISTORY_BLOCKS * BS) as u32).collect();
    let mut hashes = Vec::new();
    extend_hashes(42, &tokens, BS, &mut hashes);
    let opts = CacheOptions {
        host_cache_mib: 256,
        disk_cache_mib: 0,
        ..CacheOptions::default()
    };
    let device = DevicePart {
        memory: MemoryPool::new("cpu", None),
        bytes: block_bytes,
    };
    let mut cache =
        ConversationCache::new(&opts, layout(block_bytes), RamGate::system(0), vec![device])
            .expect("cache");
    let blocks = pool.allocate(HISTORY_BLOCKS).expect("blocks").blocks;
    for (i, &b) in blocks.iter().enumerate() {
        pool.register(b, hashes[i], &tokens[i * BS..(i + 1) * BS]);
    }
    pool.release(&blocks);
    let all = pool.allocate(2 * HISTORY_BLOCKS).expect("all blocks");
    cache.offload(&pool, &all.evicted);
    pool.release(&all.blocks);
    assert_eq!(
        cache.stats().host_blocks,
        HISTORY_BLOCKS,
        "the history is in the host tier"
    );
    group.throughput(Throughput::Bytes(history_bytes));
    let pool_cell = std::cell::RefCell::new(pool);
    group.bench_function("restore 150 blocks from host", |b| {
        b.iter_batched(
            // Fresh device blocks; whatever they cached is dropped (it is all in host).
            || {
                let a = pool_cell.borrow_mut().allocate(HISTORY_BLOCKS);
                a.expect("fresh blocks").blocks
            },
            |dst| {
                let mut pool = pool_cell.borrow_mut();
                let n = cache.probe(&hashes, &tokens, 0);
                let restored = cache.onload(&mut pool, &dst[..n], &hashes, &tokens, 0);
                pool.release(&dst);
                assert_eq!(restored, HISTORY_BLOCKS);
            },
            BatchSize::PerIteration,
        )
    });

    // One block through the disk tier.
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut disk, _) = DiskTier::open(
        DiskOptions {
            dir: dir.path().to_path_buf(),
            budget_bytes: 64 << 20,
            max_age_days: 7.0,
        },
        layout(block_bytes),
    )
    .expect("disk tier");
    let block_tokens = &tokens[..BS];
    let mut next_hash = 1u64;
    group.throughput(Throughput::Bytes(block_bytes as u64));
    group.bench_function("disk write 1 block (fsync)", |b| {
        b.iter(|| {
            next_hash += 1;
            disk.write(next_hash, block_tokens, &bytes).expect("write")
        })
    });
    disk.write(1, block_tokens, &bytes).expect("write");
    group.bench_function("disk read 1 block (verified)", |b| {
        b.iter(|| disk.read(1, block_tokens, &mut bytes).expect("read"))
    });
    group.finish();
}

criterion_group!(benches, moves);
criterion_main!(benches);
