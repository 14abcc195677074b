//! The graph cache: captured decode steps, one per padded batch size, bounded in count and bytes,
//! least recently used first out, and never fatal.
//!
//! A decode step is captured per *padded* batch size (1, 2, 4, 8, ... and `max_batch` itself when
//! it is not a power of two), never per slot layout: the slot-to-row map and the block tables are
//! device buffers the graph reads, so `max_batch = 256` needs at most 9 graphs. A batch of 5 rows
//! replays the graph for 8 with 3 padding rows.
//!
//! Everything here is independent of the device: the backend that captures graphs implements
//! [`GraphBackend`] and is handed to [`GraphCache::get_or_capture`] at each step (the CUDA one,
//! `rust/device/cuda/runner/capture.rs`, borrows the device's step buffers and K/V for the capture, so
//! the cache holds only the graphs). The tests below drive the cache with a fake backend that
//! simulates a device with a fixed amount of memory.
//!
//! A graph is an optimization, so nothing here fails a step (docs/design.md, contract 1): when a graph
//! cannot be had (no room by configuration, too large for the budget, out of device memory twice,
//! any other capture failure) [`GraphCache::get_or_capture`] answers [`StepGraph::Uncaptured`] with
//! the reason, logs one line for a failure, counts it, and the caller runs the step without a
//! graph.

use std::fmt;

/// Log target of the graph cache's lines (the Python bindings turn it into a logger name).
const LOG: &str = "strata_rs.graphs";

const MIB: f64 = (1u64 << 20) as f64;

/// Why a capture failed. Out-of-memory is apart because the cache answers it by freeing graphs and
/// trying once more; any other failure is not retried.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CaptureError {
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    #[error("{0}")]
    Other(String),
}

/// What captures a decode step as a graph for one padded batch size.
///
/// A graph is freed by dropping it, not by an explicit `release` call: Rust's ownership then frees
/// every graph exactly once, including those still cached when the cache itself is dropped, and
/// no code path (an early return, an eviction) can forget one. cudarc's `CudaGraph` already
/// destroys its graph and its executable in `Drop`, so the CUDA backend needs no wrapper for it.
pub trait GraphBackend {
    type Graph;

    /// Captures (and instantiates) the decode step for `padded_batch` rows.
    fn capture(&mut self, padded_batch: usize) -> Result<Self::Graph, CaptureError>;

    /// The device bytes `graph` holds. Read once, when the graph enters the cache: the cache's
    /// byte count must not drift if the backend's answer changes later.
    fn bytes(&self, graph: &Self::Graph) -> u64;
}

/// The cache's bounds. Any of them 0 turns graphs off: every step runs uncaptured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphCacheLimits {
    /// The largest batch a step may have; the last padded size.
    pub max_batch: usize,
    /// At most this many graphs are cached.
    pub max_graphs: usize,
    /// The cached graphs hold at most this many device bytes together.
    pub max_bytes: u64,
}

/// Why a step runs without a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UncapturedReason {
    /// `max_batch`, `max_graphs` or `max_bytes` is 0.
    Disabled,
    /// The batch is 0 or larger than `max_batch`: no padded size covers it.
    BatchOutOfRange { batch: usize, max_batch: usize },
    /// The graph alone takes more than the byte budget. Remembered: steps of this padded size
    /// run uncaptured from then on.
    TooLarge { bytes: u64, max_bytes: u64 },
    /// Capture ran out of device memory, and again after freeing graphs (or with none to free).
    /// Not remembered: memory may be free at the next step.
    OutOfMemory(String),
    /// Capture failed for another reason. Remembered, like `TooLarge`.
    CaptureFailed(String),
}

impl fmt::Display for UncapturedReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UncapturedReason::Disabled => write!(f, "graphs are off (a limit is 0)"),
            UncapturedReason::BatchOutOfRange { batch, max_batch } => {
                write!(f, "batch {batch} is outside 1..={max_batch}")
            }
            UncapturedReason::TooLarge { bytes, max_bytes } => write!(
                f,
                "the graph takes {}, over the graph budget of {}",
                mib(*bytes),
                mib(*max_bytes)
            ),
            UncapturedReason::OutOfMemory(message) => write!(f, "out of device memory: {message}"),
            UncapturedReason::CaptureFailed(message) => write!(f, "capture failed: {message}"),
        }
    }
}

/// What `get_or_capture` gives the step: a graph to replay, or the reason to run without one.
#[derive(Debug)]
pub enum StepGraph<'a, G> {
    Replay(&'a G),
    Uncaptured(UncapturedReason),
}

/// Counters of the graph cache. `graphs` and `bytes` are the present contents; the rest count
/// events since the cache was made. Serialized as `stats()["graphs"]` (rust/engine/stats.rs).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphCacheStats {
    /// Graphs cached now.
    pub graphs: usize,
    /// Device bytes the cached graphs hold now.
    pub bytes: u64,
    /// Successful captures, whether the graph was then kept or was too large.
    pub captures: u64,
    /// Steps that found their graph cached.
    pub hits: u64,
    /// Graphs the cache freed: to stay within its bounds, or to make room after an out-of-memory
    /// capture.
    pub evictions: u64,
    /// Second captures made after an out-of-memory capture freed graphs (whatever their outcome).
    pub oom_retries: u64,
    /// Steps that ran uncaptured because capture ran out of memory (after the retry, if any).
    pub oom_fallbacks: u64,
    /// Captures that failed with an error other than out-of-memory.
    pub capture_failures: u64,
    /// Graphs dropped because alone they take more than the byte budget.
    pub oversize: u64,
}

/// The padded size whose graph runs `batch` rows: the next power of two, or `max_batch` when that
/// is smaller. None when `batch` is 0 or larger than `max_batch`.
pub fn padded_batch(batch: usize, max_batch: usize) -> Option<usize> {
    if batch == 0 || batch > max_batch {
        return None;
    }
    // No power of two above `batch` fits in a usize only when batch > usize::MAX / 2, and then
    // max_batch (>= batch) is the padded size anyway.
    let power = batch.checked_next_power_of_two().unwrap_or(max_batch);
    Some(power.min(max_batch))
}

/// Every padded size for `max_batch`, smallest first: the graphs a full cache would hold.
pub fn padded_sizes(max_batch: usize) -> Vec<usize> {
    let mut sizes = Vec::new();
    let mut size = 1usize;
    while size < max_batch {
        sizes.push(size);
        match size.checked_mul(2) {
            Some(next) => size = next,
            None => break,
        }
    }
    if max_batch > 0 {
        sizes.push(max_batch);
    }
    sizes
}

struct CachedGraph<G> {
    padded: usize,
    bytes: u64,
    graph: G,
}

/// Cached graphs of type `G`; the backend that captures them is lent to each
/// [`GraphCache::get_or_capture`] call.
pub struct GraphCache<G> {
    limits: GraphCacheLimits,
    /// Least recently used first. A Vec, not a map: it holds O(log max_batch) graphs, so a linear
    /// search is as fast as a map and the order is plain to see.
    entries: Vec<CachedGraph<G>>,
    /// Sum of `entries[..].bytes`.
    bytes: u64,
    /// Padded sizes that will not get a graph (too large, or a capture failure that is not
    /// out-of-memory), with the reason. Trying again each step would pay a capture and log a line
    /// per step for the same outcome.
    refused: Vec<(usize, UncapturedReason)>,
    stats: GraphCacheStats,
}

impl<G> GraphCache<G> {
    pub fn new(limits: GraphCacheLimits) -> GraphCache<G> {
        GraphCache {
            limits,
            entries: Vec::new(),
            bytes: 0,
            refused: Vec::new(),
            stats: GraphCacheStats::default(),
        }
    }

    pub fn limits(&self) -> GraphCacheLimits {
        self.limits
    }

    /// The padded size whose graph runs `batch` rows (see [`padded_batch`]).
    pub fn padded(&self, batch: usize) -> Option<usize> {
        padded_batch(batch, self.limits.max_batch)
    }

    /// The padded sizes cached now, least recently used first.
    pub fn cached_sizes(&self) -> Vec<usize> {
        self.entries.iter().map(|e| e.padded).collect()
    }

    pub fn stats(&self) -> GraphCacheStats {
        GraphCacheStats {
            graphs: self.entries.len(),
            bytes: self.bytes,
            ..self.stats.clone()
        }
    }

    /// The graph for `padded(batch)`: cached (now the most recently used), or captured now by
    /// `backend`, or the reason the step runs without one. Never an error, never a panic.
    pub fn get_or_capture<B: GraphBackend<Graph = G>>(
        &mut self,
        batch: usize,
        backend: &mut B,
    ) -> StepGraph<'_, G> {
        let limits = self.limits;
        if limits.max_batch == 0 || limits.max_graphs == 0 || limits.max_bytes == 0 {
            return StepGraph::Uncaptured(UncapturedReason::Disabled);
        }
        let Some(padded) = self.padded(batch) else {
            return StepGraph::Uncaptured(UncapturedReason::BatchOutOfRange {
                batch,
                max_batch: limits.max_batch,
            });
        };
        if let Some(i) = self.entries.iter().position(|e| e.padded == padded) {
            self.stats.hits += 1;
            let entry = self.entries.remove(i);
            return StepGraph::Replay(self.push_most_recent(entry));
        }
        if let Some((_, reason)) = self.refused.iter().find(|(size, _)| *size == padded) {
            return StepGraph::Uncaptured(reason.clone());
        }
        match self.capture(batch, padded, backend) {
            Ok(entry) => {
                self.bytes += entry.bytes;
                StepGraph::Replay(self.push_most_recent(entry))
            }
            Err(reason) => StepGraph::Uncaptured(reason),
        }
    }

    /// Captures the graph for `padded` and makes room for it; the caller inserts it. On failure,
    /// logs and counts it and returns the reason.
    fn capture<B: GraphBackend<Graph = G>>(
        &mut self,
        batch: usize,
        padded: usize,
        backend: &mut B,
    ) -> Result<CachedGraph<G>, UncapturedReason> {
        // Room by count first, so that the evicted graph's memory is free before capture needs
        // memory. If the capture then fails, that graph went for nothing: a rare cost, since a
        // too-large graph or a non-OOM failure is refused for good (once per size), and after an
        // out-of-memory capture the cache frees graphs anyway.
        while self.entries.len() >= self.limits.max_graphs {
            self.evict_lru();
        }

        let graph = match backend.capture(padded) {
            Ok(graph) => graph,
            Err(CaptureError::OutOfMemory(first)) => {
                self.retry_after_oom(batch, padded, first, backend)?
            }
            Err(CaptureError::Other(message)) => {
                return Err(self.capture_failed(batch, padded, message))
            }
        };
        self.stats.captures += 1;

        let bytes = backend.bytes(&graph);
        let max_bytes = self.limits.max_bytes;
        if bytes > max_bytes {
            drop(graph);
            self.stats.oversize += 1;
            log::warn!(
                target: LOG,
                "batch {batch}: the decode graph for {padded} rows takes {}, over the graph budget of {}; steps of {padded} rows run uncaptured from now on",
                mib(bytes),
                mib(max_bytes)
            );
            let reason = UncapturedReason::TooLarge { bytes, max_bytes };
            self.refused.push((padded, reason.clone()));
            return Err(reason);
        }
        // `self.bytes <= max_bytes` always holds, so the subtraction is exact; written so that a
        // budget near u64::MAX cannot overflow an addition.
        while bytes > max_bytes.saturating_sub(self.bytes) && !self.entries.is_empty() {
            self.evict_lru();
        }
        Ok(CachedGraph {
            padded,
            bytes,
            graph,
        })
    }

    /// After an out-of-memory capture: frees the least recently used half of the cached graphs
    /// (rounded up, so a single graph is freed too) and captures once more. The graph being
    /// captured is not among them: a miss means it is not cached. With nothing to free, a retry
    /// would meet the same memory, so there is none.
    fn retry_after_oom<B: GraphBackend<Graph = G>>(
        &mut self,
        batch: usize,
        padded: usize,
        first: String,
        backend: &mut B,
    ) -> Result<G, UncapturedReason> {
        let to_free = self.entries.len().div_ceil(2);
        if to_free == 0 {
            return Err(self.oom_fallback(batch, padded, first, "with no graphs cached to free"));
        }
        let mut freed_bytes = 0;
        for _ in 0..to_free {
            freed_bytes += self.evict_lru();
        }
        self.stats.oom_retries += 1;
        match backend.capture(padded) {
            Ok(graph) => Ok(graph),
            Err(CaptureError::OutOfMemory(again)) => {
                let after = format!("after freeing {to_free} graph(s), {}", mib(freed_bytes));
                Err(self.oom_fallback(batch, padded, again, &after))
            }
            Err(CaptureError::Other(message)) => Err(self.capture_failed(batch, padded, message)),
        }
    }

    fn oom_fallback(
        &mut self,
        batch: usize,
        padded: usize,
        message: String,
        after: &str,
    ) -> UncapturedReason {
        self.stats.oom_fallbacks += 1;
        log::warn!(
            target: LOG,
            "batch {batch}: capturing the decode graph for {padded} rows ran out of device memory {after} ({message}); the step runs uncaptured (graph cache: {} graphs, {})",
            self.entries.len(),
            mib(self.bytes)
        );
        UncapturedReason::OutOfMemory(message)
    }

    fn capture_failed(&mut self, batch: usize, padded: usize, message: String) -> UncapturedReason {
        self.stats.capture_failures += 1;
        log::warn!(
            target: LOG,
            "batch {batch}: capturing the decode graph for {padded} rows failed ({message}); steps of {padded} rows run uncaptured from now on (graph cache: {} graphs, {})",
            self.entries.len(),
            mib(self.bytes)
        );
        let reason = UncapturedReason::CaptureFailed(message);
        self.refused.push((padded, reason.clone()));
        reason
    }

    /// Frees the least recently used graph (dropping it frees its device memory); returns its
    /// bytes, 0 when the cache is empty.
    fn evict_lru(&mut self) -> u64 {
        if self.entries.is_empty() {
            return 0;
        }
        let entry = self.entries.remove(0);
        self.bytes -= entry.bytes;
        self.stats.evictions += 1;
        entry.bytes
    }

    /// Puts `entry` last (most recently used) and returns its graph. Byte accounting is the
    /// caller's: a hit moves an entry, a capture adds one.
    fn push_most_recent(&mut self, entry: CachedGraph<G>) -> &G {
        self.entries.push(entry);
        let last = self.entries.len() - 1;
        &self.entries[last].graph
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::cpu::test_rng::Rng;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// A device with `capacity` bytes of memory for graphs. It records which graphs are alive,
    /// so a test can compare it with what the cache believes it holds.
    struct FakeDevice {
        capacity: u64,
        live_bytes: u64,
        /// Ids of the graphs not yet dropped.
        live: Vec<u64>,
        next_id: u64,
        /// Capture attempts so far, failed ones included.
        attempts: u64,
        successes: u64,
        /// (attempt number counting from 1, the error that attempt returns).
        fail_attempts: Vec<(u64, CaptureError)>,
        /// Padded sizes of the dropped graphs, in the order they were dropped.
        freed: Vec<usize>,
    }

    struct FakeBackend {
        device: Rc<RefCell<FakeDevice>>,
        bytes_of: fn(usize) -> u64,
    }

    struct FakeGraph {
        id: u64,
        padded: usize,
        bytes: u64,
        device: Rc<RefCell<FakeDevice>>,
    }

    impl Drop for FakeGraph {
        fn drop(&mut self) {
            let mut device = self.device.borrow_mut();
            let Some(i) = device.live.iter().position(|id| *id == self.id) else {
                panic!("graph {} freed twice", self.id);
            };
            device.live.remove(i);
            device.live_bytes -= self.bytes;
            device.freed.push(self.padded);
        }
    }

    impl GraphBackend for FakeBackend {
        type Graph = FakeGraph;

        fn capture(&mut self, padded_batch: usize) -> Result<FakeGraph, CaptureError> {
            let mut device = self.device.borrow_mut();
            device.attempts += 1;
            let attempt = device.attempts;
            if let Some((_, error)) = device.fail_attempts.iter().find(|(n, _)| *n == attempt) {
                return Err(error.clone());
            }
            let bytes = (self.bytes_of)(padded_batch);
            let free = device.capacity - device.live_bytes;
            if bytes > free {
                return Err(CaptureError::OutOfMemory(format!(
                    "{bytes} bytes wanted, {free} free"
                )));
            }
            device.successes += 1;
            device.live_bytes += bytes;
            let id = device.next_id;
            device.next_id += 1;
            device.live.push(id);
            Ok(FakeGraph {
                id,
                padded: padded_batch,
                bytes,
                device: Rc::clone(&self.device),
            })
        }

        fn bytes(&self, graph: &FakeGraph) -> u64 {
            graph.bytes
        }
    }

    /// 1000 bytes per padded row.
    fn thousand_per_row(padded: usize) -> u64 {
        padded as u64 * 1000
    }

    fn fake_cache(
        limits: GraphCacheLimits,
        capacity: u64,
        bytes_of: fn(usize) -> u64,
    ) -> (Fixture, Rc<RefCell<FakeDevice>>) {
        let device = Rc::new(RefCell::new(FakeDevice {
            capacity,
            live_bytes: 0,
            live: Vec::new(),
            next_id: 0,
            attempts: 0,
            successes: 0,
            fail_attempts: Vec::new(),
            freed: Vec::new(),
        }));
        let backend = FakeBackend {
            device: Rc::clone(&device),
            bytes_of,
        };
        (
            Fixture {
                cache: GraphCache::new(limits),
                backend,
            },
            device,
        )
    }

    /// The cache and the backend every step hands it, as the CUDA runner pairs them.
    struct Fixture {
        cache: GraphCache<FakeGraph>,
        backend: FakeBackend,
    }

    impl Fixture {
        fn get_or_capture(&mut self, batch: usize) -> StepGraph<'_, FakeGraph> {
            self.cache.get_or_capture(batch, &mut self.backend)
        }
    }

    impl std::ops::Deref for Fixture {
        type Target = GraphCache<FakeGraph>;
        fn deref(&self) -> &Self::Target {
            &self.cache
        }
    }

    fn limits(max_batch: usize, max_graphs: usize, max_bytes: u64) -> GraphCacheLimits {
        GraphCacheLimits {
            max_batch,
            max_graphs,
            max_bytes,
        }
    }

    /// The padded size of the graph `get_or_capture` returned, or the reason there is none.
    fn step(cache: &mut Fixture, batch: usize) -> Result<usize, UncapturedReason> {
        match cache.get_or_capture(batch) {
            StepGraph::Replay(graph) => Ok(graph.padded),
            StepGraph::Uncaptured(reason) => Err(reason),
        }
    }

    /// The cache's books agree with the fake device: no leak, no graph counted twice.
    fn assert_consistent(cache: &Fixture, device: &Rc<RefCell<FakeDevice>>) {
        let stats = cache.stats();
        let device = device.borrow();
        assert_eq!(device.live_bytes, stats.bytes);
        assert_eq!(device.live.len(), stats.graphs);
        let summed: u64 = cache.entries.iter().map(|e| e.bytes).sum();
        assert_eq!(summed, stats.bytes);
        assert!(stats.graphs <= cache.limits.max_graphs);
        assert!(stats.bytes <= cache.limits.max_bytes);
    }

    #[test]
    fn padded_sizes_are_powers_of_two_then_max_batch() {
        let table = |max_batch: usize| -> Vec<Option<usize>> {
            (0..=max_batch + 1)
                .map(|b| padded_batch(b, max_batch))
                .collect()
        };
        assert_eq!(table(1), [None, Some(1), None]);
        let s = Some;
        assert_eq!(
            table(8),
            [None, s(1), s(2), s(4), s(4), s(8), s(8), s(8), s(8), None]
        );
        assert_eq!(
            table(12),
            [
                None,
                s(1),
                s(2),
                s(4),
                s(4),
                s(8),
                s(8),
                s(8),
                s(8),
                s(12),
                s(12),
                s(12),
                s(12),
                None
            ]
        );
        assert_eq!(padded_batch(5, 8), Some(8));
        assert_eq!(padded_batch(9, 12), Some(12));
        assert_eq!(padded_batch(16, 32), Some(16));
        assert_eq!(padded_batch(17, 32), Some(32));
        assert_eq!(padded_batch(32, 32), Some(32));
        assert_eq!(padded_batch(33, 32), None);
        assert_eq!(padded_batch(1, 0), None);
        assert_eq!(padded_batch(usize::MAX, usize::MAX), Some(usize::MAX));
        assert_eq!(
            padded_batch((1 << 63) + 1, usize::MAX),
            Some(usize::MAX),
            "no power of two above it fits a usize"
        );

        assert_eq!(padded_sizes(0), Vec::<usize>::new());
        assert_eq!(padded_sizes(1), [1]);
        assert_eq!(padded_sizes(8), [1, 2, 4, 8]);
        assert_eq!(padded_sizes(12), [1, 2, 4, 8, 12]);
        assert_eq!(padded_sizes(32), [1, 2, 4, 8, 16, 32]);
        assert_eq!(padded_sizes(usize::MAX).len(), 65);

        // max_batch 256: 9 graphs at most, and padded_sizes lists exactly the sizes batches use.
        let mut used: Vec<usize> = (1..=256).filter_map(|b| padded_batch(b, 256)).collect();
        used.dedup();
        assert_eq!(used, [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        assert_eq!(padded_sizes(256), used);
        for max_batch in [1, 8, 12, 32, 100] {
            let mut used: Vec<usize> = (1..=max_batch)
                .filter_map(|b| padded_batch(b, max_batch))
                .collect();
            used.dedup();
            assert_eq!(padded_sizes(max_batch), used, "max_batch {max_batch}");
        }
    }

    #[test]
    fn zero_limits_run_everything_uncaptured() {
        for l in [
            limits(0, 4, 1 << 20),
            limits(8, 0, 1 << 20),
            limits(8, 4, 0),
        ] {
            let (mut cache, device) = fake_cache(l, 1 << 30, thousand_per_row);
            for batch in [0, 1, 3, 8, 9, usize::MAX] {
                assert_eq!(step(&mut cache, batch), Err(UncapturedReason::Disabled));
            }
            assert_eq!(device.borrow().attempts, 0);
            assert_eq!(cache.stats(), GraphCacheStats::default());
        }
    }

    #[test]
    fn batch_out_of_range_runs_uncaptured() {
        let (mut cache, device) = fake_cache(limits(8, 4, 1 << 20), 1 << 30, thousand_per_row);
        assert_eq!(
            step(&mut cache, 0),
            Err(UncapturedReason::BatchOutOfRange {
                batch: 0,
                max_batch: 8
            })
        );
        assert_eq!(
            step(&mut cache, 9),
            Err(UncapturedReason::BatchOutOfRange {
                batch: 9,
                max_batch: 8
            })
        );
        assert_eq!(device.borrow().attempts, 0);
        assert_eq!(cache.stats(), GraphCacheStats::default());
    }

    #[test]
    fn a_hit_replays_the_same_graph() {
        let (mut cache, device) = fake_cache(limits(8, 4, 1 << 20), 1 << 30, thousand_per_row);
        let first_id = match cache.get_or_capture(3) {
            StepGraph::Replay(g) => (g.id, g.padded),
            StepGraph::Uncaptured(reason) => panic!("{reason}"),
        };
        let second_id = match cache.get_or_capture(4) {
            StepGraph::Replay(g) => (g.id, g.padded),
            StepGraph::Uncaptured(reason) => panic!("{reason}"),
        };
        assert_eq!(first_id, (0, 4));
        assert_eq!(second_id, (0, 4));
        assert_eq!(device.borrow().attempts, 1);
        let stats = cache.stats();
        assert_eq!(
            stats,
            GraphCacheStats {
                graphs: 1,
                bytes: 4000,
                captures: 1,
                hits: 1,
                ..GraphCacheStats::default()
            }
        );
        assert_consistent(&cache, &device);
    }

    #[test]
    fn a_hit_refreshes_recency_and_the_lru_graph_goes_first() {
        let (mut cache, device) = fake_cache(limits(64, 3, 1 << 20), 1 << 30, thousand_per_row);
        assert_eq!(step(&mut cache, 1), Ok(1));
        assert_eq!(step(&mut cache, 2), Ok(2));
        assert_eq!(step(&mut cache, 4), Ok(4));
        assert_eq!(cache.cached_sizes(), [1, 2, 4]);
        // A hit on 1 makes 2 the least recently used.
        assert_eq!(step(&mut cache, 1), Ok(1));
        assert_eq!(cache.cached_sizes(), [2, 4, 1]);
        assert_eq!(step(&mut cache, 8), Ok(8));
        assert_eq!(device.borrow().freed, [2]);
        assert_eq!(cache.cached_sizes(), [4, 1, 8]);
        // Then 4, then 1.
        assert_eq!(step(&mut cache, 16), Ok(16));
        assert_eq!(step(&mut cache, 32), Ok(32));
        assert_eq!(device.borrow().freed, [2, 4, 1]);
        assert_eq!(cache.cached_sizes(), [8, 16, 32]);
        let stats = cache.stats();
        assert_eq!((stats.captures, stats.hits, stats.evictions), (6, 1, 3));
        assert_consistent(&cache, &device);
    }

    #[test]
    fn the_byte_budget_evicts_as_many_lru_graphs_as_needed() {
        // 10 graphs allowed by count; 15000 bytes by budget.
        let (mut cache, device) = fake_cache(limits(16, 10, 15_000), 1 << 30, thousand_per_row);
        for batch in [1, 2, 4] {
            step(&mut cache, batch).unwrap();
        }
        assert_eq!(cache.stats().bytes, 7000);
        // 8000 more would make 15000: fits exactly, nothing evicted.
        assert_eq!(step(&mut cache, 8), Ok(8));
        assert_eq!(cache.stats().bytes, 15_000);
        assert_eq!(device.borrow().freed, Vec::<usize>::new());
        // 16000 alone is over 15000: too large, not kept, nothing evicted for it.
        assert_eq!(
            step(&mut cache, 16),
            Err(UncapturedReason::TooLarge {
                bytes: 16_000,
                max_bytes: 15_000
            })
        );
        assert_eq!(device.borrow().freed, [16]);
        assert_eq!(cache.cached_sizes(), [1, 2, 4, 8]);
        assert_consistent(&cache, &device);

        // max_batch 12, 20000-byte budget: 9 rows pad to 12, 12000 bytes, beside 15000 cached.
        // Freeing 1, 2 and 4 (LRU first) leaves 8000, and 8000 + 12000 fits: 8 stays.
        let (mut cache, device) = fake_cache(limits(12, 10, 20_000), 1 << 30, thousand_per_row);
        for batch in [1, 2, 4, 8] {
            step(&mut cache, batch).unwrap();
        }
        assert_eq!(cache.stats().bytes, 15_000);
        assert_eq!(step(&mut cache, 9), Ok(12));
        assert_eq!(device.borrow().freed, [1, 2, 4]);
        assert_eq!(cache.cached_sizes(), [8, 12]);
        assert_eq!(cache.stats().bytes, 20_000);
        assert_eq!(cache.stats().evictions, 3);
        assert_consistent(&cache, &device);
    }

    #[test]
    fn an_oversize_graph_is_refused_once_and_not_captured_again() {
        let (mut cache, device) = fake_cache(limits(8, 4, 5000), 1 << 30, thousand_per_row);
        assert_eq!(step(&mut cache, 2), Ok(2));
        let too_large = UncapturedReason::TooLarge {
            bytes: 8000,
            max_bytes: 5000,
        };
        assert_eq!(step(&mut cache, 5), Err(too_large.clone()));
        assert_eq!(step(&mut cache, 8), Err(too_large));
        assert_eq!(
            device.borrow().attempts,
            2,
            "the second 8-row step captured again"
        );
        assert_eq!(device.borrow().freed, [8]);
        let stats = cache.stats();
        assert_eq!(
            stats,
            GraphCacheStats {
                graphs: 1,
                bytes: 2000,
                captures: 2,
                oversize: 1,
                ..GraphCacheStats::default()
            }
        );
        assert_consistent(&cache, &device);
    }

    /// A cache holding graphs for 1, 2, 4 and 8 (15000 bytes), with recency 2, 4, 8, 1 (a hit on
    /// 1), on a device of `capacity` bytes.
    fn four_graphs(capacity: u64) -> (Fixture, Rc<RefCell<FakeDevice>>) {
        let (mut cache, device) = fake_cache(limits(64, 8, 1 << 20), capacity, thousand_per_row);
        for batch in [1, 2, 4, 8, 1] {
            step(&mut cache, batch).unwrap();
        }
        assert_eq!(cache.cached_sizes(), [2, 4, 8, 1]);
        (cache, device)
    }

    #[test]
    fn oom_frees_the_lru_half_and_the_retry_succeeds() {
        // 15000 live + 16000 for the new graph > 25000: OOM. Freeing 2 and 4 (6000) leaves 9000
        // live, and 9000 + 16000 fits.
        let (mut cache, device) = four_graphs(25_000);
        assert_eq!(step(&mut cache, 16), Ok(16));
        assert_eq!(device.borrow().freed, [2, 4]);
        assert_eq!(cache.cached_sizes(), [8, 1, 16]);
        assert_eq!(device.borrow().attempts, 6);
        let stats = cache.stats();
        assert_eq!(
            stats,
            GraphCacheStats {
                graphs: 3,
                bytes: 25_000,
                captures: 5,
                hits: 1,
                evictions: 2,
                oom_retries: 1,
                ..GraphCacheStats::default()
            }
        );
        // The graph just captured is the one cached and replayed.
        let (id, padded) = match cache.get_or_capture(16) {
            StepGraph::Replay(g) => (g.id, g.padded),
            StepGraph::Uncaptured(reason) => panic!("{reason}"),
        };
        assert_eq!((id, padded), (4, 16));
        assert!(device.borrow().live.contains(&4));
        assert_consistent(&cache, &device);
    }

    #[test]
    fn oom_twice_runs_uncaptured_and_keeps_the_books() {
        // 16000 never fits beside the graphs the half-free leaves (9000): OOM again.
        let (mut cache, device) = four_graphs(20_000);
        let Err(UncapturedReason::OutOfMemory(message)) = step(&mut cache, 16) else {
            panic!("expected out of memory");
        };
        assert_eq!(message, "16000 bytes wanted, 11000 free");
        assert_eq!(device.borrow().freed, [2, 4]);
        assert_eq!(cache.cached_sizes(), [8, 1]);
        let stats = cache.stats();
        assert_eq!(
            stats,
            GraphCacheStats {
                graphs: 2,
                bytes: 9000,
                captures: 4,
                hits: 1,
                evictions: 2,
                oom_retries: 1,
                oom_fallbacks: 1,
                ..GraphCacheStats::default()
            }
        );
        assert_consistent(&cache, &device);
        // Out of memory is not remembered: the next 16-row step tries again, frees the LRU half
        // of what is left (8; 1 of 2 graphs), and now 1000 + 16000 fits.
        assert_eq!(step(&mut cache, 16), Ok(16));
        assert_eq!(device.borrow().freed, [2, 4, 8]);
        assert_eq!(cache.cached_sizes(), [1, 16]);
        assert_eq!(cache.stats().oom_retries, 2);
        assert_eq!(cache.stats().oom_fallbacks, 1);
        assert_consistent(&cache, &device);
    }

    #[test]
    fn oom_with_nothing_cached_falls_back_without_a_retry() {
        let (mut cache, device) = fake_cache(limits(8, 4, 1 << 20), 3000, thousand_per_row);
        assert_eq!(
            step(&mut cache, 8),
            Err(UncapturedReason::OutOfMemory(
                "8000 bytes wanted, 3000 free".into()
            ))
        );
        assert_eq!(device.borrow().attempts, 1);
        let stats = cache.stats();
        assert_eq!((stats.oom_retries, stats.oom_fallbacks), (0, 1));
        // A size that fits still gets its graph.
        assert_eq!(step(&mut cache, 2), Ok(2));
        assert_consistent(&cache, &device);
    }

    #[test]
    fn oom_frees_half_rounded_up() {
        // Three cached graphs (1, 2, 4; 7000 bytes) and 8000 more do not fit in 12000: half
        // rounded up is 2 graphs, which leaves 4000, and 4000 + 8000 fits.
        let (mut cache, device) = fake_cache(limits(64, 8, 1 << 20), 12_000, thousand_per_row);
        for batch in [1, 2, 4] {
            step(&mut cache, batch).unwrap();
        }
        assert_eq!(step(&mut cache, 8), Ok(8));
        assert_eq!(device.borrow().freed, [1, 2]);
        assert_eq!(cache.cached_sizes(), [4, 8]);
        // One cached graph (4000 + 8000 > 10000): it is freed.
        let (mut cache, device) = fake_cache(limits(64, 8, 1 << 20), 10_000, thousand_per_row);
        step(&mut cache, 4).unwrap();
        assert_eq!(step(&mut cache, 8), Ok(8));
        assert_eq!(device.borrow().freed, [4]);
        assert_consistent(&cache, &device);
    }

    #[test]
    fn a_non_oom_failure_runs_uncaptured_and_is_not_retried() {
        let (mut cache, device) = fake_cache(limits(8, 4, 1 << 20), 1 << 30, thousand_per_row);
        let failure = CaptureError::Other("stream capture invalidated".into());
        device.borrow_mut().fail_attempts.push((2, failure));
        assert_eq!(step(&mut cache, 1), Ok(1));
        let refused = Err(UncapturedReason::CaptureFailed(
            "stream capture invalidated".into(),
        ));
        assert_eq!(step(&mut cache, 2), refused);
        assert_eq!(step(&mut cache, 2), refused);
        assert_eq!(device.borrow().attempts, 2);
        // Other sizes still capture.
        assert_eq!(step(&mut cache, 4), Ok(4));
        let stats = cache.stats();
        assert_eq!(
            stats,
            GraphCacheStats {
                graphs: 2,
                bytes: 5000,
                captures: 2,
                capture_failures: 1,
                ..GraphCacheStats::default()
            }
        );
        assert_consistent(&cache, &device);
    }

    #[test]
    fn a_retry_that_fails_otherwise_counts_as_a_capture_failure() {
        let (mut cache, device) = four_graphs(25_000);
        // Attempt 6 is the retry of the 16-row capture.
        let failure = CaptureError::Other("instantiate failed".into());
        device.borrow_mut().fail_attempts.push((6, failure));
        assert_eq!(
            step(&mut cache, 16),
            Err(UncapturedReason::CaptureFailed("instantiate failed".into()))
        );
        let stats = cache.stats();
        assert_eq!(
            (
                stats.oom_retries,
                stats.oom_fallbacks,
                stats.capture_failures
            ),
            (1, 0, 1)
        );
        assert_eq!(cache.cached_sizes(), [8, 1]);
        assert_consistent(&cache, &device);
    }

    #[test]
    fn dropping_the_cache_frees_every_graph() {
        let (mut cache, device) = fake_cache(limits(8, 4, 1 << 20), 1 << 30, thousand_per_row);
        for batch in [1, 2, 4, 8] {
            step(&mut cache, batch).unwrap();
        }
        assert_eq!(device.borrow().live.len(), 4);
        drop(cache);
        assert_eq!(device.borrow().live_bytes, 0);
        assert_eq!(device.borrow().live.len(), 0);
    }

    #[test]
    fn ten_thousand_random_batches_keep_the_bounds_and_the_books() {
        // max_batch 200: padded sizes 1..128 and 200. A graph takes 1000 bytes per padded row
        // plus 3000, so 200 (203000 bytes) is over the 150000 budget. The device holds 215000
        // bytes: a large graph beside a well-filled cache runs out of memory, and 200 can only be
        // captured (then refused as too large) when the cache holds 12000 bytes or less.
        fn bytes_of(padded: usize) -> u64 {
            padded as u64 * 1000 + 3000
        }
        let l = limits(200, 5, 150_000);
        let (mut cache, device) = fake_cache(l, 215_000, bytes_of);
        // Two captures fail otherwise: their sizes are refused for good.
        device.borrow_mut().fail_attempts.extend([
            (40, CaptureError::Other("a".into())),
            (41, CaptureError::Other("b".into())),
        ]);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut replays, mut uncaptured) = (0u64, 0u64);
        for _ in 0..10_000 {
            // Log-uniform-ish sizes in 0..=256, so that small and large padded sizes both come
            // up, and 0 and 201..=256 are out of range.
            let ceiling = 1usize << rng.below(9);
            let batch = rng.below(ceiling + 1);
            let hits_before = cache.stats().hits;
            let expected = cache.padded(batch);
            match cache.get_or_capture(batch) {
                StepGraph::Replay(graph) => {
                    replays += 1;
                    assert_eq!(Some(graph.padded), expected, "batch {batch}");
                    assert!(device.borrow().live.contains(&graph.id));
                }
                StepGraph::Uncaptured(reason) => {
                    uncaptured += 1;
                    if expected.is_none() {
                        assert_eq!(
                            reason,
                            UncapturedReason::BatchOutOfRange {
                                batch,
                                max_batch: 200
                            }
                        );
                    }
                    assert_eq!(cache.stats().hits, hits_before, "a hit must replay");
                }
            }
            assert_consistent(&cache, &device);
        }
        let stats = cache.stats();
        let device = device.borrow();
        assert_eq!(replays + uncaptured, 10_000);
        // Every successful capture is cached now, or was evicted, or was too large.
        assert_eq!(device.successes, stats.captures);
        assert_eq!(
            stats.captures,
            stats.graphs as u64 + stats.evictions + stats.oversize
        );
        // A replay is a hit or a capture that was kept.
        assert_eq!(
            replays,
            stats.hits + stats.captures - stats.oversize,
            "{stats:?}"
        );
        assert_eq!(stats.oversize, 1, "200 is refused after its first capture");
        assert_eq!(stats.capture_failures, 2);
        // Every path ran.
        assert!(stats.evictions > 0, "{stats:?}");
        assert!(stats.oom_retries > 0, "{stats:?}");
        assert!(stats.oom_fallbacks > 0, "{stats:?}");
        assert!(stats.hits > 5_000, "{stats:?}");
    }
}
