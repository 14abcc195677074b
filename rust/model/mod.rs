//! A Llama-family model: config, weights (views into the memory-mapped files) and the forward pass.

pub mod chat_template;
pub mod config;
pub mod forward;
pub mod gguf;
pub mod kernels;
pub mod testing;
pub mod tokenizer;
pub mod weights;

use std::path::Path;

use crate::error::{Result, StrataError};
use config::ModelConfig;
use kernels::cpu::rope::RopeTable;
use weights::{DType, SafetensorsFiles, Tensor};

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub mlp_norm: Vec<f32>,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

impl LayerWeights {
    /// The layer's weight matrices, in the order the forward pass reads them.
    pub fn matrices(&self) -> [&Tensor; 7] {
        [
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }
}

pub struct Model {
    pub config: ModelConfig,
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// The embedding matrix itself when the model ties them.
    pub lm_head: Tensor,
    pub rope: RopeTable,
    /// dtype of the weight matrices (all matrices of one model share it).
    pub dtype: DType,
    /// Bytes of weight matrices read by one decode step (every matrix once, the embedding row aside).
    pub decode_weight_bytes: usize,
}

impl Model {
    /// Loads config.json and the safetensors weights of `dir`. `max_positions` bounds the RoPE table.
    pub fn load(dir: &Path, max_positions: usize) -> Result<Model> {
        let config = ModelConfig::load(dir)?;
        let files = SafetensorsFiles::open(dir)?;
        let c = &config;
        let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);

        let vector =
            |name: &str, n: usize| -> Result<Vec<f32>> { Ok(files.get(name, &[n])?.to_f32_vec()) };
        let optional = |present: bool, name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            if present {
                vector(name, n).map(Some)
            } else {
                Ok(None)
            }
        };

        let embed = files.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            // Old Llama checkpoints carry the rotary inv_freq buffer; it is recomputed, not read.
            files.ignore(&format!("{p}.self_attn.rotary_emb.inv_freq"));
            layers.push(LayerWeights {
                attn_norm: vector(&format!("{p}.input_layernorm.weight"), h)?,
                q_proj: files.get(&format!("{p}.self_attn.q_proj.weight"), &[q, h])?,
                k_proj: files.get(&format!("{p}.self_attn.k_proj.weight"), &[kv, h])?,
                v_proj: files.get(&format!("{p}.self_attn.v_proj.weight"), &[kv, h])?,
                o_proj: files.get(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?,
                q_bias: optional(c.qkv_bias, &format!("{p}.self_attn.q_proj.bias"), q)?,
                k_bias: optional(c.qkv_bias, &format!("{p}.self_attn.k_proj.bias"), kv)?,
                v_bias: optional(c.qkv_bias, &format!("{p}.self_attn.v_proj.bias"), kv)?,
                o_bias: optional(c.o_bias, &format!("{p}.self_attn.o_proj.bias"), h)?,
                q_norm: optional(
                    c.qk_norm,
                    &format!("{p}.self_attn.q_norm.weight"),
                    c.head_dim,
                )?,
                k_norm: optional(
                    c.qk_norm,
                    &format!("{p}.self_attn.k_norm.weight"),
                    c.head_dim,
                )?,
                mlp_norm: vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                gate_proj: files.get(&format!("{p}.mlp.gate_proj.weight"), &[inter, h])?,
                up_proj: files.get(&format!("{p}.mlp.up_proj.weight"), &[inter, h])?,
                down_proj: files.get(&format!("{p}.mlp.down_proj.weight"), &[h, inter])?,
            });
        }
        let norm = vector("model.norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings {
            // Some tied checkpoints still store the head; transformers ignores it and so do we.
            files.ignore("lm_head.weight");
            embed.clone()
        } else {
            files.get("lm_head.weight", &[c.vocab_size, h])?
        };
        files.check_all_used()?;

        let dtype = embed.dtype;
        let mut decode_weight_bytes = lm_head.byte_len();
        for l in &layers {
            for t in l.matrices() {
                if t.dtype != dtype {
                    return Err(StrataError::model_load(
                        files.path_of("model.embed_tokens.weight").unwrap_or(dir),
                        format!(
                            "weight matrices mix dtypes ({} and {}); one dtype per model is supported",
                            dtype.name(),
                            t.dtype.name()
                        ),
                    ));
                }
                decode_weight_bytes += t.byte_len();
            }
        }
        let rope = rope_table(c, max_positions)?;
        Ok(Model {
            config,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            dtype,
            decode_weight_bytes,
        })
    }

    /// Bytes of the tensors as loaded, for the device's memory accounting: the matrices (and the
    /// embedding) at their size in the file, since they are views into the memory-mapped
    /// safetensors files (file-backed pages; an unaligned one is an owned copy of the same size),
    /// plus the 1-D tensors (norms, biases) as the owned f32 copies made at load. A tied head is
    /// the embedding itself and counts once. The RoPE table is not a tensor of the file: it is
    /// the workspace's (see `ModelRunner::new`).
    pub fn weight_bytes(&self) -> usize {
        self.stage_weight_bytes(0..self.layers.len(), true, true)
    }

    /// Bytes of the tensors one device of a layer split holds: its `layers`, the embedding on
    /// the `first` device, the final norm and the head on the `last`. A tied head counts once
    /// when one device holds both ends; split, the last device holds its own copy.
    pub fn stage_weight_bytes(
        &self,
        layers: std::ops::Range<usize>,
        first: bool,
        last: bool,
    ) -> usize {
        let vector = |v: &Vec<f32>| v.len() * std::mem::size_of::<f32>();
        let optional = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, vector);
        let mut bytes = 0;
        if first {
            bytes += self.embed.byte_len();
        }
        if last {
            bytes += vector(&self.norm);
            if !(self.config.tie_word_embeddings && first) {
                bytes += self.lm_head.byte_len();
            }
        }
        for l in &self.layers[layers] {
            bytes += l.matrices().iter().map(|t| t.byte_len()).sum::<usize>();
            bytes += vector(&l.attn_norm) + vector(&l.mlp_norm);
            bytes += [
                &l.q_bias, &l.k_bias, &l.v_bias, &l.o_bias, &l.q_norm, &l.k_norm,
            ]
            .iter()
            .map(|v| optional(v))
            .sum::<usize>();
        }
        bytes
    }

    /// Rebuilds the RoPE table for `max_positions` (the engine sizes it once the K/V pool has
    /// bounded the context).
    pub fn set_max_positions(&mut self, max_positions: usize) -> Result<()> {
        self.rope = rope_table(&self.config, max_positions)?;
        Ok(())
    }
}

fn rope_table(c: &ModelConfig, max_positions: usize) -> Result<RopeTable> {
    RopeTable::try_new(c.head_dim, c.rope_theta, &c.rope_scaling, max_positions).ok_or_else(|| {
        StrataError::invalid(
            "max_context",
            format!("cannot allocate the rotary position table for {max_positions} positions"),
        )
    })
}
