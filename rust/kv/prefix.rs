//! The device prefix cache: full K/V blocks indexed by the hash of everything before and in them.
//!
//! A full block's identity is a hash chain: `hash(parent hash, its token ids)`, started from a
//! salt that names the model and the K/V format, so equal prefixes map to equal hashes and K/V
//! never crosses models. Blocks nobody references but that still hold a valid prefix stay indexed
//! in an LRU list; allocation takes truly free blocks first and evicts the least recently used
//! cached block after that.

use std::collections::HashMap;

/// The hash of a block whose parent hashes to `parent`, holding `tokens`. Stable across runs and
/// platforms (the disk tier will store it): splitmix64's finalizer over each token.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(parent ^ 0x9e37_79b9_7f4a_7c15);
    for &t in tokens {
        h = mix(h ^ (u64::from(t) + 1).wrapping_mul(0xff51_afd7_ed55_8ccd));
    }
    mix(h ^ tokens.len() as u64)
}

/// Hashes of the full blocks of `tokens`, continuing the chain in `hashes` (which holds the
/// hashes of the first `hashes.len()` blocks already).
pub fn extend_hashes(salt: u64, tokens: &[u32], block_size: usize, hashes: &mut Vec<u64>) {
    let full = tokens.len() / block_size;
    for b in hashes.len()..full {
        let parent = if b == 0 { salt } else { hashes[b - 1] };
        hashes.push(block_hash(
            parent,
            &tokens[b * block_size..(b + 1) * block_size],
        ));
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const NIL: u32 = u32::MAX;

/// A doubly linked list over block ids: O(1) push, remove and pop of the oldest.
struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    fn new(n: usize) -> Lru {
        Lru {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            linked: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Appends `b` as the most recently used.
    fn push(&mut self, b: u32) {
        debug_assert!(!self.linked[b as usize]);
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.linked[i] = true;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        let i = b as usize;
        if !self.linked[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[i] = false;
        self.len -= 1;
    }

    fn pop_oldest(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }
}

/// A cached block the device is about to reuse: what it held, for the tiers below.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub block: u32,
    pub hash: u64,
    pub tokens: Box<[u32]>,
}

/// What a cached block holds: its hash and, to rule out a hash collision, its tokens.
struct Entry {
    hash: u64,
    tokens: Box<[u32]>,
}

/// Hash → block, the content of each indexed block, and the LRU of indexed blocks nobody holds.
pub struct PrefixIndex {
    by_hash: HashMap<u64, u32>,
    entries: Vec<Option<Entry>>,
    lru: Lru,
}

impl PrefixIndex {
    pub fn new(num_blocks: usize) -> PrefixIndex {
        PrefixIndex {
            by_hash: HashMap::new(),
            entries: (0..num_blocks).map(|_| None).collect(),
            lru: Lru::new(num_blocks),
        }
    }

    /// Blocks indexed (held or not).
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Indexed blocks nobody holds: evictable.
    pub fn evictable(&self) -> usize {
        self.lru.len
    }

    pub fn is_indexed(&self, block: u32) -> bool {
        self.entries[block as usize].is_some()
    }

    /// Indexes `block` as holding `tokens` under `hash`; false (and nothing changes) when the
    /// hash is already indexed, e.g. two sequences computed the same prefix at once.
    pub fn insert(&mut self, block: u32, hash: u64, tokens: &[u32]) -> bool {
        if self.by_hash.contains_key(&hash) || self.entries[block as usize].is_some() {
            return false;
        }
        self.by_hash.insert(hash, block);
        self.entries[block as usize] = Some(Entry {
            hash,
            tokens: tokens.into(),
        });
        true
    }

    /// The block holding `tokens` under `hash`, if indexed.
    pub fn get(&self, hash: u64, tokens: &[u32]) -> Option<u32> {
        let &b = self.by_hash.get(&hash)?;
        match &self.entries[b as usize] {
            Some(e) if *e.tokens == *tokens => Some(b),
            _ => None,
        }
    }

    /// An indexed block lost its last holder: it becomes the most recently used evictable one.
    pub fn park(&mut self, block: u32) {
        self.lru.push(block);
    }

    /// An evictable block got a holder again.
    pub fn unpark(&mut self, block: u32) {
        self.lru.remove(block);
    }

    /// Drops the least recently used evictable block from the index and returns what it held.
    pub fn evict(&mut self) -> Option<Evicted> {
        let block = self.lru.pop_oldest()?;
        let e = self.entries[block as usize].take()?;
        self.by_hash.remove(&e.hash);
        Some(Evicted {
            block,
            hash: e.hash,
            tokens: e.tokens,
        })
    }

    /// Evictable blocks, least recently used first.
    pub fn parked_oldest_first(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(self.lru.head).filter(|&b| b != NIL), |&b| {
            Some(self.lru.next[b as usize]).filter(|&n| n != NIL)
        })
    }

    /// Every indexed block: (block, hash, tokens).
    pub fn iter(&self) -> impl Iterator<Item = (u32, u64, &[u32])> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(b, e)| e.as_ref().map(|e| (b as u32, e.hash, &*e.tokens)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_chain_depends_on_everything_before() {
        let a = block_hash(7, &[1, 2, 3]);
        assert_eq!(a, block_hash(7, &[1, 2, 3]), "deterministic");
        assert_ne!(a, block_hash(8, &[1, 2, 3]), "parent matters");
        assert_ne!(a, block_hash(7, &[1, 2, 4]), "tokens matter");
        assert_ne!(a, block_hash(7, &[2, 1, 3]), "order matters");
        assert_ne!(
            block_hash(7, &[0]),
            block_hash(7, &[0, 0]),
            "length matters"
        );
        // A pinned value: the disk tier stores these, so they must not drift between builds.
        assert_eq!(block_hash(0, &[1, 2, 3]), 10911690665797823103);
        let mut hs = Vec::new();
        extend_hashes(5, &[1, 2, 3, 4, 5], 2, &mut hs);
        assert_eq!(hs, vec![block_hash(5, &[1, 2]), block_hash(hs[0], &[3, 4])]);
        extend_hashes(5, &[1, 2, 3, 4, 5, 6], 2, &mut hs);
        assert_eq!(hs.len(), 3);
        assert_eq!(hs[2], block_hash(hs[1], &[5, 6]));
    }

    #[test]
    fn lookup_checks_tokens_and_evicts_oldest_first() {
        let mut ix = PrefixIndex::new(4);
        assert!(ix.insert(0, 10, &[1, 2]));
        assert!(ix.insert(1, 11, &[3, 4]));
        assert!(!ix.insert(2, 10, &[1, 2]), "hash already indexed");
        assert_eq!(ix.get(10, &[1, 2]), Some(0));
        assert_eq!(ix.get(10, &[1, 3]), None, "a collision is not a hit");
        assert_eq!(ix.evict(), None, "nothing parked");
        ix.park(1);
        ix.park(0);
        assert_eq!(ix.evictable(), 2);
        ix.unpark(1);
        ix.park(1);
        assert_eq!(ix.parked_oldest_first().collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(
            ix.evict(),
            Some(Evicted {
                block: 0,
                hash: 10,
                tokens: vec![1, 2].into()
            }),
            "least recently parked first"
        );
        assert_eq!(ix.get(10, &[1, 2]), None, "evicted blocks leave the index");
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.iter().collect::<Vec<_>>(), vec![(1, 11, &[3u32, 4][..])]);
        assert_eq!(ix.evict().map(|e| e.block), Some(1));
        assert_eq!(ix.evict(), None);
        assert!(ix.is_empty());
    }
}
