//! Exported file descriptors, watched (issue 23). VMM memory exported as a POSIX fd
//! (`cuMemExportToShareableHandle`) lives while any copy of that fd is open (the documentation
//! counts shareable handles among the references `cuMemRelease` waits for), wherever the copy is:
//! in a unix socket not yet received, in a forked child, in a process that has not imported it
//! yet. vramcap cannot see those copies, but they are all one *open file description* (SCM_RIGHTS
//! and fork share it), which the kernel keeps until its last copy closes. So each export takes an
//! OFD read lock on one byte of that description, a byte no one else uses, and keeps a second
//! description of the same file of its own (reopened through `/proc/self/fd`): `F_OFD_GETLK` on
//! it answers whether the exported description still exists, in whatever process.
//!
//! A member asks at its exit (`handles::settle_exports`, in a group only): an export whose
//! description is gone can live on only in imports (which members count); one still open (the
//! application's own fd too: vramcap never closes it), or one vramcap could not watch (another handle type, a file that takes no lock), may be imported by
//! any process later, and stays the group's for good (`shm::Shared::kept_for_good`).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: the shareable handle is an `int` fd.
pub const POSIX_FD: c_int = 1;

/// Lock bytes start here, far past anything a driver's own locks would use (the fake driver locks
/// bytes 0 to 2 of its memfd).
const BYTE_BASE: i64 = 1 << 40;

#[derive(Clone, Copy, Debug)]
pub struct Watch {
    /// The exporting process: a forked child inherits the table, not the exports.
    pub pid: u32,
    /// Our own description of the same file; −1: not watched (counts as open).
    probe: c_int,
    byte: i64,
}

impl Watch {
    /// An export vramcap cannot watch: it may be open anywhere, for good.
    pub fn unsure() -> Watch {
        Watch { pid: std::process::id(), probe: -1, byte: 0 }
    }
}

/// Starts watching a successful export of handle type `kind` into `*shareable`.
///
/// # Safety
/// `shareable` is the out-parameter of a successful `cuMemExportToShareableHandle`.
pub unsafe fn watch(kind: c_int, shareable: *const c_void) -> Watch {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    if kind != POSIX_FD || shareable.is_null() {
        return Watch::unsure();
    }
    let fd = unsafe { *(shareable as *const c_int) };
    let pid = std::process::id();
    let n = NEXT.fetch_add(1, Ordering::Relaxed) & 0xf_ffff;
    let byte = BYTE_BASE + ((pid as i64) << 20) + n as i64;
    let Some((dev, ino)) = identity(fd) else { return Watch::unsure() };
    if lock(fd, libc::F_RDLCK as i16, byte).is_err() {
        return Watch::unsure();
    }
    let path = format!("/proc/self/fd/{fd}\0");
    let probe = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    let w = Watch { pid, probe, byte };
    // The probe must see the lock, or it can tell nothing.
    if probe < 0 || identity(probe) != Some((dev, ino)) || locked(probe, byte) != Some(true) {
        forget(w);
        return Watch::unsure();
    }
    w
}

/// Stops watching (the watch is of no use: a failed probe, an export not ours to count).
pub fn forget(w: Watch) {
    if w.probe >= 0 {
        unsafe { libc::close(w.probe) };
    }
}

/// At exit: whether the exported description may still be open anywhere (the application's own
/// copy included: vramcap never closes an fd it did not open, since the application may use it
/// after this, in a later `atexit` handler or a destructor). Unsure is open.
pub fn still_open(w: Watch) -> bool {
    if w.probe < 0 {
        return true;
    }
    let open = locked(w.probe, w.byte) != Some(false);
    forget(w);
    open
}

fn identity(fd: c_int) -> Option<(u64, u64)> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (fd >= 0 && unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

fn flock_at(kind: i16, byte: i64) -> libc::flock {
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind;
    l.l_whence = libc::SEEK_SET as i16;
    l.l_start = byte;
    l.l_len = 1;
    l
}

fn lock(fd: c_int, kind: i16, byte: i64) -> Result<(), ()> {
    let l = flock_at(kind, byte);
    if unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &l) } == 0 { Ok(()) } else { Err(()) }
}

/// Whether a description other than `fd`'s holds a lock on `byte` of its file.
fn locked(fd: c_int, byte: i64) -> Option<bool> {
    let mut l = flock_at(libc::F_WRLCK as i16, byte);
    (unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut l) } == 0).then_some(l.l_type != libc::F_UNLCK as i16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> c_int {
        unsafe { libc::memfd_create(c"watch".as_ptr(), 0) }
    }

    /// A copy of the exported description (here: a dup, as SCM_RIGHTS or fork would make) keeps
    /// it open after the application's fd closes; with the last copy it is gone. The application's
    /// fd is never closed by vramcap.
    #[test]
    fn a_watch_sees_the_exported_description_until_its_last_copy_closes() {
        let fd = memfd();
        let w = unsafe { watch(POSIX_FD, (&fd as *const c_int).cast()) };
        assert!(w.probe >= 0);
        let copy = unsafe { libc::dup(fd) };
        unsafe { libc::close(fd) };
        assert!(still_open(w), "a copy is still open");
        unsafe { libc::close(copy) };

        let fd = memfd();
        let w = unsafe { watch(POSIX_FD, (&fd as *const c_int).cast()) };
        assert!(still_open(w), "the application's own fd is open");
        assert_ne!(unsafe { libc::fcntl(fd, libc::F_GETFD) }, -1, "and left open");
        unsafe { libc::close(fd) };

        let fd = memfd();
        let w = unsafe { watch(POSIX_FD, (&fd as *const c_int).cast()) };
        unsafe { libc::close(fd) };
        assert!(!still_open(w), "the application's copy was the last");
    }

    #[test]
    fn what_cannot_be_watched_counts_as_open() {
        assert!(still_open(Watch::unsure()));
        let fabric = [0u8; 64];
        assert!(still_open(unsafe { watch(8, fabric.as_ptr().cast()) }));
    }
}
