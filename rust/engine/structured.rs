//! Structured output: a grammar (a JSON schema, any JSON object, a regex, a choice of strings, a
//! Lark grammar) that every sampled token must keep satisfiable. llguidance compiles the grammar
//! and computes each step's mask of allowed tokens; the sampler then picks among those only.
//!
//! One `Grammars` per engine holds llguidance's parser factory, built on first use from the
//! model's tokenizer (the bytes of every token, and the tokenizer itself for the grammar's
//! literals). A request's grammar is compiled on the caller's side, so a bad one is refused
//! before it queues, naming the field; each choice of the request gets its own `Constraint`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value as Json;

use crate::error::{Result, StrataError};
use crate::model::tokenizer::Tokenizer;

/// Which tokens may come next: one bit per token of the model's vocabulary.
pub type Mask = SimpleVob;

/// What a request constrains its output to: vLLM's `structured_outputs` fields, one at a time.
#[derive(Clone, Debug, PartialEq)]
pub enum StructuredOutput {
    /// Output that parses as JSON and validates against this schema.
    Json(Json),
    /// Output that parses as one JSON object (OpenAI's `{"type": "json_object"}`).
    JsonObject,
    /// Output that matches this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Output that is exactly one of these strings.
    Choice(Vec<String>),
    /// Output in the language of this Lark grammar (llguidance's dialect).
    Grammar(String),
}

const KINDS: &str = "json, json_object, regex, choice or grammar";

impl StructuredOutput {
    /// From the caller's object, vLLM's `structured_outputs`: exactly one of `json` (a schema, as
    /// an object, a bool or its JSON text), `json_object: true`, `regex`, `choice` (a list of
    /// strings) or `grammar` (Lark) set; keys set to null count as unset.
    pub fn from_json(v: &Json) -> Result<StructuredOutput> {
        const FIELD: &str = "structured_outputs";
        let obj = v.as_object().ok_or_else(|| {
            StrataError::invalid(FIELD, format!("must be an object with one of {KINDS}"))
        })?;
        let set: Vec<(&String, &Json)> = obj.iter().filter(|(_, v)| !v.is_null()).collect();
        let (key, value) = match set.as_slice() {
            [one] => *one,
            [] => {
                return Err(StrataError::invalid(
                    FIELD,
                    format!("must set one of {KINDS}"),
                ))
            }
            many => {
                let keys: Vec<&str> = many.iter().map(|(k, _)| k.as_str()).collect();
                return Err(StrataError::invalid(
                    FIELD,
                    format!("must set only one of {KINDS}, got {}", keys.join(", ")),
                ));
            }
        };
        let field = format!("{FIELD}.{key}");
        let text = |what: &str| {
            value
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| StrataError::invalid(&field, format!("must be {what}")))
        };
        Ok(match key.as_str() {
            "json" => StructuredOutput::Json(match value {
                Json::String(s) => serde_json::from_str(s)
                    .map_err(|e| StrataError::invalid(&field, format!("is not valid JSON: {e}")))?,
                Json::Object(_) | Json::Bool(_) => value.clone(),
                _ => {
                    return Err(StrataError::invalid(
                        &field,
                        "must be a JSON schema: an object, a bool, or its JSON text",
                    ))
                }
            }),
            "json_object" => match value {
                Json::Bool(true) => StructuredOutput::JsonObject,
                _ => return Err(StrataError::invalid(&field, "must be true")),
            },
            "regex" => StructuredOutput::Regex(text("a string")?),
            "grammar" => StructuredOutput::Grammar(text("a string (a Lark grammar)")?),
            "choice" => {
                let items = value
                    .as_array()
                    .ok_or_else(|| StrataError::invalid(&field, "must be a list of strings"))?;
                let options = items
                    .iter()
                    .map(|i| i.as_str().map(str::to_string))
                    .collect::<Option<Vec<String>>>()
                    .ok_or_else(|| StrataError::invalid(&field, "must be a list of strings"))?;
                if options.is_empty() {
                    return Err(StrataError::invalid(&field, "must not be empty"));
                }
                StructuredOutput::Choice(options)
            }
            other => {
                return Err(StrataError::invalid(
                    format!("{FIELD}.{other}"),
                    format!("unknown; set one of {KINDS}"),
                ))
            }
        })
    }

    /// The caller's name for this kind (`structured_outputs.<field>`).
    pub fn field(&self) -> &'static str {
        match self {
            StructuredOutput::Json(_) => "structured_outputs.json",
            StructuredOutput::JsonObject => "structured_outputs.json_object",
            StructuredOutput::Regex(_) => "structured_outputs.regex",
            StructuredOutput::Choice(_) => "structured_outputs.choice",
            StructuredOutput::Grammar(_) => "structured_outputs.grammar",
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        match self {
            StructuredOutput::Json(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            StructuredOutput::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
            StructuredOutput::Choice(options) => {
                let alternatives: Vec<String> =
                    options.iter().map(|o| regex_syntax::escape(o)).collect();
                TopLevelGrammar::from_regex(&alternatives.join("|"))
            }
            StructuredOutput::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// The model's tokenizer as llguidance sees it: a trie of every token's bytes, and the
/// tokenizer for the grammar's literal strings.
struct EngineTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for EngineTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Asked for a grammar's literals and for bytes it forces, which can end inside a UTF-8
        // character: valid text goes through the tokenizer, any other bytes through the trie
        // (a lossy conversion would turn them into U+FFFD's bytes). A tokenizer error also
        // falls back to the trie.
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// The engine's grammar compiler: llguidance's parser factory for this model's tokenizer.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    factory: OnceLock<std::result::Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Self {
        Grammars {
            tokenizer,
            vocab_size,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self, field: &str) -> Result<&Arc<ParserFactory>> {
        self.factory
            .get_or_init(|| build_factory(&self.tokenizer, self.vocab_size))
            .as_ref()
            .map_err(|why| {
                StrataError::invalid(field, format!("this model's tokenizer cannot: {why}"))
            })
    }

    /// Compiles `output` for one request; the error names the field and llguidance's reason.
    pub fn compile(&self, output: &StructuredOutput) -> Result<Constraint> {
        let field = output.field();
        let factory = self.factory(field)?;
        let grammar = output.grammar();
        let parser = guarded(|| factory.create_parser(grammar))
            .map_err(|why| StrataError::invalid(field, why))?
            .map_err(|e| StrataError::invalid(field, format!("cannot compile: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(StrataError::invalid(field, format!("cannot compile: {e}")));
        }
        Ok(Constraint {
            matcher: Box::new(matcher),
        })
    }
}

fn build_factory(
    tokenizer: &Arc<Tokenizer>,
    vocab_size: usize,
) -> std::result::Result<Arc<ParserFactory>, String> {
    let json: Json = serde_json::from_str(&tokenizer.to_json()?)
        .map_err(|e| format!("its tokenizer JSON does not parse: {e}"))?;
    let mut words = guarded(|| llguidance::token_bytes_from_tokenizer_json(&json))?
        .map_err(|e| format!("token bytes: {e}"))?;
    // Embedding rows past the tokenizer's vocabulary have no bytes: never allowed.
    if words.len() > vocab_size {
        return Err(format!(
            "the tokenizer has {} tokens, the model {vocab_size}",
            words.len()
        ));
    }
    words.resize(vocab_size, Vec::new());
    let eos = tokenizer.eos_token_ids();
    let first_eos = *eos.first().ok_or("the tokenizer names no EOS token")?;
    let trie =
        TokTrie::from(&TokRxInfo::new(vocab_size as u32, first_eos), &words).with_eos_tokens(eos);
    let env: TokEnv = Arc::new(EngineTokEnv {
        trie,
        tokenizer: tokenizer.clone(),
    });
    let mut factory =
        guarded(|| ParserFactory::new_simple(&env))?.map_err(|e| format!("parser factory: {e}"))?;
    factory.quiet();
    Ok(Arc::new(factory))
}

/// llguidance asserts on inputs it does not expect; an assertion is a refusal here, not a crash.
fn guarded<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "llguidance failed".into())
    })
}

/// One sequence's grammar state: which tokens may come next, advanced by each sampled token.
#[derive(Clone)]
pub struct Constraint {
    // Boxed: the parser state is large, and requests and sequences move through channels.
    matcher: Box<Matcher>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// An independent copy in the same state (for the request's other choices).
    pub fn fork(&self) -> Constraint {
        Constraint {
            matcher: Box::new(self.matcher.deep_clone()),
        }
    }

    /// The tokens allowed next: the grammar's, or only EOS once the grammar is complete.
    pub fn mask(&mut self) -> Result<Mask> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| StrataError::Internal(format!("structured output: {e}")))
    }

    /// Advances past a sampled token. True when the grammar is complete (nothing may follow).
    pub fn accept(&mut self, token: u32) -> Result<bool> {
        self.matcher
            .consume_token(token)
            .map_err(|e| StrataError::Internal(format!("structured output: {e}")))?;
        Ok(self.matcher.is_stopped())
    }
}

/// Sets every logit the mask does not allow to -inf.
pub fn apply_mask(mask: &Mask, logits: &mut [f32]) {
    mask.iter_unset_entries(|t| {
        if let Some(x) = logits.get_mut(t) {
            *x = f32::NEG_INFINITY;
        }
    });
}
