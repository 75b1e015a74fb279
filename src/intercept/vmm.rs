//! Virtual memory management (PyTorch expandable segments, NCCL ≥ 2.19): the physical allocation
//! (`cuMemCreate`, keyed by its handle, device locations only) is what is charged; reserving
//! address space and mapping/unmapping a handle are traced but never counted, so memory mapped at
//! several addresses is counted once. The charge goes at `cuMemRelease` (the driver frees the
//! memory once it is also unmapped; callers unmap first).

use super::charge::{self, Target, emit, timed};
use super::{MISSING_REAL, Mode, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::ledger::Kind;
use std::ffi::{c_int, c_void};

pub unsafe fn create(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) -> CUresult {
    let Some(f) = real::cuMemCreate() else { return MISSING_REAL };
    let call = || unsafe { f(handle, size, prop, flags) };
    let loc = if prop.is_null() { None } else { Some(unsafe { (*prop).location }) };
    match loc {
        Some(l) if l.type_ == CU_MEM_LOCATION_TYPE_DEVICE && l.id >= 0 => {
            charge::alloc(Hook::cuMemCreate, Kind::VmmHandle, Target::Device(l.id as usize), size as u64, call, || unsafe { *handle })
        }
        // Host (NUMA) locations are host memory; a NULL prop is the driver's to refuse.
        _ => call(),
    }
}

pub unsafe fn release(handle: CUmemGenericAllocationHandle) -> CUresult {
    let Some(f) = real::cuMemRelease() else { return MISSING_REAL };
    charge::free(Hook::cuMemRelease, Kind::VmmHandle, handle, || unsafe { f(handle) })
}

/// Calls the driver and emits a traced-only event: the caller's memory, not ours to count.
pub fn traced(op: Op, api: Hook, ptr: impl FnOnce() -> u64, size: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() != Mode::Enforce {
        return call();
    }
    let t = timed(call);
    let rc = t.rc;
    if crate::events::enabled() {
        let dev = super::current_device().map_or(-1, |d| d as i32);
        let (op, p) = if rc == CUDA_SUCCESS { (op, ptr()) } else { (Op::Fail, 0) };
        emit(op, api, dev, p, size, t, if dev >= 0 { crate::ledger::used(dev as usize) } else { 0 });
    }
    rc
}

pub unsafe fn address_reserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64) -> CUresult {
    let Some(f) = real::cuMemAddressReserve() else { return MISSING_REAL };
    traced(Op::Reserve, Hook::cuMemAddressReserve, || unsafe { *ptr }, size as u64, || unsafe { f(ptr, size, align, addr, flags) })
}

pub unsafe fn address_free(ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::cuMemAddressFree() else { return MISSING_REAL };
    traced(Op::Unmap, Hook::cuMemAddressFree, || ptr, size as u64, || unsafe { f(ptr, size) })
}

pub unsafe fn map(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) -> CUresult {
    let Some(f) = real::cuMemMap() else { return MISSING_REAL };
    traced(Op::Map, Hook::cuMemMap, || ptr, size as u64, || unsafe { f(ptr, size, offset, handle, flags) })
}

pub unsafe fn unmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::cuMemUnmap() else { return MISSING_REAL };
    traced(Op::Unmap, Hook::cuMemUnmap, || ptr, size as u64, || unsafe { f(ptr, size) })
}

/// Memory exported by another process: that process is charged for it.
pub unsafe fn import_shareable(handle: *mut CUmemGenericAllocationHandle, os: *mut c_void, kind: c_int) -> CUresult {
    let Some(f) = real::cuMemImportFromShareableHandle() else { return MISSING_REAL };
    traced(Op::IpcOpen, Hook::cuMemImportFromShareableHandle, || unsafe { *handle }, 0, || unsafe { f(handle, os, kind) })
}
