//! config.json -> ModelConfig, for the Llama family (llama, mistral, qwen2, qwen3), Gemma 3,
//! Phi-3 (and Phi-4-mini, which is a phi3) and the mixture-of-experts families Qwen3-MoE and
//! Mixtral.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Result, StrataError};
use crate::model::kernels::cpu::rope::{yarn_mscale, RopePairing, RopeScaling};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen3's attention with mixture-of-experts MLPs.
    Qwen3Moe,
    /// Mistral's attention with mixture-of-experts MLPs.
    Mixtral,
    /// Phi-3 and Phi-4-mini: Llama's layer with fused q/k/v and gate/up projections, a partial
    /// rotary embedding and LongRoPE.
    Phi3,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mixtral => "mixtral",
            Family::Phi3 => "phi3",
        }
    }
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (the Llama family).
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// The experts of a mixture-of-experts model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// The k experts each token is routed to.
    pub experts_per_token: usize,
    /// Each expert's MLP width.
    pub expert_intermediate_size: usize,
    /// Whether the k routing weights are renormalized to sum to 1 (Mixtral always; Qwen3-MoE
    /// when `norm_topk_prob`).
    pub renormalize: bool,
    /// Per layer: experts (true) or the dense MLP of `intermediate_size` (Qwen3-MoE's
    /// `mlp_only_layers` and `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
}

impl MoeConfig {
    /// Whether `layer` routes to experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers[layer]
    }
}

/// The RoPE of the sliding-window layers, where it differs from the others' (Gemma 3: another
/// base, no scaling).
#[derive(Clone, Debug, PartialEq)]
pub struct LocalRope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The dimensions of each q/k head that RoPE rotates: `head_dim`, or Phi's
    /// `partial_rotary_factor` of it (the rest pass through).
    pub rotary_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Which dimensions of q and k rotate together (GGUF llama files store adjacent pairs).
    pub rope_pairing: RopePairing,
    /// The longest context the model serves by default: the config's, or with YaRN the
    /// original context times the factor.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (always for qwen2; `attention_bias` for llama/mistral).
    pub qkv_bias: bool,
    /// o_proj carries a bias (llama/mistral `attention_bias`).
    pub o_bias: bool,
    /// Qwen3: RMSNorm over each head of q and k before RoPE.
    pub qk_norm: bool,
    /// Keys older than this many positions are invisible (Mistral v0.1; Qwen2/3 when
    /// `use_sliding_window`), in the layers that `sliding_layers` marks.
    pub sliding_window: Option<usize>,
    /// Per layer: does the sliding window apply? (Qwen: only from `max_window_layers` on, or as
    /// `layer_types` says.)
    pub sliding_layers: Vec<bool>,
    pub activation: Activation,
    /// Gemma: each token's embedding is multiplied by this (sqrt(hidden_size)).
    pub embed_scale: Option<f32>,
    /// Gemma: an RMSNorm on the attention's output and one on the MLP's, before each is added
    /// to the residual stream (four norms a layer).
    pub post_norms: bool,
    /// Attention scores are scaled by 1/sqrt(this): head_dim, or Gemma's `query_pre_attn_scalar`.
    pub query_pre_attn_scalar: f32,
    /// Gemma 2 style: logits become cap * tanh(logits / cap).
    pub final_logit_softcap: Option<f32>,
    /// The sliding layers' own RoPE, if they have one.
    pub local_rope: Option<LocalRope>,
    /// Mixture of experts (qwen3_moe, mixtral).
    pub moe: Option<MoeConfig>,
}

/// The `model_type`s read.
const SUPPORTED_TYPES: &str = "llama, mistral, qwen2, qwen3, gemma3_text, qwen3_moe, mixtral, phi3";

/// Bounds no real model comes near. Past them, sizes computed from config.json before the weights
/// are checked against it (per-layer lists, heads x head_dim) would overflow or allocate without
/// end.
pub const MAX_LAYERS: usize = 4096;
pub const MAX_HEADS: usize = 1 << 16;
/// Token ids are 32-bit.
pub const MAX_VOCAB: usize = 1 << 32;
/// More experts than any model has (DeepSeek-V3 and Kimi K2: 256 and 384).
pub const MAX_EXPERTS: usize = 4096;

/// Reads one JSON field with a clear error naming the file and the field.
struct Fields<'a> {
    file: &'a Path,
    map: &'a Map<String, Value>,
    /// Where `map` sits in the file ("text_config." for a vision-language folder's text model).
    prefix: &'a str,
}

impl Fields<'_> {
    fn err(&self, field: &str, reason: impl std::fmt::Display) -> StrataError {
        StrataError::model_load(self.file, format!("{}{field}: {reason}", self.prefix))
    }

    fn opt(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, field: &str) -> Result<Option<usize>> {
        match self.opt(field) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n as usize)),
                None => Err(self.err(field, format!("expected a non-negative integer, found {v}"))),
            },
        }
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.usize_opt(field)?
            .ok_or_else(|| self.err(field, "missing"))
    }

    fn positive(&self, field: &str) -> Result<usize> {
        let n = self.usize(field)?;
        if n == 0 {
            return Err(self.err(field, "must be > 0"));
        }
        Ok(n)
    }

    fn at_most(&self, field: &str, n: usize, max: usize) -> Result<usize> {
        if n > max {
            return Err(self.err(field, format!("{n} is more than {max}")));
        }
        Ok(n)
    }

    fn f64_opt(&self, field: &str) -> Result<Option<f64>> {
        match self.opt(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.err(field, format!("expected a finite number, found {v}"))),
            },
        }
    }

    fn bool_opt(&self, field: &str) -> Result<Option<bool>> {
        match self.opt(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(field, format!("expected true or false, found {v}"))),
        }
    }
}

impl ModelConfig {
    pub fn load(dir: &Path) -> Result<ModelConfig> {
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file)
            .map_err(|e| StrataError::model_load(&file, format!("cannot read: {e}")))?;
        Self::parse(&file, &text)
    }

    pub fn parse(file: &Path, text: &str) -> Result<ModelConfig> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| StrataError::model_load(file, format!("invalid JSON: {e}")))?;
        let map = json
            .as_object()
            .ok_or_else(|| StrataError::model_load(file, "expected a JSON object"))?;
        let top = Fields {
            file,
            map,
            prefix: "",
        };
        let model_type = top
            .opt("model_type")
            .ok_or_else(|| top.err("model_type", "missing"))?
            .as_str()
            .ok_or_else(|| top.err("model_type", "expected a string"))?;
        // Gemma 3's vision-language folders (4B and up): the text model runs alone, from
        // text_config, which states only what differs from Gemma3TextConfig's defaults.
        if model_type == "gemma3" {
            let text = match top.opt("text_config") {
                Some(Value::Object(m)) => m,
                Some(_) => return Err(top.err("text_config", "expected an object")),
                None => return Err(top.err("text_config", "missing")),
            };
            let text = with_gemma3_defaults(text);
            let f = Fields {
                file,
                map: &text,
                prefix: "text_config.",
            };
            return Self::parse_fields(&f, Family::Gemma3);
        }
        let family = match model_type {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gemma3_text" => Family::Gemma3,
            "qwen3_moe" => Family::Qwen3Moe,
            "mixtral" => Family::Mixtral,
            "phi3" => Family::Phi3,
            other => {
                return Err(top.err(
                    "model_type",
                    format!("unsupported model type {other:?} (supported: {SUPPORTED_TYPES})"),
                ))
            }
        };
        if family == Family::Gemma3 {
            let map = with_gemma3_defaults(map);
            return Self::parse_fields(&Fields { map: &map, ..top }, family);
        }
        Self::parse_fields(&top, family)
    }

    /// The config of `family` from `f`'s fields.
    fn parse_fields(f: &Fields, family: Family) -> Result<ModelConfig> {
        let gemma = family == Family::Gemma3;

        let hidden_size = f.positive("hidden_size")?;
        let num_heads = f.at_most(
            "num_attention_heads",
            f.positive("num_attention_heads")?,
            MAX_HEADS,
        )?;
        let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            // Gemma 3's default (transformers' Gemma3TextConfig).
            None if gemma => 256,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(f.err(
                        "head_dim",
                        "missing, and hidden_size is not a multiple of num_attention_heads",
                    ));
                }
                hidden_size / num_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 || head_dim > 256 {
            return Err(f.err(
                "head_dim",
                format!("{head_dim} is not an even size in 2..=256"),
            ));
        }
        if num_heads / num_kv_heads > 16 {
            return Err(f.err(
                "num_key_value_heads",
                "more than 16 query heads per key/value head is not supported",
            ));
        }
        // Phi-3 states the context it was trained at beside the one it serves; LongRoPE reads
        // it (transformers' Phi3Config: 4096 when unstated, whatever rope_parameters says).
        let original_max_positions = match f.usize_opt("original_max_position_embeddings")? {
            None if family == Family::Phi3 => Some(4096),
            n => n,
        };

        // transformers 5 moves rope_theta and the scaling into `rope_parameters`, and keys them
        // by layer type for Gemma 3 (its sliding layers have a RoPE of their own).
        let rope_params = match f.opt("rope_parameters") {
            None => None,
            Some(Value::Object(m)) => Some(m),
            Some(_) => return Err(f.err("rope_parameters", "expected an object")),
        };
        let (rope_params, rope_params_field, local_params) = match rope_params {
            Some(m) if m.contains_key("full_attention") => (
                Some(object(f, m, "rope_parameters", "full_attention")?),
                "rope_parameters.full_attention",
                m.get("sliding_attention")
                    .map(|_| object(f, m, "rope_parameters", "sliding_attention"))
                    .transpose()?,
            ),
            other => (other, "rope_parameters", None),
        };
        let default_theta = if gemma { 1_000_000.0 } else { 10000.0 };
        let rope_theta = match f.f64_opt("rope_theta")? {
            Some(t) => t,
            None => theta_in(f, rope_params, rope_params_field)?.unwrap_or(default_theta),
        };
        if rope_theta <= 0.0 {
            return Err(f.err("rope_theta", "must be > 0"));
        }
        let max_position_embeddings = match f.usize_opt("max_position_embeddings")? {
            Some(0) => return Err(f.err("max_position_embeddings", "must be > 0")),
            Some(n) => n,
            None if gemma => 131072,
            None => 2048,
        };
        // transformers reads partial_rotary_factor from the RoPE object first (transformers 5
        // writes it there and at the top level), then from the top level.
        let inner_partial = f
            .opt("rope_scaling")
            .and_then(Value::as_object)
            .into_iter()
            .chain(rope_params)
            .find_map(|m| m.get("partial_rotary_factor").filter(|v| !v.is_null()));
        let partial = match inner_partial {
            Some(v) => Some(v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
                f.err(
                    "partial_rotary_factor",
                    format!("expected a number, found {v}"),
                )
            })?),
            None => f.f64_opt("partial_rotary_factor")?,
        };
        let rotary_dim = match partial {
            None => head_dim,
            Some(p) if p > 0.0 && p <= 1.0 => {
                // transformers: int(head_dim * partial_rotary_factor).
                let d = (head_dim as f64 * p) as usize;
                if d < 2 || !d.is_multiple_of(2) {
                    return Err(f.err(
                        "partial_rotary_factor",
                        format!("{p} of head_dim {head_dim} is {d} dimensions, not an even number"),
                    ));
                }
                d
            }
            Some(p) => return Err(f.err("partial_rotary_factor", format!("{p} is not in (0, 1]"))),
        };
        let context = RopeContext {
            max_positions: max_position_embeddings,
            original_max_positions,
            rotary_dim,
        };
        let rope_scaling = match f.opt("rope_scaling") {
            Some(Value::Object(m)) => parse_rope_scaling(f, "rope_scaling", m, &context)?,
            Some(_) => return Err(f.err("rope_scaling", "expected an object or null")),
            None => match rope_params {
                Some(m) => parse_rope_scaling(f, rope_params_field, m, &context)?,
                None => RopeScaling::None,
            },
        };
        // Gemma 3's sliding layers: `rope_local_base_freq` (transformers 4), or their own entry
        // of `rope_parameters` (5); never scaled in the first form.
        let local_rope = if gemma {
            let field = "rope_parameters.sliding_attention";
            let theta = match f.f64_opt("rope_local_base_freq")? {
                Some(t) => t,
                None => theta_in(f, local_params, field)?.unwrap_or(10000.0),
            };
            if theta <= 0.0 {
                return Err(f.err("rope_local_base_freq", "must be > 0"));
            }
            let scaling = match local_params {
                Some(m) => parse_rope_scaling(f, field, m, &context)?,
                None => RopeScaling::None,
            };
            Some(LocalRope { theta, scaling })
        } else {
            None
        };
        let max_position_embeddings = rope_scaling.context(max_position_embeddings);

        let explicit_bias = f.bool_opt("attention_bias")?;
        let (qkv_bias, o_bias) = match family {
            // Qwen2 always has q/k/v biases and never an o_proj bias.
            Family::Qwen2 => (true, false),
            _ => {
                let b = explicit_bias.unwrap_or(false);
                (b, b)
            }
        };
        if f.bool_opt("mlp_bias")?.unwrap_or(false) {
            return Err(f.err("mlp_bias", "MLP biases are not supported"));
        }
        let sliding_window = match family {
            Family::Mistral | Family::Mixtral | Family::Phi3 => f.usize_opt("sliding_window")?,
            Family::Gemma3 => Some(f.usize_opt("sliding_window")?.unwrap_or(4096)),
            Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe
                if f.bool_opt("use_sliding_window")?.unwrap_or(false) =>
            {
                f.usize_opt("sliding_window")?
            }
            _ => None,
        };

        let num_layers = f.at_most(
            "num_hidden_layers",
            f.positive("num_hidden_layers")?,
            MAX_LAYERS,
        )?;
        let sliding_layers = match f.opt("layer_types") {
            Some(Value::Array(types)) => {
                if types.len() != num_layers {
                    return Err(f.err(
                        "layer_types",
                        format!("has {} entries for {num_layers} layers", types.len()),
                    ));
                }
                types
                    .iter()
                    .map(|t| t.as_str() == Some("sliding_attention"))
                    .collect()
            }
            Some(_) => return Err(f.err("layer_types", "expected a list")),
            // Older Gemma 3 configs: every `sliding_window_pattern`-th layer is global.
            None if gemma => {
                let pattern = f.usize_opt("sliding_window_pattern")?.unwrap_or(6).max(1);
                (0..num_layers).map(|l| (l + 1) % pattern != 0).collect()
            }
            None => {
                let first = match family {
                    // Qwen3-MoE slides every layer (transformers never reads its
                    // max_window_layers).
                    Family::Qwen2 | Family::Qwen3 => f.usize_opt("max_window_layers")?.unwrap_or(0),
                    _ => 0,
                };
                (0..num_layers).map(|l| l >= first).collect()
            }
        };

        let eps = f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
        if eps <= 0.0 {
            return Err(f.err("rms_norm_eps", "must be > 0"));
        }
        let activation = if gemma {
            let field = if f.opt("hidden_activation").is_some() {
                "hidden_activation"
            } else {
                "hidden_act"
            };
            match f.opt(field).and_then(Value::as_str) {
                None | Some("gelu_pytorch_tanh") => Activation::GeluTanh,
                Some(other) => {
                    return Err(f.err(
                        field,
                        format!("unsupported activation {other:?} (supported: gelu_pytorch_tanh)"),
                    ))
                }
            }
        } else {
            Activation::Silu
        };
        let query_pre_attn_scalar = match (gemma, f.f64_opt("query_pre_attn_scalar")?) {
            (false, _) => head_dim as f32,
            (true, None) => 256.0,
            (true, Some(x)) if x > 0.0 => x as f32,
            (true, Some(_)) => return Err(f.err("query_pre_attn_scalar", "must be > 0")),
        };
        // `attn_logit_softcapping` (Gemma 2's) is read by transformers' Gemma 3 but never applied:
        // ignored here too.
        let final_logit_softcap = match f.f64_opt("final_logit_softcapping")? {
            Some(cap) if cap <= 0.0 => return Err(f.err("final_logit_softcapping", "must be > 0")),
            cap => cap.map(|c| c as f32),
        };
        Ok(ModelConfig {
            family,
            hidden_size,
            intermediate_size: f.positive("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            vocab_size: f.at_most("vocab_size", f.positive("vocab_size")?, MAX_VOCAB)?,
            rms_norm_eps: eps as f32,
            rope_theta,
            rope_scaling,
            rope_pairing: RopePairing::Half,
            max_position_embeddings,
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(gemma),
            qkv_bias,
            o_bias,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3),
            sliding_window: sliding_window.filter(|&w| w > 0),
            sliding_layers,
            activation,
            embed_scale: gemma.then(|| (hidden_size as f32).sqrt()),
            post_norms: gemma,
            query_pre_attn_scalar,
            final_logit_softcap,
            local_rope,
            moe: parse_moe(f, family, num_layers)?,
        })
    }

    /// The sliding window of `layer`, if it has one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.sliding_layers[layer])
    }

    /// The factor of the attention scores.
    pub fn attention_scale(&self) -> f32 {
        1.0 / self.query_pre_attn_scalar.sqrt()
    }

    /// Whether `layer` uses the sliding layers' own RoPE.
    pub fn local_rope_at(&self, layer: usize) -> bool {
        self.local_rope.is_some() && self.sliding_layers[layer]
    }

    /// The widest MLP of a layer: the dense one's, or an expert's.
    pub fn mlp_width(&self) -> usize {
        let expert = self.moe.as_ref().map_or(0, |m| m.expert_intermediate_size);
        self.intermediate_size.max(expert)
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// `map` over the defaults of transformers' Gemma3TextConfig for the sizes a config must
/// otherwise state (Gemma 3's Hub configs omit what equals them; gemma-3-4b's text_config has no
/// vocab_size, for one). The other Gemma defaults are `parse`'s own.
fn with_gemma3_defaults(map: &Map<String, Value>) -> Map<String, Value> {
    let mut out: Map<String, Value> = [
        ("vocab_size", 262_208),
        ("hidden_size", 2304),
        ("intermediate_size", 9216),
        ("num_hidden_layers", 26),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), Value::from(v)))
    .collect();
    for (k, v) in map {
        out.insert(k.clone(), v.clone());
    }
    out
}

/// The experts of a qwen3_moe or mixtral config (None for the dense families).
fn parse_moe(f: &Fields, family: Family, num_layers: usize) -> Result<Option<MoeConfig>> {
    let (experts_field, width_field) = match family {
        Family::Qwen3Moe => ("num_experts", "moe_intermediate_size"),
        Family::Mixtral => ("num_local_experts", "intermediate_size"),
        _ => return Ok(None),
    };
    let num_experts = f.at_most(experts_field, f.positive(experts_field)?, MAX_EXPERTS)?;
    let experts_per_token = f.positive("num_experts_per_tok")?;
    if experts_per_token > num_experts {
        return Err(f.err(
            "num_experts_per_tok",
            format!("{experts_per_token} is more than {experts_field} {num_experts}"),
        ));
    }
    let sparse_layers = if family == Family::Qwen3Moe {
        let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1);
        let dense: Vec<usize> = match f.opt("mlp_only_layers") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|n| n as usize))
                .collect::<Option<_>>()
                .ok_or_else(|| f.err("mlp_only_layers", "expected a list of layer indices"))?,
            Some(_) => return Err(f.err("mlp_only_layers", "expected a list of layer indices")),
        };
        // transformers' Qwen3MoeDecoderLayer: experts unless the layer is listed, or off the step.
        (0..num_layers)
            .map(|l| !dense.contains(&l) && step > 0 && (l + 1) % step == 0)
            .collect()
    } else {
        vec![true; num_layers]
    };
    Ok(Some(MoeConfig {
        num_experts,
        experts_per_token,
        expert_intermediate_size: f.positive(width_field)?,
        renormalize: family == Family::Mixtral || f.bool_opt("norm_topk_prob")?.unwrap_or(false),
        sparse_layers,
    }))
}

/// `parent.key`, which must be an object.
fn object<'a>(
    f: &Fields,
    parent: &'a Map<String, Value>,
    parent_field: &str,
    key: &str,
) -> Result<&'a Map<String, Value>> {
    parent
        .get(key)
        .and_then(Value::as_object)
        .ok_or_else(|| f.err(&format!("{parent_field}.{key}"), "expected an object"))
}

/// The `rope_theta` of a `rope_parameters` object (`field`), if it has one.
fn theta_in(f: &Fields, m: Option<&Map<String, Value>>, field: &str) -> Result<Option<f64>> {
    match m.and_then(|m| m.get("rope_theta")) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| f.err(&format!("{field}.rope_theta"), "expected a number")),
    }
}

/// What a RoPE scaling reads of the rest of the config.
struct RopeContext {
    /// `max_position_embeddings`: YaRN's original context when the scaling names none.
    max_positions: usize,
    /// The top-level `original_max_position_embeddings` (Phi-3's), if any.
    original_max_positions: Option<usize>,
    /// LongRoPE has one factor per rotated frequency.
    rotary_dim: usize,
}

/// The scaling of `m` (the config's `field`).
fn parse_rope_scaling(
    f: &Fields,
    field: &str,
    m: &Map<String, Value>,
    context: &RopeContext,
) -> Result<RopeScaling> {
    let max_positions = context.max_positions;
    // transformers writes the kind as "rope_type"; older configs use "type".
    let kind = m
        .get("rope_type")
        .or_else(|| m.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| -> Result<f64> {
        m.get(key)
            .and_then(Value::as_f64)
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| {
                f.err(
                    &format!("{field}.{key}"),
                    "missing or not a positive number",
                )
            })
    };
    let opt_num = |key: &str| -> Result<Option<f64>> {
        match m.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .map(Some)
                .ok_or_else(|| f.err(&format!("{field}.{key}"), "not a positive number")),
        }
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "yarn" => {
            let factor = num("factor")?;
            let attention_factor = match opt_num("attention_factor")? {
                Some(a) => a,
                // DeepSeek's configs give the multipliers of the default instead.
                None => match (opt_num("mscale")?, opt_num("mscale_all_dim")?) {
                    (Some(ms), Some(all)) => yarn_mscale(factor, ms) / yarn_mscale(factor, all),
                    _ => yarn_mscale(factor, 1.0),
                },
            };
            let truncate = match m.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(f.err(&format!("{field}.truncate"), "expected true or false"))
                }
            };
            Ok(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: opt_num("original_max_position_embeddings")?
                    .unwrap_or(max_positions as f64),
                beta_fast: opt_num("beta_fast")?.unwrap_or(32.0),
                beta_slow: opt_num("beta_slow")?.unwrap_or(1.0),
                attention_factor,
                truncate,
            })
        }
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        // "su" is LongRoPE's name in the first Phi-3 configs.
        "longrope" | "su" => {
            let factors = |key: &str| -> Result<Vec<f64>> {
                let name = format!("{field}.{key}");
                let list = m
                    .get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| f.err(&name, "missing or not a list"))?;
                let want = context.rotary_dim / 2;
                if list.len() != want {
                    return Err(f.err(
                        &name,
                        format!(
                            "has {} factors; the rotary dimensions need {want}",
                            list.len()
                        ),
                    ));
                }
                list.iter()
                    .map(|v| v.as_f64().filter(|x| x.is_finite() && *x > 0.0))
                    .collect::<Option<Vec<f64>>>()
                    .ok_or_else(|| f.err(&name, "expected positive numbers"))
            };
            // transformers' _compute_longrope_parameters: the original context is the config's
            // (max_position_embeddings when it states none); the factor of the default
            // attention factor is the scaling's own, else the served over the original context.
            let original = match context.original_max_positions {
                Some(0) => {
                    return Err(f.err("original_max_position_embeddings", "must be > 0"));
                }
                Some(orig) => orig as f64,
                None => max_positions as f64,
            };
            let factor = match opt_num("factor")? {
                Some(x) => x,
                None => max_positions as f64 / original,
            };
            let attention_factor = match opt_num("attention_factor")? {
                Some(a) => a,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / original.ln()).sqrt(),
            };
            Ok(RopeScaling::LongRope {
                short_factors: factors("short_factor")?,
                long_factors: factors("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            })
        }
        "llama3" => {
            let low = num("low_freq_factor")?;
            let high = num("high_freq_factor")?;
            if high <= low {
                return Err(f.err(
                    &format!("{field}.high_freq_factor"),
                    "must be greater than low_freq_factor",
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            })
        }
        other => Err(f.err(
            &format!("{field}.rope_type"),
            format!(
                "unsupported rope scaling {other:?} (supported: default, linear, llama3, yarn, \
                 longrope)"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::parse(Path::new("m/config.json"), text)
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100"#;

    #[test]
    fn qwen3_reads_head_dim_and_rope_parameters() {
        let c = parse(&format!(
            r#"{{"model_type": "qwen3", {BASE}, "head_dim": 32,
                "rope_parameters": {{"rope_type": "default", "rope_theta": 1000000.0}}}}"#
        ))
        .unwrap();
        assert_eq!(c.family, Family::Qwen3);
        assert_eq!(c.head_dim, 32);
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!(c.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn llama3_scaling_and_qwen2_biases() {
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0
            }
        );
        assert_eq!(c.head_dim, 16);
        let q = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "sliding_window": 4}}"#
        ))
        .unwrap();
        assert!(q.qkv_bias && !q.o_bias);
        assert_eq!(
            q.sliding_window, None,
            "qwen2 ignores sliding_window unless use_sliding_window"
        );
        let q = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "sliding_window": 4, "use_sliding_window": true, "max_window_layers": 1}}"#
        ))
        .unwrap();
        assert_eq!(
            (q.window(0), q.window(1)),
            (None, Some(4)),
            "window from max_window_layers on"
        );
        let m = parse(&format!(
            r#"{{"model_type": "mistral", {BASE}, "sliding_window": 4, "rope_scaling": {{"type": "linear", "factor": 2}}}}"#
        ))
        .unwrap();
        assert_eq!(m.sliding_window, Some(4));
        assert_eq!(m.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn qwen_yarn_scaling() {
        // Qwen2.5's long-context setting: 32K positions stretched 4 times.
        let c = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "max_position_embeddings": 32768, "rope_scaling":
                {{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}}}"#
        ))
        .unwrap();
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 32768.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 0.1 * 4f64.ln() + 1.0,
                truncate: true,
            }
        );
        assert_eq!(c.max_position_embeddings, 131072);
        // Without an original context: the config's; explicit betas, attention factor, truncate.
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "max_position_embeddings": 4096, "rope_scaling":
                {{"rope_type": "yarn", "factor": 2, "beta_fast": 16, "beta_slow": 2,
                "attention_factor": 1.25, "truncate": false}}}}"#
        ))
        .unwrap();
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Yarn {
                factor: 2.0,
                original_max_position_embeddings: 4096.0,
                beta_fast: 16.0,
                beta_slow: 2.0,
                attention_factor: 1.25,
                truncate: false,
            }
        );
        assert_eq!(c.max_position_embeddings, 8192);
        // DeepSeek's multipliers of the default attention factor.
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"rope_type": "yarn",
                "factor": 40, "mscale": 1.0, "mscale_all_dim": 0.5}}}}"#
        ))
        .unwrap();
        assert_eq!(
            c.rope_scaling.attention_factor(),
            (0.1 * 40f64.ln() + 1.0) / (0.05 * 40f64.ln() + 1.0)
        );
    }

    #[test]
    fn phi3_reads_partial_rotary_and_longrope() {
        // Phi-4-mini's form: 3/4 of each head rotates, LongRoPE from a stated original context.
        let c = parse(&format!(
            r#"{{"model_type": "phi3", {BASE}, "partial_rotary_factor": 0.75,
                "max_position_embeddings": 4096, "original_max_position_embeddings": 256,
                "sliding_window": 2047, "rope_scaling": {{"type": "longrope",
                "short_factor": [1, 1.5, 2, 2.5, 3, 3.5], "long_factor": [2, 3, 4, 5, 6, 7]}}}}"#
        ))
        .unwrap();
        assert_eq!(c.family, Family::Phi3);
        assert_eq!((c.head_dim, c.rotary_dim), (16, 12));
        assert_eq!(
            c.rope_scaling,
            RopeScaling::LongRope {
                short_factors: vec![1.0, 1.5, 2.0, 2.5, 3.0, 3.5],
                long_factors: vec![2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                original_max_position_embeddings: 256.0,
                // transformers: sqrt(1 + ln(4096 / 256) / ln(256)) = sqrt(1.5).
                attention_factor: 1.5f64.sqrt(),
            }
        );
        assert_eq!(c.max_position_embeddings, 4096);
        assert_eq!((c.window(0), c.window(1)), (Some(2047), Some(2047)));
        assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
        // An explicit attention factor.
        let c = parse(&format!(
            r#"{{"model_type": "phi3", {BASE}, "rope_scaling": {{"rope_type": "longrope",
                "short_factor": [1, 1, 1, 1, 1, 1, 1, 1], "long_factor": [1, 2, 3, 4, 5, 6, 7, 8],
                "attention_factor": 1.25}}}}"#
        ))
        .unwrap();
        assert_eq!(c.rotary_dim, 16);
        assert_eq!(c.rope_scaling.attention_factor(), 1.25);
        // As transformers 5 writes it: partial_rotary_factor inside rope_parameters wins over
        // the top level's; the original context is the top level's (4096 when unstated, not
        // rope_parameters' copy), and the scaling's own factor sets the attention factor.
        let c = parse(&format!(
            r#"{{"model_type": "phi3", {BASE}, "partial_rotary_factor": 1.0,
                "max_position_embeddings": 131072, "rope_parameters": {{"rope_type": "longrope",
                "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
                "original_max_position_embeddings": 100,
                "short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2]}}}}"#
        ))
        .unwrap();
        assert_eq!(c.rotary_dim, 8);
        let RopeScaling::LongRope {
            original_max_position_embeddings,
            attention_factor,
            ..
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(original_max_position_embeddings, 4096.0);
        assert_eq!(attention_factor, (1.0 + 4f64.ln() / 4096f64.ln()).sqrt());
        let e = parse(&format!(
            r#"{{"model_type": "phi3", {BASE}, "partial_rotary_factor": 0.5, "rope_scaling":
                {{"type": "longrope", "short_factor": [1, 1], "long_factor": [1, 1, 1, 1]}}}}"#
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: rope_scaling.short_factor: has 2 factors; the rotary dimensions need 4"
        );
        let e = parse(&format!(
            r#"{{"model_type": "phi3", {BASE}, "partial_rotary_factor": 0.2}}"#
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: partial_rotary_factor: 0.2 of head_dim 16 is 3 dimensions, not an \
             even number"
        );
    }

    #[test]
    fn gemma3_reads_both_rope_forms_and_its_layer_types() {
        // transformers 4: rope_local_base_freq beside the global theta and scaling; the old
        // sliding_window_pattern (every 6th layer global).
        let c = parse(&format!(
            r#"{{"model_type": "gemma3_text", {BASE}, "num_hidden_layers": 7, "head_dim": 32,
                "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 6,
                "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {{"rope_type": "linear", "factor": 8.0}},
                "final_logit_softcapping": 30.0, "attn_logit_softcapping": null,
                "hidden_activation": "gelu_pytorch_tanh"}}"#
        ))
        .unwrap();
        assert_eq!(c.family, Family::Gemma3);
        assert_eq!(
            (0..7).map(|l| c.window(l)).collect::<Vec<_>>(),
            [Some(8), Some(8), Some(8), Some(8), Some(8), None, Some(8)]
        );
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(
            c.local_rope,
            Some(LocalRope {
                theta: 10000.0,
                scaling: RopeScaling::None
            })
        );
        assert!(c.local_rope_at(0) && !c.local_rope_at(5));
        assert_eq!(c.attention_scale(), 1.0 / 24f32.sqrt());
        assert_eq!(c.embed_scale, Some(8.0));
        assert_eq!(c.final_logit_softcap, Some(30.0));
        assert_eq!(c.activation, Activation::GeluTanh);
        assert!(c.qk_norm && c.post_norms && c.tie_word_embeddings && !c.qkv_bias);

        // transformers 5: one rope_parameters entry per layer type, and layer_types.
        let c = parse(&format!(
            r#"{{"model_type": "gemma3_text", {BASE}, "head_dim": 32, "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention"],
                "rope_parameters": {{
                    "full_attention": {{"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
                    "sliding_attention": {{"rope_type": "default", "rope_theta": 10000.0}}}}}}"#
        ))
        .unwrap();
        assert_eq!((c.window(0), c.window(1)), (None, Some(8)));
        assert_eq!(
            (c.rope_theta, &c.rope_scaling),
            (1e6, &RopeScaling::Linear { factor: 8.0 })
        );
        assert_eq!(c.local_rope.as_ref().map(|l| l.theta), Some(10000.0));
        // Gemma 3's defaults where a config is silent.
        assert_eq!(c.attention_scale(), 1.0 / 16.0);
        assert_eq!(c.final_logit_softcap, None);
        let llama = parse(&format!(r#"{{"model_type": "llama", {BASE}}}"#)).unwrap();
        assert_eq!(llama.attention_scale(), 1.0 / 4.0);
        assert!(llama.local_rope.is_none() && llama.embed_scale.is_none() && !llama.post_norms);
        assert_eq!(llama.activation, Activation::Silu);
    }

    #[test]
    fn mixtures_of_experts() {
        let c = parse(&format!(
            r#"{{"model_type": "qwen3_moe", {BASE}, "num_hidden_layers": 4, "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [1]}}"#
        ))
        .unwrap();
        assert_eq!(c.family, Family::Qwen3Moe);
        assert!(c.qk_norm);
        assert_eq!(
            c.moe,
            Some(MoeConfig {
                num_experts: 8,
                experts_per_token: 2,
                expert_intermediate_size: 32,
                renormalize: true,
                sparse_layers: vec![true, false, true, true],
            })
        );
        assert_eq!(c.mlp_width(), 128);
        // decoder_sparse_step 2: every second layer; norm_topk_prob defaults to false.
        let c = parse(&format!(
            r#"{{"model_type": "qwen3_moe", {BASE}, "num_hidden_layers": 4, "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 256, "decoder_sparse_step": 2}}"#
        ))
        .unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.sparse_layers, [false, true, false, true]);
        assert!(!moe.renormalize);
        assert_eq!(c.mlp_width(), 256);
        // Mixtral: every layer, always renormalized, the experts' width is intermediate_size.
        let c = parse(&format!(
            r#"{{"model_type": "mixtral", {BASE}, "num_local_experts": 8,
                "num_experts_per_tok": 2, "sliding_window": null}}"#
        ))
        .unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (
                moe.renormalize,
                moe.expert_intermediate_size,
                &moe.sparse_layers[..]
            ),
            (true, 128, &[true, true][..])
        );
        assert!(!c.qk_norm && c.sliding_window.is_none());
        for (extra, want) in [
            (
                r#""num_local_experts": 2, "num_experts_per_tok": 3"#,
                "num_experts_per_tok: 3 is more than num_local_experts 2",
            ),
            (r#""num_experts_per_tok": 2"#, "num_local_experts: missing"),
        ] {
            let e = parse(&format!(r#"{{"model_type": "mixtral", {BASE}, {extra}}}"#)).unwrap_err();
            assert_eq!(e.to_string(), format!("m/config.json: {want}"));
        }
    }

    #[test]
    fn gemma3_refusals_name_the_field() {
        for (extra, want) in [
            (
                r#""hidden_activation": "gelu""#,
                "hidden_activation: unsupported activation \"gelu\" (supported: gelu_pytorch_tanh)",
            ),
            (
                r#""rope_parameters": {"full_attention": 3}"#,
                "rope_parameters.full_attention: expected an object",
            ),
        ] {
            let e = parse(&format!(
                r#"{{"model_type": "gemma3_text", {BASE}, {extra}}}"#
            ))
            .unwrap_err();
            assert_eq!(e.to_string(), format!("m/config.json: {want}"));
        }
        let e = parse(&format!(r#"{{"model_type": "gemma3", {BASE}}}"#)).unwrap_err();
        assert_eq!(e.to_string(), "m/config.json: text_config: missing");
    }

    #[test]
    fn gemma3_vision_language_folders_run_their_text_model() {
        // gemma-3-4b-it's config.json: text_config states what differs from Gemma3TextConfig's
        // defaults (no vocab_size, no head count), the vision tower's config beside it.
        let c = parse(
            r#"{"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "boi_token_index": 255999, "eos_token_id": [1, 106], "mm_tokens_per_image": 256,
                "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
                "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}"#,
        )
        .unwrap();
        assert_eq!(c.family, Family::Gemma3);
        assert_eq!(
            (
                c.hidden_size,
                c.intermediate_size,
                c.num_layers,
                c.vocab_size
            ),
            (2560, 10240, 34, 262_208)
        );
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (8, 4, 256));
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(
            (c.rope_theta, c.window(0), c.window(5)),
            (1e6, Some(1024), None)
        );
        assert!(c.tie_word_embeddings && c.post_norms);
        // Errors name the field where it is.
        let e = parse(r#"{"model_type": "gemma3", "text_config": {"num_hidden_layers": 0}}"#)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: text_config.num_hidden_layers: must be > 0"
        );
        let e = parse(r#"{"model_type": "gemma3", "text_config": 3}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: text_config: expected an object"
        );
    }

    #[test]
    fn errors_name_file_and_field() {
        let e = parse(&format!(r#"{{"model_type": "gpt2", {BASE}}}"#)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: model_type: unsupported model type \"gpt2\" (supported: llama, mistral, qwen2, qwen3, gemma3_text, qwen3_moe, mixtral, phi3)"
        );
        let e = parse(r#"{"model_type": "llama", "hidden_size": 64}"#).unwrap_err();
        assert_eq!(e.to_string(), "m/config.json: num_attention_heads: missing");
        let e = parse("{not json").unwrap_err();
        assert!(
            e.to_string().starts_with("m/config.json: invalid JSON: "),
            "{e}"
        );
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"type": "dynamic", "factor": 2}}}}"#
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: rope_scaling.rope_type: unsupported rope scaling \"dynamic\" (supported: default, linear, llama3, yarn, longrope)"
        );
        let e = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "rope_scaling": {{"type": "yarn", "factor": 4, "beta_fast": -1}}}}"#
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: rope_scaling.beta_fast: not a positive number"
        );
        let e = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "rope_scaling": {{"type": "yarn", "factor": 4, "truncate": 1}}}}"#
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: rope_scaling.truncate: expected true or false"
        );
        for (field, value, want) in [
            (
                "num_hidden_layers",
                "1000000000000000",
                "num_hidden_layers: 1000000000000000 is more than 4096",
            ),
            (
                "num_attention_heads",
                "4611686018427387904",
                "num_attention_heads: 4611686018427387904 is more than 65536",
            ),
            (
                "vocab_size",
                "4294967297",
                "vocab_size: 4294967297 is more than 4294967296",
            ),
            (
                "max_position_embeddings",
                "0",
                "max_position_embeddings: must be > 0",
            ),
        ] {
            let e = parse(&format!(
                r#"{{"model_type": "llama", {BASE}, "{field}": {value}}}"#
            ))
            .unwrap_err();
            assert_eq!(e.to_string(), format!("m/config.json: {want}"));
        }
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "hidden_size": -3}}"#
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: hidden_size: expected a non-negative integer, found -3"
        );
    }
}
