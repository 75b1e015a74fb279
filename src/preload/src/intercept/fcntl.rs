//! `fcntl` and `fcntl64`, interposed so that an application cannot drop the OFD locks vramcap
//! keeps on exported memory (issue 23). Each export takes an OFD read lock on byte
//! `LOCK_BASE + id` of the exported open file description, and the group reads `/proc/locks`: a
//! listed lock means some copy of the fd is open somewhere and the memory may still be imported,
//! so it stays charged. Any holder of a copy could remove that lock with an unlock of the whole
//! file (`F_OFD_SETLK`, `F_UNLCK`, start 0, length 0) and keep the fd: the group would give the
//! memory back while it can still be imported (a cap bypass). Only an OFD unlock on the same
//! description removes an OFD lock (process-associated locks, `lockf` and `flock` are other
//! owners), so only `F_OFD_SETLK` / `F_OFD_SETLKW` with `F_UNLCK` are changed here: the requested
//! range, computed as the kernel computes it, is unlocked except for `[LOCK_BASE, LOCK_END)`,
//! which no application or driver uses. Everything else reaches the real `fcntl` as it came.
//!
//! Not covered (docs/coverage.md): a raw `syscall(SYS_fcntl, ..)`, glibc's `__fcntl` (another
//! name of the same function, which programs do not call), and a process that holds a copy of
//! the fd without vramcap preloaded.
//!
//! The hook allocates nothing, writes nothing and logs nothing: `fcntl` is async-signal-safe and
//! called from everywhere (allocators, loggers, signal handlers). It reads no configuration
//! either (that may allocate): with vramcap disabled nobody takes the reserved bytes, so keeping
//! them is harmless. Its arithmetic cannot panic (`i128`), so nothing needs `catch_unwind`.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use vramcap_common::group_ledger::kept::{LOCK_BASE, LOCK_END};

/// The kernel's `OFFSET_MAX` (`loff_t` is 64 bits): where a lock of length 0 ends.
pub const OFFSET_MAX: i64 = i64::MAX;

/// A byte range as the kernel keeps a lock: `start..=end` (`fl_start`, `fl_end`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: i64,
    pub end: i64,
}

/// The bytes an application's unlock leaves locked (vramcap's export ids and probe).
pub const RESERVED: Span = Span { start: LOCK_BASE as i64, end: LOCK_END as i64 - 1 };

/// The range of a lock request whose `l_whence` resolved to `base` (0, the file position or the
/// file size): `flock64_to_posix_lock` in the kernel's fs/locks.c, check for check, so that the
/// pieces vramcap unlocks are exactly what the kernel would have unlocked. `Err(errno)`: the
/// kernel refuses the request with that error.
pub fn resolve(base: i64, l_start: i64, l_len: i64) -> Result<Span, c_int> {
    // i128: the kernel's checks are written to avoid overflow; here none can happen at all.
    let (base, l_start, l_len, max) = (base as i128, l_start as i128, l_len as i128, OFFSET_MAX as i128);
    if l_start > max - base {
        return Err(libc::EOVERFLOW);
    }
    let start = base + l_start;
    if start < 0 {
        return Err(libc::EINVAL);
    }
    let (start, end) = if l_len > 0 {
        if l_len - 1 > max - start {
            return Err(libc::EOVERFLOW);
        }
        (start, start + l_len - 1)
    } else if l_len < 0 {
        // POSIX-2001: a negative length covers the bytes before start.
        if start + l_len < 0 {
            return Err(libc::EINVAL);
        }
        (start + l_len, start - 1)
    } else {
        (start, max)
    };
    // Both lie in 0..=OFFSET_MAX now.
    Ok(Span { start: start as i64, end: end as i64 })
}

/// Whether an unlock of `span` would touch vramcap's bytes.
pub fn touches_reserved(span: Span) -> bool {
    span.start <= RESERVED.end && span.end >= RESERVED.start
}

/// What of `span` an application's unlock may remove: all but [`RESERVED`], in at most two
/// pieces (below it, above it); none when `span` lies inside it.
pub fn outside_reserved(span: Span) -> [Option<Span>; 2] {
    let below = (span.start < RESERVED.start).then(|| Span { start: span.start, end: span.end.min(RESERVED.start - 1) });
    let above = (span.end > RESERVED.end).then(|| Span { start: span.start.max(RESERVED.end + 1), end: span.end });
    [below, above]
}

/// `req` narrowed to `span`, as an absolute (`SEEK_SET`) request; everything else (`l_type`,
/// `l_pid`, which the kernel checks too) is kept.
fn request(req: &libc::flock, span: Span) -> libc::flock {
    let mut r = *req;
    r.l_whence = libc::SEEK_SET as libc::c_short;
    r.l_start = span.start;
    // Length 0 is "to OFFSET_MAX"; otherwise end - start + 1 fits (start >= 0, end < OFFSET_MAX).
    r.l_len = if span.end == OFFSET_MAX { 0 } else { span.end - span.start + 1 };
    r
}

/// An absolute request the kernel refuses with `errno` (EINVAL or EOVERFLOW) whatever the file's
/// position: a refused request is still handed to the kernel, so that its own earlier checks (a
/// bad fd, an `O_PATH` fd) decide the error first, as they would have.
fn refused(req: &libc::flock, errno: c_int) -> libc::flock {
    let mut r = *req;
    r.l_whence = libc::SEEK_SET as libc::c_short;
    (r.l_start, r.l_len) = if errno == libc::EOVERFLOW { (OFFSET_MAX, 2) } else { (-1, 0) };
    r
}

/// The real function behind a hook; the third argument is passed as a word (see [`fcntl`]).
pub type FcntlFn = unsafe extern "C" fn(c_int, c_int, usize) -> c_int;

fn set_errno(e: c_int) {
    unsafe { *libc::__errno_location() = e };
}

/// What the kernel takes as `l_whence`'s origin: 0, the file position, or the file's size.
/// `Err(errno)` when it cannot be known. A file without a position to ask for (`lseek` fails with
/// ESPIPE: pipes, sockets, some devices) is refused rather than guessed: a guessed origin could
/// put the unlock over vramcap's bytes. No application is known to unlock relative to the
/// position of such a file.
fn origin(fd: c_int, whence: c_int) -> Result<i64, c_int> {
    let errno = || unsafe { *libc::__errno_location() };
    match whence {
        libc::SEEK_SET => Ok(0),
        libc::SEEK_CUR => {
            let pos = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
            if pos < 0 { Err(errno()) } else { Ok(pos) }
        }
        _ => {
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            if unsafe { libc::fstat(fd, &mut st) } != 0 { Err(errno()) } else { Ok(st.st_size) }
        }
    }
}

/// The hook's body, with the real function to call.
///
/// # Safety
/// As `fcntl(fd, cmd, arg)`: for `F_OFD_SETLK` / `F_OFD_SETLKW`, `arg` is NULL or points to a
/// readable `struct flock`.
pub unsafe fn hook(fd: c_int, cmd: c_int, arg: usize, real: FcntlFn) -> c_int {
    // NULL: the kernel answers EFAULT.
    if (cmd != libc::F_OFD_SETLK && cmd != libc::F_OFD_SETLKW) || arg == 0 {
        return unsafe { real(fd, cmd, arg) };
    }
    // One read of the application's request; the kernel gets this copy (or pieces of it), never
    // the application's memory, which another thread could change after the decision (a read
    // lock turned into an unlock). F_OFD_SETLK(W) writes nothing back, so a copy is equivalent.
    let req: libc::flock = unsafe { std::ptr::read_unaligned(arg as *const libc::flock) };
    let whence = req.l_whence as c_int;
    if req.l_type != libc::F_UNLCK as libc::c_short || ![libc::SEEK_SET, libc::SEEK_CUR, libc::SEEK_END].contains(&whence) {
        // A lock, or a whence the kernel refuses (EINVAL).
        return unsafe { real(fd, cmd, &req as *const libc::flock as usize) };
    }
    let base = match origin(fd, whence) {
        Ok(b) => b,
        Err(e) => {
            set_errno(e);
            return -1;
        }
    };
    let span = match resolve(base, req.l_start, req.l_len) {
        Ok(s) => s,
        Err(e) => return unsafe { real(fd, cmd, &refused(&req, e) as *const libc::flock as usize) },
    };
    if !touches_reserved(span) {
        // SEEK_SET goes as it came; CUR / END as the absolute range just computed (another thread
        // moving the position meanwhile must not move the unlock onto vramcap's bytes).
        let r = if whence == libc::SEEK_SET { req } else { request(&req, span) };
        return unsafe { real(fd, cmd, &r as *const libc::flock as usize) };
    }
    let pieces = outside_reserved(span);
    if pieces.iter().all(Option::is_none) {
        return nothing_to_unlock(fd, &req, real);
    }
    // Every piece is tried (an unlock that fails for want of memory in one may succeed in the
    // other); the result is the first failure's.
    let mut failed = None;
    for span in pieces.into_iter().flatten() {
        let r = request(&req, span);
        if unsafe { real(fd, cmd, &r as *const libc::flock as usize) } != 0 && failed.is_none() {
            failed = Some(unsafe { *libc::__errno_location() });
        }
    }
    match failed {
        None => 0,
        Some(e) => {
            set_errno(e);
            -1
        }
    }
}

/// An unlock that lies wholly inside vramcap's bytes succeeds without a call, unless the kernel
/// would have refused it: `l_pid` not 0 (EINVAL), a closed or `O_PATH` fd (EBADF).
fn nothing_to_unlock(fd: c_int, req: &libc::flock, real: FcntlFn) -> c_int {
    let flags = unsafe { real(fd, libc::F_GETFL, 0) };
    let errno = if flags < 0 {
        unsafe { *libc::__errno_location() }
    } else if flags & libc::O_PATH != 0 {
        libc::EBADF
    } else if req.l_pid != 0 {
        libc::EINVAL
    } else {
        return 0;
    };
    set_errno(errno);
    -1
}

/// The raw system call: what is left when the C library has neither `fcntl` nor `fcntl64` after
/// us (never with glibc). `syscall` sets errno.
unsafe extern "C" fn syscall_fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    unsafe { libc::syscall(libc::SYS_fcntl, fd as libc::c_long, cmd as libc::c_long, arg) as c_int }
}

static REAL_FCNTL: AtomicPtr<c_void> = AtomicPtr::new(null_mut());
static REAL_FCNTL64: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// The next definition of `name` after vramcap (or of `other`, if the C library lacks `name`),
/// looked up once: `dlsym(RTLD_NEXT)` from this library means "after us". Never one of our own
/// hooks: calling that would recurse.
fn real(cache: &AtomicPtr<c_void>, name: &std::ffi::CStr, other: &std::ffi::CStr) -> FcntlFn {
    let mut p = cache.load(Ordering::Acquire);
    if p.is_null() {
        let ours = [fcntl as *mut c_void, fcntl64 as *mut c_void];
        for n in [name, other] {
            p = unsafe { crate::dl::real_dlsym(libc::RTLD_NEXT, n.as_ptr()) };
            if !p.is_null() && !ours.contains(&p) {
                break;
            }
            p = null_mut();
        }
        if p.is_null() {
            p = syscall_fcntl as *mut c_void;
        }
        // Racing threads find the same answer: either store is right.
        cache.store(p, Ordering::Release);
    }
    unsafe { std::mem::transmute::<*mut c_void, FcntlFn>(p) }
}

// `fcntl(int fd, int cmd, ...)` is variadic in C. On x86_64 and aarch64 Linux (System V and
// AAPCS64 calling conventions) a variadic call passes its integer and pointer arguments in the
// same registers as a plain call, so a non-variadic function with a word for the third argument
// receives it correctly, whatever `cmd` expects there (an int, a pointer, nothing). Elsewhere
// (and Apple's aarch64 ABI, which puts variadic arguments on the stack) this would be wrong, so
// the module exists only on these targets (`intercept/mod.rs`). In unit tests they are not exported (the test binary
// keeps the C library's `fcntl`); the tests call [`hook`] directly.

/// `fcntl`, interposed (see the module).
///
/// # Safety
/// As the C library's `fcntl`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    unsafe { hook(fd, cmd, arg, real(&REAL_FCNTL, c"fcntl", c"fcntl64")) }
}

/// `fcntl64`, interposed: glibc (2.28 and later) binds a caller's `fcntl` to it when the caller
/// is built with 64-bit file offsets. Forwards to the real `fcntl64`.
///
/// # Safety
/// As the C library's `fcntl64`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    unsafe { hook(fd, cmd, arg, real(&REAL_FCNTL64, c"fcntl64", c"fcntl")) }
}

#[cfg(test)]
#[path = "fcntl_tests.rs"]
mod tests;
