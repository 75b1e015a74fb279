//! Admission: how a member's request is decided under the group's policy (issue 17;
//! docs/configuration.md, "Sharing one GPU: policies").
//!
//! Per device the ledger keeps `used` (what members hold) and `held` = `used` + every member's
//! unmet reserve. Every rule is decided by compare-and-swap on the word the rule is about, as
//! part of the reservation itself, never by a look followed by an act:
//!
//! - the budget and reserves: one CAS on `held` (`held + need ≤ limit − headroom`, where `need`
//!   is the request minus what the member's own unmet reserve covers);
//! - the headroom: the same CAS with the whole limit, for the one member holding the headroom
//!   (a member that started late takes it when nobody uses it: [`Shared::try_take_headroom`]);
//! - `equal`: one CAS on the member's own charge (`charge + size ≤ share`, share = budget / N);
//! - `priority`: a member that does not fit takes unmet reserve of lower priorities, each piece
//!   with one CAS on that member's `unmet` (a piece is had by exactly one side), then decides on
//!   `held` as above; what it took stays counted in `held` throughout, and goes back to the
//!   member it was taken from when freed (`loan`).
//!
//! Every step that a kill could interrupt leaves `held` (or `used`) too high: a member killed in
//! the middle of a request costs the others at most that request until its slot is reclaimed.

use super::shm::{DEVICES, LATE, Over, Policy, Rule, Shared, SlotWord, State, holder_token, sub_saturating};
use std::sync::atomic::{AtomicU64, Ordering::*};

/// What a granted request took: from the member's own unmet reserve (`own`), from `held`
/// (`added`), and from lower-priority members' unmet reserves (`stolen`, counted in `held`
/// already); `held` after it, and the device's limit and headroom as the request saw them.
struct Taken {
    own: u64,
    added: u64,
    stolen: Vec<(usize, u64)>,
    held_after: u64,
    limit: u64,
    headroom: u64,
}

/// Adds `v` to `a` if the result stays ≤ `bound`; `Err(current)` otherwise. The CAS is SeqCst:
/// on `held` it is the reservation half of the store-then-load pair with [`Shared::set_limit`]
/// (see there). On x86 a locked CAS is a full fence whatever the ordering: the same code.
#[inline]
fn add_bounded(a: &AtomicU64, v: u64, bound: u64) -> Result<u64, u64> {
    let mut cur = a.load(Relaxed);
    loop {
        let next = match cur.checked_add(v) {
            Some(n) if n <= bound => n,
            _ => return Err(cur),
        };
        match a.compare_exchange_weak(cur, next, SeqCst, Relaxed) {
            Ok(_) => return Ok(next),
            Err(actual) => cur = actual,
        }
    }
}

/// Takes up to `v` from `a`; returns what was taken (fast when `a` is 0: one load).
#[inline]
fn take(a: &AtomicU64, v: u64) -> u64 {
    if v == 0 || a.load(Relaxed) == 0 { 0 } else { sub_saturating(a, v) }
}

/// Raises `a` by up to `v`, never above `cap`; returns the raise.
fn refill(a: &AtomicU64, v: u64, cap: u64) -> u64 {
    let mut cur = a.load(Relaxed);
    loop {
        let add = v.min(cap.saturating_sub(cur));
        if add == 0 {
            return 0;
        }
        match a.compare_exchange_weak(cur, cur + add, AcqRel, Relaxed) {
            Ok(_) => return add,
            Err(actual) => cur = actual,
        }
    }
}

#[inline]
fn note_peak(d: &super::shm::Device, held: u64) {
    // Unmet reserves are not use: only a member with a reserve pays the second load.
    if held > d.peak.load(Relaxed) {
        let used = held.saturating_sub(d.unmet.load(Relaxed));
        d.peak.fetch_max(used, Relaxed);
    }
}

/// Takes up to `v` of slot `s`'s unmet reserve on `e`, keeping the device's sum in step.
#[inline]
fn take_own(d: &super::shm::Device, unmet: &AtomicU64, v: u64) -> u64 {
    let t = take(unmet, v);
    if t > 0 {
        sub_saturating(&d.unmet, t);
    }
    t
}

/// Puts `v` back into an unmet reserve (and the device's sum), up to `cap`; returns it.
pub(super) fn give_unmet(d: &super::shm::Device, unmet: &AtomicU64, v: u64, cap: u64) -> u64 {
    let back = refill(unmet, v, cap);
    if back > 0 {
        d.unmet.fetch_add(back, AcqRel);
    }
    back
}

impl Shared {
    pub fn policy(&self) -> Policy {
        Policy::from_word(self.header.policy.load(Acquire)).unwrap_or(Policy::Shared)
    }

    /// Whether slot `i` holds the group's headroom.
    #[inline]
    pub fn holds_headroom(&self, i: usize) -> bool {
        let h = self.header.headroom_holder.load(Acquire);
        h != 0 && h == holder_token(i, SlotWord::unpack(self.slots[i].word.load(Acquire)).generation)
    }

    /// The budget slot `i` may fill on device `e`: the limit, less the headroom unless it
    /// holds it. `(limit, budget, headroom)`; a limit of 0 (none) reads as `u64::MAX`.
    #[inline]
    fn budget(&self, i: usize, e: usize) -> (u64, u64, u64) {
        let d = &self.devices[e];
        let limit = match d.limit.load(Acquire) {
            0 => return (u64::MAX, u64::MAX, 0),
            l => l,
        };
        let headroom = self.headroom(e).min(limit);
        let budget = if headroom == 0 || self.holds_headroom(i) { limit } else { limit - headroom };
        (limit, budget, headroom)
    }

    /// `equal`'s share of slot `i` on `e`: (share, budget it divides, members).
    pub fn share(&self, i: usize, e: usize) -> Option<(u64, u64, u64)> {
        // The policy word first: a read-mostly line, so `shared` and `priority` pay one load.
        if self.header.policy.load(Relaxed) != Policy::Equal as u32 {
            return None;
        }
        let (limit, _, headroom) = self.budget(i, e);
        if limit == u64::MAX {
            return None;
        }
        let n = self.header.members.load(Acquire).max(1);
        let base = limit - headroom;
        let extra = if headroom > 0 && self.holds_headroom(i) { headroom } else { 0 };
        Some((base / n + extra, base, n))
    }

    /// Reserves `size` on device entry `e` for the member in slot `i` and records it as its
    /// charge: the reservation and every rule of the policy in one step (see the module).
    /// Inlined into the library's group step (another crate): it is the group's hot path.
    ///
    /// The common case is one predictable branch: no headroom on the device, no unmet reserve
    /// of this member, a policy other than `equal`. Then every rule but the budget is moot (the
    /// others' reserves are in `held` already) and the request is one CAS on `held` against the
    /// limit. Anything else, and any refusal (where `priority` may take from lower members and a
    /// late member the headroom), goes to [`Shared::charge_general`], which decides it afresh:
    /// the fast attempt changed nothing when it gives up.
    #[inline(always)]
    pub fn charge(&self, i: usize, e: usize, size: u64) -> Result<(), Over> {
        self.charge_racing(i, e, size, || {})
    }

    /// [`Shared::charge`] with `gap` run between its first look at the limit and its CAS on
    /// `held`: where a change of the limit racing the request lands (tests put one there;
    /// `charge` passes nothing, which compiles away).
    #[doc(hidden)]
    #[inline(always)]
    pub fn charge_racing(&self, i: usize, e: usize, size: u64, gap: impl Fn()) -> Result<(), Over> {
        let (d, s) = (&self.devices[e], &self.slots[i]);
        // Raw headroom words 0 (not set yet) and 1 (set to none) both mean no headroom.
        let rare = (d.headroom.load(Relaxed) >> 1) | s.unmet[e].load(Relaxed);
        if rare != 0 || self.header.policy.load(Relaxed) == Policy::Equal as u32 {
            return self.charge_general(i, e, size, &gap);
        }
        let raw = d.limit.load(Acquire);
        let limit = if raw == 0 { u64::MAX } else { raw };
        gap();
        let Ok(held_after) = add_bounded(&d.held, size, limit) else { return self.charge_general(i, e, size, &|| {}) };
        // The limit again, after the CAS (issue 26), so that a request that read the old limit
        // and charged after a shrink is held to the new one. SeqCst, like the CAS and the
        // setter's store and its look at `held` after it ([`Shared::set_limit`]): a change whose
        // setter did not see this CAS is seen here. Acquire would not do: a store then a load
        // against a CAS then a load lets both sides miss the other. On x86 a SeqCst load is a
        // plain load: the hot path pays nothing for it.
        let now = d.limit.load(SeqCst);
        if now != raw {
            self.limit_moved(e, size, held_after, limit, now)?;
        }
        s.charge[e].fetch_add(size, AcqRel);
        note_peak(d, held_after);
        Ok(())
    }

    /// The limit changed between the first look and the CAS: a shrink that the request no
    /// longer fits takes it back (it never became the member's charge) and refuses it.
    #[cold]
    #[inline(never)]
    fn limit_moved(&self, e: usize, size: u64, held_after: u64, limit: u64, now: u64) -> Result<(), Over> {
        if now != 0 && now < limit && held_after > now {
            return Err(self.undo_after_shrink(usize::MAX, e, size, 0, &[], now));
        }
        Ok(())
    }

    /// [`Shared::charge`] under every rule of the policy.
    #[inline(never)]
    fn charge_general(&self, i: usize, e: usize, size: u64, gap: &dyn Fn()) -> Result<(), Over> {
        let t = self.admit(i, e, size, gap)?;
        if !t.stolen.is_empty() {
            self.lend(i, e, &t.stolen);
        }
        let d = &self.devices[e];
        note_peak(d, t.held_after);
        if t.headroom > 0 {
            let free_after = t.limit.saturating_sub(t.held_after);
            let free_before = free_after.saturating_add(t.added);
            if free_before >= t.headroom && free_after < t.headroom {
                // The headroom is being used: neighbours give back what they hold unused.
                self.header.pressure.fetch_add(1, AcqRel);
            }
        }
        Ok(())
    }

    /// A request granted against a limit that shrank meanwhile: taken back (before it became
    /// the member's charge), refused by the new one.
    #[cold]
    #[inline(never)]
    fn undo_after_shrink(&self, i: usize, e: usize, added: u64, own: u64, stolen: &[(usize, u64)], limit: u64) -> Over {
        let d = &self.devices[e];
        sub_saturating(&d.held, added);
        if own > 0 {
            give_unmet(d, &self.slots[i].unmet[e], own, u64::MAX);
        }
        self.give_back(e, stolen);
        Over { used: self.used(e), limit, rule: Rule::Budget }
    }

    /// Whether [`Shared::charge`] would grant `size` now, leaving the ledger as it was: for a
    /// replay judging a request that the recorded run refused (a ledger nobody else writes).
    pub fn probe(&self, i: usize, e: usize, size: u64) -> Result<(), Over> {
        let holder = self.header.headroom_holder.load(Acquire);
        let t = self.admit(i, e, size, &|| {});
        // A late member may have taken the headroom to answer: put it back.
        self.header.headroom_holder.store(holder, Release);
        let t = t?;
        let (d, s) = (&self.devices[e], &self.slots[i]);
        sub_saturating(&s.charge[e], size);
        sub_saturating(&d.held, t.added);
        give_unmet(d, &s.unmet[e], t.own, u64::MAX);
        self.give_back(e, &t.stolen);
        Ok(())
    }

    /// The rules of [`Shared::charge`]: on success the request is charged and `held` raised.
    #[inline(always)]
    fn admit(&self, i: usize, e: usize, size: u64, gap: &dyn Fn()) -> Result<Taken, Over> {
        match self.admit_once(i, e, size, gap) {
            Err(over) => self.admit_as_holder(i, e, size, over),
            ok => ok,
        }
    }

    /// A refused member that started late takes the headroom if nobody uses it and asks again
    /// (once): the "+1" job fits whoever held the headroom idle before it.
    #[cold]
    fn admit_as_holder(&self, i: usize, e: usize, size: u64, over: Over) -> Result<Taken, Over> {
        let late = self.slots[i].flags.load(Acquire) & LATE != 0;
        if !late || self.headroom(e) == 0 || self.holds_headroom(i) || !self.try_take_headroom(i) {
            return Err(over);
        }
        self.admit_once(i, e, size, &|| {})
    }

    /// `gap`: see [`Shared::charge_racing`].
    #[inline(always)]
    fn admit_once(&self, i: usize, e: usize, size: u64, gap: &dyn Fn()) -> Result<Taken, Over> {
        let (d, s) = (&self.devices[e], &self.slots[i]);
        let (limit, budget, headroom) = self.budget(i, e);
        gap();
        // The member's own unmet reserve first: that part is in `held` already.
        let own = take_own(d, &s.unmet[e], size);
        let need = size - own;
        let mut stolen: Vec<(usize, u64)> = Vec::new();
        // All of it from the member's own reserve: already in `held`, kept for it whatever the
        // others hold, and no write to the group's contended word.
        let fits = if need == 0 { Ok(d.held.load(Acquire)) } else { add_bounded(&d.held, need, budget) };
        let held_after = match fits {
            Ok(h) => h,
            Err(held) => {
                let policy = self.policy();
                let mut admitted = None;
                if policy == Policy::Priority {
                    // Never more than this request: what is taken becomes this member's charge.
                    let deficit = held.saturating_add(need).saturating_sub(budget).min(need);
                    stolen = self.take_from_lower(i, e, deficit);
                    let got: u64 = stolen.iter().map(|&(_, b)| b).sum();
                    if got > 0 {
                        admitted = add_bounded(&d.held, need - got, budget).ok();
                    }
                }
                match admitted {
                    Some(h) => h,
                    None => {
                        self.give_back(e, &stolen);
                        give_unmet(d, &s.unmet[e], own, u64::MAX);
                        let rule = self.why(i, e, held, need, limit, budget, headroom, policy);
                        return Err(Over { used: self.used(e), limit, rule });
                    }
                }
            }
        };
        let got: u64 = stolen.iter().map(|&(_, b)| b).sum();
        // The limit again, after the CAS (issue 26): SeqCst, see `charge_racing`.
        let now = d.limit.load(SeqCst);
        if now != 0 && now < limit && held_after > now {
            return Err(self.undo_after_shrink(i, e, need - got, own, &stolen, now));
        }
        match self.share(i, e) {
            Some((share, base, n)) => {
                if add_bounded(&s.charge[e], size, share).is_err() {
                    sub_saturating(&d.held, need - got);
                    give_unmet(d, &s.unmet[e], own, u64::MAX);
                    self.give_back(e, &stolen);
                    let rule = Rule::Share { share, budget: base, members: n };
                    return Err(Over { used: self.used(e), limit, rule });
                }
            }
            None => {
                s.charge[e].fetch_add(size, AcqRel);
            }
        }
        Ok(Taken { own, added: need - got, stolen, held_after, limit, headroom })
    }

    /// What slot `i` could be granted on `e` now (for `cuMemGetInfo`).
    pub fn available(&self, i: usize, e: usize) -> u64 {
        let (d, s) = (&self.devices[e], &self.slots[i]);
        let (_, budget, _) = self.budget(i, e);
        let own = s.unmet[e].load(Acquire);
        let free = budget.saturating_sub(d.held.load(Acquire)).saturating_add(own);
        match self.share(i, e) {
            Some((share, _, _)) => free.min(share.saturating_sub(s.charge[e].load(Acquire))),
            None => free,
        }
    }

    /// Charges memory the driver already handed out: no rule applies, it exists.
    pub fn charge_unchecked(&self, i: usize, e: usize, size: u64) {
        let (d, s) = (&self.devices[e], &self.slots[i]);
        let own = take_own(d, &s.unmet[e], size);
        let held = d.held.fetch_add(size - own, AcqRel).saturating_add(size - own);
        s.charge[e].fetch_add(size, AcqRel);
        note_peak(d, held);
    }

    /// A reservation without a member (tests, and tools probing a ledger): budget only.
    pub fn reserve(&self, e: usize, size: u64) -> Result<u64, Over> {
        let d = &self.devices[e];
        let limit = match d.limit.load(Acquire) {
            0 => u64::MAX,
            l => l,
        };
        add_bounded(&d.held, size, limit).map_err(|_| Over { used: self.used(e), limit, rule: Rule::Budget })
    }

    /// Gives back up to `size` of what slot `i` holds on `e`; returns what was given back. Never
    /// more than the slot holds. What the member borrowed from lower priorities goes back to
    /// its lenders first, then its own reserve fills up again (both are kept for their owner
    /// while it lives), the rest leaves `held`.
    #[inline]
    pub fn uncharge(&self, i: usize, e: usize, size: u64) -> u64 {
        let (d, s) = (&self.devices[e], &self.slots[i]);
        let taken = sub_saturating(&s.charge[e], size);
        // One branch for the common case: no loans (on any device) and no reserve here.
        if s.loans_on.load(Relaxed) | s.reserve[e].load(Relaxed) != 0 {
            return self.uncharge_to_owners(i, e, taken);
        }
        sub_saturating(&d.held, taken);
        taken
    }

    /// The rest of [`Shared::uncharge`] for a member with loans or a reserve: `taken` bytes
    /// left its charge; its lenders, then its own reserve, get theirs back before `held` does.
    #[inline(never)]
    fn uncharge_to_owners(&self, i: usize, e: usize, taken: u64) -> u64 {
        let (d, s) = (&self.devices[e], &self.slots[i]);
        let repaid = if s.loans_on.load(Relaxed) & (1 << e) == 0 { 0 } else { self.repay(i, e, taken) };
        let r = s.reserve[e].load(Relaxed);
        let back = if r == 0 { 0 } else { give_unmet(d, &s.unmet[e], taken - repaid, r.saturating_sub(s.charge[e].load(Acquire))) };
        sub_saturating(&d.held, taken - repaid - back);
        taken
    }

    /// Claims `bytes` of reserve on `e` for slot `i` at its start: from the free budget (less
    /// the headroom), or not at all.
    pub fn claim_reserve(&self, i: usize, e: usize, bytes: u64) -> Result<(), Over> {
        let d = &self.devices[e];
        let (limit, _, headroom) = self.budget(i, e);
        let budget = limit.saturating_sub(headroom);
        if let Err(held) = add_bounded(&d.held, bytes, budget) {
            let rule = self.why(i, e, held, bytes, limit, budget, headroom, Policy::Shared);
            return Err(Over { used: self.used(e), limit, rule });
        }
        self.slots[i].reserve[e].fetch_add(bytes, AcqRel);
        self.slots[i].unmet[e].fetch_add(bytes, AcqRel);
        d.unmet.fetch_add(bytes, AcqRel);
        Ok(())
    }

    /// Drops slot `i`'s unmet reserve on `e` (a start refused after all).
    pub fn drop_reserve(&self, i: usize, e: usize) {
        let s = &self.slots[i];
        let u = s.unmet[e].swap(0, AcqRel);
        s.reserve[e].store(0, Release);
        sub_saturating(&self.devices[e].unmet, u);
        sub_saturating(&self.devices[e].held, u);
    }

    /// Live members other than `i` with an unmet reserve on `e` and a priority below `i`'s,
    /// lowest first (then the latest started); takes up to `deficit` from them.
    #[cold]
    fn take_from_lower(&self, i: usize, e: usize, deficit: u64) -> Vec<(usize, u64)> {
        let mine = self.slots[i].priority.load(Acquire) as i64;
        let mut lower: Vec<(i64, std::cmp::Reverse<u64>, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|&(j, s)| {
                j != i
                    && SlotWord::unpack(s.word.load(Acquire)).state == State::Live
                    && (s.priority.load(Acquire) as i64) < mine
                    && s.unmet[e].load(Acquire) > 0
            })
            .map(|(j, s)| (s.priority.load(Acquire) as i64, std::cmp::Reverse(s.start.load(Acquire)), j))
            .collect();
        lower.sort();
        let mut out = Vec::new();
        let mut left = deficit;
        for (_, _, j) in lower {
            if left == 0 {
                break;
            }
            let got = take_own(&self.devices[e], &self.slots[j].unmet[e], left);
            if got > 0 {
                out.push((j, got));
                left -= got;
            }
        }
        out
    }

    /// Returns pieces taken by [`take_from_lower`] that stayed counted in `held`.
    fn give_back(&self, e: usize, pieces: &[(usize, u64)]) {
        for &(j, b) in pieces {
            give_unmet(&self.devices[e], &self.slots[j].unmet[e], b, u64::MAX);
        }
    }

    /// Which rule refused `need` bytes (cold: only on a denial).
    #[allow(clippy::too_many_arguments)]
    #[cold]
    fn why(&self, i: usize, e: usize, held: u64, need: u64, limit: u64, budget: u64, headroom: u64, policy: Policy) -> Rule {
        let want = held.saturating_add(need);
        // Unmet reserves of others that count against us (under `priority`, lower ones were
        // taken already, so only equal and higher ones remain in the way).
        let mine = self.slots[i].priority.load(Acquire) as i64;
        let (mut bytes, mut top) = (0u64, None::<(u64, usize)>);
        for (j, s) in self.slots.iter().enumerate() {
            if j == i || SlotWord::unpack(s.word.load(Acquire)).state == State::Free {
                continue;
            }
            if policy == Policy::Priority && (s.priority.load(Acquire) as i64) < mine {
                continue;
            }
            let u = s.unmet[e].load(Acquire);
            bytes += u;
            if u > 0 && top.is_none_or(|(b, _)| u > b) {
                top = Some((u, j));
            }
        }
        if let Some((_, j)) = top
            && want.saturating_sub(bytes) <= budget
        {
            let s = &self.slots[j];
            let mut comm = [0u8; 16];
            for (k, w) in s.comm.iter().enumerate() {
                comm[k * 8..k * 8 + 8].copy_from_slice(&w.load(Relaxed).to_le_bytes());
            }
            let pid = SlotWord::unpack(s.word.load(Acquire)).pid;
            return Rule::Reserved { bytes, pid, comm, higher: policy == Policy::Priority };
        }
        if headroom > 0 && budget < limit && want <= limit {
            return Rule::Headroom { headroom };
        }
        Rule::Budget
    }

    /// Sum over devices of what live members other than `i` hold (is the group running?).
    pub fn others_hold_memory(&self, i: usize) -> bool {
        (0..DEVICES).any(|e| self.used(e) > self.slots[i].charge[e].load(Acquire))
    }

    /// Makes slot `i` the headroom holder if nobody alive holds it, or if its holder does not
    /// use it (no device's `held` is above its limit less its headroom): for a member that
    /// started while other members held memory (a restart, the "+1" job), at its start and when
    /// a request of its own needs the headroom. So the member that gets the headroom is the
    /// late starter that needs it, whatever the order the group started in, and a holder that
    /// does not use it keeps it only until such a member comes. A holder that uses it keeps it
    /// while it lives (nothing is taken back).
    pub fn try_take_headroom(&self, i: usize) -> bool {
        let h = self.header.headroom_holder.load(Acquire);
        let me = holder_token(i, SlotWord::unpack(self.slots[i].word.load(Acquire)).generation);
        if h == me {
            return true;
        }
        if h != 0 {
            let j = (h & 0xffff_ffff) as usize - 1;
            let w = self.slots.get(j).map(|s| SlotWord::unpack(s.word.load(Acquire)));
            let alive = w.is_some_and(|w| w.state != State::Free && holder_token(j, w.generation) == h);
            if alive && self.headroom_in_use() {
                return false;
            }
        }
        self.header.headroom_holder.compare_exchange(h, me, AcqRel, Relaxed).is_ok()
    }

    /// Whether any device holds more than its limit less its headroom: someone (the holder, or
    /// one that held it before) uses the headroom.
    fn headroom_in_use(&self) -> bool {
        self.devices.iter().enumerate().any(|(e, d)| {
            let (limit, headroom) = (d.limit.load(Acquire), self.headroom(e));
            limit > 0 && headroom > 0 && d.held.load(Acquire) > limit.saturating_sub(headroom)
        })
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod charge_tests;
