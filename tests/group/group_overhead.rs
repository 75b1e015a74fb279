//! A group's budget counts what the GPU counts (issue 24): every member's context (and modules)
//! in it, members in PID namespaces of their own included, whether or not they can see their
//! pid as the host (and NVML) knows it. The fake driver's shared device counter is the GPU: its
//! peak never passes the group's budget.

use vramcap_tests::common;
use common::*;
use std::path::Path;

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
        .map(|_| {
            Run::client("client_linked")
                .env("VRAMCAP_GROUP", "first")
                .env("VRAMCAP_GROUP_DIR", &dir)
                .env("VRAMCAP_GROUP_LIMIT", "700m")
                .env("FAKECUDA_CTX_BYTES", "300m")
                .env("FAKECUDA_CTX_DELAY_US", "400000")
                .env("FAKECUDA_SHARED_DEVICE", &devfile)
                .args(["init ctx 0 sleep 60000"])
                .spawn()
        })
        .collect();
    let rcs: Vec<i64> = members.iter_mut().map(|m| m.wait_for("ctx").rc()).collect();
    let (held, peak) = device(&devfile);
    assert!(peak <= 700 * MIB, "the device held {} MiB past the group's 700 MiB: {rcs:?}", peak / MIB);
    assert_eq!(rcs.iter().filter(|&&rc| rc == 0).count(), 2, "two contexts fit: {rcs:?}");
    assert_eq!(rcs.iter().filter(|&&rc| rc == 2).count(), 2, "the others are refused with out of memory: {rcs:?}");
    assert_eq!(held, 600 * MIB);
    members.into_iter().for_each(Running::sigkill);
}
