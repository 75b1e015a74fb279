//! Who sets a group's budget while its members run (issue 26).
//!
//! Two writers: a member joining with `VRAMCAP_GROUP_LIMIT` (the newest member's setting wins, as
//! before), and an operator with `vramcap limit --group`. Once an operator has set a device's
//! budget, members joining later adopt it: restarting one process of a resized pod must not undo
//! the resize. Each device entry says who wrote its limit last (`limit_by`) and keeps the
//! operator's value apart (`operator_limit`), so a member racing an operator puts the operator's
//! budget back instead of overwriting it (see [`Shared::member_limit`]).
//!
//! The limit itself stays one 64-bit word: an allocation is judged against the old or the new
//! value, never half of one, and admission re-reads it after its compare-and-swap (`admit`), so
//! a request that raced a shrink is held to the new budget.

use super::shm::Shared;
use std::sync::atomic::Ordering::*;

const OPERATOR: u64 = 1 << 63;
const KNOWN: u64 = 1 << 62;

/// Who wrote a device's limit last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setter {
    pub uid: u32,
    /// `vramcap limit` (true) or a member's `VRAMCAP_GROUP_LIMIT` (false).
    pub operator: bool,
}

impl Setter {
    fn pack(self) -> u64 {
        KNOWN | if self.operator { OPERATOR } else { 0 } | self.uid as u64
    }
    fn unpack(w: u64) -> Option<Setter> {
        (w & KNOWN != 0).then_some(Setter { uid: w as u32, operator: w & OPERATOR != 0 })
    }
    /// `group` or `operator uid N` / `member uid N`, for messages and traces.
    pub fn describe(self) -> String {
        format!("{} uid {}", if self.operator { "operator" } else { "member" }, self.uid)
    }
}

/// What a joining member's `VRAMCAP_GROUP_LIMIT` did to a device's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberLimit {
    /// Written: the previous limit (0 = none).
    Applied { old: u64 },
    /// An operator set the budget: kept (bytes, the operator's uid).
    Adopted { bytes: u64, uid: u32 },
}

impl Shared {
    /// Who set device entry `e`'s limit last (`None`: nobody since the ledger was made).
    pub fn limit_setter(&self, e: usize) -> Option<Setter> {
        Setter::unpack(self.devices[e].limit_by.load(Acquire))
    }

    /// An operator sets `e`'s budget (0 = none); returns the previous one. The operator's value
    /// is published before the flag, and the flag before the limit: a member that sees the flag
    /// finds the value it must put back.
    pub fn operator_set_limit(&self, e: usize, bytes: u64, uid: u32) -> u64 {
        let d = &self.devices[e];
        d.operator_limit.store(bytes, SeqCst);
        d.limit_by.store(Setter { uid, operator: true }.pack(), SeqCst);
        self.set_limit(e, bytes)
    }

    /// A joining member's `VRAMCAP_GROUP_LIMIT` for `e`: written unless an operator set the
    /// budget. A member that wrote while an operator did (the flag appeared after its check)
    /// writes the operator's value back: whichever order the two ran in, the operator's budget is
    /// what stays.
    pub fn member_limit(&self, e: usize, want: u64, uid: u32) -> MemberLimit {
        let d = &self.devices[e];
        let adopted = || MemberLimit::Adopted {
            bytes: d.operator_limit.load(SeqCst),
            uid: self.limit_setter(e).map_or(0, |s| s.uid),
        };
        if self.limit_setter(e).is_some_and(|s| s.operator) {
            return adopted();
        }
        let seen = d.limit_by.load(SeqCst);
        let mine = Setter { uid, operator: false }.pack();
        // A CAS, not a store: an operator's flag set in between is never erased.
        if d.limit_by.compare_exchange(seen, mine, SeqCst, SeqCst).is_err() && self.limit_setter(e).is_some_and(|s| s.operator) {
            return adopted();
        }
        let old = self.set_limit(e, want);
        if self.limit_setter(e).is_some_and(|s| s.operator) {
            self.set_limit(e, d.operator_limit.load(SeqCst));
            return adopted();
        }
        MemberLimit::Applied { old }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_adopt_an_operators_budget_and_overwrite_each_other() {
        let s = Shared::in_memory("b");
        assert_eq!(s.limit_setter(0), None);
        assert_eq!(s.member_limit(0, 100, 7), MemberLimit::Applied { old: 0 });
        assert_eq!(s.member_limit(0, 200, 8), MemberLimit::Applied { old: 100 }, "the newest member wins");
        assert_eq!(s.limit_setter(0), Some(Setter { uid: 8, operator: false }));
        assert_eq!(s.operator_set_limit(0, 50, 1000), 200);
        assert_eq!(s.member_limit(0, 300, 8), MemberLimit::Adopted { bytes: 50, uid: 1000 });
        assert_eq!(s.devices[0].limit.load(SeqCst), 50);
        assert_eq!(s.limit_setter(0), Some(Setter { uid: 1000, operator: true }));
    }

    #[test]
    fn a_member_racing_an_operator_never_undoes_the_operators_budget() {
        for round in 0..200u64 {
            let s = Shared::in_memory("race");
            s.member_limit(0, 10, 1);
            let want = 1000 + round;
            std::thread::scope(|t| {
                t.spawn(|| {
                    for _ in 0..50 {
                        s.member_limit(0, 5, 2);
                    }
                });
                t.spawn(|| s.operator_set_limit(0, want, 3));
            });
            assert_eq!(s.devices[0].limit.load(SeqCst), want, "round {round}");
        }
    }
}
