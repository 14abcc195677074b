//! BlockPool: the device's K/V memory, cut into fixed-size blocks of `block_size` tokens.
//!
//! Layout per layer: K and V are each `[num_blocks, block_size, kv_heads, head_dim]` f32. A
//! sequence owns a block table; its token at position p lives in block `table[p / block_size]`,
//! row `p % block_size`. Blocks are reference-counted so that sequences can share a prefix.

use crate::error::{Result, StrataError};
use crate::model::kernels::cpu::attention::KvLayer;

struct LayerStore {
    k: Vec<f32>,
    v: Vec<f32>,
}

pub struct BlockPool {
    block_size: usize,
    num_blocks: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: Vec<LayerStore>,
    refcount: Vec<u32>,
    /// Free block ids; popped from the end, so recently freed blocks are reused first.
    free: Vec<u32>,
}

impl BlockPool {
    /// Bytes of K/V one block holds across all layers.
    pub fn block_bytes(
        num_layers: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> usize {
        num_layers * 2 * block_size * kv_heads * head_dim * std::mem::size_of::<f32>()
    }

    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<BlockPool> {
        if num_blocks == 0 || block_size == 0 {
            return Err(StrataError::invalid(
                "kv_memory_mib",
                "the K/V budget holds no block; raise it",
            ));
        }
        let per_layer = num_blocks
            .checked_mul(block_size * kv_heads * head_dim)
            .ok_or_else(|| StrataError::invalid("kv_memory_mib", "too large"))?;
        let mut layers = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            // Zeroed allocations are lazily backed by the OS: untouched blocks cost no RAM.
            let mut k = Vec::new();
            let mut v = Vec::new();
            k.try_reserve_exact(per_layer)
                .and_then(|_| v.try_reserve_exact(per_layer))
                .map_err(|_| {
                    StrataError::Internal(format!(
                        "cannot allocate the K/V pool ({} MiB)",
                        (num_layers * per_layer * 8) >> 20
                    ))
                })?;
            k.resize(per_layer, 0.0);
            v.resize(per_layer, 0.0);
            layers.push(LayerStore { k, v });
        }
        Ok(BlockPool {
            block_size,
            num_blocks,
            kv_heads,
            head_dim,
            layers,
            refcount: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` blocks, or none at all when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            self.refcount[b as usize] = 1;
        }
        Some(blocks)
    }

    /// Adds a reference to a block another sequence already holds (a shared prefix).
    pub fn retain(&mut self, block: u32) {
        self.refcount[block as usize] += 1;
    }

    /// Drops one reference to each block; blocks nobody holds go back to the free list.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let rc = &mut self.refcount[b as usize];
            debug_assert!(*rc > 0, "block {b} released more often than taken");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                self.free.push(b);
            }
        }
    }

    /// Index of the K/V row for position `pos` of a sequence with block table `table`.
    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Writes one token's K and V (`kv_heads * head_dim` each) into `slot` of `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_heads * self.head_dim;
        let store = &mut self.layers[layer];
        store.k[slot * d..(slot + 1) * d].copy_from_slice(k);
        store.v[slot * d..(slot + 1) * d].copy_from_slice(v);
    }

    pub fn layer(&self, layer: usize) -> KvLayer<'_> {
        let store = &self.layers[layer];
        KvLayer {
            k: &store.k,
            v: &store.v,
            block_size: self.block_size,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_and_share() {
        let mut pool = BlockPool::new(2, 4, 16, 2, 8).unwrap();
        let a = pool.allocate(3).unwrap();
        assert_eq!(pool.num_free(), 1);
        assert!(pool.allocate(2).is_none(), "all-or-nothing");
        assert_eq!(pool.num_free(), 1);
        pool.retain(a[0]);
        pool.release(&a);
        assert_eq!(pool.num_free(), 3, "the shared block stays taken");
        pool.release(&a[..1]);
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn slots_follow_the_block_table() {
        let mut pool = BlockPool::new(1, 4, 4, 1, 2).unwrap();
        let table = [3u32, 1];
        assert_eq!(pool.slot(&table, 0), 12);
        assert_eq!(pool.slot(&table, 5), 5);
        pool.write(0, pool.slot(&table, 5), &[1.0, 2.0], &[3.0, 4.0]);
        let l = pool.layer(0);
        assert_eq!(&l.k[10..12], &[1.0, 2.0]);
        assert_eq!(&l.v[10..12], &[3.0, 4.0]);
    }
}
