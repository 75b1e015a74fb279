//! Observe mode in one process (issue 26, `VRAMCAP_MODE=observe`): every allocation the cap would
//! refuse is granted on every lookup path, the job sees the physical device, every would-be
//! denial is in the trace, and the report and replay say the same. Controls: the same ops
//! enforced are refused, and the view is capped.

use std::time::Instant;
use vramcap_tests::common::*;
use vramcap_tests::observe_support::{LOOKUPS, check_report_and_replay, check_trace};
use vramcap_tests::trace_support::tmpdir;

const OPS: &str = "init ctx 0 info total 0 alloc 600m alloc 600m alloc 100m info total 0 free 0 alloc 100m";

#[test]
fn observe_mode_grants_what_the_cap_would_refuse_on_every_lookup_path() {
    let dir = tmpdir("observe-process");
    for c in LOOKUPS {
        let trace = dir.join(format!("{c}.jsonl"));
        let out = Run::client(c).env("VRAMCAP_LIMIT", "1g").env("VRAMCAP_MODE", "observe").env("VRAMCAP_TRACE", &trace).args([OPS]).run();
        out.ok();
        assert!(out.of("alloc").iter().all(|a| a.rc() == 0), "{c}: nothing refused:\n{}", out.stdout);
        // The physical device, before and after going over the cap: 16 GiB, as the bare driver.
        let bare = Run::client(c).bare().args([OPS]).run();
        for op in ["info", "total"] {
            for n in 0..2 {
                assert_eq!(out.nth(op, n).fields, bare.nth(op, n).fields, "{c}: {op} #{n} as without vramcap");
            }
        }
        assert_eq!(out.nth("total", 0).num("bytes"), 16 * GIB);
        assert!(out.stderr.contains("vramcap: observe mode: granted cuMemAlloc_v2 of 629145600 bytes"), "{c}: {}", out.stderr);
        // 600m + 600m is over 1 GiB; so is 1200m + 100m; after a free, 700m + 100m fits.
        let want = [
            ("cuMemAlloc_v2", 600 * MIB, "process", GIB, 600 * MIB),
            ("cuMemAlloc_v2", 100 * MIB, "process", GIB, 1200 * MIB),
        ];
        check_trace(&trace, &want);
        check_report_and_replay(&trace, &want, "cap", Some("1GiB"));
    }
}

#[test]
fn enforced_the_same_ops_are_refused_and_the_view_is_capped() {
    let dir = tmpdir("observe-control");
    for c in LOOKUPS {
        let trace = dir.join(format!("{c}.jsonl"));
        for mode in [None, Some("enforce"), Some(" ENFORCE ")] {
            let mut r = Run::client(c).env("VRAMCAP_LIMIT", "1g").env("VRAMCAP_TRACE", &trace);
            if let Some(m) = mode {
                r = r.env("VRAMCAP_MODE", m);
            }
            let out = r.args([OPS]).run();
            out.ok();
            let rcs: Vec<i64> = out.of("alloc").iter().map(|a| a.rc()).collect();
            assert_eq!(rcs, [0, 2, 0, 0], "{c} {mode:?}");
            assert_eq!(out.nth("total", 0).num("bytes"), GIB, "{c} {mode:?}");
            let t = std::fs::read_to_string(&trace).unwrap();
            assert!(!t.contains("would_deny") && !t.contains("\"mode\""), "{c} {mode:?}: {t}");
        }
    }
}

/// Pools and graphs reach the cap through their own paths (`intercept::pool`, `graph`): granted
/// too, and traced with the request's size.
#[test]
fn stream_ordered_allocations_are_observed_too() {
    let dir = tmpdir("observe-async");
    let trace = dir.join("t.jsonl");
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_MODE", "observe")
        .env("VRAMCAP_TRACE", &trace)
        .args(["init ctx 0 async 800m async 400m info"])
        .run();
    out.ok();
    assert_eq!(out.of("async").iter().map(|a| a.rc()).collect::<Vec<_>>(), [0, 0], "{}", out.stdout);
    assert_eq!(out.nth("info", 0).num("total"), 16 * GIB);
    let t = vramcap_tests::trace_support::read_trace(&trace);
    let w: Vec<_> = t.iter().filter(|e| e["op"] == "would_deny").collect();
    assert_eq!(w.len(), 1, "{t:?}");
    assert_eq!((w[0]["api"].as_str(), w[0]["size"].as_u64(), w[0]["cap"].as_str()), (Some("cuMemAllocAsync"), Some(400 * MIB), Some("process")));
    // Enforced, the second is refused (the control).
    let out = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "1g").args(["init ctx 0 async 800m async 400m"]).run();
    assert_eq!(out.of("async").iter().map(|a| a.rc()).collect::<Vec<_>>(), [0, 2]);
}

/// NVML shows the physical device too (it is capped when enforcing: the control).
#[test]
fn nvml_shows_the_physical_device_in_observe_mode() {
    for (mode, total) in [("observe", 16 * GIB), ("enforce", 4 * GIB)] {
        let out = Run::client("client_nvml")
            .env("VRAMCAP_LIMIT", "4GiB")
            .env("VRAMCAP_MODE", mode)
            .env("FAKECUDA_MEM", "16GiB")
            .args(["nvml 0 init ctx 0 alloc 1024 cuinfo nvml 0 nvml2 0 alloc 4096 cuinfo nvml 0"])
            .run();
        out.ok();
        for i in 0..4 {
            assert_eq!(out.nth("nvml", i).num("total"), total, "{mode}: nvml line {i}:\n{}", out.stdout);
        }
        assert_eq!(out.nth("cuinfo", 1).num("total"), total, "{mode}");
        let rcs: Vec<i64> = out.of("alloc").iter().map(|a| a.rc()).collect();
        assert_eq!(rcs, if mode == "observe" { [0, 0] } else { [0, 2] }, "{mode}");
    }
}

/// At most one observe line a second, however many would-be denials: the rest are counted.
#[test]
fn the_observe_line_is_rate_limited() {
    let dir = tmpdir("observe-lines");
    let trace = dir.join("t.jsonl");
    let ops: String = std::iter::once("init ctx 0 alloc 1g".to_string()).chain((0..200).map(|_| "alloc 1m".to_string())).collect::<Vec<_>>().join(" ");
    let started = Instant::now();
    let out = Run::client("client_linked").env("VRAMCAP_LIMIT", "1g").env("VRAMCAP_MODE", "observe").env("VRAMCAP_TRACE", &trace).args([ops.as_str()]).run();
    let secs = started.elapsed().as_secs();
    out.ok();
    let lines = out.stderr.lines().filter(|l| l.contains("observe mode")).count();
    assert!(lines >= 1 && lines as u64 <= secs + 1, "{lines} lines in {secs} s:\n{}", out.stderr);
    let t = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(t.matches("\"op\":\"would_deny\"").count(), 200, "every would-be denial is traced");
    assert!(t.contains("\"would_deny\":{\"0\":200"), "{}", t.lines().last().unwrap());
}

/// A mode that is neither: invalid input, named, and nothing is handed out (never observe).
#[test]
fn a_bad_mode_fails_closed_naming_the_variable() {
    for c in LOOKUPS {
        let out = Run::client(c).env("VRAMCAP_LIMIT", "1g").env("VRAMCAP_MODE", "watch").args(["init ctx 0 alloc 2g"]).run();
        assert_ne!(out.nth("init", 0).rc(), 0, "{c}: {}", out.stdout);
        let line = out.stderr.lines().find(|l| l.contains("VRAMCAP_MODE")).unwrap_or_else(|| panic!("{c}: {}", out.stderr));
        assert!(line.contains("\"watch\"") && line.contains("enforce") && line.contains("observe"), "{line}");
    }
}
