//! Issue 25 (tenants, third review): a reserve a higher priority borrowed goes back to its
//! lender; the headroom's "+1" job fits whatever the start order; the ceiling file's sharing
//! settings and limits cannot be changed from the environment in any spelling; a member
//! retrying an over-budget request does not keep its neighbours trimming.

use super::group_policy::{member, touch};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::*;
use std::time::Duration;
use vramcap_common::group_ledger::file;
use vramcap_tests::common::*;

fn ledger(dir: &Path, name: &str) -> file::Mapping {
    file::open_existing(&file::path_for(dir.to_str().unwrap(), name)).unwrap().expect("ledger exists")
}

fn go(dir: &Path, n: &str) -> PathBuf {
    dir.join(format!("go-{n}"))
}

/// Item 1: L (priority 0, reserve 600 MiB) holds nothing; H (priority 10) takes the whole 1 GiB
/// (600 MiB of it L's unmet reserve) and frees it; M (priority 0, no reserve) is then refused
/// L's 600 MiB, and L gets them. Control: with H gone before anything was borrowed the same M
/// and L get the same answers.
#[test]
fn a_reserve_a_higher_priority_borrowed_goes_back_to_its_member_not_to_an_equal_one() {
    for borrow in [true, false] {
        let dir = private_group_dir();
        let base = [("VRAMCAP_GROUP_LIMIT", "1g"), ("VRAMCAP_GROUP_POLICY", "priority")];
        let mut l = member(&dir, "loan", &[base[0], base[1], ("VRAMCAP_GROUP_RESERVE", "600m")])
            .args([format!("init ctx 0 waitfile {} alloc 600m sleep 60000", go(&dir, "l").display())])
            .spawn();
        std::thread::sleep(Duration::from_millis(300));
        let h_script = if borrow { "init ctx 0 alloc 1g free 0" } else { "init ctx 0 alloc 424m free 0" };
        let out = member(&dir, "loan", &[("VRAMCAP_PRIORITY", "10")]).args([h_script]).run();
        assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
        let m = ledger(&dir, "loan");
        assert_eq!((m.shm.used(0), m.shm.devices[0].held.load(SeqCst)), (0, 600 * MIB), "borrow={borrow}: L's reserve is back");
        let out = member(&dir, "loan", &[]).args(["init ctx 0 alloc 1g alloc 424m"]).run();
        assert_ne!(out.nth("alloc", 0).rc(), 0, "borrow={borrow}: an equal priority took L's reserve: {}", out.stderr);
        assert_eq!(out.nth("alloc", 1).rc(), 0, "{}", out.stderr);
        assert!(out.stderr.contains(&format!("600.0 MiB (pid {} \"client_linked\")", l.pid())), "{}", out.stderr);
        touch(&go(&dir, "l"));
        assert_eq!(l.wait_for("alloc").rc(), 0, "borrow={borrow}: L gets its reserve");
        l.sigkill();
    }
}

/// Item 2: the documented headroom example scaled down (240 MiB headroom, 1200 MiB budget, four
/// 240 MiB jobs started one after another): the fifth fits, a sixth does not; once the fifth is
/// gone, a restart of a job whose predecessor still holds its memory fits too.
#[test]
fn the_plus_one_job_fits_after_four_jobs_started_one_after_another() {
    let dir = private_group_dir();
    let env = [("VRAMCAP_GROUP_LIMIT", "1200m"), ("VRAMCAP_GROUP_HEADROOM", "240m")];
    let job = |env: &[(&str, &str)]| {
        let mut r = member(&dir, "plus1", env).args(["init ctx 0 alloc 240m sleep 60000"]).spawn();
        let rc = r.wait_for("alloc").rc();
        (r, rc)
    };
    let mut jobs = Vec::new();
    for k in 0..4 {
        let (r, rc) = job(&env);
        assert_eq!(rc, 0, "job {k}");
        jobs.push(r);
    }
    let (fifth, rc) = job(&[]);
    assert_eq!(rc, 0, "the fifth job fits in the headroom");
    let out = member(&dir, "plus1", &[]).args(["init ctx 0 alloc 1m"]).run();
    assert_ne!(out.nth("alloc", 0).rc(), 0, "a sixth does not: {}", out.stderr);
    fifth.sigkill();
    // A restart of job 3 while job 3 still holds its memory (it is draining).
    let (restart, rc) = job(&[]);
    assert_eq!(rc, 0, "the restart fits");
    let m = ledger(&dir, "plus1");
    assert_eq!(m.shm.used(0), 1200 * MIB);
    restart.sigkill();
    for j in jobs {
        j.sigkill();
    }
}
