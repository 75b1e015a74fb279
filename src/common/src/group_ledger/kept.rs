//! Exported memory whose file may still be open after its exporter ended (issue 23, item 11).
//!
//! VMM memory exported as a POSIX fd (`cuMemExportToShareableHandle`) lives while any copy of the
//! fd is open, wherever the copy is (a unix socket not yet received, a forked child, a process
//! that has not imported it yet), and while any process maps or references an import of it. All
//! copies of an fd are one *open file description* (SCM_RIGHTS and fork share it), which the
//! kernel keeps until its last copy closes, and an OFD lock lives exactly as long as its
//! description. So the memory of allocation `id` is marked by read locks on one byte,
//! `LOCK_BASE + id`, wherever it can still be reached from:
//! - each export locks that byte of the exported description;
//! - each process that imports it (`intercept::shareable::keep`, whatever its group, or none)
//!   locks that byte of a private memfd of its own from before its driver call until its import
//!   ends, so an importer that closed the fd still shows, in any group, and a process's death
//!   drops its locks as the driver drops its imports (a received fd that does not name one id, an
//!   application's own lock merged with ours, or one whose locks cannot be read, makes the import
//!   lock every id byte it may stand for: it keeps more, never less);
//! - a re-export of an import locks the same bytes on its new description.
//!
//! Ids are the group's: a bijection of a counter, scrambled with a random seed the group's
//! creator draws, so that two groups' ids (every lock on the machine is in one list) do not meet
//! by accident. An export writes a [`Record`]: the exported file (device and inode, as
//! `/proc/locks` names them), the id and the bytes. `/proc/locks` lists every OFD lock of the
//! machine, whatever the process (a reader trusts its view only when it lists the reader's own
//! probe lock, [`proc_locks`]). A lock keeps an allocation when its range covers the id's byte and
//! it either starts in vramcap's bytes (an export, a re-export or an import: any file) or is on a
//! file one of the allocation's exports recorded (an application's own whole-file lock on its
//! exported fd merges with ours into one range starting at 0). An allocation that two readings of
//! the list in a row (more while readings differ) show without such a lock ([`CLOSED`]) has no fd
//! and no import left anywhere: nobody can reach it any more (a lock on it is only taken by a process that holds an fd or an
//! import of it, which showed), so its memory is free on the device. Two readings, because the
//! kernel prints a long list a page at a time and a lock removed earlier in the list between two
//! pages shifts the rest: one reading can skip a lock that stayed.
//!
//! When a member ends, [`Shared::reclaim`] keeps all it exported in `held` and
//! [`Shared::settle_records`] makes its records stand for exactly that; [`Shared::sweep_exports`]
//! (run by `reclaim_in`: at a member's start, before any denial, by the sidecar and by `vramcap
//! limit`) gives back an ended allocation it finds closed (to `orphans`, which go back once no
//! member holds an import of unknown origin: one whose fd carried no lock it could read). What
//! cannot be decided stays charged: an export that could not be watched (another handle type, a
//! file that takes no lock, a `/proc/locks` that did not show the lock, the records full) leaves
//! its bytes in `unsure` or marks its allocation's records [`UNSURE`]; `vramcap limit --group
//! NAME` shows them and `--drop-exports` gives them back ([`Shared::drop_exports`]).

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
/// `Record::flags`: no open description and no import of the allocation is left (its byte was
/// uncovered in `/proc/locks`; once gone it cannot come back).
pub const CLOSED: u64 = 4;
/// Ids are below this (their bytes below the probe's, `2 * LOCK_BASE`).
const ID_MASK: u64 = LOCK_BASE - 1;
/// An odd multiplier: `x -> x * SCRAMBLE + seed` is a bijection modulo 2^40.
const SCRAMBLE: u64 = 0x9e37_79b9_7f4a_7c15 & ID_MASK | 1;

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
    /// Export ids handed out so far (the counter scrambled into ids).
    pub next_id: AtomicU64,
    /// Drawn at random by the group's creator ([`Shared::init`]): scrambles the ids.
    pub seed: AtomicU64,
    /// Per device entry: bytes ended members exported that no record describes (an export that
    /// could not be watched): kept until an operator drops them.
    pub unsure: [AtomicU64; DEVICES],
    pub records: [Record; RECORDS],
}

/// An OFD lock as `/proc/locks` prints it: the file (`major << 32 | minor`, inode) and the bytes it
/// covers (first, last; `u64::MAX` for `EOF`).
pub type Lock = (u64, u64, u64, u64);

/// Whether `lock` keeps allocation `id` reachable: its range covers the id's byte, and it starts
/// in vramcap's bytes or is on one of the allocation's exported `files`.
pub fn keeps(lock: &Lock, id: u64, files: &[(u64, u64)]) -> bool {
    let Some(byte) = LOCK_BASE.checked_add(id) else { return true };
    let &(dev, ino, first, last) = lock;
    first <= byte && byte <= last && (first >= LOCK_BASE || files.contains(&(dev, ino)))
}

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
}

/// What the group keeps of ended members' exports on one device entry (`vramcap limit`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeptBytes {
    /// An fd of it may still be open somewhere, or a process imports it (a lock of it was there at
    /// the last look).
    pub open: u64,
    /// Could not be watched: given back only by an operator.
    pub unsure: u64,
    /// No fd and no watched import left: given back when the members' imports of unknown origin end.
    pub imported: u64,
}

impl Shared {
    /// A new export id (never 0, below `LOCK_BASE`), one per exported allocation: distinct within
    /// the group for 2^40 exports, scattered by the group's seed across groups.
    pub fn new_export_id(&self) -> u64 {
        let seed = self.kept.seed.load(Relaxed);
        loop {
            let n = self.kept.next_id.fetch_add(1, AcqRel).wrapping_add(1);
            let id = n.wrapping_mul(SCRAMBLE).wrapping_add(seed) & ID_MASK;
            if id != 0 {
                return id;
            }
        }
    }

    /// Records an export of member `i` (`bytes` on entry `e`, the file `dev`/`ino` locked at the
    /// id's byte); `unsure`: it could not be watched (its allocation's records are never swept).
    /// False when every record is taken: the caller marks the allocation unsure.
    pub fn record_export(&self, i: usize, e: usize, bytes: u64, dev: u64, ino: u64, id: u64, unsure: bool) -> bool {
        self.write_record(i, e, bytes, (dev, ino), id, if unsure { UNSURE } else { 0 })
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
            if r.owner.load(Acquire) & !WRITING == token && r.id.load(Relaxed) == id {
                r.flags.fetch_or(UNSURE, AcqRel);
            }
        }
    }

    /// Member `i` (of `generation`) ended keeping `kept[e]` exported bytes in `held` on each entry:
    /// its records are made to stand for no more than that (in record order), what no record
    /// describes goes to `unsure`, and records it had not finished writing are freed. A takeover
    /// of an interrupted reclaim runs it again with nothing kept: records only ever shrink. (Its
    /// imports ended with it: the kernel dropped their locks with its files.)
    pub(super) fn settle_records(&self, i: usize, generation: u32, kept: &[u64; DEVICES]) {
        let token = holder_token(i, generation);
        let mut left = *kept;
        for r in &self.kept.records {
            let o = r.owner.load(Acquire);
            if o == token | WRITING {
                let _ = r.owner.compare_exchange(o, 0, AcqRel, Relaxed);
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
                out.push(Allocation { id, records: Vec::new(), unsure: false, busy: false, closed: true });
            }
            let a = out.last_mut().unwrap();
            a.records.push((k, o));
            a.unsure |= flags & UNSURE != 0;
            a.busy |= o & (WRITING | SWEEPING) != 0 || !self.ended(o);
            a.closed &= flags & CLOSED != 0;
        }
        out
    }

    /// Gives allocation `id` back (to `orphans`, then to the group if no member holds an import of
    /// unknown origin) if its exporter ended and no fd or import of it is left.
    fn give_back_closed(&self, id: u64) -> u64 {
        let mut moved = 0u64;
        for a in self.allocations(Some(id)) {
            if !a.busy && !a.unsure && a.closed {
                moved = a.records.iter().fold(moved, |m, &(k, o)| m.saturating_add(self.give_record(k, o)));
            }
        }
        if moved > 0 {
            self.release_orphans();
        }
        moved
    }

    /// Gives back (to `orphans`, then to the group when no member holds an import of unknown
    /// origin) the exported memory of ended members that no lock in `locks()` keeps ([`keeps`]:
    /// no fd of it open and no process importing it; `/proc/locks`, read only when there is
    /// something to decide, at least twice and until two readings in a row agree (at most six
    /// tries): an allocation is closed only when no reading keeps it; `None`: unreadable or torn,
    /// tried again; fewer than two good readings decide nothing). Returns the bytes moved.
    ///
    /// An importer locks the id's byte before its driver call and closes the fd after it, so the
    /// kernel's list shows the fd's lock or the import's at every moment in between.
    pub fn sweep_exports(&self, locks: &dyn Fn() -> Option<Vec<Lock>>) -> u64 {
        let mut candidates: Vec<_> = self.allocations(None).into_iter().filter(|a| !a.busy && !a.unsure).collect();
        if candidates.is_empty() {
            return 0;
        }
        // At least two readings, and more until two in a row agree: a reading torn by locks
        // coming and going is followed by another. A reading that failed (unreadable, or torn
        // past our own probe) is tried again; short of two good ones, nothing open is decided.
        let (mut last, mut good): (Option<Vec<Lock>>, u32) = (None, 0);
        for _attempt in 0..6 {
            if candidates.iter().all(|a| a.closed) {
                break;
            }
            let Some(mut locks) = locks() else { continue };
            good += 1;
            candidates.retain(|a| a.closed || !self.kept_by(a, &locks));
            locks.sort_unstable();
            if good >= 2 && last.as_ref() == Some(&locks) {
                break;
            }
            last = Some(locks);
        }
        if good < 2 {
            candidates.retain(|a| a.closed);
        }
        let mut moved = 0u64;
        for a in candidates {
            for &(k, _) in &a.records {
                self.kept.records[k].flags.fetch_or(CLOSED, SeqCst);
            }
            moved = moved.saturating_add(self.give_back_closed(a.id));
        }
        moved
    }

    /// Whether a lock in `locks` keeps allocation `a` (its exports' files as recorded).
    fn kept_by(&self, a: &Allocation, locks: &[Lock]) -> bool {
        let files: Vec<(u64, u64)> = a
            .records
            .iter()
            .map(|&(k, _)| (self.kept.records[k].dev.load(Relaxed), self.kept.records[k].ino.load(Relaxed)))
            .collect();
        locks.iter().any(|l| keeps(l, a.id, &files))
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
    /// exports that it cannot decide (`unsure`) — and, with `open`, of those a lock still keeps
    /// (an fd open somewhere, or a process importing it): they are treated as gone and given back
    /// now (what imports of unknown origin keep, when those end). Returns the bytes given back now,
    /// per entry.
    pub fn drop_exports(&self, open: bool) -> [u64; DEVICES] {
        let mut out = [0u64; DEVICES];
        for (e, o) in out.iter_mut().enumerate() {
            let b = self.kept.unsure[e].swap(0, AcqRel);
            if b > 0 {
                self.orphans[e].fetch_add(b, SeqCst);
                *o += b;
            }
        }
        // The operator's word stands for the locks: as if every fd and import were gone. An
        // allocation a live member still exports, or one being written or swept, is left alone.
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

/// 64 random bits for a new group's id seed (`getrandom`; the clock and pid if it fails: ids only
/// need to differ between groups by accident, never against an adversary).
pub fn random_seed() -> u64 {
    let mut b = [0u8; 8];
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, libc::GRND_NONBLOCK) };
    if n == 8 {
        return u64::from_ne_bytes(b);
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ (u64::from(std::process::id()) << 40)
}

/// A `/proc` file read with large reads. The kernel prints `/proc/locks` a page at a time and
/// starts again from a position for each `read`: locks added or removed between two reads shift
/// the rest, and a line can be skipped. `read_to_string` begins with a 32-byte read (and so many
/// small ones): a list of a dozen locks came back torn while another program locked and
/// unlocked. Each read here asks for 64 KiB, so a list that fits a page is read in one.
fn read_whole(path: &str) -> Option<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let (mut out, mut chunk) = (Vec::new(), vec![0u8; 64 * 1024]);
    loop {
        match f.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    String::from_utf8(out).ok()
}

/// A lock byte past every id: this process's own probe (ids count exports, far below 2^40).
const PROBE_BYTE: u64 = LOCK_BASE << 1;

/// The OFD locks at or past [`LOCK_BASE`] that `/proc/locks` lists; `None` if it cannot be read,
/// or if it does not list this process's own probe lock: a view that hides locks (a `/proc/locks`
/// masked in a container, a sandbox's /proc) would make every export look closed.
pub fn proc_locks() -> Option<Vec<Lock>> {
    let probe = probe()?;
    let locks = parse_locks(&read_whole("/proc/locks")?);
    locks.iter().any(|l| (l.0, l.1) == (probe.0, probe.1) && l.2 <= probe.2 && probe.2 <= l.3).then_some(locks)
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
        let byte = WORDS[2].load(Relaxed);
        return Some((WORDS[0].load(Relaxed), WORDS[1].load(Relaxed), byte, byte));
    }
    let fd = unsafe { libc::memfd_create(c"vramcap-locks-probe".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let found = lock_byte(fd, PROBE_BYTE).then(|| fd_locks(fd)).flatten().and_then(|l| l.into_iter().find(|x| x.2 == PROBE_BYTE && x.3 == PROBE_BYTE));
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
    set_range(fd, byte, byte, libc::F_RDLCK)
}

/// Takes an OFD read lock on bytes `first..=last` of open file description `fd` (`last`
/// `u64::MAX`: to the end of the file).
pub fn lock_range(fd: i32, first: u64, last: u64) -> bool {
    set_range(fd, first, last, libc::F_RDLCK)
}

/// Drops the OFD lock on `byte` of open file description `fd`.
pub fn unlock_byte(fd: i32, byte: u64) -> bool {
    set_range(fd, byte, byte, libc::F_UNLCK)
}

/// Drops the OFD locks on bytes `first..=last` of open file description `fd`.
pub fn unlock_range(fd: i32, first: u64, last: u64) -> bool {
    set_range(fd, first, last, libc::F_UNLCK)
}

fn set_range(fd: i32, first: u64, last: u64, kind: i32) -> bool {
    let Ok(start) = i64::try_from(first) else { return false };
    let len = if last == u64::MAX { 0 } else { last.checked_sub(first).and_then(|d| i64::try_from(d + 1).ok()).unwrap_or(-1) };
    if len < 0 {
        return false;
    }
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as i16;
    l.l_whence = libc::SEEK_SET as i16;
    l.l_start = start;
    l.l_len = len;
    // The system call itself: in the preload library `fcntl` is our own interposer, which keeps
    // these bytes from any unlock (an application's, and so ours too).
    unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_OFD_SETLK, &l as *const libc::flock) == 0 }
}

/// The OFD locks reaching [`LOCK_BASE`] or past that this process's open file description `fd`
/// holds (`/proc/self/fdinfo`, lines `lock:\t1: OFDLCK ...`); `None` if it cannot be read.
pub fn fd_locks(fd: i32) -> Option<Vec<Lock>> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    let lines: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("lock:")).collect();
    Some(parse_locks(&lines.join("\n")))
}

/// Lines like `4: OFDLCK ADVISORY  READ -1 00:01:1025 1099511627781 1099511627781` (device in
/// hex; the last byte `EOF` for a lock to the end of the file) whose range reaches [`LOCK_BASE`];
/// a waiter (`->`) holds nothing.
pub fn parse_locks(text: &str) -> Vec<Lock> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || f[1] != "OFDLCK" {
            continue;
        }
        let file: Vec<&str> = f[5].split(':').collect();
        let last = if f[7] == "EOF" { Ok(u64::MAX) } else { f[7].parse::<u64>() };
        let (Some(maj), Some(min), Some(ino), Ok(first), Ok(last)) = (
            file.first().and_then(|x| u64::from_str_radix(x, 16).ok()),
            file.get(1).and_then(|x| u64::from_str_radix(x, 16).ok()),
            file.get(2).and_then(|x| x.parse::<u64>().ok()),
            f[6].parse::<u64>(),
            last,
        ) else {
            continue;
        };
        if last >= LOCK_BASE && first <= last {
            out.push((maj << 32 | min, ino, first, last));
        }
    }
    out
}

#[cfg(test)]
#[path = "kept_tests.rs"]
mod tests;
