//! Finding the CUDA libraries that cudarc opens by name at run time (libnvrtc, libcublas).
//!
//! cudarc opens a library through the dynamic loader by its names (`libcublas.so`,
//! `libcublas.so.13`, ...) and panics on first use when it cannot. So each library is found
//! first, in this order:
//! 1. its environment variable (`STRATA_NVRTC_PATH`, `STRATA_CUBLAS_PATH`): the library file, or
//!    a folder holding `lib<name>.so.<major>`;
//! 2. the dynamic loader's own search (`LD_LIBRARY_PATH`, the system's CUDA install);
//! 3. the active Python virtual environment (`$VIRTUAL_ENV`), where NVIDIA's wheels put it
//!    (`lib/python3.*/site-packages/nvidia/*/lib/lib<name>.so.<major>`).
//!
//! A library found by path is opened once with `dlopen` and never closed; cudarc's later open by
//! name then gets that same library, since the loader matches an already loaded library by its
//! soname (`libcublas.so.13`). A library's own dependencies (libcublasLt beside libcublas) are
//! found through the wheel's `$ORIGIN` run path.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

/// One library cudarc opens by name.
#[derive(Clone, Copy, Debug)]
pub struct CudaLibrary {
    /// `nvrtc` for libnvrtc.so.
    pub name: &'static str,
    /// The environment variable that names the file or its folder.
    pub env: &'static str,
    /// The pip package that carries it, for messages.
    pub wheel: &'static str,
}

pub const NVRTC: CudaLibrary = CudaLibrary {
    name: "nvrtc",
    env: "STRATA_NVRTC_PATH",
    wheel: "nvidia-cuda-nvrtc",
};

pub const CUBLAS: CudaLibrary = CudaLibrary {
    name: "cublas",
    env: "STRATA_CUBLAS_PATH",
    wheel: "nvidia-cublas",
};

impl CudaLibrary {
    fn prefix(&self) -> String {
        format!("lib{}.so.", self.name)
    }

    /// Finds the library and opens it when found by path, reading the environment through
    /// `env`; `present` asks cudarc whether it can open the library by name. Returns where it
    /// was found, for messages.
    pub fn find(
        &self,
        env: impl Fn(&str) -> Option<OsString>,
        present: impl Fn() -> bool,
    ) -> Result<String, String> {
        let found_at = if let Some(given) = env(self.env) {
            let file = self.library_file(Path::new(&given)).ok_or_else(|| {
                format!(
                    "{}={} is neither a lib{} file nor a folder holding {}<major>",
                    self.env,
                    Path::new(&given).display(),
                    self.name,
                    self.prefix()
                )
            })?;
            open_by_path(&file)?;
            format!("{} (from {})", file.display(), self.env)
        } else if present() {
            "the dynamic loader's search path".to_string()
        } else if let Some(file) =
            env("VIRTUAL_ENV").and_then(|v| self.virtualenv_library(v.into()))
        {
            open_by_path(&file)?;
            format!("{} (in $VIRTUAL_ENV)", file.display())
        } else {
            return Err(format!(
                "lib{} was not found: set {} to it, add its folder to LD_LIBRARY_PATH, or \
                 `pip install {}` into the active virtual environment",
                self.name, self.env, self.wheel
            ));
        };
        if !present() {
            return Err(format!(
                "{found_at} was opened, but cudarc cannot open it by name (its soname must be \
                 {}13 or another name cudarc looks for)",
                self.prefix()
            ));
        }
        Ok(found_at)
    }

    /// `path` itself when it is a file, else the newest `lib<name>.so.<major>` in the folder.
    pub fn library_file(&self, path: &Path) -> Option<PathBuf> {
        if path.is_file() {
            return Some(path.to_path_buf());
        }
        let mut found: Vec<(u32, PathBuf)> = fs::read_dir(path)
            .ok()?
            .filter_map(|entry| {
                let file = entry.ok()?.path();
                Some((self.library_major(&file)?, file))
            })
            .collect();
        found.sort();
        found.pop().map(|(_, file)| file)
    }

    /// 13 for `.../libnvrtc.so.13`; `None` for any other name.
    fn library_major(&self, file: &Path) -> Option<u32> {
        file.file_name()?
            .to_str()?
            .strip_prefix(&self.prefix())?
            .parse()
            .ok()
    }

    /// `$VIRTUAL_ENV/lib/python3.*/site-packages/nvidia/*/lib/lib<name>.so.<major>`, the newest
    /// major when several wheels are installed: the CUDA 13 wheels share the folder `cu13`
    /// (`cuda_nvrtc` and `cublas` in the CUDA 12 ones).
    pub fn virtualenv_library(&self, venv: PathBuf) -> Option<PathBuf> {
        let mut candidates = Vec::new();
        for python in fs::read_dir(venv.join("lib")).ok()?.flatten() {
            let nvidia = python.path().join("site-packages").join("nvidia");
            let Ok(packages) = fs::read_dir(&nvidia) else {
                continue;
            };
            for package in packages.flatten() {
                if let Some(file) = self.library_file(&package.path().join("lib")) {
                    candidates.push(file);
                }
            }
        }
        candidates.sort_by_key(|file| self.library_major(file));
        candidates.pop()
    }
}

/// Opens the library for the life of the process, so that cudarc's open by soname finds it.
pub fn open_by_path(file: &Path) -> Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: opening runs the library's initialisers (NVIDIA's runtime libraries, found where
    // they are installed); RTLD_GLOBAL so that later opens by name resolve to this one.
    let library = unsafe { Library::open(Some(file), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("cannot open {}: {e}", file.display()))?;
    // Never closed: cudarc holds symbols of it for the life of the process.
    std::mem::forget(library);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_lookup_picks_the_newest_major_and_reports_bad_files() {
        for lib in [NVRTC, CUBLAS] {
            let dir = tempfile::tempdir().expect("a temp dir");
            assert_eq!(lib.library_file(dir.path()), None);
            let n = lib.name;
            for name in [
                format!("lib{n}.so.12"),
                format!("lib{n}.so.13"),
                format!("lib{n}-builtins.so.13.5"),
                format!("lib{n}Lt.so.14"),
                format!("lib{n}.so.13.alt"),
            ] {
                fs::write(dir.path().join(name), b"not a library").expect("a file");
            }
            let found = lib.library_file(dir.path()).expect("a library file");
            assert_eq!(found, dir.path().join(format!("lib{n}.so.13")));
            assert_eq!(lib.library_file(&found), Some(found.clone()));
            let e = open_by_path(&found).expect_err("not a shared object");
            assert!(
                e.starts_with(&format!("cannot open {}: ", found.display())),
                "{e}"
            );
            assert_eq!(lib.library_file(&dir.path().join("absent")), None);
        }
    }

    #[test]
    fn a_bad_path_in_the_environment_is_a_clear_error() {
        for lib in [NVRTC, CUBLAS] {
            let dir = tempfile::tempdir().expect("a temp dir");
            let not_a_library = dir.path().join(format!("lib{}.so.13", lib.name));
            fs::write(&not_a_library, b"not a library").expect("a file");
            let env_with = |value: PathBuf| {
                move |name: &str| (name == lib.env).then(|| value.clone().into_os_string())
            };
            let absent = dir.path().join("absent");
            let e = lib
                .find(env_with(absent.clone()), || false)
                .expect_err("no such file");
            assert_eq!(
                e,
                format!(
                    "{}={} is neither a lib{} file nor a folder holding lib{}.so.<major>",
                    lib.env,
                    absent.display(),
                    lib.name,
                    lib.name
                )
            );
            for given in [not_a_library.clone(), dir.path().to_path_buf()] {
                let e = lib
                    .find(env_with(given), || false)
                    .expect_err("not a shared object");
                assert!(
                    e.starts_with(&format!("cannot open {}: ", not_a_library.display())),
                    "{e}"
                );
            }
            let e = lib.find(|_| None, || false).expect_err("nowhere");
            assert_eq!(
                e,
                format!(
                    "lib{} was not found: set {} to it, add its folder to LD_LIBRARY_PATH, or \
                     `pip install {}` into the active virtual environment",
                    lib.name, lib.env, lib.wheel
                )
            );
        }
    }

    #[test]
    fn a_virtualenv_library_is_found_in_any_nvidia_package() {
        let venv = tempfile::tempdir().expect("a temp dir");
        assert_eq!(NVRTC.virtualenv_library(venv.path().to_path_buf()), None);
        let lib = venv
            .path()
            .join("lib/python3.11/site-packages/nvidia/cu13/lib");
        let older = venv
            .path()
            .join("lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib");
        fs::create_dir_all(&lib).expect("folders");
        fs::create_dir_all(&older).expect("folders");
        fs::write(lib.join("libnvrtc.so.13"), b"").expect("a file");
        fs::write(lib.join("libcublas.so.13"), b"").expect("a file");
        // A CUDA 12 wheel beside it: its folder sorts last, but its major is older.
        fs::write(older.join("libnvrtc.so.12"), b"").expect("a file");
        assert_eq!(
            NVRTC.virtualenv_library(venv.path().to_path_buf()),
            Some(lib.join("libnvrtc.so.13"))
        );
        assert_eq!(
            CUBLAS.virtualenv_library(venv.path().to_path_buf()),
            Some(lib.join("libcublas.so.13"))
        );
    }
}
