//! The step plan ([`HostPlan`]): each row's token, position, K/V slot and attention row, the
//! block tables and the rows that want logits, built and checked on the host (as `Model::plan`
//! checks the CPU's) before each device copies it into the plan buffers its kernels read. Kept
//! apart from the GPU code so that its CPU tests pin down what the kernels are given.

use crate::device::cuda::kernels::SLOT_SKIP;
use crate::error::{Result, StrataError};
use crate::model::config::ModelConfig;
use crate::model::forward::{LogitsWanted, SeqChunk};

/// The step plan, built on the host and copied into every device's plan buffers.
#[derive(Default)]
pub(super) struct HostPlan {
    pub(super) tokens: Vec<u32>,
    pub(super) positions: Vec<u32>,
    pub(super) slots: Vec<u32>,
    /// (pos, table_start, table_len) per row: the attention kernel's rows.
    pub(super) rows: Vec<u32>,
    pub(super) tables: Vec<u32>,
    /// The rows whose logits the step returns, in batch order.
    pub(super) picked: Vec<u32>,
}

impl HostPlan {
    /// The plan of `batch`, checked as `Model::plan` checks it: the step fits the workspace, the
    /// RoPE table and the block tables, every token is in the vocabulary, `out` holds the
    /// logits. Returns the row count.
    pub(super) fn build(
        &mut self,
        batch: &[SeqChunk],
        config: &ModelConfig,
        block_size: usize,
        max_positions: usize,
        max_tokens: usize,
        out_len: usize,
    ) -> Result<usize> {
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if n == 0 || n > max_tokens {
            return Err(StrataError::Internal(format!(
                "a step of {n} tokens (workspace holds 1..={max_tokens})"
            )));
        }
        for v in [
            &mut self.tokens,
            &mut self.positions,
            &mut self.slots,
            &mut self.rows,
            &mut self.tables,
            &mut self.picked,
        ] {
            v.clear();
        }
        let mut row = 0u32;
        for s in batch {
            // Its "last" row would be the previous chunk's.
            if s.tokens.is_empty() && s.logits != LogitsWanted::None {
                return Err(StrataError::Internal(
                    "a chunk with no tokens cannot want logits".into(),
                ));
            }
            let end = s.start_pos + s.tokens.len();
            if end > max_positions || end.div_ceil(block_size) > s.block_table.len() {
                return Err(StrataError::Internal(format!(
                    "positions up to {end} exceed the RoPE table or the block table"
                )));
            }
            if let Some(&tok) = s.tokens.iter().find(|&&t| t as usize >= config.vocab_size) {
                return Err(StrataError::invalid(
                    "token_ids",
                    format!(
                        "token id {tok} is outside the vocabulary (size {})",
                        config.vocab_size
                    ),
                ));
            }
            let table_start = self.tables.len() as u32;
            self.tables.extend_from_slice(s.block_table);
            for (i, pos) in (s.start_pos..end).enumerate() {
                self.tokens.push(s.tokens[i]);
                self.positions.push(pos as u32);
                let block = s.block_table[pos / block_size] as usize;
                self.slots
                    .push((block * block_size + pos % block_size) as u32);
                self.rows
                    .extend_from_slice(&[pos as u32, table_start, s.block_table.len() as u32]);
            }
            let len = s.tokens.len() as u32;
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => self.picked.push(row + len - 1),
                LogitsWanted::All => self.picked.extend(row..row + len),
            }
            row += len;
        }
        if out_len < self.picked.len() * config.vocab_size {
            return Err(StrataError::Internal("logits buffer too small".into()));
        }
        Ok(n)
    }

    /// Pads a decode plan of `n` rows to `padded`: rows that write nothing and whose outputs
    /// nobody reads (the runner's module docs).
    pub(super) fn pad(&mut self, n: usize, padded: usize) {
        for r in n..padded {
            self.tokens.push(0);
            self.positions.push(0);
            self.slots.push(SLOT_SKIP);
            self.rows.extend_from_slice(&[0, 0, 0]);
            self.picked.push(r as u32);
        }
    }

    /// Undoes [`HostPlan::pad`]: the plan of the `n` rows as built.
    pub(super) fn unpad(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.positions.truncate(n);
        self.slots.truncate(n);
        self.rows.truncate(3 * n);
        self.picked.truncate(n);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tiny_config;
    use super::*;

    /// The plan the GPU kernels read, worked by hand for a mixed step (block size 16): a decode
    /// row, a 3-token prefill that wants every row, and a 2-token chunk that wants none.
    #[test]
    fn a_mixed_step_plans_the_rows_slots_and_picks_the_cpu_uses() {
        let c = tiny_config();
        let (a, b, d) = ([9u32], [1u32, 2, 3], [4u32, 5]);
        let (ta, tb, td) = ([7u32, 2, 11], [4u32], [1u32, 6]);
        let batch = [
            SeqChunk {
                tokens: &a,
                start_pos: 40,
                block_table: &ta,
                logits: LogitsWanted::Last,
            },
            SeqChunk {
                tokens: &b,
                start_pos: 0,
                block_table: &tb,
                logits: LogitsWanted::All,
            },
            SeqChunk {
                tokens: &d,
                start_pos: 14,
                block_table: &td,
                logits: LogitsWanted::None,
            },
        ];
        let mut plan = HostPlan::default();
        assert_eq!(plan.build(&batch, &c, 16, 512, 64, 4 * 256).unwrap(), 6);
        assert_eq!(plan.tokens, [9, 1, 2, 3, 4, 5]);
        assert_eq!(plan.positions, [40, 0, 1, 2, 14, 15]);
        // Block table entry pos / 16, times 16, plus pos % 16.
        assert_eq!(plan.slots, [11 * 16 + 8, 64, 65, 66, 16 + 14, 16 + 15]);
        assert_eq!(
            plan.rows,
            [40, 0, 3, 0, 3, 1, 1, 3, 1, 2, 3, 1, 14, 4, 2, 15, 4, 2]
        );
        assert_eq!(plan.tables, [7, 2, 11, 4, 1, 6]);
        assert_eq!(plan.picked, [0, 1, 2, 3]);
        // A second build starts afresh; padding to a graph's size adds rows that write no K/V.
        let one = [SeqChunk {
            tokens: &a,
            start_pos: 40,
            block_table: &ta,
            logits: LogitsWanted::Last,
        }];
        assert_eq!(plan.build(&one, &c, 16, 512, 64, 256).unwrap(), 1);
        plan.pad(1, 4);
        assert_eq!(plan.tokens, [9, 0, 0, 0]);
        assert_eq!(plan.slots, [184, SLOT_SKIP, SLOT_SKIP, SLOT_SKIP]);
        assert_eq!(plan.rows, [40, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(plan.tables, [7, 2, 11]);
        assert_eq!(plan.picked, [0, 1, 2, 3]);
        // A step that gets no graph runs the plan as built.
        plan.unpad(1);
        assert_eq!(
            (&plan.tokens[..], &plan.positions[..], &plan.slots[..]),
            (&[9][..], &[40][..], &[184][..])
        );
        assert_eq!(
            (&plan.rows[..], &plan.picked[..]),
            (&[40, 0, 3][..], &[0][..])
        );
    }

    /// What the plan refuses, as the CPU's `Model::plan` does.
    #[test]
    fn a_plan_refuses_what_the_cpu_refuses() {
        let c = tiny_config();
        let message = |batch: &[SeqChunk], out_len: usize| {
            let err = HostPlan::default()
                .build(batch, &c, 16, 512, 4, out_len)
                .expect_err("refused");
            err.to_string()
        };
        let chunk = |tokens: &'static [u32], start_pos: usize, table: &'static [u32]| SeqChunk {
            tokens,
            start_pos,
            block_table: table,
            logits: LogitsWanted::Last,
        };
        assert!(message(&[chunk(&[256], 0, &[0])], 256)
            .contains("token_ids: token id 256 is outside the vocabulary (size 256)"));
        assert!(message(&[chunk(&[1, 2], 15, &[0])], 256)
            .contains("positions up to 17 exceed the RoPE table or the block table"));
        assert!(message(&[chunk(&[1], 512, &[0; 40])], 256).contains("positions up to 513"));
        assert!(message(&[chunk(&[1; 5], 0, &[0])], 5 * 256)
            .contains("a step of 5 tokens (workspace holds 1..=4)"));
        assert!(message(&[chunk(&[1], 0, &[0])], 255).contains("logits buffer too small"));
        assert!(message(
            &[SeqChunk {
                logits: LogitsWanted::All,
                ..chunk(&[], 0, &[0])
            }],
            256
        )
        .contains("a step of 0 tokens"));
    }
}
