//! One forward pass over a mixed batch: each sequence brings a chunk of new tokens (a prefill
//! chunk, or one token when decoding) and its block table into the paged K/V pool.
//!
//! Reads top to bottom like llama2.c's `forward()`: every buffer lives in `Workspace`, sized at
//! load for `max_tokens` tokens per step, so the loop below never allocates.

use crate::error::{Result, StrataError};
use crate::kv::blocks::BlockPool;
use crate::model::kernels::cpu::attention::{paged_attention, AttnRow, AttnScratch};
use crate::model::kernels::cpu::embedding::embed;
use crate::model::kernels::cpu::matmul::{linear, linear_group, LinearOut, MatmulScratch};
use crate::model::kernels::cpu::rmsnorm::{rmsnorm, rmsnorm_inplace};
use crate::model::kernels::cpu::swiglu::silu_mul;
use crate::model::Model;

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
    /// Final-normed hidden rows of the positions that want logits.
    picked: Vec<f32>,
    rows: Vec<AttnRow>,
    tables: Vec<u32>,
    slots: Vec<usize>,
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
            gate: vec![0.0; t * c.intermediate_size],
            up: vec![0.0; t * c.intermediate_size],
            picked: vec![0.0; t * c.hidden_size],
            rows: Vec::with_capacity(t),
            // A capacity hint from the context served (the RoPE table's), not config.json's
            // max_position_embeddings, which can be far beyond memory.
            tables: Vec::with_capacity(t + model.rope.max_positions() / 4),
            slots: Vec::with_capacity(t),
            matmul: {
                let mut m = MatmulScratch::new(
                    threads,
                    c.hidden_size.max(c.q_dim()).max(c.intermediate_size),
                    t,
                );
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
        floats * size_of::<f32>()
            + self.rows.capacity() * size_of::<AttnRow>()
            + self.tables.capacity() * size_of::<u32>()
            + self.slots.capacity() * size_of::<usize>()
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
        next.tables.clear();
        next.tables.extend_from_slice(&self.tables);
        next.slots.clear();
        next.slots.extend_from_slice(&self.slots);
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
        Ok(self.logits(batch, &mut ws[last], out))
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
        ws.tables.clear();
        ws.slots.clear();
        let mut logit_rows = 0;
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
            for pos in s.start_pos..end {
                ws.rows.push(AttnRow {
                    pos: pos as u32,
                    table_start,
                    table_len: s.block_table.len() as u32,
                });
                ws.slots.push(kv.slot(s.block_table, pos));
            }
            logit_rows += match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => s.tokens.len(),
            };
        }
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
            embed(
                self.embed.matrix(),
                tok,
                &mut x[t * hidden..(t + 1) * hidden],
            );
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
        let (hidden, q_dim, kv_dim, inter) =
            (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let x = &mut ws.x[..n * hidden];
        let xn = &mut ws.xn[..n * hidden];
        let q = &mut ws.q[..n * q_dim];
        let k = &mut ws.k[..n * kv_dim];
        let v = &mut ws.v[..n * kv_dim];
        let attn = &mut ws.attn[..n * q_dim];
        let gate = &mut ws.gate[..n * inter];
        let up = &mut ws.up[..n * inter];
        let mm = &mut ws.matmul;

        let scale = 1.0 / (c.head_dim as f32).sqrt();
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
            for (t, row) in ws.rows.iter().enumerate() {
                let pos = row.pos as usize;
                self.rope
                    .apply(&mut q[t * q_dim..(t + 1) * q_dim], c.num_heads, pos);
                self.rope
                    .apply(&mut k[t * kv_dim..(t + 1) * kv_dim], c.num_kv_heads, pos);
                kv.write(
                    li,
                    ws.slots[t],
                    &k[t * kv_dim..(t + 1) * kv_dim],
                    &v[t * kv_dim..(t + 1) * kv_dim],
                );
            }
            paged_attention(
                q,
                &ws.rows,
                &ws.tables,
                &kv.layer(li),
                c.num_heads,
                scale,
                c.window(li),
                attn,
                &mut ws.attention,
            );
            linear(attn, n, l.o_proj.matrix(), l.o_bias.as_deref(), xn, mm);
            add_in_place(x, xn);

            // MLP block.
            rmsnorm(x, &l.mlp_norm, c.rms_norm_eps, xn);
            let gate_up = &mut [
                LinearOut {
                    w: l.gate_proj.matrix(),
                    bias: None,
                    y: &mut *gate,
                },
                LinearOut {
                    w: l.up_proj.matrix(),
                    bias: None,
                    y: &mut *up,
                },
            ];
            linear_group(xn, n, gate_up, mm);
            silu_mul(gate, up);
            linear(gate, n, l.down_proj.matrix(), None, xn, mm);
            add_in_place(x, xn);
        }
    }

    /// The last device's output: the final norm and the LM head, only for the rows that want
    /// logits. Returns the number of logit rows.
    fn logits(&self, batch: &[SeqChunk], ws: &mut Workspace, out: &mut [f32]) -> usize {
        let c = &self.config;
        let hidden = c.hidden_size;
        let x = &ws.x;
        let mm = &mut ws.matmul;
        let mut r = 0;
        let mut t0 = 0;
        for s in batch {
            let len = s.tokens.len();
            let wanted = match s.logits {
                LogitsWanted::None => t0..t0,
                LogitsWanted::Last => t0 + len - 1..t0 + len,
                LogitsWanted::All => t0..t0 + len,
            };
            for t in wanted {
                rmsnorm(
                    &x[t * hidden..(t + 1) * hidden],
                    &self.norm,
                    c.rms_norm_eps,
                    &mut ws.picked[r * hidden..(r + 1) * hidden],
                );
                r += 1;
            }
            t0 += len;
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
        }
        r
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
