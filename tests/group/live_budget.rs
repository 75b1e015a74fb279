//! Changing a running group's budget with `vramcap limit` (issue 26): shrink below use, grow,
//! later joiners adopting the operator's budget, another uid refused, and a race of budgets
//! moving under 4 processes × 16 threads measured on the fake driver's shared device counter.

use vramcap_tests::common;
use common::*;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};
use vramcap_common::group_ledger::file;

fn member(dir: &Path, name: &str, limit: Option<&str>) -> Run {
    let r = Run::client("client_linked").env("VRAMCAP_GROUP", name).env("VRAMCAP_GROUP_DIR", dir);
    match limit {
        Some(l) => r.env("VRAMCAP_GROUP_LIMIT", l),
        None => r,
    }
}

fn limit_cmd(dir: &Path, name: &str, spec: Option<&str>) -> Command {
    limit_cmd_of(Path::new(vramcap_bin()), dir, name, spec)
}

/// The same with a given binary: another uid runs the copy every user can reach
/// (`sidecar_support::reachable`), since a checkout under a private directory is out of its reach.
fn limit_cmd_of(bin: &Path, dir: &Path, name: &str, spec: Option<&str>) -> Command {
    let mut c = Command::new(bin);
    c.args(["limit", "--group", name, "--group-dir", dir.to_str().unwrap()]);
    c.args(spec);
    c
}

/// `vramcap limit ...` as the test's uid: (status ok, stdout + stderr).
fn limit(dir: &Path, name: &str, spec: Option<&str>) -> (bool, String) {
    let o = limit_cmd(dir, name, spec).output().unwrap();
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

fn ledger_limit(dir: &Path, name: &str) -> u64 {
    let m = file::open_existing(&file::path_for(dir.to_str().unwrap(), name)).unwrap().unwrap();
    m.shm.devices[0].limit.load(SeqCst)
}

#[test]
fn a_shrink_below_use_refuses_new_memory_and_a_grow_lets_it_through() {
    let dir = private_group_dir();
    let trace = dir.join("a.jsonl");
    let mut a = member(&dir, "live", Some("1g")).env("VRAMCAP_TRACE", &trace).args(["init ctx 0 alloc 512m sleep 7000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let (ok, out) = limit(&dir, "live", Some("256m"));
    assert!(ok, "{out}");
    assert!(out.contains("limit 1.0 GiB -> 256.0 MiB") && out.contains("nothing is taken away"), "{out}");
    // B joins with its own (larger) VRAMCAP_GROUP_LIMIT: the operator's budget stands.
    let mut b = member(&dir, "live", Some("4g")).args(["init ctx 0 info alloc 64m sleep 2500 alloc 64m"]).spawn();
    let info = b.wait_for("info");
    assert_eq!((info.num("total"), info.num("free")), (256 * MIB, 0), "the new total, nothing free");
    assert_eq!(b.wait_for("alloc").rc(), 2, "refused while the group holds more than the new budget");
    // Members look at the group's budget every 250 ms for their traces: let A see this one.
    std::thread::sleep(Duration::from_millis(700));
    let (ok, out) = limit(&dir, "live", Some("2g"));
    assert!(ok, "{out}");
    assert_eq!(b.wait_for("alloc").rc(), 0, "the grow lets the refused work through");
    let status = b.finish();
    assert!(status.success());
    let (ok, shown) = limit(&dir, "live", None);
    assert!(ok, "{shown}");
    assert!(shown.contains("limit 2.0 GiB (set with `vramcap limit` by uid"), "{shown}");
    assert!(shown.contains("used 512.0 MiB"), "{shown}");
    assert_eq!(ledger_limit(&dir, "live"), 2 * GIB);
    // A's trace has both changes as `limit` events, and the report lists them.
    assert!(a.finish().success());
    let text = std::fs::read_to_string(&trace).unwrap();
    let limits: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["op"] == "limit" && v["dev"] == 0)
        .collect();
    assert_eq!(limits.len(), 2, "{text}");
    assert_eq!((limits[0]["old"].as_u64(), limits[0]["new"].as_u64()), (Some(GIB), Some(256 * MIB)), "{}", limits[0]);
    assert_eq!((limits[1]["old"].as_u64(), limits[1]["new"].as_u64()), (Some(256 * MIB), Some(2 * GIB)), "{}", limits[1]);
    assert_eq!((limits[0]["source"].as_str(), limits[0]["uid"].as_u64()), (Some("group"), Some(unsafe { libc::geteuid() } as u64)));
    let o = Command::new(vramcap_bin()).arg("report").arg(&trace).output().unwrap();
    let report = String::from_utf8_lossy(&o.stdout);
    assert!(report.contains("limit changes   2") && report.contains("1.0 GiB -> 256.0 MiB  by group (uid"), "{report}");
}

#[test]
fn a_later_member_adopts_the_operators_budget_and_says_so_once() {
    let dir = private_group_dir();
    let mut a = member(&dir, "adopt", Some("1g")).args(["init ctx 0 alloc 1m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    assert!(limit(&dir, "adopt", Some("300m")).0);
    let out = member(&dir, "adopt", Some("4g")).args(["init ctx 0 alloc 512m"]).run();
    assert_eq!(out.nth("alloc", 0).rc(), 2, "held to the operator's 300 MiB, not its own 4 GiB");
    let lines: Vec<&str> = out.stderr.lines().filter(|l| l.contains("set with `vramcap limit`")).collect();
    assert_eq!(lines.len(), 1, "{}", out.stderr);
    assert!(lines[0].contains("device 0: 300.0 MiB (VRAMCAP_GROUP_LIMIT's 4.0 GiB)"), "{}", lines[0]);
    assert_eq!(ledger_limit(&dir, "adopt"), 300 * MIB);
    // Control: without an operator the newest member's setting still wins.
    let dir2 = private_group_dir();
    let mut c = member(&dir2, "newest", Some("1g")).args(["init ctx 0 alloc 1m sleep 60000"]).spawn();
    assert_eq!(c.wait_for("alloc").rc(), 0);
    let out = member(&dir2, "newest", Some("4g")).args(["init ctx 0 alloc 2g"]).run();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert!(out.stderr.contains("the newest VRAMCAP_GROUP_LIMIT wins"), "{}", out.stderr);
    a.sigkill();
    c.sigkill();
}

#[test]
fn another_uid_cannot_change_a_group_it_does_not_own_even_through_the_ledgers_unix_group() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run the command as another uid");
        return;
    }
    let dir = private_group_dir();
    let mut a = member(&dir, "owned", Some("1g")).args(["init ctx 0 alloc 1m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    // The ledger made group-writable for uid 65534's group: it may open the file, not change it.
    let path = file::path_for(dir.to_str().unwrap(), "owned");
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::chown(c.as_ptr(), 0, 65534) }, 0);
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    use std::os::unix::process::CommandExt;
    let o = limit_cmd_of(&vramcap_tests::sidecar_support::reachable().vramcap, &dir, "owned", Some("64m")).uid(65534).gid(65534).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("belongs to uid 0; only that uid or root may change its budget") && err.contains("nothing changed"), "{err}");
    assert_eq!(ledger_limit(&dir, "owned"), GIB, "nothing changed");
    // Control: the same uid may read it.
    let o = limit_cmd_of(&vramcap_tests::sidecar_support::reachable().vramcap, &dir, "owned", None).uid(65534).gid(65534).output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("limit 1.0 GiB"), "{o:?}");
    a.sigkill();
}

#[test]
fn bad_specs_are_refused_naming_the_input() {
    let dir = private_group_dir();
    let mut a = member(&dir, "bad", Some("1g")).args(["init ctx 0 alloc 1m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    for (spec, want) in [("50%", "a percentage needs the device's size"), ("7=1g", "no device 7"), ("lots", "expected"), ("GPU-12=1g", "whole UUID")] {
        let (ok, out) = limit(&dir, "bad", Some(spec));
        assert!(!ok && out.contains(spec) && out.contains(want), "{spec}: {out}");
    }
    assert_eq!(ledger_limit(&dir, "bad"), GIB);
    let (ok, out) = limit(&dir, "nosuch", None);
    assert!(!ok && out.contains("no group \"nosuch\""), "{out}");
    a.sigkill();
}


/// 4 processes × 16 threads allocate and free while the budget moves up and down. After each
/// change, once the group's ledger is within the new budget (what was held before a shrink is
/// never taken away), the driver's own counter never passes it.
#[test]
fn budgets_moving_under_sixty_four_racing_threads_are_never_passed() {
    let dir = private_group_dir();
    let devfile = dir.join("device");
    let dev = SharedDevice::open(&devfile);
    let deadline = Instant::now() + Duration::from_secs(12);
    let runs: Vec<_> = (0..4)
        .map(|i| {
            let (dir, devfile) = (dir.clone(), devfile.clone());
            std::thread::spawn(move || {
                let mut k = 0;
                while Instant::now() < deadline {
                    let out = member(&dir, "moving", Some("96m"))
                        .env("FAKECUDA_SHARED_DEVICE", &devfile)
                        .args([format!("init ctx 0 threads 16 3000 6m {}", i * 1000 + k + 1)])
                        .run();
                    assert_eq!(out.nth("threads", 0).num("other"), 0, "{}", out.stderr);
                    k += 1;
                }
            })
        })
        .collect();
    // Wait for the group's ledger (the first member makes it).
    let path = file::path_for(dir.to_str().unwrap(), "moving");
    while file::open_existing(&path).ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let m = file::open_existing(&path).unwrap().unwrap();
    let (mut checked, mut contended) = (0, 0);
    for (n, budget) in [40u64, 96, 24, 64, 16, 80, 32, 48].iter().cycle().enumerate() {
        if Instant::now() + Duration::from_secs(2) > deadline {
            break;
        }
        let l = budget * MIB;
        let (ok, out) = limit(&dir, "moving", Some(&format!("{budget}m")));
        assert!(ok, "{out}");
        // Held before a shrink stays until freed: from the moment the ledger is within the new
        // budget, every grant was judged by it (reservations come before the driver's call).
        let t = Instant::now();
        while m.shm.devices[0].held.load(SeqCst) > l && t.elapsed() < Duration::from_secs(3) {
            std::thread::yield_now();
        }
        if m.shm.devices[0].held.load(SeqCst) > l {
            continue;
        }
        dev.peak().store(dev.held(), SeqCst);
        std::thread::sleep(Duration::from_millis(250));
        let peak = dev.peak().load(SeqCst);
        assert!(peak <= l, "phase {n}: the driver held {peak} bytes under a budget of {l}");
        checked += 1;
        contended += (peak > l / 2) as usize;
    }
    for r in runs {
        r.join().unwrap();
    }
    assert!(checked >= 6, "only {checked} phases were checked");
    assert!(contended >= checked / 2, "the budgets must have been contended: {contended} of {checked} phases");
}

/// A burst racing shrinks (the post-CAS re-read of the limit, issue 26). 3 processes × 16 threads
/// allocate and free 64 KiB blocks; the budget is 1 GiB (never in the way) and, again and again,
/// one member is stopped (SIGSTOP: its threads freeze wherever they are, some between reading the
/// limit and their compare-and-swap), the budget is cut to what the group holds, and the member
/// is continued. Its threads must be held to the new budget, so from the cut on the driver's own
/// counter never passes it. Without the re-read they pass on the old limit read before the stop.
#[test]
fn a_burst_racing_shrinks_never_passes_the_new_budget_on_the_device() {
    let dir = private_group_dir();
    let devfile = dir.join("device");
    let dev = SharedDevice::open(&devfile);
    let big = GIB;
    let members: Vec<Running> = (0..3)
        .map(|i| {
            member(&dir, "burst", Some("1g"))
                .env("FAKECUDA_SHARED_DEVICE", &devfile)
                .args([format!("init ctx 0 threads 16 1000000000 64k {}", i + 1)])
                .spawn()
        })
        .collect();
    let path = file::path_for(dir.to_str().unwrap(), "burst");
    let m = loop {
        if let Some(m) = file::open_existing(&path).ok().flatten() {
            break m;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let d = &m.shm.devices[0];
    let uid = unsafe { libc::geteuid() };
    let signal = |r: &Running, sig| assert_eq!(unsafe { libc::kill(r.pid() as i32, sig) }, 0);
    let (mut checked, mut contended) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(6);
    for n in 0.. {
        if Instant::now() > deadline {
            break;
        }
        let stopped = &members[n % members.len()];
        m.shm.operator_set_limit(0, big, uid);
        std::thread::sleep(Duration::from_millis(3));
        signal(stopped, libc::SIGSTOP);
        std::thread::sleep(Duration::from_millis(1));
        // Cut to what the group holds (reservations included: they come before the driver's
        // call): any grant on the old budget passes the new one.
        let small = d.held.load(SeqCst).next_multiple_of(64 << 10);
        m.shm.operator_set_limit(0, small, uid);
        let within = small >= 4 * MIB && d.held.load(SeqCst) <= small;
        dev.peak().store(dev.held(), SeqCst);
        signal(stopped, libc::SIGCONT);
        if !within {
            continue;
        }
        std::thread::sleep(Duration::from_millis(10));
        let peak = dev.peak().load(SeqCst);
        assert!(peak <= small, "cut {n}: the driver held {peak} bytes under a budget of {small}");
        checked += 1;
        contended += (peak > small * 3 / 4) as usize;
    }
    for r in members {
        r.sigkill();
    }
    assert!(checked >= 20, "only {checked} cuts were checked");
    assert!(contended >= checked / 2, "the budget must have been contended: {contended} of {checked} cuts");
}

/// Shrinking below what is held asks members with idle pool memory to give it back (the group's
/// pressure count, answered at each member's next driver call: here A's polling), before anyone
/// is even refused; and growing lets a refused job through at its very next request.
#[test]
fn a_shrink_makes_idle_pools_give_back_and_a_grow_lets_a_refused_job_through() {
    let dir = private_group_dir();
    // A's pool keeps the 200 MiB it freed (release threshold at max) and A keeps calling the driver.
    let mut a = member(&dir, "trim", Some("1g")).args(["init ctx 0 defpool 0 keep 0 async 200m freeasync 0 sync poll 6000 5"]).spawn();
    assert_eq!(a.wait_for("sync").rc(), 0);
    let m = file::open_existing(&file::path_for(dir.to_str().unwrap(), "trim")).unwrap().unwrap();
    assert_eq!(m.shm.used(0), 200 * MIB, "the pool keeps what was freed");
    let (ok, out) = limit(&dir, "trim", Some("150m"));
    assert!(ok && out.contains("members give back idle pool and graph memory"), "{out}");
    let t = Instant::now();
    while m.shm.used(0) > 0 && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(m.shm.used(0), 0, "A trimmed its idle pool after the shrink, with no request refused");
    // B is refused under 150 MiB, then, with no restart, granted right after a grow.
    let mut b = member(&dir, "trim", None).args(["init ctx 0 alloc 200m sleep 3000 alloc 200m"]).spawn();
    assert_eq!(b.wait_for("alloc").rc(), 2, "refused under the 150 MiB budget");
    let (ok, out) = limit(&dir, "trim", Some("1g"));
    assert!(ok, "{out}");
    assert_eq!(b.wait_for("alloc").rc(), 0, "the grow lets the refused job through at its next request");
    assert!(b.finish().success());
    a.sigkill();
}
