//! The dynamic-linker side: our `dlsym`, the real `dlsym`, and the driver libraries we open
//! ourselves.
//!
//! `dlsym` is a naked trampoline. glibc resolves `dlsym(RTLD_NEXT, ..)` (and the namespace of
//! `RTLD_DEFAULT`) relative to the object that *called* `dlsym`, found from the return address.
//! A hook that calls the real `dlsym` makes itself the caller, and another preloaded library that
//! finds "its next definition" that way gets itself back and recurses forever (HAMi-core's
//! recursive-dlsym hang). The trampoline asks [`dlsym_decide`] whether to answer itself; if not it
//! *jumps* (not calls) to the real `dlsym`, so the real one sees the original return address.

use crate::config;
use crate::hooks::{self, Lib};
use crate::log::log_at;
use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// The next `dlsym` after us: glibc's, or another preloaded wrapper's. Not exported, so the
/// trampoline can reach it PC-relative.
static VRAMCAP_REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

#[cfg(all(target_arch = "x86_64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // Entry: rsp = 8 mod 16. Keep the arguments, realign, ask Rust.
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "ret",
        // Not ours to answer: tail-jump with the caller's return address still on the stack.
        "2:",
        "jmp qword ptr [rip + {real}]",
        decide = sym dlsym_decide,
        real = sym VRAMCAP_REAL_DLSYM,
    )
}

#[cfg(all(target_arch = "aarch64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {decide}",
        "mov x9, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "cbz x9, 2f",
        "mov x0, x9",
        "ret",
        // x30 holds the original caller again: a plain branch keeps RTLD_NEXT meaning what it did.
        "2:",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "br x16",
        decide = sym dlsym_decide,
        real = sym VRAMCAP_REAL_DLSYM,
    )
}

/// Returns the answer for a `dlsym` we intercept, or NULL to let the real `dlsym` answer.
/// Always leaves `VRAMCAP_REAL_DLSYM` set before returning NULL.
#[cfg_attr(test, allow(dead_code))]
extern "C" fn dlsym_decide(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    if real_dlsym_fn().is_none() {
        // Nothing to jump to. This cannot happen with glibc; failing loudly beats recursing.
        crate::log::write_line("vramcap: cannot find the real dlsym (dlvsym failed); aborting");
        std::process::abort();
    }
    if handle == libc::RTLD_NEXT || symbol.is_null() || in_init() {
        return null_mut();
    }
    std::panic::catch_unwind(|| decide(handle, symbol)).unwrap_or(null_mut())
}

#[cfg_attr(test, allow(dead_code))]
fn decide(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return null_mut();
    }
    let Some(hook) = hooks::find(name) else { return null_mut() };
    if config::get().disabled {
        return null_mut();
    }
    // The caller of our dlsym handed these to dlsym: the same contract holds.
    let found = unsafe { real_dlsym(handle, symbol) };
    if found.is_null() {
        return null_mut();
    }
    let wrapper = hooks::wrapper(hook);
    if found == wrapper || found == hooks::real(hook) {
        return wrapper;
    }
    // The caller has a driver, vramcap has none it can use: our wrapper (which fails: its real
    // function is missing) instead of the caller's driver running uncapped.
    if hooks::info(hook).lib == Lib::Cuda && driver_unusable() {
        return wrapper;
    }
    // The caller's handle resolved to some other definition (another copy of the driver than the
    // one we opened, or a library that merely shares the name): not ours to replace.
    log_at!(
        config::Level::Debug,
        "dlsym({}) resolved outside the driver vramcap opened; passed through",
        String::from_utf8_lossy(name)
    );
    null_mut()
}

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

fn real_dlsym_fn() -> Option<DlsymFn> {
    let mut p = VRAMCAP_REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        // Versioned lookup of the next `dlsym`: dlvsym is not hooked, so this cannot recurse.
        for ver in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), ver.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        if p.is_null() {
            return None;
        }
        VRAMCAP_REAL_DLSYM.store(p, Ordering::Release);
    }
    Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// `dlsym` on a handle we name (never `RTLD_NEXT`: from here that would mean "after vramcap").
///
/// # Safety
/// `handle` must be a handle from `dlopen` (or `RTLD_DEFAULT`) and `symbol` a NUL-terminated string.
pub unsafe fn real_dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    match real_dlsym_fn() {
        Some(f) => unsafe { f(handle, symbol) },
        None => null_mut(),
    }
}

thread_local! {
    /// Set while this thread is inside our own `dlopen` of the driver: anything the driver's
    /// constructors look up meanwhile is passed through untouched.
    static IN_INIT: Cell<u32> = const { Cell::new(0) };
}

#[cfg_attr(test, allow(dead_code))]
fn in_init() -> bool {
    IN_INIT.with(|c| c.get() > 0)
}

struct InitGuard;
impl InitGuard {
    fn enter() -> InitGuard {
        IN_INIT.with(|c| c.set(c.get() + 1));
        InitGuard
    }
}
impl Drop for InitGuard {
    fn drop(&mut self) {
        IN_INIT.with(|c| c.set(c.get() - 1));
    }
}

static HANDLES: [AtomicPtr<c_void>; 2] = [const { AtomicPtr::new(null_mut()) }; 2];
static OPEN_FAILED: [AtomicBool; 2] = [const { AtomicBool::new(false) }; 2];

/// Our own handle on the real driver library. `dlsym(RTLD_NEXT)` cannot see a driver that the
/// runtime loaded `RTLD_LOCAL`, so we open it ourselves (the loader returns the already-loaded
/// copy). Opening is lazy: a process that never touches CUDA never loads the driver because of us.
pub fn library(lib: Lib) -> *mut c_void {
    let i = lib as usize;
    let h = HANDLES[i].load(Ordering::Acquire);
    if !h.is_null() || OPEN_FAILED[i].load(Ordering::Relaxed) {
        return h;
    }
    let path = library_path(lib);
    let c = CString::new(path.clone()).unwrap_or_else(|_| CString::from(c"libcuda.so.1"));
    let opened = {
        let _guard = InitGuard::enter();
        unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) }
    };
    if opened.is_null() {
        if !OPEN_FAILED[i].swap(true, Ordering::AcqRel) {
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
            };
            crate::log::write_line(&format!("vramcap: cannot open {path}: {why}{}", consequence(lib)));
        }
        return null_mut();
    }
    // A library that loads but is no driver (a wrong VRAMCAP_REAL_LIBCUDA) is as unusable as a
    // missing one: every slot would be empty while the process's own driver runs uncapped.
    if lib == Lib::Cuda && unsafe { real_dlsym(opened, c"cuInit".as_ptr()) }.is_null() {
        if !OPEN_FAILED[i].swap(true, Ordering::AcqRel) {
            crate::log::write_line(&format!("vramcap: {path} is not a CUDA driver (it has no cuInit){}", consequence(lib)));
        }
        return null_mut();
    }
    // A racing thread may have opened it too: the loader hands both the same handle.
    match HANDLES[i].compare_exchange(null_mut(), opened, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => opened,
        Err(winner) => winner,
    }
}

fn consequence(lib: Lib) -> &'static str {
    match lib {
        Lib::Cuda => "; every CUDA call will fail (vramcap never runs uncapped): point VRAMCAP_REAL_LIBCUDA at the driver or unset it",
        Lib::Nvml => "; NVML shows the physical view",
    }
}

/// Whether the CUDA driver is loaded in this process (by us or anyone), without loading it.
pub fn driver_loaded() -> bool {
    if !HANDLES[Lib::Cuda as usize].load(Ordering::Acquire).is_null() {
        return true;
    }
    let Ok(c) = CString::new(library_path(Lib::Cuda)) else { return false };
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return false;
    }
    unsafe { libc::dlclose(h) };
    true
}

/// The driver vramcap opened cannot be used (missing, or not a driver): every CUDA entry point
/// vramcap wraps must then deny, whichever way the caller found it.
pub fn driver_unusable() -> bool {
    library(Lib::Cuda).is_null()
}

pub fn library_path(lib: Lib) -> String {
    match lib {
        Lib::Cuda => config::get().real_libcuda.clone().unwrap_or_else(|| "libcuda.so.1".into()),
        // Never the caller's choice in a setuid/setgid/capability process (config::ceiling).
        Lib::Nvml => std::env::var("VRAMCAP_REAL_LIBNVML")
            .ok()
            .filter(|v| !v.trim().is_empty() && !config::ceiling::secure_mode() && config::get().ceiling.is_none())
            .unwrap_or_else(|| "libnvidia-ml.so.1".into()),
    }
}

/// A lazily resolved pointer to one real driver function.
pub struct Slot {
    /// NUL-terminated exported name.
    pub cname: &'static str,
    pub lib: Lib,
    ptr: AtomicPtr<c_void>,
}

/// Cached "the driver has no such symbol".
const MISSING: *mut c_void = 1 as *mut c_void;

impl Slot {
    pub const fn new(cname: &'static str, lib: Lib) -> Slot {
        Slot { cname, lib, ptr: AtomicPtr::new(null_mut()) }
    }

    #[inline]
    pub fn get(&self) -> *mut c_void {
        let p = self.ptr.load(Ordering::Acquire);
        if p == MISSING {
            return null_mut();
        }
        if !p.is_null() {
            return p;
        }
        self.resolve()
    }

    #[cold]
    fn resolve(&self) -> *mut c_void {
        let h = library(self.lib);
        if h.is_null() {
            return null_mut();
        }
        // `cname` is NUL-terminated by construction (the hook tables append "\0").
        let p = unsafe { real_dlsym(h, self.cname.as_ptr().cast()) };
        self.ptr.store(if p.is_null() { MISSING } else { p }, Ordering::Release);
        p
    }
}
