//! Reserve loans under `priority` (issue 25): unmet reserve that a member of higher priority took
//! from a lower one goes back to that lender when the borrower frees it (or dies), while the
//! lender lives, instead of to the common pool, where a member of the lender's own priority could
//! take it. docs/configuration.md: "no other member can take it (under priority, only a member of
//! strictly higher priority can)".
//!
//! The borrower keeps the record (`Slot::loan_key`/`loan_bytes`, at most [`LOANS`] lender and
//! device pairs; a loan beyond that is not recorded and comes back as before: as its lender
//! frees memory of its own). Repaying moves bytes from the borrower's charge into the lender's
//! unmet reserve: both are counted in `held`, so the group's total never moves and the budget
//! holds whatever order the steps run in. A step a kill interrupts leaves `held` too high
//! (stricter), never too low. Memory is fungible: a borrower's frees repay its loans first.

use super::shm::{LOANS, Shared, SlotWord, State, sub_saturating};
use std::sync::atomic::Ordering::*;

/// The record of a loan from slot `j` (of generation `generation`) on device entry `e`; never 0.
fn key(j: usize, generation: u32, e: usize) -> u64 {
    ((generation as u64) << 32) | ((e as u64) << 16) | (j as u64 + 1)
}

fn lender(key: u64) -> (usize, u32, usize) {
    (((key & 0xffff) - 1) as usize, (key >> 32) as u32, ((key >> 16) & 0xffff) as usize)
}

impl Shared {
    /// Records that slot `i` took `pieces` (lender slot, bytes) of unmet reserve on entry `e`
    /// for a request it was granted.
    #[cold]
    pub(super) fn lend(&self, i: usize, e: usize, pieces: &[(usize, u64)]) {
        let s = &self.slots[i];
        // The flag first: a kill before the record leaves a flag with nothing behind it.
        s.loans_on.fetch_or(1 << e, AcqRel);
        for &(j, bytes) in pieces {
            let w = SlotWord::unpack(self.slots[j].word.load(Acquire));
            if w.state != State::Live {
                continue; // gone already: nothing to give back to
            }
            let k = key(j, w.generation, e);
            let at = (0..LOANS).find(|&n| s.loan_key[n].load(Acquire) == k).or_else(|| {
                (0..LOANS).find(|&n| s.loan_key[n].load(Acquire) == 0 && s.loan_bytes[n].load(Acquire) == 0)
            });
            if let Some(n) = at {
                s.loan_bytes[n].fetch_add(bytes, AcqRel);
                s.loan_key[n].store(k, Release);
            }
        }
    }

    /// Slot `i` gives back up to `freed` bytes of what it borrowed on entry `e` (it freed them,
    /// or died holding them); returns the bytes its lenders took into their unmet reserves
    /// (they stay in `held`). The rest of `freed` is the caller's to give back. Only slot `i`
    /// itself, or whoever empties its slot, calls this.
    #[cold]
    pub(super) fn repay(&self, i: usize, e: usize, freed: u64) -> u64 {
        let s = &self.slots[i];
        let (mut left, mut kept, mut open) = (freed, 0, false);
        for n in 0..LOANS {
            let k = s.loan_key[n].load(Acquire);
            if k == 0 || lender(k).2 != e {
                continue;
            }
            if left > 0 {
                let t = sub_saturating(&s.loan_bytes[n], left);
                left -= t;
                kept += self.give_to_lender(k, t);
            }
            if s.loan_bytes[n].load(Acquire) == 0 {
                s.loan_key[n].store(0, Release);
            } else {
                open = true;
            }
        }
        if !open {
            s.loans_on.fetch_and(!(1 << e), AcqRel);
        }
        kept
    }

    /// Puts `bytes` back into the unmet reserve of the lender `k` names, if it still lives, up
    /// to its reserve less what it holds (it may have filled its reserve again by freeing memory
    /// of its own); returns what it took.
    fn give_to_lender(&self, k: u64, bytes: u64) -> u64 {
        let (j, generation, e) = lender(k);
        let Some(o) = self.slots.get(j) else { return 0 };
        let w = SlotWord::unpack(o.word.load(Acquire));
        if bytes == 0 || w.state != State::Live || w.generation != generation {
            return 0;
        }
        let cap = o.reserve[e].load(Acquire).saturating_sub(o.charge[e].load(Acquire));
        super::admit::give_unmet(&self.devices[e], &o.unmet[e], bytes, cap)
    }

    /// Drops every loan record of slot `i` (its slot is being emptied: what was still out was
    /// repaid from its charges or is gone with its lender).
    pub(super) fn forget_loans(&self, i: usize) {
        let s = &self.slots[i];
        for n in 0..LOANS {
            s.loan_bytes[n].store(0, Release);
            s.loan_key[n].store(0, Release);
        }
        s.loans_on.store(0, Release);
    }

    /// Bytes slot `i` still owes its lenders on entry `e` (tests, tools).
    pub fn borrowed(&self, i: usize, e: usize) -> u64 {
        let s = &self.slots[i];
        (0..LOANS)
            .filter(|&n| matches!(s.loan_key[n].load(Acquire), k if k != 0 && lender(k).2 == e))
            .map(|n| s.loan_bytes[n].load(Acquire))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_are_never_zero() {
        for (j, g, e) in [(0, 0, 0), (1023, 0x3fff_ffff, 63), (7, 1, 5)] {
            let k = key(j, g, e);
            assert_ne!(k, 0);
            assert_eq!(lender(k), (j, g, e));
        }
    }
}
