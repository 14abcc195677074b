use super::*;
use crate::model::testing::{GgufWriter, TestModel};
use crate::model::Model;

fn write(dir: &Path, name: &str, w: &GgufWriter) -> PathBuf {
    let path = dir.join(name);
    w.write(&path).expect("write gguf");
    path
}

fn load_err(path: &Path) -> String {
    match Model::load(path, 16) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

/// A one-tensor file with the given metadata hooks.
fn small(extra: impl FnOnce(&mut GgufWriter)) -> GgufWriter {
    let mut w = GgufWriter::default();
    w.string("general.architecture", "llama");
    extra(&mut w);
    w.tensor("token_embd.weight", &[4, 32], DType::F32, &[0.5; 128]);
    w
}

#[test]
fn metadata_and_tensors_read_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = small(|w| {
        w.u32("llama.block_count", 3);
        w.f32("llama.rope.freq_base", 500000.0);
        w.bool("tokenizer.ggml.add_bos_token", true);
        w.strings("tokenizer.ggml.tokens", &["a", "b"]);
    });
    w.tensor("blk.0.attn_norm.weight", &[32], DType::F16, &[1.5; 32]);
    let path = write(dir.path(), "m.gguf", &w);
    let m = GgufModel::open(&path).expect("open");
    assert_eq!(m.metadata.str("general.architecture").unwrap(), "llama");
    assert_eq!(m.metadata.usize("llama.block_count").unwrap(), 3);
    assert_eq!(
        m.metadata.f64_opt("llama.rope.freq_base").unwrap(),
        Some(500000.0)
    );
    assert_eq!(
        m.metadata.bool_opt("tokenizer.ggml.add_bos_token").unwrap(),
        Some(true)
    );
    assert_eq!(
        m.metadata.strings_opt("tokenizer.ggml.tokens").unwrap(),
        Some(vec!["a".to_string(), "b".to_string()])
    );
    let e = m.get("token_embd.weight", &[4, 32]).expect("tensor");
    assert_eq!(e.dtype, DType::F32);
    assert_eq!(e.to_f32_vec(), vec![0.5; 128]);
    let n = m.get("blk.0.attn_norm.weight", &[32]).expect("tensor");
    assert_eq!(n.dtype, DType::F16);
    assert_eq!(n.to_f32_vec(), vec![1.5; 32]);
    // Wrong types and shapes name the file and the key or tensor.
    let err = m.metadata.str("llama.block_count").unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{}: llama.block_count: expected a string, found uint32",
            path.display()
        )
    );
    let err = m.get("token_embd.weight", &[32, 4]).err().expect("shape");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tensor token_embd.weight: shape [4, 32], expected [32, 4]",
            path.display()
        )
    );
    let err = m.get("output.weight", &[4, 32]).err().expect("missing");
    assert_eq!(
        err.to_string(),
        format!("{}: missing tensor output.weight", path.display())
    );
}

#[test]
fn a_tiny_model_loads_with_its_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    for family in ["llama", "qwen2", "qwen3"] {
        let t = TestModel::tiny(family);
        let path = dir.path().join(format!("{family}.gguf"));
        t.write_gguf(&path, DType::F16).expect("write");
        let m = Model::load(&path, 64).expect("load");
        let c = &m.config;
        assert_eq!(c.family.name(), family);
        assert_eq!(
            (c.hidden_size, c.intermediate_size, c.num_layers),
            (64, 128, 2)
        );
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 16));
        assert_eq!(c.vocab_size, 256);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(c.qkv_bias, family == "qwen2");
        assert_eq!(c.qk_norm, family == "qwen3");
        let pairing = if family == "llama" {
            RopePairing::Adjacent
        } else {
            RopePairing::Half
        };
        assert_eq!(c.rope_pairing, pairing);
        assert_eq!(m.rope.pairing(), pairing);
        assert_eq!(m.dtype, DType::F16);
        assert!(!c.tie_word_embeddings);
    }
}

use crate::model::kernels::cpu::rope::{RopePairing, RopeScaling};

#[test]
fn bad_headers_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = small(|_| {}).bytes();
    let path = dir.path().join("bad.gguf");
    let p = path.display().to_string();
    let check = |bytes: &[u8], want: &str| {
        std::fs::write(&path, bytes).expect("write");
        let err = GgufModel::open(&path).err().expect("an error").to_string();
        assert_eq!(err, format!("{p}: {want}"));
    };
    let mut b = good.clone();
    b[0] = b'X';
    check(&b, "not a GGUF file (magic \"XGUF\", expected \"GGUF\")");
    let mut b = good.clone();
    b[4] = 1;
    check(
        &b,
        "version: GGUF version 1 is not supported (supported: 2, 3)",
    );
    check(
        &good[..6],
        "truncated file: version runs past the end (6 bytes)",
    );
    // The tensor's data cut off.
    check(
        &good[..good.len() - 8],
        "tensor token_embd.weight: truncated file: the tensor ends at byte 512 of the data section but it has 504 bytes",
    );
    // Every prefix of the header is an error, never a panic or a huge allocation.
    for len in 0..good.len() {
        std::fs::write(&path, &good[..len]).expect("write");
        assert!(GgufModel::open(&path).is_err(), "prefix {len} opened");
    }
}

#[test]
fn tensor_types_and_offsets_are_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.gguf");
    let p = path.display().to_string();
    let with = |id: u32, offset_bump: u64, cols: usize| {
        let mut w = GgufWriter::default();
        w.string("general.architecture", "llama");
        w.tensors.push((
            "token_embd.weight".into(),
            vec![4, cols],
            id,
            vec![0u8; 4096],
        ));
        let mut b = w.bytes();
        if offset_bump > 0 {
            // The offset field ends the tensor info: header, metadata, name, dims, type.
            let meta: usize = w.metadata.iter().map(Vec::len).sum();
            let at = 24 + meta + 8 + "token_embd.weight".len() + 4 + 16 + 4;
            b[at..at + 8].copy_from_slice(&offset_bump.to_le_bytes());
        }
        b
    };
    let check = |bytes: Vec<u8>, want: &str| {
        std::fs::write(&path, bytes).expect("write");
        let err = GgufModel::open(&path).err().expect("an error").to_string();
        assert_eq!(err, format!("{p}: {want}"));
    };
    check(
        with(16, 0, 32),
        "tensor token_embd.weight: type IQ2_XXS is not supported",
    );
    check(
        with(99, 0, 32),
        "tensor token_embd.weight: unknown type id 99",
    );
    check(
        with(12, 0, 32),
        "tensor token_embd.weight: Q4_K rows of 32 elements are not whole blocks of 256",
    );
    check(
        with(0, 4, 32),
        "tensor token_embd.weight: offset 4 is not a multiple of the alignment 32",
    );
}

#[test]
fn model_errors_name_the_key_or_tensor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = TestModel::tiny("llama");
    let path = dir.path().join("m.gguf");
    t.write_gguf(&path, DType::F32).expect("write");
    let p = path.display().to_string();
    // An unknown architecture.
    let mut w = small(|_| {});
    w.metadata[0] = {
        let mut x = GgufWriter::default();
        x.string("general.architecture", "mamba");
        x.metadata.remove(0)
    };
    let other = write(dir.path(), "mamba.gguf", &w);
    assert_eq!(
        load_err(&other),
        format!(
            "{}: general.architecture: unsupported architecture \"mamba\" (supported: llama, qwen2, qwen3, qwen3moe, gemma3, phi3)",
            other.display()
        )
    );
    // A missing hyper-parameter.
    let bare = write(dir.path(), "bare.gguf", &small(|_| {}));
    assert_eq!(
        load_err(&bare),
        format!("{}: llama.embedding_length: missing", bare.display())
    );
    // A misshaped tensor: rebuild the file with one matrix transposed.
    let m = GgufModel::open(&path).expect("open");
    assert!(m.contains("blk.1.ffn_down.weight"));
    let w = rebuilt(&m, |_| {}, Some("blk.1.ffn_down.weight"));
    let bad = write(dir.path(), "bad.gguf", &w);
    assert_eq!(
        load_err(&bad),
        format!(
            "{}: tensor blk.1.ffn_down.weight: shape [128, 64], expected [64, 128]",
            bad.display()
        )
    );
    let _ = p;
}

/// The tiny llama file `m` written again with its hyper-parameters, `extra` metadata, and its
/// tensors in f32 (`transposed` with its shape reversed).
fn rebuilt(
    m: &GgufModel,
    extra: impl FnOnce(&mut GgufWriter),
    transposed: Option<&str>,
) -> GgufWriter {
    let mut w = GgufWriter::default();
    w.string("general.architecture", "llama");
    for key in [
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
    ] {
        let k = format!("llama.{key}");
        w.u32(&k, m.metadata.usize(&k).expect("key") as u32);
    }
    w.f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    extra(&mut w);
    for name in m.tensor_names() {
        let info = m.info(name).expect("info");
        let mut shape = info.shape.clone();
        if Some(name.as_str()) == transposed {
            shape.reverse();
        }
        let data = m.get(name, &info.shape).expect("tensor").to_f32_vec();
        w.tensor(name, &shape, DType::F32, &data);
    }
    w
}

#[test]
fn yarn_keys_are_read_or_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    TestModel::tiny("llama")
        .write_gguf(&path, DType::F32)
        .expect("write");
    let m = GgufModel::open(&path).expect("open");
    let yarn = |w: &mut GgufWriter| {
        w.string("llama.rope.scaling.type", "yarn");
        w.f32("llama.rope.scaling.factor", 4.0);
        w.u32("llama.rope.scaling.original_context_length", 32);
        w.f32("llama.rope.scaling.yarn_beta_fast", 16.0);
    };
    let file = write(dir.path(), "yarn.gguf", &rebuilt(&m, yarn, None));
    let c = Model::load(&file, 64).expect("load").config;
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32.0,
            beta_fast: 16.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
            truncate: true,
        }
    );
    assert_eq!(c.max_position_embeddings, 128);
    let deepseek = |w: &mut GgufWriter| {
        yarn(w);
        w.f32("llama.rope.scaling.yarn_log_multiplier", 0.1);
    };
    let file = write(dir.path(), "deepseek.gguf", &rebuilt(&m, deepseek, None));
    assert_eq!(
        load_err(&file),
        format!(
            "{}: llama.rope.scaling.yarn_log_multiplier: not supported",
            file.display()
        )
    );
    let no_factor = |w: &mut GgufWriter| w.string("llama.rope.scaling.type", "yarn");
    let file = write(dir.path(), "bare.gguf", &rebuilt(&m, no_factor, None));
    assert_eq!(
        load_err(&file),
        format!("{}: llama.rope.scaling.factor: missing", file.display())
    );
}

#[test]
fn split_files_load_as_one_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = TestModel::tiny("qwen3");
    let whole = dir.path().join("whole.gguf");
    t.write_gguf(&whole, DType::F32).expect("write");
    let m = GgufModel::open(&whole).expect("open");
    let names: Vec<String> = m.tensor_names().cloned().collect();
    let (a, b) = names.split_at(names.len() / 2);
    let meta = std::fs::read(&whole).expect("read");
    let _ = meta;
    let part = |i: u32, tensors: &[String], with_model_meta: bool| {
        let mut w = GgufWriter::default();
        if with_model_meta {
            w.string("general.architecture", "qwen3");
            for (k, v) in m.metadata.values.iter() {
                if let (Some(rest), Some(n)) = (k.strip_prefix("qwen3."), v.as_i128()) {
                    w.u32(&format!("qwen3.{rest}"), n as u32);
                }
            }
            w.f32("qwen3.attention.layer_norm_rms_epsilon", 1e-5);
            w.raw(
                "split.tensors.count",
                5,
                &(names.len() as i32).to_le_bytes(),
            );
        }
        w.raw("split.no", 2, &(i as u16).to_le_bytes());
        w.raw("split.count", 2, &2u16.to_le_bytes());
        for name in tensors {
            let info = m.info(name).expect("info");
            let data = m.get(name, &info.shape).expect("tensor").to_f32_vec();
            w.tensor(name, &info.shape, DType::F32, &data);
        }
        w
    };
    let first = write(dir.path(), "m-00001-of-00002.gguf", &part(0, a, true));
    write(dir.path(), "m-00002-of-00002.gguf", &part(1, b, false));
    let split = Model::load(&first, 64).expect("split model");
    assert_eq!(split.config.num_layers, 2);
    // The folder holding the set loads it too (the second file is not a second model).
    std::fs::remove_file(&whole).expect("rm");
    let from_dir = Model::load(dir.path(), 64).expect("folder of a split set");
    assert_eq!(from_dir.config.hidden_size, 64);
    // A missing part names the file.
    let second = dir.path().join("m-00002-of-00002.gguf");
    std::fs::remove_file(&second).expect("rm");
    assert_eq!(
        load_err(&first),
        format!(
            "{}: cannot open: No such file or directory (os error 2)",
            second.display()
        )
    );
}

#[test]
fn folders_and_paths_are_located() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope");
    assert_eq!(
        ModelSource::locate(&missing).unwrap_err().to_string(),
        format!("{}: not found", missing.display())
    );
    assert_eq!(
        ModelSource::locate(dir.path()).unwrap_err().to_string(),
        format!(
            "{}: not a model folder: no config.json and no .gguf file",
            dir.path().display()
        )
    );
    let t = TestModel::tiny("llama");
    let a = dir.path().join("a.gguf");
    t.write_gguf(&a, DType::F32).expect("write");
    assert_eq!(
        ModelSource::locate(dir.path()).expect("one gguf"),
        ModelSource::Gguf(a.clone())
    );
    t.write_gguf(&dir.path().join("b.gguf"), DType::F32)
        .expect("write");
    assert_eq!(
        ModelSource::locate(dir.path()).unwrap_err().to_string(),
        format!(
            "{}: several GGUF models (2): name the file to load, e.g. {}",
            dir.path().display(),
            a.display()
        )
    );
    assert!(is_later_split_file(Path::new("x-00002-of-00003.gguf")));
    assert!(!is_later_split_file(Path::new("x-00001-of-00003.gguf")));
    assert!(!is_later_split_file(Path::new("x.gguf")));
}

use crate::model::ModelSource;
