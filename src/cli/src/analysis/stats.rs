//! What `report` accumulates per process and device while the merged stream goes by. Memory is
//! bounded by the live allocations (the table that finds leaks and lifetimes) plus a few fixed
//! histograms and short incident lists.

use super::trace::{Event, Op};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Pointers are already well spread; one multiply is enough and much cheaper than SipHash.
#[derive(Default)]
pub struct PtrHasher(u64);
impl Hasher for PtrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
}
pub type PtrMap<V> = HashMap<u64, V, BuildHasherDefault<PtrHasher>>;

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
    pub live: PtrMap<Live>,
    /// Allocations whose address was handed out again before their free appeared in the file:
    /// the free may still come (written after the re-allocation, stamped before it).
    pub shadowed: PtrMap<Live>,
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
            live: PtrMap::default(),
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
                    self.shadowed.insert(e.ptr, old);
                }
            }
            Op::Free => {
                self.frees += 1;
                self.driver_ns[1] += e.dur_ns;
                self.used = next_used(self.used, e);
                // A free stamped before the allocation now live at its address belongs to the
                // earlier allocation there (frees are stamped before their driver call, so a
                // free and the re-allocation of its address are in time order, not always in
                // file order).
                let earlier = self.live.get(&e.ptr).is_some_and(|l| l.t_ns > e.t_ns) && self.shadowed.contains_key(&e.ptr);
                let found = if earlier { self.shadowed.remove(&e.ptr) } else { self.live.remove(&e.ptr) };
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
}

impl ProcStats {
    #[inline]
    pub fn dev(&mut self, index: i32) -> &mut DevStats {
        // A process touches one to eight devices: a linear scan beats a map.
        match self.devices.iter().position(|d| d.index == index) {
            Some(i) => &mut self.devices[i],
            None => {
                self.devices.push(DevStats::new(index));
                self.devices.sort_by_key(|d| d.index);
                let i = self.devices.iter().position(|d| d.index == index).unwrap_or(0);
                &mut self.devices[i]
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
}
