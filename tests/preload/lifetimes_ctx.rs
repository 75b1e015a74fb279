//! The cap follows the driver's documented lifetimes of contexts and VMM handles, through all three
//! lookup paths. Every scenario runs twice: under vramcap with a 256 MiB cap, and on the bare fake
//! driver with 256 MiB of memory, which keeps the documented rules itself (contexts free their
//! memory when they end; VMM memory lives until released and unmapped). Both must grant and refuse
//! exactly the same calls: a denial the bare driver would not make is a false out-of-memory, a
//! grant it would refuse is memory past the cap.

use vramcap_tests::common;
use common::*;

/// Runs `ops` under the cap and on the bare 256 MiB driver; checks the result codes of `op` are
/// `want` in both, and that both end with the same free memory.
fn agree(ops: &str, checks: &[(&str, &[i64])]) {
    for c in CLIENTS {
        let capped = Run::client(c).env("VRAMCAP_LIMIT", "256m").args([ops, "info"]).run();
        capped.ok();
        let bare = Run::client(c).bare().env("FAKECUDA_MEM", "256m").args([ops, "info"]).run();
        bare.ok();
        for (op, want) in checks {
            let rcs = |o: &Output| o.of(op).iter().map(|l| l.rc()).collect::<Vec<_>>();
            assert_eq!(rcs(&bare), *want, "{c}: the bare driver's own rule for `{op}` in: {ops}\n{}", bare.stdout);
            assert_eq!(rcs(&capped), *want, "{c}: `{op}` under the cap in: {ops}\n{}{}", capped.stdout, capped.stderr);
        }
        let free = |o: &Output| o.of("info").last().unwrap().num("free");
        assert_eq!(free(&capped), free(&bare), "{c}: cuMemGetInfo agrees with the driver after: {ops}");
    }
}

#[test]
fn the_last_primary_release_frees_the_primary_contexts_memory() {
    // cuda-bindings' sequence: retain, 200 MiB, release, retain, 200 MiB (both ABIs of release).
    agree("init ctx 0 alloc 200m release2 0 ctx 0 alloc 200m release1 0 ctx 0 alloc 200m", &[
        ("alloc", &[0, 0, 0]),
        ("primrelease", &[0, 0]),
    ]);
    // Pitched, managed memory and arrays go with it too.
    agree("init ctx 0 managed 100m array 4096 4096 pitch 1000 32768 release2 0 ctx 0 alloc 250m", &[
        ("alloc", &[0]),
    ]);
}

/// Green contexts (issue 23, item 8): a green context retains the primary context, its
/// `CUcontext` is treated as the primary context, and what is allocated in it is the primary
/// context's memory, freed when the primary context ends, whichever call ends it.
#[test]
fn a_green_contexts_memory_goes_with_the_last_primary_release() {
    // The green context's destroy is the last release.
    agree("init ctx 0 green 0 greenctx 0 push 0 alloc 200m pop release2 0 greendestroy 0 primstate 0 ctx 0 alloc 200m", &[
        ("alloc", &[0, 0]),
        ("greendestroy", &[0]),
        ("primstate", &[0]),
    ]);
    // The application's own release is the last: the destroyed green context's memory lived on
    // with the primary context until then (200 MiB more is refused in between).
    agree("init ctx 0 green 0 greenctx 0 push 0 alloc 200m pop greendestroy 0 alloc 200m release1 0 ctx 0 alloc 200m", &[
        ("alloc", &[0, 2, 0]),
        ("primrelease", &[0]),
    ]);
    // Two green contexts on the device, arrays and pitched memory too; the primary context is
    // never retained by the application: the second destroy ends it.
    agree("init green 0 green 0 greenctx 0 greenctx 1 push 0 alloc 100m array 4096 4096 pop push 1 pitch 1000 32768 \
           greendestroy 0 alloc 200m greendestroy 1 ctx 0 alloc 250m", &[
        ("alloc", &[0, 2, 0]),
        ("greendestroy", &[0, 0]),
    ]);
}

#[test]
fn a_primary_reset_frees_a_green_contexts_memory_and_its_context_cannot_be_destroyed() {
    // cuCtxDestroy of a green context's CUcontext is refused (it stands for the primary context)
    // and frees nothing; a primary reset frees what the green context allocated.
    agree("init ctx 0 green 0 greenctx 0 push 0 alloc 200m destroy2 0 alloc 200m reset 0 alloc 200m pop greendestroy 0 \
           alloc 50m alloc 50m", &[
        ("destroy", &[201]),
        ("alloc", &[0, 2, 0, 0, 2]),
        ("reset", &[0]),
    ]);
}

#[test]
fn a_release_that_is_not_the_last_keeps_the_memory() {
    agree("init ctx 0 ctx 0 alloc 200m release2 0 primstate 0 alloc 200m release2 0 primstate 0 ctx 0 alloc 200m", &[
        ("alloc", &[0, 2, 0]),
        ("primstate", &[0, 0]),
    ]);
    // Releasing a context never retained is the driver's error, and changes nothing.
    agree("init ctx 0 alloc 200m release2 0 release2 0 ctx 0 alloc 200m", &[
        ("primrelease", &[0, 201]),
        ("alloc", &[0, 0]),
    ]);
}

#[test]
fn destroying_a_context_keeps_vmm_memory() {
    // 10 × (create context, cuMemCreate 200 MiB, destroy): the handles outlive their contexts.
    let mut ops = String::from("init ctx 0");
    for i in 0..10 {
        let (create, destroy) = (1 + i % 4, if i % 2 == 0 { "destroy1" } else { "destroy2" });
        ops += &format!(" mkctx {create} 0 vmm 200m 0 {destroy} {i}");
    }
    let mut want = vec![2; 10];
    want[0] = 0;
    agree(&ops, &[("vmm", &want), ("mkctx", &[0; 10]), ("destroy", &[0; 10])]);
    // What the context allocated itself goes with it, whichever cuCtxCreate ABI made it.
    for v in 1..=4 {
        agree(&format!("init mkctx {v} 0 alloc 100m array 4096 4096 vmm 50m 0 destroy2 0 ctx 0 alloc 200m"), &[
            ("alloc", &[0, 0]),
        ]);
    }
}

#[test]
fn a_primary_reset_keeps_vmm_memory() {
    // slot 0: the allocation, slot 1: the handle.
    for reset in ["reset", "reset1"] {
        agree(&format!("init ctx 0 alloc 100m vmm 100m 0 {reset} 0 alloc 200m release 1 alloc 200m"), &[
            ("alloc", &[0, 2, 0]),
            ("reset", &[0]),
        ]);
    }
}

#[test]
fn the_end_of_a_context_keeps_stream_ordered_memory() {
    // cuMemAllocAsync / cuMemAllocFromPoolAsync memory belongs to its pool (the device's), not to
    // the context that asked for it: a destroyed context leaves it allocated until it is freed.
    // slot 0: the default pool's 200 MiB; pool 0 is created in the doomed context. Freed memory
    // goes back at a synchronize (release threshold 0) before the last request, so that request
    // needs no trim (vramcap trims before it denies, the bare driver need not).
    for destroy in ["destroy1", "destroy2"] {
        agree(&format!("init mkctx 2 0 poolcreate 0 async 200m {destroy} 0 ctx 0 async 100m palloc 0 100m freeasync 0 sync async 100m"), &[
            ("async", &[0, 2, 0]),
            ("palloc", &[2]),
            ("destroy", &[0]),
            ("freeasync", &[0]),
        ]);
        agree(&format!("init mkctx 2 0 poolcreate 0 palloc 0 200m {destroy} 0 ctx 0 async 100m freeasync 0 sync palloc 0 100m"), &[
            ("palloc", &[0, 0]),
            ("async", &[2]),
        ]);
    }
    // A primary context reset frees what the context allocated, not what its pools hold.
    for reset in ["reset", "reset1"] {
        agree(&format!("init ctx 0 poolcreate 0 async 150m palloc 0 50m {reset} 0 async 100m palloc 0 100m freeasync 0 sync async 100m"), &[
            ("async", &[0, 2, 0]),
            ("palloc", &[0, 2]),
            ("reset", &[0]),
        ]);
    }
}

#[test]
fn a_detach_to_zero_destroys_the_context() {
    // PyCUDA: push, detach (which pops); the next context starts from zero.
    for v in 1..=4 {
        agree(&format!("init mkctx {v} 0 alloc 200m pop push 0 detach 0 mkctx 2 0 alloc 200m"), &[
            ("alloc", &[0, 0]),
            ("detach", &[0]),
        ]);
    }
    // An attached context lives until its last detach.
    agree("init mkctx 2 0 attach alloc 200m detach 1 push 0 alloc 200m detach 0 mkctx 2 0 alloc 200m detach 2", &[
        ("attach", &[0]),
        ("detach", &[0, 0, 0]),
        ("alloc", &[0, 2, 0]),
    ]);
}

#[test]
fn vmm_memory_lives_until_released_and_unmapped() {
    // NVIDIA's samples release right after mapping: 5 × 200 MiB must not all be granted.
    let mut ops = String::from("init ctx 0");
    for k in 0..5 {
        ops += &format!(" vmm 200m 0 vamap {k} 200m release {k}");
    }
    ops += " vaunmap 0 vmm 200m 0";
    agree(&ops, &[("vmm", &[0, 2, 2, 2, 2, 0]), ("vamap", &[0, 1, 1, 1, 1]), ("vaunmap", &[0])]);
}

#[test]
fn every_mapping_keeps_it_and_a_partial_unmap_is_refused_without_losing_it() {
    agree(
        "init ctx 0 vmm 100m 0 vamap 0 100m vamap 0 100m release 0 vaunmap 0 vmm 200m 0 \
         vaunmap 1 0 2m vmm 200m 0 vaunmap 1 vmm 200m 0",
        &[("vmm", &[0, 2, 2, 0]), ("vaunmap", &[0, 1, 0])],
    );
}

#[test]
fn a_retained_handle_is_one_more_reference() {
    // NCCL's free: retain the handle from the address, release that, unmap, release its own.
    agree(
        "init ctx 0 vmm 100m 0 vamap 0 100m retainh 0 50m release 1 vaunmap 0 vmm 200m 0 release 0 vmm 200m 0",
        &[("retainh", &[0]), ("release", &[0, 0]), ("vmm", &[0, 2, 0])],
    );
    // Release first, then find the handle again from the mapping: it is live again.
    agree(
        "init ctx 0 vmm 100m 0 vamap 0 100m release 0 retainh 0 0 vaunmap 0 vmm 200m 0 release 1 vmm 200m 0",
        &[("vmm", &[0, 2, 0]), ("release", &[0, 0]), ("retainh", &[0])],
    );
}

#[test]
fn an_exported_allocation_keeps_its_memory_after_release_and_unmap() {
    // Exported as a POSIX fd, then released and unmapped: the shareable handle is a reference the
    // process cannot see released (an importer anywhere may still hold the memory).
    agree("init ctx 0 vmmfd 200m 0 vamap 0 200m export 0 release 0 vaunmap 0 vmm 200m 0", &[
        ("export", &[0]),
        ("release", &[0]),
        ("vaunmap", &[0]),
        ("vmm", &[0, 2]),
    ]);
    // Imported again in this process: the same handle, one more reference; both released, the
    // memory still lives.
    agree("init ctx 0 vmmfd 200m 0 export 0 import 0 release 0 release 1 vmm 200m 0", &[
        ("import", &[0]),
        ("release", &[0, 0]),
        ("vmm", &[0, 2]),
    ]);
    // A refused export (the handle was not created shareable) keeps nothing alive.
    agree("init ctx 0 vmm 200m 0 export 0 release 0 vmm 200m 0", &[("export", &[1]), ("vmm", &[0, 0])]);
}

#[test]
fn racing_threads_never_pass_the_cap_and_leave_nothing_charged() {
    for c in CLIENTS {
        // 16 threads × 300 rounds of create, map, release-after-map (or NCCL's retain/release),
        // unmap, 4 MiB each, under a cap of 24 MiB: the driver never holds more than the cap,
        // and when all is unmapped and released nothing is charged.
        let out = Run::client(c)
            .env("VRAMCAP_LIMIT", "24m")
            .args(["init ctx 0 vmmstorm 16 300 4m info stats 0"])
            .run();
        out.ok();
        let s = out.nth("vmmstorm", 0);
        assert_eq!(s.num("other"), 0, "{c}: {}", out.stdout);
        assert_eq!(s.num("ok") + s.num("oom"), 16 * 300, "{c}");
        assert!(s.num("ok") > 0, "{c}");
        let st = out.nth("stats", 0);
        assert!(st.num("peak") <= 24 * MIB, "{c}: the driver held {} under a 24 MiB cap", st.num("peak"));
        assert_eq!(st.num("bytes_held"), 0, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 24 * MIB, "{c}: every charge went with its memory");
        // Without contention for the cap, no round is ever refused.
        let out = Run::client(c).env("VRAMCAP_LIMIT", "64m").args(["init ctx 0 vmmstorm 8 300 4m info"]).run();
        out.ok();
        assert_eq!(out.nth("vmmstorm", 0).num("oom"), 0, "{c}: a false out-of-memory: {}", out.stdout);
        assert_eq!(out.nth("info", 0).num("free"), 64 * MIB, "{c}");
    }
}

#[test]
fn every_abi_of_the_context_and_vmm_lifetime_entry_points_is_wrapped() {
    // Each base name at every version a runtime or binding may ask for (CUDA 13 included): the
    // driver's answer is kept (same result, status, NULL or not) and the pointer is our wrapper
    // of exactly that variant, never "none of the variants".
    let names = [
        "cuCtxCreate", "cuCtxDestroy", "cuCtxAttach", "cuCtxDetach", "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxReset", "cuMemCreate", "cuMemRelease", "cuMemMap",
        "cuMemUnmap", "cuMemRetainAllocationHandle", "cuMemImportFromShareableHandle",
        "cuMemExportToShareableHandle",
    ];
    let versions = [2000, 3020, 4000, 7000, 10020, 11000, 11040, 12000, 12050, 13000, 13050];
    let dir = private_group_dir();
    let tsv = dir.join("lifetimes.tsv");
    let rows: Vec<String> =
        names.iter().flat_map(|n| versions.iter().map(move |v| format!("{n}\t{v}\t0\n"))).collect();
    std::fs::write(&tsv, rows.concat()).unwrap();
    let replay = |preload: bool| {
        let mut r = Run::client("replay").args([tsv.to_str().unwrap()]);
        r = if preload { r.env("VRAMCAP_LIMIT", "1g") } else { r.bare() };
        let out = r.run();
        out.ok();
        out
    };
    let (bare, with) = (replay(false), replay(true));
    assert!(!with.stderr.contains("none of the variants"), "{}", with.stderr);
    let cols = |o: &Output| o.stdout.lines().map(|l| l.split('\t').map(String::from).collect::<Vec<_>>()).collect::<Vec<_>>();
    let (b, w) = (cols(&bare), cols(&with));
    assert_eq!(b.len(), w.len());
    let mut wrapped = 0;
    for (b, w) in b.iter().zip(&w) {
        assert_eq!(b[..6], w[..6], "the driver's answer changed");
        if names.contains(&b[0].as_str()) && b[5] == "1" {
            assert_eq!(w[6], "libvramcap.so", "{} @{} is not wrapped", w[0], w[1]);
            wrapped += 1;
        }
    }
    assert!(wrapped > 90, "only {wrapped} answers wrapped");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_trace_names_the_call_that_ended_the_memory() {
    let dir = private_group_dir();
    let path = dir.join("t.jsonl");
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "256m")
        .env("VRAMCAP_TRACE", &path)
        .args(["init ctx 0 vmm 4m 0 vamap 0 4m release 0 vaunmap 0 mkctx 2 0 alloc 1m attach detach 1 push 0 detach 0"])
        .args(["alloc 2m release2 0"])
        .run();
    out.ok();
    let text = std::fs::read_to_string(&path).unwrap();
    let got: Vec<String> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "event" && (v["op"] == "alloc" || v["op"] == "free"))
        .map(|v| format!("{} {} {}", v["op"].as_str().unwrap(), v["api"].as_str().unwrap(), v["size"]))
        .collect();
    let mib = |n: u64| n * MIB;
    assert_eq!(
        got,
        [
            format!("alloc cuMemCreate {}", mib(4)),
            format!("free cuMemUnmap {}", mib(4)),
            format!("alloc cuMemAlloc_v2 {}", mib(1)),
            format!("free cuCtxDetach {}", mib(1)),
            format!("alloc cuMemAlloc_v2 {}", mib(2)),
            format!("free cuDevicePrimaryCtxRelease_v2 {}", mib(2)),
        ],
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn racing_context_lifetimes_leave_the_ledger_equal_to_the_driver() {
    for c in CLIENTS {
        // 12 threads × 300 rounds: create/allocate/destroy, create/attach/detach twice, and
        // retain/allocate/free/release the shared primary context, 4 MiB each under 24 MiB.
        let out = Run::client(c).env("VRAMCAP_LIMIT", "24m").args(["init ctxstorm 12 300 4m ctx 0 info stats 0"]).run();
        out.ok();
        let s = out.nth("ctxstorm", 0);
        assert_eq!(s.num("other"), 0, "{c}: {}{}", out.stdout, out.stderr);
        assert!(s.num("ok") > 0, "{c}");
        let st = out.nth("stats", 0);
        assert!(st.num("peak") <= 24 * MIB, "{c}: the driver held {} under a 24 MiB cap", st.num("peak"));
        assert_eq!(st.num("bytes_held"), 0, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 24 * MIB, "{c}: every context took its charges along");
    }
}

#[test]
fn forking_while_threads_end_contexts_and_allocations_never_hangs() {
    // The context lock is held across driver calls and the VMM table's while ledger locks are
    // taken: the fork handlers must take them in that order or a fork deadlocks (the run's
    // timeout would kill it). Afterwards the ledger still equals the driver.
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "64m")
        .timeout(std::time::Duration::from_secs(60))
        .args(["init forkstorm 4 400 4m 60 ctx 0 info stats 0"])
        .run();
    out.ok();
    let f = out.nth("forkstorm", 0);
    assert_eq!((f.num("other"), f.num("bad_children")), (0, 0), "{}", out.stdout);
    assert_eq!(out.nth("stats", 0).num("bytes_held"), 0);
    assert_eq!(out.nth("info", 0).num("free"), 64 * MIB);
}
