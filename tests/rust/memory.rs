//! The device MemoryPool's accounting of a loaded model: weights, K/V and workspace bytes against
//! figures computed here from the files and the config, and their release.

use std::path::Path;

use strata_rs::device::memory_pool::{MemoryPool, Purpose};
use strata_rs::engine::runner::ModelRunner;
use strata_rs::error::StrataError;
use strata_rs::kv::blocks::KvDtype;
use strata_rs::model::testing::TestModel;
use strata_rs::model::weights::DType;
use strata_rs::model::Model;

const KV_BLOCKS: usize = 64;
const BLOCK_SIZE: usize = 16;
const MAX_POSITIONS: usize = 512;

/// The weight bytes as the loader keeps them, from the safetensors header alone: matrices at
/// their size in the file (memory-mapped views), 1-D tensors widened to f32 (owned copies), and
/// a stored head skipped when the model ties it to the embedding.
fn weight_bytes_from_header(dir: &Path, tied: bool) -> u64 {
    let file = std::fs::read(dir.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&file[8..8 + header_len]).unwrap();
    let mut total = 0;
    for (name, info) in &header {
        if name == "__metadata__" || (tied && name == "lm_head.weight") {
            continue;
        }
        let shape: Vec<u64> = info["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let offsets: Vec<u64> = info["data_offsets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        total += if shape.len() == 1 {
            shape[0] * 4
        } else {
            offsets[1] - offsets[0]
        };
    }
    total
}

#[test]
fn a_runner_accounts_its_weights_kv_and_workspace_and_releases_them() {
    for (family, dtype, tied) in [
        ("llama", DType::F32, false),
        ("qwen2", DType::Bf16, true),
        ("qwen3", DType::F16, false),
    ] {
        let case = format!("{family} {} tied={tied}", dtype.name());
        let dir = tempfile::tempdir().unwrap();
        let shape = TestModel {
            dtype,
            tied,
            ..TestModel::tiny(family)
        };
        shape.write(dir.path()).unwrap();
        let model = Model::load(dir.path(), MAX_POSITIONS).unwrap();
        let kv_dtype = KvDtype::for_weights(dtype);
        let memory = MemoryPool::new("cpu", None);
        let runner =
            ModelRunner::new(&memory, model, KV_BLOCKS, BLOCK_SIZE, 64, 2, kv_dtype).unwrap();

        let weights = weight_bytes_from_header(dir.path(), tied);
        assert_eq!(memory.in_use(Purpose::Weights), weights, "{case}");
        // f32 files: exactly the header's sum. Half-precision files: the vectors double.
        if dtype == DType::F32 {
            let file = std::fs::metadata(dir.path().join("model.safetensors")).unwrap();
            assert!(weights < file.len(), "{case}: the tensors, not the header");
        }

        let block_bytes =
            shape.layers * 2 * BLOCK_SIZE * shape.kv_heads * kv_dtype.row_bytes(shape.head_dim);
        let kv = (KV_BLOCKS * block_bytes) as u64;
        assert_eq!(memory.in_use(Purpose::Kv), kv, "{case}");
        assert_eq!(runner.kv.storage_bytes() as u64, kv, "{case}: as allocated");

        // The RoPE table (cos and sin, head_dim / 2 floats per position each) is workspace.
        let rope = (2 * MAX_POSITIONS * shape.head_dim / 2 * 4) as u64;
        assert_eq!(runner.model.rope.bytes() as u64, rope, "{case}");
        let workspace = memory.in_use(Purpose::Workspace);
        assert_eq!(
            workspace,
            runner.workspaces()[0].bytes() as u64 + rope,
            "{case}"
        );
        // At least the activations: x, picked (hidden), gate and up (intermediate) per token.
        let floor = 64 * (2 * shape.hidden + 2 * shape.intermediate) * 4;
        assert!(workspace > (floor as u64 + rope), "{case}: {workspace}");

        assert_eq!(memory.in_use(Purpose::Graphs), 0, "{case}");
        assert_eq!(memory.in_use(Purpose::Staging), 0, "{case}");
        assert_eq!(memory.total_in_use(), weights + kv + workspace, "{case}");
        drop(runner);
        assert_eq!(memory.total_in_use(), 0, "{case}: released with the runner");
    }
}

#[test]
fn a_pool_too_small_for_the_kv_refuses_the_load_before_allocating_it() {
    let dir = tempfile::tempdir().unwrap();
    TestModel::tiny("llama").write(dir.path()).unwrap();
    let model = Model::load(dir.path(), MAX_POSITIONS).unwrap();
    let weights = model.weight_bytes() as u64;
    // Room for the weights and one byte more.
    let memory = MemoryPool::new("cpu", Some(weights + 1));
    let err = ModelRunner::new(&memory, model, KV_BLOCKS, BLOCK_SIZE, 64, 2, KvDtype::F32)
        .err()
        .expect("the K/V pool cannot fit");
    // tiny: 2 layers x K and V x 16 tokens x 2 heads x 16 dims x 4 bytes, 64 blocks.
    let kv = 64 * 2 * 2 * 16 * 2 * 16 * 4;
    assert!(matches!(err, StrataError::InvalidRequest { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "kv_memory_mib: device cpu: cannot reserve {kv} bytes for kv: {weights} of {} bytes \
             in use",
            weights + 1
        )
    );
    assert_eq!(
        memory.total_in_use(),
        0,
        "the weights' reservation went with the error"
    );
}
