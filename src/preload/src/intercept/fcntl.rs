//! `fcntl` and `fcntl64`, interposed so that an application cannot drop the OFD locks vramcap
//! keeps on exported memory (issue 23). Each export takes an OFD read lock on byte
//! `LOCK_BASE + id` of the exported open file description, and the group reads `/proc/locks`: a
//! listed lock means some copy of the fd is open somewhere and the memory may still be imported,
//! so it stays charged. Any holder of a copy could remove that lock with an unlock of the whole
//! file (`F_OFD_SETLK`, `F_UNLCK`, start 0, length 0) and keep the fd: the group would give the
//! memory back while it can still be imported (a cap bypass). Only an OFD unlock on the same
//! description removes an OFD lock (process-associated locks, `lockf` and `flock` are other
//! owners), so only `F_OFD_SETLK` / `F_OFD_SETLKW` with `F_UNLCK` are looked at.
//!
//! The application's unlock goes to the kernel exactly as it asked (its own locks go, whatever
//! they were): vramcap never narrows it, since a narrowed unlock leaves the application holding a
//! lock it released. Before it, the description's own lock list (`/proc/self/fdinfo`) is read for
//! vramcap's locks: one-byte read locks in `[LOCK_BASE, LOCK_END)`, bytes no application or
//! driver uses; after a successful unlock those are taken again (one read lock per byte, as
//! before: taking a lock that is still there changes nothing). A lock of vramcap's that an
//! application's own lock had merged with (the application locked a range covering it, then
//! unlocked) is no longer one byte and is not told apart: it goes with the application's.
//!
//! Not covered (docs/coverage.md): that merged case, a raw `syscall(SYS_fcntl, ..)`, glibc's
//! `__fcntl` (another name of the same function, which programs do not call), and a process that
//! holds a copy of the fd without vramcap preloaded.
//!
//! The hook allocates nothing, writes nothing and logs nothing: `fcntl` is async-signal-safe and
//! called from everywhere (allocators, loggers, signal handlers). It reads the lock list with
//! `open`/`read`/`close` into a stack buffer, and restores `errno`. It reads no configuration
//! either (that may allocate): with vramcap disabled nobody takes the reserved bytes, so there is
//! nothing to take again. Its parsing cannot panic, so nothing needs `catch_unwind`.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use vramcap_common::group_ledger::kept::{LOCK_BASE, LOCK_END};

/// vramcap's one-byte locks a description can hold that are taken again after an unlock (an
/// exported fd holds one; more are restored in order, the rest left to the application's unlock).
const KEPT: usize = 16;

/// The real function behind a hook; the third argument is passed as a word (see [`fcntl`]).
pub type FcntlFn = unsafe extern "C" fn(c_int, c_int, usize) -> c_int;

fn errno() -> c_int {
    unsafe { *libc::__errno_location() }
}

fn set_errno(e: c_int) {
    unsafe { *libc::__errno_location() = e };
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
    // One read of the application's request; the kernel gets this copy, never the application's
    // memory, which another thread could change after the decision (a read lock turned into an
    // unlock after the lock list was read). F_OFD_SETLK(W) writes nothing back.
    let req: libc::flock = unsafe { std::ptr::read_unaligned(arg as *const libc::flock) };
    if req.l_type != libc::F_UNLCK as libc::c_short {
        return unsafe { real(fd, cmd, &req as *const libc::flock as usize) };
    }
    let saved = errno();
    let mut ours = [0u64; KEPT];
    let n = our_locks(fd, &mut ours);
    set_errno(saved);
    let rc = unsafe { real(fd, cmd, &req as *const libc::flock as usize) };
    if rc == 0 && n > 0 {
        let saved = errno();
        for &byte in &ours[..n] {
            relock(fd, byte);
        }
        set_errno(saved);
    }
    rc
}

/// Takes vramcap's read lock on `byte` of `fd` again (the system call: `fcntl` is this hook).
fn relock(fd: c_int, byte: u64) {
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_RDLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = byte as i64;
    l.l_len = 1;
    unsafe { libc::syscall(libc::SYS_fcntl, fd as libc::c_long, libc::F_OFD_SETLK as libc::c_long, &l as *const libc::flock) };
}

/// vramcap's locks on `fd`'s description (one-byte read locks in `[LOCK_BASE, LOCK_END)`) as
/// `/proc/self/fdinfo/FD` lists them, into `out`; returns how many (0 when it cannot be read).
fn our_locks(fd: c_int, out: &mut [u64; KEPT]) -> usize {
    if fd < 0 {
        return 0;
    }
    let mut path = *b"/proc/self/fdinfo/\0\0\0\0\0\0\0\0\0\0\0\0";
    let mut digits = [0u8; 10];
    let (mut v, mut k) = (fd as u32, 0);
    loop {
        digits[k] = b'0' + (v % 10) as u8;
        k += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for (i, d) in digits[..k].iter().rev().enumerate() {
        path[18 + i] = *d;
    }
    let f = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if f < 0 {
        return 0;
    }
    let mut n = 0;
    let (mut buf, mut line, mut len) = ([0u8; 1024], [0u8; 256], 0usize);
    'read: loop {
        let got = unsafe { libc::read(f, buf.as_mut_ptr().cast(), buf.len()) };
        if got <= 0 {
            break;
        }
        for &c in &buf[..got as usize] {
            if c != b'\n' {
                if len < line.len() {
                    line[len] = c;
                }
                len += 1;
                continue;
            }
            if len <= line.len()
                && let Some(byte) = one_byte_lock(&line[..len])
                && n < KEPT
            {
                out[n] = byte;
                n += 1;
                if n == KEPT {
                    break 'read;
                }
            }
            len = 0;
        }
    }
    unsafe { libc::close(f) };
    n
}

/// The byte of a `lock:` line of fdinfo that is one of vramcap's: `lock:\t1: OFDLCK ADVISORY  READ
/// -1 00:01:1025 B B`, B in `[LOCK_BASE, LOCK_END)`.
pub fn one_byte_lock(line: &[u8]) -> Option<u64> {
    let rest = line.strip_prefix(b"lock:")?;
    let mut f = rest.split(|c| c.is_ascii_whitespace()).filter(|w| !w.is_empty());
    let (_, kind, _, mode, _, _, first, last) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    if kind != b"OFDLCK" || mode != b"READ" || first != last {
        return None;
    }
    let byte = first.iter().try_fold(0u64, |a, &c| if c.is_ascii_digit() { a.checked_mul(10)?.checked_add(u64::from(c - b'0')) } else { None })?;
    (LOCK_BASE..LOCK_END).contains(&byte).then_some(byte)
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
