//! The platform's ceiling: `/etc/vramcap/limits`, a root-owned file of `KEY=VALUE` lines with the
//! variables' names and grammar (issue 15). The environment of a process can be changed by
//! anything running in its container, so when the file exists it is the ceiling: the environment
//! may lower limits and add a trace, but never raise a limit (both are resolved per device and
//! the smaller wins: [`cap`]), leave the file's group, name another driver, or disable vramcap.
//! A refused override says so once on stderr.
//!
//! In secure-execution mode (`getauxval(AT_SECURE)`: setuid, setgid, file capabilities, where
//! `/etc/ld.so.preload` still loads us) the caller's environment must not choose what the
//! privileged process opens: every variable naming a file, socket, directory or library is
//! ignored (with a line), leaving the ceiling file and defaults.
//!
//! The path is a constant on purpose: a variable or file that moved it would be the attacker's
//! way out. Tests run as root in a mount namespace with their own `/etc` (tests/preload/ceiling.rs).

use super::Config;
use crate::grammar::group::GroupConfig;
use crate::grammar::limits::{ConfigError, LimitSpec};
use crate::grammar::names;

pub const PATH: &str = "/etc/vramcap/limits";

/// Variables that name something the process opens: never from the environment of a
/// secure-execution process.
pub const PATH_VARS: &[&str] = &[
    "VRAMCAP_REAL_LIBCUDA",
    "VRAMCAP_REAL_LIBNVML",
    "VRAMCAP_TRACE",
    "VRAMCAP_SIDECAR",
    "VRAMCAP_GROUP_DIR",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
];

/// The file's limits, which the environment's can only lower.
#[derive(Debug, Clone, Default)]
pub struct Ceiling {
    pub path: String,
    pub limits: LimitSpec,
    pub group_limits: LimitSpec,
}

/// setuid, setgid or file capabilities: the loader's secure-execution mode.
pub fn secure_mode() -> bool {
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

/// Why a file or directory we would trust is not safe: not root's, or writable by a non-root
/// group or by everyone.
fn untrusted(st: &libc::stat) -> Option<String> {
    if st.st_uid != 0 {
        return Some(format!("owned by uid {}, not root", st.st_uid));
    }
    if st.st_mode & 0o002 != 0 || (st.st_mode & 0o020 != 0 && st.st_gid != 0) {
        return Some(format!("writable by users other than root (mode {:o})", st.st_mode & 0o7777));
    }
    None
}

/// The file's lines: `Ok(None)` if there is no file; `Err(warning)` if it exists but cannot be
/// trusted or read (then it is ignored, with that warning). A symbolic link is followed (a
/// Kubernetes ConfigMap volume's files are links into the volume): only root can place one in
/// the root-owned directory we check, and the file opened must be root's too.
pub fn read_file(path: &str) -> Result<Option<String>, String> {
    let c = std::ffi::CString::new(path).map_err(|_| format!("{path:?}: NUL byte"))?;
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENOENT) { Ok(None) } else { Err(format!("ignoring {path}: {e}")) };
    }
    use std::os::fd::FromRawFd;
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(format!("ignoring {path}: not a regular file"));
    }
    if let Some(why) = untrusted(&st) {
        return Err(format!("ignoring {path}: {why}; the ceiling file must be root's and writable only by root"));
    }
    let dir = std::path::Path::new(path).parent().unwrap_or(std::path::Path::new("/"));
    let dc = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap_or_default();
    let mut dst: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::stat(dc.as_ptr(), &mut dst) } != 0 {
        return Err(format!("ignoring {path}: cannot inspect {}", dir.display()));
    }
    if let Some(why) = untrusted(&dst) {
        return Err(format!("ignoring {path}: its directory {} is {why}", dir.display()));
    }
    let mut text = String::new();
    use std::io::Read;
    f.take(1 << 16).read_to_string(&mut text).map_err(|e| format!("ignoring {path}: {e}"))?;
    Ok(Some(text))
}

/// `KEY=VALUE` lines; `#` comments and blank lines skipped. A line we cannot read is an error:
/// a platform's ceiling that does not say what it meant fails closed.
pub fn parse(path: &str, text: &str) -> Result<Vec<(String, String)>, ConfigError> {
    let mut vars = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |reason: &str| ConfigError {
            var: format!("{path} line {}", n + 1),
            value: line.to_string(),
            reason: reason.to_string(),
            expected: "KEY=VALUE with a vramcap variable's name and grammar (docs/configuration.md)".into(),
        };
        let (k, v) = line.split_once('=').ok_or_else(|| bad("no `=`"))?;
        let k = k.trim();
        if !(names::is_known(k) || k.starts_with("CUDA_DEVICE_MEMORY_LIMIT") || k == "CUDA_DEVICE_MEMORY_SHARED_CACHE") {
            return Err(bad(&format!("unknown variable {k} (did you mean {}?)", names::nearest(k))));
        }
        vars.push((k.to_string(), v.trim().to_string()));
    }
    Ok(vars)
}

fn truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

/// The configuration from the ceiling file's text (if any) and the environment. Pure.
pub fn merge(file: Option<(&str, &str)>, env: &[(String, String)], secure: bool) -> Config {
    let mut warnings = Vec::new();
    let env: Vec<(String, String)> = env
        .iter()
        .filter(|(k, v)| {
            let drop = secure && PATH_VARS.contains(&k.as_str()) && !v.trim().is_empty();
            if drop {
                warnings.push(format!(
                    "ignoring {k}: this process runs in secure-execution mode (setuid, setgid or capabilities), \
                     where files, sockets and libraries come only from {PATH} and the defaults"
                ));
            }
            !drop
        })
        .cloned()
        .collect();
    let Some((path, text)) = file else {
        let mut c = Config::from_vars(&env);
        c.warnings.splice(0..0, warnings);
        return c;
    };
    let fvars = match parse(path, text) {
        Ok(v) => v,
        Err(e) => {
            let mut c = Config::from_vars(&[]);
            c.error = Some(e);
            return c;
        }
    };
    let fc = Config::from_vars(&fvars);
    if let Some(mut e) = fc.error {
        e.reason = format!("{} (in {path})", e.reason);
        let mut c = Config::from_vars(&[]);
        c.error = Some(e);
        return c;
    }
    let refuse = |k: &str, v: &str, why: &str| format!("ignoring {k}={v:?}: {path} sets this machine's ceiling, {why}");
    let mut merged = fvars.clone();
    for (k, v) in &env {
        let file_value = fvars.iter().find(|(fk, _)| fk == k).map(|(_, fv)| fv.as_str());
        let refused = match k.as_str() {
            "VRAMCAP_DISABLE" => (truthy(v) && !fc.disabled).then_some("which the environment cannot turn off"),
            // Observe mode grants what the cap would refuse: only the file itself turns it on.
            "VRAMCAP_MODE" if v.trim().eq_ignore_ascii_case("observe") && fc.mode != super::CapMode::Observe => {
                Some("and only a VRAMCAP_MODE=observe line in it turns observe mode on here")
            }
            "VRAMCAP_GROUP" | "VRAMCAP_GROUP_DIR" | "CUDA_DEVICE_MEMORY_SHARED_CACHE"
                if fc.group.is_some() && file_value != Some(v.trim()) && !v.trim().is_empty() =>
            {
                Some("whose group the environment cannot leave")
            }
            // Every spelling of a family the file sets (the list form, `_<i>` suffixes): the
            // file's alone, so a per-device name cannot override it (issue 25).
            k if sharing_family(k).is_some_and(|f| file_sets(&fvars, f)) && file_value.is_none_or(|f| f.trim() != v.trim()) && !v.trim().is_empty() => {
                Some("and a job's share of its group is the platform's to set")
            }
            "VRAMCAP_REAL_LIBCUDA" | "VRAMCAP_REAL_LIBNVML" if file_value != Some(v.trim()) && !v.trim().is_empty() => {
                Some("and the driver it counts is not the environment's to choose")
            }
            _ => None,
        };
        if let Some(why) = refused {
            warnings.push(refuse(k, v, why));
            continue;
        }
        // Not refused but the file's stands: the same value, a blank, or a "0".
        if sharing_family(k).is_some_and(|f| file_sets(&fvars, f)) {
            continue; // a blank or the file's own value: the file's stands
        }
        match k.as_str() {
            "VRAMCAP_DISABLE" | "VRAMCAP_REAL_LIBCUDA" | "VRAMCAP_REAL_LIBNVML" => continue,
            "VRAMCAP_GROUP" | "VRAMCAP_GROUP_DIR" | "CUDA_DEVICE_MEMORY_SHARED_CACHE" if fc.group.is_some() => continue,
            _ => {}
        }
        // Limits (capped by the file's at resolve time), a trace, the sidecar, the log level.
        merged.retain(|(mk, _)| mk != k);
        merged.push((k.clone(), v.clone()));
    }
    let mut c = Config::from_vars(&merged);
    // The file's group stands whatever the environment's limits did (a process limit would
    // otherwise turn HAMi's container budget off).
    if let Some(fg) = &fc.group
        && c.error.is_none()
    {
        let limits = match &c.group {
            Some(g) if g.name == fg.name && !g.limits.is_empty() => g.limits.clone(),
            _ => fg.limits.clone(),
        };
        // Sharing settings come through `merged`: the file's where it sets them (refused from
        // the environment above), else the environment's.
        let mut g = GroupConfig { name: fg.name.clone(), limits, dir: fg.dir.clone(), ..fg.clone() };
        if let Some(e) = c.group.as_ref() {
            (g.policy, g.priority, g.reserve, g.headroom) = (e.policy, e.priority, e.reserve.clone(), e.headroom.clone());
        }
        c.group = Some(g);
    }
    // HAMi's variable counts only where no vramcap limit is set (grammar::group); the file's
    // limits are vramcap's, so the environment's CUDA_DEVICE_MEMORY_LIMIT is not used: said once
    // per variable instead of nothing at all.
    if c.error.is_none() {
        let used = |k: &str| c.group.as_ref().is_some_and(|g| g.limits.entries.iter().any(|e| e.var == k));
        for (k, v) in &env {
            let hami = k == "CUDA_DEVICE_MEMORY_LIMIT" || k.starts_with("CUDA_DEVICE_MEMORY_LIMIT_");
            if hami && !v.trim().is_empty() && !used(k) && !warnings.iter().any(|w| w.starts_with(&format!("ignoring {k}="))) {
                warnings.push(refuse(k, v, "and HAMi's variable applies only where no vramcap limit is set (the environment may lower the ceiling with VRAMCAP_LIMIT)"));
            }
        }
    }
    c.disabled = fc.disabled;
    // The environment may only make the mode stricter (enforce over the file's observe).
    c.mode_origin = match (c.mode, fc.mode) {
        (super::CapMode::Observe, _) => super::ModeOrigin::CeilingFile,
        _ if env.iter().any(|(k, v)| k == "VRAMCAP_MODE" && v.trim().eq_ignore_ascii_case("observe")) => super::ModeOrigin::RefusedByCeiling,
        (super::CapMode::Enforce, super::CapMode::Observe) => super::ModeOrigin::Environment,
        _ => super::ModeOrigin::Default,
    };
    c.ceiling = Some(Ceiling {
        path: path.to_string(),
        limits: fc.limits.clone(),
        group_limits: fc.group.as_ref().map(|g| g.limits.clone()).unwrap_or_default(),
    });
    c.warnings.splice(0..0, warnings);
    c
}

/// `devices` (in order) with their ceilings, runs of one value together: `512.0 MiB on devices
/// 0-7`, `1.0 GiB on device 0, 2.0 GiB on devices 1-3`.
pub fn describe_devices(devices: &[usize], ceiling: &[u64]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < devices.len() {
        let v = ceiling.get(devices[i]).copied().unwrap_or(0);
        let mut j = i;
        while j + 1 < devices.len() && devices[j + 1] == devices[j] + 1 && ceiling.get(devices[j + 1]).copied() == Some(v) {
            j += 1;
        }
        let which = if i == j { format!("device {}", devices[i]) } else { format!("devices {}-{}", devices[i], devices[j]) };
        match parts.last_mut() {
            // The same ceiling after a gap: one value, its device lists joined.
            Some(last) if last.starts_with(&format!("{} on ", crate::grammar::size::human(v))) => last.push_str(&format!(", {}", which.trim_start_matches("devices ").trim_start_matches("device "))),
            _ => parts.push(format!("{} on {which}", crate::grammar::size::human(v))),
        }
        i = j + 1;
    }
    parts.join("; ")
}

/// Lowers each device's limit to the ceiling's (0 = no limit on either side); returns the
/// devices where the environment asked for more.
pub fn cap(limits: &mut [u64], ceiling: &[u64]) -> Vec<usize> {
    let mut raised = Vec::new();
    for (d, (l, &c)) in limits.iter_mut().zip(ceiling).enumerate() {
        if c != 0 && (*l == 0 || *l > c) {
            raised.push(d);
            *l = c;
        }
    }
    raised
}

/// The process's configuration: the ceiling file (when present and trusted) and the environment.
pub fn from_env_vars(env: &[(String, String)]) -> Config {
    let secure = secure_mode();
    match read_file(PATH) {
        Ok(Some(text)) => merge(Some((PATH, &text)), env, secure),
        Ok(None) => merge(None, env, secure),
        Err(w) => {
            let mut c = merge(None, env, secure);
            c.warnings.insert(0, w);
            c
        }
    }
}

/// The sharing family of `k` (`VRAMCAP_GROUP_POLICY`, `VRAMCAP_PRIORITY`,
/// `VRAMCAP_GROUP_RESERVE[_<i>]`, `VRAMCAP_GROUP_HEADROOM[_<i>]`): where the ceiling file sets any
/// name of a family, the environment cannot change any name of it.
fn sharing_family(k: &str) -> Option<&'static str> {
    const SCALAR: [&str; 2] = ["VRAMCAP_GROUP_POLICY", "VRAMCAP_PRIORITY"];
    const PER_DEVICE: [&str; 2] = ["VRAMCAP_GROUP_RESERVE", "VRAMCAP_GROUP_HEADROOM"];
    SCALAR.into_iter().find(|f| k == *f).or_else(|| PER_DEVICE.into_iter().find(|f| k == *f || k.strip_prefix(f).is_some_and(|r| r.starts_with('_'))))
}

fn file_sets(fvars: &[(String, String)], family: &str) -> bool {
    fvars.iter().any(|(k, v)| sharing_family(k) == Some(family) && !v.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    }

    const FILE: &str = "# platform\nVRAMCAP_LIMIT=20g\nVRAMCAP_GROUP=pod-a\nVRAMCAP_GROUP_LIMIT=40g\nVRAMCAP_GROUP_DIR=/run/vramcap\n";

    #[test]
    fn the_environment_cannot_disable_leave_or_swap_the_driver() {
        let c = merge(
            Some((PATH, FILE)),
            &env(&[
                ("VRAMCAP_DISABLE", "1"),
                ("VRAMCAP_GROUP", "other"),
                ("VRAMCAP_GROUP_DIR", "/tmp"),
                ("VRAMCAP_REAL_LIBCUDA", "/tmp/x.so"),
                ("VRAMCAP_TRACE", "/tmp/t.jsonl"),
            ]),
            false,
        );
        assert!(c.error.is_none(), "{:?}", c.error);
        assert!(!c.disabled);
        let g = c.group.unwrap();
        assert_eq!((g.name.as_deref(), g.dir.as_str()), (Some("pod-a"), "/run/vramcap"));
        assert_eq!(c.real_libcuda, None);
        assert_eq!(c.trace.as_deref(), Some("/tmp/t.jsonl"), "a trace may be added");
        assert_eq!(c.warnings.len(), 4, "{:?}", c.warnings);
        assert!(c.warnings.iter().all(|w| w.contains(PATH)));
    }

    #[test]
    fn limits_from_the_environment_are_capped_not_dropped() {
        // HAMi's container budget in the file; a process limit in the environment would turn
        // the group off without the ceiling.
        let c = merge(Some((PATH, "CUDA_DEVICE_MEMORY_LIMIT=1g\n")), &env(&[("VRAMCAP_LIMIT", "80g")]), false);
        assert!(c.group.is_some() && !c.limits.is_empty());
        let mut l = vec![80 << 30, 0, 1 << 20];
        assert_eq!(cap(&mut l, &[20 << 30, 20 << 30, 20 << 30]), vec![0, 1]);
        assert_eq!(l, vec![20 << 30, 20 << 30, 1 << 20]);
        let mut l = vec![5];
        assert_eq!(cap(&mut l, &[0]), Vec::<usize>::new());
    }

    /// Issue 28 item 11: HAMi's variable in the environment, unused because the file sets
    /// vramcap's limits, is said once (it was silently dropped); used, nothing is said.
    #[test]
    fn an_unused_hami_limit_under_a_ceiling_is_said_once() {
        for file in ["VRAMCAP_LIMIT=512m\n", "VRAMCAP_GROUP=plat\nVRAMCAP_GROUP_LIMIT=512m\n"] {
            for k in ["CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0"] {
                let c = merge(Some((PATH, file)), &env(&[(k, "1g")]), false);
                let said: Vec<&String> = c.warnings.iter().filter(|w| w.contains(k)).collect();
                assert_eq!(said.len(), 1, "{file:?} {k}: {:?}", c.warnings);
                assert!(said[0].starts_with(&format!("ignoring {k}=\"1g\": {PATH}")) && said[0].contains("VRAMCAP_LIMIT"), "{}", said[0]);
            }
        }
        // Controls: the file's own HAMi budget lowered by the environment's is used (capped at
        // resolve time), and without a file nothing is said.
        let c = merge(Some((PATH, "CUDA_DEVICE_MEMORY_LIMIT=2g\n")), &env(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]), false);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        assert!(merge(None, &env(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]), false).warnings.is_empty());
    }

    #[test]
    fn devices_are_described_in_runs() {
        let g = 1u64 << 30;
        assert_eq!(describe_devices(&[0, 1, 2, 3, 4, 5, 6, 7], &[g / 2; 8]), "512.0 MiB on devices 0-7");
        assert_eq!(describe_devices(&[3], &[g; 8]), "1.0 GiB on device 3");
        assert_eq!(describe_devices(&[0, 1, 2, 5], &[g, 2 * g, 2 * g, g, g, 2 * g]), "1.0 GiB on device 0; 2.0 GiB on devices 1-2, 5");
    }

    #[test]
    fn secure_mode_ignores_every_path_from_the_environment() {
        let c = merge(None, &env(&[("VRAMCAP_TRACE", "/x"), ("VRAMCAP_REAL_LIBCUDA", "/y"), ("VRAMCAP_SIDECAR", "/s"), ("VRAMCAP_LIMIT", "1g")]), true);
        assert_eq!((c.trace, c.real_libcuda, c.sidecar), (None, None, None));
        assert_eq!(c.limits.entries.len(), 1);
        assert_eq!(c.warnings.len(), 3);
        // The file's paths still count.
        let c = merge(Some((PATH, "VRAMCAP_TRACE=/var/log/t\n")), &env(&[("VRAMCAP_TRACE", "/x")]), true);
        assert_eq!(c.trace.as_deref(), Some("/var/log/t"));
    }

    /// Issue 25 item 3: every sharing family the file sets, in every spelling the environment
    /// could use (the same name, the list form, a per-device suffix, a blank), stays the file's,
    /// with one line per refused variable; a family the file does not set is the environment's.
    #[test]
    fn every_spelling_of_a_sharing_family_the_file_sets_is_the_files() {
        let file = "VRAMCAP_GROUP=pod\nVRAMCAP_GROUP_LIMIT=1g\nVRAMCAP_GROUP_POLICY=priority\nVRAMCAP_PRIORITY=-5\n\
                    VRAMCAP_GROUP_RESERVE=100m\nVRAMCAP_GROUP_HEADROOM_0=200m\n";
        let want = merge(Some((PATH, file)), &[], false).group.unwrap();
        for (k, v) in [
            ("VRAMCAP_GROUP_RESERVE_0", "900m"),
            ("VRAMCAP_GROUP_RESERVE", "0=900m"),
            ("VRAMCAP_GROUP_RESERVE", ""),
            ("VRAMCAP_GROUP_HEADROOM_0", "0"),
            ("VRAMCAP_GROUP_HEADROOM", "0"),
            ("VRAMCAP_GROUP_HEADROOM_1", "1g"),
            ("VRAMCAP_GROUP_POLICY", "shared"),
            ("VRAMCAP_GROUP_POLICY", " "),
            ("VRAMCAP_PRIORITY", "10"),
            ("VRAMCAP_PRIORITY", ""),
        ] {
            let c = merge(Some((PATH, file)), &env(&[(k, v)]), false);
            assert!(c.error.is_none(), "{k}={v:?}: {:?}", c.error);
            let g = c.group.unwrap();
            assert_eq!((g.policy, g.priority, &g.reserve, &g.headroom), (want.policy, want.priority, &want.reserve, &want.headroom), "{k}={v:?}");
            let said = c.warnings.iter().filter(|w| w.contains(&format!("ignoring {k}=")) && w.contains(PATH)).count();
            assert_eq!(said, usize::from(!v.trim().is_empty()), "{k}={v:?}: {:?}", c.warnings);
        }
        // The file sets no headroom: the environment's counts.
        let c = merge(Some((PATH, "VRAMCAP_GROUP=pod\nVRAMCAP_GROUP_RESERVE=1m\n")), &env(&[("VRAMCAP_GROUP_HEADROOM_0", "5m")]), false);
        assert_eq!(c.group.unwrap().headroom.entries.len(), 1);
    }

    /// Issue 26: the environment cannot switch a ceiling machine to observe; the file can, and
    /// the environment can switch it back to enforce there.
    #[test]
    fn observe_mode_is_the_ceiling_files_to_turn_on() {
        use crate::config::{CapMode, ModeOrigin};
        let c = merge(Some((PATH, "VRAMCAP_LIMIT=1g\n")), &env(&[("VRAMCAP_MODE", "observe")]), false);
        assert!(c.error.is_none(), "{:?}", c.error);
        assert_eq!((c.mode, c.mode_origin), (CapMode::Enforce, ModeOrigin::RefusedByCeiling));
        let said: Vec<_> = c.warnings.iter().filter(|w| w.contains("VRAMCAP_MODE")).collect();
        assert_eq!(said.len(), 1, "{:?}", c.warnings);
        assert!(said[0].contains(PATH), "{}", said[0]);
        let c = merge(Some((PATH, "VRAMCAP_MODE=observe\n")), &[], false);
        assert_eq!((c.mode, c.mode_origin), (CapMode::Observe, ModeOrigin::CeilingFile));
        let c = merge(Some((PATH, "VRAMCAP_MODE=observe\n")), &env(&[("VRAMCAP_MODE", "observe")]), false);
        assert_eq!((c.mode, c.warnings.len()), (CapMode::Observe, 0), "{:?}", c.warnings);
        let c = merge(Some((PATH, "VRAMCAP_MODE=observe\n")), &env(&[("VRAMCAP_MODE", "enforce")]), false);
        assert_eq!((c.mode, c.mode_origin), (CapMode::Enforce, ModeOrigin::Environment));
        // A bad value from either side fails closed.
        assert!(merge(Some((PATH, "VRAMCAP_MODE=dry\n")), &[], false).error.is_some());
        assert!(merge(Some((PATH, "VRAMCAP_MODE=observe\n")), &env(&[("VRAMCAP_MODE", "dry")]), false).error.is_some());
        // Without a file, the environment's.
        assert_eq!(merge(None, &env(&[("VRAMCAP_MODE", "observe")]), false).mode, CapMode::Observe);
    }

    #[test]
    fn a_bad_file_fails_closed() {
        for text in ["VRAMCAP_LIMIT 8g\n", "VRAMCAP_LIMITS=8g\n", "VRAMCAP_LIMIT=lots\n"] {
            let c = merge(Some((PATH, text)), &[], false);
            let e = c.error.expect(text);
            assert!(e.to_string().contains(PATH) || e.to_string().contains("VRAMCAP_LIMIT"), "{e}");
        }
    }
}
