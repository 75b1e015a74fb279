//! vramcap's pure modules, compiled for the fuzz targets by path (the same files the library and
//! the CLI build), plus the two tiny crate-level items they call, as no-op stand-ins: logging
//! (stderr) and turning the trace on. Nothing here is a second copy of a parser.
#![allow(dead_code, unused_imports, clippy::all)]

#[path = "../../src/config/mod.rs"]
pub mod config;

/// The limit grammar `config` re-exports (src/grammar/, shared by the library and the CLI).
#[path = "../../src/grammar/mod.rs"]
pub mod grammar;

/// The CLI's name for the size grammar (`crate::size` in src/analysis).
pub use config::size;

#[path = "../../src/analysis/mod.rs"]
pub mod analysis;

pub mod group;

#[path = "../../src/sidecar/mod.rs"]
pub mod sidecar;

pub mod env_input;

pub mod log {
    /// The library writes configuration warnings to fd 2; a fuzzer wants silence.
    pub fn write_line(_line: &str) {}

    pub fn monotonic_ns() -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

pub mod trace {
    /// The library starts event recording here; parsing is all the fuzzer exercises.
    pub fn configure(_cfg: &crate::config::Config) {}
}

/// A per-process scratch directory for targets that must go through files.
pub fn scratch_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("vramcap-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch dir");
        d
    })
    .clone()
}
