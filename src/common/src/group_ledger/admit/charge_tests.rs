//! Charging and reclaiming on a ledger in memory, under the default (shared) policy.

use super::*;
use crate::group_ledger::shm::{Liveness, Member};

/// A zeroed `Shared` on the heap: the same state a fresh file has.
fn fresh() -> Box<Shared> {
    let layout = std::alloc::Layout::new::<Shared>();
    unsafe { Box::from_raw(std::alloc::alloc_zeroed(layout).cast::<Shared>()) }
}

#[test]
fn charges_respect_the_limit_and_release_exactly() {
    let s = fresh();
    s.set_limit(0, 100);
    let m = s.claim(10, 5, 7).unwrap();
    assert!(s.charge(m, 0, 60).is_ok());
    assert_eq!(s.charge(m, 0, 41), Err(Over { used: 60, limit: 100, rule: Rule::Budget }));
    assert!(s.charge(m, 0, 40).is_ok());
    assert_eq!(s.uncharge(m, 0, 30), 30);
    assert_eq!(s.used(0), 70);
    // More than the slot holds: only what it holds leaves the group.
    let other = s.claim(11, 5, 7).unwrap();
    s.charge(other, 0, 20).unwrap();
    assert_eq!(s.uncharge(m, 0, 1000), 70);
    assert_eq!(s.used(0), 20);
    assert_eq!(s.devices[0].peak.load(Relaxed), 100);
    s.set_limit(0, 0);
    assert!(s.charge(m, 0, u64::MAX / 2).is_ok(), "0 = no limit");
}

#[test]
fn dead_members_are_reclaimed_once_and_pid_reuse_is_not_death() {
    let s = fresh();
    let dead = s.claim(100, 1111, 7).unwrap();
    let live = s.claim(100, 2222, 7).unwrap(); // same pid, newer start: the pid was reused
    s.charge(dead, 3, 500).unwrap();
    s.charge(live, 3, 70).unwrap();
    // The only process with pid 100 started at 2222.
    let oracle = |ms: &[Member]| {
        ms.iter()
            .map(|m| if m.pid == 100 && (m.start == 2222 || m.start == 0) { Liveness::Alive } else { Liveness::Dead })
            .collect::<Vec<_>>()
    };
    assert_eq!(s.reclaim_dead(1, &oracle), (1, 500));
    assert_eq!(s.used(3), 70);
    assert_eq!(SlotWord::unpack(s.slots[live].word.load(Relaxed)).state, State::Live);
    assert_eq!(s.slots[live].charge[3].load(Relaxed), 70);
    assert_eq!(s.reclaim_dead(1, &oracle), (0, 0), "exactly once");
    // A stale view of the reclaimed slot (older generation) cannot reclaim the new owner.
    let stale = SlotWord { state: State::Live, generation: 1, pid: 100 }.pack();
    let again = s.claim(300, 9, 7).unwrap();
    assert_eq!(again, dead);
    s.charge(again, 3, 5).unwrap();
    assert_eq!(s.reclaim(again, stale, 1), None);
    assert_eq!(s.used(3), 75);
    assert_eq!(s.members(), 2);
}

#[test]
fn a_reclaimer_that_died_midway_is_taken_over() {
    let s = fresh();
    let m = s.claim(50, 1, 7).unwrap();
    s.charge(m, 0, 8).unwrap();
    // Reclaimer 60 took the slot and died before emptying it.
    let w = s.slots[m].word.load(Relaxed);
    let stuck = SlotWord { state: State::Reclaiming, pid: 60, ..SlotWord::unpack(w) }.pack();
    s.slots[m].word.store(stuck, Relaxed);
    let oracle = |ms: &[Member]| {
        ms.iter().map(|m| if m.pid == 60 || m.pid == 50 { Liveness::Dead } else { Liveness::Alive }).collect::<Vec<_>>()
    };
    assert_eq!(s.reclaim_dead(7, &oracle), (1, 8));
    assert_eq!(s.used(0), 0);
    assert_eq!(s.members(), 0);
}

#[test]
fn a_taken_over_reclaim_frees_once_and_never_over_a_new_claim() {
    let s = fresh();
    let m = s.claim(50, 1, 7).unwrap();
    s.charge(m, 0, 8).unwrap();
    let w = s.slots[m].word.load(Relaxed);
    // Observer A starts emptying; observer B judges A dead and takes over and finishes.
    let a = SlotWord { state: State::Reclaiming, pid: 60, ..SlotWord::unpack(w) }.pack();
    s.slots[m].word.store(a, Relaxed);
    assert_eq!(s.reclaim(m, a, 61), Some(8));
    // A new member takes the slot; A's late finish must not free it.
    let again = s.claim(70, 2, 7).unwrap();
    assert_eq!(again, m);
    let free = SlotWord { state: State::Free, generation: SlotWord::unpack(a).generation, pid: 0 }.pack();
    assert!(s.slots[m].word.compare_exchange(a, free, AcqRel, Relaxed).is_err());
    assert_eq!(SlotWord::unpack(s.slots[m].word.load(Relaxed)).state, State::Live);
    assert_eq!((s.slots[m].pidns.load(Relaxed), s.slots[m].start.load(Relaxed)), (7, 2));
    assert_eq!(s.used(0), 0);
}

#[test]
fn racing_threads_never_exceed_and_end_at_zero() {
    let s: &'static Shared = Box::leak(fresh());
    s.set_limit(0, 1000);
    let ts: Vec<_> = (0..8u32)
        .map(|t| {
            std::thread::spawn(move || {
                let m = s.claim(1000 + t, 1, 7).unwrap();
                for i in 0..20_000u64 {
                    if s.charge(m, 0, 1 + i % 13).is_ok() {
                        assert!(s.used(0) <= 1000);
                        s.uncharge(m, 0, 1 + i % 13);
                    }
                }
                s.slots[m].charge[0].load(Relaxed)
            })
        })
        .collect();
    for t in ts {
        assert_eq!(t.join().unwrap(), 0);
    }
    assert_eq!(s.used(0), 0);
    assert!(s.devices[0].peak.load(Relaxed) <= 1000);
}

// A change of the limit racing a request, made exactly between the request's first look at the
// limit and its CAS (issue 26: the re-read after the CAS). Remove the re-read and these fail.
#[test]
fn a_shrink_racing_a_request_is_the_budget_it_is_judged_by() {
    let s = fresh();
    s.set_limit(0, 100);
    let m = s.claim(10, 5, 7).unwrap();
    s.charge(m, 0, 30).unwrap();
    // Read 100, cut to 60 before the CAS: 30 + 50 no longer fits.
    assert_eq!(s.charge_racing(m, 0, 50, || { let _ = s.set_limit(0, 60); }), Err(Over { used: 30, limit: 60, rule: Rule::Budget }));
    assert_eq!((s.used(0), s.devices[0].held.load(Relaxed), s.slots[m].charge[0].load(Relaxed)), (30, 30, 30), "nothing left behind");
    // What still fits the new budget is granted.
    s.set_limit(0, 100);
    s.charge_racing(m, 0, 30, || { let _ = s.set_limit(0, 60); }).unwrap();
    assert_eq!(s.used(0), 60);
    // A grow in the gap: refused on the old limit at first, then judged afresh on the new one.
    s.charge_racing(m, 0, 40, || { let _ = s.set_limit(0, 200); }).unwrap();
    assert_eq!(s.used(0), 100);
    assert_eq!(s.devices[0].peak.load(Relaxed), 100);
}

#[test]
fn a_shrink_racing_a_request_under_the_general_rules_is_the_budget_it_is_judged_by() {
    // A member with an unmet reserve takes the general path (`charge_general`).
    let s = fresh();
    s.set_limit(0, 100);
    let m = s.claim(10, 5, 7).unwrap();
    s.claim_reserve(m, 0, 10).unwrap();
    // 10 of its own reserve and 50 more: 60 fits 100, not the 50 it was cut to meanwhile.
    assert!(s.charge_racing(m, 0, 60, || { let _ = s.set_limit(0, 50); }).is_err());
    assert_eq!((s.devices[0].held.load(Relaxed), s.slots[m].unmet[0].load(Relaxed), s.used(0)), (10, 10, 0), "all given back");
    s.charge_racing(m, 0, 40, || { let _ = s.set_limit(0, 50); }).unwrap();
    assert_eq!((s.devices[0].held.load(Relaxed), s.used(0)), (40, 40));
}

// The setter's store then look at `held` against a request's CAS on `held` then re-read of the
// limit, many times over (store-buffering, `crate::litmus`): a grant of 100 that the setter did
// not see must have been judged by the limit of 10 it set first, which refuses it.
#[test]
fn a_grant_the_setter_did_not_see_was_judged_by_the_new_limit() {
    let s: &'static Shared = Box::leak(fresh());
    let m = s.claim(10, 5, 7).unwrap();
    let missed = crate::litmus::store_buffering_rounds(
        200_000,
        || {
            s.uncharge(m, 0, u64::MAX);
            s.set_limit(0, 1000);
        },
        || {
            s.set_limit(0, 10);
            s.used(0)
        },
        || s.charge(m, 0, 100).is_ok(),
    );
    assert_eq!(missed, 0, "rounds in which a request of 100 was granted past a group limit of 10 set first");
}
