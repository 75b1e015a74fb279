//! Libraries (CUDA 12.0: `cuLibraryLoadData`, `cuLibraryLoadFromFile`, `cuLibraryUnload`): code
//! loaded independently of any context. The driver documents that with eager loading
//! (`CUDA_MODULE_LOADING=EAGER`) a library is loaded into every context that exists at the call
//! and into every context created later, until it is unloaded; with lazy loading, into a context
//! only when a function of it is first needed there. What that takes (each copy's `__device__`
//! globals, and the heap and printf FIFO a context's first module brings) is measured like a
//! module's (`overhead`): the books of every device that holds a context, around the call. The
//! calls that only look a library up (`cuLibraryGetGlobal`, `cuLibraryGetKernel`,
//! `cuKernelGetFunction`, ...) pass through unwrapped.
//!
//! Charged to: on a device with exactly one context, that context (a copy and its heap go with
//! it when it ends, as a module's do); on a device with several, no context — which of them ends
//! first is unknown, and charging any one could give back copies the others still hold. At least
//! the image's globals (an ELF cubin's `.nv.global*` sizes) are charged per context, whatever the
//! books say: with lazy loading the driver takes them later, at a launch vramcap does not see.
//! A load that does not fit is unloaded again and refused with `CUDA_ERROR_OUT_OF_MEMORY`.
//!
//! Given back at `cuLibraryUnload`: what the books say the unload gave back on each device, never
//! more than the library was charged there, and — when contexts were created on the device since
//! the load, whose copies were measured as part of their own size — never more than the image's
//! globals. What stays (the heaps, copies in contexts that ended first) goes with the one
//! context it was charged to; charged to no context, it goes only if no context is left on the
//! device at the unload, else it stays charged: a false denial at worst, never memory past the cap.

use super::context::serial;
use super::{MISSING_REAL, Mode, context, guarded, mode, overhead};
use crate::ffi::*;
use crate::hooks::{Hook, import, real};
use crate::ledger::{self, MAX_DEVICES};
use crate::sync::Lock;
use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void};

/// What a library was charged on one device.
struct Share {
    dev: usize,
    /// The device's one context at the load, or 0: charged to no context.
    owner: u64,
    bytes: u64,
    /// What was reserved and is charged at least: the image's globals times the contexts it was
    /// loaded into, and the current context's heap and FIFO when the load brings them.
    globals: u64,
    /// The contexts on the device at the load.
    ctxs: Vec<u64>,
}

/// Loaded libraries (taken only under `context::serial()`).
static LIBRARIES: Lock<Option<HashMap<u64, Vec<Share>>>> = Lock::new(None);

/// The globals of one copy of each loaded library (taken only under `context::serial()`): what
/// a context made while it is loaded gets (eager loading), whether or not a context existed at
/// the load.
static IMAGES: Lock<Option<HashMap<u64, u64>>> = Lock::new(None);

/// What a context made now takes for the loaded libraries: a copy of each (its globals) with
/// eager loading, nothing with lazy loading (a copy is made at first use, unseen).
pub(super) fn copies_for_a_new_context() -> u64 {
    if !eager_loading() {
        return 0;
    }
    IMAGES.lock().as_ref().map_or(0, |m| m.values().fold(0, |a, &b| a.saturating_add(b)))
}

/// Whether libraries load into every context at once (`CUDA_MODULE_LOADING=EAGER`) or into a
/// context at a function's first use (`LAZY`). Unset, the driver's default: lazy from CUDA 12.2
/// on, eager before (and where the driver cannot say its version: eager, the larger estimate).
pub(super) fn eager_loading() -> bool {
    static EAGER: once_cell::sync::OnceCell<bool> = once_cell::sync::OnceCell::new();
    *EAGER.get_or_init(|| match std::env::var("CUDA_MODULE_LOADING").ok().as_deref() {
        Some("EAGER") => true,
        Some("LAZY") => false,
        _ => {
            let mut v = 0;
            let known = import::cuDriverGetVersion().is_some_and(|f| unsafe { f(&mut v) } == CUDA_SUCCESS);
            !known || v < 12020
        }
    })
}

/// The device of a context; `None` where the driver cannot say (before CUDA 13: no
/// `cuCtxGetDevice_v2`).
fn device_of(ctx: u64) -> Option<usize> {
    let f = import::cuCtxGetDevice_v2()?;
    let mut d: CUdevice = -1;
    if unsafe { f(&mut d, ctx as CUcontext) } != CUDA_SUCCESS {
        return None;
    }
    usize::try_from(d).ok()
}

/// The contexts on `dev`: its primary context if active (0 if its handle is unknown) and the
/// created ones (`uses`: `context::serial()`'s map). A context whose device is unknown counts on
/// every device: more contexts can only make a library charged to none of them.
fn contexts_on(uses: &Option<HashMap<u64, u32>>, dev: usize) -> Vec<u64> {
    let mut out = Vec::new();
    if context::primary_active(dev as CUdevice) {
        out.push(context::primary_of(dev as CUdevice));
    }
    for &c in uses.iter().flat_map(|m| m.keys()) {
        if device_of(c).is_none_or(|d| d == dev) {
            out.push(c);
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn charge(api: Hook, lib: u64, s: &Share, reserved: u64) -> Result<(), CUresult> {
    match s.owner {
        0 => overhead::charge_unowned(api, lib, s.dev, s.bytes, reserved),
        ctx => overhead::charge(api, ctx, s.dev, s.bytes, reserved, false),
    }
}

fn give_back(api: Hook, lib: u64, s: &Share, bytes: u64) {
    match s.owner {
        0 => overhead::give_back(api, lib, s.dev, bytes),
        ctx => overhead::shrink(api, ctx, bytes),
    }
}

fn load(api: Hook, out: *mut CUlibrary, globals: impl FnOnce() -> u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() != Mode::Enforce {
        return call();
    }
    let uses = serial();
    if let Err(e) = super::init::ensure_limits() {
        return e.code();
    }
    let globals = guarded(0, globals);
    let eager = eager_loading();
    // Before the call: on each device with a context, the books, and the image's globals per
    // context reserved (books first: a reading must not count our own reservation).
    let mut before: Vec<(Share, Option<overhead::Probe>)> = Vec::new();
    for dev in 0..ledger::device_count().min(MAX_DEVICES) {
        let ctxs = guarded(Vec::new(), || contexts_on(&uses, dev));
        if ctxs.is_empty() {
            continue;
        }
        let probe = guarded(None, || Some(overhead::probe(dev)));
        // Eagerly loaded, the first copy in a context brings its heap and FIFO too: reserved for
        // the current context, whose sizes `cuCtxGetLimit` can tell (the others' are measured).
        let heap = match super::current() {
            Some((d, c)) if d == dev && eager && ctxs.contains(&c) => super::modules::heap_estimate(c),
            _ => 0,
        };
        let want = globals.saturating_mul(ctxs.len() as u64).saturating_add(heap);
        if want > 0
            && let Err(e) = guarded(Err(CUDA_ERROR_OUT_OF_MEMORY), || overhead::reserve(api, dev, want))
        {
            before.iter().for_each(|(s, _)| ledger::unreserve(s.dev, s.globals));
            return e;
        }
        let owner = if ctxs.len() == 1 { ctxs[0] } else { 0 };
        before.push((Share { dev, owner, bytes: 0, globals: want, ctxs }, probe));
    }
    let rc = call();
    if rc != CUDA_SUCCESS {
        before.iter().for_each(|(s, _)| ledger::unreserve(s.dev, s.globals));
        return rc;
    }
    // Loaded eagerly into each of them, even if undone below: their heaps are taken. Lazily, into
    // none yet: a module loaded next still brings its context's heap.
    if eager {
        guarded((), || before.iter().flat_map(|(s, _)| &s.ctxs).filter(|&&c| c != 0).for_each(|&c| overhead::note_heap(c)));
    }
    let lib = unsafe { *out } as u64;
    let mut shares = Vec::new();
    let mut refused = false;
    for (mut s, p) in before {
        if refused {
            ledger::unreserve(s.dev, s.globals);
            shares.push((s, p));
            continue;
        }
        let measured = p.as_ref().and_then(|p| guarded(None, || overhead::measured(p, s.globals)));
        s.bytes = measured.map_or(0, |d| d.clamp(0, u64::MAX as i128) as u64).max(s.globals);
        if guarded(Err(CUDA_ERROR_OUT_OF_MEMORY), || charge(api, lib, &s, s.globals)).is_err() {
            refused = true;
            s.bytes = 0;
        }
        shares.push((s, p));
    }
    if refused {
        undo(api, lib, shares);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    guarded((), || {
        LIBRARIES.lock().get_or_insert_with(HashMap::new).insert(lib, shares.into_iter().map(|(s, _)| s).collect());
        IMAGES.lock().get_or_insert_with(HashMap::new).insert(lib, globals);
    });
    drop(uses);
    rc
}

/// A load that does not fit: what was charged goes, the library is unloaded again (the real
/// driver's unload, directly), and what the driver still holds since the load's readings (a heap
/// stays with its context) is charged as it is.
fn undo(api: Hook, lib: u64, shares: Vec<(Share, Option<overhead::Probe>)>) {
    guarded((), || shares.iter().for_each(|(s, _)| give_back(api, lib, s, s.bytes)));
    if let Some(unload) = real::cuLibraryUnload() {
        unsafe { unload(lib as CUlibrary) };
    }
    guarded((), || {
        for (s, p) in &shares {
            match (s.owner, p) {
                (_, None) => {}
                (0, Some(p)) => overhead::keep_unowned(api, lib, p),
                (ctx, Some(p)) => overhead::settle_kept(api, ctx, p),
            }
        }
    });
}

/// The image's globals are read as a module's are (`modules::image_globals`: ELF headers only).
pub unsafe fn load_data(
    lib: *mut CUlibrary,
    code: *const c_void,
    jit: *mut CUjit_option,
    jit_values: *mut *mut c_void,
    n_jit: c_uint,
    opts: *mut CUlibraryOption,
    opt_values: *mut *mut c_void,
    n_opts: c_uint,
) -> CUresult {
    let Some(f) = real::cuLibraryLoadData() else { return MISSING_REAL };
    load(Hook::cuLibraryLoadData, lib, || super::modules::image_globals(code), || unsafe {
        f(lib, code, jit, jit_values, n_jit, opts, opt_values, n_opts)
    })
}

pub unsafe fn load_from_file(
    lib: *mut CUlibrary,
    path: *const c_char,
    jit: *mut CUjit_option,
    jit_values: *mut *mut c_void,
    n_jit: c_uint,
    opts: *mut CUlibraryOption,
    opt_values: *mut *mut c_void,
    n_opts: c_uint,
) -> CUresult {
    let Some(f) = real::cuLibraryLoadFromFile() else { return MISSING_REAL };
    load(Hook::cuLibraryLoadFromFile, lib, || super::modules::file_globals(path), || unsafe {
        f(lib, path, jit, jit_values, n_jit, opts, opt_values, n_opts)
    })
}

/// `cuLibraryUnload` unloads the library from every context: what the books say each device gave
/// back goes (see the module's comment for the bounds).
pub unsafe fn unload(lib: CUlibrary) -> CUresult {
    let Some(f) = real::cuLibraryUnload() else { return MISSING_REAL };
    if mode() != Mode::Enforce {
        return unsafe { f(lib) };
    }
    let uses = serial();
    let key = lib as u64;
    let shares = guarded(None, || LIBRARIES.lock().as_mut().and_then(|m| m.remove(&key))).unwrap_or_default();
    let probes: Vec<_> = shares.iter().map(|s| guarded(None, || Some(overhead::probe(s.dev)))).collect();
    let rc = unsafe { f(lib) };
    if rc == CUDA_SUCCESS {
        guarded((), || {
            IMAGES.lock().as_mut().map(|m| m.remove(&key));
        });
    }
    if rc != CUDA_SUCCESS {
        guarded((), || {
            if !shares.is_empty() {
                LIBRARIES.lock().get_or_insert_with(HashMap::new).insert(key, shares);
            }
        });
        return rc;
    }
    guarded((), || {
        for (s, p) in shares.iter().zip(&probes) {
            let freed = p.as_ref().and_then(|p| overhead::measured(p, 0)).map_or(0, |d| (-d).clamp(0, u64::MAX as i128) as u64);
            let now = contexts_on(&uses, s.dev);
            // Contexts made since the load hold copies measured as part of their own size.
            let bound = if now.iter().any(|c| !s.ctxs.contains(c)) { s.globals } else { s.bytes };
            let mut back = freed.min(bound).min(s.bytes);
            if s.owner == 0 && now.is_empty() {
                back = s.bytes;
            }
            give_back(Hook::cuLibraryUnload, key, s, back);
        }
    });
    rc
}
