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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group_ledger::kept::Lock;

    fn held(s: &Shared) -> u64 {
        s.devices[0].held.load(SeqCst)
    }

    fn charge(s: &Shared, i: usize, b: u64) {
        s.slots[i].charge[0].fetch_add(b, SeqCst);
        s.devices[0].held.fetch_add(b, SeqCst);
    }

    /// Member `i` ends, and the group looks at the locks: none is held (every fd closed).
    fn end(s: &Shared, i: usize) -> Option<u64> {
        let r = s.reclaim(i, s.slots[i].word.load(SeqCst), 9);
        s.sweep_exports(&|| Some(Vec::<Lock>::new()));
        r
    }

    /// An exported allocation of `b` bytes by member `i`, recorded with id `id`.
    fn export(s: &Shared, i: usize, b: u64, id: u64) {
        s.exported(i, 0, b);
        assert!(s.record_export(i, 0, b, 1, 7, id, false));
    }

    /// An exporter whose fd is closed everywhere ends while another member maps its memory: the
    /// bytes stay the group's until the last import ends, wherever it ends (released, or its
    /// member reclaimed).
    #[test]
    fn exported_memory_outlives_its_exporter_while_imports_hold_it() {
        let s = Shared::in_memory("x");
        // Exporter a (200 exported, 50 not), importer b.
        let (a, b) = (s.claim(1, 1, 0).unwrap(), s.claim(2, 1, 0).unwrap());
        charge(&s, a, 250);
        export(&s, a, 200, 1);
        s.import_began(b);
        assert_eq!(end(&s, a), Some(50));
        assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (200, 200), "the exported bytes stay");
        s.import_ended(b);
        assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (0, 0), "the last import gave them back");
        // No importer: the export goes with its exporter.
        let a = s.claim(3, 1, 0).unwrap();
        charge(&s, a, 100);
        export(&s, a, 100, 2);
        assert_eq!(end(&s, a), Some(0));
        assert_eq!(held(&s), 0);
        // The importer dies: reclaiming it gives the exported bytes back.
        let (a, c) = (s.claim(4, 1, 0).unwrap(), s.claim(5, 1, 0).unwrap());
        charge(&s, a, 100);
        export(&s, a, 100, 3);
        s.import_began(c);
        end(&s, a);
        assert_eq!(held(&s), 100);
        end(&s, c);
        assert_eq!((held(&s), s.orphans[0].load(SeqCst), s.imports_held()), (0, 0, 0));
    }
}
