//! Stream-ordered allocation (`cuMemAllocAsync` and friends): a pool is charged what it really
//! reserves on its device (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), not what the application
//! currently holds. A pool that keeps freed memory (release threshold raised, as PyTorch's and
//! TensorFlow's async allocators do) stays charged; a trim, or a synchronize after which a pool
//! with a low threshold gave memory back, releases the charge. Reserved bytes are re-read before and
//! after every allocation, free and trim, after synchronizes, and whenever a report or a denial
//! depends on them.
//!
//! A request the pool can serve from memory it already holds is never denied; one that would grow
//! the pool reserves the growth (rounded to the 2 MiB allocation granularity) against the cap
//! before the driver is asked, and is denied with `CUDA_ERROR_OUT_OF_MEMORY` if that does not fit.
//! Known limit: a pool whose free memory is fragmented may grow although it reported enough free
//! bytes; the charge follows the real reserved bytes right after the call.

use super::charge::{Timed, emit, timed};
use super::init::ensure_limits;
use super::{MISSING_REAL, Mode, current_context, current_device, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger::{self, Charge, Kind};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

const MAX_POOLS: usize = 256;
const TOMBSTONE: u64 = u64::MAX;
/// Pools grow in multiples of the allocation granularity (2 MiB on every current GPU).
const GROWTH_UNIT: u64 = 2 << 20;

struct Pool {
    handle: AtomicU64,
    /// Device ordinal + 1 (0 while the registering thread has not stored it yet).
    dev: AtomicU32,
    /// Bytes of this pool currently in the device's charge.
    charged: AtomicU64,
}

static POOLS: [Pool; MAX_POOLS] =
    [const { Pool { handle: AtomicU64::new(0), dev: AtomicU32::new(0), charged: AtomicU64::new(0) } }; MAX_POOLS];
/// Slots ever used (scans stop here).
static USED_SLOTS: AtomicUsize = AtomicUsize::new(0);

fn slots() -> &'static [Pool] {
    &POOLS[..USED_SLOTS.load(Ordering::Acquire).min(MAX_POOLS)]
}

fn find(handle: u64) -> Option<&'static Pool> {
    slots().iter().find(|p| p.handle.load(Ordering::Acquire) == handle)
}

/// The slot of a pool, registering it on `dev` if we have not seen it.
fn register(handle: u64, dev: usize) -> Option<&'static Pool> {
    if handle == 0 {
        return None;
    }
    if let Some(p) = find(handle) {
        return Some(p);
    }
    for (i, p) in POOLS.iter().enumerate() {
        let cur = p.handle.load(Ordering::Acquire);
        if (cur == 0 || cur == TOMBSTONE) && p.handle.compare_exchange(cur, handle, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            p.charged.store(0, Ordering::Release);
            p.dev.store(dev as u32 + 1, Ordering::Release);
            USED_SLOTS.fetch_max(i + 1, Ordering::AcqRel);
            // A racing registration of the same handle may have claimed another slot first.
            return find(handle);
        }
    }
    None
}

fn attribute(handle: u64, attr: c_int) -> Option<u64> {
    let f = import::cuMemPoolGetAttribute()?;
    let mut v: u64 = 0;
    (unsafe { f(handle as CUmemoryPool, attr, (&mut v as *mut u64).cast::<c_void>()) } == CUDA_SUCCESS).then_some(v)
}

/// Re-reads what the pool reserves and moves the device's charge by the difference.
/// Lock-free: racing settles may leave a stale value behind, but the ledger always equals the sum
/// of what the slots say they charged, and the next settle corrects it.
fn settle(p: &Pool) -> i64 {
    let handle = p.handle.load(Ordering::Acquire);
    let dev = p.dev.load(Ordering::Acquire);
    if handle == 0 || handle == TOMBSTONE || dev == 0 {
        return 0;
    }
    let Some(now) = attribute(handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) else { return 0 };
    let dev = dev as usize - 1;
    let old = p.charged.swap(now, Ordering::AcqRel);
    if now > old {
        ledger::charge(dev, now - old);
    } else {
        ledger::release(dev, old - now);
    }
    now as i64 - old as i64
}

/// Settles every pool on `dev` (`None`: on every device). Returns whether any charge went down.
pub fn refresh(dev: Option<usize>) -> bool {
    let mut released = false;
    for p in slots() {
        let d = p.dev.load(Ordering::Acquire);
        if d != 0 && dev.is_none_or(|x| x + 1 == d as usize) {
            released |= settle(p) < 0;
        }
    }
    released
}

pub fn refresh_device(dev: usize) -> bool {
    refresh(Some(dev))
}

enum Plan {
    Deny(CUresult, i32, u64),
    Forward,
    /// Call the driver; `growth` bytes are reserved against the cap until the pool is settled.
    Go { pool: &'static Pool, dev: usize, growth: u64 },
}

fn plan(api: Hook, pool: Option<u64>, size: u64) -> Plan {
    if let Err(e) = ensure_limits() {
        return Plan::Deny(e.code(), -1, 0);
    }
    let Some(cur) = current_device() else { return Plan::Forward };
    let slot = match pool {
        Some(h) => register(h, cur),
        None => {
            let Some(f) = import::cuDeviceGetMemPool() else { return Plan::Forward };
            let mut h: CUmemoryPool = std::ptr::null_mut();
            if unsafe { f(&mut h, cur as CUdevice) } != CUDA_SUCCESS {
                return Plan::Forward;
            }
            register(h as u64, cur)
        }
    };
    // More than MAX_POOLS pools: count nothing rather than guess.
    let Some(slot) = slot else { return Plan::Forward };
    let dev = (slot.dev.load(Ordering::Acquire).max(1) - 1) as usize;
    settle(slot);
    let handle = slot.handle.load(Ordering::Acquire);
    let held = attribute(handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).unwrap_or(0);
    let used = attribute(handle, CU_MEMPOOL_ATTR_USED_MEM_CURRENT).unwrap_or(held);
    if size <= held.saturating_sub(used) {
        return Plan::Go { pool: slot, dev, growth: 0 };
    }
    let growth = size.div_ceil(GROWTH_UNIT).saturating_mul(GROWTH_UNIT);
    match ledger::reserve(dev, growth).or_else(|_| {
        refresh_device(dev);
        ledger::reserve(dev, growth)
    }) {
        Ok(()) => Plan::Go { pool: slot, dev, growth },
        Err(d) => {
            let scope = if d.group { crate::group::name() } else { None };
            crate::log::denied_in(crate::hooks::info(api).name, dev, size, d.used, d.limit, scope);
            // The event's `used` is this process's charge, even when the group's budget refused.
            Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, dev as i32, ledger::used(dev))
        }
    }
}

unsafe fn alloc(api: Hook, dptr: *mut CUdeviceptr, size: usize, pool: Option<u64>, call: impl FnOnce() -> CUresult) -> CUresult {
    match mode() {
        Mode::PassThrough => return call(),
        Mode::FailClosed => return CUDA_ERROR_NOT_PERMITTED,
        Mode::Enforce => {}
    }
    match guarded(Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0), || plan(api, pool, size as u64)) {
        Plan::Deny(rc, dev, used) => {
            emit(Op::Deny, api, dev, 0, size as u64, Timed::instant(rc), used);
            rc
        }
        Plan::Forward => call(),
        Plan::Go { pool, dev, growth } => {
            let t = timed(call);
    let rc = t.rc;
            guarded((), || {
                ledger::release(dev, growth);
                settle(pool);
                if rc == CUDA_SUCCESS {
                    let key = unsafe { *dptr };
                    let c = Charge { dev: dev as u16, size: size as u64, ctx: current_context() };
                    ledger::insert(Kind::AsyncPtr, key, c);
                    emit(Op::Alloc, api, dev as i32, key, size as u64, t, ledger::used(dev));
                } else {
                    emit(Op::Fail, api, dev as i32, 0, size as u64, t, ledger::used(dev));
                }
            });
            rc
        }
    }
}

/// The pool keeps the block reserved, so the charge normally stays; the free is charged to the
/// device the allocation came from, whatever the current context is ([`charge::free`]).
fn free(api: Hook, ptr: CUdeviceptr, call: impl FnOnce() -> CUresult) -> CUresult {
    super::charge::free(api, Kind::AsyncPtr, ptr, call)
}

pub unsafe fn alloc_async(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocAsync() else { return MISSING_REAL };
    unsafe { alloc(Hook::cuMemAllocAsync, dptr, size, None, || f(dptr, size, stream)) }
}

pub unsafe fn alloc_async_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocAsync_ptsz() else { return MISSING_REAL };
    unsafe { alloc(Hook::cuMemAllocAsync_ptsz, dptr, size, None, || f(dptr, size, stream)) }
}

pub unsafe fn alloc_from_pool(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocFromPoolAsync() else { return MISSING_REAL };
    let p = (!pool.is_null()).then_some(pool as u64);
    unsafe { alloc(Hook::cuMemAllocFromPoolAsync, dptr, size, p, || f(dptr, size, pool, stream)) }
}

pub unsafe fn alloc_from_pool_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemAllocFromPoolAsync_ptsz() else { return MISSING_REAL };
    let p = (!pool.is_null()).then_some(pool as u64);
    unsafe { alloc(Hook::cuMemAllocFromPoolAsync_ptsz, dptr, size, p, || f(dptr, size, pool, stream)) }
}

pub unsafe fn free_async(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemFreeAsync() else { return MISSING_REAL };
    free(Hook::cuMemFreeAsync, ptr, || unsafe { f(ptr, stream) })
}

pub unsafe fn free_async_ptsz(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemFreeAsync_ptsz() else { return MISSING_REAL };
    free(Hook::cuMemFreeAsync_ptsz, ptr, || unsafe { f(ptr, stream) })
}

/// Settles one pool after a call that may have changed what it reserves, registering it on the
/// current device if we have not seen it; a drop in its charge is a `free` event of `api`.
fn after(api: Hook, pool: u64) {
    if mode() != Mode::Enforce {
        return;
    }
    guarded((), || {
        let slot = find(pool).or_else(|| register(pool, current_device()?));
        if let Some(p) = slot {
            let delta = settle(p);
            if delta < 0 {
                let dev = p.dev.load(Ordering::Acquire).max(1) as usize - 1;
                emit(Op::Free, api, dev as i32, pool, (-delta) as u64, Timed::instant(CUDA_SUCCESS), ledger::used(dev));
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

pub unsafe fn default_pool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDeviceGetDefaultMemPool() else { return MISSING_REAL };
    let rc = unsafe { f(pool, dev) };
    if rc == CUDA_SUCCESS && !pool.is_null() && dev >= 0 && mode() == Mode::Enforce {
        guarded((), || {
            register(unsafe { *pool } as u64, dev as usize);
        });
    }
    rc
}

pub unsafe fn create(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult {
    let Some(f) = real::cuMemPoolCreate() else { return MISSING_REAL };
    let rc = unsafe { f(pool, props) };
    if rc == CUDA_SUCCESS && !pool.is_null() && !props.is_null() && mode() == Mode::Enforce {
        guarded((), || {
            let loc = unsafe { (*props).location };
            // Pools of host memory are not device memory: never registered, never charged.
            if loc.type_ == CU_MEM_LOCATION_TYPE_DEVICE && loc.id >= 0 {
                register(unsafe { *pool } as u64, loc.id as usize);
            }
        });
    }
    rc
}

pub unsafe fn destroy(pool: CUmemoryPool) -> CUresult {
    let Some(f) = real::cuMemPoolDestroy() else { return MISSING_REAL };
    let rc = unsafe { f(pool) };
    if rc == CUDA_SUCCESS && mode() == Mode::Enforce {
        guarded((), || {
            if let Some(p) = find(pool as u64) {
                let dev = p.dev.load(Ordering::Acquire).max(1) as usize - 1;
                let old = p.charged.swap(0, Ordering::AcqRel);
                ledger::release(dev, old);
                p.handle.store(TOMBSTONE, Ordering::Release);
                emit(Op::Free, Hook::cuMemPoolDestroy, dev as i32, pool as u64, old, Timed::instant(rc), ledger::used(dev));
            }
        });
    }
    rc
}

fn after_sync(rc: CUresult) -> CUresult {
    if rc == CUDA_SUCCESS && mode() == Mode::Enforce && USED_SLOTS.load(Ordering::Relaxed) > 0 {
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
