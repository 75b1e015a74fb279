//! Sharing policies among real processes (issue 17): `equal`, `priority`, reserves, headroom,
//! pressure trimming, `kill -9` under each policy, and 16 racing processes per policy. Members
//! are the C clients under the preload; the ledger is read through the library's own `group`
//! module, as the sidecar reads it.

use vramcap_tests::common;
use common::*;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};
use vramcap_common::group_ledger::{self as group, file};

pub(crate) fn member(dir: &Path, name: &str, env: &[(&str, &str)]) -> Run {
    let mut r = Run::client("client_linked").env("VRAMCAP_GROUP", name).env("VRAMCAP_GROUP_DIR", dir);
    for (k, v) in env {
        r = r.env(k, v);
    }
    r
}

fn ledger(dir: &Path, name: &str) -> file::Mapping {
    file::open_existing(&file::path_for(dir.to_str().unwrap(), name)).unwrap().expect("ledger exists")
}

/// Kills a member that waits forever and returns what it wrote on stderr.
fn stop(mut r: Running) -> String {
    let _ = r.child.kill();
    r.child.wait().unwrap();
    let mut err = String::new();
    r.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    err
}

pub(crate) fn touch(p: &Path) {
    std::fs::write(p, "").unwrap();
}

fn go(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("go{n}"))
}

#[test]
fn equal_shares_follow_members_joining_and_leaving_and_nothing_is_taken_back() {
    let dir = private_group_dir();
    let env = [("VRAMCAP_GROUP_LIMIT", "300m"), ("VRAMCAP_GROUP_POLICY", "equal")];
    let script = format!(
        "init ctx 0 alloc 100m waitfile {} alloc 60m alloc 50m waitfile {} alloc 1m free 2 alloc 1m waitfile {} alloc 40m sleep 60000",
        go(&dir, 1).display(),
        go(&dir, 2).display(),
        go(&dir, 3).display()
    );
    let mut a = member(&dir, "eq", &env).args([script]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0, "alone: share 300 MiB");
    let b = member(&dir, "eq", &env).args(["init ctx 0 sleep 60000"]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    touch(&go(&dir, 1));
    assert_ne!(a.wait_for("alloc").rc(), 0, "two members: 160 MiB is above the 150 MiB share");
    assert_eq!(a.wait_for("alloc").rc(), 0, "150 MiB is the share");
    // A third member: the share shrinks to 100 MiB; A keeps its 150 MiB but gets nothing more.
    let c = member(&dir, "eq", &env).args(["init ctx 0 sleep 60000"]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    let m = ledger(&dir, "eq");
    assert_eq!(m.shm.used(0), 150 * MIB, "nothing was taken back");
    // Denial lines are at most one a second per process: let the next one be printed.
    std::thread::sleep(Duration::from_millis(1100));
    touch(&go(&dir, 2));
    assert_ne!(a.wait_for("alloc").rc(), 0, "above the new share");
    assert_ne!(a.wait_for("alloc").rc(), 0, "still above it after freeing 50 MiB (100 MiB is the share)");
    // C leaves (killed): its share comes back at once, 150 MiB each again.
    c.sigkill();
    touch(&go(&dir, 3));
    assert_eq!(a.wait_for("alloc").rc(), 0, "100 + 1 + 40 MiB fits the 150 MiB share again");
    let err = stop(a);
    assert!(err.contains("equal share 150.0 MiB of 300.0 MiB among 2 members"), "{err}");
    assert!(err.contains("equal share 100.0 MiB of 300.0 MiB among 3 members"), "{err}");
    stop(b);
}

#[test]
fn priority_keeps_a_higher_members_minimum_and_takes_from_lower_ones() {
    let dir = private_group_dir();
    let base = [("VRAMCAP_GROUP_LIMIT", "1000m"), ("VRAMCAP_GROUP_POLICY", "priority")];
    let high_env = [base[0], base[1], ("VRAMCAP_PRIORITY", "10"), ("VRAMCAP_GROUP_RESERVE", "600m")];
    let script = format!("init ctx 0 waitfile {} alloc 700m alloc 99m alloc 1m sleep 60000", go(&dir, 1).display());
    let mut high = member(&dir, "prio", &high_env).args([script]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    // A low member with a reserve of its own: 600 + 300 reserved of 1000 MiB.
    let low_env = [base[0], base[1], ("VRAMCAP_GROUP_RESERVE", "300m")];
    let script = format!("init ctx 0 alloc 101m alloc 100m waitfile {} alloc 1m sleep 60000", go(&dir, 2).display());
    let mut low = member(&dir, "prio", &low_env).args([script]).spawn();
    // Both come out of its own reserve: nothing new is held.
    assert_eq!(low.wait_for("alloc").rc(), 0);
    assert_eq!(low.wait_for("alloc").rc(), 0);
    let m = ledger(&dir, "prio");
    let d = &m.shm.devices[0];
    assert_eq!((m.shm.used(0), d.held.load(SeqCst)), (201 * MIB, 900 * MIB), "used 201 + unmet 600 (H) + 99 (L)");
    // H: 700 MiB (600 from its reserve, 100 free), then 99 MiB taken from L's unmet reserve.
    touch(&go(&dir, 1));
    assert_eq!(high.wait_for("alloc").rc(), 0);
    assert_eq!(high.wait_for("alloc").rc(), 0, "a higher priority takes a lower member's unmet reserve");
    assert_eq!((m.shm.used(0), d.held.load(SeqCst)), (1000 * MIB, 1000 * MIB));
    assert_eq!(m.shm.slots.iter().map(|s| s.unmet[0].load(SeqCst)).sum::<u64>(), 0);
    assert_ne!(high.wait_for("alloc").rc(), 0, "and never past the budget");
    // L's reserve was taken: not even 1 MiB more until it frees.
    touch(&go(&dir, 2));
    assert_ne!(low.wait_for("alloc").rc(), 0);
    let err = stop(low);
    stop(high);
    assert!(err.contains("of group \"prio\" limit 1048576000"), "{err}");
}

#[test]
fn a_low_priority_member_is_denied_while_a_higher_minimum_is_unmet() {
    let dir = private_group_dir();
    let high_env =
        [("VRAMCAP_GROUP_LIMIT", "1g"), ("VRAMCAP_GROUP_POLICY", "priority"), ("VRAMCAP_PRIORITY", "5"), ("VRAMCAP_GROUP_RESERVE", "600m")];
    let high = member(&dir, "p2", &high_env).args(["init ctx 0 sleep 60000"]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    let out = member(&dir, "p2", &[("VRAMCAP_PRIORITY", "1")]).args(["init ctx 0 alloc 500m alloc 424m"]).run();
    assert_ne!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert_eq!(out.nth("alloc", 1).rc(), 0, "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("reserved for higher priority: 600.0 MiB (pid {} \"client_linked\")", high.pid())),
        "{}",
        out.stderr
    );
    stop(high);
}

#[test]
fn a_reserve_that_does_not_fit_is_refused_at_init_saying_by_whom() {
    let dir = private_group_dir();
    let a = member(&dir, "res", &[("VRAMCAP_GROUP_LIMIT", "1g"), ("VRAMCAP_GROUP_RESERVE", "700m")]).args(["init ctx 0 sleep 60000"]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    let out = member(&dir, "res", &[("VRAMCAP_GROUP_RESERVE", "400m")]).args(["init ctx 0 alloc 1m"]).run();
    assert_ne!(out.nth("alloc", 0).rc(), 0, "a refused member gets nothing: {}", out.stderr);
    let want = format!("VRAMCAP_GROUP_RESERVE 400.0 MiB does not fit on device 0 of group \"res\": limit 1.0 GiB, headroom 0 B, reserved 700.0 MiB by pid {} \"client_linked\" 700.0 MiB", a.pid());
    assert!(out.stderr.contains(&want), "{}", out.stderr);
    let m = ledger(&dir, "res");
    assert_eq!(m.shm.devices[0].held.load(SeqCst), 700 * MIB, "the refused reserve left nothing behind");
    group::reclaim_in(m.shm);
    assert_eq!(m.shm.members(), 1, "and its slot went back");
    // 300 MiB still fits beside A's 700 (of 1 GiB = 1024 MiB); 25 MiB more does not.
    let out = member(&dir, "res", &[("VRAMCAP_GROUP_RESERVE", "300m")]).args(["init ctx 0 alloc 300m alloc 25m"]).run();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc() != 0), (0, true), "{}", out.stderr);
    stop(a);
}

#[test]
fn a_second_policy_is_refused_while_members_run_and_set_once_they_are_gone() {
    let dir = private_group_dir();
    let a = member(&dir, "pol", &[("VRAMCAP_GROUP_LIMIT", "1g"), ("VRAMCAP_GROUP_POLICY", "equal")]).args(["init ctx 0 sleep 60000"]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    let out = member(&dir, "pol", &[("VRAMCAP_GROUP_POLICY", "priority")]).args(["init ctx 0 alloc 1m"]).run();
    assert_ne!(out.nth("alloc", 0).rc(), 0);
    assert!(out.stderr.contains("group \"pol\" uses policy equal (set by its first member), and this process asks for priority (VRAMCAP_GROUP_POLICY=priority)"), "{}", out.stderr);
    // Not asking: the group's policy (two members: 512 MiB each).
    let out = member(&dir, "pol", &[]).args(["init ctx 0 alloc 513m alloc 512m"]).run();
    assert_eq!((out.nth("alloc", 0).rc() != 0, out.nth("alloc", 1).rc()), (true, 0), "{}", out.stderr);
    stop(a);
    let out = member(&dir, "pol", &[("VRAMCAP_GROUP_POLICY", "priority")]).args(["init ctx 0 alloc 1000m"]).run();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "alone: it sets the policy: {}", out.stderr);
    assert_eq!(ledger(&dir, "pol").shm.policy(), vramcap_common::group_ledger::shm::Policy::Priority);
    let bad = member(&dir, "pol", &[("VRAMCAP_GROUP_POLICY", "fair")]).args(["init ctx 0 alloc 1m"]).run();
    assert!(bad.stderr.contains("invalid VRAMCAP_GROUP_POLICY=\"fair\": not a policy; expected shared"), "{}", bad.stderr);
}

#[test]
fn the_headroom_is_kept_for_a_member_that_starts_later() {
    let dir = private_group_dir();
    let env = [("VRAMCAP_GROUP_LIMIT", "1000m"), ("VRAMCAP_GROUP_HEADROOM", "200m")];
    let mut a = member(&dir, "hr", &env).args(["init ctx 0 alloc 801m alloc 800m sleep 60000"]).spawn();
    assert_ne!(a.wait_for("alloc").rc(), 0, "the first member may not use the headroom");
    assert_eq!(a.wait_for("alloc").rc(), 0);
    // B starts while A holds memory: it holds the headroom and may use it.
    let mut b = member(&dir, "hr", &[]).args(["init ctx 0 alloc 200m sleep 60000"]).spawn();
    assert_eq!(b.wait_for("alloc").rc(), 0, "the late starter uses the headroom");
    // C starts while B holds it: nothing for C.
    let out = member(&dir, "hr", &[]).args(["init ctx 0 alloc 1m"]).run();
    assert_ne!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    // B dies: the headroom is free for the next starter (a restart).
    b.sigkill();
    let out = member(&dir, "hr", &[]).args(["init ctx 0 alloc 200m"]).run();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "the restart gets the headroom back: {}", out.stderr);
    let err = stop(a);
    assert!(err.contains("headroom 200.0 MiB kept for a member not running yet"), "{err}");
    // A member asking for another headroom while A runs is refused.
    let a = member(&dir, "hr", &env).args(["init ctx 0 sleep 60000"]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    let out = member(&dir, "hr", &[("VRAMCAP_GROUP_HEADROOM", "100m")]).args(["init ctx 0 alloc 1m"]).run();
    assert!(out.stderr.contains("the group keeps a headroom of 200.0 MiB (set by its first member), and this process asks for 100.0 MiB"), "{}", out.stderr);
    stop(a);
}

/// Every member was killed (their charges still in the ledger): the next to start is the group's
/// first again, not a late starter, so it does not get the headroom.
#[test]
fn a_member_starting_after_the_whole_group_died_does_not_get_the_headroom() {
    let dir = private_group_dir();
    let env = [("VRAMCAP_GROUP_LIMIT", "1000m"), ("VRAMCAP_GROUP_HEADROOM", "200m")];
    let mut a = member(&dir, "gone", &env).args(["init ctx 0 alloc 500m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    a.sigkill();
    let m = ledger(&dir, "gone");
    assert_eq!(m.shm.used(0), 500 * MIB, "the dead member's charge is still in the ledger");
    let out = member(&dir, "gone", &[]).args(["init ctx 0 alloc 801m alloc 800m"]).run();
    assert_ne!(out.nth("alloc", 0).rc(), 0, "the headroom went to a member that is the only one: {}", out.stderr);
    assert_eq!(out.nth("alloc", 1).rc(), 0, "{}", out.stderr);
    assert_eq!(m.shm.header.headroom_holder.load(SeqCst), 0);
}

/// A neighbour's pool keeps 200 MiB it does not use; a denied member makes it trim at its next
/// driver call and succeeds on the retry. A neighbour that makes no driver call gives nothing.
#[test]
fn pressure_makes_a_busy_neighbour_trim_its_pool_for_a_denied_member() {
    for busy in [true, false] {
        let dir = private_group_dir();
        let tail = if busy { "poll 1000 5" } else { "sleep 5000" };
        let script = format!("init ctx 0 defpool 0 keep 0 async 200m freeasync 0 sync {tail}");
        let mut b = member(&dir, "pr", &[("VRAMCAP_GROUP_LIMIT", "256m")]).args([script]).spawn();
        assert_eq!(b.wait_for("sync").rc(), 0);
        let m = ledger(&dir, "pr");
        assert_eq!(m.shm.used(0), 200 * MIB, "the pool keeps what was freed");
        let t = Instant::now();
        let out = member(&dir, "pr", &[]).args(["init ctx 0 alloc 100m"]).run();
        let took = t.elapsed();
        if busy {
            assert_eq!(out.nth("alloc", 0).rc(), 0, "the neighbour trimmed: {}", out.stderr);
            assert!(m.shm.used(0) <= 100 * MIB);
        } else {
            assert_ne!(out.nth("alloc", 0).rc(), 0, "an idle neighbour gives nothing back: {}", out.stderr);
            println!("denied after waiting {took:?} (bounded by 100 ms plus start-up)");
        }
        stop(b);
    }
}

/// `kill -9` of a member under each policy: its charge, reserve, share and headroom come back
/// at once (the next member that would be denied reclaims it).
#[test]
fn a_killed_member_loses_nothing_under_any_policy() {
    for policy in ["shared", "equal", "priority"] {
        let dir = private_group_dir();
        let env = [("VRAMCAP_GROUP_LIMIT", "1000m"), ("VRAMCAP_GROUP_POLICY", policy), ("VRAMCAP_GROUP_HEADROOM", "100m")];
        let first = member(&dir, "k", &env).args(["init ctx 0 alloc 10m sleep 60000"]).spawn();
        std::thread::sleep(Duration::from_millis(300));
        let mut a = member(&dir, "k", &[("VRAMCAP_GROUP_RESERVE", "300m"), ("VRAMCAP_PRIORITY", "9")])
            .args(["init ctx 0 alloc 400m sleep 60000"])
            .spawn();
        assert_eq!(a.wait_for("alloc").rc(), 0, "{policy}");
        let m = ledger(&dir, "k");
        assert!(m.shm.header.headroom_holder.load(SeqCst) != 0, "{policy}: A started late and holds the headroom");
        a.sigkill();
        let first_err = stop(first);
        let _ = first_err;
        // Alone now (the first member stopped too): the whole budget less the headroom, at once.
        let out = member(&dir, "k", &[]).args(["init ctx 0 alloc 900m"]).run();
        assert_eq!(out.nth("alloc", 0).rc(), 0, "{policy}: {}", out.stderr);
        group::reclaim_in(m.shm);
        let d = &m.shm.devices[0];
        assert_eq!((m.shm.used(0), d.held.load(SeqCst), m.shm.members()), (0, 0, 0), "{policy}");
        assert_eq!(m.shm.header.members.load(SeqCst), 0, "{policy}: the member count came back too");
        assert_eq!(m.shm.header.headroom_holder.load(SeqCst), 0, "{policy}");
    }
}

/// 16 processes allocate and free at random for 10 s under each policy, with reserves and a
/// headroom; what they hold together (from their own reports, not the ledger) never passes the
/// budget, and the ledger ends empty.
#[test]
fn sixteen_racing_processes_never_pass_the_budget_under_any_policy() {
    let secs: u64 = std::env::var("VRAMCAP_TEST_RACE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    for policy in ["shared", "equal", "priority"] {
        let dir = private_group_dir();
        let limit = 256 * MIB;
        let deadline = Instant::now() + Duration::from_secs(secs);
        let runs: Vec<_> = (0..16)
            .map(|i| {
                let prio = (i % 3).to_string();
                let mut env = vec![("VRAMCAP_GROUP_LIMIT", "256m".to_string()), ("VRAMCAP_GROUP_POLICY", policy.to_string()), ("VRAMCAP_PRIORITY", prio)];
                env.push(("VRAMCAP_GROUP_HEADROOM", "16m".into()));
                // The fake's device counters, shared by all 16 as one physical GPU would be.
                env.push(("FAKECUDA_SHARED_DEVICE", dir.join("device").to_string_lossy().into_owned()));
                if i % 4 == 0 {
                    env.push(("VRAMCAP_GROUP_RESERVE", "8m".into()));
                }
                let dir = dir.clone();
                std::thread::spawn(move || {
                    let mut all = Vec::new();
                    let mut k = 0;
                    while Instant::now() < deadline {
                        let pairs: Vec<(&str, &str)> = env.iter().map(|(a, b)| (*a, b.as_str())).collect();
                        let out = member(&dir, "race", &pairs).args([format!("init ctx 0 record 200 24m 2000 {}", i * 1000 + k)]).run();
                        all.push(out);
                        k += 1;
                    }
                    all
                })
            })
            .collect();
        let mut events: Vec<(u64, i64)> = Vec::new();
        let (mut oom, mut refused) = (0, 0);
        for t in runs {
            for out in t.join().unwrap() {
                if out.stderr.contains("VRAMCAP_GROUP_RESERVE 8.0 MiB does not fit") {
                    // Refused at start (the group was full): it got nothing, as it should.
                    refused += 1;
                    continue;
                }
                let rec = out.nth("record", 0);
                assert_eq!(rec.num("other"), 0, "{policy}: {}", out.stderr);
                oom += rec.num("oom");
                for h in out.of("held") {
                    events.push((h.num("t0"), h.num("size") as i64));
                    events.push((h.num("t1"), -(h.num("size") as i64)));
                }
            }
        }
        events.sort_by_key(|&(t, d)| (t, -d));
        let (mut held, mut max) = (0i64, 0i64);
        for (_, d) in &events {
            held += d;
            max = max.max(held);
        }
        println!("{policy}: {} allocations, {oom} denied, {refused} reserves refused, at most {} MiB held together", events.len() / 2, max as u64 / MIB);
        assert!(max as u64 <= limit, "{policy}: the processes held {max} bytes together, limit {limit}");
        // The device's own view: what the driver handed out to all of them at once, at any instant.
        let dev = std::fs::read(dir.join("device")).unwrap();
        let word = |i: usize| u64::from_ne_bytes(dev[i * 8..i * 8 + 8].try_into().unwrap());
        let (device_held, device_peak) = (word(0), word(1));
        println!("{policy}: the shared device's peak {} MiB, {} bytes held at the end", device_peak / MIB, device_held);
        assert!(device_peak <= limit, "{policy}: the device held {device_peak} bytes at once, limit {limit}");
        assert!(device_peak >= max as u64, "{policy}: the device saw less than the clients held ({device_peak} < {max})");
        assert_eq!(device_held, 0, "{policy}: every allocation was freed");
        assert!(oom > 0, "{policy}: the budget must have been contended");
        let m = ledger(&dir, "race");
        group::reclaim_in(m.shm);
        let d = &m.shm.devices[0];
        assert_eq!((m.shm.used(0), d.held.load(SeqCst), m.shm.members()), (0, 0, 0), "{policy}: the ledger ends empty");
        assert!(d.peak.load(SeqCst) <= limit);
    }
}

pub(crate) fn trace_lines(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Waits until the trace at `p` has its header line (the writer starts with the first event).
fn header_of(p: &Path) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(h) = trace_lines(p).into_iter().next() {
            return h;
        }
        assert!(Instant::now() < deadline, "no header in {}", p.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 17 item 6: a member's trace carries its policy, priority, reserve, the group's headroom
/// and whether it holds it, and its `equal` share: in the header as at start, in the summary as
/// at exit (a third member joined in between, so the share shrank); `vramcap report` prints them.
/// Under `priority` there is no share, and a negative priority stays negative.
#[test]
fn a_members_trace_and_report_carry_its_sharing_settings() {
    let dir = private_group_dir();
    let env = [("VRAMCAP_GROUP_LIMIT", "400m"), ("VRAMCAP_GROUP_POLICY", "equal"), ("VRAMCAP_GROUP_HEADROOM", "100m")];
    let mut a = member(&dir, "vis", &env).args(["init ctx 0 alloc 10m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    // B starts while A holds memory: it holds the headroom. Its share: (400 − 100) / 2 + 100.
    let trace = dir.join("b.jsonl");
    let script = format!("init ctx 0 alloc 1m waitfile {} alloc 1m", go(&dir, 1).display());
    let b = member(&dir, "vis", &[("VRAMCAP_GROUP_RESERVE", "30m"), ("VRAMCAP_PRIORITY", "2")]).env("VRAMCAP_TRACE", &trace).args([script]).spawn();
    let h = header_of(&trace);
    assert_eq!((h["group"].as_str(), h["group_policy"].as_str()), (Some("vis"), Some("equal")), "{h}");
    assert_eq!((h["group_priority"].as_i64(), h["group_holds_headroom"].as_bool()), (Some(2), Some(true)), "{h}");
    let d = &h["devices"][0];
    assert_eq!(d["group_limit"], 400 * MIB, "{h}");
    assert_eq!((d["group_reserve"].as_u64(), d["group_headroom"].as_u64()), (Some(30 * MIB), Some(100 * MIB)), "{h}");
    assert_eq!(d["group_share"], 250 * MIB, "{h}");
    // A third member starts late while B does not use the headroom: C takes it (issue 25), so
    // B's share is 300 / 3 when it exits.
    let c = member(&dir, "vis", &[]).args(["init ctx 0 sleep 60000"]).spawn();
    std::thread::sleep(Duration::from_millis(300));
    touch(&go(&dir, 1));
    assert!(b.finish().success());
    let s = trace_lines(&trace).pop().unwrap();
    assert_eq!(s["type"], "summary", "{s}");
    let g = &s["group"];
    assert_eq!((g["policy"].as_str(), g["priority"].as_i64(), g["holds_headroom"].as_bool()), (Some("equal"), Some(2), Some(false)), "{s}");
    assert_eq!((g["reserve"]["0"].as_u64(), g["headroom"]["0"].as_u64()), (Some(30 * MIB), Some(100 * MIB)), "{s}");
    assert_eq!(g["share"]["0"], 100 * MIB, "{s}");
    assert_eq!(g["limit"]["0"], 400 * MIB, "the existing fields stay: {s}");

    let report = |args: &[&str]| {
        let out = std::process::Command::new(vramcap_tests::common::vramcap_bin()).args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = report(&["report", trace.to_str().unwrap()]);
    let want = "group sharing   policy equal, priority 2, share 250.0 MiB at start, 100.0 MiB at exit, reserve 30.0 MiB, headroom 100.0 MiB (this process could use it)";
    assert!(text.contains(want), "{text}");
    let j: serde_json::Value = serde_json::from_str(&report(&["report", "--json", trace.to_str().unwrap()])).unwrap();
    let p = &j["processes"][0];
    assert_eq!((p["group_policy"].as_str(), p["group_priority"].as_i64(), p["group_holds_headroom"].as_bool()), (Some("equal"), Some(2), Some(true)));
    let d = &p["devices"][0];
    assert_eq!((d["group_share"].as_u64(), d["group_share_at_exit"].as_u64()), (Some(250 * MIB), Some(100 * MIB)), "{d}");
    assert_eq!((d["group_reserve"].as_u64(), d["group_headroom"].as_u64()), (Some(30 * MIB), Some(100 * MIB)), "{d}");
    stop(a);
    stop(c);

    // `priority`: alone (no headroom to hold), no share; the priority is signed.
    let trace = dir.join("p.jsonl");
    let env = [("VRAMCAP_GROUP_LIMIT", "1g"), ("VRAMCAP_GROUP_POLICY", "priority"), ("VRAMCAP_PRIORITY", "-3"), ("VRAMCAP_GROUP_RESERVE", "100m")];
    member(&dir, "vis-p", &env).env("VRAMCAP_TRACE", &trace).args(["init ctx 0 alloc 1m"]).run().ok();
    let lines = trace_lines(&trace);
    let (h, s) = (&lines[0], lines.last().unwrap());
    assert_eq!((h["group_policy"].as_str(), h["group_priority"].as_i64(), h["group_holds_headroom"].as_bool()), (Some("priority"), Some(-3), Some(false)), "{h}");
    let d = &h["devices"][0];
    assert_eq!((d["group_reserve"].as_u64(), d["group_headroom"].as_u64()), (Some(100 * MIB), Some(0)), "{h}");
    assert!(d.get("group_share").is_none() && s["group"].get("share").is_none(), "a share only under equal: {h} {s}");
    assert_eq!((s["group"]["policy"].as_str(), s["group"]["priority"].as_i64()), (Some("priority"), Some(-3)), "{s}");
    let text = report(&["report", trace.to_str().unwrap()]);
    assert!(text.contains("group sharing   policy priority, priority -3, reserve 100.0 MiB, headroom 0 B\n"), "{text}");
}
