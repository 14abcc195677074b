//! One forward pass over a mixed batch: each sequence brings a chunk of new tokens (a prefill
//! chunk, or one token when decoding) and its block table into the paged K/V pool.
//!
//! Reads top to bottom like llama2.c's `forward()`: every buffer lives in `Workspace`, sized at
//! load for `max_tokens` tokens per step, so the loop below never allocates.

use crate::error::{Result, StrataError};
use crate::kv::blocks::BlockPool;
use crate::model::config::{Activation, MoeConfig};
use crate::model::kernels::cpu::attention::{paged_attention, AttnRow, AttnScratch};
use crate::model::kernels::cpu::embedding::embed;
use crate::model::kernels::cpu::geglu::gelu_tanh_mul;
use crate::model::kernels::cpu::matmul::{linear, linear_group, LinearOut, MatmulScratch};
use crate::model::kernels::cpu::rmsnorm::{rmsnorm, rmsnorm_inplace};
use crate::model::kernels::cpu::router::{route, Route};
use crate::model::kernels::cpu::swiglu::silu_mul;
use crate::model::kernels::cpu::MatRef;
use crate::model::{ExpertWeights, Mlp, MlpWeights, Model};

/// Which positions of a chunk need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    Last,
    All,
}

/// One sequence's share of a step: `tokens` at positions `start_pos..start_pos + tokens.len()`.
/// Its block table must already cover every one of those positions.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub logits: LogitsWanted,
}

/// What a mixture-of-experts MLP needs beyond a dense one's, for `t` tokens.
#[derive(Default)]
struct ExpertBuffers {
    /// Router logits, `[t, num_experts]`.
    logits: Vec<f32>,
    /// Each token's k routes, `[t, k]`.
    routes: Vec<Route>,
    /// The (token, slot) indices routed to the expert at hand.
    picked: Vec<usize>,
    /// Those tokens' rows gathered, which the expert's MLP overwrites with its output rows:
    /// `[t, hidden]`.
    rows_in: Vec<f32>,
    /// Each (token, slot)'s expert output, `[t, k, hidden]`, summed per token in slot order.
    outputs: Vec<f32>,
}

impl ExpertBuffers {
    fn new(moe: &MoeConfig, t: usize, hidden: usize) -> ExpertBuffers {
        let k = moe.experts_per_token;
        ExpertBuffers {
            logits: vec![0.0; t * moe.num_experts],
            routes: vec![Route::default(); t * k],
            picked: Vec::with_capacity(t * k),
            rows_in: vec![0.0; t * hidden],
            outputs: vec![0.0; t * k * hidden],
        }
    }

    fn floats(&self) -> usize {
        self.logits.capacity() + self.rows_in.capacity() + self.outputs.capacity()
    }
}

/// Every activation buffer of a step, allocated once.
pub struct Workspace {
    max_tokens: usize,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Mixture-of-experts models' buffers (empty for dense ones).
    moe: ExpertBuffers,
    /// Final-normed hidden rows of the positions that want logits.
    picked: Vec<f32>,
    rows: Vec<AttnRow>,
    /// The rows that want logits (indices into `rows`, in batch order), and their `AttnRow`s:
    /// the last layer runs only those past its K/V.
    out_rows: Vec<u32>,
    out_attn_rows: Vec<AttnRow>,
    tables: Vec<u32>,
    slots: Vec<usize>,
    /// `tables` and `slots` in window slots, for the sliding layers of a pool that keeps them
    /// (`BlockPool::is_windowed`); empty otherwise.
    window_tables: Vec<u32>,
    window_slots: Vec<usize>,
    matmul: MatmulScratch,
    attention: AttnScratch,
}

impl Workspace {
    pub fn new(model: &Model, max_tokens: usize, threads: usize) -> Workspace {
        let c = &model.config;
        let t = max_tokens;
        Workspace {
            max_tokens,
            x: vec![0.0; t * c.hidden_size],
            xn: vec![0.0; t * c.hidden_size.max(c.q_dim())],
            q: vec![0.0; t * c.q_dim()],
            k: vec![0.0; t * c.kv_dim()],
            v: vec![0.0; t * c.kv_dim()],
            attn: vec![0.0; t * c.q_dim()],
            gate: vec![0.0; t * c.mlp_width()],
            up: vec![0.0; t * c.mlp_width()],
            moe: c
                .moe
                .as_ref()
                .map(|m| ExpertBuffers::new(m, t, c.hidden_size))
                .unwrap_or_default(),
            picked: vec![0.0; t * c.hidden_size],
            rows: Vec::with_capacity(t),
            out_rows: Vec::with_capacity(t),
            out_attn_rows: Vec::with_capacity(t),
            // A capacity hint from the context served (the RoPE table's), not config.json's
            // max_position_embeddings, which can be far beyond memory.
            tables: Vec::with_capacity(t + model.rope.max_positions() / 4),
            slots: Vec::with_capacity(t),
            window_tables: Vec::with_capacity(if c.sliding_window.is_some() {
                t + model.rope.max_positions() / 4
            } else {
                0
            }),
            window_slots: Vec::with_capacity(if c.sliding_window.is_some() { t } else { 0 }),
            matmul: {
                let mut m =
                    MatmulScratch::new(threads, c.hidden_size.max(c.q_dim()).max(c.mlp_width()), t);
                if model.bf16_dot {
                    m.enable_bf16_dot(t);
                }
                m
            },
            attention: AttnScratch::new(t, c.num_heads, c.head_dim, threads),
        }
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Bytes the buffers hold as allocated at load, kernel scratch included (for the device's
    /// memory accounting; `tables` may grow past its capacity hint later, uncounted).
    pub fn bytes(&self) -> usize {
        use std::mem::size_of;
        let floats: usize = [
            &self.x,
            &self.xn,
            &self.q,
            &self.k,
            &self.v,
            &self.attn,
            &self.gate,
            &self.up,
            &self.picked,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum();
        (floats + self.moe.floats()) * size_of::<f32>()
            + self.moe.routes.capacity() * size_of::<Route>()
            + self.moe.picked.capacity() * size_of::<usize>()
            + (self.rows.capacity() + self.out_attn_rows.capacity()) * size_of::<AttnRow>()
            + self.out_rows.capacity() * size_of::<u32>()
            + (self.tables.capacity() + self.window_tables.capacity()) * size_of::<u32>()
            + (self.slots.capacity() + self.window_slots.capacity()) * size_of::<usize>()
            + self.matmul.bytes()
            + self.attention.bytes()
    }
}

impl Workspace {
    /// The activation hand-off at a layer-split boundary: the next device gets the hidden rows
    /// and the step's plan (each row's position and block table, its K/V slot). On the CPU it is
    /// a copy between two buffers of host memory; a GPU backend copies device to device here
    /// (peer copy, or through the host), ordered after the producing device's compute.
    fn hand_off(&self, next: &mut Workspace, n: usize, hidden: usize) {
        next.x[..n * hidden].copy_from_slice(&self.x[..n * hidden]);
        next.rows.clear();
        next.rows.extend_from_slice(&self.rows);
        next.out_rows.clear();
        next.out_rows.extend_from_slice(&self.out_rows);
        next.tables.clear();
        next.tables.extend_from_slice(&self.tables);
        next.slots.clear();
        next.slots.extend_from_slice(&self.slots);
        next.window_tables.clear();
        next.window_tables.extend_from_slice(&self.window_tables);
        next.window_slots.clear();
        next.window_slots.extend_from_slice(&self.window_slots);
    }
}

impl Model {
    /// Runs one step. Writes each chunk's K/V into `kv`, and the logits of the positions that want
    /// them, in batch order, into `out` (`[rows, vocab]`). Returns the number of logit rows.
    ///
    /// `ws` holds one workspace per device of the layer split (`kv.num_stages()`): the first
    /// device embeds, each device runs its layer range in its own workspace and hands the
    /// activations to the next, the last one computes the logits. The arithmetic of a row is the
    /// same whatever the split, so the logits are bitwise those of one device.
    pub fn forward(
        &self,
        batch: &[SeqChunk],
        kv: &mut BlockPool,
        ws: &mut [Workspace],
        out: &mut [f32],
    ) -> Result<usize> {
        if !kv.is_host() {
            return Err(StrataError::Internal(
                "the CPU forward pass was given a device-held K/V pool".into(),
            ));
        }
        if ws.len() != kv.num_stages() || ws.is_empty() {
            return Err(StrataError::Internal(format!(
                "{} workspaces for {} devices",
                ws.len(),
                kv.num_stages()
            )));
        }
        let hidden = self.config.hidden_size;
        let n = self.plan(batch, kv, &mut ws[0], out.len())?;
        self.embed_tokens(batch, &mut ws[0], n)?;
        for stage in 0..ws.len() {
            if stage > 0 {
                let (done, rest) = ws.split_at_mut(stage);
                done[stage - 1].hand_off(&mut rest[0], n, hidden);
            }
            self.run_layers(kv.stage_layers(stage), kv, &mut ws[stage], n);
        }
        let last = ws.len() - 1;
        Ok(self.logits(&mut ws[last], out))
    }

    /// Where each token's K/V goes and which positions each query row may see (into `ws`),
    /// after checking the step against the workspace, the RoPE table, the block tables and the
    /// logits buffer (`out_len` floats). Returns the step's token count.
    fn plan(
        &self,
        batch: &[SeqChunk],
        kv: &BlockPool,
        ws: &mut Workspace,
        out_len: usize,
    ) -> Result<usize> {
        let c = &self.config;
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if n == 0 || n > ws.max_tokens {
            return Err(StrataError::Internal(format!(
                "a step of {n} tokens (workspace holds 1..={})",
                ws.max_tokens
            )));
        }
        ws.rows.clear();
        ws.out_rows.clear();
        ws.tables.clear();
        ws.slots.clear();
        ws.window_tables.clear();
        ws.window_slots.clear();
        for s in batch {
            // Its "last" row would be the previous chunk's.
            if s.tokens.is_empty() && s.logits != LogitsWanted::None {
                return Err(StrataError::Internal(
                    "a chunk with no tokens cannot want logits".into(),
                ));
            }
            let end = s.start_pos + s.tokens.len();
            if end > self.rope.max_positions()
                || end.div_ceil(kv.block_size()) > s.block_table.len()
            {
                return Err(StrataError::Internal(format!(
                    "positions up to {end} exceed the RoPE table or the block table"
                )));
            }
            let table_start = ws.tables.len() as u32;
            ws.tables.extend_from_slice(s.block_table);
            // The sliding layers read each row's window and write its row: those blocks must
            // have their window slots (the scheduler keeps them while a window reaches them).
            let read = kv.first_read(s.start_pos)..end.div_ceil(kv.block_size());
            if !kv.has_window_slots(&s.block_table[read.clone()]) {
                return Err(StrataError::Internal(format!(
                    "blocks {read:?} of a sequence at positions {}..{end} lack window slots",
                    s.start_pos
                )));
            }
            kv.window_table(s.block_table, &mut ws.window_tables);
            for pos in s.start_pos..end {
                ws.rows.push(AttnRow {
                    pos: pos as u32,
                    table_start,
                    table_len: s.block_table.len() as u32,
                });
                ws.slots.push(kv.slot(s.block_table, pos));
                if let Some(row) = kv.window_row(s.block_table, pos) {
                    ws.window_slots.push(row);
                }
            }
            let first = ws.rows.len() - s.tokens.len();
            let wanted = match s.logits {
                LogitsWanted::None => first..first,
                LogitsWanted::Last => ws.rows.len() - 1..ws.rows.len(),
                LogitsWanted::All => first..ws.rows.len(),
            };
            ws.out_rows.extend(wanted.map(|t| t as u32));
        }
        let logit_rows = ws.out_rows.len();
        if out_len < logit_rows * c.vocab_size {
            return Err(StrataError::Internal("logits buffer too small".into()));
        }
        Ok(n)
    }

    /// The first device's input: each token's embedding row.
    fn embed_tokens(&self, batch: &[SeqChunk], ws: &mut Workspace, n: usize) -> Result<()> {
        let c = &self.config;
        let hidden = c.hidden_size;
        let x = &mut ws.x[..n * hidden];
        for (t, &tok) in batch.iter().flat_map(|s| s.tokens).enumerate() {
            if tok as usize >= c.vocab_size {
                return Err(StrataError::invalid(
                    "token_ids",
                    format!(
                        "token id {tok} is outside the vocabulary (size {})",
                        c.vocab_size
                    ),
                ));
            }
            let row = &mut x[t * hidden..(t + 1) * hidden];
            embed(self.embed.matrix(), tok, row);
            if let Some(scale) = c.embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        Ok(())
    }

    /// One device's share of the step: the layers `layers`, reading and writing their K/V.
    fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        kv: &mut BlockPool,
        ws: &mut Workspace,
        n: usize,
    ) {
        let c = &self.config;
        let (hidden, q_dim, kv_dim) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let x = &mut ws.x[..n * hidden];
        let xn = &mut ws.xn[..n * hidden];
        let q = &mut ws.q[..n * q_dim];
        let k = &mut ws.k[..n * kv_dim];
        let v = &mut ws.v[..n * kv_dim];
        let attn = &mut ws.attn[..n * q_dim];
        let gate = &mut ws.gate;
        let up = &mut ws.up;
        let moe_buffers = &mut ws.moe;
        let mm = &mut ws.matmul;
        let last_layer = self.layers.len() - 1;

        let scale = c.attention_scale();
        for li in layers {
            let l = &self.layers[li];
            // Attention block.
            rmsnorm(x, &l.attn_norm, c.rms_norm_eps, xn);
            let qkv = &mut [
                LinearOut {
                    w: l.q_proj.matrix(),
                    bias: l.q_bias.as_deref(),
                    y: &mut *q,
                },
                LinearOut {
                    w: l.k_proj.matrix(),
                    bias: l.k_bias.as_deref(),
                    y: &mut *k,
                },
                LinearOut {
                    w: l.v_proj.matrix(),
                    bias: l.v_bias.as_deref(),
                    y: &mut *v,
                },
            ];
            linear_group(xn, n, qkv, mm);
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rmsnorm_inplace(q, qn, c.rms_norm_eps);
                rmsnorm_inplace(k, kn, c.rms_norm_eps);
            }
            let rope = self.rope_at(li);
            // A sliding layer of a pool with window slots keeps its K/V in them.
            let (tables, slots) = if kv.is_windowed(li) {
                (&ws.window_tables, &ws.window_slots)
            } else {
                (&ws.tables, &ws.slots)
            };
            for (t, row) in ws.rows.iter().enumerate() {
                let pos = row.pos as usize;
                rope.apply(&mut q[t * q_dim..(t + 1) * q_dim], c.num_heads, pos);
                rope.apply(&mut k[t * kv_dim..(t + 1) * kv_dim], c.num_kv_heads, pos);
                kv.write(
                    li,
                    slots[t],
                    &k[t * kv_dim..(t + 1) * kv_dim],
                    &v[t * kv_dim..(t + 1) * kv_dim],
                );
            }
            // The last layer's output feeds nothing but the logits: once every row has written
            // its K/V, only the rows that want logits go on, moved to the front (a row's
            // arithmetic does not depend on the rows beside it). A prefill chunk skips the
            // rest of the last layer for all its rows but one, a draft's catch-up for all.
            let (n, rows) = if li == last_layer {
                ws.out_attn_rows.clear();
                for (j, &t) in ws.out_rows.iter().enumerate() {
                    let t = t as usize;
                    ws.out_attn_rows.push(ws.rows[t]);
                    x.copy_within(t * hidden..(t + 1) * hidden, j * hidden);
                    q.copy_within(t * q_dim..(t + 1) * q_dim, j * q_dim);
                }
                (ws.out_rows.len(), &ws.out_attn_rows)
            } else {
                (n, &ws.rows)
            };
            if n == 0 {
                break;
            }
            let (x, xn) = (&mut x[..n * hidden], &mut xn[..n * hidden]);
            let (q, attn) = (&q[..n * q_dim], &mut attn[..n * q_dim]);
            paged_attention(
                q,
                rows,
                tables,
                &kv.layer(li),
                c.num_heads,
                scale,
                c.window(li),
                attn,
                &mut ws.attention,
            );
            linear(attn, n, l.o_proj.matrix(), l.o_bias.as_deref(), xn, mm);
            if let Some(w) = &l.post_attn_norm {
                rmsnorm_inplace(xn, w, c.rms_norm_eps);
            }
            add_in_place(x, xn);

            // MLP block: the result replaces the normed rows in `xn`.
            rmsnorm(x, &l.mlp_norm, c.rms_norm_eps, xn);
            match (&l.mlp, &c.moe) {
                (Mlp::Dense(d), _) => mlp(d, c.activation, xn, n, gate, up, mm),
                (Mlp::Experts(e), Some(moe)) => {
                    experts(e, moe, c.activation, xn, n, moe_buffers, gate, up, mm)
                }
                (Mlp::Experts(_), None) => unreachable!("experts without a mixture config"),
            }
            if let Some(w) = &l.post_mlp_norm {
                rmsnorm_inplace(xn, w, c.rms_norm_eps);
            }
            add_in_place(x, xn);
        }
    }

    /// The last device's output: the final norm and the LM head for the rows that want logits,
    /// which the last layer left at the front of `x` in batch order. Returns their number.
    fn logits(&self, ws: &mut Workspace, out: &mut [f32]) -> usize {
        let c = &self.config;
        let hidden = c.hidden_size;
        let mm = &mut ws.matmul;
        let r = ws.out_rows.len();
        for j in 0..r {
            rmsnorm(
                &ws.x[j * hidden..(j + 1) * hidden],
                &self.norm,
                c.rms_norm_eps,
                &mut ws.picked[j * hidden..(j + 1) * hidden],
            );
        }
        if r > 0 {
            linear(
                &ws.picked[..r * hidden],
                r,
                self.lm_head.matrix(),
                None,
                &mut out[..r * c.vocab_size],
                mm,
            );
            if let Some(cap) = c.final_logit_softcap {
                for v in &mut out[..r * c.vocab_size] {
                    *v = cap * (*v / cap).tanh();
                }
            }
        }
        r
    }
}

/// The gated MLP of `n` rows of `xn`, written back into them; `gate` and `up` are scratch.
fn mlp(
    w: &MlpWeights,
    activation: Activation,
    xn: &mut [f32],
    n: usize,
    gate: &mut [f32],
    up: &mut [f32],
    mm: &mut MatmulScratch,
) {
    let width = w.gate_proj.shape[0];
    let (gate, up) = (&mut gate[..n * width], &mut up[..n * width]);
    let gate_up = &mut [
        LinearOut {
            w: w.gate_proj.matrix(),
            bias: None,
            y: &mut *gate,
        },
        LinearOut {
            w: w.up_proj.matrix(),
            bias: None,
            y: &mut *up,
        },
    ];
    linear_group(xn, n, gate_up, mm);
    match activation {
        Activation::Silu => silu_mul(gate, up),
        Activation::GeluTanh => gelu_tanh_mul(gate, up),
    }
    linear(gate, n, w.down_proj.matrix(), None, xn, mm);
}

/// A mixture-of-experts MLP over `n` rows of `xn`, written back into them. Each row's router
/// picks k experts; each expert runs once over the rows routed to it (gathered); a row's
/// result is its k outputs, weighted, summed in its routes' order. A row's arithmetic does not
/// depend on which rows share the step (the kernels' rows are independent), so the mixture
/// keeps the forward pass batch-invariant.
#[allow(clippy::too_many_arguments)]
fn experts(
    w: &ExpertWeights,
    moe: &MoeConfig,
    activation: Activation,
    xn: &mut [f32],
    n: usize,
    b: &mut ExpertBuffers,
    gate: &mut [f32],
    up: &mut [f32],
    mm: &mut MatmulScratch,
) {
    let (e, k) = (moe.num_experts, moe.experts_per_token);
    let hidden = xn.len() / n;
    let logits = &mut b.logits[..n * e];
    linear(xn, n, w.router.matrix(), None, logits, mm);
    let routes = &mut b.routes[..n * k];
    for (row, out) in logits.chunks_exact(e).zip(routes.chunks_exact_mut(k)) {
        route(row, moe.renormalize, out);
    }
    if n == 1 {
        single_row_experts(w, routes, activation, xn, &mut b.outputs, gate, up, mm);
        return;
    }
    for (expert, weights) in w.experts.iter().enumerate() {
        b.picked.clear();
        b.picked.extend(
            routes
                .iter()
                .enumerate()
                .filter(|(_, r)| r.expert as usize == expert)
                .map(|(slot, _)| slot),
        );
        let m = b.picked.len();
        if m == 0 {
            continue;
        }
        let rows_in = &mut b.rows_in[..m * hidden];
        for (dst, &slot) in rows_in.chunks_exact_mut(hidden).zip(&b.picked) {
            let t = slot / k;
            dst.copy_from_slice(&xn[t * hidden..(t + 1) * hidden]);
        }
        mlp(weights, activation, rows_in, m, gate, up, mm);
        for (src, &slot) in rows_in.chunks_exact(hidden).zip(&b.picked) {
            b.outputs[slot * hidden..(slot + 1) * hidden].copy_from_slice(src);
        }
    }
    weighted_sum(routes, &b.outputs, xn, k);
}

/// `experts` for one row (decode): every chosen expert reads the same row, so the gate and up
/// products of two experts at a time run as one `linear_group` (one fork and join instead of
/// two, no gather), with the same bits as `experts`'s separate calls and the same sum.
#[allow(clippy::too_many_arguments)]
fn single_row_experts(
    w: &ExpertWeights,
    routes: &[Route],
    activation: Activation,
    xn: &mut [f32],
    outputs: &mut [f32],
    gate: &mut [f32],
    up: &mut [f32],
    mm: &mut MatmulScratch,
) {
    let (hidden, k) = (xn.len(), routes.len());
    let mut s = 0;
    while s < k {
        let first = &w.experts[routes[s].expert as usize];
        let width = first.gate_proj.shape[0];
        let pair = s + 1 < k
            && gate.len() >= 2 * width
            && w.experts[routes[s + 1].expert as usize].gate_proj.shape[0] == width;
        let m = if pair { 2 } else { 1 };
        {
            let (g0, g1) = gate[..m * width].split_at_mut(width);
            let (u0, u1) = up[..m * width].split_at_mut(width);
            fn out(x: &MlpWeights) -> (MatRef<'_>, MatRef<'_>) {
                (x.gate_proj.matrix(), x.up_proj.matrix())
            }
            let (gate0, up0) = out(first);
            let mut outs = [
                LinearOut {
                    w: gate0,
                    bias: None,
                    y: g0,
                },
                LinearOut {
                    w: up0,
                    bias: None,
                    y: u0,
                },
            ];
            if pair {
                let (gate1, up1) = out(&w.experts[routes[s + 1].expert as usize]);
                let [a, b] = outs;
                linear_group(
                    xn,
                    1,
                    &mut [
                        a,
                        b,
                        LinearOut {
                            w: gate1,
                            bias: None,
                            y: g1,
                        },
                        LinearOut {
                            w: up1,
                            bias: None,
                            y: u1,
                        },
                    ],
                    mm,
                );
            } else {
                linear_group(xn, 1, &mut outs, mm);
            }
        }
        for j in 0..m {
            let slot = s + j;
            let g = &mut gate[j * width..(j + 1) * width];
            let u = &up[j * width..(j + 1) * width];
            match activation {
                Activation::Silu => silu_mul(g, u),
                Activation::GeluTanh => gelu_tanh_mul(g, u),
            }
            let down = w.experts[routes[slot].expert as usize].down_proj.matrix();
            linear(
                g,
                1,
                down,
                None,
                &mut outputs[slot * hidden..(slot + 1) * hidden],
                mm,
            );
        }
        s += m;
    }
    weighted_sum(routes, outputs, xn, k);
}

/// Each row of `xn` as its k expert outputs (`outputs`, `[rows, k, hidden]`) times their
/// routes' weights, summed in route order.
fn weighted_sum(routes: &[Route], outputs: &[f32], xn: &mut [f32], k: usize) {
    let hidden = xn.len() / (routes.len() / k);
    for (t, out) in xn.chunks_exact_mut(hidden).enumerate() {
        out.fill(0.0);
        for slot in t * k..(t + 1) * k {
            let y = &outputs[slot * hidden..(slot + 1) * hidden];
            for (o, v) in out.iter_mut().zip(y) {
                *o += routes[slot].weight * v;
            }
        }
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
