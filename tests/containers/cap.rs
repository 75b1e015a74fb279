//! The cap inside a container started with a `vramcap cdi` device: every lookup path, the views,
//! and what the container's environment and its root can do to it.

use crate::needs_podman;
use crate::podman::{Cdi, client};
use vramcap_tests::common::*;

const PATHS: [&str; 3] = ["client_linked", "client_dlsym", "client_procaddr"];

#[test]
fn a_client_is_capped_at_its_budget_through_every_lookup_path() {
    needs_podman!();
    let c = Cdi::new("paths", &[("small", "256m")], &[]);
    let script = PATHS.map(|w| client(w, "init ctx 0 alloc 200m alloc 100m info")).join("; ");
    let out = c.run(&["small"], &[], &script);
    out.ok();
    for (i, w) in PATHS.iter().enumerate() {
        assert_eq!((out.nth("alloc", 2 * i).rc(), out.nth("alloc", 2 * i + 1).rc()), (0, 2), "{w}: {}\n{}", out.stdout, out.stderr);
        let info = out.nth("info", i);
        assert_eq!((info.num("total"), info.num("free")), (256 * MIB, 56 * MIB), "{w}: cuMemGetInfo shows the budget");
    }
    assert_eq!(out.stderr.matches("vramcap: denied cuMemAlloc_v2").count(), 3, "{}", out.stderr);
    // The same container without the device: nothing in the image caps anything.
    let bare = c.run(&[], &[], &client("client_procaddr", "init ctx 0 alloc 200m alloc 100m"));
    bare.ok();
    assert_eq!((bare.nth("alloc", 0).rc(), bare.nth("alloc", 1).rc()), (0, 0), "{}", bare.stderr);
}

#[test]
fn the_containers_environment_cannot_raise_or_remove_the_cap() {
    needs_podman!();
    let c = Cdi::new("env", &[("small", "256m")], &[]);
    let p = client("client_procaddr", "init ctx 0 alloc 300m alloc 200m");
    let script = format!(
        "VRAMCAP_LIMIT=1t VRAMCAP_GROUP_LIMIT=1t CUDA_DEVICE_MEMORY_LIMIT=1t {p}\n\
         VRAMCAP_DISABLE=1 {p}\n\
         LD_PRELOAD= {p}\n\
         LD_PRELOAD=/nonexistent.so {p}\n\
         env -i {p}\n\
         VRAMCAP_GROUP=mine VRAMCAP_GROUP_DIR=/tmp VRAMCAP_GROUP_LIMIT=1t {p}\n\
         VRAMCAP_REAL_LIBCUDA=/nonexistent.so {p}\n\
         for ld in /lib64/ld-linux*.so.2 /lib/ld-linux*.so.1; do [ -e \"$ld\" ] && break; done; \"$ld\" {p}\n\
         if (echo VRAMCAP_LIMIT=1t > /etc/vramcap/limits) 2>/dev/null; then echo wrote-limits; else echo limits-refused; fi\n\
         if (echo > /etc/ld.so.preload) 2>/dev/null; then echo wrote-preload; else echo preload-refused; fi\n\
         {p}\n"
    );
    let out = c.run(&["small"], &[], &script);
    out.ok();
    let allocs = out.of("alloc");
    assert_eq!(allocs.len(), 18, "{}\n{}", out.stdout, out.stderr);
    for (i, pair) in allocs.chunks(2).enumerate() {
        assert_eq!((pair[0].rc(), pair[1].rc()), (2, 0), "run {i}: 300m over the 256m budget, 200m within it:\n{}\n{}", out.stdout, out.stderr);
    }
    assert!(out.stdout.contains("limits-refused") && out.stdout.contains("preload-refused"), "{}", out.stdout);
    assert!(out.stderr.contains("ignoring VRAMCAP_DISABLE=\"1\""), "{}", out.stderr);
}

/// Root inside the container (the default user) tries to move, remove, rewrite and unmount
/// everything that holds the cap; each attempt fails, and a process started after them is still
/// under the budget and in the container's group (it shares the budget with one that started
/// before). On the image (overlayfs, where renaming a lower directory fails with EXDEV anyway)
/// and on a plain root directory, where any directory can be renamed unless it is a mount point.
#[test]
fn root_inside_cannot_move_remove_or_unmount_the_cap() {
    needs_podman!();
    let c = Cdi::new("root", &[("small", "256m")], &[]);
    let plain = crate::podman::rootfs_copy(&c.dir);
    for rootfs in [None, Some(plain.as_path())] {
        attack_from_inside(&c, rootfs);
    }
}

fn attack_from_inside(c: &Cdi, rootfs: Option<&std::path::Path>) {
    let l = "/etc/vramcap/group/vramcap-group-small";
    let attacks = [
        "mv /etc /etc.moved".to_string(),
        "mv /etc/vramcap /etc/vramcap.moved".into(),
        "mv /etc/ld.so.preload /etc/preload.moved".into(),
        "rm -f /etc/ld.so.preload".into(),
        "rm -f /etc/vramcap/limits".into(),
        "rm -f /etc/vramcap/libvramcap.so".into(),
        "mv /etc/vramcap/libvramcap.so /etc/vramcap/x.so".into(),
        format!("rm -f {l}"),
        format!("mv {l} /tmp/ledger"),
        "mv /etc/vramcap/group /etc/vramcap/g2".into(),
        "rmdir /etc/vramcap/group".into(),
        "chmod 0666 /etc/vramcap/limits".into(),
        "chmod 0777 /etc/vramcap".into(),
        "touch /etc/vramcap/group/vramcap-group-other".into(),
        "truncate -s 0 /etc/vramcap/libvramcap.so".into(),
        "sh -c 'echo /nope.so > /etc/ld.so.preload'".into(),
        "umount /etc/vramcap".into(),
        "umount -l /etc/vramcap".into(),
        "umount /etc/ld.so.preload".into(),
        format!("umount {l}"),
        "umount -l /etc".into(),
        "mount -t tmpfs tmpfs /etc/vramcap".into(),
    ];
    let mut script = format!("{} > /tmp/holder.out &\nholder=$!\n", client("client_procaddr", "init ctx 0 alloc 200m sleep 30000"));
    script.push_str("while ! grep -q '^alloc' /tmp/holder.out; do sleep 0.05; done; cat /tmp/holder.out\n");
    for a in &attacks {
        script.push_str(&format!("if {a} 2>/dev/null; then echo 'attack-succeeded {a}'; else echo 'attack-refused'; fi\n"));
    }
    script.push_str(&format!("{}\n", client("client_linked", "init ctx 0 alloc 100m alloc 50m info")));
    script.push_str("kill $holder\n");
    let out = c.run_on(&["small"], &[], rootfs, &script);
    assert!(!out.stdout.contains("attack-succeeded"), "{rootfs:?}: {}\n{}", out.stdout, out.stderr);
    assert_eq!(out.stdout.matches("attack-refused").count(), attacks.len(), "{}", out.stdout);
    assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    // 200m held by the first process: the group's 56m are left.
    assert_eq!((out.nth("alloc", 1).rc(), out.nth("alloc", 2).rc()), (2, 0), "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.nth("info", 0).num("total"), 256 * MIB);
}

/// The ledger must be writable by the container's processes; what root inside can do to it
/// is to break it, and then nobody in the container gets device memory (never an uncapped one).
#[test]
fn a_ledger_broken_from_inside_fails_closed() {
    needs_podman!();
    let c = Cdi::new("broken", &[("small", "256m")], &[]);
    let l = "/etc/vramcap/group/vramcap-group-small";
    for (attack, says) in [(format!("truncate -s 0 {l}"), "truncated"), (format!("chmod 0666 {l}"), "writable by every user")] {
        let script = format!("{}\n{attack}\n{}\n", client("client_procaddr", "init ctx 0 alloc 10m"), client("client_procaddr", "init ctx 0 alloc 10m"));
        let out = c.run(&["small"], &[], &script);
        out.ok();
        assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
        assert_ne!(out.nth("alloc", 1).rc(), 0, "{attack}: an allocation after it must fail: {}", out.stderr);
        assert!(out.stderr.contains(says), "{attack}: {}", out.stderr);
    }
}

/// A process that may create a user namespace is root over a mount namespace of its own and can
/// mount over /etc/ld.so.preload there (podman's default seccomp profile allows it). Under a
/// profile that forbids new user namespaces, as Docker's and containerd's defaults do for a
/// container without CAP_SYS_ADMIN, it cannot.
#[test]
fn a_user_namespace_cannot_hide_the_preload_under_a_profile_that_forbids_it() {
    needs_podman!();
    let c = Cdi::new("userns", &[("small", "256m")], &[]);
    let profile = crate::podman::seccomp_without_user_namespaces(&c.dir);
    let script = format!(
        "echo > /tmp/empty\n\
         unshare -U -m -r sh -c 'mount --bind /tmp/empty /etc/ld.so.preload && echo hidden && {}'\n\
         echo unshare-rc=$?\n{}\n",
        client("client_procaddr", "init ctx 0 alloc 300m"),
        client("client_procaddr", "init ctx 0 alloc 300m")
    );
    let sec = format!("seccomp={}", profile.display());
    let out = c.run(&["small"], &["--security-opt", &sec], &script);
    assert!(!out.stdout.contains("hidden"), "{}\n{}", out.stdout, out.stderr);
    assert!(!out.stdout.contains("unshare-rc=0"), "{}", out.stdout);
    assert_eq!(out.of("alloc").iter().map(|l| l.rc()).collect::<Vec<_>>(), [2], "{}\n{}", out.stdout, out.stderr);
    // The same attack under podman's default profile, for the record (docs/security.md).
    let open = c.run(&["small"], &[], &script);
    eprintln!("under podman's default seccomp profile: {}", if open.stdout.contains("hidden") { "the preload can be hidden" } else { "refused too" });
}

/// The image is the tenant's: a symbolic link where a mount goes would have the runtime mount
/// onto the link's target, leaving the link itself (an ordinary file of the image) to be removed.
/// Such a container never starts.
#[test]
fn an_image_with_links_where_the_mounts_go_never_starts() {
    needs_podman!();
    let c = Cdi::new("links", &[("small", "256m")], &[]);
    let cases: [(&str, &str); 3] = [
        ("ld.so.preload", "ln -s /tmp/pre etc/ld.so.preload"),
        ("vramcap", "mkdir -p tmp/vc && ln -s /tmp/vc etc/vramcap"),
        ("etc", "mv etc etc.real && ln -s etc.real etc"),
    ];
    for (i, (what, plant)) in cases.iter().enumerate() {
        let dir = c.dir.join(format!("image-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let root = crate::podman::rootfs_copy(&dir);
        let made = crate::podman::sh(&format!("cd {} && {plant}", root.display()));
        assert!(made.status.success(), "{plant}");
        let out = c.run_on(&["small"], &[], Some(&root), &client("client_procaddr", "init ctx 0 alloc 300m"));
        assert!(!out.status.success() && out.of("alloc").is_empty(), "{what}: the container ran: {}\n{}", out.stdout, out.stderr);
        assert!(out.stderr.contains("symbolic link") && out.stderr.contains(what), "{what}: {}", out.stderr);
    }
}

/// The hook makes `/etc` a mount of its own, except in a `--read-only` container: there runc makes
/// the root mount read-only (that one alone), so a separate /etc would stay writable, and the read-
/// only root already keeps /etc from being renamed.
#[test]
fn a_read_only_container_keeps_a_read_only_etc() {
    needs_podman!();
    let c = Cdi::new("readonly", &[("small", "256m")], &[]);
    let script = format!(
        "if touch /etc/new 2>/dev/null; then echo etc-writable; else echo etc-read-only; fi\n\
         if touch /opt/new 2>/dev/null; then echo root-writable; else echo root-read-only; fi\n\
         if mv /etc /etc.moved 2>/dev/null; then echo etc-moved; fi\n{}\n",
        client("client_procaddr", "init ctx 0 alloc 200m alloc 100m")
    );
    let out = c.run(&["small"], &["--read-only"], &script);
    out.ok();
    assert!(out.stdout.contains("root-read-only") && out.stdout.contains("etc-read-only"), "{}", out.stdout);
    assert!(!out.stdout.contains("etc-moved"), "{}", out.stdout);
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (0, 2), "{}", out.stderr);
    let rw = c.run(&["small"], &[], "if touch /etc/new 2>/dev/null; then echo etc-writable; fi");
    assert!(rw.stdout.contains("etc-writable"), "a writable container's /etc stays writable: {}", rw.stdout);
}

/// A container whose own mounts (a pod's volumeMounts, podman's -v) cover what the device mounts
/// never starts, or starts with the device's mounts on top: either way not uncapped.
#[test]
fn a_containers_own_mount_over_the_devices_files_never_uncaps_it() {
    needs_podman!();
    let c = Cdi::new("own-mounts", &[("small", "256m")], &[]);
    let empty = c.dir.join("empty");
    std::fs::write(&empty, "").unwrap();
    std::fs::create_dir_all(c.dir.join("emptydir")).unwrap();
    for (what, vol) in [
        ("/etc/ld.so.preload", format!("{}:/etc/ld.so.preload:ro", empty.display())),
        ("/etc/vramcap", format!("{}:/etc/vramcap:ro", c.dir.join("emptydir").display())),
    ] {
        let out = c.run(&["small"], &["-v", &vol], &client("client_procaddr", "init ctx 0 alloc 300m"));
        let allocs: Vec<i64> = out.of("alloc").iter().map(|l| l.rc()).collect();
        assert!(allocs.is_empty() || allocs == [2], "{what}: {allocs:?}\n{}\n{}", out.stdout, out.stderr);
        eprintln!("{what}: {}", if allocs.is_empty() { "the container was refused" } else { "the device's mount won" });
    }
}
