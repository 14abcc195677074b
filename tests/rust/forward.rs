//! The forward pass on real files: mixed batches, chunking, dtypes, and load errors.

use std::path::Path;

use strata_rs::device::memory_pool::MemoryPool;
use strata_rs::engine::runner::ModelRunner;
use strata_rs::error::StrataError;
use strata_rs::kv::blocks::KvDtype;
use strata_rs::model::forward::{LogitsWanted, SeqChunk};
use strata_rs::model::kernels::cpu::quant::{interleave, QuantType};
use strata_rs::model::testing::{write_safetensors, TestModel};
use strata_rs::model::weights::DType;
use strata_rs::model::Model;

fn runner(dir: &Path, max_batch_tokens: usize) -> ModelRunner {
    let model = Model::load(dir, 512).unwrap();
    let kv_dtype = KvDtype::for_weights(model.dtype);
    runner_of(model, max_batch_tokens, kv_dtype, 2)
}

fn runner_kv(dir: &Path, max_batch_tokens: usize, kv_dtype: KvDtype) -> ModelRunner {
    runner_of(
        Model::load(dir, 512).unwrap(),
        max_batch_tokens,
        kv_dtype,
        2,
    )
}

/// A runner of 64 blocks of 16 tokens on an unbounded CPU memory pool.
fn runner_of(
    model: Model,
    max_batch_tokens: usize,
    kv_dtype: KvDtype,
    threads: usize,
) -> ModelRunner {
    ModelRunner::new(
        &MemoryPool::new("cpu", None),
        model,
        64,
        16,
        max_batch_tokens,
        threads,
        kv_dtype,
    )
    .unwrap()
}

fn ids(n: usize, vocab: u32, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % vocab)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn range(a: &[f32]) -> f32 {
    a.iter().cloned().fold(f32::MIN, f32::max) - a.iter().cloned().fold(f32::MAX, f32::min)
}

#[test]
fn chunked_prefill_and_decode_match_one_shot_prefill() {
    for family in ["llama", "qwen2", "qwen3"] {
        let dir = tempfile::tempdir().unwrap();
        TestModel::tiny(family).write(dir.path()).unwrap();
        let tokens = ids(70, 256, 3);
        let at_once = runner(dir.path(), 512).all_logits(&tokens).unwrap();
        let tol = 1e-4 * range(&at_once);
        for step in [1, 7, 16] {
            let chunked = runner(dir.path(), step).all_logits(&tokens).unwrap();
            let d = max_abs_diff(&at_once, &chunked);
            assert!(d <= tol, "{family}: step {step}: max diff {d} > {tol}");
        }
    }
}

#[test]
fn a_mixed_batch_equals_each_sequence_alone() {
    let dir = tempfile::tempdir().unwrap();
    TestModel::tiny("llama").write(dir.path()).unwrap();
    let a = ids(40, 256, 1);
    let b = ids(23, 256, 2);
    let vocab = 256;

    // Alone: all logits of each sequence.
    let alone_a = runner(dir.path(), 512).all_logits(&a).unwrap();
    let alone_b = runner(dir.path(), 512).all_logits(&b).unwrap();

    // Together: a is prefilled to 39 tokens first, then one step holds a's last token (decode)
    // and the whole of b (prefill), sharing one forward.
    let mut r = runner(dir.path(), 512);
    let ta = r.allocate(a.len()).unwrap();
    let tb = r.allocate(b.len()).unwrap();
    let mut out = vec![0.0; 40 * vocab];
    r.prefill(&a[..39], 0, &ta, LogitsWanted::None, &mut out)
        .unwrap();
    let batch = [
        SeqChunk {
            tokens: &a[39..],
            start_pos: 39,
            block_table: &ta,
            logits: LogitsWanted::Last,
        },
        SeqChunk {
            tokens: &b,
            start_pos: 0,
            block_table: &tb,
            logits: LogitsWanted::All,
        },
    ];
    let rows = r.step(&batch, &mut out).unwrap();
    assert_eq!(rows, 1 + b.len());
    let tol = 1e-4 * range(&alone_a);
    let d = max_abs_diff(&out[..vocab], &alone_a[39 * vocab..]);
    assert!(d <= tol, "decode row differs by {d}");
    let d = max_abs_diff(&out[vocab..rows * vocab], &alone_b);
    assert!(d <= tol, "prefill rows differ by {d}");
}

#[test]
fn bf16_and_f16_weights_track_f32() {
    let dir32 = tempfile::tempdir().unwrap();
    let mut m = TestModel::tiny("llama");
    m.write(dir32.path()).unwrap();
    let tokens = ids(50, 256, 9);
    let ref32 = runner(dir32.path(), 512).all_logits(&tokens).unwrap();
    for dtype in [DType::Bf16, DType::F16] {
        let dir = tempfile::tempdir().unwrap();
        m.dtype = dtype;
        m.write(dir.path()).unwrap();
        let model = Model::load(dir.path(), 512).unwrap();
        assert_eq!(model.dtype, dtype);
        let got = runner(dir.path(), 512).all_logits(&tokens).unwrap();
        let agree = ref32
            .chunks(256)
            .zip(got.chunks(256))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        assert!(
            agree >= 45,
            "{dtype:?}: argmax agrees at only {agree}/50 positions"
        );
    }
}

#[test]
fn f16_kv_cache_chunks_consistently_and_tracks_f32_kv() {
    for family in ["llama", "qwen3"] {
        let dir = tempfile::tempdir().unwrap();
        let mut m = TestModel::tiny(family);
        m.dtype = DType::Bf16;
        m.write(dir.path()).unwrap();
        let tokens = ids(300, 256, 5);
        let mut r = runner(dir.path(), 512);
        assert_eq!(r.kv.kv_dtype(), KvDtype::F16, "bf16 weights get f16 K/V");
        let at_once = r.all_logits(&tokens).unwrap();
        let tol = 1e-4 * range(&at_once);
        for step in [1, 7, 512] {
            let mut r = runner_kv(dir.path(), step, KvDtype::F16);
            let chunked = r.all_logits(&tokens).unwrap();
            let d = max_abs_diff(&at_once, &chunked);
            assert!(d <= tol, "{family}: step {step}: max diff {d} > {tol}");
        }
        let mut r = runner_kv(dir.path(), 512, KvDtype::F32);
        assert_eq!(r.kv.kv_dtype(), KvDtype::F32);
        let f32_kv = r.all_logits(&tokens).unwrap();
        let agree = f32_kv
            .chunks(256)
            .zip(at_once.chunks(256))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        assert!(
            agree * 100 >= 95 * tokens.len(),
            "{family}: f16 K/V argmax agrees with f32 K/V at only {agree}/{}",
            tokens.len()
        );
        // Close in value too, not only in argmax.
        let d = max_abs_diff(&f32_kv, &at_once);
        assert!(
            d <= 0.05 * range(&f32_kv),
            "{family}: f16 vs f32 K/V differ by {d}"
        );
    }
}

/// bf16 and q8_0 K/V (chosen for f32 weights) give the same logits whether a prompt is read at
/// once or in chunks that read the earlier chunks' K/V from the pool, and stay close to f32 K/V.
#[test]
fn bf16_and_q8_0_kv_caches_chunk_consistently_and_track_f32_kv() {
    for family in ["llama", "qwen3"] {
        let dir = tempfile::tempdir().unwrap();
        TestModel::tiny(family).write(dir.path()).unwrap();
        let tokens = ids(300, 256, 6);
        let f32_kv = runner_kv(dir.path(), 512, KvDtype::F32)
            .all_logits(&tokens)
            .unwrap();
        for kv_dtype in [KvDtype::Bf16, KvDtype::Q8_0] {
            let mut r = runner_kv(dir.path(), 512, kv_dtype);
            assert_eq!(r.kv.kv_dtype(), kv_dtype);
            let at_once = r.all_logits(&tokens).unwrap();
            let tol = 1e-4 * range(&at_once);
            for step in [1, 7] {
                let chunked = runner_kv(dir.path(), step, kv_dtype)
                    .all_logits(&tokens)
                    .unwrap();
                let d = max_abs_diff(&at_once, &chunked);
                assert!(
                    d <= tol,
                    "{family} {kv_dtype:?}: step {step}: max diff {d} > {tol}"
                );
            }
            let d = max_abs_diff(&f32_kv, &at_once);
            assert!(
                d <= 0.05 * range(&f32_kv),
                "{family}: {kv_dtype:?} vs f32 K/V differ by {d}"
            );
        }
    }
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).max_by(|&i, &j| x[i].total_cmp(&x[j])).unwrap()
}

fn load_error(dir: &Path) -> String {
    match Model::load(dir, 64) {
        Err(e @ StrataError::ModelLoad { .. }) => e.to_string(),
        Err(e) => panic!("expected ModelLoad, got {e:?}"),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn load_errors_name_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let m = TestModel::tiny("llama");
    m.write(d).unwrap();
    let st = d.join("model.safetensors");
    let shown = st.display().to_string();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = m
        .tensors()
        .into_iter()
        .map(|(n, s)| {
            let len = s.iter().product();
            (n, s, vec![0.5; len])
        })
        .collect();

    // Missing tensor.
    let full = tensors.clone();
    tensors.retain(|(n, _, _)| n != "model.layers.1.mlp.up_proj.weight");
    write_safetensors(&st, &tensors, DType::F32).unwrap();
    assert_eq!(
        load_error(d),
        format!("{shown}: missing tensor model.layers.1.mlp.up_proj.weight")
    );

    // Extra tensor.
    let mut extra = full.clone();
    extra.push((
        "model.layers.0.mlp.extra.weight".into(),
        vec![2],
        vec![0.0; 2],
    ));
    write_safetensors(&st, &extra, DType::F32).unwrap();
    assert_eq!(
        load_error(d),
        format!("{shown}: unexpected tensor model.layers.0.mlp.extra.weight (not part of this model's architecture)")
    );

    // Shape mismatch.
    let mut wrong = full.clone();
    wrong[0] = (
        "model.embed_tokens.weight".into(),
        vec![255, 64],
        vec![0.0; 255 * 64],
    );
    write_safetensors(&st, &wrong, DType::F32).unwrap();
    assert_eq!(
        load_error(d),
        format!("{shown}: tensor model.embed_tokens.weight: shape [255, 64], expected [256, 64]")
    );

    // Truncated file.
    write_safetensors(&st, &full, DType::F32).unwrap();
    let len = std::fs::metadata(&st).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&st).unwrap();
    f.set_len(len - 100).unwrap();
    drop(f);
    let e = load_error(d);
    assert!(
        e.starts_with(&format!(
            "{shown}: tensor lm_head.weight: truncated file: the tensor ends at byte"
        )),
        "{e}"
    );

    // Unsupported dtype.
    let header =
        br#"{"model.embed_tokens.weight":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0, 0]);
    std::fs::write(&st, bytes).unwrap();
    assert_eq!(
        load_error(d),
        format!("{shown}: tensor model.embed_tokens.weight: unsupported dtype I8 (supported: F32, F16, BF16)")
    );

    // A shape whose byte size overflows: an error, not a wrapped size that matches the offsets.
    for shape in ["[4611686018427387904,4]", "[4294967296,4294967296,4]"] {
        let header = format!(
            r#"{{"model.embed_tokens.weight":{{"dtype":"F32","shape":{shape},"data_offsets":[0,0]}}}}"#
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(&st, bytes).unwrap();
        let want = shape.trim_matches(['[', ']']).replace(',', ", ");
        assert_eq!(
            load_error(d),
            format!("{shown}: tensor model.embed_tokens.weight: shape [{want}] is too large")
        );
    }

    // No weights at all.
    std::fs::remove_file(&st).unwrap();
    assert_eq!(
        load_error(d),
        format!(
            "{}: no model.safetensors or model.safetensors.index.json in the model folder",
            d.display()
        )
    );
}

#[test]
fn sharded_weights_load_like_one_file() {
    let one = tempfile::tempdir().unwrap();
    let m = TestModel::tiny("qwen2");
    m.write(one.path()).unwrap();
    let tokens = ids(20, 256, 4);
    let want = runner(one.path(), 512).all_logits(&tokens).unwrap();

    // Rewrite the same weights as two shards with an index.
    let sharded = tempfile::tempdir().unwrap();
    std::fs::copy(
        one.path().join("config.json"),
        sharded.path().join("config.json"),
    )
    .unwrap();
    let model = Model::load(one.path(), 64).unwrap();
    drop(model);
    let mut tensors = Vec::new();
    let files = strata_rs::model::weights::SafetensorsFiles::open(one.path()).unwrap();
    for (name, shape) in m.tensors() {
        let t = files.get(&name, &shape).unwrap();
        tensors.push((name, shape, t.to_f32_vec()));
    }
    let (a, b) = tensors.split_at(tensors.len() / 2);
    write_safetensors(
        &sharded.path().join("model-00001-of-00002.safetensors"),
        a,
        DType::F32,
    )
    .unwrap();
    write_safetensors(
        &sharded.path().join("model-00002-of-00002.safetensors"),
        b,
        DType::F32,
    )
    .unwrap();
    let mut map = serde_json::Map::new();
    for (n, _, _) in a {
        map.insert(n.clone(), "model-00001-of-00002.safetensors".into());
    }
    for (n, _, _) in b {
        map.insert(n.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let got = runner(sharded.path(), 512).all_logits(&tokens).unwrap();
    assert_eq!(got, want, "shards must give bit-identical logits");
}

#[test]
fn gguf_files_compute_what_the_folder_computes() {
    // The same f32 weights as a Hugging Face folder and as a GGUF file (GGUF names, llama q/k
    // rows in adjacent-pair order): the same logits, to f32 rounding (a llama head's dot
    // products sum its dimensions in another order).
    for family in ["llama", "mistral", "qwen2", "qwen3"] {
        let folder = tempfile::tempdir().unwrap();
        let m = TestModel::tiny(family);
        m.write(folder.path()).unwrap();
        let file = tempfile::tempdir().unwrap();
        let path = file.path().join("model.gguf");
        m.write_gguf(&path, DType::F32).unwrap();
        let tokens = ids(60, 256, 4);
        let want = runner(folder.path(), 512).all_logits(&tokens).unwrap();
        // The file itself, and the folder holding it.
        for source in [path.as_path(), file.path()] {
            let got = runner(source, 16).all_logits(&tokens).unwrap();
            let d = max_abs_diff(&want, &got);
            let tol = 1e-4 * range(&want);
            assert!(d <= tol, "{family}: max diff {d} > {tol}");
        }
    }
}

#[test]
fn interleaved_weights_give_the_same_logits_to_the_bit() {
    // Files of the types with an interleaved layout, with a tied embedding (the lookup then
    // reads the interleaved head) and without; 35 rows of vocabulary are not whole groups of
    // 16. Whichever kernel this CPU runs on the interleaved layout, the logits are the
    // row-major ones, bit for bit. (A type this CPU's kernels do not read interleaved stays
    // as it is.)
    for (ty, tied) in [
        (QuantType::Q4_K, true),
        (QuantType::Q6_K, false),
        (QuantType::Q6_K, true),
        (QuantType::Q4_0, false),
        (QuantType::Q4_1, true),
        (QuantType::Q8_0, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut m = TestModel::tiny("llama");
        (m.hidden, m.intermediate, m.head_dim, m.vocab, m.tied) = (256, 512, 64, 291, tied);
        let path = dir.path().join("model.gguf");
        m.write_gguf(&path, DType::Quant(ty)).unwrap();
        let tokens = ids(40, 291, 6);
        let want = runner(&path, 512).all_logits(&tokens).unwrap();
        let mut model = Model::load(&path, 512).unwrap();
        let bytes = model.weight_bytes();
        let wanted = interleave::wanted(ty);
        // 2 layers x 7 matrices, and the head.
        let changed = if wanted { 15 } else { 0 };
        assert_eq!(model.interleave_for_cpu(), changed, "{ty:?} tied={tied}");
        assert_eq!(
            model.interleave_for_cpu(),
            0,
            "interleaving twice changes nothing"
        );
        // The vocabulary padded to 304 rows; a tied head still counts once.
        let pad = if wanted {
            (304 - 291) * ty.row_bytes(256).unwrap()
        } else {
            0
        };
        assert_eq!(model.weight_bytes(), bytes + pad, "{ty:?} tied={tied}");
        let got = runner_of(model, 16, KvDtype::for_weights(DType::Quant(ty)), 2)
            .all_logits(&tokens)
            .unwrap();
        assert_bits_eq(&got, &want, &format!("{ty:?} tied={tied}"));
    }
}

// ---- Batch invariance: every row's logits are bitwise independent of the step it ran in. ----

/// The tiny model of `family` in `dtype` (mistral with a 50-key sliding window, so that windows
/// cut the attention segments in the sequences below).
fn invariance_model(family: &'static str, dtype: DType) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut m = TestModel::tiny(family);
    if let DType::Quant(q) = dtype {
        // A GGUF file; rows of 256 for the K-quants' blocks.
        if q.block_elems() > 32 {
            (m.hidden, m.intermediate, m.head_dim) = (256, 512, 64);
        }
        m.write_gguf(&dir.path().join("model.gguf"), dtype).unwrap();
        return dir;
    }
    m.dtype = dtype;
    m.write(dir.path()).unwrap();
    if family == "mistral" {
        let path = dir.path().join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        cfg["sliding_window"] = 50.into();
        std::fs::write(&path, cfg.to_string()).unwrap();
    }
    dir
}

/// Every invariance model: four families in f32, llama also in bf16 and f16 (f16 K/V), mistral
/// (sliding window) also in bf16, and GGUF files of four block formats.
fn invariance_models() -> Vec<(String, tempfile::TempDir)> {
    let mut v = Vec::new();
    for (family, dtype) in [
        ("llama", DType::F32),
        ("qwen2", DType::F32),
        ("qwen3", DType::F32),
        ("mistral", DType::F32),
        ("llama", DType::Bf16),
        ("llama", DType::F16),
        ("mistral", DType::Bf16),
        ("llama", DType::Quant(QuantType::Q8_0)),
        ("qwen2", DType::Quant(QuantType::Q4_1)),
        ("llama", DType::Quant(QuantType::Q4_K)),
        ("qwen3", DType::Quant(QuantType::Q6_K)),
    ] {
        v.push((
            format!("{family} {dtype:?}"),
            invariance_model(family, dtype),
        ));
    }
    v
}

fn runner_threads(dir: &Path, max_batch_tokens: usize, threads: usize) -> ModelRunner {
    let model = Model::load(dir, 512).unwrap();
    let kv_dtype = KvDtype::for_weights(model.dtype);
    runner_of(model, max_batch_tokens, kv_dtype, threads)
}

/// Asserts bitwise equality, naming the first differing element.
fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} differs: {} vs {} (max abs diff {})",
            got[i],
            want[i],
            max_abs_diff(got, want)
        );
    }
}

/// One chunk (300 tokens: the panel matmul path, attention over 3 segments) vs chunks of 1, 7,
/// 16 and 100 tokens (max_batch_tokens set to the chunk: the stream path, and every split of the
/// prompt), on 2 threads and on 1 or 3: every position's logits, bit for bit.
#[test]
fn logits_are_bitwise_independent_of_chunking_and_threads() {
    let tokens = ids(300, 256, 11);
    for (name, dir) in invariance_models() {
        let want = runner_threads(dir.path(), 512, 2)
            .all_logits(&tokens)
            .unwrap();
        for (step, threads) in [
            (512, 1),
            (512, 3),
            (1, 2),
            (7, 2),
            (16, 3),
            (100, 2),
            (100, 1),
        ] {
            let got = runner_threads(dir.path(), step, threads)
                .all_logits(&tokens)
                .unwrap();
            assert_bits_eq(
                &got,
                &want,
                &format!("{name}: chunks of {step} on {threads} threads"),
            );
        }
    }
}

/// A sequence's logits alone vs in steps shared with other sequences' prefill chunks and decode
/// rows (before and after it in the batch, with more and fewer rows than the matmul's stream
/// path takes), for every position of its prompt.
#[test]
fn logits_are_bitwise_independent_of_batch_neighbours() {
    let vocab = 256;
    let target = ids(150, 256, 21);
    let other_a = ids(260, 256, 22);
    let other_b = ids(90, 256, 23);
    for (name, dir) in invariance_models() {
        let want = runner(dir.path(), 512).all_logits(&target).unwrap();
        let mut r = runner(dir.path(), 512);
        let tt = r.allocate(target.len()).unwrap();
        let ta = r.allocate(other_a.len()).unwrap();
        let tb = r.allocate(other_b.len()).unwrap();
        let mut sink = vec![0.0; 512 * vocab];
        // The others' history: a is 200 tokens in (decode rows from there), b 40.
        r.prefill(&other_a[..200], 0, &ta, LogitsWanted::None, &mut sink)
            .unwrap();
        r.prefill(&other_b[..40], 0, &tb, LogitsWanted::None, &mut sink)
            .unwrap();
        // The target in chunks of 3, 60, 1, 86 tokens, each step with different company.
        let mut got = vec![0.0; target.len() * vocab];
        let (mut pos, mut a_pos, mut b_pos) = (0, 200, 40);
        for (i, len) in [3usize, 60, 1, 86].into_iter().enumerate() {
            let chunk = SeqChunk {
                tokens: &target[pos..pos + len],
                start_pos: pos,
                block_table: &tt,
                logits: LogitsWanted::All,
            };
            let a_dec = SeqChunk {
                tokens: &other_a[a_pos..a_pos + 1],
                start_pos: a_pos,
                block_table: &ta,
                logits: LogitsWanted::Last,
            };
            let b_len = [20, 1, 29, 0][i];
            let b_pre = SeqChunk {
                tokens: &other_b[b_pos..b_pos + b_len],
                start_pos: b_pos,
                block_table: &tb,
                logits: LogitsWanted::All,
            };
            // Target first, in the middle, last, and alone with a decode row.
            let (batch, at): (Vec<SeqChunk>, usize) = match i {
                0 => (vec![chunk, a_dec, b_pre], 0),
                1 => (vec![a_dec, chunk, b_pre], 1),
                2 => (vec![b_pre, a_dec, chunk], b_len + 1),
                _ => (vec![a_dec, chunk], 1),
            };
            let rows = r.step(&batch, &mut sink).unwrap();
            assert_eq!(rows, len + 1 + b_len);
            got[pos * vocab..(pos + len) * vocab]
                .copy_from_slice(&sink[at * vocab..(at + len) * vocab]);
            pos += len;
            a_pos += 1;
            b_pos += b_len;
        }
        assert_eq!(pos, target.len());
        assert_bits_eq(
            &got,
            &want,
            &format!("{name}: target among other sequences"),
        );
    }
}

/// The last layer runs only the rows that want logits (`forward.rs`): a prompt's first 100
/// tokens prefilled without logits beside another prompt without logits (both skip the rest of
/// the last layer for every row), then 49 tokens wanting their last row only beside the other
/// sequence's decode row, then one decode row: each logit row equals that of a prefill that
/// wanted every row, bit for bit, so the K/V the skipping steps wrote is the same.
#[test]
fn rows_that_want_no_logits_change_no_logits() {
    fn chunk<'a>(t: &'a [u32], at: usize, table: &'a [u32], logits: LogitsWanted) -> SeqChunk<'a> {
        SeqChunk {
            tokens: t,
            start_pos: at,
            block_table: table,
            logits,
        }
    }
    let vocab = 256;
    let target = ids(150, 256, 31);
    let other = ids(91, 256, 32);
    for (name, dir) in invariance_models() {
        let want = runner(dir.path(), 512).all_logits(&target).unwrap();
        let want_other = runner(dir.path(), 512).all_logits(&other).unwrap();
        let mut r = runner(dir.path(), 512);
        let tt = r.allocate(target.len()).unwrap();
        let to = r.allocate(other.len()).unwrap();
        let mut out = vec![f32::NAN; 2 * vocab];
        let none = LogitsWanted::None;
        let rows = r
            .step(
                &[
                    chunk(&target[..100], 0, &tt, none),
                    chunk(&other[..90], 0, &to, none),
                ],
                &mut out,
            )
            .unwrap();
        assert_eq!(rows, 0, "{name}");
        let last = LogitsWanted::Last;
        let rows = r
            .step(
                &[
                    chunk(&other[90..], 90, &to, last),
                    chunk(&target[100..149], 100, &tt, last),
                ],
                &mut out,
            )
            .unwrap();
        assert_eq!(rows, 2, "{name}");
        assert_bits_eq(
            &out[..vocab],
            &want_other[90 * vocab..],
            &format!("{name}: the other sequence's decode row"),
        );
        assert_bits_eq(
            &out[vocab..],
            &want[148 * vocab..149 * vocab],
            &format!("{name}: the last row of a chunk"),
        );
        let rows = r
            .step(&[chunk(&target[149..], 149, &tt, last)], &mut out)
            .unwrap();
        assert_eq!(rows, 1, "{name}");
        assert_bits_eq(
            &out[..vocab],
            &want[149 * vocab..],
            &format!("{name}: a decode row after chunks without logits"),
        );
    }
}

/// Greedy decode for `steps` tokens after `prompt`, each step's logits recorded. `company`
/// gives, per step, other rows to run in the same step (prefill chunks and decode rows of other
/// sequences, placed before the target).
fn greedy(
    r: &mut ModelRunner,
    prompt: &[u32],
    steps: usize,
    mut company: impl FnMut(usize, &mut ModelRunner) -> Vec<(Vec<u32>, usize, Vec<u32>)>,
) -> (Vec<u32>, Vec<f32>) {
    let vocab = r.model.config.vocab_size;
    let table = r.allocate(prompt.len() + steps).unwrap();
    let mut out = vec![0.0; vocab];
    r.prefill(prompt, 0, &table, LogitsWanted::Last, &mut out)
        .unwrap();
    let (mut toks, mut logits) = (Vec::new(), out.clone());
    let mut sink = vec![0.0; 512 * vocab];
    for i in 0..steps {
        let next = argmax(&out) as u32;
        toks.push(next);
        let others = company(i, r);
        let mut batch: Vec<SeqChunk> = others
            .iter()
            .map(|(t, start, table)| SeqChunk {
                tokens: t,
                start_pos: *start,
                block_table: table,
                logits: LogitsWanted::Last,
            })
            .collect();
        let before = batch.len();
        let tok = [next];
        batch.push(SeqChunk {
            tokens: &tok,
            start_pos: prompt.len() + i,
            block_table: &table,
            logits: LogitsWanted::Last,
        });
        let rows = r.step(&batch, &mut sink).unwrap();
        assert_eq!(rows, before + 1);
        out.copy_from_slice(&sink[before * vocab..(before + 1) * vocab]);
        logits.extend_from_slice(&out);
    }
    (toks, logits)
}

/// A 40-step greedy continuation alone vs interleaved with other sequences' prefill chunks
/// (of 1 to 120 tokens) and decode rows: the same tokens and the same logits, bit for bit.
#[test]
fn greedy_decode_is_bitwise_independent_of_interleaving() {
    let prompt = ids(130, 256, 31);
    let other = ids(400, 256, 32);
    for (name, dir) in invariance_models() {
        let (want_toks, want_logits) =
            greedy(&mut runner(dir.path(), 512), &prompt, 40, |_, _| Vec::new());
        let mut r = runner(dir.path(), 512);
        let t1 = r.allocate(other.len()).unwrap();
        let t2 = r.allocate(other.len()).unwrap();
        let (mut p1, mut p2) = (0usize, 0usize);
        let (got_toks, got_logits) = greedy(&mut r, &prompt, 40, |i, _| {
            let mut v = Vec::new();
            // Sequence 1 prefills in chunks of 1 to 120 tokens, then decodes; sequence 2 joins
            // at step 10 with 33-token chunks between decode rows.
            let len1 = if i < 5 { [1, 7, 64, 65, 120][i] } else { 1 };
            v.push((other[p1..p1 + len1].to_vec(), p1, t1.clone()));
            p1 += len1;
            if i >= 10 {
                let len2 = if i % 3 == 0 { 33 } else { 1 };
                v.push((other[p2..p2 + len2].to_vec(), p2, t2.clone()));
                p2 += len2;
            }
            v
        });
        assert_eq!(got_toks, want_toks, "{name}: greedy tokens differ");
        assert_bits_eq(&got_logits, &want_logits, &format!("{name}: greedy logits"));
    }
}

/// A chunk with no tokens that wants logits is refused (its "last" row would be its
/// neighbour's); with no logits wanted it is an empty part of the step.
#[test]
fn a_chunk_with_no_tokens_cannot_want_logits() {
    let dir = tempfile::tempdir().unwrap();
    TestModel::tiny("llama").write(dir.path()).unwrap();
    let a = ids(5, 256, 1);
    let mut r = runner(dir.path(), 512);
    let ta = r.allocate(a.len()).unwrap();
    let tb = r.allocate(1).unwrap();
    let mut out = vec![0.0; 2 * 256];
    let step = |r: &mut ModelRunner, logits: LogitsWanted, out: &mut [f32]| {
        let batch = [
            SeqChunk {
                tokens: &a,
                start_pos: 0,
                block_table: &ta,
                logits: LogitsWanted::Last,
            },
            SeqChunk {
                tokens: &[],
                start_pos: 0,
                block_table: &tb,
                logits,
            },
        ];
        r.step(&batch, out)
    };
    match step(&mut r, LogitsWanted::Last, &mut out) {
        Err(StrataError::Internal(m)) => {
            assert_eq!(m, "a chunk with no tokens cannot want logits")
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
    assert_eq!(step(&mut r, LogitsWanted::None, &mut out).unwrap(), 1);
}

/// A mistral with a 50-key window whose layers keep their K/V in 8 window slots (5 blocks a
/// window reads, two more for a chunk), for 300 tokens in 19 blocks: every position's logits are
/// those of a pool that keeps every position, bit for bit, chunked as the steps come.
#[test]
fn window_slots_give_the_logits_of_a_pool_that_keeps_every_position() {
    use strata_rs::engine::runner::Stage;
    use strata_rs::kv::window::WindowLayout;
    let tokens = ids(300, 256, 11);
    let dir = invariance_model("mistral", DType::F32);
    for chunk in [1, 7, 16] {
        let want = runner_threads(dir.path(), chunk, 2)
            .all_logits(&tokens)
            .unwrap();
        let model = Model::load(dir.path(), 512).unwrap();
        let layers = model.config.num_layers;
        let stage = Stage {
            memory: MemoryPool::new("cpu", None),
            layers,
        };
        let window = WindowLayout {
            window: 50,
            layers: vec![true; layers],
            num_slots: 8,
        };
        let mut r = ModelRunner::split(
            &[stage],
            model,
            64,
            Some(window),
            16,
            chunk,
            2,
            KvDtype::F32,
        )
        .unwrap();
        let got = r.all_logits(&tokens).unwrap();
        assert_bits_eq(&got, &want, &format!("chunks of {chunk}"));
        assert_eq!(r.kv.window_slots(), Some((8, 0, 0)), "all given back");
    }
}
