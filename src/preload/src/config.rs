//! The process's configuration, read once per process (and again after `exec`): the environment
//! as `getenv` sees it and the machine's ceiling file, built by the pure parser both sides share
//! (`vramcap_common::config`). Nothing else happens when it is read: which subsystems it turns on
//! (the trace writer) is decided by the caller that needs them (`intercept::init`).

pub use vramcap_common::config::{CapMode, Config, Level, ModeOrigin, ceiling, privacy};
pub use vramcap_common::grammar::{group, limits, size};

pub use group::GroupConfig;

use std::sync::atomic::{AtomicPtr, Ordering};

fn from_env() -> Config {
    // Case-insensitive prefix, so a misspelled `vramcap_limit` reaches the unknown-name warning.
    let (vars, bad) = group::vars_from(our_env().into_iter());
    // Fault injection for tests/preload/faults.rs: only a real panic shows that the statically linked
    // unwinder (build.rs) finds our frames and `get` contains it (a broken one aborts).
    if vars.iter().any(|(k, v)| k == "VRAMCAP_TEST_PANIC" && v == "config") {
        panic!("VRAMCAP_TEST_PANIC=config");
    }
    // The file's identity before it is read: the watcher's baseline (`ceiling_watch`).
    let _ = CEILING_AT_START.set(file_identity(ceiling::PATH));
    let mut c = ceiling::from_env_vars(&vars);
    // Kept for the ceiling file's re-reads (`ceiling_watch`): the environment as it was at start.
    let _ = ENV_VARS.set(vars.clone());
    // A variable we could not read is no variable: the limit it meant would silently vanish.
    if let Some(e) = bad {
        c.error = Some(e);
    }
    c
}

static ENV_VARS: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// The ceiling file's identity taken just before the configuration read it. The watcher compares
/// with this first: taken when its thread first ran instead, an edit made between the read and
/// that first look (a loaded machine runs the thread late) was the baseline and never applied.
static CEILING_AT_START: std::sync::OnceLock<Option<[i64; 6]>> = std::sync::OnceLock::new();

/// [`CEILING_AT_START`]; `None` before the configuration was read.
pub fn ceiling_identity_at_start() -> Option<Option<[i64; 6]>> {
    CEILING_AT_START.get().copied()
}

/// What tells an edited file from the one read last: inode, size, change and modification time.
pub fn file_identity(path: &str) -> Option<[i64; 6]> {
    let c = std::ffi::CString::new(path).ok()?;
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // `stat`, not `lstat`: a ConfigMap's file is a link that Kubernetes swaps on update.
    (unsafe { libc::stat(c.as_ptr(), &mut st) } == 0).then(|| {
        [st.st_ino as i64, st.st_size, st.st_mtime, st.st_mtime_nsec, st.st_ctime, st.st_ctime_nsec]
    })
}

/// Our variables as the environment had them when the configuration was read.
pub fn env_vars() -> &'static [(String, String)] {
    ENV_VARS.get().map_or(&[], Vec::as_slice)
}

/// The environment's entries whose names [`group::is_ours`], read straight from `environ` as
/// `getenv` does. `std::env::vars_os` first copies every variable of the process (two
/// allocations each, under a lock of our own std that guards nothing against the C code around
/// us): 40–80 µs of every process's start on the reference VM (docs/performance.md). An entry
/// without `=` is skipped and a name may begin with `=`, as std has it.
fn our_env() -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    use std::os::unix::ffi::OsStrExt;
    unsafe extern "C" {
        static environ: *const *const std::ffi::c_char;
    }
    let mut out = Vec::new();
    let mut p = unsafe { environ };
    while !p.is_null() {
        let entry = unsafe { *p };
        if entry.is_null() {
            break;
        }
        if let Some((k, v)) = ours(unsafe { std::ffi::CStr::from_ptr(entry) }.to_bytes()) {
            out.push((std::ffi::OsStr::from_bytes(k).to_owned(), std::ffi::OsStr::from_bytes(v).to_owned()));
        }
        p = unsafe { p.add(1) };
    }
    out
}

/// One `environ` entry as `(name, value)` when the name is ours.
fn ours(entry: &[u8]) -> Option<(&[u8], &[u8])> {
    let eq = entry.iter().skip(1).position(|&c| c == b'=')? + 1;
    let (k, v) = (&entry[..eq], &entry[eq + 1..]);
    group::is_ours(k).then_some((k, v))
}

static CONFIG: AtomicPtr<Config> = AtomicPtr::new(std::ptr::null_mut());

/// The process's configuration. Racing first callers each parse and one wins the swap: nobody
/// waits on anybody, and the parse touches nothing but the environment and the ceiling file.
pub fn get() -> &'static Config {
    let p = CONFIG.load(Ordering::Acquire);
    if !p.is_null() {
        return unsafe { &*p };
    }
    // A parser bug must fail closed, once: without this a panic (caught further up, in the hook)
    // left no configuration, so every call re-parsed, panicked again and ran uncapped.
    let parsed = std::panic::catch_unwind(from_env).unwrap_or_else(|_| Config::parser_failed());
    let fresh = Box::into_raw(Box::new(parsed));
    match CONFIG.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            let c = unsafe { &*fresh };
            crate::log::set_level(c.log_level);
            for w in &c.warnings {
                crate::log::write_line(&format!("vramcap: {w}"));
            }
            if let Some(e) = &c.error {
                crate::log::write_line(&format!(
                    "vramcap: {e}. Refusing to run uncapped: CUDA initialisation will fail."
                ));
            }
            c
        }
        Err(winner) => {
            drop(unsafe { Box::from_raw(fresh) });
            unsafe { &*winner }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environ_entries_split_as_std_splits_them() {
        assert_eq!(ours(b"VRAMCAP_LIMIT=1g=x"), Some((&b"VRAMCAP_LIMIT"[..], &b"1g=x"[..])));
        assert_eq!(ours(b"vramcap_limit="), Some((&b"vramcap_limit"[..], &b""[..])));
        assert_eq!(ours(b"CUDA_DEVICE_MEMORY_LIMIT_0=2g"), Some((&b"CUDA_DEVICE_MEMORY_LIMIT_0"[..], &b"2g"[..])));
        // Not ours, no `=`, or a name that only starts after a leading `=`.
        assert_eq!(ours(b"PATH=/bin"), None);
        assert_eq!(ours(b"VRAMCAP_LIMIT"), None);
        assert_eq!(ours(b"=VRAMCAP_LIMIT=1g"), None);
        assert_eq!(ours(b""), None);
    }
}
