//! Where memory at a `CUmemLocation` lives, read from the driver API's `CUmemLocationType`: only
//! the host types are host memory; a device and a device's locality domain (CUDA 13.4, a portion
//! of that device's memory) are device memory; any other value (invalid, `INVISIBLE`, a type newer
//! than this library) cannot be placed, and vramcap refuses it rather than pass memory it cannot
//! count.

use super::charge::{Timed, emit};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::Hook;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

const HOST: c_int = 2;
const HOST_NUMA: c_int = 3;
const HOST_NUMA_CURRENT: c_int = 4;
/// `id` is then the union's `localized` member: byte 0 the device ordinal, byte 1 the domain.
const DEVICE_LOCALITY_DOMAIN: c_int = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Device(usize),
    Host,
    /// A type that names no memory vramcap knows how to count.
    Unknown,
}

pub fn place(l: CUmemLocation) -> Place {
    match l.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE if l.id >= 0 => Place::Device(l.id as usize),
        DEVICE_LOCALITY_DOMAIN => Place::Device((l.id & 0xff) as usize),
        HOST | HOST_NUMA | HOST_NUMA_CURRENT => Place::Host,
        _ => Place::Unknown,
    }
}

/// Refuses a location vramcap cannot place before the driver sees it, saying why once: a device
/// location whose id is no device ordinal (the driver's `CUDA_ERROR_INVALID_DEVICE`; −1 is the
/// host only as v1's `CUdevice`, `CU_DEVICE_CPU`), or a type of unknown memory.
#[cold]
pub fn refuse(api: Hook, l: CUmemLocation) -> CUresult {
    static SAID: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
    let device = l.type_ == CU_MEM_LOCATION_TYPE_DEVICE;
    let rc = if device { CUDA_ERROR_INVALID_DEVICE } else { CUDA_ERROR_INVALID_VALUE };
    if !SAID[device as usize].swap(true, Ordering::Relaxed) {
        super::guarded((), || {
            let name = crate::hooks::info(api).name;
            crate::log::write_line(&if device {
                format!(
                    "vramcap: {name} refused (CUDA_ERROR_INVALID_DEVICE): memory location type 1 (a device) with id {} \
                     names no device: a device location's id is a device ordinal, 0 or more (-1 means the host, \
                     CU_DEVICE_CPU, only as the device argument of cuMemPrefetchAsync v1); for the host give \
                     location type 2 (CU_MEM_LOCATION_TYPE_HOST)",
                    l.id
                )
            } else {
                format!(
                    "vramcap: {name} refused (CUDA_ERROR_INVALID_VALUE): memory location type {} (id {}) is not one \
                     vramcap can place; expected a device (1), a host type (2, 3, 4) or a device locality domain (6)",
                    l.type_, l.id
                )
            })
        });
    }
    emit(Op::Fail, api, -1, 0, 0, Timed::instant(rc), 0);
    rc
}
