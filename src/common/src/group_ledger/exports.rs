//! Exported VMM memory outliving its exporter (issue 23): a member that exported memory as a
//! shareable handle (`cuMemExportToShareableHandle`) marks those bytes of its charge
//! (`Slot::exported`); a member holding a handle imported from another process counts it
//! (`Slot::imports`). When a member ends ([`Shared::reclaim`]) its exported bytes stay in `held`
//! as the group's (`Shared::orphans`) while any member holds an import, since the importer's
//! mapping keeps the memory alive and the driver does not say which export an import came from;
//! they go back when no member holds one. That holds only for exports whose every fd is closed,
//! which the member settles at exit (`SETTLED`, preload `intercept::shareable`); an export whose fd
//! may still be open (sent, not yet imported), or any export of a member that ended unsettled,
//! stays in `held` for good ([`Shared::kept_for_good`]): any process may import it later.

use super::shm::{DEVICES, SETTLED, Shared, SlotWord, State, sub_saturating};
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

    /// Bytes of member `i`'s charge on entry `e` it exported (0: one more export of memory already
    /// marked). Any export unsettles the member's exports: its fd is open.
    pub fn exported(&self, i: usize, e: usize, bytes: u64) {
        self.slots[i].exported[e].fetch_add(bytes, AcqRel);
        self.slots[i].flags.fetch_and(!SETTLED, AcqRel);
    }

    /// Member `i` is settling its exports at exit: set before it looks at them, so that an export
    /// made meanwhile (which clears it) leaves them unsettled.
    pub fn exports_settling(&self, i: usize) {
        self.slots[i].flags.fetch_or(SETTLED, AcqRel);
    }

    /// `bytes` of member `i`'s exported charge on entry `e` have an fd open somewhere as it ends:
    /// any process may import them later, and nothing will say when they go. They leave the
    /// member's charge and stay in `held` for good (stricter, never looser: like a leak).
    pub fn kept_for_good(&self, i: usize, e: usize, bytes: u64) {
        let s = &self.slots[i];
        let b = sub_saturating(&s.exported[e], bytes);
        sub_saturating(&s.charge[e], b);
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

    fn held(s: &Shared) -> u64 {
        s.devices[0].held.load(SeqCst)
    }

    fn charge(s: &Shared, i: usize, b: u64) {
        s.slots[i].charge[0].fetch_add(b, SeqCst);
        s.devices[0].held.fetch_add(b, SeqCst);
    }

    fn end(s: &Shared, i: usize) -> Option<u64> {
        s.reclaim(i, s.slots[i].word.load(SeqCst), 9)
    }

    /// An exporter that settled its exports (no fd open) and ends while another member maps its
    /// memory: the bytes stay the group's until the last import ends, wherever it ends (released,
    /// or its member reclaimed).
    #[test]
    fn exported_memory_outlives_its_exporter_while_imports_hold_it() {
        let s = Shared::in_memory("x");
        // Exporter a (200 exported, 50 not), importer b.
        let (a, b) = (s.claim(1, 1, 0).unwrap(), s.claim(2, 1, 0).unwrap());
        charge(&s, a, 250);
        s.exported(a, 0, 200);
        s.import_began(b);
        s.exports_settling(a);
        assert_eq!(end(&s, a), Some(50));
        assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (200, 200), "the exported bytes stay");
        s.import_ended(b);
        assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (0, 0), "the last import gave them back");
        // No importer: the export goes with its exporter.
        let a = s.claim(3, 1, 0).unwrap();
        charge(&s, a, 100);
        s.exported(a, 0, 100);
        s.exports_settling(a);
        assert_eq!(end(&s, a), Some(100));
        assert_eq!(held(&s), 0);
        // The importer dies: reclaiming it gives the exported bytes back.
        let (a, c) = (s.claim(4, 1, 0).unwrap(), s.claim(5, 1, 0).unwrap());
        charge(&s, a, 100);
        s.exported(a, 0, 100);
        s.import_began(c);
        s.exports_settling(a);
        end(&s, a);
        assert_eq!(held(&s), 100);
        end(&s, c);
        assert_eq!((held(&s), s.orphans[0].load(SeqCst), s.imports_held()), (0, 0, 0));
    }

    /// An exported fd that may still be open when its exporter ends (sent and not yet imported,
    /// left in a child, or the exporter killed before it could look) keeps the bytes the group's
    /// for good, importers or not: any process may import it later.
    #[test]
    fn an_export_that_may_still_be_open_stays_charged_for_good() {
        let s = Shared::in_memory("x");
        // Settled, one export still open (kept for good), one closed.
        let a = s.claim(1, 1, 0).unwrap();
        charge(&s, a, 300);
        s.exported(a, 0, 200);
        s.exports_settling(a);
        s.kept_for_good(a, 0, 120);
        assert_eq!(end(&s, a), Some(180), "the export whose fd is closed went with its exporter");
        assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (120, 0));
        // Killed before settling: all it exported stays, with no import anywhere.
        let b = s.claim(2, 1, 0).unwrap();
        charge(&s, b, 100);
        s.exported(b, 0, 60);
        assert_eq!(end(&s, b), Some(40));
        assert_eq!(held(&s), 180);
        // An export made while it settles unsettles it.
        let c = s.claim(3, 1, 0).unwrap();
        charge(&s, c, 10);
        s.exports_settling(c);
        s.exported(c, 0, 10);
        assert_eq!(end(&s, c), Some(0));
        assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (190, 0), "never given back by imports ending");
        s.release_orphans();
        assert_eq!(held(&s), 190);
    }
}
