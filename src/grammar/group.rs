//! `VRAMCAP_GROUP`, `VRAMCAP_GROUP_LIMIT[_<i>]`, `VRAMCAP_GROUP_DIR`, and HAMi-core's
//! `CUDA_DEVICE_MEMORY_LIMIT`, which is a container budget and so becomes a group limit.

use super::limits::{ConfigError, LimitSpec};

pub const DEFAULT_DIR: &str = "/dev/shm";

#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    /// `None`: the container's default group (HAMi compatibility), named at attach time.
    pub name: Option<String>,
    /// Empty: adopt the limits the group already has.
    pub limits: LimitSpec,
    pub dir: String,
}

const NAME_FORM: &str = "1 to 64 characters from A-Z a-z 0-9 . _ - (not starting with .)";

fn check_name(v: &str) -> Result<String, ConfigError> {
    let ok = !v.is_empty()
        && v.len() <= 64
        && !v.starts_with('.')
        && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
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

/// Per-process limits and the group (if any) from the environment pairs.
pub fn from_vars<'a>(
    vars: impl Iterator<Item = (&'a str, &'a str)> + Clone,
) -> Result<(LimitSpec, Option<GroupConfig>), ConfigError> {
    let get = |k: &str| vars.clone().find(|(n, v)| *n == k && !v.trim().is_empty()).map(|(_, v)| v.trim());
    let process = LimitSpec::from_family(vars.clone(), "VRAMCAP_LIMIT")?;
    let mut limits = LimitSpec::from_family(vars.clone(), "VRAMCAP_GROUP_LIMIT")?;
    let name = get("VRAMCAP_GROUP").map(check_name).transpose()?;
    let dir = get("VRAMCAP_GROUP_DIR").unwrap_or(DEFAULT_DIR).to_string();
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
        limits = LimitSpec::from_family(vars, "CUDA_DEVICE_MEMORY_LIMIT")?;
        hami = !limits.is_empty();
    }
    let group = (name.is_some() || hami).then_some(GroupConfig { name, limits, dir });
    Ok((process, group))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[(&str, &str)]) -> Result<(LimitSpec, Option<GroupConfig>), ConfigError> {
        from_vars(v.iter().map(|(a, b)| (*a, *b)))
    }

    #[test]
    fn group_and_process_limits_are_separate() {
        let (p, g) = parse(&[("VRAMCAP_GROUP", "team"), ("VRAMCAP_GROUP_LIMIT", "8g"), ("VRAMCAP_LIMIT", "2g")]).unwrap();
        assert_eq!(p.entries.len(), 1);
        let g = g.unwrap();
        assert_eq!(g.name.as_deref(), Some("team"));
        assert_eq!(g.limits.entries[0].var, "VRAMCAP_GROUP_LIMIT");
        assert_eq!(g.dir, DEFAULT_DIR);
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
    fn bad_group_input_is_an_error() {
        for v in ["a/b", ".hidden", "x y", &"n".repeat(65)] {
            let e = parse(&[("VRAMCAP_GROUP", v)]).unwrap_err();
            assert!(e.to_string().contains("VRAMCAP_GROUP=") && e.to_string().contains("expected"), "{e}");
        }
        assert!(parse(&[("VRAMCAP_GROUP_LIMIT", "1g")]).unwrap_err().to_string().contains("needs a group"));
        assert_eq!(parse(&[("VRAMCAP_GROUP", "g"), ("VRAMCAP_GROUP_LIMIT", "lots")]).unwrap_err().var, "VRAMCAP_GROUP_LIMIT");
    }
}
