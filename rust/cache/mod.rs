//! The conversation cache: the tiers below the device (host RAM, disk) and the moves between them.
//!
//! The device tier is the block pool's prefix cache (`kv`). When the pool evicts a cached block,
//! `ConversationCache::offload` copies it to the host tier if the RAM gate admits it, else writes
//! it to disk; the host tier's own evictions go to disk. At admission the scheduler asks `probe`
//! how much of a prompt's prefix lies below the device and, when the device can take it,
//! `onload` copies it up. Every move is optional: a refusal or failure is counted, logged in one
//! line, and the request recomputes what was not restored.

pub mod disk;
pub mod faults;
pub mod host;
pub mod mover;
pub mod ram_gate;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use mover::{ConversationCache, DevicePart};

/// Where a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    /// The routes a block takes between tiers: offloads down, then restores up.
    pub const ROUTES: [(Tier, Tier); 5] = [
        (Tier::Device, Tier::Host),
        (Tier::Device, Tier::Disk),
        (Tier::Host, Tier::Disk),
        (Tier::Host, Tier::Device),
        (Tier::Disk, Tier::Device),
    ];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// How a move ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum MoveResult {
    Ok,
    /// A gate or budget said no before anything was tried.
    Refused,
    /// An allocation, copy, write, read or checksum failed.
    Failed,
}

impl MoveResult {
    pub const ALL: [MoveResult; 3] = [MoveResult::Ok, MoveResult::Refused, MoveResult::Failed];

    pub fn name(self) -> &'static str {
        match self {
            MoveResult::Ok => "ok",
            MoveResult::Refused => "refused",
            MoveResult::Failed => "failed",
        }
    }
}

/// What refused a move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Gate {
    /// The RAM gate: not enough available memory above the floor.
    Ram,
    /// A block larger than the whole host budget.
    HostBudget,
    /// A block larger than the whole disk budget.
    DiskBudget,
    /// The device could not take an onload (blocks neither free nor evictable), or one device's
    /// memory pool refused what a move would allocate on it (its staging part).
    Device,
}

impl Gate {
    pub const ALL: [Gate; 4] = [Gate::Ram, Gate::HostBudget, Gate::DiskBudget, Gate::Device];

    pub fn name(self) -> &'static str {
        match self {
            Gate::Ram => "ram",
            Gate::HostBudget => "host_budget",
            Gate::DiskBudget => "disk_budget",
            Gate::Device => "device",
        }
    }
}

/// The cache's options; every one is an `Engine.load` keyword and a `strata-rs serve` flag.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheOptions {
    /// Host tier budget; 0 turns the tier off.
    pub host_cache_mib: usize,
    /// Memory the host tier always leaves available to the rest of the machine.
    pub host_min_free_mib: usize,
    /// Disk tier folder; `None`: the user's cache folder (`$XDG_CACHE_HOME/strata-rs/kv`, or
    /// `~/.cache/strata-rs/kv`).
    pub disk_cache_dir: Option<PathBuf>,
    /// Disk tier budget; 0 turns the tier off.
    pub disk_cache_mib: usize,
    /// Files older than this are deleted at start; 0 empties the tier at start.
    pub disk_cache_days: f64,
    /// Fault injection (`faults::Faults::parse`); empty for none.
    pub faults: String,
    /// Whenever the engine falls idle after work, the cached blocks not on disk yet are written
    /// there (as at a clean close), so that a conversation survives the process being killed:
    /// for replicas sharing a disk folder, one picks up another's conversations.
    pub disk_write_when_idle: bool,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            host_cache_mib: 4096,
            host_min_free_mib: 1024,
            disk_cache_dir: None,
            disk_cache_mib: 16384,
            disk_cache_days: 7.0,
            faults: String::new(),
            disk_write_when_idle: false,
        }
    }
}

impl CacheOptions {
    /// Checks the values a caller can get wrong, before anything is loaded.
    pub fn validate(&self) -> crate::error::Result<()> {
        let days = self.disk_cache_days;
        if days.is_nan() || days < 0.0 {
            return Err(crate::error::StrataError::invalid(
                "disk_cache_days",
                format!("must be >= 0, got {days}"),
            ));
        }
        faults::Faults::parse(&self.faults, "cache_faults").map(|_| ())
    }

    /// The disk tier's folder: the option, else the user's cache folder; `None` when neither
    /// `XDG_CACHE_HOME` nor `HOME` is set.
    pub fn disk_dir(&self) -> Option<PathBuf> {
        if let Some(d) = &self.disk_cache_dir {
            return Some(d.clone());
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("strata-rs").join("kv"))
    }
}

/// A restore as the log line reports it (and `stats()["cache"]["last_restore"]`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct RestoreRecord {
    pub tokens: usize,
    pub from_host: usize,
    pub from_disk: usize,
    pub bytes: u64,
    pub seconds: f64,
}

/// The cache's counters, published with the engine's stats after each step; `stats()["cache"]`
/// is their public shape (`engine::stats::CacheReport`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStats {
    pub host_blocks: usize,
    pub host_bytes: u64,
    pub host_budget: u64,
    pub disk_blocks: usize,
    pub disk_bytes: u64,
    pub disk_budget: u64,
    pub disk_dir: Option<String>,
    /// (from, to, result) -> blocks moved (every block is `kv_block_bytes`).
    pub moves: BTreeMap<(Tier, Tier, MoveResult), u64>,
    pub refusals: BTreeMap<Gate, u64>,
    /// Refusals by one device's memory pool (a move's staging buffer, on a GPU its copy
    /// stream), by device name ("cpu", "cpu:1", "cuda:0"); each is also under `Gate::Device`.
    pub device_refusals: BTreeMap<String, u64>,
    /// Prompt tokens restored from each tier below the device.
    pub hit_tokens_host: u64,
    pub hit_tokens_disk: u64,
    /// Disk files found bad (at the startup scan or on a read) and deleted.
    pub corrupt_files: u64,
    /// Files adopted by the startup scan, and later ones another process sharing the disk
    /// folder wrote (found when a prompt needs them, or when making room).
    pub adopted_files: u64,
    /// Faults injected by `cache_faults`, per kind: each one is also a failed or refused move.
    pub faults_injected: BTreeMap<&'static str, u64>,
    pub last_restore: Option<RestoreRecord>,
}

/// Mebibytes for log lines: two decimals below 10 MiB, so that one block does not read as 0.
pub fn mib(bytes: u64) -> String {
    let m = bytes as f64 / (1u64 << 20) as f64;
    if m < 10.0 {
        format!("{m:.2} MiB")
    } else {
        format!("{m:.0} MiB")
    }
}
