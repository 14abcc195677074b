//! Random-weight model folders written from Rust, for `cargo test` and the criterion benches
//! (the Python `strata-rs make-model` is the full generator, with a tokenizer).

use std::io::Write;
use std::path::Path;

use half::{bf16, f16};
use serde_json::json;

use crate::model::weights::DType;

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
        let mut rng = self.seed.max(1);
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
                    .map(|_| center + 0.0866 * (uniform(&mut rng) * 2.0 - 1.0))
                    .collect();
                (name, shape, data)
            })
            .collect();
        write_safetensors(&dir.join("model.safetensors"), &tensors, self.dtype)
    }
}

fn uniform(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 40) as f32 / (1u64 << 24) as f32
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
            }
        }
    }
    f.flush()
}
