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
    (1, 7, LOCK_BASE + id)
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
    // Another allocation's lock, or the same byte of another file, is not this one's.
    assert_eq!(s.sweep_exports(&|| Some(vec![lock(6), (2, 7, LOCK_BASE + 5)])), 200);
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
    assert_eq!(s.sweep_exports(&|| Some(vec![(1, 8, LOCK_BASE + 3)])), 0, "its second export is open");
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
    assert_eq!(parse_locks(t), vec![(1, 1025, LOCK_BASE + 5), (0x103 << 32 | 2, 9, LOCK_BASE + 14)]);
    assert!(proc_locks().is_some());
}

/// Imports are followed per allocation: an import of one ended exporter's memory keeps that memory
/// charged, not every ended exporter's; it goes when that import ends, or with its importer. An
/// import whose allocation the importer could not tell keeps every closed one (`orphans`).
#[test]
fn an_import_keeps_only_the_allocation_it_imported() {
    let s = Shared::in_memory("x");
    let (a, b, c) = (s.claim(1, 1, 0).unwrap(), s.claim(2, 1, 0).unwrap(), s.claim(3, 1, 0).unwrap());
    charge(&s, a, 100);
    charge(&s, b, 100);
    export(&s, a, 100, 1);
    export(&s, b, 100, 2);
    assert!(s.import_of(c, 1));
    end(&s, a);
    end_and_sweep(&s, b);
    assert_eq!(held(&s), 100, "b's memory, which nobody imports, came back");
    assert_eq!(s.kept_exports()[0], KeptBytes { open: 0, unsure: 0, imported: 100 });
    assert_eq!(s.import_of_ended(c, 1), 100, "the last import of a's memory ended");
    assert_eq!(held(&s), 0);
    // The importer ends holding its import: it goes with it.
    let (d, f) = (s.claim(4, 1, 0).unwrap(), s.claim(5, 1, 0).unwrap());
    charge(&s, d, 100);
    export(&s, d, 100, 3);
    assert!(s.import_of(f, 3));
    end_and_sweep(&s, d);
    assert_eq!(held(&s), 100);
    end(&s, f);
    assert_eq!(held(&s), 0);
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
/// then lists one range starting at 0, the sweep finds the export's lock gone and gives the memory
/// back while the fd is still open (importable). Cap bypass.
#[test]
#[ignore = "open (issue 23): the kernel merges an application's whole-file lock with the export's byte lock"]
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

/// The lock is matched by (device, inode, byte) only, not by open file description: a lock that
/// another, unrelated open of the same file holds on that byte counts as the export's. On the
/// NVIDIA driver the exported fd is (to our reading) a file of /dev/nvidiactl, one inode that every
/// process may open (0666): anyone can lock bytes `LOCK_BASE + 1..N` (ids are small and
/// sequential) and keep every ended exporter's memory charged for good (every group's ids start
/// at 1, so a live export of another group does the same by accident). Here a regular file, opened
/// twice, stands for it. False denial / DoS until `--drop-exports --open-too`.
#[test]
#[ignore = "open (issue 23): locks are matched by file and byte, not by open file description"]
fn attack23_a_lock_on_another_open_of_the_same_file_keeps_the_memory() {
    let s = Shared::in_memory("x");
    let path = std::env::temp_dir().join(format!("attack23-{}", std::process::id()));
    std::fs::write(&path, b"x").unwrap();
    let open = |p: &std::path::Path| std::os::fd::IntoRawFd::into_raw_fd(std::fs::File::open(p).unwrap());
    let (exported, outsider) = (open(&path), open(&path));
    let id = 1;
    export_real(&s, exported, id);
    assert!(lock_byte(outsider, LOCK_BASE + id), "an unrelated process's lock on the same byte");
    unsafe { libc::close(exported) };
    let moved = s.sweep_exports(&proc_locks);
    unsafe { libc::close(outsider) };
    let _ = std::fs::remove_file(&path);
    assert_eq!((moved, held(&s)), (200, 0), "no copy of the exported description is left: nobody can import it");
}

/// Import records share the 1024 records with exports: a job whose members import many of each
/// other's segments (8 ranks importing 20 segments from each of 7 peers: 1120 imports) fills them,
/// and an export made meanwhile is undecidable: after the whole job ended, with no fd and no
/// import left, its memory stays charged until an operator runs `--drop-exports`. False denial.
#[test]
#[ignore = "open (issue 23): import records can fill the 1024 records"]
fn attack23_imports_filling_the_records_leave_an_export_charged_after_everything_ended() {
    let s = Shared::in_memory("x");
    let (a, b) = (s.claim(1, 1, 0).unwrap(), s.claim(2, 1, 0).unwrap());
    for k in 0..RECORDS as u64 {
        assert!(s.import_of(b, 10_000 + k));
    }
    charge(&s, a, 200);
    s.exported(a, 0, 200);
    let recorded = s.record_export(a, 0, 200, 1, 7, 5, false);
    if !recorded {
        s.export_unsure(a, 5);
    }
    end(&s, b);
    end(&s, a);
    let moved = s.sweep_exports(&|| Some(Vec::<Lock>::new()));
    assert_eq!((recorded, moved, held(&s)), (true, 200, 0), "no fd and no import of it is left, no member runs");
}
