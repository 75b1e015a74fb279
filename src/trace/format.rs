//! Trace lines (docs/trace-format.md, version 1). Events are formatted by hand into a reused
//! buffer (they are the bulk of the file); the header and summary, written once, use serde_json.

use crate::events::Record;
use crate::hooks::HOOKS;

pub const VERSION: u32 = 1;

fn push_u64(buf: &mut Vec<u8>, mut v: u64) {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    buf.extend_from_slice(&tmp[i..]);
}

fn push_i64(buf: &mut Vec<u8>, v: i64) {
    if v < 0 {
        buf.push(b'-');
    }
    push_u64(buf, v.unsigned_abs());
}

fn push_hex(buf: &mut Vec<u8>, v: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    buf.extend_from_slice(b"\"0x");
    if v == 0 {
        buf.push(b'0');
    } else {
        let start = (15 - v.leading_zeros() / 4) as i32;
        for shift in (0..=start).rev() {
            buf.push(DIGITS[((v >> (shift * 4)) & 0xf) as usize]);
        }
    }
    buf.push(b'"');
}

/// Appends one `{"type":"event",...}` line; `t_ns` and `dur_ns` are already converted from ticks.
pub fn event_line(buf: &mut Vec<u8>, r: &Record, t_ns: u64, dur_ns: u64) {
    let e = &r.ev;
    buf.extend_from_slice(b"{\"type\":\"event\",\"seq\":");
    push_u64(buf, r.seq);
    buf.extend_from_slice(b",\"t_ns\":");
    push_u64(buf, t_ns);
    buf.extend_from_slice(b",\"tid\":");
    push_u64(buf, r.tid as u64);
    buf.extend_from_slice(b",\"op\":\"");
    buf.extend_from_slice(e.op.name().as_bytes());
    buf.extend_from_slice(b"\",\"api\":\"");
    buf.extend_from_slice(HOOKS[e.api as usize].name.as_bytes());
    buf.extend_from_slice(b"\",\"dev\":");
    push_i64(buf, e.dev as i64);
    buf.extend_from_slice(b",\"ptr\":");
    push_hex(buf, e.ptr);
    buf.extend_from_slice(b",\"size\":");
    push_u64(buf, e.size);
    buf.extend_from_slice(b",\"result\":");
    push_i64(buf, e.result as i64);
    buf.extend_from_slice(b",\"dur_ns\":");
    push_u64(buf, dur_ns);
    buf.extend_from_slice(b",\"used\":");
    push_u64(buf, e.used);
    if e.group_used != crate::events::NO_GROUP {
        buf.extend_from_slice(b",\"group_used\":");
        push_u64(buf, e.group_used);
    }
    buf.extend_from_slice(b"}\n");
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceLine {
    pub index: usize,
    pub total: u64,
    pub limit: Option<u64>,
    /// The group's budget on this device (group members only; absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_limit: Option<u64>,
    #[serde(flatten)]
    pub sharing: DeviceSharing,
}

/// Where the group caps a device: this member's reserve and the group's headroom (0 when none),
/// and under `equal` its share now (issue 17). In the header's `devices[]` and in every usage
/// line's (the share moves as members come and go); all absent where the group does not cap.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct DeviceSharing {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_reserve: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_headroom: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_share: Option<u64>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Header {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub version: u32,
    pub pid: i32,
    pub ppid: i32,
    pub exe: String,
    pub cmdline: Vec<String>,
    pub host: String,
    pub start_unix_ns: u64,
    pub devices: Vec<DeviceLine>,
    pub group: Option<String>,
    /// Group members only: the group's policy, this member's priority, and whether it is the
    /// one member that may use the group's headroom; all three hold for the member's whole life.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_policy: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_priority: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_holds_headroom: Option<bool>,
    /// `VRAMCAP_JOB`, when set: the job this process belongs to (`vramcap run` sets one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
}

pub fn json_line(buf: &mut Vec<u8>, v: &impl serde::Serialize) {
    if serde_json::to_writer(&mut *buf, v).is_ok() {
        buf.push(b'\n');
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// When the process exited, on the events' clock.
    pub t_ns: u64,
    pub events: u64,
    pub dropped: u64,
    pub peak: std::collections::BTreeMap<String, u64>,
    pub used: std::collections::BTreeMap<String, u64>,
    /// Per device, every allocation the cap refused (printed on stderr or not, traced or dropped).
    pub denied: std::collections::BTreeMap<String, u64>,
    /// The group this process belonged to, and the group's numbers at its exit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupSummary>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct GroupSummary {
    pub name: String,
    /// Per device the group caps: its budget, and every member's charge together at this exit.
    pub limit: std::collections::BTreeMap<String, u64>,
    pub used: std::collections::BTreeMap<String, u64>,
    /// The member's policy, priority and headroom holding (absent when it had no slot, e.g. a
    /// forked child that never allocated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holds_headroom: Option<bool>,
    /// Per device the group caps: this member's reserve, the group's headroom, and under
    /// `equal` the member's share at this exit.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub reserve: std::collections::BTreeMap<String, u64>,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub headroom: std::collections::BTreeMap<String, u64>,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub share: std::collections::BTreeMap<String, u64>,
}

/// A periodic `{"type":"usage",...}` snapshot: the process's numbers as the ledger and the writer
/// know them now, so a reader that missed events (a sidecar that restarted) is right again.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Usage {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub t_ns: u64,
    pub events: u64,
    pub dropped: u64,
    pub devices: Vec<DeviceUsage>,
    pub allocations: Vec<AllocCount>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceUsage {
    pub index: usize,
    pub used: u64,
    pub limit: Option<u64>,
    pub peak: u64,
    pub denied: u64,
    /// The group's budget and charge (group members whose group caps the device only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_used: Option<u64>,
    #[serde(flatten)]
    pub sharing: DeviceSharing,
}

/// Successful counted allocations (`op` `alloc`) of one entry point on one device, since start.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AllocCount {
    pub dev: i32,
    pub api: &'static str,
    pub count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Event, Op};
    use crate::hooks::Hook;

    fn golden_event() -> Record {
        Record {
            seq: 17,
            at: 0,
            tid: 4243,
            lost_before: 0,
            ev: Event {
                op: Op::Alloc,
                api: Hook::cuMemAlloc_v2,
                dev: 0,
                ptr: 0x7f3a_4000_0000,
                size: 1_048_576,
                result: 0,
                dur: 0,
                used: 5_242_880,
                group_used: crate::events::NO_GROUP,
            },
        }
    }

    /// The golden line is the example of docs/trace-format.md: changing either breaks this test.
    #[test]
    fn event_line_matches_the_documented_example() {
        let mut buf = Vec::new();
        event_line(&mut buf, &golden_event(), 1_200_345, 850);
        assert_eq!(
            String::from_utf8(buf).unwrap(),
            "{\"type\":\"event\",\"seq\":17,\"t_ns\":1200345,\"tid\":4243,\"op\":\"alloc\",\"api\":\"cuMemAlloc_v2\",\
             \"dev\":0,\"ptr\":\"0x7f3a40000000\",\"size\":1048576,\"result\":0,\"dur_ns\":850,\"used\":5242880}\n"
        );
        let doc = include_str!("../../docs/trace-format.md");
        assert!(doc.contains("\"ptr\":\"0x7f3a40000000\",\"size\":1048576,\"result\":0,\"dur_ns\":850,\"used\":5242880}"));
    }

    #[test]
    fn numbers_and_pointers() {
        let mut r = golden_event();
        r.ev.dev = -1;
        r.ev.ptr = 0;
        r.ev.result = 2;
        r.ev.op = Op::Deny;
        r.ev.size = u64::MAX;
        let mut buf = Vec::new();
        event_line(&mut buf, &r, 0, 0);
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(v["dev"], -1);
        assert_eq!(v["ptr"], "0x0");
        assert_eq!(v["op"], "deny");
        assert_eq!(v["size"], u64::MAX);
        let mut buf = Vec::new();
        push_hex(&mut buf, 0xf);
        push_hex(&mut buf, 0x10);
        push_hex(&mut buf, u64::MAX);
        assert_eq!(String::from_utf8(buf).unwrap(), "\"0xf\"\"0x10\"\"0xffffffffffffffff\"");
    }
}
