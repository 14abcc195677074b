//! ConversationCache: the host and disk tiers and every move between them and the device.
//!
//! Moves run on the engine thread, between steps, synchronously: on the CPU backend a block copy
//! is a memcpy, and an onload must finish before the prefill that follows it anyway.

use std::time::Instant;

use super::disk::{BlockLayout, DiskError, DiskOptions, DiskTier};
use super::faults::{FaultKind, Faults};
use super::host::HostTier;
use super::{mib, CacheOptions, CacheStats, Gate, MoveResult, RestoreRecord, Tier};
use crate::cache::ram_gate::{RamGate, RamRefusal};
use crate::device::memory_pool::{MemoryPool, PoolRefusal, Purpose, Reservation};
use crate::error::Result;
use crate::kv::blocks::BlockPool;
use crate::kv::prefix::Evicted;

const LOG: &str = "strata_rs.cache";

/// One device of the split as the mover sees it: its pool and its part of a block.
#[derive(Clone, Debug)]
pub struct DevicePart {
    pub memory: MemoryPool,
    /// Bytes of one block's K/V that live on this device (`BlockPool::part_bytes`).
    pub bytes: usize,
}

#[derive(Debug)]
struct StagingPart {
    device: DevicePart,
    /// This device's part of the staging buffer, once reserved (on first use; kept for the
    /// engine's life, as the buffer is).
    reservation: Option<Reservation>,
}

/// A device whose pool refused what a move would allocate on it.
struct DeviceRefusal {
    device: String,
    refusal: PoolRefusal,
}

pub struct ConversationCache {
    host: HostTier,
    disk: Option<DiskTier>,
    gate: RamGate,
    faults: Faults,
    block_size: usize,
    block_bytes: usize,
    /// One block: staging for device -> disk writes and disk -> device reads, allocated once.
    scratch: Vec<u8>,
    /// The devices of the layer split, in layer order, in whose pools the staging buffer is
    /// accounted: each for its part of a block (its layers), since each device's copy passes
    /// through its own part. The host tier is not accounted there: its bytes are the cache's own
    /// (`stats.host_bytes`), under its budget and the RAM gate.
    devices: Vec<StagingPart>,
    /// The buffer of the last block the host tier let go, reused by the next offload: once the
    /// host tier is full, an offload allocates nothing.
    spare: Option<Box<[u8]>>,
    /// Files the disk tier's startup scan adopted (`stats.adopted_files` adds those adopted
    /// later, written by another process sharing the folder).
    scan_adopted: u64,
    write_when_idle: bool,
    stats: CacheStats,
}

fn seconds_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

fn rate(bytes: u64, seconds: f64) -> String {
    format!("{:.1} GB/s", bytes as f64 / seconds.max(1e-9) / 1e9)
}

/// A block-sized buffer, or why the allocator refused it (never an abort).
fn zeroed_block(bytes: usize) -> std::result::Result<Vec<u8>, String> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(bytes)
        .map_err(|e| format!("allocation failed: {e}"))?;
    prefault(&mut buf);
    buf.resize(bytes, 0);
    Ok(buf)
}

/// Maps the pages of `buf`'s fresh capacity in one call. A block is larger than malloc's mmap
/// threshold, so its pages are new, and faulting them in one by one as they are first written
/// cost several times the copy itself (docs/benchmarks.md, "Figures behind code comments").
/// Best effort: kernels before 5.14 refuse the advice and the pages fault in as before.
fn prefault(buf: &mut Vec<u8>) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = buf.as_mut_ptr() as usize;
        let first = start.next_multiple_of(PAGE);
        let end = (start + buf.capacity()) / PAGE * PAGE;
        if end > first {
            // SAFETY: [first, end) lies inside `buf`'s allocation; the advice only maps pages
            // (zero-filled), it never changes what the program can observe.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    end - first,
                    libc::MADV_POPULATE_WRITE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

impl ConversationCache {
    /// Opens the tiers. A disk folder that cannot be opened leaves the disk tier off (logged);
    /// only bad option values are errors.
    pub fn new(
        opts: &CacheOptions,
        layout: BlockLayout,
        gate: RamGate,
        devices: Vec<DevicePart>,
    ) -> Result<Self> {
        opts.validate()?;
        let faults = Faults::parse(&opts.faults, "cache_faults")?;
        let block_bytes = layout.block_bytes as usize;
        let mut stats = CacheStats::default();
        let disk = match (opts.disk_cache_mib, opts.disk_dir()) {
            (0, _) => None,
            (_, None) => {
                log::warn!(target: LOG, "disk tier off: no disk_cache_dir, and neither XDG_CACHE_HOME nor HOME is set");
                None
            }
            (budget_mib, Some(dir)) => {
                let disk_opts = DiskOptions {
                    dir: dir.clone(),
                    budget_bytes: (budget_mib as u64) << 20,
                    max_age_days: opts.disk_cache_days,
                };
                match DiskTier::open(disk_opts, layout) {
                    Ok((tier, scan)) => {
                        log::info!(
                            target: LOG,
                            "disk tier {}: adopted {} blocks ({}), deleted {} corrupt, {} expired, {} over budget, {} temp files",
                            dir.display(),
                            scan.adopted,
                            mib(scan.adopted_bytes),
                            scan.corrupt_deleted,
                            scan.expired_deleted,
                            scan.over_budget_deleted,
                            scan.temp_deleted
                        );
                        stats.adopted_files = scan.adopted as u64;
                        stats.corrupt_files = scan.corrupt_deleted as u64;
                        Some(tier)
                    }
                    Err(e) => {
                        log::warn!(target: LOG, "disk tier off: {e}");
                        None
                    }
                }
            }
        };
        stats.host_budget = (opts.host_cache_mib as u64) << 20;
        stats.disk_dir = disk.as_ref().map(|d| d.dir().display().to_string());
        let mut cache = ConversationCache {
            host: HostTier::new((opts.host_cache_mib as u64) << 20),
            disk,
            gate,
            faults,
            block_size: layout.block_size as usize,
            block_bytes,
            scratch: Vec::new(),
            devices: devices
                .into_iter()
                .map(|device| StagingPart {
                    device,
                    reservation: None,
                })
                .collect(),
            spare: None,
            scan_adopted: stats.adopted_files,
            write_when_idle: opts.disk_write_when_idle,
            stats,
        };
        cache.refresh_sizes();
        Ok(cache)
    }

    /// No tiers below the device (scheduler tests, and `host_cache_mib=0, disk_cache_mib=0`).
    pub fn off(block_size: usize, block_bytes: usize) -> Self {
        ConversationCache {
            host: HostTier::new(0),
            disk: None,
            gate: RamGate::system(0),
            faults: Faults::default(),
            block_size,
            block_bytes,
            scratch: Vec::new(),
            // With every tier off, nothing is staged.
            devices: Vec::new(),
            spare: None,
            scan_adopted: 0,
            write_when_idle: false,
            stats: CacheStats::default(),
        }
    }

    fn host_on(&self) -> bool {
        self.host.budget() > 0
    }

    pub fn is_off(&self) -> bool {
        !self.host_on() && self.disk.is_none()
    }

    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    fn count(&mut self, from: Tier, to: Tier, result: MoveResult, blocks: usize) {
        if blocks > 0 {
            *self.stats.moves.entry((from, to, result)).or_default() += blocks as u64;
        }
    }

    fn refuse(&mut self, gate: Gate) {
        *self.stats.refusals.entry(gate).or_default() += 1;
    }

    /// A refusal by one device's pool: counted under the `device` gate and by the device's name.
    fn refuse_on_device(&mut self, device: &str) {
        self.refuse(Gate::Device);
        *self
            .stats
            .device_refusals
            .entry(device.to_string())
            .or_default() += 1;
    }

    fn refresh_sizes(&mut self) {
        self.stats.host_blocks = self.host.len();
        self.stats.host_bytes = self.host.bytes();
        if let Some(d) = &self.disk {
            self.stats.adopted_files = self.scan_adopted + d.adopted_later();
            self.stats.disk_blocks = d.len();
            self.stats.disk_bytes = d.bytes();
            self.stats.disk_budget = d.budget();
        }
    }

    /// Counts one operation of `kind` for fault injection; true when it must fail (counted).
    fn fault(&mut self, kind: FaultKind) -> bool {
        let fails = self.faults.fails(kind);
        if fails {
            *self.stats.faults_injected.entry(kind.name()).or_default() += 1;
        }
        fails
    }

    /// The RAM gate, or the `ram_gate` fault: a refusal as if the telemetry could not be read.
    fn admit_ram(&mut self, need: u64) -> std::result::Result<(), RamRefusal> {
        if self.fault(FaultKind::RamGate) {
            return Err(RamRefusal {
                need,
                floor: self.gate.floor(),
                available: None,
                reason: "injected fault".into(),
            });
        }
        self.gate.admit(need)
    }

    /// Reserves each device's part of the staging buffer that is not reserved yet; all or
    /// nothing: a refusal by any device gives back what this call reserved, and names the device.
    fn reserve_device_staging(&mut self) -> std::result::Result<(), DeviceRefusal> {
        let mut taken = Vec::new();
        for (i, part) in self.devices.iter().enumerate() {
            if part.reservation.is_some() {
                continue;
            }
            let memory = &part.device.memory;
            match memory.reserve(Purpose::Staging, part.device.bytes as u64) {
                Ok(r) => taken.push((i, r)),
                Err(refusal) => {
                    return Err(DeviceRefusal {
                        device: memory.device().to_string(),
                        refusal,
                    })
                }
            }
        }
        for (i, r) in taken {
            self.devices[i].reservation = Some(r);
        }
        Ok(())
    }

    /// The one-block staging buffer of disk moves, allocated on first use through the RAM gate
    /// and each device's pool (a refusal refuses that move, counted by gate, and by device for
    /// a device's; a later one tries again). Kept for the engine's life.
    fn staging(&mut self) -> std::result::Result<(), String> {
        if self.scratch.len() == self.block_bytes {
            return Ok(());
        }
        if let Err(r) = self.admit_ram(self.block_bytes as u64) {
            self.refuse(Gate::Ram);
            return Err(format!("no staging buffer: {r}"));
        }
        if let Err(r) = self.reserve_device_staging() {
            self.refuse_on_device(&r.device);
            return Err(format!("no staging buffer: {}", r.refusal));
        }
        self.scratch =
            zeroed_block(self.block_bytes).map_err(|e| format!("no staging buffer: {e}"))?;
        Ok(())
    }

    /// Asks every device of the split whether it can take an onload of `blocks` blocks from
    /// block `from` of the prompt, counting what the move itself would allocate on each: the
    /// staging buffer's part, on first use, when a block comes from disk (on a GPU, also the
    /// copy stream created on first use). Blocks free or evictable are asked of the shared block
    /// table by the caller. A refusal is counted (gate `device`, and by device) and logged naming
    /// the device; the data stays below and the prompt is read.
    pub fn admit_onload(
        &mut self,
        hashes: &[u64],
        tokens: &[u32],
        from: usize,
        blocks: usize,
    ) -> bool {
        let bs = self.block_size;
        let from_disk = (from..from + blocks).any(|i| {
            let (h, t) = (hashes[i], &tokens[i * bs..(i + 1) * bs]);
            !self.host.contains(h, t)
        });
        if !from_disk {
            return true;
        }
        match self.reserve_device_staging() {
            Ok(()) => true,
            Err(r) => {
                self.refuse_on_device(&r.device);
                log::info!(
                    target: LOG,
                    "skip onload of {} tokens: device {} cannot take its part of the staging buffer: {}",
                    blocks * bs,
                    r.device,
                    r.refusal
                );
                false
            }
        }
    }

    /// Cached device blocks about to be reused: their K/V goes to the host tier when the RAM
    /// gate admits it, else to disk, else it is dropped. Blocks already below are only refreshed.
    pub fn offload(&mut self, kv: &BlockPool, evicted: &[Evicted]) {
        if evicted.is_empty() || self.is_off() {
            return;
        }
        let bs = self.block_size;
        let mut todo: Vec<&Evicted> = Vec::with_capacity(evicted.len());
        for e in evicted {
            if self.host.contains(e.hash, &e.tokens) {
                self.host.touch(e.hash);
            } else {
                todo.push(e);
            }
        }
        if todo.is_empty() {
            return;
        }
        let need = (todo.len() * self.block_bytes) as u64;
        let started = Instant::now();
        let mut host_refusal: Option<String> = None;
        if !self.host_on() {
            host_refusal = Some("host tier off".into());
        } else if !self.host.can_ever_hold(self.block_bytes as u64) {
            self.refuse(Gate::HostBudget);
            host_refusal = Some(format!(
                "host budget {} is smaller than one block",
                mib(self.host.budget())
            ));
        } else if let Err(r) = self.admit_ram(need) {
            self.refuse(Gate::Ram);
            host_refusal = Some(r.to_string());
        }
        let (mut to_host, mut host_failed) = (0usize, None::<String>);
        let mut below: Vec<&Evicted> = Vec::new();
        for e in todo {
            if host_refusal.is_none() {
                match self.copy_to_host(kv, e) {
                    Ok(()) => {
                        to_host += 1;
                        continue;
                    }
                    Err(why) => {
                        self.count(Tier::Device, Tier::Host, MoveResult::Failed, 1);
                        host_failed.get_or_insert(why);
                    }
                }
            }
            below.push(e);
        }
        if host_refusal.is_some() && self.host_on() {
            self.count(Tier::Device, Tier::Host, MoveResult::Refused, below.len());
        }
        self.count(Tier::Device, Tier::Host, MoveResult::Ok, to_host);
        if to_host > 0 {
            let s = seconds_since(started);
            let bytes = (to_host * self.block_bytes) as u64;
            log::debug!(target: LOG, "offloaded {} tokens to host in {:.1} ms ({})", to_host * bs, s * 1e3, rate(bytes, s));
        }
        if let Some(why) = host_refusal.filter(|_| self.host_on()) {
            log::warn!(target: LOG, "skip offload of {} tokens to host: {why}", below.len() * bs);
        }
        if let Some(why) = host_failed {
            log::warn!(target: LOG, "skip offload to host ({} of them): {why}", below.len() * bs);
        }
        // What the host did not take goes to disk, straight from the device.
        let (mut written, mut failed) = (0usize, None::<String>);
        for e in &below {
            match self.write_to_disk(kv, e) {
                Some(Ok(())) => written += 1,
                Some(Err(why)) => {
                    failed.get_or_insert(why);
                }
                None => {}
            }
        }
        if let Some(why) = failed {
            log::warn!(target: LOG, "skip offload to disk: {why}");
        }
        if written > 0 {
            log::debug!(target: LOG, "wrote {} tokens to disk", written * bs);
        }
        self.refresh_sizes();
    }

    /// Copies one device block into the host tier, making room by moving the host's oldest
    /// blocks to disk.
    fn copy_to_host(&mut self, kv: &BlockPool, e: &Evicted) -> std::result::Result<(), String> {
        while !self.host.has_room(self.block_bytes as u64) {
            let Some((hash, old)) = self.host.pop_oldest() else {
                break;
            };
            if let Err(why) = self.demote(hash, &old.tokens, &old.data) {
                log::warn!(target: LOG, "skip move of {} tokens from host to disk: {why}", old.tokens.len());
            }
            if old.data.len() == self.block_bytes {
                self.spare = Some(old.data);
            }
        }
        // The RAM gate admitted the whole batch already: this is the allocation itself (a reused
        // buffer counts as one, so that injected faults fail the same moves either way).
        if self.fault(FaultKind::Alloc) {
            return Err("allocation failed (injected fault)".into());
        }
        let mut buf = match self.spare.take() {
            Some(b) => b,
            None => zeroed_block(self.block_bytes)?.into_boxed_slice(),
        };
        if self.fault(FaultKind::CopyOut) {
            return Err("copy failed (injected fault)".into());
        }
        if let Err(why) = kv.read_block(e.block, &mut buf) {
            self.spare = Some(buf);
            return Err(format!("copy failed: {why}"));
        }
        self.host.insert(e.hash, e.tokens.clone(), buf);
        Ok(())
    }

    /// A host block leaving RAM: written to disk unless it is there already.
    fn demote(
        &mut self,
        hash: u64,
        tokens: &[u32],
        data: &[u8],
    ) -> std::result::Result<(), String> {
        let Some(disk) = self.disk.as_mut() else {
            return Ok(());
        };
        if disk.contains(hash, tokens) {
            disk.touch(hash);
            return Ok(());
        }
        if self.fault(FaultKind::Write) {
            self.count(Tier::Host, Tier::Disk, MoveResult::Failed, 1);
            return Err("write failed (injected fault)".into());
        }
        let Some(disk) = self.disk.as_mut() else {
            return Ok(());
        };
        let result = disk.write(hash, tokens, data);
        self.disk_result(Tier::Host, result)
    }

    /// A device block written straight to disk; `None` when there is no disk tier.
    fn write_to_disk(
        &mut self,
        kv: &BlockPool,
        e: &Evicted,
    ) -> Option<std::result::Result<(), String>> {
        let disk = self.disk.as_mut()?;
        if disk.contains(e.hash, &e.tokens) {
            disk.touch(e.hash);
            return Some(Ok(()));
        }
        if self.fault(FaultKind::Write) {
            self.count(Tier::Device, Tier::Disk, MoveResult::Failed, 1);
            return Some(Err("write failed (injected fault)".into()));
        }
        if let Err(why) = self.staging() {
            self.count(Tier::Device, Tier::Disk, MoveResult::Refused, 1);
            return Some(Err(why));
        }
        if let Err(why) = kv.read_block(e.block, &mut self.scratch) {
            self.count(Tier::Device, Tier::Disk, MoveResult::Failed, 1);
            return Some(Err(format!("copy failed: {why}")));
        }
        let disk = self.disk.as_mut()?;
        let result = disk.write(e.hash, &e.tokens, &self.scratch);
        Some(self.disk_result(Tier::Device, result))
    }

    fn disk_result(
        &mut self,
        from: Tier,
        result: std::result::Result<bool, DiskError>,
    ) -> std::result::Result<(), String> {
        match result {
            Ok(_) => {
                self.count(from, Tier::Disk, MoveResult::Ok, 1);
                Ok(())
            }
            Err(e @ DiskError::NoRoom { .. }) => {
                self.refuse(Gate::DiskBudget);
                self.count(from, Tier::Disk, MoveResult::Refused, 1);
                Err(e.to_string())
            }
            Err(e) => {
                self.count(from, Tier::Disk, MoveResult::Failed, 1);
                Err(e.to_string())
            }
        }
    }

    /// Whether the engine writes its cached blocks to disk whenever it falls idle.
    pub fn writes_when_idle(&self) -> bool {
        self.write_when_idle && self.disk.is_some()
    }

    /// The prefix hashes of the host tier's blocks.
    pub fn host_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.host.iter_oldest_first().map(|(h, _, _)| h)
    }

    /// How many blocks from block `from` on, consecutive, the tiers below the device hold for
    /// this prompt (`hashes` are its full blocks' hashes). Found blocks are marked used, so that
    /// making room for their onload does not push them out first.
    pub fn probe(&mut self, hashes: &[u64], tokens: &[u32], from: usize) -> usize {
        if self.is_off() {
            return 0;
        }
        let bs = self.block_size;
        let mut n = 0;
        for (i, &h) in hashes.iter().enumerate().skip(from) {
            let t = &tokens[i * bs..(i + 1) * bs];
            if self.host.contains(h, t) {
                self.host.touch(h);
            } else if let Some(d) = self.disk.as_mut().filter(|d| d.contains(h, t)) {
                d.touch(h);
            } else if self.disk.as_mut().is_some_and(|d| d.find(h, t)) {
                // A file another process sharing the folder wrote since our scan: adopted as
                // the most recently used.
            } else {
                break;
            }
            n += 1;
        }
        n
    }

    /// The device could not take an onload: the data stays below and the prompt is read.
    pub fn refuse_onload(&mut self, tokens: usize, free: usize, need: usize) {
        self.refuse(Gate::Device);
        log::info!(
            target: LOG,
            "skip onload of {tokens} tokens: the device has {free} blocks free or evictable, needs {need}"
        );
    }

    /// Copies blocks `from..from + dst.len()` of the prompt from the tiers below into the fresh
    /// device blocks `dst` and indexes them there. Stops at the first block that cannot be
    /// restored (gone, failed copy or read, bad checksum); returns how many were restored.
    pub fn onload(
        &mut self,
        kv: &mut BlockPool,
        dst: &[u32],
        hashes: &[u64],
        tokens: &[u32],
        from: usize,
    ) -> usize {
        let bs = self.block_size;
        let started = Instant::now();
        let (mut from_host, mut from_disk) = (0usize, 0usize);
        let mut stopped: Option<String> = None;
        for (j, &block) in dst.iter().enumerate() {
            let i = from + j;
            let (h, t) = (hashes[i], &tokens[i * bs..(i + 1) * bs]);
            if self.host.contains(h, t) {
                if self.fault(FaultKind::CopyIn) {
                    self.count(Tier::Host, Tier::Device, MoveResult::Failed, 1);
                    stopped = Some("copy from host failed (injected fault)".into());
                    break;
                }
                if let Some(data) = self.host.get(h, t) {
                    if let Err(why) = kv.write_block(block, data) {
                        self.count(Tier::Host, Tier::Device, MoveResult::Failed, 1);
                        stopped = Some(format!("copy from host failed: {why}"));
                        break;
                    }
                }
                from_host += 1;
            } else if self.disk.as_ref().is_some_and(|d| d.contains(h, t)) {
                let copied = self.read_from_disk(h, t).and_then(|()| {
                    kv.write_block(block, &self.scratch)
                        .map_err(|why| format!("copy to the device failed: {why}"))
                });
                if let Err(why) = copied {
                    self.count(Tier::Disk, Tier::Device, MoveResult::Failed, 1);
                    stopped = Some(why);
                    break;
                }
                from_disk += 1;
            } else {
                stopped = Some("the block left the tiers below".into());
                break;
            }
            kv.register(block, h, t);
        }
        self.count(Tier::Host, Tier::Device, MoveResult::Ok, from_host);
        self.count(Tier::Disk, Tier::Device, MoveResult::Ok, from_disk);
        let restored = from_host + from_disk;
        self.stats.hit_tokens_host += (from_host * bs) as u64;
        self.stats.hit_tokens_disk += (from_disk * bs) as u64;
        if restored > 0 {
            let seconds = seconds_since(started);
            let bytes = (restored * self.block_bytes) as u64;
            let source = match (from_host, from_disk) {
                (_, 0) => "host".to_string(),
                (0, _) => "disk".to_string(),
                (h, d) => format!("host ({} tokens) and disk ({} tokens)", h * bs, d * bs),
            };
            log::info!(
                target: LOG,
                "restored {} tokens from {source} in {:.1} ms ({})",
                restored * bs,
                seconds * 1e3,
                rate(bytes, seconds)
            );
            self.stats.last_restore = Some(RestoreRecord {
                tokens: restored * bs,
                from_host: from_host * bs,
                from_disk: from_disk * bs,
                bytes,
                seconds,
            });
        }
        if let Some(why) = stopped {
            log::warn!(
                target: LOG,
                "restore stopped after {} of {} tokens: {why}; the rest is recomputed",
                restored * bs,
                dst.len() * bs
            );
        }
        self.refresh_sizes();
        restored
    }

    /// Reads one block from disk into `scratch`.
    fn read_from_disk(&mut self, hash: u64, tokens: &[u32]) -> std::result::Result<(), String> {
        if self.fault(FaultKind::Read) {
            return Err("read from disk failed (injected fault)".into());
        }
        self.staging()?;
        let Some(disk) = self.disk.as_mut() else {
            return Err("no disk tier".into());
        };
        match disk.read(hash, tokens, &mut self.scratch) {
            Ok(()) => Ok(()),
            Err(e) => {
                if matches!(e, DiskError::Corrupt(_)) {
                    self.stats.corrupt_files += 1;
                }
                Err(e.to_string())
            }
        }
    }

    /// A clean shutdown: writes every cached block (host tier, then the device's prefix cache)
    /// that is not on disk yet, so that the next start finds the conversations.
    pub fn persist(&mut self, kv: &BlockPool) {
        if self.disk.is_none() {
            return;
        }
        let started = Instant::now();
        let (mut written, mut present, mut failed) = (0usize, 0usize, None::<String>);
        let host: Vec<(u64, Box<[u32]>)> = self
            .host
            .iter_oldest_first()
            .map(|(h, t, _)| (h, t.into()))
            .collect();
        for (hash, tokens) in host {
            if self
                .disk
                .as_ref()
                .is_some_and(|d| d.contains(hash, &tokens))
            {
                present += 1;
                continue;
            }
            let Some(data) = self.host.get(hash, &tokens).map(|d| d.to_vec()) else {
                continue;
            };
            match self.demote(hash, &tokens, &data) {
                Ok(()) => written += 1,
                Err(why) => {
                    failed.get_or_insert(why);
                }
            }
        }
        let device: Vec<Evicted> = kv
            .cached_blocks()
            .map(|(block, hash, tokens)| Evicted {
                block,
                hash,
                tokens: tokens.into(),
            })
            .collect();
        for e in &device {
            if self
                .disk
                .as_ref()
                .is_some_and(|d| d.contains(e.hash, &e.tokens))
            {
                present += 1;
                continue;
            }
            match self.write_to_disk(kv, e) {
                Some(Ok(())) => written += 1,
                Some(Err(why)) => {
                    failed.get_or_insert(why);
                }
                None => {}
            }
        }
        let bs = self.block_size;
        log::info!(
            target: LOG,
            "saved {} tokens to disk in {:.1} ms ({} already there)",
            written * bs,
            seconds_since(started) * 1e3,
            present * bs
        );
        if let Some(why) = failed {
            log::warn!(target: LOG, "some blocks were not saved: {why}");
        }
        self.refresh_sizes();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ram_gate::CgroupMemory;
    use crate::kv::blocks::KvDtype;
    use crate::kv::prefix::extend_hashes;

    const BS: usize = 2;

    /// A pool of `blocks` blocks (1 layer, 1 head, head_dim 2) and a cache over it whose RAM gate
    /// reads a fake meminfo with `available_kib` available and no floor.
    fn setup(
        dir: &std::path::Path,
        blocks: usize,
        available_kib: u64,
        host_mib: usize,
        disk_mib: usize,
        faults: &str,
    ) -> (BlockPool, ConversationCache) {
        let pool = BlockPool::new(1, blocks, BS, 1, 2, KvDtype::F32).unwrap();
        let meminfo = dir.join("meminfo");
        std::fs::write(&meminfo, format!("MemAvailable: {available_kib} kB\n")).unwrap();
        let gate = RamGate::with_paths(meminfo, CgroupMemory::None, 0);
        let opts = CacheOptions {
            host_cache_mib: host_mib,
            disk_cache_dir: Some(dir.join("kv")),
            disk_cache_mib: disk_mib,
            faults: faults.into(),
            ..CacheOptions::default()
        };
        let layout = BlockLayout {
            salt: 7,
            kv_dtype: 4,
            block_size: BS as u32,
            num_layers: 1,
            kv_heads: 1,
            head_dim: 2,
            block_bytes: pool.bytes_per_block() as u64,
        };
        let cache =
            ConversationCache::new(&opts, layout, gate, vec![cpu_part(&pool, None)]).unwrap();
        (pool, cache)
    }

    /// The whole pool as one device "cpu" with `capacity`.
    fn cpu_part(pool: &BlockPool, capacity: Option<u64>) -> DevicePart {
        DevicePart {
            memory: MemoryPool::new("cpu", capacity),
            bytes: pool.bytes_per_block(),
        }
    }

    /// Fills a sequence of `tokens` into fresh blocks (K = token id, V = -id), registers its
    /// full blocks and releases them: they stay cached, evictable.
    fn cached_sequence(pool: &mut BlockPool, tokens: &[u32]) -> Vec<u64> {
        let mut hashes = Vec::new();
        extend_hashes(7, tokens, BS, &mut hashes);
        let blocks = pool.allocate(tokens.len() / BS).unwrap().blocks;
        for (p, &t) in tokens.iter().enumerate() {
            let slot = pool.slot(&blocks, p);
            pool.write(0, slot, &[t as f32, 0.5], &[-(t as f32), 0.25]);
        }
        for (i, &b) in blocks.iter().enumerate() {
            pool.register(b, hashes[i], &tokens[i * BS..(i + 1) * BS]);
        }
        pool.release(&blocks);
        hashes
    }

    /// K of every position in `table`, as written by `cached_sequence`.
    fn keys(pool: &BlockPool, table: &[u32], len: usize) -> Vec<f32> {
        let l = pool.layer(0);
        (0..len)
            .map(|p| l.k.get(l.k_index(pool.slot(table, p), 0, 0)))
            .collect()
    }

    fn moved(c: &ConversationCache, from: Tier, to: Tier, r: MoveResult) -> u64 {
        c.stats().moves.get(&(from, to, r)).copied().unwrap_or(0)
    }

    #[test]
    fn evicted_blocks_go_to_host_and_come_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let (mut pool, mut cache) = setup(dir.path(), 4, 1 << 20, 1, 0, "");
        let tokens = [11u32, 12, 13, 14, 15, 16];
        let hashes = cached_sequence(&mut pool, &tokens);
        // Another sequence takes every block: all three cached blocks are evicted.
        let a = pool.allocate(4).unwrap();
        assert_eq!(a.evicted.len(), 3);
        cache.offload(&pool, &a.evicted);
        assert_eq!(moved(&cache, Tier::Device, Tier::Host, MoveResult::Ok), 3);
        assert_eq!(cache.stats().host_blocks, 3);
        pool.release(&a.blocks);
        // The conversation returns: all three are below the device, in order.
        assert_eq!(cache.probe(&hashes, &tokens, 0), 3);
        assert_eq!(cache.probe(&hashes, &[11, 12, 13, 99, 15, 16], 0), 1);
        let dst = pool.allocate(3).unwrap().blocks;
        assert_eq!(cache.onload(&mut pool, &dst, &hashes, &tokens, 0), 3);
        let expect: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        assert_eq!(keys(&pool, &dst, 6), expect);
        assert_eq!(
            pool.lookup(&hashes, &tokens),
            dst,
            "restored blocks are indexed"
        );
        assert_eq!(cache.stats().hit_tokens_host, 6);
        let r = cache.stats().last_restore.clone().unwrap();
        assert_eq!((r.tokens, r.from_host), (6, 6));
        assert_eq!(r.bytes, 3 * pool.bytes_per_block() as u64);
    }

    #[test]
    fn a_ram_refusal_sends_blocks_to_disk_and_the_disk_restores_them() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing available: the gate refuses everything.
        let (mut pool, mut cache) = setup(dir.path(), 4, 0, 1, 1, "");
        let tokens = [21u32, 22, 23, 24, 25, 26];
        let hashes = cached_sequence(&mut pool, &tokens);
        let a = pool.allocate(4).unwrap();
        cache.offload(&pool, &a.evicted);
        assert_eq!(
            moved(&cache, Tier::Device, Tier::Host, MoveResult::Refused),
            3
        );
        // The disk's staging buffer is a host allocation too: refused for each block. One
        // refusal for the host batch, three for the disk moves; nothing is lost but cache.
        assert_eq!(cache.stats().refusals.get(&Gate::Ram), Some(&4));
        assert_eq!(
            moved(&cache, Tier::Device, Tier::Disk, MoveResult::Refused),
            3
        );
        assert_eq!(cache.probe(&hashes, &tokens, 0), 0);
        pool.release(&a.blocks);

        // With memory for the staging block but a host tier that is off, blocks go to disk.
        let dir = tempfile::tempdir().unwrap();
        let (mut pool, mut cache) = setup(dir.path(), 4, 1 << 20, 0, 1, "");
        let hashes = cached_sequence(&mut pool, &tokens);
        let a = pool.allocate(4).unwrap();
        cache.offload(&pool, &a.evicted);
        assert_eq!(moved(&cache, Tier::Device, Tier::Disk, MoveResult::Ok), 3);
        pool.release(&a.blocks);
        assert_eq!(cache.probe(&hashes, &tokens, 0), 3);
        let dst = pool.allocate(3).unwrap().blocks;
        assert_eq!(cache.onload(&mut pool, &dst, &hashes, &tokens, 0), 3);
        let expect: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        assert_eq!(keys(&pool, &dst, 6), expect);
        assert_eq!(cache.stats().hit_tokens_disk, 6);
    }

    #[test]
    fn the_staging_buffer_is_accounted_in_the_device_pool_and_refused_past_its_capacity() {
        let tokens = [41u32, 42, 43, 44, 45, 46];
        // A host tier that is off sends blocks to disk through the one-block staging buffer.
        let dir = tempfile::tempdir().unwrap();
        let (mut pool, mut cache) = setup(dir.path(), 4, 1 << 20, 0, 1, "");
        let block = pool.bytes_per_block() as u64;
        assert_eq!(
            cache.devices[0].device.memory.in_use(Purpose::Staging),
            0,
            "allocated on first use"
        );
        cached_sequence(&mut pool, &tokens);
        let a = pool.allocate(4).unwrap();
        cache.offload(&pool, &a.evicted);
        assert_eq!(moved(&cache, Tier::Device, Tier::Disk, MoveResult::Ok), 3);
        assert_eq!(
            cache.devices[0].device.memory.in_use(Purpose::Staging),
            block,
            "one buffer, reused"
        );
        let memory = cache.devices[0].device.memory.clone();
        drop(cache);
        assert_eq!(memory.total_in_use(), 0, "released with the cache");

        // A device pool with no room left for it: the disk moves are refused, nothing staged.
        let dir = tempfile::tempdir().unwrap();
        let (mut pool, mut cache) = setup(dir.path(), 4, 1 << 20, 0, 1, "");
        cache.devices[0].device.memory = MemoryPool::new("cpu", Some(block - 1));
        cached_sequence(&mut pool, &tokens);
        let a = pool.allocate(4).unwrap();
        cache.offload(&pool, &a.evicted);
        assert_eq!(
            moved(&cache, Tier::Device, Tier::Disk, MoveResult::Refused),
            3
        );
        assert_eq!(cache.devices[0].device.memory.total_in_use(), 0);
        assert!(cache.scratch.is_empty());
        assert_eq!(cache.stats().refusals.get(&Gate::Device), Some(&3));
        assert_eq!(cache.stats().device_refusals.get("cpu"), Some(&3));
        assert_eq!(cache.stats().refusals.get(&Gate::Ram), None);
    }

    #[test]
    fn an_onload_from_disk_is_admitted_per_device_and_refused_naming_the_full_one() {
        let tokens = [51u32, 52, 53, 54, 55, 56];
        let dir = tempfile::tempdir().unwrap();
        // A first cache (host tier off) writes three blocks to disk.
        let (mut pool, mut cache) = setup(dir.path(), 4, 1 << 20, 0, 1, "");
        let hashes = cached_sequence(&mut pool, &tokens);
        let a = pool.allocate(4).unwrap();
        cache.offload(&pool, &a.evicted);
        pool.release(&a.blocks);
        assert_eq!(moved(&cache, Tier::Device, Tier::Disk, MoveResult::Ok), 3);
        drop(cache);

        // The same blocks seen by a cache over two devices; the second has 1 byte left for
        // its part of the staging buffer.
        let half = pool.bytes_per_block() / 2;
        let two = |second: Option<u64>| {
            let meminfo = dir.path().join("meminfo");
            let gate = RamGate::with_paths(meminfo, CgroupMemory::None, 0);
            let opts = CacheOptions {
                host_cache_mib: 0,
                disk_cache_dir: Some(dir.path().join("kv")),
                disk_cache_mib: 1,
                ..CacheOptions::default()
            };
            let layout = BlockLayout {
                salt: 7,
                kv_dtype: 4,
                block_size: BS as u32,
                num_layers: 1,
                kv_heads: 1,
                head_dim: 2,
                block_bytes: pool.bytes_per_block() as u64,
            };
            let parts = vec![
                DevicePart {
                    memory: MemoryPool::new("cpu:0", None),
                    bytes: half,
                },
                DevicePart {
                    memory: MemoryPool::new("cpu:1", second),
                    bytes: half,
                },
            ];
            ConversationCache::new(&opts, layout, gate, parts).unwrap()
        };
        let mut tight = two(Some(1));
        assert_eq!(tight.probe(&hashes, &tokens, 0), 3);
        assert!(!tight.admit_onload(&hashes, &tokens, 0, 3));
        assert_eq!(tight.stats().refusals.get(&Gate::Device), Some(&1));
        assert_eq!(
            tight.stats().device_refusals,
            [("cpu:1".to_string(), 1)].into_iter().collect()
        );
        // All or nothing: cpu:0's part was given back.
        let staged: Vec<u64> = tight
            .devices
            .iter()
            .map(|d| d.device.memory.in_use(Purpose::Staging))
            .collect();
        assert_eq!(staged, [0, 0]);
        drop(tight);

        // With room on both, each device reserves its part and the restore happens.
        let mut roomy = two(None);
        assert!(roomy.admit_onload(&hashes, &tokens, 0, 3));
        let staged: Vec<u64> = roomy
            .devices
            .iter()
            .map(|d| d.device.memory.in_use(Purpose::Staging))
            .collect();
        assert_eq!(staged, [half as u64, half as u64]);
        let dst = pool.allocate(3).unwrap().blocks;
        assert_eq!(roomy.onload(&mut pool, &dst, &hashes, &tokens, 0), 3);
        assert_eq!(keys(&pool, &dst, 6), tokens.map(|t| t as f32));
        assert!(roomy.stats().device_refusals.is_empty());
    }

    #[test]
    fn an_injected_ram_gate_refusal_sends_the_batch_to_disk() {
        let dir = tempfile::tempdir().unwrap();
        // Plenty of memory, but the first gate check (the host batch) is made to refuse; the
        // second (the disk's staging buffer) passes.
        let (mut pool, mut cache) = setup(dir.path(), 4, 1 << 20, 1, 1, "ram_gate:1");
        let tokens = [31u32, 32, 33, 34, 35, 36];
        let hashes = cached_sequence(&mut pool, &tokens);
        let a = pool.allocate(4).unwrap();
        cache.offload(&pool, &a.evicted);
        assert_eq!(cache.stats().refusals.get(&Gate::Ram), Some(&1));
        assert_eq!(
            moved(&cache, Tier::Device, Tier::Host, MoveResult::Refused),
            3
        );
        assert_eq!(moved(&cache, Tier::Device, Tier::Disk, MoveResult::Ok), 3);
        pool.release(&a.blocks);
        let dst = pool.allocate(3).unwrap().blocks;
        assert_eq!(cache.onload(&mut pool, &dst, &hashes, &tokens, 0), 3);
        let expect: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        assert_eq!(keys(&pool, &dst, 6), expect);
    }

    #[test]
    fn a_failed_copy_in_stops_the_restore_at_that_block() {
        let dir = tempfile::tempdir().unwrap();
        let (mut pool, mut cache) = setup(dir.path(), 4, 1 << 20, 1, 0, "copy_in:2");
        let tokens = [31u32, 32, 33, 34, 35, 36];
        let hashes = cached_sequence(&mut pool, &tokens);
        let a = pool.allocate(4).unwrap();
        cache.offload(&pool, &a.evicted);
        pool.release(&a.blocks);
        let dst = pool.allocate(3).unwrap().blocks;
        assert_eq!(cache.onload(&mut pool, &dst, &hashes, &tokens, 0), 1);
        assert_eq!(keys(&pool, &dst[..1], 2), [31.0, 32.0]);
        assert_eq!(
            moved(&cache, Tier::Host, Tier::Device, MoveResult::Failed),
            1
        );
        assert_eq!(
            pool.lookup(&hashes, &tokens),
            dst[..1],
            "only the restored block is indexed"
        );
    }

    /// A device part in host memory that fails the reads and writes whose numbers (from 1) it
    /// is given, as a GPU's copies can fail.
    struct FlakyPart {
        blocks: Vec<Vec<u8>>,
        fail_reads: Vec<usize>,
        fail_writes: Vec<usize>,
        reads: std::cell::Cell<usize>,
        writes: usize,
    }

    impl crate::kv::blocks::DeviceKv for FlakyPart {
        fn read_part(&self, block: u32, out: &mut [u8]) -> std::result::Result<(), String> {
            self.reads.set(self.reads.get() + 1);
            if self.fail_reads.contains(&self.reads.get()) {
                return Err(format!("read {} failed", self.reads.get()));
            }
            out.copy_from_slice(&self.blocks[block as usize]);
            Ok(())
        }
        fn write_part(&mut self, block: u32, data: &[u8]) -> std::result::Result<(), String> {
            self.writes += 1;
            if self.fail_writes.contains(&self.writes) {
                return Err(format!("write {} failed", self.writes));
            }
            self.blocks[block as usize].copy_from_slice(data);
            Ok(())
        }
        fn bytes(&self) -> usize {
            self.blocks.iter().map(Vec::len).sum()
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    /// A failed copy out of a device part fails that block's offload (counted) and leaves the
    /// others; a failed copy in stops the restore there (counted); what moved comes back exact.
    #[test]
    fn a_device_parts_failed_copies_fail_those_moves_only() {
        let dir = tempfile::tempdir().unwrap();
        let (host_pool, mut cache) = setup(dir.path(), 4, 1 << 20, 1, 0, "");
        let bytes = host_pool.bytes_per_block();
        let part = FlakyPart {
            blocks: vec![vec![0; bytes]; 4],
            fail_reads: vec![2],
            // Writes 1 to 3 fill the blocks; 4 is the first restore's first copy in.
            fail_writes: vec![4],
            reads: std::cell::Cell::new(0),
            writes: 0,
        };
        let mut pool =
            BlockPool::on_devices(&[1], vec![Box::new(part)], 4, BS, 1, 2, KvDtype::F32).unwrap();
        let tokens = [41u32, 42, 43, 44, 45, 46];
        let mut hashes = Vec::new();
        extend_hashes(7, &tokens, BS, &mut hashes);
        let blocks = pool.allocate(3).unwrap().blocks;
        for (i, &b) in blocks.iter().enumerate() {
            pool.write_block(b, &vec![i as u8 + 1; bytes]).unwrap();
            pool.register(b, hashes[i], &tokens[i * BS..(i + 1) * BS]);
        }
        pool.release(&blocks);
        let a = pool.allocate(4).unwrap();
        assert_eq!(a.evicted.len(), 3);
        cache.offload(&pool, &a.evicted);
        assert_eq!(moved(&cache, Tier::Device, Tier::Host, MoveResult::Ok), 2);
        assert_eq!(
            moved(&cache, Tier::Device, Tier::Host, MoveResult::Failed),
            1
        );
        pool.release(&a.blocks);
        // Evicted leaves first: the chain's first block is there, whichever other one failed.
        let below = cache.probe(&hashes, &tokens, 0);
        assert!((1..=2).contains(&below), "{below}");
        let dst = pool.allocate(below).unwrap().blocks;
        assert_eq!(cache.onload(&mut pool, &dst, &hashes, &tokens, 0), 0);
        assert_eq!(
            moved(&cache, Tier::Host, Tier::Device, MoveResult::Failed),
            1
        );
        assert!(
            pool.lookup(&hashes, &tokens).is_empty(),
            "nothing half-restored is indexed"
        );
        // The next attempt's copies succeed: the blocks come back as they left.
        assert_eq!(cache.onload(&mut pool, &dst, &hashes, &tokens, 0), below);
        let mut back = vec![0u8; bytes];
        pool.read_block(dst[0], &mut back).unwrap();
        assert_eq!(
            back,
            vec![1u8; bytes],
            "the first block came back as it left"
        );
    }
}
