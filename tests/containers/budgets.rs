//! One budget per container (or pod): its processes share it, other containers never do, and a
//! container killed with SIGKILL gives it back.

use crate::needs_podman;
use crate::podman::{Cdi, client, name, owner_label, sh};


/// A process that takes `size` and keeps it for 30 s, inside a container.
fn holder(size: &str) -> String {
    client("client_procaddr", &format!("init ctx 0 alloc {size} sleep 30000"))
}

#[test]
fn the_processes_of_a_container_share_its_budget() {
    needs_podman!();
    let c = Cdi::new("share", &[("small", "256m")], &[]);
    let script = format!(
        "{} > /tmp/h.out &\nh=$!\nwhile ! grep -q '^alloc' /tmp/h.out; do sleep 0.05; done; cat /tmp/h.out\n{}\nkill $h\n",
        holder("200m"),
        client("client_dlsym", "init ctx 0 alloc 100m alloc 50m")
    );
    let out = c.run(&["small"], &[], &script);
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert_eq!((out.nth("alloc", 1).rc(), out.nth("alloc", 2).rc()), (2, 0), "the second process gets what the first left: {}", out.stderr);
    assert!(out.stderr.contains("of group \"small\""), "{}", out.stderr);
}

#[test]
fn containers_never_share_a_budget() {
    needs_podman!();
    let c = Cdi::new("apart", &[("small", "256m"), ("other", "256m")], &[]);
    let mut a = c.spawn(&name("apart"), &["small"], &[], &holder("200m"));
    assert!(a.wait_for("alloc").contains("rc=0"));
    let id = a.id();
    assert!(c.group_dir.join(format!("ctr-{id}/vramcap-group-small")).is_file(), "the container's own ledger");
    for device in ["small", "other"] {
        let out = c.run(&[device], &[], &client("client_procaddr", "init ctx 0 alloc 200m"));
        out.ok();
        assert_eq!(out.nth("alloc", 0).rc(), 0, "a second container on {device} has a budget of its own: {}", out.stderr);
    }
    a.kill9();
}

#[test]
fn a_container_killed_with_sigkill_leaves_nothing_behind() {
    needs_podman!();
    let c = Cdi::new("kill", &[("small", "256m")], &[]);
    let mut a = c.spawn(&name("kill"), &["small"], &[], &holder("200m"));
    assert!(a.wait_for("alloc").contains("rc=0"));
    let ledger_dir = c.group_dir.join(format!("ctr-{}", a.id()));
    assert!(ledger_dir.is_dir());
    a.kill9();
    assert!(!ledger_dir.exists(), "the poststop hook removes the container's ledger");
    let out = c.run(&["small"], &[], &client("client_procaddr", "init ctx 0 alloc 250m"));
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert_eq!(std::fs::read_dir(&c.group_dir).unwrap().filter(|e| !e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.')).count(), 0);
}

/// The containers of a pod (podman's pods carry the sandbox annotation CRI-O's do) share one
/// ledger. A container killed with SIGKILL gives its part back at once: its poststop hook, on the
/// host, sees the dead container's PID namespace, which the pod's other containers cannot.
#[test]
fn the_containers_of_a_pod_share_a_budget_and_a_killed_one_gives_its_part_back() {
    needs_podman!();
    let c = Cdi::new("pod", &[("small", "256m")], &[]);
    let pod = name("pod");
    let made = sh(&format!("podman pod create --infra=false --label {} --name {pod}", owner_label()));
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let pod_id = String::from_utf8_lossy(&made.stdout).trim().to_string();
    let in_pod = ["--pod", pod.as_str()];
    let mut a = c.spawn(&name("pod-a"), &["small"], &in_pod, &holder("200m"));
    assert!(a.wait_for("alloc").contains("rc=0"));
    // A container of the pod that outlives `a`, so the pod's ledger lives on.
    let mut b = c.spawn(&name("pod-b"), &["small"], &in_pod, "echo started; sleep 60");
    b.wait_for("started");
    let ledger = c.group_dir.join(format!("pod-{pod_id}"));
    assert!(ledger.join("vramcap-group-small").is_file(), "{}", ledger.display());
    let out = c.run(&["small"], &in_pod, &client("client_linked", "init ctx 0 alloc 100m alloc 50m"));
    out.ok();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (2, 0), "the pod's budget is shared: {}", out.stderr);
    a.kill9();
    assert!(ledger.join("vramcap-group-small").is_file(), "the pod's ledger stays while the pod has containers");
    let out = c.run(&["small"], &in_pod, &client("client_procaddr", "init ctx 0 alloc 250m"));
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "the killed container's 200m came back: {}", out.stderr);
    b.kill9();
    assert!(!ledger.exists(), "the pod's last container removes its ledger");
    sh(&format!("podman pod rm -f {pod}"));
}
