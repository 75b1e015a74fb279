//! Giving back unused memory when a neighbour needs it (issue 17, item 4).
//!
//! A member that is denied, or whose request makes the group's free budget fall below the
//! headroom, bumps the ledger's pressure count. Every member compares that count with the last
//! one it answered at each of its driver calls (one load) and, when it moved, trims its own
//! stream-ordered pools and graph memory (`intercept::pressure::relieve`) in its own thread,
//! then records the count in its slot. The denied member waits, bounded, until every other live
//! member has answered or the budget has room, then retries once.

use super::shm::{SlotWord, State};
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// The longest a denied member waits for its neighbours (docs/configuration.md).
pub const WAIT: Duration = Duration::from_millis(100);
/// A member waits at most once per this interval; within it, a denial only signals.
const WAIT_INTERVAL: Duration = Duration::from_secs(1);

static SEEN: AtomicU64 = AtomicU64::new(0);
static LAST_WAIT_MS: AtomicU64 = AtomicU64::new(0);

/// The pressure count to answer, when it moved since this process last answered.
#[inline]
pub fn pending() -> Option<u64> {
    let s = super::shared()?;
    let p = s.header.pressure.load(Relaxed);
    (p != SEEN.load(Relaxed)).then_some(p)
}

/// Records that this process answered count `p` (after trimming).
pub fn answered(p: u64) {
    SEEN.store(p, Relaxed);
    if let Some((s, i)) = super::me() {
        s.slots[i].pressure_seen.store(p, Release);
    }
}

fn now_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000 + 1
}

/// A denied member asks the others to trim. Returns whether it waited for them (then the
/// caller retries once); false when it is alone or waited less than a second ago.
#[cold]
pub fn ask(dev: usize, size: u64) -> bool {
    let Some((s, me)) = super::me() else {
        return false;
    };
    let p = s.header.pressure.fetch_add(1, AcqRel) + 1;
    // Our own pools were trimmed already (the caller did): answer our own call.
    answered(p);
    let others: Vec<usize> =
        (0..s.slots.len()).filter(|&j| j != me && SlotWord::unpack(s.slots[j].word.load(Acquire)).state == State::Live).collect();
    let (last, now) = (LAST_WAIT_MS.load(Relaxed), now_ms());
    if others.is_empty() || (last != 0 && now.saturating_sub(last) < WAIT_INTERVAL.as_millis() as u64) {
        return false;
    }
    LAST_WAIT_MS.store(now, Relaxed);
    let e = super::entry(dev);
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        let all = others.iter().all(|&j| {
            let sl = &s.slots[j];
            sl.pressure_seen.load(Acquire) >= p || SlotWord::unpack(sl.word.load(Acquire)).state != State::Live
        });
        let room = e.is_some_and(|e| {
            let d = &s.devices[e];
            let limit = d.limit.load(Acquire);
            limit == 0 || d.held.load(Acquire).saturating_add(size) <= limit
        });
        if all || room {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}
