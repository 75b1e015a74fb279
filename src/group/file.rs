//! The ledger file: created complete or not at all, opened and checked, mapped `MAP_SHARED`;
//! and what `/proc` says about a member's identity.

use super::shm::{LAYOUT_BYTES, Liveness, Shared};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `<dir>/vramcap-group-<name>`
pub fn path_for(dir: &str, name: &str) -> PathBuf {
    Path::new(dir).join(format!("vramcap-group-{name}"))
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap_or_default()
}

fn os_err(what: &str, p: &Path) -> String {
    format!("cannot {what} group ledger {}: {}", p.display(), std::io::Error::last_os_error())
}

/// A mapped ledger. Never unmapped while referenced: the process keeps it for its lifetime.
pub struct Mapping {
    pub shm: &'static Shared,
    len: usize,
}

impl Mapping {
    pub fn unmap(self) {
        unsafe { libc::munmap(self.shm as *const Shared as *mut libc::c_void, self.len) };
    }
}

fn map_fd(fd: i32, p: &Path) -> Result<Mapping, String> {
    let ptr = unsafe {
        libc::mmap(std::ptr::null_mut(), LAYOUT_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    if ptr == libc::MAP_FAILED {
        return Err(os_err("map", p));
    }
    Ok(Mapping { shm: unsafe { &*(ptr as *const Shared) }, len: LAYOUT_BYTES })
}

/// Opens an existing ledger and checks it; `Ok(None)` if there is none.
pub fn open_existing(p: &Path) -> Result<Option<Mapping>, String> {
    let fd = unsafe { libc::open(cstr(p).as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT) {
            return Ok(None);
        }
        return Err(os_err("open", p));
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let size = if unsafe { libc::fstat(fd, &mut st) } == 0 { st.st_size as u64 } else { 0 };
    if size < LAYOUT_BYTES as u64 {
        unsafe { libc::close(fd) };
        // Mapping past the end would SIGBUS on first touch: refuse before mapping.
        return Err(format!(
            "group ledger {} is truncated ({size} bytes, expected {LAYOUT_BYTES})",
            p.display()
        ));
    }
    let m = map_fd(fd, p);
    unsafe { libc::close(fd) };
    let m = m?;
    if let Err(e) = m.shm.validate() {
        m.unmap();
        return Err(format!("group ledger {}: {e}", p.display()));
    }
    Ok(Some(m))
}

/// Opens the ledger, creating it if absent. A new ledger is built in a private temporary file
/// and published with `link()`, which fails if another member published first: nobody ever
/// sees a half-initialised file.
pub fn open_or_create(p: &Path, name: &str) -> Result<Mapping, String> {
    for _ in 0..8 {
        if let Some(m) = open_existing(p)? {
            return Ok(m);
        }
        let tmp = p.with_file_name(format!(
            ".{}.{}.{}",
            p.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id(),
            // Unique enough with the pid; no crate-local clock, so the CLI can share this file.
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        ));
        let fd = unsafe {
            libc::open(cstr(&tmp).as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o660)
        };
        if fd < 0 {
            return Err(os_err("create", &tmp));
        }
        // 0660 whatever the umask: members may run as other users of the same group.
        let ok = unsafe { libc::fchmod(fd, 0o660) == 0 && libc::ftruncate(fd, LAYOUT_BYTES as libc::off_t) == 0 };
        let m = if ok { map_fd(fd, &tmp) } else { Err(os_err("size", &tmp)) };
        unsafe { libc::close(fd) };
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                unsafe { libc::unlink(cstr(&tmp).as_ptr()) };
                return Err(e);
            }
        };
        m.shm.init(name);
        let linked = unsafe { libc::link(cstr(&tmp).as_ptr(), cstr(p).as_ptr()) } == 0;
        let err = std::io::Error::last_os_error();
        unsafe { libc::unlink(cstr(&tmp).as_ptr()) };
        if linked {
            return Ok(m);
        }
        m.unmap();
        if err.raw_os_error() != Some(libc::EEXIST) {
            return Err(format!("cannot create group ledger {}: {err}", p.display()));
        }
        // Another member published first: open theirs.
    }
    Err(format!("group ledger {} keeps appearing and vanishing", p.display()))
}

/// Field 22 (`starttime`) of `/proc/<pid>/stat`, and whether the process is a zombie.
pub fn proc_start(pid: u32) -> Option<(u64, bool)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&s)
}

/// The command name (field 2) may contain spaces and parentheses: fields are counted after the
/// last `)`.
pub fn parse_stat(s: &str) -> Option<(u64, bool)> {
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace(); // field 3 onwards
    let state = f.next()?;
    let start = f.nth(18)?.parse().ok()?; // field 22
    Some((start, state == "Z" || state == "X"))
}

/// This process's identity as other members will check it.
pub fn self_start() -> u64 {
    proc_start(std::process::id()).map_or(0, |(s, _)| s)
}

/// Alive unless the pid is gone, is a zombie, or carries another start time (reused pid).
/// `start == 0` asks only whether the pid exists. A pid we may not signal (another user) and
/// whose `/proc` entry we cannot read counts as alive: never reclaim on a guess.
pub fn liveness(pid: u32, start: u64) -> Liveness {
    if pid == 0 || pid > i32::MAX as u32 {
        return Liveness::Dead;
    }
    if unsafe { libc::kill(pid as i32, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return Liveness::Dead;
    }
    match proc_start(pid) {
        Some((_, true)) => Liveness::Dead,
        Some((s, false)) if start != 0 && s != start => Liveness::Dead,
        _ => Liveness::Alive,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_odd_command_names() {
        let line = "1234 (a) b (c)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        assert_eq!(parse_stat(line), Some((987654, false)));
        let z = "7 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 42 20";
        assert_eq!(parse_stat(z), Some((42, true)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn own_identity_is_alive_and_a_wrong_start_is_not() {
        let me = std::process::id();
        let s = self_start();
        assert!(s > 0);
        assert_eq!(liveness(me, s), Liveness::Alive);
        assert_eq!(liveness(me, 0), Liveness::Alive);
        assert_eq!(liveness(me, s + 1), Liveness::Dead, "same pid, other start time: a reused pid");
        assert_eq!(liveness(0, 0), Liveness::Dead);
    }

    #[test]
    fn create_then_open_and_refuse_corruption() {
        let dir = std::env::temp_dir().join(format!("vramcap-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = path_for(dir.to_str().unwrap(), "u");
        let _ = std::fs::remove_file(&p);
        let m = open_or_create(&p, "u").unwrap();
        assert_eq!(m.shm.name(), "u");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o660);
        m.shm.devices[0].used.store(5, std::sync::atomic::Ordering::Relaxed);
        let again = open_or_create(&p, "u").unwrap();
        assert_eq!(again.shm.devices[0].used.load(std::sync::atomic::Ordering::Relaxed), 5, "one shared file");
        std::fs::write(&p, b"short").unwrap();
        assert!(open_existing(&p).err().unwrap().contains("truncated"));
        std::fs::write(&p, vec![0u8; LAYOUT_BYTES]).unwrap();
        assert!(open_existing(&p).err().unwrap().contains("bad magic"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
