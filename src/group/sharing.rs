//! Joining a group's sharing rules at CUDA init (issue 17): the group's policy and headroom,
//! set by its first member and refused when a member asks for others; this member's priority,
//! name and reserve. Every refusal is one line that says what the group has, what this process
//! asked for and by which variable, and the member's slot goes back at once.

use super::shm::{DEVICES, Policy, Shared, SlotWord, State};
use crate::config::{GroupConfig, limits::DeviceInfo, size::human};
use crate::grammar::group::PolicyName;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// `VRAMCAP_PRIORITY` as written to the slot (also by a forked child registering late).
static PRIORITY: AtomicU64 = AtomicU64::new(0);

fn to_policy(p: PolicyName) -> Policy {
    match p {
        PolicyName::Shared => Policy::Shared,
        PolicyName::Equal => Policy::Equal,
        PolicyName::Priority => Policy::Priority,
    }
}

/// Writes this process's priority and command name into its freshly claimed slot.
pub fn describe(s: &Shared, slot: usize) {
    let sl = &s.slots[slot];
    sl.priority.store(PRIORITY.load(Relaxed), Release);
    let comm = std::fs::read("/proc/self/comm").unwrap_or_default();
    let mut buf = [0u8; 16];
    let name: Vec<u8> = comm.into_iter().filter(|&b| b != b'\n').take(16).collect();
    buf[..name.len()].copy_from_slice(&name);
    for (k, w) in sl.comm.iter().enumerate() {
        w.store(u64::from_le_bytes(buf[k * 8..k * 8 + 8].try_into().unwrap()), Relaxed);
    }
}

/// A member's command name as the ledger has it.
pub fn comm_of(comm: &[u8; 16]) -> String {
    String::from_utf8_lossy(comm).trim_end_matches('\0').to_string()
}

/// Whether any live member other than `slot` is in the group (dead ones were reclaimed first).
fn alone(s: &Shared, slot: usize) -> bool {
    super::reclaim_in(s);
    s.slots.iter().enumerate().all(|(j, o)| j == slot || SlotWord::unpack(o.word.load(Acquire)).state == State::Free)
}

/// Applies the group settings of `cfg` for the member in `slot`; `entries[d]` is the group's
/// entry for this process's device `d`.
pub fn join(s: &Shared, slot: usize, name: &str, cfg: &GroupConfig, devices: &[DeviceInfo], entries: &[usize]) -> Result<(), String> {
    PRIORITY.store(cfg.priority as u64, Relaxed);
    s.slots[slot].priority.store(cfg.priority as u64, Release);
    join_policy(s, slot, name, cfg)?;
    join_headroom(s, slot, name, cfg, devices, entries)?;
    claim_reserves(s, slot, name, cfg, devices, entries)?;
    let headroom = entries.iter().any(|&e| s.headroom(e) > 0);
    // The dead are reclaimed before looking (cold, at start): a holder that died is not a holder,
    // and a group whose members all died is not running, so its next member is its first again.
    if headroom {
        super::reclaim_in(s);
    }
    if headroom && s.others_hold_memory(slot) && s.try_take_headroom(slot) {
        crate::log::log_at!(
            crate::config::Level::Info,
            "group \"{name}\": this process started while the group was running and holds its headroom"
        );
    }
    Ok(())
}

fn join_policy(s: &Shared, slot: usize, name: &str, cfg: &GroupConfig) -> Result<(), String> {
    let h = &s.header;
    let want = cfg.policy.map(to_policy);
    // A new group: the first member sets the policy (shared unless it asks for another).
    let _ = h.policy.compare_exchange(0, want.unwrap_or(Policy::Shared) as u32, AcqRel, Acquire);
    let Some(want) = want else { return Ok(()) };
    let cur = h.policy.load(Acquire);
    if cur == want as u32 {
        return Ok(());
    }
    let have = Policy::from_word(cur).map_or("unknown", Policy::name);
    // The group's members are all gone (the ledger outlives them): the new first member sets it.
    if alone(s, slot) && h.policy.compare_exchange(cur, want as u32, AcqRel, Acquire).is_ok() {
        crate::log::log_at!(crate::config::Level::Info, "group \"{name}\": policy {} (was {have}, no member running)", want.name());
        return Ok(());
    }
    Err(format!(
        "group \"{name}\" uses policy {have} (set by its first member), and this process asks for {} \
         (VRAMCAP_GROUP_POLICY={}): a group has one policy; use the group's, or another group",
        want.name(),
        want.name()
    ))
}

fn join_headroom(s: &Shared, slot: usize, name: &str, cfg: &GroupConfig, devices: &[DeviceInfo], entries: &[usize]) -> Result<(), String> {
    let want = if cfg.headroom.is_empty() { None } else { Some(cfg.headroom.resolve(devices).map_err(|e| e.to_string())?) };
    let mut others = None;
    for (d, &e) in entries.iter().enumerate() {
        let dev = &s.devices[e];
        // Never set (0): the first member sets it, to what it asks for or to none. Racing first
        // members asking for the same value agree; one asking for none wins only if it is first.
        let w = want.as_ref().map(|v| v[d]);
        if dev.headroom.load(Acquire) == 0 {
            s.set_headroom(e, 0, w.unwrap_or(0));
        }
        let Some(w) = w else { continue };
        let cur = dev.headroom.load(Acquire);
        if s.headroom(e) == w {
            continue;
        }
        // Set already: only a member alone in the group (the others are gone) may change it.
        if *others.get_or_insert_with(|| alone(s, slot)) && s.set_headroom(e, cur, w) {
            continue;
        }
        return Err(format!(
            "group \"{name}\" device {d}: the group keeps a headroom of {} (set by its first member), and this \
             process asks for {} (VRAMCAP_GROUP_HEADROOM): a group has one headroom; leave it unset to use the group's",
            human(s.headroom(e)),
            human(w)
        ));
    }
    Ok(())
}

fn claim_reserves(s: &Shared, slot: usize, name: &str, cfg: &GroupConfig, devices: &[DeviceInfo], entries: &[usize]) -> Result<(), String> {
    if cfg.reserve.is_empty() {
        return Ok(());
    }
    let want = cfg.reserve.resolve(devices).map_err(|e| e.to_string())?;
    for (d, (&e, &r)) in entries.iter().zip(&want).enumerate() {
        if r == 0 {
            continue;
        }
        if let Err(over) = s.claim_reserve(slot, e, r) {
            for &done in &entries[..d] {
                s.drop_reserve(slot, done);
            }
            return Err(reserve_refusal(s, slot, name, d, e, r, over.limit));
        }
    }
    Ok(())
}

/// "what is reserved by whom": every other member's reserve and use on the device.
fn reserve_refusal(s: &Shared, slot: usize, name: &str, d: usize, e: usize, r: u64, limit: u64) -> String {
    let mut by = Vec::new();
    let mut reserved = 0;
    for (j, o) in s.slots.iter().enumerate() {
        let w = SlotWord::unpack(o.word.load(Acquire));
        let rj = o.reserve[e].load(Acquire);
        if j == slot || w.state == State::Free || rj == 0 {
            continue;
        }
        reserved += rj;
        let mut comm = [0u8; 16];
        for (k, c) in o.comm.iter().enumerate() {
            comm[k * 8..k * 8 + 8].copy_from_slice(&c.load(Relaxed).to_le_bytes());
        }
        by.push(format!("pid {} \"{}\" {}", w.pid, comm_of(&comm), human(rj)));
    }
    let whom = if by.is_empty() {
        "no other member has a reserve".to_string()
    } else {
        format!("reserved {} by {}", human(reserved), by.join(", "))
    };
    format!(
        "VRAMCAP_GROUP_RESERVE {} does not fit on device {d} of group \"{name}\": limit {}, headroom {}, {whom}, \
         in use {} (a reserve is claimed at start from what is free): lower the reserve, or start when the group has room",
        human(r),
        human(limit),
        human(s.headroom(e)),
        human(s.used(e))
    )
}

/// This member's sharing settings as the ledger has them (trace header, doctor, sidecar).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemberView {
    pub policy: &'static str,
    pub priority: i64,
    pub holds_headroom: bool,
    /// Per device of this process: (reserve, unmet, headroom, equal share if any).
    pub devices: Vec<(u64, u64, u64, Option<u64>)>,
}

impl MemberView {
    /// Device `d`'s (reserve, headroom, equal share) for the trace and the sidecar.
    pub fn on(&self, d: usize) -> Option<(u64, u64, Option<u64>)> {
        self.devices.get(d).map(|&(reserve, _, headroom, share)| (reserve, headroom, share))
    }
}

/// This member's view, `None` outside a group or before it has a slot (a forked child that has
/// not charged yet). Reads the ledger's words only: cheap, but not for the allocation path.
pub fn view() -> Option<MemberView> {
    let (s, slot) = super::me()?;
    let sl = &s.slots[slot];
    let mut devices = Vec::new();
    for d in 0..crate::ledger::device_count().min(DEVICES) {
        let Some(e) = super::entry(d) else { break };
        devices.push((
            sl.reserve[e].load(Acquire),
            sl.unmet[e].load(Acquire),
            s.headroom(e),
            s.share(slot, e).map(|(share, _, _)| share),
        ));
    }
    Some(MemberView {
        policy: s.policy().name(),
        priority: sl.priority.load(Acquire) as i64,
        holds_headroom: s.holds_headroom(slot),
        devices,
    })
}
