//! The lifetime of a VMM physical allocation, as the driver documents it: its memory lives until
//! every reference to its handle is released (`cuMemCreate` gives one, each
//! `cuMemRetainAllocationHandle` one more) AND every mapping of it is unmapped. Releasing right
//! after mapping is what NVIDIA's own VMM samples do, so the charge must outlive the release.
//!
//! Each allocation has a ledger entry (`Kind::VmmHandle`) holding its charge. Its key is the handle
//! while the handle is live; once every reference is released but mappings remain, the driver may
//! hand the same handle value to a new allocation, so the entry moves to a private key
//! (`ORPHAN | id`) until the last mapping goes.
//!
//! A shareable handle (`cuMemExportToShareableHandle`) is a reference too, released wherever it
//! was imported, which this process cannot see: an exported allocation is never ended here, and
//! its charge stays for the life of the process. In a group its bytes are marked exported in the
//! member's slot and each export is recorded with its locked file (`shareable`), so that when this
//! process ends they stay the group's while an fd of them is open anywhere or any process holds an
//! import (`group_ledger::kept`). A handle imported from another process (`foreign`) is charged
//! nowhere here (its exporter is charged), but its lifetime is followed the same way (references
//! and mappings): while it lasts, this process holds an import, shown by a lock
//! (`shareable::keep`) or, in a group, counted as one of unknown origin; a re-export of it
//! carries its allocation's lock.
//!
//! Mapped ranges are kept as pieces; an unmap subtracts its range from whatever it overlaps
//! (a driver that refuses sub-range unmaps leaves nothing to subtract; one that allows them leaves
//! the rest mapped), so an allocation mapped at several addresses stays charged until the last.
//!
//! Every change that can end an allocation is made *before* the driver call (its ledger entry taken
//! out, as `charge::free` does) and undone if the call fails: once the driver has freed it, another
//! thread may get the same handle value or address at once. The table lock is never held across a
//! driver call.

use super::charge::{Timed, emit};
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::Hook;
use crate::ledger::{self, Charge, Kind};
use crate::sync::Lock;
use super::shareable::Carry;
use std::collections::{BTreeMap, HashMap};
use vramcap_common::group_ledger::kept::LOCK_BASE;

/// Ledger keys of allocations whose handle is released while still mapped (handles are driver
/// pointers, far below this bit).
const ORPHAN: u64 = 1 << 63;
/// `Alloc::export_id` of an allocation not watched (outside a group, or unwatchable).
const UNWATCHED: u64 = u64::MAX;

#[derive(Clone, Copy, Debug)]
struct Alloc {
    /// Its handle value (what events show).
    handle: u64,
    /// The ledger key of its charge: the handle, or `ORPHAN | id` once every reference is released.
    key: u64,
    /// Handle references not yet released.
    refs: u32,
    /// Mapped pieces.
    pieces: u32,
    /// `cuMemMap` and `cuMemExportToShareableHandle` calls in flight.
    pending: u32,
    /// Exported as a shareable handle: alive for the life of the process.
    exported: bool,
    /// In a group, the id its exports lock (`shareable`): 0 none yet, [`UNWATCHED`] an export of
    /// it could not be watched or recorded (the group keeps it until an operator drops it). For a
    /// `foreign` allocation: 0.
    export_id: u64,
    /// Imported from another process's shareable handle: no charge here; its end is the end of
    /// one of this process's imports.
    foreign: bool,
    /// For a `foreign` allocation: the bytes its import carries (`shareable::origin`), locked
    /// while it lives (`shareable::keep`); (0, 0): none (counted as of unknown origin in a group).
    carry: Carry,
}

impl Alloc {
    fn alive(&self) -> bool {
        self.refs > 0 || self.pieces > 0 || self.pending > 0 || self.exported
    }
}

#[derive(Default)]
struct Table {
    allocs: HashMap<u64, Alloc>,
    /// Live handle value → allocation id.
    handles: HashMap<u64, u64>,
    /// Mapped piece start → (end, allocation id); pieces never overlap.
    pieces: BTreeMap<u64, (u64, u64)>,
    next: u64,
}

static TABLE: Lock<Option<Table>> = Lock::new(None);

/// A mapped piece: (start, end, allocation id).
type Piece = (u64, u64, u64);

fn with<R>(f: impl FnOnce(&mut Table) -> R) -> R {
    install_fork_handlers();
    let mut g = TABLE.lock();
    f(g.get_or_insert_with(Table::default))
}

fn rekey(from: u64, to: u64) {
    if from != to
        && let Some(c) = ledger::take(Kind::VmmHandle, from)
    {
        ledger::insert(Kind::VmmHandle, to, c);
    }
}

/// An allocation taken out of the table and the ledger, to be charged off once the driver call
/// succeeds (or put back if it fails).
struct Ending {
    id: u64,
    alloc: Alloc,
    charge: Option<Charge>,
    /// Its bytes already stopped counting as held (before the driver call that frees them).
    uncommitted: bool,
}

impl Table {
    /// Takes `id` out if nothing keeps it alive any more.
    fn end_if_dead(&mut self, id: u64, out: &mut Vec<Ending>) {
        if let Some(a) = self.allocs.get(&id).copied()
            && !a.alive()
        {
            self.allocs.remove(&id);
            out.push(Ending { id, alloc: a, charge: ledger::take(Kind::VmmHandle, a.key), uncommitted: false });
        }
    }

    /// The last reference of `id` is gone (released, or its handle value reused by the driver).
    fn orphan(&mut self, id: u64, out: &mut Vec<Ending>) {
        let Some(a) = self.allocs.get_mut(&id) else { return };
        a.refs = 0;
        if a.alive() {
            let k = a.key;
            a.key = ORPHAN | id;
            rekey(k, ORPHAN | id);
        } else {
            self.end_if_dead(id, out);
        }
    }

    /// `handle` now names allocation `id` (the driver said so).
    fn bind(&mut self, handle: u64, id: u64, out: &mut Vec<Ending>) {
        if let Some(&old) = self.handles.get(&handle)
            && old != id
        {
            // The driver reused the value: the old allocation's references are gone.
            self.handles.remove(&handle);
            self.orphan(old, out);
        }
        self.handles.insert(handle, id);
        if let Some(a) = self.allocs.get_mut(&id)
            && a.key != handle
        {
            rekey(a.key, handle);
            a.key = handle;
        }
    }

    /// A released import of allocation `from` still alive (mapped) whose handle value was
    /// `handle`.
    fn released_import_of(&self, handle: u64, from: Carry) -> Option<u64> {
        self.allocs.iter().find(|(_, a)| a.foreign && a.refs == 0 && a.handle == handle && a.carry == from).map(|(&id, _)| id)
    }

    fn restore(&mut self, e: Ending) {
        if let Some(c) = e.charge {
            if e.uncommitted {
                ledger::commit(c.dev as usize, c.size);
            }
            ledger::insert(Kind::VmmHandle, e.alloc.key, c);
        }
        self.allocs.insert(e.id, e.alloc);
    }

    /// Removes `[start, end)` from the mapped pieces; returns the pieces removed and the
    /// leftovers put back (a sub-range unmap of a larger piece).
    fn carve(&mut self, start: u64, end: u64) -> (Vec<Piece>, Vec<Piece>) {
        let hit: Vec<Piece> = self
            .pieces
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(&s, &(e, id))| (s, e, id))
            .collect();
        let mut added = Vec::new();
        for &(s, e, id) in &hit {
            self.pieces.remove(&s);
            let mut left = 0;
            for (ls, le) in [(s, start), (end, e)] {
                if ls < le && ls >= s && le <= e {
                    self.pieces.insert(ls, (le, id));
                    added.push((ls, le, id));
                    left += 1;
                }
            }
            if let Some(a) = self.allocs.get_mut(&id) {
                a.pieces = a.pieces - 1 + left;
            }
        }
        (hit, added)
    }
}

/// Charges off allocations whose memory the driver has freed.
fn charge_off(api: Hook, t: Timed, gone: Vec<Ending>) {
    for e in gone {
        if e.alloc.foreign {
            end_import(if e.alloc.carry == NO_CARRY { Counted::Unknown } else { Counted::Of(e.alloc.carry) });
        }
        if let Some(c) = e.charge {
            if e.uncommitted {
                ledger::unreserve(c.dev as usize, c.size);
            } else {
                ledger::release(c.dev as usize, c.size);
            }
            emit(Op::Free, api, c.dev as i32, e.alloc.handle, c.size, t, ledger::used(c.dev as usize));
        }
    }
}

/// After a successful `cuMemCreate`: the new allocation's ledger key (its handle).
pub fn created(handle: u64) -> u64 {
    let mut gone = Vec::new();
    with(|t| {
        t.next += 1;
        let id = t.next;
        t.allocs.insert(id, Alloc { handle, key: handle, refs: 1, pieces: 0, pending: 0, exported: false, export_id: 0, foreign: false, carry: NO_CARRY });
        t.bind(handle, id, &mut gone);
    });
    charge_off(Hook::cuMemCreate, Timed::instant(CUDA_SUCCESS), gone);
    handle
}

/// A `cuMemRelease` in flight.
pub struct Release {
    handle: u64,
    id: u64,
    /// The charge of an allocation this release will end unless something pins it meanwhile: no
    /// longer held from before the call (the driver frees it during the call).
    uncommitted: Option<Charge>,
}

/// Before `cuMemRelease(handle)`: one reference fewer, and the allocation kept alive (and its
/// handle bound) for the length of the call: a `cuMemMap` or an export of the same handle on
/// another thread meanwhile may reach the driver first, and must find the allocation to pin it.
/// Whether the release ended the allocation is decided after the call (`None`: not a handle we
/// charged).
pub fn release_begin(handle: u64) -> Option<Release> {
    with(|t| {
        let id = *t.handles.get(&handle)?;
        let a = t.allocs.get_mut(&id)?;
        a.refs = a.refs.saturating_sub(1);
        let last = a.refs == 0 && a.pieces == 0 && a.pending == 0 && !a.exported;
        a.pending += 1;
        let key = a.key;
        let uncommitted = if last { ledger::peek(Kind::VmmHandle, key) } else { None };
        if let Some(c) = uncommitted {
            ledger::uncommit(c.dev as usize, c.size);
        }
        Some(Release { handle, id, uncommitted })
    })
}

pub fn release_end(r: Option<Release>, t: Timed) {
    let Some(r) = r else { return };
    let mut gone = Vec::new();
    with(|tb| {
        let Some(a) = tb.allocs.get_mut(&r.id) else { return };
        a.pending -= 1;
        if t.rc != CUDA_SUCCESS {
            // The handle is still valid: the reference is back.
            a.refs += 1;
            return;
        }
        if a.refs == 0 {
            // The driver may already have handed the value to a new allocation (then `created`
            // bound it there and orphaned this one): unbind only our own binding.
            if tb.handles.get(&r.handle) == Some(&r.id) {
                tb.handles.remove(&r.handle);
            }
            tb.orphan(r.id, &mut gone);
        } else {
            tb.end_if_dead(r.id, &mut gone);
        }
    });
    if let Some(c) = r.uncommitted {
        match gone.iter_mut().find(|e| e.id == r.id && e.charge.is_some()) {
            Some(e) => e.uncommitted = true,
            // Still alive (the call failed, or a map or export pinned it meanwhile): held again.
            None => ledger::commit(c.dev as usize, c.size),
        }
    }
    charge_off(Hook::cuMemRelease, t, gone);
}

/// Before `cuMemMap(.., handle, ..)`: the allocation being mapped (kept alive during the call).
pub fn map_begin(handle: u64) -> Option<u64> {
    with(|t| {
        let id = *t.handles.get(&handle)?;
        t.allocs.get_mut(&id)?.pending += 1;
        Some(id)
    })
}

pub fn map_end(id: Option<u64>, ptr: u64, size: u64, t: Timed) {
    let Some(id) = id else { return };
    let mut gone = Vec::new();
    with(|tb| {
        if t.rc == CUDA_SUCCESS && size > 0 {
            // Anything we still had at these addresses was unmapped in a way we did not see.
            let (hit, _) = tb.carve(ptr, ptr.saturating_add(size));
            for (_, _, other) in hit {
                tb.end_if_dead(other, &mut gone);
            }
            tb.pieces.insert(ptr, (ptr.saturating_add(size), id));
            if let Some(a) = tb.allocs.get_mut(&id) {
                a.pieces += 1;
            }
        }
        if let Some(a) = tb.allocs.get_mut(&id) {
            a.pending -= 1;
        }
        tb.end_if_dead(id, &mut gone);
    });
    charge_off(Hook::cuMemMap, t, gone);
}

/// Before `cuMemExportToShareableHandle(.., handle, ..)`: the allocation being exported, kept alive
/// during the call (`None`: not a handle we charged).
pub fn export_begin(handle: u64) -> Option<u64> {
    map_begin(handle)
}

/// After the export: a shared allocation is never ended (its charge stays); a refused export
/// changes nothing. In a group, `watch(id)` locks the exported fd at the allocation's id
/// (`shareable::watch`) and the export is recorded in the group's ledger, so that the group keeps
/// the memory after this process ends as long as an fd of it is open anywhere.
pub fn export_end(id: Option<u64>, t: Timed, watch: impl FnOnce(&[(u64, u64)]) -> Option<(u64, u64)>) {
    let Some(id) = id else { return };
    let mut gone = Vec::new();
    let (mut marked, mut reexport) = (None, None);
    with(|tb| {
        if let Some(a) = tb.allocs.get_mut(&id) {
            a.pending -= 1;
            if t.rc == CUDA_SUCCESS && !a.foreign {
                // Its first export: from now on it may outlive this process.
                let first = !a.exported;
                a.exported = true;
                // The id is taken under the table's lock: concurrent exports of one allocation
                // share it (one atomic add in the ledger, no I/O).
                if a.export_id == 0 {
                    a.export_id = crate::group::new_export_id().unwrap_or(UNWATCHED);
                }
                marked = ledger::peek(Kind::VmmHandle, a.key).map(|c| (c, first, a.export_id));
            } else if t.rc == CUDA_SUCCESS && a.foreign && a.carry != NO_CARRY {
                // A re-export of an import: its new description carries what the import did.
                reexport = Some(a.carry);
            }
        }
        tb.end_if_dead(id, &mut gone);
    });
    if let Some((c, first, xid)) = marked {
        let (dev, size) = (c.dev as usize, if first { c.size } else { 0 });
        crate::group::exported(dev, size);
        if xid != UNWATCHED {
            record(id, xid, dev, size, watch(&[(LOCK_BASE + xid, LOCK_BASE + xid)]));
        }
    } else if let Some(carry) = reexport
        && watch(&[carry]).is_none()
        && carry.0 == carry.1
    {
        // Unwatched, it would let the exporter's group forget memory this fd keeps: if that
        // group is ours, an unsure record keeps the allocation until an operator drops it.
        crate::group::record_export(0, 0, carry.0 - LOCK_BASE, None);
    }
    charge_off(Hook::cuMemExportToShareableHandle, t, gone);
}

/// Records one export of allocation `id` (group id `xid`). One that cannot be watched or recorded
/// makes the whole allocation undecidable; so does one recorded while another export of it found
/// that meanwhile (the table's lock orders the two: one of them sees the other).
fn record(id: u64, xid: u64, dev: usize, size: u64, file: Option<(u64, u64)>) {
    let recorded = crate::group::record_export(dev, size, xid, file);
    let unsure = if !recorded || file.is_none() {
        with(|tb| tb.allocs.get_mut(&id).map(|a| a.export_id = UNWATCHED));
        true
    } else {
        with(|tb| tb.allocs.get(&id).is_some_and(|a| a.export_id == UNWATCHED))
    };
    if unsure {
        crate::group::export_unsure(xid);
    }
}

/// What `unmap_begin` changed, undone by a failed call.
pub struct Unmap {
    removed: Vec<Piece>,
    added: Vec<Piece>,
    ending: Vec<Ending>,
}

/// Before `cuMemUnmap(ptr, size)`.
pub fn unmap_begin(ptr: u64, size: u64) -> Unmap {
    with(|t| {
        let (removed, added) = t.carve(ptr, ptr.saturating_add(size));
        let mut ending = Vec::new();
        for &(_, _, id) in &removed {
            t.end_if_dead(id, &mut ending);
        }
        // The driver frees them during the call: no longer held from before it.
        for e in &mut ending {
            if let Some(c) = e.charge {
                ledger::uncommit(c.dev as usize, c.size);
                e.uncommitted = true;
            }
        }
        Unmap { removed, added, ending }
    })
}

pub fn unmap_end(u: Unmap, t: Timed) {
    if t.rc == CUDA_SUCCESS {
        charge_off(Hook::cuMemUnmap, t, u.ending);
        return;
    }
    with(|tb| {
        for e in u.ending {
            tb.restore(e);
        }
        for (s, _, id) in u.added {
            tb.pieces.remove(&s);
            if let Some(a) = tb.allocs.get_mut(&id) {
                a.pieces -= 1;
            }
        }
        for (s, e, id) in u.removed {
            tb.pieces.insert(s, (e, id));
            if let Some(a) = tb.allocs.get_mut(&id) {
                a.pieces += 1;
            }
        }
    });
}

/// Before `cuMemRetainAllocationHandle(&h, addr)`: the allocation mapped at `addr`, given a
/// reference for the duration of the call.
pub fn retain_begin(addr: u64) -> Option<u64> {
    with(|t| {
        let (_, &(end, id)) = t.pieces.range(..=addr).next_back()?;
        if end <= addr {
            return None;
        }
        t.allocs.get_mut(&id)?.refs += 1;
        Some(id)
    })
}

pub fn retain_end(id: Option<u64>, handle: impl FnOnce() -> u64, t: Timed) {
    let mut gone = Vec::new();
    with(|tb| match id {
        Some(id) if t.rc == CUDA_SUCCESS => tb.bind(handle(), id, &mut gone),
        Some(id) => {
            if let Some(a) = tb.allocs.get_mut(&id) {
                a.refs -= 1;
            }
            tb.end_if_dead(id, &mut gone);
        }
        // Not an address we know: a handle we know gains a reference, any other is not ours.
        None if t.rc == CUDA_SUCCESS => add_ref(tb, handle()),
        None => {}
    });
    charge_off(Hook::cuMemRetainAllocationHandle, t, gone);
}

fn add_ref(t: &mut Table, handle: u64) {
    if let Some(id) = t.handles.get(&handle)
        && let Some(a) = t.allocs.get_mut(id)
    {
        a.refs += 1;
    }
}

/// How this process counts an import in flight: not at all, as one of the group member's imports
/// of unknown origin, or as an import of watched allocation `id` (`shareable::keep`: its lock
/// shows the exporter's group, whichever it is, that this process holds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    No,
    Unknown,
    Of(Carry),
}

/// `Alloc::carry` of an import that carries none of vramcap's bytes.
const NO_CARRY: Carry = (0, 0);

/// Before `cuMemImportFromShareableHandle` of a handle exported from allocation `from` (as its
/// fd's lock says, `shareable::origin`): the import this process may hold is shown from
/// before the driver call on (an fd closed meanwhile must find it shown), until [`import_end`]
/// finds it was none.
pub fn import_begin(from: Option<Carry>) -> Counted {
    if let Some(span) = from
        && super::shareable::keep(span)
    {
        return Counted::Of(span);
    }
    if !crate::group::active() {
        return Counted::No;
    }
    crate::group::import_began();
    Counted::Unknown
}

fn end_import(c: Counted) {
    match c {
        Counted::No => {}
        Counted::Unknown => crate::group::import_ended(),
        Counted::Of(span) => super::shareable::release(span),
    }
}

/// After the import: a handle of ours (exported by this very process) gains a reference; any
/// other is memory another process is charged for, followed (when counted) as one of this
/// process's imports until its last reference and mapping go.
pub fn import_end(counted: Counted, handle: impl FnOnce() -> u64, t: Timed) {
    let mut gone = Vec::new();
    let foreign = t.rc == CUDA_SUCCESS
        && with(|tb| {
            let handle = handle();
            if tb.handles.contains_key(&handle) {
                add_ref(tb, handle);
                return false;
            }
            if let Counted::Of(x) = counted
                && let Some(id) = tb.released_import_of(handle, x)
            {
                // The same import again, its value still the released one's (its memory mapped,
                // so the value cannot name anything else): one more reference to it.
                tb.allocs.get_mut(&id).map(|a| a.refs += 1);
                tb.bind(handle, id, &mut gone);
                return false;
            }
            if counted == Counted::No {
                return false;
            }
            tb.next += 1;
            let id = tb.next;
            let carry = if let Counted::Of(x) = counted { x } else { NO_CARRY };
            tb.allocs.insert(id, Alloc { handle, key: handle, refs: 1, pieces: 0, pending: 0, exported: false, export_id: 0, foreign: true, carry });
            tb.bind(handle, id, &mut gone);
            true
        });
    if !foreign {
        end_import(counted);
    }
    charge_off(Hook::cuMemImportFromShareableHandle, t, gone);
}

static FORK_HANDLERS: std::sync::Once = std::sync::Once::new();

pub(super) fn install_fork_handlers() {
    extern "C" fn prepare() {
        TABLE.acquire_for_fork();
        super::shareable::keeper_prepare();
    }
    extern "C" fn parent() {
        super::shareable::keeper_parent();
        TABLE.release_after_fork();
    }
    extern "C" fn child() {
        super::shareable::keeper_child();
        TABLE.reset_in_child();
    }
    FORK_HANDLERS.call_once(|| unsafe {
        // The table's lock is taken before ledger locks: register after the ledger.
        ledger::install_fork_handlers();
        libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
    });
}

#[cfg(test)]
mod tests;
