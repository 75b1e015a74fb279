use super::*;

fn held(s: &Shared) -> u64 {
    s.devices[0].held.load(SeqCst)
}

fn charge(s: &Shared, i: usize, b: u64) {
    s.slots[i].charge[0].fetch_add(b, SeqCst);
    s.devices[0].held.fetch_add(b, SeqCst);
}

/// Member `i` exports `b` bytes of its charge as allocation `id` (file 1:7).
fn export(s: &Shared, i: usize, b: u64, id: u64) {
    s.exported(i, 0, b);
    assert!(s.record_export(i, 0, b, 1, 7, id, false));
}

fn end(s: &Shared, i: usize) {
    assert!(s.reclaim(i, s.slots[i].word.load(SeqCst), 9).is_some());
}

/// Member `i` ends, and the group looks at the locks: none is held (every fd closed).
fn end_and_sweep(s: &Shared, i: usize) -> Option<u64> {
    let r = s.reclaim(i, s.slots[i].word.load(SeqCst), 9);
    s.sweep_exports(&|| Some(Vec::<Lock>::new()));
    r
}

fn lock(id: u64) -> Lock {
    (1, 7, LOCK_BASE + id, LOCK_BASE + id)
}

/// An ended exporter's memory stays the group's while its lock is listed (an fd of it open
/// somewhere, imported or not), and comes back once it is gone: the charge is not kept for good.
#[test]
fn an_ended_exporters_memory_comes_back_when_no_fd_of_it_is_left() {
    let s = Shared::in_memory("x");
    let a = s.claim(1, 1, 0).unwrap();
    charge(&s, a, 300);
    export(&s, a, 200, 5);
    end(&s, a);
    assert_eq!(held(&s), 200, "the exported bytes stay with the exporter gone");
    assert_eq!(s.sweep_exports(&|| Some(vec![lock(5)])), 0);
    assert_eq!(held(&s), 200, "an fd of it is still open");
    assert_eq!(s.kept_exports()[0], KeptBytes { open: 200, unsure: 0, imported: 0 });
    assert_eq!(s.sweep_exports(&|| None), 0, "unreadable locks decide nothing");
    // The same byte on another file keeps it (an import's lock, a re-export's), and so does a
    // range covering it on its own file (an application's whole-file lock merged with ours).
    assert_eq!(s.sweep_exports(&|| Some(vec![(2, 7, LOCK_BASE + 5, LOCK_BASE + 5)])), 0);
    assert_eq!(s.sweep_exports(&|| Some(vec![(1, 7, 0, u64::MAX)])), 0);
    // Another allocation's lock, or an unrelated file's lock starting below our bytes, does not.
    assert_eq!(s.sweep_exports(&|| Some(vec![lock(6), (2, 7, 0, u64::MAX), (2, 8, 5, LOCK_BASE + 4)])), 200);
    assert_eq!((held(&s), s.kept_exports()[0]), (0, KeptBytes::default()));
}

/// Several exports of one allocation (one id): kept while any of their locks is listed, even one
/// a live member holds records of; and a record never gives back more than its member kept.
#[test]
fn an_allocation_goes_only_when_every_export_of_it_is_closed() {
    let s = Shared::in_memory("x");
    let (a, b) = (s.claim(1, 1, 0).unwrap(), s.claim(2, 1, 0).unwrap());
    charge(&s, a, 100);
    s.exported(a, 0, 100);
    assert!(s.record_export(a, 0, 100, 1, 7, 3, false));
    assert!(s.record_export(a, 0, 0, 1, 8, 3, false));
    assert!(s.record_export(b, 0, 0, 1, 9, 3, false));
    end(&s, a);
    assert_eq!(s.sweep_exports(&|| Some(vec![])), 0, "a live member still has a record of it");
    end(&s, b);
    assert_eq!(s.sweep_exports(&|| Some(vec![(1, 8, LOCK_BASE + 3, LOCK_BASE + 3)])), 0, "its second export is open");
    assert_eq!(s.sweep_exports(&|| Some(vec![])), 100);
    assert_eq!(held(&s), 0);
    // Charged 50 (another member holds 70 more), records say 80: only 50 were kept, only 50 go.
    let (c, d) = (s.claim(3, 1, 0).unwrap(), s.claim(4, 1, 0).unwrap());
    charge(&s, c, 50);
    charge(&s, d, 70);
    s.exported(c, 0, 80);
    assert!(s.record_export(c, 0, 80, 1, 7, 4, false));
    end_and_sweep(&s, c);
    assert_eq!(held(&s), 70, "the other member's charge is untouched");
}

/// What cannot be watched stays charged, is shown, and goes only when an operator drops it.
#[test]
fn an_export_that_cannot_be_watched_stays_until_an_operator_drops_it() {
    let s = Shared::in_memory("x");
    let a = s.claim(1, 1, 0).unwrap();
    charge(&s, a, 300);
    // Not recorded at all (60), and an allocation one of whose exports could not be watched (100).
    s.exported(a, 0, 60);
    export(&s, a, 100, 2);
    s.export_unsure(a, 2);
    // One whose fd is still open (40).
    export(&s, a, 40, 3);
    end(&s, a);
    s.sweep_exports(&|| Some(vec![lock(3)]));
    assert_eq!(held(&s), 200);
    assert_eq!(s.kept_exports()[0], KeptBytes { open: 40, unsure: 160, imported: 0 });
    assert_eq!(s.drop_exports(false)[0], 160, "the undecidable ones");
    assert_eq!((held(&s), s.kept_exports()[0]), (40, KeptBytes { open: 40, unsure: 0, imported: 0 }));
    assert_eq!(s.drop_exports(true)[0], 40, "and, asked, the open ones");
    assert_eq!(held(&s), 0);
}

/// A record not finished when its member died is freed with it; its bytes are unsure.
#[test]
fn a_record_its_member_did_not_finish_is_undecidable() {
    let s = Shared::in_memory("x");
    let a = s.claim(1, 1, 0).unwrap();
    charge(&s, a, 100);
    s.exported(a, 0, 100);
    let token = holder_token(a, SlotWord::unpack(s.slots[a].word.load(SeqCst)).generation);
    s.kept.records[0].owner.store(token | WRITING, SeqCst);
    end(&s, a);
    assert_eq!(s.kept.records[0].owner.load(SeqCst), 0);
    assert_eq!(s.kept_exports()[0].unsure, 100);
}

#[test]
fn proc_locks_lines_are_read() {
    let t = "1: POSIX  ADVISORY  WRITE 12 00:1a:33 1099511627776 1099511627776\n\
             2: OFDLCK ADVISORY  READ -1 00:01:1025 1099511627781 1099511627781\n\
             2: -> OFDLCK ADVISORY  WRITE -1 00:01:1025 1099511627781 1099511627781\n\
             3: OFDLCK ADVISORY  READ -1 fd:0a:77 0 EOF\n\
             4: OFDLCK ADVISORY  READ -1 103:2:9 1099511627790 1099511627790\n";
    assert_eq!(
        parse_locks(t),
        vec![(1, 1025, LOCK_BASE + 5, LOCK_BASE + 5), (0xfd << 32 | 0xa, 77, 0, u64::MAX), (0x103 << 32 | 2, 9, LOCK_BASE + 14, LOCK_BASE + 14)]
    );
    assert!(proc_locks().is_some());
}

/// Imports are locks (on the importer's own memfd, any file): an import of one ended exporter's
/// memory keeps that memory charged, not every ended exporter's; it goes when that lock goes. An
/// import whose allocation the importer could not tell keeps every closed one (`orphans`).
#[test]
fn an_import_keeps_only_the_allocation_it_imported() {
    let s = Shared::in_memory("x");
    let (a, b) = (s.claim(1, 1, 0).unwrap(), s.claim(2, 1, 0).unwrap());
    charge(&s, a, 100);
    charge(&s, b, 100);
    export(&s, a, 100, 1);
    export(&s, b, 100, 2);
    let import = (9, 9, LOCK_BASE + 1, LOCK_BASE + 1);
    end(&s, a);
    end(&s, b);
    assert_eq!(s.sweep_exports(&|| Some(vec![import])), 100);
    assert_eq!(held(&s), 100, "b's memory, which nobody imports, came back");
    assert_eq!(s.kept_exports()[0], KeptBytes { open: 100, unsure: 0, imported: 0 });
    assert_eq!(s.sweep_exports(&|| Some(vec![])), 100, "the import's lock is gone");
    assert_eq!(held(&s), 0);
    // A reading that skips a lock (the kernel's list printed a page at a time) decides nothing
    // when the other reading shows it.
    let d = s.claim(4, 1, 0).unwrap();
    charge(&s, d, 100);
    export(&s, d, 100, 3);
    end(&s, d);
    let readings = std::sync::atomic::AtomicU32::new(0);
    let torn = || Some(if readings.fetch_add(1, SeqCst) == 0 { vec![] } else { vec![(9, 9, LOCK_BASE + 3, LOCK_BASE + 3)] });
    assert_eq!(s.sweep_exports(&torn), 0);
    assert_eq!((held(&s), readings.load(SeqCst)), (100, 2));
    assert_eq!(s.sweep_exports(&|| Some(vec![])), 100);
    // An import of unknown origin keeps every closed allocation until it ends.
    let (g, h) = (s.claim(6, 1, 0).unwrap(), s.claim(7, 1, 0).unwrap());
    charge(&s, g, 100);
    export(&s, g, 100, 4);
    s.import_began(h);
    end_and_sweep(&s, g);
    assert_eq!(held(&s), 100);
    s.import_ended(h);
    assert_eq!(held(&s), 0);
}

/// A reading that fails (a torn list that skipped our own probe) is tried again, not taken for
/// "undecidable": the sweep decides from two good readings; with fewer it decides nothing.
#[test]
fn a_failed_reading_is_tried_again() {
    let s = Shared::in_memory("x");
    let a = s.claim(1, 1, 0).unwrap();
    charge(&s, a, 100);
    export(&s, a, 100, 3);
    end(&s, a);
    let tries = std::sync::atomic::AtomicU32::new(0);
    let once_good = || (tries.fetch_add(1, SeqCst) == 2).then(Vec::new);
    assert_eq!(s.sweep_exports(&once_good), 0, "one good reading of six decides nothing");
    assert_eq!((held(&s), tries.load(SeqCst)), (100, 6));
    tries.store(0, SeqCst);
    let first_fails = || (tries.fetch_add(1, SeqCst) > 0).then(Vec::new);
    assert_eq!(s.sweep_exports(&first_fails), 100);
    assert_eq!((held(&s), tries.load(SeqCst)), (0, 3));
}

/// Ids are scrambled with the group's seed: distinct within a group, and two groups' first
/// exports (every lock of the machine is in one list) do not share a byte.
#[test]
fn ids_differ_within_a_group_and_between_groups() {
    let (g, h) = (Shared::in_memory("g"), Shared::in_memory("h"));
    let mine: std::collections::HashSet<u64> = (0..10_000).map(|_| g.new_export_id()).collect();
    assert_eq!(mine.len(), 10_000);
    assert!(mine.iter().all(|&id| id != 0 && id < LOCK_BASE));
    let theirs: std::collections::HashSet<u64> = (0..10_000).map(|_| h.new_export_id()).collect();
    assert_eq!(mine.intersection(&theirs).count(), 0, "seeds {:#x} {:#x}", g.kept.seed.load(SeqCst), h.kept.seed.load(SeqCst));
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
    assert_eq!(end_and_sweep(&s, a), Some(50));
    assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (200, 200), "the exported bytes stay");
    s.import_ended(b);
    assert_eq!((held(&s), s.orphans[0].load(SeqCst)), (0, 0), "the last import gave them back");
    // No importer: the export goes with its exporter.
    let a = s.claim(3, 1, 0).unwrap();
    charge(&s, a, 100);
    export(&s, a, 100, 2);
    assert_eq!(end_and_sweep(&s, a), Some(0));
    assert_eq!(held(&s), 0);
    // The importer dies: reclaiming it gives the exported bytes back.
    let (a, c) = (s.claim(4, 1, 0).unwrap(), s.claim(5, 1, 0).unwrap());
    charge(&s, a, 100);
    export(&s, a, 100, 3);
    s.import_began(c);
    end_and_sweep(&s, a);
    assert_eq!(held(&s), 100);
    end_and_sweep(&s, c);
    assert_eq!((held(&s), s.orphans[0].load(SeqCst), s.imports_held()), (0, 0, 0));
}

// ---- attack23: real kernel locks, the sweep as `reclaim_in` runs it (`proc_locks`) ----

/// An OFD lock on `fd` of `kind` over [start, start+len) (len 0: to the end of the file).
fn ofd(fd: i32, kind: i32, start: i64, len: i64) -> bool {
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as i16;
    l.l_whence = libc::SEEK_SET as i16;
    l.l_start = start;
    l.l_len = len;
    unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &l) == 0 }
}

/// A member exports 200 bytes as allocation `id` on `fd` (locked and recorded as `watch` does),
/// and ends: the group keeps 200.
fn export_real(s: &Shared, fd: i32, id: u64) -> usize {
    let a = s.claim(1, 1, 0).unwrap();
    charge(s, a, 200);
    assert!(lock_byte(fd, LOCK_BASE + id));
    let file = fd_locks(fd).unwrap().into_iter().find(|l| l.2 == LOCK_BASE + id).unwrap();
    s.exported(a, 0, 200);
    assert!(s.record_export(a, 0, 200, file.0, file.1, id, false));
    end(s, a);
    assert_eq!(held(s), 200);
    a
}

/// The application takes a whole-file OFD read lock on its own exported fd (any OFD lock of the
/// same type covering or touching byte `LOCK_BASE + id` merges with vramcap's): `/proc/locks`
/// then lists one range starting at 0, which still covers the byte on the exported file: kept.
#[test]
fn attack23_a_whole_file_read_lock_on_the_exported_fd_hides_the_export() {
    let s = Shared::in_memory("x");
    let fd = unsafe { libc::memfd_create(c"attack23-merge".as_ptr(), 0) };
    let id = 3_000_000 + std::process::id() as u64;
    export_real(&s, fd, id);
    assert!(ofd(fd, libc::F_RDLCK, 0, 0), "the application's own whole-file read lock");
    let moved = s.sweep_exports(&proc_locks);
    let open = unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1;
    unsafe { libc::close(fd) };
    assert!(open);
    assert_eq!((moved, held(&s)), (0, 200), "the exported fd is still open: its memory can still be imported");
}

/// Any holder of a copy of the exported fd (the application, a process it sent the fd to) can
/// drop the lock with `F_OFD_SETLK F_UNLCK` and keep the fd: the sweep gives the memory back while
/// the fd can still be imported. Cap bypass by the holder of an fd.
#[test]
#[ignore = "documented limit (issue 23): a raw unlock outside a preloaded process; in one, intercept::fcntl keeps the lock (tests/group/exported_unlock.rs)"]
fn attack23_unlocking_the_exported_fd_gives_the_memory_back_while_it_is_open() {
    let s = Shared::in_memory("x");
    let fd = unsafe { libc::memfd_create(c"attack23-unlock".as_ptr(), 0) };
    let id = 4_000_000 + std::process::id() as u64;
    export_real(&s, fd, id);
    assert!(ofd(fd, libc::F_UNLCK, 0, 0));
    let moved = s.sweep_exports(&proc_locks);
    unsafe { libc::close(fd) };
    assert_eq!((moved, held(&s)), (0, 200), "the exported fd is still open: its memory can still be imported");
}

/// Locks cannot tell open file descriptions apart: a lock another process takes on the byte (it
/// read it from `/proc/locks`, which every user may read) keeps the memory as an import would.
/// That fails closed: the group keeps memory that is free, until an operator drops it (`vramcap
/// limit --group NAME --drop-exports --open-too`), which this checks. (By accident it cannot
/// happen: ids are scrambled per group, `ids_differ_within_a_group_and_between_groups`.)
#[test]
fn a_forged_lock_keeps_the_memory_until_an_operator_drops_it() {
    let s = Shared::in_memory("x");
    let path = std::env::temp_dir().join(format!("attack23-{}", std::process::id()));
    std::fs::write(&path, b"x").unwrap();
    let open = |p: &std::path::Path| std::os::fd::IntoRawFd::into_raw_fd(std::fs::File::open(p).unwrap());
    let (exported, outsider) = (open(&path), open(&path));
    let id = s.new_export_id();
    export_real(&s, exported, id);
    assert!(lock_byte(outsider, LOCK_BASE + id), "an unrelated process's lock on the same byte");
    unsafe { libc::close(exported) };
    let moved = s.sweep_exports(&proc_locks);
    assert_eq!((moved, held(&s)), (0, 200), "a lock on the byte is taken for an import");
    assert_eq!(s.drop_exports(true)[0], 200);
    unsafe { libc::close(outsider) };
    let _ = std::fs::remove_file(&path);
    assert_eq!(held(&s), 0);
}

/// An importer's lock is on a memfd of its own: it keeps the allocation after every copy of the
/// exported fd is closed, and the allocation goes with it. (Imports take no ledger records: any
/// number of them leaves every record to exports.)
#[test]
fn an_importers_own_lock_keeps_the_memory_after_the_fd_is_closed() {
    let s = Shared::in_memory("x");
    let fd = unsafe { libc::memfd_create(c"attack23-export".as_ptr(), 0) };
    let keeper = unsafe { libc::memfd_create(c"attack23-import".as_ptr(), 0) };
    let id = s.new_export_id();
    export_real(&s, fd, id);
    assert!(lock_byte(keeper, LOCK_BASE + id), "the importer shows its import before its driver call");
    unsafe { libc::close(fd) };
    assert_eq!((s.sweep_exports(&proc_locks), held(&s)), (0, 200), "imported: kept");
    assert!(unlock_byte(keeper, LOCK_BASE + id), "the import ended");
    assert_eq!((s.sweep_exports(&proc_locks), held(&s)), (200, 0));
    unsafe { libc::close(keeper) };
}

/// A lock that stays is seen while another program's locks come and go: `/proc/locks` used to be
/// read with small reads (`read_to_string` starts with 32 bytes), each one restarting the kernel's
/// listing from a position that the other program's lock and unlock shifted, and an export whose
/// fd stayed open was found closed and given back in about half of 50 sweeps (a cap bypass,
/// found by the sweep benchmark).
#[test]
fn a_lock_that_stays_is_seen_while_other_locks_come_and_go() {
    let db = unsafe { libc::memfd_create(c"churn-db".as_ptr(), 0) };
    for k in 0..10 {
        assert!(ofd(db, libc::F_RDLCK, 2 * k, 1));
    }
    let s = Shared::in_memory("x");
    let fd = unsafe { libc::memfd_create(c"churn-export".as_ptr(), 0) };
    export_real(&s, fd, s.new_export_id());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let moved = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(SeqCst) {
                ofd(db, libc::F_RDLCK, 1 << 30, 1);
                ofd(db, libc::F_UNLCK, 1 << 30, 1);
            }
        });
        let moved: u64 = (0..300).map(|_| s.sweep_exports(&proc_locks)).sum();
        stop.store(true, SeqCst);
        moved
    });
    unsafe { libc::close(fd) };
    unsafe { libc::close(db) };
    assert_eq!((moved, held(&s)), (0, 200), "the export's fd is open all along");
}

/// `scripts/bench-sweep`: what one sweep's reading of `/proc/locks` costs with `n` unrelated
/// locks listed (a database's byte-range locks) while an ended export's fd stays open (a sweep
/// runs before every denial), and how long another program's lock+unlock waits meanwhile.
/// Prints numbers; asserts nothing about time.
#[test]
#[ignore = "benchmark: run by scripts/bench-sweep"]
fn bench_sweep() {
    let n: i64 = std::env::var("BENCH_LOCKS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    let db = unsafe { libc::memfd_create(c"bench-sweep-db".as_ptr(), 0) };
    for k in 0..n {
        assert!(ofd(db, libc::F_RDLCK, 2 * k, 1));
    }
    let s = Shared::in_memory("x");
    let fd = unsafe { libc::memfd_create(c"bench-sweep-export".as_ptr(), 0) };
    export_real(&s, fd, s.new_export_id());
    const SWEEPS: u32 = 50;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (per_sweep, worst) = std::thread::scope(|sc| {
        let other = sc.spawn(|| {
            let mut worst = std::time::Duration::ZERO;
            while !stop.load(SeqCst) {
                let t = std::time::Instant::now();
                ofd(db, libc::F_RDLCK, 1 << 30, 1);
                ofd(db, libc::F_UNLCK, 1 << 30, 1);
                worst = worst.max(t.elapsed());
            }
            worst
        });
        let t = std::time::Instant::now();
        let mut moved = 0;
        for _ in 0..SWEEPS {
            moved += s.sweep_exports(&proc_locks);
        }
        let per = t.elapsed() / SWEEPS;
        stop.store(true, SeqCst);
        assert_eq!(moved, 0, "the export's fd is open");
        (per, other.join().unwrap())
    });
    println!("{n} locks listed: one sweep {per_sweep:?}; another program's slowest lock+unlock meanwhile {worst:?}");
    unsafe { libc::close(fd) };
    unsafe { libc::close(db) };
}
