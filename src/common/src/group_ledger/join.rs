//! A member's start in its group (issue 17): the group's policy and headroom, set by its first
//! member and refused when a later one asks for others; this member's priority and reserve; and
//! whether it becomes the one member that may use the headroom. The library runs this at CUDA
//! init (src/preload/src/group/sharing.rs adds the words and the log lines); `vramcap replay
//! --policy` runs it for each trace as it starts.

use super::shm::{LATE, MODE_ENFORCE, MODE_OBSERVE, Over, Policy, Shared, SlotWord, State};
use crate::config::CapMode;
use crate::grammar::size::human;
use std::sync::atomic::Ordering::*;

/// What a member asks of its group; per-device values are indexed like `entries`.
pub struct Request<'a> {
    /// `VRAMCAP_GROUP_POLICY`; `None`: adopt the group's (`shared` for a new group).
    pub policy: Option<Policy>,
    /// `VRAMCAP_PRIORITY`.
    pub priority: i64,
    /// `VRAMCAP_MODE` (after the ceiling file's say).
    pub mode: CapMode,
    /// `VRAMCAP_GROUP_HEADROOM` per entry, resolved to bytes; `None`: adopt the group's.
    pub headroom: Option<&'a [u64]>,
    /// `VRAMCAP_GROUP_RESERVE` per entry in bytes (empty: none).
    pub reserve: &'a [u64],
}

/// How a start went, for the member's log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Joined {
    /// The group had no member running and another policy: this member reset it (from this).
    pub policy_was: Option<&'static str>,
    /// This member started while others held memory and holds the headroom now (it may take it
    /// later too, when it needs it and nobody uses it).
    pub holds_headroom: bool,
    /// What this member's mode did to the group's, or the group's to it.
    pub mode: Option<ModeJoin>,
}

/// How a member's `VRAMCAP_MODE` met its group's mode (issue 26). Enforce always wins: a
/// member observing while another enforces would spend the budget the other is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeJoin {
    /// It asked for observe; the group enforces, so it enforces too.
    AdoptedEnforce,
    /// It enforces; the group observed with members running, and enforces from now on (every
    /// member's next allocation that does not fit is refused).
    GroupNowEnforces,
    /// The group had another mode and no member running: this member's mode is the group's now.
    Reset { was: CapMode },
}

/// Why a start was refused; the slot is the caller's to give back.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Policy { have: &'static str, want: Policy },
    /// `d`: the index into `entries` (the member's device ordinal).
    Headroom { d: usize, have: u64, want: u64 },
    Reserve { d: usize, bytes: u64, over: Over },
}

impl Shared {
    /// Whether any member other than `slot` holds a slot. The caller reclaims the dead first.
    pub fn alone(&self, slot: usize) -> bool {
        self.slots.iter().enumerate().all(|(j, o)| j == slot || SlotWord::unpack(o.word.load(Acquire)).state == State::Free)
    }

    /// Applies `req` for the member in `slot`; `entries[d]` is the group's entry for the member's
    /// device `d`. `sweep` reclaims dead members (the library asks `/proc`; a replay has none):
    /// it runs before deciding that nobody else is running. On a refusal nothing this call
    /// claimed stays claimed.
    pub fn join(&self, slot: usize, entries: &[usize], req: &Request, sweep: &dyn Fn(&Shared)) -> Result<Joined, Refused> {
        self.slots[slot].priority.store(req.priority as u64, Release);
        let mut joined = Joined { policy_was: self.join_policy(slot, req.policy, sweep)?, holds_headroom: false, mode: None };
        joined.mode = self.join_mode(slot, req.mode, sweep);
        self.join_headroom(slot, entries, req.headroom, sweep)?;
        self.claim_reserves(slot, entries, req.reserve)?;
        let headroom = entries.iter().any(|&e| self.headroom(e) > 0);
        // The dead are reclaimed before looking: a holder that died is not a holder, and a group
        // whose members all died is not running, so its next member is its first again.
        if headroom {
            sweep(self);
        }
        if headroom && self.others_hold_memory(slot) {
            // Started while the group was running: it may take the headroom, now or when it
            // needs it and nobody uses it (`try_take_headroom`).
            self.slots[slot].flags.fetch_or(LATE, AcqRel);
            joined.holds_headroom = self.try_take_headroom(slot);
        }
        Ok(joined)
    }

    fn join_policy(&self, slot: usize, want: Option<Policy>, sweep: &dyn Fn(&Shared)) -> Result<Option<&'static str>, Refused> {
        let h = &self.header;
        // A new group: the first member sets the policy (shared unless it asks for another).
        let _ = h.policy.compare_exchange(0, want.unwrap_or(Policy::Shared) as u32, AcqRel, Acquire);
        let Some(want) = want else { return Ok(None) };
        let cur = h.policy.load(Acquire);
        if cur == want as u32 {
            return Ok(None);
        }
        let have = Policy::from_word(cur).map_or("unknown", Policy::name);
        // The group's members are all gone (the ledger outlives them): the new first member sets it.
        sweep(self);
        if self.alone(slot) && h.policy.compare_exchange(cur, want as u32, AcqRel, Acquire).is_ok() {
            return Ok(Some(have));
        }
        Err(Refused::Policy { have, want })
    }

    /// The group's mode: set by its first member; a member asking for observe in a group that
    /// enforces enforces too; a member that enforces makes an observing group enforce. Only a
    /// member alone in the group (the others gone) may turn enforce into observe.
    fn join_mode(&self, slot: usize, want: CapMode, sweep: &dyn Fn(&Shared)) -> Option<ModeJoin> {
        let h = &self.header;
        let word = |m: CapMode| if m == CapMode::Observe { MODE_OBSERVE } else { MODE_ENFORCE };
        let _ = h.mode.compare_exchange(0, word(want), AcqRel, Acquire);
        let cur = h.mode.load(Acquire);
        if cur == word(want) {
            return None;
        }
        let was = if cur == MODE_OBSERVE { CapMode::Observe } else { CapMode::Enforce };
        sweep(self);
        if self.alone(slot) && h.mode.compare_exchange(cur, word(want), SeqCst, SeqCst).is_ok() {
            // A member that claimed its slot after we looked may have read the old mode and
            // enforce on it: whoever is here now, after our write, keeps the stricter mode.
            if want == CapMode::Observe && !self.alone(slot) {
                let _ = h.mode.compare_exchange(MODE_OBSERVE, MODE_ENFORCE, SeqCst, SeqCst);
                return Some(ModeJoin::AdoptedEnforce);
            }
            return Some(ModeJoin::Reset { was });
        }
        match want {
            CapMode::Observe => Some(ModeJoin::AdoptedEnforce),
            CapMode::Enforce => {
                // Unconditional: whatever raced us, the group ends up enforcing.
                h.mode.store(MODE_ENFORCE, Release);
                Some(ModeJoin::GroupNowEnforces)
            }
        }
    }

    /// An operator's `vramcap limit --enforce`: the group enforces from now on (each member at
    /// its next allocation that does not fit); returns whether it observed.
    pub fn enforce(&self) -> bool {
        self.header.mode.swap(MODE_ENFORCE, AcqRel) == MODE_OBSERVE
    }

    /// Whether the group's members observe (`VRAMCAP_MODE=observe`, issue 26): read at each
    /// allocation that does not fit, never on the allocation path itself.
    pub fn observing(&self) -> bool {
        self.header.mode.load(Acquire) == MODE_OBSERVE
    }

    fn join_headroom(&self, slot: usize, entries: &[usize], want: Option<&[u64]>, sweep: &dyn Fn(&Shared)) -> Result<(), Refused> {
        let mut others = None;
        for (d, &e) in entries.iter().enumerate() {
            let dev = &self.devices[e];
            // Never set (0): the first member sets it, to what it asks for or to none. Racing first
            // members asking for the same value agree; one asking for none wins only if it is first.
            let w = want.map(|v| v.get(d).copied().unwrap_or(0));
            if dev.headroom.load(Acquire) == 0 {
                self.set_headroom(e, 0, w.unwrap_or(0));
            }
            let Some(w) = w else { continue };
            let cur = dev.headroom.load(Acquire);
            if self.headroom(e) == w {
                continue;
            }
            // Set already: only a member alone in the group (the others are gone) may change it.
            let alone = *others.get_or_insert_with(|| {
                sweep(self);
                self.alone(slot)
            });
            if alone && self.set_headroom(e, cur, w) {
                continue;
            }
            return Err(Refused::Headroom { d, have: self.headroom(e), want: w });
        }
        Ok(())
    }

    fn claim_reserves(&self, slot: usize, entries: &[usize], want: &[u64]) -> Result<(), Refused> {
        for (d, (&e, &r)) in entries.iter().zip(want).enumerate() {
            if r == 0 {
                continue;
            }
            if let Err(over) = self.claim_reserve(slot, e, r) {
                for &done in &entries[..d] {
                    self.drop_reserve(slot, done);
                }
                return Err(Refused::Reserve { d, bytes: r, over });
            }
        }
        Ok(())
    }

    /// A member's command name as slot `j` has it.
    pub fn comm(&self, j: usize) -> String {
        let mut comm = [0u8; 16];
        for (k, c) in self.slots[j].comm.iter().enumerate() {
            comm[k * 8..k * 8 + 8].copy_from_slice(&c.load(Relaxed).to_le_bytes());
        }
        comm_of(&comm)
    }
}

/// A command name as the ledger keeps it (16 bytes, NUL-padded).
pub fn comm_of(comm: &[u8; 16]) -> String {
    String::from_utf8_lossy(comm).trim_end_matches('\0').to_string()
}

impl Refused {
    /// The refusal as one line for the member's stderr: what the group has, what this process
    /// asked for and by which variable. `slot` and `entries` as given to [`Shared::join`].
    pub fn message(&self, s: &Shared, slot: usize, entries: &[usize], name: &str) -> String {
        match *self {
            Refused::Policy { have, want } => format!(
                "group \"{name}\" uses policy {have} (set by its first member), and this process asks for {} \
                 (VRAMCAP_GROUP_POLICY={}): a group has one policy; use the group's, or another group",
                want.name(),
                want.name()
            ),
            Refused::Headroom { d, have, want } => format!(
                "group \"{name}\" device {d}: the group keeps a headroom of {} (set by its first member), and this \
                 process asks for {} (VRAMCAP_GROUP_HEADROOM): a group has one headroom; leave it unset to use the group's",
                human(have),
                human(want)
            ),
            Refused::Reserve { d, bytes, over } => reserve_refusal(s, slot, name, d, entries[d], bytes, over.limit),
        }
    }
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
        by.push(format!("pid {} \"{}\" {}", w.pid, s.comm(j), human(rj)));
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
