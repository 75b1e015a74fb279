//! How a trace file is opened (docs/security.md, "Trace files"; docs/configuration.md, "Tracing").
//!
//! The trace path comes from the environment and may lie in a directory other users can write
//! (`/tmp`), and the process may run as root. So:
//! - a new file is created with `O_CREAT | O_EXCL`, which never follows a final symlink and never
//!   touches an existing file: two processes started at once with one template cannot both get it;
//! - an existing path is opened with `O_NOFOLLOW`; a final symlink is followed only when it belongs
//!   to us or to root (`/dev/stdout`, links we made ourselves), never when someone else planted it;
//! - an existing regular file is taken over (later emptied by the writer) only when it is ours
//!   (our effective uid, one link: not a hard link to someone's file), no running process holds
//!   its `flock` (every writer holds one on its file for its lifetime; the kernel drops it when
//!   the process dies, however it dies) and its header names no running process;
//! - otherwise the trace goes to `PATH.<pid>` (then `PATH.<pid>.1`, ...), created exclusively, and
//!   one stderr line names the file actually written.
//!
//! A FIFO, a terminal or `/dev/null` is written as it is, never truncated.

use std::ffi::CString;
use std::io::Error;

/// A trace file this process may empty and write.
pub struct Opened {
    pub fd: i32,
    /// The file actually written (the template's expansion, or a fallback).
    pub path: String,
    /// Set when `path` is a fallback: why the first choice was not used.
    pub moved: Option<String>,
}

enum Claim {
    Ours(i32),
    /// Exists and is not ours to take: why.
    Taken(String),
    Failed(Error),
}

/// Fallbacks tried after the first choice (`PATH.<pid>`, `PATH.<pid>.1`, ...).
const FALLBACKS: usize = 4;

/// Opens the trace for `path`; `Err` carries the path that failed and why.
pub fn open_trace(path: &str, pid: i32) -> Result<Opened, (String, Error)> {
    let mut why_moved: Option<String> = None;
    for i in 0..=FALLBACKS {
        let candidate = match i {
            0 => path.to_string(),
            1 => format!("{path}.{pid}"),
            n => format!("{path}.{pid}.{}", n - 1),
        };
        match claim(&candidate, pid) {
            Claim::Ours(fd) => return Ok(Opened { fd, path: candidate, moved: why_moved }),
            Claim::Taken(why) => {
                why_moved.get_or_insert(why);
            }
            Claim::Failed(e) => return Err((candidate, e)),
        }
    }
    let why = why_moved.unwrap_or_default();
    Err((path.to_string(), Error::other(format!("{why}, and so are {path}.{pid} and the next {} fallbacks", FALLBACKS - 1))))
}

fn errno() -> i32 {
    Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn claim(path: &str, me: i32) -> Claim {
    let Ok(c) = CString::new(path) else { return Claim::Failed(Error::from_raw_os_error(libc::EINVAL)) };
    let euid = unsafe { libc::geteuid() };
    // A file that vanishes or appears between two steps is simply tried again.
    for _ in 0..8 {
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        let fd = unsafe { libc::open(c.as_ptr(), flags, 0o644) };
        if fd >= 0 {
            return settle_created(fd, path);
        }
        if errno() != libc::EEXIST {
            return Claim::Failed(Error::last_os_error());
        }
        // No O_TRUNC anywhere: the writer empties the file once it is known to be ours.
        let mut fd = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            match errno() {
                libc::ENOENT => continue,
                libc::ELOOP => {
                    let mut st: libc::stat = unsafe { std::mem::zeroed() };
                    if unsafe { libc::lstat(c.as_ptr(), &mut st) } != 0 {
                        continue;
                    }
                    if (st.st_mode & libc::S_IFMT) != libc::S_IFLNK {
                        continue;
                    }
                    if st.st_uid != euid && st.st_uid != 0 {
                        return Claim::Taken(format!("{path} is a symbolic link owned by uid {}, not followed", st.st_uid));
                    }
                    // Our own link or root's (`/dev/stdout`): followed, and what it leads to is
                    // judged below like any file.
                    fd = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC, 0o644) };
                    if fd < 0 {
                        return Claim::Failed(Error::last_os_error());
                    }
                }
                _ => return Claim::Failed(Error::last_os_error()),
            }
        }
        return judge_existing(fd, path, euid, me);
    }
    Claim::Failed(Error::other("the path kept changing while it was opened"))
}

/// `fd` is a file this process just created. The lock tells processes starting now that it is
/// in use; but one of them may have opened the new, still unlocked and empty file between our
/// `open` and our `flock`, locked it and judged it free (no header names a running process).
/// The lock decides: whoever holds it writes the file, the other falls back (CI saw two
/// processes write one file before this check).
fn settle_created(fd: i32, path: &str) -> Claim {
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 && errno() == libc::EWOULDBLOCK {
        unsafe { libc::close(fd) };
        return Claim::Taken(format!("{path} is being written by another running process"));
    }
    Claim::Ours(fd)
}

/// `fd` is open on something that already existed at `path`.
fn judge_existing(fd: i32, path: &str, euid: u32, me: i32) -> Claim {
    let taken = |why: String| {
        unsafe { libc::close(fd) };
        Claim::Taken(why)
    };
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        let e = Error::last_os_error();
        unsafe { libc::close(fd) };
        return Claim::Failed(e);
    }
    if (st.st_mode & libc::S_IFMT) != libc::S_IFREG {
        // A FIFO, a terminal, /dev/null: written as it is (the writer never truncates these).
        return Claim::Ours(fd);
    }
    if st.st_uid != euid {
        return taken(format!("{path} belongs to uid {}, not overwritten", st.st_uid));
    }
    if st.st_nlink > 1 {
        return taken(format!("{path} has {} hard links, not overwritten", st.st_nlink));
    }
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        if errno() == libc::EWOULDBLOCK {
            return taken(format!("{path} is being written by another running process"));
        }
        // A filesystem without locks: the header check below still applies.
    }
    if let Some(pid) = live_owner(fd, me) {
        return taken(format!("{path} is being written by running pid {pid}"));
    }
    Claim::Ours(fd)
}

/// The pid in the header of the existing trace open on `fd`, if that process is alive and not
/// us (a file of a finished run, or our own from before `exec`, is taken over). Read through
/// `/proc/self/fd`, so it is the very file we hold, not whatever the path names by now.
fn live_owner(fd: i32, me: i32) -> Option<i32> {
    use std::io::{BufRead, Read};
    let f = std::fs::File::open(format!("/proc/self/fd/{fd}")).ok()?;
    let mut first = String::new();
    std::io::BufReader::new(f.take(4096)).read_line(&mut first).ok()?;
    let digits = first.split_once("\"pid\":")?.1;
    let end = digits.find(|c: char| !c.is_ascii_digit()).unwrap_or(digits.len());
    let pid: i32 = digits[..end].parse().ok()?;
    let alive = pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || errno() == libc::EPERM);
    (pid != me && alive).then_some(pid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn dir(name: &str) -> String {
        let d = std::env::temp_dir().join(format!("vramcap-create-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d.to_string_lossy().into_owned()
    }

    #[test]
    fn creates_then_a_second_claim_while_locked_falls_back() {
        let d = dir("lock");
        let p = format!("{d}/t.jsonl");
        let a = open_trace(&p, 11).unwrap();
        assert_eq!((a.path.as_str(), a.moved.is_none()), (p.as_str(), true));
        // Same process, another open file description: the lock is per description.
        let b = open_trace(&p, 22).unwrap();
        assert_eq!(b.path, format!("{p}.22"));
        assert!(b.moved.unwrap().contains("another running process"));
        unsafe { libc::close(a.fd) };
        // Unlocked and ours: taken over (a finished run's file).
        let c = open_trace(&p, 33).unwrap();
        assert_eq!(c.path, p);
        unsafe { libc::close(b.fd) };
        unsafe { libc::close(c.fd) };
    }

    /// The window between creating a file and locking it: another process that opened and
    /// locked the new file in that window keeps it, and the creator falls back.
    #[test]
    fn a_file_locked_by_another_between_create_and_lock_is_left_to_it() {
        let d = dir("window");
        let p = format!("{d}/t.jsonl");
        let c = CString::new(p.as_str()).unwrap();
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        let created = unsafe { libc::open(c.as_ptr(), flags, 0o644) };
        assert!(created >= 0);
        let other = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        assert_eq!(unsafe { libc::flock(other, libc::LOCK_EX | libc::LOCK_NB) }, 0);
        match settle_created(created, &p) {
            Claim::Taken(why) => assert!(why.contains("another running process"), "{why}"),
            _ => panic!("the creator kept a file another process had locked"),
        }
        unsafe { libc::close(other) };
        // Unlocked again: a fresh creation settles as ours.
        let p2 = format!("{d}/u.jsonl");
        let c2 = CString::new(p2.as_str()).unwrap();
        let fd = unsafe { libc::open(c2.as_ptr(), flags, 0o644) };
        assert!(matches!(settle_created(fd, &p2), Claim::Ours(_)));
        unsafe { libc::close(fd) };
    }

    #[test]
    fn hard_links_and_foreign_symlinks_are_not_taken() {
        let d = dir("links");
        let victim = format!("{d}/victim");
        std::fs::write(&victim, "keep").unwrap();
        let hard = format!("{d}/hard.jsonl");
        std::fs::hard_link(&victim, &hard).unwrap();
        let o = open_trace(&hard, 44).unwrap();
        assert_eq!(o.path, format!("{hard}.44"));
        assert!(o.moved.unwrap().contains("hard links"));
        unsafe { libc::close(o.fd) };
        // Our own symlink is followed.
        let link = format!("{d}/mine.jsonl");
        std::os::unix::fs::symlink(format!("{d}/target"), &link).unwrap();
        let o = open_trace(&link, 45).unwrap();
        assert_eq!(o.path, link);
        unsafe { libc::close(o.fd) };
        assert!(std::fs::metadata(format!("{d}/target")).unwrap().is_file(), "created through our link");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(std::fs::metadata(&victim).unwrap().nlink(), 2);
    }
}
