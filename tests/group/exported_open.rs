//! Findings on issue 23 item 11 (exported fds outliving their exporter) from an attack on it, now
//! closed: each test states what the bare driver does and what the group must then do. Imports
//! and re-exports carry the allocation's lock (`intercept::shareable`), so the exporter's group
//! sees them wherever they are.

use vramcap_tests::common;
use common::*;

const BUDGET: u64 = 256 * MIB;

use super::scene::{self, Scene as Setup, go};

fn setup() -> Setup {
    scene::scene()
}

fn member(s: &Setup, bare: bool) -> Run {
    member_as(s, bare, "client_linked")
}

/// A member run through one of the three front ends (linked, `dlsym`, `cuGetProcAddress`).
fn member_as(s: &Setup, bare: bool, client: &str) -> Run {
    let r = scene::in_group(s, "xg", Run::client(client));
    if bare { r.bare() } else { r }
}


/// E exports 200 MiB to member I; I imports it, closes the received fd, *re-exports its imported
/// handle* (`cuMemExportToShareableHandle` on a handle from `cuMemImportFromShareableHandle`: the
/// fake allows it, as the driver's documentation does not forbid it) and sends that new fd to R,
/// which just holds it; I releases its import and exits, E releases and exits. The memory still
/// lives on the device (R's fd keeps it and R may import it at any time), so the group must still
/// hold it.
fn chain(s: &Setup, bare: bool) -> Running {
    let rx = format!("fdlisten {} fdrecv fdack waitfifo {} fdclose 0", s.sock2.display(), s.go1.display());
    let mut r = member(s, bare).args([rx]).spawn();
    assert_eq!(r.wait_for("fdlisten").rc(), 0);
    let imp = format!(
        "init ctx 0 fdlisten {} fdrecv import 0 fdclose 0 fdack export 0 fdsend 1 {} release 0",
        s.sock.display(),
        s.sock2.display()
    );
    let mut i = member(s, bare).args([imp]).spawn();
    assert_eq!(i.wait_for("fdlisten").rc(), 0);
    let out = member(s, bare).args([format!("init ctx 0 vmmfd 200m 0 export 0 fdsend 0 {} release 0", s.sock.display())]).run();
    out.ok();
    assert_eq!(i.wait_for("import").rc(), 0);
    assert_eq!(i.wait_for("export").rc(), 0, "the importer re-exports its imported handle");
    assert_eq!(i.wait_for("fdsend").rc(), 0);
    assert_eq!(i.wait_for("release").rc(), 0);
    i.finish();
    r
}

#[test]
fn a_reexported_import_keeps_the_memory_charged_after_exporter_and_importer_end() {
    // Bare: R's fd alone keeps the 200 MiB on the device.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let r = chain(&s, true);
    assert_eq!(dev.held(), 200 * MIB, "bare: the re-exported fd keeps the memory");
    go(&s.go1);
    r.finish();

    // In the group: 250 MiB more while the 200 MiB still live is past the 256 MiB budget.
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let r = chain(&s, false);
    assert_eq!(dev.held(), 200 * MIB, "the re-exported fd keeps the memory");
    let out = member(&s, false).args(["init ctx 0 vmm 250m 0"]).run();
    let rc = out.nth("vmm", 0).rc();
    let held = dev.held();
    go(&s.go1);
    r.finish();
    assert_eq!(rc, 2, "granted 250 MiB while the device holds {} MiB of the group's memory (budget 256)", held / MIB);
}

/// The same member run in group `name` (each group 256 MiB), through `client`.
fn in_named(s: &Setup, name: &str, client: &str) -> Run {
    member_as(s, false, client).env("VRAMCAP_GROUP", name)
}

/// Two groups (two containers, 256 MiB each) share VMM memory: E in group `h` exports 200 MiB to
/// I in group `g`, which imports and maps it (not charged in `g`: "memory another process owns and
/// is charged for") and closes the fd; E releases and exits. `h` then finds no lock and no import
/// *in its own ledger* and gives the 200 MiB back while I still maps them: charged nowhere. With
/// 250 MiB more in `h` and 200 MiB more in `g` the device holds 650 MiB under two budgets of 256.
#[test]
fn memory_imported_by_another_group_stays_charged_to_the_exporters_group() {
    // On each lookup path: export, import, map and release all go through the same wrappers.
    for c in CLIENTS {
        imported_by_another_group(c);
    }
}

fn imported_by_another_group(c: &str) {
    let s = setup();
    let dev = SharedDevice::open(&s.devfile);
    let ops = format!(
        "init ctx 0 fdlisten {} fdrecv import 0 vamap 0 200m fdclose 0 fdack waitfifo {} vmm 200m 0",
        s.sock.display(),
        s.go1.display()
    );
    let mut i = in_named(&s, "g", c).args([ops]).spawn();
    assert_eq!(i.wait_for("fdlisten").rc(), 0);
    let out = in_named(&s, "h", c).args([format!("init ctx 0 vmmfd 200m 0 export 0 fdsend 0 {} release 0", s.sock.display())]).run();
    out.ok();
    assert_eq!(i.wait_for("vamap").rc(), 0);
    let ask = in_named(&s, "h", c).args(["init ctx 0 vmm 250m 0 waitfifo /dev/null"]).spawn();
    let mut ask = ask;
    let h_rc = ask.wait_for("vmm").rc();
    go(&s.go1);
    let g_rc = i.wait_for("vmm").rc();
    i.finish();
    ask.finish();
    let peak = dev.peak().load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        peak <= 2 * BUDGET && h_rc == 2,
        "{c}: h granted 250 MiB (rc {h_rc}), g granted 200 MiB (rc {g_rc}) while g's member maps h's 200 MiB: device peak {} MiB under two budgets of 256",
        peak / MIB
    );
}
