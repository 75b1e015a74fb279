//! Unit tests of `handles`: the lifetimes of VMM allocations, without a driver.
use super::*;

// Device 50 is this module's: the ledger's budgets are process-global. Handles are distinct
// per test (tests run in parallel on one table).
const DEV: usize = 50;
const OK: Timed = Timed { rc: CUDA_SUCCESS, dur: 0, at: 0 };
const FAIL: Timed = Timed { rc: CUDA_ERROR_INVALID_VALUE, dur: 0, at: 0 };

fn create(handle: u64, size: u64) {
    create_on(DEV, handle, size);
}

fn create_on(dev: usize, handle: u64, size: u64) {
    ledger::charge(dev, size);
    let key = created(handle);
    assert!(ledger::insert(Kind::VmmHandle, key, Charge { dev: dev as u16, size, ctx: 0 }).is_none());
}

fn held(key: u64) -> bool {
    let c = ledger::take(Kind::VmmHandle, key);
    if let Some(c) = c {
        ledger::insert(Kind::VmmHandle, key, c);
    }
    c.is_some()
}

fn map(handle: u64, ptr: u64, size: u64) {
    let id = map_begin(handle);
    assert!(id.is_some());
    map_end(id, ptr, size, OK);
}

fn release(handle: u64, t: Timed) {
    let r = release_begin(handle);
    release_end(r, t);
}

fn unmap(ptr: u64, size: u64, t: Timed) {
    let u = unmap_begin(ptr, size);
    unmap_end(u, t);
}

#[test]
fn released_while_mapped_stays_charged_until_the_last_unmap() {
    let (h, a, b) = (0x1000_0000, 0x7000_0000_0000, 0x7100_0000_0000);
    create(h, 100);
    map(h, a, 10);
    map(h, b, 10);
    release(h, OK);
    assert!(!held(h) && held(ORPHAN | with(|t| t.pieces[&a].1)), "moved off the reusable handle value");
    unmap(a, 10, OK);
    assert_eq!(with(|t| t.pieces.get(&b).copied().map(|p| p.0)), Some(b + 10));
    unmap(b, 4, FAIL);
    assert_eq!(with(|t| t.pieces.get(&b).copied()).map(|p| p.0), Some(b + 10), "a refused unmap changes nothing");
    unmap(b, 4, OK);
    assert_eq!(with(|t| t.pieces.get(&(b + 4)).copied()).map(|p| p.0), Some(b + 10), "the rest stays mapped");
    let id = with(|t| t.pieces[&(b + 4)].1);
    unmap(b + 4, 6, OK);
    assert!(with(|t| !t.allocs.contains_key(&id)), "the last piece ends it");
    assert!(!held(ORPHAN | id));
}

#[test]
fn a_failed_release_keeps_the_handle() {
    let h = 0x2000_0000;
    create(h, 100);
    release(h, FAIL);
    assert!(held(h));
    release(h, OK);
    assert!(!held(h));
    assert!(release_begin(h).is_none(), "a released handle is unknown");
}

#[test]
fn retain_adds_a_reference_and_revives_the_handle() {
    let (h, a) = (0x3000_0000, 0x7200_0000_0000);
    create(h, 100);
    map(h, a, 10);
    release(h, OK);
    let id = retain_begin(a + 5);
    retain_end(id, || h, OK);
    assert!(held(h), "the same handle value again");
    unmap(a, 10, OK);
    assert!(held(h), "still referenced");
    release(h, OK);
    assert!(!held(h));
}

#[test]
fn an_exported_allocation_stays_charged_after_release_and_unmap() {
    // Device 51: this charge stays for the life of the test process, and device 50's budget
    // is also read exactly by `mem::tests`.
    const KEPT: usize = 51;
    let (h, a, g) = (0x5000_0000, 0x7400_0000_0000, 0x5100_0000);
    create_on(KEPT, h, 100);
    map(h, a, 10);
    let id = export_begin(h);
    assert!(id.is_some());
    export_end(id, OK, |_| None);
    release(h, OK);
    unmap(a, 10, OK);
    let id = id.unwrap();
    assert!(with(|t| t.allocs.contains_key(&id)) && held(ORPHAN | id), "the importer may still use it");
    create_on(KEPT, h, 7); // the driver may hand the value out again: the new allocation is its own
    assert!(held(ORPHAN | id) && held(h));
    release(h, OK);
    assert!(!held(h) && held(ORPHAN | id));
    assert_eq!(ledger::used(KEPT), 100);
    // A refused export pins nothing.
    create_on(KEPT, g, 5);
    let id = export_begin(g);
    export_end(id, FAIL, |_| None);
    release(g, OK);
    assert!(!held(g) && with(|t| !t.allocs.contains_key(&id.unwrap())));
    assert_eq!(ledger::used(KEPT), 100);
    // An export racing the last release (the driver exported first): pinned all the same.
    let x = 0x5200_0000;
    create_on(KEPT, x, 3);
    let r = release_begin(x);
    let id = export_begin(x);
    assert!(id.is_some(), "the export must find the allocation while its release is in flight");
    release_end(r, OK);
    export_end(id, OK, |_| None);
    assert!(held(ORPHAN | id.unwrap()));
    assert_eq!(ledger::used(KEPT), 103);
}

/// A map of the handle on another thread while its last release is in the driver: whichever
/// the driver took first, the allocation is pinned by the mapping if the map succeeded.
#[test]
fn a_map_racing_the_last_release_pins_the_allocation() {
    let (h, a) = (0x6000_0000, 0x7500_0000_0000);
    create(h, 64);
    let r = release_begin(h);
    let id = map_begin(h);
    assert!(id.is_some(), "the handle is still the driver's during the release: the map must find it");
    release_end(r, OK);
    map_end(id, a, 64, OK);
    assert!(held(ORPHAN | id.unwrap()), "mapped memory outlives the release");
    unmap(a, 64, OK);
    assert!(!held(ORPHAN | id.unwrap()) && with(|t| !t.allocs.contains_key(&id.unwrap())));
    // The driver took the release first: the map fails, and that ends the allocation.
    create(h, 64);
    let r = release_begin(h);
    let id = map_begin(h);
    release_end(r, OK);
    assert!(with(|t| t.allocs.contains_key(&id.unwrap())), "kept while the map is in flight");
    map_end(id, a, 64, FAIL);
    assert!(with(|t| !t.allocs.contains_key(&id.unwrap())) && !held(h));
}

#[test]
fn a_reused_handle_value_never_takes_the_old_charge() {
    let (h, a) = (0x4000_0000, 0x7300_0000_0000);
    create(h, 100);
    map(h, a, 10);
    release(h, OK);
    create(h, 7); // the driver hands the value out again
    let old = with(|t| t.pieces[&a].1);
    assert!(held(ORPHAN | old) && held(h));
    unmap(a, 10, OK);
    assert!(!held(ORPHAN | old) && held(h));
    release(h, OK);
    assert!(!held(h));
}
