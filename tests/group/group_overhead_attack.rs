//! Attacks on issue 24 in a group (reviewer's tests, branch attack24): the first-context lease
//! and the measurement of members' contexts.

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

/// Members that use green contexts only (`cuGreenCtxCreate` makes the primary context): each
/// create takes the first-context lease, but gives it back without noting any size (the green
/// path charges the primary context as the green context's own, never `note_context`), so the
/// next member makes its primary context unreserved too, and the device holds it past the
/// budget until it is measured and refused. The same members with `ctx 0` pass
/// (`group_overhead::members_starting_together_never_hold_unmeasured_contexts_past_the_budget`).
#[test]
fn members_starting_together_with_green_contexts_never_hold_unmeasured_contexts_past_the_budget() {
    let dir = private_group_dir();
    let devfile = dir.join("device");
    // 700 MiB: one member (300 MiB primary + 75 MiB green) fits, a second does not.
    let mut members: Vec<Running> = (0..3)
        .map(|_| {
            Run::client("client_linked")
                .env("VRAMCAP_GROUP", "green-first")
                .env("VRAMCAP_GROUP_DIR", &dir)
                .env("VRAMCAP_GROUP_LIMIT", "700m")
                .env("FAKECUDA_CTX_BYTES", "300m")
                .env("FAKECUDA_CTX_DELAY_US", "400000")
                .env("FAKECUDA_SHARED_DEVICE", &devfile)
                .args(["init green 0 sleep 60000"])
                .spawn()
        })
        .collect();
    let rcs: Vec<i64> = members.iter_mut().map(|m| m.wait_for("green").rc()).collect();
    let (_, peak) = device(&devfile);
    members.into_iter().for_each(Running::sigkill);
    assert_eq!(rcs.iter().filter(|&&rc| rc == 0).count(), 1, "{rcs:?}");
    assert!(peak <= 700 * MIB, "the device held {} MiB past the group's 700 MiB: {rcs:?}", peak / MIB);
}

/// Members in PID namespaces with their own `/proc` read NVML's device memory (their host pid is
/// unknown). A member reads the books *before* it waits for the first-context lease
/// (`context::begin_context`: the probe, then `reserve_context`), so the context the lease holder
/// makes meanwhile lands in its reading and is charged as its own: each waiter is charged two
/// contexts. Two 300 MiB contexts fit 700 MiB; the second member is refused. The fake's
/// `FAKECUDA_CTX_SETUP_US` (added on attack24): a driver that sets a context up before its memory
/// is taken, as a real one initialises for 100s of ms and takes memory as it goes.
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
    let member = |delay: &str| {
        Run::client("client_linked")
            .env("VRAMCAP_GROUP", "killed")
            .env("VRAMCAP_GROUP_DIR", &dir)
            .env("VRAMCAP_GROUP_LIMIT", "2g")
            .env("FAKECUDA_CTX_BYTES", "300m")
            .env("FAKECUDA_CTX_DELAY_US", delay)
            .env("FAKECUDA_SHARED_DEVICE", &devfile)
            .args(["init ctx 0 sleep 60000"])
            .spawn()
    };
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
    assert!(took < Duration::from_secs(4), "the waiter went on {took:?} after the holder died");
}
