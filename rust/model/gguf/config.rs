//! The model's hyper-parameters from GGUF metadata (`<arch>.*` keys), as a `ModelConfig`.

use crate::error::Result;
use crate::model::config::{
    Activation, Family, LocalRope, ModelConfig, MoeConfig, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS,
    MAX_VOCAB,
};
use crate::model::kernels::cpu::rope::{yarn_mscale, RopePairing, RopeScaling};

use super::Metadata;

/// Architectures read, by their `general.architecture` name. Mistral files use "llama".
const ARCHITECTURES: &str = "llama, qwen2, qwen3, qwen3moe, gemma3, phi3";

/// The RoPE frequency divisors a file may store as tensors.
#[derive(Default)]
pub struct RopeFactorTensors {
    /// `rope_freqs.weight`: what llama.cpp's converter computed from a Llama 3 scaling.
    pub freqs: Option<Vec<f64>>,
    /// `rope_factors_long.weight` and `rope_factors_short.weight`: Phi-3's LongRoPE.
    pub long: Option<Vec<f64>>,
    pub short: Option<Vec<f64>>,
}

/// The config of the model `meta` describes. `vocab_size` is the token count of the tokenizer
/// when the file has no `<arch>.vocab_size`; `tied` says whether the file lacks `output.weight`;
/// `factors` are the RoPE factor tensors the file has.
pub fn model_config(
    meta: &Metadata,
    vocab_size: usize,
    tied: bool,
    factors: RopeFactorTensors,
) -> Result<ModelConfig> {
    let arch = meta.str("general.architecture")?;
    let (family, pairing) = match arch {
        // llama.cpp's converter permutes llama q/k rows to adjacent pairs; qwen files keep HF's.
        "llama" => (Family::Llama, RopePairing::Adjacent),
        "qwen2" => (Family::Qwen2, RopePairing::Half),
        "qwen3" => (Family::Qwen3, RopePairing::Half),
        "qwen3moe" => (Family::Qwen3Moe, RopePairing::Half),
        "gemma3" => (Family::Gemma3, RopePairing::Half),
        // llama.cpp rotates phi3 as NEOX does: its converter keeps HF's row order.
        "phi3" => (Family::Phi3, RopePairing::Half),
        other => {
            return Err(meta.err(
                "general.architecture",
                format!("unsupported architecture {other:?} (supported: {ARCHITECTURES})"),
            ))
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let positive = |k: &str, max: usize| -> Result<usize> {
        let n = meta
            .uniform_usize_opt(&key(k))?
            .ok_or_else(|| meta.err(&key(k), "missing"))?;
        if n == 0 || n > max {
            return Err(meta.err(&key(k), format!("{n} is not in 1..={max}")));
        }
        Ok(n)
    };

    let hidden_size = positive("embedding_length", usize::MAX)?;
    let num_layers = positive("block_count", MAX_LAYERS)?;
    let intermediate_size = positive("feed_forward_length", usize::MAX)?;
    let num_heads = positive("attention.head_count", MAX_HEADS)?;
    let num_kv_heads = match meta.uniform_usize_opt(&key("attention.head_count_kv"))? {
        None => num_heads,
        Some(n) => n,
    };
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(meta.err(
            &key("attention.head_count_kv"),
            format!("{num_kv_heads} does not divide attention.head_count {num_heads}"),
        ));
    }
    if num_heads / num_kv_heads > 16 {
        return Err(meta.err(
            &key("attention.head_count_kv"),
            "more than 16 query heads per key/value head is not supported",
        ));
    }
    let head_dim = match meta.usize_opt(&key("attention.key_length"))? {
        Some(d) => d,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(meta.err(
                &key("attention.key_length"),
                "missing, and embedding_length is not a multiple of attention.head_count",
            ))
        }
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > 256 {
        return Err(meta.err(
            &key("attention.key_length"),
            format!("{head_dim} is not an even size in 2..=256"),
        ));
    }
    if let Some(v) = meta.usize_opt(&key("attention.value_length"))? {
        if v != head_dim {
            return Err(meta.err(
                &key("attention.value_length"),
                format!("{v} differs from attention.key_length {head_dim}; not supported"),
            ));
        }
    }
    let rotary_dim = match meta.usize_opt(&key("rope.dimension_count"))? {
        None => head_dim,
        Some(d) if d == head_dim => d,
        // Partial rotation is Phi's (Phi-4-mini's 0.75); elsewhere it would be silently wrong.
        Some(d) if family == Family::Phi3 && d >= 2 && d < head_dim && d.is_multiple_of(2) => d,
        Some(d) => {
            return Err(meta.err(
                &key("rope.dimension_count"),
                format!("{d}: partial rotary embeddings (head size {head_dim}) are not supported"),
            ))
        }
    };

    let rope_theta = meta.f64_opt(&key("rope.freq_base"))?.unwrap_or(10000.0);
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(meta.err(&key("rope.freq_base"), "must be a positive number"));
    }
    let scaling_type = meta.str_opt(&key("rope.scaling.type"))?.unwrap_or("none");
    let stated_context = meta.usize_opt(&key("context_length"))?.unwrap_or(2048);
    let rope_scaling = match (scaling_type, factors.freqs) {
        _ if factors.long.is_some() || factors.short.is_some() => long_rope(
            meta,
            arch,
            stated_context,
            rotary_dim,
            factors.long,
            factors.short,
        )?,
        (_, Some(factors)) => {
            if factors.len() != head_dim / 2 || factors.iter().any(|f| f.is_nan() || *f <= 0.0) {
                return Err(meta.err(
                    "rope_freqs.weight",
                    format!("expected {} positive factors", head_dim / 2),
                ));
            }
            RopeScaling::Factors(factors)
        }
        ("none", None) => RopeScaling::None,
        ("linear", None) => {
            let factor = meta
                .f64_opt(&key("rope.scaling.factor"))?
                .ok_or_else(|| meta.err(&key("rope.scaling.factor"), "missing"))?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(meta.err(&key("rope.scaling.factor"), "must be a positive number"));
            }
            RopeScaling::Linear { factor }
        }
        ("yarn", None) => {
            let positive = |name: &str| -> Result<Option<f64>> {
                match meta.f64_opt(&key(name))? {
                    Some(x) if !(x.is_finite() && x > 0.0) => {
                        Err(meta.err(&key(name), "must be a positive number"))
                    }
                    x => Ok(x),
                }
            };
            // DeepSeek's and gpt-oss's variants change the attention factor in ways of their
            // own: refused rather than run with the wrong scale.
            for name in [
                "rope.scaling.yarn_log_multiplier",
                "rope.scaling.yarn_attn_factor",
            ] {
                if meta.contains(&key(name)) {
                    return Err(meta.err(&key(name), "not supported"));
                }
            }
            let factor = positive("rope.scaling.factor")?
                .ok_or_else(|| meta.err(&key("rope.scaling.factor"), "missing"))?;
            let original = match positive("rope.scaling.original_context_length")? {
                Some(n) => n,
                None => meta.usize_opt(&key("context_length"))?.unwrap_or(2048) as f64,
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: positive("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                beta_slow: positive("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                attention_factor: yarn_mscale(factor, 1.0),
                truncate: true,
            }
        }
        (other, None) => {
            return Err(meta.err(
                &key("rope.scaling.type"),
                format!("unsupported rope scaling {other:?} (supported: none, linear, yarn)"),
            ))
        }
    };
    let context = rope_scaling.context(stated_context);
    let eps = meta
        .f64_opt(&key("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| meta.err(&key("attention.layer_norm_rms_epsilon"), "missing"))?;
    if eps.is_nan() || eps <= 0.0 {
        return Err(meta.err(&key("attention.layer_norm_rms_epsilon"), "must be > 0"));
    }
    let vocab_size = meta.usize_opt(&key("vocab_size"))?.unwrap_or(vocab_size);
    if vocab_size == 0 || vocab_size > MAX_VOCAB {
        return Err(meta.err(
            &key("vocab_size"),
            format!("{vocab_size} is not in 1..={MAX_VOCAB}"),
        ));
    }
    let sliding_window = meta
        .usize_opt(&key("attention.sliding_window"))?
        .filter(|&w| w > 0);
    let gemma = family == Family::Gemma3;
    let moe = experts(meta, arch, num_layers)?;
    // Mixtral files use the llama architecture, with experts.
    let family = match (family, &moe) {
        (Family::Llama, Some(_)) => Family::Mixtral,
        _ => family,
    };
    // Gemma 3 files say neither which layers slide nor the sliding layers' RoPE base nor the
    // attention scale: llama.cpp fixes them by architecture (with a window: every sixth layer
    // global, the others on base 10000 unscaled; 1/sqrt(head size) but for the 27B's 62
    // layers, whose query_pre_attn_scalar is hidden / heads), and so does this.
    let gemma_window = gemma && sliding_window.is_some();
    let sliding_layers = if gemma_window {
        (0..num_layers).map(|l| (l + 1) % 6 != 0).collect()
    } else {
        vec![sliding_window.is_some(); num_layers]
    };
    let local_rope = if gemma_window {
        let theta = meta.f64_opt(&key("rope.freq_base_swa"))?.unwrap_or(10000.0);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(meta.err(&key("rope.freq_base_swa"), "must be a positive number"));
        }
        Some(LocalRope {
            theta,
            scaling: RopeScaling::None,
        })
    } else {
        None
    };
    let query_pre_attn_scalar = if gemma && num_layers == 62 {
        (hidden_size / num_heads) as f32
    } else {
        head_dim as f32
    };
    let final_logit_softcap = match meta.f64_opt(&key("final_logit_softcapping"))? {
        Some(cap) if !(cap.is_finite() && cap > 0.0) => {
            return Err(meta.err(&key("final_logit_softcapping"), "must be a positive number"))
        }
        cap => cap.map(|c| c as f32),
    };
    Ok(ModelConfig {
        family,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rotary_dim,
        vocab_size,
        rms_norm_eps: eps as f32,
        rope_theta,
        rope_scaling,
        rope_pairing: pairing,
        max_position_embeddings: context.max(1),
        tie_word_embeddings: tied,
        qkv_bias: family == Family::Qwen2,
        o_bias: false,
        qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3),
        sliding_window,
        sliding_layers,
        activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        embed_scale: gemma.then(|| (hidden_size as f32).sqrt()),
        post_norms: gemma,
        query_pre_attn_scalar,
        final_logit_softcap,
        local_rope,
        moe,
    })
}

/// Phi-3's LongRoPE from its two factor tensors, the original context
/// (`rope.scaling.original_context_length`) and the attention factor
/// (`rope.scaling.attn_factor`).
fn long_rope(
    meta: &Metadata,
    arch: &str,
    context: usize,
    rotary_dim: usize,
    long: Option<Vec<f64>>,
    short: Option<Vec<f64>>,
) -> Result<RopeScaling> {
    let key = |k: &str| format!("{arch}.{k}");
    let check = |name: &str, factors: Option<Vec<f64>>| -> Result<Vec<f64>> {
        match factors {
            Some(f) if f.len() == rotary_dim / 2 && f.iter().all(|x| x.is_finite() && *x > 0.0) => {
                Ok(f)
            }
            _ => Err(meta.err(
                name,
                format!(
                    "expected {} positive factors (LongRoPE needs both rope_factors_long and \
                     rope_factors_short)",
                    rotary_dim / 2
                ),
            )),
        }
    };
    let long = check("rope_factors_long.weight", long)?;
    let short = check("rope_factors_short.weight", short)?;
    let original = match meta.usize_opt(&key("rope.scaling.original_context_length"))? {
        Some(0) => {
            return Err(meta.err(&key("rope.scaling.original_context_length"), "must be > 0"))
        }
        Some(n) => n as f64,
        None => context as f64,
    };
    // llama.cpp's default when the key is missing (its converter always writes it).
    let attention_factor = match meta.f64_opt(&key("rope.scaling.attn_factor"))? {
        Some(a) if !(a.is_finite() && a > 0.0) => {
            return Err(meta.err(
                &key("rope.scaling.attn_factor"),
                "must be a positive number",
            ))
        }
        Some(a) => a,
        None => 1.0,
    };
    Ok(RopeScaling::LongRope {
        short_factors: short,
        long_factors: long,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

/// The experts `<arch>.expert_count` and its companions describe (None without experts).
/// Which layers hold them is the file's tensors' to say (`Model::from_gguf`); here all do.
fn experts(meta: &Metadata, arch: &str, num_layers: usize) -> Result<Option<MoeConfig>> {
    let key = |k: &str| format!("{arch}.{k}");
    let num_experts = match meta.usize_opt(&key("expert_count"))? {
        None | Some(0) => return Ok(None),
        Some(n) if n > MAX_EXPERTS => {
            return Err(meta.err(
                &key("expert_count"),
                format!("{n} is more than {MAX_EXPERTS}"),
            ))
        }
        Some(n) => n,
    };
    let used = meta
        .usize_opt(&key("expert_used_count"))?
        .ok_or_else(|| meta.err(&key("expert_used_count"), "missing"))?;
    if used == 0 || used > num_experts {
        return Err(meta.err(
            &key("expert_used_count"),
            format!("{used} is not in 1..={num_experts}"),
        ));
    }
    // Qwen3-MoE names the experts' width; Mixtral's is the feed-forward length.
    let width = match meta.usize_opt(&key("expert_feed_forward_length"))? {
        Some(w) => w,
        None => meta.usize(&key("feed_forward_length"))?,
    };
    if width == 0 {
        return Err(meta.err(&key("expert_feed_forward_length"), "must be > 0"));
    }
    Ok(Some(MoeConfig {
        num_experts,
        experts_per_token: used,
        expert_intermediate_size: width,
        // llama.cpp renormalizes the k weights of both unless the file says otherwise.
        renormalize: meta.bool_opt(&key("expert_weights_norm"))?.unwrap_or(true),
        sparse_layers: vec![true; num_layers],
    }))
}
