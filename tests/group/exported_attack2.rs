//! Second attack on issue 23 (exported fds kept charged while an fd or an import lives; the
//! `fcntl` interposer; keeper spans; re-imports). Each test failed on the branch it was written
//! against (`attack23c`, whose interposer narrowed an application's unlock and so left it a lock
//! over vramcap's bytes); the interposer now passes the unlock as asked and takes vramcap's own
//! one-byte locks again.
//!
//! Shape as in `exported_attack.rs`: E (a member of group `xg`, 256 MiB) makes 200 MiB shareable
//! as an fd; the fake driver's device counters shared by the processes (`FAKECUDA_SHARED_DEVICE`)
//! say what the device really holds.

use vramcap_tests::common;
use common::*;

use super::scene::{self, Scene as Setup, go};

fn setup() -> Setup {
    scene::scene()
}

/// A process on the shared fake device, with no group (preloaded unless `bare`).
fn plain(s: &Setup, bare: bool) -> Run {
    let r = scene::on_device(s, Run::client("client_linked"));
    if bare { r.bare() } else { r }
}

/// A member of group `name` (256 MiB), or the same process on the bare fake (`bare`).
fn in_group(s: &Setup, name: &str, bare: bool) -> Run {
    scene::in_group(s, name, plain(s, bare))
}


/// A new member of `xg` asks for `size`: the call's rc (2: out of memory) and its output.
fn ask(s: &Setup, size: &str) -> (i64, String) {
    let out = in_group(s, "xg", false).args([format!("init ctx 0 vmm {size} 0")]).run();
    (out.nth("vmm", 0).rc(), out.stdout)
}

/// E in `xg` exports 200 MiB, closes its only fd, releases and exits: nothing of it is left
/// anywhere (no fd, no import), so the device frees it.
fn export_and_end(s: &Setup) {
    let out = in_group(s, "xg", false).args(["init ctx 0 vmmfd 200m 0 export 0 fdclose 0 release 0"]).run();
    out.ok();
    for op in ["vmm", "export", "fdclose", "release"] {
        assert_eq!(out.nth(op, 0).rc(), 0, "{op}: {}", out.stdout);
    }
}

/// FINDING (breaks applications): a preloaded process, vramcap disabled (`VRAMCAP_DISABLE=1`) and
/// no CUDA at all, uses the commonest OFD lock: a whole-file write lock on its lock file, then the
/// matching whole-file unlock. The interposer narrows the unlock (it reads no configuration), so
/// the process keeps a write lock on bytes [2^40, 2^42) of its lock file: a second open of the
/// file (another instance of the program) can never take the lock (EAGAIN; with `F_OFD_SETLKW`
/// it waits forever). Without vramcap the lock is free again.
#[test]
fn attack2_a_disabled_process_cannot_release_its_own_whole_file_lock() {
    let s = setup();
    let file = s.dir.join("app.lock");
    let ops = format!("ofdcycle {}", file.display());
    let bare = Run::client("client_linked").bare().args([ops.clone()]).run();
    assert_eq!(bare.nth("ofdcycle", 0).rc(), 0);
    assert_eq!(bare.nth("ofdcycle", 0).get("relock"), "0", "bare: the released lock can be taken again");
    let out = Run::client("client_linked").env("VRAMCAP_DISABLE", "1").args([ops]).run();
    assert_eq!(out.nth("ofdcycle", 0).rc(), 0);
    assert_eq!(out.nth("ofdcycle", 0).get("relock"), "0", "preloaded: the application's released lock is still held: {}", out.stdout);
}

/// FINDING (false denial, machine-wide): the lock the narrowed unlock leaves behind starts at
/// 2^40 and covers every id byte, and the sweep counts any lock starting at or past 2^40, on any
/// file, as an import or fd of every group's allocation whose byte it covers. So one innocent
/// process (no group, vramcap disabled, no CUDA) that locks and unlocks its lock file the usual way
/// and keeps it open pins every group's ended exports on the machine: `xg`'s 200 MiB, which no
/// fd and no import reaches any more and the device has freed, stay charged.
#[test]
fn attack2_an_unrelated_lock_file_keeps_every_groups_ended_exports() {
    // Control: without the lock file, xg gets its 200 MiB back.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    export_and_end(&s);
    assert_eq!(dev.held(), 0, "the device freed the memory");
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 0, "control: xg gets its memory back: {out}");

    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let file = s.dir.join("app.lock");
    let mut h = Run::client("client_linked")
        .env("VRAMCAP_DISABLE", "1")
        .args([format!("ofdcycle {} waitfifo {}", file.display(), s.go1.display())])
        .spawn();
    assert_eq!(h.wait_for("ofdcycle").rc(), 0);
    export_and_end(&s);
    let held = dev.held();
    let (rc, out) = ask(&s, "250m");
    go(&s.go1);
    h.finish();
    assert_eq!(held, 0, "the device freed the memory");
    assert_eq!(rc, 0, "xg refused 250 MiB of 256 while the device holds nothing of it (an unrelated process's lock file keeps it): {out}");
}
