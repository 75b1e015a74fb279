//! The sharing rules on a ledger in memory (the same bytes a mapped file holds).

use super::*;
use crate::group_ledger::shm::Device;

fn fresh(policy: Policy, limit: u64) -> &'static Shared {
    let layout = std::alloc::Layout::new::<Shared>();
    let s: &'static Shared = unsafe { &*std::alloc::alloc_zeroed(layout).cast::<Shared>() };
    s.init("t");
    s.header.policy.store(policy as u32, Relaxed);
    s.set_limit(0, limit);
    s
}

fn member(s: &Shared, pid: u32, priority: i64) -> usize {
    let i = s.claim(pid, pid as u64, 7).unwrap();
    s.slots[i].priority.store(priority as u64, Relaxed);
    i
}

fn dev(s: &Shared) -> &Device {
    &s.devices[0]
}

fn rule(r: Result<(), Over>) -> Rule {
    r.unwrap_err().rule
}

#[test]
fn a_reserve_is_kept_for_its_member_and_comes_back_when_it_frees() {
    let s = fresh(Policy::Shared, 100);
    let (a, b) = (member(s, 10, 0), member(s, 11, 0));
    s.claim_reserve(a, 0, 30).unwrap();
    assert_eq!((dev(s).held.load(Relaxed), s.used(0)), (30, 0));
    assert!(matches!(rule(s.charge(b, 0, 71)), Rule::Reserved { bytes: 30, pid: 10, higher: false, .. }));
    s.charge(b, 0, 70).unwrap();
    // A's own reserve: no new budget needed.
    s.charge(a, 0, 30).unwrap();
    assert_eq!((dev(s).held.load(Relaxed), s.slots[a].unmet[0].load(Relaxed)), (100, 0));
    assert_eq!(rule(s.charge(a, 0, 1)), Rule::Budget);
    // A frees 10: kept for A, not for B.
    assert_eq!(s.uncharge(a, 0, 10), 10);
    assert_eq!((s.slots[a].unmet[0].load(Relaxed), dev(s).held.load(Relaxed)), (10, 100));
    assert!(s.charge(b, 0, 1).is_err());
    s.charge(a, 0, 10).unwrap();
    // B frees: leaves the group.
    s.uncharge(b, 0, 70);
    assert_eq!((dev(s).held.load(Relaxed), s.used(0)), (30, 30));
    // A dies: charge and reserve come back at once.
    s.reclaim(a, s.slots[a].word.load(Relaxed), 1);
    assert_eq!((dev(s).held.load(Relaxed), s.used(0)), (0, 0));
}

#[test]
fn a_reserve_that_does_not_fit_is_refused_and_leaves_nothing() {
    let s = fresh(Policy::Shared, 100);
    let (a, b) = (member(s, 10, 0), member(s, 11, 0));
    dev(s).headroom.store(11, Relaxed);
    s.claim_reserve(a, 0, 60).unwrap();
    // 60 + 40 > 100 - 10.
    assert!(s.claim_reserve(b, 0, 40).is_err());
    assert_eq!((dev(s).held.load(Relaxed), s.slots[b].reserve[0].load(Relaxed)), (60, 0));
    s.claim_reserve(b, 0, 30).unwrap();
    s.drop_reserve(b, 0);
    assert_eq!(dev(s).held.load(Relaxed), 60);
}

#[test]
fn equal_shares_follow_members_and_nothing_is_taken_back() {
    let s = fresh(Policy::Equal, 100);
    let m: Vec<usize> = (0..4).map(|k| member(s, 20 + k, 0)).collect();
    s.charge(m[0], 0, 25).unwrap();
    assert_eq!(rule(s.charge(m[0], 0, 1)), Rule::Share { share: 25, budget: 100, members: 4 });
    assert_eq!(s.used(0), 25, "a refused share leaves no charge");
    assert_eq!(dev(s).held.load(Relaxed), 25);
    // One leaves: shares grow to 33.
    s.reclaim(m[3], s.slots[m[3]].word.load(Relaxed), 1);
    s.charge(m[0], 0, 8).unwrap();
    assert!(s.charge(m[0], 0, 1).is_err());
    // Two join: the share shrinks to 20, nothing is taken back, more is refused until below.
    member(s, 30, 0);
    member(s, 31, 0);
    assert_eq!(s.slots[m[0]].charge[0].load(Relaxed), 33);
    assert!(matches!(rule(s.charge(m[0], 0, 1)), Rule::Share { share: 20, members: 5, .. }));
    s.uncharge(m[0], 0, 14);
    s.charge(m[0], 0, 1).unwrap();
    assert!(s.charge(m[0], 0, 1).is_err());
}

#[test]
fn priority_takes_lower_reserves_and_never_higher_ones() {
    let s = fresh(Policy::Priority, 100);
    let (low, high) = (member(s, 40, 0), member(s, 41, 10));
    s.claim_reserve(low, 0, 60).unwrap();
    // High needs 50: 40 are free, 10 come from Low's unmet reserve.
    s.charge(high, 0, 50).unwrap();
    assert_eq!((s.slots[low].unmet[0].load(Relaxed), dev(s).held.load(Relaxed)), (50, 100));
    s.charge(low, 0, 50).unwrap();
    assert_eq!(rule(s.charge(low, 0, 1)), Rule::Budget);
    // An equal priority shares on demand and keeps the others' reserves.
    let s = fresh(Policy::Priority, 100);
    let (a, b) = (member(s, 50, 5), member(s, 51, 5));
    s.claim_reserve(a, 0, 60).unwrap();
    assert!(matches!(rule(s.charge(b, 0, 41)), Rule::Reserved { bytes: 60, pid: 50, higher: true, .. }));
    assert_eq!(s.slots[a].unmet[0].load(Relaxed), 60);
    // A lower one is refused with the higher member named.
    let s = fresh(Policy::Priority, 100);
    let (low, high) = (member(s, 60, -1), member(s, 61, 3));
    s.claim_reserve(high, 0, 60).unwrap();
    assert!(matches!(rule(s.charge(low, 0, 41)), Rule::Reserved { bytes: 60, pid: 61, higher: true, .. }));
    s.charge(low, 0, 40).unwrap();
    // What a refused steal took is given back.
    let s = fresh(Policy::Priority, 100);
    let (low, high) = (member(s, 70, 0), member(s, 71, 9));
    s.claim_reserve(low, 0, 10).unwrap();
    s.charge_unchecked(low, 0, 0);
    s.charge(high, 0, 90).unwrap();
    assert!(s.charge(high, 0, 20).is_err(), "10 of Low's reserve cannot cover 20");
    assert_eq!((s.slots[low].unmet[0].load(Relaxed), dev(s).held.load(Relaxed)), (10, 100));
}

#[test]
fn the_headroom_is_kept_for_a_later_member_and_returns_with_it() {
    let s = fresh(Policy::Shared, 100);
    dev(s).headroom.store(21, Relaxed);
    let a = member(s, 80, 0);
    assert!(!s.others_hold_memory(a));
    s.charge(a, 0, 80).unwrap();
    assert_eq!(rule(s.charge(a, 0, 1)), Rule::Headroom { headroom: 20 });
    assert!(!s.try_take_headroom(a) || s.holds_headroom(a), "only one holder");
    s.header.headroom_holder.store(0, Relaxed);
    let b = member(s, 81, 0);
    assert!(s.others_hold_memory(b));
    assert!(s.try_take_headroom(b));
    let before = s.header.pressure.load(Relaxed);
    s.charge(b, 0, 20).unwrap();
    assert_eq!(s.header.pressure.load(Relaxed), before + 1, "using the headroom asks neighbours to trim");
    let c = member(s, 82, 0);
    assert!(!s.try_take_headroom(c), "B holds it while it lives");
    s.reclaim(b, s.slots[b].word.load(Relaxed), 1);
    assert_eq!(s.header.headroom_holder.load(Relaxed), 0);
    assert!(s.try_take_headroom(c));
}

#[test]
fn a_member_killed_mid_request_leaves_held_high_never_low() {
    let s = fresh(Policy::Shared, 100);
    let a = member(s, 90, 0);
    s.claim_reserve(a, 0, 20).unwrap();
    // Killed after taking from its unmet reserve and adding to held, before recording the
    // charge: the reclaim gives back what the slot shows; the in-flight part stays counted.
    s.slots[a].unmet[0].fetch_sub(5, Relaxed);
    dev(s).held.fetch_add(10, Relaxed);
    s.reclaim(a, s.slots[a].word.load(Relaxed), 1);
    assert_eq!(dev(s).held.load(Relaxed), 15, "stricter by the one request in flight");
    assert_eq!(s.header.members.load(Relaxed), 0);
}

#[test]
fn racing_members_never_pass_the_budget_under_any_policy() {
    for policy in [Policy::Shared, Policy::Equal, Policy::Priority] {
        let s = fresh(policy, 1000);
        dev(s).headroom.store(101, Relaxed);
        let ts: Vec<_> = (0..8u32)
            .map(|t| {
                std::thread::spawn(move || {
                    let m = member(s, 1000 + t, (t % 3) as i64);
                    if t % 2 == 0 {
                        let _ = s.claim_reserve(m, 0, 50);
                    }
                    if t == 7 {
                        let _ = s.try_take_headroom(m);
                    }
                    for i in 0..20_000u64 {
                        let size = 1 + i % 97;
                        if s.charge(m, 0, size).is_ok() {
                            assert!(s.used(0) <= 1000, "{policy:?}");
                            s.uncharge(m, 0, size);
                        }
                    }
                    assert_eq!(s.slots[m].charge[0].load(Relaxed), 0);
                    m
                })
            })
            .collect();
        let slots: Vec<usize> = ts.into_iter().map(|t| t.join().unwrap()).collect();
        let unmet: u64 = slots.iter().map(|&m| s.slots[m].unmet[0].load(Relaxed)).sum();
        assert_eq!(s.used(0), 0, "{policy:?}");
        assert_eq!(dev(s).held.load(Relaxed), unmet, "{policy:?}: held = used + unmet when quiet");
        assert!(dev(s).peak.load(Relaxed) <= 1000);
        for m in slots {
            s.reclaim(m, s.slots[m].word.load(Relaxed), 1);
        }
        assert_eq!(dev(s).held.load(Relaxed), 0, "{policy:?}");
    }
}

#[test]
fn what_a_members_own_reserve_covers_is_granted_even_when_the_headroom_is_in_use() {
    let s = fresh(Policy::Shared, 100);
    dev(s).headroom.store(21, Relaxed);
    let a = member(s, 95, 0);
    s.claim_reserve(a, 0, 30).unwrap();
    // A late starter holds the headroom and fills the group to its whole limit.
    let b = member(s, 96, 0);
    s.charge(b, 0, 1).unwrap();
    assert!(s.try_take_headroom(b));
    s.charge(b, 0, 69).unwrap();
    assert_eq!(dev(s).held.load(Relaxed), 100);
    // Above A's budget (limit less headroom), yet its reserve is its own: granted, 30 and no more.
    s.charge(a, 0, 30).unwrap();
    assert!(s.charge(a, 0, 1).is_err());
    assert_eq!((dev(s).held.load(Relaxed), s.used(0)), (100, 100));
    // Freed, it fills A's reserve again: still kept for A.
    assert_eq!(s.uncharge(a, 0, 30), 30);
    assert_eq!((s.slots[a].unmet[0].load(Relaxed), dev(s).held.load(Relaxed)), (30, 100));
}

/// Every word a request can move, for comparing a ledger before and after.
fn words(s: &Shared, slots: &[usize]) -> Vec<u64> {
    let d = dev(s);
    let mut w = vec![d.held.load(Relaxed), d.unmet.load(Relaxed)];
    for &i in slots {
        w.extend([s.slots[i].charge[0].load(Relaxed), s.slots[i].unmet[0].load(Relaxed), s.slots[i].reserve[0].load(Relaxed)]);
    }
    w
}

/// `probe` answers as `charge` would and leaves the ledger as it was: a grant from the
/// member's own reserve, one that takes a lower member's reserve (priority), and a refusal.
#[test]
fn a_probe_answers_as_a_charge_would_and_changes_nothing() {
    for policy in [Policy::Shared, Policy::Equal, Policy::Priority] {
        let s = fresh(policy, 100);
        let (lo, own, hi) = (member(s, 10, 0), member(s, 11, 0), member(s, 12, 5));
        s.claim_reserve(lo, 0, 30).unwrap();
        s.claim_reserve(own, 0, 20).unwrap();
        s.charge(hi, 0, 30).unwrap();
        let all = [lo, own, hi];
        for (who, size) in [(own, 20), (hi, 40), (hi, 60), (lo, 31), (own, 1)] {
            let before = words(s, &all);
            let probed = s.probe(who, 0, size);
            assert_eq!(words(s, &all), before, "{policy:?}: probe({who}, {size}) changed the ledger");
            let charged = s.charge(who, 0, size);
            assert_eq!(probed, charged, "{policy:?}: probe and charge disagree on ({who}, {size})");
            if charged.is_ok() {
                s.uncharge(who, 0, size);
            }
        }
    }
}

/// Issue 25 item 1: what a higher priority took from a lower member's unmet reserve goes back to
/// that member when freed, not to the common pool, where an equal priority could take it.
#[test]
fn what_a_higher_priority_borrowed_goes_back_to_its_lender() {
    let s = fresh(Policy::Priority, 1000);
    let (l, h, m) = (member(s, 10, 0), member(s, 11, 10), member(s, 12, 0));
    s.claim_reserve(l, 0, 600).unwrap();
    s.charge(h, 0, 1000).unwrap();
    assert_eq!((s.slots[l].unmet[0].load(Relaxed), s.borrowed(h, 0)), (0, 600));
    s.uncharge(h, 0, 1000);
    assert_eq!((s.slots[l].unmet[0].load(Relaxed), dev(s).held.load(Relaxed), s.borrowed(h, 0)), (600, 600, 0));
    assert!(matches!(rule(s.charge(m, 0, 1000)), Rule::Reserved { bytes: 600, pid: 10, .. }));
    s.charge(m, 0, 400).unwrap();
    s.charge(l, 0, 600).unwrap();
    assert_eq!(dev(s).held.load(Relaxed), 1000);
}

/// Each loan goes back to the member it was taken from: B (3) took L1's (0) reserve, H (10)
/// took L2's (5); B's free refills L1, never L2 (which B could not have taken).
#[test]
fn a_loan_goes_back_to_its_own_lender_and_not_to_another() {
    let s = fresh(Policy::Priority, 300);
    let (l1, l2, b, h) = (member(s, 20, 0), member(s, 21, 5), member(s, 22, 3), member(s, 23, 10));
    s.claim_reserve(l1, 0, 100).unwrap();
    s.claim_reserve(l2, 0, 100).unwrap();
    s.charge(b, 0, 200).unwrap();
    s.charge(h, 0, 100).unwrap();
    assert_eq!((s.borrowed(b, 0), s.borrowed(h, 0)), (100, 100));
    s.uncharge(b, 0, 150);
    assert_eq!((s.slots[l1].unmet[0].load(Relaxed), s.slots[l2].unmet[0].load(Relaxed)), (100, 0));
    assert_eq!(dev(s).held.load(Relaxed), 250, "B's other 50 left the group");
    s.uncharge(h, 0, 40);
    assert_eq!(s.slots[l2].unmet[0].load(Relaxed), 40);
    // H dies with 60 still borrowed: they go back to L2 as H is reclaimed.
    s.reclaim(h, s.slots[h].word.load(Relaxed), 1);
    assert_eq!((s.slots[l2].unmet[0].load(Relaxed), dev(s).held.load(Relaxed)), (100, 250));
}

/// A lender that is gone gets nothing back (its reserve left with it); one that refilled its
/// reserve by freeing memory of its own takes back no more than its reserve.
#[test]
fn a_loan_never_refills_a_dead_lender_nor_past_a_reserve() {
    let s = fresh(Policy::Priority, 100);
    let (l, h) = (member(s, 30, 0), member(s, 31, 9));
    s.claim_reserve(l, 0, 50).unwrap();
    s.charge(h, 0, 100).unwrap();
    s.reclaim(l, s.slots[l].word.load(Relaxed), 1);
    assert_eq!(dev(s).held.load(Relaxed), 100);
    let again = member(s, 32, 0);
    assert_eq!(again, l, "the slot is taken again: another member, another generation");
    s.uncharge(h, 0, 100);
    assert_eq!((s.slots[again].unmet[0].load(Relaxed), dev(s).held.load(Relaxed)), (0, 0));
    // The lender frees its own memory while its loan is out (its reserve fills again from
    // that), then grows to its whole reserve: the borrower's free then gives it nothing more.
    let s = fresh(Policy::Priority, 200);
    let (l, h, m) = (member(s, 40, 0), member(s, 41, 9), member(s, 42, 0));
    s.claim_reserve(l, 0, 50).unwrap();
    s.charge(l, 0, 20).unwrap();
    s.charge(m, 0, 50).unwrap();
    s.charge(h, 0, 130).unwrap();
    assert_eq!(s.borrowed(h, 0), 30);
    s.uncharge(l, 0, 20);
    assert_eq!(s.slots[l].unmet[0].load(Relaxed), 20, "its own frees fill its reserve");
    s.uncharge(m, 0, 50);
    s.charge(l, 0, 50).unwrap();
    assert_eq!((s.slots[l].unmet[0].load(Relaxed), dev(s).held.load(Relaxed)), (0, 180));
    s.uncharge(h, 0, 130);
    assert_eq!((s.slots[l].unmet[0].load(Relaxed), dev(s).held.load(Relaxed), s.borrowed(h, 0)), (0, 50, 0));
}

/// A member joining a group with a headroom of 240 in a budget of 1200 (the documented "+1"
/// example, in MiB).
fn start(s: &Shared, pid: u32) -> usize {
    let i = member(s, pid, 0);
    let req = crate::group_ledger::join::Request { policy: None, priority: 0, mode: crate::config::CapMode::Enforce, headroom: Some(&[240]), reserve: &[] };
    s.join(i, &[0], &req, &|_| {}).unwrap();
    i
}

/// Issue 25 item 2: four jobs of 240 started one after another, then a fifth (or a restart whose
/// predecessor still holds its memory): it fits whoever held the headroom before it, in any
/// start order; the first member never uses the headroom, and a sixth finds it in use.
#[test]
fn the_plus_one_job_fits_whatever_the_start_order() {
    // One after another: each starts once the one before holds its memory.
    let s = fresh(Policy::Shared, 1200);
    let first = start(s, 1);
    s.charge(first, 0, 240).unwrap();
    let mut jobs = vec![first];
    for pid in 2..=4 {
        let j = start(s, pid);
        s.charge(j, 0, 240).unwrap();
        jobs.push(j);
    }
    assert!(matches!(rule(s.charge(first, 0, 1)), Rule::Headroom { headroom: 240 }), "the first never uses it");
    let fifth = start(s, 5);
    s.charge(fifth, 0, 240).unwrap();
    assert_eq!(dev(s).held.load(Relaxed), 1200);
    let sixth = start(s, 6);
    assert!(s.charge(sixth, 0, 1).is_err(), "the headroom is in use: nothing for a sixth");
    // The fifth exits; a restart of the fourth while the fourth still drains fits too.
    s.reclaim(fifth, s.slots[fifth].word.load(Relaxed), 1);
    s.reclaim(sixth, s.slots[sixth].word.load(Relaxed), 1);
    let restart = start(s, 7);
    s.charge(restart, 0, 240).unwrap();

    // All four late, the holder (the last to start) allocates first: the fourth to allocate
    // needs the headroom and takes it from the holder, which does not use it.
    let s = fresh(Policy::Shared, 1200);
    let first = start(s, 1);
    s.charge(first, 0, 240).unwrap();
    let late: Vec<usize> = (2..=5).map(|pid| start(s, pid)).collect();
    assert!(s.holds_headroom(late[3]), "the last to start holds it");
    for &j in [late[3], late[0], late[1]].iter() {
        s.charge(j, 0, 240).unwrap();
    }
    s.charge(late[2], 0, 240).unwrap();
    assert!(s.holds_headroom(late[2]) && dev(s).held.load(Relaxed) == 1200);

    // None late (the four started before any held memory): the fifth is the late one.
    let s = fresh(Policy::Shared, 1200);
    let four: Vec<usize> = (1..=4).map(|pid| start(s, pid)).collect();
    for &j in &four {
        s.charge(j, 0, 240).unwrap();
    }
    let fifth = start(s, 5);
    s.charge(fifth, 0, 240).unwrap();
}

/// A holder that used the headroom and freed it keeps no claim on it: the next late starter
/// that needs it gets it. One that uses it keeps it (nothing is taken back).
#[test]
fn an_idle_holder_does_not_keep_the_headroom() {
    let s = fresh(Policy::Shared, 1200);
    let first = start(s, 1);
    s.charge(first, 0, 960).unwrap();
    let a = start(s, 2);
    s.charge(a, 0, 240).unwrap();
    let b = start(s, 3);
    assert!(!s.holds_headroom(b) && s.charge(b, 0, 1).is_err(), "A uses it");
    s.uncharge(a, 0, 240);
    s.charge(b, 0, 240).unwrap();
    assert!(s.holds_headroom(b) && !s.holds_headroom(a));
    assert!(s.charge(a, 0, 1).is_err(), "A lost it to B, which uses it");
}

/// Issue 26: the group's mode. The first member sets it; enforce always wins over a running
/// group; a member alone (the others gone) sets it again.
#[test]
fn the_groups_mode_is_its_first_members_and_enforce_wins() {
    use crate::config::CapMode::{Enforce, Observe};
    use crate::group_ledger::join::{ModeJoin, Request};
    let req = |mode| Request { policy: None, priority: 0, mode, headroom: None, reserve: &[] };
    let s = fresh(Policy::Shared, 1200);
    let a = member(s, 1, 0);
    assert_eq!(s.join(a, &[0], &req(Observe), &|_| {}).unwrap().mode, None, "the first member sets it");
    assert!(s.observing());
    let b = member(s, 2, 0);
    assert_eq!(s.join(b, &[0], &req(Observe), &|_| {}).unwrap().mode, None);
    let c = member(s, 3, 0);
    assert_eq!(s.join(c, &[0], &req(Enforce), &|_| {}).unwrap().mode, Some(ModeJoin::GroupNowEnforces));
    assert!(!s.observing(), "one member enforcing: every member enforces");
    let d = member(s, 4, 0);
    assert_eq!(s.join(d, &[0], &req(Observe), &|_| {}).unwrap().mode, Some(ModeJoin::AdoptedEnforce));
    assert!(!s.observing());
    // The others gone (the sweep empties their slots): the one left sets the mode.
    let sweep = |s: &Shared| {
        for i in [a, b, c] {
            s.reclaim(i, s.slots[i].word.load(Relaxed), 9);
        }
    };
    assert_eq!(s.join(d, &[0], &req(Observe), &sweep).unwrap().mode, Some(ModeJoin::Reset { was: Enforce }));
    assert!(s.observing());
    assert!(s.enforce(), "the operator's switch says it observed");
    assert!(!s.observing() && !s.enforce());
}
