//! The record of every intercepted call, handed from the allocating thread to consumers (the trace
//! writer, the sidecar connection). The allocating thread only fills a small fixed-size record;
//! formatting and I/O happen elsewhere.

use crate::ffi::CUresult;
use crate::hooks::Hook;

/// What happened, as the trace's `op` field names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

impl Op {
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
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub op: Op,
    pub api: Hook,
    /// Device ordinal, -1 when none applies.
    pub dev: i32,
    /// Device pointer, or the handle for VMM.
    pub ptr: u64,
    /// Bytes requested; for `free`, bytes released.
    pub size: u64,
    pub result: CUresult,
    /// Time spent in the real driver call.
    pub dur_ns: u64,
    /// The device's charge after the call.
    pub used: u64,
}

/// Whether anyone consumes events (decides whether wrappers time the driver call).
#[inline]
pub fn enabled() -> bool {
    false
}

/// Monotonic nanoseconds (CLOCK_MONOTONIC; vDSO, no syscall).
#[inline]
pub fn now_ns() -> u64 {
    crate::log::monotonic_ns()
}

/// Hands an event to the consumers. Never blocks, never does I/O.
#[inline]
pub fn emit(_e: Event) {}
