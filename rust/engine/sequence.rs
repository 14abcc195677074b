//! Sequence: one choice of one request as it moves through the engine. What the scheduler reads
//! and writes (its tokens, how many of them have K/V in the pool, its block table, its drafts) is
//! the sequence itself; what turns its tokens into a response (sampler, grammar, detokenizer,
//! stop strings, the stream it answers on) is its `Output`, which the scheduler never touches:
//! it is generic over it, so its tests run sequences without any.

use std::time::Instant;

use super::ngram::DraftLength;
use super::request::{CancelFlag, Event};
use super::sampler::Sampler;
use super::stop::StopStrings;
use super::structured::Constraint;
use crate::model::tokenizer::IncrementalDecoder;
use tokio::sync::mpsc::UnboundedSender;

pub struct Sequence<O = Output> {
    /// Engine-wide id of this sequence.
    pub id: u64,
    /// Prompt followed by every token generated so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V is in the pool; `tokens[computed..]` is what the next steps must feed.
    pub computed: usize,
    /// Blocks holding positions `0..table.len() * block_size`.
    pub table: Vec<u32>,
    /// `table[window_from..]` hold this sequence's window references (the blocks its sliding
    /// layers still read; 0 without window slots).
    pub window_from: usize,
    /// Prefix hashes of the full blocks of `tokens` (a chain; see `kv::prefix`).
    pub hashes: Vec<u64>,
    /// Blocks of `table` already registered in the prefix index (or found there).
    pub registered: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Most tokens this sequence may hold (prompt + output): `max_tokens` or the context.
    pub max_len: usize,
    /// For choice i > 0 of a request: the first choice's sequence, whose prompt blocks it waits
    /// for so that it shares them instead of computing them again.
    pub follows: Option<u64>,
    /// How many drafts it tries (speculative decoding); `None` when it does not draft.
    pub drafting: Option<DraftLength>,
    /// This step's drafts, empty when it drafts none: they follow its pending token in the step
    /// (`fed`), and the step's logits at each of those rows check them.
    pub drafts: Vec<u32>,
    /// The pending token followed by `drafts`.
    pub fed: Vec<u32>,
    /// Tokens whose draft-model K/V is in the pool (with a draft model; `<= computed` between
    /// steps, except that a draft-model proposal runs ahead of it within a step).
    pub draft_computed: usize,
    /// Whether it keeps the draft model's K/V (with a draft model): from admission when it
    /// drafts, until its drafts stay rejected (it detaches: no more drafts, no draft forward)
    /// or a prefix hit reaches blocks without the draft's K/V. Its blocks indexed after that
    /// are marked as without it ([`crate::kv::blocks::BlockPool::set_draft_kv`]).
    pub draft_kv: bool,
    /// Times admitted (more than once after a preemption).
    pub admissions: u32,
    /// What makes its response; the scheduler never reads it.
    pub out: O,
}

/// A sequence's response side: how its next token is picked, and how its tokens become the
/// deltas of its stream.
pub struct Output {
    /// The request it belongs to, and which of its `n` choices it is.
    pub request_id: u64,
    pub index: usize,
    pub sampler: Sampler,
    /// The grammar the output follows, if the request set one.
    pub constraint: Option<Constraint>,
    pub detok: IncrementalDecoder,
    pub stop: StopStrings,
    /// Token ids that end the choice: EOS (unless ignored) and `stop_token_ids`.
    pub stop_ids: Vec<u32>,
    pub want_logprobs: bool,
    pub events: UnboundedSender<Event>,
    pub cancel: CancelFlag,
    pub arrived: Instant,
    pub first_token_at: Option<Instant>,
}

impl<O> Sequence<O> {
    /// A sequence not yet admitted: no K/V, no blocks, no drafts.
    pub fn new(id: u64, prompt: Vec<u32>, max_len: usize, out: O) -> Sequence<O> {
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            table: Vec::new(),
            window_from: 0,
            hashes: Vec::new(),
            registered: 0,
            cached_tokens: 0,
            max_len,
            follows: None,
            drafting: None,
            drafts: Vec::new(),
            fed: Vec::new(),
            draft_computed: 0,
            draft_kv: false,
            admissions: 0,
            out,
        }
    }

    /// Tokens not yet fed to the model.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether the first forward of its prompt is still ahead (or in progress).
    pub fn in_prefill(&self) -> bool {
        self.tokens.len() == self.prompt_len
    }
}
