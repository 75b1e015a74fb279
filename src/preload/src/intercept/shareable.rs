//! Exported file descriptors and imports, watched (issue 23; the group's side, and why a lock
//! tells, is `vramcap_common::group_ledger::kept`). Each export of an allocation takes an OFD read
//! lock on byte `LOCK_BASE + id` of the exported open file description (`id`: the allocation's,
//! handed out by the group): the lock lives exactly as long as some copy of that fd is open, in
//! whatever process, and `/proc/locks` lists it for whoever looks. vramcap never closes the
//! application's fds: its copy is the application's to use and close. Each import of a watched
//! allocation ([`keep`]) takes the same byte on a memfd of this process's own until the import
//! ends, so the exporter's group (whichever it is) sees the memory held after the fd is closed.

use crate::sync::Lock;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU8, Ordering};
use vramcap_common::group_ledger::kept::{LOCK_BASE, fd_locks, lock_range, proc_locks, unlock_range};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: the shareable handle is an `int` fd.
pub const POSIX_FD: c_int = 1;

/// Locks `ranges` (first, last byte: an allocation's id byte, or what a re-export carries) of the
/// exported description a successful export of handle type `kind` wrote to `*shareable`, and
/// returns that file as the kernel names it in `/proc/locks` (`major << 32 | minor`, inode: read
/// back from this description's own locks, so that no other naming, a file system's `stat`, can
/// differ). `None`: it cannot be watched (another handle type, a file that takes no lock, locks
/// this process cannot see), and its memory must be kept.
///
/// # Safety
/// `shareable` is the out-parameter of a successful `cuMemExportToShareableHandle`.
pub unsafe fn watch(kind: c_int, shareable: *const c_void, ranges: &[(u64, u64)]) -> Option<(u64, u64)> {
    if kind != POSIX_FD || shareable.is_null() || ranges.is_empty() {
        return None;
    }
    let fd = unsafe { *(shareable as *const c_int) };
    if fd < 0 || !ranges.iter().all(|&(first, last)| lock_range(fd, first, last)) {
        return None;
    }
    // An application's unlock of this file takes them again (`intercept::fcntl`).
    for &(first, _) in ranges.iter().filter(|r| r.0 == r.1) {
        remember(fd, first);
    }
    let byte = ranges[0].0;
    // Any range covering the byte: the application may hold a lock of its own that merged with it.
    let lock = fd_locks(fd)?.into_iter().find(|l| l.2 <= byte && byte <= l.3)?;
    visible(lock).then_some((lock.0, lock.1))
}

/// vramcap locked `byte` of `fd`'s file: an application's unlock there takes it again.
fn remember(fd: c_int, byte: u64) {
    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    super::fcntl::remember(fd, byte);
    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    let _ = (fd, byte);
}

/// Bytes an import or a re-export carries (first, last): an allocation's id byte, or, when the
/// received fd does not name one id, every id byte it may stand for.
pub type Carry = (u64, u64);

/// The end (exclusive) of the id bytes (the probe's byte is past them).
const ID_END: u64 = LOCK_BASE << 1;

/// What a shareable handle of type `kind` about to be imported (`os`, an fd passed by value)
/// carries, as the locks on the received description say: `None` if it carries none of vramcap's
/// bytes (not a fd, or an export no group watches); its id's byte (one lock, on one byte); else
/// (an application's lock merged with ours, several ranges, or locks this process cannot read)
/// the span of id bytes it may stand for, cut to the ids (a merged range starting at 0 becomes
/// every id: the import then keeps every ended export it could be, which errs towards denying).
pub fn origin(kind: c_int, os: *const c_void) -> Option<Carry> {
    if kind != POSIX_FD {
        return None;
    }
    let fd = os as usize as c_int;
    let Some(locks) = fd_locks(fd) else { return Some((LOCK_BASE, ID_END - 1)) };
    let ids: Vec<Carry> = locks.iter().filter(|l| l.2 < ID_END).map(|l| (l.2.max(LOCK_BASE), l.3.min(ID_END - 1))).collect();
    if let [(first, last)] = ids.as_slice()
        && first == last
    {
        // Its exporter's lock, kept through this process's unlocks of the fd too.
        remember(fd, *first);
    }
    let first = ids.iter().map(|r| r.0).min()?;
    Some((first, ids.iter().map(|r| r.1).max()?))
}

/// This process's imports of watched allocations: a memfd of its own (close-on-exec, never
/// shared: a forked child drops its copy) locked at the bytes each import carries, with a count
/// per span (one lock stands for all of a process's imports of an allocation).
struct Keeper {
    fd: c_int,
    held: Vec<(Carry, u32)>,
}

static KEEPER: Lock<Keeper> = Lock::new(Keeper { fd: -1, held: Vec::new() });

/// This process holds one more import carrying `span`, from now (before the driver call) until
/// [`release`]: false if it cannot be shown (no memfd, no lock), and the import is counted
/// without its allocation.
pub fn keep(span: Carry) -> bool {
    // A fork during the import must find the child's handler in place.
    super::handles::install_fork_handlers();
    let mut k = KEEPER.lock();
    if let Some(e) = k.held.iter_mut().find(|e| e.0 == span) {
        e.1 += 1;
        return true;
    }
    if k.fd < 0 {
        k.fd = unsafe { libc::memfd_create(c"vramcap-imports".as_ptr(), libc::MFD_CLOEXEC) };
    }
    if k.fd < 0 || !lock_range(k.fd, span.0, span.1) {
        return false;
    }
    k.held.push((span, 1));
    true
}

/// One import carrying `span` that [`keep`] showed has ended.
pub fn release(span: Carry) {
    let mut k = KEEPER.lock();
    let Some(i) = k.held.iter().position(|e| e.0 == span) else { return };
    k.held[i].1 -= 1;
    if k.held[i].1 > 0 {
        return;
    }
    k.held.swap_remove(i);
    // Only the bytes no other import of ours covers (an unlock takes every lock of ours in its
    // range, and unlocking then locking again would leave a moment a sweep could see). Cannot
    // fail on bytes we locked; if it did, the lock would keep the memory (stricter).
    for (first, last) in uncovered(span, &k.held) {
        unlock_range(k.fd, first, last);
    }
}

/// The parts of `span` that none of `held` covers.
fn uncovered(span: Carry, held: &[(Carry, u32)]) -> Vec<Carry> {
    let mut others: Vec<Carry> = held.iter().map(|e| e.0).filter(|o| o.0 <= span.1 && span.0 <= o.1).collect();
    others.sort_unstable();
    let (mut out, mut next) = (Vec::new(), Some(span.0));
    for (first, last) in others {
        let Some(from) = next else { break };
        if first > from {
            out.push((from, first - 1));
        }
        next = if last >= span.1 { None } else { Some(from.max(last + 1)) };
    }
    if let Some(from) = next {
        out.push((from, span.1));
    }
    out
}

/// For `pthread_atfork`, after the handle table's lock: the keeper's lock.
pub(super) fn keeper_prepare() {
    KEEPER.acquire_for_fork();
}

pub(super) fn keeper_parent() {
    KEEPER.release_after_fork();
}

/// The child holds none of its parent's imports, and must not unlock them: its copy of the
/// memfd is the parent's description (locks are the description's), so it closes it.
pub(super) fn keeper_child() {
    KEEPER.reset_in_child();
    let mut k = KEEPER.lock();
    if k.fd >= 0 {
        unsafe { libc::close(k.fd) };
    }
    k.fd = -1;
    // Not dropped: freeing in a forked child of a multithreaded process is not safe.
    std::mem::forget(std::mem::take(&mut k.held));
}

/// Whether `/proc/locks` here shows our locks, asked with the first one (whoever decides later
/// reads the same kernel list): a system where it does not leaves every export undecidable.
fn visible(lock: (u64, u64, u64, u64)) -> bool {
    // 0: not asked yet; 1: shown; 2: not shown.
    static SEEN: AtomicU8 = AtomicU8::new(0);
    match SEEN.load(Ordering::Acquire) {
        1 => true,
        2 => false,
        _ => {
            let shown = proc_locks().is_some_and(|l| l.contains(&lock));
            SEEN.store(if shown { 1 } else { 2 }, Ordering::Release);
            shown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> c_int {
        unsafe { libc::memfd_create(c"watch".as_ptr(), 0) }
    }

    fn listed(file: (u64, u64), id: u64) -> bool {
        proc_locks().unwrap().contains(&(file.0, file.1, LOCK_BASE + id, LOCK_BASE + id))
    }

    /// The lock shows while any copy of the exported description is open (here a dup, as
    /// SCM_RIGHTS or fork would make), and goes with the last; the application's fd stays open.
    #[test]
    fn the_lock_lives_as_long_as_a_copy_of_the_exported_fd() {
        let fd = memfd();
        let id = 1_000_000 + std::process::id() as u64;
        let file = unsafe { watch(POSIX_FD, (&fd as *const c_int).cast(), &[(LOCK_BASE + id, LOCK_BASE + id)]) }.expect("a memfd is watched");
        assert!(listed(file, id));
        assert_ne!(unsafe { libc::fcntl(fd, libc::F_GETFD) }, -1, "the application's fd is left open");
        let copy = unsafe { libc::dup(fd) };
        unsafe { libc::close(fd) };
        assert!(listed(file, id), "a copy is still open");
        unsafe { libc::close(copy) };
        assert!(!listed(file, id), "the last copy closed");
    }

    /// An importer finds the allocation in the fd it received (the same description).
    #[test]
    fn a_received_fd_names_its_allocation() {
        let fd = memfd();
        let id = 2_000_000 + std::process::id() as u64;
        unsafe { watch(POSIX_FD, (&fd as *const c_int).cast(), &[(LOCK_BASE + id, LOCK_BASE + id)]) }.unwrap();
        let copy = unsafe { libc::dup(fd) };
        assert_eq!(origin(POSIX_FD, copy as usize as *const c_void), Some((LOCK_BASE + id, LOCK_BASE + id)));
        let other = memfd();
        assert_eq!(origin(POSIX_FD, other as usize as *const c_void), None);
        // The application's own whole-file lock merges with ours: it still carries our bytes, it
        // no longer names one id: every id.
        assert!(lock_range(other, 0, u64::MAX));
        assert_eq!(origin(POSIX_FD, other as usize as *const c_void), Some((LOCK_BASE, ID_END - 1)));
        assert_eq!(origin(POSIX_FD, -5isize as *const c_void), Some((LOCK_BASE, ID_END - 1)), "unreadable");
        unsafe { libc::close(fd) };
        unsafe { libc::close(copy) };
        unsafe { libc::close(other) };
    }

    #[test]
    fn a_release_unlocks_only_what_no_other_import_covers() {
        let e = |f: u64, l: u64| ((f, l), 1u32);
        assert_eq!(uncovered((10, 20), &[]), vec![(10, 20)]);
        assert_eq!(uncovered((10, 20), &[e(12, 12), e(15, 16)]), vec![(10, 11), (13, 14), (17, 20)]);
        assert_eq!(uncovered((10, 20), &[e(0, 100)]), vec![]);
        assert_eq!(uncovered((10, 20), &[e(5, 10), e(20, 30)]), vec![(11, 19)]);
        assert_eq!(uncovered((10, 20), &[e(11, 14), e(12, 13), e(30, 40)]), vec![(10, 10), (15, 20)]);
        // An id import and an import of every id in one process, released in either order.
        let (id, all) = ((LOCK_BASE + 5, LOCK_BASE + 5), (LOCK_BASE, ID_END - 1));
        let fd = memfd();
        let listed = |b: u64| fd_locks(fd).unwrap().iter().any(|l| l.2 <= b && b <= l.3);
        assert!(lock_range(fd, id.0, id.1) && lock_range(fd, all.0, all.1));
        for (first, last) in uncovered(all, &[(id, 1)]) {
            unlock_range(fd, first, last);
        }
        assert!(listed(LOCK_BASE + 5) && !listed(LOCK_BASE + 6));
        unsafe { libc::close(fd) };
    }

    /// A forked child shares the keeper's open file description (locks are the description's):
    /// were it to release an import it inherited, it would unlock the parent's. The child's fork
    /// handler drops its copy and its counts, so its release unlocks nothing, and its exit leaves
    /// the parent's lock in place.
    #[test]
    fn a_forked_child_cannot_release_its_parents_import() {
        let span = (LOCK_BASE + 424_242, LOCK_BASE + 424_242);
        assert!(keep(span));
        let fd = KEEPER.lock().fd;
        let listed = || fd_locks(fd).unwrap().iter().any(|l| l.2 <= span.0 && span.0 <= l.3);
        assert!(listed());
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            release(span);
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status));
        assert!(listed(), "the child unlocked the parent's import");
        release(span);
        assert!(!listed());
    }

    #[test]
    fn what_cannot_be_watched_says_so() {
        let fabric = [0u8; 64];
        let b = [(LOCK_BASE + 1, LOCK_BASE + 1)];
        assert_eq!(unsafe { watch(8, fabric.as_ptr().cast(), &b) }, None);
        let bad: c_int = -1;
        assert_eq!(unsafe { watch(POSIX_FD, (&bad as *const c_int).cast(), &b) }, None);
    }
}
