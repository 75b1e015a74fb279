//! Paths inside a container's root filesystem, reached from the hook (which runs as root with the
//! host's view before the container's root is pivoted to). The image is not trusted: a symbolic
//! link it planted at `/etc` would otherwise point a mount at the host's own directories. So each
//! component is opened on its own with `O_NOFOLLOW`, a link anywhere is refused, and mounts go to
//! the `/proc/self/fd/N` of what was opened, never to a path resolved again.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// An `O_PATH` descriptor, closed on drop.
pub struct Fd(i32);

impl Drop for Fd {
    fn drop(&mut self) {
        unsafe { libc::close(self.0) };
    }
}

fn cstr(s: &[u8]) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{:?} contains a NUL byte", String::from_utf8_lossy(s)))
}

fn last_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

impl Fd {
    /// The container's root, as the runtime gave it (its own path: followed).
    pub fn root(path: &Path) -> Result<Fd, String> {
        let c = cstr(path.as_os_str().as_bytes())?;
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(format!("cannot open the container's root {}: {}", path.display(), last_err()));
        }
        Ok(Fd(fd))
    }

    /// `rel` (`etc/vramcap/group`) below this directory, one component at a time, never through
    /// a symbolic link. `shown` names the path in messages as the container sees it.
    pub fn walk(&self, rel: &str, shown: &str) -> Result<Fd, String> {
        let mut cur: Option<Fd> = None;
        for part in rel.split('/').filter(|p| !p.is_empty()) {
            if part == "." || part == ".." {
                return Err(format!("{shown}: `{part}` in a container path"));
            }
            let base = cur.as_ref().map_or(self.0, |f| f.0);
            let c = cstr(part.as_bytes())?;
            let fd = unsafe { libc::openat(base, c.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(format!("{shown}: cannot open `{part}` in the container: {}", last_err()));
            }
            let next = Fd(fd);
            if next.kind()? == libc::S_IFLNK {
                return Err(format!(
                    "{shown}: `{part}` is a symbolic link in the container's image; vramcap refuses to mount through it"
                ));
            }
            cur = Some(next);
        }
        cur.ok_or_else(|| format!("{shown}: empty path"))
    }

    fn stat(&self) -> Result<libc::stat, String> {
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(self.0, &mut st) } != 0 {
            return Err(format!("cannot inspect an opened path: {}", last_err()));
        }
        Ok(st)
    }

    /// `S_IFDIR`, `S_IFREG`, `S_IFLNK`, ...
    pub fn kind(&self) -> Result<u32, String> {
        Ok(self.stat()?.st_mode & libc::S_IFMT)
    }

    /// Whether this is the very file or directory at `host` (the same inode: a bind mount of it).
    pub fn is(&self, host: &Path) -> Result<bool, String> {
        let mine = self.stat()?;
        let m = std::fs::metadata(host).map_err(|e| format!("{}: {e}", host.display()))?;
        use std::os::unix::fs::MetadataExt;
        Ok(mine.st_dev == m.dev() && mine.st_ino == m.ino())
    }

    /// The magic link that names exactly what was opened.
    pub fn proc_path(&self) -> String {
        format!("/proc/self/fd/{}", self.0)
    }
}

/// Bind-mounts `source` (a host path, or a `proc_path`) onto what `target` opened; `recursive`
/// takes the mounts below `source` along.
pub fn bind(source: &str, target: &Fd, recursive: bool, shown: &str) -> Result<(), String> {
    let (src, dst) = (cstr(source.as_bytes())?, cstr(target.proc_path().as_bytes())?);
    let flags = libc::MS_BIND | if recursive { libc::MS_REC } else { 0 };
    if unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), std::ptr::null(), flags, std::ptr::null()) } != 0 {
        return Err(format!("cannot bind {source} onto {shown} in the container: {}", last_err()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symlink_anywhere_on_the_way_is_refused() {
        let t = std::env::temp_dir().join(format!("vramcap-rootfs-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&t);
        std::fs::create_dir_all(t.join("real/etc/vramcap")).unwrap();
        std::fs::write(t.join("real/etc/vramcap/limits"), "x").unwrap();
        std::fs::create_dir_all(t.join("evil")).unwrap();
        std::os::unix::fs::symlink("/", t.join("evil/etc")).unwrap();
        let root = Fd::root(&t.join("real")).unwrap();
        let f = root.walk("etc/vramcap/limits", "/etc/vramcap/limits").unwrap();
        assert_eq!(f.kind().unwrap(), libc::S_IFREG);
        assert!(f.is(&t.join("real/etc/vramcap/limits")).unwrap());
        assert!(!f.is(&t.join("real/etc/vramcap")).unwrap());
        let evil = Fd::root(&t.join("evil")).unwrap();
        let e = evil.walk("etc/vramcap", "/etc/vramcap").err().unwrap();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(root.walk("etc/../etc", "x").err().unwrap().contains("`..`"));
        assert!(root.walk("etc/missing", "x").err().unwrap().contains("No such file"));
        std::fs::remove_dir_all(&t).unwrap();
    }
}
