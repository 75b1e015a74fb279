//! `cuGetProcAddress` (v1, CUDA 11.3) and `cuGetProcAddress_v2` (CUDA 12): how the CUDA runtime,
//! PyTorch's driver table and cuda-bindings obtain every driver function.
//!
//! We let the real driver choose the variant (it alone knows which ABI matches the requested
//! version and flags), then replace its answer by our wrapper for *that exact exported function*,
//! matched by address. Handing out a wrapper for a guessed variant could give the caller another
//! ABI than it asked for, so an answer we cannot match is never "fixed up". What happens to it
//! depends on the base name ([`hooks::accounts`]):
//! - a name that only reads or traces (`cuMemGetInfo`, `cuCtxSynchronize`, host memory, ...):
//!   passed through, silently: nothing the cap counts can go uncounted through it, and a normal
//!   process must print nothing;
//! - a name that allocates or frees device memory: reported once, and the caller gets
//!   [`denied`] instead, which returns `CUDA_ERROR_NOT_PERMITTED` without calling the driver.
//!   Why a stub and not `*pfn = NULL` with `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`: the
//!   driver documents that the lookup succeeded and `*pfn` is the function; rewriting that into
//!   "not found" tells the runtime the driver is too old (it may refuse to initialise at all, or a
//!   caller that trusts a successful lookup calls NULL and crashes). The stub keeps the lookup's
//!   documented answer (the runtime's replay is unchanged), costs nothing, and turns only the one
//!   entry point vramcap cannot count into a CUresult error the caller already handles.

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
        unsafe { substitute_guarded(symbol, pfn, version, flags) };
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
        unsafe { substitute_guarded(symbol, pfn, version, flags) };
    }
    rc
}

static WARNED: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// What the caller gets for a driver answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// Not a name vramcap wraps, or the driver returned nothing: the driver's answer as it is.
    Driver,
    /// The driver returned the function behind this hook: our wrapper instead.
    Wrap(hooks::Hook),
    /// A variant vramcap does not wrap of a name that only reads or traces: the driver's answer.
    Unwrapped(hooks::Hook),
    /// A variant vramcap does not wrap of a name that allocates or frees: [`denied`].
    Deny(hooks::Hook),
}

/// The decision, pure but for `real` (the driver's function behind each hook).
fn choose(base: &[u8], got: *mut c_void, real: impl Fn(hooks::Hook) -> *mut c_void) -> Answer {
    if got.is_null() {
        return Answer::Driver;
    }
    let mut first_of_base = None;
    for h in HOOKS.iter().filter(|h| h.lib == Lib::Cuda && h.base.as_bytes() == base) {
        first_of_base.get_or_insert(h.hook);
        if real(h.hook) == got {
            return Answer::Wrap(h.hook);
        }
    }
    match first_of_base {
        None => Answer::Driver,
        Some(h) if hooks::accounts(base) => Answer::Deny(h),
        Some(h) => Answer::Unwrapped(h),
    }
}

/// Stands in for an allocating or freeing entry point vramcap cannot wrap. Every driver entry
/// point returns a `CUresult`, and in the C calling convention (x86-64 and AArch64 alike) a callee
/// that declares fewer parameters than the caller passes simply ignores them, so this is a sound
/// stand-in for any of them: nothing is read, nothing is written, the driver is not called.
unsafe extern "C" fn denied() -> CUresult {
    CUDA_ERROR_NOT_PERMITTED
}

/// [`substitute`] with panics contained; a panic must not hand out an unwrapped allocator either.
unsafe fn substitute_guarded(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: cuuint64_t) {
    if !guarded(false, || unsafe { substitute(symbol, pfn, version, flags) }) {
        let base = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        if hooks::accounts(base) && !unsafe { *pfn }.is_null() {
            unsafe { *pfn = denied as *const () as *mut c_void };
        }
    }
}

/// Returns false only by panicking (see [`substitute_guarded`]).
unsafe fn substitute(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: cuuint64_t) -> bool {
    if config::get().disabled {
        return true;
    }
    let base = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !base.starts_with(b"cu") {
        return true;
    }
    match choose(base, unsafe { *pfn }, hooks::real) {
        Answer::Driver | Answer::Unwrapped(_) => {}
        Answer::Wrap(h) => unsafe { *pfn = hooks::wrapper(h) },
        Answer::Deny(h) => {
            unsafe { *pfn = denied as *const () as *mut c_void };
            let i = h as usize;
            let bit = 1u64 << (i % 64);
            if WARNED[(i / 64) % 4].fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                crate::log::write_line(&format!(
                    "vramcap: cuGetProcAddress(\"{}\", {version}, flags={flags}) returned an entry point that is \
                     none of the variants vramcap wraps; it allocates or frees device memory, so the caller gets \
                     one that fails with CUDA_ERROR_NOT_PERMITTED (memory must not go uncounted)",
                    String::from_utf8_lossy(base)
                ));
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::{Hook, find};

    fn fake_real(h: Hook) -> *mut c_void {
        (0x1000 + 16 * h as usize) as *mut c_void
    }

    #[test]
    fn known_variants_are_wrapped() {
        let h = find(b"cuMemAlloc_v2").unwrap();
        assert_eq!(choose(b"cuMemAlloc", fake_real(h), fake_real), Answer::Wrap(h));
        let h = find(b"cuMemGetInfo_v2").unwrap();
        assert_eq!(choose(b"cuMemGetInfo", fake_real(h), fake_real), Answer::Wrap(h));
    }

    #[test]
    fn an_unknown_variant_is_denied_only_where_memory_could_go_uncounted() {
        let unknown = 0x9999_0000 as *mut c_void;
        for base in ["cuMemAlloc", "cuMemFree", "cuMemAllocPitch", "cuMemAllocManaged", "cuArrayCreate", "cuArrayDestroy"] {
            assert!(matches!(choose(base.as_bytes(), unknown, fake_real), Answer::Deny(_)), "{base}");
        }
        for base in ["cuMemGetInfo", "cuDeviceTotalMem", "cuMemHostAlloc", "cuInit", "cuCtxSynchronize"] {
            assert!(matches!(choose(base.as_bytes(), unknown, fake_real), Answer::Unwrapped(_)), "{base}");
        }
        // Not found stays not found; names we do not wrap are never touched.
        assert_eq!(choose(b"cuMemAlloc", std::ptr::null_mut(), fake_real), Answer::Driver);
        assert_eq!(choose(b"cuLaunchKernel", unknown, fake_real), Answer::Driver);
        // The driver we opened is unusable (every real slot NULL): allocators are denied.
        assert!(matches!(choose(b"cuMemAlloc", unknown, |_| std::ptr::null_mut()), Answer::Deny(_)));
    }

    #[test]
    fn the_stub_denies() {
        assert_eq!(unsafe { denied() }, CUDA_ERROR_NOT_PERMITTED);
    }
}
