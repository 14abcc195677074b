//! The host tier: K/V blocks kept in RAM below the device, under a byte budget, least recently
//! used first out. It only keeps what it is given; the RAM gate and the moves live in `mover`.

use std::collections::{BTreeMap, HashMap};

/// One block's K/V (laid out as `BlockPool::read_block` writes it) and the tokens it holds.
pub struct HostBlock {
    pub tokens: Box<[u32]>,
    pub data: Box<[u8]>,
    tick: u64,
}

pub struct HostTier {
    budget: u64,
    bytes: u64,
    blocks: HashMap<u64, HostBlock>,
    /// tick -> hash; the first entry is the least recently used.
    lru: BTreeMap<u64, u64>,
    tick: u64,
}

impl HostTier {
    pub fn new(budget: u64) -> HostTier {
        HostTier {
            budget,
            bytes: 0,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn contains(&self, hash: u64, tokens: &[u32]) -> bool {
        self.blocks.get(&hash).is_some_and(|b| *b.tokens == *tokens)
    }

    /// Makes `hash` the most recently used.
    pub fn touch(&mut self, hash: u64) {
        self.tick += 1;
        if let Some(b) = self.blocks.get_mut(&hash) {
            self.lru.remove(&b.tick);
            b.tick = self.tick;
            self.lru.insert(self.tick, hash);
        }
    }

    /// The block's K/V when it holds `tokens` under `hash`; marks it used.
    pub fn get(&mut self, hash: u64, tokens: &[u32]) -> Option<&[u8]> {
        if !self.contains(hash, tokens) {
            return None;
        }
        self.touch(hash);
        self.blocks.get(&hash).map(|b| &*b.data)
    }

    /// Whether `bytes` more fit in the budget once everything evictable were gone.
    pub fn can_ever_hold(&self, bytes: u64) -> bool {
        bytes <= self.budget
    }

    /// Whether `bytes` more fit without evicting anything.
    pub fn has_room(&self, bytes: u64) -> bool {
        self.bytes + bytes <= self.budget
    }

    /// Takes the least recently used block out (the caller may write it to disk).
    pub fn pop_oldest(&mut self) -> Option<(u64, HostBlock)> {
        let (_, hash) = self.lru.pop_first()?;
        let b = self.blocks.remove(&hash)?;
        self.bytes -= b.data.len() as u64;
        Some((hash, b))
    }

    /// Adds a block as the most recently used. The caller made room first (`has_room`).
    pub fn insert(&mut self, hash: u64, tokens: Box<[u32]>, data: Box<[u8]>) {
        if let Some(old) = self.blocks.remove(&hash) {
            self.lru.remove(&old.tick);
            self.bytes -= old.data.len() as u64;
        }
        self.tick += 1;
        self.bytes += data.len() as u64;
        self.lru.insert(self.tick, hash);
        self.blocks.insert(
            hash,
            HostBlock {
                tokens,
                data,
                tick: self.tick,
            },
        );
    }

    /// Every block, least recently used first: (hash, tokens, data).
    pub fn iter_oldest_first(&self) -> impl Iterator<Item = (u64, &[u32], &[u8])> {
        self.lru.values().filter_map(|h| {
            let b = self.blocks.get(h)?;
            Some((*h, &*b.tokens, &*b.data))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(x: u8) -> Box<[u8]> {
        vec![x; 10].into()
    }

    #[test]
    fn lru_order_budget_and_token_check() {
        let mut h = HostTier::new(30);
        h.insert(1, vec![1].into(), data(1));
        h.insert(2, vec![2].into(), data(2));
        h.insert(3, vec![3].into(), data(3));
        assert_eq!((h.len(), h.bytes()), (3, 30));
        assert!(!h.has_room(1) && h.can_ever_hold(30) && !h.can_ever_hold(31));
        assert_eq!(h.get(1, &[1]), Some(&[1u8; 10][..]), "a hit refreshes it");
        assert_eq!(h.get(2, &[9]), None, "other tokens are not a hit");
        assert!(h.contains(2, &[2]) && !h.contains(2, &[3]));
        let (hash, b) = h.pop_oldest().unwrap();
        assert_eq!((hash, &*b.tokens), (2, &[2u32][..]));
        assert_eq!(h.bytes(), 20);
        let order: Vec<u64> = h.iter_oldest_first().map(|(k, _, _)| k).collect();
        assert_eq!(order, [3, 1]);
        h.touch(3);
        assert_eq!(h.pop_oldest().unwrap().0, 1);
        h.insert(3, vec![3].into(), data(7));
        assert_eq!((h.len(), h.bytes()), (1, 10), "re-inserting replaces");
        assert_eq!(h.pop_oldest().unwrap().1.data[0], 7);
        assert!(h.pop_oldest().is_none() && h.is_empty());
    }
}
