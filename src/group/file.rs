//! The ledger file: created complete or not at all, opened and checked, mapped `MAP_SHARED`;
//! and what `/proc` says about a member's identity.

use super::shm::{LAYOUT_BYTES, Shared};
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

/// Start time of a pid of our own namespace, and whether it is a zombie.
pub fn proc_start(pid: u32) -> Option<(u64, bool)> {
    super::liveness::proc_start_of(&pid.to_string())
}

/// This process's start time as other members will check it.
pub fn self_start() -> u64 {
    super::liveness::self_identity().0
}

#[allow(unused_imports)] // the fuzz targets parse through here
pub use super::liveness::{liveness, parse_stat};
#[cfg(test)]
mod tests {
    use super::*;

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
