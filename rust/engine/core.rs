//! EngineCore: the state the engine thread owns and the step it repeats: schedule, run one
//! forward over the mixed batch, sample, stream the deltas out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::doorbell::deferring_rings;
use super::ngram::DraftLength;
use super::request::{Delta, Event, FinishReason, Request, TokenLogprob, Usage};
use super::runner::ModelRunner;
use super::sampler::{argmax, splitmix, Sampler};
use super::scheduler::{Chunk, Scheduler};
use super::sequence::{Output, Sequence};
use super::stats::EngineStats;
use super::stop::StopStrings;
use super::structured::{apply_mask, Constraint, Mask};
use crate::cache::ConversationCache;
use crate::device::memory_pool::{MemoryPool, Purpose, Reservation};
use crate::error::{Result, StrataError};
use crate::model::forward::{LogitsWanted, SeqChunk};
use crate::model::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::sync::lock;

/// A request's choices share this until the last one finishes.
struct RequestState {
    choices_left: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    draft_tokens: usize,
    accepted_draft_tokens: usize,
    /// Still counted against `max_waiting` (no choice admitted yet).
    queued: bool,
}

pub struct EngineCore {
    pub runner: ModelRunner,
    pub scheduler: Scheduler,
    /// The tiers below the device, and the moves between them.
    pub cache: ConversationCache,
    tokenizer: Arc<Tokenizer>,
    max_context: usize,
    requests: HashMap<u64, RequestState>,
    next_seq_id: u64,
    /// Logits of the rows a step samples from: `[max_batch, vocab]`, allocated at load.
    logits: Vec<f32>,
    /// The draft model's logits of one proposal round: `[max_batch, its vocab]` (empty without
    /// a draft model).
    draft_logits: Vec<f32>,
    /// `logits` in the device's memory accounting (workspace); held for its `Drop`.
    _logits_reservation: Reservation,
    /// Requests submitted and not yet admitted; shared with submitters for the `max_waiting` bound.
    pub queued: Arc<AtomicUsize>,
    /// Published to `stats` in one piece after each step, so readers never see half a step.
    local: EngineStats,
    pub stats: Arc<Mutex<EngineStats>>,
    /// Seeds requests that did not bring one.
    entropy: u64,
    /// Deltas of the step in progress: sent after its stats are published, so that a caller
    /// who sees its request end also sees the blocks it freed.
    outbox: Vec<Addressed>,
    /// Deltas handed to the compute threads to send (see `deliver`), in step order.
    delivery: Arc<Mutex<Vec<Addressed>>>,
    /// Set by `Engine::inject_fault`: the next step panics.
    pub inject_fault: bool,
    /// `local.steps` at the last idle write to disk (`persist_if_idle_writes`).
    steps_persisted: u64,
}

/// An event and the stream it goes to.
type Addressed = (UnboundedSender<Event>, Event);
/// A step's grammar masks, by sequence id.
type Masks = HashMap<u64, Result<Mask>>;
/// The sequences a step finished, with why and their last delta; removed after the step's
/// draft-model catch-up (which still writes into their blocks).
type Finished = Vec<(u64, FinishReason, Delta)>;

impl EngineCore {
    /// `memory`: the device's pool, in which the logits buffer is accounted (as workspace).
    /// `logit_rows`: the most rows a step samples from (a sequence's drafts add rows).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        memory: &MemoryPool,
        runner: ModelRunner,
        scheduler: Scheduler,
        cache: ConversationCache,
        tokenizer: Arc<Tokenizer>,
        max_context: usize,
        logit_rows: usize,
        queued: Arc<AtomicUsize>,
        stats: Arc<Mutex<EngineStats>>,
    ) -> Result<EngineCore> {
        let vocab = runner.model.config.vocab_size;
        let logits_len = logit_rows * vocab;
        let draft_logits_len = runner
            .draft_vocab()
            .map_or(0, |v| scheduler.max_batch() * v);
        let logits_reservation = memory
            .reserve(
                Purpose::Workspace,
                ((logits_len + draft_logits_len) * size_of::<f32>()) as u64,
            )
            .map_err(|r| StrataError::invalid("max_batch", r.to_string()))?;
        let entropy = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x5eed, |d| d.as_nanos() as u64);
        Ok(EngineCore {
            runner,
            scheduler,
            cache,
            tokenizer,
            max_context,
            requests: HashMap::new(),
            next_seq_id: 0,
            logits: vec![0.0; logits_len],
            draft_logits: vec![0.0; draft_logits_len],
            _logits_reservation: logits_reservation,
            queued,
            local: EngineStats::default(),
            stats,
            entropy,
            outbox: Vec::new(),
            delivery: Arc::new(Mutex::new(Vec::new())),
            inject_fault: false,
            steps_persisted: 0,
        })
    }

    pub fn is_idle(&self) -> bool {
        self.scheduler.is_idle()
    }

    /// Queues a validated request as one sequence per choice.
    pub fn add_request(&mut self, req: Request) {
        let p = &req.params;
        let vocab = self.runner.model.config.vocab_size;
        let max_len = match p.max_tokens {
            Some(m) => (req.prompt.len() + m).min(self.max_context),
            None => self.max_context,
        };
        let mut stop_ids = p.stop_token_ids.clone();
        if !p.ignore_eos {
            stop_ids.extend_from_slice(self.tokenizer.eos_token_ids());
        }
        let first = self.next_seq_id;
        for index in 0..p.n {
            let seed = match p.seed {
                Some(s) => splitmix(s.wrapping_add(index as u64)),
                None => {
                    self.entropy = splitmix(self.entropy);
                    self.entropy
                }
            };
            let out = Output {
                request_id: req.id,
                index,
                sampler: Sampler::new(p, seed, &req.prompt, vocab),
                constraint: req.constraint.as_ref().map(Constraint::fork),
                detok: IncrementalDecoder::new(p.skip_special_tokens),
                stop: StopStrings::new(p.stop.clone()),
                stop_ids: stop_ids.clone(),
                want_logprobs: p.logprobs.is_some(),
                events: req.events.clone(),
                cancel: req.cancel.clone(),
                arrived: Instant::now(),
                first_token_at: None,
            };
            let mut seq = Sequence::new(self.next_seq_id, req.prompt.clone(), max_len, out);
            seq.follows = (index > 0).then_some(first);
            seq.drafting = self
                .scheduler
                .speculative
                .filter(|_| p.speculative)
                .map(|o| DraftLength::new(o.max_drafts));
            seq.draft_kv = seq.drafting.is_some();
            self.next_seq_id += 1;
            self.scheduler.waiting.push_back(seq);
        }
        self.requests.insert(
            req.id,
            RequestState {
                choices_left: p.n,
                prompt_tokens: req.prompt.len(),
                completion_tokens: 0,
                cached_tokens: 0,
                draft_tokens: 0,
                accepted_draft_tokens: 0,
                queued: true,
            },
        );
    }

    /// One engine step. True when a step ran or there is nothing to do (idle); false when work
    /// waits but nothing could be scheduled. Errors are internal faults; the caller ends every
    /// stream with them.
    pub fn step(&mut self) -> Result<bool> {
        if self.inject_fault {
            panic!("injected fault");
        }
        // The step's time covers scheduling too: admission's cache lookups and restores, and the
        // offload of evicted blocks, are the engine's work, not the stream's.
        let started = Instant::now();
        self.drop_cancelled();
        let plan = self
            .scheduler
            .schedule(&mut self.runner.kv, &mut self.cache);
        for seq in &self.scheduler.running {
            if seq.admissions > 0 {
                if let Some(r) = self.requests.get_mut(&seq.out.request_id) {
                    if r.queued {
                        r.queued = false;
                        self.queued.fetch_sub(1, Ordering::Relaxed);
                    }
                }
            }
        }
        if plan.is_empty() {
            self.publish_stats(None, &plan);
            self.deliver();
            return Ok(self.is_idle());
        }
        // A step of decode rows only (with or without drafts) measures what its rows cost.
        let decode_rows = self.decode_rows(&plan);
        self.propose(&plan)?;
        let (rows, masks) = self.forward_and_masks(&plan)?;
        self.scheduler.commit(&plan, &mut self.runner.kv);
        let finished = self.sample_and_emit(rows, masks)?;
        self.catch_up_draft(&plan)?;
        for (id, reason, delta) in finished {
            self.finish(id, reason, Some(delta));
        }
        if let Some(rows) = decode_rows {
            let seconds = started.elapsed().as_secs_f64();
            self.scheduler.step_costs.record(rows, seconds);
        }
        self.publish_stats(Some(started.elapsed()), &plan);
        self.deliver();
        Ok(true)
    }

    /// With a draft model, fills in the drafts [`Scheduler`] made room for, each the draft
    /// model's greedy pick (so the target's acceptance rule for a draft proposed with certainty
    /// keeps sampling exact): one draft-model forward per draft, batched across the sequences.
    /// The first feeds a sequence's tokens from where its draft K/V ends through its pending
    /// token; each later one feeds the draft before.
    fn propose(&mut self, plan: &[Chunk]) -> Result<()> {
        let Some(draft_vocab) = self.runner.draft_vocab() else {
            return Ok(());
        };
        // A padded vocabulary's extra rows are no tokens of the target's.
        let vocab = draft_vocab.min(self.runner.model.config.vocab_size);
        let drafting: Vec<usize> = plan
            .iter()
            .filter_map(|c| self.scheduler.running.iter().position(|s| s.id == c.seq))
            .filter(|&i| !self.scheduler.running[i].drafts.is_empty())
            .collect();
        let rounds = drafting
            .iter()
            .map(|&i| self.scheduler.running[i].drafts.len())
            .max()
            .unwrap_or(0);
        for round in 0..rounds {
            let fed: Vec<usize> = drafting
                .iter()
                .copied()
                .filter(|&i| self.scheduler.running[i].drafts.len() > round)
                .collect();
            let batch: Vec<SeqChunk> = fed
                .iter()
                .map(|&i| {
                    let seq = &self.scheduler.running[i];
                    let (tokens, start_pos) = match round {
                        0 => {
                            let start = seq.draft_computed.min(seq.computed);
                            (&seq.tokens[start..], start)
                        }
                        r => (&seq.drafts[r - 1..r], seq.tokens.len() + r - 1),
                    };
                    SeqChunk {
                        tokens,
                        start_pos,
                        block_table: &seq.table,
                        logits: LogitsWanted::Last,
                    }
                })
                .collect();
            self.local.spec_draft_model_tokens += fed_tokens(&batch);
            let out = &mut self.draft_logits[..fed.len() * draft_vocab];
            self.runner.draft_step(&batch, out)?;
            for (row, &i) in fed.iter().enumerate() {
                let logits = &out[row * draft_vocab..row * draft_vocab + vocab];
                let pick = argmax(logits);
                let seq = &mut self.scheduler.running[i];
                seq.drafts[round] = pick;
                seq.fed[1 + round] = pick;
            }
        }
        for &i in &drafting {
            let seq = &mut self.scheduler.running[i];
            seq.draft_computed = seq.tokens.len();
        }
        Ok(())
    }

    /// With a draft model, feeds it what the target computed and it has not (prefill chunks,
    /// decode rows, a last accepted draft) for each sequence of the step that keeps the draft's
    /// K/V (`Sequence::draft_kv`) and filled a block: so every full block such a sequence
    /// indexes, the only kind the prefix index and the tiers keep, has its draft K/V once the
    /// step ends, and a prefix hit or a restore serves both models. The rows of a block not yet
    /// full wait, fed a block at a time or by the sequence's next proposal (`propose`): a
    /// sequence whose drafting is paused costs the draft model a chunk per block, not a forward
    /// per step; one that detached or never drafted costs it nothing.
    fn catch_up_draft(&mut self, plan: &[Chunk]) -> Result<()> {
        if self.runner.draft_vocab().is_none() {
            return Ok(());
        }
        let bs = self.runner.kv.block_size();
        let behind: Vec<usize> = plan
            .iter()
            .filter_map(|c| self.scheduler.running.iter().position(|s| s.id == c.seq))
            .filter(|&i| {
                let seq = &self.scheduler.running[i];
                seq.draft_kv && seq.computed / bs > seq.draft_computed / bs
            })
            .collect();
        if behind.is_empty() {
            return Ok(());
        }
        let batch: Vec<SeqChunk> = behind
            .iter()
            .map(|&i| {
                let seq = &self.scheduler.running[i];
                SeqChunk {
                    tokens: &seq.tokens[seq.draft_computed..seq.computed],
                    start_pos: seq.draft_computed,
                    block_table: &seq.table,
                    logits: LogitsWanted::None,
                }
            })
            .collect();
        self.local.spec_draft_model_tokens += fed_tokens(&batch);
        self.runner.draft_step(&batch, &mut [])?;
        for &i in &behind {
            let seq = &mut self.scheduler.running[i];
            seq.draft_computed = seq.computed;
        }
        Ok(())
    }

    /// The rows of `plan` when every chunk is one decode row and its drafts; else `None`.
    fn decode_rows(&self, plan: &[Chunk]) -> Option<usize> {
        let mut rows = 0;
        for c in plan {
            let seq = self.scheduler.running.iter().find(|s| s.id == c.seq)?;
            if seq.pending() != 1 {
                return None;
            }
            rows += c.len;
        }
        Some(rows)
    }

    /// Hands the step's deltas to a compute thread, which sends them. Sending wakes the
    /// consumers' event loops, and the woken Python thread tends to preempt the thread that
    /// woke it: on the engine thread that holds up the next step's scheduling for as long as
    /// Python handles its chunks (docs/benchmarks.md, "Figures behind code comments"); on a
    /// compute thread, idle between forwards, the two overlap. One queue, drained in order
    /// under its lock, keeps every stream's events in step order whichever thread runs which
    /// job.
    fn deliver(&mut self) {
        if self.outbox.is_empty() {
            return;
        }
        lock(&self.delivery).append(&mut self.outbox);
        let queue = Arc::clone(&self.delivery);
        self.runner.spawn(move || send_all(&mut lock(&queue)));
    }

    /// Sends the step's deltas from this thread, after any still queued for delivery: for the
    /// last events before the engine stops, which must not wait on the compute threads.
    fn send_outbox(&mut self) {
        let mut queue = lock(&self.delivery);
        queue.append(&mut self.outbox);
        send_all(&mut queue);
    }

    /// The forward, and beside it, on a thread of their own, the grammar masks of the
    /// constrained rows it will sample (a mask depends only on the tokens so far, so it need not
    /// wait for the logits, and a constrained row does not hold up the step).
    fn forward_and_masks(&mut self, plan: &[Chunk]) -> Result<(Vec<(u64, usize)>, Masks)> {
        let mut constrained = Vec::new();
        for c in plan {
            if let Some(seq) = self.scheduler.running_mut(c.seq) {
                if seq.computed + c.len == seq.tokens.len() {
                    if let Some(constraint) = seq.out.constraint.take() {
                        constrained.push((seq.id, constraint));
                    }
                }
            }
        }
        if constrained.is_empty() {
            return Ok((self.forward(plan)?, Masks::new()));
        }
        let (rows, computed) = std::thread::scope(|s| {
            let masks = s.spawn(move || {
                constrained
                    .into_iter()
                    .map(|(id, mut c)| {
                        let mask = c.mask();
                        (id, c, mask)
                    })
                    .collect::<Vec<_>>()
            });
            let rows = self.forward(plan);
            (rows, masks.join())
        });
        let computed = computed
            .map_err(|_| StrataError::Internal("the grammar mask thread panicked".into()))?;
        let mut masks = Masks::new();
        for (id, constraint, mask) in computed {
            if let Some(seq) = self.scheduler.running_mut(id) {
                seq.out.constraint = Some(constraint);
                masks.insert(id, mask);
            }
        }
        Ok((rows?, masks))
    }

    /// Runs the model over the planned chunks; returns the sequences (in plan order) that got
    /// logits rows, with how many: one for a chunk that reaches its sequence's last token, one
    /// more per draft for a drafting sequence.
    fn forward(&mut self, plan: &[Chunk]) -> Result<Vec<(u64, usize)>> {
        let mut batch = Vec::with_capacity(plan.len());
        let mut sampled = Vec::new();
        let mut rows = 0;
        for c in plan {
            let seq = self
                .scheduler
                .running
                .iter()
                .find(|s| s.id == c.seq)
                .ok_or_else(|| StrataError::Internal("planned sequence is not running".into()))?;
            if !seq.drafts.is_empty() {
                sampled.push((seq.id, seq.fed.len()));
                rows += seq.fed.len();
                batch.push(SeqChunk {
                    tokens: &seq.fed,
                    start_pos: seq.computed,
                    block_table: &seq.table,
                    logits: LogitsWanted::All,
                });
                continue;
            }
            let end = seq.computed + c.len;
            let last = end == seq.tokens.len();
            if last {
                sampled.push((seq.id, 1));
                rows += 1;
            }
            batch.push(SeqChunk {
                tokens: &seq.tokens[seq.computed..end],
                start_pos: seq.computed,
                block_table: &seq.table,
                logits: if last {
                    LogitsWanted::Last
                } else {
                    LogitsWanted::None
                },
            });
        }
        let vocab = self.runner.model.config.vocab_size;
        let out = &mut self.logits[..rows * vocab];
        let runner = &mut self.runner;
        runner.step(&batch, out)?;
        Ok(sampled)
    }

    /// Samples each sequence's next token from its logits row; a drafting sequence goes on
    /// through its rows while its drafts are accepted (each row's logits came after the drafts
    /// before it), so one step may emit several of its tokens, in one delta.
    fn sample_and_emit(&mut self, rows: Vec<(u64, usize)>, mut masks: Masks) -> Result<Finished> {
        let vocab = self.runner.model.config.vocab_size;
        let max_drafts = self.scheduler.speculative.map_or(0, |o| o.max_drafts);
        let now = Instant::now();
        let mut finished = Vec::new();
        let mut emitted = 0u64;
        let mut ttfts = Vec::new();
        let mut first_row = 0;
        for (id, n_rows) in rows {
            let base = first_row;
            first_row += n_rows;
            let Some(seq) = self.scheduler.running_mut(id) else {
                continue;
            };
            let mut delta = Delta {
                index: seq.out.index,
                token_ids: Vec::new(),
                text: String::new(),
                logprobs: Vec::new(),
                finish_reason: None,
                usage: None,
            };
            let mut failed = false;
            let mut accepted = 0;
            let fed_from = seq.tokens.len();
            for r in 0..n_rows {
                let row = &mut self.logits[(base + r) * vocab..(base + r + 1) * vocab];
                let draft = seq.drafts.get(r).copied();
                let mask = match seq.out.constraint.as_mut() {
                    Some(c) => match masks.remove(&id).unwrap_or_else(|| c.mask()) {
                        Ok(mask) => Some(mask),
                        Err(e) => {
                            grammar_failed(seq, e, &mut self.outbox);
                            failed = true;
                            break;
                        }
                    },
                    None => None,
                };
                let (s, draft_taken) = seq.out.sampler.sample_or_accept(row, draft, |row| {
                    if let Some(mask) = &mask {
                        apply_mask(mask, row);
                    }
                });
                let tok = s.token;
                seq.tokens.push(tok);
                emitted += 1;
                let grammar_done = match seq.out.constraint.as_mut().map(|c| c.accept(tok)) {
                    Some(Ok(done)) => done,
                    Some(Err(e)) => {
                        grammar_failed(seq, e, &mut self.outbox);
                        failed = true;
                        break;
                    }
                    None => false,
                };
                if seq.out.first_token_at.is_none() {
                    seq.out.first_token_at = Some(now);
                    if seq.out.index == 0 {
                        ttfts.push((now - seq.out.arrived).as_secs_f64());
                    }
                }
                let mut finish = None;
                if seq.out.stop_ids.contains(&tok) {
                    finish = Some(FinishReason::Stop);
                } else {
                    // An id past the tokenizer's vocabulary (a padded embedding row) has no text.
                    let piece = if self.tokenizer.knows(tok) {
                        seq.out.detok.push(&self.tokenizer, tok)?
                    } else {
                        String::new()
                    };
                    let (emit, stopped) = seq.out.stop.push(&piece);
                    delta.text.push_str(&emit);
                    if stopped {
                        finish = Some(FinishReason::Stop);
                    }
                }
                // A complete grammar allows nothing more: the output ends as at a stop string.
                if finish.is_none() && (grammar_done || seq.tokens.len() >= seq.max_len) {
                    let rest = seq.out.detok.flush(&self.tokenizer)?;
                    let (emit, stopped) = seq.out.stop.push(&rest);
                    delta.text.push_str(&emit);
                    if !stopped {
                        delta.text.push_str(&seq.out.stop.flush());
                    }
                    // Held-back text can settle a stop string only now.
                    finish = Some(if grammar_done || seq.out.stop.stopped() {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    });
                }
                if let (true, Some(lp)) = (seq.out.want_logprobs, s.logprob) {
                    delta.logprobs.push(TokenLogprob {
                        token: tok,
                        logprob: lp,
                        top: s.top_logprobs,
                    });
                }
                delta.token_ids.push(tok);
                delta.finish_reason = finish;
                accepted += usize::from(draft_taken);
                if finish.is_some() || !draft_taken {
                    break;
                }
            }
            let proposed = seq.drafts.len();
            if proposed > 0 {
                if let Some(d) = seq.drafting.as_mut() {
                    d.update(proposed, accepted, max_drafts);
                }
                self.local.record_drafts(proposed, accepted);
                if let Some(r) = self.requests.get_mut(&seq.out.request_id) {
                    r.draft_tokens += proposed;
                    r.accepted_draft_tokens += accepted;
                }
                // A draft model was fed every draft but the last: its K/V holds the accepted
                // ones among them.
                let fed = accepted.min(proposed - 1);
                seq.draft_computed = seq.draft_computed.min(fed_from + fed);
            }
            self.scheduler.accept_drafts(id, &mut self.runner.kv);
            // The request ends with the grammar's error (sent above); its tokens go nowhere.
            if failed {
                continue;
            }
            match delta.finish_reason {
                Some(f) => finished.push((id, f, delta)),
                None => {
                    let Some(seq) = self.scheduler.running_mut(id) else {
                        continue;
                    };
                    self.outbox
                        .push((seq.out.events.clone(), Event::Delta(delta)));
                }
            }
        }
        self.local.generated_tokens += emitted;
        ttfts
            .into_iter()
            .for_each(|t| self.local.ttft_seconds.push(t));
        Ok(finished)
    }

    /// Removes a sequence and sends its last delta (with usage when its request is done).
    fn finish(&mut self, id: u64, reason: FinishReason, delta: Option<Delta>) {
        let Some(seq) = self.scheduler.remove(id, &mut self.runner.kv) else {
            return;
        };
        let mut delta = delta.unwrap_or_else(|| Delta {
            index: seq.out.index,
            token_ids: Vec::new(),
            text: String::new(),
            logprobs: Vec::new(),
            finish_reason: Some(reason),
            usage: None,
        });
        if let Some(req) = self.requests.get_mut(&seq.out.request_id) {
            req.completion_tokens += seq.output_len();
            if seq.out.index == 0 {
                req.cached_tokens = seq.cached_tokens;
            }
            req.choices_left -= 1;
            if req.choices_left == 0 {
                delta.usage = Some(Usage {
                    prompt_tokens: req.prompt_tokens,
                    completion_tokens: req.completion_tokens,
                    cached_tokens: req.cached_tokens,
                    draft_tokens: req.draft_tokens,
                    accepted_draft_tokens: req.accepted_draft_tokens,
                });
                if req.queued {
                    self.queued.fetch_sub(1, Ordering::Relaxed);
                }
                self.requests.remove(&seq.out.request_id);
            }
        }
        match reason {
            FinishReason::Cancelled => self.local.cancelled += 1,
            _ => self.local.finished += 1,
        }
        self.outbox.push((seq.out.events, Event::Delta(delta)));
    }

    /// Sequences whose caller cancelled or stopped listening leave before the step is planned.
    fn drop_cancelled(&mut self) {
        let gone: Vec<u64> = self
            .scheduler
            .running
            .iter()
            .chain(&self.scheduler.waiting)
            .filter(|s| s.out.cancel.is_cancelled() || s.out.events.is_closed())
            .map(|s| s.id)
            .collect();
        for id in gone {
            self.finish(id, FinishReason::Cancelled, None);
        }
    }

    /// Ends every stream with `err` and forgets every sequence (engine stop or fault).
    pub fn fail_all(&mut self, err: impl Fn() -> StrataError) {
        let ids: Vec<u64> = self
            .scheduler
            .running
            .iter()
            .chain(&self.scheduler.waiting)
            .map(|s| s.id)
            .collect();
        for id in ids {
            if let Some(seq) = self.scheduler.remove(id, &mut self.runner.kv) {
                if self
                    .requests
                    .remove(&seq.out.request_id)
                    .is_some_and(|r| r.queued)
                {
                    self.queued.fetch_sub(1, Ordering::Relaxed);
                }
                self.outbox.push((seq.out.events, Event::Error(err())));
            }
        }
        self.publish_stats(None, &[]);
        self.send_outbox();
    }

    fn publish_stats(&mut self, step: Option<Duration>, plan: &[Chunk]) {
        let kv = &self.runner.kv;
        let st = &mut self.local;
        st.running = self.scheduler.running.len();
        st.waiting = self.scheduler.waiting.len();
        st.kv_blocks_total = kv.num_blocks();
        st.kv_blocks_used = kv.num_used();
        st.kv_blocks_cached = kv.num_cached();
        (
            st.kv_window_slots_total,
            st.kv_window_slots_used,
            st.kv_window_slots_passed,
        ) = kv.window_slots().unwrap_or_default();
        let c = self.scheduler.counters;
        st.preemptions = c.preemptions;
        st.prefix_query_tokens = c.prefix_query_tokens;
        st.prefix_hit_tokens = c.prefix_hit_tokens;
        st.spec_draft_detached = c.draft_detached;
        st.cache.clone_from(self.cache.stats());
        st.graphs = self.runner.graph_stats();
        st.copy_streams = self.runner.copy_streams();
        if let Some(d) = step {
            st.record_step(d, plan.iter().map(|c| c.len).sum());
        }
        let mut shared = crate::sync::lock(&self.stats);
        // Refusals are counted by submitters, on their side of the channel.
        let refused = shared.refused;
        shared.clone_from(st);
        shared.refused = refused;
    }

    /// Prompt tokens accepted, for the stats.
    pub fn count_prompt(&mut self, n: usize) {
        self.local.prompt_tokens += n as u64;
    }

    /// A clean shutdown: the cached conversations go to disk for the next start.
    pub fn persist_cache(&mut self) {
        self.cache.persist(&self.runner.kv);
        self.publish_stats(None, &[]);
    }

    /// The prefix hashes of the blocks on the device (the prefix index) and in the host tier.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        let mut hashes: Vec<u64> = self.runner.kv.cached_blocks().map(|(_, h, _)| h).collect();
        hashes.extend(self.cache.host_hashes());
        hashes
    }

    /// With `disk_write_when_idle`: the cached blocks of the steps since the last write go to
    /// disk, now that nothing waits for the engine thread.
    pub fn persist_if_idle_writes(&mut self) {
        if self.cache.writes_when_idle() && self.local.steps != self.steps_persisted {
            self.steps_persisted = self.local.steps;
            self.persist_cache();
        }
    }

    /// Records why the loop stopped, for `stats()["stopped"]`.
    pub fn set_stopped(&mut self, reason: String) {
        self.local.stopped = Some(reason);
        self.publish_stats(None, &[]);
    }
}

/// Sends queued events in order; the event loops they wake are rung once each after the last
/// send (`doorbell::deferring_rings`), so that a loop's one wake-up finds the whole step's
/// deltas. A closed stream is noticed at the next step's cancellation sweep, so a failed send
/// needs nothing here.
fn send_all(queue: &mut Vec<Addressed>) {
    deferring_rings(|| {
        for (to, event) in queue.drain(..) {
            let _ = to.send(event);
        }
    });
}

/// A grammar that cannot go on (llguidance's limits, or a token it refuses) ends its request
/// with the reason; the other requests carry on. The sequence leaves at the next step.
fn grammar_failed(seq: &mut Sequence, e: StrataError, outbox: &mut Vec<Addressed>) {
    log::warn!("request {}: {e}", seq.out.request_id);
    let why = StrataError::invalid("structured_outputs", e.to_string());
    outbox.push((seq.out.events.clone(), Event::Error(why)));
    seq.out.cancel.cancel();
}

/// Tokens a draft-model forward over `batch` feeds (`stats.spec_draft_model_tokens`).
fn fed_tokens(batch: &[SeqChunk]) -> u64 {
    batch.iter().map(|c| c.tokens.len() as u64).sum()
}
