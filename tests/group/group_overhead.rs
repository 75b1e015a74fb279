//! A group's budget counts what the GPU counts (issue 24): every member's context (and modules)
//! in it, members in PID namespaces of their own included, whether or not they can see their
//! pid as the host (and NVML) knows it. The fake driver's shared device counter is the GPU: its
//! peak never passes the group's budget.

use vramcap_tests::common;
use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

/// The shared device file's (held, peak) on device 0.
fn device(path: &Path) -> (u64, u64) {
    let b = std::fs::read(path).unwrap();
    let word = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
    (word(0), word(1))
}

fn member(dir: &Path, devfile: &Path, own_proc: bool, limit: Option<&str>, ops: &str) -> Run {
    let r = in_pid_namespace("client_linked", own_proc, ops)
        .env("VRAMCAP_GROUP", "ovh")
        .env("VRAMCAP_GROUP_DIR", dir)
        .env("FAKECUDA_CTX_BYTES", "300m")
        .env("FAKECUDA_SHARED_DEVICE", devfile);
    match limit {
        Some(l) => r.env("VRAMCAP_GROUP_LIMIT", l),
        None => r,
    }
}

/// A member of group `group` (limit `limit`) in this PID namespace, contexts of 300 MiB.
fn starter(dir: &Path, devfile: &Path, group: &str, limit: &str, ops: &str) -> Run {
    Run::client("client_linked")
        .env("VRAMCAP_GROUP", group)
        .env("VRAMCAP_GROUP_DIR", dir)
        .env("VRAMCAP_GROUP_LIMIT", limit)
        .env("FAKECUDA_CTX_BYTES", "300m")
        .env("FAKECUDA_SHARED_DEVICE", devfile)
        .args([ops])
}

#[test]
fn every_members_context_counts_in_the_group_and_the_device_never_passes_the_budget() {
    if !can_unshare() {
        eprintln!("SKIPPED: needs root and PID namespaces");
        return;
    }
    // With the host's /proc (NVML's per-process entry under the host pid) and with one of its
    // own (the host pid unknown: NVML's device memory instead).
    for own_proc in [false, true] {
        let dir = private_group_dir();
        let devfile = dir.join("device");
        // A: its context (300 MiB) and 400 MiB; NVML lists it with both.
        let mut a = member(&dir, &devfile, own_proc, Some("1g"), "init ctx 0 alloc 400m procs 0 sleep 60000").spawn();
        assert_eq!(a.wait_for("alloc").rc(), 0);
        let procs = a.wait_for("procs");
        if !own_proc {
            assert_eq!(procs.num("self"), 700 * MIB, "NVML names A by its host pid, context included");
        }
        // B: its context is reserved before it is made (the size A measured), and counted.
        let mut b = member(&dir, &devfile, own_proc, None, "init ctx 0 info alloc 24m alloc 1m sleep 60000").spawn();
        assert_eq!(b.wait_for("ctx").rc(), 0);
        assert_eq!(b.wait_for("info").num("free"), 24 * MIB, "the group's budget less two contexts and A's 400 MiB");
        assert_eq!(b.wait_for("alloc").rc(), 0);
        assert_eq!(b.wait_for("alloc").rc(), 2, "the budget is full");
        // C: a third context cannot fit: refused before the driver makes it.
        let out = member(&dir, &devfile, own_proc, None, "init ctx 0 stats 0").run();
        assert_eq!(out.nth("ctx", 0).rc(), 2, "{}{}", out.stdout, out.stderr);
        let (held, peak) = device(&devfile);
        assert!(peak <= GIB, "own /proc {own_proc}: the device held {peak} past the group's 1 GiB");
        assert_eq!(held, GIB, "A and B: two contexts, 424 MiB");
        a.sigkill();
        b.sigkill();
    }
}

/// `nvidia-smi` in a preloaded container: a tool that never starts CUDA is shown the group's
/// budget and what the group's jobs hold (their contexts included), read from the ledger without
/// joining it and without initialising CUDA.
#[test]
fn a_tool_that_never_starts_cuda_sees_what_the_group_holds() {
    let dir = private_group_dir();
    let job = Run::client("client_linked")
        .env("VRAMCAP_GROUP", "tool")
        .env("VRAMCAP_GROUP_DIR", &dir)
        .env("VRAMCAP_GROUP_LIMIT", "2g")
        .env("FAKECUDA_CTX_BYTES", "300m");
    let mut a = job.args(["init ctx 0 alloc 600m sleep 60000"]).spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let m = vramcap_common::group_ledger::file::open_existing(&vramcap_common::group_ledger::file::path_for(dir.to_str().unwrap(), "tool"))
        .unwrap()
        .unwrap();
    let members = || m.shm.header.members.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(members(), 1);
    for limit in [None, Some("2g")] {
        let mut tool = Run::client("client_nvml").env("VRAMCAP_GROUP", "tool").env("VRAMCAP_GROUP_DIR", &dir);
        if let Some(l) = limit {
            tool = tool.env("VRAMCAP_GROUP_LIMIT", l);
        }
        let out = tool.args(["nvml 0 nvml2 0 cucount"]).run();
        out.ok();
        assert_eq!(out.nth("cucount", 0).rc(), 3, "CUDA was initialised: {}", out.stderr);
        for i in 0..2 {
            let n = out.nth("nvml", i);
            assert_eq!((n.num("total"), n.num("used"), n.num("free")), (2 * GIB, 900 * MIB, 2 * GIB - 900 * MIB), "{limit:?}: {}", out.stdout);
        }
        assert_eq!(members(), 1, "the tool did not join the group");
    }
    a.sigkill();
}

/// Members starting together before any of them measured a context (issue 24): none knows what a
/// context costs, so none can reserve it. The group's first context is measured by one member at
/// a time, and the others reserve the size it measured, so the device never holds more than the
/// budget, not even while contexts are being made (each takes 400 ms to make here, as a real
/// driver takes a while; the members start within that).
#[test]
fn members_starting_together_never_hold_unmeasured_contexts_past_the_budget() {
    let dir = private_group_dir();
    let devfile = dir.join("device");
    // 700 MiB: two 300 MiB contexts fit, a third does not.
    let mut members: Vec<Running> = (0..4)
        .map(|_| starter(&dir, &devfile, "first", "700m", "init ctx 0 sleep 60000").env("FAKECUDA_CTX_DELAY_US", "400000").spawn())
        .collect();
    let rcs: Vec<i64> = members.iter_mut().map(|m| m.wait_for("ctx").rc()).collect();
    let (held, peak) = device(&devfile);
    assert!(peak <= 700 * MIB, "the device held {} MiB past the group's 700 MiB: {rcs:?}", peak / MIB);
    assert_eq!(rcs.iter().filter(|&&rc| rc == 0).count(), 2, "two contexts fit: {rcs:?}");
    assert_eq!(rcs.iter().filter(|&&rc| rc == 2).count(), 2, "the others are refused with out of memory: {rcs:?}");
    assert_eq!(held, 600 * MIB);
    members.into_iter().for_each(Running::sigkill);
}

/// Members that use green contexts only (`cuGreenCtxCreate` makes the primary context): the
/// first create takes the first-context lease and notes what it measured (primary and green
/// together) before giving it back; the next member reserves that before its create. Before the
/// fix the green path noted no size, and the next member made its primary context unreserved,
/// past the budget until measured and refused.
#[test]
fn members_starting_together_with_green_contexts_never_hold_unmeasured_contexts_past_the_budget() {
    let dir = private_group_dir();
    let devfile = dir.join("device");
    // 700 MiB: one member (300 MiB primary + 75 MiB green) fits, a second does not.
    let mut members: Vec<Running> = (0..3)
        .map(|_| starter(&dir, &devfile, "green-first", "700m", "init green 0 sleep 60000").env("FAKECUDA_CTX_DELAY_US", "400000").spawn())
        .collect();
    let rcs: Vec<i64> = members.iter_mut().map(|m| m.wait_for("green").rc()).collect();
    let (_, peak) = device(&devfile);
    members.into_iter().for_each(Running::sigkill);
    assert_eq!(rcs.iter().filter(|&&rc| rc == 0).count(), 1, "{rcs:?}");
    assert!(peak <= 700 * MIB, "the device held {} MiB past the group's 700 MiB: {rcs:?}", peak / MIB);
}

/// Members in PID namespaces with their own `/proc` read NVML's device memory (their host pid is
/// unknown), which other members move. A member must read the books only after it waited for the
/// first-context lease: read before, the context the holder made meanwhile landed in its reading
/// and was charged as its own (two contexts: the second member was refused though two 300 MiB
/// contexts fit 700 MiB). `FAKECUDA_CTX_SETUP_US`: a driver that sets a context up before its
/// memory is taken, as a real one initialises for a while and takes memory as it goes.
#[test]
fn a_member_waiting_for_the_first_context_lease_is_not_charged_the_holders_context() {
    if !can_unshare() {
        eprintln!("SKIPPED: needs root and PID namespaces");
        return;
    }
    let dir = private_group_dir();
    let devfile = dir.join("device");
    let member = || {
        in_pid_namespace("client_linked", true, "init ctx 0 info sleep 60000")
            .env("VRAMCAP_GROUP", "wait")
            .env("VRAMCAP_GROUP_DIR", &dir)
            .env("VRAMCAP_GROUP_LIMIT", "700m")
            .env("FAKECUDA_CTX_BYTES", "300m")
            .env("FAKECUDA_CTX_SETUP_US", "400000")
            .env("FAKECUDA_SHARED_DEVICE", &devfile)
            // NVML's device memory is the whole device's (the fake's default is this process's).
            .env("FAKENVML_DEVICE_WIDE", "1")
            .spawn()
    };
    // B starts while A holds the lease and is setting its context up: B reads the books before
    // A's context is in them, then waits for A's size.
    let mut a = member();
    std::thread::sleep(Duration::from_millis(150));
    let mut b = member();
    let (ra, rb) = (a.wait_for("ctx").rc(), b.wait_for("ctx").rc());
    let (held, peak) = device(&devfile);
    a.sigkill();
    b.sigkill();
    assert!(peak <= 700 * MIB, "peak {} MiB", peak / MIB);
    assert_eq!((ra, rb), (0, 0), "two 300 MiB contexts fit a 700 MiB budget (device held {} MiB)", held / MIB);
}

/// The holder of the first-context lease killed in the middle of making its context: a member
/// waiting for the lease goes on once the holder is found dead (its slot reclaimed), well before
/// the 10 s patience.
#[test]
fn a_lease_holder_killed_mid_creation_does_not_hold_up_the_others() {
    let dir = private_group_dir();
    let devfile = dir.join("device");
    let member = |delay: &str| starter(&dir, &devfile, "killed", "2g", "init ctx 0 sleep 60000").env("FAKECUDA_CTX_DELAY_US", delay).spawn();
    let mut a = member("20000000");
    a.wait_for("init");
    std::thread::sleep(Duration::from_millis(300));
    let mut b = member("0");
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    a.sigkill();
    let rc = b.wait_for("ctx").rc();
    let took = t.elapsed();
    b.sigkill();
    assert_eq!(rc, 0);
    // Found dead by the once-a-second sweep; the patience (10 s) is far longer.
    assert!(took < Duration::from_secs(8), "the waiter went on {took:?} after the holder died");
}
