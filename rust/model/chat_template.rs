//! Chat templates: the model's own Jinja template rendered as transformers renders it.
//!
//! minijinja is configured to behave like the Jinja2 environment transformers builds in
//! `apply_chat_template`: trim_blocks, lstrip_blocks, loop controls, Python string methods
//! (minijinja-contrib's pycompat), `raise_exception`, `strftime_now`, Python-style value
//! printing and transformers' own `tojson`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error as JinjaError, ErrorKind, Output, State, Value};
use serde_json::Value as Json;

use super::tokenizer::read_optional;
use crate::error::{Result, StrataError};

const TEMPLATE_NAME: &str = "chat_template";

/// Steps (minijinja's fuel: about one per instruction) one render may take. A template that
/// loops without end (nested `range(100000)` loops) must fail, not hold the caller forever. The
/// qwen3 fixture takes about 90 steps per message of a tool-using conversation (see the tests),
/// so this is room for some 200,000 messages, and it runs out in about a second.
pub const RENDER_FUEL: u64 = 20_000_000;
/// Bytes one render may write: far beyond any prompt a context can hold, small enough that a
/// template printing `'x' * 100000000` in a loop fails instead of exhausting memory.
pub const MAX_RENDER_BYTES: usize = 64 << 20;

/// Either a compiled template or the reason there is none (reported on use, not at
/// load: a model without a template can still serve plain completions).
pub enum ChatTemplate {
    Compiled(Box<Environment<'static>>),
    Missing(String),
}

impl ChatTemplate {
    /// dir/chat_template.jinja wins over tokenizer_config.json's `chat_template`, as in
    /// transformers; a list of named templates uses the one named "default".
    pub fn load(dir: &Path, cfg_path: &Path, cfg: &serde_json::Map<String, Json>) -> Result<Self> {
        load_chat_template(dir, cfg_path, cfg)
    }

    /// A template given as text (a GGUF file's `tokenizer.chat_template`); `field` and `origin`
    /// name it in a syntax error.
    pub fn from_source(source: Option<&str>, origin: &Path, field: &str) -> Result<Self> {
        let Some(source) = source else {
            return Ok(ChatTemplate::Missing(
                "the model has no chat template".to_string(),
            ));
        };
        let env = build_environment(source.to_string())
            .map_err(|e| StrataError::model_load(origin, format!("{field}: {e}")))?;
        Ok(ChatTemplate::Compiled(Box::new(env)))
    }

    pub fn is_available(&self) -> bool {
        matches!(self, ChatTemplate::Compiled(_))
    }

    /// Renders with the same variables as transformers' render call: the special tokens,
    /// tools and documents (None unless given), the caller's extras, then `messages` and
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        special_tokens: &BTreeMap<String, String>,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<String> {
        let env = match self {
            ChatTemplate::Compiled(env) => env,
            ChatTemplate::Missing(reason) => {
                return Err(StrataError::invalid("messages", reason.clone()))
            }
        };
        check_messages(messages)?;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in special_tokens {
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
                            "chat_template_kwargs",
                            format!("\"{k}\" cannot be set as an extra template variable"),
                        ));
                    }
                    ctx.insert(k.clone(), Value::from_serialize(v));
                }
            }
            Some(_) => {
                return Err(StrataError::invalid(
                    "chat_template_kwargs",
                    "expected a JSON object",
                ));
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
        let mut out = CappedWriter::new(MAX_RENDER_BYTES);
        let rendered = template.render_captured_to(ctx, &mut out);
        if out.over {
            return Err(StrataError::invalid(
                "messages",
                format!(
                    "the chat template's output exceeds {} MiB",
                    MAX_RENDER_BYTES >> 20
                ),
            ));
        }
        rendered.map_err(render_error)?;
        // Every write is a whole &str from the template, so the bytes are UTF-8.
        String::from_utf8(out.buf)
            .map_err(|e| StrataError::Internal(format!("chat template output: {e}")))
    }
}

/// Collects a render's output up to `limit` bytes; past it every write fails (and the render
/// with it).
struct CappedWriter {
    buf: Vec<u8>,
    limit: usize,
    over: bool,
}

impl CappedWriter {
    fn new(limit: usize) -> Self {
        CappedWriter {
            buf: Vec::new(),
            limit,
            over: false,
        }
    }
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("the output limit is reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
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
    env.set_fuel(Some(RENDER_FUEL));
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
    if err.kind() == ErrorKind::OutOfFuel {
        return StrataError::invalid(
            "messages",
            format!("the chat template did not finish within {RENDER_FUEL} steps"),
        );
    }
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

/// transformers' `strftime_now(fmt)`: `datetime.now().strftime(fmt)`, the local time.
fn strftime_now(format: String) -> std::result::Result<String, JinjaError> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("clock error: {e}")))?;
    strftime_local(&format, now.as_secs(), now.subsec_micros())
}

/// `format` applied to the local time of `unix_secs` (and `micros`) as Python's naive
/// `datetime.strftime` applies it: `%f` is the microseconds, `%z` and `%Z` are empty (a naive
/// datetime has no zone), and every other directive goes to the C library's `strftime`, which
/// is what Python calls for them (so the directives, the glibc flags such as `%-d` and the C
/// locale's names are Python's). The time zone is the process's (`TZ`, else /etc/localtime),
/// through `localtime_r`; no Rust crate reports the local offset in a process with threads.
fn strftime_local(
    format: &str,
    unix_secs: u64,
    micros: u32,
) -> std::result::Result<String, JinjaError> {
    let invalid =
        |why: &str| JinjaError::new(ErrorKind::InvalidOperation, format!("strftime_now: {why}"));
    // Python's own directives first; `%%` stays for strftime to print.
    let mut c_format = String::with_capacity(format.len());
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            c_format.push(c);
            continue;
        }
        match chars.next() {
            Some('f') => {
                let _ = write!(c_format, "{micros:06}");
            }
            Some('z') | Some('Z') => {}
            Some(other) => {
                c_format.push('%');
                c_format.push(other);
            }
            None => c_format.push('%'),
        }
    }
    if c_format.is_empty() {
        return Ok(String::new());
    }
    let c_format = std::ffi::CString::new(c_format)
        .map_err(|_| invalid("the format contains a NUL character"))?;
    let time =
        libc::time_t::try_from(unix_secs).map_err(|_| invalid("the clock is out of range"))?;
    // SAFETY: `tm` is plain data that localtime_r fills; both pointers are valid.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&time, &mut tm) }.is_null() {
        return Err(invalid("the local time is not representable"));
    }
    // strftime returns 0 for a result that does not fit (or is empty, which no directive of
    // the C locale gives): grow, up to a bound.
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: `buf` holds `buf.len()` bytes; the format is NUL-terminated; `tm` is filled.
        let n =
            unsafe { libc::strftime(buf.as_mut_ptr().cast(), buf.len(), c_format.as_ptr(), &tm) };
        if n > 0 {
            buf.truncate(n);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        if buf.len() >= 1 << 16 {
            return Err(invalid("the formatted time is empty or longer than 64 KiB"));
        }
        buf.resize(buf.len() * 16, 0);
    }
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

    fn compiled(source: &str) -> ChatTemplate {
        ChatTemplate::Compiled(Box::new(
            build_environment(source.to_string()).expect("compile"),
        ))
    }

    fn render_user(t: &ChatTemplate) -> Result<String> {
        let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
        t.render(&BTreeMap::new(), &messages, true, None)
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let t = compiled(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x",
        );
        let started = std::time::Instant::now();
        let err = render_user(&t).expect_err("out of fuel");
        assert!(matches!(err, StrataError::InvalidRequest { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("messages: the chat template did not finish within {RENDER_FUEL} steps")
        );
        // Generous for a loaded debug build; the budget is about a second of work.
        assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
    }

    #[test]
    fn recursion_and_output_are_bounded() {
        let t = compiled("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
        assert_eq!(
            render_user(&t).expect_err("recursion").to_string(),
            "messages: chat template failed: invalid operation: recursion limit exceeded (in chat_template:1)"
        );
        let t = compiled("{% for a in range(100) %}{{ 'x' * 10000000 }}{% endfor %}");
        assert_eq!(
            render_user(&t).expect_err("output cap").to_string(),
            "messages: the chat template's output exceeds 64 MiB"
        );
        // Just under the cap is fine.
        let t = compiled("{{ 'x' * 1000000 }}");
        assert_eq!(render_user(&t).expect("1 MB").len(), 1_000_000);
    }

    /// A long tool-using conversation through the qwen3 fixture stays far below the fuel budget:
    /// the budget fails loops, not real templates.
    #[test]
    fn real_templates_use_little_fuel() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/qwen3.jinja");
        let source = std::fs::read_to_string(&path).expect("fixture");
        let env = build_environment(source).expect("compile");
        let template = env.get_template(TEMPLATE_NAME).expect("template");
        let mut messages = Vec::new();
        for i in 0..1000 {
            messages.push(serde_json::json!({"role": "user", "content": format!("question {i}")}));
            messages.push(serde_json::json!({
                "role": "assistant", "content": "<think>\nhm\n</think>\n\nanswer",
                "tool_calls": [{"function": {"name": "f", "arguments": {"q": i}}}]
            }));
            messages.push(serde_json::json!({"role": "tool", "content": "result"}));
        }
        let ctx = serde_json::json!({
            "messages": messages, "add_generation_prompt": true,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        });
        let mut out = Vec::new();
        let captured = template.render_captured_to(ctx, &mut out).expect("render");
        let (consumed, _) = captured.state().fuel_levels().expect("fuel is on");
        assert!(out.len() > 100_000);
        assert!(
            consumed < RENDER_FUEL / 20,
            "3000 messages took {consumed} steps of {RENDER_FUEL}"
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
    fn strftime_is_pythons_naive_local_time() {
        // 2024-07-26 13:05:09.000042 UTC, a Friday. The C library's local time of it, as
        // Python's datetime.fromtimestamp(t).strftime would give (checked against Python itself
        // in tests/test_chat_template.py); here the fields that do not depend on the zone.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        let got = strftime_local("%M:%S.%f|%z|%Z|%%f|%", t, 42).expect("formats");
        assert_eq!(got, "05:09.000042|||%f|%");
        assert_eq!(strftime_local("", t, 0).expect("formats"), "");
        let year = strftime_local("%Y %b %A", t, 0).expect("formats");
        assert!(
            ["2024 Jul Friday", "2024 Jul Thursday", "2024 Jul Saturday"].contains(&year.as_str()),
            "{year}"
        );
        let long = strftime_local(&"%Y".repeat(5_000), t, 0).expect("formats");
        assert_eq!(long.len(), 20_000);
        let e = strftime_local(&"%Y".repeat(20_000), t, 0).expect_err("too long");
        assert!(
            e.to_string()
                .contains("strftime_now: the formatted time is empty or longer than 64 KiB"),
            "{e}"
        );
        assert!(strftime_local("a\0b", t, 0).is_err());
    }
}
