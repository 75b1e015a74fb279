//! A lock-free table of live device pointers: the hot path of every allocation and free.
//!
//! Open addressing with linear probing over a fixed array. Claiming a slot is one compare-and-swap
//! on its key; removing is one compare-and-swap to a tombstone. No lock, so nothing to take
//! around `fork()` and nothing a preempted thread can hold. A pointer is inserted only after the
//! driver returned it and removed only when the application frees it, so a key's value is always
//! written before anyone can look it up. When a probe runs long (the table is crowded), the caller
//! falls back to the ledger's locked overflow map, so capacity is never a correctness limit.

use std::sync::atomic::{AtomicU64, Ordering};

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = u64::MAX;
/// 2^18 slots (4 MiB of keys and values, touched lazily by the kernel's zero pages).
const SLOTS: usize = 1 << 18;
/// Probes before giving up and using the overflow map.
pub const MAX_PROBE: usize = 64;

pub struct LiveTable {
    keys: Box<[AtomicU64]>,
    /// Two words per slot: the charge, packed by the caller.
    values: Box<[[AtomicU64; 2]]>,
}

#[inline]
fn home(key: u64) -> usize {
    // Device pointers are 256-byte aligned or more: mix the high bits down.
    ((key >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - 18)) as usize
}

impl LiveTable {
    pub fn new() -> LiveTable {
        // calloc-backed: the kernel maps pages only when first written.
        LiveTable {
            keys: (0..SLOTS).map(|_| AtomicU64::new(EMPTY)).collect(),
            values: (0..SLOTS).map(|_| [AtomicU64::new(0), AtomicU64::new(0)]).collect(),
        }
    }

    /// Inserts `key`. Returns the previous value if the key was already present (a free we never
    /// saw), `Ok(None)` on a fresh insert, `Err(())` if the neighbourhood is full.
    pub fn insert(&self, key: u64, value: [u64; 2]) -> Result<Option<[u64; 2]>, ()> {
        debug_assert!(key != EMPTY && key != TOMBSTONE);
        let start = home(key);
        let mut free_slot = None;
        for i in 0..MAX_PROBE {
            let s = (start + i) % SLOTS;
            let k = self.keys[s].load(Ordering::Acquire);
            if k == key {
                let old = [self.values[s][0].load(Ordering::Relaxed), self.values[s][1].load(Ordering::Relaxed)];
                self.values[s][0].store(value[0], Ordering::Relaxed);
                self.values[s][1].store(value[1], Ordering::Relaxed);
                return Ok(Some(old));
            }
            if k == TOMBSTONE && free_slot.is_none() {
                free_slot = Some(s);
            }
            if k == EMPTY {
                // The key is not further on: claim the first free slot seen.
                let s = free_slot.unwrap_or(s);
                return match self.claim(s, key, value) {
                    true => Ok(None),
                    false => self.insert(key, value), // lost a race for the slot: probe again
                };
            }
        }
        match free_slot {
            Some(s) if self.claim(s, key, value) => Ok(None),
            Some(_) => self.insert(key, value),
            None => Err(()),
        }
    }

    fn claim(&self, s: usize, key: u64, value: [u64; 2]) -> bool {
        // Values first: a reader that finds the key must find its value.
        let cur = self.keys[s].load(Ordering::Acquire);
        if cur != EMPTY && cur != TOMBSTONE {
            return false;
        }
        self.values[s][0].store(value[0], Ordering::Relaxed);
        self.values[s][1].store(value[1], Ordering::Relaxed);
        self.keys[s].compare_exchange(cur, key, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Removes `key`, returning its value.
    pub fn take(&self, key: u64) -> Option<[u64; 2]> {
        if key == EMPTY || key == TOMBSTONE {
            return None;
        }
        let start = home(key);
        for i in 0..MAX_PROBE {
            let s = (start + i) % SLOTS;
            let k = self.keys[s].load(Ordering::Acquire);
            if k == EMPTY {
                return None;
            }
            if k == key {
                let v = [self.values[s][0].load(Ordering::Relaxed), self.values[s][1].load(Ordering::Relaxed)];
                if self.keys[s].compare_exchange(key, TOMBSTONE, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    return Some(v);
                }
                return None;
            }
        }
        None
    }

    /// Removes every entry whose value matches `pred` (a context destroyed: rare, so a full scan).
    pub fn drain(&self, pred: impl Fn([u64; 2]) -> bool) -> Vec<(u64, [u64; 2])> {
        let mut out = Vec::new();
        for s in 0..SLOTS {
            let k = self.keys[s].load(Ordering::Acquire);
            if k == EMPTY || k == TOMBSTONE {
                continue;
            }
            let v = [self.values[s][0].load(Ordering::Relaxed), self.values[s][1].load(Ordering::Relaxed)];
            if pred(v) && self.keys[s].compare_exchange(k, TOMBSTONE, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                out.push((k, v));
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.keys.iter().filter(|k| !matches!(k.load(Ordering::Relaxed), EMPTY | TOMBSTONE)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_take_and_stale_replace() {
        let t = LiveTable::new();
        assert_eq!(t.insert(0x1000, [1, 2]), Ok(None));
        assert_eq!(t.insert(0x1000, [3, 4]), Ok(Some([1, 2])));
        assert_eq!(t.take(0x1000), Some([3, 4]));
        assert_eq!(t.take(0x1000), None);
        assert_eq!(t.take(0x2000), None);
    }

    #[test]
    fn colliding_keys_and_tombstone_reuse() {
        let t = LiveTable::new();
        // Same home slot: keys differing only below bit 8.
        let keys: Vec<u64> = (1..=40).map(|i| 0x7000_0000 + i).collect();
        for &k in &keys {
            assert_eq!(t.insert(k, [k, 0]), Ok(None));
        }
        for &k in keys.iter().step_by(2) {
            assert_eq!(t.take(k), Some([k, 0]));
        }
        for &k in keys.iter().skip(1).step_by(2) {
            assert_eq!(t.take(k), Some([k, 0]), "found past tombstones");
        }
        assert_eq!(t.len(), 0);
        // A full neighbourhood reports it instead of looping.
        let crowd: Vec<u64> = (1..=(MAX_PROBE as u64 + 1)).map(|i| 0x9000_0000 + i).collect();
        let results: Vec<_> = crowd.iter().map(|&k| t.insert(k, [0, 0])).collect();
        assert!(results.iter().take(MAX_PROBE).all(|r| *r == Ok(None)));
        assert_eq!(*results.last().unwrap(), Err(()));
    }

    #[test]
    fn concurrent_insert_take_is_exact() {
        let t = std::sync::Arc::new(LiveTable::new());
        let hs: Vec<_> = (0..8u64)
            .map(|th| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for round in 0..2000u64 {
                        let keys: Vec<u64> = (0..32u64).map(|i| ((th << 40) | (round % 7) << 20 | i << 8) + 256).collect();
                        for &k in &keys {
                            assert_eq!(t.insert(k, [k, th]), Ok(None));
                        }
                        for &k in &keys {
                            assert_eq!(t.take(k), Some([k, th]));
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(t.len(), 0);
    }
}
