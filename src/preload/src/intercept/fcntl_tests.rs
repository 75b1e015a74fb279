use super::*;
use vramcap_common::group_ledger::kept::lock_byte;

const B: i64 = LOCK_BASE as i64;
const E: i64 = LOCK_END as i64;

fn span(start: i64, end: i64) -> Span {
    Span { start, end }
}

// ---- the arithmetic ----

#[test]
fn ranges_resolve_as_the_kernel_resolves_them() {
    assert_eq!(resolve(0, 0, 0), Ok(span(0, OFFSET_MAX)), "length 0: to the end");
    assert_eq!(resolve(0, 10, 5), Ok(span(10, 14)));
    assert_eq!(resolve(0, 10, -5), Ok(span(5, 9)), "negative length: the bytes before start");
    assert_eq!(resolve(0, 10, -10), Ok(span(0, 9)));
    assert_eq!(resolve(0, 10, -11), Err(libc::EINVAL));
    assert_eq!(resolve(0, -1, 1), Err(libc::EINVAL), "before the start of the file");
    assert_eq!(resolve(100, -100, 1), Ok(span(0, 0)), "SEEK_CUR / SEEK_END back to byte 0");
    assert_eq!(resolve(100, -101, 1), Err(libc::EINVAL));
    assert_eq!(resolve(100, OFFSET_MAX - 100, 0), Ok(span(OFFSET_MAX, OFFSET_MAX)));
    assert_eq!(resolve(100, OFFSET_MAX - 99, 0), Err(libc::EOVERFLOW), "start past OFFSET_MAX");
    assert_eq!(resolve(0, OFFSET_MAX, 1), Ok(span(OFFSET_MAX, OFFSET_MAX)));
    assert_eq!(resolve(0, OFFSET_MAX, 2), Err(libc::EOVERFLOW), "end past OFFSET_MAX");
    assert_eq!(resolve(0, 1, OFFSET_MAX), Ok(span(1, OFFSET_MAX)));
    assert_eq!(resolve(0, i64::MIN, 1), Err(libc::EINVAL));
    assert_eq!(resolve(OFFSET_MAX, 0, -OFFSET_MAX), Ok(span(0, OFFSET_MAX - 1)));
    assert_eq!(resolve(OFFSET_MAX, 0, i64::MIN), Err(libc::EINVAL));
}

#[test]
fn an_unlock_keeps_only_the_reserved_bytes() {
    assert_eq!(RESERVED, span(1 << 40, (1 << 42) - 1));
    // The whole file: below and above.
    assert_eq!(outside_reserved(span(0, OFFSET_MAX)), [Some(span(0, B - 1)), Some(span(E, OFFSET_MAX))]);
    // Straddling either edge: one piece.
    assert_eq!(outside_reserved(span(B - 10, B + 10)), [Some(span(B - 10, B - 1)), None]);
    assert_eq!(outside_reserved(span(E - 10, E + 10)), [None, Some(span(E, E + 10))]);
    // Inside: nothing.
    assert_eq!(outside_reserved(span(B, E - 1)), [None, None]);
    assert_eq!(outside_reserved(span(B + 5, B + 5)), [None, None]);
    // Touching or not.
    assert!(touches_reserved(span(0, B)) && touches_reserved(span(E - 1, E)) && touches_reserved(span(B + 3, B + 3)));
    assert!(!touches_reserved(span(0, B - 1)) && !touches_reserved(span(E, OFFSET_MAX)));
}

#[test]
fn narrowed_requests_name_the_same_bytes() {
    let req: libc::flock = unsafe { std::mem::zeroed() };
    let r = request(&req, span(E, OFFSET_MAX));
    assert_eq!((r.l_whence as c_int, r.l_start, r.l_len), (libc::SEEK_SET, E, 0), "to the end: length 0");
    let r = request(&req, span(0, B - 1));
    assert_eq!((r.l_start, r.l_len), (0, B));
    assert_eq!(resolve(0, r.l_start, r.l_len), Ok(span(0, B - 1)));
    for e in [libc::EINVAL, libc::EOVERFLOW] {
        let r = refused(&req, e);
        assert_eq!(resolve(0, r.l_start, r.l_len), Err(e));
    }
}

// ---- real kernel locks, through the hooks (not exported in tests: called by name) ----

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
fn a_whole_file_unlock_leaves_vramcaps_byte_and_removes_the_applications_locks() {
    let fd = memfd();
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, 0, 10), (0, 0), "the application's own lock");
    assert!(lock_byte(fd, LOCK_BASE + 7), "vramcap's export lock");
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, E + 100, 10), (0, 0), "the application's, past vramcap's bytes");
    assert_eq!(held(fd), vec![(0, Some(9)), (B + 7, Some(B + 7)), (E + 100, Some(E + 109))]);
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    assert_eq!(held(fd), vec![(B + 7, Some(B + 7))], "only vramcap's lock is left");
    // F_OFD_SETLKW and fcntl64 narrow the same way.
    assert_eq!(ofd(fd, libc::F_WRLCK, libc::SEEK_SET, 0, 10), (0, 0));
    let l = flock(libc::F_UNLCK, libc::SEEK_SET, 0, 0);
    assert_eq!(unsafe { fcntl64(fd, libc::F_OFD_SETLKW, &l as *const libc::flock as usize) }, 0);
    assert_eq!(held(fd), vec![(B + 7, Some(B + 7))]);
    unsafe { libc::close(fd) };
}

#[test]
fn an_unlock_that_misses_vramcaps_bytes_goes_as_it_came() {
    let fd = memfd();
    assert_eq!(ofd(fd, libc::F_WRLCK, libc::SEEK_SET, 0, 100), (0, 0));
    assert!(lock_byte(fd, LOCK_BASE + 1));
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, 50, -10), (0, 0), "bytes 40..=49");
    assert_eq!(held(fd), vec![(0, Some(39)), (50, Some(99)), (B + 1, Some(B + 1))]);
    unsafe { libc::close(fd) };
}

#[test]
fn seek_cur_and_seek_end_are_resolved_before_narrowing() {
    let fd = memfd();
    // A sparse file reaching past vramcap's first bytes, the position just before them.
    assert_eq!(unsafe { libc::ftruncate(fd, B + 100) }, 0);
    assert_eq!(unsafe { libc::lseek(fd, B - 5, libc::SEEK_SET) }, B - 5);
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, B - 20, 10), (0, 0));
    assert!(lock_byte(fd, LOCK_BASE + 3));
    assert!(lock_byte(fd, LOCK_BASE + 60));
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, E, 1), (0, 0));
    // SEEK_CUR: [B - 25, B + 4]: the application's lock goes, vramcap's byte 3 stays.
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_CUR, -20, 30), (0, 0));
    assert_eq!(held(fd), vec![(B + 3, Some(B + 3)), (B + 60, Some(B + 60)), (E, Some(E))]);
    // SEEK_END: from B + 50 to the end: the application's byte at E goes, vramcap's 60 stays.
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_END, -50, 0), (0, 0));
    assert_eq!(held(fd), vec![(B + 3, Some(B + 3)), (B + 60, Some(B + 60))]);
    // Resolved from where the file is: back before the start is refused, as the kernel does.
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_END, -(B + 101), 1), (-1, libc::EINVAL));
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_CUR, OFFSET_MAX - B + 6, 1), (-1, libc::EOVERFLOW));
    assert_eq!(held(fd).len(), 2);
    unsafe { libc::close(fd) };
}

#[test]
fn errors_are_the_kernels_and_unlock_nothing() {
    let fd = memfd();
    assert!(lock_byte(fd, LOCK_BASE + 2));
    assert_eq!(ofd(fd, libc::F_RDLCK, libc::SEEK_SET, 0, 1), (0, 0));
    // l_pid must be 0 for OFD requests: refused, both pieces.
    let mut l = flock(libc::F_UNLCK, libc::SEEK_SET, 0, 0);
    l.l_pid = 1;
    assert_eq!(unsafe { fcntl(fd, libc::F_OFD_SETLK, &l as *const libc::flock as usize) }, -1);
    assert_eq!(unsafe { *libc::__errno_location() }, libc::EINVAL);
    assert_eq!(held(fd), vec![(0, Some(0)), (B + 2, Some(B + 2))], "nothing unlocked");
    // Inside vramcap's bytes only: nothing to do, but a bad request is still refused.
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, B, 10), (0, 0));
    assert_eq!(held(fd), vec![(0, Some(0)), (B + 2, Some(B + 2))]);
    assert_eq!(unsafe { fcntl(fd, libc::F_OFD_SETLK, &l as *const libc::flock as usize) }, -1, "l_pid, inside");
    l.l_pid = 0;
    l.l_start = B;
    l.l_len = 1;
    assert_eq!(unsafe { fcntl(-1, libc::F_OFD_SETLK, &l as *const libc::flock as usize) }, -1);
    assert_eq!(unsafe { *libc::__errno_location() }, libc::EBADF);
    // A bad whence, a negative start, a closed fd: the kernel's answers.
    assert_eq!(ofd(fd, libc::F_UNLCK, 7, 0, 0), (-1, libc::EINVAL));
    assert_eq!(ofd(fd, libc::F_UNLCK, libc::SEEK_SET, -1, 0), (-1, libc::EINVAL));
    assert_eq!(ofd(-1, libc::F_UNLCK, libc::SEEK_SET, 0, 0), (-1, libc::EBADF));
    assert_eq!(ofd(-1, libc::F_UNLCK, libc::SEEK_CUR, 0, 0), (-1, libc::EBADF));
    assert_eq!(ofd(-1, libc::F_UNLCK, libc::SEEK_END, 0, 0), (-1, libc::EBADF));
    // NULL: the kernel's EFAULT.
    assert_eq!(unsafe { fcntl(fd, libc::F_OFD_SETLK, 0) }, -1);
    assert_eq!(unsafe { *libc::__errno_location() }, libc::EFAULT);
    assert_eq!(held(fd), vec![(0, Some(0)), (B + 2, Some(B + 2))]);
    unsafe { libc::close(fd) };
}

#[test]
fn a_file_without_a_position_is_refused_for_seek_cur() {
    let mut p = [0; 2];
    assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
    assert_eq!(ofd(p[0], libc::F_UNLCK, libc::SEEK_CUR, 0, 0), (-1, libc::ESPIPE));
    // SEEK_SET on it goes to the kernel as usual.
    assert_eq!(ofd(p[0], libc::F_UNLCK, libc::SEEK_SET, 0, 0), (0, 0));
    unsafe { libc::close(p[0]) };
    unsafe { libc::close(p[1]) };
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

// ---- attack (issue 23, second round) ----

/// A second open file description of `fd`'s file (what another process opening the same file,
/// or this one opening it again, holds).
fn reopen(fd: c_int) -> c_int {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap();
    let other = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    assert!(other >= 0);
    other
}

/// FINDING (breaks applications): the commonest OFD lock there is, a whole-file write lock
/// (`l_start 0, l_len 0`) taken and then released with the matching whole-file unlock, on a file
/// that has nothing to do with CUDA. The hook narrows the unlock, so the application keeps a write
/// lock on bytes [2^40, 2^42) of its own file after its unlock "succeeded": every other open of the
/// file (another process, or a second `open` here) is refused a whole-file lock (EAGAIN) until the
/// description is closed, and an `F_OFD_SETLKW` waits forever. It happens in every preloaded
/// process (the hook reads no configuration: `VRAMCAP_DISABLE=1` too), and on descriptions that
/// hold none of vramcap's locks at all.
#[test]
#[ignore = "attack: an application's whole-file OFD unlock leaves a write lock on [2^40, 2^42): other opens of the file can never lock it again"]
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

/// FINDING (breaks applications), the same with a read lock: after A's whole-file read lock and
/// whole-file unlock, a writer on another description is refused.
#[test]
#[ignore = "attack: an application's whole-file OFD read unlock leaves a read lock on [2^40, 2^42): writers elsewhere are refused"]
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
