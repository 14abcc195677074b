//! Window slots: where the sliding-window layers keep a block's K/V.
//!
//! A sliding layer (Gemma 3's five of six, every layer of a windowed Mistral) reads only the last
//! `window` positions, so its K and V arrays hold `num_slots` blocks, fewer than the pool has,
//! and a block has a slot only while it can still be read: while some running sequence's window
//! reaches it, or while it is the tail of a conversation left in the prefix cache, whose next
//! token would read it. Block ids, block tables and the prefix index stay one for all layers; the
//! forward pass reads the sliding layers through `slot_of` (docs/design.md, "Sliding-window
//! K/V").
//!
//! This file keeps the slots themselves; [`crate::kv::blocks::BlockPool`] decides when a block
//! takes or gives back one, since that depends on its holders and the prefix index.

/// A block without a slot.
const NO_SLOT: u32 = u32::MAX;

/// What a pool's window slots are: the window, which layers use it, and how many slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowLayout {
    /// Positions a sliding layer reads: `pos - window < j <= pos`.
    pub window: usize,
    /// Per layer: are its K/V kept in slots?
    pub layers: Vec<bool>,
    pub num_slots: usize,
}

impl WindowLayout {
    /// Slots for the windows of `max_batch` running sequences, at most [`WINDOWS_KEPT`] (each a
    /// window, its partial last block and one more), a step's new blocks, and as many again
    /// for the tails of cached conversations; never more than the pool's blocks. More windows
    /// than that wait for slots as sequences wait for blocks.
    pub fn slots_for(
        window: usize,
        block_size: usize,
        max_batch: usize,
        max_batch_tokens: usize,
        num_blocks: usize,
    ) -> usize {
        let per_sequence = window.div_ceil(block_size) + 2;
        let windows = 2 * max_batch.min(WINDOWS_KEPT);
        (windows * per_sequence + max_batch_tokens.div_ceil(block_size)).min(num_blocks)
    }
}

/// The running sequences whose windows the slots are sized for: on the CPU a step of more long
/// sequences than this is rare, and every slot more is memory the full layers cannot use.
pub const WINDOWS_KEPT: usize = 8;

/// Per block: its slot, and the running sequences whose window reaches it.
pub struct WindowSlots {
    window: usize,
    block_size: usize,
    layers: Vec<bool>,
    slot_of: Vec<u32>,
    /// Running sequences whose window reaches the block (its "window references").
    refs: Vec<u32>,
    free: Vec<u32>,
    num_slots: usize,
    /// Blocks in the prefix cache's LRU (nobody holds them) that keep a slot.
    pub parked: usize,
    /// Slots given back because every window had passed their block.
    pub passed: u64,
}

impl WindowSlots {
    pub fn new(layout: &WindowLayout, block_size: usize, num_blocks: usize) -> WindowSlots {
        WindowSlots {
            window: layout.window,
            block_size,
            layers: layout.layers.clone(),
            slot_of: vec![NO_SLOT; num_blocks],
            refs: vec![0; num_blocks],
            free: (0..layout.num_slots as u32).rev().collect(),
            num_slots: layout.num_slots,
            parked: 0,
            passed: 0,
        }
    }

    pub fn window(&self) -> usize {
        self.window
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Slots no block holds.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Whether `layer` keeps its K/V in slots.
    pub fn is_windowed(&self, layer: usize) -> bool {
        self.layers.get(layer).copied().unwrap_or(false)
    }

    /// The first block a sequence with `computed` positions still reads: its next token, at
    /// position `computed`, sees positions from `computed + 1 - window` on.
    pub fn first_read(&self, computed: usize) -> usize {
        (computed + 1).saturating_sub(self.window) / self.block_size
    }

    /// The first block a sequence with `computed` positions keeps for its sliding layers: what
    /// its last full block's end reads, the point it would resume from (a prefix hit ends at a
    /// full block).
    pub fn first_kept(&self, computed: usize) -> usize {
        self.first_read(computed / self.block_size * self.block_size)
    }

    pub fn slot(&self, block: u32) -> Option<u32> {
        let s = self.slot_of[block as usize];
        (s != NO_SLOT).then_some(s)
    }

    pub fn has_slot(&self, block: u32) -> bool {
        self.slot_of[block as usize] != NO_SLOT
    }

    pub fn num_blocks(&self) -> usize {
        self.slot_of.len()
    }

    pub fn refs(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// Gives `block` a free slot; the caller made sure there is one.
    pub fn take(&mut self, block: u32) {
        debug_assert!(!self.has_slot(block), "block {block} has a slot already");
        if let Some(s) = self.free.pop() {
            self.slot_of[block as usize] = s;
        }
    }

    /// Gives `block`'s slot back, if it has one.
    pub fn give_back(&mut self, block: u32) {
        let s = std::mem::replace(&mut self.slot_of[block as usize], NO_SLOT);
        if s != NO_SLOT {
            self.free.push(s);
        }
    }

    pub fn add_ref(&mut self, block: u32) {
        debug_assert!(self.has_slot(block), "block {block} is read without a slot");
        self.refs[block as usize] += 1;
    }

    /// Drops one window reference; returns how many are left.
    pub fn drop_ref(&mut self, block: u32) -> u32 {
        let r = &mut self.refs[block as usize];
        debug_assert!(*r > 0, "block {block}: window reference dropped twice");
        *r = r.saturating_sub(1);
        *r
    }

    /// The longest prefix of `table` (blocks that hold positions `0..table.len() * block_size`)
    /// a sequence can continue from: every block its next token reads has its slot.
    pub fn usable_prefix(&self, table: &[u32]) -> usize {
        let mut n = table.len();
        while n > 0 {
            let first = self.first_read(n * self.block_size);
            match table[first..n].iter().rposition(|&b| !self.has_slot(b)) {
                None => return n,
                // A shorter prefix reads this block too unless it ends at or before it.
                Some(j) => n = first + j,
            }
        }
        0
    }

    /// `table` with each block replaced by its slot; a block without one becomes slot 0, which
    /// the attention kernel never reads for it (it is outside every window: `Model::plan`
    /// checks that each row's window has its slots).
    pub fn translate(&self, table: &[u32], out: &mut Vec<u32>) {
        out.extend(table.iter().map(|&b| self.slot(b).unwrap_or(0)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(window: usize, num_slots: usize, num_blocks: usize) -> WindowSlots {
        let layout = WindowLayout {
            window,
            layers: vec![true, false],
            num_slots,
        };
        WindowSlots::new(&layout, 4, num_blocks)
    }

    #[test]
    fn first_read_follows_the_window() {
        let w = slots(8, 4, 8);
        // Position 8 sees 1..=8: block 0 still holds position 1.
        assert_eq!(w.first_read(8), 0);
        // Position 11 sees 4..=11: block 1 on.
        assert_eq!(w.first_read(11), 1);
        assert_eq!(w.first_read(12), 1);
        assert_eq!(w.first_read(15), 2);
        assert!(w.is_windowed(0) && !w.is_windowed(1) && !w.is_windowed(9));
    }

    #[test]
    fn slots_are_taken_and_given_back() {
        let mut w = slots(8, 2, 4);
        w.take(3);
        w.take(1);
        assert_eq!((w.slot(3), w.slot(1), w.slot(0)), (Some(0), Some(1), None));
        assert_eq!(w.num_free(), 0);
        w.give_back(3);
        w.give_back(3);
        assert_eq!(w.num_free(), 1);
        w.take(2);
        assert_eq!(w.slot(2), Some(0));
        let mut t = Vec::new();
        w.translate(&[0, 1, 2], &mut t);
        assert_eq!(t, vec![0, 1, 0]);
    }

    #[test]
    fn usable_prefix_needs_the_next_tokens_window() {
        // Window 8, blocks of 4: a prefix of n blocks reads blocks (4n + 1 - 8) / 4 .. n.
        let mut w = slots(8, 8, 8);
        let table = [0, 1, 2, 3, 4];
        for b in [2, 3, 4] {
            w.take(b);
        }
        // 5 blocks (20 positions): reads positions 13..=20, blocks 3 and 4.
        assert_eq!(w.usable_prefix(&table), 5);
        w.give_back(3);
        // Without block 3: 5 and 4 blocks read it; 3 blocks (position 12 reads 5..=12) read
        // blocks 1 and 2, and block 1 has no slot; 1 block reads only block 0, which has none.
        assert_eq!(w.usable_prefix(&table), 0);
        w.take(1);
        assert_eq!(w.usable_prefix(&table), 3);
        w.take(0);
        w.give_back(1);
        w.give_back(2);
        // 2 blocks read positions 1..=8: blocks 0 and 1.
        assert_eq!(w.usable_prefix(&table), 1);
        assert_eq!(w.usable_prefix(&[]), 0);
    }
}
