//! The group ledger a process finds in VRAMCAP_GROUP_DIR may be anything: truncated, another
//! program's file, an older layout, or corrupted by a crash or a hostile member. The input is the
//! file's beginning (header and the first device entries and slots, the rest zeros; a leading
//! byte picks a short, exact or long file). `file::open_existing` must refuse what it cannot use
//! and everything done on a ledger it accepts (device entries, reserve/charge/uncharge, dead
//! member reclaim, name) must not crash, whatever the counters say. Also `/proc/<pid>/stat`
//! parsing, which decides whether a member is dead.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vramcap_fuzz::group::{file, kept, shm};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, body)) = data.split_first() else { return };
    let _ = file::parse_stat(&String::from_utf8_lossy(body));
    let len = match mode % 4 {
        0 => body.len(),
        1 => shm::LAYOUT_BYTES - 1,
        _ => shm::LAYOUT_BYTES + (mode as usize >> 2),
    };
    let mut bytes = vec![0u8; len];
    let n = body.len().min(len);
    bytes[..n].copy_from_slice(&body[..n]);
    if mode & 2 != 0 && len >= 16 {
        // Often keep the header valid so the fuzzer explores what follows it.
        let fresh = shm_header();
        bytes[..fresh.len()].copy_from_slice(fresh);
    }
    let p = vramcap_fuzz::scratch_dir().join("ledger");
    std::fs::write(&p, &bytes).unwrap();
    let m = match file::open_existing(&p) {
        Ok(Some(m)) => m,
        Ok(None) => panic!("an existing file reported as absent"),
        Err(e) => {
            assert!(e.contains("group ledger"), "{e}");
            return;
        }
    };
    assert!(len >= shm::LAYOUT_BYTES);
    let s = m.shm;
    let _ = s.name();
    let _ = s.members();
    let key = u64::from_le_bytes(body.get(..8).and_then(|b| b.try_into().ok()).unwrap_or([1; 8]));
    if let Some(e) = s.device_entry(shm::device_key(&format!("{key}"))) {
        assert!(e < shm::DEVICES);
        let size = key >> (key % 64);
        let _ = s.set_limit(e, key.rotate_left(7));
        if let Some(slot) = s.claim(4_000_000, 1, 1) {
            let _ = s.charge(slot, e, size);
            s.charge_unchecked(slot, e, size);
            let _ = s.uncharge(slot, e, size.wrapping_mul(3));
        }
        let _ = s.reserve(e, size);
    }
    // Every non-free slot counts as dead: reclaim must cope with any charges it finds.
    let _ = s.reclaim_dead(1, &|ms: &[shm::Member]| vec![shm::Liveness::Dead; ms.len()]);
    // Export records of any content: sweeps, the operator's view and drop must cope too.
    let _ = s.sweep_exports(&|| Some(vec![(1, 7, kept::LOCK_BASE + 3)]));
    let _ = s.kept_exports();
    let _ = s.drop_exports(true);
    m.unmap();
});

/// A valid header, as `Shared::init` writes it (built in memory, not copied by hand).
fn shm_header() -> &'static [u8] {
    static HEADER: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    HEADER.get_or_init(|| {
    let layout = std::alloc::Layout::new::<shm::Shared>();
    let fresh = unsafe { Box::from_raw(std::alloc::alloc_zeroed(layout).cast::<shm::Shared>()) };
    fresh.init("fuzz");
    let n = std::mem::size_of::<shm::Header>();
    let bytes = unsafe { std::slice::from_raw_parts((&*fresh as *const shm::Shared).cast::<u8>(), n) }.to_vec();
    bytes
    })
}
