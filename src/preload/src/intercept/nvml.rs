//! NVML's memory view (`nvidia-smi`, monitoring agents, frameworks that size themselves from it)
//! agrees with `cuMemGetInfo_v2`: total = min(limit, physical) (the tighter of the process's and
//! its group's), free = min(physical free, total − charged), used = total − free; never above
//! physical, never negative. NVML numbers devices
//! its own way (all GPUs, no `CUDA_VISIBLE_DEVICES`), so a handle is matched to a CUDA ordinal by
//! UUID once CUDA is up (before that: `nvml_early`); a GPU this process cannot see through CUDA
//! keeps the physical view.

use super::init::{ensure_limits, format_uuid};
use super::mem::virtual_info;
use super::{Mode, guarded, mode};
use crate::ffi::*;
use crate::hooks::{import, real};
use crate::ledger;
use std::ffi::{CStr, c_char};

/// The CUDA ordinal of an NVML device handle, by UUID.
fn cuda_ordinal(dev: nvmlDevice_t) -> Option<usize> {
    let f = import::nvmlDeviceGetUUID()?;
    let mut buf = [0 as c_char; 96];
    if unsafe { f(dev, buf.as_mut_ptr(), buf.len() as u32) } != NVML_SUCCESS {
        return None;
    }
    let uuid = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().ok()?.to_ascii_lowercase();
    let (count_fn, get_fn, uuid_fn) = (import::cuDeviceGetCount()?, import::cuDeviceGet()?, import::cuDeviceGetUuid()?);
    let mut n = 0;
    if unsafe { count_fn(&mut n) } != CUDA_SUCCESS {
        return None;
    }
    (0..n.max(0) as usize).find(|&i| {
        let (mut d, mut b) = (0, [0u8; 16]);
        let ok = unsafe { get_fn(&mut d, i as i32) == CUDA_SUCCESS && uuid_fn(&mut b, d) == CUDA_SUCCESS };
        ok && format_uuid(&b).to_ascii_lowercase() == uuid
    })
}

/// (total, free, used) as this process should see them, or `None` for the physical view.
fn capped(dev: nvmlDevice_t, phys_total: u64, phys_free: u64) -> Option<(u64, u64, u64)> {
    // Failed closed, nothing can be allocated: the view says so, as `cuMemGetInfo`'s does.
    let nothing_free = Some((phys_total, 0, phys_total));
    match mode() {
        Mode::PassThrough => return None,
        Mode::FailClosed => return nothing_free,
        Mode::Enforce => {}
    }
    // Before CUDA is up the UUID match below has no CUDA to ask (and must not start it).
    if !super::nvml_early::cuda_is_up() {
        return super::nvml_early::capped(dev, phys_total, phys_free);
    }
    if ensure_limits().is_err() {
        return nothing_free;
    }
    // Observe mode: the job sizes itself from the physical device, as without vramcap.
    if crate::observe::physical_view() {
        return None;
    }
    let d = cuda_ordinal(dev)?;
    // Capped by the process's own limit, its group's budget, or both.
    if ledger::limit(d).is_none() && crate::group::view(d).is_none() {
        return None;
    }
    super::pool::refresh_device(d);
    let (free, total) = virtual_info(d, phys_free, phys_total);
    // Used is what this view cannot hand out: with a group that includes the other members.
    Some((total, free, total.saturating_sub(free)))
}

pub unsafe fn memory_info(dev: nvmlDevice_t, mem: *mut nvmlMemory_t) -> nvmlReturn_t {
    let Some(f) = real::nvmlDeviceGetMemoryInfo() else { return 13 }; // NVML_ERROR_FUNCTION_NOT_FOUND
    let rc = unsafe { f(dev, mem) };
    if rc == NVML_SUCCESS && !mem.is_null() {
        let m = unsafe { &mut *mem };
        if let Some((t, fr, u)) = guarded(None, || capped(dev, m.total, m.free)) {
            (m.total, m.free, m.used) = (t, fr, u);
        }
    }
    rc
}

pub unsafe fn memory_info_v2(dev: nvmlDevice_t, mem: *mut nvmlMemory_v2_t) -> nvmlReturn_t {
    let Some(f) = real::nvmlDeviceGetMemoryInfo_v2() else { return 13 };
    let rc = unsafe { f(dev, mem) };
    if rc == NVML_SUCCESS && !mem.is_null() {
        let m = unsafe { &mut *mem };
        if let Some((t, fr, u)) = guarded(None, || capped(dev, m.total, m.free)) {
            // Driver-reserved memory stays what it is, squeezed so the parts add up to the total.
            m.reserved = m.reserved.min(t.saturating_sub(u).saturating_sub(fr));
            (m.total, m.free, m.used) = (t, fr, u);
        }
    }
    rc
}
