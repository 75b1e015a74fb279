//! The trace records (docs/trace-format.md, version 1), defined once for the writer (the preload
//! library, and the sidecar's `--trace-dir` files) and every reader (`vramcap report`, `plot`,
//! `export`, `replay`, `run --report`):
//!
//! - [`record`]: the `header`, `summary` and `usage` lines, one serde type each, written and read
//!   by the same definition;
//! - [`event`]: the `event` line, which is the bulk of a trace: written by hand into a reused
//!   buffer (no allocation on the writer thread) and read by a one-pass scanner ([`scan`]) with
//!   serde_json as the fallback for unusual lines;
//! - [`Op`]: every kind of event, by the name the trace gives it.
//!
//! Both directions are tested against each other and against golden lines
//! (tests/data/golden/trace-v1.jsonl): a field renamed or dropped on one side fails a test.

pub mod event;
pub mod record;
pub mod scan;

#[cfg(test)]
mod golden;

/// The format version in every header.
pub const VERSION: u32 = 1;

/// What an event records, as its `op` field names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Charged against the cap.
    Alloc,
    /// Released.
    Free,
    /// Refused by the cap; the driver was not called.
    Deny,
    /// The driver returned an error.
    Fail,
    Map,
    Unmap,
    Reserve,
    HostAlloc,
    HostFree,
    IpcOpen,
    /// A limit changed while the process ran (issue 26): `api` says by what (`ceiling`: the
    /// ceiling file, `group`: the group's ledger), `ptr` the old limit, `size` the new one (0 =
    /// none), `result` the uid that changed it (ceiling: 0, root's file); written with the named
    /// fields `old`, `new`, `uid` and `source` as well.
    Limit,
    /// Observe mode (issue 26): the cap would have refused this allocation and granted it
    /// (the driver's answer follows as the usual `alloc` or `fail`). `size` is the request,
    /// `ptr` the limit that would have refused, `result` which cap ([`WouldDenyCap`]), `dur_ns`
    /// what that cap had charged before the request; written with the named fields `cap`,
    /// `limit` and `charge` as well.
    WouldDeny,
    /// Device memory the driver took that no allocation returned (issue 24): a context, a
    /// module's globals, a per-context reservation (`cuCtxSetLimit`), as measured from the
    /// driver's books around the call named by `api`; `ptr` the context it belongs to, `size`
    /// the bytes now charged for it. Counted against the cap like an allocation.
    Overhead,
    /// Overhead given back (the context ended, a module was unloaded, a limit lowered): `ptr`
    /// the context, `size` the bytes.
    OverheadFree,
    /// Read from a trace: an `op` this version does not know (never written).
    Other,
}

impl Op {
    /// Every op the library writes.
    pub const WRITTEN: [Op; 14] = [
        Op::Alloc,
        Op::Free,
        Op::Deny,
        Op::Fail,
        Op::Map,
        Op::Unmap,
        Op::Reserve,
        Op::HostAlloc,
        Op::HostFree,
        Op::IpcOpen,
        Op::Limit,
        Op::WouldDeny,
        Op::Overhead,
        Op::OverheadFree,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Alloc => "alloc",
            Op::Free => "free",
            Op::Deny => "deny",
            Op::Fail => "fail",
            Op::Map => "map",
            Op::Unmap => "unmap",
            Op::Reserve => "reserve",
            Op::HostAlloc => "host_alloc",
            Op::HostFree => "host_free",
            Op::IpcOpen => "ipc_open",
            Op::Limit => "limit",
            Op::WouldDeny => "would_deny",
            Op::Overhead => "overhead",
            Op::OverheadFree => "overhead_free",
            Op::Other => "other",
        }
    }

    /// The op a trace's `op` text names; [`Op::Other`] for one this version does not know.
    pub fn parse(s: &[u8]) -> Op {
        Op::WRITTEN.into_iter().find(|o| o.name().as_bytes() == s).unwrap_or(Op::Other)
    }

    /// Whether the event moves the cap's charge (the rest are traced only).
    pub fn is_counted(self) -> bool {
        matches!(self, Op::Alloc | Op::Free | Op::Deny | Op::Fail | Op::Overhead | Op::OverheadFree)
    }
}

/// Which cap a `would_deny` event's allocation would have been refused by (its `result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WouldDenyCap {
    /// The process's own limit (`VRAMCAP_LIMIT*`).
    Process = 1,
    /// The group's budget (or a rule of its sharing policy).
    Group = 2,
    /// The machine's ceiling file's limit (the process's limit is the file's).
    Ceiling = 3,
}

impl WouldDenyCap {
    pub fn name(self) -> &'static str {
        match self {
            WouldDenyCap::Process => "process",
            WouldDenyCap::Group => "group",
            WouldDenyCap::Ceiling => "ceiling",
        }
    }
    pub fn from_result(r: i64) -> Option<WouldDenyCap> {
        match r {
            1 => Some(WouldDenyCap::Process),
            2 => Some(WouldDenyCap::Group),
            3 => Some(WouldDenyCap::Ceiling),
            _ => None,
        }
    }
}

/// Text from a trace or a client as it may be printed: control characters (terminal escapes
/// among them) become `?`.
pub fn printable(s: &str) -> String {
    s.chars().map(|ch| if ch.is_control() { '?' } else { ch }).collect()
}
