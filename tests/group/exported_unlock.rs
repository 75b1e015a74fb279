//! A holder of an exported fd unlocks the whole file (issue 23): vramcap's lock on byte
//! `LOCK_BASE + id` of the exported description is how the group sees that a copy of the fd is
//! still open after its exporter ended. An `F_OFD_SETLK F_UNLCK` over the whole file would remove
//! it while the fd stays open (importable): the group would give the memory back. In a preloaded
//! process the unlock is narrowed (`intercept::fcntl`) and leaves vramcap's bytes locked.
//!
//! The fake driver keeps its own record of open exported fds in an OFD lock on byte 0 of the
//! exported description (a real driver keeps the memory alive while the fd is open, lock or not),
//! so the unlocks here start at byte 3: past the fake's bytes 0 to 2, over everything else,
//! vramcap's bytes included.

use vramcap_tests::common;
use common::*;

use super::scene::{self, Scene as Setup, go};

fn setup() -> Setup {
    scene::scene()
}

/// A member of group `xg` (256 MiB), or the same process on the bare fake (`bare`).
fn member(s: &Setup, bare: bool) -> Run {
    let r = scene::in_group(s, "xg", Run::client("client_linked"));
    if bare { r.bare() } else { r }
}


/// The exporter: 200 MiB exported as an fd, the whole file unlocked (from byte 3), the fd sent to
/// a holder that unlocks it too and just holds it; the exporter releases and exits. Returns the
/// holder, still holding the fd, and both unlocks' lines.
fn unlocked_and_held(s: &Setup, bare: bool) -> (Running, Line, Line) {
    let ops = format!("fdlisten {} fdrecv fdunlock 0 3 fdack waitfifo {} fdclose 0", s.sock.display(), s.go1.display());
    let mut holder = member(s, bare).args([ops]).spawn();
    assert_eq!(holder.wait_for("fdlisten").rc(), 0);
    let ops = format!("init ctx 0 vmmfd 200m 0 export 0 fdunlock 0 3 fdsend 0 {} release 0", s.sock.display());
    let out = member(s, bare).args([ops]).run();
    out.ok();
    for op in ["vmm", "export", "fdsend", "release"] {
        assert_eq!(out.nth(op, 0).rc(), 0, "{op}: {}", out.stdout);
    }
    let theirs = holder.wait_for("fdunlock");
    (holder, out.nth("fdunlock", 0).clone(), theirs)
}

#[test]
fn unlocking_the_exported_fd_keeps_its_memory_charged_while_a_holder_keeps_the_fd() {
    // Bare: the held fd keeps the 200 MiB on the device after the exporter is gone.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let (holder, mine, theirs) = unlocked_and_held(&s, true);
    for l in [&mine, &theirs] {
        assert_eq!((l.rc(), l.num("app"), l.num("kept")), (0, 0, 0), "bare: the unlock removes every lock it covers: {l:?}");
    }
    assert_eq!(dev.held(), 200 * MIB, "bare: the held fd keeps the exporter's memory");
    go(&s.go1);
    holder.finish();

    // In the group: both unlocks remove the application's own lock and leave vramcap's, so a
    // third member's 250 MiB is past the 256 MiB budget while the fd is held; once the holder
    // closed it, 250 MiB fit.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let (holder, mine, theirs) = unlocked_and_held(&s, false);
    for l in [&mine, &theirs] {
        assert_eq!((l.rc(), l.num("app")), (0, 0), "the application's own lock is unlocked: {l:?}");
        assert_eq!(l.num("kept"), 1, "vramcap's export lock is left: {l:?}");
    }
    let out = member(&s, false).args(["init ctx 0 vmm 250m 0"]).run();
    let (rc, held) = (out.nth("vmm", 0).rc(), dev.held());
    go(&s.go1);
    holder.finish();
    assert_eq!(rc, 2, "granted 250 MiB while the device holds {} MiB of the group's (budget 256)", held / MIB);
    let out = member(&s, false).args(["init ctx 0 vmm 250m 0"]).run();
    assert_eq!(out.nth("vmm", 0).rc(), 0, "the fd is closed: the memory is the group's no longer: {}", out.stdout);
}
