//! Context lifetimes, as the driver documents them. Memory made by `cuMemAlloc*`,
//! `cuMemAllocPitch`, `cuMemAllocManaged` and arrays belongs to the context current when it was
//! made, and the driver frees it without a free call when that context ends:
//! - `cuCtxDestroy`, whatever the context's use count;
//! - `cuCtxDetach` dropping the use count to zero (`cuCtxCreate*` starts it at one, each
//!   `cuCtxAttach` adds one): PyCUDA ends its contexts this way;
//! - the last `cuDevicePrimaryCtxRelease`: the driver resets the primary context. The driver's own
//!   count decides, read back with `cuDevicePrimaryCtxGetState` after each release, so a reference
//!   taken where we could not see it (or before us) is never miscounted;
//! - `cuDevicePrimaryCtxReset` (which keeps the retain count).
//!
//! A green context's `CUcontext` stands for the primary context: the primary context's end takes
//! what was allocated in the device's green contexts too (`super::green`).
//!
//! Every charge records its context, and all of that context's charges of those kinds go once the
//! driver has ended it. `cuMemCreate` handles and stream-ordered (pool) memory are *not* freed with
//! a context (documented for `cuCtxDestroy`): they belong to the device and keep their charges.
//!
//! These calls are rare; each holds one lock across its driver call and bookkeeping, so that "the
//! driver ended the context" and "its charges go" happen with no retain or allocation of another
//! thread in between (an allocation needs a retained context first).

use super::charge::{Timed, emit};
use super::overhead;
use super::{MISSING_REAL, Mode, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger::{self, Kind};
use crate::sync::{Guard, Lock};
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

/// Use counts of the contexts made by `cuCtxCreate*` (absent: a context we did not see made).
static USES: Lock<Option<HashMap<u64, u32>>> = Lock::new(None);

/// The primary context of each device, as last returned by `cuDevicePrimaryCtxRetain`.
static PRIMARY: [AtomicU64; ledger::MAX_DEVICES] = [const { AtomicU64::new(0) }; ledger::MAX_DEVICES];

/// What a context takes with it: the kinds of memory the driver frees at its end.
const CONTEXT_OWNED: [Kind; 3] = [Kind::DevicePtr, Kind::Array, Kind::Managed];

/// Taken around every context lifetime call (green contexts' too, `super::green`) and every call
/// that measures overhead.
pub(super) fn serial() -> Guard<'static, Option<HashMap<u64, u32>>> {
    install_fork_handlers();
    USES.lock()
}

/// After the driver ended these contexts (0s are skipped): their charges go.
pub(super) fn release_contexts(api: Hook, ctxs: &[u64]) {
    if ctxs.iter().all(|&c| c == 0) {
        return;
    }
    // Under the managed table's lock: no prefetch has shares of these contexts out meanwhile.
    let drained = super::managed::locked(|t| {
        let d = ledger::drain(&CONTEXT_OWNED, |c| c.ctx != 0 && ctxs.contains(&c.ctx));
        super::managed::contexts_ended(t, ctxs);
        d
    });
    for (_, key, c) in drained {
        ledger::release(c.dev as usize, c.size);
        emit(Op::Free, api, c.dev as i32, key, c.size, Timed::instant(CUDA_SUCCESS), ledger::used(c.dev as usize));
    }
}

/// After the driver ended these contexts.
pub(super) fn ended(api: Hook, ctxs: &[u64]) {
    // The address may come back as another device's context.
    super::contexts_changed();
    release_contexts(api, ctxs);
    overhead_ended(api, ctxs);
}

/// The contexts' overhead (issue 24) goes with them: a primary context's end takes its green
/// contexts' handles too, which hold none of their own.
fn overhead_ended(api: Hook, ctxs: &[u64]) {
    for &c in ctxs {
        overhead::context_ended(api, c);
    }
}

/// Moves the context-owned charges of `from` to `to` (a green context destroyed while the primary
/// context it shares memory with lives on: its memory is the primary context's, and goes at its end).
pub(super) fn rekey(from: u64, to: u64) {
    if from == 0 || to == 0 {
        return;
    }
    // Under the managed table's lock: a prefetch in flight could otherwise put a share back under
    // `from` after this pass (a handle the driver may give out again).
    super::managed::locked(|t| {
        for (kind, key, c) in ledger::drain(&CONTEXT_OWNED, |c| c.ctx == from) {
            ledger::insert(kind, key, ledger::Charge { ctx: to, ..c });
        }
        super::managed::rekey(t, from, to);
    });
}

/// Charges of a context that the coming driver call will end, taken out before the call: the
/// driver frees their memory during the call and another thread may be handed it at once, so it
/// must stop counting as held first (as `charge::free` does). Their charge stays until
/// [`ending_done`].
fn ending(ctxs: &[u64]) -> Vec<(Kind, u64, ledger::Charge)> {
    if ctxs.iter().all(|&c| c == 0) {
        return Vec::new();
    }
    let taken = super::managed::locked(|_| ledger::drain(&CONTEXT_OWNED, |c| c.ctx != 0 && ctxs.contains(&c.ctx)));
    for (_, _, c) in &taken {
        ledger::uncommit(c.dev as usize, c.size);
    }
    taken
}

/// After the call [`ending`] prepared: ended (`ok`), the charges go; otherwise they are put back.
/// `ends`: the context itself ended (not a primary reset), and its overhead goes with it.
fn ending_done(api: Hook, ctxs: &[u64], taken: Vec<(Kind, u64, ledger::Charge)>, ok: bool, ends: bool) {
    if ok {
        super::contexts_changed();
        for (_, key, c) in taken {
            ledger::unreserve(c.dev as usize, c.size);
            emit(Op::Free, api, c.dev as i32, key, c.size, Timed::instant(CUDA_SUCCESS), ledger::used(c.dev as usize));
        }
        // Anything charged to the context while the call was in flight went with it too.
        release_contexts(api, ctxs);
        if ends {
            overhead_ended(api, ctxs);
        }
    } else {
        for (kind, key, c) in taken {
            ledger::commit(c.dev as usize, c.size);
            ledger::insert(kind, key, c);
        }
    }
}

unsafe fn destroy(api: Hook, f: unsafe extern "C" fn(CUcontext) -> CUresult, ctx: CUcontext) -> CUresult {
    if mode() != Mode::Enforce {
        return unsafe { f(ctx) };
    }
    let mut uses = serial();
    let taken = guarded(Vec::new(), || ending(&[ctx as u64]));
    let rc = unsafe { f(ctx) };
    guarded((), || {
        if rc == CUDA_SUCCESS {
            uses.get_or_insert_with(HashMap::new).remove(&(ctx as u64));
        }
        ending_done(api, &[ctx as u64], taken, rc == CUDA_SUCCESS, true);
    });
    rc
}

pub unsafe fn destroy_v2(ctx: CUcontext) -> CUresult {
    let Some(f) = real::cuCtxDestroy_v2() else { return MISSING_REAL };
    unsafe { destroy(Hook::cuCtxDestroy_v2, f, ctx) }
}

pub unsafe fn destroy_v1(ctx: CUcontext) -> CUresult {
    let Some(f) = real::cuCtxDestroy() else { return MISSING_REAL };
    unsafe { destroy(Hook::cuCtxDestroy, f, ctx) }
}

/// A new context on `dev`, use count one. `call` makes it and says where it landed. What the
/// context itself takes is measured around the call and charged (`overhead`); one that does not
/// fit is destroyed again and refused.
fn create(api: Hook, dev: CUdevice, pctx: *mut CUcontext, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() != Mode::Enforce {
        return call();
    }
    let mut uses = serial();
    let Some(made) = begin_context(api, dev) else { return CUDA_ERROR_OUT_OF_MEMORY };
    let rc = call();
    if rc == CUDA_SUCCESS {
        let ctx = unsafe { *pctx };
        if !finish_context(api, made, ctx as u64, rc) {
            // Our own undo, not the application's destroy: the real driver's, directly.
            if let Some(destroy) = real::cuCtxDestroy_v2() {
                unsafe { destroy(ctx) };
            }
            super::contexts_changed();
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        // An entry left under this address was a context that ended unseen: this one starts anew.
        guarded((), || {
            uses.get_or_insert_with(HashMap::new).insert(ctx as u64, 1);
        });
    } else {
        finish_context(api, made, 0, rc);
    }
    rc
}

/// Before a call that creates a context on `dev`: the books read and the size of the last
/// context reserved; `None`: that reservation does not fit (refused, the driver is not called).
fn begin_context(api: Hook, dev: CUdevice) -> Option<Option<(overhead::Probe, u64)>> {
    let Ok(d) = usize::try_from(dev) else { return Some(None) };
    if d >= ledger::MAX_DEVICES || super::init::ensure_limits().is_err() {
        return Some(None);
    }
    // The size to reserve first (it may wait for another member's first context), then the books,
    // then the reservation: a reading must count neither that context nor our own reservation.
    let est = guarded(0, || overhead::context_estimate(d));
    let probe = guarded_probe(d);
    match guarded(Err(CUDA_ERROR_OUT_OF_MEMORY), || overhead::reserve_context(api, d, est)) {
        Ok(reserved) => match probe {
            Some(p) => Some(Some((p, reserved))),
            None => {
                ledger::unreserve(d, reserved);
                overhead::context_settled(d);
                Some(None)
            }
        },
        Err(_) => {
            overhead::context_settled(d);
            None
        }
    }
}

/// The books read before a call (`None` if the reading panicked: nothing is measured then).
fn guarded_probe(d: usize) -> Option<overhead::Probe> {
    guarded(None, || Some(overhead::probe(d)))
}

/// After the call [`begin_context`] prepared: charges what the new context `ctx` measured
/// (`rc` success) or gives the reservation back. `false`: the context does not fit.
fn finish_context(api: Hook, made: Option<(overhead::Probe, u64)>, ctx: u64, rc: CUresult) -> bool {
    let Some((probe, reserved)) = made else { return true };
    let d = probe.dev;
    let fits = finish_measured(api, &probe, reserved, ctx, rc);
    // After the size was noted (or the context not made): a member waiting for it goes on.
    overhead::context_settled(d);
    fits
}

fn finish_measured(api: Hook, probe: &overhead::Probe, reserved: u64, ctx: u64, rc: CUresult) -> bool {
    let d = probe.dev;
    if rc != CUDA_SUCCESS {
        ledger::unreserve(d, reserved);
        return true;
    }
    guarded(true, || {
        let (bytes, exact) = match overhead::measured_spanning(probe, reserved) {
            // A prefetch completed while the context was made moved the books by an amount the
            // measurement cannot tell from the context's own: the size last measured
            // (reserved) when there is one, else the larger bound.
            Some(m) if m.unsure > 0 && reserved > 0 => (reserved, false),
            Some(m) => ((m.bytes + m.unsure as i128).clamp(0, u64::MAX as i128) as u64, m.exact),
            None => {
                unmeasured(d);
                (reserved, false)
            }
        };
        let fits = overhead::charge_as(api, ctx, d, bytes, reserved, true, exact).is_ok();
        if fits && super::libraries::copies_for_a_new_context() > 0 {
            // Made with a copy of every loaded library (eager loading), and so with its heap.
            overhead::note_heap(ctx);
        }
        fits
    })
}

/// Said once per process: a context whose size the driver's books cannot tell is charged what
/// the last one measured (nothing for the first).
fn unmeasured(dev: usize) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        crate::log::write_line(&format!(
            "vramcap: device {dev}: cannot read the driver's books (no NVML entry for this process, no context to compare): context memory is charged as last measured"
        ));
    });
}

pub unsafe fn create_v1(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuCtxCreate() else { return MISSING_REAL };
    create(Hook::cuCtxCreate, dev, pctx, || unsafe { f(pctx, flags, dev) })
}

pub unsafe fn create_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuCtxCreate_v2() else { return MISSING_REAL };
    create(Hook::cuCtxCreate_v2, dev, pctx, || unsafe { f(pctx, flags, dev) })
}

pub unsafe fn create_v3(pctx: *mut CUcontext, params: *mut c_void, n: c_int, flags: c_uint, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuCtxCreate_v3() else { return MISSING_REAL };
    create(Hook::cuCtxCreate_v3, dev, pctx, || unsafe { f(pctx, params, n, flags, dev) })
}

pub unsafe fn create_v4(pctx: *mut CUcontext, params: *mut c_void, flags: c_uint, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuCtxCreate_v4() else { return MISSING_REAL };
    create(Hook::cuCtxCreate_v4, dev, pctx, || unsafe { f(pctx, params, flags, dev) })
}

/// `cuCtxAttach`: the current context's use count, plus one.
pub unsafe fn attach(pctx: *mut CUcontext, flags: c_uint) -> CUresult {
    let Some(f) = real::cuCtxAttach() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(pctx, flags) };
    }
    let mut uses = serial();
    let rc = unsafe { f(pctx, flags) };
    if rc == CUDA_SUCCESS {
        guarded((), || {
            if let Some(n) = uses.get_or_insert_with(HashMap::new).get_mut(&(unsafe { *pctx } as u64)) {
                *n += 1;
            }
        });
    }
    rc
}

/// `cuCtxDetach`: minus one; at zero the driver destroys the context as `cuCtxDestroy` would. A
/// context whose count we do not know (not made through a wrapper we saw) keeps its charges:
/// we cannot tell whether it ended, and guessing "yes" could hand out memory that still exists.
pub unsafe fn detach(ctx: CUcontext) -> CUresult {
    let Some(f) = real::cuCtxDetach() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(ctx) };
    }
    let mut uses = serial();
    let key = ctx as u64;
    // The last use we know of: the call ends the context.
    let last = guarded(false, || uses.as_ref().and_then(|m| m.get(&key)) == Some(&1));
    let taken = if last { guarded(Vec::new(), || ending(&[key])) } else { Vec::new() };
    let rc = unsafe { f(ctx) };
    guarded((), || {
        let mut gone = false;
        if rc == CUDA_SUCCESS {
            let map = uses.get_or_insert_with(HashMap::new);
            if let Some(n) = map.get_mut(&key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(&key);
                    gone = true;
                }
            }
        }
        if last || gone {
            ending_done(Hook::cuCtxDetach, &[key], taken, gone, true);
        }
    });
    rc
}

/// The primary context of `dev` if it is active (learning its handle must not create it: an
/// inactive one holds no charges anyway). Retain + release leaves its reference count unchanged.
fn active_primary(dev: CUdevice) -> u64 {
    let (Some(state), Some(retain), Some(release)) =
        (import::cuDevicePrimaryCtxGetState(), import::cuDevicePrimaryCtxRetain(), import::cuDevicePrimaryCtxRelease_v2())
    else {
        return 0;
    };
    let (mut flags, mut active) = (0, 0);
    if unsafe { state(dev, &mut flags, &mut active) } != CUDA_SUCCESS || active == 0 {
        return 0;
    }
    let mut ctx: CUcontext = std::ptr::null_mut();
    if unsafe { retain(&mut ctx, dev) } != CUDA_SUCCESS {
        return 0;
    }
    unsafe { release(dev) };
    ctx as u64
}

/// The primary context of `dev`: the driver's answer while it is active (a reset may have given
/// it a new handle), else the one we last saw retained.
pub(super) fn primary_of(dev: CUdevice) -> u64 {
    match active_primary(dev) {
        0 => usize::try_from(dev).ok().and_then(|d| PRIMARY.get(d)).map_or(0, |p| p.load(Ordering::Acquire)),
        ctx => ctx,
    }
}

/// Whether the driver still holds `dev`'s primary context. Unknown counts as yes: keeping
/// charges of memory that is gone can only deny, dropping them could hand out memory that exists.
pub(super) fn primary_active(dev: CUdevice) -> bool {
    let Some(state) = import::cuDevicePrimaryCtxGetState() else { return true };
    let (mut flags, mut active) = (0, 0);
    let rc = unsafe { state(dev, &mut flags, &mut active) };
    rc != CUDA_SUCCESS || active != 0
}

pub unsafe fn primary_retain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDevicePrimaryCtxRetain() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(pctx, dev) };
    }
    let _serial = serial();
    // The first retain creates the context: what it takes is measured and charged.
    let made = if primary_active(dev) { Some(None) } else { begin_context(Hook::cuDevicePrimaryCtxRetain, dev) };
    let Some(made) = made else { return CUDA_ERROR_OUT_OF_MEMORY };
    let rc = unsafe { f(pctx, dev) };
    let ctx = if rc == CUDA_SUCCESS { (unsafe { *pctx }) as u64 } else { 0 };
    if !finish_context(Hook::cuDevicePrimaryCtxRetain, made, ctx, rc) {
        // Our own retain is undone with the driver's release, directly: the context ends again.
        if let Some(release) = real::cuDevicePrimaryCtxRelease_v2() {
            unsafe { release(dev) };
        }
        super::contexts_changed();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if rc == CUDA_SUCCESS
        && let Some(p) = usize::try_from(dev).ok().and_then(|d| PRIMARY.get(d))
    {
        p.store(ctx, Ordering::Release);
    }
    rc
}

unsafe fn primary_release(api: Hook, f: unsafe extern "C" fn(CUdevice) -> CUresult, dev: CUdevice) -> CUresult {
    if mode() != Mode::Enforce {
        return unsafe { f(dev) };
    }
    let serial = serial();
    let ctx = guarded(0, || primary_of(dev));
    let rc = unsafe { f(dev) };
    let reset = rc == CUDA_SUCCESS
        && guarded(false, || {
            let gone = !primary_active(dev);
            if gone {
                // What was allocated in the device's green contexts is the primary context's memory.
                ended(api, &super::green::with_primary(dev, ctx));
            }
            gone
        });
    drop(serial);
    if reset {
        device_reset();
    }
    rc
}

pub unsafe fn primary_release_v2(dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDevicePrimaryCtxRelease_v2() else { return MISSING_REAL };
    unsafe { primary_release(Hook::cuDevicePrimaryCtxRelease_v2, f, dev) }
}

pub unsafe fn primary_release_v1(dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDevicePrimaryCtxRelease() else { return MISSING_REAL };
    unsafe { primary_release(Hook::cuDevicePrimaryCtxRelease, f, dev) }
}

unsafe fn reset(api: Hook, f: unsafe extern "C" fn(CUdevice) -> CUresult, dev: CUdevice) -> CUresult {
    if mode() != Mode::Enforce {
        return unsafe { f(dev) };
    }
    let serial = serial();
    let ctxs = guarded(Vec::new(), || super::green::with_primary(dev, primary_of(dev)));
    let ctx = ctxs.first().copied().unwrap_or(0);
    // A reset gives back what modules and limits took (the context itself stays retained): the
    // books read before the context's allocations stop counting as held (`ending`), while the
    // counts are quiet; their frees are then in both the books and the counts.
    let probe = usize::try_from(dev).ok().filter(|&d| d < ledger::MAX_DEVICES).and_then(guarded_probe);
    let taken = guarded(Vec::new(), || ending(&ctxs));
    let rc = unsafe { f(dev) };
    guarded((), || {
        ending_done(api, &ctxs, taken, rc == CUDA_SUCCESS, false);
        if rc == CUDA_SUCCESS {
            // Modules, heap and FIFO went: the next load brings them again.
            ctxs.iter().for_each(|&c| overhead::heap_gone(c));
        }
        if rc == CUDA_SUCCESS
            && let Some(p) = &probe
        {
            let _ = overhead::settle(api, ctx, p);
        }
    });
    drop(serial);
    if rc == CUDA_SUCCESS {
        device_reset();
    }
    rc
}

/// A primary context reset "cleans up all resources associated with the current device": whatever
/// the driver did to the device's pools, re-read what they hold (outside our lock: pools have
/// their own bookkeeping).
pub(super) fn device_reset() {
    guarded((), || {
        super::pool::refresh(None);
    });
}

pub unsafe fn reset_v2(dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDevicePrimaryCtxReset_v2() else { return MISSING_REAL };
    unsafe { reset(Hook::cuDevicePrimaryCtxReset_v2, f, dev) }
}

pub unsafe fn reset_v1(dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDevicePrimaryCtxReset() else { return MISSING_REAL };
    unsafe { reset(Hook::cuDevicePrimaryCtxReset, f, dev) }
}

static FORK_HANDLERS: std::sync::Once = std::sync::Once::new();

/// A fork while another thread is inside one of these calls must not leave the child's lock held.
fn install_fork_handlers() {
    extern "C" fn prepare() {
        USES.acquire_for_fork();
    }
    extern "C" fn parent() {
        USES.release_after_fork();
    }
    extern "C" fn child() {
        USES.reset_in_child();
    }
    FORK_HANDLERS.call_once(|| unsafe {
        // This lock is taken before ledger locks (the drain), the VMM table's (never inside it)
        // and the managed-memory table's: register after them, so that prepare takes it first.
        ledger::install_fork_handlers();
        super::handles::install_fork_handlers();
        // The managed-memory table is taken inside this lock too (a context's end forgets its
        // allocations).
        super::managed::install_fork_handlers();
        libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
    });
}
