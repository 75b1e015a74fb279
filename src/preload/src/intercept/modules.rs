//! Modules and per-context limits: the device memory they take is measured around the call and
//! charged to the current context as overhead (`overhead`); one that does not fit is undone
//! (the module unloaded, the limit put back) and refused with `CUDA_ERROR_OUT_OF_MEMORY`, which
//! `cuModuleLoad*` and `cuCtxSetLimit` document. An unload, or a limit lowered, gives back what
//! the books say the driver gave back.

use super::context::serial;
use super::{MISSING_REAL, Mode, current, guarded, mode, overhead};
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger;
use std::os::unix::ffi::OsStrExt;
use crate::sync::Lock;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};

/// The context (and its device) each loaded module was loaded into.
static MODULES: Lock<Option<HashMap<u64, (u64, usize)>>> = Lock::new(None);

/// A call that may take memory for the current context: `estimate` (what it takes at least)
/// reserved first — a call whose estimate does not fit is refused before the driver makes the
/// device hold it — the rest measured and charged, undone if it does not fit. `loads`: a module
/// load, which also brings the context's malloc heap and printf FIFO if it is the first
/// ([`heap_estimate`]). Without a current context the driver refuses the call itself.
fn measured_call(
    api: Hook,
    loads: bool,
    estimate: impl FnOnce() -> u64,
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(),
    record: impl FnOnce(u64, usize),
) -> CUresult {
    if mode() != Mode::Enforce {
        return call();
    }
    let _serial = serial();
    let Some((dev, ctx)) = guarded(None, current) else { return call() };
    if let Err(e) = super::init::ensure_limits() {
        return e.code();
    }
    let probe = guarded(None, || Some(overhead::probe(dev)));
    let est = guarded(0, || estimate().saturating_add(if loads { heap_estimate(ctx) } else { 0 }));
    if est > 0
        && let Err(e) = guarded(Err(CUDA_ERROR_OUT_OF_MEMORY), || overhead::reserve(api, dev, est))
    {
        return e;
    }
    let rc = call();
    if rc != CUDA_SUCCESS {
        ledger::unreserve(dev, est);
        return rc;
    }
    if loads {
        // Loaded, even if undone below: the heap stays with the context.
        guarded((), || overhead::note_heap(ctx));
    }
    let delta = probe.as_ref().and_then(|p| guarded(None, || overhead::measured(p, est)));
    let fits = guarded(Ok(()), || match delta {
        Some(d) if d < 0 => {
            ledger::unreserve(dev, est);
            overhead::shrink(api, ctx, (-d).min(u64::MAX as i128) as u64);
            Ok(())
        }
        Some(d) => overhead::charge(api, ctx, dev, d.min(u64::MAX as i128) as u64, est, false),
        // Unreadable books: at least what the image said.
        None => overhead::charge(api, ctx, dev, est, est, false),
    });
    if fits.is_err() {
        undo();
        if let Some(p) = &probe {
            guarded((), || overhead::settle_kept(api, ctx, p));
        }
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    guarded((), || record(ctx, dev));
    rc
}

/// What the context's first module load takes besides the module: the malloc heap and the printf
/// FIFO at their set sizes ("the actual memory allocation for the heap occurs when a module is
/// loaded into the context", CUDA Programming Guide); nothing once a load brought them.
pub(super) fn heap_estimate(ctx: u64) -> u64 {
    if overhead::heap_taken(ctx) {
        return 0;
    }
    let Some(get) = import::cuCtxGetLimit() else { return 0 };
    let size = |limit: CUlimit| {
        let mut v = 0usize;
        if unsafe { get(&mut v, limit) } == CUDA_SUCCESS { v as u64 } else { 0 }
    };
    size(CU_LIMIT_MALLOC_HEAP_SIZE).saturating_add(size(CU_LIMIT_PRINTF_FIFO_SIZE))
}

/// What raising the stack from `old` to `value` bytes a thread takes at once: every thread the
/// device can hold resident gets its stack (multiprocessors × threads per multiprocessor); 0 where
/// the driver cannot say.
fn stack_estimate(old: usize, value: usize) -> u64 {
    let (Some(dev_of), Some(attr)) = (import::cuCtxGetDevice(), import::cuDeviceGetAttribute()) else { return 0 };
    let mut dev: CUdevice = 0;
    if unsafe { dev_of(&mut dev) } != CUDA_SUCCESS {
        return 0;
    }
    let get = |a: c_int| {
        let mut v: c_int = 0;
        if unsafe { attr(&mut v, a, dev) } == CUDA_SUCCESS { u64::try_from(v).unwrap_or(0) } else { 0 }
    };
    let threads = get(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).saturating_mul(get(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR));
    (value.saturating_sub(old) as u64).saturating_mul(threads)
}

fn load(api: Hook, module: *mut CUmodule, estimate: impl FnOnce() -> u64, call: impl FnOnce() -> CUresult) -> CUresult {
    measured_call(
        api,
        true,
        estimate,
        call,
        || {
            if let Some(unload) = real::cuModuleUnload() {
                unsafe { unload(*module) };
            }
        },
        |ctx, dev| {
            MODULES.lock().get_or_insert_with(HashMap::new).insert(unsafe { *module } as u64, (ctx, dev));
        },
    )
}

/// The globals of an image in memory. The driver requires a complete image, so an ELF image's
/// headers can be read where they say they are; anything else is looked at one byte at a time
/// and no further than its first byte that is not ELF's magic.
pub(super) fn image_globals(image: *const c_void) -> u64 {
    if image.is_null() {
        return 0;
    }
    let read = |off: u64, len: usize| {
        let off = usize::try_from(off).ok()?;
        Some(unsafe { std::slice::from_raw_parts((image as *const u8).add(off), len) }.to_vec())
    };
    super::cubin::elf_globals_in(&read).unwrap_or(0)
}

/// The globals of a module file, read with `pread` (headers only).
pub(super) fn file_globals(fname: *const c_char) -> u64 {
    use std::os::unix::fs::FileExt;
    if fname.is_null() {
        return 0;
    }
    let path = std::ffi::OsStr::from_bytes(unsafe { std::ffi::CStr::from_ptr(fname) }.to_bytes());
    let Ok(f) = std::fs::File::open(path) else { return 0 };
    let read = |off: u64, len: usize| {
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, off).ok().map(|()| buf)
    };
    super::cubin::elf_globals_in(&read).unwrap_or(0)
}

pub unsafe fn load_file(module: *mut CUmodule, fname: *const c_char) -> CUresult {
    let Some(f) = real::cuModuleLoad() else { return MISSING_REAL };
    load(Hook::cuModuleLoad, module, || file_globals(fname), || unsafe { f(module, fname) })
}

pub unsafe fn load_data(module: *mut CUmodule, image: *const c_void) -> CUresult {
    let Some(f) = real::cuModuleLoadData() else { return MISSING_REAL };
    load(Hook::cuModuleLoadData, module, || image_globals(image), || unsafe { f(module, image) })
}

pub unsafe fn load_data_ex(
    module: *mut CUmodule,
    image: *const c_void,
    n: c_uint,
    options: *mut CUjit_option,
    values: *mut *mut c_void,
) -> CUresult {
    let Some(f) = real::cuModuleLoadDataEx() else { return MISSING_REAL };
    load(Hook::cuModuleLoadDataEx, module, || image_globals(image), || unsafe { f(module, image, n, options, values) })
}

pub unsafe fn load_fat_binary(module: *mut CUmodule, fat: *const c_void) -> CUresult {
    let Some(f) = real::cuModuleLoadFatBinary() else { return MISSING_REAL };
    load(Hook::cuModuleLoadFatBinary, module, || image_globals(fat), || unsafe { f(module, fat) })
}

/// What the driver gives back at an unload is read from the books on the module's device.
pub unsafe fn unload(module: CUmodule) -> CUresult {
    let Some(f) = real::cuModuleUnload() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(module) };
    }
    let _serial = serial();
    let owner = guarded(None, || MODULES.lock().as_ref().and_then(|m| m.get(&(module as u64)).copied()));
    let probe = owner.and_then(|(_, dev)| guarded(None, || Some(overhead::probe(dev))));
    let rc = unsafe { f(module) };
    if rc == CUDA_SUCCESS {
        guarded((), || {
            MODULES.lock().as_mut().map(|m| m.remove(&(module as u64)));
            if let (Some((ctx, _)), Some(p)) = (owner, &probe) {
                let _ = overhead::settle(Hook::cuModuleUnload, ctx, p);
            }
        });
    }
    rc
}

/// `cuCtxSetLimit`: what a limit reserves (the stack at once; the heap and printf FIFO when a
/// module is loaded, measured there) is measured; one that does not fit is set back.
pub unsafe fn set_limit(limit: CUlimit, value: usize) -> CUresult {
    let Some(f) = real::cuCtxSetLimit() else { return MISSING_REAL };
    let mut old = 0usize;
    let known = import::cuCtxGetLimit().is_some_and(|g| unsafe { g(&mut old, limit) } == CUDA_SUCCESS);
    measured_call(
        Hook::cuCtxSetLimit,
        false,
        // The stack is taken at once ("takes effect immediately"); the heap and FIFO at the next
        // first module load, reserved there.
        || if known && limit == CU_LIMIT_STACK_SIZE { stack_estimate(old, value) } else { 0 },
        || unsafe { f(limit, value) },
        || {
            if known {
                unsafe { f(limit, old) };
            }
        },
        |_, _| {},
    )
}
