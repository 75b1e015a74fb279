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
//! A green context or conversion we did not see leaves its charges keyed to a handle nothing ends:
//! they stay (a false denial at worst, never memory past the cap).

use super::{MISSING_REAL, Mode, context, guarded, mode};
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::sync::Lock;
use std::collections::HashMap;
use std::ffi::c_uint;

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
    let rc = unsafe { f(g, desc, dev, flags) };
    if rc == CUDA_SUCCESS {
        guarded((), || {
            // An entry left under this handle was a green context destroyed unseen.
            GREENS.lock().get_or_insert_with(HashMap::new).insert(unsafe { *g } as u64, (dev, 0));
        });
    }
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
                ctxs.push(ctx);
                context::ended(Hook::cuGreenCtxDestroy, &ctxs);
                reset = true;
            } else {
                context::rekey(ctx, context::primary_of(dev));
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
