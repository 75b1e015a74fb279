//! The ledger's unit tests (kept apart: `ledger.rs` is the hot path's code).

use super::*;

// Each test uses its own device index: the budgets are process-global.
#[test]
fn reserve_respects_the_limit_exactly() {
    let d = 40;
    set_limit(d, 100);
    assert!(reserve(d, 60).is_ok());
    assert_eq!(reserve(d, 41), Err(Denied { used: 60, limit: 100, group: false, rule: crate::group::shm::Rule::Budget }));
    assert!(reserve(d, 40).is_ok());
    assert_eq!(charged(d), 100);
    release(d, 100);
    assert_eq!(charged(d), 0);
    release(d, 5);
    assert_eq!(charged(d), 0, "never below zero");
    set_limit(d, 0);
    assert_eq!(limit(d), None);
    assert!(reserve(d, u64::MAX / 2).is_ok());
    assert!(reserve(d, u64::MAX).is_err(), "overflow is a denial, not a wrap");
}

#[test]
fn a_shrink_racing_a_reservation_is_the_limit_it_is_judged_by() {
    // The ceiling file cut between the look at the limit and the CAS (issue 26): without the
    // re-read after the CAS, 60 + 50 would pass on the 200 read first.
    let d = 44;
    set_limit(d, 200);
    reserve(d, 60).unwrap();
    assert_eq!(reserve_local_racing(d, 50, || set_limit(d, 100)), Err(Denied { used: 60, limit: 100, group: false, rule: crate::group::shm::Rule::Budget }));
    assert_eq!(charged(d), 60, "nothing left behind");
    // What fits the new limit passes.
    set_limit(d, 200);
    reserve_local_racing(d, 40, || set_limit(d, 100)).unwrap();
    assert_eq!(charged(d), 100);
}

/// A shrink against a reservation in flight, many times over, each round started together:
/// the shrinker stores the new limit and then reads what is charged; the reserver CASes its
/// charge up and then re-reads the limit. At least one must see the other (store-buffering):
/// a grant the shrinker did not see must have been judged by the new limit, which it does
/// not fit. With a Release store of the limit the shrinker's read of `charged` can pass its
/// own store (x86's store buffer), the reserver re-reads the old limit, and both miss.
#[test]
fn a_grant_the_shrinker_did_not_see_was_judged_by_the_new_limit() {
    let d = 45;
    let missed = vramcap_common::litmus::store_buffering_rounds(
        200_000,
        || {
            release(d, charged(d));
            set_limit(d, 1000);
        },
        || {
            set_limit(d, 10);
            charged(d)
        },
        || reserve_local(d, 100).is_ok(),
    );
    assert_eq!(missed, 0, "rounds in which a reservation of 100 was granted past a limit of 10 that the shrinker published first");
}

#[test]
fn racing_reservations_never_exceed_the_limit() {
    let d = 41;
    set_limit(d, 1000);
    let granted: u64 = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let mut got = 0;
                for _ in 0..10_000 {
                    if reserve(d, 7).is_ok() {
                        got += 7;
                    }
                }
                got
            })
        })
        .map(|t| t.join().unwrap())
        .sum();
    assert!(granted <= 1000 && granted > 1000 - 7);
    assert_eq!(charged(d), granted);
    assert_eq!(used(d), 0, "reservations are not memory until committed");
}

#[test]
fn table_round_trip() {
    let c = Charge { dev: 3, size: 4096, ctx: 7 };
    assert_eq!(insert(Kind::DevicePtr, 0xdead_0000, c), None);
    assert_eq!(insert(Kind::DevicePtr, 0xdead_0000, c), Some(c));
    assert_eq!(take(Kind::DevicePtr, 0xdead_0000), Some(c));
    assert_eq!(take(Kind::DevicePtr, 0xdead_0000), None);
    assert_eq!(take(Kind::DevicePtr, 0xbeef), None);
}

#[test]
fn drain_takes_one_context_across_kinds() {
    let (a, b) = (Charge { dev: 5, size: 1, ctx: 0xc1 }, Charge { dev: 5, size: 2, ctx: 0xc2 });
    insert(Kind::Array, 0x1000, a);
    insert(Kind::VmmHandle, 0x1000, a);
    insert(Kind::Array, 0x2000, b);
    let mut got = drain(&ALL_KINDS, |c| c.ctx == 0xc1);
    got.sort_by_key(|g| g.0 as usize);
    assert_eq!(got, vec![(Kind::VmmHandle, 0x1000, a), (Kind::Array, 0x1000, a)]);
    assert_eq!(take(Kind::Array, 0x2000), Some(b));
    assert_eq!(take(Kind::Array, 0x1000), None);
}

#[test]
fn drain_takes_only_the_kinds_asked_for() {
    // A context's end frees its pointers and arrays, never its VMM handles.
    let c = Charge { dev: 6, size: 1, ctx: 0xc3 };
    insert(Kind::Array, 0x3000, c);
    insert(Kind::VmmHandle, 0x3000, c);
    insert(Kind::DevicePtr, 0x3000_0000, c);
    let mut got = drain(&[Kind::DevicePtr, Kind::Array], |c| c.ctx == 0xc3);
    got.sort_by_key(|g| g.0 as usize);
    assert_eq!(got, vec![(Kind::DevicePtr, 0x3000_0000, c), (Kind::Array, 0x3000, c)]);
    assert_eq!(take(Kind::VmmHandle, 0x3000), Some(c));
}

#[test]
fn peak_tracks_the_high_water_mark() {
    let d = 42;
    reserve(d, 10).unwrap();
    commit(d, 10);
    release(d, 10);
    reserve(d, 5).unwrap();
    commit(d, 5);
    assert_eq!((peak(d), used(d), charged(d)), (10, 5, 5));
}

#[test]
fn a_snapshot_tells_an_allocation_made_and_freed_from_nothing_moving() {
    let d = 37;
    reserve(d, 7).unwrap();
    commit(d, 7);
    let a = snapshot(d);
    assert_eq!((a.charged, a.held), (7, 7));
    assert_eq!(snapshot(d), a, "nothing moved");
    reserve(d, 48).unwrap();
    commit(d, 48);
    uncommit(d, 48);
    unreserve(d, 48);
    let b = snapshot(d);
    assert_eq!((b.charged, b.held, used(d), charged(d)), (7, 7, 7, 7), "back where it was");
    assert_ne!(a, b, "but an allocation came and went");
}

#[test]
fn reservations_the_driver_refuses_are_never_held_nor_in_the_peak() {
    let d = 43;
    reserve(d, 100).unwrap();
    commit(d, 100);
    // Another thread's reservation, in flight while this one commits, then refused.
    reserve(d, 900).unwrap();
    reserve(d, 50).unwrap();
    commit(d, 50);
    unreserve(d, 900);
    assert_eq!((used(d), charged(d), peak(d)), (150, 150, 150));
    // A free: not held from before the driver call, not charged after it.
    uncommit(d, 100);
    assert_eq!((used(d), charged(d)), (50, 150));
    unreserve(d, 100);
    assert_eq!((used(d), charged(d), peak(d)), (50, 50, 150));
    // A pool that grew by itself: charged and held at once.
    charge(d, 30);
    assert_eq!((used(d), charged(d), peak(d)), (80, 80, 150));
}
