//! The registry of memory pools this process allocates from, and how each pool's charge follows
//! what the driver says it really reserves (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
//!
//! The table grows (chunks of doubling size, never freed, so a `&'static Pool` stays valid
//! without locks); when it cannot grow, registration fails and the caller denies: a pool we
//! cannot count never gets memory.
//!
//! A pool destroyed while allocations from it are live keeps its memory until the last of them
//! is freed (the driver's documented rule), so its slot becomes an *orphan*: no longer findable by
//! handle (the address may come back as a new pool), still charged, released when its live count
//! reaches zero.

use crate::ffi::*;
use crate::hooks::import;
use crate::ledger;
use crate::sync::Lock;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// A free slot a destroyed pool left behind (reusable).
const TOMBSTONE: u64 = u64::MAX;
/// Marks a destroyed pool whose allocations are still live. Pool handles are addresses (below
/// 2^63), so a marked handle can never equal a live one.
const ORPHAN: u64 = 1 << 63;
/// A slot being filled in by the thread that claimed it (matches no handle, orphan or not).
const CLAIMING: u64 = u64::MAX - 1;

pub struct Pool {
    handle: AtomicU64,
    /// Device ordinal + 1 (0 while the registering thread has not stored it yet).
    dev: AtomicU32,
    /// Bumped each time the slot is claimed, so an allocation's entry can tell its pool from a
    /// later one in the same slot.
    generation: AtomicU32,
    /// Bytes of this pool currently in the device's charge.
    charged: AtomicU64,
    /// Allocations from this pool that we saw made and not yet freed.
    live: AtomicU64,
}

impl Pool {
    const fn new() -> Pool {
        Pool {
            handle: AtomicU64::new(0),
            dev: AtomicU32::new(0),
            generation: AtomicU32::new(0),
            charged: AtomicU64::new(0),
            live: AtomicU64::new(0),
        }
    }

    pub fn device(&self) -> Option<usize> {
        match self.dev.load(Ordering::Acquire) {
            0 => None,
            d => Some(d as usize - 1),
        }
    }

    pub fn handle(&self) -> Option<u64> {
        let h = self.handle.load(Ordering::Acquire);
        (h != 0 && h != TOMBSTONE && h & ORPHAN == 0).then_some(h)
    }

    pub fn charged(&self) -> u64 {
        self.charged.load(Ordering::Acquire)
    }
}

/// Chunk `k` holds `FIRST << k` slots; 40 chunks are far beyond any process's pools.
const FIRST: usize = 64;
const CHUNKS: usize = 40;
static CHUNK: [AtomicPtr<Pool>; CHUNKS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; CHUNKS];
/// Slots ever claimed (scans stop here).
static USED: AtomicUsize = AtomicUsize::new(0);

fn locate(i: usize) -> (usize, usize) {
    let n = i / FIRST + 1;
    let k = (usize::BITS - 1 - n.leading_zeros()) as usize;
    (k, i - FIRST * ((1 << k) - 1))
}

fn slot(i: usize) -> Option<&'static Pool> {
    let (k, off) = locate(i);
    let c = CHUNK.get(k)?.load(Ordering::Acquire);
    (!c.is_null()).then(|| unsafe { &*c.add(off) })
}

/// The slot, allocating its chunk if needed (`None`: out of memory or out of chunks).
fn slot_or_grow(i: usize) -> Option<&'static Pool> {
    if let Some(p) = slot(i) {
        return Some(p);
    }
    let (k, _) = locate(i);
    let cell = CHUNK.get(k)?;
    let len = FIRST << k;
    let mut v: Vec<Pool> = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.extend((0..len).map(|_| Pool::new()));
    let fresh = Box::into_raw(v.into_boxed_slice()) as *mut Pool;
    if let Err(_other) = cell.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        // Another thread grew the table first: ours was never published.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(fresh, len)) });
    }
    slot(i)
}

/// Every slot ever claimed, with its index.
pub fn slots() -> impl Iterator<Item = (usize, &'static Pool)> {
    (0..USED.load(Ordering::Acquire)).filter_map(|i| slot(i).map(|p| (i, p)))
}

pub fn find(handle: u64) -> Option<(usize, &'static Pool)> {
    if handle == 0 || handle & ORPHAN != 0 {
        return None;
    }
    slots().find(|(_, p)| p.handle.load(Ordering::Acquire) == handle)
}

/// The slot of a pool, registering it on `dev` if we have not seen it. `None` only when the
/// table cannot grow: the caller must deny.
pub fn register(handle: u64, dev: usize) -> Option<(usize, &'static Pool)> {
    if handle == 0 || handle & ORPHAN != 0 {
        return None;
    }
    if let Some(found) = find(handle) {
        return Some(found);
    }
    let mut i = 0;
    loop {
        let p = slot_or_grow(i)?;
        let cur = p.handle.load(Ordering::Acquire);
        if (cur == 0 || cur == TOMBSTONE) && p.handle.compare_exchange(cur, CLAIMING, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            // Filled in while no lookup can match the slot, then published with the handle.
            p.generation.fetch_add(1, Ordering::AcqRel);
            p.charged.store(0, Ordering::Release);
            p.live.store(0, Ordering::Release);
            p.dev.store(dev as u32 + 1, Ordering::Release);
            USED.fetch_max(i + 1, Ordering::AcqRel);
            p.handle.store(handle, Ordering::Release);
            // A racing registration of the same handle may have claimed an earlier slot: the
            // lowest slot wins, so both racers agree and the pool is charged once.
            if let Some((j, first)) = find(handle)
                && j != i
            {
                p.dev.store(0, Ordering::Release);
                p.handle.store(TOMBSTONE, Ordering::Release);
                return Some((j, first));
            }
            return Some((i, p));
        }
        i += 1;
    }
}

/// Marks a tag: bit 63 is never set in a user-space address, so a tag stored where entries of
/// other kinds keep their context can never be mistaken for a context.
const TAGGED: u64 = 1 << 63;

/// What an allocation's ledger entry remembers of its pool (the slot and its generation).
pub fn tag(i: usize, p: &Pool) -> u64 {
    TAGGED | (p.generation.load(Ordering::Acquire) as u64 & 0x7fff_ffff) << 32 | (i as u64 + 1)
}

/// The pool an allocation's entry names, if that slot still holds the same pool.
pub fn by_tag(tag: u64) -> Option<&'static Pool> {
    if tag & TAGGED == 0 {
        return None;
    }
    let i = (tag & 0xffff_ffff).checked_sub(1)? as usize;
    let p = slot(i)?;
    (p.generation.load(Ordering::Acquire) as u64 & 0x7fff_ffff == (tag & !TAGGED) >> 32).then_some(p)
}

fn attribute(handle: u64, attr: c_int) -> Option<u64> {
    let f = import::cuMemPoolGetAttribute()?;
    let mut v: u64 = 0;
    (unsafe { f(handle as CUmemoryPool, attr, (&mut v as *mut u64).cast::<c_void>()) } == CUDA_SUCCESS).then_some(v)
}

/// Serializes settles: each reads the driver and moves the charge by the difference, so a read
/// taken earlier can never overwrite one taken later (which would undercount a pool that grew in
/// between). Held only across one `cuMemPoolGetAttribute`; reset in a forked child.
static SETTLE: Lock<()> = Lock::new(());
static FORK_HANDLER: AtomicBool = AtomicBool::new(false);

extern "C" fn settle_lock_in_child() {
    SETTLE.reset_in_child();
}

/// Re-reads what the pool reserves and sets its charge to that; `reservation` (bytes reserved
/// for the call that just returned) is given back in the same step, so the ledger moves once
/// by the net difference. Returns the change of the pool's charge. When the driver cannot say,
/// the reservation stays charged to the pool (the next settle corrects it).
pub fn settle(p: &Pool, reservation: u64) -> i64 {
    if !FORK_HANDLER.load(Ordering::Relaxed) && !FORK_HANDLER.swap(true, Ordering::AcqRel) {
        unsafe { libc::pthread_atfork(None, None, Some(settle_lock_in_child)) };
    }
    let (Some(handle), Some(dev)) = (p.handle(), p.device()) else {
        if let Some(dev) = p.device() {
            ledger::unreserve(dev, reservation);
            reserved_done(dev, reservation);
        }
        return 0;
    };
    let _g = SETTLE.lock();
    let Some(now) = attribute(handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) else {
        p.charged.fetch_add(reservation, Ordering::AcqRel);
        ledger::commit(dev, reservation);
        reserved_done(dev, reservation);
        return reservation as i64;
    };
    let old = p.charged.swap(now, Ordering::AcqRel);
    ledger::settle(dev, old, now, reservation);
    // After the ledger, under the lock: a reading never sees the reservation gone from both.
    if reservation > 0 {
        reserved_done(dev, reservation);
    }
    now as i64 - old as i64
}

/// Per device, bytes reserved for stream-ordered allocations whose pools are not settled yet
/// (from the allocation's reservation until [`settle`] moved the ledger for it): what of the
/// ledger's reservations in flight the pools' own reading (`reserved_vs_charged`) accounts for.
static RESERVING: [AtomicU64; ledger::MAX_DEVICES] = [const { AtomicU64::new(0) }; ledger::MAX_DEVICES];

/// A stream-ordered allocation reserved `bytes` on `dev` and goes to the driver.
pub fn reserving(dev: usize, bytes: u64) {
    if let Some(r) = RESERVING.get(dev) {
        r.fetch_add(bytes, Ordering::AcqRel);
    }
}

fn reserved_done(dev: usize, bytes: u64) {
    if let Some(r) = RESERVING.get(dev) {
        let _ = r.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(bytes)));
    }
}

/// What the pools on `dev` reserve by the driver's word, and what vramcap charges for them, summed.
/// They differ while a pool the driver trimmed (at a synchronize, `cuMemPoolTrimTo`, pressure
/// relief) or grew is not settled yet: the overhead measurement counts the driver's word, not the
/// charge (`overhead::quiet_read_with`). Under the settle lock, so no settle is half done (charge
/// swapped, ledger not moved yet). A pool the driver cannot tell about counts as charged.
/// Third: what [`reserving`] says is in flight for them.
pub fn reserved_vs_charged(dev: usize) -> (u64, u64, u64) {
    if !any() {
        return (0, 0, 0);
    }
    let _g = SETTLE.lock();
    let (d, c) = slots().fold((0u64, 0u64), |(d, c), (_, p)| match (p.handle(), p.device()) {
        (Some(h), Some(pd)) if pd == dev => {
            let charged = p.charged();
            let driver = attribute(h, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).unwrap_or(charged);
            (d.saturating_add(driver), c.saturating_add(charged))
        }
        _ => (d, c),
    });
    (d, c, RESERVING.get(dev).map_or(0, |r| r.load(Ordering::Acquire)))
}

/// Whether any pool was ever registered (lets synchronizes skip the scan).
pub fn any() -> bool {
    USED.load(Ordering::Relaxed) > 0
}

/// Marks a pool destroyed. With allocations still live it becomes an orphan that keeps its
/// charge; otherwise its charge is released now. Returns the bytes released.
pub fn destroyed(p: &Pool) -> u64 {
    let Some(h) = p.handle() else { return 0 };
    p.handle.store(h | ORPHAN, Ordering::Release);
    if p.live.load(Ordering::Acquire) == 0 { finish_orphan(p, h | ORPHAN) } else { 0 }
}

/// An allocation from `p` was freed: one fewer live. An orphan whose last allocation this was
/// releases its whole charge (returned).
pub fn freed_one(p: &Pool) -> u64 {
    let before = p
        .live
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| Some(n.saturating_sub(1)))
        .unwrap_or(0);
    if before <= 1 && is_orphan(p) { finish_orphan(p, p.handle.load(Ordering::Acquire)) } else { 0 }
}

pub fn live(p: &Pool) -> u64 {
    p.live.load(Ordering::Acquire)
}

/// The driver says nothing is allocated from `p` (read while its handle was valid).
pub fn none_live(p: &Pool) {
    p.live.store(0, Ordering::Release);
}

pub fn allocated_one(p: &Pool) {
    p.live.fetch_add(1, Ordering::AcqRel);
}

/// Exactly one caller wins the slot back (the compare-exchange) and releases the charge.
fn finish_orphan(p: &Pool, marked: u64) -> u64 {
    let Some(dev) = p.device() else { return 0 };
    if p.handle.compare_exchange(marked, TOMBSTONE, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return 0;
    }
    let old = p.charged.swap(0, Ordering::AcqRel);
    ledger::release(dev, old);
    old
}

/// Orphans still holding memory (for trims: the driver no longer takes their handle).
pub fn is_orphan(p: &Pool) -> bool {
    let h = p.handle.load(Ordering::Acquire);
    h != TOMBSTONE && h != CLAIMING && h & ORPHAN != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_index_once() {
        let mut expect = (0usize, 0usize);
        for i in 0..FIRST * 15 {
            let (k, off) = locate(i);
            if (k, off) != expect {
                assert_eq!((k, off), (expect.0 + 1, 0), "index {i}");
            }
            assert!(off < FIRST << k);
            expect = (k, off + 1);
        }
    }

    #[test]
    fn registration_grows_past_any_fixed_size_and_reuses_freed_slots() {
        let base = 0x5000_0000_0000u64;
        let n = 1000u64;
        for h in 0..n {
            assert!(register(base + h * 16, 0).is_some(), "pool {h}");
        }
        let (i, p) = find(base + 999 * 16).expect("the 1000th pool is registered");
        assert!(i >= 999);
        assert_eq!(register(base + 999 * 16, 0).map(|x| x.0), Some(i), "registered once");
        // A destroyed pool with nothing live gives its slot back.
        assert_eq!(destroyed(p), 0);
        assert!(find(base + 999 * 16).is_none());
        let (j, _) = register(base + 5 * 16 + 8, 0).unwrap();
        assert!(j <= i);
    }

    #[test]
    fn an_orphan_is_released_by_its_last_free_only() {
        let (i, p) = register(0x6000_0000_0010, 45).unwrap();
        let t = tag(i, p);
        ledger::charge(45, 100);
        p.charged.store(100, Ordering::Release);
        allocated_one(p);
        allocated_one(p);
        assert_eq!(destroyed(p), 0, "two allocations live: the charge stays");
        assert!(find(0x6000_0000_0010).is_none(), "the handle may be reused by a new pool");
        assert_eq!(freed_one(by_tag(t).unwrap()), 0);
        assert_eq!(ledger::used(45), 100);
        assert_eq!(freed_one(by_tag(t).unwrap()), 100);
        assert_eq!(ledger::used(45), 0);
        assert!(by_tag(t).is_some_and(|p| p.charged() == 0));
    }
}
