//! Stream-ordered allocation (`cuMemAllocAsync` and friends): a pool is charged what it really
//! reserves on its device (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, [`pool_table`]), not what the
//! application currently holds. A pool that keeps freed memory (release threshold raised, as
//! PyTorch's and TensorFlow's async allocators do) stays charged until it gives memory back.
//!
//! Every allocation reserves its size (rounded up to the 2 MiB granularity) against the cap
//! before the driver is asked, whether or not the pool looks like it could serve it from free
//! memory (a fragmented pool grows although its free bytes add up), and settles to the pool's
//! real growth right after, in one step. Concurrent allocations therefore can never together
//! pass the cap. Before a denial, the memory pressure the driver would feel on a full device is
//! applied ([`pressure`](super::pressure)): this process's pools and graph memory are trimmed and
//! re-read first.
//!
//! Which device: the explicit pool's, or the device of the stream (`cuStreamGetDevice`, else
//! `cuStreamGetCtx`; the legacy and per-thread default streams mean the current context), never
//! the caller's current context as such. A thread with no current context allocating on another
//! context's stream is charged like any other.
//!
//! [`pool_table`]: super::pool_table

use super::charge::{Timed, begun, emit, timed};
use super::init::ensure_limits;
use super::location::{self, Place};
use super::pool_table::{self as table, Pool};
use super::{MISSING_REAL, Mode, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger::{self, Charge, Kind};
use crate::sync::Lock;
use std::collections::HashSet;
use std::ffi::{c_int, c_void};

/// Pools grow in multiples of the allocation granularity (2 MiB on every current GPU).
const GROWTH_UNIT: u64 = 2 << 20;

/// Settles every pool on `dev` (`None`: on every device) and the graph memory there. Returns
/// whether any charge went down.
pub fn refresh(dev: Option<usize>) -> bool {
    let mut released = false;
    if table::any() {
        for (_, p) in table::slots() {
            if p.handle().is_some() && dev.is_none_or(|d| p.device() == Some(d)) {
                released |= table::settle(p, 0) < 0;
            }
        }
    }
    released | super::graph::refresh(dev)
}

pub fn refresh_device(dev: usize) -> bool {
    refresh(Some(dev))
}

/// The device a stream's work runs on. The default-stream handles (NULL, `CU_STREAM_LEGACY`,
/// `CU_STREAM_PER_THREAD`) mean the calling thread's current context.
fn stream_device(stream: CUstream) -> Result<usize, CUresult> {
    if (stream as usize) <= 2 {
        return super::current().map(|(d, _)| d).ok_or(CUDA_ERROR_INVALID_CONTEXT);
    }
    let mut dev: CUdevice = -1;
    if let Some(f) = import::cuStreamGetDevice() {
        let rc = unsafe { f(stream, &mut dev) };
        return if rc != CUDA_SUCCESS { Err(rc) } else { usize::try_from(dev).map_err(|_| CUDA_ERROR_INVALID_VALUE) };
    }
    // Drivers before 12.8: the stream's context, then that context's device.
    let get_ctx = import::cuStreamGetCtx().ok_or(MISSING_REAL)?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    let rc = unsafe { get_ctx(stream, &mut ctx) };
    if rc != CUDA_SUCCESS {
        return Err(rc);
    }
    let rc = if let Some(f) = import::cuCtxGetDevice_v2() {
        unsafe { f(&mut dev, ctx) }
    } else {
        let (Some(push), Some(get), Some(pop)) =
            (import::cuCtxPushCurrent_v2(), import::cuCtxGetDevice(), import::cuCtxPopCurrent_v2())
        else {
            return Err(MISSING_REAL);
        };
        let mut popped: CUcontext = std::ptr::null_mut();
        match unsafe { push(ctx) } {
            CUDA_SUCCESS => {
                let rc = unsafe { get(&mut dev) };
                unsafe { pop(&mut popped) };
                rc
            }
            rc => rc,
        }
    };
    if rc != CUDA_SUCCESS { Err(rc) } else { usize::try_from(dev).map_err(|_| CUDA_ERROR_INVALID_VALUE) }
}

/// A pool we never saw handed out (no wrapped call returned it): find whose default or current
/// pool it is. `None`: nothing we can count, so the caller denies.
fn adopt(handle: u64) -> Option<(usize, &'static Pool)> {
    let (get_default, get_current) = (real::cuDeviceGetDefaultMemPool(), real::cuDeviceGetMemPool());
    for d in 0..ledger::device_count().max(1) {
        for f in [get_default, get_current].into_iter().flatten() {
            let mut h: CUmemoryPool = std::ptr::null_mut();
            if unsafe { f(&mut h, d as CUdevice) } == CUDA_SUCCESS && h as u64 == handle {
                return table::register(handle, d);
            }
        }
    }
    None
}

/// Pools of memory that is not device memory (host locations): never charged, never denied.
static HOST_POOLS: Lock<Option<HashSet<u64>>> = Lock::new(None);

static HOST_POOLS_FORK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn host_pools_in_child() {
    HOST_POOLS.reset_in_child();
}

fn host_pool(handle: u64, add: Option<bool>) -> bool {
    if add == Some(true) && !HOST_POOLS_FORK.swap(true, std::sync::atomic::Ordering::AcqRel) {
        // A fork while another thread holds the lock must not leave the child's copy locked.
        unsafe { libc::pthread_atfork(None, None, Some(host_pools_in_child)) };
    }
    let mut g = HOST_POOLS.lock();
    match add {
        Some(true) => g.get_or_insert_with(HashSet::new).insert(handle),
        Some(false) => g.as_mut().is_some_and(|s| s.remove(&handle)),
        None => g.as_ref().is_some_and(|s| s.contains(&handle)),
    }
}

fn is_capturing(stream: CUstream) -> bool {
    let Some(f) = import::cuStreamIsCapturing() else { return false };
    let mut status: c_int = 0;
    unsafe { f(stream, &mut status) == CUDA_SUCCESS && status == CU_STREAM_CAPTURE_STATUS_ACTIVE }
}

enum Plan {
    Deny(CUresult, i32, u64),
    /// Not device memory now: captured into a graph (the graph's launch is charged) or a host
    /// pool's.
    Forward,
    /// Call the driver; `reserved` bytes are held against the cap until the pool is settled.
    Go { slot: usize, pool: &'static Pool, dev: usize, reserved: u64 },
}

fn plan(api: Hook, pool: Option<u64>, stream: CUstream, size: u64) -> Plan {
    if let Err(e) = ensure_limits() {
        return Plan::Deny(e.code(), -1, 0);
    }
    let found = match pool {
        Some(h) => match table::find(h) {
            Some(f) => Some(f),
            None if host_pool(h, None) => return Plan::Forward,
            None => adopt(h),
        },
        None => {
            let dev = match stream_device(stream) {
                Ok(d) => d,
                Err(rc) => return Plan::Deny(rc, -1, 0),
            };
            let Some(f) = real::cuDeviceGetMemPool() else { return Plan::Deny(MISSING_REAL, dev as i32, 0) };
            let mut h: CUmemoryPool = std::ptr::null_mut();
            match unsafe { f(&mut h, dev as CUdevice) } {
                CUDA_SUCCESS => table::register(h as u64, dev),
                rc => return Plan::Deny(rc, dev as i32, 0),
            }
        }
    };
    // A pool we cannot register (the table cannot grow) or place is never handed memory.
    let Some((slot, p)) = found else { return Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0) };
    let Some(dev) = p.device() else { return Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0) };
    let want = size.div_ceil(GROWTH_UNIT).saturating_mul(GROWTH_UNIT);
    if ledger::reserve(dev, want).is_ok() {
        return Plan::Go { slot, pool: p, dev, reserved: want };
    }
    // Only now (the rare path) ask whether this is a capture, which allocates nothing.
    if is_capturing(stream) {
        return Plan::Forward;
    }
    match super::pressure::reserve(dev, want) {
        Ok(()) => Plan::Go { slot, pool: p, dev, reserved: want },
        // Observe mode charges what the pool would grow by (`want`) and lets the call go.
        Err(d) if !super::charge::refused_sized(api, dev, size, want, &d) => Plan::Go { slot, pool: p, dev, reserved: want },
        Err(_) => Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, dev as i32, ledger::used(dev)),
    }
}

unsafe fn alloc(
    api: Hook,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<u64>,
    stream: CUstream,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    match mode() {
        Mode::PassThrough => return call(),
        Mode::FailClosed => return CUDA_ERROR_NOT_PERMITTED,
        Mode::Enforce => {}
    }
    match guarded(Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0), || plan(api, pool, stream, size as u64)) {
        Plan::Deny(rc, dev, used) => {
            emit(Op::Deny, api, dev, 0, size as u64, Timed::instant(rc), used);
            rc
        }
        Plan::Forward => call(),
        Plan::Go { slot, pool, dev, reserved } => {
            table::reserving(dev, reserved);
            let t = timed(call);
            guarded((), || {
                table::settle(pool, reserved);
                if t.rc == CUDA_SUCCESS {
                    let key = unsafe { *dptr };
                    table::allocated_one(pool);
                    let c = Charge { dev: dev as u16, size: size as u64, ctx: table::tag(slot, pool) };
                    // An entry already under this key: that allocation was freed where we did
                    // not see it (the driver reused the address).
                    if let Some(stale) = ledger::insert(Kind::AsyncPtr, key, c)
                        && let Some(p) = table::by_tag(stale.ctx)
                    {
                        table::freed_one(p);
                    }
                    emit(Op::Alloc, api, dev as i32, key, size as u64, t, ledger::used(dev));
                } else {
                    emit(Op::Fail, api, dev as i32, 0, size as u64, t, ledger::used(dev));
                }
            });
            t.rc
        }
    }
}

/// The pool normally keeps the block reserved, so its charge stays; the free belongs to the
/// pool the allocation came from, whatever the current context is. The last free of a destroyed
/// pool's allocations releases that pool's whole charge.
fn free(api: Hook, ptr: CUdeviceptr, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() == Mode::PassThrough {
        return call();
    }
    let taken = guarded(None, || ledger::take(Kind::AsyncPtr, ptr));
    // A destroyed pool's last allocation: the driver gives the pool's memory back in this call,
    // its charge goes after (`moves`). Any free of an orphan's is marked (one load for the rest).
    let orphan = |c: &Charge| table::by_tag(c.ctx).is_some_and(table::is_orphan);
    let _moving = taken.filter(orphan).map(|c| super::moves::Moving::on(Some(c.dev as usize), 0));
    // Stamped when the call began, as `charge::free` does: once the driver has the free, another
    // thread can be handed the same address, and its allocation must not come out earlier.
    let t = begun(timed(call));
    guarded((), || match taken {
        Some(c) if t.rc == CUDA_SUCCESS => {
            if let Some(p) = table::by_tag(c.ctx)
                && table::freed_one(p) == 0
            {
                table::settle(p, 0);
            }
            emit(Op::Free, api, c.dev as i32, ptr, c.size, t, ledger::used(c.dev as usize));
        }
        Some(c) => {
            ledger::insert(Kind::AsyncPtr, ptr, c);
            emit(Op::Fail, api, c.dev as i32, ptr, 0, t, ledger::used(c.dev as usize));
        }
        None if t.rc != CUDA_SUCCESS => emit(Op::Fail, api, -1, ptr, 0, t, 0),
        None => {}
    });
    t.rc
}

pub unsafe fn alloc_async(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocAsync() else { return MISSING_REAL };
    unsafe { alloc(Hook::cuMemAllocAsync, dptr, size, None, stream, || f(dptr, size, stream)) }
}

/// The stream a `_ptsz` variant means by `stream`, for the questions vramcap asks about it with
/// the plain entry points (`cuStreamIsCapturing`, `cuStreamGetDevice`): its default stream (NULL)
/// is the calling thread's per-thread default stream, which can be capturing, not the legacy one.
/// The driver itself is always handed the caller's value.
fn per_thread(stream: CUstream) -> CUstream {
    if stream.is_null() { CU_STREAM_PER_THREAD } else { stream }
}

pub unsafe fn alloc_async_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocAsync_ptsz() else { return MISSING_REAL };
    unsafe { alloc(Hook::cuMemAllocAsync_ptsz, dptr, size, None, per_thread(stream), || f(dptr, size, stream)) }
}

pub unsafe fn alloc_from_pool(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocFromPoolAsync() else { return MISSING_REAL };
    if pool.is_null() {
        return unsafe { f(dptr, size, pool, stream) }; // the driver's own error
    }
    unsafe { alloc(Hook::cuMemAllocFromPoolAsync, dptr, size, Some(pool as u64), stream, || f(dptr, size, pool, stream)) }
}

pub unsafe fn alloc_from_pool_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocFromPoolAsync_ptsz() else { return MISSING_REAL };
    if pool.is_null() {
        return unsafe { f(dptr, size, pool, stream) };
    }
    let hook = Hook::cuMemAllocFromPoolAsync_ptsz;
    unsafe { alloc(hook, dptr, size, Some(pool as u64), per_thread(stream), || f(dptr, size, pool, stream)) }
}

pub unsafe fn free_async(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemFreeAsync() else { return MISSING_REAL };
    free(Hook::cuMemFreeAsync, ptr, || unsafe { f(ptr, stream) })
}

pub unsafe fn free_async_ptsz(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemFreeAsync_ptsz() else { return MISSING_REAL };
    free(Hook::cuMemFreeAsync_ptsz, ptr, || unsafe { f(ptr, stream) })
}

/// Settles one pool after a call that may have changed what it reserves; a drop in its charge
/// is a `free` event of `api`.
fn after(api: Hook, pool: u64) {
    if mode() != Mode::Enforce {
        return;
    }
    guarded((), || {
        if let Some((_, p)) = table::find(pool) {
            let delta = table::settle(p, 0);
            if delta < 0
                && let Some(dev) = p.device()
            {
                emit(Op::Free, api, dev as i32, pool, delta.unsigned_abs(), Timed::instant(CUDA_SUCCESS), ledger::used(dev));
            }
        }
    });
}

pub unsafe fn trim_to(pool: CUmemoryPool, keep: usize) -> CUresult {
    let Some(f) = real::cuMemPoolTrimTo() else { return MISSING_REAL };
    let rc = unsafe { f(pool, keep) };
    if rc == CUDA_SUCCESS {
        after(Hook::cuMemPoolTrimTo, pool as u64);
    }
    rc
}

pub unsafe fn set_attribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) -> CUresult {
    let Some(f) = real::cuMemPoolSetAttribute() else { return MISSING_REAL };
    let rc = unsafe { f(pool, attr, value) };
    if rc == CUDA_SUCCESS && attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD {
        after(Hook::cuMemPoolSetAttribute, pool as u64);
    }
    rc
}

/// A pool handed to the application: registered on the device it belongs to, or remembered as a
/// pool of host memory. A pool of unknown place is neither: what is asked of it is refused
/// ([`plan`] cannot place it).
fn handed_out(rc: CUresult, pool: *mut CUmemoryPool, place: Place) {
    if rc == CUDA_SUCCESS && !pool.is_null() && mode() == Mode::Enforce {
        guarded((), || {
            let h = unsafe { *pool } as u64;
            match place {
                Place::Device(d) => {
                    table::register(h, d);
                }
                Place::Host => {
                    host_pool(h, Some(true));
                }
                Place::Unknown => {}
            }
        });
    }
}

fn device_place(dev: CUdevice) -> Place {
    if dev >= 0 { Place::Device(dev as usize) } else { Place::Unknown }
}

pub unsafe fn default_pool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDeviceGetDefaultMemPool() else { return MISSING_REAL };
    let rc = unsafe { f(pool, dev) };
    handed_out(rc, pool, device_place(dev));
    rc
}

pub unsafe fn current_pool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDeviceGetMemPool() else { return MISSING_REAL };
    let rc = unsafe { f(pool, dev) };
    handed_out(rc, pool, device_place(dev));
    rc
}

/// Where a pool's memory is charged, from its allocation type and location. Pinned pools live at
/// their location. Managed pools (CUDA 13) are device memory wherever they prefer to live: their
/// pages migrate to the device that uses them, and a preferred location (the host, or none at all,
/// `CU_MEM_LOCATION_TYPE_NONE`) is only a hint. Like `cuMemAllocManaged`, one is charged to the
/// device it names, or else to the device of the calling thread's context (unknown without one,
/// so nothing is handed out of it: vramcap cannot say which device's cap it would count against).
fn pool_place(alloc_type: c_int, loc: *const CUmemLocation) -> Place {
    if loc.is_null() {
        return Place::Unknown;
    }
    let l = unsafe { *loc };
    match (alloc_type, location::place(l)) {
        (CU_MEM_ALLOCATION_TYPE_MANAGED, Place::Device(d)) => Place::Device(d),
        (CU_MEM_ALLOCATION_TYPE_MANAGED, _) if l.type_ == CU_MEM_LOCATION_TYPE_NONE || location::place(l) == Place::Host => {
            super::current_device().map_or(Place::Unknown, Place::Device)
        }
        (CU_MEM_ALLOCATION_TYPE_MANAGED, _) => Place::Unknown,
        (_, p) => p,
    }
}

/// CUDA 13: `cuMemGetDefaultMemPool(pool, location, type)`.
pub unsafe fn location_default_pool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: c_int) -> CUresult {
    let Some(f) = real::cuMemGetDefaultMemPool() else { return MISSING_REAL };
    let rc = unsafe { f(pool, loc, kind) };
    handed_out(rc, pool, guarded(Place::Unknown, || pool_place(kind, loc)));
    rc
}

/// CUDA 13: `cuMemGetMemPool(pool, location, type)`.
pub unsafe fn location_current_pool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: c_int) -> CUresult {
    let Some(f) = real::cuMemGetMemPool() else { return MISSING_REAL };
    let rc = unsafe { f(pool, loc, kind) };
    handed_out(rc, pool, guarded(Place::Unknown, || pool_place(kind, loc)));
    rc
}

pub unsafe fn create(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult {
    let Some(f) = real::cuMemPoolCreate() else { return MISSING_REAL };
    // A NULL props is the driver's to refuse.
    if props.is_null() || mode() != Mode::Enforce {
        return unsafe { f(pool, props) };
    }
    let (kind, loc) = unsafe { ((*props).alloc_type, (*props).location) };
    let place = guarded(Place::Unknown, || pool_place(kind, &loc));
    // A location that names no memory vramcap can place is refused before the driver is asked
    // (a managed pool without a preferred device, made with no current context, goes through:
    // it is only refused memory).
    let unplaced = location::place(loc) == Place::Unknown && !(kind == CU_MEM_ALLOCATION_TYPE_MANAGED && loc.type_ == CU_MEM_LOCATION_TYPE_NONE);
    if unplaced {
        return location::refuse(Hook::cuMemPoolCreate, loc);
    }
    let rc = unsafe { f(pool, props) };
    // Pools of host memory are not device memory: never charged.
    handed_out(rc, pool, place);
    rc
}

/// The driver returns at once, but a pool with live allocations keeps its memory until they are
/// freed: its charge stays until then ([`table::destroyed`]).
pub unsafe fn destroy(pool: CUmemoryPool) -> CUresult {
    let Some(f) = real::cuMemPoolDestroy() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(pool) };
    }
    // Last look while the handle is valid: what it reserves, and whether anything from it is
    // still allocated that we did not see (then the charge can never be released safely).
    let before = guarded(None, || {
        let (_, p) = table::find(pool as u64)?;
        table::settle(p, 0);
        let mut used: u64 = 0;
        let f = import::cuMemPoolGetAttribute()?;
        let rc = unsafe { f(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, (&mut used as *mut u64).cast()) };
        Some((p, (rc == CUDA_SUCCESS).then_some(used)))
    });
    // A pool with nothing live gives its memory back in the call, its charge goes after (`moves`).
    let _moving = before.as_ref().and_then(|(p, _)| p.device()).map(|d| super::moves::Moving::on(Some(d), 0));
    let rc = unsafe { f(pool) };
    if rc == CUDA_SUCCESS {
        guarded((), || {
            host_pool(pool as u64, Some(false));
        });
    }
    if rc == CUDA_SUCCESS
        && let Some((p, driver_used)) = before
    {
        guarded((), || {
            match driver_used {
                // allocations we never saw: keep the charge for good
                Some(u) if u > 0 && table::live(p) == 0 => table::allocated_one(p),
                // The driver holds nothing allocated from it, so the destroy gives its memory back:
                // what we counted as live was never the pool's (an allocation captured into a
                // graph, never launched, allocates nothing) or was freed where we did not see.
                Some(0) => table::none_live(p),
                _ => {}
            }
            let released = table::destroyed(p);
            if released > 0
                && let Some(dev) = p.device()
            {
                let t = Timed::instant(rc);
                emit(Op::Free, Hook::cuMemPoolDestroy, dev as i32, pool as u64, released, t, ledger::used(dev));
            }
        });
    }
    rc
}

fn after_sync(rc: CUresult) -> CUresult {
    if rc == CUDA_SUCCESS && mode() == Mode::Enforce {
        guarded((), || {
            refresh(None);
        });
    }
    rc
}

pub unsafe fn stream_sync(stream: CUstream) -> CUresult {
    let Some(f) = real::cuStreamSynchronize() else { return MISSING_REAL };
    after_sync(unsafe { f(stream) })
}

pub unsafe fn stream_sync_ptsz(stream: CUstream) -> CUresult {
    let Some(f) = real::cuStreamSynchronize_ptsz() else { return MISSING_REAL };
    after_sync(unsafe { f(stream) })
}

pub unsafe fn ctx_sync() -> CUresult {
    let Some(f) = real::cuCtxSynchronize() else { return MISSING_REAL };
    after_sync(unsafe { f() })
}

/// CUDA 13's `cuCtxSynchronize_v2(ctx)`.
pub unsafe fn ctx_sync_v2(ctx: CUcontext) -> CUresult {
    let Some(f) = real::cuCtxSynchronize_v2() else { return MISSING_REAL };
    after_sync(unsafe { f(ctx) })
}
