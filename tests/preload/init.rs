//! Lazy initialisation: racing first calls, the driver opened from another path, lookups made
//! while the driver is being loaded, and a missing driver.

use vramcap_tests::common;
use common::*;
use std::time::Duration;

#[test]
fn sixty_four_threads_making_their_first_calls_at_once() {
    // client_linked's first call into vramcap is inside the race: configuration, driver handle,
    // real-function slots and limit resolution all initialise under contention.
    for _ in 0..5 {
        let out = Run::client("client_linked")
            .env("VRAMCAP_LIMIT", "1g")
            .args(["race 64 ctx 0 info stats 0"])
            .timeout(Duration::from_secs(30))
            .run();
        out.ok();
        let r = out.nth("race", 0);
        assert_eq!((r.num("ok"), r.num("fail")), (64, 0), "{}", out.stderr);
        let i = out.nth("info", 0);
        assert_eq!((i.num("free"), i.num("total")), (GIB, GIB));
        assert_eq!(out.nth("stats", 0).num("alloc_calls"), 64);
    }
}

#[test]
fn real_driver_from_another_path_with_lookups_in_its_constructor() {
    build_c();
    let dir = std::env::temp_dir().join(format!("vramcap-init-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("libcuda-copy.so");
    std::fs::copy(shim_dir().join("libcuda.so.1"), &copy).unwrap();
    // The app loads target/cuda-shim/libcuda.so.1 at start-up; vramcap opens the copy (another
    // file, so the loader maps it afresh) and the copy's constructor calls dlsym on driver names
    // while vramcap is inside that dlopen. `init` and `total` go through vramcap to the copy.
    let out = Run::client("client_linked")
        .env("VRAMCAP_REAL_LIBCUDA", &copy)
        .env("FAKECUDA_CTOR_LOOKUP", "1")
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init total 0"])
        .timeout(Duration::from_secs(20))
        .run();
    out.ok();
    assert_eq!(out.nth("init", 0).rc(), 0);
    assert_eq!(out.nth("total", 0).num("bytes"), GIB);
    assert_eq!(out.stderr.matches("fakecuda: constructor lookups ok").count(), 2, "{}", out.stderr);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_driver_that_cannot_be_opened_is_reported_and_nothing_is_handed_out() {
    let out = Run::client("client_linked")
        .env("VRAMCAP_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init alloc 1m"])
        .run();
    out.ok();
    assert_ne!(out.nth("init", 0).rc(), 0);
    assert_ne!(out.nth("alloc", 0).rc(), 0);
    assert!(out.stderr.contains("vramcap: cannot open /nonexistent/libcuda.so.1"), "{}", out.stderr);
}

/// A limit whose value is not UTF-8 cannot be read as the cap it meant: treating it as unset ran
/// the job uncapped without a word. It is invalid input on every path, with the variable named.
#[test]
fn a_limit_that_is_not_utf8_fails_closed_on_every_path() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let bad = OsStr::from_bytes(b"1\xffg");
    let cases: [(&str, &[(&str, &str)]); 5] = [
        ("VRAMCAP_LIMIT", &[]),
        ("VRAMCAP_LIMIT_0", &[]),
        ("VRAMCAP_GROUP_LIMIT", &[("VRAMCAP_GROUP", "utf8test")]),
        ("CUDA_DEVICE_MEMORY_LIMIT", &[]),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", &[]),
    ];
    for (var, extra) in cases {
        for client in ["client_linked", "client_dlsym", "client_procaddr"] {
            let mut r = Run::client(client).env(var, bad);
            for (k, v) in extra {
                r = r.env(k, v);
            }
            let out = r.args(["init ctx 0 alloc 1m"]).run();
            assert_ne!(out.nth("init", 0).rc(), 0, "{client} {var}: CUDA initialised with an unreadable limit");
            assert_ne!(out.nth("alloc", 0).rc(), 0, "{client} {var}: memory handed out");
            assert!(
                out.stderr.contains(var) && out.stderr.contains("not valid UTF-8"),
                "{client} {var}: no message naming the variable:\n{}",
                out.stderr
            );
        }
    }
}

/// An unusable VRAMCAP_REAL_LIBCUDA (missing, or a library that is no driver) denies on every
/// path: the linked client, `dlsym` on the process's own driver handle and the runtime's way
/// (`cuGetProcAddress_v2`). Main denied only the linked client; the other two ran uncapped on
/// the process's driver without a word. One line says why.
#[test]
fn an_unusable_real_driver_denies_on_every_path_with_one_line() {
    let not_a_driver = ctests_dir().join("libnextwrap.so");
    for (path, says) in [
        ("/nonexistent/libcuda.so.1".to_string(), "vramcap: cannot open /nonexistent/libcuda.so.1"),
        (not_a_driver.display().to_string(), "is not a CUDA driver"),
    ] {
        for client in ["client_linked", "client_dlsym", "client_procaddr"] {
            let out = Run::client(client)
                .env("VRAMCAP_REAL_LIBCUDA", &path)
                .env("VRAMCAP_LIMIT", "1g")
                .args(["init ctx 0 alloc 1m info"])
                .run();
            // The runtime's way fails at its first lookup; the others get an error from each call.
            let granted = out.of("alloc").iter().any(|l| l.rc() == 0) || out.of("init").iter().any(|l| l.rc() == 0);
            assert!(!granted, "{client} {path}: ran on the process's driver uncapped:\n{}", out.stdout);
            let lines: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("vramcap:")).collect();
            assert_eq!(lines.len(), 1, "{client} {path}: want one line:\n{}", out.stderr);
            assert!(lines[0].contains(says) && lines[0].contains("VRAMCAP_REAL_LIBCUDA"), "{client}: {}", lines[0]);
        }
    }
}

/// A limit that cannot be resolved (a device this process lacks) refuses every allocation; the
/// memory views agree and show nothing free instead of the device's free memory.
#[test]
fn a_limit_that_cannot_be_resolved_shows_nothing_free() {
    let mut shown = 0;
    for client in ["client_linked", "client_dlsym", "client_procaddr"] {
        let out = Run::client(client).env("VRAMCAP_LIMIT", "7=2g").args(["init ctx 0 info alloc 1m"]).run();
        let info = out.nth("info", 0);
        if info.rc() == 0 {
            assert_eq!(info.num("free"), 0, "{client}: {}", out.stderr);
            shown += 1;
        }
        assert_ne!(out.nth("alloc", 0).rc(), 0, "{client}");
        assert!(out.stderr.contains("device 7 does not exist"), "{client}: {}", out.stderr);
    }
    assert!(shown > 0, "no client got a memory view to check");
    // NVML's view agrees (both ABIs), after CUDA's init failed closed and before any CUDA call.
    for ops in ["init ctx 0 cuinfo nvml 0 nvml2 0 alloc 1", "nvml 0 nvml2 0"] {
        let out = Run::client("client_nvml").env("VRAMCAP_LIMIT", "7=2g").args([ops]).run();
        // Both ABIs answer on an `nvml` line.
        for n in 0..2 {
            let l = out.nth("nvml", n);
            assert_eq!(l.rc(), 0, "{ops}: {}", out.stderr);
            assert_eq!(l.num("free"), 0, "{ops} #{n}: {}", out.stderr);
            assert_eq!(l.num("used"), l.num("total"), "{ops} #{n}");
        }
    }
}
