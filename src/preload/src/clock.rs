//! Cheap timestamps for events. Reading CLOCK_MONOTONIC costs ~20 ns even through the vDSO and an
//! event needs two reads (start and end of the driver call); the CPU's invariant time-stamp
//! counter costs ~8 ns. The allocating thread stores raw ticks; the writer thread converts them to
//! nanoseconds with a calibration it keeps refining against CLOCK_MONOTONIC.
//!
//! The counter is used only where the kernel itself trusts it (its clocksource is `tsc`, or the
//! ARM generic timer); otherwise ticks are plain monotonic nanoseconds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static USE_COUNTER: AtomicBool = AtomicBool::new(false);
/// A reference pair taken when recording started.
static REF_TICKS: AtomicU64 = AtomicU64::new(0);
static REF_NS: AtomicU64 = AtomicU64::new(0);

pub fn monotonic_ns() -> u64 {
    crate::log::monotonic_ns()
}

#[inline]
fn raw_counter() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(target_arch = "aarch64")]
    {
        let v: u64;
        unsafe { core::arch::asm!("mrs {}, cntvct_el0", out(reg) v, options(nomem, nostack)) };
        v
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        monotonic_ns()
    }
}

/// A timestamp in ticks (see [`Calibration`] for converting).
#[inline]
pub fn ticks() -> u64 {
    if USE_COUNTER.load(Ordering::Relaxed) { raw_counter() } else { monotonic_ns() }
}

/// Decides the tick source and takes the reference pair. Called once, when events are enabled.
pub fn init() {
    let trusted = if cfg!(target_arch = "aarch64") {
        true
    } else if cfg!(target_arch = "x86_64") {
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .map(|s| s.trim() == "tsc")
            .unwrap_or(false)
    } else {
        false
    };
    USE_COUNTER.store(trusted, Ordering::Relaxed);
    let (t, n) = pair();
    REF_TICKS.store(t, Ordering::Relaxed);
    REF_NS.store(n, Ordering::Relaxed);
}

/// A (ticks, monotonic ns) pair read back to back.
fn pair() -> (u64, u64) {
    let t = ticks();
    let n = monotonic_ns();
    (t, n)
}

/// Converts ticks to monotonic nanoseconds. Owned by the writer thread.
pub struct Calibration {
    counter: bool,
    base_ticks: u64,
    base_ns: u64,
    /// Latest pair: conversions anchor here so the error stays within one refresh interval.
    anchor_ticks: u64,
    anchor_ns: u64,
    ns_per_tick: f64,
    /// The first refresh anchors on its pair; later ones only steer.
    calibrated: bool,
    /// The previous lines, newest last: a tick from before the current anchor (an event
    /// published late, such as a free stamped before a long driver call) is converted by the line
    /// that was current at its time, exactly as events drained earlier were.
    past: [(u64, u64, f64); PAST_LINES],
}

const PAST_LINES: usize = 16;

/// How much faster or slower than the measured rate the conversion may run while it catches up
/// with the monotonic clock: 1 ms per second.
const MAX_SLEW: f64 = 1e-3;

impl Calibration {
    /// Needs ~10 ms between `init()` and the first conversion for a usable rate; waits if less,
    /// through `sleep`, which returns false to stop waiting: a process that exits sooner is not
    /// held up (its events all lie within the measured span, converted from an anchor taken at
    /// the end of it, so a short span costs them no accuracy; only extrapolating needs the 10 ms).
    pub fn new(sleep: &dyn Fn(std::time::Duration) -> bool) -> Calibration {
        let counter = USE_COUNTER.load(Ordering::Relaxed);
        let (bt, bn) = (REF_TICKS.load(Ordering::Relaxed), REF_NS.load(Ordering::Relaxed));
        let mut c = Calibration { counter, base_ticks: bt, base_ns: bn, anchor_ticks: bt, anchor_ns: bn, ns_per_tick: 1.0, calibrated: false, past: [(0, 0, 0.0); PAST_LINES] };
        if counter {
            while monotonic_ns().saturating_sub(bn) < 10_000_000 {
                if !sleep(std::time::Duration::from_millis(2)) {
                    break;
                }
            }
            c.refresh();
        }
        c
    }

    /// Re-measures the rate over the whole span since recording started and re-anchors, keeping
    /// the conversion continuous: the new line starts where the old one is at this moment, and
    /// its slope steers toward the monotonic clock by at most [`MAX_SLEW`]. Re-anchoring on the
    /// fresh pair itself made the conversion jump by that pair's jitter (a preemption between its
    /// two reads, tens of microseconds on a busy machine), so an event converted after a refresh
    /// could come out earlier than one converted before it that happened later: a free stamped
    /// before the re-allocation of its address then looked like it came after it.
    pub fn refresh(&mut self) {
        if !self.counter {
            return;
        }
        let (t, n) = pair();
        if t > self.base_ticks && n > self.base_ns && t >= self.anchor_ticks {
            let rate = (n - self.base_ns) as f64 / (t - self.base_ticks) as f64;
            let here = if self.calibrated { self.to_ns(t) } else { n };
            // Remove the offset over about a second, never faster than MAX_SLEW.
            let slew = ((n as f64 - here as f64) / 1e9).clamp(-MAX_SLEW, MAX_SLEW);
            if self.calibrated {
                self.past.rotate_left(1);
                self.past[PAST_LINES - 1] = (self.anchor_ticks, self.anchor_ns, self.ns_per_tick);
            }
            self.ns_per_tick = rate * (1.0 + slew);
            self.anchor_ticks = t;
            self.anchor_ns = here;
            self.calibrated = true;
        }
    }

    #[inline]
    pub fn to_ns(&self, ticks: u64) -> u64 {
        if !self.counter {
            return ticks;
        }
        let (mut at, mut ns, mut rate) = (self.anchor_ticks, self.anchor_ns, self.ns_per_tick);
        if ticks < at {
            // Rare (late events only): the newest past line that starts at or before `ticks`.
            for &(t, n, r) in self.past.iter().rev() {
                if r == 0.0 {
                    break;
                }
                (at, ns, rate) = (t, n, r);
                if t <= ticks {
                    break;
                }
            }
        }
        let d = ticks as i128 - at as i128;
        (ns as i128 + (d as f64 * rate) as i128).max(0) as u64
    }

    #[inline]
    pub fn span_ns(&self, ticks: u64) -> u64 {
        if self.counter { (ticks as f64 * self.ns_per_tick) as u64 } else { ticks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converted_ticks_track_the_monotonic_clock() {
        init();
        let c = Calibration::new(&|d| {
            std::thread::sleep(d);
            true
        });
        let t = ticks();
        let n = monotonic_ns();
        let converted = c.to_ns(t);
        assert!(converted.abs_diff(n) < 1_000_000, "converted {converted} vs monotonic {n}");
        let t0 = ticks();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let span = c.span_ns(ticks() - t0);
        assert!((15_000_000..200_000_000).contains(&span), "20 ms measured as {span} ns");
    }

    /// Refreshing never moves a converted time backwards: the conversion stays continuous.
    #[test]
    fn a_refresh_keeps_the_conversion_continuous() {
        init();
        let mut c = Calibration::new(&|d| {
            std::thread::sleep(d);
            true
        });
        if !c.counter {
            return;
        }
        for _ in 0..50 {
            let t = ticks();
            let before = c.to_ns(t);
            std::thread::sleep(std::time::Duration::from_micros(300));
            c.refresh();
            let after = c.to_ns(t);
            assert!(after.abs_diff(before) <= 1_000, "a refresh moved a converted tick by {} ns", after as i64 - before as i64);
        }
        let n = monotonic_ns();
        assert!(c.to_ns(ticks()).abs_diff(n) < 2_000_000);
    }
}
