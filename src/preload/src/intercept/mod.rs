//! The wrappers behind the hook table. Every wrapper follows one shape: decide (reserve against
//! the ledger), call the real driver exactly once outside any `catch_unwind`, then record. A panic
//! in bookkeeping is contained by [`guarded`] and can never repeat or skip the driver call.

pub mod arrays;
pub mod books;
pub mod charge;
pub mod context;
pub mod cubin;
// The hooks rely on how these targets pass variadic arguments (see the module).
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
pub mod fcntl;
pub mod handles;
pub mod graph;
pub mod graph_nodes;
pub mod green;
pub mod host;
pub mod init;
pub mod libraries;
pub mod location;
pub mod managed;
pub mod mem;
pub mod nvml;
pub mod nvml_early;
pub mod overhead;
pub mod modules;
pub mod moves;
pub mod pool;
pub mod pool_table;
pub mod pressure;
pub mod procaddr;
pub mod shareable;
pub mod vmm;

use crate::config;
use crate::ffi::*;
use crate::hooks::import;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

/// Returned when the driver lacks the function a wrapper stands for (we never guess an ABI).
pub const MISSING_REAL: CUresult = 302; // CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// `VRAMCAP_DISABLE=1`: forward everything untouched.
    PassThrough = 1,
    /// Normal operation: count and cap.
    Enforce = 2,
    /// The configuration is invalid: hand out no device memory at all.
    FailClosed = 3,
}

/// The mode, cached in one byte (0: not yet known): every wrapper asks, so this is one load.
/// Found out by the first wrapper a process calls, which also turns the trace on.
static MODE: AtomicU8 = AtomicU8::new(0);

#[inline]
pub fn mode() -> Mode {
    match MODE.load(Ordering::Relaxed) {
        1 => Mode::PassThrough,
        2 => Mode::Enforce,
        3 => Mode::FailClosed,
        _ => first_mode(),
    }
}

/// The first wrapper of the process: reads the configuration, and events start being recorded
/// here if a trace or a sidecar wants them (the configuration itself starts nothing). Out of
/// line, so every wrapper's inlined `mode()` stays one load and a compare.
#[cold]
#[inline(never)]
fn first_mode() -> Mode {
    let c = config::get();
    crate::trace::configure(c, crate::hooks::api_name);
    let m = if c.error.is_some() {
        Mode::FailClosed
    } else if c.disabled {
        Mode::PassThrough
    } else {
        Mode::Enforce
    };
    MODE.store(m as u8, Ordering::Relaxed);
    m
}

/// Runs bookkeeping with panics contained; `fallback` is what a panic yields.
#[inline]
pub fn guarded<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// The device of the calling thread's current context, as the driver sees it.
pub fn current_device() -> Option<usize> {
    let f = import::cuCtxGetDevice()?;
    let mut dev: CUdevice = -1;
    let rc = unsafe { f(&mut dev) };
    (rc == CUDA_SUCCESS && dev >= 0).then_some(dev as usize)
}

/// Bumped whenever a context may have been destroyed, so cached (context → device) answers
/// taken before cannot outlive a context whose address is reused.
static CONTEXT_GENERATION: AtomicU32 = AtomicU32::new(0);

thread_local! {
    /// (context, its device, generation): a context's device never changes, so one driver call
    /// (`cuCtxGetCurrent`) per allocation answers both "which context" and "which device".
    static LAST_CONTEXT: Cell<(u64, usize, u32)> = const { Cell::new((0, 0, u32::MAX)) };
}

pub fn contexts_changed() {
    CONTEXT_GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// The calling thread's current context and its device (`None` without a current context).
#[inline]
pub fn current() -> Option<(usize, u64)> {
    let ctx = current_context();
    if ctx == 0 {
        return None;
    }
    let generation = CONTEXT_GENERATION.load(Ordering::Acquire);
    if let Ok((c, d, g)) = LAST_CONTEXT.try_with(|c| c.get())
        && c == ctx
        && g == generation
    {
        return Some((d, ctx));
    }
    let dev = current_device()?;
    let _ = LAST_CONTEXT.try_with(|c| c.set((ctx, dev, generation)));
    Some((dev, ctx))
}

/// The calling thread's current context as an integer (0 when none): what a charge is tied to.
pub fn current_context() -> u64 {
    let Some(f) = import::cuCtxGetCurrent() else { return 0 };
    let mut ctx: CUcontext = std::ptr::null_mut();
    if unsafe { f(&mut ctx) } == CUDA_SUCCESS { ctx as u64 } else { 0 }
}
