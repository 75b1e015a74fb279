//! Memory no allocation call returns (issue 24): what a context takes when it is created, what a
//! module's code and `__device__` globals take when it is loaded, what a per-context reservation
//! (`cuCtxSetLimit`) takes. Nobody says how much that is, so it is measured: the driver's own
//! books ([`books`]) are read before and after each such call, the change minus what vramcap
//! itself counted meanwhile (allocations of other threads) is this call's overhead, and it is
//! charged to the process and its group like an allocation (the cap counts it, so do
//! `cuMemGetInfo` and NVML's views), under the context it belongs to. It goes back when the
//! driver gives it back (a module unloaded, a limit lowered: measured again) and all of it when
//! the context ends.
//!
//! Never on the allocation path: only context creation and end, module load and unload, and
//! `cuCtxSetLimit` pay for the readings. All of it happens under the context lock
//! (`context::serial`), so two of these calls never measure each other's memory.
//!
//! A context cannot be refused before it exists, since its size is only known after: the size
//! last measured for a context on the device is reserved before the call (none for the first; in
//! a group, the first is measured by one member at a time, `group::first_context`),
//! and a context whose measured size does not fit is ended at once and refused with the driver's
//! `CUDA_ERROR_OUT_OF_MEMORY`; so is a module (unloaded) and a limit (put back).

use super::books::{self, Reading, Source};
use super::moves;
use super::charge::{Timed, emit};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::Hook;
use crate::ledger::{self, MAX_DEVICES};
use crate::sync::Lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// What each context holds beyond its allocations: its own size, and what modules and limits
/// added (a primary reset gives that part back and keeps the context).
#[derive(Clone, Copy, Default)]
struct Held {
    dev: usize,
    context: u64,
    extra: u64,
}

static HELD: Lock<Option<HashMap<u64, Held>>> = Lock::new(None);

/// The size last measured for a context on each device: reserved before the next one is made.
static LAST_CONTEXT: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// Overhead this process holds on `dev`.
pub fn total(dev: usize) -> u64 {
    ledger::overhead(dev)
}

/// A reading of the driver's books and of what vramcap counted as allocations at that moment.
pub struct Probe {
    pub dev: usize,
    books: Option<Reading>,
    counted: u64,
    /// The moves (`moves`) just before the reading: a prefetch completed since moved the books
    /// where vramcap's counts did not follow.
    moves: moves::Look,
    /// Taken at a quiet moment (not the bound that makes the overhead larger).
    exact: bool,
}

/// Quick tries at a reading with vramcap's own count standing still (see [`quiet_read`]), a
/// yield apart; then pauses that let a thread descheduled in the middle of its call finish it,
/// up to [`QUIET_PATIENCE`] in all. Only the rare calls that measure wait: never an allocation.
const QUIET_SPINS: usize = 64;
const QUIET_PATIENCE: std::time::Duration = std::time::Duration::from_millis(100);
/// How long to wait for a reading no move spoiled when none came within [`QUIET_PATIENCE`]: moves
/// are single driver calls (a prefetch, a free, a destroy) and a settle after a trim.
const MOVE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

/// The books of `dev`, and what vramcap counted as allocations at that moment. Other threads'
/// allocations go on meanwhile: one in flight is reserved (`charged`) before the driver has it
/// and held only after, and a free is no longer held before the driver has it and still charged
/// until after; so the driver's books may or may not show either. A reading taken between two
/// equal looks at the counts ([`ledger::Snapshot`]) with nothing reserved beyond what is held
/// had nothing in flight, and nothing made and freed again meanwhile either: the look includes a
/// count that only grows, so an allocation made, seen by the books and freed again between the two
/// looks (`charged` and `held` back where they were) is not taken for a quiet moment. That mistake
/// charged another thread's allocation as a context's overhead.
///
/// Memory can also change in the books while the counts stand still: a pool the driver
/// trimmed (at a synchronize, `cuMemPoolTrimTo`, pressure relief) or grew for an allocation in
/// flight is settled only after the call, and a prefetch, a destroyed pool's last free or a
/// pool's destroy move pages or give memory back inside the driver call. So the pools and graph
/// memory are counted at the driver's word, read on both sides of the books and the same
/// ([`moves::pools`]; a stream-ordered allocation in flight is then no uncertainty), and no
/// reading a move was under way or completed around is taken ([`moves::Moving`]).
///
/// Failing a quiet moment within [`QUIET_PATIENCE`], the bound that makes the overhead larger
/// (`before`: what is in flight counted as allocations; after: not) — too large can only deny,
/// too small could pass the cap — from the steady reading with the least in flight, since what
/// is in flight is what the bound can overstate by.
/// `own`: this call's reservation, outstanding while it reads (not in flight elsewhere).
/// The third: whether it was a quiet moment (not a bound).
fn quiet_read(dev: usize, only: Option<Source>, before: bool, own: u64) -> Option<(Reading, u64, bool)> {
    quiet_read_with(dev, before, own, || books::read(dev, only))
}

/// [`quiet_read`] with the books read by `read` (the unit tests put other threads' calls there).
fn quiet_read_with(dev: usize, before: bool, own: u64, mut read: impl FnMut() -> Option<Reading>) -> Option<(Reading, u64, bool)> {
    // What vramcap counted, with its pools and graph memory at the driver's word (`moves::pools`,
    // read on both sides of the books and the same: no trim or growth in the driver between).
    // Less the overhead already charged: what is left is allocations.
    let ours = |c: u64, p: moves::Pools| ((c as i128 + p.driver as i128 - p.charged as i128).max(0) as u64).saturating_sub(total(dev));
    let start = std::time::Instant::now();
    let mut pause = std::time::Duration::from_micros(20);
    // (in flight, reading, what it counted, its pools): the steady reading with the least in flight.
    let mut best: Option<(u64, Reading, u64, moves::Pools)> = None;
    for i in 0.. {
        let s1 = ledger::snapshot(dev);
        let (m1, p1) = (moves::look(dev), moves::pools(dev));
        let r = read()?;
        let (p2, m2) = (moves::pools(dev), moves::look(dev));
        let s2 = ledger::snapshot(dev);
        // Memory that moved in the books without moving the counts (`moves`) makes any reading
        // taken meanwhile wrong by an amount nothing bounds: never a candidate.
        let moved = !(m1 == m2 && m1.still() && p1 == p2);
        if s1 == s2 && !moved {
            let (reserved, held) = (s1.charged.saturating_sub(own), s1.held);
            // Stream-ordered allocations in flight are in the pools' reading already.
            let in_flight = reserved.abs_diff(held).saturating_sub(if reserved > held { p1.reserving } else { 0 });
            if in_flight == 0 {
                return Some((r, ours(held, p1), true));
            }
            let counted = if before { held + in_flight.min(reserved.saturating_sub(held)) } else { reserved.min(held) };
            if best.as_ref().is_none_or(|b| in_flight < b.0) {
                best = Some((in_flight, r, counted, p1));
            }
        }
        if i < QUIET_SPINS {
            std::thread::yield_now();
        } else if start.elapsed() >= QUIET_PATIENCE && (best.is_some() || start.elapsed() >= MOVE_PATIENCE) {
            break;
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(2));
        }
    }
    if let Some((_, r, counted, p)) = best {
        return Some((r, ours(counted, p), false));
    }
    // Never steady: the counts (or the books without them) moved during every reading.
    let c = if before { ledger::charged(dev).saturating_sub(own) } else { ledger::used(dev) };
    let p = moves::pools(dev);
    let r = read()?;
    Some((r, ours(c, p), false))
}

/// Reads the books before a call (and before any reservation for it).
pub fn probe(dev: usize) -> Probe {
    let moves = moves::look(dev);
    match quiet_read(dev, None, true, 0) {
        Some((r, counted, exact)) => Probe { dev, books: Some(r), counted, moves, exact },
        None => Probe { dev, books: None, counted: 0, moves, exact: false },
    }
}

/// What the driver took (positive) or gave back (negative) since `p`, beyond vramcap's own
/// allocations; `None` when the books could not be read twice from one source. `reserved`: what
/// the caller reserved for the call and has not settled yet. A move vramcap's counts never follow
/// (a prefetch) completed meanwhile makes it unsure by up to that move's size: the larger bound.
pub fn measured(p: &Probe, reserved: u64) -> Option<i128> {
    measured_spanning(p, reserved).map(|m| m.bytes + m.unsure as i128)
}

/// What [`measured_spanning`] says.
pub struct Measure {
    pub bytes: i128,
    /// By how much it may be off either way (0: no uncounted move completed meanwhile).
    pub unsure: u64,
    /// Both readings at quiet moments and nothing unsure: a size to go by next time.
    pub exact: bool,
}

/// [`measured`], and by how much it may be off either way (0: exact): the moves vramcap's counts
/// never follow that completed since `p` (`moves::Moving::on`).
pub fn measured_spanning(p: &Probe, reserved: u64) -> Option<Measure> {
    let before = p.books?;
    let (after, counted, quiet) = quiet_read(p.dev, Some(before.source), false, reserved)?;
    let unsure = p.moves.unfollowed_until(&moves::look(p.dev));
    let books = after.used as i128 - before.used as i128;
    let ours = counted as i128 - p.counted as i128;
    Some(Measure { bytes: books - ours, unsure, exact: quiet && p.exact && unsure == 0 })
}

/// Whether `p` could read the books at all (for the one-line notice when it could not).
pub fn source(p: &Probe) -> Option<Source> {
    p.books.map(|r| r.source)
}

/// What a context about to be made on `dev` will take at least: the size this process's last
/// context measured there, or the largest any member of its group measured, plus a copy of each
/// loaded library (eager loading). Before the books are read for the creation: a member that
/// waits here for the group's first context (`group::first_context`) must not have the holder's
/// context in its reading. Reserve it with [`reserve_context`].
pub fn context_estimate(dev: usize) -> u64 {
    let last = LAST_CONTEXT.get(dev).map_or(0, |l| l.load(Ordering::Acquire));
    let mut est = last.max(crate::group::context_estimate(dev));
    if est == 0 && crate::group::first_context(dev) {
        // This member measures the group's first one: the others wait for its size.
        if let Some(l) = LEASED.get(dev) {
            l.store(true, Ordering::Release);
        }
    } else if est == 0 {
        est = crate::group::context_estimate(dev);
    }
    est.saturating_add(super::libraries::copies_for_a_new_context())
}

/// Reserves `est` ([`context_estimate`]) before a call that creates a context: `Err` (nothing
/// reserved) when that cannot fit.
pub fn reserve_context(api: Hook, dev: usize, est: u64) -> Result<u64, CUresult> {
    if est == 0 {
        return Ok(0);
    }
    reserve(api, dev, est).map(|()| est)
}

/// A context made in a create that also made the primary context (`cuGreenCtxCreate`): `bytes`
/// for both, noted as the primary context's size (the larger estimate: the next create reserves
/// at least the primary), so that a program using green contexts only gets a reservation too.
pub fn note_primary_with_green(dev: usize, bytes: u64) {
    if let Some(l) = LAST_CONTEXT.get(dev) {
        l.store(bytes, Ordering::Release);
    }
    crate::group::note_context(dev, bytes);
}

/// Devices where this process holds the group's first-context lease (`group::first_context`).
static LEASED: [std::sync::atomic::AtomicBool; MAX_DEVICES] = [const { std::sync::atomic::AtomicBool::new(false) }; MAX_DEVICES];

/// [`context_settled`] when dropped: for a creation with many ways out (`green::create`).
pub struct Settle(pub usize);

impl Drop for Settle {
    fn drop(&mut self) {
        context_settled(self.0);
    }
}

/// A context creation [`reserve_context`] prepared is over (made and measured, or not made): a
/// first-context lease goes back, after the size was noted.
pub fn context_settled(dev: usize) {
    if LEASED.get(dev).is_some_and(|l| l.swap(false, Ordering::AcqRel)) {
        crate::group::first_context_done(dev);
    }
}

/// Reserves `size` bytes of overhead on `dev`, or refuses them with the driver's out-of-memory
/// code (the denial said and traced). In observe mode a refusal is granted and recorded as a
/// `would_deny`, like an allocation's: a job in observe mode must see no refusal vramcap made.
pub fn reserve(api: Hook, dev: usize, size: u64) -> Result<(), CUresult> {
    match ledger::reserve(dev, size) {
        Ok(()) => Ok(()),
        Err(d) => deny(api, dev, size, &d),
    }
}

#[cold]
#[inline(never)]
fn deny(api: Hook, dev: usize, size: u64, d: &ledger::Denied) -> Result<(), CUresult> {
    if !super::charge::refused(api, dev, size, d) {
        return Ok(());
    }
    emit(Op::Deny, api, dev as i32, 0, size, Timed::instant(CUDA_ERROR_OUT_OF_MEMORY), ledger::used(dev));
    Err(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Turns `reserved` into a reservation of `bytes` (more reserved, or the surplus given back);
/// `Err` (nothing left reserved) when the more does not fit.
fn settle_reservation(api: Hook, dev: usize, bytes: u64, reserved: u64) -> Result<(), CUresult> {
    if bytes > reserved
        && let Err(e) = reserve(api, dev, bytes - reserved)
    {
        ledger::unreserve(dev, reserved);
        return Err(e);
    }
    if reserved > bytes {
        ledger::unreserve(dev, reserved - bytes);
    }
    Ok(())
}

/// Charges `bytes` measured for `ctx` (a new context when `new`), `reserved` of them reserved
/// before the call. `Err` when they do not fit: nothing stays charged, the caller undoes the call.
pub fn charge(api: Hook, ctx: u64, dev: usize, bytes: u64, reserved: u64, new: bool) -> Result<(), CUresult> {
    charge_as(api, ctx, dev, bytes, reserved, new, new)
}

/// [`charge`]; a new context's size is what the next one reserves (this process's last, the
/// group's largest for good) only when `note` (it was measured exactly): a bound (the books never
/// quiet, a prefetch completed meanwhile) is noted only where no size is known yet (one wrong
/// reading used to raise the group's estimate for the life of its ledger).
pub fn charge_as(api: Hook, ctx: u64, dev: usize, bytes: u64, reserved: u64, new: bool, note: bool) -> Result<(), CUresult> {
    settle_reservation(api, dev, bytes, reserved)?;
    if new && let Some(l) = LAST_CONTEXT.get(dev) {
        if note {
            l.store(bytes, Ordering::Release);
            crate::group::note_context(dev, bytes);
        } else if l.compare_exchange(0, bytes, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            crate::group::note_context_if_none(dev, bytes);
        }
    }
    if new {
        // A context whose end we never saw left its address to this one: its memory is gone.
        context_ended(api, ctx);
    }
    if bytes == 0 {
        return Ok(());
    }
    ledger::commit(dev, bytes);
    ledger::add_overhead(dev, bytes);
    let mut held = HELD.lock();
    let h = held.get_or_insert_with(HashMap::new).entry(ctx).or_insert(Held { dev, ..Held::default() });
    if new {
        h.context = h.context.saturating_add(bytes);
    } else {
        h.extra = h.extra.saturating_add(bytes);
    }
    let now = h.context + h.extra;
    drop(held);
    emit(Op::Overhead, api, dev as i32, ctx, now, Timed::instant(CUDA_SUCCESS), ledger::used(dev));
    Ok(())
}

/// Charges `bytes` of overhead that no one context holds (a library's copies on a device with
/// several contexts, `super::libraries`): traced under `key`, given back only by [`give_back`].
pub fn charge_unowned(api: Hook, key: u64, dev: usize, bytes: u64, reserved: u64) -> Result<(), CUresult> {
    settle_reservation(api, dev, bytes, reserved)?;
    if bytes > 0 {
        ledger::commit(dev, bytes);
        ledger::add_overhead(dev, bytes);
        emit(Op::Overhead, api, dev as i32, key, bytes, Timed::instant(CUDA_SUCCESS), ledger::used(dev));
    }
    Ok(())
}

/// What an undone call left held since `p`, charged to no context (see [`charge_unowned`]): it
/// stays charged, whether or not it fits.
pub fn keep_unowned(api: Hook, key: u64, p: &Probe) {
    if let Some(d) = measured(p, 0)
        && d > 0
    {
        let bytes = d.min(u64::MAX as i128) as u64;
        ledger::charge(p.dev, bytes);
        ledger::add_overhead(p.dev, bytes);
        emit(Op::Overhead, api, p.dev as i32, key, bytes, Timed::instant(CUDA_SUCCESS), ledger::used(p.dev));
    }
}

pub fn give_back(api: Hook, ctx: u64, dev: usize, bytes: u64) {
    if bytes == 0 {
        return;
    }
    ledger::release(dev, bytes);
    ledger::sub_overhead(dev, bytes);
    emit(Op::OverheadFree, api, dev as i32, ctx, bytes, Timed::instant(CUDA_SUCCESS), ledger::used(dev));
}

/// The driver gave back `bytes` of what modules and limits added to `ctx` (never more than they
/// added: the context itself goes only with the context).
pub fn shrink(api: Hook, ctx: u64, bytes: u64) {
    let taken = {
        let mut held = HELD.lock();
        let Some(h) = held.as_mut().and_then(|m| m.get_mut(&ctx)) else { return };
        let n = bytes.min(h.extra);
        h.extra -= n;
        (h.dev, n)
    };
    give_back(api, ctx, taken.0, taken.1);
}

/// Everything charged to `from` (a green context destroyed while the primary context it may have
/// created lives on) is `to`'s from now on, and goes when `to` ends.
pub fn hand_over(from: u64, to: u64) {
    let mut held = HELD.lock();
    let Some(m) = held.as_mut() else { return };
    let Some(h) = m.remove(&from) else { return };
    let t = m.entry(to).or_insert(Held { dev: h.dev, ..Held::default() });
    t.extra = t.extra.saturating_add(h.context + h.extra);
}

/// Contexts whose malloc heap and printf FIFO the driver has taken (a module or library was
/// loaded into them): the next load there brings none (`modules::heap_estimate`).
static HEAPED: Lock<Option<std::collections::HashSet<u64>>> = Lock::new(None);

pub fn note_heap(ctx: u64) {
    HEAPED.lock().get_or_insert_with(Default::default).insert(ctx);
}

pub fn heap_taken(ctx: u64) -> bool {
    HEAPED.lock().as_ref().is_some_and(|s| s.contains(&ctx))
}

/// The driver gave back what modules brought to `ctx` (a primary reset keeps the context).
pub fn heap_gone(ctx: u64) {
    if let Some(s) = HEAPED.lock().as_mut() {
        s.remove(&ctx);
    }
}

/// The context ended: everything charged to it goes.
pub fn context_ended(api: Hook, ctx: u64) {
    heap_gone(ctx);
    let gone = HELD.lock().as_mut().and_then(|m| m.remove(&ctx));
    if let Some(h) = gone {
        give_back(api, ctx, h.dev, h.context + h.extra);
    }
}

/// Settles a call measured with `p` against `ctx`: growth is charged (`Err` if it does not fit:
/// the caller undoes the call), shrinkage given back.
pub fn settle(api: Hook, ctx: u64, p: &Probe) -> Result<(), CUresult> {
    match measured(p, 0) {
        Some(d) if d > 0 => charge(api, ctx, p.dev, d.min(u64::MAX as i128) as u64, 0, false),
        Some(d) if d < 0 => {
            shrink(api, ctx, (-d).min(u64::MAX as i128) as u64);
            Ok(())
        }
        _ => Ok(()),
    }
}

/// After an undo (a module unloaded again, a limit set back): what the driver still holds since
/// `p` exists whether or not it fits (a heap stays with its context once a module brought it),
/// so it is charged as it is; what it gave back, given back.
pub fn settle_kept(api: Hook, ctx: u64, p: &Probe) {
    match measured(p, 0) {
        Some(d) if d > 0 => {
            let bytes = d.min(u64::MAX as i128) as u64;
            ledger::charge(p.dev, bytes);
            ledger::add_overhead(p.dev, bytes);
            let mut held = HELD.lock();
            let h = held.get_or_insert_with(HashMap::new).entry(ctx).or_insert(Held { dev: p.dev, ..Held::default() });
            h.extra = h.extra.saturating_add(bytes);
            let now = h.context + h.extra;
            drop(held);
            emit(Op::Overhead, api, p.dev as i32, ctx, now, Timed::instant(CUDA_SUCCESS), ledger::used(p.dev));
        }
        Some(d) if d < 0 => shrink(api, ctx, (-d).min(u64::MAX as i128) as u64),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_gives_back_all_it_was_charged_and_a_shrink_never_takes_the_context() {
        let d = 61;
        ledger::set_limit(d, 100);
        charge(Hook::cuCtxCreate_v2, 7, d, 60, 0, true).unwrap();
        assert_eq!(LAST_CONTEXT[d].load(Ordering::Relaxed), 60);
        charge(Hook::cuCtxCreate_v2, 7, d, 30, 0, false).unwrap();
        // Past the cap: refused, nothing left charged.
        assert_eq!(charge(Hook::cuCtxCreate_v2, 7, d, 20, 0, false), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!((ledger::charged(d), total(d)), (90, 90));
        shrink(Hook::cuCtxCreate_v2, 7, 1000);
        assert_eq!((ledger::charged(d), ledger::used(d), total(d)), (60, 60, 60));
        context_ended(Hook::cuCtxDestroy_v2, 7);
        assert_eq!((ledger::charged(d), ledger::used(d), total(d)), (0, 0, 0));
        ledger::set_limit(d, 0);
    }

    /// A context's size measured only as a bound (the books never quiet, a
    /// prefetch completed meanwhile) is what the next context reserves only where nothing was
    /// measured before; an exact measurement replaces it.
    #[test]
    fn a_bound_never_raises_the_size_the_next_context_reserves() {
        let d = 53;
        charge_as(Hook::cuCtxCreate_v2, 0x53, d, 70, 0, true, false).unwrap();
        assert_eq!(LAST_CONTEXT[d].load(Ordering::Relaxed), 70, "nothing known: the bound is better than none");
        charge_as(Hook::cuCtxCreate_v2, 0x54, d, 30, 0, true, true).unwrap();
        assert_eq!(LAST_CONTEXT[d].load(Ordering::Relaxed), 30, "an exact size replaces it");
        charge_as(Hook::cuCtxCreate_v2, 0x55, d, 400, 0, true, false).unwrap();
        assert_eq!(LAST_CONTEXT[d].load(Ordering::Relaxed), 30, "a bound never raises it");
        for c in [0x53, 0x54, 0x55] {
            context_ended(Hook::cuCtxDestroy_v2, c);
        }
        assert_eq!(ledger::charged(d), 0);
    }

    /// The mistake that got issue 24 reverted: while the books were read, another thread's
    /// allocation was made (reserved, handed out, committed) and freed again (given back,
    /// unreserved), so the counts looked the same before and after, but the books had it. That
    /// reading must not be taken: it charged the other thread's allocation as overhead.
    #[test]
    fn an_allocation_made_and_freed_while_the_books_are_read_is_not_a_quiet_moment() {
        let d = 60;
        let mut calls = 0;
        let read = || {
            calls += 1;
            if calls == 1 {
                // Another thread: cuMemAlloc (48) seen by the books, then its cuMemFree.
                ledger::reserve(d, 48).unwrap();
                ledger::commit(d, 48);
                ledger::uncommit(d, 48);
                ledger::unreserve(d, 48);
                return Some(Reading { source: Source::Process, used: 48 });
            }
            Some(Reading { source: Source::Process, used: 0 })
        };
        let (r, counted, _) = quiet_read_with(d, false, 0, read).unwrap();
        assert_eq!((r.used, counted), (0, 0), "the reading taken while an allocation came and went was used");
        assert_eq!(calls, 2);
        // A reading with nothing moving is taken at once.
        let (r, _, _) = quiet_read_with(d, false, 0, || Some(Reading { source: Source::Process, used: 5 })).unwrap();
        assert_eq!(r.used, 5);
    }

    /// A free in flight (no longer held, still charged) or an allocation in flight (charged, not
    /// yet held) is never a quiet moment either; nor is one that moved during the reading.
    #[test]
    fn a_reading_with_anything_in_flight_waits_for_it_to_land() {
        let d = 59;
        ledger::reserve(d, 10).unwrap();
        ledger::commit(d, 10);
        ledger::uncommit(d, 10); // a free whose driver call is under way
        let mut calls = 0;
        let read = || {
            calls += 1;
            if calls == 2 {
                ledger::unreserve(d, 10); // ... returns during the second reading
            }
            Some(Reading { source: Source::Process, used: if calls <= 2 { 10 } else { 0 } })
        };
        let (r, counted, _) = quiet_read_with(d, false, 0, read).unwrap();
        assert_eq!((r.used, counted, calls), (0, 0, 3));
    }

    /// A move (`moves`: a prefetch, an orphan pool's last free) changes the books while the counts
    /// stand still: no reading taken while one is under way, or that one completed around, is
    /// taken (a context made meanwhile was charged the move).
    #[test]
    fn a_reading_taken_while_memory_moves_uncounted_is_not_taken() {
        let d = 52;
        let mut moving = Some(moves::Moving::on(Some(d), 0));
        let mut calls = 0;
        let read = || {
            calls += 1;
            if calls == 2 {
                moving.take(); // the move settles during the second reading
            }
            Some(Reading { source: Source::Process, used: if calls <= 2 { 400 } else { 0 } })
        };
        let (r, counted, _) = quiet_read_with(d, false, 0, read).unwrap();
        assert_eq!((r.used, counted, calls), (0, 0, 3));
    }

    /// Something that never lands (a thread stopped in the middle of its call): after the
    /// patience, the bound that makes the overhead larger, from the steady reading with the least
    /// in flight — before a call what is in flight counts as allocated, after it as not.
    #[test]
    fn without_a_quiet_moment_the_bound_comes_from_the_reading_with_least_in_flight() {
        let d = 58;
        ledger::reserve(d, 100).unwrap();
        ledger::commit(d, 100);
        ledger::reserve(d, 30).unwrap(); // in flight for good
        let mut calls = 0;
        let read = |calls: &mut i32| {
            *calls += 1;
            match *calls {
                // Not steady: another allocation comes and goes during the reading.
                1..=3 => {
                    ledger::reserve(d, 5).unwrap();
                    ledger::commit(d, 5);
                    ledger::release(d, 5);
                }
                // Steady, 30 in flight. Then 40 more go in flight, for good.
                4 => {}
                5 => ledger::reserve(d, 40).unwrap(),
                _ => {}
            }
            Some(Reading { source: Source::Process, used: 1000 })
        };
        let (r, counted, _) = quiet_read_with(d, true, 0, || read(&mut calls)).unwrap();
        assert_eq!((r.used, counted), (1000, 130), "before: the 30 in flight at the best reading counted as allocated");
        let (_, counted, _) = quiet_read_with(d, false, 0, || read(&mut calls)).unwrap();
        assert_eq!(counted, 100, "after: nothing in flight counted");
        // `own` (the caller's own reservation) is not in flight.
        let (_, counted, _) = quiet_read_with(d, true, 70, || read(&mut calls)).unwrap();
        assert_eq!(counted, 100, "all that is reserved is the caller's own: a quiet moment");
        ledger::unreserve(d, 70);
        ledger::release(d, 100);
    }
}
