//! Scheduler: which sequences run in the next step, and how many of their tokens.
//!
//! Each step: every running sequence that is decoding gets its one row first; then running
//! prefills get chunks from what is left of the token budget; then waiting sequences are admitted
//! (first come, first served) while rows, budget and K/V blocks allow. A prompt whose leading full
//! blocks are in the prefix cache starts after them. When a running sequence needs a block and
//! none is left, the most recently admitted sequence is preempted: its blocks are released (full
//! ones stay cached) and it goes back to the front of the queue, to be recomputed on readmission.

use std::collections::VecDeque;

use super::ngram::{
    best_draft_len, expected_accepted, propose, DraftOptions, StepCosts, StepSoFar,
};
use super::sequence::{Output, Sequence};
use crate::cache::ConversationCache;
use crate::kv::blocks::BlockPool;
use crate::kv::prefix::extend_hashes;

/// One sequence's share of a step: `len` tokens from `tokens[computed..]`, or, when the sequence
/// drafts, its pending token and its drafts (`Sequence::fed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub seq: u64,
    pub len: usize,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct SchedulerCounters {
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache at admission, and those found on the device
    /// (the tiers below count their own hits).
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Sequences that stopped keeping a draft model's K/V (`Sequence::draft_kv`).
    pub draft_detached: u64,
}

/// Generic over the sequences' `Output`, which it never reads: the engine schedules
/// `Sequence<Output>`, the tests here sequences without one.
pub struct Scheduler<O = Output> {
    pub waiting: VecDeque<Sequence<O>>,
    /// In admission order: the last one is the first to be preempted.
    pub running: Vec<Sequence<O>>,
    max_batch: usize,
    max_batch_tokens: usize,
    block_size: usize,
    /// Start of every prefix hash chain: names the model and the K/V format.
    salt: u64,
    /// Drafting settings (n-gram lookup or a draft model), when the engine decodes
    /// speculatively.
    pub speculative: Option<DraftOptions>,
    /// Measured decode step times by rows, which decide how many drafts pay.
    pub step_costs: StepCosts,
    pub counters: SchedulerCounters,
}

impl<O> Scheduler<O> {
    pub fn new(max_batch: usize, max_batch_tokens: usize, block_size: usize, salt: u64) -> Self {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_batch,
            max_batch_tokens,
            block_size,
            salt,
            speculative: None,
            step_costs: StepCosts::default(),
            counters: SchedulerCounters::default(),
        }
    }

    /// Most sequences running at once.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn running_mut(&mut self, id: u64) -> Option<&mut Sequence<O>> {
        self.running.iter_mut().find(|s| s.id == id)
    }

    /// Plans the next step. Every planned sequence's block table covers its chunk on return.
    pub fn schedule(&mut self, kv: &mut BlockPool, cache: &mut ConversationCache) -> Vec<Chunk> {
        let mut plan: Vec<Chunk> = Vec::new();
        let mut budget = self.max_batch_tokens;
        let decode_rows = self
            .running
            .iter()
            .filter(|s| s.pending() == 1)
            .count()
            .min(budget);
        // The step without the drafts not yet planned (`best_draft_len`).
        let mut step = StepSoFar {
            rows: decode_rows,
            tokens: decode_rows as f64,
        };

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
                while !self.grow(i, target, kv, cache) {
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
                let drafts = if decoding {
                    let (n, accepted) = self.draft(i, step, budget - len, kv, cache);
                    step.rows += n;
                    step.tokens += accepted;
                    n
                } else {
                    0
                };
                let len = len + drafts;
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
                // Later choices wait until the first one's full prompt blocks are cached.
                let shareable = (seq.prompt_len - 1) / self.block_size;
                let first_busy = self.waiting.iter().any(|s| s.id == first)
                    || self
                        .running
                        .iter()
                        .any(|s| s.id == first && s.registered < shareable);
                if first_busy {
                    break;
                }
            }
            let Some(len) = self.admit(budget, kv, cache) else {
                break;
            };
            let seq = &self.running[self.running.len() - 1];
            plan.push(Chunk { seq: seq.id, len });
            budget -= len;
        }
        plan
    }

    /// Moves the front of the queue to `running` with blocks for its first chunk (at most
    /// `budget` tokens), reusing cached prefix blocks: those on the device, then those the tiers
    /// below can restore when the device can take them. `None` when the blocks are not there.
    ///
    /// The prompt's blocks, and what each count means (`usable` stops one token short of the
    /// end: the last token is always computed, its logits pick the next one):
    ///
    /// ```text
    /// prompt:   | hit (device, retained) | restored (host/disk -> fresh) | chunk ... | rest
    ///           |<------- cached = (hit + restored) * bs tokens -------->|<- len ->|
    /// blocks:   | hit.len()              | need(restored) fresh blocks: the restored ones,
    ///           |                        | then those the chunk's len tokens reach into
    /// ```
    ///
    /// `below` is what the tiers could restore (`probe`), 0 when the device cannot take it
    /// (`admit_onload`); `restored <= below` is what the move did restore, and blocks allocated
    /// for a shortfall are released at once.
    fn admit(
        &mut self,
        budget: usize,
        kv: &mut BlockPool,
        cache: &mut ConversationCache,
    ) -> Option<usize> {
        let bs = self.block_size;
        let seq = self.waiting.front_mut()?;
        extend_hashes(self.salt, &seq.tokens, bs, &mut seq.hashes);
        // At least the last token is fed to the model: its logits pick the next token.
        let usable = (seq.tokens.len() - 1) / bs;
        let mut hit = kv.lookup(&seq.hashes[..usable], &seq.tokens);
        for &b in &hit {
            kv.retain(b);
        }
        let mut below = cache.probe(&seq.hashes[..usable], &seq.tokens, hit.len());
        // Every device of the split must be able to take what the move allocates on it.
        if below > 0 && !cache.admit_onload(&seq.hashes, &seq.tokens, hit.len(), below) {
            below = 0;
        }
        // Blocks for the restored prefix and the first chunk after it.
        let need = |hit: usize, restored: usize| {
            let cached = (hit + restored) * bs;
            let len = (seq.tokens.len() - cached).min(budget);
            (cached + len).div_ceil(bs) - hit
        };
        let mut restored = 0;
        let mut table = None;
        if below > 0 {
            // Restored blocks take window slots only for the sliding layers' part they bring.
            match kv.allocate_unslotted(need(hit.len(), below)) {
                Some(a) => {
                    cache.offload(kv, &a.evicted);
                    restored =
                        cache.onload(kv, &a.blocks[..below], &seq.hashes, &seq.tokens, hit.len());
                    let mut blocks = a.blocks;
                    let mut chain = hit.clone();
                    chain.extend_from_slice(&blocks[..restored]);
                    // A restore that stopped short needs fewer blocks; the rest were never used.
                    let keep = need(hit.len(), restored);
                    if kv.usable_prefix(&chain) < chain.len()
                        || !kv.give_slots(&blocks[restored..keep])
                    {
                        // The next token's window lacks a sliding layers' part (a block passed
                        // by an earlier window), or the blocks to compute lack slots: the
                        // restored blocks stay cached, and the sequence starts where the
                        // device's own blocks let it.
                        kv.release(&blocks);
                        restored = 0;
                    } else {
                        kv.release(&blocks[keep..]);
                        blocks.truncate(keep);
                        table = Some(blocks);
                    }
                }
                None => cache.refuse_onload(below * bs, kv.num_free(), need(hit.len(), below)),
            }
        }
        let fresh = match table {
            Some(t) => t,
            None => {
                // With window slots the device's blocks count only as far as the next token's
                // window has its slots.
                let n = kv.usable_prefix(&hit);
                kv.release(&hit[n..]);
                hit.truncate(n);
                match kv.allocate(need(hit.len(), 0)) {
                    Some(a) => {
                        cache.offload(kv, &a.evicted);
                        a.blocks
                    }
                    None => {
                        kv.release(&hit);
                        return None;
                    }
                }
            }
        };
        let cached = (hit.len() + restored) * bs;
        let len = (seq.tokens.len() - cached).min(budget);
        let mut seq = self.waiting.pop_front()?;
        if seq.admissions == 0 {
            seq.cached_tokens = cached;
            self.counters.prefix_query_tokens += seq.prompt_len as u64;
            self.counters.prefix_hit_tokens += (hit.len() * bs) as u64;
        }
        seq.admissions += 1;
        seq.registered = hit.len() + restored;
        seq.table = hit;
        seq.table.extend(fresh);
        seq.computed = cached;
        // The draft model continues from where its K/V ends: a sequence that keeps it and
        // found blocks without it (indexed by one that did not) cannot compute it in blocks it
        // shares, so it detaches.
        seq.draft_computed = kv.draft_kv_prefix(&seq.table[..cached / bs]) * bs;
        if seq.draft_kv && seq.draft_computed < cached {
            seq.draft_kv = false;
            self.counters.draft_detached += 1;
        }
        seq.window_from = kv.first_kept(cached);
        kv.enter_windows(&seq.table, seq.window_from);
        self.running.push(seq);
        Some(len)
    }

    /// Extends running sequence `i`'s table to cover `target` tokens; false when blocks are short.
    fn grow(
        &mut self,
        i: usize,
        target: usize,
        kv: &mut BlockPool,
        cache: &mut ConversationCache,
    ) -> bool {
        let seq = &mut self.running[i];
        let need = target
            .div_ceil(self.block_size)
            .saturating_sub(seq.table.len());
        if need == 0 {
            return true;
        }
        match kv.allocate(need) {
            Some(a) => {
                cache.offload(kv, &a.evicted);
                let from = seq.table.len();
                seq.table.extend(a.blocks);
                kv.enter_windows(&seq.table[from..], 0);
                true
            }
            None => false,
        }
    }

    /// Proposes drafts for decoding sequence `i` (at most `room` tokens of the step's budget;
    /// `step`: the step as planned without its drafts) as many as pay for their rows, and grows
    /// its table for them; returns how many, and how many of them are expected to be accepted.
    /// Drafts are an optimization: where the blocks for them are not free, the sequence decodes
    /// without (nobody is preempted and no cached block is evicted for them).
    fn draft(
        &mut self,
        i: usize,
        step: StepSoFar,
        room: usize,
        kv: &mut BlockPool,
        cache: &mut ConversationCache,
    ) -> (usize, f64) {
        let seq = &mut self.running[i];
        seq.drafts.clear();
        let (Some(options), Some(drafting)) = (self.speculative, seq.drafting.as_mut()) else {
            return (0, 0.0);
        };
        if options.model && !seq.draft_kv {
            return (0, 0.0);
        }
        // Every draft accepted, plus the token after them, must fit the sequence's length.
        let fits = seq.max_len.saturating_sub(seq.tokens.len() + 1);
        // The adaptive policy weighs every draft the options allow (`best_draft_len`); without
        // it the length follows the last steps' acceptance (`DraftLength::take`).
        let wanted = if options.adaptive {
            options.max_drafts
        } else {
            drafting.take()
        };
        let max = wanted.min(room).min(fits);
        if options.model {
            // The draft model fills them in before the step's forward (`EngineCore::propose`).
            seq.drafts.resize(max, 0);
        } else {
            propose(&seq.tokens, &options, max, &mut seq.drafts);
        }
        if options.adaptive {
            let (available, rate) = (seq.drafts.len(), drafting.rate());
            let best = best_draft_len(&self.step_costs, step, available, rate);
            // Paused, a draft model still costs its catch-up on every token. One whose drafts
            // stay rejected, or whose rate no draft pays at even counting only its own tokens
            // (a rate no draft then updates), stops for the rest of the sequence.
            let alone = StepSoFar {
                rows: step.rows,
                tokens: 1.0,
            };
            let pays = available == 0
                || best_draft_len(&self.step_costs, alone, available, rate) != Some(0);
            if options.model && (drafting.stays_rejected() || !pays) {
                seq.draft_kv = false;
                seq.drafts.clear();
                self.counters.draft_detached += 1;
                return (0, 0.0);
            }
            // Not measured yet: none this step, which measures it. None pays at the estimated
            // rate: one draft now and then all the same (`DraftLength::probe`), since only
            // checked drafts move the estimate.
            let n = match best {
                None => 0,
                Some(0) => usize::from(available > 0 && drafting.probe()),
                Some(k) => {
                    drafting.chosen();
                    k
                }
            };
            seq.drafts.truncate(n);
        }
        let n = seq.drafts.len();
        if n == 0 {
            return (0, 0.0);
        }
        let target = seq.computed + 1 + n;
        let need = target
            .div_ceil(self.block_size)
            .saturating_sub(seq.table.len());
        if need > kv.num_empty() || !self.grow(i, target, kv, cache) {
            self.running[i].drafts.clear();
            return (0, 0.0);
        }
        let seq = &mut self.running[i];
        seq.fed.clear();
        seq.fed.extend_from_slice(&seq.tokens[seq.computed..]);
        seq.fed.extend_from_slice(&seq.drafts);
        let rate = seq.drafting.as_ref().map_or(0.0, |d| d.rate());
        (n, expected_accepted(n, rate))
    }

    /// Sends running sequence `i` back to the front of the queue without its blocks.
    fn preempt(&mut self, i: usize, kv: &mut BlockPool) {
        let mut seq = self.running.remove(i);
        kv.release_table(&seq.table, seq.window_from);
        seq.table.clear();
        seq.window_from = 0;
        seq.drafts.clear();
        seq.computed = 0;
        seq.draft_computed = 0;
        seq.registered = 0;
        self.counters.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Records that a step fed each chunk's tokens, and indexes the blocks that became full.
    /// Drafts are not counted: their K/V counts once they are accepted (`accept_drafts`).
    pub fn commit(&mut self, plan: &[Chunk], kv: &mut BlockPool) {
        for c in plan {
            if let Some(i) = self.running.iter().position(|s| s.id == c.seq) {
                let fed = c.len - self.running[i].drafts.len();
                self.advance(i, fed, kv);
            }
        }
    }

    /// After sampling a drafting sequence: its K/V counts up to its last token (the accepted
    /// drafts were fed), its table is cut back to what that needs (the rejected drafts' blocks
    /// are released unindexed), and its drafts are cleared. So its blocks and the prefix index
    /// are those of a run without drafts.
    pub fn accept_drafts(&mut self, id: u64, kv: &mut BlockPool) {
        let Some(i) = self.running.iter().position(|s| s.id == id) else {
            return;
        };
        let seq = &mut self.running[i];
        if seq.drafts.is_empty() {
            return;
        }
        seq.drafts.clear();
        let accepted = (seq.tokens.len() - 1).saturating_sub(seq.computed);
        self.advance(i, accepted, kv);
        let seq = &mut self.running[i];
        let keep = seq.computed.div_ceil(self.block_size);
        if seq.table.len() > keep {
            // The window reaches every drafted block (`window_from <= computed / block_size`).
            kv.release_table(&seq.table[keep..], 0);
            seq.table.truncate(keep);
        }
    }

    /// Counts `n` more of running sequence `i`'s tokens as in the pool, and indexes the blocks
    /// that became full.
    fn advance(&mut self, i: usize, n: usize, kv: &mut BlockPool) {
        let bs = self.block_size;
        let seq = &mut self.running[i];
        seq.computed += n;
        let mut passed = kv.first_kept(seq.computed).min(seq.table.len());
        if passed > seq.window_from {
            // Later choices of the request, still waiting, will continue from its prompt's
            // blocks: the window there stays until they are admitted.
            let id = seq.id;
            if self.waiting.iter().any(|w| w.follows == Some(id)) {
                let seq = &self.running[i];
                let shared = (seq.prompt_len - 1) / bs * bs;
                passed = passed.min(kv.first_kept(shared).max(seq.window_from));
            }
        }
        let seq = &mut self.running[i];
        if passed > seq.window_from {
            kv.pass_window(&seq.table[seq.window_from..passed]);
            seq.window_from = passed;
        }
        let full = seq.computed / bs;
        if full > seq.registered {
            extend_hashes(self.salt, &seq.tokens[..full * bs], bs, &mut seq.hashes);
            for b in seq.registered..full {
                kv.register(
                    seq.table[b],
                    seq.hashes[b],
                    &seq.tokens[b * bs..(b + 1) * bs],
                );
                // A sequence that keeps the draft's K/V has it in every full block once the
                // step ends (`EngineCore::catch_up_draft`).
                let with_draft = seq.draft_kv || (b + 1) * bs <= seq.draft_computed;
                kv.set_draft_kv(seq.table[b], with_draft);
            }
            seq.registered = full;
        }
    }

    /// Removes a sequence wherever it is, releasing its blocks.
    pub fn remove(&mut self, id: u64, kv: &mut BlockPool) -> Option<Sequence<O>> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(i);
            kv.release_table(&seq.table, seq.window_from);
            seq.table.clear();
            seq.window_from = 0;
            return Some(seq);
        }
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::blocks::KvDtype;

    const BS: usize = 4;

    /// A sequence without an output side: the scheduler needs none.
    fn seq(id: u64, tokens: Vec<u32>) -> Sequence<()> {
        Sequence::new(id, tokens, 1000, ())
    }

    fn pool(blocks: usize) -> BlockPool {
        BlockPool::new(1, blocks, BS, 1, 2, KvDtype::F32).unwrap()
    }

    /// Runs a step's bookkeeping without a model: feeds the plan and "samples" token 7 for every
    /// sequence whose chunk reached its end.
    fn fake_step(s: &mut Scheduler<()>, kv: &mut BlockPool) -> Vec<Chunk> {
        let mut cache = ConversationCache::off(BS, kv.bytes_per_block());
        let plan = s.schedule(kv, &mut cache);
        s.commit(&plan, kv);
        for c in &plan {
            let seq = s.running_mut(c.seq).unwrap();
            if seq.computed == seq.tokens.len() {
                seq.tokens.push(7);
            }
        }
        plan
    }

    #[test]
    fn decodes_go_first_and_prefill_is_chunked_under_the_budget() {
        let mut kv = pool(32);
        let mut s = Scheduler::<()>::new(4, 8, BS, 1);
        s.waiting.push_back(seq(0, vec![1, 2, 3]));
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 0, len: 3 }]);
        // Sequence 0 decodes; a 20-token prompt arrives and gets what is left of the budget.
        s.waiting.push_back(seq(1, (10..30).collect()));
        assert_eq!(
            fake_step(&mut s, &mut kv),
            vec![Chunk { seq: 0, len: 1 }, Chunk { seq: 1, len: 7 }]
        );
        assert_eq!(
            fake_step(&mut s, &mut kv),
            vec![Chunk { seq: 0, len: 1 }, Chunk { seq: 1, len: 7 }]
        );
        assert_eq!(
            fake_step(&mut s, &mut kv),
            vec![Chunk { seq: 0, len: 1 }, Chunk { seq: 1, len: 6 }]
        );
        // Both decode now.
        assert_eq!(
            fake_step(&mut s, &mut kv),
            vec![Chunk { seq: 0, len: 1 }, Chunk { seq: 1, len: 1 }]
        );
        let tables: Vec<usize> = s.running.iter().map(|q| q.table.len()).collect();
        // 3 prompt + 4 generated = 7 tokens fed (2 blocks); 20 + 1 fed = 21 tokens (6 blocks).
        assert_eq!(tables, vec![2, 6]);
        assert_eq!(kv.num_used(), 8);
    }

    /// Every running sequence's window has its slots, and each block of it one reference (a
    /// sequence whose later choices wait may hold more).
    fn assert_windows_held(s: &Scheduler<()>, kv: &BlockPool) {
        for q in &s.running {
            let kept = kv.first_kept(q.computed).min(q.table.len());
            if s.waiting.iter().any(|w| w.follows == Some(q.id)) {
                assert!(q.window_from <= kept);
            } else {
                assert_eq!(q.window_from, kept);
            }
            assert!(
                kv.has_window_slots(&q.table[q.window_from..]),
                "seq {}",
                q.id
            );
        }
    }

    /// A one-layer pool of `blocks` whose layer slides over 8 positions (a token reads at most 3
    /// blocks of 4) in `slots` window slots.
    fn window_pool(blocks: usize, slots: usize) -> BlockPool {
        let window = crate::kv::window::WindowLayout {
            window: 8,
            layers: vec![true],
            num_slots: slots,
        };
        BlockPool::windowed(&[1], blocks, Some(window), BS, 1, 2, KvDtype::F32).unwrap()
    }

    #[test]
    fn sliding_windows_give_their_slots_back_and_a_conversation_resumes_exactly() {
        let mut kv = window_pool(32, 6);
        let mut s = Scheduler::<()>::new(4, 8, BS, 1);
        let prompt: Vec<u32> = (100..140).collect();
        s.waiting.push_back(seq(0, prompt.clone()));
        // 40 prompt tokens in chunks of 8, then decoding: never more than 4 slots held.
        for _ in 0..12 {
            fake_step(&mut s, &mut kv);
            assert_windows_held(&s, &kv);
            let (_, used, _) = kv.window_slots().unwrap();
            assert!(used <= 4, "{used} slots held");
        }
        let q = &s.running[0];
        // 40 + 7 tokens fed (12 blocks); the next token reads positions 40..=47.
        // It keeps the window of its last full block's end (44 reads 37..=44): blocks 9 to 11.
        assert_eq!((q.computed, q.table.len(), q.window_from), (47, 12, 9));
        assert_eq!(kv.window_slots(), Some((6, 3, 9)));
        assert_eq!(kv.num_used(), 12, "the full layers keep every block");
        // The conversation ends: its last blocks stay cached with their slots, and it comes
        // back with one more turn. Its whole history is a hit; the next token's window is there.
        let mut done = s.remove(0, &mut kv).unwrap();
        assert_eq!(kv.num_used(), 0);
        done.tokens.extend([5, 6, 7]);
        s.waiting.push_back(seq(1, done.tokens.clone()));
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 1, len: 7 }]);
        assert_eq!(s.running[0].cached_tokens, 44);
        assert_windows_held(&s, &kv);
        // Another conversation that shares only the first 20 tokens finds those blocks without
        // their sliding part: it starts from the beginning.
        let mut other = prompt[..20].to_vec();
        other.extend([1, 2, 3, 4, 5]);
        s.waiting.push_back(seq(2, other));
        fake_step(&mut s, &mut kv);
        assert_eq!(s.running[1].cached_tokens, 0);
        assert_windows_held(&s, &kv);
    }

    #[test]
    fn window_slot_pressure_preempts_and_every_sequence_finishes() {
        // Three sequences whose windows need 3 to 5 slots each, in 7.
        let mut kv = window_pool(64, 7);
        let mut s = Scheduler::<()>::new(4, 8, BS, 1);
        for id in 0..3u64 {
            let prompt = (0..30).map(|t| 100 * id as u32 + t).collect();
            s.waiting.push_back(seq(id, prompt));
        }
        let mut finished = Vec::new();
        let mut least_free = usize::MAX;
        for _ in 0..300 {
            fake_step(&mut s, &mut kv);
            assert_windows_held(&s, &kv);
            let (total, used, _) = kv.window_slots().unwrap();
            assert!(used <= total);
            least_free = least_free.min(kv.num_free());
            let done: Vec<u64> = s
                .running
                .iter()
                .filter(|q| q.tokens.len() >= q.prompt_len + 20)
                .map(|q| q.id)
                .collect();
            for id in done {
                let q = s.remove(id, &mut kv).unwrap();
                assert_eq!(q.tokens[q.prompt_len..], [7; 20]);
                finished.push(id);
            }
            if s.is_idle() {
                break;
            }
        }
        finished.sort_unstable();
        assert_eq!(finished, vec![0, 1, 2]);
        assert!(least_free <= 1, "{least_free} slots left at least");
        assert!(s.counters.preemptions > 0, "the slots were short");
        assert_eq!(kv.num_used(), 0);
    }

    /// Random arrivals (prompts sharing prefixes, some whole earlier conversations coming
    /// back), lengths and finishes on a windowed pool short of blocks and of slots: after every
    /// step the pool's bookkeeping holds and every running window has its slots; at the end
    /// nothing is held.
    #[test]
    fn window_slots_hold_under_random_traffic() {
        let mut rng = crate::rng::Rng(0x5eed);
        for (blocks, slots) in [(24, 9), (40, 12), (64, 40)] {
            let mut kv = window_pool(blocks, slots);
            let mut s = Scheduler::<()>::new(4, 12, BS, 1);
            let stems: Vec<Vec<u32>> = (0..3)
                .map(|k| (0..20).map(|t| 1000 * k + t).collect())
                .collect();
            let mut history: Vec<Vec<u32>> = Vec::new();
            let (mut next_id, mut finished) = (0u64, 0);
            for _ in 0..400 {
                if s.waiting.len() < 3 && rng.below(3) == 0 {
                    let mut prompt = match (history.is_empty(), rng.below(3)) {
                        (false, 0) => history[rng.below(history.len())].clone(),
                        _ => stems[rng.below(stems.len())][..4 + rng.below(16)].to_vec(),
                    };
                    let extra = 1 + rng.below(30);
                    prompt.extend((0..extra).map(|_| 5000 + rng.below(100) as u32));
                    let mut q = seq(next_id, prompt);
                    q.max_len = q.tokens.len() + 1 + rng.below(40);
                    s.waiting.push_back(q);
                    next_id += 1;
                }
                fake_step(&mut s, &mut kv);
                kv.check_window_slots();
                assert_windows_held(&s, &kv);
                let done: Vec<u64> = s
                    .running
                    .iter()
                    .filter(|q| q.tokens.len() >= q.max_len)
                    .map(|q| q.id)
                    .collect();
                for id in done {
                    let q = s.remove(id, &mut kv).unwrap();
                    history.push(q.tokens);
                    finished += 1;
                    kv.check_window_slots();
                }
            }
            while let Some(id) = s.running.first().map(|q| q.id) {
                s.remove(id, &mut kv);
            }
            kv.check_window_slots();
            assert_eq!(kv.num_used(), 0);
            assert!(finished >= 10, "{finished} finished of {next_id}");
            let (_, used, passed) = kv.window_slots().unwrap();
            assert!(passed > 0 && used <= slots);
            assert!(s.counters.preemptions > 0, "the pool was short");
            if slots == 40 {
                assert!(s.counters.prefix_hit_tokens > 0, "conversations came back");
            }
        }
    }

    #[test]
    fn block_pressure_preempts_the_newest_and_it_resumes_from_the_cache() {
        let mut kv = pool(4);
        let mut s = Scheduler::<()>::new(4, 64, BS, 1);
        s.waiting.push_back(seq(0, vec![1, 2, 3, 4, 5, 6])); // 2 blocks
        s.waiting.push_back(seq(1, vec![9, 9, 9, 9, 9])); // 2 blocks
        let plan = fake_step(&mut s, &mut kv);
        assert_eq!(plan.len(), 2);
        assert_eq!(kv.num_free(), 0);
        // Sequence 0 holds 7 tokens (6 fed): feeding the 7th still fits its 2 blocks; the 8th
        // and 9th need a third block, which only preempting sequence 1 can free.
        fake_step(&mut s, &mut kv);
        fake_step(&mut s, &mut kv);
        let plan = fake_step(&mut s, &mut kv);
        assert_eq!(plan, vec![Chunk { seq: 0, len: 1 }]);
        assert_eq!(s.counters.preemptions, 1);
        assert_eq!(s.waiting.front().map(|q| q.id), Some(1));
        let victim = s.waiting.front().unwrap();
        assert_eq!((victim.computed, victim.table.len()), (0, 0));
        // Its first full block stayed cached: readmission starts after it.
        assert_eq!(kv.num_cached(), 3);
        let done = s.running.remove(0);
        kv.release(&done.table);
        // It held 8 tokens (7 fed); the cached block covers 4, so 4 are fed again.
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 1, len: 4 }]);
        assert_eq!(
            s.running[0].cached_tokens, 0,
            "counted at first admission only"
        );
        assert_eq!(s.running[0].tokens.len(), 9);
    }

    #[test]
    fn a_cached_prefix_is_reused_and_the_last_token_is_always_fed() {
        let mut kv = pool(16);
        let mut s = Scheduler::<()>::new(4, 64, BS, 1);
        let prompt: Vec<u32> = (1..=9).collect();
        s.waiting.push_back(seq(0, prompt.clone()));
        fake_step(&mut s, &mut kv);
        let done = s.running.remove(0);
        kv.release(&done.table);
        // Same prompt: 2 full blocks cached, the 9th token is fed.
        s.waiting.push_back(seq(1, prompt.clone()));
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 1, len: 1 }]);
        assert_eq!(s.running[0].cached_tokens, 8);
        let done = s.running.remove(0);
        kv.release(&done.table);
        // A prompt of exactly 8 tokens: only the first block may be reused.
        s.waiting.push_back(seq(2, prompt[..8].to_vec()));
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 2, len: 4 }]);
        assert_eq!(s.running[0].cached_tokens, 4);
        assert_eq!(s.counters.prefix_hit_tokens, 12);
        assert_eq!(s.counters.prefix_query_tokens, 9 + 9 + 8);
    }

    #[test]
    fn blocks_say_whether_they_hold_the_draft_k_v_and_a_hit_without_it_detaches() {
        let mut kv = pool(16);
        kv.attach_draft(1, 1, 2).unwrap();
        let mut s = Scheduler::<()>::new(4, 64, BS, 1);
        let run = |s: &mut Scheduler<()>, kv: &mut BlockPool, id, prompt: &[u32], draft_kv| {
            let mut q = seq(id, prompt.to_vec());
            q.draft_kv = draft_kv;
            s.waiting.push_back(q);
            fake_step(s, kv);
            let q = s.running.remove(0);
            kv.release(&q.table);
            (q.cached_tokens, q.draft_kv, q.draft_computed, q.table)
        };
        // A sequence that keeps no draft K/V indexes its two full blocks without it.
        let prompt: Vec<u32> = (1..=9).collect();
        let (_, _, _, table) = run(&mut s, &mut kv, 0, &prompt, false);
        assert_eq!(kv.draft_kv_prefix(&table[..2]), 0);
        // One that keeps it finds them: its draft model has no K/V there to continue from, and
        // it cannot compute it in shared blocks, so it detaches.
        let (cached, draft_kv, draft_computed, _) = run(&mut s, &mut kv, 1, &prompt, true);
        assert_eq!((cached, draft_kv, draft_computed), (8, false, 0));
        assert_eq!(s.counters.draft_detached, 1);
        // Blocks indexed by one that keeps it hold it, and a hit on them keeps drafting.
        let other: Vec<u32> = (50..59).collect();
        let (_, _, _, table) = run(&mut s, &mut kv, 2, &other, true);
        assert_eq!(kv.draft_kv_prefix(&table[..2]), 2);
        let (cached, draft_kv, draft_computed, _) = run(&mut s, &mut kv, 3, &other, true);
        assert_eq!((cached, draft_kv, draft_computed), (8, true, 8));
        assert_eq!(s.counters.draft_detached, 1);
    }

    #[test]
    fn later_choices_wait_for_the_first_ones_prompt() {
        let mut kv = pool(16);
        let mut s = Scheduler::<()>::new(4, 4, BS, 1);
        s.waiting.push_back(seq(0, (1..=9).collect()));
        let mut second = seq(1, (1..=9).collect());
        second.follows = Some(0);
        s.waiting.push_back(second);
        // Budget 4: the first choice's prompt takes three steps; the second waits for it.
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 0, len: 4 }]);
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 0, len: 4 }]);
        assert_eq!(
            fake_step(&mut s, &mut kv),
            vec![Chunk { seq: 0, len: 1 }, Chunk { seq: 1, len: 1 }]
        );
        assert_eq!(
            s.running[1].cached_tokens, 8,
            "the second choice shares the prompt's blocks"
        );
    }

    #[test]
    fn later_choices_share_the_prompt_after_the_first_ones_window_moved_on() {
        let mut kv = window_pool(64, 32);
        let mut s = Scheduler::<()>::new(4, 4, BS, 1);
        s.waiting.push_back(seq(0, (1..=9).collect()));
        // Another request's long prompt takes the budget the second choice waits for.
        s.waiting.push_back(seq(2, (100..140).collect()));
        let mut second = seq(1, (1..=9).collect());
        second.follows = Some(0);
        s.waiting.push_back(second);
        for _ in 0..40 {
            fake_step(&mut s, &mut kv);
            kv.check_window_slots();
            assert_windows_held(&s, &kv);
            if s.running.iter().any(|q| q.id == 1) {
                break;
            }
        }
        let second = s.running.iter().find(|q| q.id == 1).unwrap();
        assert_eq!(
            second.cached_tokens, 8,
            "the second choice shares the prompt's blocks"
        );
        // The first had decoded well past the prompt meanwhile; its window now moves on.
        let first = s.running.iter().find(|q| q.id == 0).unwrap();
        assert!(kv.first_kept(first.computed) > kv.first_kept(8) + 1);
        fake_step(&mut s, &mut kv);
        assert_windows_held(&s, &kv);
    }

    /// Lookup drafts, up to 4, with the adaptive policy.
    const LOOKUP: DraftOptions = DraftOptions {
        model: false,
        max_drafts: 4,
        min_n: 1,
        max_n: 3,
        adaptive: true,
    };

    /// Runs one sequence to the end of `output` (what the "model" picks at each position), with
    /// n-gram drafts or without; after every step, records (tokens, computed, table blocks, pool
    /// blocks used, blocks indexed) and the drafts proposed and accepted.
    fn run_to_end(
        drafting: bool,
        prompt: &[u32],
        output: &[u32],
    ) -> (Vec<[usize; 5]>, usize, usize) {
        let mut kv = pool(32);
        let mut cache = ConversationCache::off(BS, kv.bytes_per_block());
        let mut s = Scheduler::<()>::new(4, 64, BS, 1);
        let mut q = seq(0, prompt.to_vec());
        if drafting {
            s.speculative = Some(LOOKUP);
            q.drafting = Some(super::super::ngram::DraftLength::new(4));
            // Steps measured as weights-bound (every row count as cheap as one): drafts pay.
            for rows in 1..=8 {
                s.step_costs.record(rows, 0.010);
            }
        }
        s.waiting.push_back(q);
        let (mut records, mut proposed, mut accepted) = (Vec::new(), 0, 0);
        while s.running.first().map_or(0, |q| q.output_len()) < output.len() {
            let plan = s.schedule(&mut kv, &mut cache);
            s.commit(&plan, &mut kv);
            let q = &mut s.running[0];
            if q.computed < q.tokens.len() {
                continue; // a prefill chunk short of the prompt's end
            }
            proposed += q.drafts.len();
            for r in 0..=q.drafts.len() {
                let Some(&next) = output.get(q.output_len()) else {
                    break;
                };
                q.tokens.push(next);
                if q.drafts.get(r) != Some(&next) {
                    break;
                }
                accepted += 1;
            }
            s.accept_drafts(0, &mut kv);
            let q = &s.running[0];
            records.push([
                q.tokens.len(),
                q.computed,
                q.table.len(),
                kv.num_used(),
                kv.num_cached(),
            ]);
        }
        (records, proposed, accepted)
    }

    /// The steps (of the first 40) at which a sequence that repeats "1 2 3 4 5" drafts, and how
    /// many drafts, with step costs `cost(rows)`; the model goes on repeating it (drafts are
    /// right; the estimate is not updated here, so it stays at its prior of one in two).
    fn drafted_steps(cost: impl Fn(usize) -> f64) -> Vec<(usize, usize)> {
        let mut kv = pool(64);
        let mut cache = ConversationCache::off(BS, kv.bytes_per_block());
        let mut s = Scheduler::<()>::new(4, 64, BS, 1);
        s.speculative = Some(LOOKUP);
        for rows in 1..=8 {
            s.step_costs.record(rows, cost(rows));
        }
        let mut q = seq(0, [1, 2, 3, 4, 5].repeat(2));
        q.drafting = Some(super::super::ngram::DraftLength::new(4));
        s.waiting.push_back(q);
        let mut drafted = Vec::new();
        for step in 0..40 {
            let plan = s.schedule(&mut kv, &mut cache);
            s.commit(&plan, &mut kv);
            let q = &mut s.running[0];
            if q.computed < q.tokens.len() {
                continue;
            }
            if !q.drafts.is_empty() {
                drafted.push((step, q.drafts.len()));
            }
            for _ in 0..=q.drafts.len() {
                q.tokens.push(q.tokens[q.tokens.len() - 5]);
            }
            s.accept_drafts(0, &mut kv);
        }
        drafted
    }

    #[test]
    fn drafts_that_do_not_pay_are_only_probed() {
        // Every row as dear as the first: at one in two, no draft pays; one is checked at the
        // 4th, 12th and 28th decode steps (the waits doubling) so that the estimate can move.
        assert_eq!(
            drafted_steps(|rows| 0.010 * rows as f64),
            [(4, 1), (12, 1), (28, 1)]
        );
        // Rows nearly free: all four drafts pay at every decode step (the prompt is step 0).
        let cheap = drafted_steps(|rows| 0.010 + 0.0001 * rows as f64);
        assert_eq!(cheap.len(), 39);
        assert!(cheap.iter().all(|&(_, n)| n == 4), "{cheap:?}");
    }

    #[test]
    fn rejected_drafts_leave_the_blocks_and_index_of_a_run_without_them() {
        // The prompt repeats "1 2 3", so lookup drafts "4 5 6 7"; the output takes some of
        // them, then goes elsewhere, then repeats again.
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3];
        let output = [4, 5, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2];
        let (plain, p0, _) = run_to_end(false, &prompt, &output);
        let (drafted, proposed, accepted) = run_to_end(true, &prompt, &output);
        assert_eq!(p0, 0);
        assert!(
            proposed > accepted && accepted >= 8,
            "{proposed} {accepted}"
        );
        assert!(drafted.len() < plain.len(), "drafts saved no step");
        // At every point the drafted run reached, the state is the plain run's at that length.
        for d in &drafted {
            let p = plain.iter().find(|p| p[0] == d[0]).expect("same lengths");
            assert_eq!(d, p, "[tokens, computed, table, used, cached]");
        }
    }

    #[test]
    fn admission_stops_at_max_batch_and_when_blocks_run_out() {
        let mut kv = pool(3);
        let mut s = Scheduler::<()>::new(2, 64, BS, 1);
        for i in 0..3 {
            s.waiting.push_back(seq(i, vec![i as u32 + 1; 3]));
        }
        assert_eq!(fake_step(&mut s, &mut kv).len(), 2, "max_batch");
        assert_eq!(s.waiting.len(), 1);
        let mut kv = pool(1);
        let mut s = Scheduler::<()>::new(4, 64, BS, 1);
        s.waiting.push_back(seq(0, vec![1; 3]));
        s.waiting.push_back(seq(1, vec![2; 3]));
        assert_eq!(fake_step(&mut s, &mut kv), vec![Chunk { seq: 0, len: 3 }]);
        assert_eq!(
            s.waiting.len(),
            1,
            "no block for the second: it waits, nothing fails"
        );
    }
}
