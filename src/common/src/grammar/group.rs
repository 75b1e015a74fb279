//! `VRAMCAP_GROUP`, `VRAMCAP_GROUP_LIMIT[_<i>]`, `VRAMCAP_GROUP_DIR`, and HAMi-core's
//! `CUDA_DEVICE_MEMORY_LIMIT`, which is a container budget and so becomes a group limit; the
//! sharing settings `VRAMCAP_GROUP_POLICY`, `VRAMCAP_PRIORITY`, `VRAMCAP_GROUP_RESERVE[_<i>]`
//! and `VRAMCAP_GROUP_HEADROOM[_<i>]` (issue 17).

use super::limits::{ConfigError, LimitSpec};

/// Where the default per-user ledger directory is made.
pub const DEFAULT_DIR: &str = "/dev/shm";

/// Without `VRAMCAP_GROUP_DIR`: `/dev/shm/vramcap-<uid>`, a directory only this user can write
/// (`/dev/shm` itself lets any user create a group's ledger first: issue 15).
pub fn default_dir() -> String {
    format!("{DEFAULT_DIR}/vramcap-{}", unsafe { libc::geteuid() })
}

#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    /// `None`: the container's default group (HAMi compatibility), named at attach time.
    pub name: Option<String>,
    /// Empty: adopt the limits the group already has.
    pub limits: LimitSpec,
    pub dir: String,
    /// HAMi-core's `CUDA_DEVICE_MEMORY_SHARED_CACHE`: the ledger file itself (the container's
    /// budget lives there, as HAMi's device plugin placed it), instead of
    /// `dir/vramcap-group-<name>`. Only for HAMi's container budget without `VRAMCAP_GROUP`.
    pub ledger: Option<String>,
    /// `VRAMCAP_GROUP_POLICY`; `None`: adopt the group's (`shared` for a new group).
    pub policy: Option<PolicyName>,
    /// `VRAMCAP_PRIORITY` (default 0, higher wins).
    pub priority: i64,
    /// `VRAMCAP_GROUP_RESERVE`: kept for this member while it lives (limit grammar).
    pub reserve: LimitSpec,
    /// `VRAMCAP_GROUP_HEADROOM`; empty: adopt the group's.
    pub headroom: LimitSpec,
}

/// The policies `VRAMCAP_GROUP_POLICY` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyName {
    Shared,
    Equal,
    Priority,
}

pub const POLICY_FORM: &str = "shared (on demand, the default), equal (budget / members) or priority (with VRAMCAP_PRIORITY)";

impl PolicyName {
    pub fn parse(v: &str) -> Option<PolicyName> {
        match v.trim().to_ascii_lowercase().as_str() {
            "shared" => Some(PolicyName::Shared),
            "equal" => Some(PolicyName::Equal),
            "priority" => Some(PolicyName::Priority),
            _ => None,
        }
    }
    /// A policy name from elsewhere (a client's header, a trace) as it may be printed: one of
    /// ours, or "unknown" (never the text itself: it could carry terminal control codes).
    pub fn shown(v: &str) -> &'static str {
        PolicyName::parse(v).map_or("unknown", PolicyName::name)
    }
    pub fn name(self) -> &'static str {
        match self {
            PolicyName::Shared => "shared",
            PolicyName::Equal => "equal",
            PolicyName::Priority => "priority",
        }
    }
}

const NAME_FORM: &str = super::group_name::FORM;

fn check_name(v: &str) -> Result<String, ConfigError> {
    if super::group_name::valid(v) {
        Ok(v.to_string())
    } else {
        Err(ConfigError {
            var: "VRAMCAP_GROUP".into(),
            value: v.into(),
            reason: "not a usable group name".into(),
            expected: NAME_FORM.into(),
        })
    }
}

/// Whether vramcap reads this variable (the library's and the CLI's one rule).
pub fn is_ours(name: &[u8]) -> bool {
    (name.len() >= 8 && name[..8].eq_ignore_ascii_case(b"VRAMCAP_"))
        || name.starts_with(b"CUDA_DEVICE_MEMORY_LIMIT")
        || HAMI_VARS.iter().any(|v| v.as_bytes() == name)
}

/// HAMi-core's variables read besides its limits: where the container's budget lives, and its
/// switch to turn control off (which vramcap does not obey, and says so: docs/configuration.md).
pub const HAMI_VARS: [&str; 2] = ["CUDA_DEVICE_MEMORY_SHARED_CACHE", "CUDA_DISABLE_CONTROL"];

/// The variables vramcap reads (shared by the library and the CLI), out of `(name, value)` pairs from the environment. A name or a
/// value that is not UTF-8 cannot be read as what it was meant to say (a limit, a group, a
/// driver path), so it is invalid input: the first one is returned as the error, never skipped.
pub fn vars_from(
    env: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> (Vec<(String, String)>, Option<ConfigError>) {
    use std::os::unix::ffi::OsStrExt;
    let mut vars = Vec::new();
    let mut bad = None;
    for (k, v) in env {
        if !is_ours(k.as_bytes()) {
            continue;
        }
        match (k.to_str(), v.to_str()) {
            (Some(k), Some(v)) => vars.push((k.to_string(), v.to_string())),
            _ => {
                bad.get_or_insert_with(|| ConfigError {
                    var: k.to_string_lossy().into_owned(),
                    value: v.to_string_lossy().into_owned(),
                    reason: "not valid UTF-8 (bytes shown as \u{fffd})".into(),
                    expected: "a value in plain text; see docs/configuration.md for each variable's form".into(),
                });
            }
        }
    }
    (vars, bad)
}

/// Per-process limits and the group (if any) from the environment pairs.
pub fn from_vars<'a>(
    vars: impl Iterator<Item = (&'a str, &'a str)> + Clone,
) -> Result<(LimitSpec, Option<GroupConfig>), ConfigError> {
    let get = |k: &str| vars.clone().find(|(n, v)| *n == k && !v.trim().is_empty()).map(|(_, v)| v.trim());
    let process = LimitSpec::from_family(vars.clone(), "VRAMCAP_LIMIT")?;
    let mut limits = LimitSpec::from_family(vars.clone(), "VRAMCAP_GROUP_LIMIT")?;
    let name = get("VRAMCAP_GROUP").map(check_name).transpose()?;
    let dir = get("VRAMCAP_GROUP_DIR").map_or_else(default_dir, str::to_string);
    if name.is_none() && !limits.is_empty() {
        return Err(ConfigError {
            var: limits.entries[0].var.clone(),
            value: String::new(),
            reason: "a group limit needs a group".into(),
            expected: "VRAMCAP_GROUP=<name> next to it".into(),
        });
    }
    // HAMi's variable is the budget of the whole container: only when we have no limit at all.
    let mut hami = false;
    if process.is_empty() && limits.is_empty() {
        limits = LimitSpec::from_family(vars.clone(), "CUDA_DEVICE_MEMORY_LIMIT")?;
        hami = !limits.is_empty();
    }
    let policy = get("VRAMCAP_GROUP_POLICY")
        .map(|v| {
            PolicyName::parse(v).ok_or_else(|| ConfigError {
                var: "VRAMCAP_GROUP_POLICY".into(),
                value: v.into(),
                reason: "not a policy".into(),
                expected: POLICY_FORM.into(),
            })
        })
        .transpose()?;
    let priority = get("VRAMCAP_PRIORITY")
        .map(|v| {
            v.parse::<i64>().ok().filter(|p| p.unsigned_abs() <= 1 << 31).ok_or_else(|| ConfigError {
                var: "VRAMCAP_PRIORITY".into(),
                value: v.into(),
                reason: "not an integer".into(),
                expected: "an integer such as 10 or -5 (default 0; a higher number wins)".into(),
            })
        })
        .transpose()?
        .unwrap_or(0);
    let reserve = LimitSpec::from_family(vars.clone(), "VRAMCAP_GROUP_RESERVE")?;
    let headroom = LimitSpec::from_family(vars.clone(), "VRAMCAP_GROUP_HEADROOM")?;
    if name.is_none() && !hami {
        // A sharing setting without a group would be silently ignored: say so instead.
        let set = [
            ("VRAMCAP_GROUP_POLICY", policy.is_some()),
            ("VRAMCAP_PRIORITY", get("VRAMCAP_PRIORITY").is_some()),
            ("VRAMCAP_GROUP_RESERVE", !reserve.is_empty()),
            ("VRAMCAP_GROUP_HEADROOM", !headroom.is_empty()),
        ];
        if let Some((var, _)) = set.iter().find(|(_, on)| *on) {
            return Err(ConfigError {
                var: var.to_string(),
                value: get(var).unwrap_or_default().to_string(),
                reason: "a group setting needs a group".into(),
                expected: "VRAMCAP_GROUP=<name> (and VRAMCAP_GROUP_LIMIT) next to it".into(),
            });
        }
    }
    // HAMi's device plugin gives each container its own cache file: the budget lives there.
    let ledger = get("CUDA_DEVICE_MEMORY_SHARED_CACHE").filter(|_| hami && name.is_none()).map(str::to_string);
    if let Some(l) = &ledger
        && (!l.starts_with('/') || l.ends_with('/'))
    {
        return Err(ConfigError {
            var: "CUDA_DEVICE_MEMORY_SHARED_CACHE".into(),
            value: l.clone(),
            reason: "not an absolute file path (processes started in different directories would keep different budgets)".into(),
            expected: "an absolute path such as /usr/local/vgpu/3f6c.cache, as HAMi's device plugin sets it".into(),
        });
    }
    let group = (name.is_some() || hami).then_some(GroupConfig { name, limits, dir, ledger, policy, priority, reserve, headroom });
    if let Some(g) = &group
        && !g.dir.starts_with('/')
    {
        // Relative to each member's working directory: one group would split into several
        // ledgers, each with the whole budget.
        return Err(ConfigError {
            var: "VRAMCAP_GROUP_DIR".into(),
            value: g.dir.clone(),
            reason: "a relative path (members started in different directories would keep different ledgers)".into(),
            expected: "an absolute path, such as /dev/shm/team-a".into(),
        });
    }
    Ok((process, group))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[(&str, &str)]) -> Result<(LimitSpec, Option<GroupConfig>), ConfigError> {
        from_vars(v.iter().map(|(a, b)| (*a, *b)))
    }

    #[test]
    fn non_utf8_is_an_error_not_a_silent_unset() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let raw = |k: &[u8], v: &[u8]| (OsString::from_vec(k.to_vec()), OsString::from_vec(v.to_vec()));
        for name in ["VRAMCAP_LIMIT", "VRAMCAP_LIMIT_1", "VRAMCAP_GROUP_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0"] {
            let (vars, bad) = vars_from(
                vec![raw(b"PATH", b"/bin"), raw(name.as_bytes(), b"1\xffg"), raw(b"VRAMCAP_LOG", b"info")].into_iter(),
            );
            let e = bad.unwrap_or_else(|| panic!("{name}: non-UTF-8 accepted"));
            assert_eq!(e.var, name);
            assert!(e.to_string().contains("UTF-8"), "{e}");
            assert_eq!(vars, vec![("VRAMCAP_LOG".to_string(), "info".to_string())]);
        }
        // A name that is not UTF-8 but is one of ours is just as unreadable.
        assert!(vars_from(vec![raw(b"VRAMCAP_LIMIT_\xff", b"1g")].into_iter()).1.is_some());
        // Other programs' variables are none of our business.
        let (vars, bad) = vars_from(vec![raw(b"LANG", b"\xff"), raw(b"X\xff", b"1")].into_iter());
        assert!(vars.is_empty() && bad.is_none());
    }

    #[test]
    fn group_and_process_limits_are_separate() {
        let (p, g) = parse(&[("VRAMCAP_GROUP", "team"), ("VRAMCAP_GROUP_LIMIT", "8g"), ("VRAMCAP_LIMIT", "2g")]).unwrap();
        assert_eq!(p.entries.len(), 1);
        let g = g.unwrap();
        assert_eq!(g.name.as_deref(), Some("team"));
        assert_eq!(g.limits.entries[0].var, "VRAMCAP_GROUP_LIMIT");
        assert_eq!(g.dir, format!("/dev/shm/vramcap-{}", unsafe { libc::geteuid() }));
        let (_, g) = parse(&[("VRAMCAP_GROUP", "t"), ("VRAMCAP_GROUP_LIMIT_1", "50%"), ("VRAMCAP_GROUP_DIR", "/x")]).unwrap();
        let g = g.unwrap();
        assert_eq!((g.limits.entries.len(), g.dir.as_str()), (1, "/x"));
        // A group without a limit adopts the group's.
        assert!(parse(&[("VRAMCAP_GROUP", "t")]).unwrap().1.unwrap().limits.is_empty());
        assert_eq!(parse(&[("VRAMCAP_LIMIT", "1g")]).unwrap().1, None);
    }

    #[test]
    fn hami_becomes_the_container_group_only_without_our_limits() {
        let (p, g) = parse(&[("CUDA_DEVICE_MEMORY_LIMIT", "6g")]).unwrap();
        assert!(p.is_empty());
        let g = g.unwrap();
        assert_eq!((g.name.clone(), g.limits.entries[0].var.as_str()), (None, "CUDA_DEVICE_MEMORY_LIMIT"));
        let (_, g) = parse(&[("CUDA_DEVICE_MEMORY_LIMIT", "6g"), ("VRAMCAP_GROUP", "mine")]).unwrap();
        assert_eq!(g.unwrap().name.as_deref(), Some("mine"));
        let (p, g) = parse(&[("CUDA_DEVICE_MEMORY_LIMIT", "6g"), ("VRAMCAP_LIMIT", "2g")]).unwrap();
        assert_eq!((p.entries.len(), g), (1, None));
        let (_, g) = parse(&[("CUDA_DEVICE_MEMORY_LIMIT", "6g"), ("VRAMCAP_GROUP", "m"), ("VRAMCAP_GROUP_LIMIT", "1g")]).unwrap();
        assert_eq!(g.unwrap().limits.entries[0].var, "VRAMCAP_GROUP_LIMIT");
    }

    #[test]
    fn hamis_shared_cache_is_the_ledger_of_its_container_budget() {
        let cache = ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/usr/local/vgpu/3f6c.cache");
        let (_, g) = parse(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"), cache]).unwrap();
        assert_eq!(g.unwrap().ledger.as_deref(), Some("/usr/local/vgpu/3f6c.cache"));
        // Only for HAMi's budget, and not once the group is named: then vramcap's rules hold.
        let (_, g) = parse(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g"), ("VRAMCAP_GROUP", "mine"), cache]).unwrap();
        assert_eq!(g.unwrap().ledger, None);
        assert_eq!(parse(&[("VRAMCAP_LIMIT", "1g"), cache]).unwrap().1, None);
        for bad in ["vgpu/x.cache", "/usr/local/vgpu/"] {
            let e = parse(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g"), ("CUDA_DEVICE_MEMORY_SHARED_CACHE", bad)]).unwrap_err();
            assert_eq!(e.var, "CUDA_DEVICE_MEMORY_SHARED_CACHE", "{bad}");
        }
        assert!(is_ours(b"CUDA_DEVICE_MEMORY_SHARED_CACHE") && is_ours(b"CUDA_DISABLE_CONTROL") && !is_ours(b"CUDA_VISIBLE_DEVICES"));
    }

    #[test]
    fn a_relative_group_dir_is_an_error() {
        for d in ["groups", "./g", "../shm", "~/g"] {
            let e = parse(&[("VRAMCAP_GROUP", "t"), ("VRAMCAP_GROUP_DIR", d)]).unwrap_err();
            assert_eq!(e.var, "VRAMCAP_GROUP_DIR");
            assert!(e.to_string().contains("absolute path"), "{e}");
        }
        let e = parse(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g"), ("VRAMCAP_GROUP_DIR", "g")]).unwrap_err();
        assert_eq!(e.var, "VRAMCAP_GROUP_DIR");
        // No group: the directory is not used.
        assert!(parse(&[("VRAMCAP_GROUP_DIR", "g")]).is_ok());
    }

    #[test]
    fn bad_group_input_is_an_error() {
        for v in ["a/b", ".hidden", "x y", &"n".repeat(65)] {
            let e = parse(&[("VRAMCAP_GROUP", v)]).unwrap_err();
            assert!(e.to_string().contains("VRAMCAP_GROUP=") && e.to_string().contains("expected"), "{e}");
        }
        assert!(parse(&[("VRAMCAP_GROUP_LIMIT", "1g")]).unwrap_err().to_string().contains("needs a group"));
        assert_eq!(parse(&[("VRAMCAP_GROUP", "g"), ("VRAMCAP_GROUP_LIMIT", "lots")]).unwrap_err().var, "VRAMCAP_GROUP_LIMIT");
    }

    #[test]
    fn sharing_settings_parse_and_bad_ones_name_their_variable() {
        let g = |v: &[(&str, &str)]| parse(v).unwrap().1.unwrap();
        let base = [("VRAMCAP_GROUP", "t"), ("VRAMCAP_GROUP_LIMIT", "8g")];
        let c = g(&[base[0], base[1], ("VRAMCAP_GROUP_POLICY", "priority"), ("VRAMCAP_PRIORITY", "-5"), ("VRAMCAP_GROUP_RESERVE", "0=1g,1=2g"), ("VRAMCAP_GROUP_HEADROOM", "512m")]);
        assert_eq!((c.policy, c.priority), (Some(PolicyName::Priority), -5));
        assert_eq!((c.reserve.entries.len(), c.headroom.entries.len()), (2, 1), "the per-device list form and a uniform size");
        assert_eq!(g(&base).priority, 0, "default priority");
        for (var, v, says) in [
            ("VRAMCAP_GROUP_POLICY", "fair", "not a policy"),
            ("VRAMCAP_PRIORITY", "high", "not an integer"),
            ("VRAMCAP_PRIORITY", "1.5", "not an integer"),
            ("VRAMCAP_PRIORITY", "99999999999", "not an integer"),
            ("VRAMCAP_GROUP_RESERVE", "lots", ""),
            ("VRAMCAP_GROUP_HEADROOM", "1=", ""),
        ] {
            let e = parse(&[base[0], base[1], (var, v)]).unwrap_err();
            assert_eq!(e.var, var, "{var}={v}: {e}");
            assert!(e.to_string().contains(says) && e.to_string().contains("expected"), "{var}={v}: {e}");
        }
        // Without a group a sharing setting would be ignored: an error instead.
        for (var, v) in [("VRAMCAP_GROUP_POLICY", "equal"), ("VRAMCAP_PRIORITY", "3"), ("VRAMCAP_GROUP_RESERVE", "1g"), ("VRAMCAP_GROUP_HEADROOM", "1g")] {
            let e = parse(&[("VRAMCAP_LIMIT", "8g"), (var, v)]).unwrap_err();
            assert_eq!(e.var, var);
            assert!(e.to_string().contains("needs a group"), "{e}");
        }
    }
}
