//! One stderr line per denial, rate-limited so a job retrying in a loop cannot flood its log,
//! and the count of every denial per device (the trace summary's `denied`).

use crate::log::{Level, enabled, monotonic_ns, write_line};
use std::sync::atomic::{AtomicU64, Ordering};
use vramcap_common::grammar::size::human;
use vramcap_common::group_ledger::shm::Rule;

/// At most one denial line per this many nanoseconds; the rest are counted and summarised.
const DENIAL_INTERVAL_NS: u64 = 1_000_000_000;
static LAST_DENIAL_NS: AtomicU64 = AtomicU64::new(0);
static SUPPRESSED: AtomicU64 = AtomicU64::new(0);

/// Holds a denial line back; the first time, arranges for one line at exit saying how many were
/// never followed by a printed line that counted them.
#[cold]
fn suppress() {
    SUPPRESSED.fetch_add(1, Ordering::Relaxed);
    static AT_EXIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !AT_EXIT.swap(true, Ordering::AcqRel) {
        extern "C" fn child() {
            SUPPRESSED.store(0, Ordering::Relaxed);
        }
        unsafe {
            libc::atexit(suppressed_at_exit);
            libc::pthread_atfork(None, None, Some(child));
        }
    }
}

extern "C" fn suppressed_at_exit() {
    let n = SUPPRESSED.swap(0, Ordering::Relaxed);
    if n > 0 {
        write_line(&format!("vramcap: {n} more denial(s) not shown (at most one denial line per second is printed)"));
    }
}

/// One line per denial, rate-limited so a job retrying in a loop cannot flood its log.
pub fn denied(api: &str, dev: usize, size: u64, used: u64, limit: u64) {
    let d = crate::ledger::Denied { used, limit, group: false, rule: Rule::Budget };
    denied_in(api, dev, size, &d, None)
}

/// Every denial per device, printed or not (the trace summary's `denied`).
static DENIALS: [AtomicU64; crate::ledger::MAX_DEVICES] = [const { AtomicU64::new(0) }; crate::ledger::MAX_DEVICES];

/// Denials on `dev` since the process started (a forked child counts its own from 0).
pub fn count(dev: usize) -> u64 {
    DENIALS.get(dev).map_or(0, |d| d.load(Ordering::Relaxed))
}

/// In a forked child: its own denials, its own held-back lines (the parent reports its own).
pub fn after_fork_child() {
    for d in &DENIALS {
        d.store(0, Ordering::Relaxed);
    }
    SUPPRESSED.store(0, Ordering::Relaxed);
}

/// [`denied`], naming the group whose budget refused (`used`/`limit` are then the group's).
pub fn denied_in(api: &str, dev: usize, size: u64, d: &crate::ledger::Denied, group: Option<&str>) {
    let (used, limit) = (d.used, d.limit);
    if let Some(d) = DENIALS.get(dev) {
        d.fetch_add(1, Ordering::Relaxed);
    }
    if !enabled(Level::Warn) {
        return;
    }
    let now = monotonic_ns();
    let last = LAST_DENIAL_NS.load(Ordering::Relaxed);
    if last != 0 && now.saturating_sub(last) < DENIAL_INTERVAL_NS {
        suppress();
        return;
    }
    if LAST_DENIAL_NS.compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed).is_err() {
        suppress();
        return;
    }
    let suppressed = SUPPRESSED.swap(0, Ordering::Relaxed);
    let h = human;
    let scope = group.map_or(String::new(), |g| format!("group \"{g}\" "));
    let more = if suppressed > 0 { format!(" ({suppressed} more denials not shown)") } else { String::new() };
    let rule = rule_text(&d.rule);
    write_line(&format!(
        "vramcap: denied {api} of {size} bytes ({}) on device {dev}: used {used} ({}) of {scope}limit {limit} ({}){rule}{more}",
        h(size),
        h(used),
        h(limit)
    ));
}

/// Which of the group's rules refused, as the denial line says it (issue 17).
pub fn rule_text(r: &Rule) -> String {
    let h = human;
    match *r {
        Rule::Budget => String::new(),
        Rule::Headroom { headroom } => format!(": headroom {} kept for a member not running yet", h(headroom)),
        Rule::Share { share, budget, members } => format!(": equal share {} of {} among {members} members", h(share), h(budget)),
        Rule::Reserved { bytes, pid, comm, higher } => format!(
            ": reserved for {}: {} (pid {pid} \"{}\")",
            if higher { "higher priority" } else { "other members" },
            h(bytes),
            vramcap_common::group_ledger::join::comm_of(&comm)
        ),
    }
}
