//! Stream-ordered and graph memory live as long as the driver's documentation says, and the cap
//! holds through every one of those lifetimes (issue 14): pools destroyed with live allocations,
//! allocations on another device's stream from a thread without a context, fragmented pools,
//! racing threads, more pools than any fixed table, graph memory allocated at launch, and pools
//! that keep freed memory (which must never cause a false denial). Each runs through the three
//! lookup paths; the fake driver's own statistics (`stats`: what really reached the device) prove
//! the physical peak stayed within the cap.

use vramcap_tests::common;
use common::*;

fn rcs(out: &Output, op: &str) -> Vec<i64> {
    out.of(op).iter().map(|l| l.rc()).collect()
}

/// What the device really held at its peak, from the fake driver's side of the interposer.
fn peak(out: &Output, i: usize) -> u64 {
    out.nth("stats", i).num("peak")
}

#[test]
fn a_destroyed_pool_keeps_its_memory_until_its_allocations_are_freed() {
    for c in CLIENTS {
        // 10 × (create a pool, take 200 MiB from it, destroy the pool without freeing).
        let out = run_capped(c, "256m", "init ctx 0 poolburst 0 10 200m info stats 0 freeasync 0 info poolburst 0 1 200m stats 0");
        let burst = out.nth("poolburst", 0);
        assert_eq!((burst.num("ok"), burst.num("oom"), burst.num("other")), (1, 9, 0), "{c}: {}", out.stdout);
        assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{c}: the destroyed pool's memory is still charged");
        assert!(peak(&out, 0) <= 256 * MIB, "{c}: {} bytes reached the device", peak(&out, 0));
        assert_eq!(out.nth("freeasync", 0).rc(), 0, "{c}: freeing after the destroy is legal");
        assert_eq!(out.nth("info", 1).num("free"), 256 * MIB, "{c}: the last free released the pool");
        assert_eq!(out.nth("poolburst", 1).num("ok"), 1, "{c}");
        assert_eq!(out.nth("stats", 1).num("bytes_held"), 200 * MIB, "{c}: the fake freed the first pool");
    }
}

/// The fake as drivers with fewer ways to learn a stream's device, each with the entry point only
/// its way calls: the full driver (`cuStreamGetDevice`, CUDA 12.8), one without it
/// (`cuStreamGetCtx`, then `cuCtxGetDevice_v2` of that context), and a driver before 12.8, which
/// has neither (`cuStreamGetCtx`, then push, `cuCtxGetDevice`, pop). cuda-shim/*.map say what each
/// lacks.
const STREAM_DRIVERS: [(&str, &str); 3] = [
    ("cuda-shim", "cuStreamGetDevice"),
    ("cuda-shim-nostreamdev", "cuCtxGetDevice_v2"),
    ("cuda-shim-12.0", "cuCtxPushCurrent_v2"),
];

/// `run` on one of [`STREAM_DRIVERS`], checking from the fake's call counters that vramcap found
/// the stream's device that driver's way.
fn run_on(driver: (&str, &str), client: &str, limit: &str, ops: &str) -> Output {
    let (dir, way) = driver;
    let ops = format!("{ops} calls cuStreamGetCtx calls {way}");
    let out = Run::client(client)
        .env("LD_LIBRARY_PATH", shim_dir().with_file_name(dir))
        .env("VRAMCAP_LIMIT", limit)
        .args([ops.as_str()])
        .run();
    out.ok();
    let n = |i| out.nth("calls", i).num("n");
    assert!(n(1) > 0, "{client} on {dir}: {way} never called\n{}", out.stdout);
    assert_eq!(n(0) > 0, dir != "cuda-shim", "{client} on {dir}: cuStreamGetCtx only where the driver lacks cuStreamGetDevice");
    out
}

#[test]
fn stream_ordered_memory_is_charged_even_from_a_thread_without_a_context() {
    for driver in STREAM_DRIVERS {
        for c in CLIENTS {
            // The stream belongs to device 0's context; the allocating thread has none current.
            let out = run_on(driver, c, "256m", "init ctx 0 stream noctx 0 20 100m info stats 0");
            let n = out.nth("noctx", 0);
            assert_eq!((n.num("ok"), n.num("oom"), n.num("other")), (2, 18, 0), "{c} on {}: {}", driver.0, out.stdout);
            assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{c} on {}", driver.0);
            assert!(peak(&out, 0) <= 256 * MIB, "{c} on {}", driver.0);
        }
    }
}

#[test]
fn stream_ordered_memory_belongs_to_the_streams_and_the_pools_device() {
    for driver in STREAM_DRIVERS {
        for c in CLIENTS {
            // Device 1 is capped at 256 MiB, device 0 at 1 GiB; device 0's context is current.
            let out = run_on(driver, c, "0=1g,1=256m", "init ctx 1 stream ctx 0 asyncs 0 200m asyncs 0 100m info");
            assert_eq!(rcs(&out, "async"), vec![0, 2], "{c} on {}: charged to the stream's device 1", driver.0);
            assert_eq!(out.nth("info", 0).num("free"), GIB, "{c} on {}: nothing charged to the current device 0", driver.0);
        }
    }
    for c in CLIENTS {
        // A device's current pool, learned through cuDeviceGetMemPool while device 0 is current.
        let out = run_capped(c, "0=1g,1=256m", "init ctx 0 curpool 1 palloc 0 200m palloc 0 100m info");
        assert_eq!(rcs(&out, "palloc"), vec![0, 2], "{c}: the pool is device 1's");
        assert_eq!(out.nth("info", 0).num("free"), GIB, "{c}");
    }
}

#[test]
fn a_fragmented_pool_cannot_grow_past_the_cap() {
    for c in CLIENTS {
        // A pool that keeps freed memory; each request (100, 102, … MiB) fits no freed block, so
        // the pool grows on every call although its free bytes add up (1.8 GiB on the old code).
        let out = run_capped(c, "256m", "init ctx 0 frag 18 100m 2m stats 0 info");
        let f = out.nth("frag", 0);
        assert_eq!((f.num("ok"), f.num("oom"), f.num("other")), (18, 0, 0), "{c}: trimmed, never denied");
        assert!(peak(&out, 0) <= 256 * MIB, "{c}: {} MiB reached the device", peak(&out, 0) / MIB);
        assert_eq!(out.nth("info", 0).num("free"), 256 * MIB - 134 * MIB, "{c}: exactly what the pool holds");
    }
}

#[test]
fn racing_threads_never_pass_the_cap() {
    for c in CLIENTS {
        for round in 0..8 {
            // The pool holds a freed 40 MiB block that "fits" every request; 16 threads race.
            let out = run_capped(c, "256m", "init ctx 0 asyncrace 16 20m 40m stats 0");
            let r = out.nth("asyncrace", 0);
            assert_eq!(r.num("ok") + r.num("oom"), 16, "{c} round {round}: {}", out.stdout);
            assert!((1..=12).contains(&r.num("ok")), "{c} round {round}: {}", out.stdout);
            assert!(peak(&out, 0) <= 256 * MIB, "{c} round {round}: {} MiB", peak(&out, 0) / MIB);
        }
    }
}

#[test]
fn pools_beyond_any_table_size_are_counted() {
    for c in CLIENTS {
        let out = run_capped(c, "256m", "init ctx 0 manypools 300 40m stats 0");
        let m = out.nth("manypools", 0);
        assert_eq!(m.num("created"), 300);
        assert_eq!((m.num("ok"), m.num("oom"), m.num("other")), (6, 294, 0), "{c}: the 257th pool too");
        assert!(peak(&out, 0) <= 256 * MIB, "{c}");
    }
}

#[test]
fn a_pool_keeping_freed_memory_never_causes_a_false_denial() {
    for c in CLIENTS {
        // PyTorch's cudaMallocAsync backend: release threshold at max, freed blocks stay reserved.
        let out = run_capped(c, "256m", "init ctx 0 poolcreate 0 keep 0 palloc 0 200m freeasync 0 sync alloc 200m info stats 0");
        assert_eq!(rcs(&out, "alloc"), vec![0], "{c}: the driver would have trimmed the pool; so do we");
        assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{c}");
        assert!(peak(&out, 0) <= 256 * MIB, "{c}");
        let out = run_capped(c, "256m", "init ctx 0 poolcreate 0 keep 0 palloc 0 200m freeasync 0 async 200m info");
        assert_eq!(rcs(&out, "async"), vec![0], "{c}: another pool's request, same rule");
        assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{c}");
    }
}

#[test]
fn graph_memory_is_charged_when_a_launch_allocates_it() {
    // Instantiated through each variant (WithFlags, _v2, WithParams, WithParams_ptsz, v1),
    // launched or uploaded through each stream flavour.
    for c in CLIENTS {
        for (variant, first, second) in [(0, "glaunch", "glaunchp"), (1, "gupload", "glaunch"), (2, "glaunchp", "guploadp"), (3, "glaunch", "glaunch"), (4, "guploadp", "glaunch")] {
            let ops = format!("init ctx 0 graph 0 200m 1 {variant} info {first} 0 info gmem 0 {second} 0 info alloc 100m info");
            let out = run_capped(c, "256m", &ops);
            let ctx = format!("{c} variant {variant}: {}", out.stdout);
            assert_eq!(out.nth("graph", 0).rc(), 0, "{ctx}");
            assert_eq!(out.nth("info", 0).num("free"), 256 * MIB, "{ctx}: instantiation allocates nothing");
            assert_eq!(rcs(&out, "glaunch"), vec![0, 0], "{ctx}");
            assert_eq!(out.nth("info", 1).num("free"), 56 * MIB, "{ctx}: the graph's memory is charged");
            assert_eq!(out.nth("gmem", 0).num("reserved"), 200 * MIB, "{ctx}");
            assert_eq!(out.nth("info", 2).num("free"), 56 * MIB, "{ctx}: a relaunch reuses it");
            // Graph memory no graph uses is trimmed before a denial, like a pool's.
            assert_eq!(rcs(&out, "alloc"), vec![0], "{ctx}");
            assert_eq!(out.nth("info", 3).num("free"), 156 * MIB, "{ctx}");
        }
    }
}

#[test]
fn a_launch_past_the_cap_is_denied_with_the_drivers_out_of_memory() {
    for c in CLIENTS {
        let out = run_capped(c, "256m", "init ctx 0 alloc 100m graph 0 200m 1 0 glaunch 0 gmem 0 stats 0 free 0 glaunch 0 gmem 0 info");
        assert_eq!(rcs(&out, "glaunch"), vec![2, 0], "{c}: CUDA_ERROR_OUT_OF_MEMORY, then granted");
        assert_eq!(out.nth("gmem", 0).num("reserved"), 0, "{c}: the denied launch never reached the driver");
        assert!(peak(&out, 0) <= 256 * MIB, "{c}");
        assert_eq!(out.nth("gmem", 1).num("reserved"), 200 * MIB, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{c}");
    }
}

#[test]
fn graph_allocations_the_graph_does_not_free_stay_charged_until_trimmed() {
    for c in CLIENTS {
        let out = run_capped(c, "256m", "init ctx 0 graph 0 100m 0 0 glaunch 0 info glaunch 0 freeasync 0 info gmem 0 gtrim 0 info");
        assert_eq!(rcs(&out, "glaunch"), vec![0, 1], "{c}: relaunching before the free is the driver's error");
        assert_eq!(out.nth("info", 0).num("free"), 156 * MIB, "{c}");
        assert_eq!(out.nth("freeasync", 0).rc(), 0, "{c}");
        assert_eq!(out.nth("info", 1).num("free"), 156 * MIB, "{c}: freed, but still reserved for graphs");
        assert_eq!(out.nth("gmem", 0).num("used"), 0, "{c}");
        assert_eq!(out.nth("info", 2).num("free"), 256 * MIB, "{c}: cuDeviceGraphMemTrim gave it back");
    }
}

#[test]
fn captured_allocations_are_charged_at_launch_not_at_capture() {
    for c in CLIENTS {
        // Capturing near the cap allocates nothing, so it is not refused; the launch is.
        let out = run_capped(c, "256m", "init ctx 0 alloc 200m capture 100m 1 info glaunch 0 free 0 glaunch 0 info stats 0");
        assert_eq!(out.nth("capture", 0).rc(), 0, "{c}: {}", out.stdout);
        assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{c}");
        assert_eq!(rcs(&out, "glaunch"), vec![2, 0], "{c}");
        assert_eq!(out.nth("info", 1).num("free"), 156 * MIB, "{c}");
        assert!(peak(&out, 0) <= 256 * MIB, "{c}");
    }
}

#[test]
fn cuda_13_synchronize_is_wrapped_and_the_process_stays_quiet() {
    for c in CLIENTS {
        let out = run_capped(c, "64m", "init ctx 0 async 40m freeasync 0 info ctxsync2 info");
        assert_eq!(out.nth("sync", 0).rc(), 0, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 24 * MIB, "{c}");
        assert_eq!(out.nth("info", 1).num("free"), 64 * MIB, "{c}: given back at cuCtxSynchronize_v2");
        assert!(!out.stderr.contains("vramcap"), "{c}: a normal process prints nothing: {}", out.stderr);
    }
}

#[test]
fn nvidia_cuda_bindings_pools_and_graphs_follow_the_lifetimes() {
    // A real third-party client (NVIDIA's cuda-bindings, runtime-style lookups): destroyed pool
    // with a live allocation, allocations from a thread without a context, a graph launch.
    build_c();
    let py = root().join(".venv/bin/python");
    assert!(py.exists(), "{} missing: scripts/test creates it", py.display());
    let out = Run::program(&py)
        .env("VRAMCAP_LIMIT", "256m")
        .args([root().join("tests/python/bindings_pools.py").to_str().unwrap()])
        .run();
    assert!(out.status.success(), "cuda-bindings pools failed:\n{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("bindings pools ok"), "{}", out.stdout);
}

/// Issue 23: a capture on the per-thread default stream (NULL to `cuStreamBeginCapture_v2_ptsz`
/// and `cuMemAllocAsync_ptsz`) allocates nothing; it must be asked of that stream, not of the
/// legacy one (which is never capturing), or a capture near the cap is refused. The launch is
/// charged.
#[test]
fn a_capture_on_the_per_thread_default_stream_allocates_nothing() {
    let ops = "init ctx 0 alloc 200m ptcapture 100m info glaunch 0 free 0 glaunch 0 info stats 0";
    for c in CLIENTS {
        let out = run_capped(c, "256m", ops);
        assert_eq!(out.nth("capture", 0).rc(), 0, "{c}: {}", out.stdout);
        assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{c}: the capture is not charged");
        assert_eq!(rcs(&out, "glaunch"), vec![2, 0], "{c}: the launch is");
        assert!(peak(&out, 0) <= 256 * MIB, "{c}");

        let bare = Run::client(c).bare().args([ops]).run();
        bare.ok();
        assert_eq!(bare.nth("capture", 0).rc(), 0, "{c}: the plain driver captures it");
        assert_eq!(bare.nth("stats", 0).num("bytes_held"), 100 * MIB, "{c}: and allocates at launch");
    }
}

/// Issue 23: `cuMemAllocFromPoolAsync` captured into a graph that is never launched allocates
/// nothing from the pool, so destroying the pool gives all of its memory back, and its charge goes
/// with it (it stayed for ever: a false out-of-memory).
#[test]
fn a_captured_pool_allocation_never_launched_does_not_keep_a_destroyed_pools_charge() {
    let ops = "init ctx 0 poolcreate 0 palloc 0 100m freeasync 0 pcapture 0 100m pooldestroy 0 info alloc 200m stats 0";
    for c in CLIENTS {
        let out = run_capped(c, "256m", ops);
        assert_eq!(out.nth("capture", 0).rc(), 0, "{c}: {}", out.stdout);
        assert_eq!(out.nth("pooldestroy", 0).rc(), 0, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 256 * MIB, "{c}: the destroyed pool's charge went");
        assert_eq!(out.nth("alloc", 0).rc(), 0, "{c}");

        let bare = Run::client(c).bare().args([ops]).run();
        bare.ok();
        assert_eq!(bare.nth("stats", 0).num("bytes_held"), 200 * MIB, "{c}: the plain driver freed the pool");
    }
}
