//! Observe mode (issue 26, `VRAMCAP_MODE=observe`): a cap that only watches. Every allocation
//! the cap would refuse is granted and recorded (a `would_deny` event, a count per device, a
//! stderr line at most once a second), and the job sees the physical device: `cuMemGetInfo`,
//! `cuDeviceTotalMem` and NVML are not rewritten. So an operator can see what a cap would have
//! refused before turning it on.
//!
//! Nothing here is on the allocation path: the ledger still decides every request with its one
//! compare-and-swap, and only a request it refuses reaches [`grant`] (the cold deny path),
//! which then charges it without the limit, as the driver's memory exists either way. Once
//! over the limit every further request takes this path, which is what a cap would have done.
//!
//! Observe holds only where nobody enforces: with a ceiling file only a `VRAMCAP_MODE=observe`
//! line in the file turns it on (the configuration refuses the environment's), and in a group
//! only while the group's ledger says observe (the first member sets it; a member that enforces
//! makes the group enforce, `group_ledger::join`). The group's word is re-read at each would-be
//! denial, so a group that starts enforcing is obeyed at the next allocation that does not fit.

use crate::config::{self, CapMode};
use crate::events::{self, Api, Event, NO_GROUP, Op};
use crate::ledger::{self, Denied, MAX_DEVICES};
use crate::log::{monotonic_ns, write_line};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use vramcap_common::grammar::size::human;
use vramcap_common::trace::WouldDenyCap;

/// Would-be denials per device since the process started (the summary's `would_deny`).
static COUNT: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Devices whose process limit is the ceiling file's (the environment asked for more or none).
static FROM_CEILING: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];
/// When the last observe line was printed (monotonic ns, 0: never).
static LAST_LINE_NS: AtomicU64 = AtomicU64::new(0);
const LINE_INTERVAL_NS: u64 = 1_000_000_000;

/// Whether this process asked for observe mode (after the ceiling file had its say).
pub fn configured() -> bool {
    let c = config::get();
    c.error.is_none() && !c.disabled && c.mode == CapMode::Observe
}

/// Whether an allocation that does not fit is granted now: this process observes, and so does
/// its group if it has one. Not for the allocation path (reads the configuration and the
/// group's ledger).
pub fn active() -> bool {
    configured() && crate::group::observing()
}

/// Whether the memory queries show the physical device (observe mode) rather than the cap.
pub fn physical_view() -> bool {
    active()
}

/// Records which devices' limits are the ceiling file's (at start and when it changes): where
/// the process's limit, as capped, is the file's (the environment asked for more, the same or
/// none), the file would have refused what the limit refuses.
pub fn set_from_ceiling(limits: &[u64], ceiling: &[u64]) {
    for (d, f) in FROM_CEILING.iter().enumerate().take(limits.len()) {
        let c = ceiling.get(d).copied().unwrap_or(0);
        f.store(c != 0 && limits[d] == c, Ordering::Relaxed);
    }
}

/// Whether the trace's summary carries `would_deny`: the process observes, or did (its group
/// may have started enforcing since).
pub fn summarised() -> bool {
    configured() && (active() || COUNT.iter().any(|c| c.load(Ordering::Relaxed) > 0))
}

/// Would-be denials on `dev` so far (a forked child counts its own from 0).
pub fn count(dev: usize) -> u64 {
    COUNT.get(dev).map_or(0, |c| c.load(Ordering::Relaxed))
}

pub fn after_fork_child() {
    for c in &COUNT {
        c.store(0, Ordering::Relaxed);
    }
}

/// The deny path: in observe mode, charges `charge` bytes on `dev` (for a request of `size`) as
/// a reservation the caller commits or rolls back as usual, records the would-be denial, and
/// returns true; otherwise false (the caller refuses). `d` is what the ledger refused with;
/// `api` and `name` the entry point.
#[cold]
#[inline(never)]
pub fn grant(api: Api, name: &str, dev: usize, size: u64, charge: u64, d: &Denied) -> bool {
    if !configured() {
        return false;
    }
    if !crate::group::observing() {
        say_group_enforces();
        return false;
    }
    ledger::charge_reserved(dev, charge);
    if let Some(c) = COUNT.get(dev) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    let cap = if d.group {
        WouldDenyCap::Group
    } else if FROM_CEILING.get(dev).is_some_and(|f| f.load(Ordering::Relaxed)) {
        WouldDenyCap::Ceiling
    } else {
        WouldDenyCap::Process
    };
    if events::enabled() {
        let group_used = crate::group::view(dev).map_or(NO_GROUP, |(_, u)| u);
        // `ptr`, `result` and `dur` carry the limit, the cap and its charge (`Op::WouldDeny`).
        let ev = Event { op: Op::WouldDeny, api, dev: dev as i32, ptr: d.limit, size, result: cap as i32, dur: d.used, used: ledger::used(dev), group_used };
        events::emit(ev, crate::clock::ticks());
    }
    say(name, dev, size, d, cap);
    true
}

/// At most one line a second; the timestamp test is the only cost of the ones not printed.
fn say(api: &str, dev: usize, size: u64, d: &Denied, cap: WouldDenyCap) {
    let now = monotonic_ns();
    let last = LAST_LINE_NS.load(Ordering::Relaxed);
    if (last != 0 && now.saturating_sub(last) < LINE_INTERVAL_NS)
        || LAST_LINE_NS.compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed).is_err()
    {
        return;
    }
    let scope = match (cap, crate::group::name()) {
        (WouldDenyCap::Group, Some(g)) => format!("group \"{g}\" "),
        (WouldDenyCap::Ceiling, _) => format!("{} ", config::ceiling::PATH),
        _ => String::new(),
    };
    let total: u64 = (0..MAX_DEVICES).map(count).sum();
    write_line(&format!(
        "vramcap: observe mode: granted {api} of {size} bytes ({}) on device {dev} that the {scope}limit {} would have refused \
         (charged {}); {total} would-be denial(s) so far (VRAMCAP_MODE=observe: nothing is refused)",
        human(size),
        human(d.limit),
        human(d.used)
    ));
}

/// Whether this process was told that its group enforces (at its start, or since).
static GROUP_ENFORCES_SAID: AtomicBool = AtomicBool::new(false);

/// The member's start said it already (`group::sharing`): one line, not two.
pub fn group_enforces_said() {
    GROUP_ENFORCES_SAID.store(true, Ordering::Relaxed);
}

/// Once: this process asked for observe, and its group enforces now.
#[cold]
fn say_group_enforces() {
    if !GROUP_ENFORCES_SAID.swap(true, Ordering::Relaxed) {
        write_line(&format!(
            "vramcap: group \"{}\" enforces its budget now (a member that enforces joined it, or `vramcap limit --enforce`): \
             this process's allocations that do not fit are refused, VRAMCAP_MODE=observe notwithstanding",
            crate::group::name().unwrap_or("")
        ));
    }
}
