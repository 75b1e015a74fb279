//! Every other way a framework gets device memory is capped through all three lookup paths:
//! each family reaches the cap, is denied without the driver being asked, frees, and is granted
//! again. The procaddr client gets `_ptsz` variants through cuGetProcAddress with flags=2.

use vramcap_tests::common;
use common::*;

fn rcs(out: &Output, op: &str) -> Vec<i64> {
    out.of(op).iter().map(|l| l.rc()).collect()
}

#[test]
fn pitch_is_charged_pitch_times_height() {
    for c in CLIENTS {
        // 1000-byte rows get a 1024-byte pitch: 1024 × 32768 = 32 MiB each; the cap holds two.
        let out = run_capped(c, "64m", "init ctx 0 pitch 1000 32768 pitch 1000 32768 info pitch 1000 1 free 0 pitch 1000 32768 stats 0");
        assert_eq!(rcs(&out, "pitch"), vec![0, 0, 2, 0], "{c}");
        assert_eq!(out.nth("pitch", 0).num("pitch"), 1024);
        assert_eq!(out.nth("info", 0).num("free"), 0, "{c}: exactly pitch × height charged");
        assert_eq!(out.nth("stats", 0).num("alloc_calls"), 3, "{c}: the denial never reached the driver");
    }
}

#[test]
fn managed_memory_counts_as_device_memory() {
    for c in CLIENTS {
        let out = run_capped(c, "64m", "init ctx 0 managed 48m managed 32m free 0 managed 32m info");
        assert_eq!(rcs(&out, "managed"), vec![0, 2, 0], "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 32 * MIB, "{c}");
    }
}

#[test]
fn vmm_handles_are_charged_once_however_often_mapped() {
    for c in CLIENTS {
        let out = run_capped(
            c,
            "64m",
            "init ctx 0 vmm 48m 0 vmmmap 0 info vmm 32m 0 vmmhost 32m release 0 vmm 32m 0 vmm 32m 0 vmm 2m 0 info",
        );
        assert_eq!(rcs(&out, "vmm"), vec![0, 2, 0, 0, 2], "{c}");
        assert_eq!(out.nth("vmmmap", 0).rc(), 0, "{c}: mapped twice, written through");
        assert_eq!(out.nth("info", 0).num("free"), 16 * MIB, "{c}: mappings are not counted");
        assert_eq!(out.nth("vmmhost", 0).rc(), 0, "{c}: host locations are not device memory");
        assert_eq!(out.nth("release", 0).rc(), 0);
        assert_eq!(out.nth("info", 1).num("free"), 0, "{c}");
    }
}

#[test]
fn async_allocations_charge_what_the_default_pool_reserves() {
    for c in CLIENTS {
        // Default pool (release threshold 0): freed memory stays reserved until a synchronize.
        let out = run_capped(
            c,
            "64m",
            "init ctx 0 async 40m asyncp 30m freeasync 0 info async 40m sync info \
             freeasyncp 2 syncp info async 40m asyncp 20m info freeasync 3 freeasync 4 ctxsync info",
        );
        assert_eq!(rcs(&out, "async"), vec![0, 2, 0, 0, 0], "{c}: _ptsz growth past the cap is denied");
        assert_eq!(out.nth("info", 0).num("free"), 24 * MIB, "{c}: the pool still holds the freed 40 MiB");
        assert_eq!(out.nth("info", 1).num("free"), 24 * MIB, "{c}: served from the pool, not denied");
        assert_eq!(out.nth("info", 2).num("free"), 64 * MIB, "{c}: given back at the synchronize");
        assert_eq!(out.nth("info", 3).num("free"), 4 * MIB, "{c}");
        assert_eq!(out.nth("info", 4).num("free"), 64 * MIB, "{c}: usage back to zero");
    }
}

#[test]
fn a_pool_that_keeps_memory_stays_charged_until_trimmed() {
    for c in CLIENTS {
        let out = run_capped(
            c,
            "64m",
            "init ctx 0 poolcreate 0 keep 0 palloc 0 40m freeasync 0 sync info reserved 0 \
             async 30m reserved 0 info freeasync 1 sync pallocp 0 40m freeasyncp 2 sync info trim 0 0 info",
        );
        assert_eq!(rcs(&out, "palloc"), vec![0, 0], "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 24 * MIB, "{c}: threshold max keeps it reserved");
        assert_eq!(out.nth("reserved", 0).num("bytes"), 40 * MIB);
        // The driver would give a full device the pool's unused memory; so does the cap.
        assert_eq!(rcs(&out, "async"), vec![0], "{c}: granted after the pool's unused memory was trimmed");
        assert_eq!(out.nth("reserved", 1).num("bytes"), 0, "{c}");
        assert_eq!(out.nth("info", 1).num("free"), 34 * MIB, "{c}");
        assert_eq!(out.nth("info", 2).num("free"), 24 * MIB, "{c}: kept again after the free");
        assert_eq!(out.nth("info", 3).num("free"), 64 * MIB, "{c}: an explicit trim releases it");
    }
}

#[test]
fn repeated_async_alloc_free_never_fails_falsely() {
    // The HAMi-core false-OOM regression: a cap just above one allocation.
    for c in CLIENTS {
        let out = run_capped(c, "65m", "init ctx 0 cycles 10000 64m 0 cycles 10000 64m 1 cycles 2000 64m 7 info");
        for l in out.of("cycles") {
            assert_eq!((l.num("oom"), l.num("other")), (0, 0), "{c}: {l:?}");
        }
        assert_eq!(out.nth("cycles", 0).num("ok"), 10000);
        assert_eq!(out.nth("cycles", 1).num("ok"), 10000);
    }
}

#[test]
fn arrays_are_charged_from_their_descriptor() {
    for c in CLIENTS {
        // float 2048 × 4096 = 32 MiB; 3D 1024 × 1024 × 8 × 4 = 32 MiB; mipmap 1024² floats = 4 MiB + 1/3.
        let out = run_capped(
            c,
            "64m",
            "init ctx 0 array 2048 4096 array3d 1024 1024 8 mipmap 1024 1024 4 arrfree 1 mipmap 1024 1024 4 info",
        );
        assert_eq!(rcs(&out, "array"), vec![0, 0, 2, 0], "{c}");
        let used = 64 * MIB - out.nth("info", 0).num("free");
        assert_eq!(used, 32 * MIB + 4 * (1024 * 1024 + 512 * 512 + 256 * 256 + 128 * 128), "{c}");
    }
}

/// The legacy ABIs a driver still hands out for an old version (32-bit pitch and descriptors):
/// each is the same memory as its current ABI and is capped the same way. On the old code the
/// runtime's way got the driver's unwrapped function (uncounted), the linked and dlsym ways the
/// driver's own export.
#[test]
fn legacy_abis_are_capped_like_the_current_ones() {
    for c in CLIENTS {
        // 1000-byte rows → 1024-byte pitch: 1024 × 32768 = 32 MiB each; the cap holds two.
        let out = run_capped(c, "64m", "init ctx 0 pitch1 1000 32768 pitch 1000 32768 pitch1 1000 1 free 0 pitch1 1000 32768 info stats 0");
        assert_eq!(rcs(&out, "pitch1"), vec![0, 2, 0], "{c}");
        assert_eq!(out.nth("pitch1", 0).num("pitch"), 1024, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 0, "{c}: exactly pitch × height charged");
        assert_eq!(out.nth("stats", 0).num("alloc_calls"), 3, "{c}: the denial never reached the driver");
        // float 2048 × 4096 = 32 MiB; 3D 1024 × 1024 × 8 floats = 32 MiB; a third does not fit.
        let out = run_capped(c, "64m", "init ctx 0 array1 2048 4096 array3d1 1024 1024 8 array1 1 1 arrfree 0 array1 2048 4096 info");
        assert_eq!(rcs(&out, "array1"), vec![0, 0, 2, 0], "{c}");
        assert_eq!(out.nth("info", 0).num("free"), 0, "{c}");
        // Host memory and IPC through the legacy ABIs: work, traced, never counted.
        let out = run_capped(c, "1m", "init ctx 0 host1 64m info");
        assert_eq!(out.nth("host1", 0).rc(), 0, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), MIB, "{c}");
        assert!(!out.stderr.contains("vramcap"), "{c}: {}", out.stderr);
    }
}

#[test]
fn destroying_a_context_releases_its_charges() {
    for c in CLIENTS {
        // The context's own memory goes with it; the VMM handle (slot 2) is the device's and stays
        // until released (tests/preload/lifetimes_ctx.rs has the other ways a context ends).
        let out = run_capped(
            c,
            "64m",
            "init ctx 0 newctx 0 alloc 32m array 2048 2048 vmm 16m 0 alloc 1m ctxdestroy 0 ctx 0 info alloc 60m \
             release 2 alloc 60m",
        );
        assert_eq!(rcs(&out, "alloc"), vec![0, 2, 2, 0], "{c}");
        assert_eq!(out.nth("ctxdestroy", 0).rc(), 0);
        assert_eq!(out.nth("info", 0).num("free"), 48 * MIB, "{c}");
        let out = run_capped(c, "64m", "init ctx 0 alloc 60m reset 0 ctx 0 info alloc 60m");
        assert_eq!(rcs(&out, "alloc"), vec![0, 0], "{c}: a primary context reset releases too");
    }
}

#[test]
fn host_and_ipc_memory_is_not_counted() {
    for c in CLIENTS {
        let out = run_capped(c, "1m", "init ctx 0 host 64m info");
        assert_eq!(out.nth("host", 0).rc(), 0, "{c}");
        assert_eq!(out.nth("info", 0).num("free"), MIB, "{c}");
    }
}

#[test]
fn nvml_and_cuda_views_agree() {
    // NVML numbers devices in reverse here: handles are matched to CUDA ordinals by UUID.
    let out = Run::client("client_nvml")
        .env("VRAMCAP_LIMIT", "1=4GiB")
        .env("FAKECUDA_MEM", "16GiB")
        .env("FAKENVML_REVERSE", "1")
        .args(["init ctx 1 alloc 1024 cuinfo nvml 0 nvml2 0 nvmlsym 0 nvmlnull 0 nvml 1"])
        .run();
    out.ok();
    let cu = out.nth("cuinfo", 0);
    assert_eq!((cu.num("total"), cu.num("free")), (4 * GIB, 3 * GIB));
    for i in 0..3 {
        let n = out.nth("nvml", i);
        assert_eq!(n.rc(), 0);
        assert_eq!((n.num("total"), n.num("free"), n.num("used")), (4 * GIB, 3 * GIB, GIB), "nvml line {i}");
    }
    assert_ne!(out.nth("nvml", 3).rc(), 0, "NULL is the library's to refuse, without a crash");
    let other = out.nth("nvml", 4);
    assert_eq!((other.num("total"), other.num("used")), (16 * GIB, 0), "device 0 is uncapped: physical view");
}

/// NVML asked before (or without) CUDA: the cap shows, and CUDA stays uninitialised. Ordinal keys
/// follow CUDA_VISIBLE_DEVICES over the PCI bus order; UUID keys and uniform limits need no order.
/// Main showed the physical 8 GiB here.
#[test]
fn nvml_before_cuda_shows_the_cap() {
    let nvml = |vars: &[(&str, &str)], ops: &str| {
        let mut r = Run::client("client_nvml").env("FAKECUDA_DEVICE_COUNT", "2").env("FAKECUDA_MEM", "8g");
        for (k, v) in vars {
            r = r.env(k, v);
        }
        let out = r.args([ops]).run();
        out.ok();
        assert!(!out.stderr.contains("vramcap"), "{vars:?}: {}", out.stderr);
        // Never initialises CUDA from inside an NVML call.
        assert_eq!(out.nth("cucount", 0).rc(), 3, "{vars:?}: CUDA was initialised");
        out.of("nvml").iter().map(|l| (l.num("total") / MIB, l.num("free") / MIB, l.num("used") / MIB)).collect::<Vec<_>>()
    };
    let ops = "nvml 0 nvml 1 nvml2 0 nvmlsym 1 cucount";
    let lim = ("VRAMCAP_LIMIT", "0=1g,1=2g");
    assert_eq!(nvml(&[lim], ops), vec![(1024, 1024, 0), (2048, 2048, 0), (1024, 1024, 0), (2048, 2048, 0)]);
    // NVML numbers GPUs its own way: the PCI bus decides, not NVML's index.
    assert_eq!(nvml(&[lim, ("FAKENVML_REVERSE", "1")], ops)[..2], [(2048, 2048, 0), (1024, 1024, 0)]);
    // CUDA_VISIBLE_DEVICES reorders CUDA's ordinals: CUDA 0 is the second GPU on the bus.
    assert_eq!(nvml(&[lim, ("CUDA_VISIBLE_DEVICES", "1,0")], ops)[..2], [(2048, 2048, 0), (1024, 1024, 0)]);
    let first = ("VRAMCAP_LIMIT", "0=1g");
    assert_eq!(nvml(&[first, ("CUDA_VISIBLE_DEVICES", "GPU-8932f938")], ops)[..2], [(8192, 8192, 0), (1024, 1024, 0)]);
    // UUID keys and a uniform limit.
    assert_eq!(nvml(&[("VRAMCAP_LIMIT", "GPU-8932f938=3g")], ops)[..2], [(8192, 8192, 0), (3072, 3072, 0)]);
    assert_eq!(nvml(&[("VRAMCAP_LIMIT", "512m"), ("CUDA_VISIBLE_DEVICES", "0")], ops)[..2], [(512, 512, 0), (8192, 8192, 0)]);
    // Once CUDA is up, the same limits hold (matched by UUID then).
    let out = Run::client("client_nvml")
        .env("FAKECUDA_DEVICE_COUNT", "2")
        .env("FAKECUDA_MEM", "8g")
        .env("VRAMCAP_LIMIT", "0=1g,1=2g")
        .args(["nvml 1 init ctx 0 alloc 256 nvml 0 nvml 1"])
        .run();
    out.ok();
    let t: Vec<(u64, u64)> = out.of("nvml").iter().map(|l| (l.num("total") / MIB, l.num("free") / MIB)).collect();
    assert_eq!(t, vec![(2048, 2048), (1024, 768), (2048, 2048)]);
}

/// A handle mapped into a sparse array keeps its memory after `cuMemRelease` and every
/// `cuMemUnmap`, so vramcap refuses `cuMemMapArrayAsync` (both ABIs) before the driver reads the
/// list, says why once, and the bare driver shows the call would otherwise have reached it.
#[test]
fn sparse_array_mappings_are_refused_before_the_driver_sees_them() {
    let ops = "init ctx 0 maparray maparrayp calls cuMemMapArrayAsync calls cuMemMapArrayAsync_ptsz";
    for c in CLIENTS {
        let out = run_capped(c, "256m", ops);
        assert_eq!(rcs(&out, "maparray"), vec![801, 801], "{c}: CUDA_ERROR_NOT_SUPPORTED");
        assert_eq!(out.nth("calls", 0).num("n"), 0, "{c}: the driver never read the list");
        assert_eq!(out.nth("calls", 1).num("n"), 0, "{c}: nor the _ptsz one's");
        assert_eq!(out.stderr.lines().filter(|l| l.contains("sparse array")).count(), 1, "{c}: one line says why:\n{}", out.stderr);
        assert!(out.stderr.contains("cuMemMapArrayAsync"), "{c}: {}", out.stderr);

        let bare = Run::client(c).bare().args([ops]).run();
        bare.ok();
        assert_eq!(bare.nth("calls", 0).num("n") + bare.nth("calls", 1).num("n"), 2, "{c}: bare, both reach the driver");
    }
    // VRAMCAP_DISABLE=1 passes it through like everything else.
    let off = Run::client("client_linked").env("VRAMCAP_DISABLE", "1").args([ops]).run();
    off.ok();
    assert_eq!(off.nth("calls", 0).num("n"), 1);
    // No cap at all (a trace alone): nothing to get around, so it goes through, without a word.
    let dir = std::env::temp_dir().join(format!("vramcap-families-sparse-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let free = Run::client("client_procaddr").env("VRAMCAP_TRACE", dir.join("t.jsonl")).args([ops]).run();
    free.ok();
    assert_eq!(rcs(&free, "maparray"), vec![801, 801], "the fake's own answer (no sparse support)");
    assert_eq!(free.nth("calls", 0).num("n") + free.nth("calls", 1).num("n"), 2, "{}", free.stderr);
    assert!(!free.stderr.contains("sparse array"), "{}", free.stderr);
    // A group budget is a cap: refused.
    let grouped = Run::client("client_procaddr")
        .env("VRAMCAP_GROUP", "sparse")
        .env("VRAMCAP_GROUP_LIMIT", "1g")
        .env("VRAMCAP_GROUP_DIR", &dir)
        .args([ops])
        .run();
    grouped.ok();
    assert_eq!(grouped.nth("calls", 0).num("n") + grouped.nth("calls", 1).num("n"), 0, "{}", grouped.stderr);
    let _ = std::fs::remove_dir_all(&dir);
}
