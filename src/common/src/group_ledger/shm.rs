//! The shared ledger of a group, as it lies in the mmapped file, and every operation on it.
//!
//! Everything here is lock-free: the only cross-process synchronisation is compare-and-swap on
//! 64-bit words, so a member killed at any instruction can never leave another one waiting.
//!
//! - A **device entry** per GPU (keyed by a hash of its UUID, so members with different
//!   `CUDA_VISIBLE_DEVICES` agree on which GPU is which) holds the group's `limit` and `used`.
//!   Reserving is one CAS on `used` that fails when `used + size > limit`.
//! - A **slot** per member process holds its identity (pid, start time from `/proc/self/stat`
//!   and PID namespace inode, so that an observer in another PID namespace can find it: see
//!   `file::liveness`) and what it has charged on each device entry. Invariant: `used ≥ Σ slot charges`; every
//!   step that could be interrupted errs on the side of `used` being too high (a leak makes the
//!   cap stricter, never looser).
//! - A dead member's slot is reclaimed by whoever first moves its word from LIVE to RECLAIMING
//!   with one CAS: exactly once. The word carries a generation so a slot freed and taken again
//!   between our look and our CAS is not mistaken for the one we looked at.

use super::kept::Kept;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

pub const MAGIC: u64 = u64::from_le_bytes(*b"VRAMCAPG");
/// 2: slots carry the member's PID namespace; claim and release publish with compare-and-swap.
/// 3: sharing policies (issue 17): the group's policy, live-member count, pressure counter and
/// headroom holder; per device `held` (what admission decides on) and headroom; per member its
/// priority, name, reserve and unmet reserve.
/// 4 (issue 25 and 26, one change): per device who set the limit last (`limit_by`) and the budget
/// an operator set with `vramcap limit` (`operator_limit`), which later members adopt; per member
/// the reserve it took from lower priorities, by lender and device, so that it goes back to its
/// lender when freed, and whether it started late (who may take the headroom).
/// 5 (issues 23 and 26): the header's former padding word is the group's mode ([`MODE_ENFORCE`]
/// or [`MODE_OBSERVE`]; a version 4 member would enforce while the group observes, or ignore a
/// group that enforces); exported VMM memory outlives its exporter: per member the bytes of its
/// charge it exported as shareable handles and the count of shareable handles it imported from
/// others; per device the exported bytes whose exporter ended while members held imports
/// (`orphans`).
/// 6 (issue 24): per device the size of the largest context a member measured there
/// (`context_bytes`), which a member reserves before it creates its first context, and who is
/// measuring the group's first one there (`context_lease`).
/// 7 (issue 23, exported fds): the group's records of exported files (`kept`, [`super::kept`]):
/// an ended member's exported memory stays in `held` until no open file description of it is
/// left (then it lives only in imports: `orphans`); a version 6 member would give it back with
/// its exporter, while an fd sent and not yet imported keeps the memory alive.
/// 8 (issue 23, imports and ids): imports are locks, not records (a version 7 member's import
/// records would read as exports), and ids are scrambled with the group's `kept.seed`.
pub const VERSION: u32 = 8;
pub const DEVICES: usize = 64;
pub const SLOTS: usize = 1024;
pub const NAME_BYTES: usize = 64;
/// Loans (lender, device) a member keeps track of at once (`group_ledger::loan`).
pub const LOANS: usize = 15;

#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    /// `size_of::<Shared>()` as the creator built it: a different layout is refused.
    pub layout_bytes: AtomicU32,
    pub devices: AtomicU32,
    pub slots: AtomicU32,
    /// Bumped on every limit change (the sidecar can watch it).
    pub limit_seq: AtomicU64,
    /// Group name, NUL-padded (for tools reading the file).
    pub name: [AtomicU64; NAME_BYTES / 8],
    /// [`Policy`] as set by the group's first member; 0: not set yet.
    pub policy: AtomicU32,
    /// The group's mode (issue 26): [`MODE_ENFORCE`] or [`MODE_OBSERVE`], set by its first
    /// member; 0: not set yet. Enforce wins (`join`): no member observes while another enforces.
    pub mode: AtomicU32,
    /// Slots not free (claimed, live or being emptied): the N of `equal`'s budget / N. Raised
    /// before a slot is claimed and lowered after it is freed, so it is never too low (a share
    /// is never too big).
    pub members: AtomicU64,
    /// Bumped when a member is denied or the free budget falls below the headroom: every member
    /// trims its unused pool and graph memory at its next driver call (`group::pressure`).
    pub pressure: AtomicU64,
    /// The member that may use the headroom: `generation << 32 | (slot + 1)`; 0: nobody.
    pub headroom_holder: AtomicU64,
}

#[repr(C, align(64))]
pub struct Device {
    /// 0: unused; otherwise the device key (never 0, see [`device_key`]).
    pub key: AtomicU64,
    /// Bytes; 0 = no limit.
    pub limit: AtomicU64,
    /// What members hold (charged to live members, and dead ones not yet reclaimed) plus every
    /// member's unmet reserve: what admission compares with the limit, in one CAS
    /// (`group::admit`). The only word every allocation of the group writes. Invariant:
    /// `held ≥ charges + unmet`; a kill midway leaves it higher (stricter), never lower.
    pub held: AtomicU64,
    /// The highest `held − unmet` seen (what members held at most).
    pub peak: AtomicU64,
    /// Σ of the members' unmet reserves (written only by members with a reserve).
    pub unmet: AtomicU64,
    /// Bytes of the limit kept for a member that is not running yet (`VRAMCAP_GROUP_HEADROOM`),
    /// plus one once set: 0 means no member has set it yet (the first one does, see
    /// `group::sharing`). Read through [`Shared::headroom`].
    pub headroom: AtomicU64,
    /// Who set `limit` last: [`super::budget::Setter`] packed (0: nobody yet).
    pub limit_by: AtomicU64,
    /// The budget an operator set with `vramcap limit` (valid while `limit_by` says operator):
    /// a member joining with another `VRAMCAP_GROUP_LIMIT` puts this one back.
    pub operator_limit: AtomicU64,
    /// The largest context (device memory a context takes itself) a member measured on this
    /// device: what another member reserves before creating one, so that a context the budget
    /// cannot hold is refused before the driver makes it (issue 24). 0: none measured yet.
    pub context_bytes: AtomicU64,
    /// The member measuring the group's first context on this device (`holder_token`; 0:
    /// nobody): while it does, others wait for its size instead of making theirs unreserved
    /// ([`super::lease`]).
    pub context_lease: AtomicU64,
}

#[repr(C, align(64))]
pub struct Slot {
    /// [`SlotWord`] packed: state, generation, pid.
    pub word: AtomicU64,
    /// Owner's start time (clock ticks after boot, `/proc/<pid>/stat` field 22).
    pub start: AtomicU64,
    /// Inode of the owner's PID namespace (`/proc/self/ns/pid`); its pid is a pid of that
    /// namespace. 0: unknown (judged as the observer's own namespace).
    pub pidns: AtomicU64,
    /// `VRAMCAP_PRIORITY` as an `i64` (two's complement).
    pub priority: AtomicU64,
    /// The member's command name (`/proc/self/comm`), NUL-padded: denial lines name it.
    pub comm: [AtomicU64; 2],
    /// The last pressure count this member answered by trimming.
    pub pressure_seen: AtomicU64,
    /// Bytes charged per device entry.
    pub charge: [AtomicU64; DEVICES],
    /// `VRAMCAP_GROUP_RESERVE` per device entry, as claimed at start.
    pub reserve: [AtomicU64; DEVICES],
    /// The part of the reserve not in use (and not taken by a higher priority): counted in
    /// `held`, so nobody else can take it.
    pub unmet: [AtomicU64; DEVICES],
    /// Bit `e`: this member has loans on device entry `e` (one load on its frees).
    pub loans_on: AtomicU64,
    /// Unmet reserve this member took from lower priorities, as `loan::key` (lender slot and
    /// generation, device entry; 0: free) and bytes still out. Written by the member itself,
    /// and by whoever empties its slot.
    pub loan_key: [AtomicU64; LOANS],
    pub loan_bytes: [AtomicU64; LOANS],
    /// [`LATE`]: set at start, cleared when the slot is claimed.
    pub flags: AtomicU64,
    /// Bytes of `charge` per device entry that are allocations this member exported as shareable
    /// handles (`cuMemExportToShareableHandle`): memory that may live on in an importer after
    /// this member ends.
    pub exported: [AtomicU64; DEVICES],
    /// Shareable handles imported from other processes that this member still holds (a reference
    /// or a mapping): while any member holds one, exported memory of ended members stays charged.
    pub imports: AtomicU64,
}

/// `Header::mode`: members refuse what does not fit.
pub const MODE_ENFORCE: u32 = 1;
/// `Header::mode`: members grant what does not fit and record it (`VRAMCAP_MODE=observe`).
pub const MODE_OBSERVE: u32 = 2;

/// `Slot::flags`: the member started while other members held memory (a restart, the "+1"
/// job): it may take the headroom when nobody uses it (`Shared::try_take_headroom`).
pub const LATE: u64 = 1;

#[repr(C)]
pub struct Shared {
    pub header: Header,
    pub devices: [Device; DEVICES],
    /// Per device entry: bytes exported by members that have ended, kept in `held` while any
    /// member holds an imported shareable handle (the importer's mapping keeps the memory alive;
    /// which export it came from the driver does not say). Given back when no member holds one.
    pub orphans: [AtomicU64; DEVICES],
    pub slots: [Slot; SLOTS],
    /// Exported memory of ended members whose file may still be open ([`super::kept`]).
    pub kept: Kept,
}

pub const LAYOUT_BYTES: usize = std::mem::size_of::<Shared>();

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Free = 0,
    /// Taken by `pid`, identity being written (no charges yet).
    Claiming = 1,
    Live = 2,
    /// Being emptied by `pid` (the reclaimer, or the owner leaving).
    Reclaiming = 3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotWord {
    pub state: State,
    /// 30 bits, bumped on every claim.
    pub generation: u32,
    pub pid: u32,
}

impl SlotWord {
    pub fn pack(self) -> u64 {
        ((self.state as u64) << 62) | (((self.generation & 0x3fff_ffff) as u64) << 32) | self.pid as u64
    }
    pub fn unpack(w: u64) -> SlotWord {
        let state = match w >> 62 {
            0 => State::Free,
            1 => State::Claiming,
            2 => State::Live,
            _ => State::Reclaiming,
        };
        SlotWord { state, generation: ((w >> 32) & 0x3fff_ffff) as u32, pid: w as u32 }
    }
}

/// Whether the process named by a slot still runs. An observer that cannot tell says `Alive`:
/// a charge is never reclaimed on a guess.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// Gone, or its pid now belongs to a process with another start time.
    Dead,
}

/// Who a slot names, as read from the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// The pid in the member's own PID namespace.
    pub pid: u32,
    /// 0 = unknown (then only the pid's existence counts).
    pub start: u64,
    pub pidns: u64,
}

/// Judges a batch of members at once (an observer may need one `/proc` scan for all of them),
/// returning one verdict per member in order.
pub type Judge<'a> = &'a dyn Fn(&[Member]) -> Vec<Liveness>;

/// Stable, never-zero key of a GPU (FNV-1a of its UUID string).
pub fn device_key(id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h.max(1)
}

/// A refused request: the group's `used` and `limit` on the device, and the rule that refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Over {
    pub used: u64,
    pub limit: u64,
    pub rule: Rule,
}

/// Which rule of the group refused (issue 17: denial lines say which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// The budget itself (every policy).
    Budget,
    /// The last `headroom` bytes are kept for a member that is not running yet.
    Headroom { headroom: u64 },
    /// `equal`: the member's share of the budget.
    Share { share: u64, budget: u64, members: u64 },
    /// Unmet reserves of other members; `higher`: under `priority`, of higher priorities only
    /// (lower ones were taken already). The member with the largest one is named.
    Reserved { bytes: u64, pid: u32, comm: [u8; 16], higher: bool },
}

/// `VRAMCAP_GROUP_POLICY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Shared = 1,
    Equal = 2,
    Priority = 3,
}

impl Policy {
    pub fn from_word(w: u32) -> Option<Policy> {
        match w {
            1 => Some(Policy::Shared),
            2 => Some(Policy::Equal),
            3 => Some(Policy::Priority),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Policy::Shared => "shared",
            Policy::Equal => "equal",
            Policy::Priority => "priority",
        }
    }
}

impl Shared {
    /// A ledger on the heap, as a freshly created file holds it: what `vramcap replay --policy`
    /// runs the library's admission over (and unit tests). About 2.5 MiB.
    pub fn in_memory(name: &str) -> Box<Shared> {
        let layout = std::alloc::Layout::new::<Shared>();
        // Every field is an atomic integer, for which all-zero bytes are a valid value.
        let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Shared>();
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        let s = unsafe { Box::from_raw(p) };
        s.init(name);
        s
    }

    /// Fills a zeroed mapping before it is published (only the creator, before `link`).
    pub fn init(&self, name: &str) {
        let h = &self.header;
        let mut buf = [0u8; NAME_BYTES];
        let n = name.len().min(NAME_BYTES);
        buf[..n].copy_from_slice(&name.as_bytes()[..n]);
        for (i, w) in h.name.iter().enumerate() {
            w.store(u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap()), Relaxed);
        }
        h.version.store(VERSION, Relaxed);
        self.kept.seed.store(super::kept::random_seed(), Relaxed);
        h.layout_bytes.store(LAYOUT_BYTES as u32, Relaxed);
        h.devices.store(DEVICES as u32, Relaxed);
        h.slots.store(SLOTS as u32, Relaxed);
        h.magic.store(MAGIC, Release);
    }

    /// Why this mapping is not a ledger we can use, if it is not.
    pub fn validate(&self) -> Result<(), String> {
        let h = &self.header;
        if h.magic.load(Acquire) != MAGIC {
            return Err("bad magic: not a vramcap group ledger, or corrupted".into());
        }
        let v = h.version.load(Relaxed);
        if v != VERSION {
            return Err(format!("format version {v}, this vramcap understands version {VERSION}"));
        }
        let (l, d, s) = (h.layout_bytes.load(Relaxed), h.devices.load(Relaxed), h.slots.load(Relaxed));
        if (l as usize, d as usize, s as usize) != (LAYOUT_BYTES, DEVICES, SLOTS) {
            return Err(format!(
                "layout {l} bytes/{d} devices/{s} slots, expected {LAYOUT_BYTES}/{DEVICES}/{SLOTS}"
            ));
        }
        Ok(())
    }

    pub fn name(&self) -> String {
        let bytes: Vec<u8> = self.header.name.iter().flat_map(|w| w.load(Relaxed).to_le_bytes()).collect();
        String::from_utf8_lossy(&bytes).trim_end_matches('\0').to_string()
    }

    /// The entry of device `key`, taking a free one if the group has not seen it yet. Entries are
    /// taken in order with one CAS each, so two racing members always agree on the index.
    pub fn device_entry(&self, key: u64) -> Option<usize> {
        for (i, d) in self.devices.iter().enumerate() {
            match d.key.compare_exchange(0, key, AcqRel, Acquire) {
                Ok(_) => return Some(i),
                Err(k) if k == key => return Some(i),
                Err(_) => {}
            }
        }
        None
    }

    /// What the group's members hold on device entry `e` (the held budget less unmet reserves).
    /// `held` is read SeqCst: read after a [`Shared::set_limit`] (`vramcap limit` says what the
    /// group holds against the new budget), it counts every grant not judged by the new limit.
    #[inline]
    pub fn used(&self, e: usize) -> u64 {
        let d = &self.devices[e];
        d.held.load(SeqCst).saturating_sub(d.unmet.load(Acquire))
    }

    /// The headroom of device entry `e` in bytes.
    #[inline]
    pub fn headroom(&self, e: usize) -> u64 {
        self.devices[e].headroom.load(Acquire).saturating_sub(1)
    }

    /// Sets the headroom of `e` if it is still `cur_raw` (the stored word); false if it changed.
    pub fn set_headroom(&self, e: usize, cur_raw: u64, bytes: u64) -> bool {
        self.devices[e].headroom.compare_exchange(cur_raw, bytes.saturating_add(1), AcqRel, Acquire).is_ok()
    }

    /// Sets a device's group limit (0 = none); returns the previous one.
    pub fn set_limit(&self, e: usize, bytes: u64) -> u64 {
        // SeqCst, as are the loads it pairs with: a store (here) then a load of `held` (`used`)
        // on one side, a CAS on `held` then a re-read of the limit on the other (`charge`,
        // `admit_once`). Only if all four are SeqCst must one side see the other: a request
        // whose CAS the setter's later look at `held` missed re-reads this limit, and one that
        // re-read the old limit is in what the setter sees. With a Release store the two can
        // both miss (x86: the load passes the store in the store buffer; a swap is a locked
        // instruction, a full fence, and a SeqCst store an `xchg`).
        // charge_tests::a_grant_the_setter_did_not_see_was_judged_by_the_new_limit.
        let old = self.devices[e].limit.swap(bytes, SeqCst);
        if old != bytes {
            self.header.limit_seq.fetch_add(1, Release);
        }
        old
    }

    /// Takes a free slot for a member. The identity is written while the slot is CLAIMING and
    /// published with a CAS: an observer that misjudged us and took the slot meanwhile makes the
    /// CAS fail, and we take another slot instead of sharing one.
    pub fn claim(&self, pid: u32, start: u64, pidns: u64) -> Option<usize> {
        for (i, s) in self.slots.iter().enumerate() {
            let w = s.word.load(Acquire);
            let sw = SlotWord::unpack(w);
            if sw.state != State::Free {
                continue;
            }
            let claiming = SlotWord { state: State::Claiming, generation: sw.generation.wrapping_add(1), pid };
            // Counted before the slot is taken: a kill in between leaves N too high (shares
            // smaller), never too low.
            self.header.members.fetch_add(1, AcqRel);
            if s.word.compare_exchange(w, claiming.pack(), AcqRel, Relaxed).is_ok() {
                s.start.store(start, Release);
                s.pidns.store(pidns, Release);
                s.priority.store(0, Release);
                s.flags.store(0, Release);
                for c in &s.comm {
                    c.store(0, Relaxed);
                }
                s.pressure_seen.store(self.header.pressure.load(Acquire), Release);
                let live = SlotWord { state: State::Live, ..claiming }.pack();
                if s.word.compare_exchange(claiming.pack(), live, AcqRel, Relaxed).is_ok() {
                    return Some(i);
                }
                // Taken over by an observer that judged us dead: it frees the slot and lowers
                // the count.
                continue;
            }
            sub_saturating(&self.header.members, 1);
        }
        None
    }

    /// Empties a slot whose word is `w` on behalf of `me`; exactly one caller succeeds for a
    /// given `w`. Returns the bytes given back to the group.
    pub fn reclaim(&self, i: usize, w: u64, me: u32) -> Option<u64> {
        let s = &self.slots[i];
        let sw = SlotWord::unpack(w);
        let mine = SlotWord { state: State::Reclaiming, generation: sw.generation, pid: me };
        s.word.compare_exchange(w, mine.pack(), AcqRel, Relaxed).ok()?;
        let mut total = 0;
        let loans = s.loans_on.load(Acquire);
        // Its imports go first: exported memory they kept alive may go back with them.
        let imported = s.imports.swap(0, SeqCst);
        let mut kept_on = [0u64; DEVICES];
        for e in 0..DEVICES {
            // Zero the slot first: a kill right here leaks (stricter), never double-counts.
            let charged = s.charge[e].swap(0, AcqRel);
            let exported = s.exported[e].swap(0, AcqRel).min(charged);
            // What it borrowed goes back to its lenders (it stays in `held`, as their reserve).
            let repaid = if loans & (1 << e) != 0 { self.repay(i, e, charged) } else { 0 };
            // Memory it exported may live on: in an fd still open anywhere (sent, not yet
            // imported), or in an importer's mapping. It stays in `held`, described by the
            // member's export records, until `sweep_exports` finds no open file of it.
            let kept = exported.min(charged - repaid);
            kept_on[e] = kept;
            let unmet = s.unmet[e].swap(0, AcqRel);
            s.reserve[e].store(0, Release);
            total += charged - kept;
            if unmet > 0 {
                sub_saturating(&self.devices[e].unmet, unmet);
            }
            if charged - repaid - kept + unmet > 0 {
                sub_saturating(&self.devices[e].held, charged - repaid - kept + unmet);
            }
        }
        // Before the slot is free (an ended record is one whose slot is): records never stand for
        // more than it kept, whatever the sweep does later.
        self.settle_records(i, sw.generation, &kept_on);
        if imported > 0 {
            // The last import may have ended with this member.
            self.release_orphans();
        }
        self.forget_loans(i);
        // The headroom goes back with its holder, and so does a context lease.
        let token = holder_token(i, sw.generation);
        let _ = self.header.headroom_holder.compare_exchange(token, 0, AcqRel, Relaxed);
        self.drop_context_leases(token);
        // A CAS, not a store: if another observer took the emptying over (it judged us dead),
        // exactly one of us frees the slot, and never over a member that claimed it since.
        let free = SlotWord { state: State::Free, generation: sw.generation, pid: 0 }.pack();
        if s.word.compare_exchange(mine.pack(), free, AcqRel, Relaxed).is_ok() {
            sub_saturating(&self.header.members, 1);
        }
        Some(total)
    }

    /// Reclaims every slot whose owner is gone. All words are read first, then `judge` is asked
    /// about their owners at once, then each slot is reclaimed with a CAS on the word read: a
    /// process that claimed a slot before the judge looked is seen by it, and a slot re-taken
    /// since has another generation and is left alone. CLAIMING and RECLAIMING slots are judged
    /// by the identity they carry too: taking over from a live claimer or reclaimer is harmless
    /// (charges leave by swap, words change by CAS). Returns (slots, bytes) reclaimed.
    pub fn reclaim_dead(&self, me: u32, judge: Judge) -> (usize, u64) {
        let mut words = Vec::new();
        let mut members = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            let w = s.word.load(Acquire);
            let sw = SlotWord::unpack(w);
            if sw.state == State::Free {
                continue;
            }
            let start = if sw.state == State::Live { s.start.load(Acquire) } else { 0 };
            words.push((i, w));
            members.push(Member { pid: sw.pid, start, pidns: s.pidns.load(Acquire) });
        }
        if members.is_empty() {
            return (0, 0);
        }
        let verdicts = judge(&members);
        let (mut n, mut bytes) = (0, 0);
        for (&(i, w), v) in words.iter().zip(verdicts) {
            if v == Liveness::Dead && let Some(b) = self.reclaim(i, w, me) {
                n += 1;
                bytes += b;
            }
        }
        (n, bytes)
    }

    /// Number of slots in use.
    pub fn members(&self) -> usize {
        self.slots.iter().filter(|s| SlotWord::unpack(s.word.load(Acquire)).state != State::Free).count()
    }
}

/// The `headroom_holder` word naming slot `i` of generation `generation`.
pub fn holder_token(i: usize, generation: u32) -> u64 {
    ((generation as u64) << 32) | (i as u64 + 1)
}

#[inline]
pub(super) fn sub_saturating(a: &AtomicU64, v: u64) -> u64 {
    let mut cur = a.load(Relaxed);
    loop {
        let take = cur.min(v);
        if take == 0 {
            // Nothing to take: no write, so no contended cache line for nothing.
            return 0;
        }
        match a.compare_exchange_weak(cur, cur - take, AcqRel, Relaxed) {
            Ok(_) => return take,
            Err(actual) => cur = actual,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A zeroed `Shared` on the heap: the same state a fresh file has.
    pub fn fresh() -> Box<Shared> {
        let layout = std::alloc::Layout::new::<Shared>();
        unsafe { Box::from_raw(std::alloc::alloc_zeroed(layout).cast::<Shared>()) }
    }

    #[test]
    fn layout_is_fixed() {
        // Changing this means changing VERSION: members built from different versions share files.
        assert_eq!(std::mem::size_of::<Header>(), 128);
        assert_eq!(std::mem::size_of::<Device>(), 128);
        assert_eq!(std::mem::size_of::<Slot>(), 2368);
        assert_eq!(std::mem::size_of::<Kept>(), 576 + 64 * super::super::kept::RECORDS);
        assert_eq!(LAYOUT_BYTES, 128 + 128 * 64 + 8 * 64 + 2368 * 1024 + 576 + 64 * 1024);
        assert_eq!(std::mem::offset_of!(Shared, devices) % 64, 0);
    }

    #[test]
    fn slot_word_round_trips() {
        for w in [
            SlotWord { state: State::Free, generation: 0, pid: 0 },
            SlotWord { state: State::Live, generation: 0x3fff_ffff, pid: u32::MAX },
            SlotWord { state: State::Reclaiming, generation: 7, pid: 4_194_304 },
            SlotWord { state: State::Claiming, generation: 1, pid: 1 },
        ] {
            assert_eq!(SlotWord::unpack(w.pack()), w);
        }
    }

    #[test]
    fn init_validate_and_corruption() {
        let s = fresh();
        assert!(s.validate().unwrap_err().contains("bad magic"));
        s.init("team-a");
        assert_eq!(s.validate(), Ok(()));
        assert_eq!(s.name(), "team-a");
        s.header.version.store(9, Relaxed);
        assert!(s.validate().unwrap_err().contains("version 9"));
        s.header.version.store(VERSION, Relaxed);
        s.header.slots.store(3, Relaxed);
        assert!(s.validate().unwrap_err().contains("3 slots"));
    }

    #[test]
    fn device_entries_are_shared_by_key() {
        let s = fresh();
        let (a, b) = (device_key("GPU-a"), device_key("GPU-b"));
        assert_eq!(s.device_entry(a), Some(0));
        assert_eq!(s.device_entry(b), Some(1));
        assert_eq!(s.device_entry(a), Some(0));
        assert_ne!(device_key(""), 0);
    }
}
