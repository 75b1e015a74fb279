//! Exported memory whose file may still be open after its exporter ended (issue 23, item 11).
//!
//! VMM memory exported as a POSIX fd (`cuMemExportToShareableHandle`) lives while any copy of the
//! fd is open, wherever the copy is (a unix socket not yet received, a forked child, a process
//! that has not imported it yet): any process holding one may import it later. All copies are one
//! *open file description* (SCM_RIGHTS and fork share it), which the kernel keeps until its last
//! copy closes, and an OFD lock lives exactly as long as its description. So each export takes a
//! read lock on one byte of the exported description, `LOCK_BASE + id`, with an `id` the group
//! hands out per allocation (every export of one allocation locks the same byte, a byte no driver
//! uses), and writes a [`Record`]: the file (device and inode, as `/proc/locks` names them), the
//! id and the bytes. `/proc/locks` lists every OFD lock of the machine, whatever the process (a
//! reader trusts its view only when it lists the reader's own probe lock, [`proc_locks`]): a
//! record whose lock is gone from it has no copy of its fd left anywhere, so nobody can import it
//! any more, and its memory lives on only in the imports already made, which members count
//! per allocation: an importer finds the id in its received fd's own lock
//! (`/proc/self/fdinfo`) and holds an [`IMPORT`] record of it while the import lasts; an import
//! whose allocation it cannot tell is counted per member instead (`exports`: `orphans` stay while
//! any such import is held).
//!
//! When a member ends, [`Shared::reclaim`] keeps all it exported in `held` and
//! [`Shared::settle_records`] makes its records stand for exactly that (and frees its import
//! records); [`Shared::sweep_exports`] (run by `reclaim_in`: at a member's start, before any
//! denial, by the sidecar and by `vramcap limit`) marks an ended allocation whose every lock is
//! gone [`CLOSED`], and gives it back once no import record of it is left (the last import's end
//! does it too, [`Shared::import_of_ended`]; to `orphans` while a member holds an import of unknown
//! origin). What cannot be
//! decided stays charged: an export that could not be watched (another handle type, a file that
//! takes no lock, a `/proc/locks` that did not show the lock, the records full) leaves its bytes
//! in `unsure` or marks its allocation's records [`UNSURE`]; `vramcap limit --group NAME` shows
//! them and `--drop-exports` gives them back ([`Shared::drop_exports`]).

use super::shm::{DEVICES, SLOTS, Shared, SlotWord, State, holder_token};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::*;

/// Export records a group keeps at once; an export past them is undecidable (`unsure`).
pub const RECORDS: usize = 1024;
/// The first lock byte: far past anything a driver's own locks use (the fake driver locks bytes 0
/// to 2 of its memfd).
pub const LOCK_BASE: u64 = 1 << 40;
/// The end (exclusive) of the bytes vramcap locks (ids, and each process's probe at `2 * LOCK_BASE`):
/// an application's unlock over them is narrowed to leave them (`intercept::fcntl`).
pub const LOCK_END: u64 = LOCK_BASE << 2;
/// `Record::owner` bit: the exporter is still writing the record.
const WRITING: u64 = 1 << 63;
/// `Record::owner` bit: a sweep is giving the record's bytes back.
const SWEEPING: u64 = 1 << 62;
/// `Record::flags`: another export of the same allocation could not be watched.
pub const UNSURE: u64 = 1;
/// `Record::flags`: not an export but an import of allocation `id` that member `owner` holds (a
/// reference or a mapping): the allocation's memory lives while any is held.
pub const IMPORT: u64 = 2;
/// `Record::flags`: no open description of the export is left (the lock was gone from
/// `/proc/locks`; once gone it cannot come back): only imports keep it.
pub const CLOSED: u64 = 4;

#[repr(C, align(64))]
pub struct Record {
    /// `holder_token(slot, generation)` of the exporting member (with [`WRITING`] while it writes);
    /// 0: free.
    pub owner: AtomicU64,
    /// The device entry whose `held` keeps the bytes.
    pub entry: AtomicU64,
    /// Bytes of the member's exported charge the record stands for (0: one more export of an
    /// allocation another record counts).
    pub bytes: AtomicU64,
    /// The exported file's device (`major << 32 | minor`) and inode.
    pub dev: AtomicU64,
    pub ino: AtomicU64,
    /// The allocation's id: its exports lock byte `LOCK_BASE + id`.
    pub id: AtomicU64,
    /// [`UNSURE`].
    pub flags: AtomicU64,
    _pad: AtomicU64,
}

#[repr(C)]
pub struct Kept {
    /// The last export id handed out (ids start at 1).
    pub next_id: AtomicU64,
    /// Per device entry: bytes ended members exported that no record describes (an export that
    /// could not be watched): kept until an operator drops them.
    pub unsure: [AtomicU64; DEVICES],
    pub records: [Record; RECORDS],
}

/// A file's identity as `/proc/locks` prints it, and a lock byte: (`major << 32 | minor`, inode,
/// byte).
pub type Lock = (u64, u64, u64);

/// The records of one exported allocation.
struct Allocation {
    id: u64,
    /// (record index, owner word as read).
    records: Vec<(usize, u64)>,
    /// A record is [`UNSURE`]: never swept.
    unsure: bool,
    /// A record is being written or swept, or its member has not ended: not decided now.
    busy: bool,
    /// Every export record is [`CLOSED`].
    closed: bool,
    /// Import records of it (members hold the memory mapped or referenced).
    imports: usize,
}

/// What the group keeps of ended members' exports on one device entry (`vramcap limit`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeptBytes {
    /// An fd of it may still be open somewhere (its lock was there at the last look).
    pub open: u64,
    /// Could not be watched: given back only by an operator.
    pub unsure: u64,
    /// No fd left, mapped by importers: given back when their imports end.
    pub imported: u64,
}

impl Shared {
    /// A new export id (never 0), one per exported allocation.
    pub fn new_export_id(&self) -> u64 {
        self.kept.next_id.fetch_add(1, AcqRel) + 1
    }

    /// Records an export of member `i` (`bytes` on entry `e`, the file `dev`/`ino` locked at the
    /// id's byte); `unsure`: it could not be watched (its allocation's records are never swept).
    /// False when every record is taken: the caller marks the allocation unsure.
    pub fn record_export(&self, i: usize, e: usize, bytes: u64, dev: u64, ino: u64, id: u64, unsure: bool) -> bool {
        self.write_record(i, e, bytes, (dev, ino), id, if unsure { UNSURE } else { 0 })
    }

    /// Member `i` holds one more import of allocation `id` (from before its driver call, so that a
    /// sweep that finds the exported fd closed sees it). False when every record is taken: the
    /// caller counts it as an import of unknown origin.
    pub fn import_of(&self, i: usize, id: u64) -> bool {
        self.write_record(i, 0, 0, (0, 0), id, IMPORT)
    }

    /// Member `i` no longer holds that import: the allocation goes back if it was the last one
    /// and no fd of it is left. Returns the bytes given back.
    pub fn import_of_ended(&self, i: usize, id: u64) -> u64 {
        let token = holder_token(i, SlotWord::unpack(self.slots[i].word.load(Acquire)).generation);
        let mine = self.kept.records.iter().find(|r| {
            r.owner.load(Acquire) == token && r.id.load(Relaxed) == id && r.flags.load(Acquire) & IMPORT != 0
        });
        // SeqCst: the sweep marks CLOSED, then counts imports; we free ours, then look at CLOSED.
        if mine.is_some_and(|r| r.owner.compare_exchange(token, 0, SeqCst, Relaxed).is_ok()) { self.give_back_closed(id) } else { 0 }
    }

    fn write_record(&self, i: usize, e: usize, bytes: u64, (dev, ino): (u64, u64), id: u64, flags: u64) -> bool {
        let token = holder_token(i, SlotWord::unpack(self.slots[i].word.load(Acquire)).generation);
        for r in &self.kept.records {
            if r.owner.load(Relaxed) != 0 || r.owner.compare_exchange(0, token | WRITING, AcqRel, Relaxed).is_err() {
                continue;
            }
            r.entry.store(e as u64, Relaxed);
            r.bytes.store(bytes, Relaxed);
            r.dev.store(dev, Relaxed);
            r.ino.store(ino, Relaxed);
            r.id.store(id, Relaxed);
            r.flags.store(flags, Relaxed);
            r.owner.store(token, SeqCst);
            return true;
        }
        false
    }

    /// An export of allocation `id` by member `i` could not be watched (and not recorded): none of
    /// the allocation's records may ever be swept.
    pub fn export_unsure(&self, i: usize, id: u64) {
        let token = holder_token(i, SlotWord::unpack(self.slots[i].word.load(Acquire)).generation);
        for r in &self.kept.records {
            if r.owner.load(Acquire) & !WRITING == token && r.id.load(Relaxed) == id && r.flags.load(Acquire) & IMPORT == 0 {
                r.flags.fetch_or(UNSURE, AcqRel);
            }
        }
    }

    /// Member `i` (of `generation`) ended keeping `kept[e]` exported bytes in `held` on each entry:
    /// its records are made to stand for no more than that (in record order), what no record
    /// describes goes to `unsure`, and records it had not finished writing are freed. A takeover
    /// of an interrupted reclaim runs it again with nothing kept: records only ever shrink.
    pub(super) fn settle_records(&self, i: usize, generation: u32, kept: &[u64; DEVICES]) {
        let token = holder_token(i, generation);
        let mut left = *kept;
        let mut imported = Vec::new();
        for r in &self.kept.records {
            let o = r.owner.load(Acquire);
            if o == token | WRITING {
                let _ = r.owner.compare_exchange(o, 0, AcqRel, Relaxed);
            } else if o == token && r.flags.load(Acquire) & IMPORT != 0 {
                // Its imports end with it (the driver unmaps a dead process's memory).
                if r.owner.compare_exchange(o, 0, SeqCst, Relaxed).is_ok() {
                    imported.push(r.id.load(Relaxed));
                }
            } else if o == token {
                let e = (r.entry.load(Relaxed) as usize).min(DEVICES - 1);
                let b = r.bytes.load(Relaxed);
                let take = b.min(left[e]);
                if take < b {
                    r.bytes.store(take, Release);
                }
                left[e] -= take;
            }
        }
        for (e, &b) in left.iter().enumerate() {
            if b > 0 {
                self.kept.unsure[e].fetch_add(b, AcqRel);
            }
        }
        for id in imported {
            self.give_back_closed(id);
        }
    }

    /// Whether the member a record names has ended and been reclaimed (its slot free or taken by
    /// another generation): only then does the record stand for kept bytes.
    fn ended(&self, owner: u64) -> bool {
        let (slot, generation) = ((owner & 0xffff_ffff) as usize, (owner >> 32) as u32 & 0x3fff_ffff);
        if slot == 0 || slot > SLOTS {
            return true;
        }
        let sw = SlotWord::unpack(self.slots[slot - 1].word.load(Acquire));
        sw.state == State::Free || sw.generation != generation
    }

    /// Every record in use, grouped by allocation id (`only`: that id alone).
    fn allocations(&self, only: Option<u64>) -> Vec<Allocation> {
        let mut all: Vec<(u64, usize, u64, u64)> = Vec::new();
        for (k, r) in self.kept.records.iter().enumerate() {
            let o = r.owner.load(SeqCst);
            let id = r.id.load(Relaxed);
            if o != 0 && only.is_none_or(|x| x == id) {
                all.push((id, k, o, r.flags.load(SeqCst)));
            }
        }
        all.sort_unstable();
        let mut out: Vec<Allocation> = Vec::new();
        for (id, k, o, flags) in all {
            if out.last().is_none_or(|a| a.id != id) {
                out.push(Allocation { id, records: Vec::new(), imports: 0, unsure: false, busy: false, closed: true });
            }
            let a = out.last_mut().unwrap();
            if flags & IMPORT != 0 {
                // Being written or not, held by a live member or a dead one not yet reclaimed.
                a.imports += 1;
                continue;
            }
            a.records.push((k, o));
            a.unsure |= flags & UNSURE != 0;
            a.busy |= o & (WRITING | SWEEPING) != 0 || !self.ended(o);
            a.closed &= flags & CLOSED != 0;
        }
        out.retain(|a| !a.records.is_empty());
        out
    }

    /// Gives allocation `id` back (to `orphans`, then to the group if no member holds an import of
    /// unknown origin) if its exporter ended, no fd of it is left and no member imports it.
    fn give_back_closed(&self, id: u64) -> u64 {
        let mut moved = 0u64;
        for a in self.allocations(Some(id)) {
            if !a.busy && !a.unsure && a.closed && a.imports == 0 {
                moved = a.records.iter().fold(moved, |m, &(k, o)| m.saturating_add(self.give_record(k, o)));
            }
        }
        if moved > 0 {
            self.release_orphans();
        }
        moved
    }

    /// Gives back (to `orphans`, then to the group when no member holds an import) the exported
    /// memory of ended members whose every exported description is closed (no lock of the
    /// allocation's in `locks()`: `/proc/locks`, read only when there is something to decide;
    /// `None`: unreadable, nothing decided) and that no member imports. Returns the bytes moved.
    ///
    /// An importer counts its import before its driver call and closes the fd after it, and the
    /// kernel's lock list orders that close before our reading of it: an allocation found with no
    /// lock left has every import already counted (an import record, or one of unknown origin,
    /// which `release_orphans` waits for).
    pub fn sweep_exports(&self, locks: &dyn Fn() -> Option<Vec<Lock>>) -> u64 {
        let candidates: Vec<_> = self.allocations(None).into_iter().filter(|a| !a.busy && !a.unsure).collect();
        if candidates.is_empty() {
            return 0;
        }
        let locks = if candidates.iter().all(|a| a.closed) { Some(Vec::new()) } else { locks() };
        let mut moved = 0u64;
        for a in candidates {
            if !a.closed {
                let Some(locks) = &locks else { continue };
                // An id no lock byte can have (a damaged ledger) counts as open: kept.
                let open = a.records.iter().any(|&(k, _)| {
                    let r = &self.kept.records[k];
                    LOCK_BASE.checked_add(a.id).is_none_or(|b| locks.contains(&(r.dev.load(Relaxed), r.ino.load(Relaxed), b)))
                });
                if open {
                    continue;
                }
                for &(k, _) in &a.records {
                    self.kept.records[k].flags.fetch_or(CLOSED, SeqCst);
                }
            }
            moved = moved.saturating_add(self.give_back_closed(a.id));
        }
        moved
    }

    /// Frees record `k` (owned by `owner`) and moves its bytes to `orphans`; exactly one caller
    /// does it. A sweep killed midway leaves the record taken: its bytes stay in `held` (stricter).
    fn give_record(&self, k: usize, owner: u64) -> u64 {
        let r = &self.kept.records[k];
        if r.owner.compare_exchange(owner, owner | SWEEPING, AcqRel, Relaxed).is_err() {
            return 0;
        }
        let b = r.bytes.swap(0, AcqRel);
        if b > 0 {
            self.orphans[(r.entry.load(Relaxed) as usize).min(DEVICES - 1)].fetch_add(b, SeqCst);
        }
        r.owner.store(0, Release);
        b
    }

    /// What the group keeps of ended members' exports, per device entry.
    pub fn kept_exports(&self) -> [KeptBytes; DEVICES] {
        let mut out = [KeptBytes::default(); DEVICES];
        for (e, o) in out.iter_mut().enumerate() {
            o.unsure = self.kept.unsure[e].load(Acquire);
            o.imported = self.orphans[e].load(Acquire);
        }
        for a in self.allocations(None).into_iter().filter(|a| !a.busy) {
            for (k, _) in a.records {
                let r = &self.kept.records[k];
                let e = (r.entry.load(Relaxed) as usize).min(DEVICES - 1);
                let b = r.bytes.load(Relaxed);
                if a.unsure {
                    out[e].unsure = out[e].unsure.saturating_add(b);
                } else if a.closed {
                    out[e].imported = out[e].imported.saturating_add(b);
                } else {
                    out[e].open = out[e].open.saturating_add(b);
                }
            }
        }
        out
    }

    /// An operator's word that no process will import what the group keeps of ended members'
    /// exports that it cannot decide (`unsure`) — and, with `open`, of those whose fd is still open
    /// somewhere: they are treated as closed (given back now, or when the imports members hold of
    /// them end). Returns the bytes given back now, per entry.
    pub fn drop_exports(&self, open: bool) -> [u64; DEVICES] {
        let mut out = [0u64; DEVICES];
        for (e, o) in out.iter_mut().enumerate() {
            let b = self.kept.unsure[e].swap(0, AcqRel);
            if b > 0 {
                self.orphans[e].fetch_add(b, SeqCst);
                *o += b;
            }
        }
        // The operator's word stands for the fd: as if every copy were closed. An allocation a
        // live member still exports, or one being written or swept, is left alone; what importers
        // map goes when their imports end.
        for a in self.allocations(None).into_iter().filter(|a| !a.busy && (a.unsure || (open && !a.closed))) {
            for &(k, _) in &a.records {
                let r = &self.kept.records[k];
                r.flags.fetch_or(CLOSED, SeqCst);
                r.flags.fetch_and(!UNSURE, SeqCst);
            }
            let e = (self.kept.records[a.records[0].0].entry.load(Relaxed) as usize).min(DEVICES - 1);
            out[e] = out[e].saturating_add(self.give_back_closed(a.id));
        }
        self.release_orphans();
        out
    }
}

/// A lock byte past every id: this process's own probe (ids count exports, far below 2^40).
const PROBE_BYTE: u64 = LOCK_BASE << 1;

/// The OFD locks at or past [`LOCK_BASE`] that `/proc/locks` lists; `None` if it cannot be read,
/// or if it does not list this process's own probe lock: a view that hides locks (a `/proc/locks`
/// masked in a container, a sandbox's /proc) would make every export look closed.
pub fn proc_locks() -> Option<Vec<Lock>> {
    let probe = probe()?;
    let locks = parse_locks(&std::fs::read_to_string("/proc/locks").ok()?);
    locks.contains(&probe).then_some(locks)
}

/// This process's probe: an OFD lock on [`PROBE_BYTE`] of a memfd of its own, kept for the life
/// of the process (a forked child shares it), named as the kernel names it (`fd_locks`). Published
/// with atomics, not a lock: a fork while another thread makes it must not leave the child waiting.
/// Threads racing to make it each keep their own (an fd apiece, once).
fn probe() -> Option<Lock> {
    // 0: none yet, 1: being published, 2: `WORDS` hold it.
    static STATE: AtomicU64 = AtomicU64::new(0);
    static WORDS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];
    if STATE.load(Acquire) == 2 {
        return Some((WORDS[0].load(Relaxed), WORDS[1].load(Relaxed), WORDS[2].load(Relaxed)));
    }
    let fd = unsafe { libc::memfd_create(c"vramcap-locks-probe".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let found = lock_byte(fd, PROBE_BYTE).then(|| fd_locks(fd)).flatten().and_then(|l| l.into_iter().find(|x| x.2 == PROBE_BYTE));
    let Some(lock) = found else {
        unsafe { libc::close(fd) };
        return None;
    };
    if STATE.compare_exchange(0, 1, AcqRel, Acquire).is_ok() {
        WORDS[0].store(lock.0, Relaxed);
        WORDS[1].store(lock.1, Relaxed);
        WORDS[2].store(lock.2, Relaxed);
        STATE.store(2, Release);
    }
    Some(lock)
}

/// Takes an OFD read lock on `byte` of open file description `fd`.
pub fn lock_byte(fd: i32, byte: u64) -> bool {
    let Ok(start) = i64::try_from(byte) else { return false };
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_RDLCK as i16;
    l.l_whence = libc::SEEK_SET as i16;
    l.l_start = start;
    l.l_len = 1;
    unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &l) == 0 }
}

/// The OFD locks at or past [`LOCK_BASE`] that this process's open file description `fd` holds
/// (`/proc/self/fdinfo`, lines `lock:\t1: OFDLCK ...`); `None` if it cannot be read.
pub fn fd_locks(fd: i32) -> Option<Vec<Lock>> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    let lines: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("lock:")).collect();
    Some(parse_locks(&lines.join("\n")))
}

/// Lines like `4: OFDLCK ADVISORY  READ -1 00:01:1025 1099511627781 1099511627781` (device in
/// hex); a waiter (`->`) holds nothing.
pub fn parse_locks(text: &str) -> Vec<Lock> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || f[1] != "OFDLCK" {
            continue;
        }
        let file: Vec<&str> = f[5].split(':').collect();
        let (Some(maj), Some(min), Some(ino), Ok(start)) = (
            file.first().and_then(|x| u64::from_str_radix(x, 16).ok()),
            file.get(1).and_then(|x| u64::from_str_radix(x, 16).ok()),
            file.get(2).and_then(|x| x.parse::<u64>().ok()),
            f[6].parse::<u64>(),
        ) else {
            continue;
        };
        if start >= LOCK_BASE {
            out.push((maj << 32 | min, ino, start));
        }
    }
    out
}

#[cfg(test)]
#[path = "kept_tests.rs"]
mod tests;
