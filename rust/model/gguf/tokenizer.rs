//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, built into a
//! `tokenizers` tokenizer that gives the ids llama.cpp gives for the same text (llama.cpp's
//! `llama_tokenize` with `parse_special = true`).
//!
//! Two tokenizer models are supported, as llama.cpp names them in `tokenizer.ggml.model`:
//!
//! * `gpt2`: byte-level BPE. The text is split by the regular expressions llama.cpp applies for
//!   the file's `tokenizer.ggml.pre`, one after the other (each splits the pieces the previous
//!   one left, keeping both the matches and the text between them), then each piece's bytes are
//!   mapped to GPT-2's byte characters and merged by the ranks of `tokenizer.ggml.merges`.
//! * `llama`: SentencePiece's BPE. Spaces become "▁" (and one is put in front of each run of
//!   text when `add_space_prefix`); pieces merge by the score of the piece they form, highest
//!   first; characters no token covers become their `<0xNN>` byte tokens. The merges are the
//!   vocabulary's own splits (every token that is two tokens joined), ranked by score, as
//!   transformers' LlamaConverter builds them.
//!
//! Control, unknown and user-defined tokens (and the tokens llama.cpp takes for control tokens by
//! their text: end-of-turn, fill-in-the-middle, ...) are added tokens: they are split out of the
//! text before anything else, as llama.cpp does with `parse_special`. Control and unknown tokens
//! are "special" (dropped by `decode(skip_special_tokens = true)`), user-defined ones are not.

use std::collections::{BTreeSet, HashMap};

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, NormalizerWrapper, SplitDelimiterBehavior};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";

/// The `tokenizer.ggml.*` metadata of a GGUF file, borrowed from the file's reader.
pub struct GgufVocab<'a> {
    /// tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: &'a str,
    /// tokenizer.ggml.pre: the pre-tokenizer of a "gpt2" model.
    pub pre: Option<&'a str>,
    /// tokenizer.ggml.tokens: the vocabulary, indexed by id.
    pub tokens: &'a [String],
    /// tokenizer.ggml.scores: one per token (the merge priorities of a "llama" model).
    pub scores: Option<&'a [f32]>,
    /// tokenizer.ggml.token_type: one per token (1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte).
    pub token_types: Option<&'a [i32]>,
    /// tokenizer.ggml.merges: "left right", highest priority first (a "gpt2" model's).
    pub merges: Option<&'a [String]>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

/// A built tokenizer and what the engine needs beside it.
pub struct GgufTokenizer {
    /// Encodes (`add_special_tokens` adds bos/eos as llama.cpp's `add_special` does) and
    /// decodes.
    pub tokenizer: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    /// The eos id (a "llama" vocabulary without one has llama's </s>, 2).
    pub eos: Option<u32>,
    /// The tokens that end generation, as llama.cpp's `llama_vocab_is_eog`, ascending.
    pub eog_ids: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

/// Token attributes, llama.cpp's `LLAMA_TOKEN_ATTR_*` bits.
mod attr {
    pub const UNDEFINED: u16 = 0;
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ModelKind {
    /// "gpt2": byte-level BPE.
    Bpe,
    /// "llama": SentencePiece BPE with byte fallback.
    Spm,
}

/// Builds the tokenizer. Errors name the metadata key at fault.
pub fn build(v: &GgufVocab) -> Result<GgufTokenizer, String> {
    let kind = match v.model {
        "gpt2" => ModelKind::Bpe,
        "llama" => ModelKind::Spm,
        other => {
            return Err(format!(
            "{KEY_MODEL}: unsupported tokenizer model {other:?} (supported: \"gpt2\", \"llama\")"
        ))
        }
    };
    let pre = match kind {
        ModelKind::Bpe => Some(pre_tokenizer(v.pre)?),
        ModelKind::Spm => None,
    };

    let n = v.tokens.len();
    if n == 0 {
        return Err(format!("{KEY_TOKENS}: the vocabulary is empty"));
    }
    let n_u32 = u32::try_from(n).map_err(|_| format!("{KEY_TOKENS}: {n} tokens are too many"))?;
    if let Some(scores) = v.scores {
        if scores.len() < n {
            return Err(format!(
                "{KEY_SCORES}: {} scores for {n} tokens",
                scores.len()
            ));
        }
    }
    if let Some(types) = v.token_types {
        if types.len() < n {
            return Err(format!(
                "{KEY_TOKEN_TYPE}: {} token types for {n} tokens",
                types.len()
            ));
        }
    }

    // The texts as llama.cpp keeps them: an empty token becomes "[EMPTY_<id>]", and a text
    // must name one token only.
    let texts: Vec<String> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.clone()
            }
        })
        .collect();
    let mut ids: HashMap<&str, u32> = HashMap::with_capacity(n);
    for (i, text) in texts.iter().enumerate() {
        if let Some(first) = ids.insert(text.as_str(), i as u32) {
            return Err(format!(
                "{KEY_TOKENS}: duplicate token {text:?} (ids {first} and {i})"
            ));
        }
    }

    // The special ids. A "llama" vocabulary defaults to llama's <unk> 0, <s> 1, </s> 2; an id
    // past the vocabulary is ignored (llama.cpp warns and keeps the default).
    let default = |id: u32| (kind == ModelKind::Spm && id < n_u32).then_some(id);
    let special = |key: &str, id: Option<u32>, fallback: Option<u32>| match id {
        Some(id) if id < n_u32 => Some(id),
        Some(id) => {
            log::warn!("{key}: id {id} is past the vocabulary ({n} tokens); ignored");
            fallback
        }
        None => fallback,
    };
    let bos = special(KEY_BOS, v.bos, default(1));
    let eos = special(KEY_EOS, v.eos, default(2));
    let unk = special(KEY_UNK, v.unk, default(0));
    let eot = special(KEY_EOT, v.eot, None);
    let eom = special(KEY_EOM, v.eom, None);
    let _pad = special(KEY_PAD, v.pad, None);

    let (attrs, eog) = token_attrs(&texts, v.token_types, &ids, [eos, eot, eom]);

    let (default_add_bos, ignore_merges) = match &pre {
        Some(p) => (p.add_bos, p.ignore_merges),
        None => (true, false),
    };
    let add_bos = v.add_bos.unwrap_or(default_add_bos);
    let add_eos = v.add_eos.unwrap_or(false);
    if add_bos && bos.is_none() {
        return Err(format!("{KEY_ADD_BOS} is true, but {KEY_BOS} is not set"));
    }
    if add_eos && eos.is_none() {
        return Err(format!("{KEY_ADD_EOS} is true, but {KEY_EOS} is not set"));
    }

    let is_added =
        |id: usize| attrs[id] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0;
    let vocab: Vocab = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();

    let mut tokenizer = match kind {
        ModelKind::Bpe => {
            let merges = v
                .merges
                .ok_or_else(|| format!("{KEY_MERGES}: missing (a gpt2 tokenizer needs merges)"))?;
            let merges = bpe_merges(merges, &ids);
            let model = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .ignore_merges(ignore_merges)
                .build()
                .map_err(|e| format!("{KEY_MERGES}: {e}"))?;
            let mut tok = tokenizers::Tokenizer::new(model);
            let pre = pre.as_ref().map(|p| p.build()).transpose()?;
            tok.with_pre_tokenizer(pre);
            tok.with_decoder(Some(ByteLevel::default()));
            tok
        }
        ModelKind::Spm => {
            let scores = v.scores;
            let score = |id: usize| scores.map_or(0.0, |s| s[id]);
            let merges = spm_merges(&texts, &ids, score, |id| !is_added(id));
            let mut builder = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .byte_fallback(true)
                .fuse_unk(true);
            if let Some(unk) = unk {
                builder = builder.unk_token(texts[unk as usize].clone());
            }
            let model = builder.build().map_err(|e| format!("{KEY_TOKENS}: {e}"))?;
            let mut tok = tokenizers::Tokenizer::new(model);
            let add_space_prefix = v.add_space_prefix.unwrap_or(true);
            let escape = NormalizerWrapper::Replace(
                Replace::new(" ", "\u{2581}").map_err(|e| format!("{KEY_TOKENS}: {e}"))?,
            );
            let normalizer = if add_space_prefix {
                NormalizerWrapper::Sequence(tokenizers::normalizers::Sequence::new(vec![
                    NormalizerWrapper::Prepend(Prepend::new("\u{2581}".to_string())),
                    escape,
                ]))
            } else {
                escape
            };
            tok.with_normalizer(Some(normalizer));
            let mut decoders = vec![
                DecoderWrapper::Replace(
                    Replace::new("\u{2581}", " ").map_err(|e| format!("{KEY_TOKENS}: {e}"))?,
                ),
                DecoderWrapper::ByteFallback(ByteFallback::new()),
                DecoderWrapper::Fuse(Fuse::new()),
            ];
            if add_space_prefix {
                decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
            }
            tok.with_decoder(Some(DecoderSequence::new(decoders)));
            tok
        }
    };

    // Control and unknown tokens are special (skipped when decoding without specials),
    // user-defined ones are not; both are matched in the raw text, longest first.
    let added = |special: bool| -> Vec<AddedToken> {
        (0..n)
            .filter(|&i| is_added(i) && (attrs[i] & attr::USER_DEFINED == 0) == special)
            .map(|i| {
                AddedToken::from(texts[i].clone(), special)
                    .normalized(false)
                    .single_word(false)
                    .lstrip(false)
                    .rstrip(false)
            })
            .collect()
    };
    tokenizer.add_special_tokens(&added(true));
    tokenizer.add_tokens(&added(false));

    if add_bos || add_eos {
        let processor = post_processor(&texts, bos.filter(|_| add_bos), eos.filter(|_| add_eos))?;
        tokenizer.with_post_processor(Some(processor));
    }

    Ok(GgufTokenizer {
        tokenizer,
        bos,
        eos,
        eog_ids: eog.into_iter().collect(),
        add_bos,
        add_eos,
    })
}

/// `encode(.., add_special_tokens = true)` puts bos before and eos after the text, as
/// llama.cpp's `add_special` does.
fn post_processor(
    texts: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
) -> Result<TemplateProcessing, String> {
    let fail = |e: String| format!("{KEY_ADD_BOS}: {e}");
    let mut specials = Vec::new();
    for (name, id) in [("bos", bos), ("eos", eos)] {
        if let Some(id) = id {
            let text = texts[id as usize].clone();
            specials.push(
                SpecialToken::new(name.to_string(), vec![id], vec![text])
                    .map_err(|e| fail(e.to_string()))?,
            );
        }
    }
    let template = |seq: &str, type_id: u32| -> Vec<String> {
        let mut t = Vec::new();
        if bos.is_some() {
            t.push(format!("bos:{type_id}"));
        }
        t.push(format!("{seq}:{type_id}"));
        if eos.is_some() {
            t.push(format!("eos:{type_id}"));
        }
        t
    };
    let single = template("$A", 0);
    let pair: Vec<String> = single.iter().cloned().chain(template("$B", 1)).collect();
    TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map_err(fail)?
        .special_tokens(specials)
        .build()
        .map_err(|e| fail(e.to_string()))
}

// ---------------------------------------------------------------------------
// Token attributes and the end-of-generation set
// ---------------------------------------------------------------------------

/// Token texts llama.cpp takes for end-of-generation tokens (and makes control tokens).
const EOG_TEXTS: [&str; 22] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
];

/// Fill-in-the-middle token texts, by role; llama.cpp makes the first one it finds of each role
/// a control token, and the pad, repo and file-separator ones end generation.
const FIM_PRE: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<\u{ff5c}fim\u{2581}begin\u{ff5c}>",
    "<PRE>",
    "\u{2581}<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<\u{ff5c}fim\u{2581}hole\u{ff5c}>",
    "<SUF>",
    "\u{2581}<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<\u{ff5c}fim\u{2581}end\u{ff5c}>",
    "<MID>",
    "\u{2581}<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP: &[&str] = &["<|file_sep|>"];

/// Tokens gpt-oss templates print: llama.cpp makes them user-defined whatever their type.
const ALWAYS_RENDERED: [&str; 4] = ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// llama.cpp's token attributes after its load-time fix-ups, and its end-of-generation set.
/// `eog_ids` are the eos, eot and eom ids, which end generation whatever their text.
fn token_attrs(
    texts: &[String],
    types: Option<&[i32]>,
    ids: &HashMap<&str, u32>,
    eog_ids: [Option<u32>; 3],
) -> (Vec<u16>, BTreeSet<u32>) {
    let mut attrs: Vec<u16> = (0..texts.len())
        .map(|i| match types.map(|t| t[i]) {
            None | Some(1) => attr::NORMAL,
            Some(2) => attr::UNKNOWN,
            Some(3) => attr::CONTROL,
            Some(4) => attr::USER_DEFINED,
            Some(5) => attr::UNUSED,
            Some(6) => attr::BYTE,
            Some(_) => attr::UNDEFINED,
        })
        .collect();
    let find = |candidates: &[&str]| candidates.iter().filter_map(|t| ids.get(t)).min().copied();
    let mut eog = BTreeSet::new();

    for candidates in [FIM_PRE, FIM_SUF, FIM_MID] {
        if let Some(id) = find(candidates) {
            attrs[id as usize] |= attr::CONTROL;
        }
    }
    for candidates in [FIM_PAD, FIM_REP, FIM_SEP] {
        if let Some(id) = find(candidates) {
            attrs[id as usize] |= attr::CONTROL;
            eog.insert(id);
        }
    }
    for text in EOG_TEXTS {
        if let Some(&id) = ids.get(text) {
            attrs[id as usize] |= attr::CONTROL;
            eog.insert(id);
        }
    }
    for text in ALWAYS_RENDERED {
        if let Some(&id) = ids.get(text) {
            attrs[id as usize] = attr::USER_DEFINED;
        }
    }
    eog.extend(eog_ids.into_iter().flatten());

    let in_eog =
        |eog: &BTreeSet<u32>, text: &str| ids.get(text).filter(|id| eog.contains(id)).copied();
    // gpt-oss (and solar-open): "<|end|>" ends a message, not the generation.
    let has_call = in_eog(&eog, "<|call|>")
        .or(in_eog(&eog, "<|calls|>"))
        .is_some();
    let has_return = in_eog(&eog, "<|return|>").is_some();
    let has_flush = in_eog(&eog, "<|flush|>").is_some();
    if let Some(end) = in_eog(&eog, "<|end|>") {
        if has_call && (has_return || has_flush) {
            eog.remove(&end);
            attrs[end as usize] = attr::USER_DEFINED;
        }
    }
    // gemma4: "</s>" is an ordinary token there.
    if in_eog(&eog, "<|tool_response>").is_some() {
        if let Some(s) = in_eog(&eog, "</s>") {
            eog.remove(&s);
            attrs[s as usize] = attr::NORMAL;
        }
    }
    (attrs, eog)
}

// ---------------------------------------------------------------------------
// Merges
// ---------------------------------------------------------------------------

/// A gpt2 model's merges, "left right" split at the first space after the first character as
/// llama.cpp splits them. Duplicates keep their first (highest) rank; merges of or into strings
/// that are not tokens are left out (llama.cpp could form such a string, then spell it out in
/// single-byte tokens; the tokenizers crate cannot hold such a merge).
fn bpe_merges(merges: &[String], ids: &HashMap<&str, u32>) -> Vec<(String, String)> {
    let mut seen = std::collections::HashSet::with_capacity(merges.len());
    let mut out = Vec::with_capacity(merges.len());
    let mut skipped = 0usize;
    for merge in merges {
        let split = merge
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(i, _)| i);
        let Some(at) = split else {
            skipped += 1;
            continue;
        };
        let (left, right) = (&merge[..at], &merge[at + 1..]);
        let joined = format!("{left}{right}");
        if !ids.contains_key(left) || !ids.contains_key(right) || !ids.contains_key(joined.as_str())
        {
            skipped += 1;
            continue;
        }
        if seen.insert((left, right)) {
            out.push((left.to_string(), right.to_string()));
        }
    }
    if skipped > 0 {
        log::debug!("{KEY_MERGES}: {skipped} merges left out (not of tokens)");
    }
    out
}

/// A SentencePiece vocabulary's merges: every way a mergeable token is two tokens joined, the
/// token with the higher score first (ties: the lower id, then the lower ids of the halves).
fn spm_merges(
    texts: &[String],
    ids: &HashMap<&str, u32>,
    score: impl Fn(usize) -> f32,
    mergeable: impl Fn(usize) -> bool,
) -> Vec<(String, String)> {
    let mut merges: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (id, text) in texts.iter().enumerate() {
        if !mergeable(id) {
            continue;
        }
        for (at, _) in text.char_indices().skip(1) {
            let (left, right) = (&text[..at], &text[at..]);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                if mergeable(l as usize) && mergeable(r as usize) {
                    merges.push((score(id), id as u32, l, r));
                }
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    // llama.cpp breaks a tie of scores by position (leftmost first), which merge ranks cannot
    // express: a vocabulary of tied scores (converters that write one score for all) may get
    // other ids than llama.cpp's for some texts (95% of random texts agree when all tie).
    let tied = merges
        .windows(2)
        .filter(|w| w[0].0 == w[1].0 && w[0].1 != w[1].1)
        .count();
    if tied > merges.len() / 10 {
        log::warn!(
            "{KEY_SCORES}: {tied} of {} merges tie on score; some texts may get other ids than llama.cpp's",
            merges.len()
        );
    }
    merges
        .into_iter()
        .map(|(_, _, l, r)| (texts[l as usize].clone(), texts[r as usize].clone()))
        .collect()
}

// ---------------------------------------------------------------------------
// Pre-tokenizers
// ---------------------------------------------------------------------------

/// GPT-2's split (llama.cpp runs it through its own code, equal to this expression with a last
/// `|\s+`, which never matches more than the text it leaves between matches).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const JAIS2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const UFAKZEKA: &str =
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const MINICPM5: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const EXAONE_MOE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";
const DEEPSEEK3: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// deepseek-llm's letters (llama.cpp lists them as ranges; here as code points, since several are
/// characters a text normalisation would change).
const DEEPSEEK_LETTERS: &str = concat!(
    r"\s?[",
    r"A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}",
    r"\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}",
    r"\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}",
    r"\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}",
    r"\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}",
    r"\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}",
    r"\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}",
    r"\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}",
    r"\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}",
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}",
    r"\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}",
    r"\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}",
    r"\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}",
    r"\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}",
    r"\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}",
    r"\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}",
    "]+"
);
/// CJK runs of deepseek's pre-tokenizers. llama.cpp matches these expressions on text whose
/// non-ASCII spaces it has replaced by "\v", so a space inside a range (U+3000 is in U+0800 to
/// U+4E00) never matches: `&&\S`.
const DEEPSEEK_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}&&\S]+";
const DEEPSEEK_PUNCT: &str =
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}&&\S]+";
const PORO: &str = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+";

/// The split a `tokenizer.ggml.pre` names: llama.cpp's regular expressions, applied in turn.
struct PreTokenizer {
    regexes: &'static [&'static str],
    /// Whether a piece that is itself a token skips the merges (llama.cpp's ignore_merges).
    ignore_merges: bool,
    /// Whether bos is added by default (tokenizer.ggml.add_bos_token overrides it).
    add_bos: bool,
}

impl PreTokenizer {
    fn build(&self) -> Result<PreTokenizerWrapper, String> {
        let mut steps = Vec::with_capacity(self.regexes.len() + 1);
        for regex in self.regexes {
            let split = Split::new(
                SplitPattern::Regex(regex.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| format!("{KEY_PRE}: cannot compile {regex:?}: {e}"))?;
            steps.push(PreTokenizerWrapper::Split(split));
        }
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, false, false,
        )));
        Ok(PreTokenizerWrapper::Sequence(PreSequence::new(steps)))
    }
}

/// The pre-tokenizer names llama.cpp knows (llama-vocab.cpp) and their splits: (names,
/// expressions, ignore_merges, add_bos by default).
type PreEntry = (&'static [&'static str], &'static [&'static str], bool, bool);
const PRE_TOKENIZERS: &[PreEntry] = &[
    (
        &["default"],
        &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        false,
        false,
    ),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        &[LLAMA3],
        true,
        true,
    ),
    (
        &["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"],
        &[LLAMA3],
        false,
        false,
    ),
    (&["jais-2"], &[JAIS2], false, false),
    (
        &["deepseek-llm"],
        &[
            r"[\r\n]",
            DEEPSEEK_LETTERS,
            DEEPSEEK_PUNCT,
            r"\s+\z",
            DEEPSEEK_CJK,
            r"\p{N}+",
        ],
        false,
        false,
    ),
    (
        &["deepseek-coder"],
        &[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            DEEPSEEK_CJK,
            r"\p{N}",
        ],
        false,
        false,
    ),
    (
        &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        &[
            r"\p{N}{1,3}",
            r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
            DEEPSEEK3,
        ],
        false,
        false,
    ),
    (
        &["falcon"],
        &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
        false,
        false,
    ),
    (
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        &[r"\p{N}", GPT2],
        false,
        false,
    ),
    (
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
        ],
        &[GPT2],
        false,
        false,
    ),
    (
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        &[QWEN2],
        false,
        false,
    ),
    (&["qwen35"], &[QWEN35], false, false),
    (
        &["poro-chat", "bloom", "gpt3-finnish"],
        &[PORO],
        false,
        false,
    ),
    (&["viking"], &[PORO, r"\p{N}"], false, false),
    (&["tekken"], &[TEKKEN], true, true),
    (
        &["chameleon"],
        &[
            "<sentinel:[0-9]+>",
            "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            GPT2,
        ],
        false,
        true,
    ),
    (
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        &[GPT4O],
        false,
        false,
    ),
    (&["seed-coder"], &[SEED_CODER], false, false),
    (
        &["bailingmoe", "bailingmoe2", "llada-moe"],
        &[BAILINGMOE],
        false,
        false,
    ),
    (&["ufakzeka"], &[UFAKZEKA], false, false),
    (&["minicpm5"], &[r"\p{N}{1,3}", MINICPM5], true, false),
    (&["laguna"], &[r"[^\n]+|[\n]+", QWEN2], false, false),
    (&["exaone-moe"], &[EXAONE_MOE], false, false),
];

/// The pre-tokenizer `tokenizer.ggml.pre` names; a file without one gets llama.cpp's "default".
fn pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizer, String> {
    let name = pre.unwrap_or_else(|| {
        log::warn!("{KEY_PRE}: missing; llama.cpp's \"default\" pre-tokenizer is used");
        "default"
    });
    PRE_TOKENIZERS
        .iter()
        .find(|(names, ..)| names.contains(&name))
        .map(|&(_, regexes, ignore_merges, add_bos)| PreTokenizer {
            regexes,
            ignore_merges,
            add_bos,
        })
        .ok_or_else(|| format!("{KEY_PRE}: unknown pre-tokenizer {name:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's byte -> printable char table used by byte-level BPE.
    fn byte_chars() -> Vec<char> {
        let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
        let mut table = vec!['\0'; 256];
        for &b in &printable {
            table[b as usize] = char::from_u32(b).expect("char");
        }
        let mut next = 256u32;
        for b in 0..256u32 {
            if !printable.contains(&b) {
                table[b as usize] = char::from_u32(next).expect("char");
                next += 1;
                printable.push(b);
            }
        }
        table
    }

    struct Owned {
        model: &'static str,
        pre: Option<&'static str>,
        tokens: Vec<String>,
        scores: Option<Vec<f32>>,
        types: Option<Vec<i32>>,
        merges: Option<Vec<String>>,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: Option<bool>,
        add_space_prefix: Option<bool>,
    }

    impl Owned {
        fn vocab(&self) -> GgufVocab<'_> {
            GgufVocab {
                model: self.model,
                pre: self.pre,
                tokens: &self.tokens,
                scores: self.scores.as_deref(),
                token_types: self.types.as_deref(),
                merges: self.merges.as_deref(),
                bos: self.bos,
                eos: self.eos,
                eot: None,
                eom: None,
                unk: None,
                pad: None,
                add_bos: self.add_bos,
                add_eos: None,
                add_space_prefix: self.add_space_prefix,
            }
        }

        fn build(&self) -> GgufTokenizer {
            build(&self.vocab()).expect("build")
        }

        fn error(&self) -> String {
            match build(&self.vocab()) {
                Ok(_) => panic!("build should fail"),
                Err(e) => e,
            }
        }
    }

    /// Byte-level BPE: ids 0..=255 are the bytes (byte b is id b), 256.. merges, then 262..
    /// the control tokens and a user-defined one.
    fn gpt2(pre: &'static str) -> Owned {
        let chars = byte_chars();
        let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
        let merges = ["Ġ t", "h e", "Ġt he", "1 2", "3 4", "12 3"];
        for m in merges {
            tokens.push(m.replace(' ', ""));
        }
        for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"] {
            tokens.push(t.to_string());
        }
        let mut types = vec![1; tokens.len()];
        types[262..265].fill(3);
        types[265] = 4;
        Owned {
            model: "gpt2",
            pre: Some(pre),
            tokens,
            scores: None,
            types: Some(types),
            merges: Some(merges.iter().map(|m| m.to_string()).collect()),
            bos: Some(262),
            eos: Some(264),
            add_bos: None,
            add_space_prefix: None,
        }
    }

    fn ids(tok: &GgufTokenizer, text: &str, add_special: bool) -> Vec<u32> {
        tok.tokenizer
            .encode(text, add_special)
            .expect("encode")
            .get_ids()
            .to_vec()
    }

    fn decode(tok: &GgufTokenizer, ids: &[u32], skip_special: bool) -> String {
        tok.tokenizer.decode(ids, skip_special).expect("decode")
    }

    #[test]
    fn gpt2_merges_and_pre_tokenizers() {
        // GPT-2's split keeps " 1234" whole: "1 2" and "3 4" merge, and "12 3" never gets a 3.
        let tok = gpt2("gpt-2").build();
        assert_eq!(ids(&tok, "the 1234", false), [116, 257, 32, 259, 260]);
        assert_eq!(ids(&tok, " the", false), [258]);
        // llama3's splits digits in threes and the space apart; "123" is a token, taken whole.
        let tok = gpt2("llama-bpe").build();
        assert_eq!(ids(&tok, "the 1234", false), [116, 257, 32, 261, 52]);
        // smollm's splits every digit.
        let tok = gpt2("smollm").build();
        assert_eq!(ids(&tok, "the 1234", false), [116, 257, 32, 49, 50, 51, 52]);
    }

    #[test]
    fn gpt2_special_tokens_split_out_and_round_trip() {
        let tok = gpt2("gpt-2").build();
        assert_eq!(
            ids(&tok, "<|im_start|>the<tool><|im_end|>", false),
            [263, 116, 257, 265, 264]
        );
        for text in [
            "héllo wörld 日本語 🎉\n\t  x  ",
            "<|im_start|>user\n3.14 <tool> ok<|im_end|>",
            "",
        ] {
            let encoded = ids(&tok, text, false);
            assert_eq!(decode(&tok, &encoded, false), text);
        }
        // Control tokens are skipped when asked, user-defined ones are text.
        let encoded = ids(&tok, "<|im_start|>the<tool><|im_end|>", false);
        assert_eq!(decode(&tok, &encoded, true), "the<tool>");
        // eos, and <|endoftext|> by its text.
        assert_eq!(tok.eog_ids, [262, 264]);
        assert_eq!(
            (tok.bos, tok.add_bos, tok.add_eos),
            (Some(262), false, false)
        );
    }

    #[test]
    fn add_bos_follows_the_pre_tokenizer_and_the_metadata() {
        let tok = gpt2("llama-bpe").build();
        assert!(tok.add_bos);
        assert_eq!(ids(&tok, "the", true), [262, 116, 257]);
        assert_eq!(ids(&tok, "the", false), [116, 257]);
        let mut owned = gpt2("llama-bpe");
        owned.add_bos = Some(false);
        let tok = owned.build();
        assert_eq!(ids(&tok, "the", true), [116, 257]);
        let mut owned = gpt2("gpt-2");
        owned.add_bos = Some(true);
        assert_eq!(ids(&owned.build(), "the", true), [262, 116, 257]);
    }

    #[test]
    fn tokens_taken_for_control_tokens_by_their_text() {
        let mut owned = gpt2("gpt-2");
        // An end-of-turn token the converter left "normal", and a fill-in-the-middle pad.
        owned.tokens[256] = "<|eot_id|>".to_string();
        owned.tokens[257] = "<fim_pad>".to_string();
        owned.merges = Some(vec![]);
        let tok = owned.build();
        assert_eq!(tok.eog_ids, [256, 257, 262, 264]);
        assert_eq!(
            ids(&tok, "a<|eot_id|>b<fim_pad>", false),
            [97, 256, 98, 257]
        );
        assert_eq!(decode(&tok, &[97, 256, 98, 257], true), "ab");
    }

    #[test]
    fn every_pre_tokenizer_compiles_and_splits() {
        let text = "Hello, wörld! it's 1234567 3.14 ~~ 日本語 \u{3000}x  \n\n\tend ";
        for &(names, ..) in PRE_TOKENIZERS {
            let tok = gpt2(names[0]).build();
            let encoded = ids(&tok, text, false);
            assert_eq!(decode(&tok, &encoded, false), text, "{}", names[0]);
        }
    }

    /// SentencePiece: <unk> <s> </s>, the 256 byte tokens (byte b is id 3 + b), then pieces
    /// whose scores order the merges, a control and a user-defined token.
    fn spm() -> Owned {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0.0; 3];
        for b in 0..256 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        let pieces = [
            "▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "hell", "hello", "▁hello", "or",
            "▁w", "▁wor", "ld", "▁world",
        ];
        for (i, p) in pieces.iter().enumerate() {
            tokens.push(p.to_string());
            types.push(1);
            scores.push(-1.0 - i as f32);
        }
        tokens.push("<|im_end|>".to_string());
        types.push(3);
        scores.push(0.0);
        tokens.push("<tool>".to_string());
        types.push(4);
        scores.push(0.0);
        Owned {
            model: "llama",
            pre: None,
            tokens,
            scores: Some(scores),
            types: Some(types),
            merges: None,
            bos: None,
            eos: None,
            add_bos: None,
            add_space_prefix: None,
        }
    }

    #[test]
    fn spm_merges_by_score_with_byte_fallback() {
        let tok = spm().build();
        // "▁hello▁world": ll, he, hell, hello, ▁hello, or, ▁w, ▁wor, ld, ▁world.
        assert_eq!(ids(&tok, "hello world", false), [271, 276]);
        // A leading space is kept: "▁▁hello".
        assert_eq!(ids(&tok, " hello", false), [259, 271]);
        // "é" is no piece: its UTF-8 bytes C3 A9.
        assert_eq!(ids(&tok, "hé", false), [259, 260, 3 + 0xC3, 3 + 0xA9]);
        // llama's defaults: bos <s> added, eos </s>.
        assert_eq!(ids(&tok, "hello", true), [1, 271]);
        assert_eq!((tok.bos, tok.add_bos, tok.add_eos), (Some(1), true, false));
        assert_eq!(tok.eog_ids, [2, 277]);
    }

    #[test]
    fn spm_special_tokens_and_round_trips() {
        let tok = spm().build();
        // Every run of text after a special token gets its "▁", as in llama.cpp.
        assert_eq!(
            ids(&tok, "<s>hello<tool>world</s>", false),
            [1, 271, 278, 276, 2]
        );
        for text in ["hello world", "héllo  wörld 日本 🎉\n", "x<|im_end|>"] {
            let encoded = ids(&tok, text, false);
            assert_eq!(decode(&tok, &encoded, false), text);
        }
        assert_eq!(decode(&tok, &[1, 271, 2], false), "<s> hello</s>");
        assert_eq!(decode(&tok, &[1, 271, 278, 2], true), "hello<tool>");
        // Without the space prefix.
        let mut owned = spm();
        owned.add_space_prefix = Some(false);
        let tok = owned.build();
        assert_eq!(ids(&tok, "hello world", false), [270, 276]);
        assert_eq!(ids(&tok, " hello world", false), [271, 276]);
        assert_eq!(decode(&tok, &[271, 276], false), " hello world");
    }

    #[test]
    fn errors_name_the_key() {
        let mut owned = gpt2("gpt-2");
        owned.model = "bert";
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.model: unsupported tokenizer model \"bert\" (supported: \"gpt2\", \"llama\")"
        );
        let owned = gpt2("foo");
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.pre: unknown pre-tokenizer \"foo\""
        );
        let mut owned = gpt2("gpt-2");
        owned.merges = None;
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.merges: missing (a gpt2 tokenizer needs merges)"
        );
        let mut owned = gpt2("gpt-2");
        owned.tokens[300 - 35] = "a".to_string();
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.tokens: duplicate token \"a\" (ids 97 and 265)"
        );
        let mut owned = gpt2("gpt-2");
        owned.types = Some(vec![1; 10]);
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.token_type: 10 token types for 266 tokens"
        );
        let mut owned = spm();
        owned.scores = Some(vec![0.0]);
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.scores: 1 scores for 279 tokens"
        );
        let mut owned = gpt2("llama-bpe");
        owned.bos = None;
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"
        );
        let mut owned = gpt2("gpt-2");
        owned.tokens.clear();
        owned.types = None;
        assert_eq!(
            owned.error(),
            "tokenizer.ggml.tokens: the vocabulary is empty"
        );
    }

    fn fixture(name: &str) -> serde_json::Value {
        let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("read fixture");
        serde_json::from_str(&text).expect("fixture JSON")
    }

    fn strings(v: &serde_json::Value) -> Vec<String> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|s| s.as_str().expect("string").to_string())
            .collect()
    }

    fn numbers<T: TryFrom<i64>>(v: &serde_json::Value) -> Vec<T> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|n| {
                T::try_from(n.as_i64().expect("integer"))
                    .ok()
                    .expect("in range")
            })
            .collect()
    }

    /// Compares the ids of every corpus text with llama.cpp's; returns the mismatches.
    fn compare(
        tok: &GgufTokenizer,
        corpus: &[String],
        expected: &serde_json::Value,
        label: &str,
    ) -> Vec<String> {
        let mut bad = Vec::new();
        for (text, want) in corpus.iter().zip(expected.as_array().expect("ids")) {
            let want: Vec<u32> = numbers(want);
            let got = ids(tok, text, false);
            if got != want {
                bad.push(format!(
                    "{label}: {text:?}\n  got  {got:?}\n  want {want:?}"
                ));
            }
            // The text comes back, but for the "▁" a SentencePiece vocabulary with
            // add_space_prefix puts after each special token (llama.cpp's decode keeps it too).
            let added = tok.tokenizer.get_added_tokens_decoder();
            let spaced = got.iter().any(|id| added.contains_key(id));
            let back = decode(tok, &got, false);
            if back != *text && !(spaced && label == "add_space_prefix") {
                bad.push(format!("{label}: {text:?} decodes to {back:?}"));
            }
        }
        bad
    }

    /// llama.cpp's ids, end-of-generation set and add_bos under every pre-tokenizer, for a
    /// byte-level BPE vocabulary cut from SmolLM2's (tests/fixtures/smollm2_gguf_tokens.py).
    #[test]
    fn bpe_ids_equal_llama_cpp_under_every_pre_tokenizer() {
        let fx = fixture("gguf_bpe_pre_tokenizers.json");
        let corpus = strings(&fx["corpus"]);
        let tokens = strings(&fx["tokens"]);
        let types: Vec<i32> = numbers(&fx["token_types"]);
        let merges = strings(&fx["merges"]);
        let pres = fx["pre"].as_object().expect("pre");
        assert!(pres.len() >= 26, "{} pre-tokenizers", pres.len());
        let mut bad = Vec::new();
        for (pre, want) in pres {
            let v = GgufVocab {
                model: "gpt2",
                pre: Some(pre),
                tokens: &tokens,
                scores: None,
                token_types: Some(&types),
                merges: Some(&merges),
                bos: Some(1),
                eos: Some(2),
                eot: None,
                eom: None,
                unk: None,
                pad: None,
                add_bos: None,
                add_eos: None,
                add_space_prefix: None,
            };
            let tok = build(&v).expect("build");
            assert_eq!(tok.eog_ids, numbers::<u32>(&want["eog"]), "{pre}: eog");
            assert_eq!(
                Some(tok.add_bos),
                want["add_bos"].as_bool(),
                "{pre}: add_bos"
            );
            bad.extend(compare(&tok, &corpus, &want["ids"], pre));
        }
        assert!(
            bad.is_empty(),
            "{} mismatches:\n{}",
            bad.len(),
            bad.join("\n")
        );
    }

    /// llama.cpp's ids for a SentencePiece vocabulary with scores, byte tokens and control
    /// tokens, with and without add_space_prefix.
    #[test]
    fn spm_ids_equal_llama_cpp() {
        let fx = fixture("gguf_spm_tokens.json");
        let corpus = strings(&fx["corpus"]);
        let tokens = strings(&fx["tokens"]);
        let types: Vec<i32> = numbers(&fx["token_types"]);
        let scores: Vec<f32> = fx["scores"]
            .as_array()
            .expect("scores")
            .iter()
            .map(|s| s.as_f64().expect("number") as f32)
            .collect();
        let mut bad = Vec::new();
        for (key, space_prefix) in [("add_space_prefix", true), ("no_space_prefix", false)] {
            let want = &fx[key];
            let v = GgufVocab {
                model: "llama",
                pre: None,
                tokens: &tokens,
                scores: Some(&scores),
                token_types: Some(&types),
                merges: None,
                bos: Some(1),
                eos: Some(2),
                eot: None,
                eom: None,
                unk: Some(0),
                pad: None,
                add_bos: None,
                add_eos: None,
                add_space_prefix: Some(space_prefix),
            };
            let tok = build(&v).expect("build");
            assert_eq!(tok.eog_ids, numbers::<u32>(&want["eog"]), "{key}: eog");
            assert_eq!(
                Some(tok.add_bos),
                want["add_bos"].as_bool(),
                "{key}: add_bos"
            );
            bad.extend(compare(&tok, &corpus, &want["ids"], key));
        }
        assert!(
            bad.is_empty(),
            "{} mismatches:\n{}",
            bad.len(),
            bad.join("\n")
        );
    }
}
