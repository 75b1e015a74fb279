//! What the sidecar knows: one entry per connected preloaded process, built from the lines it
//! streams (docs/sidecar-protocol.md). Identity is the connection's peer credentials; the pid a
//! client writes in its header is only a label.

use serde_json::{Value, json};
use std::collections::BTreeMap;

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Device {
    pub used: u64,
    pub limit: Option<u64>,
    pub peak: u64,
    pub denied: u64,
    /// Observe mode (issue 26): allocations the cap would have refused and granted.
    pub would_deny: u64,
    /// The group's budget and charge on the device (group members only).
    pub group_limit: Option<u64>,
    pub group_used: Option<u64>,
    /// Of `used`, memory the driver took beyond allocations (contexts, modules, limits), as of
    /// the last usage snapshot.
    pub overhead: u64,
    /// The member's reserve, the group's headroom and (`equal`) the member's share on the
    /// device, where the group caps it (issue 17).
    pub group_reserve: Option<u64>,
    pub group_headroom: Option<u64>,
    pub group_share: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct Client {
    /// From SO_PEERCRED: who is really on the other end.
    pub pid: i32,
    pub uid: u32,
    /// The pid the process reported (differs from `pid` across PID namespaces).
    pub reported_pid: i64,
    /// With `reported_pid`, tells a reconnection of the same process from another process.
    pub start_unix_ns: u64,
    pub exe: String,
    pub cmdline: Vec<String>,
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
    /// The container id and Kubernetes pod uid from the peer's cgroup path (the kernel's word,
    /// not the client's: `identity`), set by the server once the header is in.
    pub container_id: Option<String>,
    pub pod_uid: Option<String>,
    pub group: Option<String>,
    /// The group's policy, the member's priority and whether it holds the group's headroom
    /// (group members of a vramcap that sends them).
    pub policy: Option<String>,
    pub priority: Option<i64>,
    pub holds_headroom: Option<bool>,
    /// The header's `mode`: true when the process started in observe mode (issue 26).
    pub observe: bool,
    pub devices: BTreeMap<usize, Device>,
    /// (device, api) → successful counted allocations.
    pub allocations: BTreeMap<(i64, String), u64>,
    pub dropped: u64,
    pub events: u64,
    /// A summary arrived: the process is exiting.
    pub finished: bool,
}

/// Longest label kept from a client (executable, pod, namespace, container): every string a
/// client sends is held for as long as it is connected, so each is bounded.
const MAX_LABEL_CHARS: usize = 256;

fn str_field(v: &Value, k: &str) -> Option<String> {
    v.get(k).and_then(Value::as_str).map(|s| s.chars().take(MAX_LABEL_CHARS).collect())
}

fn u64_field(v: &Value, k: &str) -> Result<u64, String> {
    v.get(k).and_then(Value::as_u64).ok_or_else(|| format!("`{k}` is not a non-negative integer"))
}

/// Highest device ordinal accepted (the preload tracks at most 64 devices).
const MAX_DEVICE: u64 = 1023;

/// `(device, api)` allocation series kept per client. A client names the entry point of each
/// allocation itself, and a new name on every line grew the sidecar without bound (500 000 events:
/// 543 MB, and a 70 MB `/metrics` page). The library's allocating entry points are a few dozen
/// names of `cu` and letters, digits and `_`; a name of another form, or past this many series,
/// is counted under `api="other"` on its device.
pub const MAX_ALLOCATION_SERIES: usize = 64;
const MAX_API_LEN: usize = 64;
pub const OTHER_API: &str = "other";

fn api_like(api: &str) -> bool {
    api.len() <= MAX_API_LEN && api.starts_with("cu") && api.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn device_index(v: &Value, k: &str) -> Result<usize, String> {
    let d = u64_field(v, k)?;
    if d > MAX_DEVICE {
        return Err(format!("device {d} out of range (0..={MAX_DEVICE})"));
    }
    Ok(d as usize)
}

impl Client {
    /// A client from its header line; `Err` names what is wrong with it.
    pub fn from_header(pid: i32, uid: u32, h: &Value) -> Result<Client, String> {
        let version = h.get("version").and_then(Value::as_u64).ok_or("header without `version`")?;
        if version != crate::sidecar::TRACE_VERSION {
            return Err(format!("trace format version {version} (this sidecar reads {})", crate::sidecar::TRACE_VERSION));
        }
        if let Some(p) = h.get("protocol") {
            let p = p.as_u64().ok_or("`protocol` is not an integer")?;
            if p != crate::sidecar::PROTOCOL {
                return Err(format!("protocol version {p} (this sidecar speaks {})", crate::sidecar::PROTOCOL));
            }
        }
        let mut c = Client {
            pid,
            uid,
            reported_pid: h.get("pid").and_then(Value::as_i64).unwrap_or(0),
            start_unix_ns: h.get("start_unix_ns").and_then(Value::as_u64).unwrap_or(0),
            exe: str_field(h, "exe").unwrap_or_else(|| "unknown".into()),
            // Redacted here too: an older or hostile client's secrets are never stored.
            cmdline: vramcap_common::config::privacy::redact(
                &h.get("cmdline")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect::<Vec<_>>())
                    .unwrap_or_default(),
            ),
            namespace: str_field(h, "namespace"),
            pod: str_field(h, "pod"),
            container: str_field(h, "container"),
            container_id: None,
            pod_uid: None,
            group: str_field(h, "group"),
            policy: str_field(h, "group_policy").map(|p| vramcap_common::grammar::group::PolicyName::shown(&p).to_string()),
            priority: h.get("group_priority").and_then(Value::as_i64),
            holds_headroom: h.get("group_holds_headroom").and_then(Value::as_bool),
            observe: h.get("mode").and_then(Value::as_str) == Some("observe"),
            devices: BTreeMap::new(),
            allocations: BTreeMap::new(),
            dropped: 0,
            events: 0,
            finished: false,
        };
        // The name becomes a file name under --group-dir: checked exactly as members check
        // `VRAMCAP_GROUP`, so it can never name a path elsewhere.
        if let Some(g) = h.get("group").filter(|g| !g.is_null()) {
            match g.as_str() {
                Some(name) if vramcap_common::grammar::group_name::valid(name) => {}
                Some(name) => {
                    let shown: String = name.chars().take(80).collect();
                    return Err(format!("group name {shown:?} is not usable: expected {}", vramcap_common::grammar::group_name::FORM));
                }
                None => return Err("`group` is neither a string nor null".into()),
            }
        }
        if let Some(devs) = h.get("devices").and_then(Value::as_array) {
            for d in devs {
                let i = device_index(d, "index")?;
                let dev = c.devices.entry(i).or_default();
                dev.limit = d.get("limit").and_then(Value::as_u64);
                dev.group_limit = d.get("group_limit").and_then(Value::as_u64);
                dev.group_reserve = d.get("group_reserve").and_then(Value::as_u64);
                dev.group_headroom = d.get("group_headroom").and_then(Value::as_u64);
                dev.group_share = d.get("group_share").and_then(Value::as_u64);
            }
        }
        Ok(c)
    }

    /// Applies one line after the header. Unknown `type`s are ignored (newer clients).
    pub fn apply(&mut self, v: &Value) -> Result<(), String> {
        match v.get("type").and_then(Value::as_str) {
            Some("event") => self.event(v),
            Some("usage") => self.usage(v),
            Some("summary") => self.summary(v),
            Some(_) => Ok(()),
            None => Err("line without a string `type`".into()),
        }
    }

    fn event(&mut self, v: &Value) -> Result<(), String> {
        let op = v.get("op").and_then(Value::as_str).ok_or("event without `op`")?;
        let api = v.get("api").and_then(Value::as_str).ok_or("event without `api`")?;
        let dev = v.get("dev").and_then(Value::as_i64).ok_or("event without integer `dev`")?;
        let used = u64_field(v, "used")?;
        self.events += 1;
        if dev < 0 {
            return Ok(());
        }
        if dev as u64 > MAX_DEVICE {
            return Err(format!("device {dev} out of range"));
        }
        let d = self.devices.entry(dev as usize).or_default();
        d.used = used;
        d.peak = d.peak.max(used);
        if let Some(g) = v.get("group_used").and_then(Value::as_u64) {
            d.group_used = Some(g);
        }
        match op {
            "alloc" => *self.allocation_series(dev, api) += 1,
            "deny" => d.denied += 1,
            "would_deny" => d.would_deny += 1,
            _ => {}
        }
        Ok(())
    }

    /// The counter of `(dev, api)`, or of `(dev, "other")` for a name not of the library's form
    /// or past [`MAX_ALLOCATION_SERIES`]: at most that many series plus one per device.
    fn allocation_series(&mut self, dev: i64, api: &str) -> &mut u64 {
        let key = (dev, api.to_string());
        let fits = api_like(api) && (self.allocations.contains_key(&key) || self.allocations.len() < MAX_ALLOCATION_SERIES);
        let key = if fits { key } else { (dev, OTHER_API.to_string()) };
        self.allocations.entry(key).or_insert(0)
    }

    /// A snapshot is authoritative: it was counted from every event, including those this
    /// sidecar never received (it restarted, or the client's buffer overflowed).
    fn usage(&mut self, v: &Value) -> Result<(), String> {
        self.dropped = u64_field(v, "dropped")?;
        self.events = v.get("events").and_then(Value::as_u64).unwrap_or(self.events);
        for d in v.get("devices").and_then(Value::as_array).ok_or("usage without `devices`")? {
            let i = device_index(d, "index")?;
            let dev = self.devices.entry(i).or_default();
            dev.used = u64_field(d, "used")?;
            dev.peak = u64_field(d, "peak")?;
            dev.limit = d.get("limit").and_then(Value::as_u64);
            dev.denied = d.get("denied").and_then(Value::as_u64).unwrap_or(dev.denied);
            dev.would_deny = d.get("would_deny").and_then(Value::as_u64).unwrap_or(dev.would_deny);
            dev.group_limit = d.get("group_limit").and_then(Value::as_u64).or(dev.group_limit);
            dev.group_used = d.get("group_used").and_then(Value::as_u64).or(dev.group_used);
            dev.overhead = d.get("overhead").and_then(Value::as_u64).unwrap_or(0);
            dev.group_reserve = d.get("group_reserve").and_then(Value::as_u64).or(dev.group_reserve);
            dev.group_headroom = d.get("group_headroom").and_then(Value::as_u64).or(dev.group_headroom);
            // The share moves as members come and go: the snapshot's is the one now.
            dev.group_share = d.get("group_share").and_then(Value::as_u64).or(dev.group_share);
        }
        if let Some(allocs) = v.get("allocations").and_then(Value::as_array) {
            self.allocations.clear();
            for a in allocs {
                let dev = a.get("dev").and_then(Value::as_i64).ok_or("allocation count without `dev`")?;
                let api = a.get("api").and_then(Value::as_str).ok_or("allocation count without `api`")?;
                if !(-1..=MAX_DEVICE as i64).contains(&dev) {
                    return Err(format!("allocation count for device {dev} out of range"));
                }
                let n = u64_field(a, "count")?;
                let c = self.allocation_series(dev, api);
                *c = c.saturating_add(n);
            }
        }
        Ok(())
    }

    fn summary(&mut self, v: &Value) -> Result<(), String> {
        self.dropped = u64_field(v, "dropped")?;
        self.events = v.get("events").and_then(Value::as_u64).unwrap_or(self.events);
        for (key, field) in [("used", 0), ("peak", 1)] {
            if let Some(m) = v.get(key).and_then(Value::as_object) {
                for (d, n) in m {
                    let i: usize = d.parse().map_err(|_| format!("summary `{key}` key {d:?} is not a device"))?;
                    if i as u64 > MAX_DEVICE {
                        return Err(format!("device {i} out of range"));
                    }
                    let n = n.as_u64().ok_or_else(|| format!("summary `{key}` value is not an integer"))?;
                    let dev = self.devices.entry(i).or_default();
                    if field == 0 { dev.used = n } else { dev.peak = n }
                }
            }
        }
        self.finished = true;
        Ok(())
    }

    /// The client as `top` and the query answer show it.
    pub fn to_json(&self) -> Value {
        json!({
            "pid": self.pid,
            "uid": self.uid,
            "reported_pid": self.reported_pid,
            "exe": self.exe,
            "cmdline": self.cmdline,
            "namespace": self.namespace,
            "pod": self.pod,
            "container": self.container,
            "container_id": self.container_id,
            "pod_uid": self.pod_uid,
            "group": self.group,
            "group_policy": self.policy,
            "group_priority": self.priority,
            "group_holds_headroom": self.holds_headroom,
            "mode": if self.observe { "observe" } else { "enforce" },
            "events": self.events,
            "dropped": self.dropped,
            "devices": self.devices.iter().map(|(i, d)| json!({
                "index": i, "used": d.used, "limit": d.limit, "peak": d.peak, "denied": d.denied,
                "would_deny": d.would_deny, "overhead": d.overhead,
                "group_limit": d.group_limit, "group_used": d.group_used,
                "group_reserve": d.group_reserve, "group_headroom": d.group_headroom, "group_share": d.group_share,
            })).collect::<Vec<_>>(),
            "allocations": self.allocations.iter().map(|((dev, api), n)| json!({
                "dev": dev, "api": api, "count": n,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Everything the metrics endpoint and `top` read (behind one mutex, held briefly).
#[derive(Default)]
pub struct Registry {
    /// Keyed by connection id.
    pub clients: BTreeMap<u64, Client>,
    pub bad_clients: u64,
    /// Connections closed at once because the sidecar or the peer's uid was at its limit.
    pub refused: u64,
    /// Groups clients reported: swept for dead members after they left, and forgotten once no
    /// client names them and their ledger has no members left (reclaim.rs).
    /// Each with the uid of the client that named it (the peer's credentials): without
    /// `--group-dir` that uid's default directory is where its ledger lives.
    pub groups: std::collections::BTreeSet<(u32, String)>,
}

/// Who asks a `query` (from the asking connection's peer credentials).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Viewer {
    /// Root or the sidecar's admin group: every process.
    All,
    /// Only the processes of this uid.
    Uid(u32),
}

impl Registry {
    /// The whole state (the admin's view; the fuzz target `sidecar_records` renders it).
    #[allow(dead_code)]
    pub fn snapshot(&self) -> Value {
        self.snapshot_for(Viewer::All)
    }

    /// The answer to a `query` line: only the processes the viewer may see. `bad_clients` is a
    /// node-wide count and says nothing about anyone's jobs.
    pub fn snapshot_for(&self, viewer: Viewer) -> Value {
        let visible = |c: &&Client| match viewer {
            Viewer::All => true,
            Viewer::Uid(u) => c.uid == u,
        };
        json!({
            "type": "state",
            "protocol": crate::sidecar::PROTOCOL,
            "clients": self.clients.values().filter(visible).map(Client::to_json).collect::<Vec<_>>(),
            "bad_clients": self.bad_clients,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Value {
        serde_json::from_str(
            r#"{"type":"header","version":1,"protocol":1,"pid":7,"ppid":1,"exe":"python3","cmdline":["python3","t.py"],
                "host":"h","start_unix_ns":1,"devices":[{"index":0,"total":100,"limit":50},{"index":1,"total":100,"limit":null}],
                "group":null,"pod":"p1","namespace":"ns"}"#,
        )
        .unwrap()
    }

    fn line(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn events_then_a_snapshot_that_corrects_them() {
        let mut c = Client::from_header(4242, 1000, &header()).unwrap();
        assert_eq!((c.pid, c.reported_pid, c.pod.as_deref(), c.container.as_deref()), (4242, 7, Some("p1"), None));
        assert_eq!(c.devices[&0].limit, Some(50));
        assert_eq!(c.devices[&1].limit, None);
        let ev = |op: &str, used: u64| {
            line(&format!(r#"{{"type":"event","seq":0,"t_ns":1,"tid":1,"op":"{op}","api":"cuMemAlloc_v2","dev":0,"ptr":"0x1","size":10,"result":0,"dur_ns":1,"used":{used}}}"#))
        };
        c.apply(&ev("alloc", 10)).unwrap();
        c.apply(&ev("alloc", 30)).unwrap();
        c.apply(&ev("deny", 30)).unwrap();
        c.apply(&ev("free", 20)).unwrap();
        assert_eq!(c.devices[&0], Device { used: 20, limit: Some(50), peak: 30, denied: 1, ..Default::default() });
        assert_eq!(c.allocations[&(0, "cuMemAlloc_v2".to_string())], 2);
        c.apply(&line(
            r#"{"type":"usage","t_ns":5,"events":9,"dropped":3,"devices":[{"index":0,"used":40,"limit":50,"peak":45,"denied":2}],
                "allocations":[{"dev":0,"api":"cuMemAlloc","count":5}]}"#,
        ))
        .unwrap();
        assert_eq!(c.devices[&0], Device { used: 40, limit: Some(50), peak: 45, denied: 2, ..Default::default() });
        assert_eq!(c.allocations.len(), 1);
        assert_eq!((c.dropped, c.events), (3, 9));
        c.apply(&line(r#"{"type":"something_new","x":1}"#)).unwrap();
        c.apply(&line(r#"{"type":"summary","events":9,"dropped":4,"peak":{"0":45},"used":{"0":0}}"#)).unwrap();
        assert!(c.finished);
        assert_eq!((c.devices[&0].used, c.dropped), (0, 4));
    }

    #[test]
    fn group_names_are_checked_and_secrets_never_stored() {
        for bad in ["../../etc/shadow", "a/b", ".x", "", &"g".repeat(65)] {
            let mut h = header();
            h["group"] = bad.into();
            assert!(Client::from_header(1, 1, &h).unwrap_err().contains("not usable"), "{bad}");
        }
        let mut h = header();
        h["group"] = 5.into();
        assert!(Client::from_header(1, 1, &h).is_err());
        h["group"] = "team-1".into();
        h["cmdline"] = serde_json::json!(["python3", "t.py", "--api-key=sk-1", "--token", "t"]);
        h["exe"] = "e".repeat(100_000).into();
        let c = Client::from_header(1, 1, &h).unwrap();
        assert_eq!(c.cmdline, ["python3", "t.py", "--api-key=***", "--token", "***"]);
        assert_eq!(c.exe.len(), MAX_LABEL_CHARS);
    }

    #[test]
    fn a_viewer_sees_only_its_own_uid() {
        let mut r = Registry::default();
        r.clients.insert(1, Client::from_header(10, 1000, &header()).unwrap());
        r.clients.insert(2, Client::from_header(20, 2000, &header()).unwrap());
        let pids = |v: Value| v["clients"].as_array().unwrap().iter().map(|c| c["pid"].as_i64().unwrap()).collect::<Vec<_>>();
        assert_eq!(pids(r.snapshot_for(Viewer::Uid(2000))), [20]);
        assert_eq!(pids(r.snapshot_for(Viewer::Uid(3000))), Vec::<i64>::new());
        assert_eq!(pids(r.snapshot_for(Viewer::All)), [10, 20]);
    }

    #[test]
    fn bad_lines_are_errors_not_panics() {
        let mut h = header();
        h["version"] = 2.into();
        assert!(Client::from_header(1, 1, &h).unwrap_err().contains("version 2"));
        let mut h = header();
        h["protocol"] = 9.into();
        assert!(Client::from_header(1, 1, &h).unwrap_err().contains("protocol version 9"));
        let mut h = header();
        h["devices"][0]["index"] = (1u64 << 40).into();
        assert!(Client::from_header(1, 1, &h).is_err());
        let mut c = Client::from_header(1, 1, &header()).unwrap();
        let huge = format!(r#"{{"type":"usage","dropped":0,"devices":[],"allocations":[{{"dev":{},"api":"cuMemAlloc","count":1}}]}}"#, 1u64 << 40);
        assert!(c.apply(&line(&huge)).is_err());
        for bad in [
            r#"{"no":"type"}"#,
            r#"{"type":"event","op":"alloc"}"#,
            r#"{"type":"event","op":"alloc","api":"a","dev":99999,"used":1}"#,
            r#"{"type":"usage","dropped":-1,"devices":[]}"#,
            r#"{"type":"summary","dropped":0,"used":{"x":1}}"#,
        ] {
            assert!(c.apply(&line(bad)).is_err(), "{bad}");
        }
    }
}
