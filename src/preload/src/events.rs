//! The record of every intercepted call, handed from the allocating thread to the writer thread
//! (which formats it for the trace file and the sidecar).
//!
//! Each thread appends fixed-size records to its own single-producer ring, which the writer
//! drains every few milliseconds. So the allocating thread does no I/O, no formatting, takes no
//! lock, never allocates, and touches no cache line that other allocating threads write. A full
//! ring drops the record and counts it; in lossless mode (`VRAMCAP_TRACE_MODE=lossless`) the
//! thread waits for the writer instead, as long as there is a writer to wait for.
//!
//! Sequence numbers are given by the writer, not taken by the allocating thread: a shared counter
//! would cost every event a locked read-modify-write on one cache line that all threads fight
//! over. The writer merges each drained block by time and numbers it; a record remembers how many
//! of its thread's events were dropped just before it, so the writer leaves that many numbers out
//! and a gap in `seq` still marks where events were lost.

use crate::ffi::CUresult;
use crate::sync::Lock;
use std::cell::{Cell, UnsafeCell};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// What happened, as the trace's `op` field names it (one definition for writer and readers).
pub use vramcap_common::trace::Op;

/// An entry point, by its index in the hook table. The names are the hook table's; the writer
/// is handed them when tracing starts (`trace::configure`), so nothing on the event path needs
/// the table itself.
pub type Api = u16;

#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub op: Op,
    pub api: Api,
    /// Device ordinal, -1 when none applies.
    pub dev: i32,
    /// Device pointer, or the handle for VMM.
    pub ptr: u64,
    /// Bytes requested; for `free`, bytes released.
    pub size: u64,
    pub result: CUresult,
    /// Time spent in the real driver call, in clock ticks ([`crate::clock`]); 0 for a deny.
    pub dur: u64,
    /// This process's charge on the device after the call.
    pub used: u64,
    /// The group's charge on the device after the call ([`NO_GROUP`]: not a group member, or the
    /// group does not cap this device).
    pub group_used: u64,
}

pub const NO_GROUP: u64 = u64::MAX;

/// The `api` of a `limit` event (no entry point made it): the ceiling file, or the group's
/// ledger. Outside the hook table's indices.
pub const API_CEILING: Api = u16::MAX - 1;
pub const API_GROUP: Api = u16::MAX - 2;

/// Records a limit that changed while the process ran (`Op::Limit`, docs/trace-format.md): on
/// device `dev`, from `old` to `new` (0 = none), by `uid`; `api` is [`API_CEILING`] or
/// [`API_GROUP`].
pub fn limit_changed(api: Api, dev: usize, old: u64, new: u64, uid: u32, used: u64) {
    if enabled() {
        let ev = Event { op: Op::Limit, api, dev: dev as i32, ptr: old, size: new, result: uid as CUresult, dur: 0, used, group_used: NO_GROUP };
        emit(ev, crate::clock::ticks());
    }
}

/// An event as the writer handles it: stamped with its time and thread, numbered by [`number`].
#[derive(Clone, Copy, Debug)]
pub struct Record {
    pub seq: u64,
    /// When the call returned, in clock ticks ([`crate::clock`]).
    pub at: u64,
    pub tid: u32,
    /// Events of this thread dropped (ring full) right before this one: `seq` skips that many.
    pub lost_before: u32,
    pub ev: Event,
}

/// An event as buffered in a thread's ring: a [`Record`] without its number, packed into
/// exactly one cache line (so a push writes one line, never two).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Pushed {
    at: u64,
    ptr: u64,
    size: u64,
    dur: u64,
    used: u64,
    group_used: u64,
    tid: u32,
    result: CUresult,
    lost_before: u32,
    api: Api,
    /// Device ordinals are below `ledger::MAX_DEVICES` (64), or -1.
    dev: i8,
    op: Op,
}

impl Pushed {
    #[inline(always)]
    fn pack(at: u64, tid: u32, lost_before: u32, e: Event) -> Pushed {
        Pushed {
            at,
            ptr: e.ptr,
            size: e.size,
            dur: e.dur,
            used: e.used,
            group_used: e.group_used,
            tid,
            result: e.result,
            dev: e.dev.clamp(-1, i8::MAX as i32) as i8,
            api: e.api,
            lost_before,
            op: e.op,
        }
    }

    fn unpack(&self) -> Record {
        let ev = Event {
            op: self.op,
            api: self.api,
            dev: self.dev as i32,
            ptr: self.ptr,
            size: self.size,
            result: self.result,
            dur: self.dur,
            used: self.used,
            group_used: self.group_used,
        };
        Record { seq: 0, at: self.at, tid: self.tid, lost_before: self.lost_before, ev }
    }
}

/// Records per thread ring: at 1 M events/s from one thread the writer has 16 ms to come by.
pub const THREAD_CAPACITY: usize = 1 << 14;

/// Keeps a hot atomic on its own cache line (no false sharing with what the writer touches).
#[repr(align(128))]
struct Padded<T>(T);

/// One thread's ring: single producer (the owning thread), single consumer (the writer). Pushing
/// is a plain store of the record and a release store of `head`: no read-modify-write at all.
/// Rings are never freed: a thread that exits hands its ring back for the next new thread (the
/// writer still drains whatever it held).
pub struct ThreadBuf {
    head: Padded<AtomicUsize>,
    tail: Padded<AtomicUsize>,
    /// Events this ring dropped, ever. Written only by the producer (a plain load and store, no
    /// locked instruction: a lagging writer must not make the drop path dearer); the writer sums.
    dropped: AtomicU64,
    /// Producer only: `dropped` as of the last record pushed, and `tail` as last read.
    reported: UnsafeCell<u64>,
    tail_seen: UnsafeCell<usize>,
    slots: Box<[UnsafeCell<MaybeUninit<Pushed>>]>,
    in_use: AtomicBool,
}

unsafe impl Sync for ThreadBuf {}

const _: () = assert!(std::mem::size_of::<Pushed>() == 64);

impl ThreadBuf {
    fn new() -> ThreadBuf {
        ThreadBuf {
            head: Padded(AtomicUsize::new(0)),
            tail: Padded(AtomicUsize::new(0)),
            dropped: AtomicU64::new(0),
            reported: UnsafeCell::new(0),
            tail_seen: UnsafeCell::new(0),
            slots: (0..THREAD_CAPACITY).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect(),
            in_use: AtomicBool::new(true),
        }
    }

    /// Producer side (only the owning thread). False when full (after waiting for room, when
    /// `wait` says to).
    #[inline(always)]
    fn push(&self, tid: u32, ev: Event, at: u64, wait: bool) -> bool {
        let h = self.head.0.load(Ordering::Relaxed);
        // Only the owning thread touches these.
        let (tail_seen, reported) = unsafe { (&mut *self.tail_seen.get(), &mut *self.reported.get()) };
        // The writer's tail is re-read only when the ring looks full: its cache line is written
        // at every drain.
        if h.wrapping_sub(*tail_seen) >= THREAD_CAPACITY {
            *tail_seen = self.tail.0.load(Ordering::Acquire);
            if h.wrapping_sub(*tail_seen) >= THREAD_CAPACITY && !(wait && self.wait_for_room(h, tail_seen)) {
                self.dropped.store(self.dropped.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                return false;
            }
        }
        let lost = (self.dropped.load(Ordering::Relaxed) - *reported).min(u32::MAX as u64);
        *reported += lost;
        unsafe { (*self.slots[h % THREAD_CAPACITY].get()).write(Pushed::pack(at, tid, lost as u32, ev)) };
        self.head.0.store(h.wrapping_add(1), Ordering::Release);
        // The writer read the next slot's line a lap ago, so writing it means taking the line
        // back from the writer's core. Ask for it now: the transfer overlaps whatever the
        // application and the driver do before the next event, instead of stalling its first
        // locked instruction behind a pending store.
        prefetch_for_write(self.slots[h.wrapping_add(1) % THREAD_CAPACITY].get().cast());
        true
    }

    /// Lossless mode, ring full: waits until the writer has taken records (true), or until there
    /// is no writer left to take them (false: the process is exiting, or the writer never ran).
    /// Sleeps rather than spins: the writer needs the CPU this thread would burn.
    #[cold]
    #[inline(never)]
    fn wait_for_room(&self, h: usize, tail_seen: &mut usize) -> bool {
        let mut nap = 20_000;
        // A child made without the atfork handlers (`_Fork()`, a raw `clone`) inherits
        // WRITER_LIVE but not the writer: only a writer of this process is worth waiting for.
        while WRITER_LIVE.load(Ordering::Acquire) && WRITER_OWNER.load(Ordering::Relaxed) == unsafe { libc::getpid() } {
            let ts = libc::timespec { tv_sec: 0, tv_nsec: nap };
            unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
            nap = (nap * 2).min(1_000_000);
            *tail_seen = self.tail.0.load(Ordering::Acquire);
            if h.wrapping_sub(*tail_seen) < THREAD_CAPACITY {
                return true;
            }
        }
        false
    }

    /// Consumer side (only the writer): appends everything published so far to `into`, not yet
    /// numbered.
    pub fn drain(&self, into: &mut Vec<Record>) {
        let t = self.tail.0.load(Ordering::Relaxed);
        let h = self.head.0.load(Ordering::Acquire);
        let mut i = t;
        while i != h {
            let p = unsafe { (*self.slots[i % THREAD_CAPACITY].get()).assume_init() };
            into.push(p.unpack());
            i = i.wrapping_add(1);
        }
        self.tail.0.store(h, Ordering::Release);
    }
}

/// A hint only: no effect on what the program computes.
#[inline(always)]
fn prefetch_for_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    unsafe {
        core::arch::asm!("prefetchw [{}]", in(reg) p, options(nostack, preserves_flags, readonly))
    };
    #[cfg(target_arch = "aarch64")]
    unsafe {
        core::arch::asm!("prfm pstl1keep, [{}]", in(reg) p, options(nostack, preserves_flags, readonly))
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
}

static ENABLED: AtomicBool = AtomicBool::new(false);
/// `VRAMCAP_TRACE_MODE=lossless`: a full ring makes the thread wait instead of dropping.
static LOSSLESS: AtomicBool = AtomicBool::new(false);
/// A writer is running (or starting) and will drain the rings: what a lossless wait waits for.
static WRITER_LIVE: AtomicBool = AtomicBool::new(false);
/// The pid of the process whose writer [`WRITER_LIVE`] speaks of.
static WRITER_OWNER: AtomicI32 = AtomicI32::new(0);
static BUFFERS: Lock<Vec<&'static ThreadBuf>> = Lock::new(Vec::new());
static WRITER_STARTED: AtomicBool = AtomicBool::new(false);
/// Events the writer could not deliver (a failed write, nowhere to write). Those lost in a full
/// ring are counted by the ring itself.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Writer only: the next sequence number, and how many ring drops it has left gaps for.
static NEXT_SEQ: AtomicU64 = AtomicU64::new(0);
static GAPS: AtomicU64 = AtomicU64::new(0);
/// Bumped in a forked child, so per-thread caches taken before the fork are refreshed.
static FORK_GENERATION: AtomicU32 = AtomicU32::new(0);

/// Whether anyone consumes events (decides whether wrappers time the driver call).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn set_lossless(on: bool) {
    LOSSLESS.store(on, Ordering::Relaxed);
}

pub fn lossless() -> bool {
    LOSSLESS.load(Ordering::Relaxed)
}

/// Set by the trace module: true once a writer is started, false when it has drained for the
/// last time (from then on a lossless wait would never end).
pub fn set_writer_live(on: bool) {
    if on {
        WRITER_OWNER.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    }
    WRITER_LIVE.store(on, Ordering::Release);
}

/// Hands an event to the writer: never blocks, never allocates after the thread's first event.
/// `at` is the tick at which the call returned.
#[inline(always)]
pub fn emit(ev: Event, at: u64) {
    let Some(me) = me() else { return };
    unsafe { &*me.buf }.push(me.tid, ev, at, LOSSLESS.load(Ordering::Relaxed));
}

/// Events lost in full rings, over every ring ever handed out.
fn ring_dropped() -> u64 {
    BUFFERS.lock().iter().map(|b| b.dropped.load(Ordering::Relaxed)).sum()
}

/// Writer only: puts a drained block in time order (a thread's own events keep their order) and
/// numbers it, leaving a gap wherever a thread dropped events.
pub fn number(batch: &mut [Record]) {
    let (next, gaps) = number_from(batch, NEXT_SEQ.load(Ordering::Relaxed));
    NEXT_SEQ.store(next, Ordering::Relaxed);
    GAPS.fetch_add(gaps, Ordering::Relaxed);
}

/// [`number`] without the globals: numbers `batch` from `next`; returns the next free number and
/// how many numbers were left out for drops.
fn number_from(batch: &mut [Record], mut next: u64) -> (u64, u64) {
    // Stable, and each thread's run is already sorted: this is a merge, not a full sort.
    batch.sort_by_key(|r| r.at);
    let mut gaps = 0u64;
    for r in batch.iter_mut() {
        next += r.lost_before as u64;
        gaps += r.lost_before as u64;
        r.seq = next;
        next += 1;
    }
    (next, gaps)
}

/// Events handed out so far (written or dropped): what the writer numbered, plus ring drops it
/// has not yet seen a later event for; and of them, those dropped (in a ring, or by the writer).
/// One reading of the rings' drop counters for both: threads still allocating keep dropping into
/// full rings, and two readings would count those drops in one and not the other (the summary's
/// `events - dropped` must equal its event lines).
pub fn emitted_and_dropped() -> (u64, u64) {
    let ring = ring_dropped();
    let emitted = NEXT_SEQ.load(Ordering::Relaxed) + ring.saturating_sub(GAPS.load(Ordering::Relaxed));
    (emitted, DROPPED.load(Ordering::Relaxed) + ring)
}

pub fn dropped() -> u64 {
    emitted_and_dropped().1
}

/// Counts records the writer could not deliver (full disk, closed sink).
pub fn add_dropped(n: u64) {
    DROPPED.fetch_add(n, Ordering::Relaxed);
}

/// The writer's view: every ring ever handed out (they are never freed).
pub fn buffers(into: &mut Vec<&'static ThreadBuf>) {
    into.clear();
    into.extend(BUFFERS.lock().iter().copied());
}

/// What a thread needs per event, behind one thread-local access.
#[derive(Clone, Copy)]
struct Me {
    generation: u32,
    tid: u32,
    buf: *const ThreadBuf,
}

thread_local! {
    static ME: Cell<Me> = const { Cell::new(Me { generation: u32::MAX, tid: 0, buf: std::ptr::null() }) };
    /// Hands the ring back when the thread exits.
    static RELEASE: Release = const { Release };
}

struct Release;
impl Drop for Release {
    fn drop(&mut self) {
        if let Ok(me) = ME.try_with(|c| c.get())
            && !me.buf.is_null()
            && me.generation == FORK_GENERATION.load(Ordering::Relaxed)
        {
            unsafe { &*me.buf }.in_use.store(false, Ordering::Release);
        }
    }
}

#[inline]
fn me() -> Option<Me> {
    let generation = FORK_GENERATION.load(Ordering::Relaxed);
    let me = ME.try_with(|c| c.get()).ok()?;
    if me.generation == generation {
        return Some(me);
    }
    acquire(generation)
}

#[cold]
fn acquire(generation: u32) -> Option<Me> {
    if !WRITER_STARTED.swap(true, Ordering::AcqRel) {
        // Live from now on, before the thread exists: other threads' rings can fill while this
        // one is still starting it, and a lossless thread must wait for it, not drop.
        set_writer_live(true);
        if !crate::trace::spawn_writer() {
            set_writer_live(false);
            set_enabled(false);
            return None;
        }
    }
    let buf = {
        let mut all = BUFFERS.lock();
        match all.iter().find(|b| b.in_use.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok()) {
            Some(b) => *b,
            None => {
                let b: &'static ThreadBuf = Box::leak(Box::new(ThreadBuf::new()));
                all.push(b);
                b
            }
        }
    };
    // gettid is a syscall: once per thread (and again in a forked child).
    let me = Me { generation, tid: unsafe { libc::gettid() } as u32, buf };
    ME.try_with(|c| c.set(me)).ok()?;
    // Registers the thread-exit hook (first access only).
    let _ = RELEASE.try_with(|_| ());
    Some(me)
}

/// In a forked child only the forking thread survives and the parent's writer is gone. Forget
/// the parent's buffers without touching them (another thread may have held one at fork time)
/// and start afresh: new buffers, a new writer, a new file, sequence numbers from 0.
pub fn after_fork_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
    BUFFERS.reset_in_child();
    std::mem::forget(std::mem::take(&mut *BUFFERS.lock()));
    WRITER_STARTED.store(false, Ordering::Release);
    WRITER_LIVE.store(false, Ordering::Release);
    NEXT_SEQ.store(0, Ordering::Relaxed);
    GAPS.store(0, Ordering::Relaxed);
    DROPPED.store(0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tid: u32, at: u64, lost_before: u32) -> Record {
        let ev = Event { op: Op::Alloc, api: 1, dev: 0, ptr: 0, size: 0, result: 0, dur: 0, used: 0, group_used: NO_GROUP };
        Record { seq: u64::MAX, at, tid, lost_before, ev }
    }

    #[test]
    fn a_block_is_merged_by_time_and_drops_leave_gaps() {
        // Two threads' runs, drained one after the other; equal times keep the drained order.
        let mut b = vec![rec(1, 10, 0), rec(1, 30, 2), rec(1, 50, 0), rec(2, 20, 0), rec(2, 30, 0), rec(2, 60, 1)];
        let (next, gaps) = number_from(&mut b, 100);
        let got: Vec<(u32, u64, u64)> = b.iter().map(|r| (r.tid, r.at, r.seq)).collect();
        assert_eq!(got, [(1, 10, 100), (2, 20, 101), (1, 30, 104), (2, 30, 105), (1, 50, 106), (2, 60, 108)]);
        assert_eq!((next, gaps), (109, 3));
        // The numbers left out are exactly the drops.
        let used: std::collections::BTreeSet<u64> = b.iter().map(|r| r.seq).collect();
        assert_eq!((100..next).filter(|n| !used.contains(n)).count() as u64, gaps);
    }

    #[test]
    fn a_full_ring_counts_its_drops_and_the_next_record_carries_them() {
        let b = ThreadBuf::new();
        let ev = rec(0, 0, 0).ev;
        for i in 0..THREAD_CAPACITY as u64 {
            assert!(b.push(7, ev, i, false));
        }
        for _ in 0..3 {
            assert!(!b.push(7, ev, 0, false), "full: dropped, never waited for");
        }
        assert_eq!(b.dropped.load(Ordering::Relaxed), 3);
        let mut out = Vec::new();
        b.drain(&mut out);
        assert_eq!(out.len(), THREAD_CAPACITY);
        assert!(out.iter().enumerate().all(|(i, r)| r.at == i as u64 && r.lost_before == 0 && r.tid == 7));
        out.clear();
        // Room again: the first record after the drops says how many came before it, once.
        assert!(b.push(7, ev, 1000, false) && b.push(7, ev, 1001, false));
        b.drain(&mut out);
        let lost: Vec<u32> = out.iter().map(|r| r.lost_before).collect();
        assert_eq!(lost, [3, 0]);
    }
}

#[cfg(test)]
mod lossless_tests {
    use super::*;

    /// Lossless: a full ring waits for the consumer and loses nothing.
    #[test]
    fn a_full_ring_waits_for_the_writer_in_lossless_mode() {
        let b: &'static ThreadBuf = Box::leak(Box::new(ThreadBuf::new()));
        let ev = Event { op: Op::Alloc, api: 1, dev: 0, ptr: 0, size: 0, result: 0, dur: 0, used: 0, group_used: NO_GROUP };
        // No writer (exiting, or none started): dropped, never waited for in vain.
        for i in 0..THREAD_CAPACITY as u64 {
            assert!(b.push(7, ev, i, true));
        }
        assert!(!b.push(7, ev, 0, true));
        assert_eq!(b.dropped.load(Ordering::Relaxed), 1);
        b.drain(&mut Vec::new());
        b.dropped.store(0, Ordering::Relaxed);
        unsafe { *b.reported.get() = 0 };
        set_writer_live(true);
        let n = 3 * THREAD_CAPACITY as u64;
        let consumer = std::thread::spawn(move || {
            let mut got = Vec::new();
            while (got.len() as u64) < n {
                std::thread::sleep(std::time::Duration::from_millis(1));
                b.drain(&mut got);
            }
            got
        });
        for i in 0..n {
            assert!(b.push(7, ev, i, true));
        }
        let got = consumer.join().unwrap();
        set_writer_live(false);
        assert_eq!(b.dropped.load(Ordering::Relaxed), 0);
        assert!(got.iter().enumerate().all(|(i, r)| r.at == i as u64 && r.lost_before == 0));
    }
}
