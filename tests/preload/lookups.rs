//! Replays every cuGetProcAddress_v2 request the CUDA 12.9 and 13.5 runtimes make: with the
//! preload, the driver's answers (result, status, NULL or not) must be identical to the bare
//! driver's, wrapped names must point into libvramcap.so and everything else must still be the
//! driver's own pointer.

use vramcap_tests::common;
use common::*;
use std::process::Command;

#[derive(Debug, PartialEq, Eq)]
struct Row {
    name: String,
    version: String,
    flags: String,
    rc: String,
    status: String,
    nonnull: String,
    object: String,
}

fn replay(file: &str, vars: &[(&str, &str)], preload: bool) -> Vec<Row> {
    let mut r = Run::client("replay").args([lookups(file).to_str().unwrap()]);
    for (k, v) in vars {
        r = r.env(k, v);
    }
    if !preload {
        r = r.bare();
    }
    let out = r.run();
    out.ok();
    out.stdout
        .lines()
        .map(|l| {
            let c: Vec<&str> = l.split('\t').collect();
            assert_eq!(c.len(), 7, "bad replay line {l:?}");
            Row {
                name: c[0].into(),
                version: c[1].into(),
                flags: c[2].into(),
                rc: c[3].into(),
                status: c[4].into(),
                nonnull: c[5].into(),
                object: c[6].into(),
            }
        })
        .collect()
}

/// Base names of the wrappers we export (`cuMemAlloc_v2` → `cuMemAlloc`).
fn wrapped_bases() -> Vec<String> {
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(preload_lib()).output().expect("nm");
    let mut bases: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|n| n.starts_with("cu"))
        .map(|n| {
            let mut b = n.to_string();
            for suffix in ["_ptsz", "_ptds"] {
                if let Some(s) = b.strip_suffix(suffix) {
                    b = s.to_string();
                }
            }
            if let Some(i) = b.rfind("_v") {
                if b[i + 2..].bytes().all(|c| c.is_ascii_digit()) && i + 2 < b.len() {
                    b.truncate(i);
                }
            }
            b
        })
        .collect();
    bases.sort();
    bases.dedup();
    for must in ["cuInit", "cuGetProcAddress", "cuMemAlloc", "cuMemFree", "cuMemGetInfo", "cuDeviceTotalMem"] {
        assert!(bases.iter().any(|b| b == must), "{must} is not wrapped");
    }
    bases
}

fn check(file: &str) {
    let bare = replay(file, &[], false);
    let with = replay(file, &[("VRAMCAP_LIMIT", "4g")], true);
    assert!(bare.len() > 400, "{file}: only {} rows", bare.len());
    assert_eq!(bare.len(), with.len());
    let bases = wrapped_bases();
    let mut wrapped = 0;
    for (b, w) in bare.iter().zip(&with) {
        let key = (&b.name, &b.version, &b.flags, &b.rc, &b.status, &b.nonnull);
        assert_eq!(key, (&w.name, &w.version, &w.flags, &w.rc, &w.status, &w.nonnull), "{file}: answer changed");
        if b.nonnull == "1" {
            assert_eq!(b.object, "libcuda.so.1");
            if bases.contains(&b.name) {
                assert_eq!(w.object, "libvramcap.so", "{file}: {} v{} not wrapped", w.name, w.version);
                wrapped += 1;
            } else {
                assert_eq!(w.object, "libcuda.so.1", "{file}: {} must come back untouched", w.name);
            }
        }
    }
    assert!(wrapped >= 6, "{file}: only {wrapped} wrapped lookups");
    // Disabled: every pointer is the driver's own.
    let off = replay(file, &[("VRAMCAP_DISABLE", "1"), ("VRAMCAP_LIMIT", "4g")], true);
    for (b, o) in bare.iter().zip(&off) {
        assert_eq!(b, o, "{file}: VRAMCAP_DISABLE must be a pure pass-through");
    }
}

#[test]
fn cuda_12_9_runtime_lookups_are_preserved() {
    check("cudart12.tsv");
}

#[test]
fn cuda_13_5_runtime_lookups_are_preserved() {
    check("cudart13.tsv");
}

/// A normal process prints nothing: every lookup the CUDA 12.9 and 13.5 runtimes make, under a
/// cap, leaves stderr empty (the old code reported the legacy `cuIpcOpenMemHandle` ABI the 13.5
/// runtime asks for at 4010 as "none of the variants vramcap wraps", and passed it through).
#[test]
fn runtime_lookups_print_nothing() {
    for file in ["cudart12.tsv", "cudart13.tsv"] {
        let out = Run::client("replay").env("VRAMCAP_LIMIT", "4g").args([lookups(file).to_str().unwrap()]).run();
        out.ok();
        assert!(out.stderr.is_empty(), "{file}: stderr is not empty:\n{}", out.stderr);
    }
}

/// A driver answers an allocating name with an ABI vramcap does not wrap (a newer driver; here the
/// fake's FAKECUDA_NEW_ABI fixture): the caller gets a stub that denies, and one line says why.
/// The old code passed the driver's function through: 100 MiB granted under a 1 MiB cap.
#[test]
fn an_unknown_allocator_variant_fails_closed() {
    let run = |bare: bool| {
        let mut r = Run::client("client_procaddr")
            .env("FAKECUDA_NEW_ABI", "cuMemAlloc@3020")
            .env("VRAMCAP_LIMIT", "1m")
            .args(["init ctx 0 alloc 100m alloc 100m info"]);
        if bare {
            r = r.bare();
        }
        let out = r.run();
        out.ok();
        out
    };
    let bare = run(true);
    assert_eq!(bare.nth("alloc", 0).rc(), 0, "the fixture allocates on the bare driver");
    let out = run(false);
    assert_eq!(out.nth("init", 0).rc(), 0);
    for n in 0..2 {
        assert_eq!(out.nth("alloc", n).rc(), 800, "CUDA_ERROR_NOT_PERMITTED, without calling the driver");
    }
    assert_eq!(out.nth("info", 0).num("free"), MIB, "nothing charged, nothing held");
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line:\n{}", out.stderr);
    assert!(lines[0].contains("cuGetProcAddress(\"cuMemAlloc\", 3020") && lines[0].contains("none of the variants"), "{}", lines[0]);
}
