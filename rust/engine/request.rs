//! What a caller submits (a prompt and its `SamplingParams`) and what comes back on its stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::structured::{Constraint, StructuredOutput};
use crate::error::{Result, StrataError};

/// Most alternatives a caller may ask for with each token (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;
/// Most choices per request.
pub const MAX_N: usize = 64;

/// How to pick tokens and when to stop; validated before a request is queued.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Most tokens to generate; `None`: until the context is full.
    pub max_tokens: Option<usize>,
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of tokens seen in the prompt or output; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token in the output so far.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the output so far.
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Alternatives to report with each token's log-probability; `None`: no logprobs.
    pub logprobs: Option<usize>,
    pub n: usize,
    pub skip_special_tokens: bool,
    /// A grammar the output must follow; compiled when the request is submitted.
    pub structured_outputs: Option<StructuredOutput>,
    /// Added to a token's logit before sampling (OpenAI's `logit_bias`, in [-100, 100]): -100
    /// all but bans a token, 100 all but forces it. Logprobs stay those of the raw logits.
    pub logit_bias: Vec<(u32, f32)>,
    /// Whether this request may decode with drafts when the engine drafts (`speculative`);
    /// false decodes it one token a step.
    pub speculative: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: None,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            n: 1,
            skip_special_tokens: true,
            structured_outputs: None,
            logit_bias: Vec::new(),
            speculative: true,
        }
    }
}

impl SamplingParams {
    /// Checks every field against its range; the error names the field and the reason.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        if self.max_tokens == Some(0) {
            return Err(StrataError::invalid("max_tokens", "must be at least 1"));
        }
        for (field, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repetition_penalty", self.repetition_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            check_float(field, f64::from(v), v)?;
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err(StrataError::invalid(
                "stop",
                "must not contain an empty string",
            ));
        }
        if let Some(bad) = self
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= vocab_size)
        {
            return Err(StrataError::invalid(
                "stop_token_ids",
                format!("token id {bad} is outside the vocabulary (size {vocab_size})"),
            ));
        }
        for &(token, bias) in &self.logit_bias {
            let field = format!("logit_bias[{token}]");
            if token as usize >= vocab_size {
                return Err(StrataError::invalid(
                    field,
                    format!("token id {token} is outside the vocabulary (size {vocab_size})"),
                ));
            }
            if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
                return Err(StrataError::invalid(
                    field,
                    format!("must be a number in [-100, 100], got {bias}"),
                ));
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return Err(StrataError::invalid(
                    "logprobs",
                    format!("must be at most {MAX_LOGPROBS}, got {n}"),
                ));
            }
        }
        if self.n == 0 || self.n > MAX_N {
            return Err(StrataError::invalid(
                "n",
                format!("must be in 1..={MAX_N}, got {}", self.n),
            ));
        }
        Ok(())
    }
}

/// Checks a float sampling parameter against its range: `v` is compared, `shown` is what the
/// error prints. The Python binding checks the number the caller sent (an f64) before rounding it
/// to f32, so that 1.0000000000000002 is over top_p's 1 although it rounds to 1.0; `validate`
/// checks the f32.
pub fn check_float(field: &str, v: f64, shown: impl std::fmt::Display) -> Result<()> {
    if !v.is_finite() {
        return Err(StrataError::invalid(
            field,
            format!("must be a finite number, got {shown}"),
        ));
    }
    let (ok, range) = match field {
        "temperature" => (v >= 0.0, "must be >= 0"),
        "top_p" => (v > 0.0 && v <= 1.0, "must be in (0, 1]"),
        "min_p" => ((0.0..=1.0).contains(&v), "must be in [0, 1]"),
        "repetition_penalty" => (v > 0.0, "must be > 0"),
        "presence_penalty" | "frequency_penalty" => {
            ((-2.0..=2.0).contains(&v), "must be in [-2, 2]")
        }
        _ => (true, ""),
    };
    if ok {
        Ok(())
    } else {
        Err(StrataError::invalid(field, format!("{range}, got {shown}")))
    }
}

/// A number for an error message: exponent notation when plain digits would be long
/// (`1e300`, `-1e-50`), else as Display writes it (`1.5`, `-1`).
pub fn float_text(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-5..1e16).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

/// Roles a chat message may have.
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Checks the shape of chat messages before the template sees them: a non-empty list of objects,
/// each with a known `role` and a `content` that is text, a list of parts, or (for an assistant
/// message with tool calls) null.
pub fn validate_messages(messages: &serde_json::Value) -> Result<()> {
    let list = messages
        .as_array()
        .ok_or_else(|| StrataError::invalid("messages", "must be a list of messages"))?;
    if list.is_empty() {
        return Err(StrataError::invalid("messages", "must not be empty"));
    }
    for (i, m) in list.iter().enumerate() {
        let field = |name: &str| format!("messages[{i}].{name}");
        let obj = m.as_object().ok_or_else(|| {
            StrataError::invalid(
                format!("messages[{i}]"),
                "must be an object with role and content",
            )
        })?;
        let role = obj
            .get("role")
            .and_then(|r| r.as_str())
            .ok_or_else(|| StrataError::invalid(field("role"), "must be a string"))?;
        if !ROLES.contains(&role) {
            return Err(StrataError::invalid(
                field("role"),
                format!(
                    "unknown role {role:?} (expected one of {})",
                    ROLES.join(", ")
                ),
            ));
        }
        match obj.get("content") {
            Some(serde_json::Value::String(_)) | Some(serde_json::Value::Array(_)) => {}
            Some(serde_json::Value::Null) | None
                if role == "assistant" && obj.contains_key("tool_calls") => {}
            _ => {
                return Err(StrataError::invalid(
                    field("content"),
                    "must be a string or a list of content parts",
                ))
            }
        }
    }
    Ok(())
}

/// Why a choice ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    /// The caller went away or cancelled.
    Cancelled,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Summed over choices.
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the cache instead of a prefill.
    pub cached_tokens: usize,
    /// Draft tokens proposed and accepted (speculative decoding), summed over choices.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
}

/// The log-probability of one generated token and its most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// A prompt token's entry (`Engine::prompt_logprobs`): as a generated token's, with its rank.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptTokenLogprob {
    pub logprob: TokenLogprob,
    /// 1 + how many tokens were more likely at its position.
    pub rank: usize,
}

/// One step's output for one choice.
#[derive(Clone, Debug, PartialEq)]
pub struct Delta {
    /// Choice index, `0..n`.
    pub index: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    /// One entry per token id when logprobs were asked for.
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: Option<FinishReason>,
    /// Set on the request's last delta (its last choice finished).
    pub usage: Option<Usage>,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum Event {
    Delta(Delta),
    /// The engine failed or stopped; the stream ends with this.
    Error(StrataError),
}

/// Set by the caller's side when it stops listening; the engine frees the sequence's blocks at
/// its next step.
#[derive(Clone, Debug, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A validated request on its way to the engine thread.
#[derive(Debug)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// `params.structured_outputs`, compiled.
    pub constraint: Option<Constraint>,
    pub events: UnboundedSender<Event>,
    pub cancel: CancelFlag,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(p: SamplingParams) -> String {
        p.validate(100).unwrap_err().to_string()
    }

    #[test]
    fn messages_are_checked() {
        let check = |v: serde_json::Value| validate_messages(&v).map_err(|e| e.to_string());
        check(serde_json::json!([{"role": "user", "content": "hi"}])).unwrap();
        check(serde_json::json!([{"role": "assistant", "content": null, "tool_calls": []}]))
            .unwrap();
        assert_eq!(
            check(serde_json::json!([])).unwrap_err(),
            "messages: must not be empty"
        );
        assert_eq!(
            check(serde_json::json!({"role": "user"})).unwrap_err(),
            "messages: must be a list of messages"
        );
        assert_eq!(
            check(serde_json::json!([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]))
                .unwrap_err(),
            "messages[1].role: unknown role \"robot\" (expected one of system, developer, user, assistant, tool)"
        );
        assert_eq!(
            check(serde_json::json!([{"content": "a"}])).unwrap_err(),
            "messages[0].role: must be a string"
        );
        assert_eq!(
            check(serde_json::json!([{"role": "user", "content": 5}])).unwrap_err(),
            "messages[0].content: must be a string or a list of content parts"
        );
        assert_eq!(
            check(serde_json::json!(["hi"])).unwrap_err(),
            "messages[0]: must be an object with role and content"
        );
    }

    #[test]
    fn float_ranges_are_checked_before_rounding_to_f32() {
        let check =
            |field: &str, v: f64| check_float(field, v, float_text(v)).map_err(|e| e.to_string());
        // 1.0000000000000002 rounds to 1.0f32, inside top_p's range; the number sent is not.
        assert_eq!(1.000_000_000_000_000_2_f64 as f32, 1.0);
        assert_eq!(
            check("top_p", 1.000_000_000_000_000_2).unwrap_err(),
            "top_p: must be in (0, 1], got 1.0000000000000002"
        );
        assert_eq!(
            check("temperature", -1e-50).unwrap_err(),
            "temperature: must be >= 0, got -1e-50"
        );
        assert_eq!(
            check("presence_penalty", 2.000_000_000_000_000_4).unwrap_err(),
            "presence_penalty: must be in [-2, 2], got 2.0000000000000004"
        );
        check("top_p", 1.0).unwrap();
        check("min_p", 0.0).unwrap();
        check("repetition_penalty", 1e-50).unwrap();
        check("frequency_penalty", -2.0).unwrap();
        assert_eq!(
            check("temperature", -1e300).unwrap_err(),
            "temperature: must be >= 0, got -1e300"
        );
        assert_eq!(float_text(-1.0), "-1");
        assert_eq!(float_text(0.25), "0.25");
        assert_eq!(
            check("min_p", f64::NAN).unwrap_err(),
            "min_p: must be a finite number, got NaN"
        );
    }

    #[test]
    fn defaults_are_valid() {
        SamplingParams::default().validate(100).unwrap();
    }

    #[test]
    fn each_bad_field_is_named() {
        let d = SamplingParams::default;
        assert_eq!(
            invalid(SamplingParams {
                max_tokens: Some(0),
                ..d()
            }),
            "max_tokens: must be at least 1"
        );
        assert_eq!(
            invalid(SamplingParams {
                temperature: f32::NAN,
                ..d()
            }),
            "temperature: must be a finite number, got NaN"
        );
        assert_eq!(
            invalid(SamplingParams {
                temperature: -0.5,
                ..d()
            }),
            "temperature: must be >= 0, got -0.5"
        );
        assert_eq!(
            invalid(SamplingParams { top_p: 0.0, ..d() }),
            "top_p: must be in (0, 1], got 0"
        );
        assert_eq!(
            invalid(SamplingParams { top_p: 1.5, ..d() }),
            "top_p: must be in (0, 1], got 1.5"
        );
        assert_eq!(
            invalid(SamplingParams { min_p: -0.1, ..d() }),
            "min_p: must be in [0, 1], got -0.1"
        );
        assert_eq!(
            invalid(SamplingParams {
                repetition_penalty: 0.0,
                ..d()
            }),
            "repetition_penalty: must be > 0, got 0"
        );
        assert_eq!(
            invalid(SamplingParams {
                presence_penalty: 2.5,
                ..d()
            }),
            "presence_penalty: must be in [-2, 2], got 2.5"
        );
        assert_eq!(
            invalid(SamplingParams {
                frequency_penalty: f32::INFINITY,
                ..d()
            }),
            "frequency_penalty: must be a finite number, got inf"
        );
        assert_eq!(
            invalid(SamplingParams {
                stop: vec!["a".into(), String::new()],
                ..d()
            }),
            "stop: must not contain an empty string"
        );
        assert_eq!(
            invalid(SamplingParams {
                stop_token_ids: vec![3, 100],
                ..d()
            }),
            "stop_token_ids: token id 100 is outside the vocabulary (size 100)"
        );
        assert_eq!(
            invalid(SamplingParams {
                logprobs: Some(21),
                ..d()
            }),
            "logprobs: must be at most 20, got 21"
        );
        assert_eq!(
            invalid(SamplingParams { n: 0, ..d() }),
            "n: must be in 1..=64, got 0"
        );
    }
}
