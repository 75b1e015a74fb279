//! The job never waits for us. A program whose main thread ends with `pthread_exit` (legal, and
//! common in C and C++ servers) lives on while its other threads run; glibc ends the process with
//! `exit(0)` when the last thread ends, and only then runs `atexit` handlers. vramcap's writer and
//! I/O threads are threads too: waiting for `atexit` to stop them, they kept such a process alive
//! for ever, and as they block every signal, nothing was left to take SIGTERM or SIGINT.
//!
//! So the writer watches for that state itself: once the main thread has ended and every thread
//! left is one of ours, it finishes the trace (summary included) and ends the process as glibc
//! would have, with status 0 (or by a signal that arrived meanwhile).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// 1 once the process exits (`exit()` from any thread): the writer drains, writes the summary and
/// finishes. A futex word, so the `atexit` handler wakes the writer at once instead of waiting
/// out its idle sleep (up to 4 ms, and 10 ms of clock calibration in a short process).
static EXITING: AtomicU32 = AtomicU32::new(0);
/// 1 once the writer has finished (file closed): the `atexit` handler waits on it.
static DONE: AtomicU32 = AtomicU32::new(0);

fn futex_wait(word: &AtomicU32, expected: u32, d: Duration) {
    let ts = libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as libc::c_long };
    // EINTR, EAGAIN (the word changed) and ETIMEDOUT all mean "look again".
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, expected, &ts as *const libc::timespec);
    }
}

fn futex_wake(word: &AtomicU32) {
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX) };
}

pub fn exiting() -> bool {
    EXITING.load(Ordering::Acquire) != 0
}

/// The writer's sleeps: up to `d`, cut short when the process starts exiting. False if it is.
pub fn idle(d: Duration) -> bool {
    futex_wait(&EXITING, 0, d);
    !exiting()
}

/// Called by the writer when the trace is finished and closed.
pub fn writer_done() {
    DONE.store(1, Ordering::Release);
    futex_wake(&DONE);
}

/// `exit()`: wakes the writer and waits until it is done, at most until `deadline`.
pub fn exit_and_wait(deadline: Instant) {
    EXITING.store(1, Ordering::Release);
    futex_wake(&EXITING);
    while DONE.load(Ordering::Acquire) == 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        futex_wait(&DONE, 0, left);
    }
}

/// A forked child starts with no writer and is not exiting.
pub fn reset_after_fork() {
    EXITING.store(0, Ordering::Relaxed);
    DONE.store(0, Ordering::Relaxed);
}

/// How often the writer looks. Only a process whose main thread has ended pays more than one
/// small `/proc` read per look; a 20 ms delay at the end of such a process goes unnoticed.
pub const CHECK_EVERY: Duration = Duration::from_millis(20);

/// Names our threads carry (`std::thread::Builder::name`): `vramcap-writer`, `vramcap-io`, ...
const OUR_PREFIX: &[u8] = b"vramcap-";

/// `(comm, state)` of one thread from `/proc/self/task/<tid>/stat`: `tid (comm) S ...`.
fn comm_and_state(stat: &[u8]) -> Option<(&[u8], u8)> {
    let open = stat.iter().position(|&b| b == b'(')?;
    // The name may itself contain `)`: the last one closes it.
    let close = stat.iter().rposition(|&b| b == b')')?;
    let state = *stat.get(close + 2)?;
    Some((stat.get(open + 1..close)?, state))
}

fn ended(state: u8) -> bool {
    // Zombie or dead: a main thread that called pthread_exit stays a zombie until the process ends.
    state == b'Z' || state == b'X'
}

/// True when the main thread has ended and only vramcap's threads remain. Errs on "no": a thread
/// we cannot read is counted as the program's.
pub fn only_ours_left() -> bool {
    let pid = unsafe { libc::getpid() };
    let main = std::fs::read(format!("/proc/self/task/{pid}/stat")).unwrap_or_default();
    if !comm_and_state(&main).is_some_and(|(_, s)| ended(s)) {
        return false;
    }
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return false };
    for entry in dir {
        let Ok(entry) = entry else { return false };
        let Ok(stat) = std::fs::read(entry.path().join("stat")) else {
            // Gone between the listing and the read: it has ended.
            continue;
        };
        match comm_and_state(&stat) {
            Some((_, s)) if ended(s) => {}
            Some((comm, _)) if comm.starts_with(OUR_PREFIX) => {}
            _ => return false,
        }
    }
    true
}

/// Ends the process the way glibc does when its last thread ends: `exit(0)` (which runs the
/// `atexit` handlers, ours returning at once as the trace is finished). A signal that arrived
/// while only our threads were left, all blocking every signal, is delivered first: a SIGTERM
/// sent to the finished program ends it by SIGTERM, as it would have without vramcap.
pub fn exit_as_last_thread() -> ! {
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::exit(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_with_spaces_and_parentheses() {
        assert_eq!(comm_and_state(b"12 (python3) S 1 2"), Some((&b"python3"[..], b'S')));
        assert_eq!(comm_and_state(b"12 (a) b) Z 1"), Some((&b"a) b"[..], b'Z')));
        assert_eq!(comm_and_state(b"12 (vramcap-io) R 1"), Some((&b"vramcap-io"[..], b'R')));
        assert_eq!(comm_and_state(b""), None);
        assert_eq!(comm_and_state(b"12 (x)"), None);
    }

    #[test]
    fn a_live_main_thread_is_never_ours_alone() {
        assert!(!only_ours_left());
    }
}
