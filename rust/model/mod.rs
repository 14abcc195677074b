//! A Llama-family model: config, weights (views into the memory-mapped files) and the forward pass.

pub mod chat_template;
pub mod config;
pub mod forward;
pub mod gguf;
pub mod huge_pages;
pub mod kernels;
pub mod testing;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};

use crate::error::{Result, StrataError};
use config::{Family, ModelConfig};
use kernels::cpu::quant::QuantType;
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
    /// Gemma: the norm of the attention's output, before the residual add.
    pub post_attn_norm: Option<Vec<f32>>,
    pub mlp_norm: Vec<f32>,
    /// Gemma: the norm of the MLP's output, before the residual add.
    pub post_mlp_norm: Option<Vec<f32>>,
    pub mlp: Mlp,
}

/// A layer's MLP: one, or experts of which each token uses a few.
pub enum Mlp {
    Dense(MlpWeights),
    Experts(ExpertWeights),
}

/// A gated MLP: down(act(gate(x)) * up(x)).
pub struct MlpWeights {
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

/// A mixture-of-experts MLP: the router's `[num_experts, hidden]` matrix and each expert's MLP.
pub struct ExpertWeights {
    pub router: Tensor,
    pub experts: Vec<MlpWeights>,
}

impl MlpWeights {
    fn bytes(&self) -> usize {
        self.gate_proj.byte_len() + self.up_proj.byte_len() + self.down_proj.byte_len()
    }
}

impl LayerWeights {
    /// The layer's weight matrices, in the order the forward pass reads them (the experts in
    /// their order; a step reads only the routed ones).
    pub fn matrices(&self) -> Vec<&Tensor> {
        let mut m = vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj];
        match &self.mlp {
            Mlp::Dense(d) => m.extend([&d.gate_proj, &d.up_proj, &d.down_proj]),
            Mlp::Experts(e) => {
                m.push(&e.router);
                for x in &e.experts {
                    m.extend([&x.gate_proj, &x.up_proj, &x.down_proj]);
                }
            }
        }
        m
    }

    fn matrices_mut(&mut self) -> Vec<&mut Tensor> {
        let mut m = vec![
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
        ];
        match &mut self.mlp {
            Mlp::Dense(d) => m.extend([&mut d.gate_proj, &mut d.up_proj, &mut d.down_proj]),
            // The router stays as stored: its few rows are read by every token.
            Mlp::Experts(e) => {
                for x in &mut e.experts {
                    m.extend([&mut x.gate_proj, &mut x.up_proj, &mut x.down_proj]);
                }
            }
        }
        m
    }

    /// The dense MLP, if the layer has one.
    pub fn dense_mlp(&self) -> Option<&MlpWeights> {
        match &self.mlp {
            Mlp::Dense(d) => Some(d),
            Mlp::Experts(_) => None,
        }
    }
}

/// Block types a Hugging Face folder can be quantized to at load (`quantize=`).
pub const QUANTIZE_TYPES: [QuantType; 3] = [QuantType::Q8_0, QuantType::Q4_K, QuantType::Q6_K];

/// Parses the `quantize` option: "q8_0", "q4_k" or "q6_k".
pub fn parse_quantize(name: &str) -> Result<QuantType> {
    QUANTIZE_TYPES
        .into_iter()
        .find(|t| t.lower_name() == name)
        .ok_or_else(|| {
            StrataError::invalid(
                "quantize",
                format!("must be \"q8_0\", \"q4_k\" or \"q6_k\", got {name:?}"),
            )
        })
}

pub struct Model {
    pub config: ModelConfig,
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// The embedding matrix itself when the model ties them.
    pub lm_head: Tensor,
    pub rope: RopeTable,
    /// The sliding layers' own table (`config.local_rope`).
    pub local_rope: Option<RopeTable>,
    /// dtype of the weight matrices: the one of all of them (a Hugging Face folder), or the one
    /// holding the most bytes (a GGUF file may mix block formats).
    pub dtype: DType,
    /// Bytes of weight matrices read by one decode step (every matrix once, the embedding row aside).
    pub decode_weight_bytes: usize,
    /// bf16 matrices take the CPU's bf16 dot products, their input rows rounded to bf16
    /// (`bf16_dot=True`, where the CPU has them: `kernels::cpu::matmul_bf16dot`).
    pub bf16_dot: bool,
}

/// Where a model's files are: a Hugging Face folder (config.json, safetensors, tokenizer.json)
/// or a GGUF file (the first of its split set).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Folder(PathBuf),
    Gguf(PathBuf),
}

impl ModelSource {
    /// What `path` names: a `.gguf` file; a folder with config.json; or a folder holding one
    /// GGUF model (one file, or one split set).
    pub fn locate(path: &Path) -> Result<ModelSource> {
        if path.is_file() {
            return Ok(ModelSource::Gguf(path.to_path_buf()));
        }
        if !path.is_dir() {
            return Err(StrataError::model_load(path, "not found"));
        }
        if path.join("config.json").is_file() {
            return Ok(ModelSource::Folder(path.to_path_buf()));
        }
        let entries = std::fs::read_dir(path)
            .map_err(|e| StrataError::model_load(path, format!("cannot list: {e}")))?;
        let mut ggufs: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
            .filter(|p| !gguf::is_later_split_file(p))
            .collect();
        ggufs.sort();
        match ggufs.len() {
            1 => Ok(ModelSource::Gguf(ggufs.remove(0))),
            0 => Err(StrataError::model_load(
                path,
                "not a model folder: no config.json and no .gguf file",
            )),
            n => Err(StrataError::model_load(
                path,
                format!(
                    "several GGUF models ({n}): name the file to load, e.g. {}",
                    ggufs[0].display()
                ),
            )),
        }
    }

    /// The folder, or the (first) GGUF file.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Folder(p) | ModelSource::Gguf(p) => p,
        }
    }

    /// The files holding the weights: the folder's safetensors, or the GGUF file and the rest of
    /// its split set, sorted (for the cache's fingerprint of the model).
    pub fn weight_files(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = match self {
            ModelSource::Folder(dir) => std::fs::read_dir(dir)
                .map(|entries| {
                    entries
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                        .collect()
                })
                .unwrap_or_default(),
            ModelSource::Gguf(path) => gguf::split_set(path),
        };
        files.sort();
        files
    }

    /// "hf" or "gguf" (`engine.info["format"]`).
    pub fn format(&self) -> &'static str {
        match self {
            ModelSource::Folder(_) => "hf",
            ModelSource::Gguf(_) => "gguf",
        }
    }
}

/// The tensors of a model, whichever file format holds them.
trait TensorFiles {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
    fn ignore(&self, name: &str);
    fn check_all_used(&self) -> Result<()>;
}

impl TensorFiles for SafetensorsFiles {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        SafetensorsFiles::get(self, name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        SafetensorsFiles::contains(self, name)
    }
    fn ignore(&self, name: &str) {
        SafetensorsFiles::ignore(self, name)
    }
    fn check_all_used(&self) -> Result<()> {
        SafetensorsFiles::check_all_used(self)
    }
}

impl TensorFiles for gguf::GgufModel {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        gguf::GgufModel::get(self, name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        gguf::GgufModel::contains(self, name)
    }
    fn ignore(&self, name: &str) {
        gguf::GgufModel::ignore(self, name)
    }
    fn check_all_used(&self) -> Result<()> {
        gguf::GgufModel::check_all_used(self)
    }
}

/// Tensor names: Hugging Face's, or the GGUF ones llama.cpp's converter writes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Names {
    Hf,
    /// The text model of a vision-language checkpoint (Gemma 3's `gemma3` folders), under
    /// `language_model.model.` (transformers 4) or `model.language_model.` (5).
    HfLanguageModel(LanguageModelPrefix),
    Gguf,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LanguageModelPrefix {
    V4,
    V5,
}

impl LanguageModelPrefix {
    /// The prefix of a vision-language folder's text model, if `files` hold one.
    fn of(files: &SafetensorsFiles) -> Option<LanguageModelPrefix> {
        [LanguageModelPrefix::V4, LanguageModelPrefix::V5]
            .into_iter()
            .find(|p| files.contains(&format!("{}embed_tokens.weight", p.model())))
    }

    /// What stands for `model.` in the text model's names.
    fn model(self) -> &'static str {
        match self {
            LanguageModelPrefix::V4 => "language_model.model.",
            LanguageModelPrefix::V5 => "model.language_model.",
        }
    }
}

/// A layer's tensors: the Hugging Face name after `model.layers.N.`, the GGUF one after `blk.N.`.
const LAYER_NAMES: [(&str, &str); 19] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    // Phi-3's fused gate and up: llama.cpp keeps it whole as ffn_up, gate rows first.
    ("mlp.gate_up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

impl Names {
    fn is_hf(self) -> bool {
        !matches!(self, Names::Gguf)
    }
    fn embed(self) -> &'static str {
        match self {
            Names::Hf => "model.embed_tokens.weight",
            Names::HfLanguageModel(LanguageModelPrefix::V4) => {
                "language_model.model.embed_tokens.weight"
            }
            Names::HfLanguageModel(LanguageModelPrefix::V5) => {
                "model.language_model.embed_tokens.weight"
            }
            Names::Gguf => "token_embd.weight",
        }
    }
    fn norm(self) -> &'static str {
        match self {
            Names::Hf => "model.norm.weight",
            Names::HfLanguageModel(LanguageModelPrefix::V4) => "language_model.model.norm.weight",
            Names::HfLanguageModel(LanguageModelPrefix::V5) => "model.language_model.norm.weight",
            Names::Gguf => "output_norm.weight",
        }
    }
    fn lm_head(self) -> &'static str {
        match self {
            Names::Hf | Names::HfLanguageModel(LanguageModelPrefix::V5) => "lm_head.weight",
            Names::HfLanguageModel(LanguageModelPrefix::V4) => "language_model.lm_head.weight",
            Names::Gguf => "output.weight",
        }
    }
    /// Layer `i`'s tensor `hf` (its Hugging Face name after `model.layers.N.`) in `family`.
    fn layer(self, family: Family, i: usize, hf: &str) -> String {
        match self {
            Names::Hf => format!("model.layers.{i}.{hf}"),
            Names::HfLanguageModel(p) => format!("{}layers.{i}.{hf}", p.model()),
            // Gemma's `post_attention_layernorm` is the attention output's norm, not the
            // pre-MLP norm that Llama's is.
            Names::Gguf if family == Family::Gemma3 && hf == "post_attention_layernorm.weight" => {
                format!("blk.{i}.post_attention_norm.weight")
            }
            Names::Gguf => {
                let gguf = LAYER_NAMES
                    .iter()
                    .find(|(h, _)| *h == hf)
                    .map_or(hf, |(_, g)| *g);
                format!("blk.{i}.{gguf}")
            }
        }
    }
}

impl Model {
    /// Loads the model at `path` (see [`ModelSource::locate`]). `max_positions` bounds the RoPE
    /// table.
    pub fn load(path: &Path, max_positions: usize) -> Result<Model> {
        Self::load_source(&ModelSource::locate(path)?, max_positions)
    }

    pub fn load_source(source: &ModelSource, max_positions: usize) -> Result<Model> {
        match source {
            ModelSource::Folder(dir) => {
                let config = ModelConfig::load(dir)?;
                let files = SafetensorsFiles::open(dir)?;
                let names = match LanguageModelPrefix::of(&files) {
                    // A vision-language checkpoint: the text model runs alone, the vision
                    // tower and the projector stay unread in the map.
                    Some(prefix) if config.family == Family::Gemma3 => {
                        let names = Names::HfLanguageModel(prefix);
                        let unread: Vec<String> = files
                            .names()
                            .filter(|n| {
                                !n.starts_with(prefix.model()) && n.as_str() != names.lm_head()
                            })
                            .filter(|n| {
                                ["vision_tower.", "multi_modal_projector."]
                                    .iter()
                                    .any(|v| n.contains(v))
                            })
                            .cloned()
                            .collect();
                        unread.iter().for_each(|n| files.ignore(n));
                        names
                    }
                    _ => Names::Hf,
                };
                Self::assemble(config, &files, names, max_positions, dir)
            }
            ModelSource::Gguf(path) => {
                let file = gguf::GgufModel::open(path)?;
                Self::from_gguf(&file, max_positions)
            }
        }
    }

    /// The model a GGUF file describes: config from its metadata, tensors in their stored types.
    pub fn from_gguf(file: &gguf::GgufModel, max_positions: usize) -> Result<Model> {
        let meta = &file.metadata;
        let vocab = match meta.get("tokenizer.ggml.tokens") {
            Some(gguf::Value::Array(a)) => a.len(),
            _ => file
                .info(Names::Gguf.embed())
                .map_or(0, |i| i.shape.first().copied().unwrap_or(0)),
        };
        let factors = |name: &str| -> Result<Option<Vec<f64>>> {
            match file.info(name) {
                Some(info) => {
                    let t = file.get(name, &info.shape.clone())?;
                    Ok(Some(t.to_f32_vec().into_iter().map(f64::from).collect()))
                }
                None => Ok(None),
            }
        };
        let factors = gguf::config::RopeFactorTensors {
            freqs: factors("rope_freqs.weight")?,
            long: factors("rope_factors_long.weight")?,
            short: factors("rope_factors_short.weight")?,
        };
        let tied = !file.contains(Names::Gguf.lm_head());
        let mut config = gguf::config::model_config(meta, vocab, tied, factors)?;
        // Biases are where the file has them (qwen2 always; some llama fine-tunes).
        config.qkv_bias = file.contains("blk.0.attn_q.bias");
        config.o_bias = file.contains("blk.0.attn_output.bias");
        // Layers with a router hold experts; the others a dense MLP.
        if let Some(moe) = &mut config.moe {
            for (l, sparse) in moe.sparse_layers.iter_mut().enumerate() {
                *sparse = file.contains(&format!("blk.{l}.ffn_gate_inp.weight"));
            }
        }
        Self::assemble(config, file, Names::Gguf, max_positions, meta.path())
    }

    fn assemble(
        config: ModelConfig,
        files: &impl TensorFiles,
        names: Names,
        max_positions: usize,
        path: &Path,
    ) -> Result<Model> {
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
        // Gemma's RMSNorm scales by (1 + w): Hugging Face stores w, llama.cpp's converter
        // stores 1 + w. Adding the 1 at load (in f32, as transformers does) leaves one norm.
        let norm_offset = if c.family == Family::Gemma3 && names.is_hf() {
            1.0
        } else {
            0.0
        };
        let shifted = |mut v: Vec<f32>| {
            v.iter_mut().for_each(|w| *w += norm_offset);
            v
        };
        let norm = |name: &str, n: usize| vector(name, n).map(shifted);
        let optional_norm = |present: bool, name: &str, n: usize| {
            optional(present, name, n).map(|v| v.map(shifted))
        };
        let gemma = c.family == Family::Gemma3;
        let mlp_norm_name = if gemma {
            "pre_feedforward_layernorm.weight"
        } else {
            "post_attention_layernorm.weight"
        };

        let embed = files.get(names.embed(), &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = |hf: &str| names.layer(c.family, i, hf);
            // Old Llama checkpoints carry the rotary inv_freq buffer; it is recomputed, not read.
            files.ignore(&p("self_attn.rotary_emb.inv_freq"));
            // Phi-3 fuses q, k and v into one matrix, and gate and up into another (a GGUF file
            // may also hold them apart): each part is a view of its rows.
            let fused_qkv =
                c.family == Family::Phi3 && files.contains(&p("self_attn.qkv_proj.weight"));
            let [q_proj, k_proj, v_proj] = if fused_qkv {
                let parts = files
                    .get(&p("self_attn.qkv_proj.weight"), &[q + 2 * kv, h])?
                    .split_rows(&[q, kv, kv]);
                parts.try_into().map_err(|_| {
                    StrataError::model_load(path, "qkv_proj: split into three parts failed")
                })?
            } else {
                [
                    files.get(&p("self_attn.q_proj.weight"), &[q, h])?,
                    files.get(&p("self_attn.k_proj.weight"), &[kv, h])?,
                    files.get(&p("self_attn.v_proj.weight"), &[kv, h])?,
                ]
            };
            let dense_mlp = || -> Result<MlpWeights> {
                let [gate_proj, up_proj] = if c.family == Family::Phi3 {
                    let parts = files
                        .get(&p("mlp.gate_up_proj.weight"), &[2 * inter, h])?
                        .split_rows(&[inter, inter]);
                    parts.try_into().map_err(|_| {
                        StrataError::model_load(path, "gate_up_proj: split into two parts failed")
                    })?
                } else {
                    [
                        files.get(&p("mlp.gate_proj.weight"), &[inter, h])?,
                        files.get(&p("mlp.up_proj.weight"), &[inter, h])?,
                    ]
                };
                Ok(MlpWeights {
                    gate_proj,
                    up_proj,
                    down_proj: files.get(&p("mlp.down_proj.weight"), &[h, inter])?,
                })
            };
            layers.push(LayerWeights {
                attn_norm: norm(&p("input_layernorm.weight"), h)?,
                q_proj,
                k_proj,
                v_proj,
                o_proj: files.get(&p("self_attn.o_proj.weight"), &[h, q])?,
                q_bias: optional(c.qkv_bias, &p("self_attn.q_proj.bias"), q)?,
                k_bias: optional(c.qkv_bias, &p("self_attn.k_proj.bias"), kv)?,
                v_bias: optional(c.qkv_bias, &p("self_attn.v_proj.bias"), kv)?,
                o_bias: optional(c.o_bias, &p("self_attn.o_proj.bias"), h)?,
                q_norm: optional_norm(c.qk_norm, &p("self_attn.q_norm.weight"), c.head_dim)?,
                k_norm: optional_norm(c.qk_norm, &p("self_attn.k_norm.weight"), c.head_dim)?,
                post_attn_norm: optional_norm(
                    c.post_norms,
                    &p("post_attention_layernorm.weight"),
                    h,
                )?,
                mlp_norm: norm(&p(mlp_norm_name), h)?,
                post_mlp_norm: optional_norm(
                    c.post_norms,
                    &p("post_feedforward_layernorm.weight"),
                    h,
                )?,
                mlp: match &c.moe {
                    Some(moe) if moe.is_sparse(i) => {
                        Mlp::Experts(load_experts(files, names, c.family, i, moe, h)?)
                    }
                    _ => Mlp::Dense(dense_mlp()?),
                },
            });
        }
        let norm = norm(names.norm(), h)?;
        let lm_head = if c.tie_word_embeddings {
            // Some tied checkpoints still store the head; transformers ignores it and so do we.
            files.ignore(names.lm_head());
            embed.clone()
        } else {
            files.get(names.lm_head(), &[c.vocab_size, h])?
        };
        for read_with_the_config in [
            "rope_freqs.weight",
            "rope_factors_long.weight",
            "rope_factors_short.weight",
        ] {
            files.ignore(read_with_the_config);
        }
        files.check_all_used()?;

        if names.is_hf() {
            for t in layers.iter().flat_map(|l| l.matrices()) {
                if t.dtype != embed.dtype {
                    return Err(StrataError::model_load(
                        path,
                        format!(
                            "weight matrices mix dtypes ({} and {}); one dtype per model is supported",
                            embed.dtype.name(),
                            t.dtype.name()
                        ),
                    ));
                }
            }
        }
        let (dtype, decode_weight_bytes) = weight_summary(c, &embed, &layers, &lm_head);
        let (rope, local_rope) = rope_tables(c, max_positions)?;
        Ok(Model {
            config,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            local_rope,
            dtype,
            decode_weight_bytes,
            bf16_dot: false,
        })
    }

    /// Quantizes the weight matrices of a float model to `ty` at load (`quantize=`): every
    /// layer matrix, and the head to Q6_K (Q8_0 when `ty` is Q8_0), as llama.cpp's Q4_K_M and
    /// Q6_K files keep the head at 6 bits or more, its error reaching every logit. A matrix
    /// whose rows are not whole 256-weight blocks gets Q8_0 if they are whole 32-weight blocks
    /// and stays as it is otherwise (llama.cpp's quantizer falls back likewise). The embedding
    /// stays as stored: a step reads one row of it. Returns how many matrices fell back.
    pub fn quantize(&mut self, ty: QuantType) -> Result<usize> {
        if let DType::Quant(q) = self.dtype {
            return Err(StrataError::invalid(
                "quantize",
                format!(
                    "the model is already quantized ({}); quantize applies to float models",
                    q.lower_name()
                ),
            ));
        }
        let mut fell_back = 0;
        let mut convert = |t: &Tensor, want: QuantType| -> Tensor {
            let cols = t.shape[1];
            let fit = [want, QuantType::Q8_0]
                .into_iter()
                .find(|q| cols.is_multiple_of(q.block_elems()));
            if fit != Some(want) {
                fell_back += 1;
            }
            match fit {
                Some(q) => t.quantize(q),
                None => t.clone(),
            }
        };
        for layer in &mut self.layers {
            for m in layer.matrices_mut() {
                *m = convert(m, ty);
            }
        }
        let head = if ty == QuantType::Q8_0 {
            QuantType::Q8_0
        } else {
            QuantType::Q6_K
        };
        self.lm_head = convert(&self.lm_head, head);
        (self.dtype, self.decode_weight_bytes) =
            weight_summary(&self.config, &self.embed, &self.layers, &self.lm_head);
        Ok(fell_back)
    }

    /// Whether any matrix (or the head) is bf16: what `bf16_dot` changes.
    pub fn has_bf16_matrix(&self) -> bool {
        let bf16 = |t: &Tensor| t.dtype == DType::Bf16;
        bf16(&self.lm_head)
            || self
                .layers
                .iter()
                .any(|l| l.matrices().into_iter().any(bf16))
    }

    /// Interleaves the quantized matrices whose type this CPU's kernels read interleaved
    /// ([`kernels::cpu::quant::interleave::wanted`]): the layer matrices and the head. A tied embedding
    /// becomes the interleaved head (a lookup reads its row block by block), so the bytes stay
    /// counted once. Returns how many matrices changed.
    pub fn interleave_for_cpu(&mut self) -> usize {
        // (The map's pages the copies were read from stay page cache: clean, file-backed, the
        // first memory the OS takes back.)
        let tied = std::ptr::eq(self.lm_head.bytes().as_ptr(), self.embed.bytes().as_ptr());
        let mut changed = 0;
        for layer in &mut self.layers {
            for m in layer.matrices_mut() {
                if let Some(t) = m.interleave() {
                    *m = t;
                    changed += 1;
                }
            }
        }
        if let Some(t) = self.lm_head.interleave() {
            self.lm_head = t;
            changed += 1;
            if tied {
                self.embed = self.lm_head.clone();
            }
        }
        (self.dtype, self.decode_weight_bytes) =
            weight_summary(&self.config, &self.embed, &self.layers, &self.lm_head);
        changed
    }

    /// Bytes of the tensors as loaded, for the device's memory accounting: the matrices (and the
    /// embedding) at their size in the file, since they are views into the memory-mapped
    /// safetensors files (file-backed pages; an unaligned one is an owned copy of the same size),
    /// plus the 1-D tensors (norms, biases) as the owned f32 copies made at load, matrices
    /// quantized at load at their quantized size, and interleaved ones as their owned copies
    /// (rows padded to whole groups of 16). A tied head is the embedding itself and counts
    /// once (a tied head quantized at load is a tensor of its own). The RoPE table is not a tensor of the file: it is
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
            // A tied head is the embedding's bytes, unless it was quantized at load (its own).
            let head_is_embedding =
                std::ptr::eq(self.lm_head.bytes().as_ptr(), self.embed.bytes().as_ptr());
            if !(head_is_embedding && first) {
                bytes += self.lm_head.byte_len();
            }
        }
        for l in &self.layers[layers] {
            bytes += l.matrices().iter().map(|t| t.byte_len()).sum::<usize>();
            bytes += vector(&l.attn_norm) + vector(&l.mlp_norm);
            bytes += [
                &l.q_bias,
                &l.k_bias,
                &l.v_bias,
                &l.o_bias,
                &l.q_norm,
                &l.k_norm,
                &l.post_attn_norm,
                &l.post_mlp_norm,
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
        (self.rope, self.local_rope) = rope_tables(&self.config, max_positions)?;
        Ok(())
    }

    /// The RoPE table of `layer`.
    pub fn rope_at(&self, layer: usize) -> &RopeTable {
        match &self.local_rope {
            Some(local) if self.config.local_rope_at(layer) => local,
            _ => &self.rope,
        }
    }

    /// Bytes of the RoPE tables.
    pub fn rope_bytes(&self) -> usize {
        self.rope.bytes() + self.local_rope.as_ref().map_or(0, RopeTable::bytes)
    }
}

/// Layer `i`'s router and experts: one tensor per expert in a Hugging Face folder (Qwen3-MoE's
/// `mlp.experts.E.gate_proj`, Mixtral's `block_sparse_moe.experts.E.w1`), or the experts
/// stacked in one `[num_experts, rows, cols]` tensor per matrix in a GGUF file, each expert a
/// view of its rows.
fn load_experts(
    files: &impl TensorFiles,
    names: Names,
    family: Family,
    i: usize,
    moe: &config::MoeConfig,
    h: usize,
) -> Result<ExpertWeights> {
    let (e, inter) = (moe.num_experts, moe.expert_intermediate_size);
    if names == Names::Gguf {
        let stacked = |name: &str, rows: usize, cols: usize| -> Result<Vec<Tensor>> {
            Ok(files
                .get(&format!("blk.{i}.{name}"), &[e, rows, cols])?
                .split_outer())
        };
        let (gate, up, down) = (
            stacked("ffn_gate_exps.weight", inter, h)?,
            stacked("ffn_up_exps.weight", inter, h)?,
            stacked("ffn_down_exps.weight", h, inter)?,
        );
        let experts = gate
            .into_iter()
            .zip(up)
            .zip(down)
            .map(|((gate_proj, up_proj), down_proj)| MlpWeights {
                gate_proj,
                up_proj,
                down_proj,
            })
            .collect();
        return Ok(ExpertWeights {
            router: files.get(&format!("blk.{i}.ffn_gate_inp.weight"), &[e, h])?,
            experts,
        });
    }
    let (block, gate, up, down) = match family {
        Family::Mixtral => ("block_sparse_moe", "w1", "w3", "w2"),
        _ => ("mlp", "gate_proj", "up_proj", "down_proj"),
    };
    let p = |rest: String| names.layer(family, i, &format!("{block}.{rest}"));
    let mut experts = Vec::with_capacity(e);
    for x in 0..e {
        experts.push(MlpWeights {
            gate_proj: files.get(&p(format!("experts.{x}.{gate}.weight")), &[inter, h])?,
            up_proj: files.get(&p(format!("experts.{x}.{up}.weight")), &[inter, h])?,
            down_proj: files.get(&p(format!("experts.{x}.{down}.weight")), &[h, inter])?,
        });
    }
    Ok(ExpertWeights {
        router: files.get(&p("gate.weight".to_string()), &[e, h])?,
        experts,
    })
}

/// The model's dtype and the bytes a decode step reads of its matrices. A GGUF file mixes
/// types (Q4_K_M: Q4_K and Q6_K matrices); the model's dtype is the one that holds the most
/// bytes of the layer matrices.
/// A mixture of experts' step reads the router and the k routed experts of each layer: k / n of
/// the experts' bytes, on average.
fn weight_summary(
    c: &ModelConfig,
    embed: &Tensor,
    layers: &[LayerWeights],
    lm_head: &Tensor,
) -> (DType, usize) {
    let mut bytes_by_dtype: Vec<(DType, usize)> = Vec::new();
    let mut decode_weight_bytes = lm_head.byte_len();
    for t in layers.iter().flat_map(|l| l.matrices()) {
        match bytes_by_dtype.iter_mut().find(|(d, _)| *d == t.dtype) {
            Some((_, b)) => *b += t.byte_len(),
            None => bytes_by_dtype.push((t.dtype, t.byte_len())),
        }
        decode_weight_bytes += t.byte_len();
    }
    if let Some(moe) = &c.moe {
        for l in layers {
            if let Mlp::Experts(e) = &l.mlp {
                let experts: usize = e.experts.iter().map(|x| x.bytes()).sum();
                decode_weight_bytes -= experts - experts * moe.experts_per_token / moe.num_experts;
            }
        }
    }
    let dtype = bytes_by_dtype
        .iter()
        .max_by_key(|(_, b)| *b)
        .map_or(embed.dtype, |(d, _)| *d);
    (dtype, decode_weight_bytes)
}

/// The RoPE table of the model, and the sliding layers' own where they have one.
fn rope_tables(c: &ModelConfig, max_positions: usize) -> Result<(RopeTable, Option<RopeTable>)> {
    let table = |theta: f64, scaling| {
        RopeTable::try_new(c.rotary_dim, theta, scaling, max_positions)
            .map(|t| t.with_head_dim(c.head_dim).with_pairing(c.rope_pairing))
            .ok_or_else(|| {
                StrataError::invalid(
                    "max_context",
                    format!(
                        "cannot allocate the rotary position table for {max_positions} positions"
                    ),
                )
            })
    };
    let local = match &c.local_rope {
        Some(l) => Some(table(l.theta, &l.scaling)?),
        None => None,
    };
    Ok((table(c.rope_theta, &c.rope_scaling)?, local))
}
