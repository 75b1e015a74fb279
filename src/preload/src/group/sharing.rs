//! This member's start in its group (issue 17) and its sharing settings as the ledger has them.
//! The rules themselves (policy, headroom, reserve, the headroom holder) are the group ledger's
//! (`vramcap_common::group_ledger::join`); this side resolves the settings for this process's
//! devices and says what happened: one line per refusal, and the member's slot goes back.

use vramcap_common::grammar::group::PolicyName;
use vramcap_common::group_ledger::join::{ModeJoin, Request};
use vramcap_common::group_ledger::shm::{DEVICES, Policy, Shared};
use crate::config::{GroupConfig, limits::DeviceInfo};
use std::sync::atomic::{AtomicU64, Ordering::*};

pub use vramcap_common::group_ledger::join::comm_of;

/// `VRAMCAP_PRIORITY` as written to the slot (also by a forked child registering late).
static PRIORITY: AtomicU64 = AtomicU64::new(0);

pub fn to_policy(p: PolicyName) -> Policy {
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

/// Applies the group settings of `cfg` for the member in `slot`; `entries[d]` is the group's
/// entry for this process's device `d`.
pub fn join(s: &Shared, slot: usize, name: &str, cfg: &GroupConfig, devices: &[DeviceInfo], entries: &[usize]) -> Result<(), String> {
    PRIORITY.store(cfg.priority as u64, Relaxed);
    let headroom = if cfg.headroom.is_empty() { None } else { Some(cfg.headroom.resolve(devices).map_err(|e| e.to_string())?) };
    let reserve = if cfg.reserve.is_empty() { Vec::new() } else { cfg.reserve.resolve(devices).map_err(|e| e.to_string())? };
    let req = Request { policy: cfg.policy.map(to_policy), priority: cfg.priority, mode: crate::config::get().mode, headroom: headroom.as_deref(), reserve: &reserve };
    let sweep = |s: &Shared| {
        super::reclaim_in(s);
    };
    let joined = s.join(slot, entries, &req, &sweep).map_err(|r| r.message(s, slot, entries, name))?;
    if let Some(was) = joined.policy_was {
        let now = s.policy().name();
        crate::log::log_at!(crate::config::Level::Info, "group \"{name}\": policy {now} (was {was}, no member running)");
    }
    say_mode(name, joined.mode);
    if joined.holds_headroom {
        crate::log::log_at!(
            crate::config::Level::Info,
            "group \"{name}\": this process started while the group was running and holds its headroom"
        );
    }
    Ok(())
}

/// One line where this member's `VRAMCAP_MODE` and its group's disagreed (issue 26).
fn say_mode(name: &str, m: Option<ModeJoin>) {
    match m {
        None => {}
        Some(ModeJoin::AdoptedEnforce) => {
            crate::observe::group_enforces_said();
            crate::log::write_line(&format!(
            "vramcap: group \"{name}\" enforces its budget (set by its first member): this process enforces too, \
             not VRAMCAP_MODE=observe (a group observes only when all its members do; docs/configuration.md)"
            ))
        }
        Some(ModeJoin::GroupNowEnforces) => crate::log::write_line(&format!(
            "vramcap: group \"{name}\" was in observe mode and this process enforces (VRAMCAP_MODE is not observe): \
             the group enforces its budget from now on, for every member (a member cannot observe while another enforces)"
        )),
        Some(ModeJoin::Reset { was }) => crate::log::log_at!(
            crate::config::Level::Info,
            "group \"{name}\": mode {} (was {}, no member running)",
            crate::config::get().mode.name(),
            was.name()
        ),
    }
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
