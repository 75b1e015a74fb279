//! Exported VMM memory outliving its exporter (issue 23): a member that exported memory as a
//! shareable handle (`cuMemExportToShareableHandle`) marks those bytes of its charge
//! (`Slot::exported`); a member holding a handle imported from another process counts it
//! (`Slot::imports`). When a member ends ([`Shared::reclaim`]) its exported bytes stay in `held`
//! as the group's (`Shared::orphans`) while any member holds an import, since the importer's
//! mapping keeps the memory alive and the driver does not say which export an import came from;
//! they go back when no member holds one. An ended member's exported bytes get there only once no
//! open file description of their export is left anywhere (an fd still open may be imported
//! later): until then they are kept by the group's export records ([`super::kept`]).

use super::shm::{DEVICES, Shared, SlotWord, State, sub_saturating};
use std::sync::atomic::Ordering::*;

impl Shared {
    /// Shareable handles imported from other processes that members (live, or dead and not yet
    /// reclaimed) hold.
    pub fn imports_held(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| SlotWord::unpack(s.word.load(SeqCst)).state != State::Free)
            .map(|s| s.imports.load(SeqCst))
            .sum()
    }

    /// Member `i` now holds one more imported shareable handle.
    pub fn import_began(&self, i: usize) {
        self.slots[i].imports.fetch_add(1, SeqCst);
    }

    /// Member `i` holds one imported shareable handle fewer (its last reference released and its
    /// last mapping unmapped): exported memory of ended members goes back if that was the last.
    pub fn import_ended(&self, i: usize) {
        let n = &self.slots[i].imports;
        let mut cur = n.load(SeqCst);
        while cur > 0 {
            match n.compare_exchange_weak(cur, cur - 1, SeqCst, SeqCst) {
                Ok(_) => break,
                Err(a) => cur = a,
            }
        }
        self.release_orphans();
    }

    /// Bytes of member `i`'s charge on entry `e` it exported (they outlive it while an fd of them
    /// is open or an import holds them).
    pub fn exported(&self, i: usize, e: usize, bytes: u64) {
        self.slots[i].exported[e].fetch_add(bytes, AcqRel);
    }

    /// Gives back the exported memory of ended members if no member holds an import. Both sides
    /// write, then read the other's word (SeqCst): an exporter ending while the last import ends
    /// is seen by one of them, so nothing stays kept for nobody. Returns the bytes given back.
    pub fn release_orphans(&self) -> u64 {
        if self.imports_held() > 0 {
            return 0;
        }
        let mut total = 0;
        for e in 0..DEVICES {
            let b = self.orphans[e].swap(0, SeqCst);
            if b > 0 {
                sub_saturating(&self.devices[e].held, b);
                total += b;
            }
        }
        total
    }
}
