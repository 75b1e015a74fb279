//! The job never waits for us. A program whose main thread ends with `pthread_exit` (legal, and
//! common in C and C++ servers) lives on while its other threads run; glibc ends the process with
//! `exit(0)` when the last thread ends, and only then runs `atexit` handlers. vramcap's writer and
//! I/O threads are threads too: waiting for `atexit` to stop them, they kept such a process alive
//! for ever, and as they block every signal, nothing was left to take SIGTERM or SIGINT.
//!
//! So the writer watches for that state itself: once the main thread has ended and every thread
//! left is one of ours, it finishes the trace (summary included) and ends the process as glibc
//! would have, with status 0 (or by a signal that arrived meanwhile).

use std::time::Duration;

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
