//! Virtual memory management (PyTorch expandable segments, NCCL ≥ 2.19): the physical allocation
//! (`cuMemCreate`, keyed by its handle, device locations only) is what is charged, once however
//! often it is mapped; reserving address space is traced, never counted. The charge lives as long
//! as the driver keeps the memory: until every handle reference is released and every mapping is
//! unmapped ([`super::handles`]).

use super::charge::{self, Target, Timed, begun, emit, timed};
use super::handles;
use super::location::{self, Place};
use super::{MISSING_REAL, Mode, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::ledger::Kind;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

pub unsafe fn create(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) -> CUresult {
    let Some(f) = real::cuMemCreate() else { return MISSING_REAL };
    let call = || unsafe { f(handle, size, prop, flags) };
    // A NULL prop is the driver's to refuse.
    let Some(l) = (if prop.is_null() { None } else { Some(unsafe { (*prop).location }) }) else { return call() };
    match location::place(l) {
        Place::Device(d) => charge::alloc(Hook::cuMemCreate, Kind::VmmHandle, Target::Device(d), size as u64, call, || {
            handles::created(unsafe { *handle })
        }),
        // Host (NUMA) locations are host memory.
        Place::Host => call(),
        Place::Unknown if mode() == Mode::PassThrough => call(),
        Place::Unknown => location::refuse(Hook::cuMemCreate, l),
    }
}

/// One reference fewer; the charge goes with the last reference only if nothing is mapped.
pub unsafe fn release(handle: CUmemGenericAllocationHandle) -> CUresult {
    let Some(f) = real::cuMemRelease() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(handle) };
    }
    let r = guarded(None, || handles::release_begin(handle));
    // Stamped when the call began (`charge::begun`): the handle value may be handed out again.
    let t = begun(timed(|| unsafe { f(handle) }));
    guarded((), || handles::release_end(r, t));
    if t.rc != CUDA_SUCCESS {
        emit(Op::Fail, Hook::cuMemRelease, -1, handle, 0, t, 0);
    }
    t.rc
}

/// `cuMemRetainAllocationHandle`: one more reference to the allocation mapped at `addr` (NCCL finds
/// its handles again this way when it frees).
pub unsafe fn retain_handle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CUresult {
    let Some(f) = real::cuMemRetainAllocationHandle() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(handle, addr) };
    }
    let id = guarded(None, || handles::retain_begin(addr as u64));
    let t = timed(|| unsafe { f(handle, addr) });
    guarded((), || handles::retain_end(id, || unsafe { *handle }, t));
    t.rc
}

/// Calls the driver and emits a traced-only event: the caller's memory, not ours to count.
pub fn traced(op: Op, api: Hook, ptr: impl FnOnce() -> u64, size: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() != Mode::Enforce {
        return call();
    }
    let t = timed(call);
    note(op, api, ptr, size, t);
    t.rc
}

fn note(op: Op, api: Hook, ptr: impl FnOnce() -> u64, size: u64, t: Timed) {
    if crate::events::enabled() {
        let dev = super::current_device().map_or(-1, |d| d as i32);
        let (op, p) = if t.rc == CUDA_SUCCESS { (op, ptr()) } else { (Op::Fail, 0) };
        emit(op, api, dev, p, size, t, if dev >= 0 { crate::ledger::used(dev as usize) } else { 0 });
    }
}

pub unsafe fn address_reserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64) -> CUresult {
    let Some(f) = real::cuMemAddressReserve() else { return MISSING_REAL };
    traced(Op::Reserve, Hook::cuMemAddressReserve, || unsafe { *ptr }, size as u64, || unsafe { f(ptr, size, align, addr, flags) })
}

pub unsafe fn address_free(ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::cuMemAddressFree() else { return MISSING_REAL };
    traced(Op::Unmap, Hook::cuMemAddressFree, || ptr, size as u64, || unsafe { f(ptr, size) })
}

/// A mapping keeps the allocation's memory (and charge) alive after its handle is released.
pub unsafe fn map(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) -> CUresult {
    let Some(f) = real::cuMemMap() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(ptr, size, offset, handle, flags) };
    }
    let id = guarded(None, || handles::map_begin(handle));
    let t = timed(|| unsafe { f(ptr, size, offset, handle, flags) });
    guarded((), || handles::map_end(id, ptr, size as u64, t));
    note(Op::Map, Hook::cuMemMap, || ptr, size as u64, t);
    t.rc
}

/// The last unmap of a released allocation is where its memory (and charge) goes.
pub unsafe fn unmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::cuMemUnmap() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(ptr, size) };
    }
    let u = guarded(None, || Some(handles::unmap_begin(ptr, size as u64)));
    // Stamped when the call began (`charge::begun`): the last unmap frees the memory, and its
    // handle value may be handed out again at once.
    let t = begun(timed(|| unsafe { f(ptr, size) }));
    note(Op::Unmap, Hook::cuMemUnmap, || ptr, size as u64, t);
    if let Some(u) = u {
        guarded((), || handles::unmap_end(u, t));
    }
    t.rc
}

/// `cuMemExportToShareableHandle`: the shareable handle (an fd, a fabric handle, …) is one more
/// reference to the memory, and it may be imported in any process, where vramcap cannot see it
/// released. The allocation is pinned before the driver is asked (a release racing the export must
/// not end the charge of memory that is about to be shared) and stays charged for the life of the
/// process if the export succeeds: keeping a charge can only deny, dropping it could hand out
/// memory that still exists.
pub unsafe fn export_shareable(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_int, flags: u64) -> CUresult {
    let Some(f) = real::cuMemExportToShareableHandle() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(shareable, handle, kind, flags) };
    }
    let id = guarded(None, || handles::export_begin(handle));
    let t = timed(|| unsafe { f(shareable, handle, kind, flags) });
    guarded((), || handles::export_end(id, t, |ranges| unsafe { super::shareable::watch(kind, shareable, ranges) }));
    if t.rc != CUDA_SUCCESS {
        emit(Op::Fail, Hook::cuMemExportToShareableHandle, -1, handle, 0, t, 0);
    }
    t.rc
}

/// Memory exported by another process: that process is charged for it (in a group, the group
/// keeps it after the exporter ends while this member holds the import: `handles::import_end`).
/// A handle this process exported itself comes back as one more reference to an allocation
/// already charged.
pub unsafe fn import_shareable(handle: *mut CUmemGenericAllocationHandle, os: *mut c_void, kind: c_int) -> CUresult {
    let Some(f) = real::cuMemImportFromShareableHandle() else { return MISSING_REAL };
    traced(Op::IpcOpen, Hook::cuMemImportFromShareableHandle, || unsafe { *handle }, 0, || {
        // Followed only where releases and unmaps are (enforcing): a lock nothing would release
        // would keep the exporter's memory charged for the life of this process.
        let counted = if mode() == Mode::Enforce {
            guarded(handles::Counted::No, || handles::import_begin(super::shareable::origin(kind, os)))
        } else {
            handles::Counted::No
        };
        let t = timed(|| unsafe { f(handle, os, kind) });
        guarded((), || handles::import_end(counted, || unsafe { *handle }, t));
        t.rc
    })
}

/// `cuMemMapArrayAsync(_ptsz)` maps physical VMM memory into sparse CUDA arrays, in stream order,
/// described by `CUarrayMapInfo` entries. Such a mapping keeps a handle's memory alive after
/// `cuMemRelease` and every `cuMemUnmap`, and it ends when the stream reaches an unmap entry or
/// the array is destroyed: vramcap would have to follow tiles of arrays in stream order to know
/// when the memory goes. Until it does, the call is refused before the driver reads the list
/// (`CUDA_ERROR_NOT_SUPPORTED`, what a device without sparse array support answers), with one
/// line saying why: passing it through would let released memory outlive its charge.
/// Where no cap applies (no process or group limit on any device: a trace alone, or nothing
/// set) there is nothing to get around and the call goes through, as with `VRAMCAP_DISABLE=1`.
pub unsafe fn map_array_async(info: *mut c_void, count: c_uint, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemMapArrayAsync() else { return MISSING_REAL };
    if mode() == Mode::PassThrough || guarded(false, no_cap_applies) {
        return unsafe { f(info, count, stream) };
    }
    refuse_array_mapping(Hook::cuMemMapArrayAsync)
}

pub unsafe fn map_array_async_ptsz(info: *mut c_void, count: c_uint, stream: CUstream) -> CUresult {
    let Some(f) = real::cuMemMapArrayAsync_ptsz() else { return MISSING_REAL };
    if mode() == Mode::PassThrough || guarded(false, no_cap_applies) {
        return unsafe { f(info, count, stream) };
    }
    refuse_array_mapping(Hook::cuMemMapArrayAsync_ptsz)
}

/// Limits resolved, and none on any device, for the process or a group. Unsure (limits not
/// resolved, a configuration that failed closed) is not "none".
pub(super) fn no_cap_applies() -> bool {
    mode() == Mode::Enforce
        && super::init::ensure_limits().is_ok()
        && !crate::group::active()
        && (0..crate::ledger::MAX_DEVICES).all(|d| crate::ledger::limit(d).is_none())
}

fn refuse_array_mapping(api: Hook) -> CUresult {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        guarded((), || {
            crate::log::write_line(&format!(
                "vramcap: {} refused (CUDA_ERROR_NOT_SUPPORTED): memory mapped into a sparse array outlives \
                 cuMemRelease and cuMemUnmap, and vramcap cannot follow it, so it cannot keep the cap; \
                 run without sparse array mappings, or with VRAMCAP_DISABLE=1 where no cap is wanted",
                crate::hooks::info(api).name
            ))
        });
    }
    emit(Op::Fail, api, -1, 0, 0, Timed::instant(CUDA_ERROR_NOT_SUPPORTED), 0);
    CUDA_ERROR_NOT_SUPPORTED
}
