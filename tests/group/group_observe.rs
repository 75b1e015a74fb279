//! Observe mode in a group (issue 26): the mode is the group's, kept in its ledger and set by its
//! first member; a group observes only while all its members do, and enforce always wins (a
//! member cannot observe while another enforces: it would spend the budget the other is held
//! to). Each test starts a first member holding 800 MiB of a 1 GiB budget, waiting on a file.

use std::path::Path;
use vramcap_common::group_ledger::file;
use vramcap_tests::common::*;
use vramcap_tests::observe_support::{LOOKUPS, check_report_and_replay, check_trace};
use vramcap_tests::trace_support::tmpdir;

fn member(client: &str, dir: &Path, name: &str, mode: Option<&str>, trace: &Path) -> Run {
    let r = Run::client(client).env("VRAMCAP_GROUP", name).env("VRAMCAP_GROUP_DIR", dir).env("VRAMCAP_GROUP_LIMIT", "1g").env("VRAMCAP_TRACE", trace);
    match mode {
        Some(m) => r.env("VRAMCAP_MODE", m),
        None => r,
    }
}

fn observing(dir: &Path, name: &str) -> bool {
    file::open_existing(&file::path_for(dir.to_str().unwrap(), name)).unwrap().expect("ledger").shm.observing()
}

#[test]
fn a_group_observes_when_all_its_members_do() {
    for (i, c) in LOOKUPS.iter().enumerate() {
        let (dir, t) = (private_group_dir(), tmpdir(&format!("observe-group-{i}")));
        let go = t.join("go");
        let mut a = member(LOOKUPS[(i + 1) % 3], &dir, "obs", Some("observe"), &t.join("a.jsonl"))
            .args([format!("init ctx 0 alloc 800m waitfile {} alloc 400m", go.display())])
            .spawn();
        assert_eq!(a.wait_for("alloc").rc(), 0);
        assert!(observing(&dir, "obs"), "the first member set the group's mode");
        let b = member(c, &dir, "obs", Some("observe"), &t.join("b.jsonl")).args(["init ctx 0 alloc 600m info total 0"]).run();
        b.ok();
        assert_eq!(b.nth("alloc", 0).rc(), 0, "{c}: granted over the group's budget:\n{}", b.stderr);
        assert_eq!((b.nth("info", 0).num("total"), b.nth("total", 0).num("bytes")), (16 * GIB, 16 * GIB), "{c}: the physical view");
        std::fs::write(&go, "").unwrap();
        assert_eq!(a.wait_for("alloc").rc(), 0, "{c}");
        assert!(a.finish().success());
        // B's 600 MiB is still charged (a dead member's charge goes when someone needs the budget:
        // A's reservation reclaimed it first), so A's 400 MiB is judged against 800 MiB.
        check_trace(&t.join("b.jsonl"), &[("cuMemAlloc_v2", 600 * MIB, "group", GIB, 800 * MIB)]);
        check_trace(&t.join("a.jsonl"), &[("cuMemAlloc_v2", 400 * MIB, "group", GIB, 800 * MIB)]);
        check_report_and_replay(&t.join("b.jsonl"), &[("cuMemAlloc_v2", 600 * MIB, "group", GIB, 800 * MIB)], "group budget", None);
    }
}

#[test]
fn a_member_asking_to_observe_in_a_group_that_enforces_enforces() {
    let (dir, t) = (private_group_dir(), tmpdir("observe-group-adopt"));
    let go = t.join("go");
    let mut a = member("client_linked", &dir, "enf", None, &t.join("a.jsonl")).args([format!("init ctx 0 alloc 800m waitfile {}", go.display())]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    for c in LOOKUPS {
        let b = member(c, &dir, "enf", Some("observe"), &t.join("b.jsonl")).args(["init ctx 0 alloc 600m info"]).run();
        b.ok();
        assert_eq!(b.nth("alloc", 0).rc(), 2, "{c}: refused, as the group enforces:\n{}", b.stderr);
        assert_eq!(b.nth("info", 0).num("total"), GIB, "{c}: the group's view, not the physical one");
        let said: Vec<&str> = b.stderr.lines().filter(|l| l.contains("enforces its budget")).collect();
        assert_eq!(said.len(), 1, "{c}: one line: {}", b.stderr);
        assert!(said[0].contains("group \"enf\"") && said[0].contains("VRAMCAP_MODE=observe"), "{}", said[0]);
        let trace = std::fs::read_to_string(t.join("b.jsonl")).unwrap();
        assert!(trace.contains("\"op\":\"deny\"") && !trace.contains("would_deny") && !trace.contains("\"mode\""), "{c}: {trace}");
    }
    assert!(!observing(&dir, "enf"));
    std::fs::write(&go, "").unwrap();
    assert!(a.finish().success());
}

#[test]
fn a_member_that_enforces_makes_an_observing_group_enforce() {
    let (dir, t) = (private_group_dir(), tmpdir("observe-group-enforce"));
    let go = t.join("go");
    let mut a = member("client_dlsym", &dir, "mix", Some("observe"), &t.join("a.jsonl"))
        .args([format!("init ctx 0 alloc 800m waitfile {} alloc 400m info", go.display())])
        .spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let b = member("client_procaddr", &dir, "mix", None, &t.join("b.jsonl")).args(["init ctx 0 alloc 100m alloc 600m"]).run();
    b.ok();
    let rcs: Vec<i64> = b.of("alloc").iter().map(|l| l.rc()).collect();
    assert_eq!(rcs, [0, 2], "the enforcing member is held to the budget:\n{}", b.stderr);
    assert!(b.stderr.contains("group \"mix\" was in observe mode and this process enforces"), "{}", b.stderr);
    assert!(!observing(&dir, "mix"), "the group enforces now");
    // The observing member is refused from its next allocation that does not fit on.
    std::fs::write(&go, "").unwrap();
    assert_eq!(a.wait_for("alloc").rc(), 2, "the group enforces for every member");
    assert_eq!(a.wait_for("info").num("total"), GIB, "and the view is the group's again");
    let out = a.child_stderr_after_finish();
    assert!(out.contains("enforces its budget now (a member that enforces joined it"), "{out}");
}

#[test]
fn a_group_whose_members_are_gone_takes_its_next_first_members_mode() {
    let (dir, t) = (private_group_dir(), tmpdir("observe-group-reset"));
    for (mode, rc) in [(None, 2), (Some("observe"), 0), (None, 2)] {
        let out = member("client_linked", &dir, "reset", mode, &t.join("x.jsonl")).args(["init ctx 0 alloc 2g"]).run();
        out.ok();
        assert_eq!(out.nth("alloc", 0).rc(), rc, "{mode:?}: {}", out.stderr);
        assert_eq!(observing(&dir, "reset"), mode.is_some(), "{mode:?}");
        assert!(!out.stderr.contains("enforces its budget"), "{mode:?}: nobody else was running: {}", out.stderr);
    }
}

/// The operator's way from observe to enforce without a restart: `vramcap limit --enforce`
/// (the ledger's owner or root), obeyed by each member at its next allocation that does not fit.
#[test]
fn an_operator_turns_an_observing_group_to_enforce() {
    let (dir, t) = (private_group_dir(), tmpdir("observe-group-operator"));
    let go = t.join("go");
    let mut a = member("client_procaddr", &dir, "op", Some("observe"), &t.join("a.jsonl"))
        .args([format!("init ctx 0 alloc 800m alloc 400m info waitfile {} alloc 400m info", go.display())])
        .spawn();
    assert_eq!((a.wait_for("alloc").rc(), a.wait_for("alloc").rc()), (0, 0), "observed");
    assert_eq!(a.wait_for("info").num("total"), 16 * GIB);
    let limit = |args: &[&str]| {
        let out = std::process::Command::new(vramcap_bin()).args(["limit", "--group", "op", "--group-dir", dir.to_str().unwrap()]).args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(limit(&[]).contains("mode: observe"), "shown");
    if unsafe { libc::geteuid() } == 0 {
        // Another uid, even one the ledger's Unix group lets open the file, changes nothing.
        use std::os::unix::process::CommandExt;
        let path = file::path_for(dir.to_str().unwrap(), "op");
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 0, 65534) }, 0);
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let o = std::process::Command::new(&vramcap_tests::sidecar_support::reachable().vramcap)
            .args(["limit", "--group", "op", "--group-dir", dir.to_str().unwrap(), "--enforce"])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("only that uid or root may change its budget or mode") && err.contains("nothing changed"), "{err}");
        assert!(observing(&dir, "op"), "still observing");
    }
    assert!(limit(&["--enforce"]).contains("group \"op\": mode observe -> enforce"));
    assert!(limit(&[]).contains("mode: enforce\n"));
    assert!(!observing(&dir, "op"));
    std::fs::write(&go, "").unwrap();
    assert_eq!(a.wait_for("alloc").rc(), 2, "refused from its next allocation that does not fit");
    assert_eq!(a.wait_for("info").num("total"), GIB, "the group's view again");
    let err = a.child_stderr_after_finish();
    assert_eq!(err.matches("enforces its budget now").count(), 1, "{err}");
    let trace = std::fs::read_to_string(t.join("a.jsonl")).unwrap();
    assert_eq!((trace.matches("\"op\":\"would_deny\"").count(), trace.matches("\"op\":\"deny\"").count()), (1, 1), "{trace}");
}
