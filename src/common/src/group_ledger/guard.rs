//! A ledger truncated while mapped (`: > file`, a careless admin) must not kill anyone: touching
//! a `MAP_SHARED` page past the end of its file raises SIGBUS. Checking the size before every
//! use would cost a system call per allocation and still race the truncation, so instead:
//!
//! - every mapped ledger's address range is registered here (a fixed table of atomics);
//! - a SIGBUS handler, installed once when the first ledger is mapped, looks at the faulting
//!   address. Inside a registered range it swaps the whole range, in one `mremap`, for private
//!   memory prepared to refuse every reservation (each device's limit 1 byte, nothing used),
//!   records the loss and returns: the interrupted instruction runs again on that memory. The
//!   member then denies group allocations with a line saying why ([`lost`]); frees go on.
//! - any other SIGBUS goes to the handler that was there before us, or gets the default action
//!   (the process dies as it would have without vramcap).
//!
//! An application that later installs its own SIGBUS handler replaces ours (docs/security.md).

use super::shm::{DEVICES, Shared};
use std::cell::UnsafeCell;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering::*};

const RANGES: usize = 64;
static BASE: [AtomicUsize; RANGES] = [const { AtomicUsize::new(0) }; RANGES];
static LEN: [AtomicUsize; RANGES] = [const { AtomicUsize::new(0) }; RANGES];
/// 0: file-backed; 1: being replaced; 2: replaced.
static STATE: [AtomicU8; RANGES] = [const { AtomicU8::new(0) }; RANGES];
static LOST: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

struct Prev(UnsafeCell<libc::sigaction>);
// Written once, under `INSTALL`, before our handler can run; only read afterwards.
unsafe impl Sync for Prev {}
static PREV: Prev = Prev(UnsafeCell::new(unsafe { std::mem::zeroed() }));

/// Whether a mapped ledger was truncated under us (and replaced by a refusing copy).
pub fn lost() -> bool {
    LOST.load(Relaxed)
}

/// Guards `len` bytes at `base` (a ledger mapping). False when the table is full: the caller
/// then maps without protection, as before.
pub fn protect(base: usize, len: usize) -> bool {
    INSTALL.call_once(install);
    for i in 0..RANGES {
        if BASE[i].compare_exchange(0, usize::MAX, AcqRel, Relaxed).is_ok() {
            STATE[i].store(0, Relaxed);
            LEN[i].store(len, Release);
            BASE[i].store(base, Release);
            return true;
        }
    }
    false
}

/// Before unmapping `base`.
pub fn unprotect(base: usize) {
    for b in &BASE {
        if b.compare_exchange(base, 0, AcqRel, Relaxed).is_ok() {
            return;
        }
    }
}

fn install() {
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, PREV.0.get());
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let addr = unsafe { (*info).si_addr() } as usize;
    for i in 0..RANGES {
        let (base, len) = (BASE[i].load(Acquire), LEN[i].load(Acquire));
        if base == 0 || base == usize::MAX || addr < base || addr >= base + len {
            continue;
        }
        match STATE[i].compare_exchange(0, 1, AcqRel, Acquire) {
            Ok(_) => {
                let ok = unsafe { replace(base, len) };
                STATE[i].store(if ok { 2 } else { 0 }, Release);
                if ok {
                    LOST.store(true, Release);
                    return;
                }
            }
            // Another thread is replacing it: the instruction runs again once it is done.
            Err(_) => return,
        }
    }
    unsafe { chain(sig, info, ctx) };
}

/// Prepares refusing memory elsewhere, then moves it over the range in one step: no thread
/// ever sees a zeroed ledger (a zero limit means "no limit").
unsafe fn replace(base: usize, len: usize) -> bool {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let tmp = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    if tmp == libc::MAP_FAILED {
        return false;
    }
    let s = unsafe { &*(tmp as *const Shared) };
    for d in s.devices.iter().take(DEVICES) {
        d.limit.store(1, Relaxed);
    }
    let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
    let moved = unsafe { libc::mremap(tmp, len, len, flags, base as *mut libc::c_void) };
    if moved as usize != base {
        unsafe { libc::munmap(tmp, len) };
        return false;
    }
    true
}

/// Not ours: what would have happened without us.
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let prev = unsafe { &*PREV.0.get() };
    let h = prev.sa_sigaction;
    if h != libc::SIG_DFL && h != libc::SIG_IGN {
        if prev.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = unsafe { std::mem::transmute(h) };
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
            f(sig);
        }
        return;
    }
    // Default action: restore it and deliver the signal again (blocked until we return).
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
        libc::raise(sig);
    }
}
