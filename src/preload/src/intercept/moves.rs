//! Device memory that changes in the driver's books without passing through vramcap's
//! reserve → commit (allocations) or uncommit → unreserve (frees): a managed prefetch moves pages
//! on or off a device while their charge stays on the allocation's own device; the last free of a
//! destroyed pool's allocations and a pool's destroy give the pool's memory back inside the
//! driver call, and vramcap releases its charge only after. The overhead measurement
//! (`overhead::quiet_read_with`) takes the books at their word only when its counts stood still;
//! during such a call they do while the books move, and another thread's context would be
//! charged (or credited) what moved: a cap bypass or a false denial (found by an attack review).
//!
//! So each such call is a *move*: [`Moving`] counts it in flight from before its driver call until
//! vramcap's own bookkeeping for it has settled, then counts it done. A reading is trusted only
//! when no move was in flight at either of its two looks and none completed between them
//! ([`Look`]). Pools' and graph memory's trims (at a synchronize, `cuMemPoolTrimTo`, pressure
//! relief, `cuDeviceGraphMemTrim`) are not marked: the reading counts pools and graph memory at
//! the driver's word ([`pools`]), which costs the synchronize nothing.
//!
//! Never on the allocation path: `cuMemAlloc`/`cuMemFree` mark nothing; a stream-ordered
//! allocation pays one add and one subtract (`pool_table::reserving`), a stream-ordered free a
//! look at its pool (a destroyed one's?) before its call rather than only after.

use crate::ledger::MAX_DEVICES;
use std::sync::atomic::{AtomicU64, Ordering};

/// Per device, and one more slot for moves that may touch any device (a prefetch: its sources and
/// destinations are many). Moves in flight, and moves ever completed (only grows, wrapping).
struct Counts {
    in_flight: AtomicU64,
    done: AtomicU64,
    /// Bytes completed moves may have changed the books by that vramcap's counts never follow
    /// (only grows, wrapping): see [`Moving::on`].
    unfollowed: AtomicU64,
}

const ANY: usize = MAX_DEVICES;
static COUNTS: [Counts; MAX_DEVICES + 1] = [const { Counts { in_flight: AtomicU64::new(0), done: AtomicU64::new(0), unfollowed: AtomicU64::new(0) } }; MAX_DEVICES + 1];

/// A move of `dev`'s memory (`None`: of any device's) under way, from its creation (before the
/// driver call) until dropped (after vramcap's counts for it settled).
pub struct Moving(usize, u64);

impl Moving {
    /// `unfollowed`: how far the books may move for good without vramcap's counts following (a
    /// prefetch: its pages leave or reach a device while their charge stays where it was; 0 for a
    /// move whose charge is released after it). A measurement that spans such a move (a context
    /// made meanwhile) cannot tell the move's part from its own by up to that much.
    pub fn on(dev: Option<usize>, unfollowed: u64) -> Moving {
        let i = dev.filter(|&d| d < MAX_DEVICES).unwrap_or(ANY);
        // SeqCst, as the looks are: a reading whose books saw the move's effect (which comes
        // after this in the moving thread) must see this count at its second look.
        COUNTS[i].in_flight.fetch_add(1, Ordering::SeqCst);
        Moving(i, unfollowed)
    }
}

impl Drop for Moving {
    fn drop(&mut self) {
        // `done` first: a look that sees the move no longer in flight sees it completed.
        COUNTS[self.0].unfollowed.fetch_add(self.1, Ordering::SeqCst);
        COUNTS[self.0].done.fetch_add(1, Ordering::SeqCst);
        COUNTS[self.0].in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The moves of `dev` (and of any device) at one look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Look {
    in_flight: u64,
    done: u64,
    unfollowed: u64,
}

impl Look {
    /// No move under way at this look.
    pub fn still(&self) -> bool {
        self.in_flight == 0
    }

    /// How far the books may have moved, between `self` and the later look `then`, without
    /// vramcap's counts following.
    pub fn unfollowed_until(&self, then: &Look) -> u64 {
        then.unfollowed.wrapping_sub(self.unfollowed)
    }
}

pub fn look(dev: usize) -> Look {
    let at = |i: usize| {
        COUNTS.get(i).map_or((0, 0, 0), |c| {
            (c.in_flight.load(Ordering::SeqCst), c.done.load(Ordering::SeqCst), c.unfollowed.load(Ordering::SeqCst))
        })
    };
    let (a, b) = (at(dev), at(ANY));
    Look { in_flight: a.0 + b.0, done: a.1.wrapping_add(b.1), unfollowed: a.2.wrapping_add(b.2) }
}

/// What the pools and the graph memory on `dev` reserve by the driver's word, their charge, and
/// the reservations in flight for stream-ordered allocations (`pool_table::reserving`): a trim
/// the driver made (inside a synchronize) moves the books before vramcap settles the charge after
/// the call, and an allocation's pool grows before it is settled, so a reading counts the
/// driver's word, and such an allocation in flight is no uncertainty
/// (`overhead::quiet_read_with`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Pools {
    pub driver: u64,
    pub charged: u64,
    pub reserving: u64,
}

pub fn pools(dev: usize) -> Pools {
    let (a, b) = (super::pool_table::reserved_vs_charged(dev), super::graph::reserved_vs_charged(dev));
    Pools { driver: a.0.saturating_add(b.0), charged: a.1.saturating_add(b.1), reserving: a.2 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_seen_in_flight_and_then_as_done() {
        let d = 33;
        let a = look(d);
        assert!(a.still());
        let m = Moving::on(Some(d), 7);
        let b = look(d);
        assert!(!b.still(), "in flight");
        assert_eq!(a.unfollowed_until(&b), 0, "not before it completed");
        drop(m);
        let c = look(d);
        assert!(c.still());
        assert_ne!(a, c, "a move came and went: not the same look");
        assert_eq!(a.unfollowed_until(&c), 7);
        // (Any device's move, `Moving::on(None, ..)`, would show in every other test's looks: the
        // prefetch tests in tests/preload/overhead_attack.rs cover it.)
    }
}
