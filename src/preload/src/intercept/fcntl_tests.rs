use super::*;
use vramcap_common::group_ledger::kept::lock_byte;

const B: i64 = LOCK_BASE as i64;
const E: i64 = LOCK_END as i64;

#[test]
fn fdinfo_lock_lines_are_read() {
    assert_eq!(lock_range(b"lock:\t1: OFDLCK ADVISORY  READ -1 00:01:1025 1099511627783 1099511627783"), Some((LOCK_BASE + 7, LOCK_BASE + 7)));
    assert_eq!(lock_range(b"lock:\t1: OFDLCK ADVISORY  WRITE -1 00:01:1025 0 EOF"), Some((0, u64::MAX)));
    for other in [
        &b"lock:\t1: POSIX  ADVISORY  READ 12 00:01:1025 1099511627783 1099511627783"[..],
        b"pos:\t0",
        b"lock:\t1: OFDLCK ADVISORY  READ -1 00:01:1025 99999999999999999999999 99999999999999999999999",
        b"lock:\t1: OFDLCK ADVISORY  READ -1 00:01:1025 9 8",
        b"lock:",
    ] {
        assert_eq!(lock_range(other), None, "{}", String::from_utf8_lossy(other));
    }
}

/// vramcap's export lock on `fd`'s file at `LOCK_BASE + MARK + k` (bytes no test takes as the
/// application's: the table is the process's, and a closed memfd's inode may be reused).
const MARK: u64 = 1_000_000;

fn vramcap_lock(fd: c_int, k: u64) -> i64 {
    let byte = LOCK_BASE + MARK + k;
    assert!(lock_byte(fd, byte) && remember(fd, byte), "vramcap's export lock");
    byte as i64
}

// ---- real kernel locks, through the hooks (not exported in tests: called by name) ----

/// An application's own file: a regular file on disk (unlinked), not the kind a driver exports.
fn app_file() -> c_int {
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    let p = std::env::temp_dir().join(format!("fcntl-app-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o600) };
    assert!(fd >= 0);
    unsafe { libc::unlink(c.as_ptr()) };
    fd
}

fn memfd() -> c_int {
    let fd = unsafe { libc::memfd_create(c"fcntl-hook".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    fd
}

fn flock(kind: c_int, whence: c_int, start: i64, len: i64) -> libc::flock {
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = whence as libc::c_short;
    l.l_start = start;
    l.l_len = len;
    l
}

/// An OFD lock request through the `fcntl` hook: (rc, errno).
fn ofd(fd: c_int, kind: c_int, whence: c_int, start: i64, len: i64) -> (c_int, c_int) {
    let l = flock(kind, whence, start, len);
    let rc = unsafe { fcntl(fd, libc::F_OFD_SETLK, &l as *const libc::flock as usize) };
    (rc, if rc == 0 { 0 } else { unsafe { *libc::__errno_location() } })
}

/// The OFD locks this description holds, as `/proc/self/fdinfo` lists them: (start, end; `None`:
/// to the end).
fn held(fd: c_int) -> Vec<(i64, Option<i64>)> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
    let mut out: Vec<_> = text
        .lines()
        .filter_map(|l| l.strip_prefix("lock:"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f[1], "OFDLCK", "{l}");
            (f[6].parse().unwrap(), f[7].parse().ok())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_whole_file_unlock_removes_the_applications_locks_and_takes_vramcaps_byte_again() {
    let fd = memfd();
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, 0, 10), (0, 0), "the application's own lock");
    let v = vramcap_lock(fd, 7);
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, E + 100, 10), (0, 0), "the application's, past vramcap's bytes");
    assert_eq!(held(fd), vec![(0, Some(9)), (v, Some(v)), (E + 100, Some(E + 109))]);
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(held(fd), vec![(v, Some(v))], "only vramcap's lock is left");
    // F_OFD_SETLKW and fcntl64 the same way; relative to the end or the position too.
    assert_eq!(ofd(fd, libc::F_WRLCK, libc::SEEK_SET, 0, 10), (0, 0));
    let l = flock(libc::F_UNLCK, libc::SEEK_SET, 0, 0);
    assert_eq!(unsafe { fcntl64(fd, libc::F_OFD_SETLKW, &l as *const libc::flock as usize) }, 0);
    assert_eq!(held(fd), vec![(v, Some(v))]);
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_END, 0, 0), (0, 0));
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_CUR, 0, 0), (0, 0));
    assert_eq!(held(fd), vec![(v, Some(v))]);
    unsafe { libc::close(fd) };
}

#[test]
fn an_unlock_that_misses_vramcaps_bytes_goes_as_it_came() {
    let fd = memfd();
    assert_eq!(ofd(fd, libc::F_WRLCK, libc::SEEK_SET, 0, 100), (0, 0));
    let v = vramcap_lock(fd, 1);
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, 50, -10), (0, 0), "bytes 40..=49");
    assert_eq!(held(fd), vec![(0, Some(39)), (50, Some(99)), (v, Some(v))]);
    unsafe { libc::close(fd) };
}

/// The application's own lock over vramcap's byte merges with it (one range): its unlock takes
/// both, as the kernel does, and vramcap takes its byte again (the table says it is vramcap's).
#[test]
fn a_lock_the_application_merged_with_ours_is_taken_again_after_its_unlock() {
    let fd = memfd();
    let v = vramcap_lock(fd, 4);
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(held(fd), vec![(0, None)], "merged");
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(held(fd), vec![(v, Some(v))]);
    // A file vramcap locked nothing on: the application's unlock goes as it came, even of a byte
    // in vramcap's range (an application may lock any offset).
    let other = app_file();
    assert_eq!(ofd(other, libc::F_RDLCK, libc::SEEK_SET, v, 1), (0, 0));
    assert_eq!(ofd(other, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(held(other), vec![]);
    unsafe { libc::close(fd) };
    unsafe { libc::close(other) };
}

/// A process that holds an exported fd it neither exported nor imported (vramcap remembers
/// nothing of it) keeps the one-byte read locks in the id bytes through an unlock, on the kinds
/// of file a driver exports (a memfd here, a character device for the real driver) only.
#[test]
fn a_holder_of_an_exported_fd_keeps_its_id_lock_through_an_unlock() {
    let fd = memfd();
    let byte = LOCK_BASE + 77_777_777;
    assert!(lock_byte(fd, byte), "the exporter's lock, in another process");
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, 0, 10), (0, 0));
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(held(fd), vec![(byte as i64, Some(byte as i64))]);
    unsafe { libc::close(fd) };
}

#[test]
fn errors_are_the_kernels_and_errno_is_left_alone() {
    let fd = memfd();
    let v = vramcap_lock(fd, 2);
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, 0, 1), (0, 0));
    // l_pid must be 0 for OFD requests: refused, nothing unlocked.
    let mut l = flock(libc::F_UNLCK, libc::SEEK_SET, 0, 0);
    l.l_pid = 1;
    assert_eq!(unsafe { fcntl(fd, libc::F_OFD_SETLK, &l as *const libc::flock as usize) }, -1);
    assert_eq!(unsafe { *libc::__errno_location() }, libc::EINVAL);
    assert_eq!(held(fd), vec![(0, Some(0)), (v, Some(v))], "nothing unlocked");
    // A bad whence, a negative start, a closed fd, NULL: the kernel's answers.
    assert_eq!(ofd(fd, libc::F_UNLCK, 7, 0, 0), (-1, libc::EINVAL));
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, -1, 0), (-1, libc::EINVAL));
    assert_eq!(ofd(-1, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (-1, libc::EBADF));
    assert_eq!(unsafe { fcntl(fd, libc::F_OFD_SETLK, 0) }, -1);
    assert_eq!(unsafe { *libc::__errno_location() }, libc::EFAULT);
    assert_eq!(held(fd), vec![(0, Some(0)), (v, Some(v))]);
    // A success leaves errno as it was (the lock list is read with calls of our own).
    unsafe { *libc::__errno_location() = 1234 };
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, 0, 0).0, 0);
    assert_eq!(unsafe { *libc::__errno_location() }, 1234);
    assert_eq!(held(fd), vec![(v, Some(v))]);
    unsafe { libc::close(fd) };
}

#[test]
fn everything_else_passes_through() {
    let fd = memfd();
    assert_eq!(unsafe { fcntl(fd, libc::F_GETFD, 0) }, libc::FD_CLOEXEC);
    let dup = unsafe { fcntl(fd, libc::F_DUPFD_CLOEXEC, 100) };
    assert!(dup >= 100);
    // Locks (not unlocks) over vramcap's bytes are the application's to take.
    assert_eq!(ofd(fd, libc::F_WRLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(held(fd), vec![(0, None)]);
    // Process-associated locks are other owners: untouched by the hook.
    let l = flock(libc::F_UNLCK, libc::SEEK_SET, 0, 0);
    assert_eq!(unsafe { fcntl64(dup, libc::F_SETLK, &l as *const libc::flock as usize) }, 0);
    assert_eq!(held(fd), vec![(0, None)]);
    unsafe { libc::close(dup) };
    unsafe { libc::close(fd) };
}

#[test]
fn the_real_functions_are_the_c_librarys() {
    let ours = [fcntl as *mut c_void, fcntl64 as *mut c_void];
    for cache in [&REAL_FCNTL, &REAL_FCNTL64] {
        let _ = unsafe { fcntl(-1, libc::F_GETFD, 0) + fcntl64(-1, libc::F_GETFD, 0) };
        let p = cache.load(Ordering::Acquire);
        assert!(!p.is_null() && !ours.contains(&p) && p != syscall_fcntl as *mut c_void);
    }
}

// ---- an attack (issue 23, second round): a narrowed unlock left the application a lock ----

/// A second open file description of `fd`'s file (what another process opening the same file,
/// or this one opening it again, holds).
fn reopen(fd: c_int) -> c_int {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap();
    let other = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    assert!(other >= 0);
    other
}

/// The commonest OFD lock there is, a whole-file write lock (`l_start 0, l_len 0`) taken and then
/// released with the matching whole-file unlock, on a file that has nothing to do with CUDA: once
/// unlocked, another open of the file takes it. (The first hook narrowed the unlock and left the
/// application a write lock on bytes [2^40, 2^42): other opens were refused for good.)
#[test]
fn attack_a_whole_file_unlock_leaves_the_applications_own_write_lock_behind() {
    let a = memfd();
    let b = reopen(a);
    assert_eq!(ofd(a, libc::F_WRLCK, libc::SEEK_SET, 0, 0), (0, 0), "A locks the whole file");
    assert_eq!(ofd(b, libc::F_WRLCK, libc::SEEK_SET, 0, 0), (-1, libc::EAGAIN), "B waits its turn, as it should");
    assert_eq!(ofd(a, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0), "A unlocks the whole file");
    let left = held(a);
    let b_rc = ofd(b, libc::F_WRLCK, libc::SEEK_SET, 0, 0);
    unsafe { libc::close(a) };
    unsafe { libc::close(b) };
    assert_eq!(left, vec![], "A unlocked everything, yet its description still holds a lock");
    assert_eq!(b_rc, (0, 0), "B cannot take the lock A released");
}

/// The same with a read lock: after A's whole-file read lock and whole-file unlock, a writer on
/// another description takes the file.
#[test]
fn attack_a_whole_file_read_unlock_still_blocks_writers() {
    let a = memfd();
    let b = reopen(a);
    assert_eq!(ofd(a, libc::F_RDLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(ofd(a, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    let b_rc = ofd(b, libc::F_WRLCK, libc::SEEK_SET, 0, 0);
    unsafe { libc::close(a) };
    unsafe { libc::close(b) };
    assert_eq!(b_rc, (0, 0), "B cannot write-lock a file nobody has locked any more");
}

// ---- attack 23d: the restore after an unlock (each failed on the hook that restored every
// one-byte lock it saw) ----

/// Whether another description (`other`) can write-lock byte `b`: false while some lock is on it.
fn free_for_writer(other: c_int, b: i64) -> bool {
    let mut l = flock(libc::F_WRLCK, libc::SEEK_SET, b, 1);
    assert_eq!(unsafe { libc::syscall(libc::SYS_fcntl, other, libc::F_OFD_GETLK, &mut l as *mut libc::flock) }, 0);
    l.l_type == libc::F_UNLCK as libc::c_short
}

/// An application (a database, a sparse-file index, any program with no CUDA at all) takes a
/// one-byte OFD read lock at an offset in [2^40, 2^42) and unlocks exactly that byte. The hook
/// cannot tell the application's byte from vramcap's and takes it again after the unlock: the
/// application keeps a lock it released, and writers on other descriptions are refused for good.
#[test]
fn attack_an_applications_own_high_byte_read_lock_survives_its_unlock() {
    let a = app_file();
    let b = reopen(a);
    let byte = B + 12_345;
    assert_eq!(ofd(a, libc::F_RDLCK, libc::SEEK_SET, byte, 1), (0, 0), "the application's own read lock");
    assert!(!free_for_writer(b, byte));
    assert_eq!(ofd(a, libc::F_UNLCK, libc::SEEK_SET, byte, 1), (0, 0), "and its exact unlock");
    let (left, free) = (held(a), free_for_writer(b, byte));
    // The same through a whole-file unlock.
    assert_eq!(ofd(a, libc::F_RDLCK, libc::SEEK_SET, byte + 10, 1), (0, 0));
    assert_eq!(ofd(a, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    let left_whole = held(a);
    unsafe { libc::close(a) };
    unsafe { libc::close(b) };
    assert_eq!(left, vec![], "the application unlocked its byte, yet its description still holds it");
    assert!(free, "a writer on another description is refused the byte nobody holds");
    assert_eq!(left_whole, vec![], "a whole-file unlock leaves the application's own high-byte read locks");
}

/// vramcap's restore is blind when `/proc/self/fdinfo` cannot be opened: a process at its
/// RLIMIT_NOFILE (a busy server gets EMFILE all the time; also a sandbox without /proc) that makes
/// the commonest OFD unlock, the whole file, on an exported fd drops vramcap's export lock and keeps
/// the fd: the group's sweep then finds the allocation closed while the fd can still be imported
/// (a bypass, without any raw system call). Run in a forked child (the limit is per process).
#[test]
fn attack_a_whole_file_unlock_at_the_fd_limit_drops_vramcaps_lock() {
    let a = memfd();
    let b = reopen(a);
    let v = vramcap_lock(a, 17);
    assert!(!free_for_writer(b, v));
    let top = a.max(b) as u64 + 1;
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // Every fd number below the limit taken: the next open gets EMFILE.
        let lim = libc::rlimit { rlim_cur: top, rlim_max: top };
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        for n in 0..top as c_int {
            if unsafe { libc::fcntl(n, libc::F_GETFD) } < 0 {
                unsafe { libc::dup2(a, n) };
            }
        }
        let l = flock(libc::F_UNLCK, libc::SEEK_SET, 0, 0);
        let rc = unsafe { fcntl(a, libc::F_OFD_SETLK, &l as *const libc::flock as usize) };
        let code = if rc != 0 { 2 } else if free_for_writer(b, v) { 1 } else { 0 };
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    let still = !free_for_writer(b, v);
    unsafe { libc::close(a) };
    unsafe { libc::close(b) };
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) != 2, "the unlock itself failed: {status}");
    assert!(still && libc::WEXITSTATUS(status) == 0, "vramcap's lock on the exported description is gone after the application's whole-file unlock");
}

/// Seventeen one-byte read locks of the application's in vramcap's bytes ahead of vramcap's own
/// (the kernel lists a description's locks by offset; ids are scattered over 2^40, so most sit
/// high): an earlier hook restored the first 16 one-byte locks it saw, the application's, and
/// dropped vramcap's. Now only vramcap's (remembered) byte is taken again.
#[test]
fn attack_seventeen_low_bytes_push_vramcaps_lock_out_of_the_restore() {
    let a = memfd();
    let id_byte = vramcap_lock(a, 1 << 39);
    for k in 0..17 {
        assert_eq!(ofd(a, libc::F_RDLCK, libc::SEEK_SET, B + 2 * k, 1), (0, 0));
    }
    assert_eq!(ofd(a, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    let left = held(a);
    unsafe { libc::close(a) };
    assert_eq!(left, vec![(id_byte, Some(id_byte))], "vramcap's export lock alone is left");
}
