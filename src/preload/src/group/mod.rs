//! Group (container) caps: every process naming the same `VRAMCAP_GROUP` shares one budget per
//! device, kept in a file mapped `MAP_SHARED` (layout, lock-free operations and the sharing rules
//! in `vramcap_common::group_ledger`, re-exported here as [`shm`] and [`file`]). This module is
//! the process's side: attaching once limits are resolved, the member slot, and the
//! reserve/release steps `ledger` calls after its own.
//!
//! Nothing here waits on another process (but a member making a context while another measures
//! the group's first one, [`first_context`]): reservation is one CAS on the group's counter, slot
//! registration one CAS on a slot word. A member killed at any point costs the others at most
//! the one allocation it was in the middle of (counted, never lost).
//!
//! A member's charge leaves the group when the member dies, not when it starts exiting: after
//! `exit()` begins, other atexit handlers, C++ destructors and threads still run and still hold
//! the memory (issue 15). Whoever next needs the budget (a member about to be denied, or the
//! sidecar's sweep) finds the dead member by [`liveness`] and reclaims it.

pub mod peek;
pub mod pressure;
pub mod sharing;

pub use vramcap_common::group_ledger::{budget, file, guard, liveness, shm};

use crate::config::{GroupConfig, limits::DeviceInfo, size::human};
use crate::ledger::{Denied, MAX_DEVICES};
use shm::Shared;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU16, AtomicU64, AtomicUsize, Ordering::*};

static SHM: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
static NAME: OnceLock<String> = OnceLock::new();
const NO_ENTRY: u16 = u16::MAX;
/// This process's CUDA ordinal → the group's device entry.
static ENTRY: [AtomicU16; MAX_DEVICES] = [const { AtomicU16::new(NO_ENTRY) }; MAX_DEVICES];
const NO_SLOT: usize = usize::MAX;
static MY_SLOT: AtomicUsize = AtomicUsize::new(NO_SLOT);

/// The group this process belongs to (trace header, sidecar metrics).
pub fn name() -> Option<&'static str> {
    NAME.get().map(String::as_str)
}

#[inline]
fn shared() -> Option<&'static Shared> {
    let p = SHM.load(Acquire);
    (!p.is_null()).then(|| unsafe { &*p })
}

#[inline]
pub fn active() -> bool {
    !SHM.load(Relaxed).is_null()
}

#[inline]
fn entry(dev: usize) -> Option<usize> {
    let e = ENTRY.get(dev)?.load(Relaxed);
    (e != NO_ENTRY).then_some(e as usize)
}

/// The group's (limit, used) on one of this process's devices, when the group caps it.
/// Dead members still count in `used` until reclaimed, so a query (`cuMemGetInfo`: frameworks
/// size caches by it) first gives back what dead members hold, at most once a second.
pub fn view(dev: usize) -> Option<(u64, u64)> {
    let (s, e) = (shared()?, entry(dev)?);
    let d = &s.devices[e];
    // The ceiling file's group limit bounds this member even above the ledger's budget.
    let limit = match (d.limit.load(Acquire), CEILING[dev].load(Relaxed)) {
        (0, 0) => return None,
        (l, 0) | (0, l) => l,
        (l, c) => l.min(c),
    };
    reclaim_now_and_then(s);
    Some((limit, s.used(e)))
}

/// Whether this process's group observes (issue 26): `true` outside a group. A member whose
/// ledger is not attached (yet, or lost) does not observe: it is never granted on a guess.
pub fn observing() -> bool {
    match shared() {
        Some(s) => !guard::lost() && s.observing(),
        None => crate::config::get().group.is_none(),
    }
}

/// The largest context a member of the group measured on `dev` (0: none, or no group).
pub fn context_estimate(dev: usize) -> u64 {
    let (Some(s), Some(e)) = (shared(), entry(dev)) else { return 0 };
    s.devices[e].context_bytes.load(Acquire)
}

/// A context measured `bytes` on `dev`: later members reserve at least that before making one.
pub fn note_context(dev: usize, bytes: u64) {
    if let (Some(s), Some(e)) = (shared(), entry(dev)) {
        s.devices[e].context_bytes.fetch_max(bytes, AcqRel);
    }
}

/// A context measured at most `bytes` on `dev` (a bound, not a size): noted only where no member
/// measured one yet.
pub fn note_context_if_none(dev: usize, bytes: u64) {
    if let (Some(s), Some(e)) = (shared(), entry(dev)) {
        let _ = s.devices[e].context_bytes.compare_exchange(0, bytes, AcqRel, Acquire);
    }
}

/// How long a member waits for another one to measure the group's first context on a device: a
/// context takes a real driver well under a second to make; a holder stopped longer (a debugger,
/// SIGSTOP) is not waited for any more, and this member makes its context unreserved.
const LEASE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Before this member makes a context on `dev` while no member measured one there (issue 24):
/// the group's first context is measured by one member at a time (`shm` lease), so that members
/// starting together do not all make theirs unreserved past the budget. `true`: this member holds
/// the lease (give it back with [`first_context_done`] once its size is noted); `false`: a size
/// is known now ([`context_estimate`]), or there is no group, or the holder did not finish within
/// [`LEASE_PATIENCE`]. The one place a member waits for another: only at a context's creation,
/// never on an allocation, and a holder that dies gives the lease up with its slot.
pub fn first_context(dev: usize) -> bool {
    let (Some(s), Some(e)) = (shared(), entry(dev)) else { return false };
    let Some(i) = my_slot(s) else { return false };
    let start = std::time::Instant::now();
    loop {
        if s.devices[e].context_bytes.load(Acquire) > 0 {
            return false;
        }
        if s.take_context_lease(e, i) {
            // The holder before us may have noted its size between our look and the take.
            if s.devices[e].context_bytes.load(Acquire) > 0 {
                s.drop_context_lease(e, i);
                return false;
            }
            return true;
        }
        if start.elapsed() >= LEASE_PATIENCE {
            lease_given_up(dev);
            return false;
        }
        // A holder killed without its slot emptied gives the lease up when the sweep finds it.
        reclaim_now_and_then(s);
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

#[cold]
fn lease_given_up(dev: usize) {
    crate::log::write_line(&format!(
        "vramcap: device {dev}: another member of group {} has been making the group's first context for {} s; this one is made without knowing its size (the device may hold both past the budget until it is measured)",
        name().unwrap_or("?"),
        LEASE_PATIENCE.as_secs()
    ));
}

/// The lease [`first_context`] took goes back (the context's size is noted, or it was not made).
pub fn first_context_done(dev: usize) {
    if let (Some(s), Some(e)) = (shared(), entry(dev))
        && let Some(i) = my_slot(s)
    {
        s.drop_context_lease(e, i);
    }
}

/// Like [`view`], but `used` is what this member cannot have: `limit − used` is what it could
/// get now under the group's rules (the budget it may fill, less what the group holds and
/// others' unmet reserves, plus its own unmet reserve, within its `equal` share).
pub fn room(dev: usize) -> Option<(u64, u64)> {
    let (limit, _) = view(dev)?;
    let e = entry(dev)?;
    let Some((s, slot)) = me() else { return view(dev) };
    Some((limit, limit - s.available(slot, e).min(limit)))
}

#[cold]
fn reclaim_now_and_then(s: &Shared) {
    static LAST_S: AtomicU64 = AtomicU64::new(0);
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    let now = ts.tv_sec as u64 + 1; // never 0, so the first query always sweeps
    let last = LAST_S.load(Relaxed);
    if now != last && LAST_S.compare_exchange(last, now, Relaxed, Relaxed).is_ok() {
        reclaim_in(s);
    }
}

/// The container's default group name: processes of one container share a cgroup.
fn container_name() -> String {
    let cg = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    format!("hami-{:016x}", shm::device_key(&cg))
}

/// The group's name and its ledger's path. HAMi's shared cache names the ledger itself: every
/// process given that file shares it.
fn ledger_path(cfg: &GroupConfig) -> (String, std::path::PathBuf) {
    let name = match (&cfg.name, &cfg.ledger) {
        (Some(n), _) => n.clone(),
        (None, Some(l)) => format!("hami-{:016x}", shm::device_key(l)),
        (None, None) => container_name(),
    };
    let path = cfg.ledger.as_ref().map_or_else(|| file::path_for(&cfg.dir, &name), std::path::PathBuf::from);
    (name, path)
}

/// Joins the group once the devices are known; `limits` are this process's resolved
/// `VRAMCAP_GROUP_LIMIT` (bytes per visible device, 0 = none), `None` to adopt the group's.
/// Racing first callers each do the whole job and publish with CAS: nobody waits.
/// `ceiling`: the ceiling file's group limit per device (0 = none), which bounds this member
/// whatever budget the ledger holds (an operator may set one above it).
pub fn attach(cfg: &GroupConfig, devices: &[DeviceInfo], limits: Option<&[u64]>, ceiling: Option<&[u64]>) -> Result<(), String> {
    if active() && MY_SLOT.load(Acquire) != NO_SLOT {
        return Ok(());
    }
    let (name, path) = ledger_path(cfg);
    if cfg.ledger.is_none() && cfg.dir == crate::config::group::default_dir() {
        file::ensure_private_dir(&cfg.dir)?;
    }
    let m = file::open_or_create(&path, &name).map_err(|e| match &cfg.ledger {
        Some(l) => format!(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE={l}: {e} (vramcap keeps the container's budget in this file in its own \
             format: a cache HAMi-core wrote cannot be shared; give the container a fresh path)"
        ),
        None => e,
    })?;
    let s = m.shm;
    let mut entries = Vec::with_capacity(devices.len());
    for (d, info) in devices.iter().enumerate() {
        let id = if info.uuid.is_empty() { format!("ordinal-{d}") } else { info.uuid.clone() };
        let e = s.device_entry(shm::device_key(&id)).ok_or_else(|| {
            format!("group ledger {} already tracks {} devices", path.display(), shm::DEVICES)
        })?;
        entries.push(e);
    }
    if let Some(limits) = limits {
        let uid = unsafe { libc::getuid() };
        let what: Vec<_> = entries.iter().zip(limits).map(|(&e, &want)| (want, s.member_limit(e, want, uid))).collect();
        say_member_limit(&name, &what);
    }
    if let Some(c) = ceiling {
        for (d, &c) in c.iter().enumerate().take(MAX_DEVICES) {
            CEILING[d].store(c, Relaxed);
        }
    }
    let slot = register(s).ok_or_else(|| {
        format!("group ledger {}: all {} member slots are taken by live processes", path.display(), shm::SLOTS)
    })?;
    // Policy, headroom, priority and reserve: refused here means the slot goes back at once.
    if let Err(why) = sharing::join(s, slot, &name, cfg, devices, &entries) {
        s.reclaim(slot, s.slots[slot].word.load(Acquire), std::process::id());
        return Err(why);
    }
    // Exported memory of ended members that no fd keeps any more goes back as a member joins
    // (`/proc/locks` is read only when such memory waits for a look).
    s.sweep_exports(&vramcap_common::group_ledger::kept::proc_locks);
    for (d, &e) in entries.iter().enumerate() {
        ENTRY[d].store(e as u16, Release);
    }
    if let Err(winner) = MY_SLOT.compare_exchange(NO_SLOT, slot, AcqRel, Acquire) {
        // A racing thread of ours registered first: give ours back (it holds nothing).
        if winner != slot {
            s.reclaim(slot, s.slots[slot].word.load(Acquire), std::process::id());
        }
    }
    let _ = NAME.set(name);
    if SHM.compare_exchange(std::ptr::null_mut(), s as *const Shared as *mut Shared, AcqRel, Acquire).is_err() {
        m.unmap();
    }
    install_process_hooks();
    Ok(())
}

/// A line per device where this member's `VRAMCAP_GROUP_LIMIT` changed the group's budget, and
/// one line for the devices where it was not applied because an operator set the budget.
fn say_member_limit(name: &str, what: &[(u64, budget::MemberLimit)]) {
    let show = |b: u64| if b == 0 { "no limit".to_string() } else { human(b) };
    let mut adopted = Vec::new();
    let mut by = 0;
    for (d, &(want, w)) in what.iter().enumerate() {
        match w {
            budget::MemberLimit::Applied { old } if old != want && old != 0 => crate::log::write_line(&format!(
                "vramcap: group \"{name}\" device {d}: limit changed from {} to {} by pid {} (the newest VRAMCAP_GROUP_LIMIT wins)",
                show(old),
                show(want),
                std::process::id()
            )),
            budget::MemberLimit::Adopted { bytes, uid } if bytes != want => {
                adopted.push(format!("device {d}: {} (VRAMCAP_GROUP_LIMIT's {})", show(bytes), show(want)));
                by = uid;
            }
            _ => {}
        }
    }
    if !adopted.is_empty() {
        crate::log::write_line(&format!(
            "vramcap: group \"{name}\": using the budget uid {by} set with `vramcap limit`, not this process's \
             VRAMCAP_GROUP_LIMIT: {}",
            adopted.join(", ")
        ));
    }
}

/// Devices whose group limit changed since the last look, as (device, old, new, uid that set
/// it); `seen` holds the last limits looked at (`u64::MAX`: not looked at yet, nothing reported).
pub fn limit_changes(seen: &mut [u64]) -> Vec<(usize, u64, u64, u32)> {
    let Some(s) = shared() else { return Vec::new() };
    // A truncated ledger was swapped for a refusing copy: its limits are no one's change.
    if guard::lost() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (d, last) in seen.iter_mut().enumerate() {
        let Some(e) = entry(d) else { continue };
        let now = s.devices[e].limit.load(Acquire);
        if *last != now {
            if *last != u64::MAX {
                out.push((d, *last, now, s.limit_setter(e).map_or(0, |b| b.uid)));
            }
            *last = now;
        }
    }
    out
}

/// Writes this member's group limits into the ledger again (the ceiling file that bounds them
/// changed), as a joining member does: an operator's budget stays.
pub fn rewrite_limits(limits: &[u64]) {
    let Some(s) = shared() else { return };
    let uid = unsafe { libc::getuid() };
    for (d, &want) in limits.iter().enumerate() {
        if let Some(e) = entry(d) {
            s.member_limit(e, want, uid);
        }
    }
}

/// Sets this member's ceiling on device `dev` (0 = none; the ceiling file changed); returns the
/// previous one.
pub fn set_ceiling(dev: usize, bytes: u64) -> u64 {
    CEILING.get(dev).map_or(0, |c| c.swap(bytes, SeqCst))
}

/// The ceiling file's group limit per device (0 = none): see [`attach`].
static CEILING: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

fn register(s: &Shared) -> Option<usize> {
    let (pid, (start, pidns)) = (std::process::id(), liveness::self_identity());
    let slot = s.claim(pid, start, pidns).or_else(|| {
        reclaim_in(s);
        s.claim(pid, start, pidns)
    })?;
    sharing::describe(s, slot);
    Some(slot)
}

/// Our slot, registering (cold) in a child after fork.
#[inline]
fn my_slot(s: &Shared) -> Option<usize> {
    match MY_SLOT.load(Acquire) {
        NO_SLOT => register_late(s),
        i => Some(i),
    }
}

#[cold]
fn register_late(s: &Shared) -> Option<usize> {
    let slot = register(s)?;
    match MY_SLOT.compare_exchange(NO_SLOT, slot, AcqRel, Acquire) {
        Ok(_) => Some(slot),
        Err(winner) => {
            s.reclaim(slot, s.slots[slot].word.load(Acquire), std::process::id());
            Some(winner)
        }
    }
}

/// The group step of a reservation (after the process's own succeeded).
#[inline]
pub fn reserve(dev: usize, size: u64) -> Result<(), Denied> {
    let (Some(s), Some(e)) = (shared(), entry(dev)) else { return Ok(()) };
    let Some(slot) = my_slot(s) else { return Err(Denied { used: 0, limit: 0, group: true, rule: shm::Rule::Budget }) };
    match s.charge(slot, e, size) {
        Ok(()) => match CEILING[dev].load(Relaxed) {
            0 => Ok(()),
            c => within_ceiling(s, slot, e, size, c),
        },
        Err(_) => reserve_after_reclaim(s, slot, e, size),
    }
}

/// The ceiling file bounds this member's group whatever the ledger's budget (an operator's
/// `vramcap limit` above it is accepted, and each member held to its own ceiling).
#[cold]
#[inline(never)]
fn within_ceiling(s: &Shared, slot: usize, e: usize, size: u64, ceiling: u64) -> Result<(), Denied> {
    let used = s.used(e);
    if used <= ceiling {
        return Ok(());
    }
    s.uncharge(slot, e, size);
    Err(Denied { used: used - size, limit: ceiling, group: true, rule: shm::Rule::Budget })
}

/// Would be denied: first give back what dead members still hold, then try once more.
#[cold]
fn reserve_after_reclaim(s: &Shared, slot: usize, e: usize, size: u64) -> Result<(), Denied> {
    if guard::lost() {
        // The ledger was swapped for a copy that refuses everything (see `guard`).
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Relaxed) {
            crate::log::write_line(&format!(
                "vramcap: the ledger of group \"{}\" was truncated while in use: denying every group allocation from \
                 now on to keep the budget (memory already held stays usable and can be freed). Stop the group's \
                 jobs, remove the ledger file and restart them",
                name().unwrap_or("")
            ));
        }
        return Err(Denied { used: 0, limit: 1, group: true, rule: shm::Rule::Budget });
    }
    reclaim_in(s);
    s.charge(slot, e, size).map_err(|o| Denied { used: o.used, limit: o.limit, group: true, rule: o.rule })
}

/// The group step of `ledger::charge` (memory the driver already handed out).
pub fn charge(dev: usize, size: u64) {
    let (Some(s), Some(e)) = (shared(), entry(dev)) else { return };
    if let Some(slot) = my_slot(s) {
        s.charge_unchecked(slot, e, size);
    }
}

/// The group step of a release.
#[inline]
pub fn release(dev: usize, size: u64) {
    let (Some(s), Some(e)) = (shared(), entry(dev)) else { return };
    if let i @ 0..shm::SLOTS = MY_SLOT.load(Acquire) {
        s.uncharge(i, e, size);
    }
}

/// `size` bytes of this member's charge on `dev` were exported as a shareable handle: memory an
/// fd or an importer may keep alive after this process ends (`shm::Shared::reclaim` keeps it the
/// group's, `group_ledger::kept` decides when it goes).
pub fn exported(dev: usize, size: u64) {
    let (Some(s), Some(e)) = (shared(), entry(dev)) else { return };
    if let Some(slot) = my_slot(s) {
        s.exported(slot, e, size);
    }
}

/// A new id for an exported allocation (its exports' lock byte, `group_ledger::kept`); `None`
/// outside a group.
pub fn new_export_id() -> Option<u64> {
    shared().map(|s| s.new_export_id())
}

/// Records an export of this member's allocation `id` (`size` bytes on `dev`, 0 for one more
/// export of it) whose exported file is `file` (device, inode) locked at the id's byte; `None`:
/// not watched (its allocation is never given back without an operator). False: not recorded.
pub fn record_export(dev: usize, size: u64, id: u64, file: Option<(u64, u64)>) -> bool {
    let (Some((s, slot)), Some(e)) = (me(), entry(dev)) else { return false };
    let (d, ino) = file.unwrap_or((0, 0));
    s.record_export(slot, e, size, d, ino, id, file.is_none())
}

/// An export of allocation `id` could not be watched or recorded: none of its records is swept.
pub fn export_unsure(id: u64) {
    if let Some((s, slot)) = me() {
        s.export_unsure(slot, id);
    }
}

/// This member holds one more shareable handle another process exported.
pub fn import_began() {
    let Some(s) = shared() else { return };
    if let Some(slot) = my_slot(s) {
        s.import_began(slot);
    }
}

/// This member no longer holds one (its last reference released, its last mapping unmapped).
pub fn import_ended() {
    if let Some((s, slot)) = me() {
        s.import_ended(slot);
    }
}

/// Gives back what dead members of this process's group hold; returns (members, bytes).
/// The sidecar calls this (or [`reclaim_in`] on a ledger it opened) periodically.
pub fn reclaim_dead() -> (usize, u64) {
    shared().map_or((0, 0), reclaim_in)
}

pub use vramcap_common::group_ledger::reclaim_in;

static HOOKS: AtomicBool = AtomicBool::new(false);

/// No atexit hook: the charge stays while the process lives (see the module comment).
fn install_process_hooks() {
    if HOOKS.swap(true, AcqRel) {
        return;
    }
    unsafe {
        libc::pthread_atfork(None, None, Some(forked_child));
    }
}

/// A child is a new member: it registers its own slot on its first charge (with the parent's
/// priority, without its reserve or headroom: those were the parent's to claim).
extern "C" fn forked_child() {
    MY_SLOT.store(NO_SLOT, Relaxed);
}

/// This process's slot and the mapped ledger, for [`sharing`] and [`pressure`].
fn me() -> Option<(&'static Shared, usize)> {
    let s = shared()?;
    match MY_SLOT.load(Acquire) {
        i @ 0..shm::SLOTS => Some((s, i)),
        _ => None,
    }
}
