//! Periodic reclaim of dead group members (issue 6): a member killed with SIGKILL leaves its charge
//! in the group ledger until another member is about to be denied. The sidecar sweeps every group
//! its clients belong to, so the budget comes back even when nobody is allocating.
//!
//! It maps the same ledger files the members do (docs/configuration.md, group caps) and uses the
//! same once-only reclaim (`Shared::reclaim_dead`): a member that reclaims at the same moment
//! cannot double-count, whoever wins the slot's compare-and-swap gives the charge back.

use vramcap_common::group_ledger::{self, file};

use super::state::Registry;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bytes given back to groups since start (metric `vramcap_group_reclaimed_bytes_total`).
pub static RECLAIMED_BYTES: AtomicU64 = AtomicU64::new(0);
/// The last error each (uid, group) gave: a ledger that stays unusable is reported once, not
/// every sweep (a client could otherwise keep the log busy by naming it). Keyed by uid too: two
/// uids' groups of one name are different ledgers, and one's success must not re-arm the
/// other's line (each sweep would then log it again).
static LAST_ERROR: Mutex<BTreeMap<(u32, String), String>> = Mutex::new(BTreeMap::new());

/// Sweeps every group its clients have reported, every `every`: `dir/vramcap-group-<name>`, or
/// without `--group-dir` the reporting uid's default directory (see [`uid_dir`]). A name is
/// forgotten once no connected client of that uid names it and its ledger has no members left (or
/// there is no usable ledger): what clients send can never make the set grow for good.
pub fn spawn(dir: Option<PathBuf>, registry: Arc<Mutex<Registry>>, every: Duration) -> std::io::Result<()> {
    std::thread::Builder::new().name("group-reclaim".into()).spawn(move || {
        loop {
            std::thread::sleep(every);
            let groups: BTreeSet<(u32, String)> = registry.lock().unwrap_or_else(|e| e.into_inner()).groups.clone();
            let empty: Vec<(u32, String)> = groups.into_iter().filter(|(uid, g)| sweep_for(dir.as_deref(), *uid, g) == 0).collect();
            if empty.is_empty() {
                continue;
            }
            let mut reg = registry.lock().unwrap_or_else(|e| e.into_inner());
            for (uid, g) in empty {
                // Checked under the lock: a client that names the group now keeps it.
                if !reg.clients.values().any(|c| c.uid == uid && c.group.as_deref() == Some(g.as_str())) {
                    reg.groups.remove(&(uid, g.clone()));
                    LAST_ERROR.lock().unwrap_or_else(|e| e.into_inner()).remove(&(uid, g.clone()));
                }
            }
        }
    })?;
    Ok(())
}

/// One group of one uid; returns the members left (0 without a usable ledger).
fn sweep_for(dir: Option<&Path>, uid: u32, group: &str) -> usize {
    if let Some(d) = dir {
        return sweep(d, uid, group).2;
    }
    match uid_dir(uid) {
        Ok(fd) => {
            let left = sweep(Path::new(&format!("/proc/self/fd/{fd}")), uid, group).2;
            unsafe { libc::close(fd) };
            left
        }
        Err(e) => {
            note_error(uid, group, Err(&e), &format!("group {group:?} of uid {uid}: {e}"));
            0
        }
    }
}

/// The members' default directory of `uid` (`/dev/shm/vramcap-<uid>`), opened without following
/// a symbolic link and kept open while it is swept (so it cannot be swapped between the check and
/// the use): only a real directory of that uid that nobody else can write, as the members
/// themselves require. A squatter's directory of that name is never swept.
fn uid_dir(uid: u32) -> Result<i32, String> {
    let path = format!("{}/vramcap-{uid}", vramcap_common::grammar::group::DEFAULT_DIR);
    let c = std::ffi::CString::new(path.clone()).map_err(|e| e.to_string())?;
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("{path}: {}; not swept", std::io::Error::last_os_error()));
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_uid == uid && st.st_mode & 0o022 == 0;
    if !ok {
        unsafe { libc::close(fd) };
        return Err(format!("{path} is not a directory of uid {uid} that only it can write; not swept"));
    }
    Ok(fd)
}

/// Opens the ledger without following a symlink: `file::open_existing` opens the name itself with
/// `O_NOFOLLOW` and maps it only if it is a regular file (one lookup, so no swap in between).
fn open_ledger(path: &Path) -> Result<Option<file::Mapping>, String> {
    file::open_existing(path).map_err(|e| match std::fs::symlink_metadata(path) {
        // Only the wording: the refusal itself came from the one open above.
        Ok(m) if !m.file_type().is_file() => {
            format!("{} is not a regular file (a symlink is never followed); not swept", path.display())
        }
        _ => e,
    })
}

/// Remembers the outcome for (uid, group); true when `line` was logged (a new error).
fn note_error(uid: u32, group: &str, outcome: Result<(), &String>, line: &str) -> bool {
    let mut last = LAST_ERROR.lock().unwrap_or_else(|e| e.into_inner());
    let key = (uid, group.to_string());
    match outcome {
        Err(e) if last.get(&key) != Some(e) => {
            super::logline::log("group ledger", line);
            last.insert(key, e.clone());
            true
        }
        Err(_) => false,
        Ok(()) => {
            last.remove(&key);
            false
        }
    }
}

/// One group of one uid: returns (members, bytes) reclaimed and the members left (0 without a
/// ledger).
fn sweep(dir: &Path, uid: u32, group: &str) -> (usize, u64, usize) {
    let path = file::path_for(&dir.to_string_lossy(), group);
    let opened = open_ledger(&path);
    match &opened {
        Err(e) => note_error(uid, group, Err(e), &format!("group {group:?}: {e}")),
        Ok(_) => note_error(uid, group, Ok(()), ""),
    };
    let m = match opened {
        Ok(Some(m)) => m,
        Ok(None) | Err(_) => return (0, 0, 0),
    };
    // With the exported memory of ended members no fd keeps any more (`group_ledger::kept`).
    let (n, bytes) = group_ledger::reclaim_in(m.shm);
    let left = m.shm.members();
    m.unmap();
    if n > 0 {
        RECLAIMED_BYTES.fetch_add(bytes, Ordering::Relaxed);
        eprintln!("vramcap: sidecar: group {group:?}: reclaimed {bytes} bytes from {n} dead member(s)");
    }
    (n, bytes, left)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_uids_working_ledger_does_not_rearm_anothers_error_line() {
        let (g, e) = ("dedupe-test-group", "vanished; not swept".to_string());
        assert!(note_error(9001, g, Err(&e), "x"), "a new error is logged");
        assert!(!note_error(9001, g, Err(&e), "x"), "the same error again is not");
        // Another uid's group of the same name sweeps fine: uid 9001's error stays noted.
        assert!(!note_error(9002, g, Ok(()), ""));
        assert!(!note_error(9001, g, Err(&e), "x"), "re-armed by another uid's success");
        // The same uid's own success does re-arm it.
        assert!(!note_error(9001, g, Ok(()), ""));
        assert!(note_error(9001, g, Err(&e), "x"));
    }

    /// Only a real directory of that uid which nobody else can write is swept: a squatter's
    /// directory of that name, one others can write, or a symbolic link is refused.
    #[test]
    fn only_the_uids_own_private_directory_is_swept() {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED only_the_uids_own_private_directory_is_swept: needs root to chown");
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        let uid = 54_000 + std::process::id() % 1000;
        let dir = PathBuf::from(format!("{}/vramcap-{uid}", vramcap_common::grammar::group::DEFAULT_DIR));
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_file(&dir);
        let chown = |p: &Path, u: u32| {
            let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
            assert_eq!(unsafe { libc::lchown(c.as_ptr(), u, u) }, 0);
        };
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let err = uid_dir(uid).unwrap_err();
        assert!(err.contains("not a directory of uid"), "root's directory of that name: {err}");
        chown(&dir, uid);
        let fd = uid_dir(uid).expect("the uid's own private directory");
        unsafe { libc::close(fd) };
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(uid_dir(uid).is_err(), "a directory others can write");
        std::fs::remove_dir(&dir).unwrap();
        std::os::unix::fs::symlink("/tmp", &dir).unwrap();
        chown(&dir, uid);
        assert!(uid_dir(uid).is_err(), "a symbolic link, even the uid's own");
        std::fs::remove_file(&dir).unwrap();
    }
}
