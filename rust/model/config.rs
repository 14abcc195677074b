//! config.json -> ModelConfig, for the Llama family (llama, mistral, qwen2, qwen3).

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
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }
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
}

/// Bounds no real model comes near. Past them, sizes computed from config.json before the weights
/// are checked against it (per-layer lists, heads x head_dim) would overflow or allocate without
/// end.
pub const MAX_LAYERS: usize = 4096;
pub const MAX_HEADS: usize = 1 << 16;
/// Token ids are 32-bit.
pub const MAX_VOCAB: usize = 1 << 32;

/// Reads one JSON field with a clear error naming the file and the field.
struct Fields<'a> {
    file: &'a Path,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn err(&self, field: &str, reason: impl std::fmt::Display) -> StrataError {
        StrataError::model_load(self.file, format!("{field}: {reason}"))
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
        let f = Fields { file, map };

        let model_type = f
            .opt("model_type")
            .ok_or_else(|| f.err("model_type", "missing"))?
            .as_str()
            .ok_or_else(|| f.err("model_type", "expected a string"))?;
        let family = match model_type {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            other => {
                return Err(f.err(
                    "model_type",
                    format!(
                    "unsupported model type {other:?} (supported: llama, mistral, qwen2, qwen3)"
                ),
                ))
            }
        };

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

        // transformers 5 moves rope_theta and the scaling into `rope_parameters`.
        let rope_params = match f.opt("rope_parameters") {
            None => None,
            Some(Value::Object(m)) => Some(m),
            Some(_) => return Err(f.err("rope_parameters", "expected an object")),
        };
        let rope_theta = match f.f64_opt("rope_theta")? {
            Some(t) => t,
            None => match rope_params.and_then(|m| m.get("rope_theta")) {
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| f.err("rope_parameters.rope_theta", "expected a number"))?,
                None => 10000.0,
            },
        };
        if rope_theta <= 0.0 {
            return Err(f.err("rope_theta", "must be > 0"));
        }
        let max_position_embeddings = match f.usize_opt("max_position_embeddings")? {
            Some(0) => return Err(f.err("max_position_embeddings", "must be > 0")),
            Some(n) => n,
            None => 2048,
        };
        let rope_scaling = match f.opt("rope_scaling") {
            Some(Value::Object(m)) => {
                parse_rope_scaling(&f, "rope_scaling", m, max_position_embeddings)?
            }
            Some(_) => return Err(f.err("rope_scaling", "expected an object or null")),
            None => match rope_params {
                Some(m) => parse_rope_scaling(&f, "rope_parameters", m, max_position_embeddings)?,
                None => RopeScaling::None,
            },
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
            Family::Mistral => f.usize_opt("sliding_window")?,
            Family::Qwen2 | Family::Qwen3 if f.bool_opt("use_sliding_window")?.unwrap_or(false) => {
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
            None => {
                let first = match family {
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
        Ok(ModelConfig {
            family,
            hidden_size,
            intermediate_size: f.positive("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: f.at_most("vocab_size", f.positive("vocab_size")?, MAX_VOCAB)?,
            rms_norm_eps: eps as f32,
            rope_theta,
            rope_scaling,
            rope_pairing: RopePairing::Half,
            max_position_embeddings,
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            qk_norm: family == Family::Qwen3,
            sliding_window: sliding_window.filter(|&w| w > 0),
            sliding_layers,
        })
    }

    /// The sliding window of `layer`, if it has one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.sliding_layers[layer])
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// The scaling of `m` (the config's `field`); `max_positions` is the config's
/// `max_position_embeddings`, YaRN's original context when the scaling does not name one.
fn parse_rope_scaling(
    f: &Fields,
    field: &str,
    m: &Map<String, Value>,
    max_positions: usize,
) -> Result<RopeScaling> {
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
                "unsupported rope scaling {other:?} (supported: default, linear, llama3, yarn)"
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
    fn errors_name_file_and_field() {
        let e = parse(&format!(r#"{{"model_type": "gpt2", {BASE}}}"#)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "m/config.json: model_type: unsupported model type \"gpt2\" (supported: llama, mistral, qwen2, qwen3)"
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
            "m/config.json: rope_scaling.rope_type: unsupported rope scaling \"dynamic\" (supported: default, linear, llama3, yarn)"
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
