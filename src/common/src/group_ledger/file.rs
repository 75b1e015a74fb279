//! The ledger file: created complete or not at all, opened and checked, mapped `MAP_SHARED`;
//! and what `/proc` says about a member's identity.

use super::shm::{LAYOUT_BYTES, MAGIC, Shared, VERSION};
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

/// The format version in the header of a vramcap ledger `fd` (read, not mapped) when it is not
/// this build's; `None`: not a vramcap ledger, or this version (then it is truly truncated).
fn other_version(fd: libc::c_int) -> Option<u32> {
    let mut h = [0u8; 12];
    let n = unsafe { libc::pread(fd, h.as_mut_ptr().cast(), h.len(), 0) };
    if n != h.len() as isize || u64::from_ne_bytes(h[..8].try_into().ok()?) != MAGIC {
        return None;
    }
    let v = u32::from_ne_bytes(h[8..12].try_into().ok()?);
    (v != VERSION).then_some(v)
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
        let base = self.shm as *const Shared as usize;
        super::guard::unprotect(base);
        unsafe { libc::munmap(base as *mut libc::c_void, self.len) };
    }
}

fn map_fd(fd: i32, p: &Path) -> Result<Mapping, String> {
    let ptr = unsafe {
        libc::mmap(std::ptr::null_mut(), LAYOUT_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    if ptr == libc::MAP_FAILED {
        return Err(os_err("map", p));
    }
    // The file may be truncated later: a touch past its end is caught (see `guard`).
    super::guard::protect(ptr as usize, LAYOUT_BYTES);
    Ok(Mapping { shm: unsafe { &*(ptr as *const Shared) }, len: LAYOUT_BYTES })
}

/// What to say when a ledger or its directory may be another user's doing.
const SQUAT_FIX: &str = "another user may have made it to block or take over the group: have its owner or root \
     remove it, or set VRAMCAP_GROUP_DIR to a directory only the group's users can write";

/// Opens an existing ledger and checks its contents; `Ok(None)` if there is none. Never follows
/// a symbolic link and takes only a regular file. Any owner: the sidecar (root) uses this on
/// every user's ledgers; a member uses [`open_member`].
pub fn open_existing(p: &Path) -> Result<Option<Mapping>, String> {
    open_checked(p, false).map(|m| m.map(|(m, _)| m))
}

/// [`open_existing`], with the uid that owns the file as opened (the file mapped, not a path
/// looked up again): `vramcap limit` lets only that uid, or root, change the budget.
pub fn open_with_owner(p: &Path) -> Result<Option<(Mapping, u32)>, String> {
    open_checked(p, false)
}

/// [`open_existing`] for a member, which also refuses a ledger another user could have made or
/// can rewrite (see [`check_owner`]).
pub fn open_member(p: &Path) -> Result<Option<Mapping>, String> {
    open_checked(p, true).map(|m| m.map(|(m, _)| m))
}

fn open_checked(p: &Path, member: bool) -> Result<Option<(Mapping, u32)>, String> {
    let fd = unsafe { libc::open(cstr(p).as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK) };
    if fd < 0 {
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            Some(libc::ELOOP) => Err(format!("group ledger {} is a symbolic link, refused: {SQUAT_FIX}", p.display())),
            _ => Err(os_err("open", p)),
        };
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        let e = os_err("inspect", p);
        unsafe { libc::close(fd) };
        return Err(e);
    }
    let checked = if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        Err(format!("group ledger {} is not a regular file, refused: {SQUAT_FIX}", p.display()))
    } else if member {
        check_owner(&st, p)
    } else {
        Ok(())
    };
    let size = st.st_size as u64;
    let checked = checked.and_then(|()| {
        if size < LAYOUT_BYTES as u64 {
            // Mapping past the end would SIGBUS on first touch: refuse before mapping. A ledger
            // of another format version (another vramcap build still running, or left over) is
            // said as such, not as a truncated file.
            Err(match other_version(fd) {
                Some(v) => format!(
                    "group ledger {} is format version {v} ({size} bytes), this vramcap understands version {VERSION} ({LAYOUT_BYTES} bytes): upgrade the group's jobs together, or remove the file once none of them runs",
                    p.display()
                ),
                None => format!("group ledger {} is truncated ({size} bytes, expected {LAYOUT_BYTES})", p.display()),
            })
        } else {
            map_fd(fd, p)
        }
    });
    unsafe { libc::close(fd) };
    let m = checked?;
    if let Err(e) = m.shm.validate() {
        m.unmap();
        return Err(format!("group ledger {}: {e}", p.display()));
    }
    Ok(Some((m, st.st_uid)))
}

/// A member trusts a ledger that is not writable by every user and is its own or root's; or,
/// in a directory not every user can write (made for the group by its administrator), one of
/// its Unix groups' files. Anything else could be a squatter's: in `/dev/shm` any user can
/// create `vramcap-group-<name>` first (with a limit of their choosing, or mode 0666).
pub fn check_owner(st: &libc::stat, p: &Path) -> Result<(), String> {
    let me = unsafe { libc::geteuid() };
    if st.st_mode & 0o002 != 0 {
        return Err(format!(
            "group ledger {} is writable by every user (mode {:o}), refused: anyone could rewrite the group's limit; {SQUAT_FIX}",
            p.display(),
            st.st_mode & 0o7777
        ));
    }
    if st.st_uid == me || st.st_uid == 0 {
        return Ok(());
    }
    let dir = p.parent().unwrap_or(Path::new("/"));
    let dir_shared_with_all = std::fs::metadata(dir).map_or(true, |m| {
        use std::os::unix::fs::MetadataExt;
        m.mode() & 0o002 != 0
    });
    if !dir_shared_with_all && in_my_groups(st.st_gid) {
        return Ok(());
    }
    Err(format!(
        "group ledger {} belongs to uid {} (this process runs as uid {me}){}, refused: {SQUAT_FIX}",
        p.display(),
        st.st_uid,
        if dir_shared_with_all { " in a directory every user can write" } else { " and a Unix group this process is not in" }
    ))
}

fn in_my_groups(gid: libc::gid_t) -> bool {
    if unsafe { libc::getegid() } == gid {
        return true;
    }
    let mut groups = [0 as libc::gid_t; 256];
    let n = unsafe { libc::getgroups(groups.len() as i32, groups.as_mut_ptr()) };
    n > 0 && groups[..n as usize].contains(&gid)
}

/// Makes (or checks) the default per-user directory: a real directory of ours that nobody else
/// can write. A squatter's directory of that name is refused, never used.
pub fn ensure_private_dir(dir: &str) -> Result<(), String> {
    let c = CString::new(dir).map_err(|_| format!("group directory {dir:?} contains a NUL byte"))?;
    if unsafe { libc::mkdir(c.as_ptr(), 0o700) } != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
        return Err(format!("cannot create group directory {dir}: {}", std::io::Error::last_os_error()));
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::lstat(c.as_ptr(), &mut st) } != 0 {
        return Err(format!("cannot inspect group directory {dir}: {}", std::io::Error::last_os_error()));
    }
    let me = unsafe { libc::geteuid() };
    let problem = if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        Some("is not a directory (a symbolic link or a file)".to_string())
    } else if st.st_uid != me {
        Some(format!("belongs to uid {} (this process runs as uid {me})", st.st_uid))
    } else if st.st_mode & 0o022 != 0 {
        Some(format!("can be written by other users (mode {:o})", st.st_mode & 0o7777))
    } else {
        None
    };
    match problem {
        None => Ok(()),
        Some(why) => Err(format!(
            "group directory {dir} (the default for uid {me}) {why}, refused: another user may have made it to block or \
             take over your groups; have root remove it, or set VRAMCAP_GROUP_DIR to a directory only your group's users can write"
        )),
    }
}

/// Opens the ledger, creating it if absent. A new ledger is built in a private temporary file
/// and published with `link()`, which fails if another member published first: nobody ever
/// sees a half-initialised file.
pub fn open_or_create(p: &Path, name: &str) -> Result<Mapping, String> {
    for _ in 0..8 {
        if let Some(m) = open_member(p)? {
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
            libc::open(cstr(&tmp).as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW, 0o660)
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
        m.shm.devices[0].held.store(5, std::sync::atomic::Ordering::Relaxed);
        let again = open_or_create(&p, "u").unwrap();
        assert_eq!(again.shm.used(0), 5, "one shared file");
        std::fs::write(&p, b"short").unwrap();
        assert!(open_existing(&p).err().unwrap().contains("truncated"));
        // A smaller ledger of another format version (an older build's, left in /dev/shm) is
        // said as such: the operator is told what to do, not that the file is damaged.
        let mut old = MAGIC.to_ne_bytes().to_vec();
        old.extend_from_slice(&(VERSION - 1).to_ne_bytes());
        old.resize(4096, 0);
        std::fs::write(&p, &old).unwrap();
        let e = open_existing(&p).err().unwrap();
        assert!(e.contains(&format!("format version {}", VERSION - 1)) && e.contains("upgrade the group's jobs together"), "{e}");
        std::fs::write(&p, vec![0u8; LAYOUT_BYTES]).unwrap();
        assert!(open_existing(&p).err().unwrap().contains("bad magic"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
