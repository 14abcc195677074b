//! MemoryPool: what one device's memory holds, by purpose, and the capacity it must stay within.
//!
//! Every lasting allocation on a device is reserved here first (or, where the allocator sizes it,
//! right after) and the [`Reservation`] is kept next to what it accounts for: dropping the owner
//! drops the reservation, which gives the bytes back. So the counts cannot leak, and no code path
//! (an early return, a failed load) can forget to release.
//!
//! The pool is a handle (`Clone` shares it): the engine reads it for `stats()` while the engine
//! thread, and later the cache mover's thread, reserve and release. A `Mutex` rather than atomics
//! keeps the check against the capacity and the per-purpose counts one consistent step;
//! reservations are rare (load, one per staging buffer), so the lock is never contended.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

/// What a reservation is for. The order is the order of `stats()` and the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Purpose {
    /// The model's tensors as loaded.
    Weights,
    /// The paged K/V pool.
    Kv,
    /// Per-step buffers sized at load: activations, kernel scratch, logits, the RoPE table.
    Workspace,
    /// Captured CUDA graphs (none on the CPU).
    Graphs,
    /// Buffers that K/V passes through on its way between the device and the tiers below.
    Staging,
}

impl Purpose {
    pub const COUNT: usize = 5;
    pub const ALL: [Purpose; Purpose::COUNT] = [
        Purpose::Weights,
        Purpose::Kv,
        Purpose::Workspace,
        Purpose::Graphs,
        Purpose::Staging,
    ];

    /// The lowercase name used in `stats()`, metrics labels and messages.
    pub fn name(self) -> &'static str {
        match self {
            Purpose::Weights => "weights",
            Purpose::Kv => "kv",
            Purpose::Workspace => "workspace",
            Purpose::Graphs => "graphs",
            Purpose::Staging => "staging",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Purpose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a reservation was refused: it would take the device past its capacity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "device {device}: cannot reserve {need} bytes for {purpose}: {in_use} of {capacity} bytes \
     in use"
)]
pub struct PoolRefusal {
    pub device: String,
    pub purpose: Purpose,
    pub need: u64,
    pub in_use: u64,
    /// The configured capacity; `u64::MAX` for an unbounded pool (whose count would overflow).
    pub capacity: u64,
}

#[derive(Debug)]
struct Inner {
    device: String,
    capacity: Option<u64>,
    in_use: Mutex<[u64; Purpose::COUNT]>,
}

/// One device's memory accounting. Cheap to clone: clones share the counts.
#[derive(Clone, Debug)]
pub struct MemoryPool {
    inner: Arc<Inner>,
}

/// Bytes held for one purpose until dropped.
#[must_use = "dropping a reservation releases its bytes at once"]
#[derive(Debug)]
pub struct Reservation {
    pool: MemoryPool,
    purpose: Purpose,
    bytes: u64,
}

/// The pool's counts at one instant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSnapshot {
    pub device: String,
    /// `None`: not bounded by configuration (the CPU today).
    pub capacity: Option<u64>,
    in_use: [u64; Purpose::COUNT],
}

impl MemoryPool {
    /// A pool for `device` ("cpu", "cuda:0") holding at most `capacity` bytes; `None`: unbounded.
    pub fn new(device: impl Into<String>, capacity: Option<u64>) -> MemoryPool {
        MemoryPool {
            inner: Arc::new(Inner {
                device: device.into(),
                capacity,
                in_use: Mutex::new([0; Purpose::COUNT]),
            }),
        }
    }

    pub fn device(&self) -> &str {
        &self.inner.device
    }

    pub fn capacity(&self) -> Option<u64> {
        self.inner.capacity
    }

    fn counts(&self) -> MutexGuard<'_, [u64; Purpose::COUNT]> {
        crate::sync::lock(&self.inner.in_use)
    }

    /// Reserves `bytes` for `purpose`, or refuses when the total in use would pass the capacity.
    pub fn reserve(&self, purpose: Purpose, bytes: u64) -> Result<Reservation, PoolRefusal> {
        let mut counts = self.counts();
        let in_use: u64 = counts.iter().sum();
        let capacity = self.inner.capacity.unwrap_or(u64::MAX);
        let fits = in_use
            .checked_add(bytes)
            .is_some_and(|total| total <= capacity);
        if !fits {
            return Err(PoolRefusal {
                device: self.inner.device.clone(),
                purpose,
                need: bytes,
                in_use,
                capacity,
            });
        }
        // Cannot overflow: one purpose's count is at most the total, which fits in a u64.
        counts[purpose.index()] += bytes;
        Ok(Reservation {
            pool: self.clone(),
            purpose,
            bytes,
        })
    }

    fn release(&self, purpose: Purpose, bytes: u64) {
        let mut counts = self.counts();
        let slot = &mut counts[purpose.index()];
        // Never underflows: a reservation releases only what it added.
        *slot = slot.saturating_sub(bytes);
    }

    pub fn in_use(&self, purpose: Purpose) -> u64 {
        self.counts()[purpose.index()]
    }

    pub fn total_in_use(&self) -> u64 {
        self.counts().iter().sum()
    }

    pub fn snapshot(&self) -> PoolSnapshot {
        PoolSnapshot {
            device: self.inner.device.clone(),
            capacity: self.inner.capacity,
            in_use: *self.counts(),
        }
    }
}

impl Reservation {
    pub fn purpose(&self) -> Purpose {
        self.purpose
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pool.release(self.purpose, self.bytes);
    }
}

impl PoolSnapshot {
    pub fn in_use(&self, purpose: Purpose) -> u64 {
        self.in_use[purpose.index()]
    }

    pub fn total_in_use(&self) -> u64 {
        self.in_use.iter().sum()
    }

    /// Every purpose with its bytes, in [`Purpose::ALL`] order (zeros included).
    pub fn by_purpose(&self) -> impl Iterator<Item = (Purpose, u64)> + '_ {
        Purpose::ALL.iter().map(|&p| (p, self.in_use(p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_and_releases_by_purpose() {
        let pool = MemoryPool::new("cpu", Some(1000));
        let w = pool.reserve(Purpose::Weights, 600).unwrap();
        let kv = pool.reserve(Purpose::Kv, 300).unwrap();
        let ws = pool.reserve(Purpose::Workspace, 100).unwrap();
        assert_eq!(pool.in_use(Purpose::Weights), 600);
        assert_eq!(pool.in_use(Purpose::Kv), 300);
        assert_eq!(pool.in_use(Purpose::Workspace), 100);
        assert_eq!(pool.in_use(Purpose::Graphs), 0);
        assert_eq!(pool.total_in_use(), 1000);
        assert_eq!((kv.purpose(), kv.bytes()), (Purpose::Kv, 300));
        drop(kv);
        assert_eq!(pool.in_use(Purpose::Kv), 0);
        assert_eq!(pool.total_in_use(), 700);
        let snap = pool.snapshot();
        assert_eq!(snap.device, "cpu");
        assert_eq!(snap.capacity, Some(1000));
        assert_eq!(
            snap.by_purpose().collect::<Vec<_>>(),
            vec![
                (Purpose::Weights, 600),
                (Purpose::Kv, 0),
                (Purpose::Workspace, 100),
                (Purpose::Graphs, 0),
                (Purpose::Staging, 0),
            ]
        );
        assert_eq!(snap.total_in_use(), 700);
        drop((w, ws));
        assert_eq!(pool.total_in_use(), 0);
    }

    #[test]
    fn refuses_past_capacity_naming_purpose_need_in_use_and_capacity() {
        let pool = MemoryPool::new("cuda:0", Some(4096));
        let _w = pool.reserve(Purpose::Weights, 3072).unwrap();
        let refusal = pool.reserve(Purpose::Kv, 2048).unwrap_err();
        assert_eq!(
            refusal.to_string(),
            "device cuda:0: cannot reserve 2048 bytes for kv: 3072 of 4096 bytes in use"
        );
        assert_eq!(
            refusal,
            PoolRefusal {
                device: "cuda:0".into(),
                purpose: Purpose::Kv,
                need: 2048,
                in_use: 3072,
                capacity: 4096,
            }
        );
        // A refusal reserves nothing; exactly what is left still fits.
        assert_eq!(pool.total_in_use(), 3072);
        let _kv = pool.reserve(Purpose::Kv, 1024).unwrap();
        assert_eq!(pool.total_in_use(), 4096);
        assert!(pool.reserve(Purpose::Staging, 1).is_err());
        // Zero bytes always fit.
        assert_eq!(pool.reserve(Purpose::Graphs, 0).unwrap().bytes(), 0);
    }

    #[test]
    fn an_unbounded_pool_refuses_only_an_overflowing_count() {
        let pool = MemoryPool::new("cpu", None);
        let _big = pool.reserve(Purpose::Weights, u64::MAX - 10).unwrap();
        let _rest = pool.reserve(Purpose::Kv, 10).unwrap();
        assert_eq!(pool.total_in_use(), u64::MAX);
        let refusal = pool.reserve(Purpose::Workspace, 1).unwrap_err();
        assert_eq!(
            refusal.to_string(),
            format!(
                "device cpu: cannot reserve 1 bytes for workspace: {} of {} bytes in use",
                u64::MAX,
                u64::MAX
            )
        );
        assert_eq!(pool.snapshot().capacity, None);
    }

    #[test]
    fn dropping_the_owner_releases_its_reservation() {
        struct Buffer {
            _data: Vec<u8>,
            _reserved: Reservation,
        }
        let pool = MemoryPool::new("cpu", Some(100));
        let make = |n: usize| -> Result<Buffer, PoolRefusal> {
            let reserved = pool.reserve(Purpose::Staging, n as u64)?;
            Ok(Buffer {
                _data: vec![0; n],
                _reserved: reserved,
            })
        };
        let a = make(60).unwrap();
        assert!(make(60).is_err(), "60 + 60 > 100");
        assert_eq!(pool.in_use(Purpose::Staging), 60);
        drop(a);
        assert_eq!(pool.in_use(Purpose::Staging), 0);
        let b = make(100).unwrap();
        assert_eq!(pool.total_in_use(), 100);
        // The clone of the pool inside the reservation keeps the counts alive past the handle.
        drop(pool);
        drop(b);
    }

    #[test]
    fn concurrent_reservations_never_pass_the_capacity() {
        const CAPACITY: u64 = 1000;
        const CHUNK: u64 = 10;
        const THREADS: usize = 8;
        const TRIES: usize = 50;
        let pool = MemoryPool::new("cpu", Some(CAPACITY));
        let held: Vec<Vec<Reservation>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    let pool = pool.clone();
                    s.spawn(move || {
                        let mut mine = Vec::new();
                        for i in 0..TRIES {
                            if let Ok(r) = pool.reserve(Purpose::Kv, CHUNK) {
                                mine.push(r);
                            }
                            assert!(pool.total_in_use() <= CAPACITY);
                            // Give some back now and then, so refusals and releases interleave.
                            if i % 7 == 6 {
                                mine.pop();
                            }
                        }
                        mine
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let held_bytes: u64 = held.iter().flatten().map(Reservation::bytes).sum();
        assert_eq!(pool.total_in_use(), held_bytes);
        assert!(held_bytes <= CAPACITY, "{held_bytes} bytes held");
        // 8 threads x 50 tries want 4000 bytes: the pool ends full or nearly so.
        assert!(
            held_bytes >= CAPACITY - THREADS as u64 * CHUNK,
            "{held_bytes}"
        );
        drop(held);
        assert_eq!(pool.total_in_use(), 0);
    }

    #[test]
    fn a_full_pool_admits_exactly_its_capacity_across_threads() {
        // No releases: exactly capacity / chunk reservations may succeed, however they race.
        let pool = MemoryPool::new("cpu", Some(1000));
        let won: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let pool = pool.clone();
                    s.spawn(move || {
                        let mine: Vec<_> = (0..50)
                            .filter_map(|_| pool.reserve(Purpose::Kv, 10).ok())
                            .collect();
                        // Keep them until every thread is done trying.
                        (mine.len(), mine)
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(pool.total_in_use(), 1000);
            results.iter().map(|(n, _)| n).sum()
        });
        assert_eq!(won, 100);
        assert_eq!(pool.total_in_use(), 0);
    }
}
