//! The trace's lines as this library writes them. The records are `vramcap_common::trace`'s
//! (one definition for the writer and every reader); this adapts an event record of the rings
//! to the line, naming its entry point by the names the hook table registered
//! ([`super::api_name`]).

use crate::events::{API_CEILING, API_GROUP, NO_GROUP, Record};
use vramcap_common::trace::event::{self, EventLine};

pub use vramcap_common::trace::VERSION;
pub use vramcap_common::trace::record::{AllocCount, DeviceLine, DeviceSharing, DeviceUsage, GroupSummary, Header, Summary, Usage, json_line};

/// Appends one `{"type":"event",...}` line; `t_ns` and `dur_ns` are already converted from ticks.
pub fn event_line(buf: &mut Vec<u8>, r: &Record, t_ns: u64, dur_ns: u64) {
    let e = &r.ev;
    event::write(
        buf,
        &EventLine {
            seq: r.seq,
            t_ns,
            tid: r.tid as u64,
            op: e.op,
            api: match e.api {
                API_CEILING => "ceiling",
                API_GROUP => "group",
                a => super::api_name(a),
            },
            dev: e.dev,
            ptr: e.ptr,
            size: e.size,
            result: e.result as i64,
            dur_ns,
            used: e.used,
            group_used: (e.group_used != NO_GROUP).then_some(e.group_used),
        },
    );
}
