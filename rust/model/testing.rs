//! Random-weight model folders written from Rust, for `cargo test` and the criterion benches
//! (the Python `strata-rs make-model` is the full generator, with a tokenizer).

use std::io::Write;
use std::path::Path;

use half::{bf16, f16};
use serde_json::json;

use crate::model::weights::DType;
use crate::rng::Rng;

/// The shape of a Llama-family model to write.
#[derive(Clone, Debug)]
pub struct TestModel {
    pub model_type: &'static str,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub max_positions: usize,
    pub tied: bool,
    pub dtype: DType,
    pub seed: u64,
}

impl TestModel {
    pub fn tiny(model_type: &'static str) -> TestModel {
        TestModel {
            model_type,
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 256,
            max_positions: 512,
            tied: false,
            dtype: DType::F32,
            seed: 1,
        }
    }

    /// SmolLM2-135M's shape: the project's standard benchmark model.
    pub fn smollm_135m(dtype: DType) -> TestModel {
        TestModel {
            model_type: "llama",
            hidden: 576,
            intermediate: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            max_positions: 8192,
            tied: true,
            dtype,
            seed: 1,
        }
    }

    /// Every tensor as (name, shape, is_vector).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, q, kv, i) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        );
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h]));
            t.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            if self.model_type == "qwen2" {
                t.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
                t.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
                t.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
            }
            if self.model_type == "qwen3" {
                t.push((format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]));
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]));
            }
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tied {
            t.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        }
        t
    }

    pub fn config_json(&self) -> serde_json::Value {
        json!({
            "model_type": self.model_type,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": self.tied,
        })
    }

    /// Writes config.json and model.safetensors into `dir`.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("config.json"), self.config_json().to_string())?;
        write_safetensors(&dir.join("model.safetensors"), &self.weights(), self.dtype)
    }

    /// The same weights as [`TestModel::write`], as a GGUF file the way llama.cpp's converter
    /// writes it (GGUF names, llama q/k rows in adjacent-pair order), matrices in `dtype`
    /// (quantized with strata's own quantizer), vectors in F32. No tokenizer metadata.
    pub fn write_gguf(&self, path: &Path, dtype: DType) -> std::io::Result<()> {
        let arch = match self.model_type {
            "mistral" => "llama",
            other => other,
        };
        let mut w = GgufWriter::default();
        w.string("general.architecture", arch);
        let k = |key: &str| format!("{arch}.{key}");
        w.u32(&k("context_length"), self.max_positions as u32);
        w.u32(&k("embedding_length"), self.hidden as u32);
        w.u32(&k("block_count"), self.layers as u32);
        w.u32(&k("feed_forward_length"), self.intermediate as u32);
        w.u32(&k("attention.head_count"), self.heads as u32);
        w.u32(&k("attention.head_count_kv"), self.kv_heads as u32);
        w.u32(&k("attention.key_length"), self.head_dim as u32);
        w.u32(&k("attention.value_length"), self.head_dim as u32);
        w.f32(&k("attention.layer_norm_rms_epsilon"), 1e-5);
        w.f32(&k("rope.freq_base"), 10000.0);
        for (name, shape, mut data) in self.weights() {
            if arch == "llama" && (name.contains("q_proj.weight") || name.contains("k_proj.weight"))
            {
                data = to_adjacent_pairs(&data, self.head_dim, shape[1]);
            }
            let gguf_name = gguf_name(&name);
            let ty = if shape.len() == 2 { dtype } else { DType::F32 };
            w.tensor(&gguf_name, &shape, ty, &data);
        }
        w.write(path)
    }

    /// Every tensor with its random values (the same for a given seed).
    pub fn weights(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut rng = Rng(self.seed.max(1));
        let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = self
            .tensors()
            .into_iter()
            .map(|(name, shape)| {
                let n: usize = shape.iter().product();
                // Norm weights around 1, everything else around 0 (std 0.05), as trained models.
                let center = if shape.len() == 1 && name.ends_with("norm.weight") {
                    1.0
                } else {
                    0.0
                };
                let data = (0..n)
                    .map(|_| center + 0.0866 * (rng.unit() * 2.0 - 1.0))
                    .collect();
                (name, shape, data)
            })
            .collect();
        tensors
    }
}

/// The GGUF name llama.cpp's converter gives a Hugging Face tensor name.
fn gguf_name(hf: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let parts = [
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    let rest = hf.strip_prefix("model.layers.").unwrap_or(hf);
    let (layer, tail) = rest.split_once('.').unwrap_or(("0", rest));
    let tail = parts
        .iter()
        .find_map(|(h, g)| tail.strip_prefix(h).map(|t| format!("{g}{t}")))
        .unwrap_or_else(|| tail.to_string());
    format!("blk.{layer}.{tail}")
}

/// Rows of each head reordered from rotate-half order (i, i + d/2) to adjacent pairs (2i, 2i+1),
/// as llama.cpp's converter stores llama q and k.
pub fn to_adjacent_pairs(data: &[f32], head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; data.len()];
    let rows = data.len() / cols;
    for r in 0..rows {
        let (head, i) = (r / head_dim, r % head_dim);
        let dst = head * head_dim + if i < half { 2 * i } else { 2 * (i - half) + 1 };
        out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[r * cols..(r + 1) * cols]);
    }
    out
}

/// A GGUF writer for tests: metadata, then tensors (shape outermost first, as strata-rs names
/// shapes; written innermost first, as GGUF stores them), data aligned to 32 bytes.
#[derive(Default)]
pub struct GgufWriter {
    /// Each metadata entry as its encoded bytes (key, type, value).
    pub metadata: Vec<Vec<u8>>,
    /// (name, shape, ggml type id, bytes).
    pub tensors: Vec<(String, Vec<usize>, u32, Vec<u8>)>,
}

fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl GgufWriter {
    /// A metadata entry of `ty` with `value` already encoded.
    pub fn raw(&mut self, key: &str, ty: u32, value: &[u8]) {
        let mut e = Vec::new();
        gguf_string(&mut e, key);
        e.extend_from_slice(&ty.to_le_bytes());
        e.extend_from_slice(value);
        self.metadata.push(e);
    }
    pub fn u32(&mut self, key: &str, v: u32) {
        self.raw(key, 4, &v.to_le_bytes());
    }
    pub fn f32(&mut self, key: &str, v: f32) {
        self.raw(key, 6, &v.to_le_bytes());
    }
    pub fn bool(&mut self, key: &str, v: bool) {
        self.raw(key, 7, &[v as u8]);
    }
    pub fn string(&mut self, key: &str, v: &str) {
        let mut b = Vec::new();
        gguf_string(&mut b, v);
        self.raw(key, 8, &b);
    }
    pub fn strings(&mut self, key: &str, items: &[&str]) {
        let mut b = 8u32.to_le_bytes().to_vec();
        b.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for s in items {
            gguf_string(&mut b, s);
        }
        self.raw(key, 9, &b);
    }

    /// A tensor of `data` stored as `dtype`.
    pub fn tensor(&mut self, name: &str, shape: &[usize], dtype: DType, data: &[f32]) {
        let (id, bytes): (u32, Vec<u8>) = match dtype {
            DType::F32 => (0, data.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::F16 => (
                1,
                data.iter()
                    .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                    .collect(),
            ),
            DType::Bf16 => (
                30,
                data.iter()
                    .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                    .collect(),
            ),
            DType::Quant(q) => {
                let cols = *shape.last().unwrap_or(&1);
                let row_bytes = q.row_bytes(cols).unwrap_or(0);
                let mut bytes = vec![0u8; data.len() / cols.max(1) * row_bytes];
                for (src, dst) in data.chunks(cols).zip(bytes.chunks_mut(row_bytes.max(1))) {
                    crate::model::kernels::cpu::quant::quantize_row(q, src, dst);
                }
                (q.ggml_id(), bytes)
            }
        };
        self.tensors
            .push((name.to_string(), shape.to_vec(), id, bytes));
    }

    /// The file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for e in &self.metadata {
            out.extend_from_slice(e);
        }
        let mut offset = 0u64;
        for (name, shape, id, bytes) in &self.tensors {
            gguf_string(&mut out, name);
            out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
            for d in shape.iter().rev() {
                out.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += (bytes.len() as u64).div_ceil(32) * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        for (_, _, _, bytes) in &self.tensors {
            out.extend_from_slice(bytes);
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
        }
        out
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.bytes())
    }
}

/// A minimal safetensors writer: header JSON padded to 8 bytes, then the data in order.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: DType,
) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, shape, data) in tensors {
        let len = data.len() * dtype.size();
        let dt = match dtype {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::Quant(q) => {
                return Err(std::io::Error::other(format!(
                    "safetensors holds element types, not {}",
                    q.name()
                )))
            }
        };
        header.insert(
            name.clone(),
            json!({"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    for (_, _, data) in tensors {
        for &x in data {
            match dtype {
                DType::F32 => f.write_all(&x.to_le_bytes())?,
                DType::F16 => f.write_all(&f16::from_f32(x).to_le_bytes())?,
                DType::Bf16 => f.write_all(&bf16::from_f32(x).to_le_bytes())?,
                DType::Quant(_) => unreachable!("refused above"),
            }
        }
    }
    f.flush()
}
