//! The `header`, `summary` and `usage` lines: one type each, serialized by the writer and
//! deserialized by the readers, so the two cannot name a field differently. Fields added after
//! version 1 was first written are optional on reading (`#[serde(default)]`): old traces still
//! read. Unknown fields are ignored, as the format requires.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Per device (key: the CUDA ordinal as a string).
pub type PerDevice = BTreeMap<String, u64>;

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_empty(m: &PerDevice) -> bool {
    m.is_empty()
}

/// The first line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// `"header"`.
    #[serde(rename = "type", default)]
    pub kind: String,
    pub version: u64,
    pub pid: u64,
    #[serde(default)]
    pub ppid: u64,
    #[serde(default)]
    pub exe: String,
    #[serde(default)]
    pub cmdline: Vec<String>,
    #[serde(default)]
    pub host: String,
    pub start_unix_ns: u64,
    #[serde(default)]
    pub devices: Vec<DeviceLine>,
    /// Written as `null` outside a group.
    #[serde(default)]
    pub group: Option<String>,
    /// Group members only: the group's policy, this member's priority, and whether it is the one
    /// member that may use the group's headroom; all three hold for the member's whole life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_priority: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_holds_headroom: Option<bool>,
    /// `VRAMCAP_JOB`, when set: the job this process belongs to (`vramcap run` sets one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// `"observe"` when the process started in observe mode (issue 26; absent: enforce).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

impl Header {
    /// A header with nothing known but what every reader needs.
    pub fn empty() -> Header {
        Header {
            kind: "header".into(),
            version: 0,
            pid: 0,
            ppid: 0,
            exe: String::new(),
            cmdline: Vec::new(),
            host: String::new(),
            start_unix_ns: 0,
            devices: Vec::new(),
            group: None,
            group_policy: None,
            group_priority: None,
            group_holds_headroom: None,
            job: None,
            mode: None,
        }
    }
}

/// One device in the header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceLine {
    pub index: i32,
    #[serde(default)]
    pub total: u64,
    /// `null`: no limit.
    #[serde(default)]
    pub limit: Option<u64>,
    /// The group's budget on this device (group members only; absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_limit: Option<u64>,
    #[serde(flatten)]
    pub sharing: DeviceSharing,
}

/// Where the group caps a device: this member's reserve and the group's headroom (0 when none),
/// and under `equal` its share now (issue 17). In the header's `devices[]` and in every usage
/// line's (the share moves as members come and go); all absent where the group does not cap.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceSharing {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_reserve: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_headroom: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_share: Option<u64>,
}

/// The last line of a trace, written at exit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// `"summary"`.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// When the process exited, on the events' clock (`None` in traces from before the field).
    #[serde(default)]
    pub t_ns: Option<u64>,
    #[serde(default)]
    pub events: u64,
    #[serde(default)]
    pub dropped: u64,
    #[serde(default)]
    pub peak: PerDevice,
    /// The charge at exit: the truth even when events dropped.
    #[serde(default)]
    pub used: PerDevice,
    /// Every allocation the cap refused (printed on stderr or not, traced or dropped); `None` in
    /// traces from before the field.
    #[serde(default)]
    pub denied: Option<PerDevice>,
    /// Observe mode only: every allocation the cap would have refused and granted, per device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub would_deny: Option<PerDevice>,
    /// The group this process belonged to, and the group's numbers at its exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupSummary>,
}

impl Summary {
    pub fn used_at_exit(&self, dev: i32) -> Option<u64> {
        self.used.get(&dev.to_string()).copied()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupSummary {
    #[serde(default)]
    pub name: String,
    /// Per device the group caps: its budget, and every member's charge together at this exit.
    #[serde(default)]
    pub limit: PerDevice,
    #[serde(default)]
    pub used: PerDevice,
    /// The member's policy, priority and headroom holding (absent when it had no slot, e.g. a
    /// forked child that never allocated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holds_headroom: Option<bool>,
    /// Per device the group caps: this member's reserve, the group's headroom, and under
    /// `equal` the member's share at this exit.
    #[serde(default, skip_serializing_if = "is_empty")]
    pub reserve: PerDevice,
    #[serde(default, skip_serializing_if = "is_empty")]
    pub headroom: PerDevice,
    #[serde(default, skip_serializing_if = "is_empty")]
    pub share: PerDevice,
}

/// A periodic `{"type":"usage",...}` snapshot: the process's numbers as the ledger and the writer
/// know them now, so a reader that missed events (a sidecar that restarted) is right again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// `"usage"`.
    #[serde(rename = "type", default)]
    pub kind: String,
    pub t_ns: u64,
    #[serde(default)]
    pub events: u64,
    #[serde(default)]
    pub dropped: u64,
    #[serde(default)]
    pub devices: Vec<DeviceUsage>,
    #[serde(default)]
    pub allocations: Vec<AllocCount>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceUsage {
    pub index: i32,
    pub used: u64,
    /// `null`: no limit.
    #[serde(default)]
    pub limit: Option<u64>,
    #[serde(default)]
    pub peak: u64,
    #[serde(default)]
    pub denied: u64,
    /// Observe mode: allocations the cap would have refused (absent when none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub would_deny: u64,
    /// The group's budget and charge (group members whose group caps the device only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_used: Option<u64>,
    /// Of `used`, what the driver took beyond allocations (contexts, modules, per-context
    /// reservations; issue 24). Absent: none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overhead: u64,
    #[serde(flatten)]
    pub sharing: DeviceSharing,
}

/// Successful counted allocations (`op` `alloc`) of one entry point on one device, since start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocCount {
    pub dev: i32,
    pub api: String,
    pub count: u64,
}

/// Appends `v` as one JSON line.
pub fn json_line(buf: &mut Vec<u8>, v: &impl Serialize) {
    if serde_json::to_writer(&mut *buf, v).is_ok() {
        buf.push(b'\n');
    }
}
