//! Group (container) caps: one budget shared by several processes through a mapped ledger file.
//! Processes are the C clients under the preload; the ledger is inspected (and, like the sidecar
//! would, reclaimed) through the library's own `group` module.

use vramcap_tests::common;
use common::*;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::*;
use vramcap_common::group_ledger::{self as group, file, shm};

fn member(client: &str, dir: &Path, name: &str, limit: Option<&str>) -> Run {
    let r = Run::client(client).env("VRAMCAP_GROUP", name).env("VRAMCAP_GROUP_DIR", dir);
    match limit {
        Some(l) => r.env("VRAMCAP_GROUP_LIMIT", l),
        None => r,
    }
}

fn ledger(dir: &Path, name: &str) -> file::Mapping {
    file::open_existing(&file::path_for(dir.to_str().unwrap(), name)).unwrap().expect("ledger exists")
}

/// Device 0 is the first device every member maps, so it has entry 0.
fn used0(m: &file::Mapping) -> u64 {
    m.shm.used(0)
}

#[test]
fn eight_racing_processes_never_hold_more_than_the_group_limit() {
    let dir = private_group_dir();
    let limit = 64 * MIB;
    let runs: Vec<_> = (0..8)
        .map(|i| {
            let r = member(CLIENTS[i % 3], &dir, "race", Some("64m")).args([format!("init ctx 0 record 300 24m 1500 {i}")]);
            std::thread::spawn(move || r.run())
        })
        .collect();
    // (time, +size / -size) from what each process says it held, not from the ledger.
    let mut events: Vec<(u64, i64)> = Vec::new();
    let mut oom = 0;
    for t in runs {
        let out = t.join().unwrap();
        out.ok();
        let rec = out.nth("record", 0);
        assert_eq!(rec.num("other"), 0, "{}", out.stderr);
        oom += rec.num("oom");
        for h in out.of("held") {
            let size = h.num("size") as i64;
            events.push((h.num("t0"), size));
            events.push((h.num("t1"), -size));
        }
    }
    // Closed intervals: at equal times count the start before the end.
    events.sort_by_key(|&(t, d)| (t, -d));
    let (mut held, mut max) = (0i64, 0i64);
    for (_, d) in &events {
        held += d;
        max = max.max(held);
    }
    assert!(max as u64 <= limit, "the processes held {max} bytes together, limit {limit}");
    assert!(oom > 0, "the limit must have been contended");
    assert!(max as u64 > limit / 2, "the processes must really have shared the budget ({max})");
    let m = ledger(&dir, "race");
    assert_eq!(used0(&m), 0, "every member freed what it took");
    group::reclaim_in(m.shm);
    assert_eq!(m.shm.members(), 0, "and is dead");
    assert!(m.shm.devices[0].peak.load(SeqCst) <= limit);
}

#[test]
fn a_sigkilled_member_is_reclaimed_for_the_others_exactly_once() {
    let dir = private_group_dir();
    let mut a = member("client_linked", &dir, "kill", Some("1g")).args(["init ctx 0 alloc 512m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let mut c = member("client_dlsym", &dir, "kill", None).args(["init ctx 0 alloc 256m sleep 60000"]).spawn();
    assert_eq!(c.wait_for("alloc").rc(), 0);
    // Control: while A lives, 768 MiB more does not fit.
    let out = member("client_procaddr", &dir, "kill", None).args(["init ctx 0 alloc 768m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 2);
    assert!(out.stderr.contains("of group \"kill\" limit 1073741824"), "{}", out.stderr);
    a.sigkill();
    let m = ledger(&dir, "kill");
    assert_eq!(used0(&m), 768 * MIB, "a killed member's charge stays until reclaimed");
    // The denial path reclaims A's 512 MiB and only that: C's 256 MiB still counts.
    let out = member("client_procaddr", &dir, "kill", None).args(["init ctx 0 alloc 768m alloc 1 info"]).run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert_eq!(out.nth("alloc", 1).rc(), 2, "C's charge must survive the reclaim");
    assert_eq!((out.nth("info", 0).num("free"), out.nth("info", 0).num("total")), (0, GIB));
    // That member exited holding 768 MiB: dead now, reclaimed by whoever looks next.
    assert_eq!(group::reclaim_in(m.shm), (1, 768 * MIB));
    assert_eq!((used0(&m), m.shm.members()), (256 * MIB, 1));
    // Killed with nobody allocating: the sidecar's periodic reclaim gives it back.
    c.sigkill();
    assert_eq!(group::reclaim_in(m.shm), (1, 256 * MIB));
    assert_eq!(group::reclaim_in(m.shm), (0, 0), "exactly once");
    assert_eq!((used0(&m), m.shm.members()), (0, 0));
}

#[test]
fn a_reused_pid_is_reclaimed_but_the_live_process_with_it_keeps_its_charge() {
    let dir = private_group_dir();
    let mut live = member("client_linked", &dir, "reuse", Some("1g")).args(["init ctx 0 alloc 256m sleep 60000"]).spawn();
    assert_eq!(live.wait_for("alloc").rc(), 0);
    let m = ledger(&dir, "reuse");
    let pid = live.pid();
    let (start, _) = file::proc_start(pid).unwrap();
    // A dead member whose pid the live one now has: same pid, earlier start time.
    let ghost = m.shm.claim(pid, start - 1, group::liveness::self_identity().1).unwrap();
    m.shm.charge(ghost, 0, 512 * MIB).unwrap();
    assert_eq!(used0(&m), 768 * MIB);
    assert_eq!(group::reclaim_in(m.shm), (1, 512 * MIB), "the ghost is dead whatever its pid says");
    assert_eq!((used0(&m), m.shm.members()), (256 * MIB, 1), "the live process keeps its charge");
    // And the live member can still use exactly the rest.
    let out = member("client_dlsym", &dir, "reuse", None).args(["init ctx 0 alloc 768m alloc 1"]).run();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (0, 2), "{}", out.stderr);
    live.sigkill();
}

#[test]
fn a_thousand_short_lived_members_leave_the_ledger_at_zero() {
    let dir = private_group_dir();
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                for i in 0..125 {
                    // Most exit holding memory (their exit gives it back); some free first.
                    let ops = if i % 4 == 0 { "init ctx 0 alloc 3m free 0" } else { "init ctx 0 alloc 1m alloc 3m" };
                    let out = member(CLIENTS[(w + i) % 3], &dir, "churn", Some("64m")).args([ops]).run();
                    out.ok();
                    assert!(out.of("alloc").iter().all(|l| l.rc() == 0), "{}", out.stderr);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    // Their charges left when they died: the next one to need the budget (here the sidecar's
    // sweep) finds them all dead.
    let m = ledger(&dir, "churn");
    group::reclaim_in(m.shm);
    assert_eq!((used0(&m), m.shm.members()), (0, 0));
}

#[test]
fn free_memory_does_not_count_members_that_died() {
    let dir = private_group_dir();
    let mut c = member("client_linked", &dir, "gone", Some("1g")).args(["init ctx 0 info sleep 1500 info sleep 60000"]).spawn();
    assert_eq!(c.wait_for("info").num("free"), GIB);
    // A exits holding 512 MiB: dead, not yet reclaimed.
    let out = member("client_procaddr", &dir, "gone", None).args(["init ctx 0 alloc 512m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 0);
    // A new member, and (a second later) a running one, see the whole budget free.
    let out = member("client_dlsym", &dir, "gone", None).args(["init ctx 0 info"]).run();
    assert_eq!(out.ok().nth("info", 0).num("free"), GIB, "{}", out.stderr);
    assert_eq!(c.wait_for("info").num("free"), GIB);
    c.sigkill();
}

#[test]
fn a_member_keeps_its_charge_until_it_is_dead_not_just_exiting() {
    let dir = private_group_dir();
    // A holds 200 MiB; after exit() began it sleeps 3 s in a later atexit handler (a C++
    // destructor, a framework's shutdown) still holding that memory.
    let mut a = member("client_linked", &dir, "exit", Some("256m")).args(["exitsleep 3000 init ctx 0 alloc 200m"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    a.wait_for("exiting");
    let out = member("client_procaddr", &dir, "exit", None).args(["init ctx 0 alloc 200m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 2, "200 MiB more during A's exit would be 400 MiB under 256 MiB");
    assert_eq!(used0(&ledger(&dir, "exit")), 200 * MIB, "an exiting member still holds its memory");
    assert!(a.finish().success());
    // Dead now: the next member's denial path reclaims it at once.
    let out = member("client_procaddr", &dir, "exit", None).args(["init ctx 0 alloc 200m"]).run();
    assert_eq!(out.ok().nth("alloc", 0).rc(), 0, "{}", out.stderr);
}

fn corrupt(dir: &PathBuf, how: &str) {
    let p = file::path_for(dir.to_str().unwrap(), "bad");
    match how {
        "magic" => std::fs::write(&p, vec![0u8; shm::LAYOUT_BYTES]).unwrap(),
        "version" => {
            let m = file::open_or_create(&p, "bad").unwrap();
            m.shm.header.version.store(99, SeqCst);
        }
        _ => std::fs::write(&p, b"VRAMCAPG").unwrap(),
    }
}

#[test]
fn a_corrupted_ledger_fails_closed_with_the_message() {
    for (how, needle) in [("magic", "bad magic"), ("version", "format version 99"), ("truncated", "is truncated")] {
        for client in CLIENTS {
            let dir = private_group_dir();
            corrupt(&dir, how);
            let out = member(client, &dir, "bad", Some("1g")).args(["init ctx 0 alloc 1m stats 0"]).run();
            out.ok();
            assert_ne!(out.nth("init", 0).rc(), 0, "{client} {how}");
            assert_ne!(out.nth("alloc", 0).rc(), 0, "{client} {how}: nothing may be handed out");
            assert_eq!(out.nth("stats", 0).num("bytes_held"), 0);
            assert!(out.stderr.contains(needle), "{client} {how}: {}", out.stderr);
            assert!(out.stderr.contains("Refusing to run uncapped"), "{}", out.stderr);
        }
    }
}

#[test]
fn the_newest_limit_wins_says_so_and_views_follow_the_group() {
    let dir = private_group_dir();
    let mut a = member("client_linked", &dir, "lim", Some("1g")).args(["init ctx 0 alloc 512m info sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let i = a.wait_for("info");
    assert_eq!((i.num("free"), i.num("total")), (512 * MIB, GIB), "free is what the group has left");
    let out = member("client_procaddr", &dir, "lim", Some("768m")).args(["init ctx 0 info total 0 alloc 512m alloc 256m"]).run();
    out.ok();
    assert!(out.stderr.contains("limit changed from 1.0 GiB to 768.0 MiB"), "{}", out.stderr);
    assert_eq!((out.nth("info", 0).num("free"), out.nth("info", 0).num("total")), (256 * MIB, 768 * MIB));
    assert_eq!(out.nth("total", 0).num("bytes"), 768 * MIB);
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (2, 0));
    // Without a limit of its own a member adopts the group's, silently.
    let out = member("client_dlsym", &dir, "lim", None).args(["init ctx 0 info"]).run();
    assert_eq!(out.nth("info", 0).num("total"), 768 * MIB);
    assert!(!out.stderr.contains("limit changed"), "{}", out.stderr);
    a.sigkill();
}

#[test]
fn the_process_limit_still_applies_inside_a_group() {
    let dir = private_group_dir();
    let out = member("client_procaddr", &dir, "both", Some("1g"))
        .env("VRAMCAP_LIMIT", "256m")
        .args(["init ctx 0 alloc 512m alloc 256m info"])
        .run();
    out.ok();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (2, 0));
    assert_eq!(out.nth("info", 0).num("total"), 256 * MIB);
    assert!(out.stderr.contains("of limit 268435456"), "the process's cap refused: {}", out.stderr);
}

#[test]
fn hamis_limit_is_the_containers_budget() {
    let dir = private_group_dir();
    let hami = |ops: &str| Run::client("client_procaddr").env("VRAMCAP_GROUP_DIR", &dir).env("CUDA_DEVICE_MEMORY_LIMIT", "1g").args([ops]);
    let mut a = hami("init ctx 0 alloc 768m sleep 60000").spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let out = hami("init ctx 0 alloc 512m alloc 256m").run();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (2, 0), "{}", out.stderr);
    assert!(out.stderr.contains("of group \"hami-"), "{}", out.stderr);
    a.sigkill();
}

#[test]
fn nvml_free_is_what_the_group_has_left() {
    let dir = private_group_dir();
    let mut a = member("client_linked", &dir, "nv", Some("2g")).args(["init ctx 0 alloc 1g sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    // Another member, holding 512 MiB itself: NVML and CUDA both show the group's remainder.
    let out = member("client_nvml", &dir, "nv", None).args(["init ctx 0 alloc 512 cuinfo nvml 0 nvml2 0"]).run();
    out.ok();
    let cu = out.nth("cuinfo", 0);
    assert_eq!((cu.num("total"), cu.num("free")), (2 * GIB, 512 * MIB), "{}", out.stderr);
    for i in 0..2 {
        let n = out.nth("nvml", i);
        assert_eq!((n.num("total"), n.num("free")), (2 * GIB, 512 * MIB), "nvml line {i}");
    }
    a.sigkill();
}

/// A member's trace: `used` is always this process's own charge, also when the group's budget
/// refused; `group_used`, the header's `group_limit` and the summary's `group` carry the group's.
#[test]
fn a_group_denial_in_a_members_trace_keeps_used_to_the_process() {
    let dir = private_group_dir();
    let mut a = member("client_linked", &dir, "trace", Some("1536m")).args(["init ctx 0 alloc 1g sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let trace = dir.join("b.jsonl");
    let out = member("client_procaddr", &dir, "trace", None)
        .env("VRAMCAP_TRACE", &trace)
        .args(["init ctx 0 alloc 256m alloc 1g async 1g graph 0 1g 1 0 glaunch 0 free 0"])
        .run();
    a.sigkill();
    out.ok();
    assert_eq!(out.nth("alloc", 1).rc(), 2, "{}", out.stderr);
    assert_eq!(out.nth("async", 0).rc(), 2, "a pool's growth refused by the group: {}", out.stdout);
    assert_eq!(out.nth("glaunch", 0).rc(), 2, "a graph's memory refused by the group: {}", out.stdout);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&trace).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let header = &lines[0];
    assert_eq!(header["group"], "trace");
    assert_eq!(header["devices"][0]["group_limit"], 1536 * MIB);
    let ev: Vec<&serde_json::Value> = lines.iter().filter(|l| l["type"] == "event").collect();
    let denies: Vec<_> = ev.iter().filter(|e| e["op"] == "deny").collect();
    assert_eq!(denies.len(), 3, "{denies:?}");
    for deny in denies {
        assert_eq!(deny["used"], 256 * MIB, "the process's own charge: {deny}");
        assert_eq!(deny["group_used"], 1280 * MIB, "{deny}");
    }
    let alloc = ev.iter().find(|e| e["op"] == "alloc").unwrap();
    assert_eq!((alloc["used"].as_u64(), alloc["group_used"].as_u64()), (Some(256 * MIB), Some(1280 * MIB)));
    let s = lines.last().unwrap();
    assert_eq!(s["type"], "summary");
    assert_eq!(s["peak"]["0"], 256 * MIB);
    assert_eq!(s["denied"]["0"], 3);
    assert_eq!(s["group"]["name"], "trace");
    assert_eq!(s["group"]["limit"]["0"], 1536 * MIB);
}
