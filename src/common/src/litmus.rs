//! A store-buffering race run many times over, for the tests of the ledgers' live limit change
//! (the process's own in src/preload/src/ledger.rs, the group's in `group_ledger::admit`).
//!
//! One side stores (a new limit) and then loads (what is charged); the other read-modify-writes
//! (its charge) and then loads (the limit). Sequential consistency promises that at least one
//! side sees the other; weaker orderings let both miss, which on x86 happens when the first
//! side's load passes its own store still in the store buffer. Each round starts both sides
//! together and then delays each by a different number of spins, so that over the rounds their
//! offsets sweep the few nanoseconds in which the miss can happen.

use std::sync::atomic::{AtomicU32, Ordering::*};

/// Runs `rounds` rounds of `shrink` (on this thread, returns what it read as charged) against
/// `reserve` (on another, returns whether it was granted), `reset` before each; returns the
/// rounds in which `reserve` was granted and `shrink` read nothing charged: both missed.
pub fn store_buffering_rounds(rounds: u32, reset: impl Fn(), shrink: impl Fn() -> u64, reserve: impl Fn() -> bool + Sync) -> u32 {
    let (arrived, granted) = (AtomicU32::new(0), AtomicU32::new(0));
    let meet = |round: u32, side: u32| {
        // Two arrivals per round, counted over all rounds: side `side` of `round` is done
        // waiting once both sides of it arrived.
        arrived.fetch_add(1, AcqRel);
        let want = 2 * round + 2;
        let mut spins = 0u32;
        while arrived.load(Acquire) < want {
            spins += 1;
            if spins.is_multiple_of(1024) {
                std::thread::yield_now(); // the other side may not be running (a busy machine)
            } else {
                std::hint::spin_loop();
            }
        }
        let delay = if side == 0 { round % 32 } else { (round / 32) % 32 };
        for _ in 0..delay {
            std::hint::spin_loop();
        }
    };
    let done = AtomicU32::new(0);
    let mut missed = 0;
    std::thread::scope(|t| {
        t.spawn(|| {
            for round in 0..rounds {
                meet(round, 1);
                granted.store(reserve() as u32, Release);
                done.store(round + 1, Release);
            }
        });
        for round in 0..rounds {
            reset();
            meet(round, 0);
            let seen = shrink();
            let mut spins = 0u32;
            while done.load(Acquire) < round + 1 {
                spins += 1;
                if spins.is_multiple_of(1024) {
                    std::thread::yield_now(); // as in `meet`: the other side may be descheduled
                } else {
                    std::hint::spin_loop();
                }
            }
            if granted.load(Acquire) == 1 && seen == 0 {
                missed += 1;
            }
        }
    });
    missed
}
