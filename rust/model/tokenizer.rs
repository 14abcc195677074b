//! Text <-> token ids and chat-template rendering for a Hugging Face model folder.
//!
//! Encoding and decoding are delegated to the `tokenizers` crate (the same code
//! transformers' fast tokenizers run). Chat templates are rendered with minijinja,
//! configured to behave like the Jinja2 environment transformers builds in
//! `apply_chat_template`: trim_blocks, lstrip_blocks, loop controls, Python string
//! methods, `raise_exception`, `strftime_now` and transformers' own `tojson`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::ErrorKind as IoErrorKind;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error as JinjaError, ErrorKind, Output, State, Value};
use serde_json::Value as Json;

use crate::error::{Result, StrataError};

const TEMPLATE_NAME: &str = "chat_template";

/// The special-token fields of tokenizer_config.json that transformers passes to the
/// template (its `special_tokens_map`), so templates can say `{{ bos_token }}`.
const SPECIAL_TOKEN_FIELDS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

/// Either a compiled template or the reason there is none (reported on use, not at
/// load: a model without a template can still serve plain completions).
enum ChatTemplate {
    Compiled(Box<Environment<'static>>),
    Missing(String),
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    /// Template variables: field name -> token string (only the tokens that are set).
    special_tokens: BTreeMap<String, String>,
    chat: ChatTemplate,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("bos_token_id", &self.bos_token_id)
            .field("has_chat_template", &self.has_chat_template())
            .finish()
    }
}

impl Tokenizer {
    /// Reads dir/tokenizer.json (required), dir/tokenizer_config.json (optional),
    /// dir/chat_template.jinja (optional; wins over the config's template, as in
    /// transformers) and dir/generation_config.json (optional).
    pub fn load(dir: &Path) -> Result<Tokenizer> {
        let tok_path = dir.join("tokenizer.json");
        let tok_text = read_required(&tok_path)?;
        let mut inner = tokenizers::Tokenizer::from_str(&tok_text)
            .map_err(|e| StrataError::model_load(&tok_path, format!("invalid tokenizer: {e}")))?;

        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_json_object(&cfg_path)?.unwrap_or_default();

        let mut special_tokens = BTreeMap::new();
        for field in SPECIAL_TOKEN_FIELDS {
            if let Some(token) = special_token(&cfg_path, &cfg, field)? {
                special_tokens.insert(field.to_string(), token);
            }
        }

        rebuild_llama_post_processor(&mut inner, &cfg, &cfg_path, &special_tokens)?;

        let chat = load_chat_template(dir, &cfg_path, &cfg)?;

        let gen_path = dir.join("generation_config.json");
        let gen = read_json_object(&gen_path)?.unwrap_or_default();
        let mut eos_token_ids = match gen.get("eos_token_id") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(items)) => items
                .iter()
                .map(json_token_id)
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    StrataError::model_load(
                        &gen_path,
                        "eos_token_id: expected an integer or a list of integers",
                    )
                })?,
            Some(v) => vec![json_token_id(v).ok_or_else(|| {
                StrataError::model_load(
                    &gen_path,
                    "eos_token_id: expected an integer or a list of integers",
                )
            })?],
        };
        let eos_from_config = special_tokens
            .get("eos_token")
            .and_then(|t| inner.token_to_id(t));
        if let Some(id) = eos_from_config {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        let gen_bos = match gen.get("bos_token_id") {
            None | Some(Json::Null) => None,
            Some(v) => Some(json_token_id(v).ok_or_else(|| {
                StrataError::model_load(&gen_path, "bos_token_id: expected an integer")
            })?),
        };
        // The token the tokenizer itself inserts wins; generation_config is the fallback.
        let bos_token_id = special_tokens
            .get("bos_token")
            .and_then(|t| inner.token_to_id(t))
            .or(gen_bos);

        // get_vocab_size(true) builds a map; do it once.
        let vocab_size = inner.get_vocab_size(true);

        Ok(Tokenizer {
            inner,
            vocab_size,
            eos_token_ids,
            bos_token_id,
            special_tokens,
            chat,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| StrataError::invalid("text", format!("cannot encode: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Unknown ids are an error (the tokenizers crate would silently drop them).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.decode_checked(ids, skip_special_tokens)
    }

    fn check_id(&self, id: u32) -> Result<()> {
        if self.inner.id_to_token(id).is_none() {
            return Err(StrataError::invalid(
                "token_ids",
                format!(
                    "unknown token id {id} (vocabulary size {})",
                    self.vocab_size
                ),
            ));
        }
        Ok(())
    }

    /// Decode ids already known to be in the vocabulary.
    fn decode_checked(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| StrataError::invalid("token_ids", format!("cannot decode: {e}")))
    }

    /// Renders the model's chat template as transformers'
    /// `apply_chat_template(tokenize=False)` does. `extra` holds further template
    /// variables (tools, documents, enable_thinking, ...) as a JSON object.
    pub fn apply_chat_template(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<String> {
        let env = match &self.chat {
            ChatTemplate::Compiled(env) => env,
            ChatTemplate::Missing(reason) => {
                return Err(StrataError::invalid("messages", reason.clone()))
            }
        };
        check_messages(messages)?;

        // Same variables as transformers' render call: special tokens, tools and
        // documents (None unless given), caller kwargs, then the two fixed ones.
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Value::from(v.as_str()));
        }
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        match extra {
            None | Some(Json::Null) => {}
            Some(Json::Object(map)) => {
                for (k, v) in map {
                    if k == "messages" || k == "add_generation_prompt" {
                        return Err(StrataError::invalid(
                            "extra",
                            format!("\"{k}\" cannot be set as an extra template variable"),
                        ));
                    }
                    ctx.insert(k.clone(), Value::from_serialize(v));
                }
            }
            Some(_) => {
                return Err(StrataError::invalid("extra", "expected a JSON object"));
            }
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );

        let template = env.get_template(TEMPLATE_NAME).map_err(|e| {
            StrataError::Internal(format!("compiled chat template is missing: {e}"))
        })?;
        template.render(ctx).map_err(render_error)
    }

    pub fn has_chat_template(&self) -> bool {
        matches!(self.chat, ChatTemplate::Compiled(_))
    }

    /// Vocabulary size including added tokens (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Union of generation_config's eos ids and the eos_token's id.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

/// Incremental detokenization for streaming. Each push decodes a small window: the
/// text of the ids since the last emitted boundary, minus the text those ids had
/// before the new one. The window keeps context for decoders that treat the first
/// token specially (SentencePiece's leading space), and text is held back while it
/// ends in U+FFFD, i.e. while a byte-level token has left a UTF-8 character unfinished.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the window whose text has already been emitted up to `read_offset`.
    prefix_offset: usize,
    /// Ids before this index have been emitted.
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDecoder {
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// The new text, possibly "".
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        tok.check_id(id)?;
        self.ids.push(id);
        let skip = self.skip_special_tokens;
        let prefix = tok.decode_checked(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = tok.decode_checked(&self.ids[self.prefix_offset..], skip)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(piece) = full.strip_prefix(prefix.as_str()) else {
            // The decoder rewrote earlier text; wait for flush rather than emit a
            // piece that would not concatenate to the full decode.
            return Ok(String::new());
        };
        let piece = piece.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Ids before the window are never decoded again.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        Ok(piece)
    }

    /// Whatever is left at the end (an unfinished character comes out as U+FFFD, as
    /// in a full decode). The decoder is reset afterwards.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let skip = self.skip_special_tokens;
        let prefix = tok.decode_checked(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = tok.decode_checked(&self.ids[self.prefix_offset..], skip)?;
        let rest = match full.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_string(),
            None => {
                // Emit from the longest common prefix that ends on a char boundary.
                let mut common = full
                    .bytes()
                    .zip(prefix.bytes())
                    .take_while(|(a, b)| a == b)
                    .count();
                while !full.is_char_boundary(common) {
                    common -= 1;
                }
                full[common..].to_string()
            }
        };
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(rest)
    }
}

// ---------------------------------------------------------------------------
// Loading helpers
// ---------------------------------------------------------------------------

fn read_required(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| match e.kind() {
        IoErrorKind::NotFound => StrataError::model_load(path, "file not found"),
        _ => StrataError::model_load(path, format!("cannot read: {e}")),
    })
}

/// Ok(None) when the file does not exist.
fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == IoErrorKind::NotFound => Ok(None),
        Err(e) => Err(StrataError::model_load(path, format!("cannot read: {e}"))),
    }
}

fn read_json_object(path: &Path) -> Result<Option<serde_json::Map<String, Json>>> {
    let Some(text) = read_optional(path)? else {
        return Ok(None);
    };
    let value: Json = serde_json::from_str(&text)
        .map_err(|e| StrataError::model_load(path, format!("invalid JSON: {e}")))?;
    match value {
        Json::Object(map) => Ok(Some(map)),
        _ => Err(StrataError::model_load(path, "expected a JSON object")),
    }
}

/// A special token in tokenizer_config.json: a string, an AddedToken object
/// {"content": ...}, or null/absent.
fn special_token(
    cfg_path: &Path,
    cfg: &serde_json::Map<String, Json>,
    field: &str,
) -> Result<Option<String>> {
    match cfg.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(obj)) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(bad_special_token(cfg_path, field)),
        },
        Some(_) => Err(bad_special_token(cfg_path, field)),
    }
}

fn bad_special_token(cfg_path: &Path, field: &str) -> StrataError {
    StrataError::model_load(
        cfg_path,
        format!("{field}: expected a string or an object with \"content\""),
    )
}

fn json_token_id(v: &Json) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// transformers' LlamaTokenizerFast rebuilds the post-processor from add_bos_token
/// (default true) and add_eos_token (default false) whatever tokenizer.json says;
/// do the same so `encode(.., true)` gives the ids transformers gives.
fn rebuild_llama_post_processor(
    inner: &mut tokenizers::Tokenizer,
    cfg: &serde_json::Map<String, Json>,
    cfg_path: &Path,
    special_tokens: &BTreeMap<String, String>,
) -> Result<()> {
    let class = cfg
        .get("tokenizer_class")
        .and_then(Json::as_str)
        .unwrap_or("");
    let class = class.strip_suffix("Fast").unwrap_or(class);
    if class != "LlamaTokenizer" && class != "CodeLlamaTokenizer" {
        return Ok(());
    }
    let flag = |name: &str, default: bool| -> Result<bool> {
        match cfg.get(name) {
            None | Some(Json::Null) => Ok(default),
            Some(Json::Bool(b)) => Ok(*b),
            Some(_) => Err(StrataError::model_load(
                cfg_path,
                format!("{name}: expected true or false"),
            )),
        }
    };
    let add_bos = flag("add_bos_token", true)?;
    let add_eos = flag("add_eos_token", false)?;

    let mut specials: Vec<(String, u32)> = Vec::new();
    let mut lookup = |field: &str, wanted: bool| -> Result<Option<String>> {
        if !wanted {
            return Ok(None);
        }
        let token = special_tokens.get(field).ok_or_else(|| {
            StrataError::model_load(cfg_path, format!("{field}: required by add_{field}"))
        })?;
        let id = inner.token_to_id(token).ok_or_else(|| {
            StrataError::model_load(
                cfg_path,
                format!("{field}: {token:?} is not in the vocabulary"),
            )
        })?;
        specials.push((token.clone(), id));
        Ok(Some(token.clone()))
    };
    let bos = lookup("bos_token", add_bos)?;
    let eos = lookup("eos_token", add_eos)?;

    let with = |tok: &Option<String>, seq: u8, before: bool| match tok {
        Some(t) if before => format!("{t}:{seq} "),
        Some(t) => format!(" {t}:{seq}"),
        None => String::new(),
    };
    let single = format!("{}$A:0{}", with(&bos, 0, true), with(&eos, 0, false));
    let pair = format!(
        "{single} {}$B:1{}",
        with(&bos, 1, true),
        with(&eos, 1, false)
    );
    let processor = tokenizers::processors::template::TemplateProcessing::builder()
        .try_single(single.as_str())
        .and_then(|b| b.try_pair(pair.as_str()))
        .map_err(|e| StrataError::model_load(cfg_path, format!("add_bos_token: {e}")))?
        .special_tokens(specials)
        .build()
        .map_err(|e| StrataError::model_load(cfg_path, format!("add_bos_token: {e}")))?;
    inner.with_post_processor(Some(processor));
    Ok(())
}

fn load_chat_template(
    dir: &Path,
    cfg_path: &Path,
    cfg: &serde_json::Map<String, Json>,
) -> Result<ChatTemplate> {
    let jinja_path = dir.join("chat_template.jinja");
    let (source, origin): (String, PathBuf) =
        if let Some(text) = read_optional(&jinja_path)? {
            (text, jinja_path)
        } else {
            match cfg.get("chat_template") {
                None | Some(Json::Null) => {
                    return Ok(ChatTemplate::Missing(
                        "the model has no chat template".to_string(),
                    ))
                }
                Some(Json::String(s)) => (s.clone(), cfg_path.to_path_buf()),
                Some(Json::Array(items)) => {
                    let mut default = None;
                    for item in items {
                        let name = item.get("name").and_then(Json::as_str);
                        let template = item.get("template").and_then(Json::as_str);
                        let (Some(name), Some(template)) = (name, template) else {
                            return Err(bad_template_field(cfg_path));
                        };
                        if name == "default" {
                            default = Some(template.to_string());
                        }
                    }
                    match default {
                        Some(t) => (t, cfg_path.to_path_buf()),
                        None => return Ok(ChatTemplate::Missing(
                            "the model has several chat templates and none is named \"default\""
                                .to_string(),
                        )),
                    }
                }
                Some(_) => return Err(bad_template_field(cfg_path)),
            }
        };
    let env = build_environment(source)
        .map_err(|e| StrataError::model_load(&origin, format!("chat_template: {e}")))?;
    Ok(ChatTemplate::Compiled(Box::new(env)))
}

fn bad_template_field(cfg_path: &Path) -> StrataError {
    StrataError::model_load(
        cfg_path,
        "chat_template: expected a string or a list of {\"name\", \"template\"} objects",
    )
}

// ---------------------------------------------------------------------------
// The Jinja environment
// ---------------------------------------------------------------------------

/// Error source that marks a `raise_exception` call, so rendering can report the
/// template's own message to the caller.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn build_environment(source: String) -> std::result::Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    // jinja2 builtins that minijinja keeps in its contrib crate.
    env.add_filter("truncate", minijinja_contrib::filters::truncate);
    env.add_filter("striptags", minijinja_contrib::filters::striptags);
    env.add_filter("filesizeformat", minijinja_contrib::filters::filesizeformat);
    env.add_function("cycler", minijinja_contrib::globals::cycler);
    env.add_function("joiner", minijinja_contrib::globals::joiner);
    // Jinja2's tests duck-type: None is not iterable, strings and dicts are sequences.
    env.add_test("iterable", python_is_iterable);
    env.add_test("sequence", python_is_sequence);
    // What transformers adds.
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(&source))?;
    Ok(env)
}

/// Prints values the way Jinja2 does, i.e. with Python's str(): None, True/False,
/// float repr, and lists/dicts as Python reprs ("['a', None]", "{'k': 1}").
fn python_formatter(
    out: &mut Output,
    state: &State,
    value: &Value,
) -> std::result::Result<(), JinjaError> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            python_repr(&mut s, value)?;
            out.write_str(&s)?;
        }
        ValueKind::Number if !value.is_integer() => {
            out.write_str(&python_float_repr(f64::try_from(value.clone())?))?;
        }
        _ => minijinja::escape_formatter(out, state, value)?,
    }
    Ok(())
}

/// Jinja2's `iterable` test: iter(value) succeeds (Undefined iterates as empty).
fn python_is_iterable(value: &Value) -> bool {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        ValueKind::Undefined
        | ValueKind::String
        | ValueKind::Bytes
        | ValueKind::Seq
        | ValueKind::Map
        | ValueKind::Iterable => true,
        _ => value.try_iter().is_ok(),
    }
}

/// Jinja2's `sequence` test: has len() and [] (str, list, dict; Undefined too).
fn python_is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
    )
}

/// Python's repr() of a template value.
fn python_repr(out: &mut String, value: &Value) -> std::result::Result<(), JinjaError> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => {
            let _ = write!(out, "{value}");
        }
        ValueKind::Number => out.push_str(&python_float_repr(f64::try_from(value.clone())?)),
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or("")),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python's repr() of a str: single quotes unless the text has ' and no ".
fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(
        JinjaError::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedException(message)),
    )
}

fn render_error(err: JinjaError) -> StrataError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return StrataError::invalid("messages", raised.0.clone());
        }
        source = e.source();
    }
    StrataError::invalid("messages", format!("chat template failed: {err}"))
}

/// transformers' `{% generation %}...{% endgeneration %}` marks assistant text for
/// its training masks; rendering just emits the body, so turn the tags into an
/// always-true `if` (keeping any whitespace-control markers).
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // Search after the opening "{%" so "{%}" cannot end before it starts.
        let Some(end) = tag[2..].find("%}").map(|i| i + 2) else {
            break;
        };
        let inner = &tag[2..end];
        let open = if inner.starts_with(['-', '+']) {
            &inner[..1]
        } else {
            ""
        };
        let close = if inner.ends_with(['-', '+']) && inner.len() > open.len() {
            &inner[inner.len() - 1..]
        } else {
            ""
        };
        let word = inner[open.len()..inner.len() - close.len()].trim();
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str(&format!("{{%{open} {r} {close}%}}"));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

// ---------------------------------------------------------------------------
// tojson: transformers replaces Jinja's filter with
// json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
// (no HTML escaping, Python's default ", " / ": " separators).
// ---------------------------------------------------------------------------

struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, JinjaError> {
    let pick = |pos: Option<Value>, name: &str| -> std::result::Result<Option<Value>, JinjaError> {
        match pos {
            Some(v) => Ok(Some(v)),
            None => kwargs.get::<Option<Value>>(name),
        }
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = v.as_i64().ok_or_else(|| {
                    JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an int or a string",
                    )
                })?;
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            }
        },
    };
    let (item_sep, key_sep) = match pick(separators, "separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => match (a.as_str(), b.as_str()) {
                    (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                    _ => return Err(bad_separators()),
                },
                _ => return Err(bad_separators()),
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs
        .get::<Option<Value>>("sort_keys")?
        .is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn bad_separators() -> JinjaError {
    JinjaError::new(
        ErrorKind::InvalidOperation,
        "tojson: separators must be a pair of strings",
    )
}

fn not_serializable(value: &Value) -> JinjaError {
    JinjaError::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {} is not JSON serializable", value.kind()),
    )
}

fn write_newline(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> std::result::Result<(), JinjaError> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_json_number(out, value)?,
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or(""), style.ensure_ascii)
        }
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                write_newline(out, style, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            write_newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                write_newline(out, style, depth + 1);
                write_json_string(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, item, style, depth + 1)?;
            }
            write_newline(out, style, depth);
            out.push('}');
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// json.dumps turns str/int/float/bool/None keys into strings.
fn json_key(key: &Value) -> std::result::Result<String, JinjaError> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or("").to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::Number => {
            let mut s = String::new();
            write_json_number(&mut s, key)?;
            Ok(s)
        }
        _ => Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!(
                "keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

fn write_json_number(out: &mut String, value: &Value) -> std::result::Result<(), JinjaError> {
    if value.is_integer() {
        // Display of an integer Value is its decimal digits (covers i128/u128 too).
        let _ = write!(out, "{value}");
        return Ok(());
    }
    let f = f64::try_from(value.clone())?;
    out.push_str(&python_float_repr(f));
    Ok(())
}

/// Python's repr(float): shortest round-trip digits, exponent form outside 1e-4..1e16.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "d.ddde<exp>".
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if f < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let body = if exp >= 0 {
            let int_len = usize::try_from(exp).unwrap_or(0) + 1;
            if digits.len() <= int_len {
                format!("{digits}{}.0", "0".repeat(int_len - digits.len()))
            } else {
                format!("{}.{}", &digits[..int_len], &digits[int_len..])
            }
        } else {
            let zeros = usize::try_from(-exp - 1).unwrap_or(0);
            format!("0.{}{digits}", "0".repeat(zeros))
        };
        format!("{sign}{body}")
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------
// strftime_now
// ---------------------------------------------------------------------------

/// transformers' `strftime_now(fmt)` = datetime.now().strftime(fmt). Formatted in UTC
/// (no timezone database here); supports the common directives.
fn strftime_now(format: String) -> std::result::Result<String, JinjaError> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("clock error: {e}")))?;
    Ok(strftime(&format, i64::try_from(secs).unwrap_or(0)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// Format a Unix timestamp (UTC) with a strftime format.
fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday.
    let weekday = usize::try_from((days + 4).rem_euclid(7)).unwrap_or(0);
    let month_name = MONTHS[usize::try_from(month - 1).unwrap_or(0) % 12];
    let weekday_name = WEEKDAYS[weekday % 7];
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:>2}"),
            Some('-') => match chars.next() {
                // glibc's no-padding flag, e.g. %-d.
                Some('d') => write!(out, "{day}"),
                Some('m') => write!(out, "{month}"),
                Some('H') => write!(out, "{hour}"),
                Some('I') => write!(out, "{hour12}"),
                Some(other) => write!(out, "%-{other}"),
                None => write!(out, "%-"),
            },
            Some('b') | Some('h') => write!(out, "{}", &month_name[..3]),
            Some('B') => write!(out, "{month_name}"),
            Some('a') => write!(out, "{}", &weekday_name[..3]),
            Some('A') => write!(out, "{weekday_name}"),
            Some('w') => write!(out, "{weekday}"),
            Some('j') => write!(out, "{day_of_year:03}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{hour12:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('F') => write!(out, "{year}-{month:02}-{day:02}"),
            Some('T') => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            Some('Z') => write!(out, "UTC"),
            Some('z') => write!(out, "+0000"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of civil_from_days.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

// ---------------------------------------------------------------------------
// Input checks
// ---------------------------------------------------------------------------

fn check_messages(messages: &Json) -> Result<()> {
    let Json::Array(items) = messages else {
        return Err(StrataError::invalid(
            "messages",
            "expected a list of messages",
        ));
    };
    for (i, message) in items.iter().enumerate() {
        let Json::Object(obj) = message else {
            return Err(StrataError::invalid(
                "messages",
                format!("message {i} is not an object"),
            ));
        };
        match obj.get("role") {
            Some(Json::String(_)) => {}
            Some(_) => {
                return Err(StrataError::invalid(
                    "messages",
                    format!("message {i}: \"role\" must be a string"),
                ))
            }
            None => {
                return Err(StrataError::invalid(
                    "messages",
                    format!("message {i} has no \"role\""),
                ))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    /// GPT-2's byte -> printable char table used by byte-level BPE.
    fn byte_chars() -> Vec<char> {
        let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
        let mut table = vec!['\0'; 256];
        for &b in &printable {
            table[b as usize] = char::from_u32(b).unwrap_or('\0');
        }
        let mut next = 256u32;
        for b in 0..256u32 {
            if !printable.contains(&b) {
                table[b as usize] = char::from_u32(next).unwrap_or('\0');
                next += 1;
                printable.push(b);
            }
        }
        table
    }

    /// A byte-level BPE: ids 0..=255 are the bytes, 256.. merges, then the specials.
    fn tokenizer_json() -> Json {
        let chars = byte_chars();
        let mut vocab = serde_json::Map::new();
        for (i, c) in chars.iter().enumerate() {
            vocab.insert(c.to_string(), json!(i));
        }
        let e_acute = format!("{}{}", chars[0xC3], chars[0xA9]);
        let merges = [
            ("h".to_string(), "e".to_string()),
            ("l".to_string(), "l".to_string()),
            ("he".to_string(), "ll".to_string()),
            ("\u{120}".to_string(), "w".to_string()),
            (chars[0xC3].to_string(), chars[0xA9].to_string()),
        ];
        for (i, (a, b)) in merges.iter().enumerate() {
            vocab.insert(format!("{a}{b}"), json!(256 + i));
        }
        let _ = e_acute;
        let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        let added: Vec<Json> = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                json!({"id": 261 + i, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                                "trim_offsets": true, "use_regex": true});
        json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        })
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("write test file");
    }

    /// A model folder with tokenizer.json and the given tokenizer_config.json.
    fn folder(config: Option<Json>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        write(dir.path(), "tokenizer.json", &tokenizer_json().to_string());
        if let Some(cfg) = config {
            write(dir.path(), "tokenizer_config.json", &cfg.to_string());
        }
        dir
    }

    fn chatml_folder() -> tempfile::TempDir {
        folder(Some(json!({
            "chat_template": CHATML,
            "bos_token": null,
            "eos_token": {"content": "<|im_end|>", "special": true},
            "pad_token": "<|endoftext|>"
        })))
    }

    fn load(dir: &tempfile::TempDir) -> Tokenizer {
        Tokenizer::load(dir.path()).expect("load tokenizer")
    }

    fn load_err(dir: &tempfile::TempDir) -> String {
        match Tokenizer::load(dir.path()) {
            Ok(_) => panic!("load should fail"),
            Err(e) => {
                assert!(matches!(e, StrataError::ModelLoad { .. }), "{e:?}");
                e.to_string()
            }
        }
    }

    fn render(tok: &Tokenizer, messages: Json, extra: Option<Json>) -> Result<String> {
        tok.apply_chat_template(&messages, true, extra.as_ref())
    }

    #[test]
    fn round_trip_ascii_and_multibyte() {
        let dir = chatml_folder();
        let tok = load(&dir);
        for text in ["hello world", "héllo wörld 日本語 🎉", ""] {
            let ids = tok.encode(text, false).expect("encode");
            assert_eq!(tok.decode(&ids, false).expect("decode"), text);
        }
        // The merges apply: "hello" = "hell" + "o", " world" starts with "Ġw".
        let ids = tok.encode("hello world", false).expect("encode");
        assert_eq!(ids[0], 258);
        assert_eq!(ids[2], 259);
        assert_eq!(tok.encode("é", false).expect("encode"), vec![260]);
    }

    #[test]
    fn special_tokens_and_vocab() {
        let dir = chatml_folder();
        let tok = load(&dir);
        let ids = tok
            .encode("<|im_start|>hi<|im_end|><|endoftext|>", true)
            .expect("encode");
        assert_eq!(ids.first(), Some(&261));
        assert_eq!(&ids[ids.len() - 2..], &[262, 263]);
        assert_eq!(tok.vocab_size(), 264);
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(262));
        assert_eq!(tok.id_to_token(263).as_deref(), Some("<|endoftext|>"));
        assert_eq!(tok.id_to_token(264), None);
        // eos from tokenizer_config's object form; no bos.
        assert_eq!(tok.eos_token_ids(), &[262]);
        assert_eq!(tok.bos_token_id(), None);
        assert_eq!(tok.decode(&ids, true).expect("decode"), "hi");
    }

    #[test]
    fn decode_unknown_id_is_invalid_request() {
        let dir = chatml_folder();
        let tok = load(&dir);
        let err = tok.decode(&[1, 999], false).expect_err("unknown id");
        assert_eq!(
            err.to_string(),
            "token_ids: unknown token id 999 (vocabulary size 264)"
        );
        let mut dec = IncrementalDecoder::new(false);
        assert!(matches!(
            dec.push(&tok, 999),
            Err(StrataError::InvalidRequest { .. })
        ));
    }

    #[test]
    fn incremental_decoder_never_splits_characters() {
        let dir = chatml_folder();
        let tok = load(&dir);
        let text = "héllo wörld 日本語 🎉<|im_end|>";
        let ids = tok.encode(text, false).expect("encode");
        for skip in [false, true] {
            let mut dec = IncrementalDecoder::new(skip);
            let mut pieces = Vec::new();
            for &id in &ids {
                pieces.push(dec.push(&tok, id).expect("push"));
            }
            pieces.push(dec.flush(&tok).expect("flush"));
            for piece in &pieces {
                assert!(!piece.contains('\u{FFFD}'), "piece {piece:?}");
            }
            // Some ids are half a character, so some pushes yield nothing.
            assert!(pieces.iter().any(String::is_empty));
            assert_eq!(pieces.concat(), tok.decode(&ids, skip).expect("decode"));
        }
    }

    #[test]
    fn incremental_decoder_flushes_an_unfinished_character() {
        let dir = chatml_folder();
        let tok = load(&dir);
        let ids = tok.encode("a🎉", false).expect("encode");
        let cut = &ids[..ids.len() - 1];
        let mut dec = IncrementalDecoder::new(false);
        let mut out = String::new();
        for &id in cut {
            out.push_str(&dec.push(&tok, id).expect("push"));
        }
        assert_eq!(out, "a");
        out.push_str(&dec.flush(&tok).expect("flush"));
        assert_eq!(out, tok.decode(cut, false).expect("decode"));
        assert!(out.ends_with('\u{FFFD}'));
    }

    #[test]
    fn chatml_template_renders() {
        let dir = chatml_folder();
        let tok = load(&dir);
        assert!(tok.has_chat_template());
        let messages = json!([
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi"}
        ]);
        assert_eq!(
            render(&tok, messages.clone(), None).expect("render"),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            tok.apply_chat_template(&messages, false, None)
                .expect("render"),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn template_environment_matches_transformers() {
        let template = concat!(
            "{%- set ns = namespace(n=0) -%}\n",
            "{% for m in messages %}\n",
            "  {% if loop.index0 == 0 and m.role == 'system' %}{% continue %}{% endif %}\n",
            "[{{ m.role | upper }}:{{ m.content.strip() }}]{% if m.content.startswith(' x') %}!{% endif %}\n",
            "  {% set ns.n = ns.n + 1 %}\n",
            "{% endfor %}\n",
            "{{ ns.n }} {{ none }} {{ true }} {{ bos_token }}|{{ eos_token }}|{{ tools }}\n",
            "{{ meta | tojson }}\n",
            "{{ meta | tojson(indent=2) }}\n",
            "{{ 'a b'.split() }}{% for k, v in meta.items() %}{{ k }}={{ v }};{% endfor %}\n",
            "{% generation %}gen{% endgeneration %}",
        );
        let dir = folder(Some(json!({
            "chat_template": template, "bos_token": "<s>", "eos_token": "<|im_end|>"
        })));
        let tok = load(&dir);
        let messages = json!([
            {"role": "system", "content": "sys"},
            {"role": "user", "content": " x hi "},
            {"role": "assistant", "content": "ok"}
        ]);
        let extra = json!({"meta": {"a": 1.5, "b": [true, null, "é\"<\n"], "c": {}}});
        let out = render(&tok, messages, Some(extra)).expect("render");
        assert_eq!(
            out,
            concat!(
                "[USER:x hi]!",
                "[ASSISTANT:ok]",
                "2 None True <s>|<|im_end|>|None\n",
                "{\"a\": 1.5, \"b\": [true, null, \"é\\\"<\\n\"], \"c\": {}}\n",
                "{\n  \"a\": 1.5,\n  \"b\": [\n    true,\n    null,\n    \"é\\\"<\\n\"\n  ],\n  \"c\": {}\n}\n",
                "['a', 'b']a=1.5;b=[True, None, 'é\"<\\n'];c={};",
                "gen"
            )
        );
    }

    #[test]
    fn raise_exception_and_bad_messages_are_invalid_requests() {
        let template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}ok";
        let dir = folder(Some(json!({"chat_template": template})));
        let tok = load(&dir);
        let err =
            render(&tok, json!([{"role": "assistant", "content": "x"}]), None).expect_err("raise");
        assert!(matches!(err, StrataError::InvalidRequest { .. }));
        assert_eq!(
            err.to_string(),
            "messages: Conversation roles must start with user"
        );
        assert_eq!(
            render(&tok, json!([{"role": "user", "content": "x"}]), None).expect("render"),
            "ok"
        );
        let err = render(&tok, json!([{"content": "x"}]), None).expect_err("no role");
        assert_eq!(err.to_string(), "messages: message 0 has no \"role\"");
        let err = render(&tok, json!({"role": "user"}), None).expect_err("not a list");
        assert_eq!(err.to_string(), "messages: expected a list of messages");
        let err = render(&tok, json!([]), Some(json!({"messages": []}))).expect_err("dup");
        assert_eq!(
            err.to_string(),
            "extra: \"messages\" cannot be set as an extra template variable"
        );
    }

    #[test]
    fn missing_template_is_invalid_request() {
        let dir = folder(None);
        let tok = load(&dir);
        assert!(!tok.has_chat_template());
        let err =
            render(&tok, json!([{"role": "user", "content": "x"}]), None).expect_err("no template");
        assert_eq!(err.to_string(), "messages: the model has no chat template");
    }

    #[test]
    fn template_sources_and_precedence() {
        // A list of named templates: the "default" one is used.
        let dir = folder(Some(json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default {{ messages | length }}"}
        ]})));
        let tok = load(&dir);
        assert_eq!(render(&tok, json!([]), None).expect("render"), "default 0");
        // chat_template.jinja wins over the config, and a trailing newline is dropped.
        write(dir.path(), "chat_template.jinja", "from file\n");
        let tok = load(&dir);
        assert_eq!(render(&tok, json!([]), None).expect("render"), "from file");
    }

    #[test]
    fn generation_config_eos_ids() {
        let dir = chatml_folder();
        write(
            dir.path(),
            "generation_config.json",
            r#"{"eos_token_id": 263, "bos_token_id": 261}"#,
        );
        let tok = load(&dir);
        assert_eq!(tok.eos_token_ids(), &[263, 262]);
        assert_eq!(tok.bos_token_id(), Some(261));
        write(
            dir.path(),
            "generation_config.json",
            r#"{"eos_token_id": [262, 263]}"#,
        );
        let tok = load(&dir);
        assert_eq!(tok.eos_token_ids(), &[262, 263]);
    }

    #[test]
    fn llama_class_adds_bos() {
        let dir = folder(Some(json!({
            "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>", "add_eos_token": true
        })));
        let tok = load(&dir);
        assert_eq!(tok.encode("he", true).expect("encode"), vec![263, 256, 262]);
        assert_eq!(tok.encode("he", false).expect("encode"), vec![256]);
        assert_eq!(tok.bos_token_id(), Some(263));
    }

    #[test]
    fn load_errors_name_file_and_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().display().to_string();
        let err = Tokenizer::load(dir.path()).expect_err("no tokenizer.json");
        assert_eq!(
            err.to_string(),
            format!("{path}/tokenizer.json: file not found")
        );

        let dir = folder(None);
        let path = dir.path().display().to_string();
        write(dir.path(), "tokenizer_config.json", "{\"chat_template\": ");
        assert_eq!(
            load_err(&dir),
            format!("{path}/tokenizer_config.json: invalid JSON: EOF while parsing a value at line 1 column 18")
        );

        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"chat_template": "{% for m in messages %}x"}"#,
        );
        assert_eq!(
            load_err(&dir),
            format!("{path}/tokenizer_config.json: chat_template: syntax error: unexpected end of input, expected end of block (in chat_template:1)")
        );

        write(dir.path(), "tokenizer_config.json", r#"{"bos_token": 5}"#);
        assert_eq!(
            load_err(&dir),
            format!("{path}/tokenizer_config.json: bos_token: expected a string or an object with \"content\"")
        );

        write(dir.path(), "tokenizer_config.json", "{}");
        write(
            dir.path(),
            "generation_config.json",
            r#"{"eos_token_id": "x"}"#,
        );
        assert_eq!(
            load_err(&dir),
            format!("{path}/generation_config.json: eos_token_id: expected an integer or a list of integers")
        );

        write(dir.path(), "tokenizer.json", "{}");
        let msg = load_err(&dir);
        assert!(
            msg.starts_with(&format!("{path}/tokenizer.json: invalid tokenizer: ")),
            "{msg}"
        );
    }

    #[test]
    fn generation_tags_become_plain_blocks() {
        assert_eq!(
            strip_generation_tags("a{%- generation -%}b{% endgeneration %}{{ x }}{% if y %}"),
            "a{%- if true -%}b{% endif %}{{ x }}{% if y %}"
        );
        // Malformed input is passed through for the parser to reject, never a panic.
        assert_eq!(strip_generation_tags("{%}"), "{%}");
        assert_eq!(strip_generation_tags("{%-%}{%"), "{%-%}{%");
    }

    #[test]
    fn tojson_keeps_key_order() {
        // transformers' tojson keeps dict order; that needs the `preserve_order`
        // features of serde_json and minijinja.
        let dir = folder(Some(json!({"chat_template": "{{ messages[0] | tojson }}"})));
        let tok = load(&dir);
        let messages: Json = serde_json::from_str(
            r#"[{"role": "user", "content": "x", "arguments": {"z": 1, "a": 2}}]"#,
        )
        .expect("json");
        assert_eq!(
            render(&tok, messages, None).expect("render"),
            r#"{"role": "user", "content": "x", "arguments": {"z": 1, "a": 2}}"#,
            "enable the preserve_order features of serde_json and minijinja"
        );
    }

    #[test]
    fn types_are_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<IncrementalDecoder>();
    }

    #[test]
    fn python_float_repr_matches() {
        let cases = [
            (1.5, "1.5"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.0, "-2.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (123456789.0, "123456789.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e22, "1e+22"),
            (f64::NAN, "NaN"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn strftime_formats_utc() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %-d %H:%M:%S %j %p %I %%", t),
            "Friday July 26 13:05:09 208 PM 01 %"
        );
        assert_eq!(strftime("%F", 0), "1970-01-01");
        assert_eq!(days_from_civil(2024, 7, 26), t / 86_400);
    }
}
