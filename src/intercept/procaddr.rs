//! `cuGetProcAddress` (v1, CUDA 11.3) and `cuGetProcAddress_v2` (CUDA 12): how the CUDA runtime,
//! PyTorch's driver table and cuda-bindings obtain every driver function.
//!
//! We let the real driver choose the variant (it alone knows which ABI matches the requested
//! version and flags), then replace its answer by our wrapper for *that exact exported function*,
//! matched by address. An answer we cannot match is passed through untouched (and reported once):
//! handing out a wrapper for a guessed variant could give the caller another ABI than it asked for.

use super::{MISSING_REAL, guarded};
use crate::config;
use crate::ffi::*;
use crate::hooks::{self, HOOKS, Lib, real};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

pub unsafe fn get_proc_address_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    let Some(f) = real::cuGetProcAddress_v2() else { return MISSING_REAL };
    let rc = unsafe { f(symbol, pfn, version, flags, status) };
    if rc == CUDA_SUCCESS && !symbol.is_null() && !pfn.is_null() {
        guarded((), || unsafe { substitute(symbol, pfn, version, flags) });
    }
    rc
}

pub unsafe fn get_proc_address_v1(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: cuuint64_t,
) -> CUresult {
    let Some(f) = real::cuGetProcAddress() else { return MISSING_REAL };
    let rc = unsafe { f(symbol, pfn, version, flags) };
    if rc == CUDA_SUCCESS && !symbol.is_null() && !pfn.is_null() {
        guarded((), || unsafe { substitute(symbol, pfn, version, flags) });
    }
    rc
}

static WARNED: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

unsafe fn substitute(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: cuuint64_t) {
    let got = unsafe { *pfn };
    if got.is_null() || config::get().disabled {
        return;
    }
    let base = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !base.starts_with(b"cu") {
        return;
    }
    let mut first_of_base = None;
    for h in HOOKS.iter().filter(|h| h.lib == Lib::Cuda && h.base.as_bytes() == base) {
        first_of_base.get_or_insert(h.hook as usize);
        if hooks::real(h.hook) == got {
            unsafe { *pfn = hooks::wrapper(h.hook) };
            return;
        }
    }
    if let Some(i) = first_of_base {
        let bit = 1u64 << (i % 64);
        if WARNED[(i / 64) % 4].fetch_or(bit, Ordering::Relaxed) & bit == 0 {
            crate::log::write_line(&format!(
                "vramcap: cuGetProcAddress(\"{}\", {version}, flags={flags}) returned an entry point that is \
                 none of the variants vramcap wraps; passing it through unwrapped (not counted)",
                String::from_utf8_lossy(base)
            ));
        }
    }
}
