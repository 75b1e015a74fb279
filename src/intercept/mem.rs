//! `cuMemAlloc`/`cuMemFree` (both ABIs) and the virtualised memory views.

use super::init::ensure_limits;
use super::{MISSING_REAL, Mode, current_device, guarded, mode};
use crate::ffi::*;
use crate::hooks::real;
use crate::ledger::{self, Charge, Kind};
use std::ffi::c_uint;

/// What to do with an allocation request, decided before the driver is called.
enum Plan {
    /// Charged to this device; commit or roll back after the call.
    Charged(usize),
    /// Refused: return this code without calling the driver.
    Deny(CUresult),
    /// Not ours to count (no current context: the driver will say so itself).
    Forward,
}

fn plan(api: &'static str, size: u64) -> Plan {
    if let Err(e) = ensure_limits() {
        return Plan::Deny(e.code());
    }
    let Some(dev) = current_device() else { return Plan::Forward };
    match ledger::reserve(dev, size) {
        Ok(()) => Plan::Charged(dev),
        Err(d) => {
            crate::log::denied(api, dev, size, d.used, d.limit);
            Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY)
        }
    }
}

/// Reserve, call the driver once, then commit or roll back. `read_ptr` runs only after success.
fn charged_alloc(
    api: &'static str,
    size: u64,
    call: impl FnOnce() -> CUresult,
    read_ptr: impl FnOnce() -> u64,
) -> CUresult {
    match mode() {
        Mode::PassThrough => return call(),
        Mode::FailClosed => return CUDA_ERROR_NOT_PERMITTED,
        Mode::Enforce => {}
    }
    // A bookkeeping panic denies rather than hands out memory we did not count.
    match guarded(Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY), || plan(api, size)) {
        Plan::Deny(rc) => rc,
        Plan::Forward => call(),
        Plan::Charged(dev) => {
            let rc = call();
            guarded((), || {
                if rc == CUDA_SUCCESS {
                    ledger::note_peak(dev);
                    let charge = Charge { dev: dev as u16, size };
                    // An entry already under this address is an allocation whose free we never
                    // saw: the driver has reused the address, so that charge is gone.
                    if let Some(stale) = ledger::insert(Kind::DevicePtr, read_ptr(), charge) {
                        ledger::release(stale.dev as usize, stale.size);
                    }
                } else {
                    ledger::release(dev, size);
                }
            });
            rc
        }
    }
}

/// Take the entry out before the driver frees (so a racing allocation that gets the same address
/// cannot have its entry removed by us), release after success, put it back after failure.
fn charged_free(ptr: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() == Mode::PassThrough {
        return call();
    }
    let taken = guarded(None, || ledger::take(Kind::DevicePtr, ptr));
    let rc = call();
    if let Some(c) = taken {
        guarded((), || {
            if rc == CUDA_SUCCESS {
                ledger::release(c.dev as usize, c.size);
            } else {
                ledger::insert(Kind::DevicePtr, ptr, c);
            }
        });
    }
    rc
}

pub unsafe fn alloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::cuMemAlloc_v2() else { return MISSING_REAL };
    charged_alloc("cuMemAlloc_v2", size as u64, || unsafe { f(dptr, size) }, || unsafe { *dptr })
}

pub unsafe fn alloc_v1(dptr: *mut CUdeviceptr_v1, size: c_uint) -> CUresult {
    let Some(f) = real::cuMemAlloc() else { return MISSING_REAL };
    charged_alloc("cuMemAlloc", size as u64, || unsafe { f(dptr, size) }, || unsafe { *dptr as u64 })
}

pub unsafe fn free_v2(ptr: CUdeviceptr) -> CUresult {
    let Some(f) = real::cuMemFree_v2() else { return MISSING_REAL };
    charged_free(ptr, || unsafe { f(ptr) })
}

pub unsafe fn free_v1(ptr: CUdeviceptr_v1) -> CUresult {
    let Some(f) = real::cuMemFree() else { return MISSING_REAL };
    charged_free(ptr as u64, || unsafe { f(ptr) })
}

/// The capped view of one device: total = min(limit, physical),
/// free = min(physical free, total − used). Never above physical, never negative.
pub fn virtual_info(dev: usize, phys_free: u64, phys_total: u64) -> (u64, u64) {
    match ledger::limit(dev) {
        None => (phys_free, phys_total),
        Some(limit) => {
            let total = limit.min(phys_total);
            (phys_free.min(total.saturating_sub(ledger::used(dev))), total)
        }
    }
}

/// Calls the real `cuMemGetInfo` with the caller's pointers (so NULLs get the driver's own
/// answer), then rewrites what it returned. `query` fills physical (free, total) on success.
fn capped_info(call: impl FnOnce() -> CUresult, query: impl FnOnce() -> Option<(u64, u64)>, write: impl FnOnce(u64, u64)) -> CUresult {
    let rc = call();
    if rc != CUDA_SUCCESS || mode() != Mode::Enforce {
        return rc;
    }
    guarded((), || {
        if ensure_limits().is_err() {
            return;
        }
        let (Some(dev), Some((free, total))) = (current_device(), query()) else { return };
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
    ledger::limit(dev as usize).map_or(physical, |l| l.min(physical))
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
