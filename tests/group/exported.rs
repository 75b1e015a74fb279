//! VMM memory exported as a file descriptor to another member of the group (issue 23, item 11):
//! `cuMemExportToShareableHandle` (POSIX fd), the fd sent over a unix socket (SCM_RIGHTS),
//! `cuMemImportFromShareableHandle` and a mapping in the importer, then the exporter releases its
//! handle and exits. The importer's mapping keeps the memory alive, so the group must keep it
//! charged until the importer lets it go; the fake driver's device counters shared by the
//! processes (`FAKECUDA_SHARED_DEVICE`) show what the GPU really held.

use vramcap_tests::common;
use common::*;
use std::path::Path;

const BUDGET: u64 = 256 * MIB;

use super::scene::{self, Scene as Setup, go};

fn setup() -> Setup {
    scene::scene()
}

/// `r` in group `xg` (256 MiB), on the fake device the test's processes share.
fn in_group(s: &Setup, r: Run) -> Run {
    scene::in_group(s, "xg", r)
}

/// A member of group `xg`, or the same process on the bare fake (`bare`).
fn member(s: &Setup, bare: bool) -> Run {
    let r = in_group(s, Run::client("client_linked"));
    if bare { r.bare() } else { r }
}

/// Starts the importer: it receives the fd, imports and maps 200 MiB, answers, closes the fd and
/// waits for the test's go (the FIFO) before asking for 200 MiB more of its own, then unmaps and
/// releases the import and asks again.
fn importer(s: &Setup, bare: bool) -> Running {
    let ops = format!(
        "init ctx 0 fdlisten {} fdrecv import 0 vamap 0 200m fdclose 0 fdack waitfifo {} \
         vmm 200m 0 vaunmap 0 release 0 vmm 200m 0 info",
        s.sock.display(),
        s.go1.display()
    );
    let mut r = member(s, bare).args([ops]).spawn();
    assert_eq!(r.wait_for("fdlisten").rc(), 0);
    r
}

/// The exporter: 200 MiB shareable as an fd, exported, sent (it waits for the importer's answer),
/// released; then it exits.
fn export(s: &Setup, bare: bool) {
    let out = member(s, bare).args([format!("init ctx 0 vmmfd 200m 0 export 0 fdsend 0 {} release 0", s.sock.display())]).run();
    out.ok();
    for op in ["vmm", "export", "fdsend", "release"] {
        assert_eq!(out.nth(op, 0).rc(), 0, "{op}: {}", out.stdout);
    }
}

/// A new member of the group asks for `size` of VMM memory: the call's rc and its output.
fn ask(s: &Setup, size: &str) -> (i64, String) {
    let out = member(s, false).args([format!("init ctx 0 vmm {size} 0")]).run();
    (out.nth("vmm", 0).rc(), out.stdout)
}


#[test]
fn exported_memory_stays_charged_to_the_group_after_its_exporter_exits() {
    // Bare: the memory outlives the exporter (the device still holds it after the exporter is
    // gone) and goes with the importer's last reference; nothing refuses the second 200 MiB.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let mut imp = importer(&s, true);
    export(&s, true);
    assert_eq!(dev.held(), 200 * MIB, "bare: the importer's mapping keeps the exporter's memory");
    go(&s.go1);
    assert_eq!(imp.wait_for("vmm").rc(), 0);
    assert_eq!(imp.wait_for("release").rc(), 0);
    assert_eq!(imp.wait_for("vmm").rc(), 0);
    imp.finish();
    assert_eq!(dev.peak().load(std::sync::atomic::Ordering::SeqCst), 400 * MIB, "bare: both on the device at once");

    // In the group: the exported 200 MiB stay the group's after the exporter exits, so 200 MiB
    // more is refused; once the importer unmapped and released it, 200 MiB fit again.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let mut imp = importer(&s, false);
    export(&s, false);
    go(&s.go1);
    assert_eq!(imp.wait_for("vmm").rc(), 2, "the group holds the exported memory: 200 MiB more is past 256");
    assert_eq!(imp.wait_for("vaunmap").rc(), 0);
    assert_eq!(imp.wait_for("release").rc(), 0);
    assert_eq!(imp.wait_for("vmm").rc(), 0, "the memory came back with the import: no lasting false out-of-memory");
    let info = imp.wait_for("info");
    assert_eq!(info.num("free"), BUDGET - 200 * MIB, "charged once");
    imp.finish();
    let peak = dev.peak().load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= BUDGET, "the device held {peak} bytes under a group budget of {BUDGET}");
}

#[test]
fn a_killed_importer_gives_the_exported_memory_back() {
    let s = setup();
    let imp = importer(&s, false);
    export(&s, false);
    // The importer dies holding the mapping: the driver frees the memory with it.
    imp.sigkill();
    let out = member(&s, false).args(["init ctx 0 vmm 200m 0 info"]).run();
    out.ok();
    assert_eq!(out.nth("vmm", 0).rc(), 0, "nothing holds it any more: {}", out.stdout);
}

#[test]
fn both_members_alive_count_the_shared_memory_once() {
    // While the exporter still runs, its charge is the memory; the importer's mapping adds nothing.
    let s = setup();
    let exporter_go = scene::fifo(&s.dir, "go2");
    let mut imp = importer(&s, false);
    let ops = format!("init ctx 0 vmmfd 200m 0 export 0 fdsend 0 {} release 0 waitfifo {}", s.sock.display(), exporter_go.display());
    let exp = member(&s, false).args([ops]).spawn();
    imp.wait_for("fdack");
    // Both alive: 200 MiB of 256 held; 200 more does not fit, 40 does.
    let out = member(&s, false).args(["init ctx 0 vmm 200m 0 vmm 40m 0"]).run();
    assert_eq!(out.of("vmm").iter().map(|l| l.rc()).collect::<Vec<_>>(), vec![2, 0], "{}", out.stdout);
    // The exporter ends first, then the importer goes on: the memory is still the group's.
    go(&exporter_go);
    exp.finish();
    go(&s.go1);
    assert_eq!(imp.wait_for("vmm").rc(), 2);
    assert_eq!(imp.wait_for("vmm").rc(), 0);
    imp.finish();
}

#[test]
fn an_export_closed_in_its_own_process_leaves_no_charge_behind() {
    // One process: export, release, close the fd, exit. Bare, the memory is gone at the close.
    let s = setup();
    let plain = member(&s, true).args(["init ctx 0 vmmfd 200m 0 export 0 release 0 info fdclose 0 info"]).run();
    plain.ok();
    assert_eq!(plain.nth("info", 0).num("free") + 200 * MIB, plain.nth("info", 1).num("free"), "bare: {}", plain.stdout);
    let out = member(&s, false).args(["init ctx 0 vmmfd 200m 0 export 0 release 0 fdclose 0"]).run();
    out.ok();
    // The next member gets the whole budget: nothing of the export stayed the group's.
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 0, "{}", out);
}

/// vramcap never closes the application's fd: an `atexit` handler the application registered
/// before its first export (so it runs after any vramcap registered at the export) still finds
/// the exported fd open.
#[test]
fn the_exported_fd_stays_open_for_the_applications_own_atexit_handlers() {
    let s = setup();
    let out = member(&s, false).args(["init ctx 0 exitfd 0 vmmfd 200m 0 export 0 release 0"]).run();
    out.ok();
    assert_eq!(out.nth("exitfd", 1).rc(), 0, "the application's fd was closed under it: {}", out.stdout);
}

/// Starts a member that receives the fd and answers, but imports it only when the test says go:
/// until then the fd is held by a process that has not imported it (the exporter ends meanwhile).
/// Then it imports and maps the 200 MiB, closes the fd and asks for 200 MiB of its own.
fn late_importer(s: &Setup, bare: bool) -> Running {
    let ops = format!(
        "init ctx 0 fdlisten {} fdrecv fdack waitfifo {} import 0 vamap 0 200m fdclose 0 vmm 200m 0 info",
        s.sock.display(),
        s.go1.display()
    );
    let mut r = member(s, bare).args([ops]).spawn();
    assert_eq!(r.wait_for("fdlisten").rc(), 0);
    r
}

/// A member asking for 100 MiB while the exporter's 200 MiB live on in an fd (it reclaims the
/// ended exporter first): 300 MiB is past the budget.
fn third_member_is_refused(s: &Setup) {
    let out = member(s, false).args(["init ctx 0 vmm 100m 0"]).run();
    assert_eq!(out.nth("vmm", 0).rc(), 2, "the ended exporter's memory lives on in the fd: {}", out.stdout);
}

/// The exporter ends while the only fd of its export is held by a member that has not imported
/// it: nobody holds an import, yet the memory lives (the fd keeps it) and is imported afterwards.
/// It must stay the group's: 200 MiB more is past the 256 MiB budget.
#[test]
fn an_fd_not_yet_imported_when_its_exporter_ends_stays_charged() {
    // Bare: the fd alone keeps the memory on the device after the exporter is gone; the import
    // and 200 MiB more put 400 MiB on it.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let mut imp = late_importer(&s, true);
    export(&s, true);
    assert_eq!(dev.held(), 200 * MIB, "bare: the fd in the importer keeps the exported memory");
    go(&s.go1);
    assert_eq!(imp.wait_for("import").rc(), 0);
    assert_eq!(imp.wait_for("vmm").rc(), 0);
    imp.finish();
    assert_eq!(dev.peak().load(std::sync::atomic::Ordering::SeqCst), 400 * MIB, "bare: both on the device at once");

    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let mut imp = late_importer(&s, false);
    export(&s, false);
    // Another member needs the budget before the import: it finds the exporter gone.
    third_member_is_refused(&s);
    go(&s.go1);
    assert_eq!(imp.wait_for("import").rc(), 0);
    assert_eq!(imp.wait_for("vamap").rc(), 0);
    assert_eq!(imp.wait_for("vmm").rc(), 2, "the exported memory is still the group's: 200 MiB more is past 256");
    imp.finish();
    let peak = dev.peak().load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= BUDGET, "the device held {peak} bytes under a group budget of {BUDGET}");
}

/// The same with an exporter killed after sending: what it exported stays the group's while the fd
/// lives and its import is held, and comes back once both are gone (not kept for good).
#[test]
fn a_killed_exporter_keeps_its_exports_charged() {
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let mut imp = late_importer(&s, false);
    let hold = scene::fifo(&s.dir, "hold");
    let ops = format!("init ctx 0 vmmfd 200m 0 export 0 fdsend 0 {} release 0 waitfifo {}", s.sock.display(), hold.display());
    let mut exp = member(&s, false).args([ops]).spawn();
    assert_eq!(exp.wait_for("release").rc(), 0);
    exp.sigkill();
    third_member_is_refused(&s);
    go(&s.go1);
    assert_eq!(imp.wait_for("import").rc(), 0);
    assert_eq!(imp.wait_for("vamap").rc(), 0);
    assert_eq!(imp.wait_for("vmm").rc(), 2, "the killed exporter's memory is still the group's");
    imp.finish();
    let peak = dev.peak().load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= BUDGET, "the device held {peak} bytes under a group budget of {BUDGET}");
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 0, "no fd and no import of it is left: the group gave it back: {}", out);
}

/// A process outside CUDA that receives the fd and holds it without importing it, closes it when
/// the test says go, and then waits for `hold` before it exits.
fn receiver(s: &Setup, hold: &Path) -> Running {
    assert!(std::process::Command::new("mkfifo").arg(hold).status().unwrap().success());
    let ops = format!("fdlisten {} fdrecv fdack waitfifo {} fdclose 0 waitfifo {}", s.sock.display(), s.go1.display(), hold.display());
    let mut r = member(s, false).args([ops]).spawn();
    assert_eq!(r.wait_for("fdlisten").rc(), 0);
    r
}

/// Starts a [`receiver`], and an exporter of 200 MiB that sends it the fd, releases its handle and
/// is killed: the only fd of the export is then the receiver's, not imported.
fn killed_exporter_sent_to_receiver(s: &Setup, hold: &Path) -> Running {
    let rx = receiver(s, hold);
    let stop = scene::fifo(&s.dir, "stop");
    let ops = format!("init ctx 0 vmmfd 200m 0 export 0 fdsend 0 {} release 0 waitfifo {}", s.sock.display(), stop.display());
    let mut exp = member(s, false).args([ops]).spawn();
    assert_eq!(exp.wait_for("release").rc(), 0);
    exp.sigkill();
    rx
}

/// An exporter killed while the only fd of its export sits unimported in another process: the
/// group keeps the memory while that fd is open, and gives it back when it closes, with no
/// operator and while that process still runs.
#[test]
fn a_killed_exporters_memory_comes_back_when_its_last_fd_closes() {
    let s = setup();
    let hold = s.dir.join("hold");
    let mut rx = killed_exporter_sent_to_receiver(&s, &hold);
    third_member_is_refused(&s);
    go(&s.go1);
    assert_eq!(rx.wait_for("fdclose").rc(), 0);
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 0, "its last fd closed: the group gave it back: {}", out);
    go(&hold);
    rx.finish();
}

/// An exporter that exits with its own fd still open (no copy elsewhere): the memory goes with the
/// process, and so does the group's charge.
#[test]
fn an_fd_left_open_at_exit_goes_with_its_process() {
    let s = setup();
    let out = member(&s, false).args(["init ctx 0 vmmfd 200m 0 export 0 release 0"]).run();
    out.ok();
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 0, "nothing of it is left: {}", out);
}

/// Runs `script` (sh) in a mount namespace of its own, with the group's variables, as `unshare
/// -m` (root); `None` (and a SKIPPED line) where that is not possible.
fn in_mount_namespace(s: &Setup, script: String) -> Option<Output> {
    if unsafe { libc::geteuid() } != 0 || !Path::new("/usr/bin/unshare").exists() {
        eprintln!("SKIPPED: needs root and unshare -m");
        return None;
    }
    let sh = s.dir.join("ns.sh");
    std::fs::write(&sh, script).unwrap();
    Some(in_group(s, Run::program(Path::new("unshare"))).args(["-m sh", sh.to_str().unwrap()]).run())
}

/// A sweep whose `/proc/locks` hides the locks (masked, as a container may have it) decides
/// nothing: a killed exporter's memory whose fd another process holds stays the group's.
#[test]
fn a_sweep_that_cannot_see_the_locks_gives_nothing_back() {
    let s = setup();
    let hold = s.dir.join("hold");
    let mut rx = killed_exporter_sent_to_receiver(&s, &hold);
    let limit = format!("{} limit --group xg --group-dir {}", vramcap_bin(), s.dir.display());
    if let Some(out) = in_mount_namespace(&s, format!("mount --bind /dev/null /proc/locks && exec {limit}\n")) {
        out.ok();
        assert_eq!(ask(&s, "100m").0, 2, "the fd still keeps the memory: {}", out.stdout);
    }
    go(&s.go1);
    assert_eq!(rx.wait_for("fdclose").rc(), 0);
    go(&hold);
    rx.finish();
}

/// An export vramcap cannot watch (here: its `/proc/locks` hidden by a bind mount, so its lock
/// cannot be seen) stays the group's after its exporter ends, whatever happens to its fd: `vramcap
/// limit` shows it as undecidable and `--drop-exports` gives it back.
#[test]
fn an_export_vramcap_cannot_watch_stays_until_an_operator_drops_it() {
    let s = setup();
    let client = ctests_dir().join("client_linked");
    let script = format!("mount --bind /dev/null /proc/locks && exec {} init ctx 0 vmmfd 200m 0 export 0 release 0\n", client.display());
    let Some(out) = in_mount_namespace(&s, script) else { return };
    out.ok();
    assert_eq!(out.nth("export", 0).rc(), 0, "{}", out.stdout);
    let limit = |extra: &[&str]| {
        let o = std::process::Command::new(vramcap_bin())
            .args(["limit", "--group", "xg", "--group-dir", s.dir.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let shown = limit(&[]);
    assert!(shown.contains("200.0 MiB undecidable"), "{shown}");
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 2, "kept, although its fd is gone: {}", out);
    let dropped = limit(&["--drop-exports"]);
    assert!(dropped.contains("gave back 200.0 MiB"), "{dropped}");
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 0, "{}", out);
}

/// Imports are followed per allocation, not per device: a member mapping one ended exporter's
/// memory keeps that memory charged, not another ended exporter's that nobody imported.
#[test]
fn an_import_keeps_only_the_allocation_it_imported() {
    let s = setup();
    // The importer maps A's 100 MiB and holds it until the test says go.
    let ops = format!(
        "init ctx 0 fdlisten {} fdrecv import 0 vamap 0 100m fdclose 0 fdack waitfifo {}",
        s.sock.display(),
        s.go1.display()
    );
    let mut imp = member(&s, false).args([ops]).spawn();
    assert_eq!(imp.wait_for("fdlisten").rc(), 0);
    let a = member(&s, false).args([format!("init ctx 0 vmmfd 100m 0 export 0 fdsend 0 {} release 0", s.sock.display())]).run();
    assert_eq!(a.nth("fdsend", 0).rc(), 0, "{}", a.stdout);
    // B exports 100 MiB too, and exits with nobody importing it.
    let b = member(&s, false).args(["init ctx 0 vmmfd 100m 0 export 0 release 0"]).run();
    assert_eq!(b.nth("export", 0).rc(), 0, "{}", b.stdout);
    // A's 100 MiB live on in the importer; B's are gone: 100 MiB more fit in 256.
    let (rc, out) = ask(&s, "100m");
    assert_eq!(rc, 0, "B's memory was kept for A's importer: {}", out);
    // A's are still the group's: 200 MiB more do not fit.
    let (rc, out) = ask(&s, "200m");
    assert_eq!(rc, 2, "A's memory is mapped by the importer: {}", out);
    go(&s.go1);
    imp.finish();
    let (rc, out) = ask(&s, "250m");
    assert_eq!(rc, 0, "{}", out);
}
