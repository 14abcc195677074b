//! Scheduler: which sequences run in the next step, and how many of their tokens.
//!
//! Each step: every running sequence that is decoding gets its one row first; then running
//! prefills get chunks from what is left of the token budget; then waiting sequences are admitted
//! (first come, first served) while rows, budget and K/V blocks allow. A prompt whose leading full
//! blocks are in the prefix cache starts after them. When a running sequence needs a block and
//! none is left, the most recently admitted sequence is preempted: its blocks are released (full
//! ones stay cached) and it goes back to the front of the queue, to be recomputed on readmission.

use std::collections::VecDeque;

use super::sequence::Sequence;
use crate::kv::blocks::BlockPool;
use crate::kv::prefix::extend_hashes;

/// One sequence's share of a step: `len` tokens from `tokens[computed..]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub seq: u64,
    pub len: usize,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct SchedulerCounters {
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache at admission, and those found.
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
}

pub struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    /// In admission order: the last one is the first to be preempted.
    pub running: Vec<Sequence>,
    max_batch: usize,
    max_batch_tokens: usize,
    block_size: usize,
    /// Start of every prefix hash chain: names the model and the K/V format.
    salt: u64,
    pub counters: SchedulerCounters,
}

impl Scheduler {
    pub fn new(max_batch: usize, max_batch_tokens: usize, block_size: usize, salt: u64) -> Self {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_batch,
            max_batch_tokens,
            block_size,
            salt,
            counters: SchedulerCounters::default(),
        }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn running_mut(&mut self, id: u64) -> Option<&mut Sequence> {
        self.running.iter_mut().find(|s| s.id == id)
    }

    /// Plans the next step. Every planned sequence's block table covers its chunk on return.
    pub fn schedule(&mut self, kv: &mut BlockPool) -> Vec<Chunk> {
        let mut plan: Vec<Chunk> = Vec::new();
        let mut budget = self.max_batch_tokens;

        // Decode rows first, then prefill chunks, each in admission order: a long prompt never
        // holds back the sequences that are already streaming.
        for decoding in [true, false] {
            let mut i = 0;
            while i < self.running.len() {
                let seq = &self.running[i];
                let pending = seq.pending();
                if (pending == 1) != decoding || plan.iter().any(|c| c.seq == seq.id) {
                    i += 1;
                    continue;
                }
                let len = pending.min(budget);
                if len == 0 {
                    break;
                }
                let target = seq.computed + len;
                // Grow the table, preempting the newest sequences while blocks are short.
                let mut fits = true;
                while !self.grow(i, target, kv) {
                    let last = self.running.len() - 1;
                    if let Some(p) = plan.iter().position(|c| c.seq == self.running[last].id) {
                        budget += plan.remove(p).len;
                    }
                    self.preempt(last, kv);
                    if last == i {
                        fits = false;
                        break;
                    }
                }
                if !fits {
                    break; // `i` was the newest; nothing after it is left
                }
                plan.push(Chunk {
                    seq: self.running[i].id,
                    len,
                });
                budget -= len;
                i += 1;
            }
        }

        // Admit waiting sequences while there is room.
        while budget > 0 && self.running.len() < self.max_batch {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            if let Some(first) = seq.follows {
                // Later choices wait until the first one's prompt blocks are cached.
                let first_busy = self.waiting.iter().any(|s| s.id == first)
                    || self.running.iter().any(|s| s.id == first && s.in_prefill());
                if first_busy {
                    break;
                }
            }
            let Some(len) = self.admit(budget, kv) else {
                break;
            };
            let seq = &self.running[self.running.len() - 1];
            plan.push(Chunk { seq: seq.id, len });
            budget -= len;
        }
        plan
    }

    /// Moves the front of the queue to `running` with blocks for its first chunk (at most
    /// `budget` tokens), reusing cached prefix blocks; `None` when the blocks are not there.
    fn admit(&mut self, budget: usize, kv: &mut BlockPool) -> Option<usize> {
        let bs = self.block_size;
        let seq = self.waiting.front_mut()?;
        extend_hashes(self.salt, &seq.tokens, bs, &mut seq.hashes);
        // At least the last token is fed to the model: its logits pick the next token.
        let usable = (seq.tokens.len() - 1) / bs;
        let hit = kv.lookup(&seq.hashes[..usable], &seq.tokens);
        for &b in &hit {
            kv.retain(b);
        }
        let cached = hit.len() * bs;
        let len = (seq.tokens.len() - cached).min(budget);
        let need = (cached + len).div_ceil(bs) - hit.len();
        let Some(fresh) = kv.allocate(need) else {
            kv.release(&hit);
            return None;
        };
        let mut seq = self.waiting.pop_front()?;
        if seq.admissions == 0 {
            seq.cached_tokens = cached;
            self.counters.prefix_query_tokens += seq.prompt_len as u64;
            self.counters.prefix_hit_tokens += cached as u64;
        }
        seq.admissions += 1;
        seq.registered = hit.len();
        seq.table = hit;
        seq.table.extend(fresh);
        seq.computed = cached;
        self.running.push(seq);
        Some(len)
    }

    /// Extends running sequence `i`'s table to cover `target` tokens; false when blocks are short.
    fn grow(&mut self, i: usize, target: usize, kv: &mut BlockPool) -> bool {
        let seq = &mut self.running[i];
        let need = target
            .div_ceil(self.block_size)
            .saturating_sub(seq.table.len());
        if need == 0 {
            return true;
        }
        match kv.allocate(need) {
            Some(b) => {
                seq.table.extend(b);
                true
            }
            None => false,
        }
    }

    /// Sends running sequence `i` back to the front of the queue without its blocks.
    fn preempt(&mut self, i: usize, kv: &mut BlockPool) {
        let mut seq = self.running.remove(i);
        kv.release(&seq.table);
        seq.table.clear();
        seq.computed = 0;
        seq.registered = 0;
        self.counters.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Records that a step fed each chunk's tokens, and indexes the blocks that became full.
    pub fn commit(&mut self, plan: &[Chunk], kv: &mut BlockPool) {
        let bs = self.block_size;
        for c in plan {
            let Some(seq) = self.running.iter_mut().find(|s| s.id == c.seq) else {
                continue;
            };
            seq.computed += c.len;
            let full = seq.computed / bs;
            if full > seq.registered {
                extend_hashes(self.salt, &seq.tokens[..full * bs], bs, &mut seq.hashes);
                for b in seq.registered..full {
                    kv.register(
                        seq.table[b],
                        seq.hashes[b],
                        &seq.tokens[b * bs..(b + 1) * bs],
                    );
                }
                seq.registered = full;
            }
        }
    }

    /// Removes a sequence wherever it is, releasing its blocks.
    pub fn remove(&mut self, id: u64, kv: &mut BlockPool) -> Option<Sequence> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(i);
            kv.release(&seq.table);
            seq.table.clear();
            return Some(seq);
        }
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }
}
