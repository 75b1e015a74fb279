//! Destroying a context (or resetting a device's primary context) frees everything allocated in it
//! without a single free call: every charge is recorded with the context it was made in, and all
//! of that context's charges are released once the driver has destroyed it.

use super::charge::{Timed, emit};
use super::{MISSING_REAL, Mode, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger;

fn release_context(api: Hook, ctx: u64) {
    if ctx == 0 {
        return;
    }
    for (kind, key, c) in ledger::drain(|c| c.ctx == ctx) {
        if kind.charged() {
            ledger::release(c.dev as usize, c.size);
            emit(Op::Free, api, c.dev as i32, key, c.size, Timed::instant(CUDA_SUCCESS), ledger::used(c.dev as usize));
        }
    }
    // Stream-ordered memory went back to its pools (or with them): re-read what they hold.
    super::pool::refresh(None);
}

unsafe fn destroy(api: Hook, f: unsafe extern "C" fn(CUcontext) -> CUresult, ctx: CUcontext) -> CUresult {
    let rc = unsafe { f(ctx) };
    if rc == CUDA_SUCCESS {
        // The address may come back as another device's context.
        super::contexts_changed();
        if mode() == Mode::Enforce {
            guarded((), || release_context(api, ctx as u64));
        }
    }
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

unsafe fn reset(api: Hook, f: unsafe extern "C" fn(CUdevice) -> CUresult, dev: CUdevice) -> CUresult {
    if mode() != Mode::Enforce {
        return unsafe { f(dev) };
    }
    let ctx = guarded(0, || active_primary(dev));
    let rc = unsafe { f(dev) };
    if rc == CUDA_SUCCESS {
        guarded((), || release_context(api, ctx));
    }
    rc
}

pub unsafe fn reset_v2(dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDevicePrimaryCtxReset_v2() else { return MISSING_REAL };
    unsafe { reset(Hook::cuDevicePrimaryCtxReset_v2, f, dev) }
}

pub unsafe fn reset_v1(dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDevicePrimaryCtxReset() else { return MISSING_REAL };
    unsafe { reset(Hook::cuDevicePrimaryCtxReset, f, dev) }
}
