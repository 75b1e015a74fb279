//! What `report` accumulates per process and device while the merged stream goes by. Memory is
//! bounded by the live allocations (the table that finds leaks and lifetimes) plus a few fixed
//! histograms and short incident lists.

use super::trace::{Event, Op};
use std::collections::HashMap;

/// Pointers come from the trace, and a trace may be crafted (the sidecar's `--trace-dir` files
/// hold clients' lines as received): a plain multiply is invertible, so 40 000 chosen pointers
/// all landed in one bucket chain (2.4 s, 100 000: 68 s, where ordinary ones take 63 ms). The
/// map's hasher is std's keyed SipHash, with a key drawn per process.
pub type PtrMap<V> = HashMap<u64, V>;

#[derive(Clone, Copy, Debug)]
pub struct Live {
    pub size: u64,
    pub t_ns: u64,
    pub api: u16,
}

/// A denial or driver failure, with the usage at that moment.
#[derive(Clone, Copy, Debug)]
pub struct Incident {
    pub t_ns: u64,
    pub api: u16,
    pub size: u64,
    pub result: i64,
    pub used: u64,
}

/// A `limit` event: the cap moved from `old` to `new` (0 = none) at `t_ns`, by `source`
/// (interned: `ceiling` or `group`) and `uid`.
#[derive(Clone, Copy, Debug)]
pub struct LimitChange {
    pub t_ns: u64,
    pub old: u64,
    pub new: u64,
    pub source: u16,
    pub uid: i64,
}

/// The first `would_deny` event of a device (observe mode, issue 26): when, which entry point,
/// how big, and the cap that would have refused it (`cap`: the event's `result`).
#[derive(Clone, Copy, Debug)]
pub struct WouldDeny {
    pub t_ns: u64,
    pub api: u16,
    pub size: u64,
    pub cap: i64,
    pub limit: u64,
    pub charge: u64,
}

/// Lifetime buckets: upper bounds in ns (the last bucket is open).
pub const LIFETIME_BOUNDS: [(u64, &str); 9] = [
    (1_000, "<1us"),
    (10_000, "<10us"),
    (100_000, "<100us"),
    (1_000_000, "<1ms"),
    (10_000_000, "<10ms"),
    (100_000_000, "<100ms"),
    (1_000_000_000, "<1s"),
    (10_000_000_000, "<10s"),
    (100_000_000_000, "<100s"),
];
pub const KEEP_INCIDENTS: usize = 10;
/// Earlier allocations kept per address while their frees may still come: a crafted trace that
/// allocates one address again and again without a free cannot grow the report past this.
pub const SHADOWED_PER_ADDRESS: usize = 64;

#[derive(Debug)]
pub struct DevStats {
    pub index: i32,
    pub used: u64,
    pub peak: u64,
    pub peak_t_ns: u64,
    pub allocs: u64,
    pub frees: u64,
    pub denied: u64,
    pub failed: u64,
    pub other: u64,
    pub alloc_bytes: u64,
    /// Frees whose allocation is not in the trace (made before tracing, or dropped).
    pub unmatched_frees: u64,
    /// Time in the real driver, by op: alloc, free, fail, other.
    pub driver_ns: [u64; 4],
    /// Allocation sizes by power of two: bucket b holds sizes in [2^b, 2^(b+1)).
    pub size_hist: [u64; 64],
    /// Lifetimes of freed allocations; the last bucket is >= 100 s.
    pub life_hist: [u64; LIFETIME_BOUNDS.len() + 1],
    pub denials: Vec<Incident>,
    pub failures: Vec<Incident>,
    /// Limits changed while the process ran (`limit` events), in trace order.
    pub limits: Vec<LimitChange>,
    /// Observe mode: allocations the cap would have refused (`would_deny` events), the first.
    pub would_deny: u64,
    pub first_would_deny: Option<WouldDeny>,
    pub live: PtrMap<Live>,
    /// Overhead (`overhead` / `overhead_free` events): memory the driver took that no allocation
    /// returned, per context, now and at most; counted in `used` too, shown apart.
    pub overhead: u64,
    pub overhead_peak: u64,
    pub overhead_by_ctx: PtrMap<u64>,
    /// Allocations whose address was handed out again before their free appeared in the file,
    /// oldest first: the free may still come (written after the re-allocation, stamped before
    /// it). At most [`SHADOWED_PER_ADDRESS`] per address.
    pub shadowed: PtrMap<Vec<Live>>,
}

impl DevStats {
    pub fn new(index: i32) -> DevStats {
        DevStats {
            index,
            used: 0,
            peak: 0,
            peak_t_ns: 0,
            allocs: 0,
            frees: 0,
            denied: 0,
            failed: 0,
            other: 0,
            alloc_bytes: 0,
            unmatched_frees: 0,
            driver_ns: [0; 4],
            size_hist: [0; 64],
            life_hist: [0; LIFETIME_BOUNDS.len() + 1],
            denials: Vec::new(),
            failures: Vec::new(),
            limits: Vec::new(),
            would_deny: 0,
            first_would_deny: None,
            live: PtrMap::default(),
            overhead: 0,
            overhead_peak: 0,
            overhead_by_ctx: PtrMap::default(),
            shadowed: PtrMap::default(),
        }
    }

    /// Applies one event of this process on this device.
    #[inline]
    pub fn apply(&mut self, e: &Event) {
        match e.op {
            Op::Alloc => {
                self.allocs += 1;
                self.alloc_bytes += e.size;
                self.size_hist[63 - e.size.max(1).leading_zeros() as usize] += 1;
                self.driver_ns[0] += e.dur_ns;
                self.used = next_used(self.used, e);
                if let Some(old) = self.live.insert(e.ptr, Live { size: e.size, t_ns: e.t_ns, api: e.api }) {
                    // The address is in use again, so the old allocation was freed: its free
                    // was dropped, or comes later in the file (see `Op::Free`).
                    self.shadow(e.ptr, old);
                }
            }
            Op::Free => {
                self.frees += 1;
                self.driver_ns[1] += e.dur_ns;
                self.used = next_used(self.used, e);
                let found = if self.shadowed.is_empty() || !self.shadowed.contains_key(&e.ptr) {
                    self.live.remove(&e.ptr)
                } else {
                    self.take_freed(e.ptr, e.t_ns)
                };
                match found {
                    Some(l) => {
                        let life = e.t_ns.saturating_sub(l.t_ns);
                        let b = LIFETIME_BOUNDS.iter().position(|(ub, _)| life < *ub).unwrap_or(LIFETIME_BOUNDS.len());
                        self.life_hist[b] += 1;
                    }
                    None => self.unmatched_frees += 1,
                }
            }
            Op::Deny | Op::Fail => {
                self.used = next_used(self.used, e);
                let inc = Incident { t_ns: e.t_ns, api: e.api, size: e.size, result: e.result, used: self.used };
                if e.op == Op::Deny {
                    self.denied += 1;
                    if self.denials.len() < KEEP_INCIDENTS {
                        self.denials.push(inc);
                    }
                } else {
                    self.failed += 1;
                    self.driver_ns[2] += e.dur_ns;
                    if self.failures.len() < KEEP_INCIDENTS {
                        self.failures.push(inc);
                    }
                }
            }
            Op::Limit => {
                // Bounded like incidents: a trace cannot make the report hold millions.
                if self.limits.len() < KEEP_INCIDENTS * 10 {
                    self.limits.push(LimitChange { t_ns: e.t_ns, old: e.ptr, new: e.size, source: e.api, uid: e.result });
                }
            }
            Op::WouldDeny => {
                // Granted all the same: the `alloc` that follows moves the charge.
                self.would_deny += 1;
                self.first_would_deny.get_or_insert(WouldDeny { t_ns: e.t_ns, api: e.api, size: e.size, cap: e.result, limit: e.ptr, charge: e.dur_ns });
            }
            Op::Overhead | Op::OverheadFree => {
                self.used = next_used(self.used, e);
                // `overhead` says what the context holds now, `overhead_free` what it gave back.
                let was = self.overhead_by_ctx.get(&e.ptr).copied().unwrap_or(0);
                let now = if e.op == Op::Overhead { e.size } else { was.saturating_sub(e.size) };
                if now == 0 {
                    self.overhead_by_ctx.remove(&e.ptr);
                } else {
                    self.overhead_by_ctx.insert(e.ptr, now);
                }
                self.overhead = self.overhead.saturating_sub(was).saturating_add(now);
                self.overhead_peak = self.overhead_peak.max(self.overhead);
            }
            Op::Map | Op::Unmap | Op::Reserve | Op::HostAlloc | Op::HostFree | Op::IpcOpen | Op::Other => {
                self.used = next_used(self.used, e);
                self.other += 1;
                self.driver_ns[3] += e.dur_ns;
            }
        }
        if self.used > self.peak {
            self.peak = self.used;
            self.peak_t_ns = e.t_ns;
        }
    }

    #[cold]
    fn shadow(&mut self, ptr: u64, old: Live) {
        let v = self.shadowed.entry(ptr).or_default();
        if v.len() >= SHADOWED_PER_ADDRESS {
            v.remove(0);
        }
        v.push(old);
    }

    /// The allocation that a free at `ptr` stamped `t` ends, when earlier allocations at that
    /// address are still open: events are in causal order by `t_ns`, not by file order (`seq`).
    /// A free is stamped before its driver call and an allocation after its own, so the
    /// allocation a free ends is the latest one at that address stamped before the free (the
    /// next one there could only be made after the free). A thread delayed between stamping and
    /// writing puts its free after later allocations and frees of the same address in the file.
    /// With no allocation stamped before the free (clocks that disagree), file order decides.
    #[cold]
    fn take_freed(&mut self, ptr: u64, t: u64) -> Option<Live> {
        let live_t = self.live.get(&ptr).map(|l| l.t_ns).filter(|&lt| lt <= t);
        let older = self.shadowed.get_mut(&ptr)?;
        let best = older.iter().enumerate().filter(|(_, l)| l.t_ns <= t).max_by_key(|(_, l)| l.t_ns).map(|(i, l)| (i, l.t_ns));
        let from_older = match (live_t, best) {
            (Some(lt), Some((i, bt))) if bt > lt => Some(i),
            (Some(_), _) => None,
            (None, Some((i, _))) => Some(i),
            (None, None) => None,
        };
        match from_older {
            Some(i) => {
                let l = older.remove(i);
                if older.is_empty() {
                    self.shadowed.remove(&ptr);
                }
                Some(l)
            }
            None => self.live.remove(&ptr),
        }
    }

    pub fn leaked_bytes(&self) -> u64 {
        self.live.values().map(|l| l.size).sum()
    }

    /// The largest allocations still held at the end.
    pub fn largest_leaks(&self, n: usize) -> Vec<(u64, Live)> {
        let mut v: Vec<(u64, Live)> = self.live.iter().map(|(p, l)| (*p, *l)).collect();
        v.sort_by(|a, b| b.1.size.cmp(&a.1.size).then(a.1.t_ns.cmp(&b.1.t_ns)));
        v.truncate(n);
        v
    }
}

/// A process's charge on the device after `e`: the trace's `used` when present (it stays right
/// even when the writer dropped events), otherwise derived from the sizes.
#[inline]
pub fn next_used(prev: u64, e: &Event) -> u64 {
    match (e.used, e.op) {
        (Some(u), _) => u,
        (None, Op::Alloc) => prev.saturating_add(e.size),
        (None, Op::Free) => prev.saturating_sub(e.size),
        (None, _) => prev,
    }
}

/// Per process: its devices in order of first appearance.
pub struct ProcStats {
    pub devices: Vec<DevStats>,
    /// Events on device ordinals past the first [`ProcStats::MAX_DEVICES`].
    pub untracked: u64,
}

impl ProcStats {
    /// Device ordinals kept per process. A process touches one to eight devices (and no machine
    /// has this many); past it a crafted trace would grow the report with every new ordinal
    /// (10 000 of them, nothing live: 271 MB from a 3 MB trace). Events on further ordinals are
    /// counted in [`ProcStats::untracked`], not read.
    pub const MAX_DEVICES: usize = 64;

    pub fn new() -> ProcStats {
        ProcStats { devices: Vec::new(), untracked: 0 }
    }

    /// This process's state on device `index`; `None` (the event counted as untracked) for an
    /// ordinal past [`ProcStats::MAX_DEVICES`] distinct ones.
    #[inline]
    pub fn dev(&mut self, index: i32) -> Option<&mut DevStats> {
        // A linear scan over at most MAX_DEVICES beats a map.
        match self.devices.iter().position(|d| d.index == index) {
            Some(i) => Some(&mut self.devices[i]),
            None if self.devices.len() >= Self::MAX_DEVICES => {
                self.untracked += 1;
                None
            }
            None => {
                self.devices.push(DevStats::new(index));
                self.devices.sort_by_key(|d| d.index);
                let i = self.devices.iter().position(|d| d.index == index).unwrap_or(0);
                Some(&mut self.devices[i])
            }
        }
    }
}

/// Usage of a device summed over processes, on the merged clock (for "job peak").
#[derive(Debug, Default)]
pub struct Combined {
    pub index: i32,
    /// Current usage per process.
    pub per_proc: Vec<u64>,
    pub used: u64,
    pub peak: u64,
    pub peak_t: u64,
}

impl Combined {
    pub fn set(&mut self, proc_idx: usize, used: u64, t: u64) {
        if self.per_proc.len() <= proc_idx {
            self.per_proc.resize(proc_idx + 1, 0);
        }
        self.used = self.used - self.per_proc[proc_idx] + used;
        self.per_proc[proc_idx] = used;
        if self.used > self.peak {
            self.peak = self.used;
            self.peak_t = t;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t_ns: u64, op: Op, ptr: u64, size: u64) -> Event {
        Event { seq: 0, t_ns, tid: 1, op, op_name: 0, api: 0, dev: 0, ptr, size, result: 0, dur_ns: 0, used: None, group_used: None }
    }

    /// Pointers chosen against a plain multiplicative hash (the inverse of its multiplier, so
    /// every hash has the same low 40 bits): with a keyed hash they spread over the buckets like
    /// any others. Counted, not timed: the distinct bucket indices of 40 000 such pointers in a
    /// table of 65 536 buckets (about 29 900 for a random spread; 1 for the old hash).
    #[test]
    fn crafted_pointers_do_not_share_a_bucket() {
        use std::hash::BuildHasher;
        const C: u64 = 0x9E37_79B9_7F4A_7C15;
        // C is odd: its inverse mod 2^64 by Newton's iteration.
        let mut inv: u64 = 1;
        for _ in 0..6 {
            inv = inv.wrapping_mul(2u64.wrapping_sub(C.wrapping_mul(inv)));
        }
        assert_eq!(C.wrapping_mul(inv), 1);
        let crafted = (0..40_000u64).map(|i| {
            let fin = i << 40;
            let h = fin ^ (fin >> 29) ^ (fin >> 58);
            h.wrapping_mul(inv)
        });
        let map: PtrMap<Live> = PtrMap::default();
        let buckets: std::collections::HashSet<u64> = crafted.map(|p| map.hasher().hash_one(p) & 0xffff).collect();
        assert!(buckets.len() > 25_000, "40 000 crafted pointers fall in {} of 65 536 buckets", buckets.len());
    }

    /// A free written after the re-allocation of its address, but stamped before it, belongs to
    /// the earlier allocation: no spurious "free without a traced allocation", no false leak.
    #[test]
    fn a_free_written_after_the_reallocation_of_its_address_matches_the_earlier_allocation() {
        let mut d = DevStats::new(0);
        for e in [ev(10, Op::Alloc, 0x1000, 100), ev(30, Op::Alloc, 0x1000, 200), ev(20, Op::Free, 0x1000, 100), ev(40, Op::Free, 0x1000, 200)] {
            d.apply(&e);
        }
        assert_eq!((d.frees, d.unmatched_frees, d.live.len(), d.used), (2, 0, 0, 0));
        // The same in file order works as before.
        let mut d = DevStats::new(0);
        for e in [ev(10, Op::Alloc, 0x1000, 100), ev(20, Op::Free, 0x1000, 100), ev(30, Op::Alloc, 0x1000, 200)] {
            d.apply(&e);
        }
        assert_eq!((d.unmatched_frees, d.leaked_bytes()), (0, 200));
    }

    /// Thread 1 allocates X and frees it; thread 2 gets X next, allocates and frees it, all
    /// written before thread 1's free (delayed between its stamp and its write): in time order
    /// every free has its allocation. So for any number of reuses of the address before the
    /// delayed free appears.
    #[test]
    fn a_free_written_after_later_reuses_of_its_address_matches_its_own_allocation() {
        for reuses in [1u64, 2, 5, 70] {
            let mut d = DevStats::new(0);
            d.apply(&ev(10, Op::Alloc, 0x1000, 100));
            for k in 0..reuses {
                d.apply(&ev(30 + 20 * k, Op::Alloc, 0x1000, 200));
                d.apply(&ev(40 + 20 * k, Op::Free, 0x1000, 200));
            }
            d.apply(&ev(20, Op::Free, 0x1000, 100));
            assert_eq!((d.frees, d.unmatched_frees, d.live.len(), d.used), (reuses + 1, 0, 0, 0), "{reuses} reuse(s)");
            // Its lifetime is its own (10 ns, bucket <1us), not one measured from a later allocation.
            assert_eq!(d.life_hist[0], reuses + 1);
        }
        // Several delayed frees, written in reverse: each finds its own allocation.
        let mut d = DevStats::new(0);
        for e in [
            ev(10, Op::Alloc, 0x1000, 1),
            ev(30, Op::Alloc, 0x1000, 2),
            ev(50, Op::Alloc, 0x1000, 3),
            ev(60, Op::Free, 0x1000, 3),
            ev(40, Op::Free, 0x1000, 2),
            ev(20, Op::Free, 0x1000, 1),
        ] {
            d.apply(&e);
        }
        assert_eq!((d.unmatched_frees, d.live.len(), d.shadowed.len()), (0, 0, 0));
        // Control: a free of an address never allocated in the trace is still unmatched.
        d.apply(&ev(70, Op::Free, 0x2000, 1));
        assert_eq!(d.unmatched_frees, 1);
    }
}
