//! Configuration from the environment, read once per process (and again after `exec`).
//! Every variable is documented in docs/configuration.md.

pub mod ceiling;
pub mod names;
pub mod privacy;
// The grammar lives in src/grammar/ (shared with the `vramcap` binary); `config::limits` etc. stay
// the names the library uses.
pub use crate::grammar::{group, group_name, limits, size};

pub use group::GroupConfig;

use limits::{ConfigError, LimitSpec};
use std::sync::atomic::{AtomicPtr, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
}

#[derive(Debug)]
pub struct Config {
    /// `VRAMCAP_DISABLE=1`: every hook forwards to the driver untouched.
    pub disabled: bool,
    pub log_level: Level,
    /// Per-process limits (`VRAMCAP_LIMIT*`).
    pub limits: LimitSpec,
    /// `VRAMCAP_GROUP` (or HAMi's container budget): the budget shared with other processes.
    pub group: Option<GroupConfig>,
    /// `VRAMCAP_REAL_LIBCUDA`: the driver to open instead of `libcuda.so.1`.
    pub real_libcuda: Option<String>,
    /// `VRAMCAP_TRACE`: trace file path template (`%p`, `%t`, `%e`, `%h`).
    pub trace: Option<String>,
    /// `VRAMCAP_SIDECAR`: Unix socket of the node's sidecar to stream events to.
    pub sidecar: Option<String>,
    /// `VRAMCAP_TRACE_MODE=lossless`: a thread whose event ring is full waits for the writer
    /// instead of dropping the event (`drop`, the default, never makes the job wait).
    pub lossless: bool,
    /// `VRAMCAP_JOB`: the job this process belongs to, written into its trace header (`vramcap
    /// run` sets a fresh one, so its report finds every trace of the job and no other's).
    pub job: Option<String>,
    /// Set when any input was invalid: we then fail closed (nothing is handed out uncapped).
    pub error: Option<ConfigError>,
    /// Non-fatal problems to print once.
    pub warnings: Vec<String>,
    /// `/etc/vramcap/limits`, when present and trusted: limits the environment can only lower.
    pub ceiling: Option<ceiling::Ceiling>,
}

impl Config {
    /// Pure: builds the configuration from `(name, value)` pairs.
    pub fn from_vars(vars: &[(String, String)]) -> Config {
        let get = |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let mut warnings = names::warnings(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let mut error = None;
        let log_level = match get("VRAMCAP_LOG").map(|v| v.trim().to_ascii_lowercase()) {
            None => Level::Warn,
            Some(v) => match v.as_str() {
                "" | "warn" | "warning" => Level::Warn,
                "error" => Level::Error,
                "info" => Level::Info,
                "debug" => Level::Debug,
                _ => {
                    warnings.push(format!(
                        "ignoring VRAMCAP_LOG={v:?}: expected error, warn, info or debug; using warn"
                    ));
                    Level::Warn
                }
            },
        };
        let disabled = match get("VRAMCAP_DISABLE").map(|v| v.trim().to_ascii_lowercase()) {
            None => false,
            Some(v) => match v.as_str() {
                "" | "0" | "false" | "no" | "off" => false,
                "1" | "true" | "yes" | "on" => true,
                _ => {
                    error = Some(ConfigError {
                        var: "VRAMCAP_DISABLE".into(),
                        value: v.clone(),
                        reason: "not a boolean".into(),
                        expected: "1 (pass everything through) or 0".into(),
                    });
                    false
                }
            },
        };
        let (limits, group) = match group::from_vars(vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
            Ok(s) => s,
            Err(e) => {
                error.get_or_insert(e);
                (LimitSpec::default(), None)
            }
        };
        let real_libcuda = get("VRAMCAP_REAL_LIBCUDA").filter(|v| !v.trim().is_empty()).map(str::to_string);
        let trace = get("VRAMCAP_TRACE").filter(|v| !v.trim().is_empty()).map(str::to_string);
        let sidecar = get("VRAMCAP_SIDECAR").filter(|v| !v.trim().is_empty()).map(str::to_string);
        let lossless = match get("VRAMCAP_TRACE_MODE").map(|v| v.trim().to_ascii_lowercase()) {
            None => false,
            Some(v) => match v.as_str() {
                "" | "drop" => false,
                "lossless" => true,
                _ => {
                    // Only the trace's completeness is at stake, never the cap: warn, keep going.
                    warnings.push(format!(
                        "ignoring VRAMCAP_TRACE_MODE={v:?}: expected drop (the default) or lossless; using drop"
                    ));
                    false
                }
            },
        };
        let job = get("VRAMCAP_JOB").and_then(|v| match crate::grammar::job::parse(v) {
            Ok(id) => Some(id.to_string()),
            Err(why) => {
                // Only which traces belong together is at stake, never the cap: warn, keep going.
                warnings.push(format!(
                    "ignoring VRAMCAP_JOB={v:?}: {why}; expected {}; the trace carries no job id",
                    crate::grammar::job::FORM
                ));
                None
            }
        });
        Config { disabled, log_level, limits, group, real_libcuda, trace, sidecar, lossless, job, error, warnings, ceiling: None }
    }

    /// What a panicking parse leaves: an error, so CUDA initialisation fails instead of running
    /// uncapped.
    fn parser_failed() -> Config {
        let mut c = Config::from_vars(&[]);
        c.error = Some(ConfigError {
            var: "VRAMCAP_*".into(),
            value: String::new(),
            reason: "reading the configuration failed (a vramcap bug: please report it with your VRAMCAP_* variables)".into(),
            expected: "see docs/configuration.md".into(),
        });
        c
    }

    fn from_env() -> Config {
        // Case-insensitive prefix, so a misspelled `vramcap_limit` reaches the unknown-name warning.
        let (vars, bad) = group::vars_from(our_env().into_iter());
        // Fault injection for tests/faults.rs: only a real panic shows that the statically linked
        // unwinder (build.rs) finds our frames and `get` contains it (a broken one aborts).
        if vars.iter().any(|(k, v)| k == "VRAMCAP_TEST_PANIC" && v == "config") {
            panic!("VRAMCAP_TEST_PANIC=config");
        }
        let mut c = ceiling::from_env_vars(&vars);
        // A variable we could not read is no variable: the limit it meant would silently vanish.
        if let Some(e) = bad {
            c.error = Some(e);
        }
        c
    }
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
/// waits on anybody, and the parse touches nothing but the environment.
pub fn get() -> &'static Config {
    let p = CONFIG.load(Ordering::Acquire);
    if !p.is_null() {
        return unsafe { &*p };
    }
    // A parser bug must fail closed, once: without this a panic (caught further up, in the hook)
    // left no configuration, so every call re-parsed, panicked again and ran uncapped.
    let parsed = std::panic::catch_unwind(Config::from_env).unwrap_or_else(|_| Config::parser_failed());
    let fresh = Box::into_raw(Box::new(parsed));
    match CONFIG.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            let c = unsafe { &*fresh };
            for w in &c.warnings {
                crate::log::write_line(&format!("vramcap: {w}"));
            }
            if let Some(e) = &c.error {
                crate::log::write_line(&format!(
                    "vramcap: {e}. Refusing to run uncapped: CUDA initialisation will fail."
                ));
            }
            crate::trace::configure(c);
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

    fn cfg(vars: &[(&str, &str)]) -> Config {
        let v: Vec<(String, String)> = vars.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        Config::from_vars(&v)
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]);
        assert!(!c.disabled && c.error.is_none() && c.limits.is_empty());
        assert_eq!(c.log_level, Level::Warn);
    }

    #[test]
    fn disable_and_log_levels() {
        assert!(cfg(&[("VRAMCAP_DISABLE", "1")]).disabled);
        assert!(!cfg(&[("VRAMCAP_DISABLE", "0")]).disabled);
        assert!(cfg(&[("VRAMCAP_DISABLE", "maybe")]).error.is_some());
        assert_eq!(cfg(&[("VRAMCAP_LOG", "DEBUG")]).log_level, Level::Debug);
        let c = cfg(&[("VRAMCAP_LOG", "loud")]);
        assert_eq!(c.log_level, Level::Warn);
        assert_eq!(c.warnings.len(), 1);
    }

    #[test]
    fn job_id() {
        assert_eq!(cfg(&[("VRAMCAP_JOB", " 7f3a-run ")]).job.as_deref(), Some("7f3a-run"));
        assert_eq!(cfg(&[]).job, None);
        let c = cfg(&[("VRAMCAP_JOB", "a b")]);
        assert_eq!(c.job, None);
        assert!(c.error.is_none(), "never fails closed: only the trace's grouping is at stake");
        assert!(c.warnings[0].contains("VRAMCAP_JOB=\"a b\"") && c.warnings[0].contains("it contains ' '"), "{:?}", c.warnings);
    }

    #[test]
    fn trace_mode() {
        assert!(!cfg(&[]).lossless);
        assert!(cfg(&[("VRAMCAP_TRACE_MODE", " Lossless ")]).lossless);
        assert!(!cfg(&[("VRAMCAP_TRACE_MODE", "drop")]).lossless);
        let c = cfg(&[("VRAMCAP_TRACE_MODE", "lossy")]);
        assert!(!c.lossless && c.error.is_none());
        assert!(c.warnings[0].contains("VRAMCAP_TRACE_MODE"), "{:?}", c.warnings);
    }

    #[test]
    fn a_bad_limit_is_an_error_not_a_silent_pass() {
        let c = cfg(&[("VRAMCAP_LIMIT", "abc")]);
        assert!(c.error.unwrap().to_string().contains("VRAMCAP_LIMIT"));
    }
}
