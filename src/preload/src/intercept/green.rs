//! Green contexts (CUDA 12.4), as the driver API documents them. A green context shares its
//! device's memory with the primary context: `cuGreenCtxCreate` retains the device's primary
//! context and `cuGreenCtxDestroy` releases it, and the `CUcontext` that `cuCtxFromGreenCtx`
//! gives for it is treated as the primary context. So memory allocated while that context is
//! current (charged, like any, to the current context's handle) is the primary context's memory:
//! the driver frees it when the primary context ends (its last release, which a green context's
//! destroy can be, or a reset), and so do its charges. A green context destroyed while the primary
//! context lives on hands its charges to the primary context's handle, since its own handle may be
//! given out again.
//!
//! A green context takes device memory of its own too (issue 24): measured around
//! `cuGreenCtxCreate` like a context (`overhead`), with the size the last green context on the
//! device measured reserved before (and the primary context's, when the create will make it),
//! charged to the green context's handle; one that does not fit is destroyed again and refused
//! with `CUDA_ERROR_OUT_OF_MEMORY`. `cuGreenCtxDestroy` gives back what the books say it gave
//! back; what stays (a primary context the create made) is the primary context's, or all of it
//! goes when the destroy ends the primary context.
//!
//! A green context or conversion we did not see leaves its charges keyed to a handle nothing ends:
//! they stay (a false denial at worst, never memory past the cap).

use super::{MISSING_REAL, Mode, context, guarded, mode, overhead};
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::ledger::{self, MAX_DEVICES};
use crate::sync::Lock;
use std::collections::HashMap;
use std::ffi::c_uint;
use std::sync::atomic::{AtomicU64, Ordering};

/// The size last measured for a green context of its own on each device (one whose create did
/// not also make the primary context): reserved before the next one is made.
static LAST_GREEN: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// Live green contexts: handle → (device, its `CUcontext`, 0 until converted). Taken only while
/// holding `context::serial()` (so fork handlers need not know it: no thread holds it at a fork).
static GREENS: Lock<Option<HashMap<u64, (CUdevice, u64)>>> = Lock::new(None);

/// The contexts whose context-owned memory is `dev`'s primary context's: the primary context
/// itself and the `CUcontext` of every live green context on `dev` (called under the serial lock).
pub(super) fn with_primary(dev: CUdevice, primary: u64) -> Vec<u64> {
    let mut out = vec![primary];
    if let Some(m) = GREENS.lock().as_ref() {
        out.extend(m.values().filter(|(d, c)| *d == dev && *c != 0).map(|(_, c)| *c));
    }
    out
}

pub unsafe fn create(g: *mut CUgreenCtx, desc: CUdevResourceDesc, dev: CUdevice, flags: c_uint) -> CUresult {
    let Some(f) = real::cuGreenCtxCreate() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(g, desc, dev, flags) };
    }
    let _serial = context::serial();
    let Some(d) = usize::try_from(dev).ok().filter(|&d| d < MAX_DEVICES) else { return unsafe { f(g, desc, dev, flags) } };
    if let Err(e) = super::init::ensure_limits() {
        return e.code();
    }
    let api = Hook::cuGreenCtxCreate;
    // A first-context lease `reserve_context` may take goes back on every way out (this create
    // notes no context size: a member waiting on it makes its own next, one at a time).
    let _settle = overhead::Settle(d);
    let had_primary = guarded(true, || context::primary_active(dev));
    // The primary context's size first (it may wait for another member's), then the books, then
    // the reservations: a reading must count neither that context nor our own reservation.
    let est = if had_primary { 0 } else { guarded(0, || overhead::context_estimate(d)) };
    let probe = guarded(None, || Some(overhead::probe(d)));
    let primary = guarded(Err(CUDA_ERROR_OUT_OF_MEMORY), || overhead::reserve_context(api, d, est));
    let Ok(primary) = primary else { return CUDA_ERROR_OUT_OF_MEMORY };
    let own = LAST_GREEN[d].load(Ordering::Acquire);
    if own > 0
        && guarded(Err(CUDA_ERROR_OUT_OF_MEMORY), || overhead::reserve(api, d, own)).is_err()
    {
        ledger::unreserve(d, primary);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let reserved = primary + own;
    let rc = unsafe { f(g, desc, dev, flags) };
    if rc != CUDA_SUCCESS {
        ledger::unreserve(d, reserved);
        return rc;
    }
    let handle = unsafe { *g } as u64;
    let fits = guarded(true, || {
        let bytes = match probe.as_ref().and_then(|p| overhead::measured(p, reserved)) {
            Some(b) => b.clamp(0, u64::MAX as i128) as u64,
            None => reserved,
        };
        // A handle left charged was a green context destroyed unseen: its memory is gone.
        overhead::context_ended(api, handle);
        let ok = overhead::charge(api, handle, d, bytes, reserved, false).is_ok();
        if had_primary {
            if ok {
                LAST_GREEN[d].store(bytes, Ordering::Release);
            }
        } else {
            // The primary context and the green one in one measurement: the next create that
            // makes the primary reserves that much before the driver is called.
            overhead::note_primary_with_green(d, bytes);
        }
        ok
    });
    if !fits {
        // Our own undo: the driver's destroy, directly (it releases the primary context again).
        if let Some(destroy) = real::cuGreenCtxDestroy() {
            unsafe { destroy(handle as CUgreenCtx) };
        }
        super::contexts_changed();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    guarded((), || {
        // An entry left under this handle was a green context destroyed unseen.
        GREENS.lock().get_or_insert_with(HashMap::new).insert(handle, (dev, 0));
    });
    rc
}

pub unsafe fn to_context(pctx: *mut CUcontext, g: CUgreenCtx) -> CUresult {
    let Some(f) = real::cuCtxFromGreenCtx() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(pctx, g) };
    }
    let _serial = context::serial();
    let rc = unsafe { f(pctx, g) };
    if rc == CUDA_SUCCESS {
        guarded((), || {
            if let Some(e) = GREENS.lock().as_mut().and_then(|m| m.get_mut(&(g as u64))) {
                e.1 = unsafe { *pctx } as u64;
            }
        });
    }
    rc
}

pub unsafe fn destroy(g: CUgreenCtx) -> CUresult {
    let Some(f) = real::cuGreenCtxDestroy() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(g) };
    }
    let serial = context::serial();
    let known = guarded(None, || GREENS.lock().as_ref().and_then(|m| m.get(&(g as u64)).copied()));
    let primary = match known {
        Some((dev, _)) => guarded(0, || context::primary_of(dev)),
        None => 0,
    };
    let probe = known.and_then(|(dev, _)| usize::try_from(dev).ok().filter(|&d| d < MAX_DEVICES));
    let probe = probe.and_then(|d| guarded(None, || Some(overhead::probe(d))));
    let rc = unsafe { f(g) };
    let mut reset = false;
    if rc == CUDA_SUCCESS
        && let Some((dev, ctx)) = known
    {
        guarded((), || {
            if !context::primary_active(dev) {
                // The destroy released the primary context for the last time: the driver reset it,
                // freeing its memory and the green contexts' (this one's included).
                let mut ctxs = with_primary(dev, primary);
                ctxs.extend([ctx, g as u64]);
                context::ended(Hook::cuGreenCtxDestroy, &ctxs);
                reset = true;
            } else {
                let primary = context::primary_of(dev);
                context::rekey(ctx, primary);
                // Its own memory: what the books say the destroy gave back; the rest (a primary
                // context its create made) is the primary context's.
                if let Some(p) = &probe {
                    let _ = overhead::settle(Hook::cuGreenCtxDestroy, g as u64, p);
                }
                overhead::hand_over(g as u64, primary);
            }
            GREENS.lock().as_mut().map(|m| m.remove(&(g as u64)));
            // Its CUcontext is gone: cached (context → device) answers must not outlive it.
            super::contexts_changed();
        });
    }
    drop(serial);
    if reset {
        context::device_reset();
    }
    rc
}
