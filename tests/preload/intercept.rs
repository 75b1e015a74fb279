//! The foundation: every way a program reaches the driver is capped, lookups are untouched
//! except for what we wrap, and bad configuration fails closed.

use vramcap_tests::common;
use common::*;

#[test]
fn all_three_paths_are_capped_without_calling_the_driver_on_denial() {
    for client in CLIENTS {
        let out = Run::client(client)
            .env("VRAMCAP_LIMIT", "1GiB")
            .args(["init ctx 0 alloc 768m alloc 512m stats 0 free 0 alloc 512m alloc 512m alloc 1 stats 0"])
            .run();
        out.ok();
        assert_eq!(out.nth("init", 0).rc(), 0, "{client}");
        assert_eq!(out.nth("alloc", 0).rc(), 0, "{client}: 768 MiB fits");
        assert_eq!(out.nth("alloc", 1).rc(), 2, "{client}: 768+512 MiB is over 1 GiB");
        // Only the granted allocation reached the driver.
        assert_eq!(out.nth("stats", 0).num("alloc_calls"), 1, "{client}: the denial must not call the driver");
        assert_eq!(out.nth("free", 0).rc(), 0);
        assert_eq!(out.nth("alloc", 2).rc(), 0, "{client}: freed memory is available again");
        assert_eq!(out.nth("alloc", 3).rc(), 0, "{client}: exactly 1 GiB fits");
        assert_eq!(out.nth("alloc", 4).rc(), 2, "{client}: one byte more does not");
        let s = out.nth("stats", 1);
        assert_eq!(s.num("alloc_calls"), 3, "{client}");
        assert_eq!(s.num("bytes_held"), GIB, "{client}");
        assert!(
            out.stderr.contains("vramcap: denied cuMemAlloc_v2 of 536870912 bytes"),
            "{client}: denial line missing: {}",
            out.stderr
        );
        assert!(out.stderr.lines().all(|l| l.starts_with("vramcap:") || l.starts_with("fakecuda:")), "{}", out.stderr);
    }
}

#[test]
fn without_the_preload_the_same_requests_succeed() {
    // The control for the test above: the fake driver itself would have granted the denied one.
    let out = Run::client("client_procaddr").bare().args(["init ctx 0 alloc 768m alloc 512m"]).run();
    out.ok();
    assert_eq!(out.nth("alloc", 1).rc(), 0);
}

#[test]
fn legacy_v1_abi_is_capped_and_gets_a_32_bit_out_param() {
    for client in CLIENTS {
        let out = Run::client(client)
            .env("VRAMCAP_LIMIT", "64m")
            .args(["init ctx 0 alloc1 48m alloc1 32m stats 0 free1 0 alloc1 32m info1"])
            .run();
        out.ok();
        let a = out.nth("alloc1", 0);
        assert_eq!(a.rc(), 0, "{client}");
        assert_eq!(a.get("canary"), "ok", "{client}: a v2 wrapper given to a v1 caller overwrites the canary");
        assert!(a.num("ptr") <= u32::MAX as u64);
        assert_eq!(out.nth("alloc1", 1).rc(), 2, "{client}");
        assert_eq!(out.nth("stats", 0).num("alloc_calls"), 1, "{client}");
        assert_eq!(out.nth("free1", 0).rc(), 0);
        assert_eq!(out.nth("alloc1", 2).rc(), 0, "{client}");
        let info = out.nth("info1", 0);
        assert_eq!(info.num("total"), 64 * MIB, "{client}");
        assert_eq!(info.num("free"), 32 * MIB, "{client}");
    }
}

#[test]
fn memory_views_are_virtualised() {
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "0=4GiB")
        .env("FAKECUDA_MEM", "16GiB")
        .args(["init ctx 0 info total 0 total 1 alloc 1g info ctx 1 info"])
        .run();
    out.ok();
    let i0 = out.nth("info", 0);
    assert_eq!((i0.num("free"), i0.num("total")), (4 * GIB, 4 * GIB));
    assert_eq!(out.nth("total", 0).num("bytes"), 4 * GIB);
    assert_eq!(out.nth("total", 1).num("bytes"), 16 * GIB, "device 1 has no limit");
    let i1 = out.nth("info", 1);
    assert_eq!((i1.num("free"), i1.num("total")), (3 * GIB, 4 * GIB));
    let i2 = out.nth("info", 2);
    assert_eq!(i2.num("total"), 16 * GIB, "device 1's view is physical");
}

#[test]
fn virtual_free_never_exceeds_physical_free() {
    // The limit is above the card: the card's numbers win.
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "64GiB")
        .env("FAKECUDA_MEM", "2GiB")
        .args(["init ctx 0 alloc 1g info total 0"])
        .run();
    out.ok();
    let i = out.nth("info", 0);
    assert_eq!((i.num("free"), i.num("total")), (GIB, 2 * GIB));
    assert_eq!(out.nth("total", 0).num("bytes"), 2 * GIB);
}

#[test]
fn null_out_params_get_the_drivers_own_answer() {
    let with = Run::client("client_dlsym").env("VRAMCAP_LIMIT", "1g").args(["init ctx 0 infonull"]).run();
    let without = Run::client("client_dlsym").bare().args(["init ctx 0 infonull"]).run();
    with.ok();
    without.ok();
    assert_eq!(with.nth("info", 0).rc(), without.nth("info", 0).rc());
}

#[test]
fn a_pointer_we_did_not_hand_out_is_freed_by_the_driver_untouched() {
    let run = |bare: bool| {
        let r = Run::client("client_linked").env("VRAMCAP_LIMIT", "1g").args(["init ctx 0 alloc 512m freeptr 0x12345600 info"]);
        if bare { r.bare() } else { r }.run()
    };
    let (with, without) = (run(false), run(true));
    with.ok();
    without.ok();
    assert_eq!(with.nth("freeptr", 0).rc(), without.nth("freeptr", 0).rc(), "the driver's own error code");
    assert_ne!(with.nth("freeptr", 0).rc(), 0);
    assert_eq!(with.nth("info", 0).num("free"), 512 * MIB, "the charge for the live allocation is intact");
}

#[test]
fn per_device_lists_overrides_percent_and_uuid_keys() {
    let cases: &[(&[(&str, &str)], [u64; 2])] = &[
        (&[("VRAMCAP_LIMIT", "0=2g,1=1g")], [2 * GIB, GIB]),
        (&[("VRAMCAP_LIMIT", "3g"), ("VRAMCAP_LIMIT_1", "512m")], [3 * GIB, 512 * MIB]),
        (&[("VRAMCAP_LIMIT", "25%")], [4 * GIB, 2 * GIB]),
        (&[("VRAMCAP_LIMIT", "GPU-8932f938=1GiB")], [16 * GIB, GIB]),
        (&[("VRAMCAP_LIMIT", "0")], [16 * GIB, 8 * GIB]),
        (&[("CUDA_DEVICE_MEMORY_LIMIT", "6g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "1024m")], [6 * GIB, GIB]),
        (&[("CUDA_DEVICE_MEMORY_LIMIT", "6g"), ("VRAMCAP_LIMIT", "2g")], [2 * GIB, 2 * GIB]),
    ];
    for (vars, want) in cases {
        let mut r = Run::client("client_procaddr").env("FAKECUDA_MEM", "16g,8g").args(["init total 0 total 1"]);
        for (k, v) in vars.iter() {
            r = r.env(k, v);
        }
        let out = r.run();
        out.ok();
        assert_eq!(out.nth("init", 0).rc(), 0, "{vars:?}: {}", out.stderr);
        let got = [out.nth("total", 0).num("bytes"), out.nth("total", 1).num("bytes")];
        assert_eq!(&got, want, "{vars:?}");
    }
}

#[test]
fn percent_limit_is_enforced_on_allocation() {
    let out = Run::client("client_dlsym")
        .env("FAKECUDA_MEM", "8g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1024m")
        .args(["init ctx 0 alloc 1g alloc 1"])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0);
    assert_eq!(out.nth("alloc", 1).rc(), 2, "HAMi's variable is a real cap");
}

#[test]
fn invalid_configuration_fails_closed_with_a_clear_message() {
    for (var, value, needle) in [
        ("VRAMCAP_LIMIT", "abc", "VRAMCAP_LIMIT=\"abc\""),
        ("VRAMCAP_LIMIT", "1.5x", "VRAMCAP_LIMIT=\"1.5x\""),
        ("VRAMCAP_LIMIT", "-1", "negative"),
        // A bare number below 1 MiB is a missing unit, not a cap that denies everything.
        ("VRAMCAP_LIMIT", "8", "`8` has no unit"),
        ("VRAMCAP_LIMIT", "0=1g,7=1g", "device 7 does not exist"),
        ("VRAMCAP_LIMIT", "GPU-ffff=1g", "no visible GPU"),
        ("VRAMCAP_LIMIT_9", "1g", "device 9 does not exist"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "lots", "CUDA_DEVICE_MEMORY_LIMIT"),
    ] {
        for client in CLIENTS {
            let out = Run::client(client).env(var, value).args(["init ctx 0 alloc 1m stats 0"]).run();
            out.ok();
            assert_ne!(out.nth("init", 0).rc(), 0, "{client} {var}={value}: cuInit must fail");
            assert_ne!(out.nth("alloc", 0).rc(), 0, "{client} {var}={value}: nothing may be handed out");
            assert_eq!(out.nth("stats", 0).num("bytes_held"), 0);
            assert!(out.stderr.contains(needle), "{client} {var}={value}: stderr lacks {needle:?}:\n{}", out.stderr);
            assert!(out.stderr.contains("expected"), "the message names the expected form:\n{}", out.stderr);
        }
    }
}

#[test]
fn disable_is_a_pure_pass_through() {
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_DISABLE", "1")
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init ctx 0 alloc 2g info"])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0);
    assert_eq!(out.nth("info", 0).num("total"), 16 * GIB);
    assert!(out.stderr.is_empty(), "{}", out.stderr);
}

#[test]
fn sixteen_threads_random_alloc_free_leave_exactly_zero() {
    // Generous cap: every denial would be a false one.
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "15g")
        .env("FAKECUDA_MEM", "16g")
        .args(["init ctx 0 threads 16 100000 1m 7 info stats 0"])
        .run();
    out.ok();
    let t = out.nth("threads", 0);
    assert_eq!(t.num("oom"), 0, "false denials");
    assert_eq!(t.num("other"), 0);
    assert!(t.num("ok") > 700_000, "{t:?}");
    let i = out.nth("info", 0);
    assert_eq!(i.num("free"), i.num("total"), "usage must be exactly 0 at the end");
    assert_eq!(i.num("total"), 15 * GIB);
    assert_eq!(out.nth("stats", 0).num("bytes_held"), 0);
}

#[test]
fn sixteen_threads_under_a_tight_cap_never_exceed_it_and_end_at_zero() {
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "8m")
        .args(["init ctx 0 threads 16 20000 1m 11 info stats 0"])
        .run();
    out.ok();
    let t = out.nth("threads", 0);
    // One thread alone keeps up to 64 allocations of up to 1 MiB live: 8 MiB always bites,
    // however the threads happen to be scheduled.
    assert!(t.num("oom") > 0, "the cap should bite: {t:?}");
    assert_eq!(t.num("other"), 0);
    // The fake driver's high-water mark is the ground truth for "never exceeded".
    let s = out.nth("stats", 0);
    assert!(s.num("peak") <= 8 * MIB, "driver peak {} above the cap", s.num("peak"));
    assert_eq!(s.num("bytes_held"), 0);
    let i = out.nth("info", 0);
    assert_eq!(i.num("free"), i.num("total"));
}
