//! `vramcap report` on golden traces with known answers (tests/data/job_rank*.jsonl: see the
//! numbers worked out in each test), merging on the wall clock, and corrupt input.

use vramcap_tests::cli_support;
use cli_support::*;

fn device<'a>(r: &'a serde_json::Value, pid: u64) -> &'a serde_json::Value {
    let p = r["processes"].as_array().unwrap().iter().find(|p| p["pid"] == pid).expect("process");
    &p["devices"][0]
}

#[test]
fn golden_trace_peak_leaks_denials() {
    let r = json(&["report", "--json", &data("job_rank0.jsonl")]);
    assert_eq!(r["skipped_lines"], 0);
    let p = &r["processes"][0];
    assert_eq!((p["pid"].as_u64(), p["exe"].as_str()), (Some(100), Some("python3")));
    let d = device(&r, 100);
    assert_eq!(d["index"], 0);
    // 1 GiB + 2 GiB live at t=2000 is the peak; the denial at 3000 does not charge.
    assert_eq!(d["peak"].as_u64(), Some(3 * GIB));
    assert_eq!(d["peak_t_ns"].as_u64(), Some(2000));
    // 0x1000 (1 GiB) and 0x3000 (512 MiB) are never freed.
    assert_eq!(d["leaked_bytes"].as_u64(), Some(GIB + 512 * MIB));
    assert_eq!(d["leaked_count"].as_u64(), Some(2));
    assert_eq!(d["largest_leaks"][0]["ptr"], "0x1000");
    assert_eq!(d["largest_leaks"][1]["api"], "cuMemAllocAsync");
    assert_eq!((d["denied"].as_u64(), d["failed"].as_u64()), (Some(1), Some(1)));
    assert_eq!((d["allocs"].as_u64(), d["frees"].as_u64()), (Some(4), Some(2)));
    assert_eq!(d["denials"][0]["used"].as_u64(), Some(3 * GIB), "usage at the moment of the denial");
    assert_eq!(d["failures"][0]["size"].as_u64(), Some(8 * GIB));
    assert_eq!(d["driver_ns"]["alloc"].as_u64(), Some(500 + 700 + 500 + 500));
    assert_eq!(d["limit"].as_u64(), Some(4 * GIB));
}

#[test]
fn traces_of_one_job_merge_on_the_wall_clock() {
    let r = json(&["report", "--json", &data("job_rank0.jsonl"), &data("job_rank1.jsonl")]);
    assert_eq!(r["processes"].as_array().unwrap().len(), 2);
    assert_eq!(device(&r, 200)["peak"].as_u64(), Some(2 * GIB));
    assert_eq!(device(&r, 200)["leaked_bytes"].as_u64(), Some(GIB));
    // rank1 starts 2500 ns after rank0: at wall +2500 rank0 holds 3 GiB and rank1 takes 2 GiB.
    let c = &r["combined"][0];
    assert_eq!(c["peak"].as_u64(), Some(5 * GIB));
    assert_eq!(c["peak_unix_ns"].as_u64(), Some(1_764_441_600_000_002_500));
    assert_eq!(r["events"], 11, "the unknown `usage` line is ignored, not counted");
}

#[test]
fn human_report_names_the_essentials() {
    let out = ok(&["report", &data("job_rank0.jsonl")]);
    for want in ["peak            3.0 GiB at t=0.000s", "held at end     1.5 GiB in 2 allocation(s)", "cuMemAllocAsync", "denied          1", "while using 3.0 GiB", "lifetimes", "time in driver"] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

#[test]
fn corrupt_and_truncated_lines_are_skipped_with_line_numbers() {
    let out = vramcap(&["report", "--json", &data("corrupt.jsonl")]);
    assert!(out.status.success());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["skipped_lines"], 3);
    let lines: Vec<u64> = r["skipped"].as_array().unwrap().iter().map(|s| s["line"].as_u64().unwrap()).collect();
    assert_eq!(lines, vec![3, 4, 7]);
    let d = device(&r, 300);
    assert_eq!((d["allocs"].as_u64(), d["frees"].as_u64(), d["peak"].as_u64()), (Some(2), Some(1), Some(3 * GIB)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("corrupt.jsonl:7: truncated last line"), "{err}");
    assert!(err.contains("no summary line"), "{err}");
}

#[test]
fn not_a_trace_is_a_clear_error() {
    let dir = scratch("notatrace");
    let f = dir.join("x.jsonl");
    std::fs::write(&f, "hello\n").unwrap();
    let out = vramcap(&["report", f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("x.jsonl") && err.contains("header"), "{err}");
    let out = vramcap(&["report", "/nonexistent/trace.jsonl"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/trace.jsonl: cannot open"));
}

#[test]
fn generated_trace_agrees_with_its_summary() {
    // The generator writes its own peak and final usage in the summary line; report derives
    // them independently from the events.
    let dir = scratch("gen");
    let f = dir.join("g.jsonl");
    ok(&["gen-trace", "--events", "50000", "--limit", "1000000000", "-o", f.to_str().unwrap()]);
    let text = std::fs::read_to_string(&f).unwrap();
    let summary: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let r = json(&["report", "--json", f.to_str().unwrap()]);
    let d = &r["processes"][0]["devices"][0];
    assert_eq!(d["peak"], summary["peak"]["0"]);
    assert_eq!(d["leaked_bytes"], summary["used"]["0"]);
    assert_eq!(r["events"], 50000);
    let n = |k: &str| d[k].as_u64().unwrap();
    assert_eq!(n("allocs") + n("frees") + n("denied") + n("failed"), 50000);
    assert!(n("denied") > 0, "a 1 GB cap must deny some of the generated allocations");
}

fn write_trace(name: &str, header_extra: &str, events: &[&str], summary: &str) -> String {
    let dir = scratch(name);
    let mut t = format!(
        r#"{{"type":"header","version":1,"pid":9,"ppid":1,"exe":"job","cmdline":["job"],"host":"h","start_unix_ns":1764441600000000000,"devices":[{{"index":0,"total":17179869184,"limit":null{header_extra}}}],"group":"team"}}"#
    ) + "\n";
    for e in events {
        t += e;
        t += "\n";
    }
    t += summary;
    t += "\n";
    let p = dir.join("t.jsonl");
    std::fs::write(&p, t).unwrap();
    p.to_str().unwrap().to_string()
}

fn ev(seq: u64, t: u64, op: &str, ptr: u64, size: u64, used: u64) -> String {
    format!(r#"{{"type":"event","seq":{seq},"t_ns":{t},"tid":1,"op":"{op}","api":"cuMemAlloc_v2","dev":0,"ptr":"{ptr:#x}","size":{size},"result":0,"dur_ns":5,"used":{used}}}"#)
}

/// Events lost: the summary's held-at-exit is the truth, and the events' leak list says it is
/// incomplete. A group member's budget is shown beside its cap.
#[test]
fn dropped_events_make_the_leak_list_say_it_is_incomplete() {
    // The free of 0x2000 was dropped (seq 2 missing): from events it looks held.
    let evs = [ev(0, 10, "alloc", 0x1000, 1 << 20, 1 << 20), ev(1, 20, "alloc", 0x2000, 1 << 20, 2 << 20), ev(3, 40, "free", 0x1000, 1 << 20, 0)];
    let evs: Vec<&str> = evs.iter().map(|s| s.as_str()).collect();
    let p = write_trace("dropped", r#","group_limit":1610612736"#, &evs, r#"{"type":"summary","t_ns":50,"events":4,"dropped":1,"peak":{"0":2097152},"used":{"0":0},"denied":{"0":0},"group":{"name":"team","limit":{"0":1610612736},"used":{"0":0}}}"#);
    let text = ok(&["report", &p]);
    assert!(text.contains("held at exit    0 B (the process's own count, from its summary)"), "{text}");
    assert!(text.contains("incomplete: 1 event(s) were dropped"), "{text}");
    assert!(text.contains("group \"team\" budget 1.5 GiB"), "{text}");
    let j = json(&["report", "--json", &p]);
    let d = &j["processes"][0]["devices"][0];
    assert_eq!((d["held_at_exit"].as_u64(), d["leaks_complete"].as_bool(), d["group_limit"].as_u64()), (Some(0), Some(false), Some(1536 << 20)));
    // The plot draws the group's budget and names it.
    let svg = std::path::Path::new(&p).with_extension("svg");
    ok(&["plot", &p, "-o", svg.to_str().unwrap()]);
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(svg.contains("group \"team\" budget 1.5 GiB") || svg.contains("group &quot;team&quot; budget 1.5 GiB"), "{svg}");
    // Its end is the summary's 0 B, not the 1 MiB the events alone leave held, and it says why.
    assert!(svg.contains("0 B at end (1 event(s) dropped)"), "{svg}");
    assert!(svg.contains("all: 0 B held at the end"), "{svg}");
}

/// A free written after the re-allocation of its address (stamped before it) is matched with
/// the earlier allocation: no spurious "frees without a traced allocation".
#[test]
fn a_free_written_after_the_reallocation_is_not_unmatched() {
    let evs = [
        ev(0, 10, "alloc", 0x1000, 100, 100),
        ev(1, 30, "alloc", 0x1000, 200, 300),
        ev(2, 20, "free", 0x1000, 100, 200),
        ev(3, 40, "free", 0x1000, 200, 0),
    ];
    let evs: Vec<&str> = evs.iter().map(|s| s.as_str()).collect();
    let p = write_trace("causal", "", &evs, r#"{"type":"summary","t_ns":50,"events":4,"dropped":0,"peak":{"0":300},"used":{"0":0}}"#);
    let text = ok(&["report", &p]);
    assert!(!text.contains("frees without a traced allocation"), "{text}");
    assert!(text.contains("held at end     0 B in 0 allocation(s)"), "{text}");
}

/// A group member's sharing settings (issue 17): the header's as at start, the summary's share
/// at exit; a trace without them (older, or not a member) prints no sharing line.
#[test]
fn a_group_members_policy_share_reserve_and_headroom_are_reported() {
    let dir = scratch("sharing");
    let header = r#"{"type":"header","version":1,"pid":9,"ppid":1,"exe":"job","cmdline":["job"],"host":"h","start_unix_ns":1764441600000000000,"devices":[{"index":0,"total":17179869184,"limit":null,"group_limit":2147483648,"group_reserve":268435456,"group_headroom":536870912,"group_share":805306368}],"group":"team","group_policy":"equal","group_priority":4,"group_holds_headroom":false}"#;
    let summary = r#"{"type":"summary","t_ns":50,"events":1,"dropped":0,"peak":{"0":1048576},"used":{"0":1048576},"denied":{"0":0},"group":{"name":"team","limit":{"0":2147483648},"used":{"0":1048576},"policy":"equal","priority":4,"holds_headroom":false,"reserve":{"0":268435456},"headroom":{"0":536870912},"share":{"0":536870912}}}"#;
    let p = dir.join("t.jsonl");
    std::fs::write(&p, format!("{header}\n{}\n{summary}\n", ev(0, 10, "alloc", 0x1000, 1 << 20, 1 << 20))).unwrap();
    let text = ok(&["report", p.to_str().unwrap()]);
    assert!(
        text.contains("group sharing   policy equal, priority 4, share 768.0 MiB at start, 512.0 MiB at exit, reserve 256.0 MiB, headroom 512.0 MiB\n"),
        "{text}"
    );
    let j = json(&["report", "--json", p.to_str().unwrap()]);
    let pr = &j["processes"][0];
    assert_eq!((pr["group_policy"].as_str(), pr["group_priority"].as_i64(), pr["group_holds_headroom"].as_bool()), (Some("equal"), Some(4), Some(false)));
    let d = &pr["devices"][0];
    assert_eq!((d["group_share"].as_u64(), d["group_share_at_exit"].as_u64()), (Some(768 << 20), Some(512 << 20)));
    assert_eq!((d["group_reserve"].as_u64(), d["group_headroom"].as_u64()), (Some(256 << 20), Some(512 << 20)));
    // Without the fields: nothing invented.
    let evs = [ev(0, 10, "alloc", 0x1000, 100, 100)];
    let evs: Vec<&str> = evs.iter().map(|s| s.as_str()).collect();
    let p = write_trace("no-sharing", r#","group_limit":1610612736"#, &evs, r#"{"type":"summary","t_ns":50,"events":1,"dropped":0,"peak":{"0":100},"used":{"0":100}}"#);
    let text = ok(&["report", &p]);
    assert!(!text.contains("group sharing"), "{text}");
    assert!(json(&["report", "--json", &p])["processes"][0]["group_policy"].is_null());
    // A trace is anybody's file: what it says is never printed as terminal control codes.
    let evil = header
        .replace(r#""group_policy":"equal""#, r#""group_policy":"\u001b[31mred\nFAKE LINE""#)
        .replace(r#""exe":"job""#, r#""exe":"j\u001b]0;owned\u0007ob""#)
        .replace(r#""group":"team""#, r#""group":"te\u001b[2J\nFAKE GROUP""#);
    // The leaked allocation's api is printed in the leak list.
    let leak = ev(0, 10, "alloc", 0x1000, 1 << 20, 1 << 20).replace(r#""api":"cuMemAlloc_v2""#, r#""api":"cu\u001b]0;pwned\u0007\nFAKE API""#);
    let p = dir.join("evil.jsonl");
    std::fs::write(&p, format!("{evil}\n{leak}\n{summary}\n")).unwrap();
    let text = ok(&["report", p.to_str().unwrap()]);
    assert!(!text.contains('\u{1b}') && !text.contains('\u{7}'), "{text:?}");
    for forged in ["\nFAKE LINE", "\nFAKE GROUP", "\nFAKE API"] {
        assert!(!text.contains(forged), "{forged:?} forged a line: {text:?}");
    }
    assert!(text.contains("policy unknown") && text.contains("(j?]0;owned?ob)"), "{text}");
    assert!(text.contains("group \"te?[2J?FAKE GROUP\"") && text.contains("cu?]0;pwned??FAKE API"), "{text}");
}

/// A crafted trace (the sidecar's `--trace-dir` files hold clients' lines as received) with an
/// alloc and a free on each of 10 000 device ordinals: nothing is live at any moment, so the
/// report's state stays small; it used to keep (and print) one device entry per ordinal, 271 MB
/// for a 3 MB trace. Counted, not timed: the devices kept, and the events left unread said.
#[test]
fn report_state_does_not_grow_with_crafted_device_ordinals() {
    let d = scratch("report-devices");
    let f = d.join("t.jsonl");
    let mut s = String::from("{\"type\":\"header\",\"version\":1,\"pid\":7,\"ppid\":1,\"exe\":\"x\",\"host\":\"h\",\"start_unix_ns\":1,\"devices\":[]}\n");
    for dev in 0..10_000u64 {
        for (k, op) in ["alloc", "free"].iter().enumerate() {
            let seq = 2 * dev + k as u64;
            s += &format!("{{\"type\":\"event\",\"seq\":{seq},\"t_ns\":{seq},\"tid\":1,\"op\":\"{op}\",\"api\":\"cuMemAlloc_v2\",\"dev\":{dev},\"ptr\":\"0x1000\",\"size\":4096,\"result\":0,\"dur_ns\":1}}\n");
        }
    }
    std::fs::write(&f, s).unwrap();
    let out = vramcap(&["report", "--json", &f.to_string_lossy()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(out.stdout.len() < 1 << 20, "a {} byte report", out.stdout.len());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = &r["processes"][0];
    assert_eq!(p["devices"].as_array().unwrap().len(), 64, "devices kept");
    assert_eq!(p["untracked_device_events"], 2 * (10_000 - 64), "the rest is counted, not read");
    assert_eq!(r["events"], 20_000);
    let t = ok(&["report", &f.to_string_lossy()]);
    assert!(t.contains("19872 event(s) on device ordinals past the first 64"), "{}", &t[t.len().saturating_sub(2000)..]);
}
