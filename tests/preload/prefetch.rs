//! Managed memory counts where it is resident (issue 23, item 5): a prefetch to a device is
//! charged to that device (refused with CUDA_ERROR_OUT_OF_MEMORY, nothing moved, if its cap cannot
//! take it) and un-charged from the device it leaves; a prefetch to the host gives the device's
//! charge back; a free or a context's end un-charges every device the pages count on. Every ABI
//! the CUDA 12 and 13 runtimes ask for (v1, `_v2`, their `_ptsz` variants, the CUDA 13 batch
//! forms) through the three lookup paths; the plain fake driver, which keeps per-page residency
//! itself, is the control: it makes the move, and its own per-device count is what a device holds.

use vramcap_tests::common;
use common::*;

/// Device 0 can hold the whole allocation; device 1's cap is the 256 MiB.
const LIMITS: &str = "0=1g,1=256m";

/// One ABI: how to prefetch [slot, slot + size) to device `dev`, and the whole slot to the host.
struct Abi {
    name: &'static str,
    to_device: fn(usize, &str, u32) -> String,
    to_host: fn(usize, &str) -> String,
}

const ABIS: [Abi; 9] = [
    Abi { name: "v1", to_device: |k, s, d| format!("prefetch1 {k} 0 {s} {d}"), to_host: |k, s| format!("prefetch1 {k} 0 {s} -1") },
    Abi { name: "v1 ptsz", to_device: |k, s, d| format!("prefetch1p {k} 0 {s} {d}"), to_host: |k, s| format!("prefetch1p {k} 0 {s} -1") },
    Abi { name: "v2", to_device: |k, s, d| format!("prefetch2 {k} 0 {s} 1 {d}"), to_host: |k, s| format!("prefetch2 {k} 0 {s} 2 0") },
    // A device's locality domain is that device's memory; host NUMA is host memory.
    Abi {
        name: "v2 ptsz, locality domain / host NUMA",
        to_device: |k, s, d| format!("prefetch2p {k} 0 {s} 6 {}", d | 1 << 8),
        to_host: |k, s| format!("prefetch2p {k} 0 {s} 3 0"),
    },
    Abi { name: "batch", to_device: |k, s, d| format!("prefetchb 0 1 {k} {s} 1 {d}"), to_host: |k, s| format!("prefetchb 0 1 {k} {s} 2 0") },
    Abi { name: "batch ptsz", to_device: |k, s, d| format!("prefetchb 1 1 {k} {s} 1 {d}"), to_host: |k, s| format!("prefetchb 1 1 {k} {s} 4 0") },
    Abi { name: "discard batch", to_device: |k, s, d| format!("prefetchb 2 1 {k} {s} 1 {d}"), to_host: |k, s| format!("prefetchb 2 1 {k} {s} 2 0") },
    Abi { name: "discard batch ptsz", to_device: |k, s, d| format!("prefetchb 3 1 {k} {s} 1 {d}"), to_host: |k, s| format!("prefetchb 3 1 {k} {s} 2 0") },
    // Two locations in one batch: the range to device 1, and the allocation's last 2 MiB (beyond
    // every range the test sends to device 1) to the host.
    Abi {
        name: "batch, two locations",
        to_device: |k, s, d| format!("prefetchb2 {k} 0 {s} 1 {d} {k} 398m 2m 2 0"),
        to_host: |k, s| format!("prefetchb2 {k} 0 {s} 2 0 {k} 398m 2m 2 0"),
    },
];

fn rcs(out: &Output, op: &str) -> Vec<i64> {
    out.of(op).iter().map(|l| l.rc()).collect()
}

fn held(out: &Output, n: usize) -> u64 {
    out.nth("stats", n).num("bytes_held")
}

#[test]
fn managed_memory_prefetched_to_a_device_is_charged_there() {
    for abi in &ABIS {
        let (dev1, host) = (abi.to_device, abi.to_host);
        // 400 MiB to device 1 (the repro: refused); 200 MiB of it (granted); all of it
        // back to the host (device 1's charge goes); 250 MiB to device 1 again (granted only if it
        // went); then the free, and what device 1 shows free.
        let ops = format!(
            "init ctx 0 managed 400m {} stats 1 {} stats 1 {} stats 1 {} stats 1 free 0 stats 0 stats 1 ctx 1 info",
            dev1(0, "400m", 1),
            dev1(0, "200m", 1),
            host(0, "400m"),
            dev1(0, "250m", 1)
        );
        for c in CLIENTS {
            let out = Run::client(c).env("VRAMCAP_LIMIT", LIMITS).args([ops.as_str()]).run();
            out.ok();
            let why = format!("{c}, {}: {ops}\n{}{}", abi.name, out.stdout, out.stderr);
            assert_eq!(rcs(&out, "prefetch"), vec![2, 0, 0, 0], "{why}");
            let dev1_held: Vec<u64> = (0..4).map(|n| held(&out, n)).collect();
            assert_eq!(dev1_held, vec![0, 200 * MIB, 0, 250 * MIB], "what device 1 really holds, {why}");
            assert!(dev1_held.iter().all(|&b| b <= 256 * MIB), "{why}");
            assert_eq!((held(&out, 4), held(&out, 5)), (0, 0), "the free gives back every page, {why}");
            assert_eq!(out.nth("info", 0).num("free"), 256 * MIB, "nothing stays charged on device 1, {why}");
            assert!(out.stderr.contains("on device 1"), "the denial names device 1, {why}");

            let bare = Run::client(c).bare().args([ops.as_str()]).run();
            bare.ok();
            assert_eq!(rcs(&bare, "prefetch"), vec![0, 0, 0, 0], "{c}, {}: the plain driver moves it", abi.name);
            // All of it (but the last 2 MiB that the two-location batch sends to the host).
            let moved = if abi.name.contains("two locations") { 398 } else { 400 };
            assert_eq!(held(&bare, 0), moved * MIB, "{c}, {}: device 1 holds it there\n{}", abi.name, bare.stdout);
        }
    }
}

#[test]
fn memory_that_leaves_a_device_is_no_longer_charged_there() {
    // 200 MiB allocated on device 0 (cap 256 MiB each) moves to device 1: device 0 has room for
    // 200 MiB more, device 1 has none, until the first goes back to the host.
    let ops = "init ctx 0 managed 200m prefetch2 0 0 200m 1 1 managed 200m prefetch1 1 0 200m 1 \
               prefetch1 0 0 200m -1 prefetch1 1 0 200m 1 stats 0 stats 1";
    for c in CLIENTS {
        let out = Run::client(c).env("VRAMCAP_LIMIT", "256m").args([ops]).run();
        out.ok();
        assert_eq!(rcs(&out, "managed"), vec![0, 0], "{c}: {}", out.stdout);
        assert_eq!(rcs(&out, "prefetch"), vec![0, 2, 0, 0], "{c}: {}{}", out.stdout, out.stderr);
        assert_eq!((held(&out, 0), held(&out, 1)), (0, 200 * MIB), "{c}: {}", out.stdout);

        let bare = Run::client(c).bare().args([ops]).run();
        bare.ok();
        assert_eq!(rcs(&bare, "prefetch"), vec![0, 0, 0, 0], "{c}");
    }
}

#[test]
fn the_end_of_the_context_un_charges_every_device_the_pages_are_on() {
    // The primary context's last release frees its managed memory wherever it is resident.
    let ops = "init ctx 0 managed 200m prefetch1 0 0 200m 1 release2 0 ctx 1 managed 200m stats 1";
    for c in CLIENTS {
        let out = Run::client(c).env("VRAMCAP_LIMIT", "256m").args([ops]).run();
        out.ok();
        assert_eq!(rcs(&out, "managed"), vec![0, 0], "{c}: {}{}", out.stdout, out.stderr);
        assert_eq!(held(&out, 0), 200 * MIB, "{c}");
        let bare = Run::client(c).bare().env("FAKECUDA_MEM", "256m").args([ops]).run();
        bare.ok();
        assert_eq!(rcs(&bare, "managed"), vec![0, 0], "{c}: the plain driver freed it");
    }
}

#[test]
fn a_prefetch_vramcap_cannot_place_is_refused_before_the_driver() {
    // A range past the allocation's end (not one allocation vramcap counts) to a capped device,
    // and a location type vramcap cannot place.
    let ops = "init ctx 0 managed 4m prefetch1 0 2m 4m 1 prefetch2 0 0 4m 5 0 calls cuMemPrefetchAsync calls cuMemPrefetchAsync_v2";
    for c in CLIENTS {
        let out = Run::client(c).env("VRAMCAP_LIMIT", "256m").args([ops]).run();
        out.ok();
        assert_eq!(rcs(&out, "prefetch"), vec![801, 1], "{c}: {}", out.stdout);
        assert_eq!((out.nth("calls", 0).num("n"), out.nth("calls", 1).num("n")), (0, 0), "{c}: the driver never saw them");
        assert!(out.stderr.contains("not one cuMemAllocManaged allocation"), "{c}: says why:\n{}", out.stderr);
        let bare = Run::client(c).bare().args([ops]).run();
        bare.ok();
        assert_eq!(rcs(&bare, "prefetch"), vec![1, 1], "{c}: the plain driver refuses both itself");
    }
}

/// `cuMemPrefetchAsync_v2` to location type device with id −1 (v1's `CU_DEVICE_CPU`, which is
/// no device in a `CUmemLocation`): refused as the driver refuses it, with a line that says the
/// id names no device and how to name the host, not that the type is unknown.
#[test]
fn a_prefetch_to_device_minus_one_says_the_id_names_no_device() {
    let ops = "init ctx 0 managed 4m prefetch2 0 0 4m 1 -1 calls cuMemPrefetchAsync_v2";
    for c in CLIENTS {
        let bare = Run::client(c).bare().args([ops]).run();
        bare.ok();
        let out = Run::client(c).env("VRAMCAP_LIMIT", "256m").args([ops]).run();
        out.ok();
        assert_eq!(rcs(&out, "prefetch"), rcs(&bare, "prefetch"), "{c}: the driver's own answer: {}", out.stdout);
        assert_eq!(out.nth("calls", 0).num("n"), 0, "{c}: refused before the driver");
        assert!(
            out.stderr.contains("with id -1 names no device") && out.stderr.contains("location type 2 (CU_MEM_LOCATION_TYPE_HOST)"),
            "{c}: says what is wrong:\n{}",
            out.stderr
        );
    }
}

#[test]
fn a_batch_whose_operations_overlap_counts_every_place_they_may_leave_it() {
    // A batch's operations run in no set order (documented): [0, 200 MiB) to device 1 and the same
    // range to the host may leave it on device 1. It counts there (100 MiB more on device 1 is
    // denied) until a prefetch sends all of it to the host; under a 100 MiB cap on device 1 the
    // batch is refused.
    let batch = "prefetchb2 0 0 200m 1 1 0 0 200m 2 0";
    let ops = format!("init ctx 0 managed 200m {batch} ctx 1 info alloc 100m prefetch1 0 0 200m -1 ctx 1 info alloc 100m");
    for c in CLIENTS {
        let out = Run::client(c).env("VRAMCAP_LIMIT", LIMITS).args([ops.as_str()]).run();
        out.ok();
        let why = format!("{c}: {ops}\n{}{}", out.stdout, out.stderr);
        assert_eq!(rcs(&out, "prefetch"), vec![0, 0], "{why}");
        let free: Vec<u64> = (0..2).map(|n| out.nth("info", n).num("free")).collect();
        assert_eq!(free, vec![56 * MIB, 256 * MIB], "device 1 counts it until it is all on the host, {why}");
        assert_eq!(rcs(&out, "alloc"), vec![2, 0], "{why}");

        let small = format!("init ctx 0 managed 200m {batch} ctx 1 info");
        let out = Run::client(c).env("VRAMCAP_LIMIT", "0=1g,1=100m").args([small.as_str()]).run();
        out.ok();
        assert_eq!(rcs(&out, "prefetch"), vec![2], "{c}: refused, nothing moved\n{}{}", out.stdout, out.stderr);
        assert_eq!(out.nth("info", 0).num("free"), 100 * MIB, "{c}: nothing stays charged on device 1");

        let bare = Run::client(c).bare().args([ops.as_str()]).run();
        bare.ok();
        assert_eq!((rcs(&bare, "prefetch"), rcs(&bare, "alloc")), (vec![0, 0], vec![0, 0]), "{c}: the plain driver takes it");
    }
}
