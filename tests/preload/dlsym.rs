//! Our `dlsym` hook must keep `RTLD_NEXT` meaning what it meant for the real caller, so that
//! other preloaded wrappers (profilers, ncu, malloc hooks) keep working before and after us.

use vramcap_tests::common;
use common::*;
use std::time::Duration;

fn nextwrap() -> std::path::PathBuf {
    build_c();
    ctests_dir().join("libnextwrap.so")
}

#[test]
fn a_wrapper_after_vramcap_finds_the_driver_not_itself() {
    // libvramcap.so:libnextwrap.so — the wrapper's RTLD_NEXT must resolve after *it*.
    let out = Run::client("client_linked")
        .also_preload(nextwrap(), false)
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init version ctx 0 alloc 2g"])
        .timeout(Duration::from_secs(20))
        .run();
    out.ok();
    let v = out.nth("version", 0);
    assert_eq!(v.rc(), 0);
    assert_eq!(v.num("v"), 13050);
    assert!(out.stderr.contains("nextwrap: version_calls=1"), "{}", out.stderr);
    assert_eq!(out.nth("alloc", 0).rc(), 2, "the cap applies");
}

#[test]
fn a_wrapper_before_vramcap_reaches_vramcap_and_the_cap_holds() {
    // libnextwrap.so:libvramcap.so — the wrapper's next cuMemAlloc_v2 is ours.
    let out = Run::client("client_linked")
        .also_preload(nextwrap(), true)
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init version ctx 0 alloc 512m alloc 1g stats 0"])
        .timeout(Duration::from_secs(20))
        .run();
    out.ok();
    assert_eq!(out.nth("version", 0).num("v"), 13050);
    assert_eq!(out.nth("alloc", 0).rc(), 0);
    assert_eq!(out.nth("alloc", 1).rc(), 2, "the wrapper's RTLD_NEXT must reach vramcap");
    assert_eq!(out.nth("stats", 0).num("alloc_calls"), 1);
    assert!(out.stderr.contains("alloc_calls=2"), "{}", out.stderr);
}

#[test]
fn dlsym_of_other_names_and_handles_is_untouched() {
    // client_dlsym resolves everything by dlsym on a RTLD_LOCAL handle, including
    // fakecuda_stats (not a driver name) and cuDriverGetVersion (not wrapped).
    let out = Run::client("client_dlsym").env("VRAMCAP_LIMIT", "1g").args(["init version ctx 0 alloc 1g alloc 1 stats 0"]).run();
    out.ok();
    assert_eq!(out.nth("version", 0).num("v"), 13050);
    assert_eq!(out.nth("alloc", 1).rc(), 2);
    assert_eq!(out.nth("stats", 0).num("alloc_calls"), 1);
}
