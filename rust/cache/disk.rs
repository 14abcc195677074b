//! The disk tier of the conversation cache: K/V blocks kept in files, so that a conversation
//! survives eviction from RAM and a process restart.
//!
//! One file per block, named `{salt:016x}-{hash:016x}.kvb`: a header (magic, version, the engine's
//! K/V layout, the block's prefix hash and its own token ids, checksums) and then the payload, the
//! block's K and V for all layers as opaque bytes. The salt (model fingerprint) in the name lets
//! several models share one directory: a tier only ever looks at, counts or deletes its own files.
//!
//! Nothing read from a file is trusted: every header field must equal what this engine would
//! write, lengths come from the layout (never from the file), and both checksums are verified on
//! every read. A file that fails is deleted, so the block is recomputed and written again.
//!
//! Writes go to a temp file in the same directory, are fsynced and renamed into place, so a crash
//! never leaves a partial file under a final name (only a temp file, deleted at the next open).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"STRATAKV";
const VERSION: u32 = 1;
/// Header bytes before the token ids: magic, version, salt, hash, dtype + pad, block_size,
/// num_layers, kv_heads, head_dim, payload_len, payload_checksum.
const FIXED_HEADER: usize = 64;
const EXT: &str = ".kvb";

/// A temp file older than this is a crashed write's leftover; a younger one may be in progress.
const TEMP_GRACE_SECS: f64 = 600.0;

/// Ticks of the LRU start here, so that files another process wrote can be indexed below every
/// tick handed out (as least recently used).
const FIRST_TICK: u64 = 1 << 40;

/// Makes temp names unique among the writers of this process (the pid covers other processes).
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The engine's K/V layout: every field is written in the header and must match on read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    /// Model fingerprint: also the prefix of every file name of this engine.
    pub salt: u64,
    /// Code of the K/V format, given by the caller (the engine's `KvDtype::code`: one per
    /// format, f32, f16, bf16 and q8_0 all distinct); opaque here.
    pub kv_dtype: u8,
    /// Tokens per block.
    pub block_size: u32,
    pub num_layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Payload length of every block.
    pub block_bytes: u64,
}

impl BlockLayout {
    /// Header length: fixed fields, the token ids, the header checksum.
    fn header_len(&self) -> usize {
        (self.block_size as usize)
            .saturating_mul(4)
            .saturating_add(FIXED_HEADER + 8)
    }

    /// Length of every block file of this layout.
    fn file_len(&self) -> u64 {
        self.header_len() as u64 + self.block_bytes
    }
}

#[derive(Clone, Debug)]
pub struct DiskOptions {
    pub dir: PathBuf,
    /// File bytes (header + payload) the tier may hold.
    pub budget_bytes: u64,
    /// Files older than this (by mtime) are deleted at open; 0 empties the tier at open.
    pub max_age_days: f64,
}

/// What the startup scan did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Files kept by the tier after the scan (after trimming to the budget).
    pub adopted: usize,
    pub adopted_bytes: u64,
    pub corrupt_deleted: usize,
    pub expired_deleted: usize,
    pub over_budget_deleted: usize,
    pub temp_deleted: usize,
}

#[derive(Debug)]
pub enum DiskError {
    /// The file was wrong (bad magic/version/layout/checksum, truncated, other tokens): it was
    /// deleted. The message names the file and what was wrong.
    Corrupt(String),
    /// Not in the tier.
    Missing,
    /// The budget cannot take the block even after evicting everything older (block bigger than
    /// budget).
    NoRoom { need: u64, budget: u64 },
    /// An I/O failure; the message names the file where there is one.
    Io(io::Error),
}

impl fmt::Display for DiskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskError::Corrupt(msg) => write!(f, "corrupt K/V block file deleted: {msg}"),
            DiskError::Missing => write!(f, "K/V block not in the disk tier"),
            DiskError::NoRoom { need, budget } => write!(
                f,
                "K/V block file of {need} bytes does not fit the disk budget of {budget} bytes"
            ),
            DiskError::Io(e) => write!(f, "disk tier I/O error: {e}"),
        }
    }
}

impl std::error::Error for DiskError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DiskError::Io(e) => Some(e),
            _ => None,
        }
    }
}

/// An I/O error with the file it happened on in its message.
fn io_err(path: &Path, e: io::Error) -> DiskError {
    DiskError::Io(io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn invalid_input(msg: String) -> DiskError {
    DiskError::Io(io::Error::new(io::ErrorKind::InvalidInput, msg))
}

/// Deletes a file; true when it is gone afterwards (deleted now or already missing).
fn delete(path: &Path) -> bool {
    match fs::remove_file(path) {
        Ok(()) => true,
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

/// A held block: its LRU tick and, to rule out hash collisions, its tokens.
struct Entry {
    tick: u64,
    tokens: Box<[u32]>,
}

/// The blocks of one engine (one salt) in one directory, with an LRU over them.
pub struct DiskTier {
    dir: PathBuf,
    layout: BlockLayout,
    budget: u64,
    entries: HashMap<u64, Entry>,
    /// tick -> hash; the smallest tick is the least recently used.
    lru: BTreeMap<u64, u64>,
    next_tick: u64,
    /// The folder's mtime at our last listing: a change means another process (replicas may
    /// share the folder) created or deleted files since.
    listed_mtime: Option<SystemTime>,
    /// Files of ours that another process wrote, adopted after the startup scan.
    adopted_later: u64,
}

impl DiskTier {
    /// Creates `dir` if needed and scans it. Only files named `{layout.salt:016x}-*.kvb` are
    /// ours; every other file (other models' blocks, anything else) is left alone and not
    /// counted. Ours: older than max_age_days (by mtime) -> deleted (expired); max_age_days == 0
    /// -> every one of ours deleted; header unreadable/any header field not matching
    /// `layout`/header checksum wrong/file length != header + block_bytes -> deleted (corrupt);
    /// else adopted (hash and tokens kept in memory; payload is NOT read at scan; it is verified
    /// on every read). Leftover temp files `.{salt:016x}-*.tmp-*` of ours (writer gone, or older
    /// than 10 minutes) -> deleted (temp).
    /// Then, if adopted bytes exceed the budget, the oldest (by mtime) are deleted until within
    /// it. Errors only when the directory cannot be created or listed.
    pub fn open(
        opts: DiskOptions,
        layout: BlockLayout,
    ) -> Result<(DiskTier, ScanReport), DiskError> {
        // Cached K/V is the user's conversations: folders we create are the owner's only.
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&opts.dir)
            .map_err(|e| io_err(&opts.dir, e))?;
        let mut tier = DiskTier {
            dir: opts.dir,
            layout,
            budget: opts.budget_bytes,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            // Room below for the files found late (`insert_oldest`).
            next_tick: FIRST_TICK,
            listed_mtime: None,
            adopted_later: 0,
        };
        let report = tier.scan(opts.max_age_days)?;
        Ok((tier, report))
    }

    fn scan(&mut self, max_age_days: f64) -> Result<ScanReport, DiskError> {
        let mut report = ScanReport::default();
        let prefix = format!("{:016x}-", self.layout.salt);
        let temp_prefix = format!(".{prefix}");
        let now = SystemTime::now();
        // NaN compares false everywhere: no age limit. Infinity: no age limit either.
        let max_age_secs = max_age_days * 86_400.0;
        let mut found: Vec<(SystemTime, u64, Box<[u32]>)> = Vec::new();

        self.listed_mtime = self.dir_mtime();
        let listing = fs::read_dir(&self.dir).map_err(|e| io_err(&self.dir, e))?;
        for entry in listing {
            let entry = entry.map_err(|e| io_err(&self.dir, e))?;
            let name = entry.file_name();
            // A name that is not UTF-8 cannot be one of ours.
            let Some(name) = name.to_str() else { continue };
            let is_temp = name.starts_with(&temp_prefix) && name.contains(".tmp-");
            let is_block = name.starts_with(&prefix) && name.ends_with(EXT);
            if !is_temp && !is_block {
                continue;
            }
            // Directories, symlinks and the like are nobody's blocks: leave them alone.
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            let path = entry.path();
            // A file system without mtimes: treat the file as fresh rather than expire it.
            let mtime = meta.modified().unwrap_or(now);
            let age_secs = now
                .duration_since(mtime)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            if is_temp {
                // A recent temp file may be another live engine's write in progress (two
                // processes can share a folder): a crash's leftover is one whose writer is gone
                // or that is old.
                let leftover = age_secs > TEMP_GRACE_SECS || !writer_may_be_alive(name);
                if leftover && delete(&path) {
                    report.temp_deleted += 1;
                }
                continue;
            }
            if max_age_days <= 0.0 || age_secs > max_age_secs {
                if delete(&path) {
                    report.expired_deleted += 1;
                }
                continue;
            }
            let hex = name.strip_prefix(&prefix).and_then(|r| r.strip_suffix(EXT));
            match self.check_at_scan(hex.unwrap_or(""), &path, meta.len()) {
                Ok((hash, tokens)) => found.push((mtime, hash, tokens)),
                Err(_) => {
                    if delete(&path) {
                        report.corrupt_deleted += 1;
                    }
                }
            }
        }

        // Oldest first: ticks follow mtimes, and trimming to the budget drops the oldest.
        found.sort_by_key(|&(mtime, hash, _)| (mtime, hash));
        let file_len = self.layout.file_len();
        let mut keep = found.len() as u64;
        let mut found = found.into_iter();
        while keep.saturating_mul(file_len) > self.budget {
            let Some((_, hash, _)) = found.next() else {
                break;
            };
            if delete(&self.path_of(hash)) {
                report.over_budget_deleted += 1;
            }
            keep -= 1;
        }
        for (_, hash, tokens) in found {
            self.insert(hash, tokens);
        }
        report.adopted = self.len();
        report.adopted_bytes = self.bytes();
        Ok(report)
    }

    /// Checks one of our files at scan (`hex`: the hash part of its name): the name, the length
    /// and the header, not the payload.
    fn check_at_scan(&self, hex: &str, path: &Path, len: u64) -> Result<(u64, Box<[u32]>), String> {
        let hash = parse_hash(hex).ok_or_else(|| format!("bad hash {hex:?} in the file name"))?;
        if len != self.layout.file_len() {
            return Err(format!("length {len}, expected {}", self.layout.file_len()));
        }
        let mut header = vec![0u8; self.layout.header_len()];
        File::open(path)
            .and_then(|mut f| f.read_exact(&mut header))
            .map_err(|e| format!("header unreadable: {e}"))?;
        let (tokens, _) = check_header(&self.layout, hash, &header)?;
        Ok((hash, tokens))
    }

    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// File bytes held (header + payload); every file of a layout has the same length.
    pub fn bytes(&self) -> u64 {
        self.entries.len() as u64 * self.layout.file_len()
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the tier holds `hash` with these tokens.
    pub fn contains(&self, hash: u64, tokens: &[u32]) -> bool {
        self.entries
            .get(&hash)
            .is_some_and(|e| *e.tokens == *tokens)
    }

    /// Whether the tier holds `hash` with these tokens, adopting the file when another process
    /// sharing the folder wrote it since our scan (its header checked as at the scan; a bad one
    /// is deleted). One `stat` per miss.
    pub fn find(&mut self, hash: u64, tokens: &[u32]) -> bool {
        if self.entries.contains_key(&hash) {
            return self.contains(hash, tokens);
        }
        let path = self.path_of(hash);
        let Ok(meta) = fs::metadata(&path) else {
            return false;
        };
        if !meta.is_file() {
            return false;
        }
        let hex = format!("{hash:016x}");
        match self.check_at_scan(&hex, &path, meta.len()) {
            Ok((_, held)) if *held == *tokens => {
                self.insert(hash, held);
                self.adopted_later += 1;
                true
            }
            // A collision: another block's file under this hash; not ours to delete.
            Ok(_) => false,
            Err(_) => {
                delete(&path);
                false
            }
        }
    }

    /// Files of ours another process wrote, adopted after the startup scan (by `find` or when
    /// making room).
    pub fn adopted_later(&self) -> u64 {
        self.adopted_later
    }

    fn dir_mtime(&self) -> Option<SystemTime> {
        fs::metadata(&self.dir).and_then(|m| m.modified()).ok()
    }

    /// Brings the index up to the folder when another process changed it since our last
    /// listing: files of ours we do not know are adopted (oldest ticks, by mtime, so that they
    /// are evicted first), files we know that are gone are forgotten. So the budget holds for
    /// the folder's total, not only for what this process wrote. Best effort: a folder that
    /// cannot be listed leaves the index as it is.
    fn refresh(&mut self) {
        let mtime = self.dir_mtime();
        if mtime.is_some() && mtime == self.listed_mtime {
            return;
        }
        self.listed_mtime = mtime;
        let Ok(listing) = fs::read_dir(&self.dir) else {
            return;
        };
        let prefix = format!("{:016x}-", self.layout.salt);
        let mut seen: std::collections::HashSet<u64> = std::collections::HashSet::new();
        let mut new: Vec<(SystemTime, u64, PathBuf, u64)> = Vec::new();
        for entry in listing.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(hash) = name
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(EXT))
                .and_then(parse_hash)
            else {
                continue;
            };
            seen.insert(hash);
            if self.entries.contains_key(&hash) {
                continue;
            }
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_file() {
                let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                new.push((mtime, hash, entry.path(), meta.len()));
            }
        }
        let gone: Vec<u64> = self
            .entries
            .keys()
            .filter(|h| !seen.contains(h))
            .copied()
            .collect();
        for hash in gone {
            self.forget(hash);
        }
        // Newest first: each goes below the ones before it, so the oldest ends least recent.
        new.sort_by_key(|&(mtime, hash, _, _)| std::cmp::Reverse((mtime, hash)));
        for (_, hash, path, len) in new {
            let hex = format!("{hash:016x}");
            match self.check_at_scan(&hex, &path, len) {
                Ok((_, tokens)) => {
                    self.insert_oldest(hash, tokens);
                    self.adopted_later += 1;
                }
                Err(_) => {
                    delete(&path);
                }
            }
        }
    }

    /// Marks `hash` most recently used (no I/O).
    pub fn touch(&mut self, hash: u64) {
        let tick = self.next_tick;
        let Some(e) = self.entries.get_mut(&hash) else {
            return;
        };
        self.lru.remove(&e.tick);
        e.tick = tick;
        self.lru.insert(tick, hash);
        self.next_tick += 1;
    }

    /// Writes a block (payload.len() must equal layout.block_bytes, tokens.len() block_size, else
    /// Err(Io InvalidInput)). Already held with the same tokens -> Ok(false) without writing (just
    /// touched). Makes room first by deleting least recently used files; NoRoom when the block
    /// alone exceeds the budget. Ok(true) when written.
    pub fn write(&mut self, hash: u64, tokens: &[u32], payload: &[u8]) -> Result<bool, DiskError> {
        self.check_args(tokens, payload.len())?;
        if self.contains(hash, tokens) {
            self.touch(hash);
            return Ok(false);
        }
        let need = self.layout.file_len();
        if need > self.budget {
            return Err(DiskError::NoRoom {
                need,
                budget: self.budget,
            });
        }
        // Held with other tokens (a hash collision): the new block replaces it. Deleting first
        // means a failed write leaves neither.
        if self.entries.contains_key(&hash) {
            self.remove(hash);
        }
        if self.bytes() + need > self.budget || self.dir_mtime() != self.listed_mtime {
            self.refresh();
        }
        while self.bytes() + need > self.budget {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
            // Best effort: a file we cannot delete is forgotten, and the next scan retries it.
            delete(&self.path_of(oldest));
        }

        let path = self.path_of(hash);
        let temp = self.dir.join(format!(
            ".{}.tmp-{}-{}",
            file_name(self.layout.salt, hash),
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let header = encode_header(&self.layout, hash, tokens, xxh3_64(payload));
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)
            .and_then(|mut f| {
                f.write_all(&header)?;
                f.write_all(payload)?;
                f.sync_all()
            })
            .and_then(|()| fs::rename(&temp, &path));
        if let Err(e) = written {
            // The temp file may not exist (create failed): nothing to report then.
            fs::remove_file(&temp).ok();
            return Err(io_err(&temp, e));
        }
        // Makes the rename durable; some file systems cannot fsync a directory, so best effort.
        File::open(&self.dir).and_then(|d| d.sync_all()).ok();
        self.insert(hash, tokens.into());
        // Our own rename changed the folder: what we know of it is still complete unless someone
        // else changed it too, which the next write's check of the mtime sees.
        if self.listed_mtime.is_some() {
            self.listed_mtime = self.dir_mtime();
        }
        Ok(true)
    }

    /// Reads and verifies a block into `out` (len block_bytes): every header field, the tokens,
    /// the header and payload checksums. Any mismatch -> the file is deleted, forgotten,
    /// Err(Corrupt). Missing from the index -> Err(Missing); the file vanished -> forgotten,
    /// Err(Missing). Marks it most recently used on success. On any error `out` holds garbage.
    pub fn read(&mut self, hash: u64, tokens: &[u32], out: &mut [u8]) -> Result<(), DiskError> {
        self.check_args(tokens, out.len())?;
        let Some(entry) = self.entries.get(&hash) else {
            return Err(DiskError::Missing);
        };
        let path = self.path_of(hash);
        if *entry.tokens != *tokens {
            return Err(self.corrupt(hash, &path, "other tokens than asked for".into()));
        }
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.forget(hash);
                return Err(DiskError::Missing);
            }
            Err(e) => return Err(io_err(&path, e)),
        };
        let len = file.metadata().map_err(|e| io_err(&path, e))?.len();
        if len != self.layout.file_len() {
            let reason = format!("length {len}, expected {}", self.layout.file_len());
            return Err(self.corrupt(hash, &path, reason));
        }
        let mut header = vec![0u8; self.layout.header_len()];
        if let Err(e) = file
            .read_exact(&mut header)
            .and_then(|()| file.read_exact(out))
        {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                // Shrunk since the length check.
                return Err(self.corrupt(hash, &path, "truncated".into()));
            }
            return Err(io_err(&path, e));
        }
        let checksum = match check_header(&self.layout, hash, &header) {
            Ok((held, checksum)) if *held == *tokens => checksum,
            Ok(_) => return Err(self.corrupt(hash, &path, "other tokens in the file".into())),
            Err(reason) => return Err(self.corrupt(hash, &path, reason)),
        };
        if xxh3_64(out) != checksum {
            return Err(self.corrupt(hash, &path, "payload checksum mismatch".into()));
        }
        self.touch(hash);
        Ok(())
    }

    /// Deletes one block's file and forgets it (used by tests and by callers that find it bad).
    pub fn remove(&mut self, hash: u64) {
        self.forget(hash);
        delete(&self.path_of(hash));
    }

    /// Path of a block's file (for tests that corrupt files).
    pub fn path_of(&self, hash: u64) -> PathBuf {
        self.dir.join(file_name(self.layout.salt, hash))
    }

    fn check_args(&self, tokens: &[u32], payload_len: usize) -> Result<(), DiskError> {
        if tokens.len() as u64 != u64::from(self.layout.block_size) {
            return Err(invalid_input(format!(
                "{} tokens for a block of {}",
                tokens.len(),
                self.layout.block_size
            )));
        }
        if payload_len as u64 != self.layout.block_bytes {
            return Err(invalid_input(format!(
                "payload buffer of {payload_len} bytes for blocks of {}",
                self.layout.block_bytes
            )));
        }
        Ok(())
    }

    fn insert(&mut self, hash: u64, tokens: Box<[u32]>) {
        let tick = self.next_tick;
        self.next_tick += 1;
        self.lru.insert(tick, hash);
        if let Some(old) = self.entries.insert(hash, Entry { tick, tokens }) {
            self.lru.remove(&old.tick);
        }
    }

    /// Indexes a block as the least recently used: one another process wrote, found late.
    fn insert_oldest(&mut self, hash: u64, tokens: Box<[u32]>) {
        let tick = self
            .lru
            .keys()
            .next()
            .map_or(FIRST_TICK, |&t| t.saturating_sub(1));
        if self.lru.contains_key(&tick) {
            self.insert(hash, tokens);
            return;
        }
        self.lru.insert(tick, hash);
        if let Some(old) = self.entries.insert(hash, Entry { tick, tokens }) {
            self.lru.remove(&old.tick);
        }
    }

    fn forget(&mut self, hash: u64) {
        if let Some(e) = self.entries.remove(&hash) {
            self.lru.remove(&e.tick);
        }
    }

    /// Deletes and forgets a bad file; the error to return.
    fn corrupt(&mut self, hash: u64, path: &Path, reason: String) -> DiskError {
        self.forget(hash);
        delete(path);
        DiskError::Corrupt(format!("{}: {reason}", path.display()))
    }
}

fn file_name(salt: u64, hash: u64) -> String {
    format!("{salt:016x}-{hash:016x}{EXT}")
}

/// The hash in a file name: exactly 16 lowercase hex digits, as `file_name` writes it.
fn parse_hash(hex: &str) -> Option<u64> {
    let ok = hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !ok {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

fn encode_header(
    layout: &BlockLayout,
    hash: u64,
    tokens: &[u32],
    payload_checksum: u64,
) -> Vec<u8> {
    let mut h = Vec::with_capacity(layout.header_len());
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&layout.salt.to_le_bytes());
    h.extend_from_slice(&hash.to_le_bytes());
    h.extend_from_slice(&[layout.kv_dtype, 0, 0, 0]);
    h.extend_from_slice(&layout.block_size.to_le_bytes());
    h.extend_from_slice(&layout.num_layers.to_le_bytes());
    h.extend_from_slice(&layout.kv_heads.to_le_bytes());
    h.extend_from_slice(&layout.head_dim.to_le_bytes());
    h.extend_from_slice(&layout.block_bytes.to_le_bytes());
    h.extend_from_slice(&payload_checksum.to_le_bytes());
    for t in tokens {
        h.extend_from_slice(&t.to_le_bytes());
    }
    let checksum = xxh3_64(&h);
    h.extend_from_slice(&checksum.to_le_bytes());
    h
}

/// Whether the process named in a temp file's name (`.{name}.tmp-{pid}-{n}`) may still be
/// writing it: a live process other than this one, which has written nothing when it scans.
/// Without /proc to ask, or with a name we cannot read, assume it may.
fn writer_may_be_alive(temp_name: &str) -> bool {
    let pid = temp_name
        .rsplit_once(".tmp-")
        .and_then(|(_, rest)| rest.split('-').next())
        .and_then(|pid| pid.parse::<u32>().ok());
    let Some(pid) = pid else { return true };
    if pid == std::process::id() {
        return false;
    }
    let proc = Path::new("/proc");
    !proc.join("self").exists() || proc.join(pid.to_string()).exists()
}

/// Little-endian reads from a header whose length the caller checked.
fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Verifies a header read from a file (`header_len` bytes, sized from the layout, never from the
/// file) against the layout and the expected hash; its tokens and payload checksum when it passes,
/// else what was wrong.
fn check_header(layout: &BlockLayout, hash: u64, h: &[u8]) -> Result<(Box<[u32]>, u64), String> {
    let len = layout.header_len();
    if h.len() != len {
        return Err(format!("header of {} bytes, expected {len}", h.len()));
    }
    if &h[..8] != MAGIC {
        return Err("bad magic".into());
    }
    let version = le_u32(h, 8);
    if version != VERSION {
        return Err(format!("version {version}, expected {VERSION}"));
    }
    let stored = le_u64(h, len - 8);
    if xxh3_64(&h[..len - 8]) != stored {
        return Err("header checksum mismatch".into());
    }
    let fields: [(&str, u64, u64); 9] = [
        ("salt", le_u64(h, 12), layout.salt),
        ("hash", le_u64(h, 20), hash),
        ("kv_dtype", u64::from(h[28]), u64::from(layout.kv_dtype)),
        (
            "pad",
            u64::from(h[29]) | u64::from(h[30]) | u64::from(h[31]),
            0,
        ),
        (
            "block_size",
            u64::from(le_u32(h, 32)),
            u64::from(layout.block_size),
        ),
        (
            "num_layers",
            u64::from(le_u32(h, 36)),
            u64::from(layout.num_layers),
        ),
        (
            "kv_heads",
            u64::from(le_u32(h, 40)),
            u64::from(layout.kv_heads),
        ),
        (
            "head_dim",
            u64::from(le_u32(h, 44)),
            u64::from(layout.head_dim),
        ),
        ("payload_len", le_u64(h, 48), layout.block_bytes),
    ];
    for (name, got, want) in fields {
        if got != want {
            return Err(format!("{name} {got:#x}, expected {want:#x}"));
        }
    }
    let tokens = h[FIXED_HEADER..len - 8]
        .chunks_exact(4)
        .map(|c| le_u32(c, 0))
        .collect();
    Ok((tokens, le_u64(h, 56)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const SALT: u64 = 0x0123_4567_89ab_cdef;

    fn layout() -> BlockLayout {
        BlockLayout {
            salt: SALT,
            kv_dtype: 1,
            block_size: 4,
            num_layers: 2,
            kv_heads: 2,
            head_dim: 4,
            block_bytes: 64,
        }
    }

    /// 64 (fixed) + 4 * 4 (tokens) + 8 (checksum) + 64 (payload).
    const FILE_LEN: u64 = 152;

    fn opts(dir: &Path, budget_bytes: u64) -> DiskOptions {
        DiskOptions {
            dir: dir.to_path_buf(),
            budget_bytes,
            max_age_days: 30.0,
        }
    }

    fn open(dir: &Path, budget: u64) -> (DiskTier, ScanReport) {
        DiskTier::open(opts(dir, budget), layout()).unwrap()
    }

    fn payload(seed: u8) -> Vec<u8> {
        (0..64u8)
            .map(|i| i.wrapping_mul(7).wrapping_add(seed))
            .collect()
    }

    fn tokens(seed: u32) -> [u32; 4] {
        [seed, seed + 1, 1000 + seed, 70_000 + seed]
    }

    fn flip(path: &Path, at: u64) {
        let mut bytes = fs::read(path).unwrap();
        bytes[at as usize] ^= 0x10;
        fs::write(path, bytes).unwrap();
    }

    fn set_age(path: &Path, secs: u64) {
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(secs))
            .unwrap();
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn write_read_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, report) = open(d.path(), 1 << 20);
        assert_eq!(report, ScanReport::default());
        assert!(t.write(7, &tokens(1), &payload(3)).unwrap());
        assert_eq!((t.len(), t.bytes()), (1, FILE_LEN));
        assert_eq!(fs::metadata(t.path_of(7)).unwrap().len(), FILE_LEN);
        assert_eq!(names(d.path()), vec![format!("{SALT:016x}-{:016x}.kvb", 7)]);
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(t.path_of(7)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "conversations are the owner's only");

        let mut out = vec![0u8; 64];
        t.read(7, &tokens(1), &mut out).unwrap();
        assert_eq!(out, payload(3));
        // Same block again: nothing written.
        assert!(!t.write(7, &tokens(1), &payload(3)).unwrap());
        assert!(t.contains(7, &tokens(1)));
        assert!(!t.contains(7, &tokens(2)));
        assert!(!t.contains(8, &tokens(1)));
        assert!(matches!(
            t.read(8, &tokens(1), &mut out),
            Err(DiskError::Missing)
        ));

        // Other tokens under the same hash: the file is dropped.
        let err = t.read(7, &tokens(2), &mut out).unwrap_err();
        assert!(matches!(err, DiskError::Corrupt(_)), "{err}");
        assert!(
            err.to_string().contains(&format!("{:016x}.kvb", 7)),
            "{err}"
        );
        assert!(!t.path_of(7).exists());
        assert!(t.is_empty());
    }

    #[test]
    fn bad_arguments_are_invalid_input() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 1 << 20);
        let is_invalid = |r: Result<bool, DiskError>| matches!(r, Err(DiskError::Io(e)) if e.kind() == io::ErrorKind::InvalidInput);
        assert!(is_invalid(t.write(1, &tokens(1), &payload(0)[..63])));
        assert!(is_invalid(t.write(1, &tokens(1)[..3], &payload(0))));
        assert!(t.write(1, &tokens(1), &payload(0)).unwrap());
        let mut short = vec![0u8; 10];
        assert!(matches!(
            t.read(1, &tokens(1), &mut short),
            Err(DiskError::Io(e)) if e.kind() == io::ErrorKind::InvalidInput
        ));
        // A caller's mistake does not cost the block.
        assert!(t.contains(1, &tokens(1)));
    }

    #[test]
    fn hash_collision_write_replaces_block() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 1 << 20);
        assert!(t.write(5, &tokens(1), &payload(1)).unwrap());
        assert!(t.write(5, &tokens(2), &payload(2)).unwrap());
        assert_eq!(t.len(), 1);
        assert!(t.contains(5, &tokens(2)) && !t.contains(5, &tokens(1)));
        let mut out = vec![0u8; 64];
        t.read(5, &tokens(2), &mut out).unwrap();
        assert_eq!(out, payload(2));
    }

    #[test]
    fn created_folders_are_the_owners_only() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("a").join("kv");
        open(&dir, 1 << 20);
        assert_eq!(
            fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
    }

    #[test]
    fn reopen_adopts_and_reads() {
        let d = tempfile::tempdir().unwrap();
        {
            let (mut t, _) = open(d.path(), 1 << 20);
            t.write(42, &tokens(9), &payload(9)).unwrap();
        }
        let (mut t, report) = open(d.path(), 1 << 20);
        assert_eq!(
            report,
            ScanReport {
                adopted: 1,
                adopted_bytes: FILE_LEN,
                ..ScanReport::default()
            }
        );
        assert!(t.contains(42, &tokens(9)));
        let mut out = vec![0u8; 64];
        t.read(42, &tokens(9), &mut out).unwrap();
        assert_eq!(out, payload(9));
    }

    #[test]
    fn a_block_another_process_wrote_is_found_and_read() {
        let d = tempfile::tempdir().unwrap();
        let (mut a, _) = open(d.path(), 1 << 20);
        let (mut b, _) = open(d.path(), 1 << 20);
        a.write(42, &tokens(9), &payload(9)).unwrap();
        assert!(
            !b.contains(42, &tokens(9)),
            "not known before it is looked for"
        );
        assert!(
            !b.find(42, &tokens(8)),
            "other tokens under the hash: not ours"
        );
        assert!(b.find(42, &tokens(9)));
        assert_eq!(b.adopted_later(), 1);
        let mut out = vec![0u8; 64];
        b.read(42, &tokens(9), &mut out).unwrap();
        assert_eq!(out, payload(9));
        assert!(!b.find(43, &tokens(9)), "no file, nothing found");
        assert_eq!(
            names(d.path()).len(),
            1,
            "the collision check deleted nothing"
        );
    }

    #[test]
    fn the_budget_holds_for_the_folder_shared_by_two_tiers() {
        let d = tempfile::tempdir().unwrap();
        let budget = 4 * FILE_LEN;
        let (mut a, _) = open(d.path(), budget);
        let (mut b, _) = open(d.path(), budget);
        for i in 0..3 {
            a.write(100 + i, &tokens(i as u32), &payload(i as u8))
                .unwrap();
        }
        for i in 0..3 {
            b.write(200 + i, &tokens(i as u32), &payload(i as u8))
                .unwrap();
            assert!(names(d.path()).len() as u64 * FILE_LEN <= budget);
        }
        // b made room by deleting a's oldest files, never its own newer ones.
        let left = names(d.path());
        assert_eq!(left.len(), 4, "{left:?}");
        for i in 0..3 {
            assert!(b.contains(200 + i, &tokens(i as u32)));
        }
        assert!(a.contains(102, &tokens(2)) && b.contains(102, &tokens(2)));
        // a sees the deletions at its next write, and reading a deleted file says Missing.
        let mut out = vec![0u8; 64];
        assert!(matches!(
            a.read(100, &tokens(0), &mut out),
            Err(DiskError::Missing)
        ));
        a.write(103, &tokens(3), &payload(3)).unwrap();
        assert_eq!(names(d.path()).len(), 4);
        assert_eq!(a.len(), 4, "a's index is the folder's");
    }

    #[test]
    fn foreign_files_are_left_alone() {
        let d = tempfile::tempdir().unwrap();
        let other = BlockLayout {
            salt: 0xfeed,
            ..layout()
        };
        let (mut o, _) = DiskTier::open(opts(d.path(), 1 << 20), other).unwrap();
        o.write(42, &tokens(9), &payload(9)).unwrap();
        let foreign = o.path_of(42);
        fs::write(d.path().join("notes.txt"), b"hello").unwrap();
        fs::write(d.path().join(format!("{SALT:016x}-readme.txt")), b"x").unwrap();
        fs::create_dir(d.path().join(format!("{SALT:016x}-{:016x}.kvb", 3))).unwrap();

        let (t, report) = open(d.path(), 1 << 20);
        assert_eq!(report, ScanReport::default());
        assert_eq!((t.len(), t.bytes()), (0, 0));
        assert!(foreign.exists());
        assert_eq!(names(d.path()).len(), 4);

        // Emptying our tier by age still leaves them.
        let (_, report) = DiskTier::open(
            DiskOptions {
                max_age_days: 0.0,
                ..opts(d.path(), 1 << 20)
            },
            layout(),
        )
        .unwrap();
        assert_eq!(report, ScanReport::default());
        assert_eq!(names(d.path()).len(), 4);
    }

    #[test]
    fn other_layout_of_our_salt_is_corrupt() {
        let variants = [
            BlockLayout {
                kv_dtype: 2,
                ..layout()
            },
            BlockLayout {
                block_size: 8,
                ..layout()
            },
            BlockLayout {
                num_layers: 3,
                ..layout()
            },
            BlockLayout {
                head_dim: 8,
                block_bytes: 128,
                ..layout()
            },
        ];
        for other in variants {
            let d = tempfile::tempdir().unwrap();
            let (mut o, _) = DiskTier::open(opts(d.path(), 1 << 20), other).unwrap();
            let toks: Vec<u32> = (0..other.block_size).collect();
            o.write(42, &toks, &vec![1u8; other.block_bytes as usize])
                .unwrap();
            let path = o.path_of(42);
            let (t, report) = open(d.path(), 1 << 20);
            assert_eq!(report.corrupt_deleted, 1, "{other:?}");
            assert_eq!(report.adopted, 0);
            assert!(t.is_empty() && !path.exists());
        }
    }

    #[test]
    fn truncated_file_is_corrupt_at_scan() {
        for keep in [FILE_LEN - 1, 10, 0] {
            let d = tempfile::tempdir().unwrap();
            let path = {
                let (mut t, _) = open(d.path(), 1 << 20);
                t.write(42, &tokens(9), &payload(9)).unwrap();
                t.path_of(42)
            };
            File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(keep)
                .unwrap();
            let (t, report) = open(d.path(), 1 << 20);
            assert_eq!(report.corrupt_deleted, 1, "kept {keep}");
            assert!(t.is_empty() && !path.exists());
        }
    }

    #[test]
    fn payload_bit_flip_is_caught_at_read() {
        let d = tempfile::tempdir().unwrap();
        let path = {
            let (mut t, _) = open(d.path(), 1 << 20);
            t.write(42, &tokens(9), &payload(9)).unwrap();
            t.path_of(42)
        };
        flip(&path, FILE_LEN - 64 + 5);
        let (mut t, report) = open(d.path(), 1 << 20);
        assert_eq!(report.adopted, 1);
        let mut out = vec![0u8; 64];
        let err = t.read(42, &tokens(9), &mut out).unwrap_err();
        assert!(matches!(err, DiskError::Corrupt(_)), "{err}");
        assert!(err.to_string().contains("payload checksum"), "{err}");
        assert!(!path.exists() && t.is_empty());
    }

    #[test]
    fn header_bit_flip_is_corrupt_at_scan() {
        // In a token, in the checksum itself, in a layout field, in the magic.
        for at in [66, FILE_LEN - 64 - 1, 41, 0] {
            let d = tempfile::tempdir().unwrap();
            let path = {
                let (mut t, _) = open(d.path(), 1 << 20);
                t.write(42, &tokens(9), &payload(9)).unwrap();
                t.path_of(42)
            };
            flip(&path, at);
            let (t, report) = open(d.path(), 1 << 20);
            assert_eq!(report.corrupt_deleted, 1, "flip at {at}");
            assert!(t.is_empty() && !path.exists());
        }
    }

    #[test]
    fn header_flip_after_open_is_corrupt_at_read() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 1 << 20);
        t.write(42, &tokens(9), &payload(9)).unwrap();
        flip(&t.path_of(42), 70);
        let mut out = vec![0u8; 64];
        let err = t.read(42, &tokens(9), &mut out).unwrap_err();
        assert!(err.to_string().contains("header checksum"), "{err}");
        assert!(!t.path_of(42).exists() && t.is_empty());
    }

    #[test]
    fn hostile_header_is_rejected_without_allocating() {
        // A valid header checksum over absurd block_size and payload_len: the length check and
        // the field checks reject it; nothing is sized from the file.
        let d = tempfile::tempdir().unwrap();
        let huge = BlockLayout {
            block_size: 4,
            block_bytes: u64::MAX,
            ..layout()
        };
        let mut h = encode_header(&huge, 42, &tokens(9), 0);
        h[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
        let n = h.len() - 8;
        let c = xxh3_64(&h[..n]);
        h[n..].copy_from_slice(&c.to_le_bytes());
        h.extend_from_slice(&payload(0));
        let path = d.path().join(file_name(SALT, 42));
        fs::write(&path, &h).unwrap();
        let (_, report) = open(d.path(), 1 << 20);
        assert_eq!(report.corrupt_deleted, 1);
        assert!(!path.exists());
    }

    #[test]
    fn vanished_file_reads_missing() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 1 << 20);
        t.write(42, &tokens(9), &payload(9)).unwrap();
        fs::remove_file(t.path_of(42)).unwrap();
        let mut out = vec![0u8; 64];
        assert!(matches!(
            t.read(42, &tokens(9), &mut out),
            Err(DiskError::Missing)
        ));
        assert!(t.is_empty());
    }

    #[test]
    fn remove_deletes_and_forgets() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 1 << 20);
        t.write(42, &tokens(9), &payload(9)).unwrap();
        t.remove(42);
        assert!(t.is_empty() && !t.path_of(42).exists());
        t.remove(42);
    }

    #[test]
    fn budget_evicts_least_recently_used() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 2 * FILE_LEN);
        let mut out = vec![0u8; 64];
        t.write(1, &tokens(1), &payload(1)).unwrap();
        t.write(2, &tokens(2), &payload(2)).unwrap();
        // A read refreshes 1: 2 is now the oldest.
        t.read(1, &tokens(1), &mut out).unwrap();
        t.write(3, &tokens(3), &payload(3)).unwrap();
        assert!(t.contains(1, &tokens(1)) && t.contains(3, &tokens(3)));
        assert!(!t.contains(2, &tokens(2)) && !t.path_of(2).exists());
        assert_eq!(t.bytes(), 2 * FILE_LEN);

        // A touch refreshes 1 again: 3 goes next.
        t.touch(1);
        t.write(4, &tokens(4), &payload(4)).unwrap();
        assert!(t.contains(1, &tokens(1)) && t.contains(4, &tokens(4)));
        assert!(!t.path_of(3).exists());
        // A rewrite of a held block touches it too: 4 goes next.
        assert!(!t.write(1, &tokens(1), &payload(1)).unwrap());
        t.write(5, &tokens(5), &payload(5)).unwrap();
        assert!(t.contains(1, &tokens(1)) && !t.path_of(4).exists());
        assert_eq!(names(d.path()).len(), 2);
    }

    #[test]
    fn block_bigger_than_budget_is_no_room() {
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), FILE_LEN - 1);
        let err = t.write(1, &tokens(1), &payload(1)).unwrap_err();
        assert!(
            matches!(err, DiskError::NoRoom { need: FILE_LEN, budget } if budget == FILE_LEN - 1),
            "{err}"
        );
        assert!(names(d.path()).is_empty());
    }

    #[test]
    fn over_budget_at_open_trims_oldest() {
        let d = tempfile::tempdir().unwrap();
        {
            let (mut t, _) = open(d.path(), 1 << 20);
            for h in 1..=3u32 {
                t.write(u64::from(h), &tokens(h), &payload(h as u8))
                    .unwrap();
            }
            // Written 1, 2, 3, but aged so that 2 is the oldest, then 3, then 1.
            set_age(&t.path_of(2), 300);
            set_age(&t.path_of(3), 200);
            set_age(&t.path_of(1), 100);
        }
        let (mut t, report) = open(d.path(), 2 * FILE_LEN);
        assert_eq!(
            report,
            ScanReport {
                adopted: 2,
                adopted_bytes: 2 * FILE_LEN,
                over_budget_deleted: 1,
                ..ScanReport::default()
            }
        );
        assert!(!t.path_of(2).exists());
        // Adopted in mtime order: 3 is the least recently used.
        t.write(4, &tokens(4), &payload(4)).unwrap();
        assert!(t.contains(1, &tokens(1)) && !t.contains(3, &tokens(3)));
        assert!(!t.path_of(3).exists());
    }

    #[test]
    fn max_age_zero_empties_ours() {
        let d = tempfile::tempdir().unwrap();
        {
            let (mut t, _) = open(d.path(), 1 << 20);
            t.write(1, &tokens(1), &payload(1)).unwrap();
            t.write(2, &tokens(2), &payload(2)).unwrap();
        }
        fs::write(d.path().join("foreign.bin"), b"x").unwrap();
        let (t, report) = DiskTier::open(
            DiskOptions {
                max_age_days: 0.0,
                ..opts(d.path(), 1 << 20)
            },
            layout(),
        )
        .unwrap();
        assert_eq!(
            report,
            ScanReport {
                expired_deleted: 2,
                ..ScanReport::default()
            }
        );
        assert!(t.is_empty());
        assert_eq!(names(d.path()), vec!["foreign.bin".to_string()]);
    }

    #[test]
    fn old_file_is_expired() {
        let d = tempfile::tempdir().unwrap();
        {
            let (mut t, _) = open(d.path(), 1 << 20);
            t.write(1, &tokens(1), &payload(1)).unwrap();
            t.write(2, &tokens(2), &payload(2)).unwrap();
            set_age(&t.path_of(1), 3 * 86_400);
        }
        let (t, report) = DiskTier::open(
            DiskOptions {
                max_age_days: 1.0,
                ..opts(d.path(), 1 << 20)
            },
            layout(),
        )
        .unwrap();
        assert_eq!(
            report,
            ScanReport {
                adopted: 1,
                adopted_bytes: FILE_LEN,
                expired_deleted: 1,
                ..ScanReport::default()
            }
        );
        assert!(!t.path_of(1).exists() && t.contains(2, &tokens(2)));
    }

    #[test]
    fn leftover_temp_is_deleted() {
        let d = tempfile::tempdir().unwrap();
        // pid 1 is always alive: only the age can make its temp files leftovers.
        let ours = d.path().join(format!(".{}.tmp-1-0", file_name(SALT, 9)));
        let theirs = d.path().join(format!(".{}.tmp-1-0", file_name(0xfeed, 9)));
        // Another live process's write in progress: recent, so left alone.
        let in_progress = d.path().join(format!(".{}.tmp-1-1", file_name(SALT, 8)));
        // Recent, but its writer has exited (a crash a moment ago) or is this very process.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let dead = d
            .path()
            .join(format!(".{}.tmp-{}-0", file_name(SALT, 7), child.id()));
        let mine = d.path().join(format!(
            ".{}.tmp-{}-5",
            file_name(SALT, 6),
            std::process::id()
        ));
        for p in [&ours, &theirs, &in_progress, &dead, &mine] {
            fs::write(p, b"partial").unwrap();
        }
        let stale = SystemTime::now() - std::time::Duration::from_secs(3600);
        for p in [&ours, &theirs] {
            File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(stale)
                .unwrap();
        }
        let (_, report) = open(d.path(), 1 << 20);
        assert!(in_progress.exists(), "a recent temp file may be in use");
        assert_eq!(
            report,
            ScanReport {
                temp_deleted: 3,
                ..ScanReport::default()
            }
        );
        assert!(!ours.exists() && theirs.exists());
        assert!(!dead.exists() && !mine.exists());
    }

    #[test]
    fn failed_rename_leaves_no_temp() {
        // A directory in the way of the final name makes the rename fail, even for root.
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 1 << 20);
        fs::create_dir(t.path_of(1)).unwrap();
        fs::write(t.path_of(1).join("x"), b"x").unwrap();
        let err = t.write(1, &tokens(1), &payload(1)).unwrap_err();
        assert!(matches!(err, DiskError::Io(_)), "{err}");
        assert!(t.is_empty());
        assert_eq!(names(d.path()), vec![file_name(SALT, 1)]);
    }

    #[test]
    fn write_into_vanished_dir_fails() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("kv");
        let (mut t, _) = open(&dir, 1 << 20);
        fs::remove_dir(&dir).unwrap();
        assert!(matches!(
            t.write(1, &tokens(1), &payload(1)),
            Err(DiskError::Io(_))
        ));
        assert!(t.is_empty() && !dir.exists());
    }

    #[cfg(unix)]
    #[test]
    fn write_into_read_only_dir_fails_cleanly() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let (mut t, _) = open(d.path(), 1 << 20);
        let set_mode = |mode| {
            fs::set_permissions(d.path(), fs::Permissions::from_mode(mode)).unwrap();
        };
        set_mode(0o555);
        // Root ignores permissions: nothing to test then.
        let probe = d.path().join("probe");
        if File::create(&probe).is_ok() {
            fs::remove_file(&probe).ok();
            set_mode(0o755);
            return;
        }
        let result = t.write(1, &tokens(1), &payload(1));
        set_mode(0o755);
        let err = result.unwrap_err();
        assert!(matches!(err, DiskError::Io(_)), "{err}");
        assert!(err.to_string().contains(".tmp-"), "{err}");
        assert!(t.is_empty());
        assert!(names(d.path()).is_empty());
    }
}
