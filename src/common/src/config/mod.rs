//! The configuration vramcap runs with, built from `(name, value)` pairs of the environment and
//! the machine's ceiling file ([`ceiling`]): pure, so the library (which reads it once per
//! process, src/preload/src/config.rs) and `vramcap doctor` reach the same verdict from the same
//! input. Every variable is documented in docs/configuration.md.

pub mod ceiling;
pub mod privacy;

use crate::grammar::group::{self, GroupConfig};
use crate::grammar::limits::{ConfigError, LimitSpec};
use crate::grammar::names;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
}

/// `VRAMCAP_MODE` (issue 26): what the cap does with an allocation it would refuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapMode {
    /// Refuse it (the default).
    Enforce,
    /// Grant it and record a `would_deny` event: the job sees the physical device.
    Observe,
}

impl CapMode {
    pub fn name(self) -> &'static str {
        match self {
            CapMode::Enforce => "enforce",
            CapMode::Observe => "observe",
        }
    }
}

/// Where the mode in force came from (`vramcap doctor` says it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeOrigin {
    /// Nobody set `VRAMCAP_MODE`.
    Default,
    /// The process's environment.
    Environment,
    /// The ceiling file's own `VRAMCAP_MODE` line.
    CeilingFile,
    /// The environment asked for observe and the ceiling file does not allow it.
    RefusedByCeiling,
}

#[derive(Debug)]
pub struct Config {
    /// `VRAMCAP_DISABLE=1`: every hook forwards to the driver untouched.
    pub disabled: bool,
    /// `VRAMCAP_MODE`: enforce (the default) or observe.
    pub mode: CapMode,
    pub mode_origin: ModeOrigin,
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
    /// `VRAMCAP_TRACE_LIST`: a file (that `vramcap run --report` made, private) to which each
    /// traced process appends the path of the trace file it actually opened, so the report reads
    /// exactly those, whatever fallback name a process had to take.
    pub trace_list: Option<String>,
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
        let mode = match get("VRAMCAP_MODE").map(|v| v.trim().to_ascii_lowercase()) {
            None => CapMode::Enforce,
            Some(v) => match v.as_str() {
                "" | "enforce" => CapMode::Enforce,
                "observe" => CapMode::Observe,
                _ => {
                    // Never fails open: a mode we cannot read is not taken for observe.
                    error.get_or_insert(ConfigError {
                        var: "VRAMCAP_MODE".into(),
                        value: v.clone(),
                        reason: "not a mode".into(),
                        expected: "enforce (the default: refuse what does not fit) or observe (grant it and record a would_deny event)".into(),
                    });
                    CapMode::Enforce
                }
            },
        };
        let mode_origin = if get("VRAMCAP_MODE").is_some_and(|v| !v.trim().is_empty()) { ModeOrigin::Environment } else { ModeOrigin::Default };
        let (limits, group) = match group::from_vars(vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
            Ok(s) => s,
            Err(e) => {
                error.get_or_insert(e);
                (LimitSpec::default(), None)
            }
        };
        if let Some(v) = get("CUDA_DISABLE_CONTROL").filter(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")) {
            // HAMi-core's off switch. vramcap answers only to its own, which a platform's ceiling
            // can forbid; a HAMi setting never turns the cap off (docs/configuration.md).
            warnings.push(format!(
                "ignoring CUDA_DISABLE_CONTROL={v:?} (HAMi-core's switch): vramcap keeps the cap; VRAMCAP_DISABLE=1 turns vramcap off where no ceiling file forbids it"
            ));
        }
        let real_libcuda = get("VRAMCAP_REAL_LIBCUDA").filter(|v| !v.trim().is_empty()).map(str::to_string);
        let trace = get("VRAMCAP_TRACE").filter(|v| !v.trim().is_empty()).map(str::to_string);
        let sidecar = get("VRAMCAP_SIDECAR").filter(|v| !v.trim().is_empty()).map(str::to_string);
        let trace_list = get("VRAMCAP_TRACE_LIST").filter(|v| !v.trim().is_empty()).map(str::to_string);
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
        Config { disabled, mode, mode_origin, log_level, limits, group, real_libcuda, trace, sidecar, lossless, job, trace_list, error, warnings, ceiling: None }
    }

    /// What a panicking parse leaves: an error, so CUDA initialisation fails instead of running
    /// uncapped.
    pub fn parser_failed() -> Config {
        let mut c = Config::from_vars(&[]);
        c.error = Some(ConfigError {
            var: "VRAMCAP_*".into(),
            value: String::new(),
            reason: "reading the configuration failed (a vramcap bug: please report it with your VRAMCAP_* variables)".into(),
            expected: "see docs/configuration.md".into(),
        });
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn hamis_off_switch_is_not_obeyed_and_says_so() {
        let c = cfg(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g"), ("CUDA_DISABLE_CONTROL", "true")]);
        assert!(!c.disabled && c.group.is_some());
        assert!(c.warnings.iter().any(|w| w.contains("ignoring CUDA_DISABLE_CONTROL=\"true\"")), "{:?}", c.warnings);
        assert!(cfg(&[("CUDA_DISABLE_CONTROL", "false")]).warnings.is_empty());
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
    fn cap_mode() {
        assert_eq!((cfg(&[]).mode, cfg(&[]).mode_origin), (CapMode::Enforce, ModeOrigin::Default));
        let c = cfg(&[("VRAMCAP_MODE", " Observe ")]);
        assert_eq!((c.mode, c.mode_origin), (CapMode::Observe, ModeOrigin::Environment));
        assert_eq!(cfg(&[("VRAMCAP_MODE", "enforce")]).mode, CapMode::Enforce);
        assert_eq!(cfg(&[("VRAMCAP_MODE", "")]).mode_origin, ModeOrigin::Default);
        // A bad value fails closed, naming the variable and what it takes.
        let c = cfg(&[("VRAMCAP_MODE", "watch")]);
        assert_eq!(c.mode, CapMode::Enforce);
        let e = c.error.expect("an error").to_string();
        assert!(e.contains("VRAMCAP_MODE") && e.contains("enforce") && e.contains("observe"), "{e}");
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
