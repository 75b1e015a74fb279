//! Attacks on issue 24's measurement, kept as regression tests: memory that changes on the device
//! without passing through vramcap's reserve/commit/uncommit/unreserve while a context is being
//! measured (a "quiet reading" that took the driver's books at their word charged whatever moved
//! meanwhile to the context being made, or took it from it), and the estimates reserved before a
//! call (heaps, library copies, green contexts) that must keep the device within the cap. Each
//! test's comment tells the failure it found, as it was before the fix (docs/coverage.md says how
//! each is handled now).
//!
//! Each test uses the client's `bg N OP...` (the next N words run in a thread of their own) and
//! contexts that take the fake `FAKECUDA_CTX_DELAY_US` to make (a real driver takes 100s of ms).

use vramcap_tests::common;
use common::*;

const CAP: u64 = GIB;

fn stats_peak(o: &Output) -> u64 {
    o.of("stats").last().unwrap().num("peak")
}

/// A managed allocation prefetched to the host by another thread while a context is made: the
/// books drop by the allocation (the device no longer holds its pages), vramcap's counts do not
/// move (a managed allocation counts on its device wherever its pages are), so the context
/// measures its size less the allocation: nothing. The pages come back with a prefetch (no new
/// charge: they already count), and an allocation then fits "under" the cap while the device
/// holds the uncharged context too.
#[test]
fn a_managed_prefetch_to_the_host_while_a_context_is_made_does_not_make_the_context_free() {
    let ops = "init ctx 0 managed 400m bg 9 ctx 0 sleep 150 prefetch1 0 0 400m -1 sleep 50 mkctx 2 0 join \
               info prefetch1 0 0 400m 0 alloc 300m stats 0";
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("FAKECUDA_CTX_BYTES", "300m")
        .env("FAKECUDA_CTX_DELAY_US", "300000")
        .args([ops])
        .run();
    out.ok();
    // 300 (primary) + 400 (managed) + 300 (the new context) = 1000 MiB charged: free 24 MiB.
    assert_eq!(out.nth("info", 0).num("free"), CAP - 1000 * MIB, "the new context is not charged: {}", out.stdout);
    assert!(stats_peak(&out) <= CAP, "the device held {} MiB past a 1 GiB cap: {}", stats_peak(&out) / MIB, out.stdout);
}

/// The mirror image: pages coming back from the host while a context is made are charged as the
/// context's size (300 + 400 MiB), and a context the bare 1 GiB driver makes is refused.
#[test]
fn a_managed_prefetch_back_to_the_device_while_a_context_is_made_is_not_charged_to_the_context() {
    let ops = "init ctx 0 managed 400m prefetch1 0 0 400m -1 bg 9 ctx 0 sleep 150 prefetch1 0 0 400m 0 sleep 50 mkctx 2 0 join info";
    let bare = Run::client("client_linked")
        .bare()
        .env("FAKECUDA_MEM", "1g")
        .env("FAKECUDA_CTX_BYTES", "300m")
        .env("FAKECUDA_CTX_DELAY_US", "300000")
        .args([ops])
        .run();
    bare.ok();
    assert_eq!(bare.nth("mkctx", 0).rc(), 0, "the bare 1 GiB driver makes it: {}", bare.stdout);
    let capped = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("FAKECUDA_CTX_BYTES", "300m")
        .env("FAKECUDA_CTX_DELAY_US", "300000")
        .args([ops])
        .run();
    capped.ok();
    assert_eq!(capped.nth("mkctx", 0).rc(), 0, "false denial: {}{}", capped.stdout, capped.stderr);
}

/// A pool destroyed with an allocation live gives its memory back at that allocation's
/// cuMemFreeAsync (documented; the fake does). The driver has given it back before the call
/// returns (`FAKECUDA_FREE_DELAY_US`: a thread descheduled on its way out of the driver), and
/// vramcap releases the pool's charge only after: meanwhile its counts stand still, and a context
/// made then measures its size less the pool.
#[test]
fn an_orphan_pools_last_free_while_a_context_is_made_does_not_make_the_context_free() {
    let ops = "init ctx 0 poolcreate 0 palloc 0 400m pooldestroy 0 bg 4 sleep 150 freeasync 0 sleep 50 mkctx 2 0 join \
               alloc 700m stats 0";
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("FAKECUDA_CTX_BYTES", "300m")
        .env("FAKECUDA_CTX_DELAY_US", "300000")
        .env("FAKECUDA_FREE_DELAY_US", "600000")
        .args([ops])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 2, "700 MiB beside two 300 MiB contexts cannot fit 1 GiB: {}", out.stdout);
    assert!(stats_peak(&out) <= CAP, "the device held {} MiB past a 1 GiB cap: {}", stats_peak(&out) / MIB, out.stdout);
}

/// No fake knob at all: a thread cycling a default pool (allocate 300 MiB, free, synchronize:
/// the synchronize gives the pool's memory back in the driver, vramcap settles the pool after the
/// call returns) while another creates and destroys contexts. A context measured in the moment
/// between the driver's trim and vramcap's settle is charged 100 + 300 MiB (the trim before its
/// first reading) or nothing (after its first). Every context must measure 100 MiB.
#[test]
fn pool_trims_at_a_synchronize_never_change_a_contexts_measured_size() {
    let dir = private_group_dir();
    let trace = dir.join("trims.jsonl");
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "15g")
        .env("FAKECUDA_CTX_BYTES", "100m")
        .env("VRAMCAP_TRACE", &trace)
        .env("VRAMCAP_TRACE_MODE", "lossless")
        .args(["init ctx 0 bg 6 ctx 0 cycles 300000 300m 1 ctxstorm 1 3000 1m join"])
        .timeout(std::time::Duration::from_secs(300))
        .run();
    out.ok();
    let text = std::fs::read_to_string(&trace).unwrap();
    let sizes: Vec<u64> = text
        .lines()
        .filter(|l| l.contains("\"op\":\"overhead\"") && l.contains("\"api\":\"cuCtxCreate"))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["size"].as_u64().unwrap())
        .collect();
    let wrong: Vec<u64> = sizes.iter().copied().filter(|&s| s != 100 * MIB).collect();
    // ctxstorm: 2000 of its 3000 rounds create a context (cuCtxCreate_v2 / _v4); one charged
    // nothing leaves no `overhead` event.
    assert!(wrong.is_empty() && sizes.len() == 2000, "{} contexts charged, {} of them not 100 MiB: {:?}", sizes.len(), wrong.len(), wrong);
}

/// A library load brings the context's malloc heap and printf FIFO as a module's first load does
/// (the fake: eager loading; the Programming Guide: "the actual memory allocation for the heap
/// occurs when a module is loaded into the context"), but only the image's globals are reserved
/// before the call: a heap set past the cap is taken by the device, measured, the library is
/// unloaded again, and the heap stays (with its context) past the cap for good. Modules reserve
/// the heap first since 05de9e2; libraries do not.
#[test]
fn a_library_load_never_makes_the_device_take_a_heap_past_the_cap() {
    let dir = private_group_dir();
    let m = dir.join("lib1m.cubin");
    let ops = format!("init ctx 0 cubin {m} 1m setlimit 2 950m libdata {m} info stats 0", m = m.display());
    let eager = |r: Run| r.env("CUDA_MODULE_LOADING", "EAGER");
    let bare = eager(Run::client("client_linked").bare()).env("FAKECUDA_MEM", "1g").env("FAKECUDA_CTX_BYTES", "100m").args([&ops]).run();
    bare.ok();
    assert_ne!(bare.nth("libdata", 0).rc(), 0, "the bare 1 GiB driver cannot take the heap: {}", bare.stdout);
    let capped = eager(Run::client("client_linked")).env("VRAMCAP_LIMIT", "1g").env("FAKECUDA_CTX_BYTES", "100m").args([&ops]).run();
    capped.ok();
    assert_eq!(capped.nth("libdata", 0).rc(), 2, "{}", capped.stdout);
    let stats = capped.nth("stats", 0);
    assert!(stats.num("peak") <= CAP, "the device held {} MiB past a 1 GiB cap: {}", stats.num("peak") / MIB, capped.stdout);
    assert_eq!(stats.num("bytes_held"), 100 * MIB, "the heap was never taken: {}", capped.stdout);
}

/// A green context whose create makes the primary context (a program that uses green contexts
/// only) never tells vramcap the primary context's size (`LAST_CONTEXT`, the group's
/// `context_bytes`), nor its own (`LAST_GREEN` is noted only when the primary was there before):
/// measured once, neither is reserved the next time, and a re-create past the cap is taken by the
/// device before it is measured and refused. docs/coverage.md: "the primary context's last size
/// when the create will make it" is reserved. A plain context in the same place is refused first.
#[test]
fn a_green_context_that_makes_the_primary_is_refused_before_the_device_holds_it_the_second_time() {
    // Measured once (375 MiB: the primary 300, the green 75), all given back, then 700 MiB of VMM
    // (a device's, not a context's): 700 + 375 does not fit 1 GiB.
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("FAKECUDA_CTX_BYTES", "300m")
        .args(["init green 0 greendestroy 0 vmm 700m 0 green 0 stats 0"])
        .run();
    out.ok();
    assert_eq!(out.nth("green", 1).rc(), 2, "{}", out.stdout);
    let peak = out.nth("stats", 0).num("peak");
    assert!(peak <= CAP, "the device held {} MiB past a 1 GiB cap: {}", peak / MIB, out.stdout);
}

/// `cuDevicePrimaryCtxReset` with an allocation live reads the books for the modules and limits
/// it gives back after `context::ending` has taken the allocation out of `held` (its charge
/// stays until the call returns): the counts are never quiet, and the reading waits out the whole
/// patience (100 ms) under the context lock, every reset.
#[test]
fn a_primary_reset_with_live_allocations_does_not_wait_out_the_quiet_reading() {
    // Ten resets with an allocation live, beside ten without, in the same conditions: the waits
    // would add a second (100 ms each), whatever the machine's load adds to both.
    let run = |alloc: &str| {
        let ops = format!("init {}", format!("ctx 0 {alloc} reset 0 ").repeat(10));
        let t = std::time::Instant::now();
        let out = Run::client("client_linked").env("VRAMCAP_LIMIT", "1g").env("FAKECUDA_CTX_BYTES", "100m").args([ops]).run();
        out.ok();
        assert!(out.of("reset").iter().all(|l| l.rc() == 0), "{}", out.stdout);
        t.elapsed()
    };
    let (with, without) = (run("alloc 10m"), run("info"));
    assert!(with < without + std::time::Duration::from_millis(600), "ten resets took {with:?} with an allocation live, {without:?} without");
}

/// Lazy loading (`CUDA_MODULE_LOADING=LAZY`, the default on Linux since CUDA 12.2): a library is
/// loaded into a context only when a function of it is first needed there, so its load brings no
/// heap. vramcap marks every context's heap taken at a library load all the same
/// (`libraries::load`: `note_heap`), and the next `cuModuleLoad*` there reserves no heap: a heap
/// set past the cap is taken by the device, the module is unloaded again, and the heap stays past
/// the cap for good. The fake honours `CUDA_MODULE_LOADING=LAZY` for libraries, and lazy is its default from driver 12.2 as the real driver's.
#[test]
fn under_lazy_loading_a_library_does_not_make_the_next_module_skip_the_heap() {
    let dir = private_group_dir();
    let m = dir.join("lazy1m.cubin");
    let ops = format!("init ctx 0 cubin {m} 1m setlimit 2 950m libdata {m} moddata {m} info stats 0", m = m.display());
    let bare = Run::client("client_linked")
        .bare()
        .env("CUDA_MODULE_LOADING", "LAZY")
        .env("FAKECUDA_MEM", "1g")
        .env("FAKECUDA_CTX_BYTES", "100m")
        .args([&ops])
        .run();
    bare.ok();
    assert_eq!((bare.nth("libdata", 0).rc(), bare.nth("moddata", 0).rc()), (0, 303), "the bare driver: {}", bare.stdout);
    let capped = Run::client("client_linked")
        .env("CUDA_MODULE_LOADING", "LAZY")
        .env("VRAMCAP_LIMIT", "1g")
        .env("FAKECUDA_CTX_BYTES", "100m")
        .args([&ops])
        .run();
    capped.ok();
    assert_eq!(capped.nth("moddata", 0).rc(), 2, "{}", capped.stdout);
    let stats = capped.nth("stats", 0);
    assert!(stats.num("peak") <= CAP, "the device held {} MiB past a 1 GiB cap: {}", stats.num("peak") / MIB, capped.stdout);
    assert!(stats.num("bytes_held") <= CAP, "the heap stays past the cap: {}", capped.stdout);
}

/// A context made while a library is loaded gets a copy of it and the heap its first module
/// brings (eager loading), but only the size the last context measured (made before the library)
/// is reserved: the device takes the copy past the cap before the context is measured and
/// refused. The loaded libraries' globals and a heap could be reserved with it.
#[test]
fn a_context_made_while_a_library_is_loaded_is_refused_before_the_device_holds_its_copy() {
    let dir = private_group_dir();
    let l = dir.join("l450.cubin");
    let ops = format!("init ctx 0 cubin {l} 450m libdata {l} mkctx 2 0 stats 0", l = l.display());
    let out = Run::client("client_linked").env("CUDA_MODULE_LOADING", "EAGER").env("VRAMCAP_LIMIT", "1g").env("FAKECUDA_CTX_BYTES", "100m").args([&ops]).run();
    out.ok();
    assert_eq!(out.nth("mkctx", 0).rc(), 2, "{}", out.stdout);
    let peak = out.nth("stats", 0).num("peak");
    assert!(peak <= CAP, "the device held {} MiB past a 1 GiB cap: {}", peak / MIB, out.stdout);
}
