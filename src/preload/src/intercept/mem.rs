//! `cuMemAlloc`/`cuMemFree` (both ABIs) and the virtualised memory views.

use super::charge::{self, Target};
use super::init::ensure_limits;
use super::{MISSING_REAL, Mode, current_device, guarded, mode};
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::ledger::{self, Kind};
use std::ffi::c_uint;

pub unsafe fn alloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::cuMemAlloc_v2() else { return MISSING_REAL };
    let call = || unsafe { f(dptr, size) };
    charge::alloc(Hook::cuMemAlloc_v2, Kind::DevicePtr, Target::CurrentContext, size as u64, call, || unsafe { *dptr })
}

pub unsafe fn alloc_v1(dptr: *mut CUdeviceptr_v1, size: c_uint) -> CUresult {
    let Some(f) = real::cuMemAlloc() else { return MISSING_REAL };
    let call = || unsafe { f(dptr, size) };
    charge::alloc(Hook::cuMemAlloc, Kind::DevicePtr, Target::CurrentContext, size as u64, call, || unsafe { *dptr as u64 })
}

/// Pitched allocations: the driver picks the pitch, so reserve width rounded up to 512 bytes (the
/// largest pitch alignment current GPUs use) × height, then settle to the real pitch × height
/// (charging the difference should a driver ever pick a wider pitch).
const PITCH_BOUND_ALIGN: u64 = 512;

pub unsafe fn alloc_pitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) -> CUresult {
    let Some(f) = real::cuMemAllocPitch_v2() else { return MISSING_REAL };
    let call = || unsafe { f(dptr, pitch, width, height, elem) };
    let bound = (width as u64).div_ceil(PITCH_BOUND_ALIGN).saturating_mul(PITCH_BOUND_ALIGN).saturating_mul(height as u64);
    charge::alloc_settled(Hook::cuMemAllocPitch_v2, Kind::DevicePtr, Target::CurrentContext, bound, call, || unsafe {
        (*dptr, (*pitch as u64).saturating_mul(height as u64))
    })
}

pub unsafe fn alloc_pitch_v1(dptr: *mut CUdeviceptr_v1, pitch: *mut c_uint, width: c_uint, height: c_uint, elem: c_uint) -> CUresult {
    let Some(f) = real::cuMemAllocPitch() else { return MISSING_REAL };
    let call = || unsafe { f(dptr, pitch, width, height, elem) };
    let bound = (width as u64).div_ceil(PITCH_BOUND_ALIGN).saturating_mul(PITCH_BOUND_ALIGN).saturating_mul(height as u64);
    charge::alloc_settled(Hook::cuMemAllocPitch, Kind::DevicePtr, Target::CurrentContext, bound, call, || unsafe {
        (*dptr as u64, (*pitch as u64).saturating_mul(height as u64))
    })
}

pub unsafe fn free_v2(ptr: CUdeviceptr) -> CUresult {
    let Some(f) = real::cuMemFree_v2() else { return MISSING_REAL };
    charge::free(Hook::cuMemFree_v2, Kind::DevicePtr, ptr, || unsafe { f(ptr) })
}

pub unsafe fn free_v1(ptr: CUdeviceptr_v1) -> CUresult {
    let Some(f) = real::cuMemFree() else { return MISSING_REAL };
    charge::free(Hook::cuMemFree, Kind::DevicePtr, ptr as u64, || unsafe { f(ptr) })
}

/// The capped view of one device: for each cap that applies (the process's, the group's),
/// total = min(limit, physical) and free = min(physical free, total − charged); the view is the
/// tightest of them. Never above physical, never negative. In group mode free is what this
/// member could get from the group now (its policy, reserves and headroom: `group::room`).
pub fn virtual_info(dev: usize, phys_free: u64, phys_total: u64) -> (u64, u64) {
    let own = ledger::limit(dev).map(|l| (l, ledger::charged(dev)));
    [own, crate::group::room(dev)].into_iter().flatten().fold((phys_free, phys_total), |(free, total), (l, used)| {
        let t = l.min(phys_total);
        (free.min(t.saturating_sub(used)), total.min(t))
    })
}

/// Calls the real `cuMemGetInfo` with the caller's pointers (so NULLs get the driver's own
/// answer), then rewrites what it returned. `query` fills physical (free, total) on success.
fn capped_info(call: impl FnOnce() -> CUresult, query: impl FnOnce() -> Option<(u64, u64)>, write: impl FnOnce(u64, u64)) -> CUresult {
    let rc = call();
    let m = mode();
    if rc != CUDA_SUCCESS || m == Mode::PassThrough {
        return rc;
    }
    guarded((), || {
        if m == Mode::FailClosed || ensure_limits().is_err() {
            // Nothing can be allocated (every allocation is refused): say so, rather than show
            // the device's free memory to a framework that sizes its pools from it.
            if let Some((_, total)) = query() {
                write(0, total);
            }
            return;
        }
        let Some(dev) = current_device() else { return };
        // What pools hold may have changed since we last looked.
        super::pool::refresh_device(dev);
        let Some((free, total)) = query() else { return };
        let (vf, vt) = virtual_info(dev, free, total);
        write(vf, vt);
    });
    rc
}

pub unsafe fn get_info_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let Some(f) = real::cuMemGetInfo_v2() else { return MISSING_REAL };
    capped_info(
        || unsafe { f(free, total) },
        || {
            if !free.is_null() && !total.is_null() {
                return Some(unsafe { (*free as u64, *total as u64) });
            }
            // The driver accepted a NULL: ask again into our own variables.
            let (mut a, mut b) = (0usize, 0usize);
            (unsafe { f(&mut a, &mut b) } == CUDA_SUCCESS).then_some((a as u64, b as u64))
        },
        |vf, vt| unsafe {
            if !free.is_null() {
                *free = vf as usize;
            }
            if !total.is_null() {
                *total = vt as usize;
            }
        },
    )
}

pub unsafe fn get_info_v1(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    let Some(f) = real::cuMemGetInfo() else { return MISSING_REAL };
    capped_info(
        || unsafe { f(free, total) },
        || {
            if !free.is_null() && !total.is_null() {
                return Some(unsafe { (*free as u64, *total as u64) });
            }
            let (mut a, mut b) = (0 as c_uint, 0 as c_uint);
            (unsafe { f(&mut a, &mut b) } == CUDA_SUCCESS).then_some((a as u64, b as u64))
        },
        |vf, vt| unsafe {
            if !free.is_null() {
                *free = vf.min(c_uint::MAX as u64) as c_uint;
            }
            if !total.is_null() {
                *total = vt.min(c_uint::MAX as u64) as c_uint;
            }
        },
    )
}

fn capped_total(dev: CUdevice, physical: u64) -> u64 {
    if dev < 0 || ensure_limits().is_err() {
        return physical;
    }
    let group = crate::group::view(dev as usize).map(|(l, _)| l);
    [ledger::limit(dev as usize), group].into_iter().flatten().fold(physical, u64::min)
}

pub unsafe fn total_mem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDeviceTotalMem_v2() else { return MISSING_REAL };
    let rc = unsafe { f(bytes, dev) };
    if rc == CUDA_SUCCESS && !bytes.is_null() && mode() == Mode::Enforce {
        guarded((), || unsafe { *bytes = capped_total(dev, *bytes as u64) as usize });
    }
    rc
}

pub unsafe fn total_mem_v1(bytes: *mut c_uint, dev: CUdevice) -> CUresult {
    let Some(f) = real::cuDeviceTotalMem() else { return MISSING_REAL };
    let rc = unsafe { f(bytes, dev) };
    if rc == CUDA_SUCCESS && !bytes.is_null() && mode() == Mode::Enforce {
        guarded((), || unsafe { *bytes = capped_total(dev, *bytes as u64) as c_uint });
    }
    rc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_view_is_capped_and_never_negative() {
        let d = 50;
        ledger::set_limit(d, 4 << 30);
        assert_eq!(virtual_info(d, 10 << 30, 16 << 30), (4 << 30, 4 << 30));
        ledger::reserve(d, 3 << 30).unwrap();
        assert_eq!(virtual_info(d, 10 << 30, 16 << 30), (1 << 30, 4 << 30));
        // Physical free below the virtual free: report physical (other tenants hold memory).
        assert_eq!(virtual_info(d, 1 << 29, 16 << 30), (1 << 29, 4 << 30));
        // A limit above the card: the card.
        ledger::set_limit(d, 64 << 30);
        assert_eq!(virtual_info(d, 10 << 30, 16 << 30), (10 << 30, 16 << 30));
        ledger::set_limit(d, 1 << 30);
        assert_eq!(virtual_info(d, 10 << 30, 16 << 30), (0, 1 << 30));
        ledger::release(d, 3 << 30);
        ledger::set_limit(d, 0);
        assert_eq!(virtual_info(d, 7, 9), (7, 9));
    }
}
