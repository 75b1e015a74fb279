//! Traced, not counted: page-locked host memory and device memory another process owns (IPC).
//! These never take device memory from this process's cap, but a trace that shows them explains
//! host-memory pressure and shared buffers.

use super::vmm::traced;
use super::MISSING_REAL;
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, real};
use std::ffi::{c_uint, c_void};

pub unsafe fn host_alloc(pp: *mut *mut c_void, size: usize, flags: c_uint) -> CUresult {
    let Some(f) = real::cuMemHostAlloc() else { return MISSING_REAL };
    traced(Op::HostAlloc, Hook::cuMemHostAlloc, || unsafe { *pp as u64 }, size as u64, || unsafe { f(pp, size, flags) })
}

pub unsafe fn alloc_host_v2(pp: *mut *mut c_void, size: usize) -> CUresult {
    let Some(f) = real::cuMemAllocHost_v2() else { return MISSING_REAL };
    traced(Op::HostAlloc, Hook::cuMemAllocHost_v2, || unsafe { *pp as u64 }, size as u64, || unsafe { f(pp, size) })
}

pub unsafe fn alloc_host_v1(pp: *mut *mut c_void, size: c_uint) -> CUresult {
    let Some(f) = real::cuMemAllocHost() else { return MISSING_REAL };
    traced(Op::HostAlloc, Hook::cuMemAllocHost, || unsafe { *pp as u64 }, size as u64, || unsafe { f(pp, size) })
}

pub unsafe fn free_host(p: *mut c_void) -> CUresult {
    let Some(f) = real::cuMemFreeHost() else { return MISSING_REAL };
    traced(Op::HostFree, Hook::cuMemFreeHost, || p as u64, 0, || unsafe { f(p) })
}

pub unsafe fn register_v2(p: *mut c_void, size: usize, flags: c_uint) -> CUresult {
    let Some(f) = real::cuMemHostRegister_v2() else { return MISSING_REAL };
    traced(Op::HostAlloc, Hook::cuMemHostRegister_v2, || p as u64, size as u64, || unsafe { f(p, size, flags) })
}

pub unsafe fn register_v1(p: *mut c_void, size: usize, flags: c_uint) -> CUresult {
    let Some(f) = real::cuMemHostRegister() else { return MISSING_REAL };
    traced(Op::HostAlloc, Hook::cuMemHostRegister, || p as u64, size as u64, || unsafe { f(p, size, flags) })
}

pub unsafe fn unregister(p: *mut c_void) -> CUresult {
    let Some(f) = real::cuMemHostUnregister() else { return MISSING_REAL };
    traced(Op::HostFree, Hook::cuMemHostUnregister, || p as u64, 0, || unsafe { f(p) })
}

pub unsafe fn ipc_open_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> CUresult {
    let Some(f) = real::cuIpcOpenMemHandle_v2() else { return MISSING_REAL };
    traced(Op::IpcOpen, Hook::cuIpcOpenMemHandle_v2, || unsafe { *pdptr }, 0, || unsafe { f(pdptr, handle, flags) })
}

pub unsafe fn ipc_open_v1(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> CUresult {
    let Some(f) = real::cuIpcOpenMemHandle() else { return MISSING_REAL };
    traced(Op::IpcOpen, Hook::cuIpcOpenMemHandle, || unsafe { *pdptr }, 0, || unsafe { f(pdptr, handle, flags) })
}

pub unsafe fn ipc_close(dptr: CUdeviceptr) -> CUresult {
    let Some(f) = real::cuIpcCloseMemHandle() else { return MISSING_REAL };
    traced(Op::Unmap, Hook::cuIpcCloseMemHandle, || dptr, 0, || unsafe { f(dptr) })
}
