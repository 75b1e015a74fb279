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
//!
//! The allocation nodes are every one reachable from the graph, however nested in moved child
//! graphs (`graph_nodes`). `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD` uploads at instantiation, which
//! backs the graph's memory there: that instantiation reserves like a launch. A graph
//! instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH` has what its previous
//! launch left allocated freed before a relaunch, and the relaunch reuses it: a relaunch reserves
//! that much less, but only while nothing can have taken or trimmed that memory since (no other
//! launch, upload, trim or destroy in between: `EPOCH`, advanced before each reaches the driver)
//! and until the driver has reused it (the relaunch claims the epoch across its driver call, and
//! every advance waits for the claim); otherwise it reserves in full, which may deny what would
//! fit but never grants what would not.
//!
//! A whole-graph update (`cuGraphExecUpdate`, `_v2`) keeps the topology but may change what the
//! allocation nodes ask for: the updated graph is read too, and a launch reserves the larger of
//! both (`updated`).

use super::charge::{Timed, emit, timed};
use super::graph_nodes::{Needs, Walk, walk};
use super::init::ensure_limits;
use super::{MISSING_REAL, Mode, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger::{self, MAX_DEVICES};
use crate::sync::Lock;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bytes of each device's graph memory in its charge.
static CHARGED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Whether any graph with memory nodes was instantiated (until then nothing here runs).
static SEEN: AtomicBool = AtomicBool::new(false);
/// What vramcap knows of one executable graph.
struct Exec {
    /// What one launch may allocate, per device.
    need: Needs,
    /// Settle every device after a launch (more devices than a launch reserves on, or a graph
    /// that could not be read whole).
    all: bool,
    auto_free: bool,
    /// What its last launch left allocated, and `EPOCH` right after that launch (0: none yet).
    held: Needs,
    epoch: u64,
}
/// Executable graph → what vramcap knows of it.
static EXECS: Lock<Option<HashMap<u64, Exec>>> = Lock::new(None);
/// Advanced by 2 before every launch, upload, trim and executable-graph destroy reaches the
/// driver: anything after which the memory a previous launch left allocated may no longer be
/// there for a relaunch to reuse. Bit 0 ([`CLAIMED`]): a relaunch that counts on that memory (its
/// credit, see `Known`) is in the driver, and every bump waits until it is back, so nothing can
/// take or trim the memory between the check of the credit and the driver's use of it.
static EPOCH: AtomicU64 = AtomicU64::new(2);
const CLAIMED: u64 = 1;
/// Held by the relaunch that set [`CLAIMED`], across its driver call; a bump that finds the bit
/// set sleeps on it (the bit is set and cleared only while it is held).
static CLAIM: Lock<()> = Lock::new(());

/// Advances `EPOCH` (waiting out a credited relaunch in flight); returns the new value.
fn bump() -> u64 {
    loop {
        let e = EPOCH.load(Ordering::Acquire);
        if e & CLAIMED != 0 {
            drop(CLAIM.lock());
            continue;
        }
        if EPOCH.compare_exchange(e, e + 2, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            return e + 2;
        }
    }
}

/// A relaunch's hold on the epoch its credit was computed at (see [`claim`]).
struct Claim {
    epoch: u64,
    _held: crate::sync::Guard<'static, ()>,
}

impl Drop for Claim {
    /// Once the driver call is back (or a panic unwinds past it), the epoch moves on — the launch
    /// changed what its graph holds — and the waiting bumps go ahead: the bit is cleared before
    /// the lock is released.
    fn drop(&mut self) {
        EPOCH.store(self.epoch + 2, Ordering::Release);
    }
}

/// Claims `epoch` for a relaunch whose credit was computed at it: fails if anything bumped since.
/// Nothing bumps until the claim is dropped.
fn claim(epoch: u64) -> Option<Claim> {
    let held = CLAIM.lock();
    EPOCH.compare_exchange(epoch, epoch | CLAIMED, Ordering::AcqRel, Ordering::Acquire).ok()?;
    Some(Claim { epoch, _held: held })
}

/// Serializes settles (see `pool_table::settle`: a stale read must never overwrite a later one).
static SETTLE: Lock<()> = Lock::new(());
static FORK_HANDLER: AtomicBool = AtomicBool::new(false);

extern "C" fn locks_in_child() {
    EXECS.reset_in_child();
    SETTLE.reset_in_child();
    // A relaunch in flight on another thread is not in the child.
    CLAIM.reset_in_child();
    EPOCH.fetch_and(!CLAIMED, Ordering::AcqRel);
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

/// What `dev`'s graph memory reserves by the driver's word, and its charge (see
/// `pool_table::reserved_vs_charged`: a trim in the driver, settled only after the call).
pub fn reserved_vs_charged(dev: usize) -> (u64, u64) {
    if !SEEN.load(Ordering::Acquire) {
        return (0, 0);
    }
    let (Some(f), Some(cell)) = (import::cuDeviceGetGraphMemAttribute(), CHARGED.get(dev)) else { return (0, 0) };
    let _g = SETTLE.lock();
    let charged = cell.load(Ordering::Acquire);
    let mut now: u64 = 0;
    let rc = unsafe { f(dev as CUdevice, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, (&mut now as *mut u64).cast::<c_void>()) };
    (if rc == CUDA_SUCCESS { now } else { charged }, charged)
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
    bump();
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

fn remember(exec: CUgraphExec, w: Walk, flags: u64) {
    seen();
    let all = w.need.len() > LAUNCH_DEVICES || !w.complete;
    let auto_free = flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH != 0;
    let e = Exec { need: w.need, all, auto_free, held: w.held, epoch: 0 };
    EXECS.lock().get_or_insert_with(HashMap::new).insert(exec as u64, e);
}

fn instantiated(rc: CUresult, exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> CUresult {
    // Also without enforcement: a process that must get no memory (fail-closed) is refused the
    // launches that would allocate.
    if rc == CUDA_SUCCESS && !exec.is_null() && mode() != Mode::PassThrough {
        guarded((), || {
            let w = walk(graph);
            if !w.need.is_empty() || !w.complete {
                remember(unsafe { *exec }, w, flags);
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
    instantiated(unsafe { f(exec, graph, err, log, size) }, exec, graph, 0)
}

pub unsafe fn instantiate_v2(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    err: *mut CUgraphNode,
    log: *mut c_char,
    size: usize,
) -> CUresult {
    let Some(f) = real::cuGraphInstantiate_v2() else { return MISSING_REAL };
    instantiated(unsafe { f(exec, graph, err, log, size) }, exec, graph, 0)
}

pub unsafe fn instantiate_with_flags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> CUresult {
    let Some(f) = real::cuGraphInstantiateWithFlags() else { return MISSING_REAL };
    instantiated(unsafe { f(exec, graph, flags) }, exec, graph, flags)
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS.flags`, its first member (an in-parameter, read before the call).
fn params_flags(params: *mut c_void) -> u64 {
    if params.is_null() { 0 } else { unsafe { *(params as *const u64) } }
}

/// `cuGraphInstantiateWithParams(_ptsz)`: with `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD` the graph is
/// uploaded once instantiated, backing its memory: that is reserved first, like a launch.
fn with_params(api: Hook, exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void, call: impl FnOnce() -> CUresult) -> CUresult {
    let flags = params_flags(params);
    if flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD == 0 || mode() == Mode::PassThrough || exec.is_null() {
        return instantiated(call(), exec, graph, flags);
    }
    let w = guarded(Walk::default(), || walk(graph));
    if w.need.is_empty() && w.complete {
        return call();
    }
    seen();
    let (want, n) = first_devices(&w.need);
    let all = w.need.len() > LAUNCH_DEVICES || !w.complete;
    let rc = go(api, 0, want, n, all, call);
    if rc == CUDA_SUCCESS {
        guarded((), || remember(unsafe { *exec }, w, flags));
    }
    rc
}

pub unsafe fn instantiate_with_params(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void) -> CUresult {
    let Some(f) = real::cuGraphInstantiateWithParams() else { return MISSING_REAL };
    with_params(Hook::cuGraphInstantiateWithParams, exec, graph, params, || unsafe { f(exec, graph, params) })
}

pub unsafe fn instantiate_with_params_ptsz(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void) -> CUresult {
    let Some(f) = real::cuGraphInstantiateWithParams_ptsz() else { return MISSING_REAL };
    with_params(Hook::cuGraphInstantiateWithParams_ptsz, exec, graph, params, || unsafe { f(exec, graph, params) })
}

pub unsafe fn exec_destroy(exec: CUgraphExec) -> CUresult {
    let Some(f) = real::cuGraphExecDestroy() else { return MISSING_REAL };
    let seen = SEEN.load(Ordering::Acquire);
    if seen {
        bump();
    }
    let rc = unsafe { f(exec) };
    if rc == CUDA_SUCCESS && seen {
        guarded((), || {
            if let Some(m) = EXECS.lock().as_mut() {
                m.remove(&(exec as u64));
            }
        });
    }
    rc
}

/// Per device, the larger (`max`) or smaller of what `a` and `b` say.
fn merge(a: &Needs, b: &Needs, max: bool) -> Needs {
    let mut out: Needs = Vec::new();
    for &(d, x) in a.iter().chain(b) {
        match out.iter_mut().find(|(e, _)| *e == d) {
            Some((_, y)) => *y = if max { (*y).max(x) } else { (*y).min(x) },
            None => out.push((d, x)),
        }
    }
    if !max {
        // A device only one side names has nothing on the other.
        out.retain(|&(d, _)| a.iter().any(|&(e, _)| e == d) && b.iter().any(|&(e, _)| e == d));
    }
    out
}

/// After a successful whole-graph update the executable graph's memory nodes take `graph`'s
/// parameters (the documentation fixes the topology and the node types, not an allocation node's
/// size or device). Which of the two the driver keeps for a node it cannot say, so a launch
/// reserves, per device, the larger of the old and the new need, and the relaunch credit counts
/// on the smaller of what either leaves allocated, from the next launch on: a charge that can
/// deny what would fit, never grant what would not. A graph vramcap cannot read whole has every
/// device settled after each launch.
fn updated(rc: CUresult, exec: CUgraphExec, graph: CUgraph) -> CUresult {
    if rc != CUDA_SUCCESS || exec.is_null() || mode() == Mode::PassThrough {
        return rc;
    }
    guarded((), || {
        let w = walk(graph);
        let mut execs = EXECS.lock();
        let m = execs.get_or_insert_with(HashMap::new);
        match m.get_mut(&(exec as u64)) {
            Some(e) => {
                e.need = merge(&e.need, &w.need, true);
                e.held = merge(&e.held, &w.held, false);
                e.all |= e.need.len() > LAUNCH_DEVICES || !w.complete;
                e.epoch = 0;
            }
            None if !w.need.is_empty() || !w.complete => {
                drop(execs);
                // Its flags were not remembered (it had no memory nodes): no credit.
                remember(exec, w, 0);
            }
            None => {}
        }
    });
    rc
}

pub unsafe fn exec_update_v1(exec: CUgraphExec, graph: CUgraph, err: *mut CUgraphNode, result: *mut c_int) -> CUresult {
    let Some(f) = real::cuGraphExecUpdate() else { return MISSING_REAL };
    updated(unsafe { f(exec, graph, err, result) }, exec, graph)
}

pub unsafe fn exec_update_v2(exec: CUgraphExec, graph: CUgraph, info: *mut c_void) -> CUresult {
    let Some(f) = real::cuGraphExecUpdate_v2() else { return MISSING_REAL };
    updated(unsafe { f(exec, graph, info) }, exec, graph)
}

/// Devices one launch can reserve on without allocating (more are never needed in practice;
/// a graph spanning more devices reserves on the first ones and settles all).
const LAUNCH_DEVICES: usize = 16;

type Want = [(u16, u64); LAUNCH_DEVICES];

fn first_devices(need: &Needs) -> (Want, usize) {
    let mut want = [(0u16, 0u64); LAUNCH_DEVICES];
    let mut n = 0;
    for &(d, b) in need.iter().take(LAUNCH_DEVICES) {
        want[n] = (d, b);
        n += 1;
    }
    (want, n)
}

enum Plan {
    Deny(CUresult, i32, u64, u64),
    /// Call the driver, then settle: the devices reserved on (with what each got), and whether
    /// every device is settled too; `claim`: a relaunch reserving less by its credit holds the
    /// epoch it was computed at across the driver call.
    Go { reserved: Want, n: usize, all: bool, claim: Option<Claim> },
}

/// What a launch of `exec` reserves: `None` for an executable graph we did not see instantiated.
struct Known {
    want: Want,
    n: usize,
    all: bool,
    /// An auto-free graph relaunched with nothing in between reuses what its last launch left:
    /// that much less is reserved (`credit`) while `EPOCH` stays at `epoch`.
    credit: Want,
    epoch: u64,
}

fn wanted(exec: CUgraphExec) -> Option<Known> {
    let execs = EXECS.lock();
    let e = execs.as_ref()?.get(&(exec as u64))?;
    let (want, n) = first_devices(&e.need);
    let mut credit = [(0u16, 0u64); LAUNCH_DEVICES];
    if e.auto_free && e.epoch != 0 && e.epoch == EPOCH.load(Ordering::Acquire) {
        for (c, &(d, b)) in credit.iter_mut().zip(&want[..n]) {
            let kept = e.held.iter().find(|(h, _)| *h == d).map_or(0, |&(_, k)| k);
            *c = (d, kept.min(b));
        }
    }
    Some(Known { want, n, all: e.all, credit, epoch: e.epoch })
}

/// Reserves `want` less `credit` on each device; on a denial, what it reserved is given back.
/// The denial: the device, the bytes asked, what the device has charged.
fn reserve_all(api: Hook, want: &Want, credit: &Want, n: usize, got: &mut Want) -> Result<(), (i32, u64, u64)> {
    for i in 0..n {
        let (d, full) = want[i];
        let bytes = full.saturating_sub(credit[i].1);
        got[i] = (d, 0);
        if bytes == 0 {
            continue;
        }
        if let Err(denied) = super::pressure::reserve(d as usize, bytes)
            && super::charge::refused(api, d as usize, bytes, &denied)
        {
            for &(u, b) in &got[..i] {
                ledger::unreserve(u as usize, b);
            }
            return Err((d as i32, bytes, ledger::used(d as usize)));
        }
        got[i] = (d, bytes);
    }
    Ok(())
}

fn plan(api: Hook, known: Option<Known>) -> Plan {
    if mode() == Mode::FailClosed {
        return match known {
            Some(_) => Plan::Deny(CUDA_ERROR_NOT_PERMITTED, -1, 0, 0),
            None => Plan::Go { reserved: [(0, 0); LAUNCH_DEVICES], n: 0, all: false, claim: None },
        };
    }
    if let Err(e) = ensure_limits() {
        return Plan::Deny(e.code(), -1, 0, 0);
    }
    // An executable graph we did not see instantiated: nothing to reserve, the charge follows
    // the devices' reservations right after the launch.
    let Some(k) = known else {
        return Plan::Go { reserved: [(0, 0); LAUNCH_DEVICES], n: 0, all: true, claim: None };
    };
    let mut got = [(0u16, 0u64); LAUNCH_DEVICES];
    if let Err((d, bytes, used)) = reserve_all(api, &k.want, &k.credit, k.n, &mut got) {
        return Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, d, bytes, used);
    }
    // The credit holds only if nothing took or trimmed the memory it counts on since it was
    // computed (relieving pressure for this very reservation may have) and nothing does until
    // the driver has reused it: the claim makes both one step. Without it, the launch reserves
    // in full.
    let mut claim = None;
    if k.credit[..k.n].iter().any(|&(_, c)| c > 0) {
        claim = self::claim(k.epoch);
        if claim.is_none() {
            for &(u, b) in &got[..k.n] {
                ledger::unreserve(u as usize, b);
            }
            if let Err((d, bytes, used)) = reserve_all(api, &k.want, &[(0, 0); LAUNCH_DEVICES], k.n, &mut got) {
                return Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, d, bytes, used);
            }
        }
    }
    Plan::Go { reserved: got, n: k.n, all: k.all, claim }
}

/// Reserve, call once, settle; `key`: the executable graph for the trace (0 at instantiation).
fn go(api: Hook, key: u64, want: Want, n: usize, all: bool, call: impl FnOnce() -> CUresult) -> CUresult {
    let k = Known { want, n, all, credit: [(0, 0); LAUNCH_DEVICES], epoch: 0 };
    run(api, key, guarded(Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0, 0), || plan(api, Some(k))), call).0
}

/// The driver's answer and the `EPOCH` its call set (0 when it was not called).
fn run(api: Hook, key: u64, plan: Plan, call: impl FnOnce() -> CUresult) -> (CUresult, u64) {
    match plan {
        Plan::Deny(rc, dev, size, used) => {
            emit(Op::Deny, api, dev, key, size, Timed::instant(rc), used);
            (rc, 0)
        }
        Plan::Go { reserved, n, all, claim } => {
            // Bumped before the call: a credited relaunch in flight is waited out, and one
            // planned from now on finds its credit gone.
            let (t, epoch) = match claim {
                Some(c) => {
                    let t = timed(call);
                    let epoch = c.epoch + 2;
                    drop(c);
                    (t, epoch)
                }
                None => {
                    let epoch = bump();
                    (timed(call), epoch)
                }
            };
            guarded((), || {
                let settled = |d: usize, bytes: u64| {
                    let delta = settle(d, bytes);
                    if delta > 0 {
                        emit(Op::Alloc, api, d as i32, key, delta as u64, t, ledger::used(d));
                    }
                };
                for &(d, bytes) in &reserved[..n] {
                    settled(d as usize, bytes);
                }
                if all {
                    devices(None).for_each(|d| settled(d, 0));
                }
                if t.rc != CUDA_SUCCESS {
                    emit(Op::Fail, api, -1, key, 0, t, 0);
                }
            });
            (t.rc, epoch)
        }
    }
}

/// A launch or upload: reserve what the graph may allocate, call once, settle.
fn launched(api: Hook, exec: CUgraphExec, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() == Mode::PassThrough || !SEEN.load(Ordering::Acquire) {
        return call();
    }
    let plan = guarded(Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0, 0), || plan(api, wanted(exec)));
    let launch = matches!(api, Hook::cuGraphLaunch | Hook::cuGraphLaunch_ptsz);
    let (rc, now) = run(api, exec as u64, plan, call);
    if rc == CUDA_SUCCESS && launch && now != 0 {
        // What this launch left allocated is reusable by the next one while nothing intervenes
        // (a later bump, by any thread, ends that).
        guarded((), || {
            if let Some(e) = EXECS.lock().as_mut().and_then(|m| m.get_mut(&(exec as u64))) {
                e.epoch = now;
            }
        });
    }
    rc
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
    bump();
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
