//! Who holds how much: a budget per device (atomic counters, reserve-before-allocate) and a table
//! of live allocations so that a free releases exactly what its allocation was charged.
//!
//! Reservation is one compare-and-swap: two racing threads can never together pass the limit,
//! and there is no window between "check" and "charge".

use crate::sync::Lock;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub const MAX_DEVICES: usize = 64;
const NO_LIMIT: u64 = u64::MAX;

/// One cache line per device: threads charging different devices never share a line.
///
/// Two counts, because they answer different questions. `charged` is what the cap is decided on:
/// memory that exists plus reservations for driver calls in flight (reserve before the call, so
/// racing threads can never together pass the limit). `held` is memory that exists: added once
/// the driver has handed it out, taken away before the driver is asked to free it. Everything
/// reported (events' `used`, the summary's `used` and `peak`, the sidecar's snapshots) is `held`:
/// a reservation for a call the driver refuses was never memory, and counting it made the peak of
/// a process whose threads raced the driver's refusals higher than the device.
///
/// `committed` (bytes ever committed; only grows, wrapping) lets a look at the counts tell
/// "nothing moved" from "an allocation was made and freed again meanwhile", which leaves
/// `charged` and `held` where they were: the overhead measurement must (`Snapshot`). One more
/// read-modify-write on a line the commit has just taken anyway.
#[repr(align(128))]
struct Budget {
    charged: AtomicU64,
    held: AtomicU64,
    committed: AtomicU64,
    limit: AtomicU64,
    peak: AtomicU64,
}

static BUDGETS: [Budget; MAX_DEVICES] = [const {
    Budget {
        charged: AtomicU64::new(0),
        held: AtomicU64::new(0),
        committed: AtomicU64::new(0),
        limit: AtomicU64::new(NO_LIMIT),
        peak: AtomicU64::new(0),
    }
}; MAX_DEVICES];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    pub used: u64,
    pub limit: u64,
    /// The group's budget refused (`used`/`limit` are the group's), not the process's.
    pub group: bool,
    /// Which of the group's rules refused (`Budget` for the process's own limit).
    pub rule: crate::group::shm::Rule,
}

static TOTALS: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
static DEVICE_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Records what the driver reported for the devices this process sees (for traces and reports).
pub fn set_devices(totals: &[u64]) {
    for (d, &t) in totals.iter().take(MAX_DEVICES).enumerate() {
        TOTALS[d].store(t, Ordering::Relaxed);
    }
    DEVICE_COUNT.store(totals.len().min(MAX_DEVICES), Ordering::Release);
}

pub fn device_count() -> usize {
    DEVICE_COUNT.load(Ordering::Acquire)
}

/// Physical total of a device (0 if unknown).
pub fn total(dev: usize) -> u64 {
    TOTALS.get(dev).map_or(0, |t| t.load(Ordering::Relaxed))
}

/// The highest device index that was ever charged (for summaries when device info is missing).
pub fn highest_used_device() -> usize {
    (0..MAX_DEVICES).rev().find(|&d| peak(d) > 0).unwrap_or(0)
}

/// `bytes == 0` means no limit.
pub fn set_limit(dev: usize, bytes: u64) {
    if let Some(b) = BUDGETS.get(dev) {
        // SeqCst, as are the loads it pairs with (the re-read after the CAS in `reserve_local`,
        // and `charged` read after a change): a store then a load on one side, a CAS then a load
        // on the other. Only sequential consistency of all four promises that at least one side
        // sees the other; with Release the shrinker's later read of `charged` can pass this store
        // (x86: it waits in the store buffer, a SeqCst store is an `xchg`) while a reservation
        // re-reads the old limit, and a grant past the new limit goes unseen by both
        // (tests::a_grant_the_shrinker_did_not_see_was_judged_by_the_new_limit). Not the hot path.
        b.limit.store(if bytes == 0 { NO_LIMIT } else { bytes }, Ordering::SeqCst);
    }
}

pub fn limit(dev: usize) -> Option<u64> {
    BUDGETS.get(dev).map(|b| b.limit.load(Ordering::Acquire)).filter(|&l| l != NO_LIMIT)
}

/// What this process holds on `dev`: memory the driver handed out and has not been asked to free.
pub fn used(dev: usize) -> u64 {
    BUDGETS.get(dev).map_or(0, |b| b.held.load(Ordering::Acquire))
}

/// What the cap counts on `dev`: [`used`] plus reservations for driver calls in flight (what
/// `cuMemGetInfo` must not show as free). SeqCst: read after a [`set_limit`], what it returns
/// holds every grant that was not judged by the new limit (see there; on x86 a plain load).
pub fn charged(dev: usize) -> u64 {
    BUDGETS.get(dev).map_or(0, |b| b.charged.load(Ordering::SeqCst))
}

/// The counts of `dev` at one look. Two equal looks mean nothing was reserved, handed out or given
/// back in between — including an allocation made and freed again meanwhile, which leaves
/// [`used`] and [`charged`] where they were but not `committed` (it only grows). What the overhead
/// measurement needs to trust a reading of the driver's books taken between the two looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub charged: u64,
    pub held: u64,
    committed: u64,
}

pub fn snapshot(dev: usize) -> Snapshot {
    // `held` before `committed`: a look that sees `held` back where it was after a give-back also
    // sees the commit before it (the commit's add to `committed` comes first in its thread, and
    // the give-back's read-modify-write publishes it).
    BUDGETS.get(dev).map_or(Snapshot { charged: 0, held: 0, committed: 0 }, |b| Snapshot {
        charged: b.charged.load(Ordering::SeqCst),
        held: b.held.load(Ordering::SeqCst),
        committed: b.committed.load(Ordering::SeqCst),
    })
}

/// The most this process held on `dev` at once.
pub fn peak(dev: usize) -> u64 {
    BUDGETS.get(dev).map_or(0, |b| b.peak.load(Ordering::Acquire))
}

/// Charges `size` bytes to `dev` if that keeps it within the process's limit and then within
/// its group's (one CAS each; the first is rolled back if the second refuses). A reservation:
/// [`commit`] it once the driver has handed the memory out, [`unreserve`] it if not.
#[inline]
pub fn reserve(dev: usize, size: u64) -> Result<(), Denied> {
    reserve_local(dev, size)?;
    if crate::group::active() {
        return reserve_in_group(dev, size);
    }
    Ok(())
}

/// The group's step of [`reserve`], out of line: a process without a group pays one load and
/// one branch for it, not the registers and stack frame of the group's admission.
#[inline(never)]
fn reserve_in_group(dev: usize, size: u64) -> Result<(), Denied> {
    let r = crate::group::reserve(dev, size);
    if r.is_err() {
        unreserve_local(dev, size);
    }
    r
}

/// Gives back a reservation that never became memory (the driver refused, or handed out less).
#[inline]
pub fn unreserve(dev: usize, size: u64) {
    unreserve_local(dev, size);
    if crate::group::active() {
        crate::group::release(dev, size);
    }
}

/// The driver handed out `size` bytes reserved before the call: they are held from now on.
#[inline]
pub fn commit(dev: usize, size: u64) {
    if let Some(b) = BUDGETS.get(dev) {
        // Before `held`: see `snapshot`.
        b.committed.fetch_add(size, Ordering::AcqRel);
        let now = b.held.fetch_add(size, Ordering::AcqRel).saturating_add(size);
        // Read first: the read-modify-write is needed only when the mark moves.
        if now > b.peak.load(Ordering::Relaxed) {
            b.peak.fetch_max(now, Ordering::Relaxed);
        }
    }
}

/// `size` bytes are about to be given back to the driver: no longer held (their charge stays
/// until [`unreserve`] after the call, or [`commit`] puts them back if the call fails).
#[inline]
pub fn uncommit(dev: usize, size: u64) {
    if let Some(b) = BUDGETS.get(dev) {
        sub_saturating(&b.held, size);
    }
}

/// Gives back memory that existed and is gone (a free, a context's end, a pool that shrank): no
/// longer held, no longer charged, to the process and to its group.
#[inline]
pub fn release(dev: usize, size: u64) {
    uncommit(dev, size);
    unreserve(dev, size);
}

#[inline]
fn reserve_local(dev: usize, size: u64) -> Result<(), Denied> {
    reserve_local_racing(dev, size, || {})
}

/// [`reserve_local`] with `gap` run between its look at the limit and its CAS: where a change of
/// the limit racing the request lands (the unit tests put one there; nothing otherwise).
#[inline(always)]
fn reserve_local_racing(dev: usize, size: u64, gap: impl FnOnce()) -> Result<(), Denied> {
    let Some(b) = BUDGETS.get(dev) else { return Ok(()) };
    let limit = b.limit.load(Ordering::Acquire);
    gap();
    let mut cur = b.charged.load(Ordering::Relaxed);
    loop {
        let next = match cur.checked_add(size) {
            Some(n) if n <= limit => n,
            _ => return Err(Denied { used: cur, limit, group: false, rule: crate::group::shm::Rule::Budget }),
        };
        // The CAS and the re-read of the limit after it are SeqCst: the other half of the
        // store-then-load pair with `set_limit` (see there). Free on x86: a locked CAS is a full
        // fence whatever its ordering, and a SeqCst load is a plain load.
        match b.charged.compare_exchange_weak(cur, next, Ordering::SeqCst, Ordering::Relaxed) {
            // The limit again after the CAS: it may shrink while we run (the ceiling file is
            // re-read live, issue 26), and a request that read the old one must not pass the new.
            // A shrinker that read `charged` after its store and did not see this CAS is
            // ordered before it, so this load sees the new limit; one that saw it counts it.
            Ok(_) if b.limit.load(Ordering::SeqCst) < next => return Err(shrank_meanwhile(b, size, next)),
            Ok(_) => return Ok(()),
            Err(actual) => cur = actual,
        }
    }
}

#[cold]
#[inline(never)]
fn shrank_meanwhile(b: &Budget, size: u64, next: u64) -> Denied {
    sub_saturating(&b.charged, size);
    Denied { used: next - size, limit: b.limit.load(Ordering::Acquire), group: false, rule: crate::group::shm::Rule::Budget }
}

/// Charges a reservation's shortfall that the driver already handed out (a pitch wider than the
/// bound we reserved): it exists whether or not it fits. Not held until [`commit`].
#[inline]
pub fn charge_reserved(dev: usize, size: u64) {
    if let Some(b) = BUDGETS.get(dev) {
        b.charged.fetch_add(size, Ordering::AcqRel);
    }
    if crate::group::active() {
        crate::group::charge(dev, size);
    }
}

/// Charges memory the driver already handed out without a reservation (a pool that grew): it
/// exists whether or not it fits, so the charge must say so; held at once.
#[inline]
pub fn charge(dev: usize, size: u64) {
    charge_reserved(dev, size);
    commit(dev, size);
}

/// Moves the ledger for memory the driver sizes itself (a pool's or the graphs' reserved bytes):
/// their charge went from `old` to `now`, and the `reservation` made for the call that just
/// returned is given back in the same step, so the charge moves once, by the net difference.
pub fn settle(dev: usize, old: u64, now: u64, reservation: u64) {
    let net = now as i128 - old as i128 - reservation as i128;
    if net > 0 {
        charge_reserved(dev, net as u64);
    } else if net < 0 {
        unreserve(dev, (-net) as u64);
    }
    if now > old {
        commit(dev, now - old);
    } else if old > now {
        uncommit(dev, old - now);
    }
}

#[inline]
fn unreserve_local(dev: usize, size: u64) {
    if let Some(b) = BUDGETS.get(dev) {
        sub_saturating(&b.charged, size);
    }
}

/// Never wraps below zero, even if a caller double-releases through a bug of ours.
#[inline]
fn sub_saturating(a: &AtomicU64, size: u64) {
    let mut cur = a.load(Ordering::Relaxed);
    loop {
        let next = cur.saturating_sub(size);
        match a.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return,
            Err(actual) => cur = actual,
        }
    }
}

/// What a live allocation was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub dev: u16,
    pub size: u64,
    /// The context current when the charge was made (`CUcontext` as an integer, 0 = unknown):
    /// destroying or resetting that context releases it.
    pub ctx: u64,
}

/// Separate key spaces, so that a VMM handle can never be confused with a device pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Kind {
    /// `cuMemAlloc*` pointers (64-bit and legacy 32-bit share the address space).
    DevicePtr = 0,
    /// `cuMemCreate` handles (device locations only).
    VmmHandle = 1,
    /// `cuArrayCreate`/`cuArray3DCreate`/`cuMipmappedArrayCreate` handles.
    Array = 2,
    /// Stream-ordered allocations. Their entries carry no charge of their own (the pool's reserved
    /// bytes are charged instead): they remember which device a free belongs to.
    AsyncPtr = 3,
    /// `cuMemAllocManaged` allocations: one entry per device the allocation's pages count on, keyed
    /// by base address + device ordinal (`intercept::managed`), charged what counts there.
    Managed = 4,
}
const KINDS: usize = 5;
pub const ALL_KINDS: [Kind; KINDS] = [Kind::DevicePtr, Kind::VmmHandle, Kind::Array, Kind::AsyncPtr, Kind::Managed];

impl Kind {
    /// Whether an entry's `size` is part of the device's charge.
    pub fn charged(self) -> bool {
        self != Kind::AsyncPtr
    }
}
const SHARDS: usize = 64;

#[derive(Default, Clone, Copy)]
struct PtrHasher(u64);
impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
type Map = HashMap<u64, Charge, BuildHasherDefault<PtrHasher>>;

static TABLES: [[Lock<Option<Map>>; SHARDS]; KINDS] = [const { [const { Lock::new(None) }; SHARDS] }; KINDS];

#[inline]
fn shard(kind: Kind, key: u64) -> &'static Lock<Option<Map>> {
    // Device pointers are at least 256-byte aligned: mix the high bits in.
    let h = (key >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58;
    &TABLES[kind as usize][h as usize % SHARDS]
}

/// Device pointers live in a lock-free table; other kinds, and pointers when the table's
/// neighbourhood is crowded, in the locked maps below.
static FAST: once_cell::sync::Lazy<crate::livetable::LiveTable> = once_cell::sync::Lazy::new(crate::livetable::LiveTable::new);

/// Two words per entry: size (low 56 bits) with the device (high 8 bits), and the context.
fn pack(c: Charge) -> Option<[u64; 2]> {
    (c.size < 1 << 56 && c.dev < 256).then(|| [c.size | (c.dev as u64) << 56, c.ctx])
}

fn unpack(v: [u64; 2]) -> Charge {
    Charge { dev: (v[0] >> 56) as u16, size: v[0] & ((1 << 56) - 1), ctx: v[1] }
}

/// Remembers a live allocation; returns what an earlier entry under the same key was charged
/// (an allocation we never saw freed, e.g. through an entry point we do not wrap).
pub fn insert(kind: Kind, key: u64, charge: Charge) -> Option<Charge> {
    if kind == Kind::DevicePtr
        && key != 0
        && key != u64::MAX
        && let Some(packed) = pack(charge)
        && let Ok(old) = FAST.insert(key, packed)
    {
        return old.map(unpack);
    }
    install_fork_handlers();
    OVERFLOW_USED[kind as usize].store(true, Ordering::Relaxed);
    let mut g = shard(kind, key).lock();
    g.get_or_insert_with(|| Map::with_capacity_and_hasher(256, Default::default())).insert(key, charge)
}

/// Takes a live allocation out of the table (before its free reaches the driver, so that the
/// address cannot be reused and re-inserted by another thread while we still hold its entry).
pub fn take(kind: Kind, key: u64) -> Option<Charge> {
    if kind == Kind::DevicePtr
        && let Some(v) = FAST.take(key)
    {
        return Some(unpack(v));
    }
    if !OVERFLOW_USED[kind as usize].load(Ordering::Relaxed) {
        return None;
    }
    shard(kind, key).lock().as_mut()?.remove(&key)
}

/// What a live entry of a kind kept in the locked maps (not device pointers) was charged, left in
/// place.
pub fn peek(kind: Kind, key: u64) -> Option<Charge> {
    debug_assert!(kind != Kind::DevicePtr);
    if !OVERFLOW_USED[kind as usize].load(Ordering::Relaxed) {
        return None;
    }
    shard(kind, key).lock().as_ref()?.get(&key).copied()
}

/// Whether a kind's locked map ever held anything (lets `take` skip the lock for pointers).
static OVERFLOW_USED: [AtomicBool; KINDS] = [const { AtomicBool::new(false) }; KINDS];

/// Takes every entry of `kinds` whose charge matches `pred` out of the tables (a context ended).
pub fn drain(kinds: &[Kind], pred: impl Fn(&Charge) -> bool) -> Vec<(Kind, u64, Charge)> {
    let mut out: Vec<(Kind, u64, Charge)> = if kinds.contains(&Kind::DevicePtr) {
        FAST.drain(|v| pred(&unpack(v))).into_iter().map(|(k, v)| (Kind::DevicePtr, k, unpack(v))).collect()
    } else {
        Vec::new()
    };
    for &kind in kinds {
        for s in &TABLES[kind as usize] {
            if let Some(m) = s.lock().as_mut() {
                m.retain(|&k, c| {
                    if pred(c) {
                        out.push((kind, k, *c));
                        false
                    } else {
                        true
                    }
                });
            }
        }
    }
    out
}

/// Number of live entries (tests and reports).
pub fn live(kind: Kind) -> usize {
    let fast = if kind == Kind::DevicePtr { FAST.len() } else { 0 };
    fast + TABLES[kind as usize].iter().map(|s| s.lock().as_ref().map_or(0, |m| m.len())).sum::<usize>()
}

static FORK_HANDLERS: AtomicBool = AtomicBool::new(false);

/// Also called by modules whose locks are held while ledger locks are taken, before they register
/// their own handlers: prepare handlers run in reverse order of registration, so theirs then take
/// their lock before the ledger's, the order every thread takes them in.
pub(crate) fn install_fork_handlers() {
    if FORK_HANDLERS.load(Ordering::Relaxed) || FORK_HANDLERS.swap(true, Ordering::AcqRel) {
        return;
    }
    unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_parent), Some(after_fork_child)) };
}

extern "C" fn before_fork() {
    for kind in &TABLES {
        for s in kind {
            s.acquire_for_fork();
        }
    }
}

extern "C" fn after_fork_parent() {
    for kind in &TABLES {
        for s in kind {
            s.release_after_fork();
        }
    }
}

extern "C" fn after_fork_child() {
    // The child inherits the parent's device memory view only in name: CUDA contexts do not
    // survive fork. We keep the charges so a child that (wrongly) frees inherited pointers
    // releases exactly them, and its cap stays the parent's.
    for kind in &TABLES {
        for s in kind {
            s.reset_in_child();
        }
    }
}

/// Of what this process holds on each device, the part the driver took beyond allocations
/// (contexts, modules, per-context reservations: `intercept::overhead` keeps it). Off the
/// allocation path: moved only by those rare calls, read by views and reports.
static OVERHEAD: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

pub fn overhead(dev: usize) -> u64 {
    OVERHEAD.get(dev).map_or(0, |o| o.load(Ordering::Acquire))
}

pub fn add_overhead(dev: usize, bytes: u64) {
    if let Some(o) = OVERHEAD.get(dev) {
        o.fetch_add(bytes, Ordering::AcqRel);
    }
}

pub fn sub_overhead(dev: usize, bytes: u64) {
    if let Some(o) = OVERHEAD.get(dev) {
        sub_saturating(o, bytes);
    }
}

#[cfg(test)]
mod tests;
