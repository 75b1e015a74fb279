//! Managed memory (`cuMemAllocManaged`) and where its pages count. An allocation counts in full on
//! the device of the context that made it (all of it can be resident there). A prefetch
//! (`cuMemPrefetchAsync`: v1 with a device or `CU_DEVICE_CPU`, `_v2` with a `CUmemLocation`, their
//! `_ptsz` variants, the CUDA 13 batch forms `cuMemPrefetchBatchAsync` and
//! `cuMemDiscardAndPrefetchBatchAsync`) makes the range resident at its destination: a device
//! destination is charged what moves there (reserved before the driver is asked, refused with
//! `CUDA_ERROR_OUT_OF_MEMORY` if its cap cannot take it, nothing moved) and the devices it leaves
//! are un-charged once the driver accepted. Host memory is not capped, but what rests on the host
//! can come back to a device on a page fault that vramcap never sees: it counts on the allocation's
//! own device again (charged even past that cap: a prefetch to the host is never refused).
//!
//! Residency is kept per 2 MiB unit from the allocation's start (the largest page the driver
//! migrates); a unit a prefetch covers only in part counts both where it was and at the
//! destination (counting too much can only deny). A batch's operations run in no set order, so a
//! unit two of them send to different places counts at each. Each device's share is one ledger entry
//! (`Kind::Managed`, keyed base + device ordinal), so a context's end takes every share with it,
//! as the driver frees the memory wherever it is; a free gives back every share.
//!
//! A prefetch to a device of a range that is not (wholly) one allocation vramcap counts (a managed
//! pool's, a `__managed__` variable's) is refused under a cap (`CUDA_ERROR_NOT_SUPPORTED`, one
//! stderr line): vramcap cannot say what it would move. To the host it goes through.

use super::charge::{self, Target, Timed, begun, emit, timed};
use super::init::ensure_limits;
use super::location::{self, Place};
use super::{MISSING_REAL, Mode, guarded, mode};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::ledger::{self, Charge, Kind};
use crate::sync::Lock;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_uint;
use std::sync::atomic::{AtomicBool, Ordering};

/// Residency unit: 2 MiB, the driver's largest migration page.
pub const UNIT: u64 = 2 << 20;
const CU_DEVICE_CPU: CUdevice = -1;
/// Devices a unit's mask can name (one bit each).
const MASK_DEVICES: usize = 64;

pub(super) struct Alloc {
    size: u64,
    home: usize,
    ctx: u64,
    /// Per unit, the devices it counts on (one bit each); `None` until the first prefetch: all home.
    units: Option<Vec<u64>>,
}

impl Alloc {
    fn nunits(&self) -> usize {
        self.size.div_ceil(UNIT) as usize
    }
    fn unit_bytes(&self, u: usize) -> u64 {
        (self.size - u as u64 * UNIT).min(UNIT)
    }
    fn masks(&self) -> Vec<u64> {
        self.units.clone().unwrap_or_else(|| vec![1 << self.home; self.nunits()])
    }
    /// Devices this allocation has a share on (its ledger entries).
    fn devices(&self) -> u64 {
        self.units.as_ref().map_or(1 << self.home, |v| v.iter().fold(0, |a, m| a | m))
    }
}

/// Live managed allocations by base address. Lock order: this table, then the ledger's. Held across
/// a prefetch's driver call, so that one allocation's residency changes in the order of the calls.
static TABLE: Lock<Option<BTreeMap<u64, Alloc>>> = Lock::new(None);
/// Whether any managed allocation was ever counted here (a free that misses the pointer table
/// looks here only then).
static TRACKED: AtomicBool = AtomicBool::new(false);

fn key(base: u64, dev: usize) -> u64 {
    base + dev as u64
}

#[inline]
pub fn tracked() -> bool {
    TRACKED.load(Ordering::Relaxed)
}

pub unsafe fn alloc(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) -> CUresult {
    let Some(f) = real::cuMemAllocManaged() else { return MISSING_REAL };
    let call = || unsafe { f(dptr, size, flags) };
    let read = || (unsafe { *dptr }, size as u64);
    charge::alloc_with(Hook::cuMemAllocManaged, Target::CurrentContext, size as u64, call, read, |base, dev, ctx, bytes| {
        // Keys base + device stay distinct only for 256-byte aligned bases (the driver aligns far
        // more): anything else is counted as before, in full on its device, never moved.
        if base % 256 != 0 || dev >= MASK_DEVICES {
            return (Kind::DevicePtr, base);
        }
        install_fork_handlers();
        TRACKED.store(true, Ordering::Relaxed);
        let mut t = TABLE.lock();
        t.get_or_insert_with(BTreeMap::new).insert(base, Alloc { size: bytes, home: dev, ctx, units: None });
        (Kind::Managed, key(base, dev))
    })
}

/// `cuMemFree*` of a pointer the pointer table does not hold: if it is managed memory, every
/// device's share stops counting as held before the call and goes after it (or is put back).
#[cold]
pub fn free(api: Hook, base: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let taken = guarded(None, || {
        let mut t = TABLE.lock();
        let a = t.as_mut()?.remove(&base)?;
        let mut shares = Vec::new();
        for d in (0..MASK_DEVICES).filter(|d| a.devices() >> d & 1 == 1) {
            if let Some(c) = ledger::take(Kind::Managed, key(base, d)) {
                ledger::uncommit(d, c.size);
                shares.push((d, c));
            }
        }
        // No share left: its context ended, the driver freed it already.
        (!shares.is_empty()).then_some((a, shares))
    });
    let t = begun(timed(call));
    guarded((), || match taken {
        Some((a, shares)) if t.rc == CUDA_SUCCESS => {
            for (d, c) in &shares {
                ledger::unreserve(*d, c.size);
            }
            emit(Op::Free, api, a.home as i32, base, a.size, t, ledger::used(a.home));
        }
        Some((a, shares)) => {
            for (d, c) in shares {
                ledger::commit(d, c.size);
                ledger::insert(Kind::Managed, key(base, d), c);
            }
            let home = a.home;
            TABLE.lock().get_or_insert_with(BTreeMap::new).insert(base, a);
            emit(Op::Fail, api, home as i32, base, 0, t, ledger::used(home));
        }
        None if t.rc != CUDA_SUCCESS => emit(Op::Fail, api, -1, base, 0, t, 0),
        None => {}
    });
    t.rc
}

/// Runs `f` on the allocation table, locked. A prefetch takes an allocation's shares out of the
/// ledger and puts them back while it holds this lock, so a context's end or hand-over must pass
/// over the ledger's context-owned charges under it too: outside it, the pass can miss shares a
/// prefetch has out at that moment, which it then puts back under the old context handle.
pub(super) fn locked<R>(f: impl FnOnce(&mut BTreeMap<u64, Alloc>) -> R) -> R {
    install_fork_handlers();
    let mut g = TABLE.lock();
    f(g.get_or_insert_with(BTreeMap::new))
}

/// The driver ended these contexts, and with them their managed memory (the ledger's shares were
/// drained, under [`locked`]): forget the allocations, whose addresses the driver may hand out
/// again.
pub(super) fn contexts_ended(t: &mut BTreeMap<u64, Alloc>, ctxs: &[u64]) {
    t.retain(|_, a| a.ctx == 0 || !ctxs.contains(&a.ctx));
}

/// The shares of `from` now belong to `to` (`context::rekey`, under [`locked`]): so do its
/// allocations.
pub(super) fn rekey(t: &mut BTreeMap<u64, Alloc>, from: u64, to: u64) {
    t.values_mut().filter(|a| a.ctx == from).for_each(|a| a.ctx = to);
}

/// Where one prefetch sends its range.
#[derive(Clone, Copy)]
enum Dest {
    Device(usize),
    Host,
}

struct Move {
    ptr: u64,
    len: u64,
    dest: Dest,
}

/// What a prefetch changes, decided before the driver call.
struct Plan {
    /// Bytes reserved per destination device (committed after success).
    reserved: Vec<(usize, u64)>,
    /// Bytes charged after success without a reservation (units back on their home device).
    forced: Vec<(usize, u64)>,
    /// Per allocation: its new masks, and per device the change of its share.
    allocs: Vec<(u64, Vec<u64>, Vec<(usize, i64)>)>,
}

fn add(v: &mut Vec<(usize, u64)>, d: usize, b: u64) {
    match v.iter_mut().find(|e| e.0 == d) {
        Some(e) => e.1 += b,
        None => v.push((d, b)),
    }
}

fn plan(api: Hook, table: &mut BTreeMap<u64, Alloc>, moves: &[Move]) -> Result<Plan, CUresult> {
    // Per allocation and unit: the places this call's moves send it to, and whether one of them
    // covers it whole. A batch's operations run in no set order (documented), so a unit two of
    // them touch may end at either place: it counts at every one, and stays counted where it was
    // unless some move takes all of it away.
    let mut work: HashMap<u64, (Vec<u64>, Vec<bool>)> = HashMap::new();
    let mut device_dests = 0u64;
    for m in moves.iter().filter(|m| m.len > 0) {
        let found = table
            .range(..=m.ptr)
            .next_back()
            .filter(|(b, a)| m.ptr - **b < a.size && m.len <= a.size - (m.ptr - **b))
            .map(|(b, _)| *b);
        let Some(base) = found else {
            match m.dest {
                Dest::Host => continue,
                Dest::Device(_) if super::vmm::no_cap_applies() => continue,
                Dest::Device(d) => return Err(refuse_unknown(api, d)),
            }
        };
        let a = &table[&base];
        let bit = match m.dest {
            Dest::Device(d) => {
                device_dests |= 1 << d;
                1u64 << d
            }
            Dest::Host => 1u64 << a.home,
        };
        let (dests, whole) = work.entry(base).or_insert_with(|| (vec![0; a.nunits()], vec![false; a.nunits()]));
        let (start, end) = (m.ptr - base, m.ptr - base + m.len);
        for u in (start / UNIT) as usize..=((end - 1) / UNIT) as usize {
            let (us, ue) = (u as u64 * UNIT, u as u64 * UNIT + a.unit_bytes(u));
            dests[u] |= bit;
            whole[u] |= start <= us && ue <= end;
        }
    }
    let mut p = Plan { reserved: Vec::new(), forced: Vec::new(), allocs: Vec::new() };
    for (base, (dests, whole)) in work {
        let a = &table[&base];
        let old = a.masks();
        let masks: Vec<u64> = (0..old.len())
            .map(|u| match (dests[u], whole[u]) {
                (0, _) => old[u],
                (d, true) => d,
                (d, false) => d | old[u],
            })
            .collect();
        let mut deltas: Vec<(usize, i64)> = Vec::new();
        for u in 0..masks.len() {
            let (was, now, b) = (old[u], masks[u], a.unit_bytes(u) as i64);
            for d in (0..MASK_DEVICES).filter(|d| (was ^ now) >> d & 1 == 1) {
                let delta = if now >> d & 1 == 1 { b } else { -b };
                match deltas.iter_mut().find(|e| e.0 == d) {
                    Some(e) => e.1 += delta,
                    None => deltas.push((d, delta)),
                }
            }
        }
        for &(d, delta) in deltas.iter().filter(|e| e.1 > 0) {
            add(if device_dests >> d & 1 == 1 { &mut p.reserved } else { &mut p.forced }, d, delta as u64);
        }
        p.allocs.push((base, masks, deltas));
    }
    for (i, &(d, b)) in p.reserved.iter().enumerate() {
        if let Err(den) = super::pressure::reserve(d, b) {
            for &(d2, b2) in &p.reserved[..i] {
                ledger::unreserve(d2, b2);
            }
            let scope = if den.group { crate::group::name() } else { None };
            crate::denials::denied_in(crate::hooks::info(api).name, d, b, &den, scope);
            emit(Op::Deny, api, d as i32, 0, b, Timed::instant(CUDA_ERROR_OUT_OF_MEMORY), ledger::used(d));
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    Ok(p)
}

/// After the driver call: the moves happened (`ok`) and the shares change, or nothing did.
///
/// An allocation none of whose shares is in the ledger any more belongs to a context that is
/// ending (`context::ending` took them out before its driver call, or the end drained them while
/// this prefetch was in flight): the context's end settles what it took, and the memory goes with
/// it, so this prefetch changes nothing of it (releasing its "old" places again would un-charge
/// what the end already gives back, and a share put in now would outlive the context).
fn settle(table: &mut BTreeMap<u64, Alloc>, p: Plan, ok: bool) {
    if !ok {
        for (d, b) in p.reserved {
            ledger::unreserve(d, b);
        }
        return;
    }
    for &(d, b) in &p.reserved {
        ledger::commit(d, b);
    }
    for &(d, b) in &p.forced {
        ledger::charge(d, b);
    }
    for (base, masks, deltas) in p.allocs {
        let Some(a) = table.get_mut(&base) else { continue };
        let had = a.devices();
        let mut shares: Vec<(usize, Charge)> = (0..MASK_DEVICES)
            .filter(|d| had >> d & 1 == 1)
            .filter_map(|d| ledger::take(Kind::Managed, key(base, d)).map(|c| (d, c)))
            .collect();
        if shares.is_empty() {
            // What was charged for it above goes again.
            for &(d, delta) in deltas.iter().filter(|e| e.1 > 0) {
                ledger::release(d, delta as u64);
            }
            continue;
        }
        for (d, delta) in deltas {
            let i = shares.iter().position(|s| s.0 == d);
            let old = i.map_or(0, |i| shares[i].1.size);
            if delta < 0 {
                // Never more than the share held: the rest was not ours to give back.
                ledger::release(d, ((-delta) as u64).min(old));
            }
            let size = (old as i64 + delta).max(0) as u64;
            match i {
                Some(i) => shares[i].1.size = size,
                None => shares.push((d, Charge { dev: d as u16, size, ctx: a.ctx })),
            }
        }
        for (d, c) in shares.into_iter().filter(|s| s.1.size > 0) {
            ledger::insert(Kind::Managed, key(base, d), c);
        }
        a.units = Some(masks);
    }
}

/// Reserve → call the driver once → commit or roll back, for every range of one call.
fn prefetch(api: Hook, moves: &[Move], call: impl FnOnce() -> CUresult) -> CUresult {
    // Fail-closed: nothing was handed out, so there is nothing of ours to move.
    if mode() != Mode::Enforce || !tracked() && guarded(false, super::vmm::no_cap_applies) {
        return call();
    }
    if let Err(e) = ensure_limits() {
        return e.code();
    }
    let mut guard = TABLE.lock();
    let table = guard.get_or_insert_with(BTreeMap::new);
    let planned = guarded(Err(CUDA_ERROR_OUT_OF_MEMORY), || plan(api, table, moves));
    let p = match planned {
        Ok(p) => p,
        Err(rc) => return rc,
    };
    // The books move with the pages, vramcap's counts do not (a managed allocation counts where
    // its share is, wherever its pages are): a move until settled (`moves`), by up to what it
    // sends (each range's partial units whole).
    let unfollowed = moves.iter().fold(0u64, |a, m| a.saturating_add(m.len).saturating_add(2 * UNIT));
    let _moving = super::moves::Moving::on(None, unfollowed);
    let t = timed(call);
    let ok = t.rc == CUDA_SUCCESS;
    guarded((), || settle(table, p, ok));
    if !ok {
        emit(Op::Fail, api, -1, moves.first().map_or(0, |m| m.ptr), 0, t, 0);
    }
    t.rc
}

#[cold]
fn refuse_unknown(api: Hook, dev: usize) -> CUresult {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        crate::log::write_line(&format!(
            "vramcap: {} refused (CUDA_ERROR_NOT_SUPPORTED): the range to prefetch to device {dev} is not one \
             cuMemAllocManaged allocation vramcap counts (a managed pool's or a managed variable's memory), so \
             vramcap cannot say what it would move there; prefetch whole cuMemAllocManaged allocations, or run \
             with VRAMCAP_DISABLE=1 where no cap is wanted",
            crate::hooks::info(api).name
        ));
    }
    emit(Op::Fail, api, dev as i32, 0, 0, Timed::instant(CUDA_ERROR_NOT_SUPPORTED), 0);
    CUDA_ERROR_NOT_SUPPORTED
}

/// v1's destination: a device ordinal or `CU_DEVICE_CPU`; anything else is the driver's error.
fn v1_dest(dst: CUdevice) -> Option<Dest> {
    match dst {
        CU_DEVICE_CPU => Some(Dest::Host),
        d if d >= 0 && (d as usize) < MASK_DEVICES => Some(Dest::Device(d as usize)),
        _ => None,
    }
}

fn v2_dest(api: Hook, l: CUmemLocation) -> Result<Dest, CUresult> {
    match location::place(l) {
        Place::Device(d) if d < MASK_DEVICES => Ok(Dest::Device(d)),
        Place::Device(_) => Err(CUDA_ERROR_INVALID_DEVICE),
        Place::Host => Ok(Dest::Host),
        Place::Unknown => Err(location::refuse(api, l)),
    }
}

pub unsafe fn prefetch_v1(ptr: CUdeviceptr, len: usize, dst: CUdevice, s: CUstream) -> CUresult {
    let Some(f) = real::cuMemPrefetchAsync() else { return MISSING_REAL };
    let Some(dest) = v1_dest(dst) else { return unsafe { f(ptr, len, dst, s) } };
    prefetch(Hook::cuMemPrefetchAsync, &[Move { ptr, len: len as u64, dest }], || unsafe { f(ptr, len, dst, s) })
}

pub unsafe fn prefetch_v1_ptsz(ptr: CUdeviceptr, len: usize, dst: CUdevice, s: CUstream) -> CUresult {
    let Some(f) = real::cuMemPrefetchAsync_ptsz() else { return MISSING_REAL };
    let Some(dest) = v1_dest(dst) else { return unsafe { f(ptr, len, dst, s) } };
    prefetch(Hook::cuMemPrefetchAsync_ptsz, &[Move { ptr, len: len as u64, dest }], || unsafe { f(ptr, len, dst, s) })
}

pub unsafe fn prefetch_v2(ptr: CUdeviceptr, len: usize, l: CUmemLocation, flags: c_uint, s: CUstream) -> CUresult {
    let Some(f) = real::cuMemPrefetchAsync_v2() else { return MISSING_REAL };
    let api = Hook::cuMemPrefetchAsync_v2;
    let dest = match v2_dest(api, l) {
        Ok(d) => d,
        Err(rc) => return rc,
    };
    prefetch(api, &[Move { ptr, len: len as u64, dest }], || unsafe { f(ptr, len, l, flags, s) })
}

pub unsafe fn prefetch_v2_ptsz(ptr: CUdeviceptr, len: usize, l: CUmemLocation, flags: c_uint, s: CUstream) -> CUresult {
    let Some(f) = real::cuMemPrefetchAsync_v2_ptsz() else { return MISSING_REAL };
    let api = Hook::cuMemPrefetchAsync_v2_ptsz;
    let dest = match v2_dest(api, l) {
        Ok(d) => d,
        Err(rc) => return rc,
    };
    prefetch(api, &[Move { ptr, len: len as u64, dest }], || unsafe { f(ptr, len, l, flags, s) })
}

/// The batch's moves: `locs[i]` applies from operation `idxs[i]` up to the next entry's index. A
/// batch whose arrays do not say that (documented: the first index 0, increasing) is refused, as
/// the driver refuses it, before it is called: vramcap could not say where anything goes.
unsafe fn batch_moves(
    api: Hook,
    ptrs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    locs: *const CUmemLocation,
    idxs: *const usize,
    nlocs: usize,
) -> Result<Vec<Move>, CUresult> {
    if ptrs.is_null() || sizes.is_null() || locs.is_null() || idxs.is_null() || count == 0 || nlocs == 0 || nlocs > count {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (ptrs, sizes) = unsafe { (std::slice::from_raw_parts(ptrs, count), std::slice::from_raw_parts(sizes, count)) };
    let (locs, idxs) = unsafe { (std::slice::from_raw_parts(locs, nlocs), std::slice::from_raw_parts(idxs, nlocs)) };
    if idxs[0] != 0 || idxs.windows(2).any(|w| w[1] <= w[0]) || idxs[nlocs - 1] >= count {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut out = Vec::with_capacity(count);
    let mut l = 0;
    for i in 0..count {
        if l + 1 < nlocs && i == idxs[l + 1] {
            l += 1;
        }
        out.push(Move { ptr: ptrs[i], len: sizes[i] as u64, dest: v2_dest(api, locs[l])? });
    }
    Ok(out)
}

macro_rules! batch {
    ($name:ident, $hook:ident) => {
        pub unsafe fn $name(
            ptrs: *mut CUdeviceptr,
            sizes: *mut usize,
            count: usize,
            locs: *mut CUmemLocation,
            idxs: *mut usize,
            nlocs: usize,
            flags: u64,
            s: CUstream,
        ) -> CUresult {
            let Some(f) = real::$hook() else { return MISSING_REAL };
            let call = || unsafe { f(ptrs, sizes, count, locs, idxs, nlocs, flags, s) };
            if mode() != Mode::Enforce {
                return call();
            }
            match guarded(Err(CUDA_ERROR_INVALID_VALUE), || unsafe { batch_moves(Hook::$hook, ptrs, sizes, count, locs, idxs, nlocs) }) {
                Ok(moves) => prefetch(Hook::$hook, &moves, call),
                Err(rc) => rc,
            }
        }
    };
}

batch!(prefetch_batch, cuMemPrefetchBatchAsync);
batch!(prefetch_batch_ptsz, cuMemPrefetchBatchAsync_ptsz);
batch!(discard_prefetch_batch, cuMemDiscardAndPrefetchBatchAsync);
batch!(discard_prefetch_batch_ptsz, cuMemDiscardAndPrefetchBatchAsync_ptsz);

static FORK_HANDLERS: std::sync::Once = std::sync::Once::new();

/// A fork while another thread holds the table (across a prefetch) must not leave the child's lock
/// held. Registered before the context lock's handlers (that lock is taken first, then this one).
pub(super) fn install_fork_handlers() {
    extern "C" fn prepare() {
        TABLE.acquire_for_fork();
    }
    extern "C" fn parent() {
        TABLE.release_after_fork();
    }
    extern "C" fn child() {
        TABLE.reset_in_child();
    }
    FORK_HANDLERS.call_once(|| unsafe {
        // Taken before ledger locks: register after the ledger's, so prepare takes it first.
        ledger::install_fork_handlers();
        libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    // Devices 56 and 57 are this module's: the ledger's budgets are process-global.
    const HOME: usize = 56;
    const OTHER: usize = 57;
    const MIB: u64 = 1 << 20;

    fn one(base: u64, size: u64) -> BTreeMap<u64, Alloc> {
        BTreeMap::from([(base, Alloc { size, home: HOME, ctx: 1, units: None })])
    }

    fn deltas(p: &Plan) -> Vec<(usize, i64)> {
        let mut d = p.allocs[0].2.clone();
        d.sort();
        d
    }

    #[test]
    fn a_unit_covered_in_part_counts_where_it_was_and_at_the_destination() {
        let base = 0x7000_0000_0000;
        let mut t = one(base, 3 * MIB);
        // As the allocation left it: all of it counts on its own device.
        ledger::insert(Kind::Managed, key(base, HOME), Charge { dev: HOME as u16, size: 3 * MIB, ctx: 1 });
        // [1 MiB, 2 MiB) lies inside unit 0: it counts on both devices.
        let p = plan(Hook::cuMemPrefetchAsync, &mut t, &[Move { ptr: base + MIB, len: MIB, dest: Dest::Device(OTHER) }]).unwrap();
        assert_eq!((p.reserved.clone(), p.forced.clone()), (vec![(OTHER, 2 * MIB)], vec![]));
        assert_eq!(deltas(&p), vec![(OTHER, 2 * MIB as i64)]);
        settle(&mut t, p, false);
        // The whole allocation: both units move, the short last one by its own size.
        let p = plan(Hook::cuMemPrefetchAsync, &mut t, &[Move { ptr: base, len: 3 * MIB, dest: Dest::Device(OTHER) }]).unwrap();
        assert_eq!(deltas(&p), vec![(HOME, -3 * MIB as i64), (OTHER, 3 * MIB as i64)]);
        settle(&mut t, p, true);
        assert_eq!(t[&base].units, Some(vec![1 << OTHER, 1 << OTHER]));
        // Back to the host: it counts on its own device again, charged without a reservation.
        let p = plan(Hook::cuMemPrefetchAsync, &mut t, &[Move { ptr: base, len: 3 * MIB, dest: Dest::Host }]).unwrap();
        assert_eq!((p.reserved.clone(), p.forced.clone()), (vec![], vec![(HOME, 3 * MIB)]));
        settle(&mut t, p, true);
        assert_eq!(ledger::take(Kind::Managed, key(base, OTHER)), None, "no share left on the other device");
        assert_eq!(ledger::take(Kind::Managed, key(base, HOME)).map(|c| c.size), Some(3 * MIB));
    }

    #[test]
    fn a_destination_over_its_cap_moves_nothing() {
        let base = 0x7100_0000_0000;
        let dev = 58;
        ledger::set_limit(dev, 4 * MIB);
        let mut t = one(base, 8 * MIB);
        let r = plan(Hook::cuMemPrefetchAsync, &mut t, &[Move { ptr: base, len: 8 * MIB, dest: Dest::Device(dev) }]);
        assert_eq!(r.err(), Some(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(ledger::charged(dev), 0, "the reservation was given back");
        assert_eq!(t[&base].units, None, "nothing moved");
        ledger::set_limit(dev, 0);
    }

    #[test]
    fn a_context_ending_while_its_memory_is_prefetched_is_given_back_once() {
        // Devices 59 and 60 are this test's.
        let (home, other) = (59, 60);
        let (base, size, ctx) = (0x7200_0000_0000, 4 * MIB, 9);
        let mut t = BTreeMap::from([(base, Alloc { size, home, ctx, units: None })]);
        ledger::charge(home, size);
        ledger::insert(Kind::Managed, key(base, home), Charge { dev: home as u16, size, ctx });
        // Other memory on the home device, which must stay charged.
        ledger::charge(home, MIB);
        let p = plan(Hook::cuMemPrefetchAsync, &mut t, &[Move { ptr: base, len: size, dest: Dest::Device(other) }]).unwrap();
        // While the prefetch is in the driver, another thread's cuCtxDestroy takes the context's
        // charges out before its own driver call (context::ending) ...
        let taken = ledger::drain(&[Kind::Managed], |c| c.ctx == ctx);
        assert_eq!(taken.len(), 1);
        taken.iter().for_each(|(_, _, c)| ledger::uncommit(c.dev as usize, c.size));
        settle(&mut t, p, true);
        // ... and gives them back once the driver ended the context (context::ending_done).
        taken.iter().for_each(|(_, _, c)| ledger::unreserve(c.dev as usize, c.size));
        assert_eq!((ledger::charged(home), ledger::used(home)), (MIB, MIB), "the other memory stays charged");
        assert_eq!((ledger::charged(other), ledger::used(other)), (0, 0), "what moved went with the context");
        assert_eq!(ledger::take(Kind::Managed, key(base, other)), None, "no share outlives the context");
        ledger::release(home, MIB);
    }

    /// A green context destroyed while a prefetch of its memory is in flight (the prefetch holds
    /// the table and has the share out of the ledger) hands every share to the primary context:
    /// none is left under the old handle, which the driver may give out again.
    #[test]
    fn a_hand_over_racing_a_prefetch_leaves_no_share_under_the_old_handle() {
        // Device 61 is this test's.
        let (home, green, primary, base) = (61, 0x6_0001, 0x6_0002, 0x7300_0000_0000);
        ledger::insert(Kind::Managed, key(base, home), Charge { dev: home as u16, size: 2 * MIB, ctx: green });
        let mut held = TABLE.lock();
        held.get_or_insert_with(BTreeMap::new).insert(base, Alloc { size: 2 * MIB, home, ctx: green, units: None });
        let share = ledger::take(Kind::Managed, key(base, home)).unwrap();
        let hand_over = std::thread::spawn(move || super::super::context::rekey(green, primary));
        std::thread::sleep(std::time::Duration::from_millis(100));
        ledger::insert(Kind::Managed, key(base, home), share);
        drop(held);
        hand_over.join().unwrap();
        assert_eq!(ledger::take(Kind::Managed, key(base, home)).map(|c| c.ctx), Some(primary));
        let a = TABLE.lock().as_mut().unwrap().remove(&base).unwrap();
        assert_eq!(a.ctx, primary);
    }
}
