//! The RAM gate of the conversation cache.
//!
//! Before the cache takes host memory (a host-tier block copy, a staging buffer) it asks the gate
//! whether `need` bytes may be taken. The gate admits when `need + floor <= available`, where
//! `available` is `MemAvailable` from /proc/meminfo, or the cgroup's room when the process runs in
//! a memory-limited cgroup and that room is smaller. Telemetry that cannot be read or parsed
//! refuses: guessing wrong here means the OOM killer, so the gate never guesses.
//!
//! Reading the telemetry costs about a third of offloading one block (/proc/meminfo is generated
//! on each read; docs/benchmarks.md, "Figures behind code comments"). So the system gate lets
//! one reading serve admissions for up to a second and up to 64 MiB, each counted against it; a
//! refusal is always decided on a fresh reading. What others allocate within that second is what the floor
//! (`host_min_free_mib`, 1 GiB by default) is there for; 64 MiB is a small part of it.
//!
//! Off Linux: on macOS `available` is what the Mach VM statistics (`host_statistics64`) count as
//! free (less the speculative pages) plus inactive, psutil's `virtual_memory().available` there;
//! macOS has no cgroups. Any other system has no source the gate knows: it refuses every
//! admission (the host tier then stays empty and evicted blocks go to disk, as when the
//! telemetry cannot be read on Linux) and says so once, when the system gate is made.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A cgroup v1 limit at or above this is the kernel's "no limit" (it prints 9223372036854771712,
/// i64::MAX rounded down to a page), not a real limit.
const V1_NO_LIMIT: u64 = 1 << 60;

const MIB: u64 = 1 << 20;

/// Where the process's cgroup memory counters are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupMemory {
    /// No memory controller found: no cgroup limit applies.
    None,
    /// A cgroup v1 memory directory (memory.limit_in_bytes, memory.usage_in_bytes).
    V1(PathBuf),
    /// A cgroup v2 directory (memory.max, memory.current).
    V2(PathBuf),
}

impl CgroupMemory {
    /// Finds the process's memory cgroup from a `/proc/self/cgroup`-format file and the cgroup
    /// mount root (normally /sys/fs/cgroup). v2: the "0::<path>" line -> root/<path> if it has
    /// memory.max, else root itself if it has memory.max. v1: the line whose controller list
    /// contains "memory" -> root/memory/<path> if it has memory.limit_in_bytes, else root/memory
    /// if it has memory.limit_in_bytes. Nothing found -> None.
    pub fn detect(proc_self_cgroup: &Path, root: &Path) -> CgroupMemory {
        // An unreadable cgroup file means we cannot place the process; treat as no cgroup,
        // the same as a machine without the memory controller.
        let Ok(text) = std::fs::read_to_string(proc_self_cgroup) else {
            return CgroupMemory::None;
        };
        let mut v1_path = None;
        let mut v2_path = None;
        for line in text.lines() {
            // "hierarchy-ID:controller-list:cgroup-path"; the path may itself contain ':'.
            let mut parts = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            if id == "0" && controllers.is_empty() {
                v2_path = Some(path);
            } else if controllers.split(',').any(|c| c == "memory") {
                v1_path = Some(path);
            }
        }
        // A controller lives in one hierarchy only, so a v1 memory line means the memory
        // counters are in v1 even on a hybrid system that also has a "0::" line.
        if let Some(path) = v1_path {
            let base = root.join("memory");
            for dir in [join_cgroup(&base, path), base.clone()] {
                if dir.join("memory.limit_in_bytes").is_file() {
                    return CgroupMemory::V1(dir);
                }
            }
        }
        if let Some(path) = v2_path {
            for dir in [join_cgroup(root, path), root.to_path_buf()] {
                if dir.join("memory.max").is_file() {
                    return CgroupMemory::V2(dir);
                }
            }
        }
        CgroupMemory::None
    }
}

/// `base/<path>`; the cgroup path is absolute ("/user.slice/x"), and `Path::join` with an
/// absolute path would replace `base`, so the leading '/' is stripped first.
fn join_cgroup(base: &Path, cgroup_path: &str) -> PathBuf {
    base.join(cgroup_path.trim_start_matches('/'))
}

/// How long the system gate admits on one reading of the telemetry.
const SYSTEM_SAMPLE_TTL: Duration = Duration::from_secs(1);

/// How much one reading may admit before the gate reads again.
const SAMPLE_MAX_ADMITTED: u64 = 64 * MIB;

/// Where the gate reads the memory the system has available.
#[derive(Debug)]
enum Source {
    /// `MemAvailable` from a /proc/meminfo-format file (Linux; on any system in tests).
    Meminfo(PathBuf),
    /// The Mach VM statistics.
    #[cfg(target_os = "macos")]
    Mach,
    /// No source on this system: every admission refuses with [`UNSUPPORTED`].
    #[cfg(any(test, not(any(target_os = "linux", target_os = "macos"))))]
    Unsupported,
}

/// The refusal reason on a system with no memory telemetry the gate can read.
#[cfg(any(test, not(any(target_os = "linux", target_os = "macos"))))]
const UNSUPPORTED: &str =
    "no memory telemetry on this system (the RAM gate reads Linux's /proc/meminfo and macOS's \
     Mach VM statistics)";

/// Decides whether the cache may take host memory.
#[derive(Debug)]
pub struct RamGate {
    source: Source,
    cgroup: CgroupMemory,
    floor: u64,
    sample_ttl: Duration,
    sample: Mutex<Option<Sample>>,
}

/// A reading of the telemetry and what the gate admitted since.
#[derive(Clone, Copy, Debug)]
struct Sample {
    taken: Instant,
    available: u64,
    admitted: u64,
}

/// Why the gate refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamRefusal {
    pub need: u64,
    pub floor: u64,
    /// None when the telemetry could not be read; `reason` then says why.
    pub available: Option<u64>,
    pub reason: String,
}

impl fmt::Display for RamRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.available {
            Some(available) => write!(
                f,
                "RAM gate, need {} + {} floor, {} available",
                mib(self.need),
                mib(self.floor),
                mib(available)
            ),
            None => write!(f, "RAM gate, memory telemetry unknown: {}", self.reason),
        }
    }
}

/// "2915 MiB", or "0.35 MiB" below 1 MiB so that small block copies do not read as 0.
fn mib(bytes: u64) -> String {
    if bytes < MIB {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

impl RamGate {
    /// This system's gate. Linux: /proc/meminfo and the process's cgroup
    /// (detect("/proc/self/cgroup", "/sys/fs/cgroup")). macOS: the Mach VM statistics. Elsewhere:
    /// a gate that refuses everything, with a warning logged here.
    pub fn system(floor_bytes: u64) -> RamGate {
        #[cfg(target_os = "linux")]
        let gate = {
            let cgroup =
                CgroupMemory::detect(Path::new("/proc/self/cgroup"), Path::new("/sys/fs/cgroup"));
            RamGate::with_paths(PathBuf::from("/proc/meminfo"), cgroup, floor_bytes)
        };
        #[cfg(target_os = "macos")]
        let gate = RamGate::with_source(Source::Mach, CgroupMemory::None, floor_bytes);
        #[cfg(not(any(target_os = "linux", target_os = "macos")))]
        let gate = {
            log::warn!("{UNSUPPORTED}: the conversation cache's host RAM tier stays off");
            RamGate::with_source(Source::Unsupported, CgroupMemory::None, floor_bytes)
        };
        gate.with_sample_ttl(SYSTEM_SAMPLE_TTL)
    }

    /// A gate on these files that reads them at every admission (no reuse of a reading).
    pub fn with_paths(meminfo: PathBuf, cgroup: CgroupMemory, floor_bytes: u64) -> RamGate {
        RamGate::with_source(Source::Meminfo(meminfo), cgroup, floor_bytes)
    }

    fn with_source(source: Source, cgroup: CgroupMemory, floor_bytes: u64) -> RamGate {
        RamGate {
            source,
            cgroup,
            floor: floor_bytes,
            sample_ttl: Duration::ZERO,
            sample: Mutex::new(None),
        }
    }

    /// Admissions may use a reading up to `ttl` old (and up to 64 MiB), less what was admitted
    /// since.
    pub fn with_sample_ttl(mut self, ttl: Duration) -> RamGate {
        self.sample_ttl = ttl;
        self
    }

    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// Bytes the cache may count on: min(MemAvailable, cgroup room); Err(reason) when unknown.
    pub fn available(&self) -> Result<u64, String> {
        let mem_available = match &self.source {
            Source::Meminfo(path) => read_mem_available(path)?,
            #[cfg(target_os = "macos")]
            Source::Mach => mach_available()?,
            #[cfg(any(test, not(any(target_os = "linux", target_os = "macos"))))]
            Source::Unsupported => return Err(UNSUPPORTED.to_string()),
        };
        let room = match &self.cgroup {
            CgroupMemory::None => None,
            CgroupMemory::V2(dir) => {
                // memory.max is "max" when the cgroup has no limit.
                let max = read_file(&dir.join("memory.max"))?;
                if max.trim() == "max" {
                    None
                } else {
                    let max = parse_bytes(&dir.join("memory.max"), &max)?;
                    let current = read_bytes(&dir.join("memory.current"))?;
                    Some(max.saturating_sub(current))
                }
            }
            CgroupMemory::V1(dir) => {
                let limit = read_bytes(&dir.join("memory.limit_in_bytes"))?;
                if limit >= V1_NO_LIMIT {
                    None
                } else {
                    let usage = read_bytes(&dir.join("memory.usage_in_bytes"))?;
                    Some(limit.saturating_sub(usage))
                }
            }
        };
        Ok(match room {
            Some(room) => mem_available.min(room),
            None => mem_available,
        })
    }

    /// Ok when need + floor <= available, where available is a fresh reading, or one younger than
    /// the sample TTL less what was admitted since. A refusal always comes from a fresh reading.
    pub fn admit(&self, need: u64) -> Result<(), RamRefusal> {
        let refusal = |available: Option<u64>, reason: String| RamRefusal {
            need,
            floor: self.floor,
            available,
            reason,
        };
        // checked_add: a need so large that need + floor overflows can never be admitted.
        let total = need.checked_add(self.floor);
        let fits = |left: u64| total.is_some_and(|t| t <= left);
        let mut sample = crate::sync::lock(&self.sample);
        if let Some(s) = sample.as_mut() {
            let young = s.taken.elapsed() < self.sample_ttl;
            let within = s.admitted.saturating_add(need) <= SAMPLE_MAX_ADMITTED;
            if young && within && fits(s.available.saturating_sub(s.admitted)) {
                s.admitted += need;
                return Ok(());
            }
        }
        let available = match self.available() {
            Ok(a) => a,
            Err(reason) => {
                *sample = None;
                return Err(refusal(None, reason));
            }
        };
        let admitted = fits(available);
        *sample = Some(Sample {
            taken: Instant::now(),
            available,
            admitted: if admitted { need } else { 0 },
        });
        if admitted {
            Ok(())
        } else {
            Err(refusal(
                Some(available),
                "need + floor exceeds available memory".to_string(),
            ))
        }
    }
}

/// The file's text, or "cannot read <path>: <error>".
fn read_file(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {}", path.display(), os_message(&e)))
}

/// The io error's message without the " (os error N)" suffix, e.g. "No such file or directory".
fn os_message(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.split_once(" (os error ") {
        Some((message, _)) => message.to_string(),
        None => s,
    }
}

/// A file holding a single byte count (memory.current, memory.limit_in_bytes, ...).
fn read_bytes(path: &Path) -> Result<u64, String> {
    let text = read_file(path)?;
    parse_bytes(path, &text)
}

fn parse_bytes(path: &Path, text: &str) -> Result<u64, String> {
    let t = text.trim();
    t.parse::<u64>().map_err(|_| {
        format!(
            "cannot parse {}: {:?} is not a byte count",
            path.display(),
            shorten(t)
        )
    })
}

/// At most 40 characters of file content, so a garbage file cannot flood the reason.
fn shorten(s: &str) -> String {
    s.chars().take(40).collect()
}

/// MemAvailable from a /proc/meminfo-format file, in bytes.
fn read_mem_available(path: &Path) -> Result<u64, String> {
    let text = read_file(path)?;
    let Some((line, rest)) = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:").map(|rest| (l, rest)))
    else {
        return Err(format!("{} has no MemAvailable line", path.display()));
    };
    let bad = || format!("cannot parse {}: {:?}", path.display(), shorten(line));
    // "MemAvailable:   12345678 kB"; the kernel always writes kB (1024 bytes).
    let mut fields = rest.split_whitespace();
    let value: u64 = fields.next().and_then(|v| v.parse().ok()).ok_or_else(bad)?;
    match (fields.next(), fields.next()) {
        (Some("kB"), None) => Ok(value.saturating_mul(1024)),
        (None, None) => Ok(value),
        _ => Err(bad()),
    }
}

/// What the Mach VM statistics count as available, in bytes.
#[cfg(target_os = "macos")]
fn mach_available() -> Result<u64, String> {
    use std::sync::OnceLock;
    // One send right to the host port for the process's life (each mach_host_self call adds a
    // reference to it).
    static HOST: OnceLock<libc::mach_port_t> = OnceLock::new();
    // SAFETY: no arguments; returns the host port's name.
    #[allow(deprecated)] // libc points to the mach2 crate; this one call does not need it
    let host = *HOST.get_or_init(|| unsafe { libc::mach_host_self() });
    // SAFETY: plain integers; host_statistics64 fills at most `count` of its 32-bit words.
    let mut stats: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: `stats` holds `count` words; both pointers are valid for the call.
    let kr = unsafe {
        libc::host_statistics64(
            host,
            libc::HOST_VM_INFO64,
            (&raw mut stats).cast(),
            &mut count,
        )
    };
    if kr != libc::KERN_SUCCESS {
        return Err(format!("host_statistics64 failed (kern_return_t {kr})"));
    }
    // SAFETY: sysconf has no memory arguments.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| format!("sysconf(_SC_PAGESIZE) gave {page}"))?;
    // Copies, not references: the struct is packed.
    let (free, speculative, inactive) = (
        stats.free_count,
        stats.speculative_count,
        stats.inactive_count,
    );
    Ok(mach_available_bytes(free, speculative, inactive, page))
}

/// macOS's available memory from its VM page counts, as psutil computes `available` there:
/// free pages less the speculative ones (the kernel counts speculative read-ahead pages in
/// `free_count`; `vm_stat` subtracts them too) plus inactive pages, times the page size.
#[cfg(any(test, target_os = "macos"))]
fn mach_available_bytes(free: u32, speculative: u32, inactive: u32, page: u64) -> u64 {
    let pages = u64::from(free.saturating_sub(speculative)) + u64::from(inactive);
    pages.saturating_mul(page)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use tempfile::TempDir;

    const KB: u64 = 1024;

    /// A meminfo file with MemAvailable = `kb` kB.
    fn meminfo(dir: &TempDir, kb: u64) -> PathBuf {
        let path = dir.path().join("meminfo");
        fs::write(
            &path,
            format!("MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   {kb} kB\nBuffers:          100 kB\n"),
        )
        .unwrap();
        path
    }

    fn v2_dir(dir: &TempDir, max: &str, current: &str) -> PathBuf {
        let cg = dir.path().join("cg");
        fs::create_dir_all(&cg).unwrap();
        fs::write(cg.join("memory.max"), max).unwrap();
        fs::write(cg.join("memory.current"), current).unwrap();
        cg
    }

    fn v1_dir(dir: &TempDir, limit: &str, usage: &str) -> PathBuf {
        let cg = dir.path().join("cg1");
        fs::create_dir_all(&cg).unwrap();
        fs::write(cg.join("memory.limit_in_bytes"), limit).unwrap();
        fs::write(cg.join("memory.usage_in_bytes"), usage).unwrap();
        cg
    }

    #[test]
    fn meminfo_only_admits_at_the_edge_and_refuses_one_byte_more() {
        let dir = TempDir::new().unwrap();
        // 2437 MiB available, 1536 MiB floor.
        let avail = 2437 * MIB;
        let gate = RamGate::with_paths(meminfo(&dir, avail / KB), CgroupMemory::None, 1536 * MIB);
        assert_eq!(gate.available(), Ok(avail));
        assert_eq!(gate.floor(), 1536 * MIB);
        assert_eq!(gate.admit(avail - 1536 * MIB), Ok(()));
        let err = gate.admit(avail - 1536 * MIB + 1).unwrap_err();
        assert_eq!(err.available, Some(avail));
        assert_eq!(err.need, 901 * MIB + 1);
        assert_eq!(
            err.to_string(),
            "RAM gate, need 901 MiB + 1536 MiB floor, 2437 MiB available"
        );
        let err = gate.admit(2915 * MIB).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RAM gate, need 2915 MiB + 1536 MiB floor, 2437 MiB available"
        );
    }

    #[test]
    fn a_reading_is_reused_within_its_ttl_less_what_was_admitted() {
        let dir = TempDir::new().unwrap();
        let path = meminfo(&dir, 100 * MIB / KB);
        let gate = RamGate::with_paths(path.clone(), CgroupMemory::None, 40 * MIB)
            .with_sample_ttl(Duration::from_secs(3600));
        assert_eq!(gate.admit(30 * MIB), Ok(()));
        // The file now says 50 MiB: the reading (100) is reused, less the 30 MiB admitted.
        fs::write(&path, format!("MemAvailable:   {} kB\n", 50 * MIB / KB)).unwrap();
        assert_eq!(gate.admit(25 * MIB), Ok(()));
        // 45 MiB left in that reading, short of 6 + 40: a fresh reading (50) admits.
        assert_eq!(gate.admit(6 * MIB), Ok(()));
        // 44 left, short of 15 + 40: a fresh reading decides, and refuses naming it.
        let err = gate.admit(15 * MIB).unwrap_err();
        assert_eq!(err.available, Some(50 * MIB));
        assert_eq!(
            err.to_string(),
            "RAM gate, need 15 MiB + 40 MiB floor, 50 MiB available"
        );
    }

    #[test]
    fn a_stale_reading_is_replaced_and_unknown_telemetry_still_refuses() {
        let dir = TempDir::new().unwrap();
        let path = meminfo(&dir, 100 * MIB / KB);
        let gate = RamGate::with_paths(path.clone(), CgroupMemory::None, 0)
            .with_sample_ttl(Duration::from_millis(20));
        assert_eq!(gate.admit(MIB), Ok(()));
        fs::write(&path, format!("MemAvailable:   {} kB\n", MIB / KB)).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        // Older than the TTL: read again, and 2 MiB no longer fits.
        assert_eq!(gate.admit(2 * MIB).unwrap_err().available, Some(MIB));
        fs::remove_file(&path).unwrap();
        // A fresh reading (1 MiB) cannot cover 2 MiB, so the gate reads again: gone telemetry
        // refuses.
        let err = gate.admit(2 * MIB).unwrap_err();
        assert_eq!(err.available, None);
    }

    #[test]
    fn one_reading_admits_at_most_64_mib() {
        let dir = TempDir::new().unwrap();
        let path = meminfo(&dir, 1000 * MIB / KB);
        let gate = RamGate::with_paths(path.clone(), CgroupMemory::None, 0)
            .with_sample_ttl(Duration::from_secs(3600));
        assert_eq!(gate.admit(40 * MIB), Ok(()));
        fs::write(&path, format!("MemAvailable:   {} kB\n", 30 * MIB / KB)).unwrap();
        // 24 MiB more fits the 64 MiB a reading may admit: no new reading.
        assert_eq!(gate.admit(24 * MIB), Ok(()));
        // One byte more than 64 MiB against the first reading: read again (30 MiB), refuse 31.
        assert_eq!(gate.admit(31 * MIB).unwrap_err().available, Some(30 * MIB));
    }

    #[test]
    fn without_a_ttl_every_admission_reads_the_files() {
        let dir = TempDir::new().unwrap();
        let path = meminfo(&dir, 100 * MIB / KB);
        let gate = RamGate::with_paths(path.clone(), CgroupMemory::None, 0);
        assert_eq!(gate.admit(50 * MIB), Ok(()));
        fs::write(&path, format!("MemAvailable:   {} kB\n", MIB / KB)).unwrap();
        assert_eq!(gate.admit(2 * MIB).unwrap_err().available, Some(MIB));
    }

    #[test]
    fn need_plus_floor_overflow_refuses() {
        let dir = TempDir::new().unwrap();
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::None, 10);
        assert!(gate.admit(u64::MAX).is_err());
    }

    #[test]
    fn meminfo_without_mem_available_refuses() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("meminfo");
        fs::write(
            &path,
            "MemTotal:       32000000 kB\nMemFree:         1000000 kB\n",
        )
        .unwrap();
        let gate = RamGate::with_paths(path.clone(), CgroupMemory::None, 0);
        let reason = format!("{} has no MemAvailable line", path.display());
        assert_eq!(gate.available(), Err(reason.clone()));
        let err = gate.admit(1).unwrap_err();
        assert_eq!(err.available, None);
        assert_eq!(
            err.to_string(),
            format!("RAM gate, memory telemetry unknown: {reason}")
        );
    }

    #[test]
    fn meminfo_garbage_value_refuses() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("meminfo");
        fs::write(&path, "MemAvailable:   lots kB\n").unwrap();
        let gate = RamGate::with_paths(path.clone(), CgroupMemory::None, 0);
        assert_eq!(
            gate.available(),
            Err(format!(
                "cannot parse {}: \"MemAvailable:   lots kB\"",
                path.display()
            ))
        );
    }

    #[test]
    fn unreadable_meminfo_refuses() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("missing");
        let gate = RamGate::with_paths(path.clone(), CgroupMemory::None, 0);
        let reason = format!("cannot read {}: No such file or directory", path.display());
        assert_eq!(gate.available(), Err(reason.clone()));
        let err = gate.admit(0).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("RAM gate, memory telemetry unknown: {reason}")
        );
    }

    #[test]
    fn v2_numeric_max_below_mem_available_gives_room() {
        let dir = TempDir::new().unwrap();
        let cg = v2_dir(&dir, "4294967296\n", "1073741824\n");
        let gate = RamGate::with_paths(meminfo(&dir, 8 * MIB), CgroupMemory::V2(cg), 0);
        assert_eq!(gate.available(), Ok(3 * 1024 * MIB));
        assert_eq!(gate.admit(3 * 1024 * MIB), Ok(()));
        assert!(gate.admit(3 * 1024 * MIB + 1).is_err());
    }

    #[test]
    fn v2_max_word_means_mem_available() {
        let dir = TempDir::new().unwrap();
        let cg = v2_dir(&dir, "max\n", "1073741824\n");
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V2(cg), 0);
        assert_eq!(gate.available(), Ok(1000 * KB));
    }

    #[test]
    fn v2_mem_available_smaller_than_room_wins() {
        let dir = TempDir::new().unwrap();
        let cg = v2_dir(&dir, "4294967296\n", "0\n");
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V2(cg), 0);
        assert_eq!(gate.available(), Ok(1000 * KB));
    }

    #[test]
    fn v2_current_above_max_gives_zero() {
        let dir = TempDir::new().unwrap();
        let cg = v2_dir(&dir, "1000\n", "5000\n");
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V2(cg), 0);
        assert_eq!(gate.available(), Ok(0));
        assert_eq!(gate.admit(0), Ok(()));
        let err = gate.admit(1).unwrap_err();
        assert_eq!(err.available, Some(0));
        assert_eq!(
            err.to_string(),
            "RAM gate, need 0.00 MiB + 0.00 MiB floor, 0.00 MiB available"
        );
    }

    #[test]
    fn v2_garbage_max_refuses() {
        let dir = TempDir::new().unwrap();
        let cg = v2_dir(&dir, "lots\n", "0\n");
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V2(cg.clone()), 0);
        let reason = format!(
            "cannot parse {}: \"lots\" is not a byte count",
            cg.join("memory.max").display()
        );
        assert_eq!(gate.available(), Err(reason.clone()));
        assert_eq!(
            gate.admit(1).unwrap_err().to_string(),
            format!("RAM gate, memory telemetry unknown: {reason}")
        );
    }

    #[test]
    fn v2_missing_current_refuses() {
        let dir = TempDir::new().unwrap();
        let cg = v2_dir(&dir, "1000\n", "0\n");
        fs::remove_file(cg.join("memory.current")).unwrap();
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V2(cg.clone()), 0);
        assert_eq!(
            gate.available(),
            Err(format!(
                "cannot read {}: No such file or directory",
                cg.join("memory.current").display()
            ))
        );
    }

    #[test]
    fn v1_limit_minus_usage() {
        let dir = TempDir::new().unwrap();
        let cg = v1_dir(&dir, "2147483648\n", "536870912\n");
        let gate = RamGate::with_paths(meminfo(&dir, 8 * MIB), CgroupMemory::V1(cg), 0);
        assert_eq!(gate.available(), Ok(1536 * MIB));
    }

    #[test]
    fn v1_huge_limit_means_mem_available() {
        let dir = TempDir::new().unwrap();
        let cg = v1_dir(&dir, "9223372036854771712\n", "536870912\n");
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V1(cg), 0);
        assert_eq!(gate.available(), Ok(1000 * KB));
    }

    #[test]
    fn v1_garbage_refuses() {
        let dir = TempDir::new().unwrap();
        let cg = v1_dir(&dir, "-1\n", "0\n");
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V1(cg.clone()), 0);
        assert_eq!(
            gate.available(),
            Err(format!(
                "cannot parse {}: \"-1\" is not a byte count",
                cg.join("memory.limit_in_bytes").display()
            ))
        );
        let cg = v1_dir(&dir, "1000\n", "\n");
        let gate = RamGate::with_paths(meminfo(&dir, 1000), CgroupMemory::V1(cg.clone()), 0);
        assert_eq!(
            gate.available(),
            Err(format!(
                "cannot parse {}: \"\" is not a byte count",
                cg.join("memory.usage_in_bytes").display()
            ))
        );
    }

    fn write_cgroup_file(dir: &TempDir, text: &str) -> PathBuf {
        let path = dir.path().join("proc_self_cgroup");
        fs::write(&path, text).unwrap();
        path
    }

    fn touch(path: &Path) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, "max\n").unwrap();
    }

    #[test]
    fn detect_v2_leaf_cgroup() {
        let dir = TempDir::new().unwrap();
        let root = dir.path().join("sys");
        let leaf = root.join("user.slice/app.scope");
        touch(&leaf.join("memory.max"));
        touch(&root.join("memory.max"));
        let file = write_cgroup_file(&dir, "0::/user.slice/app.scope\n");
        assert_eq!(CgroupMemory::detect(&file, &root), CgroupMemory::V2(leaf));
    }

    #[test]
    fn detect_v2_falls_back_to_root() {
        let dir = TempDir::new().unwrap();
        let root = dir.path().join("sys");
        touch(&root.join("memory.max"));
        let file = write_cgroup_file(&dir, "0::/user.slice/app.scope\n");
        assert_eq!(CgroupMemory::detect(&file, &root), CgroupMemory::V2(root));
    }

    #[test]
    fn detect_v2_without_memory_max_is_none() {
        let dir = TempDir::new().unwrap();
        let root = dir.path().join("sys");
        fs::create_dir_all(&root).unwrap();
        let file = write_cgroup_file(&dir, "0::/user.slice/app.scope\n");
        assert_eq!(CgroupMemory::detect(&file, &root), CgroupMemory::None);
    }

    #[test]
    fn detect_v1_memory_line() {
        let dir = TempDir::new().unwrap();
        let root = dir.path().join("sys");
        let leaf = root.join("memory/docker/abc");
        touch(&leaf.join("memory.limit_in_bytes"));
        let file = write_cgroup_file(&dir, "4:memory:/docker/abc\n");
        assert_eq!(CgroupMemory::detect(&file, &root), CgroupMemory::V1(leaf));
    }

    #[test]
    fn detect_v1_falls_back_to_memory_root() {
        let dir = TempDir::new().unwrap();
        let root = dir.path().join("sys");
        touch(&root.join("memory/memory.limit_in_bytes"));
        let file = write_cgroup_file(&dir, "4:memory:/docker/abc\n");
        assert_eq!(
            CgroupMemory::detect(&file, &root),
            CgroupMemory::V1(root.join("memory"))
        );
    }

    #[test]
    fn detect_v1_mixed_picks_memory_line() {
        let dir = TempDir::new().unwrap();
        let root = dir.path().join("sys");
        touch(&root.join("memory/x/memory.limit_in_bytes"));
        touch(&root.join("memory/y/memory.limit_in_bytes"));
        let file = write_cgroup_file(&dir, "5:cpu,cpuacct:/x\n4:memory:/y\n0::/\n");
        assert_eq!(
            CgroupMemory::detect(&file, &root),
            CgroupMemory::V1(root.join("memory/y"))
        );
    }

    #[test]
    fn detect_empty_or_missing_file_is_none() {
        let dir = TempDir::new().unwrap();
        let root = dir.path().join("sys");
        touch(&root.join("memory.max"));
        let file = write_cgroup_file(&dir, "");
        assert_eq!(CgroupMemory::detect(&file, &root), CgroupMemory::None);
        assert_eq!(
            CgroupMemory::detect(&dir.path().join("missing"), &root),
            CgroupMemory::None
        );
    }

    #[test]
    fn display_small_sizes_with_two_decimals() {
        let refusal = RamRefusal {
            need: 367_002, // 0.35 MiB
            floor: 1536 * MIB,
            available: Some(1536 * MIB),
            reason: String::new(),
        };
        assert_eq!(
            refusal.to_string(),
            "RAM gate, need 0.35 MiB + 1536 MiB floor, 1536 MiB available"
        );
        let dir = TempDir::new().unwrap();
        let gate = RamGate::with_paths(meminfo(&dir, 1536 * 1024), CgroupMemory::None, 1536 * MIB);
        assert_eq!(
            gate.admit(367_002).unwrap_err(),
            RamRefusal {
                need: 367_002,
                floor: 1536 * MIB,
                available: Some(1536 * MIB),
                reason: "need + floor exceeds available memory".to_string(),
            }
        );
    }

    #[test]
    fn mach_page_counts_give_free_less_speculative_plus_inactive() {
        // 16 KiB pages (Apple silicon): (1000 - 200 + 300) pages.
        assert_eq!(mach_available_bytes(1000, 200, 300, 16384), 1100 * 16384);
        // More speculative than free (counts sampled apart): no underflow.
        assert_eq!(mach_available_bytes(10, 20, 5, 4096), 5 * 4096);
        assert_eq!(
            mach_available_bytes(u32::MAX, 0, u32::MAX, u64::MAX),
            u64::MAX
        );
    }

    #[test]
    fn a_system_without_telemetry_refuses_everything() {
        let gate = RamGate::with_source(Source::Unsupported, CgroupMemory::None, 0);
        assert_eq!(gate.available(), Err(UNSUPPORTED.to_string()));
        let err = gate.admit(0).unwrap_err();
        assert_eq!(err.available, None);
        assert_eq!(
            err.to_string(),
            format!("RAM gate, memory telemetry unknown: {UNSUPPORTED}")
        );
    }

    #[cfg(any(target_os = "linux", target_os = "macos"))]
    #[test]
    fn system_gate_reads_this_machine() {
        let available = RamGate::system(0).available();
        assert!(matches!(available, Ok(n) if n > 0), "{available:?}");
    }
}
