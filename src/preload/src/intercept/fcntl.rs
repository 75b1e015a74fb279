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
//! lock it released. vramcap remembers, in a fixed table ([`remember`]), each byte it locked on an
//! exported (or received, or re-exported) file: (device, inode, byte). An unlock on a file with
//! none (every application's own file) goes straight through, after one `fstat`. On a file with
//! some, the description's lock list (`/proc/self/fdinfo`) says which of those bytes it holds,
//! whatever range covers them (an application's own lock merged with ours too), and after a
//! successful unlock those are taken again, one read lock per byte. Bytes an application locks
//! itself in vramcap's range are never taken again: they are not in the table. A list that cannot
//! be read (no `/proc`, the process at its fd limit) restores every remembered byte of the file:
//! that may leave a lock of ours on another description of the same file (it keeps the memory
//! charged longer, never shorter).
//!
//! Not covered (docs/coverage.md): a raw `syscall(SYS_fcntl, ..)`, glibc's `__fcntl` (another
//! name of the same function, which programs do not call), a process that holds a copy of the fd
//! without vramcap preloaded or without having imported it, more than [`MINE`] remembered bytes.
//!
//! The hook allocates nothing, writes nothing and logs nothing: `fcntl` is async-signal-safe and
//! called from everywhere (allocators, loggers, signal handlers). It reads the lock list with
//! `open`/`read`/`close` into a stack buffer, and restores `errno`. It reads no configuration
//! either (that may allocate). Its parsing cannot panic, so nothing needs `catch_unwind`.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use vramcap_common::group_ledger::kept::{LOCK_BASE, LOCK_END};

/// Bytes vramcap remembers having locked on exported files (one per export of an allocation
/// here, per re-export, per received fd imported); past them, an unlock is not undone.
pub const MINE: usize = 256;

/// One remembered byte: `state` 0 free, 1 being written, 2 set.
struct Mine {
    state: AtomicU64,
    dev: AtomicU64,
    ino: AtomicU64,
    byte: AtomicU64,
}

static TABLE: [Mine; MINE] =
    [const { Mine { state: AtomicU64::new(0), dev: AtomicU64::new(0), ino: AtomicU64::new(0), byte: AtomicU64::new(0) } }; MINE];

/// `fstat(fd)`; `None` for a bad fd.
fn stat_of(fd: c_int) -> Option<libc::stat> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st)
}

/// A file's identity from `fstat` (device, inode); `None` for a bad fd.
pub fn file_of(fd: c_int) -> Option<(u64, u64)> {
    stat_of(fd).map(|st| (st.st_dev, st.st_ino))
}

/// vramcap locked `byte` (in its range) on `fd`'s file: remembered for the life of the process
/// (false when the table is full: that byte is not taken again after an application's unlock).
pub fn remember(fd: c_int, byte: u64) -> bool {
    let Some((dev, ino)) = file_of(fd) else { return false };
    if !(LOCK_BASE..LOCK_END).contains(&byte) {
        return false;
    }
    let same = |m: &Mine| m.state.load(Ordering::Acquire) == 2 && m.byte.load(Ordering::Relaxed) == byte && m.dev.load(Ordering::Relaxed) == dev && m.ino.load(Ordering::Relaxed) == ino;
    if TABLE.iter().any(same) {
        return true;
    }
    for m in &TABLE {
        if m.state.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            m.dev.store(dev, Ordering::Relaxed);
            m.ino.store(ino, Ordering::Relaxed);
            m.byte.store(byte, Ordering::Relaxed);
            m.state.store(2, Ordering::Release);
            return true;
        }
    }
    false
}

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
    let ours = stat_of(fd).and_then(|st| {
        let file = (st.st_dev, st.st_ino);
        if remembered(file) { Some(Some(file)) } else { exported_kind(fd, &st).then_some(None) }
    });
    set_errno(saved);
    match ours {
        // Every application's own file: nothing of ours on it.
        None => unsafe { real(fd, cmd, &req as *const libc::flock as usize) },
        Some(file) => unsafe { unlock_keeping_ours(fd, cmd, &req, real, file) },
    }
}

/// Whether `fd` is of the kinds of file a driver exports memory as (a character device, the real
/// driver's; a memfd, the fake's): a process that holds one without having exported or imported
/// it (vramcap remembers nothing of it) still keeps the one-byte read locks it finds in the id
/// bytes through an unlock. Applications' own files (regular files, sockets, pipes) never get
/// this: no byte of theirs is taken again.
fn exported_kind(fd: c_int, st: &libc::stat) -> bool {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFCHR => true,
        libc::S_IFREG => {
            let mut path = *b"/proc/self/fd/\0\0\0\0\0\0\0\0\0\0\0\0";
            fd_path(fd, &mut path, 14);
            let mut link = [0u8; 16];
            let n = unsafe { libc::readlink(path.as_ptr().cast(), link.as_mut_ptr().cast(), link.len()) };
            n >= 7 && link.starts_with(b"/memfd:")
        }
        _ => false,
    }
}

/// Writes `fd`'s decimal digits into `path` at `at` (a NUL-filled buffer with room for 10).
fn fd_path(fd: c_int, path: &mut [u8], at: usize) {
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
        path[at + i] = *d;
    }
}

/// Whether vramcap remembers a byte on `file`.
fn remembered((dev, ino): (u64, u64)) -> bool {
    TABLE.iter().any(|m| m.state.load(Ordering::Acquire) == 2 && m.dev.load(Ordering::Relaxed) == dev && m.ino.load(Ordering::Relaxed) == ino)
}

/// The unlock, on a file vramcap locked bytes of: the description's locks of ours it holds now
/// are taken again after it. Out of line: its buffers stay off the common path's stack.
#[inline(never)]
unsafe fn unlock_keeping_ours(fd: c_int, cmd: c_int, req: &libc::flock, real: FcntlFn, file: Option<(u64, u64)>) -> c_int {
    let saved = errno();
    let mut ours = [0u64; MINE];
    let n = match file {
        Some(file) => held_of_ours(fd, file, &mut ours),
        None => one_byte_reads(fd, &mut ours),
    };
    set_errno(saved);
    let rc = unsafe { real(fd, cmd, req as *const libc::flock as usize) };
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

/// The remembered bytes of `file` that `fd`'s description holds now (any of its locks covers
/// them), into `out`; all of the file's remembered bytes when the list cannot be read. Returns
/// how many.
fn held_of_ours(fd: c_int, (dev, ino): (u64, u64), out: &mut [u64; MINE]) -> usize {
    let mut n = 0;
    for m in &TABLE {
        if m.state.load(Ordering::Acquire) == 2 && m.dev.load(Ordering::Relaxed) == dev && m.ino.load(Ordering::Relaxed) == ino {
            out[n] = m.byte.load(Ordering::Relaxed);
            n += 1;
        }
    }
    if n == 0 {
        return 0;
    }
    let mut covered = [false; MINE];
    if !covered_by_locks(fd, &out[..n], &mut covered) {
        return n;
    }
    let mut k = 0;
    for i in 0..n {
        if covered[i] {
            out[k] = out[i];
            k += 1;
        }
    }
    k
}

/// Marks in `covered` which of `bytes` a lock of `fd`'s description covers, as
/// `/proc/self/fdinfo/FD` lists them; false when the list cannot be read.
fn covered_by_locks(fd: c_int, bytes: &[u64], covered: &mut [bool; MINE]) -> bool {
    each_lock(fd, &mut |first, last, _| {
        for (i, &b) in bytes.iter().enumerate() {
            covered[i] |= first <= b && b <= last;
        }
    })
}

/// The one-byte read locks in the id bytes (`[LOCK_BASE, 2 * LOCK_BASE)`) of `fd`'s description,
/// into `out`; how many (0 when the list cannot be read).
fn one_byte_reads(fd: c_int, out: &mut [u64; MINE]) -> usize {
    let mut n = 0;
    each_lock(fd, &mut |first, last, read| {
        if read && first == last && (LOCK_BASE..LOCK_BASE << 1).contains(&first) && n < MINE {
            out[n] = first;
            n += 1;
        }
    });
    n
}

/// Calls `f(first, last, read)` for each OFD lock of `fd`'s description that
/// `/proc/self/fdinfo/FD` lists; false when the list cannot be read.
fn each_lock(fd: c_int, f: &mut dyn FnMut(u64, u64, bool)) -> bool {
    if fd < 0 {
        return false;
    }
    let mut path = *b"/proc/self/fdinfo/\0\0\0\0\0\0\0\0\0\0\0\0";
    fd_path(fd, &mut path, 18);
    let file = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if file < 0 {
        return false;
    }
    let (mut buf, mut line, mut len, mut ok) = ([0u8; 1024], [0u8; 256], 0usize, true);
    loop {
        let got = unsafe { libc::read(file, buf.as_mut_ptr().cast(), buf.len()) };
        if got < 0 {
            ok = false;
        }
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
                && let Some((first, last)) = lock_range(&line[..len])
            {
                f(first, last, line[..len].windows(6).any(|w| w == b" READ "));
            }
            len = 0;
        }
    }
    unsafe { libc::close(file) };
    ok
}

/// The bytes an fdinfo `lock:` line's OFD lock covers: `lock:\t1: OFDLCK ADVISORY  READ -1
/// 00:01:1025 FIRST LAST` (`LAST` may be `EOF`).
pub fn lock_range(line: &[u8]) -> Option<(u64, u64)> {
    let rest = line.strip_prefix(b"lock:")?;
    let mut f = rest.split(|c| c.is_ascii_whitespace()).filter(|w| !w.is_empty());
    let (_, kind, _, _, _, _, first, last) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    if kind != b"OFDLCK" {
        return None;
    }
    let num = |w: &[u8]| w.iter().try_fold(0u64, |a, &c| if c.is_ascii_digit() { a.checked_mul(10)?.checked_add(u64::from(c - b'0')) } else { None });
    let first = num(first)?;
    let last = if last == b"EOF" { u64::MAX } else { num(last)? };
    (first <= last).then_some((first, last))
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
