//! Which device gets which limit: `VRAMCAP_LIMIT` (one size, or `key=size,...` with a CUDA
//! ordinal or GPU UUID prefix as key), `VRAMCAP_LIMIT_<i>` overrides, and HAMi-core's
//! `CUDA_DEVICE_MEMORY_LIMIT[_<i>]`; the group family `VRAMCAP_GROUP_LIMIT` has the same grammar.
//!
//! Parsing needs no driver; resolution (percent, UUID keys, "does device 3 exist") needs each
//! device's total and UUID and happens once the driver is initialised.

use super::size::{SIZE_FORM, Size, parse_size};
use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum DeviceKey {
    Ordinal(u32),
    /// Lower-case UUID prefix including `gpu-`.
    Uuid(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// `None`: every device.
    pub key: Option<DeviceKey>,
    pub size: Size,
    /// The variable this came from, for messages.
    pub var: String,
    /// The item as the user wrote it (`7=2g`, `8GiB`): messages quote it, never a rewritten
    /// `7=2147483648`.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct LimitSpec {
    /// In order of application: the list variable's entries, then `_<i>` overrides.
    pub entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub var: String,
    pub value: String,
    pub reason: String,
    pub expected: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}={:?}: {}; expected {}", self.var, self.value, self.reason, self.expected)
    }
}

pub const LIST_FORM: &str = "a size for every device (8GiB, 8g, 50%, 0 = no limit) or a list like \
     0=8GiB,1=4GiB or GPU-8932f937=8GiB (keys: CUDA ordinal or GPU UUID prefix)";

/// The per-device information resolution needs.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub total: u64,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`
    pub uuid: String,
}

impl LimitSpec {
    /// Builds the spec of one variable family (`VRAMCAP_LIMIT`, `VRAMCAP_GROUP_LIMIT`,
    /// `CUDA_DEVICE_MEMORY_LIMIT`): the list variable, then its `_<i>` overrides. Which family
    /// applies where is decided in `config::group`.
    pub fn from_family<'a>(vars: impl Iterator<Item = (&'a str, &'a str)>, family: &str) -> Result<Self, ConfigError> {
        let mut spec = LimitSpec::default();
        let mut overrides: Vec<(u32, Entry)> = Vec::new();
        for (k, v) in vars {
            if !is_family(k, family) || v.trim().is_empty() {
                continue;
            }
            if k == family {
                spec.entries.extend(parse_list(k, v)?);
            } else {
                let suffix = &k[family.len() + 1..];
                // Canonical digits only: `_00` or `_+0` would name device 0 a second time, and
                // which of two names wins would depend on the environment's order.
                let canonical = !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()) && (suffix == "0" || !suffix.starts_with('0'));
                let idx: u32 = suffix.parse().ok().filter(|_| canonical).ok_or_else(|| ConfigError {
                    var: k.to_string(),
                    value: v.to_string(),
                    reason: format!("`{suffix}` is not a device ordinal"),
                    expected: format!("{family}_<ordinal>, e.g. {family}_0=8GiB"),
                })?;
                let size = parse_size(v).map_err(|e| ConfigError {
                    var: k.to_string(),
                    value: v.to_string(),
                    reason: e.0,
                    expected: SIZE_FORM.to_string(),
                })?;
                overrides.push((idx, Entry { key: Some(DeviceKey::Ordinal(idx)), size, var: k.to_string(), text: v.trim().to_string() }));
            }
        }
        overrides.sort_by_key(|(i, _)| *i);
        spec.entries.extend(overrides.into_iter().map(|(_, e)| e));
        Ok(spec)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Limits in bytes per visible device (0 = no limit).
    pub fn resolve(&self, devices: &[DeviceInfo]) -> Result<Vec<u64>, ConfigError> {
        let mut out = vec![0u64; devices.len()];
        // Which entry of a list set each device: one list naming a device twice (`0=1g,0=2g`, or an
        // ordinal and that GPU's UUID) is ambiguous, so an error, never "the last one wins".
        let mut set_by: Vec<Option<usize>> = vec![None; devices.len()];
        for (n, e) in self.entries.iter().enumerate() {
            let err = |reason: String| ConfigError {
                var: e.var.clone(),
                value: e.text.clone(),
                reason,
                expected: "a device this process can see (CUDA ordinal or GPU UUID prefix)".into(),
            };
            let targets: Vec<usize> = match &e.key {
                None => (0..devices.len()).collect(),
                Some(DeviceKey::Ordinal(i)) => {
                    if (*i as usize) >= devices.len() {
                        return Err(err(format!(
                            "device {i} does not exist: this process sees {} device(s)",
                            devices.len()
                        )));
                    }
                    vec![*i as usize]
                }
                Some(DeviceKey::Uuid(prefix)) => {
                    let m: Vec<usize> = (0..devices.len())
                        .filter(|&d| devices[d].uuid.to_ascii_lowercase().starts_with(prefix.as_str()))
                        .collect();
                    match m.len() {
                        0 => return Err(err(format!("no visible GPU has a UUID starting with {prefix}"))),
                        1 => m,
                        _ => return Err(err(format!("UUID prefix {prefix} matches {} GPUs", m.len()))),
                    }
                }
            };
            for d in targets {
                if e.key.is_some() {
                    if let Some(first) = set_by[d].filter(|&f| self.entries[f].var == e.var) {
                        return Err(ConfigError {
                            expected: "each device named once in a list".into(),
                            ..err(format!("device {d} is named twice in one list (`{}` and `{}`)", self.entries[first].text, e.text))
                        });
                    }
                    set_by[d] = Some(n);
                }
                out[d] = e.size.bytes_for(devices[d].total);
            }
        }
        Ok(out)
    }
}

fn is_family(k: &str, family: &str) -> bool {
    k == family || (k.starts_with(family) && k.as_bytes().get(family.len()) == Some(&b'_'))
}

/// `8GiB` or `0=8GiB,1=4GiB,GPU-8932f937=2g`.
pub fn parse_list(var: &str, value: &str) -> Result<Vec<Entry>, ConfigError> {
    let err = |reason: String| ConfigError {
        var: var.to_string(),
        value: value.to_string(),
        reason,
        expected: LIST_FORM.to_string(),
    };
    if !value.contains('=') {
        let size = parse_size(value).map_err(|e| err(e.0))?;
        return Ok(vec![Entry { key: None, size, var: var.to_string(), text: value.trim().to_string() }]);
    }
    let mut out = Vec::new();
    for item in value.split(',') {
        let item = item.trim();
        let Some((k, v)) = item.split_once('=') else {
            return Err(err(format!("list item `{item}` is not key=size")));
        };
        let (k, v) = (k.trim(), v.trim());
        let key = if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) {
            DeviceKey::Ordinal(k.parse().map_err(|_| err(format!("device ordinal `{k}` is too large")))?)
        } else if k.len() > 4
            // `get`, not `[..4]`: a key may start with any UTF-8 (fuzzing found `/1kߔ19=43`).
            && k.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("gpu-"))
            && k[4..].bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        {
            DeviceKey::Uuid(k.to_ascii_lowercase())
        } else {
            return Err(err(format!("`{k}` is not a device key")));
        };
        let size = parse_size(v).map_err(|e| err(format!("`{v}` for device {k}: {}", e.0)))?;
        // The same key twice is ambiguous even before the devices are known (an ordinal and the
        // same GPU's UUID are caught when resolving).
        if let Some(first) = out.iter().find(|e: &&Entry| e.key.as_ref() == Some(&key)) {
            return Err(err(format!("device {k} is named twice in one list (`{}` and `{item}`)", first.text)));
        }
        out.push(Entry { key: Some(key), size, var: var.to_string(), text: item.to_string() });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    const G: u64 = 1 << 30;

    fn devs() -> Vec<DeviceInfo> {
        vec![
            DeviceInfo { total: 16 * G, uuid: "GPU-8932f937-0000-1111-2222-333344445555".into() },
            DeviceInfo { total: 8 * G, uuid: "GPU-8932f938-0000-1111-2222-333344445555".into() },
        ]
    }

    fn spec(vars: &[(&str, &str)]) -> Result<LimitSpec, ConfigError> {
        let family = if vars.iter().any(|(k, _)| k.starts_with("VRAMCAP")) { "VRAMCAP_LIMIT" } else { "CUDA_DEVICE_MEMORY_LIMIT" };
        LimitSpec::from_family(vars.iter().map(|(k, v)| (*k, *v)), family)
    }

    #[test]
    fn a_device_named_twice_in_one_list_is_an_error() {
        for v in ["0=1g,0=2g", "0=1g,GPU-8932f937=2g", "GPU-8932f938=1g,1=2g"] {
            let e = spec(&[("VRAMCAP_LIMIT", v)]).and_then(|s| s.resolve(&devs())).unwrap_err();
            assert_eq!(e.var, "VRAMCAP_LIMIT");
            assert!(e.to_string().contains("named twice"), "{e}");
        }
        // Caught without devices, too (`vramcap size`), and a non-canonical ordinal suffix is no
        // second name for a device.
        assert!(spec(&[("VRAMCAP_LIMIT", "0=1g,0=2g")]).unwrap_err().to_string().contains("named twice"));
        for k in ["VRAMCAP_LIMIT_00", "VRAMCAP_LIMIT_+0", "VRAMCAP_LIMIT_01", "VRAMCAP_LIMIT_"] {
            assert_eq!(spec(&[(k, "2g")]).unwrap_err().var, k);
        }
        assert!(spec(&[("VRAMCAP_LIMIT_10", "2g")]).is_ok());
        // An override of another variable is not a repetition: it is what `_<i>` is for.
        let s = spec(&[("VRAMCAP_LIMIT", "0=1g,1=1g"), ("VRAMCAP_LIMIT_1", "2g")]).unwrap();
        assert_eq!(s.resolve(&devs()).unwrap(), vec![G, 2 * G]);
    }

    #[test]
    fn one_size_for_every_device() {
        let s = spec(&[("VRAMCAP_LIMIT", "4GiB")]).unwrap();
        assert_eq!(s.resolve(&devs()).unwrap(), vec![4 * G, 4 * G]);
    }

    #[test]
    fn lists_by_ordinal_and_uuid_prefix() {
        let s = spec(&[("VRAMCAP_LIMIT", "0=8GiB,GPU-8932F938=2g")]).unwrap();
        assert_eq!(s.resolve(&devs()).unwrap(), vec![8 * G, 2 * G]);
        let s = spec(&[("VRAMCAP_LIMIT", "1=1g")]).unwrap();
        assert_eq!(s.resolve(&devs()).unwrap(), vec![0, G]);
    }

    #[test]
    fn per_ordinal_overrides_win_and_percent_uses_the_device_total() {
        let s = spec(&[("VRAMCAP_LIMIT_1", "3g"), ("VRAMCAP_LIMIT", "50%")]).unwrap();
        assert_eq!(s.resolve(&devs()).unwrap(), vec![8 * G, 3 * G]);
        let s = spec(&[("VRAMCAP_LIMIT_0", "25%")]).unwrap();
        assert_eq!(s.resolve(&devs()).unwrap(), vec![4 * G, 0]);
    }

    #[test]
    fn hami_variables_apply_only_without_ours() {
        let hami = [("CUDA_DEVICE_MEMORY_LIMIT", "6g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "1024m")];
        assert_eq!(spec(&hami).unwrap().resolve(&devs()).unwrap(), vec![6 * G, G]);
        let mixed = [("CUDA_DEVICE_MEMORY_LIMIT", "6g"), ("VRAMCAP_LIMIT", "2g")];
        assert_eq!(spec(&mixed).unwrap().resolve(&devs()).unwrap(), vec![2 * G, 2 * G]);
        assert!(spec(&[("PATH", "/bin")]).unwrap().is_empty());
        assert!(spec(&[("VRAMCAP_LIMIT", "")]).unwrap().is_empty());
    }

    #[test]
    fn bad_input_names_the_variable_and_the_form() {
        let e = spec(&[("VRAMCAP_LIMIT", "abc")]).unwrap_err();
        assert_eq!(e.var, "VRAMCAP_LIMIT");
        assert!(e.to_string().contains("VRAMCAP_LIMIT=\"abc\"") && e.to_string().contains("expected"));
        assert!(spec(&[("VRAMCAP_LIMIT", "1.5x")]).is_err());
        assert!(spec(&[("VRAMCAP_LIMIT", "-1")]).is_err());
        assert!(spec(&[("VRAMCAP_LIMIT", "0=4g,foo=2g")]).is_err());
        assert!(spec(&[("VRAMCAP_LIMIT", "0=4g,1")]).is_err());
        assert!(spec(&[("VRAMCAP_LIMIT_x", "4g")]).is_err());
        assert_eq!(spec(&[("VRAMCAP_LIMIT_1", "4q")]).unwrap_err().var, "VRAMCAP_LIMIT_1");
    }

    #[test]
    fn unknown_devices_fail_resolution() {
        for v in ["2=4g", "GPU-ffff=4g", "GPU-8932f93=4g"] {
            let s = spec(&[("VRAMCAP_LIMIT", v)]).unwrap();
            assert!(s.resolve(&devs()).is_err(), "{v}");
        }
        let s = spec(&[("VRAMCAP_LIMIT_5", "1g")]).unwrap();
        assert!(s.resolve(&devs()).unwrap_err().to_string().contains("device 5 does not exist"));
        // The message quotes what was written, not a rewritten `7=2147483648`.
        let e = spec(&[("VRAMCAP_LIMIT", "0=1g, 7=2g")]).unwrap().resolve(&devs()).unwrap_err();
        assert_eq!(e.value, "7=2g", "{e}");
    }
}
