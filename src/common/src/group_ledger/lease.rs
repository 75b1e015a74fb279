//! Who measures the group's first context on a device (issue 24). A context's size is known
//! only once the driver has made it; a member reserves the largest size another member measured
//! there (`Device::context_bytes`) before making its own, so a context the budget cannot hold is
//! refused before the device holds it. Before anyone measured one, members starting together
//! would all make theirs unreserved, and the device would hold them all past the budget until
//! they were measured and undone. So the first one takes this lease, and the others wait for its
//! size while a live member holds it. A holder that dies gives it up with its slot (`reclaim`).

use super::shm::{SlotWord, State, Shared, holder_token};
use std::sync::atomic::Ordering::*;

impl Shared {
    /// Takes device entry `e`'s context lease for slot `i` unless another live member holds it.
    pub fn take_context_lease(&self, e: usize, i: usize) -> bool {
        let lease = &self.devices[e].context_lease;
        let me = holder_token(i, SlotWord::unpack(self.slots[i].word.load(Acquire)).generation);
        loop {
            let h = lease.load(Acquire);
            if h == me {
                return true;
            }
            if h != 0 && self.token_alive(h) {
                return false;
            }
            if lease.compare_exchange(h, me, AcqRel, Acquire).is_ok() {
                return true;
            }
        }
    }

    /// Gives device entry `e`'s context lease back if slot `i` holds it.
    pub fn drop_context_lease(&self, e: usize, i: usize) {
        let me = holder_token(i, SlotWord::unpack(self.slots[i].word.load(Acquire)).generation);
        let _ = self.devices[e].context_lease.compare_exchange(me, 0, AcqRel, Relaxed);
    }

    /// Every lease `token` holds goes (its slot is being emptied).
    pub(super) fn drop_context_leases(&self, token: u64) {
        for d in self.devices.iter() {
            let _ = d.context_lease.compare_exchange(token, 0, AcqRel, Relaxed);
        }
    }

    /// Whether the member `token` names still holds its slot.
    fn token_alive(&self, token: u64) -> bool {
        let j = (token & 0xffff_ffff) as usize;
        let Some(slot) = j.checked_sub(1).and_then(|j| self.slots.get(j)) else { return false };
        let w = SlotWord::unpack(slot.word.load(Acquire));
        w.state != State::Free && holder_token(j - 1, w.generation) == token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_live_member_holds_a_lease_and_it_goes_with_its_slot() {
        let s = Shared::in_memory("lease");
        let a = s.claim(101, 1, 0).unwrap();
        let b = s.claim(102, 1, 0).unwrap();
        assert!(s.take_context_lease(3, a));
        assert!(s.take_context_lease(3, a), "again: still ours");
        assert!(!s.take_context_lease(3, b), "a live member holds it");
        assert!(s.take_context_lease(4, b), "another device's is free");
        s.drop_context_lease(3, b);
        assert!(!s.take_context_lease(3, b), "b cannot give back a's lease");
        s.drop_context_lease(3, a);
        assert!(s.take_context_lease(3, b));
        // b dies holding both: emptying its slot gives them up.
        let w = s.slots[b].word.load(Acquire);
        s.reclaim(b, w, 103).unwrap();
        assert!(s.take_context_lease(3, a) && s.take_context_lease(4, a));
    }
}
