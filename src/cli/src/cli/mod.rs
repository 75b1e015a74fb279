//! The front door: `vramcap run` (a job under the preload), `vramcap demo` (the whole product on
//! the fake GPU) and `vramcap doctor` (is this machine set up right?). Binary only.
//!
//! The limit grammar is the library's own (`vramcap_common::grammar`, the parser the library reads its variables with), so
//! `run --limit` and `doctor` accept and reject exactly what the preloaded library would.

pub mod demo;
pub mod doctor;
pub mod limit;
pub mod probe;
pub mod reach;
pub mod run;
pub mod traces;

pub(crate) use vramcap_common::grammar::{group, limits, size};

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const LIB_NAME: &str = "libvramcap.so";

/// Output commands end like coreutils when their reader goes away (`vramcap report | head`):
/// killed by SIGPIPE, silently (a shell shows status 141). Rust ignores SIGPIPE, so `println!`
/// panicked instead ("failed printing to stdout: Broken pipe", exit 101). Not for the commands
/// that write to sockets (`sidecar`, `top`), where a peer hanging up must stay an error value,
/// nor for `run`, which stays the job's parent.
pub fn die_on_broken_pipe() {
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// The directory of the running `vramcap` binary (symlinks resolved).
pub fn exe_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the vramcap binary's own path: {e}"))?;
    let exe = exe.canonicalize().unwrap_or(exe);
    Ok(exe.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// Where `libvramcap.so` may be, in order: next to the binary (`cargo build --release` puts both
/// in target/release/), `deps/` below it (a `cargo test` build), the install prefix's lib/
/// (`scripts/install.sh`: PREFIX/bin/vramcap and PREFIX/lib/libvramcap.so).
pub fn library_candidates(dir: &Path) -> Vec<PathBuf> {
    vec![dir.join(LIB_NAME), dir.join("deps").join(LIB_NAME), dir.join("../lib").join(LIB_NAME)]
}

/// The preload library, absolute, or an error that lists where we looked and how to fix it.
pub fn preload_library() -> Result<PathBuf, String> {
    let dir = exe_dir()?;
    let cands = library_candidates(&dir);
    match cands.iter().find(|p| p.is_file()) {
        Some(p) => Ok(p.canonicalize().unwrap_or_else(|_| p.clone())),
        None => Err(format!(
            "{LIB_NAME} not found; looked in: {}. Expected it next to the vramcap binary \
             (cargo build --release builds both into target/release/) or in PREFIX/lib next to \
             PREFIX/bin/vramcap (scripts/install.sh --prefix PREFIX)",
            cands.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// `LD_PRELOAD` with `lib` first and every other entry kept in order (the loader splits on
/// spaces and colons; an earlier copy of our own library is dropped so it is loaded once).
pub fn prepend_preload(lib: &Path, existing: Option<&OsStr>) -> OsString {
    let mut out = OsString::from(lib);
    if let Some(old) = existing.and_then(OsStr::to_str) {
        for e in old.split([' ', ':']).filter(|e| !e.is_empty()) {
            if Path::new(e) != lib {
                out.push(":");
                out.push(e);
            }
        }
    } else if let Some(old) = existing.filter(|o| !o.is_empty()) {
        // Not UTF-8: keep it whole rather than guess at its separators.
        out.push(":");
        out.push(old);
    }
    out
}

/// Removes every variable the library reads (and the fake driver's), so a child sees only what
/// the caller sets: `demo` must not pick up a user's group or real driver, the doctor's self-test
/// must not fail on a limit the doctor reports separately.
pub fn clear_vramcap_env(cmd: &mut Command) {
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("VRAMCAP_") || k.starts_with("CUDA_DEVICE_MEMORY_LIMIT") || k.starts_with("FAKECUDA_") {
            cmd.env_remove(k.as_ref());
        }
    }
}

/// The environment's limit-related variables as `(name, value)` pairs, for `config::group`;
/// `Err` names a variable that is not UTF-8 (the library refuses to run with it).
pub fn limit_vars_from_env() -> Result<Vec<(String, String)>, limits::ConfigError> {
    match group::vars_from(std::env::vars_os()) {
        (_, Some(e)) => Err(e),
        (vars, None) => Ok(vars),
    }
}

/// Exit status of a finished child as a shell reports it: its code, or 128 + the signal.
pub fn shell_code(st: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_is_prepended_and_others_kept() {
        let lib = Path::new("/opt/v/libvramcap.so");
        assert_eq!(prepend_preload(lib, None), "/opt/v/libvramcap.so");
        assert_eq!(prepend_preload(lib, Some(OsStr::new(""))), "/opt/v/libvramcap.so");
        assert_eq!(
            prepend_preload(lib, Some(OsStr::new("/a/x.so /b/y.so:/opt/v/libvramcap.so"))),
            "/opt/v/libvramcap.so:/a/x.so:/b/y.so"
        );
    }
}
