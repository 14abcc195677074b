//! The layer split on two (or three) CPU devices: logits bitwise equal to one device's for every
//! family and split, each device's memory accounted in its own pool, and a load refused by the
//! device that cannot hold its share.

use std::path::Path;

use strata_rs::device::memory_pool::{MemoryPool, Purpose};
use strata_rs::engine::runner::{ModelRunner, Stage};
use strata_rs::error::StrataError;
use strata_rs::kv::blocks::{BlockPool, KvDtype};
use strata_rs::model::forward::{LogitsWanted, SeqChunk};
use strata_rs::model::testing::TestModel;
use strata_rs::model::weights::DType;
use strata_rs::model::Model;

const BLOCKS: usize = 32;
const BLOCK_SIZE: usize = 16;
const LAYERS: usize = 4;

fn write_model(dir: &Path, family: &'static str, dtype: DType, tied: bool) {
    TestModel {
        layers: LAYERS,
        dtype,
        tied,
        ..TestModel::tiny(family)
    }
    .write(dir)
    .unwrap();
}

fn stages(split: &[usize], capacities: &[Option<u64>]) -> Vec<Stage> {
    split
        .iter()
        .zip(capacities)
        .enumerate()
        .map(|(i, (&layers, &capacity))| Stage {
            memory: MemoryPool::new(format!("cpu:{i}"), capacity),
            layers,
        })
        .collect()
}

fn runner(dir: &Path, split: &[usize], max_batch_tokens: usize) -> ModelRunner {
    let model = Model::load(dir, 512).unwrap();
    let kv_dtype = KvDtype::for_weights(model.dtype);
    ModelRunner::split(
        &stages(split, &vec![None; split.len()]),
        model,
        BLOCKS,
        None,
        BLOCK_SIZE,
        max_batch_tokens,
        2,
        kv_dtype,
    )
    .unwrap()
}

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % 256)
        .collect()
}

/// Logits of a mixed step after two prefills: one sequence decodes a token while another
/// prefills a chunk, so the hand-off carries rows of several sequences and block tables.
fn mixed_step_logits(r: &mut ModelRunner) -> Vec<f32> {
    let vocab = r.model.config.vocab_size;
    let (a, b) = (ids(40, 1), ids(30, 2));
    let ta = r.allocate(41).unwrap();
    let tb = r.allocate(50).unwrap();
    let mut scratch = vec![0.0; vocab];
    r.prefill(&a, 0, &ta, LogitsWanted::Last, &mut scratch)
        .unwrap();
    r.prefill(&b[..20], 0, &tb, LogitsWanted::None, &mut scratch)
        .unwrap();
    let batch = [
        SeqChunk {
            tokens: &[7],
            start_pos: 40,
            block_table: &ta,
            logits: LogitsWanted::Last,
        },
        SeqChunk {
            tokens: &b[20..],
            start_pos: 20,
            block_table: &tb,
            logits: LogitsWanted::All,
        },
    ];
    let mut out = vec![0.0; 11 * vocab];
    assert_eq!(r.step(&batch, &mut out).unwrap(), 11);
    r.kv.release(&ta);
    r.kv.release(&tb);
    out
}

#[test]
fn split_logits_equal_one_devices_bitwise_for_every_family_and_split() {
    for family in ["llama", "mistral", "qwen2", "qwen3"] {
        for (dtype, tied) in [(DType::F32, false), (DType::Bf16, true)] {
            let dir = tempfile::tempdir().unwrap();
            write_model(dir.path(), family, dtype, tied);
            let tokens = ids(70, 3);
            let mut one = runner(dir.path(), &[LAYERS], 16);
            let want = one.all_logits(&tokens).unwrap();
            let want_mixed = mixed_step_logits(&mut one);
            for split in [&[1, 3][..], &[2, 2], &[3, 1], &[1, 1, 2]] {
                let case = format!("{family} {} tied={tied} split {split:?}", dtype.name());
                let mut r = runner(dir.path(), split, 16);
                assert_eq!(r.kv.num_stages(), split.len(), "{case}");
                let got = r.all_logits(&tokens).unwrap();
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{case}: prefill logits differ"
                );
                let mixed = mixed_step_logits(&mut r);
                assert!(
                    mixed
                        .iter()
                        .zip(&want_mixed)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{case}: mixed step logits differ"
                );
            }
        }
    }
}

#[test]
fn each_device_accounts_its_own_layers_weights_kv_and_workspace() {
    for tied in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), "qwen2", DType::F32, tied);
        let model = Model::load(dir.path(), 512).unwrap();
        let (whole, embed, head, norm) = (
            model.weight_bytes() as u64,
            model.embed.byte_len() as u64,
            model.lm_head.byte_len() as u64,
            (model.norm.len() * 4) as u64,
        );
        let layer = |i: usize| model.stage_weight_bytes(i..i + 1, false, false) as u64;
        let (layer0, layers123) = (layer(0), layer(1) + layer(2) + layer(3));
        let rope = model.rope.bytes() as u64;
        let c = model.config.clone();
        let st = stages(&[1, 3], &[None, None]);
        let r =
            ModelRunner::split(&st, model, BLOCKS, None, BLOCK_SIZE, 16, 2, KvDtype::F32).unwrap();
        let (d0, d1) = (&st[0].memory, &st[1].memory);
        // The embedding on the first device, the norm and the head on the last; a tied head is
        // the last device's own copy.
        assert_eq!(d0.in_use(Purpose::Weights), embed + layer0, "tied={tied}");
        assert_eq!(
            d1.in_use(Purpose::Weights),
            layers123 + norm + head,
            "tied={tied}"
        );
        let extra_head = if tied { head } else { 0 };
        assert_eq!(
            d0.in_use(Purpose::Weights) + d1.in_use(Purpose::Weights),
            whole + extra_head
        );
        // K/V: every block, each device's layers only.
        let part = |layers| {
            BlockPool::block_bytes(layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, KvDtype::F32)
                as u64
        };
        assert_eq!(d0.in_use(Purpose::Kv), BLOCKS as u64 * part(1));
        assert_eq!(d1.in_use(Purpose::Kv), BLOCKS as u64 * part(3));
        assert_eq!(r.kv.stage_storage_bytes(1) as u64, d1.in_use(Purpose::Kv));
        assert_eq!(
            d0.in_use(Purpose::Kv) + d1.in_use(Purpose::Kv),
            r.kv.storage_bytes() as u64
        );
        // A workspace of its own, with the RoPE table, on each.
        assert_eq!(
            d0.in_use(Purpose::Workspace),
            r.workspaces()[0].bytes() as u64 + rope
        );
        assert_eq!(
            d1.in_use(Purpose::Workspace),
            r.workspaces()[1].bytes() as u64 + rope
        );
        drop(r);
        assert_eq!((d0.total_in_use(), d1.total_in_use()), (0, 0));
    }
}

#[test]
fn the_device_that_cannot_hold_its_share_refuses_the_load_and_nothing_stays_reserved() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "llama", DType::F32, false);
    let model = Model::load(dir.path(), 512).unwrap();
    let c = model.config.clone();
    let kv1 = (BLOCKS
        * BlockPool::block_bytes(3, BLOCK_SIZE, c.num_kv_heads, c.head_dim, KvDtype::F32))
        as u64;
    let weights1 = model.stage_weight_bytes(1..4, false, true) as u64;
    // cpu:1 holds its weights and half its K/V; cpu:0 is unbounded.
    let st = stages(&[1, 3], &[None, Some(weights1 + kv1 / 2)]);
    let err = ModelRunner::split(&st, model, BLOCKS, None, BLOCK_SIZE, 16, 2, KvDtype::F32)
        .err()
        .unwrap();
    assert!(matches!(err, StrataError::InvalidRequest { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "kv_memory_mib: device cpu:1: cannot reserve {kv1} bytes for kv: {weights1} of {} \
             bytes in use",
            weights1 + kv1 / 2
        )
    );
    assert_eq!(
        (st[0].memory.total_in_use(), st[1].memory.total_in_use()),
        (0, 0)
    );
}
