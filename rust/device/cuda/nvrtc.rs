//! Kernel compilation: NVRTC turns a `.cu` source into PTX or a CUBIN for one GPU architecture at
//! load, and [`KernelCache`] keeps the result on disk so that the next load skips NVRTC.
//!
//! **Finding libnvrtc.** As `libraries.rs` says: `STRATA_NVRTC_PATH`, the dynamic loader's
//! search, then the active virtual environment (the `nvidia-cuda-nvrtc` wheel). Every NVRTC call
//! runs under `catch_unwind` as a second guard, as the driver probe does: no NVRTC, or an
//! incomplete one, is an error, never a panic.
//!
//! **The cache.** One file per (program, target, options, NVRTC version), named by an xxh3-128
//! hash over all of them and the source text (headers included), so any change to a kernel gives
//! a new entry. An entry is a small header (magic, payload length, xxh3-64 of the payload) and
//! the image; it is written to a temporary name and renamed, so a reader never sees a partial
//! entry. An entry that fails its check is recompiled and rewritten. The cache is an
//! optimization: when its folder cannot be written, compilation still succeeds (with a log line).

use std::ffi::{c_char, c_int, CString};
use std::fmt;
use std::fs;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

/// Environment variable: the libnvrtc file (or its folder) to use.
pub const NVRTC_PATH_ENV: &str = super::libraries::NVRTC.env;
/// Environment variable: the kernel cache folder (default: `$XDG_CACHE_HOME/strata-rs/kernels`,
/// else `~/.cache/strata-rs/kernels`).
pub const KERNEL_CACHE_ENV: &str = "STRATA_KERNEL_CACHE";

/// A GPU architecture: compute capability `major.minor` (8.0 for A100, 9.0 for H100).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuArch {
    pub major: u32,
    pub minor: u32,
}

/// What NVRTC produces: PTX (`compute_XY`, JIT-compiled by the driver when loaded) or a CUBIN
/// (`sm_XY`, machine code for that architecture; what the engine loads, so that a driver older
/// than NVRTC is not asked to JIT newer PTX).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImageKind {
    Ptx,
    Cubin,
}

/// One compilation target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub arch: GpuArch,
    pub kind: ImageKind,
}

impl Target {
    pub fn cubin(major: u32, minor: u32) -> Target {
        Target {
            arch: GpuArch { major, minor },
            kind: ImageKind::Cubin,
        }
    }

    pub fn ptx(major: u32, minor: u32) -> Target {
        Target {
            arch: GpuArch { major, minor },
            kind: ImageKind::Ptx,
        }
    }
}

impl fmt::Display for Target {
    /// NVRTC's spelling: `sm_90` for a CUBIN, `compute_90` for PTX.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let prefix = match self.kind {
            ImageKind::Ptx => "compute",
            ImageKind::Cubin => "sm",
        };
        write!(f, "{prefix}_{}{}", self.arch.major, self.arch.minor)
    }
}

/// A kernel source and the in-memory headers it includes.
#[derive(Clone, Copy, Debug)]
pub struct Program<'a> {
    /// The file name NVRTC reports in its messages (`rmsnorm.cu`).
    pub name: &'a str,
    pub source: &'a str,
    /// `(include name, contents)`: what `#include "name"` resolves to.
    pub headers: &'a [(&'a str, &'a str)],
}

/// How to compile, beyond the target.
#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// Every warning is an error (`-Werror=all-warnings`), and ptxas warns on register spills.
    /// The tests compile this way; the engine does not, so that a newer NVRTC's new warning
    /// cannot stop a load (its log is still logged).
    pub strict: bool,
}

impl CompileOptions {
    fn nvrtc_args(&self, target: Target) -> Vec<String> {
        let mut args = vec![
            format!("--gpu-architecture={target}"),
            "--std=c++17".to_string(),
        ];
        if self.strict {
            args.push("-Werror=all-warnings".into());
            if target.kind == ImageKind::Cubin {
                args.push("--ptxas-options=--warn-on-spills".into());
            }
        }
        args
    }
}

/// A compiled kernel module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub kind: ImageKind,
    /// PTX text (without a trailing NUL) or CUBIN bytes.
    pub bytes: Vec<u8>,
}

/// What [`KernelCache::compile`] returns.
#[derive(Debug)]
pub struct Compiled {
    pub image: Image,
    /// Where the image came from, so callers and tests can tell a cache hit from NVRTC.
    pub origin: Origin,
    /// NVRTC's log (warnings), empty on a cache hit.
    pub log: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Read from a valid cache entry: NVRTC was not called.
    Cache,
    /// Compiled by NVRTC; the cache held no entry for it.
    Nvrtc,
    /// Compiled by NVRTC because the entry was unreadable or corrupt (the reason).
    NvrtcReplacingBadEntry(String),
}

#[derive(Debug, thiserror::Error)]
pub enum KernelBuildError {
    #[error("NVRTC is not available: {0}")]
    NvrtcUnavailable(String),
    #[error("NVRTC could not compile {program} for {target}:\n{log}")]
    Compile {
        program: String,
        target: Target,
        log: String,
    },
    #[error("NVRTC failed on {program}: {detail}")]
    Nvrtc { program: String, detail: String },
}

/// The loaded libnvrtc.
#[derive(Debug)]
pub struct NvrtcLibrary {
    /// `nvrtcVersion()`: part of every cache key.
    pub version: (i32, i32),
    /// Where it was found, for messages.
    pub found_at: String,
}

/// libnvrtc, found and opened on first use (see the module docs); the error says where it was
/// looked for.
pub fn nvrtc() -> Result<&'static NvrtcLibrary, KernelBuildError> {
    static LIBRARY: OnceLock<Result<NvrtcLibrary, String>> = OnceLock::new();
    LIBRARY
        .get_or_init(|| load_library(|name| std::env::var_os(name)))
        .as_ref()
        .map_err(|why| KernelBuildError::NvrtcUnavailable(why.clone()))
}

/// Finds and opens libnvrtc, reading the environment through `env`.
fn load_library(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<NvrtcLibrary, String> {
    // SAFETY: only tries to open the library by cudarc's names.
    let found_at = super::libraries::NVRTC.find(env, || unsafe { sys::is_culib_present() })?;
    let version = guarded("nvrtcVersion", || {
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: two valid out-pointers.
        check("nvrtcVersion", unsafe {
            sys::nvrtcVersion(&mut major, &mut minor)
        })?;
        Ok((major, minor))
    })?;
    Ok(NvrtcLibrary { version, found_at })
}

/// Runs NVRTC calls under `catch_unwind`: cudarc panics when a symbol is missing from the library.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(format!("{what}: libnvrtc is incomplete (a call panicked)")))
}

fn check(call: &str, result: sys::nvrtcResult) -> Result<(), String> {
    if result == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} returned {result:?}"))
    }
}

/// An NVRTC program, destroyed on drop whatever path leaves the compile.
struct ProgramHandle(sys::nvrtcProgram);

impl Drop for ProgramHandle {
    fn drop(&mut self) {
        // A destroy failure leaks the program; there is nothing better to do in a drop. The
        // guard keeps a panic (missing symbol) from unwinding out of drop.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once.
            unsafe { sys::nvrtcDestroyProgram(&mut self.0) }
        }));
    }
}

/// NVRTC, uncached. Returns the image and NVRTC's log.
fn compile_with_nvrtc(
    program: &Program,
    target: Target,
    options: &CompileOptions,
) -> Result<(Image, String), KernelBuildError> {
    nvrtc()?;
    let api_error = |detail: String| KernelBuildError::Nvrtc {
        program: program.name.to_string(),
        detail,
    };
    let to_c = |s: &str, what: &str| {
        CString::new(s).map_err(|_| api_error(format!("{what} contains a NUL byte")))
    };
    let source = to_c(program.source, "the source")?;
    let name = to_c(program.name, "the program name")?;
    let header_texts = program
        .headers
        .iter()
        .map(|(_, text)| to_c(text, "a header"))
        .collect::<Result<Vec<_>, _>>()?;
    let header_names = program
        .headers
        .iter()
        .map(|(include, _)| to_c(include, "a header name"))
        .collect::<Result<Vec<_>, _>>()?;
    let args = options
        .nvrtc_args(target)
        .iter()
        .map(|a| to_c(a, "an option"))
        .collect::<Result<Vec<_>, _>>()?;

    enum Failure {
        Api(String),
        Compile(String),
    }
    let run = || -> Result<(Image, String), Failure> {
        let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|h| h.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = header_names.iter().map(|h| h.as_ptr()).collect();
        let arg_ptrs: Vec<*const c_char> = args.iter().map(|a| a.as_ptr()).collect();
        let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer is a live C string, and the arrays hold the counts given.
        check("nvrtcCreateProgram", unsafe {
            sys::nvrtcCreateProgram(
                &mut raw,
                source.as_ptr(),
                name.as_ptr(),
                text_ptrs.len() as c_int,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        })
        .map_err(Failure::Api)?;
        let handle = ProgramHandle(raw);
        // SAFETY: a live program and `arg_ptrs.len()` live C strings.
        let compiled = unsafe {
            sys::nvrtcCompileProgram(handle.0, arg_ptrs.len() as c_int, arg_ptrs.as_ptr())
        };
        let log = program_log(&handle).map_err(Failure::Api)?;
        if compiled == sys::nvrtcResult::NVRTC_ERROR_COMPILATION {
            return Err(Failure::Compile(log));
        }
        check("nvrtcCompileProgram", compiled).map_err(|e| Failure::Api(format!("{e}\n{log}")))?;
        let bytes = match target.kind {
            ImageKind::Ptx => {
                let mut size = 0usize;
                // SAFETY: a compiled program and a valid out-pointer.
                check("nvrtcGetPTXSize", unsafe {
                    sys::nvrtcGetPTXSize(handle.0, &mut size)
                })
                .map_err(Failure::Api)?;
                let mut ptx = vec![0u8; size];
                // SAFETY: `ptx` holds the size NVRTC asked for.
                check("nvrtcGetPTX", unsafe {
                    sys::nvrtcGetPTX(handle.0, ptx.as_mut_ptr().cast())
                })
                .map_err(Failure::Api)?;
                // The size counts the terminating NUL; the image is the text.
                while ptx.last() == Some(&0) {
                    ptx.pop();
                }
                ptx
            }
            ImageKind::Cubin => {
                let mut size = 0usize;
                // SAFETY: as above.
                check("nvrtcGetCUBINSize", unsafe {
                    sys::nvrtcGetCUBINSize(handle.0, &mut size)
                })
                .map_err(Failure::Api)?;
                let mut cubin = vec![0u8; size];
                // SAFETY: as above.
                check("nvrtcGetCUBIN", unsafe {
                    sys::nvrtcGetCUBIN(handle.0, cubin.as_mut_ptr().cast())
                })
                .map_err(Failure::Api)?;
                cubin
            }
        };
        Ok((
            Image {
                kind: target.kind,
                bytes,
            },
            log,
        ))
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(Failure::Compile(log))) => Err(KernelBuildError::Compile {
            program: program.name.to_string(),
            target,
            log,
        }),
        Ok(Err(Failure::Api(detail))) => Err(api_error(detail)),
        Err(_) => Err(api_error(
            "libnvrtc is incomplete (a call panicked)".to_string(),
        )),
    }
}

fn program_log(handle: &ProgramHandle) -> Result<String, String> {
    let mut size = 0usize;
    // SAFETY: a live program and a valid out-pointer.
    check("nvrtcGetProgramLogSize", unsafe {
        sys::nvrtcGetProgramLogSize(handle.0, &mut size)
    })?;
    let mut log = vec![0u8; size.max(1)];
    // SAFETY: `log` holds the size NVRTC asked for.
    check("nvrtcGetProgramLog", unsafe {
        sys::nvrtcGetProgramLog(handle.0, log.as_mut_ptr().cast())
    })?;
    while log.last() == Some(&0) {
        log.pop();
    }
    Ok(String::from_utf8_lossy(&log).trim_end().to_string())
}

/// The on-disk kernel cache, and a count of the NVRTC compilations it made.
#[derive(Debug)]
pub struct KernelCache {
    /// `None`: no cache folder could be determined (no home); every load compiles.
    dir: Option<PathBuf>,
    nvrtc_compiles: AtomicUsize,
}

/// Entry layout: magic, payload length (u64 LE), xxh3-64 of the payload (u64 LE), payload.
const ENTRY_MAGIC: &[u8; 8] = b"STRATAK1";
const ENTRY_HEADER: usize = 8 + 8 + 8;
/// Part of every key: bump it when the entry layout or the key's contents change.
const KEY_FORMAT: &str = "strata-rs kernel cache v1";

impl KernelCache {
    /// A cache in `dir` (created on first write).
    pub fn at(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache {
            dir: Some(dir.into()),
            nvrtc_compiles: AtomicUsize::new(0),
        }
    }

    /// The user's cache: `$STRATA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/strata-rs/kernels`, else
    /// `$HOME/.cache/strata-rs/kernels`; none (compile every time) when none of them is set.
    pub fn user_default() -> KernelCache {
        KernelCache {
            dir: default_dir(|name| std::env::var_os(name)),
            nvrtc_compiles: AtomicUsize::new(0),
        }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// How many times this cache called NVRTC's compiler.
    pub fn nvrtc_compiles(&self) -> usize {
        self.nvrtc_compiles.load(Ordering::Relaxed)
    }

    /// The cache file for `program` on `target`: the name is for people, the hash is the key.
    pub fn entry_path(
        &self,
        program: &Program,
        target: Target,
        options: &CompileOptions,
    ) -> Result<Option<PathBuf>, KernelBuildError> {
        let Some(dir) = &self.dir else {
            return Ok(None);
        };
        let (major, minor) = nvrtc()?.version;
        let mut keyed = String::new();
        for part in [KEY_FORMAT, program.name, program.source] {
            keyed.push_str(&part.len().to_string());
            keyed.push(':');
            keyed.push_str(part);
        }
        for (include, text) in program.headers {
            keyed.push_str(&format!("{}:{include}{}:{text}", include.len(), text.len()));
        }
        for arg in options.nvrtc_args(target) {
            keyed.push_str(&format!("{}:{arg}", arg.len()));
        }
        keyed.push_str(&format!("nvrtc {major}.{minor}"));
        let key = xxhash_rust::xxh3::xxh3_128(keyed.as_bytes());
        let stem = program.name.strip_suffix(".cu").unwrap_or(program.name);
        let ext = match target.kind {
            ImageKind::Ptx => "ptx",
            ImageKind::Cubin => "cubin",
        };
        Ok(Some(dir.join(format!(
            "{stem}-{target}-nvrtc{major}.{minor}-{key:032x}.{ext}"
        ))))
    }

    /// The image of `program` for `target`: from the cache when a valid entry exists, else from
    /// NVRTC (then stored).
    pub fn compile(
        &self,
        program: &Program,
        target: Target,
        options: &CompileOptions,
    ) -> Result<Compiled, KernelBuildError> {
        let path = self.entry_path(program, target, options)?;
        let mut bad_entry = None;
        if let Some(path) = &path {
            match read_entry(path) {
                Ok(Some(bytes)) => {
                    return Ok(Compiled {
                        image: Image {
                            kind: target.kind,
                            bytes,
                        },
                        origin: Origin::Cache,
                        log: String::new(),
                    })
                }
                Ok(None) => {}
                Err(why) => {
                    log::warn!(
                        target: "strata_rs.kernels",
                        "kernel cache entry {} is unusable ({why}); recompiling",
                        path.display()
                    );
                    bad_entry = Some(why);
                }
            }
        }
        self.nvrtc_compiles.fetch_add(1, Ordering::Relaxed);
        let (image, log) = compile_with_nvrtc(program, target, options)?;
        if !log.is_empty() {
            log::warn!(target: "strata_rs.kernels", "NVRTC on {} for {target}: {log}", program.name);
        }
        if let Some(path) = &path {
            if let Err(why) = write_entry(path, &image.bytes) {
                log::warn!(
                    target: "strata_rs.kernels",
                    "kernel cache: could not write {} ({why}); the next load compiles again",
                    path.display()
                );
            }
        }
        Ok(Compiled {
            image,
            origin: match bad_entry {
                None => Origin::Nvrtc,
                Some(why) => Origin::NvrtcReplacingBadEntry(why),
            },
            log,
        })
    }
}

/// The cache folder [`KernelCache::user_default`] uses, given a way to read the environment.
fn default_dir(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let non_empty = |name: &str| env(name).filter(|v| !v.is_empty());
    non_empty(KERNEL_CACHE_ENV)
        .map(PathBuf::from)
        .or_else(|| non_empty("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("strata-rs/kernels")))
        .or_else(|| non_empty("HOME").map(|d| PathBuf::from(d).join(".cache/strata-rs/kernels")))
}

/// `Ok(None)`: no entry. `Err`: an entry that cannot be used (unreadable, truncated, corrupt).
fn read_entry(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read it: {e}")),
    };
    if bytes.len() < ENTRY_HEADER || &bytes[..8] != ENTRY_MAGIC {
        return Err("not a kernel cache entry (bad header)".into());
    }
    let field = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let (len, checksum) = (field(8), field(16));
    let payload = &bytes[ENTRY_HEADER..];
    if payload.len() as u64 != len {
        return Err(format!(
            "{} payload bytes where the header says {len}",
            payload.len()
        ));
    }
    if xxhash_rust::xxh3::xxh3_64(payload) != checksum {
        return Err("checksum mismatch".into());
    }
    Ok(Some(payload.to_vec()))
}

/// Writes an entry to a temporary name in the same folder, then renames it into place.
fn write_entry(path: &Path, payload: &[u8]) -> std::io::Result<()> {
    static TEMP_COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let temp = dir.join(format!(
        ".{}.{}.{}.tmp",
        path.file_name()
            .map_or("entry".into(), |n| n.to_string_lossy()),
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut file = fs::File::create(&temp)?;
        file.write_all(ENTRY_MAGIC)?;
        file.write_all(&(payload.len() as u64).to_le_bytes())?;
        file.write_all(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes())?;
        file.write_all(payload)?;
        file.sync_all()?;
        fs::rename(&temp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&temp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::test_support::nvrtc_or_skip;

    const TINY: Program = Program {
        name: "tiny.cu",
        source: "extern \"C\" __global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }\n",
        headers: &[],
    };

    #[test]
    fn a_second_compile_is_a_cache_hit_without_nvrtc() {
        if nvrtc_or_skip("a_second_compile_is_a_cache_hit_without_nvrtc").is_none() {
            return;
        }
        let dir = tempfile::tempdir().expect("a temp dir");
        let options = CompileOptions::default();
        for target in [Target::cubin(8, 0), Target::ptx(9, 0)] {
            let cache = KernelCache::at(dir.path());
            let first = cache.compile(&TINY, target, &options).expect("compiles");
            assert_eq!(first.origin, Origin::Nvrtc);
            assert_eq!(cache.nvrtc_compiles(), 1);
            let second = cache.compile(&TINY, target, &options).expect("cached");
            assert_eq!(second.origin, Origin::Cache);
            assert_eq!(second.image, first.image);
            assert_eq!(cache.nvrtc_compiles(), 1, "a hit must not call NVRTC");
            // The entry is on disk: a new cache on the same folder (a new process) hits too.
            let fresh = KernelCache::at(dir.path());
            assert_eq!(
                fresh
                    .compile(&TINY, target, &options)
                    .expect("cached")
                    .origin,
                Origin::Cache
            );
            assert_eq!(fresh.nvrtc_compiles(), 0);
        }
        // One entry per target, and no temporary files left behind.
        let names: Vec<String> = fs::read_dir(dir.path())
            .expect("the cache folder")
            .map(|e| {
                e.expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names
            .iter()
            .any(|n| n.starts_with("tiny-sm_80-nvrtc") && n.ends_with(".cubin")));
        assert!(names
            .iter()
            .any(|n| n.starts_with("tiny-compute_90-nvrtc") && n.ends_with(".ptx")));
    }

    #[test]
    fn a_corrupt_or_truncated_entry_is_recompiled() {
        if nvrtc_or_skip("a_corrupt_or_truncated_entry_is_recompiled").is_none() {
            return;
        }
        let dir = tempfile::tempdir().expect("a temp dir");
        let (target, options) = (Target::cubin(9, 0), CompileOptions::default());
        let cache = KernelCache::at(dir.path());
        let good = cache.compile(&TINY, target, &options).expect("compiles");
        let path = cache
            .entry_path(&TINY, target, &options)
            .expect("NVRTC")
            .expect("a cache folder");
        let stored = fs::read(&path).expect("the entry");
        let mut flipped = stored.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        let damages: [(&str, Vec<u8>); 4] = [
            ("a flipped payload byte", flipped),
            ("truncated", stored[..stored.len() / 2].to_vec()),
            ("empty", Vec::new()),
            (
                "not an entry",
                b"garbage that is long enough to have a header".to_vec(),
            ),
        ];
        for (i, (damage, bytes)) in damages.into_iter().enumerate() {
            fs::write(&path, bytes).expect("damaging the entry");
            let again = cache.compile(&TINY, target, &options).expect("recompiles");
            assert!(
                matches!(again.origin, Origin::NvrtcReplacingBadEntry(_)),
                "{damage}: {:?}",
                again.origin
            );
            assert_eq!(again.image, good.image, "{damage}");
            assert_eq!(cache.nvrtc_compiles(), 2 + i, "{damage}");
            // The rewritten entry is good again.
            assert_eq!(
                cache
                    .compile(&TINY, target, &options)
                    .expect("cached")
                    .origin,
                Origin::Cache,
                "{damage}"
            );
        }
    }

    #[test]
    fn any_change_to_what_is_compiled_gives_a_new_key() {
        if nvrtc_or_skip("any_change_to_what_is_compiled_gives_a_new_key").is_none() {
            return;
        }
        let dir = tempfile::tempdir().expect("a temp dir");
        let cache = KernelCache::at(dir.path());
        let options = CompileOptions::default();
        let key = |program: &Program, target: Target, options: &CompileOptions| {
            cache
                .entry_path(program, target, options)
                .expect("NVRTC")
                .expect("a cache folder")
        };
        let base = key(&TINY, Target::cubin(9, 0), &options);
        let changed_source = Program {
            source:
                "extern \"C\" __global__ void scale(float* x, float a) { x[threadIdx.x] += a; }\n",
            ..TINY
        };
        let with_header = Program {
            headers: &[("h.cuh", "// one\n")],
            ..TINY
        };
        let changed_header = Program {
            headers: &[("h.cuh", "// two\n")],
            ..TINY
        };
        let others = [
            key(&changed_source, Target::cubin(9, 0), &options),
            key(&TINY, Target::cubin(8, 0), &options),
            key(&TINY, Target::ptx(9, 0), &options),
            key(&TINY, Target::cubin(9, 0), &CompileOptions { strict: true }),
            key(&with_header, Target::cubin(9, 0), &options),
            key(&changed_header, Target::cubin(9, 0), &options),
        ];
        for (i, other) in others.iter().enumerate() {
            assert_ne!(other, &base, "change {i}");
            for later in &others[i + 1..] {
                assert_ne!(other, later);
            }
        }
        assert_eq!(
            key(&TINY, Target::cubin(9, 0), &options),
            base,
            "the key is stable"
        );
        // And the changed source really compiles anew rather than hitting the old entry.
        cache
            .compile(&TINY, Target::cubin(9, 0), &options)
            .expect("compiles");
        let changed = cache
            .compile(&changed_source, Target::cubin(9, 0), &options)
            .expect("compiles");
        assert_eq!(changed.origin, Origin::Nvrtc);
        assert_eq!(cache.nvrtc_compiles(), 2);
    }

    #[test]
    fn a_syntax_error_returns_nvrtcs_message() {
        if nvrtc_or_skip("a_syntax_error_returns_nvrtcs_message").is_none() {
            return;
        }
        let dir = tempfile::tempdir().expect("a temp dir");
        let cache = KernelCache::at(dir.path());
        let broken = Program {
            name: "broken.cu",
            source: "extern \"C\" __global__ void f(float* x) { x[0] = 1.0f }\n",
            headers: &[],
        };
        let e = cache
            .compile(&broken, Target::cubin(9, 0), &CompileOptions::default())
            .expect_err("a syntax error");
        let KernelBuildError::Compile { program, log, .. } = &e else {
            panic!("not a compile error: {e:?}");
        };
        assert_eq!(program, "broken.cu");
        assert!(log.contains("expected a \";\""), "{log}");
        let shown = e.to_string();
        assert!(
            shown.starts_with("NVRTC could not compile broken.cu for sm_90:"),
            "{shown}"
        );
        assert!(shown.contains("broken.cu(1): error"), "{shown}");
        // Nothing was cached for it.
        assert_eq!(fs::read_dir(dir.path()).map(|d| d.count()).unwrap_or(0), 0);
    }

    #[test]
    fn a_warning_fails_only_a_strict_compile() {
        if nvrtc_or_skip("a_warning_fails_only_a_strict_compile").is_none() {
            return;
        }
        let cache = KernelCache::at(tempfile::tempdir().expect("a temp dir").path());
        let warns = Program {
            name: "warns.cu",
            source: "extern \"C\" __global__ void f(float* x) { int unused = 3; x[0] = 1.0f; }\n",
            headers: &[],
        };
        let lenient = cache
            .compile(&warns, Target::cubin(8, 0), &CompileOptions::default())
            .expect("a warning is not an error");
        assert!(lenient.log.contains("unused"), "{}", lenient.log);
        let e = cache
            .compile(
                &warns,
                Target::cubin(8, 0),
                &CompileOptions { strict: true },
            )
            .expect_err("strict: the warning is an error");
        assert!(e.to_string().contains("unused"), "{e}");
    }

    #[test]
    fn an_unwritable_cache_still_compiles() {
        if nvrtc_or_skip("an_unwritable_cache_still_compiles").is_none() {
            return;
        }
        // The cache "folder" is a file: nothing can be created under it.
        let file = tempfile::NamedTempFile::new().expect("a temp file");
        let cache = KernelCache::at(file.path());
        let options = CompileOptions::default();
        for n in 1..=2 {
            let compiled = cache
                .compile(&TINY, Target::cubin(8, 0), &options)
                .expect("compiles");
            // Reading under a file fails (ENOTDIR): counted as an unusable entry, never a hit.
            assert_ne!(compiled.origin, Origin::Cache);
            assert_eq!(cache.nvrtc_compiles(), n);
        }
    }

    #[test]
    fn the_default_cache_folder_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        assert_eq!(
            default_dir(env(&[
                ("STRATA_KERNEL_CACHE", "/k"),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ])),
            Some(PathBuf::from("/k"))
        );
        assert_eq!(
            default_dir(env(&[
                ("STRATA_KERNEL_CACHE", ""),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ])),
            Some(PathBuf::from("/x/strata-rs/kernels"))
        );
        assert_eq!(
            default_dir(env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/strata-rs/kernels"))
        );
        assert_eq!(default_dir(env(&[])), None);
    }

    #[test]
    fn targets_are_spelled_as_nvrtc_wants() {
        assert_eq!(Target::cubin(9, 0).to_string(), "sm_90");
        assert_eq!(Target::ptx(8, 6).to_string(), "compute_86");
        assert_eq!(
            CompileOptions { strict: true }.nvrtc_args(Target::cubin(8, 0)),
            [
                "--gpu-architecture=sm_80",
                "--std=c++17",
                "-Werror=all-warnings",
                "--ptxas-options=--warn-on-spills"
            ]
        );
    }
}
