//! Group ledgers among hostile neighbours and in Kubernetes (issue 15): members in other PID
//! namespaces, another user squatting or rewriting a ledger, a ledger truncated while in use.
//! Several tests need root (PID namespaces, a second user): as another user they print
//! `SKIPPED` and pass; CI runs them as root.

use vramcap_tests::common;
use common::*;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering::*;
use vramcap_common::group_ledger::{self as group, file};

fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}


macro_rules! needs {
    ($cond:expr, $what:literal) => {
        if !$cond {
            eprintln!("SKIPPED: needs {}", $what);
            return;
        }
    };
}

fn member(client: &str, dir: &Path, name: &str, limit: Option<&str>) -> Run {
    let r = Run::client(client).env("VRAMCAP_GROUP", name).env("VRAMCAP_GROUP_DIR", dir);
    match limit {
        Some(l) => r.env("VRAMCAP_GROUP_LIMIT", l),
        None => r,
    }
}

/// A member in a PID namespace of its own (pid 1 there), like a container's process.
fn namespaced(client: &str, dir: &Path, name: &str, limit: Option<&str>, ops: &str) -> Run {
    let r = in_pid_namespace(client, true, ops).env("VRAMCAP_GROUP", name).env("VRAMCAP_GROUP_DIR", dir);
    match limit {
        Some(l) => r.env("VRAMCAP_GROUP_LIMIT", l),
        None => r,
    }
}

fn ledger(dir: &Path, name: &str) -> file::Mapping {
    file::open_existing(&file::path_for(dir.to_str().unwrap(), name)).unwrap().expect("ledger exists")
}

fn used0(m: &file::Mapping) -> u64 {
    m.shm.used(0)
}

/// Sweeps dead members (up to 10 s, as a sidecar would) until device 0's charge is `want`.
fn reclaim_until(m: &file::Mapping, want: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while used0(m) != want && std::time::Instant::now() < deadline {
        group::reclaim_in(m.shm);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn members_in_other_pid_namespaces_keep_their_charge_until_they_die() {
    needs!(can_unshare(), "root and unshare --pid");
    build_c();
    let dir = private_group_dir();
    // A is pid 1 of its namespace: on the host, pid 1 is another process (init).
    let mut a = namespaced("client_linked", &dir, "ns", Some("256m"), "init ctx 0 alloc 200m sleep 60000").spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    // A host member would be denied: its reclaim must not take A's charge.
    let out = member("client_procaddr", &dir, "ns", None).args(["init ctx 0 alloc 100m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 2, "300 MiB under 256 MiB: {}", out.stderr);
    // A member of a sibling namespace cannot see A's: it leaves A alone.
    let out = namespaced("client_dlsym", &dir, "ns", None, "init ctx 0 alloc 100m").run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 2, "{}", out.stderr);
    // The sidecar's sweep (root, host PID namespace, like `hostPID: true`) sees A alive.
    let m = ledger(&dir, "ns");
    group::reclaim_in(m.shm);
    assert_eq!(used0(&m), 200 * MIB, "a live member's charge must survive every sweep");
    // A dies with its namespace.
    a.sigkill();
    if group::liveness::pid_ns("self").unwrap() != group::liveness::INIT_PID_NS {
        // We are not in the host's PID namespace (CI in a container): a namespace that vanished
        // cannot be told from one we cannot see, so its member is never reclaimed on a guess.
        std::thread::sleep(std::time::Duration::from_millis(500));
        group::reclaim_in(m.shm);
        assert_eq!(used0(&m), 200 * MIB);
        eprintln!("not in the initial PID namespace: checked that an unseen namespace is left alone");
        return;
    }
    // Like the `hostPID` sidecar, we see every namespace: the sweep gives A's charge back.
    reclaim_until(&m, 0);
    assert_eq!((used0(&m), m.shm.members()), (0, 0), "dead members are reclaimed across namespaces");
    let out = member("client_procaddr", &dir, "ns", None).args(["init ctx 0 alloc 256m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 0, "{}", out.stderr);
}

#[test]
fn a_killed_member_is_reclaimed_while_its_namespace_lives() {
    needs!(can_unshare(), "root and unshare --pid");
    build_c();
    let dir = private_group_dir();
    // One namespace, two members: B (a child of the shell, not pid 1) is killed, the shell lives.
    let client = ctests_dir().join("client_linked");
    let script = format!(
        "{c} init ctx 0 alloc 100m sleep 60000 & echo child pid=$!; {c} init ctx 0 alloc 50m sleep 60000",
        c = client.display()
    );
    let sh = dir.join("members.sh");
    std::fs::write(&sh, script).unwrap();
    let mut ns = Run::program(Path::new("unshare"))
        .env("VRAMCAP_GROUP", "ns2")
        .env("VRAMCAP_GROUP_DIR", &dir)
        .env("VRAMCAP_GROUP_LIMIT", "1g")
        .args(["--pid --fork --mount-proc --kill-child sh", sh.to_str().unwrap()])
        .spawn();
    let child = ns.wait_for("child").num("pid") as u32;
    ns.wait_for("alloc");
    ns.wait_for("alloc");
    let m = ledger(&dir, "ns2");
    assert_eq!(used0(&m), 150 * MIB);
    // Kill B through its host pid (the one whose NSpid ends in `child`).
    let host_pid = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|p| {
            let st = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
            let nested = st.lines().any(|l| l.starts_with("NSpid:") && l.split_whitespace().count() > 2);
            nested && st.contains("client_linked") && group::liveness::parse_nspid(&st) == Some(child)
        })
        .expect("B on the host");
    unsafe { libc::kill(host_pid as i32, libc::SIGKILL) };
    reclaim_until(&m, 50 * MIB);
    assert_eq!(used0(&m), 50 * MIB, "B's 100 MiB back, the live member's 50 MiB kept");
    ns.sigkill();
}

/// A directory every user can write, like `/dev/shm` (mode 1777).
fn world_dir() -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = private_group_dir();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    d
}

const OTHER_UID: u32 = 54321;

fn chown(p: &Path, uid: u32, gid: u32) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::lchown(c.as_ptr(), uid, gid) }, 0, "chown {}", p.display());
}

/// The victim's run: refused (CUDA init fails, nothing handed out), saying why.
fn assert_refused(out: &Output, needle: &str) {
    out.ok();
    assert_ne!(out.nth("init", 0).rc(), 0, "{}", out.stderr);
    assert_ne!(out.nth("alloc", 0).rc(), 0, "nothing may be handed out: {}", out.stderr);
    assert!(out.stderr.contains(needle) && out.stderr.contains("VRAMCAP_GROUP_DIR"), "{needle}: {}", out.stderr);
}

#[test]
fn another_users_ledger_is_refused_in_a_shared_directory() {
    needs!(is_root(), "root (to give a file to another uid)");
    let dir = world_dir();
    let p = file::path_for(dir.to_str().unwrap(), "sq");
    // The squatter created the group's ledger first, with a limit of their choosing.
    let m = file::open_or_create(&p, "sq").unwrap();
    m.shm.set_limit(m.shm.device_entry(1).unwrap(), 1);
    chown(&p, OTHER_UID, OTHER_UID);
    let out = member("client_linked", &dir, "sq", Some("256m")).args(["init ctx 0 alloc 1m"]).run();
    assert_refused(&out, &format!("belongs to uid {OTHER_UID}"));
}

#[test]
fn a_ledger_everyone_can_write_is_refused() {
    needs!(is_root(), "root (to give a file to another uid)");
    use std::os::unix::fs::PermissionsExt;
    let dir = world_dir();
    let p = file::path_for(dir.to_str().unwrap(), "open");
    // Made by a member, then opened up so another user can rewrite the limit (400 MiB under 256).
    let out = member("client_linked", &dir, "open", Some("256m")).args(["init ctx 0 alloc 1m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 0, "{}", out.stderr);
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = member("client_linked", &dir, "open", None).args(["init ctx 0 alloc 1m"]).run();
    assert_refused(&out, "writable by every user");
}

#[test]
fn a_symlinked_ledger_is_refused() {
    let dir = world_dir();
    let target = dir.join("elsewhere");
    let m = file::open_or_create(&target, "ln").unwrap();
    m.unmap();
    std::os::unix::fs::symlink(&target, file::path_for(dir.to_str().unwrap(), "ln")).unwrap();
    let out = member("client_dlsym", &dir, "ln", Some("256m")).args(["init ctx 0 alloc 1m"]).run();
    assert_refused(&out, "symbolic link");
    // The sidecar's open never follows one either.
    assert!(file::open_existing(&file::path_for(dir.to_str().unwrap(), "ln")).err().unwrap().contains("symbolic link"));
}

#[test]
fn a_group_directory_made_for_a_unix_group_shares_ledgers_across_users() {
    needs!(is_root(), "root (to give a file to another uid)");
    use std::os::unix::fs::PermissionsExt;
    // 2770, group = ours: another user of our Unix group made the ledger; we trust it.
    let dir = private_group_dir();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o2770)).unwrap();
    let mut a = member("client_linked", &dir, "team", Some("256m")).args(["init ctx 0 alloc 100m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    chown(&file::path_for(dir.to_str().unwrap(), "team"), OTHER_UID, unsafe { libc::getegid() });
    let out = member("client_procaddr", &dir, "team", None).args(["init ctx 0 alloc 200m alloc 100m"]).run();
    out.ok();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (2, 0), "one budget: {}", out.stderr);
    a.sigkill();
}

/// `setpriv` to run a member as another (numeric) user, or None when we cannot.
fn as_other_user(client: &str) -> Option<Run> {
    if !is_root() {
        return None;
    }
    build_c();
    // A checkout under a private directory (`mktemp -d` makes 0700 ones) cannot be reached by
    // another user: the member could not even load the library. Say so and skip.
    let reach = format!("test -r {} && test -x {}", preload_lib().display(), ctests_dir().join(client).display());
    let ok = std::process::Command::new("setpriv")
        .args([&format!("--reuid={OTHER_UID}"), &format!("--regid={OTHER_UID}"), "--clear-groups", "sh", "-c", &reach])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: uid {OTHER_UID} cannot reach the library or {client} (a directory above the checkout is private)");
        return None;
    }
    Some(Run::program(Path::new("setpriv")).args([
        format!("--reuid={OTHER_UID} --regid={OTHER_UID} --clear-groups"),
        ctests_dir().join(client).display().to_string(),
    ]))
}

#[test]
fn the_default_directory_is_per_user_and_a_squatted_one_is_refused() {
    let Some(r) = as_other_user("client_linked") else {
        eprintln!("SKIPPED: needs root and a checkout another uid can reach (to run as uid {OTHER_UID})");
        return;
    };
    let dir = format!("/dev/shm/vramcap-{OTHER_UID}");
    let _ = std::fs::remove_dir_all(&dir);
    let out = r.env_remove("VRAMCAP_GROUP_DIR").env("VRAMCAP_GROUP", "mine").env("VRAMCAP_GROUP_LIMIT", "1g").args(["init ctx 0 alloc 1m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 0, "{}", out.stderr);
    let md = std::fs::symlink_metadata(&dir).unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert_eq!((md.uid(), md.permissions().mode() & 0o7777, md.is_dir()), (OTHER_UID, 0o700, true));
    assert!(Path::new(&dir).join("vramcap-group-mine").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    // Someone else (here root) made that directory first: refused, with what to do.
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let r = as_other_user("client_linked").unwrap();
    let out = r.env_remove("VRAMCAP_GROUP_DIR").env("VRAMCAP_GROUP", "mine").env("VRAMCAP_GROUP_LIMIT", "1g").args(["init ctx 0 alloc 1m"]).run();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_refused(&out, "belongs to uid 0");
}

#[test]
fn a_ledger_truncated_under_a_member_denies_and_never_kills_it() {
    for client in ["client_linked", "client_procaddr"] {
        let dir = private_group_dir();
        let mut a = member(client, &dir, "cut", Some("1g"))
            .args(["init ctx 0 alloc 100m sleep 1500 alloc 1m info free 0 free 1 alloc 2m"])
            .spawn();
        assert_eq!(a.wait_for("alloc").rc(), 0);
        // `: > ledger` while A runs.
        std::fs::File::create(file::path_for(dir.to_str().unwrap(), "cut")).unwrap();
        let alloc = a.wait_for("alloc");
        assert_ne!(alloc.rc(), 0, "{client}: the budget cannot be kept: denied");
        assert_eq!(a.wait_for("free").rc(), 0, "{client}: what it holds can still be freed");
        let status = a.child.wait().unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(a.child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(status.success(), "{client}: the job must survive (no SIGBUS): {status:?} {err}");
        assert!(err.contains("was truncated while in use") && err.contains("remove the ledger file"), "{client}: {err}");
        assert_eq!(err.matches("was truncated while in use").count(), 1, "said once: {err}");
        // A new member refuses the truncated file, and says so.
        let out = member(client, &dir, "cut", None).args(["init ctx 0 alloc 1m"]).run();
        assert!(out.stderr.contains("is truncated"), "{}", out.stderr);
    }
}

#[test]
fn an_observer_survives_a_ledger_truncated_under_it() {
    let dir = private_group_dir();
    let p = file::path_for(dir.to_str().unwrap(), "cut2");
    let m = file::open_or_create(&p, "cut2").unwrap();
    let slot = m.shm.claim(1, 1, 1).unwrap();
    m.shm.charge(slot, 0, 5).unwrap();
    // The sidecar maps a client's ledger; it is truncated before the sweep reads it.
    let seen = file::open_existing(&p).unwrap().unwrap();
    std::fs::File::create(&p).unwrap();
    assert_eq!(group::reclaim_in(seen.shm), (0, 0));
    assert_eq!(seen.shm.devices[0].limit.load(SeqCst), 1, "the replaced copy refuses everything");
    assert!(seen.shm.reserve(0, 2).is_err());
    seen.unmap();
    m.unmap();
    assert!(group::guard::lost());
}

/// A member inside a time namespace (`unshare -T`: containers restored by CRIU, or any user with
/// user namespaces) sees its own start time shifted by its boot-time offset; observers outside it
/// see the unshifted one. Both must agree that it lives: its charge stays, and a member outside
/// is denied what only the live member's memory leaves free.
#[test]
fn a_member_in_a_time_namespace_is_not_taken_for_dead() {
    let ok = is_root() && Command::new("unshare").args(["-T", "--boottime", "100000", "true"]).status().is_ok_and(|s| s.success());
    needs!(ok, "root and unshare -T (time namespaces, Linux 5.6)");
    build_c();
    let dir = private_group_dir();
    let mut a = Run::program(Path::new("unshare"))
        .env("VRAMCAP_GROUP", "tns")
        .env("VRAMCAP_GROUP_DIR", &dir)
        .env("VRAMCAP_GROUP_LIMIT", "1g")
        .args(["-T --boottime 100000", ctests_dir().join("client_linked").to_str().unwrap(), "init ctx 0 alloc 800m sleep 60000"])
        .spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let out = member("client_procaddr", &dir, "tns", None).args(["init ctx 0 alloc 800m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 2, "1.6 GiB under a 1 GiB group: {}", out.stderr);
    let m = ledger(&dir, "tns");
    group::reclaim_in(m.shm);
    assert_eq!(used0(&m), 800 * MIB, "an observer outside the time namespace reclaimed a live member");
    a.sigkill();
    reclaim_until(&m, 0);
    assert_eq!(used0(&m), 0, "dead, it is reclaimed");
}

/// `unshare(CLONE_NEWTIME)` without exec makes a namespace for the process's children only: the
/// process stays in its own, but `/proc/self/timens_offsets` now shows the children's offsets.
/// Read as its own, they shifted the start time the member recorded, and every observer took it
/// for dead (its pid alive, its start time "wrong") and reclaimed its charge.
#[test]
fn a_member_that_made_a_time_namespace_for_its_children_only_keeps_its_charge() {
    let ok = is_root() && Command::new("unshare").args(["-T", "--boottime", "100000", "true"]).status().is_ok_and(|s| s.success());
    needs!(ok, "root and time namespaces (Linux 5.6)");
    build_c();
    let dir = private_group_dir();
    let mut a = member("client_linked", &dir, "tns-children", Some("1g")).args(["timens 100000 init ctx 0 alloc 800m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("timens").rc(), 0, "unshare(CLONE_NEWTIME) and the offset write");
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let m = ledger(&dir, "tns-children");
    group::reclaim_in(m.shm);
    assert_eq!(used0(&m), 800 * MIB, "an observer took the member for dead and reclaimed its charge");
    let out = member("client_procaddr", &dir, "tns-children", None).args(["init ctx 0 alloc 800m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 2, "1.6 GiB under a 1 GiB group: {}", out.stderr);
    a.sigkill();
    reclaim_until(&m, 0);
    assert_eq!(used0(&m), 0, "dead, it is reclaimed");
}
