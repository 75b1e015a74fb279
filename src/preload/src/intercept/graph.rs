//! CUDA graph memory. A graph's memory allocation nodes (`cuGraphAddMemAllocNode`, or
//! `cuMemAllocAsync` recorded by stream capture) allocate nothing when they are made: the memory
//! is allocated when the instantiated graph is launched (or uploaded), from the device's graph
//! memory, which keeps what the graph's free nodes release reserved for the next launch until
//! `cuDeviceGraphMemTrim`.
//!
//! So vramcap charges each device's graph-memory reservation
//! (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), like a pool's. At instantiation it reads the
//! graph's allocation nodes (`cuGraphGetNodes`, `cuGraphMemAllocNodeGetParams`) and remembers
//! what a launch of that executable graph may need per device; a launch reserves that (rounded
//! to the granularity) against the cap, relieving pressure first if it does not fit, and is denied
//! with the driver's own `CUDA_ERROR_OUT_OF_MEMORY` otherwise; after the launch the charge settles
//! to the device's real reservation in one step. Graphs without memory nodes cost one load.

use super::charge::{Timed, emit, timed};
use super::init::ensure_limits;
use super::{MISSING_REAL, Mode, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger::{self, MAX_DEVICES};
use crate::sync::Lock;
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const GRANULARITY: u64 = 2 << 20;

/// Bytes of each device's graph memory in its charge.
static CHARGED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Whether any graph with memory nodes was instantiated (until then nothing here runs).
static SEEN: AtomicBool = AtomicBool::new(false);
/// Executable graph → what one launch may need, per device.
type Needs = Vec<(u16, u64)>;
static EXECS: Lock<Option<HashMap<u64, Needs>>> = Lock::new(None);
/// Serializes settles (see `pool_table::settle`: a stale read must never overwrite a later one).
static SETTLE: Lock<()> = Lock::new(());
static FORK_HANDLER: AtomicBool = AtomicBool::new(false);

extern "C" fn locks_in_child() {
    EXECS.reset_in_child();
    SETTLE.reset_in_child();
}

fn seen() {
    if !FORK_HANDLER.swap(true, Ordering::AcqRel) {
        unsafe { libc::pthread_atfork(None, None, Some(locks_in_child)) };
    }
    SEEN.store(true, Ordering::Release);
}

/// Sets `dev`'s graph-memory charge to what the driver reports, giving back `reservation` in
/// the same step. When the driver cannot say, the reservation stays charged.
fn settle(dev: usize, reservation: u64) -> i64 {
    let Some(f) = import::cuDeviceGetGraphMemAttribute() else {
        ledger::unreserve(dev, reservation);
        return 0;
    };
    let Some(cell) = CHARGED.get(dev) else { return 0 };
    let _g = SETTLE.lock();
    let mut now: u64 = 0;
    let rc = unsafe { f(dev as CUdevice, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, (&mut now as *mut u64).cast::<c_void>()) };
    if rc != CUDA_SUCCESS {
        cell.fetch_add(reservation, Ordering::AcqRel);
        ledger::commit(dev, reservation);
        return reservation as i64;
    }
    let old = cell.swap(now, Ordering::AcqRel);
    ledger::settle(dev, old, now, reservation);
    now as i64 - old as i64
}

fn devices(dev: Option<usize>) -> std::ops::Range<usize> {
    match dev {
        Some(d) => d..d + 1,
        None => 0..ledger::device_count().clamp(1, MAX_DEVICES),
    }
}

/// Re-reads the graph memory of `dev` (`None`: every device); whether a charge went down.
pub fn refresh(dev: Option<usize>) -> bool {
    if !SEEN.load(Ordering::Acquire) {
        return false;
    }
    devices(dev).fold(false, |acc, d| acc | (settle(d, 0) < 0))
}

/// Pressure relief: gives back the graph memory of `dev` no graph is using.
pub fn trim(dev: usize) -> bool {
    if !SEEN.load(Ordering::Acquire) {
        return false;
    }
    let Some(f) = real::cuDeviceGraphMemTrim() else { return false };
    if unsafe { f(dev as CUdevice) } != CUDA_SUCCESS {
        return false;
    }
    let delta = settle(dev, 0);
    if delta < 0 {
        let t = Timed::instant(CUDA_SUCCESS);
        emit(Op::Free, Hook::cuDeviceGraphMemTrim, dev as i32, 0, delta.unsigned_abs(), t, ledger::used(dev));
    }
    delta < 0
}

/// What one launch of `graph` may allocate, per device: the sum of its allocation nodes.
fn needs(graph: CUgraph) -> Needs {
    let (Some(nodes), Some(kind), Some(params)) =
        (import::cuGraphGetNodes(), import::cuGraphNodeGetType(), import::cuGraphMemAllocNodeGetParams())
    else {
        return Vec::new(); // a driver without graph memory nodes
    };
    let mut n = 0usize;
    if unsafe { nodes(graph, std::ptr::null_mut(), &mut n) } != CUDA_SUCCESS || n == 0 {
        return Vec::new();
    }
    let mut all: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    if unsafe { nodes(graph, all.as_mut_ptr(), &mut n) } != CUDA_SUCCESS {
        return Vec::new();
    }
    let mut out: Needs = Vec::new();
    for &node in &all[..n.min(all.len())] {
        let mut t = -1;
        if unsafe { kind(node, &mut t) } != CUDA_SUCCESS || t != CU_GRAPH_NODE_TYPE_MEM_ALLOC {
            continue;
        }
        let mut p: CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
        if unsafe { params(node, &mut p) } != CUDA_SUCCESS {
            continue;
        }
        let loc = p.pool_props.location;
        if loc.type_ != CU_MEM_LOCATION_TYPE_DEVICE || loc.id < 0 || loc.id as usize >= MAX_DEVICES {
            continue;
        }
        let bytes = (p.bytesize as u64).div_ceil(GRANULARITY).saturating_mul(GRANULARITY);
        match out.iter_mut().find(|(d, _)| *d as i32 == loc.id) {
            Some((_, b)) => *b = b.saturating_add(bytes),
            None => out.push((loc.id as u16, bytes)),
        }
    }
    out
}

fn instantiated(rc: CUresult, exec: *mut CUgraphExec, graph: CUgraph) -> CUresult {
    // Also without enforcement: a process that must get no memory (fail-closed) is refused the
    // launches that would allocate.
    if rc == CUDA_SUCCESS && !exec.is_null() && mode() != Mode::PassThrough {
        guarded((), || {
            let need = needs(graph);
            if !need.is_empty() {
                seen();
                let e = unsafe { *exec } as u64;
                EXECS.lock().get_or_insert_with(HashMap::new).insert(e, need);
            }
        });
    }
    rc
}

pub unsafe fn instantiate_v1(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    err: *mut CUgraphNode,
    log: *mut c_char,
    size: usize,
) -> CUresult {
    let Some(f) = real::cuGraphInstantiate() else { return MISSING_REAL };
    instantiated(unsafe { f(exec, graph, err, log, size) }, exec, graph)
}

pub unsafe fn instantiate_v2(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    err: *mut CUgraphNode,
    log: *mut c_char,
    size: usize,
) -> CUresult {
    let Some(f) = real::cuGraphInstantiate_v2() else { return MISSING_REAL };
    instantiated(unsafe { f(exec, graph, err, log, size) }, exec, graph)
}

pub unsafe fn instantiate_with_flags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> CUresult {
    let Some(f) = real::cuGraphInstantiateWithFlags() else { return MISSING_REAL };
    instantiated(unsafe { f(exec, graph, flags) }, exec, graph)
}

pub unsafe fn instantiate_with_params(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void) -> CUresult {
    let Some(f) = real::cuGraphInstantiateWithParams() else { return MISSING_REAL };
    instantiated(unsafe { f(exec, graph, params) }, exec, graph)
}

pub unsafe fn instantiate_with_params_ptsz(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void) -> CUresult {
    let Some(f) = real::cuGraphInstantiateWithParams_ptsz() else { return MISSING_REAL };
    instantiated(unsafe { f(exec, graph, params) }, exec, graph)
}

pub unsafe fn exec_destroy(exec: CUgraphExec) -> CUresult {
    let Some(f) = real::cuGraphExecDestroy() else { return MISSING_REAL };
    let rc = unsafe { f(exec) };
    if rc == CUDA_SUCCESS && SEEN.load(Ordering::Acquire) {
        guarded((), || {
            if let Some(m) = EXECS.lock().as_mut() {
                m.remove(&(exec as u64));
            }
        });
    }
    rc
}

/// Devices one launch can reserve on without allocating (more are never needed in practice;
/// a graph spanning more devices reserves on the first ones and settles all).
const LAUNCH_DEVICES: usize = 16;

enum Plan {
    Deny(CUresult, i32, u64, u64),
    /// Call the driver, then settle: the devices reserved on (with what each got), or every
    /// device when the executable graph is unknown.
    Go { reserved: [(u16, u64); LAUNCH_DEVICES], n: usize, all: bool },
}

fn plan(api: Hook, exec: CUgraphExec) -> Plan {
    let mut want = [(0u16, 0u64); LAUNCH_DEVICES];
    let mut n = 0;
    let known = EXECS.lock().as_ref().and_then(|m| m.get(&(exec as u64))).map(|need| {
        for &(d, b) in need.iter().take(LAUNCH_DEVICES) {
            want[n] = (d, b);
            n += 1;
        }
        need.len() > LAUNCH_DEVICES
    });
    if mode() == Mode::FailClosed {
        return match known {
            Some(_) => Plan::Deny(CUDA_ERROR_NOT_PERMITTED, -1, 0, 0),
            None => Plan::Go { reserved: want, n: 0, all: false },
        };
    }
    if let Err(e) = ensure_limits() {
        return Plan::Deny(e.code(), -1, 0, 0);
    }
    // An executable graph we did not see instantiated: nothing to reserve, the charge follows
    // the devices' reservations right after the launch.
    let Some(more) = known else {
        return Plan::Go { reserved: want, n: 0, all: true };
    };
    for i in 0..n {
        let (d, bytes) = want[i];
        if let Err(denied) = super::pressure::reserve(d as usize, bytes) {
            for &(u, b) in &want[..i] {
                ledger::unreserve(u as usize, b);
            }
            let scope = if denied.group { crate::group::name() } else { None };
            crate::denials::denied_in(crate::hooks::info(api).name, d as usize, bytes, &denied, scope);
            return Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, d as i32, bytes, ledger::used(d as usize));
        }
    }
    Plan::Go { reserved: want, n, all: more }
}

/// A launch or upload: reserve what the graph may allocate, call once, settle.
fn launched(api: Hook, exec: CUgraphExec, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() == Mode::PassThrough || !SEEN.load(Ordering::Acquire) {
        return call();
    }
    match guarded(Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0, 0), || plan(api, exec)) {
        Plan::Deny(rc, dev, size, used) => {
            emit(Op::Deny, api, dev, exec as u64, size, Timed::instant(rc), used);
            rc
        }
        Plan::Go { reserved, n, all } => {
            let t = timed(call);
            guarded((), || {
                let settled = |d: usize, bytes: u64| {
                    let delta = settle(d, bytes);
                    if delta > 0 {
                        emit(Op::Alloc, api, d as i32, exec as u64, delta as u64, t, ledger::used(d));
                    }
                };
                for &(d, bytes) in &reserved[..n] {
                    settled(d as usize, bytes);
                }
                if all {
                    devices(None).for_each(|d| settled(d, 0));
                }
                if t.rc != CUDA_SUCCESS {
                    emit(Op::Fail, api, -1, exec as u64, 0, t, 0);
                }
            });
            t.rc
        }
    }
}

pub unsafe fn launch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let Some(f) = real::cuGraphLaunch() else { return MISSING_REAL };
    launched(Hook::cuGraphLaunch, exec, || unsafe { f(exec, stream) })
}

pub unsafe fn launch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let Some(f) = real::cuGraphLaunch_ptsz() else { return MISSING_REAL };
    launched(Hook::cuGraphLaunch_ptsz, exec, || unsafe { f(exec, stream) })
}

pub unsafe fn upload(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let Some(f) = real::cuGraphUpload() else { return MISSING_REAL };
    launched(Hook::cuGraphUpload, exec, || unsafe { f(exec, stream) })
}

pub unsafe fn upload_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let Some(f) = real::cuGraphUpload_ptsz() else { return MISSING_REAL };
    launched(Hook::cuGraphUpload_ptsz, exec, || unsafe { f(exec, stream) })
}

pub unsafe fn mem_trim(dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDeviceGraphMemTrim() else { return MISSING_REAL };
    let rc = unsafe { f(dev) };
    if rc == CUDA_SUCCESS && dev >= 0 && mode() == Mode::Enforce && SEEN.load(Ordering::Acquire) {
        guarded((), || {
            let delta = settle(dev as usize, 0);
            if delta < 0 {
                let t = Timed::instant(rc);
                emit(Op::Free, Hook::cuDeviceGraphMemTrim, dev, 0, delta.unsigned_abs(), t, ledger::used(dev as usize));
            }
        });
    }
    rc
}
