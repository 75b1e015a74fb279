//! CUDA arrays are charged what the driver's documentation says they take (issue 23): a layered or
//! cubemap mipmapped array has every layer at every level (`Depth` is the layer count, never
//! halved), and a sparse or deferred-mapping array has no physical backing when it is created
//! (its memory comes from `cuMemCreate`, charged there). Each runs through the three lookup paths;
//! the fake driver's own statistics (`stats`) are the device's side, and the bare runs show the fake
//! keeps the same rules without vramcap.

use vramcap_tests::common;
use common::*;

// 1024² floats, 10 layers, 4 levels: 10 × 4 × (1024² + 512² + 256² + 128²) bytes.
const LAYERED: u64 = 10 * 4 * (1024 * 1024 + 512 * 512 + 256 * 256 + 128 * 128);
// 512² floats, a cubemap (6 faces), 3 levels.
const CUBE: u64 = 6 * 4 * (512 * 512 + 256 * 256 + 128 * 128);

fn rcs(out: &Output, op: &str) -> Vec<i64> {
    out.of(op).iter().map(|l| l.rc()).collect()
}

#[test]
fn layered_and_cubemap_mipmapped_arrays_keep_every_layer_at_every_level() {
    // The plain fake driver: what the device really takes.
    for c in CLIENTS {
        let out = Run::client(c).bare().args(["init ctx 0 arrayx 1024 1024 10 4 1 stats 0 arrayx 512 512 6 3 4 stats 0"]).run();
        out.ok();
        assert_eq!(rcs(&out, "array"), vec![0, 0], "{c} bare: {}", out.stdout);
        assert_eq!(out.nth("stats", 0).num("bytes_held"), LAYERED, "{c} bare");
        assert_eq!(out.nth("stats", 1).num("bytes_held"), LAYERED + CUBE, "{c} bare");
    }
    for c in CLIENTS {
        let out = run_capped(c, "64m", "init ctx 0 arrayx 1024 1024 10 4 1 info arrayx 512 512 6 3 4 info mipfree 1 mipfree 0 info");
        assert_eq!(rcs(&out, "array"), vec![0, 0], "{c}: {}", out.stdout);
        assert_eq!(64 * MIB - out.nth("info", 0).num("free"), LAYERED, "{c}: layered, charged as the device holds it");
        assert_eq!(64 * MIB - out.nth("info", 1).num("free"), LAYERED + CUBE, "{c}: cubemap");
        assert_eq!(out.nth("info", 2).num("free"), 64 * MIB, "{c}: both given back");
        // Past the cap by what the halved layers would have hidden: denied, and the device agrees.
        let out = run_capped(c, "64m", "init ctx 0 arrayx 1024 1024 10 4 1 alloc 11m stats 0");
        assert_eq!(rcs(&out, "alloc"), vec![2], "{c}: {}", out.stdout);
        assert!(out.nth("stats", 0).num("peak") <= 64 * MIB, "{c}: the device held more than the cap");
    }
}

#[test]
fn sparse_and_deferred_mapping_arrays_take_no_memory_until_mapped() {
    // 16384² floats = 1 GiB each: a sparse 3D array, a deferred-mapping mipmapped array.
    let ops = "init ctx 0 arrayx 16384 16384 0 0 64 arrayx 16384 16384 0 4 128 arrayx 16384 16384 1 0 192 info stats 0 alloc 200m";
    for c in CLIENTS {
        let out = Run::client(c).bare().args([ops]).run();
        out.ok();
        assert_eq!(rcs(&out, "array"), vec![0, 0, 0], "{c} bare: {}", out.stdout);
        assert_eq!(out.nth("stats", 0).num("bytes_held"), 0, "{c} bare: no physical backing");
    }
    for c in CLIENTS {
        let out = run_capped(c, "256m", ops);
        assert_eq!(rcs(&out, "array"), vec![0, 0, 0], "{c}: no false out-of-memory: {}", out.stdout);
        assert_eq!(out.nth("info", 0).num("free"), 256 * MIB, "{c}: nothing charged");
        assert_eq!(rcs(&out, "alloc"), vec![0], "{c}");
        // The same array with backing is charged in full.
        let out = run_capped(c, "256m", "init ctx 0 arrayx 16384 16384 0 0 0");
        assert_eq!(rcs(&out, "array"), vec![2], "{c}: {}", out.stdout);
    }
}

// 4096 × 2048 floats: the documentation clamps the level count to [1, 1 + floor(log2(4096))] = [1, 13].
fn pyramid(w: u64, h: u64, levels: u32) -> u64 {
    (0..levels).map(|l| (w >> l).max(1) * (h >> l).max(1) * 4).sum()
}

#[test]
fn mipmapped_level_counts_are_clamped_as_documented() {
    // 65 levels (past 64, where a shift by the level wraps) and u32::MAX levels are 13; 0 is 1.
    let full = pyramid(4096, 2048, 13);
    let ops = "init ctx 0 mipmap 4096 2048 65 stats 0 mipmap 4096 2048 4294967295 stats 0 mipfree 1 mipfree 0 mipmap 4096 2048 0 stats 0";
    for c in CLIENTS {
        let out = Run::client(c).bare().args([ops]).run();
        out.ok();
        assert_eq!(rcs(&out, "array"), vec![0, 0, 0], "{c} bare: {}", out.stdout);
        assert_eq!(out.nth("stats", 0).num("bytes_held"), full, "{c} bare");
        assert_eq!(out.nth("stats", 1).num("bytes_held"), 2 * full, "{c} bare");
        assert_eq!(out.nth("stats", 2).num("bytes_held"), pyramid(4096, 2048, 1), "{c} bare");
    }
    for c in CLIENTS {
        // ~42.7 MiB under a 64 MiB cap: it fits, however many levels are asked for.
        let out = run_capped(c, "64m", "init ctx 0 mipmap 4096 2048 65 info mipfree 0 mipmap 4096 2048 4294967295 info mipfree 1 mipmap 4096 2048 0 info");
        assert_eq!(rcs(&out, "array"), vec![0, 0, 0], "{c}: no false out-of-memory: {}", out.stdout);
        assert_eq!(64 * MIB - out.nth("info", 0).num("free"), full, "{c}: charged as the device holds it");
        assert_eq!(64 * MIB - out.nth("info", 1).num("free"), full, "{c}");
        assert_eq!(64 * MIB - out.nth("info", 2).num("free"), pyramid(4096, 2048, 1), "{c}");
    }
}
