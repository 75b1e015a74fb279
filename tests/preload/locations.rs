//! Memory locations (`CUmemLocationType`), as the driver API documents them (issue 23): a device
//! and a device's locality domain (CUDA 13.4) are device memory, only the host types are host
//! memory, and a type vramcap cannot place is refused before the driver sees it. CUDA 13 managed
//! pools are device memory whatever their preferred location. Each runs through the three lookup
//! paths, with the plain fake driver as the control.

use vramcap_tests::common;
use common::*;

/// `CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN`; its id is `deviceId | localityDomainId << 8`.
const DOMAIN: u32 = 6;

fn run(client: &str, ops: &str) -> Output {
    let out = Run::client(client).env("VRAMCAP_LIMIT", "256m").args([ops]).run();
    out.ok();
    out
}

fn bare(client: &str, ops: &str) -> Output {
    let out = Run::client(client).bare().args([ops]).run();
    out.ok();
    out
}

fn rcs(out: &Output, op: &str) -> Vec<i64> {
    out.of(op).iter().map(|l| l.rc()).collect()
}

#[test]
fn vmm_in_a_locality_domain_is_device_memory() {
    // Device 0, domains 0 and 1; then host NUMA node 0 (host memory, never charged).
    let ops = format!("init ctx 0 vmmat 200m {DOMAIN} 0 vmmat 200m {DOMAIN} 256 vmmat 200m 3 0 stats 0 calls cuMemCreate");
    for c in CLIENTS {
        let out = run(c, &ops);
        assert_eq!(rcs(&out, "vmmat"), vec![0, 2, 0], "{c}: {}", out.stdout);
        assert_eq!(out.nth("stats", 0).num("bytes_held"), 200 * MIB, "{c}: what the device holds");
        assert_eq!(out.nth("calls", 0).num("n"), 2, "{c}: the denial never reached the driver");

        let b = bare(c, &ops);
        assert_eq!(rcs(&b, "vmmat"), vec![0, 0, 0], "{c}: the plain driver grants both");
        assert_eq!(b.nth("stats", 0).num("bytes_held"), 400 * MIB, "{c}: the fake holds both domains on device 0");
    }
}

#[test]
fn a_location_vramcap_cannot_place_is_refused_not_passed() {
    // INVALID (0), INVISIBLE (5) and a type newer than any documented one.
    let ops = "init ctx 0 vmmat 2m 0 0 vmmat 2m 5 0 vmmat 2m 99 0 poolat 1 99 0 poolat 2 99 0 calls cuMemCreate calls cuMemPoolCreate";
    for c in CLIENTS {
        let out = run(c, ops);
        assert_eq!(rcs(&out, "vmmat"), vec![1, 1, 1], "{c}: CUDA_ERROR_INVALID_VALUE");
        assert_eq!(rcs(&out, "pool"), vec![1, 1], "{c}: pinned and managed");
        assert_eq!(out.nth("calls", 0).num("n"), 0, "{c}: never passed to the driver");
        assert_eq!(out.nth("calls", 1).num("n"), 0, "{c}");
        assert_eq!(out.stderr.lines().filter(|l| l.contains("location type")).count(), 1, "{c}: one line says why:\n{}", out.stderr);

        let b = bare(c, ops);
        assert_eq!(b.nth("calls", 0).num("n"), 3, "{c}: bare, they reach the driver");
        assert_eq!(rcs(&b, "vmmat"), vec![1, 1, 1], "{c}: which refuses them itself");
    }
}

#[test]
fn a_pool_in_a_locality_domain_is_device_memory() {
    let ops = format!("init ctx 0 poolat 1 {DOMAIN} 256 palloc 0 200m palloc 0 200m stats 0");
    for c in CLIENTS {
        let out = run(c, &ops);
        assert_eq!(out.nth("pool", 0).rc(), 0, "{c}");
        assert_eq!(rcs(&out, "palloc"), vec![0, 2], "{c}: {}", out.stdout);
        assert!(out.nth("stats", 0).num("bytes_held") <= 256 * MIB, "{c}");

        let b = bare(c, &ops);
        assert_eq!(rcs(&b, "palloc"), vec![0, 0], "{c}: the plain driver grants both");
        assert!(b.nth("stats", 0).num("bytes_held") >= 400 * MIB, "{c}: device 0 holds them");
    }
}

/// CUDA 13 managed pools: with no preferred location (`CU_MEM_LOCATION_TYPE_NONE`) or the host as
/// preferred location their pages still become resident on the device that uses them, so they
/// count against the device of the context that creates the pool, like `cuMemAllocManaged`.
#[test]
fn managed_pools_are_device_memory_whatever_they_prefer() {
    for (kind, id) in [(0, 0), (2, 0), (1, 1)] {
        // On device 1 (its context current): the fake places pages there.
        let ops = format!("init ctx 1 poolat 2 {kind} {id} palloc 0 200m palloc 0 200m stats 1");
        for c in CLIENTS {
            let out = Run::client(c).env("VRAMCAP_LIMIT", "1=256m").args([&ops]).run();
            out.ok();
            assert_eq!(out.nth("pool", 0).rc(), 0, "{c} {kind}: {}", out.stderr);
            assert_eq!(rcs(&out, "palloc"), vec![0, 2], "{c} location type {kind}: {}", out.stdout);
            assert!(out.nth("stats", 0).num("bytes_held") <= 256 * MIB, "{c}");

            let b = bare(c, &ops);
            assert_eq!(rcs(&b, "palloc"), vec![0, 0], "{c}: the plain driver grants both");
            assert!(b.nth("stats", 0).num("bytes_held") >= 400 * MIB, "{c} {kind}: device 1 holds them");
        }
    }
}
