//! The driver's own books: how much device memory the driver says this process uses, read
//! around the rare calls that take memory no allocation returns (a context, a module, a
//! per-context reservation) — never on the allocation path. In order of trust:
//!
//! 1. NVML's running-process list (`nvmlDeviceGetComputeRunningProcesses_v3`), this process's
//!    entry under its pid as the host sees it: exact, other processes cannot disturb it. NVML
//!    names processes by host pid; inside a pid namespace that is the first `NSpid` field of
//!    `/proc/self/status` when `/proc` is an ancestor namespace's. Where it is not (a container
//!    with its own `/proc`) the host pid is unknown, and this source is not used: a wrong pid
//!    would read as "uses nothing".
//! 2. NVML's device memory (`nvmlDeviceGetMemoryInfo`, the real one), used = total − free: other
//!    processes on the GPU can move it between the two readings.
//! 3. `cuMemGetInfo_v2` (the real one) in a context current on the device, before and after:
//!    as disturbed as 2, and only where a context is current before the call.
//!
//! A change is only ever read as before/after of one source, so a source's constant offset
//! (memory other processes hold) cancels out.

use super::init::format_uuid;
use crate::ffi::*;
use crate::hooks::{import, real};
use crate::ledger;
use once_cell::sync::OnceCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::ffi::{CStr, c_char};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Process,
    Device,
    MemGetInfo,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Process => "nvml-process",
            Source::Device => "nvml-device",
            Source::MemGetInfo => "cuMemGetInfo",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Reading {
    pub source: Source,
    pub used: u64,
}

/// `/proc/self/ns/pid` of the initial pid namespace (`PROC_PID_INIT_INO`).
const INIT_PIDNS: u64 = 0xEFFF_FFFC;

/// The host pid from `/proc/self/status`'s `NSpid` list and this process's pid namespace inode:
/// the first field is the pid in the namespace of the `/proc` mount, which is the host's in the
/// initial namespace, and an ancestor's where there are two fields or more.
pub fn host_pid_from(nspid: &str, pidns: u64) -> Option<u32> {
    let fields: Vec<u32> = nspid.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
    match fields.as_slice() {
        [] => None,
        [only] => (pidns == INIT_PIDNS).then_some(*only),
        [first, ..] => Some(*first),
    }
}

fn host_pid() -> Option<u32> {
    static PID: OnceCell<Option<u32>> = OnceCell::new();
    *PID.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let ino = ns.to_str()?.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()?;
        host_pid_from(nspid, ino)
    })
}

/// NVML initialised by us (reference counted by NVML; never shut down: handles stay valid).
fn nvml_up() -> bool {
    static UP: OnceCell<bool> = OnceCell::new();
    *UP.get_or_init(|| import::nvmlInit_v2().is_some_and(|f| unsafe { f() } == NVML_SUCCESS))
}

/// NVML handles found so far, by CUDA ordinal (address + 1; 0: not looked up yet). A handle
/// stays valid while NVML is initialised, and our own `nvmlInit_v2` keeps it so.
static HANDLES: [AtomicUsize; ledger::MAX_DEVICES] = [const { AtomicUsize::new(0) }; ledger::MAX_DEVICES];

/// The NVML handle of CUDA ordinal `dev`, matched by UUID.
fn nvml_handle(dev: usize) -> Option<nvmlDevice_t> {
    if !nvml_up() {
        return None;
    }
    let cached = HANDLES.get(dev)?.load(Ordering::Acquire);
    if cached != 0 {
        return Some((cached - 1) as nvmlDevice_t);
    }
    let h = find_handle(dev)?;
    HANDLES[dev].store(h as usize + 1, Ordering::Release);
    Some(h)
}

fn find_handle(dev: usize) -> Option<nvmlDevice_t> {
    let (get, uuid_fn) = (import::cuDeviceGet()?, import::cuDeviceGetUuid()?);
    let (mut d, mut b) = (0, [0u8; 16]);
    if unsafe { get(&mut d, dev as i32) } != CUDA_SUCCESS || unsafe { uuid_fn(&mut b, d) } != CUDA_SUCCESS {
        return None;
    }
    let want = format_uuid(&b).to_ascii_lowercase();
    let (count, by_index, nv_uuid) = (import::nvmlDeviceGetCount_v2()?, import::nvmlDeviceGetHandleByIndex_v2()?, import::nvmlDeviceGetUUID()?);
    let mut n = 0;
    if unsafe { count(&mut n) } != NVML_SUCCESS {
        return None;
    }
    (0..n).find_map(|i| {
        let mut h: nvmlDevice_t = std::ptr::null_mut();
        let mut buf = [0 as c_char; 96];
        let ok = unsafe { by_index(i, &mut h) == NVML_SUCCESS && nv_uuid(h, buf.as_mut_ptr(), buf.len() as u32) == NVML_SUCCESS };
        let name = ok.then(|| unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().to_ascii_lowercase());
        (name.as_deref() == Some(want.as_str())).then_some(h)
    })
}

/// What the running-process list says `pid` uses on the device (0: not listed).
fn process_used(h: nvmlDevice_t, pid: u32) -> Option<u64> {
    let f = import::nvmlDeviceGetComputeRunningProcesses_v3()?;
    let mut room = 64usize;
    // The list can grow between the size query and the read: a few tries, then give up.
    for _ in 0..4 {
        let mut buf = vec![nvmlProcessInfo_t::default(); room];
        let mut n = room as u32;
        match unsafe { f(h, &mut n, buf.as_mut_ptr()) } {
            NVML_SUCCESS => {
                let mine = buf.iter().take(n as usize).filter(|p| p.pid == pid);
                let mut sum = 0u64;
                for p in mine {
                    if p.used_gpu_memory == NVML_VALUE_NOT_AVAILABLE {
                        return None;
                    }
                    sum = sum.saturating_add(p.used_gpu_memory);
                }
                return Some(sum);
            }
            NVML_ERROR_INSUFFICIENT_SIZE => room = n as usize + 16,
            _ => return None,
        }
    }
    None
}

fn device_used(h: nvmlDevice_t) -> Option<u64> {
    let f = real::nvmlDeviceGetMemoryInfo()?;
    let mut m = nvmlMemory_t { total: 0, free: 0, used: 0 };
    (unsafe { f(h, &mut m) } == NVML_SUCCESS).then(|| m.total.saturating_sub(m.free))
}

fn mem_get_info_used(dev: usize) -> Option<u64> {
    if super::current_device() != Some(dev) {
        return None;
    }
    let f = real::cuMemGetInfo_v2()?;
    let (mut free, mut total) = (0usize, 0usize);
    (unsafe { f(&mut free, &mut total) } == CUDA_SUCCESS).then(|| (total as u64).saturating_sub(free as u64))
}

/// What the driver's books say about `dev` now, from `only` if given (the source of the reading
/// this one will be compared with), else from the most trusted source that answers.
pub fn read(dev: usize, only: Option<Source>) -> Option<Reading> {
    let want = |s: Source| only.is_none_or(|o| o == s);
    let handle = if want(Source::Process) || want(Source::Device) { nvml_handle(dev) } else { None };
    if want(Source::Process)
        && let (Some(h), Some(pid)) = (handle, host_pid())
        && let Some(used) = process_used(h, pid)
    {
        return Some(Reading { source: Source::Process, used });
    }
    if want(Source::Device)
        && let Some(used) = handle.and_then(device_used)
    {
        return Some(Reading { source: Source::Device, used });
    }
    if want(Source::MemGetInfo)
        && let Some(used) = mem_get_info_used(dev)
    {
        return Some(Reading { source: Source::MemGetInfo, used });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_pid_is_known_only_where_proc_shows_an_outer_namespace() {
        assert_eq!(host_pid_from(" 4242\n", INIT_PIDNS), Some(4242));
        // Own pid namespace, host /proc: the first field is the host's pid.
        assert_eq!(host_pid_from("\t4242\t1", 4026532000), Some(4242));
        // Own pid namespace and its own /proc: only the inner pid, not the host's.
        assert_eq!(host_pid_from("\t1", 4026532000), None);
        assert_eq!(host_pid_from("", INIT_PIDNS), None);
        assert_eq!(host_pid_from("x 1", INIT_PIDNS), None);
    }
}
