//! `vramcap cdi-hook`: what the spec's hooks run, as root, for each container. The runtime passes
//! the container's state (id, bundle, annotations) on stdin (OCI runtime spec, "State").
//!
//! - `create-container` (the `createContainer` hook: in the container's mount namespace, before
//!   its root is pivoted to): makes the container's ledger (or joins its pod's) in
//!   `--group-dir/<ctr-ID or pod-SANDBOX>/`, owned by the container's user, and binds it over the
//!   placeholder in `/etc/vramcap/group`; binds `--trace-dir/<ID>/` over `/etc/vramcap/trace`;
//!   then binds the container's `/etc` onto itself (unless its root is to be read-only), so no
//!   directory on the way to the mounts can be renamed away. Any failure fails the container's creation: it never starts uncapped.
//! - `poststop` (after the container is gone): removes the container's ledger; a pod's ledger
//!   loses this container (its dead processes' charges are reclaimed from the host, which sees
//!   every PID namespace) and goes with the pod's last container.
//!
//! All ledger-directory changes happen under one lock (`--group-dir/.lock`), so a pod's last
//! container leaving never removes a ledger a new container of the pod is joining.

use super::rootfs::{Fd, bind};
use super::{GROUP_DIR, SANDBOX_ANNOTATIONS, TRACE_DIR, check, valid_id};
use serde_json::Value;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use vramcap_common::group_ledger::{self, file};

#[derive(clap::Args, Debug)]
pub struct HookArgs {
    #[command(subcommand)]
    pub stage: Stage,
}

#[derive(clap::Subcommand, Debug)]
pub enum Stage {
    /// The createContainer hook.
    CreateContainer {
        #[arg(long, value_name = "NAME")]
        device: String,
        /// The budget's host directory, which the spec mounts at /etc/vramcap.
        #[arg(long, value_name = "DIR")]
        budget_dir: PathBuf,
        #[arg(long, value_name = "DIR")]
        group_dir: PathBuf,
        #[arg(long, value_name = "DIR")]
        trace_dir: Option<PathBuf>,
    },
    /// The poststop hook.
    Poststop {
        #[arg(long, value_name = "NAME")]
        device: String,
        #[arg(long, value_name = "DIR")]
        group_dir: PathBuf,
    },
}

/// The container's state as the runtime passes it.
#[derive(Debug)]
pub struct State {
    pub id: String,
    pub bundle: PathBuf,
    pub annotations: serde_json::Map<String, Value>,
}

/// Whose budget a container uses: its own, or its pod's (the containers of one Kubernetes pod, or
/// of one podman pod, share one ledger).
#[derive(Debug, PartialEq)]
pub enum Owner {
    Container(String),
    Pod(String),
}

impl Owner {
    pub fn dir_name(&self) -> String {
        match self {
            Owner::Container(id) => format!("ctr-{id}"),
            Owner::Pod(id) => format!("pod-{id}"),
        }
    }
}

pub fn parse_state(text: &str) -> Result<State, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("the container state on stdin is not JSON: {e}"))?;
    let id = v.get("id").and_then(Value::as_str).ok_or("the container state has no `id`")?;
    if !valid_id(id) {
        return Err(format!("container id {:?} is not usable as a directory name", id.chars().take(80).collect::<String>()));
    }
    let bundle = v.get("bundle").and_then(Value::as_str).map(PathBuf::from).filter(|b| b.is_absolute());
    Ok(State {
        id: id.to_string(),
        bundle: bundle.unwrap_or_default(),
        annotations: v.get("annotations").and_then(Value::as_object).cloned().unwrap_or_default(),
    })
}

/// A container of a pod (a sandbox id that is not its own) shares the pod's ledger.
pub fn owner(st: &State) -> Result<Owner, String> {
    let ann = |k: &str| st.annotations.get(k).and_then(Value::as_str);
    let is_sandbox = ["io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType"].iter().any(|k| ann(k) == Some("sandbox"));
    match SANDBOX_ANNOTATIONS.iter().find_map(|k| ann(k)) {
        Some(sb) if sb != st.id && !is_sandbox => {
            if !valid_id(sb) {
                return Err(format!("pod sandbox id {:?} is not usable as a directory name", sb.chars().take(80).collect::<String>()));
            }
            Ok(Owner::Pod(sb.to_string()))
        }
        _ => Ok(Owner::Container(st.id.clone())),
    }
}

fn read_stdin() -> Result<State, String> {
    let mut text = String::new();
    std::io::stdin().take(1 << 20).read_to_string(&mut text).map_err(|e| format!("cannot read the container state on stdin: {e}"))?;
    parse_state(&text)
}

/// The container as its config.json describes it.
struct Spec {
    root: PathBuf,
    /// `root.readonly`: the runtime makes the root mount read-only (that one alone) before the
    /// container's process starts.
    read_only: bool,
    uid: u32,
    gid: u32,
}

/// The container's root and its user, from the bundle's config.json.
fn read_config(bundle: &Path) -> Result<Spec, String> {
    let p = bundle.join("config.json");
    let mut text = String::new();
    std::fs::File::open(&p)
        .and_then(|f| f.take(64 << 20).read_to_string(&mut text))
        .map_err(|e| format!("cannot read the container's {}: {e}", p.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
    let root = v.pointer("/root/path").and_then(Value::as_str).ok_or_else(|| format!("{}: no root.path", p.display()))?;
    let root = if Path::new(root).is_absolute() { PathBuf::from(root) } else { bundle.join(root) };
    let id = |k: &str| v.pointer(&format!("/process/user/{k}")).and_then(Value::as_u64).unwrap_or(0) as u32;
    let read_only = v.pointer("/root/readonly").and_then(Value::as_bool).unwrap_or(false);
    Ok(Spec { root, read_only, uid: id("uid"), gid: id("gid") })
}

/// A directory of root's that nobody else can write, made if missing.
fn root_dir(dir: &Path, mode: u32) -> Result<(), String> {
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(|e| format!("{}: {e}", dir.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !m.is_dir() || m.uid() != 0 || m.mode() & 0o022 != 0 {
        return Err(format!("{}: not a directory only root can write (a symbolic link, another owner, or mode {:o}); refused", dir.display(), m.mode() & 0o7777));
    }
    Ok(())
}

/// `flock` on `--group-dir/.lock`, held until dropped.
struct Lock(std::fs::File);

fn lock(group_dir: &Path) -> Result<Lock, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let p = group_dir.join(".lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&p)
        .map_err(|e| format!("cannot open {}: {e}", p.display()))?;
    use std::os::fd::AsRawFd;
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(format!("cannot lock {}: {}", p.display(), std::io::Error::last_os_error()));
    }
    Ok(Lock(f))
}

impl Drop for Lock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn chown(p: &Path, uid: u32, gid: u32) -> Result<(), String> {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).map_err(|e| format!("cannot give {} to uid {uid}: {e}", p.display()))
}

fn remove(p: &Path) {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => eprintln!("vramcap: cdi-hook: cannot remove {}: {e}", p.display()),
        _ => {}
    }
}

fn remove_dir(p: &Path) {
    match std::fs::remove_dir(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => eprintln!("vramcap: cdi-hook: cannot remove {}: {e}", p.display()),
        _ => {}
    }
}

/// The ledger's file name (what the library opens in `VRAMCAP_GROUP_DIR` for `VRAMCAP_GROUP`).
fn ledger_name(device: &str) -> String {
    file::path_for("", device).to_string_lossy().into_owned()
}

/// A ledger directory and everything in it we make (nothing else is touched).
fn remove_owner_dir(dir: &Path, device: &str) {
    remove(&dir.join(ledger_name(device)));
    if let Ok(users) = std::fs::read_dir(dir.join("users")) {
        for u in users.flatten() {
            remove(&u.path());
        }
    }
    remove_dir(&dir.join("users"));
    remove_dir(dir);
}

fn create_container(device: &str, budget_dir: &Path, group_dir: &Path, trace_dir: Option<&Path>) -> Result<(), String> {
    check::device_name(device)?;
    let st = read_stdin()?;
    let spec = read_config(&st.bundle)?;
    let (uid, gid) = (spec.uid, spec.gid);
    let owner = owner(&st)?;
    root_dir(group_dir, 0o711)?;
    let _lock = lock(group_dir)?;
    let dir = group_dir.join(owner.dir_name());
    if let Owner::Container(_) = owner {
        // Ids are unique among live containers: whatever is there was left by a container of
        // that id that ended without its poststop (a crash), and holds only the dead.
        remove_owner_dir(&dir, device);
    }
    root_dir(&dir, 0o711)?;
    let ledger = dir.join(ledger_name(device));
    let fresh = std::fs::symlink_metadata(&ledger).is_err();
    file::open_or_create(&ledger, device).map_err(|e| format!("the container's {e}"))?.unmap();
    if fresh {
        // The container's processes must open it read-write; a member refuses a ledger of
        // another user (group_ledger::file::check_owner).
        chown(&ledger, uid, gid)?;
    }
    if let Owner::Pod(_) = owner {
        root_dir(&dir.join("users"), 0o700)?;
        std::fs::write(dir.join("users").join(&st.id), b"").map_err(|e| format!("cannot record the container in {}: {e}", dir.display()))?;
    }
    let rootfs = Fd::root(&spec.root)?;
    let etc = rootfs.walk("etc", "/etc")?;
    let vramcap = rootfs.walk("etc/vramcap", super::ETC_DIR)?;
    if !vramcap.is(budget_dir)? {
        return Err(format!(
            "{} in the container is not the budget's directory {} (is a second vramcap device, or another mount at {}, in this container?)",
            super::ETC_DIR,
            budget_dir.display(),
            super::ETC_DIR
        ));
    }
    // The image may hold /etc/ld.so.preload as a symbolic link: the runtime then mounts onto the
    // link's target, and the link itself, an ordinary file of the image, could be removed. The
    // mount must be at /etc/ld.so.preload itself.
    let preload_host = budget_dir.parent().unwrap_or(budget_dir).join("ld.so.preload");
    let preload = rootfs.walk("etc/ld.so.preload", "/etc/ld.so.preload")?;
    if !preload.is(&preload_host)? {
        return Err(format!(
            "/etc/ld.so.preload in the container is not {} (the image's own file or link is in the way); the container is refused",
            preload_host.display()
        ));
    }
    let shown = format!("{GROUP_DIR}/{}", ledger_name(device));
    let target = rootfs.walk(&format!("etc/vramcap/group/{}", ledger_name(device)), &shown)?;
    if target.kind()? != libc::S_IFREG {
        return Err(format!("{shown}: not the placeholder file the spec mounts"));
    }
    bind(&ledger.to_string_lossy(), &target, false, &shown)?;
    if let Some(t) = trace_dir {
        check::absolute("--trace-dir", t)?;
        // Root's alone, so nobody can plant a link where the next container's directory goes.
        root_dir(t, 0o755)?;
        let mine = t.join(&st.id);
        match std::fs::DirBuilder::new().mode(0o750).create(&mine) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create {}: {e}", mine.display())),
        }
        let m = std::fs::symlink_metadata(&mine).map_err(|e| format!("{}: {e}", mine.display()))?;
        if !m.is_dir() {
            return Err(format!("{}: not a directory; refused", mine.display()));
        }
        chown(&mine, uid, gid)?;
        let target = rootfs.walk("etc/vramcap/trace", TRACE_DIR)?;
        bind(&mine.to_string_lossy(), &target, false, TRACE_DIR)?;
    }
    if etc.kind()? != libc::S_IFDIR {
        return Err("/etc in the container is not a directory".into());
    }
    if spec.read_only {
        // The runtime makes the root mount read-only before the container starts: /etc cannot
        // be renamed then, and a mount of its own would stay writable (only the root mount is
        // remounted) and make the hooks of other devices that write into /etc after ours fail.
        return Ok(());
    }
    // Last, so the binds above are taken along: /etc becomes a mount point, which cannot be
    // renamed, and so every mount below it stays where it is.
    bind(&etc.proc_path(), &etc, true, "/etc")
}

fn poststop(device: &str, group_dir: &Path) -> Result<(), String> {
    check::device_name(device)?;
    let st = read_stdin()?;
    let owner = owner(&st)?;
    if std::fs::symlink_metadata(group_dir).is_err() {
        return Ok(());
    }
    root_dir(group_dir, 0o711)?;
    let _lock = lock(group_dir)?;
    let dir = group_dir.join(owner.dir_name());
    match owner {
        Owner::Container(_) => remove_owner_dir(&dir, device),
        Owner::Pod(_) => {
            remove(&dir.join("users").join(&st.id));
            let others = std::fs::read_dir(dir.join("users")).map(|d| d.count()).unwrap_or(0);
            if others == 0 {
                remove_owner_dir(&dir, device);
            } else if let Ok(Some(m)) = file::open_existing(&dir.join(ledger_name(device))) {
                // This container's processes are dead; the pod's other containers may not see
                // its PID namespace to tell. From the host every namespace is visible.
                group_ledger::reclaim_in(m.shm);
                m.unmap();
            }
        }
    }
    Ok(())
}

pub fn main(a: HookArgs) -> Result<(), String> {
    match a.stage {
        Stage::CreateContainer { device, budget_dir, group_dir, trace_dir } => {
            create_container(&device, &budget_dir, &group_dir, trace_dir.as_deref())
        }
        Stage::Poststop { device, group_dir } => poststop(&device, &group_dir),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_and_owner() {
        let st = parse_state(r#"{"ociVersion":"1.0.2","id":"abc123","pid":1,"bundle":"/b","annotations":{"io.kubernetes.cri-o.SandboxID":"pod9"}}"#).unwrap();
        assert_eq!(owner(&st).unwrap(), Owner::Pod("pod9".into()));
        let st = parse_state(r#"{"id":"abc123","bundle":"/b","annotations":{"io.kubernetes.cri.sandbox-id":"abc123","io.kubernetes.cri.container-type":"sandbox"}}"#).unwrap();
        assert_eq!(owner(&st).unwrap(), Owner::Container("abc123".into()));
        let st = parse_state(r#"{"id":"abc123","bundle":"/b"}"#).unwrap();
        assert_eq!(owner(&st).unwrap().dir_name(), "ctr-abc123");
        for bad in [r#"{"id":"../x"}"#, r#"{"id":""}"#, r#"{"bundle":"/b"}"#, "not json"] {
            assert!(parse_state(bad).is_err(), "{bad}");
        }
        let st = parse_state(r#"{"id":"a","annotations":{"io.kubernetes.cri.sandbox-id":"../../etc"}}"#).unwrap();
        assert!(owner(&st).is_err());
        assert_eq!(ledger_name("small"), "vramcap-group-small");
    }
}
