//! `VRAMCAP_TRACE_LIST=FILE`: tells `vramcap run --report` which trace file this process wrote.
//!
//! A process may not write the template's expansion: when that name is taken (another user's
//! file in `/tmp`, a running writer's) it writes a fallback (`create.rs`). Guessing those names
//! back from the template let anyone who can plant files hide a job's trace from its report, so
//! each process says which file it opened instead: one line, the path as a JSON string, appended
//! to the list `run` created in a directory only its user can enter. The list is only ever
//! appended to, never created or followed through a symlink, and only when it is a regular file
//! of our own uid: a list someone else made is not written.

use std::ffi::CString;

/// Appends `path` (made absolute: the reader does not share our working directory) to `list`.
/// Runs on the writer thread, once, after the trace file is open. Failure only costs the report
/// this file; it is said on stderr.
pub fn announce(list: &str, path: &str) {
    if let Err(e) = append(list, path) {
        crate::log::write_line(&format!("vramcap: cannot add the trace {path} to VRAMCAP_TRACE_LIST={list}: {e}; `vramcap run --report` may miss it"));
    }
}

fn append(list: &str, path: &str) -> std::io::Result<()> {
    let abs = if path.starts_with('/') {
        path.to_string()
    } else {
        std::env::current_dir()?.join(path).to_string_lossy().into_owned()
    };
    let mut line = serde_json::to_string(&abs).map_err(std::io::Error::other)?;
    line.push('\n');
    let c = CString::new(list).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_APPEND | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0
        && (st.st_mode & libc::S_IFMT) == libc::S_IFREG
        && st.st_uid == unsafe { libc::geteuid() };
    // One write: O_APPEND lines of several processes do not interleave.
    let r = if ok {
        crate::log::write_all(fd, line.as_bytes()).map_err(|(_, e)| e)
    } else {
        Err(std::io::Error::other("not a regular file of our own uid"))
    };
    unsafe { libc::close(fd) };
    r
}
