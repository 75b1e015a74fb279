//! `vramcap replay`: the golden job's two ranks on one device (see tests/data/job_rank*.jsonl).
//! Aligned at 0: rank1 holds 2 GiB from t=0, rank0 reaches 3 GiB at t=2000 → 5 GiB combined
//! until rank1 frees at t=2200.

use vramcap_tests::cli_support;
use cli_support::*;

fn replay(extra: &[&str]) -> serde_json::Value {
    let (a, b) = (data("job_rank0.jsonl"), data("job_rank1.jsonl"));
    let mut args = vec!["replay", "--json"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&[&a, &b]);
    replay_json(&args)
}

/// The JSON verdict; the exit status must agree with it (0 fits, 1 does not fit).
fn replay_json(args: &[&str]) -> serde_json::Value {
    let out = vramcap(args);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let want = if v["fits"] == true { 0 } else { 1 };
    assert_eq!(out.status.code(), Some(want), "exit status for fits={}", v["fits"]);
    v
}

/// A trace of one process: `events` as (t_ns, op, ptr, size, used), and a summary with the exit
/// time `end` (None: a cut trace, no summary).
fn synth(dir: &std::path::Path, name: &str, pid: u32, events: &[(u64, &str, u64, u64, u64)], end: Option<u64>) -> String {
    let mut t = format!(
        r#"{{"type":"header","version":1,"pid":{pid},"ppid":1,"exe":"job","cmdline":["job"],"host":"h","start_unix_ns":1764441600000000000,"devices":[{{"index":0,"total":17179869184,"limit":null}}],"group":null}}"#
    ) + "\n";
    for (seq, (at, op, ptr, size, used)) in events.iter().enumerate() {
        t += &format!(
            r#"{{"type":"event","seq":{seq},"t_ns":{at},"tid":1,"op":"{op}","api":"cuMemAlloc_v2","dev":0,"ptr":"{ptr:#x}","size":{size},"result":0,"dur_ns":5,"used":{used}}}"#
        );
        t += "\n";
    }
    if let Some(end) = end {
        let used = events.last().map_or(0, |e| e.4);
        t += &format!(r#"{{"type":"summary","t_ns":{end},"events":{},"dropped":0,"peak":{{"0":{used}}},"used":{{"0":{used}}}}}"#, events.len());
        t += "\n";
    }
    let p = dir.join(name);
    std::fs::write(&p, t).unwrap();
    p.to_str().unwrap().to_string()
}

/// A process that exited holding 1 GiB no longer counts once its trace has ended: 10 s later a
/// second one fits beside... nothing. The end comes from the summary, or from the last event of
/// a cut trace, and the output says which.
#[test]
fn a_finished_process_leaves_the_replay_at_its_traces_end() {
    let dir = scratch("release");
    let a = synth(&dir, "a.jsonl", 1, &[(100_000, "alloc", 0x1000, GIB, GIB)], Some(260_000));
    let b = synth(&dir, "b.jsonl", 2, &[(100_000, "alloc", 0x1000, GIB, GIB)], Some(260_000));
    let r = replay_json(&["replay", "--json", "--limit", "1.5GiB", "--stagger", "0,10s", &a, &b]);
    assert_eq!(r["fits"], true, "{r}");
    assert_eq!(r["peak"]["0"].as_u64(), Some(GIB));
    assert_eq!(r["traces"][0]["end_from"], "summary");
    assert_eq!(r["traces"][0]["end_ns"].as_u64(), Some(260_000));
    // Together they do not fit: the limit is first broken by the second at 100 us.
    let r = replay_json(&["replay", "--json", "--limit", "1.5GiB", &a, &b]);
    assert_eq!(r["fits"], false);
    assert_eq!(r["first_denial"]["pid"], 2);
    assert_eq!(r["first_denial"]["t_ns"].as_u64(), Some(100_000));
    assert_eq!(r["first_denial"]["device"], 0);
    assert_eq!(r["min_limit"]["0"].as_u64(), Some(2 * GIB));
    // A cut trace ends at its last event; the text says so.
    let cut = synth(&dir, "cut.jsonl", 3, &[(100_000, "alloc", 0x1000, GIB, GIB), (200_000, "free", 0x1000, GIB, 0), (300_000, "alloc", 0x2000, GIB, GIB)], None);
    let r = replay_json(&["replay", "--json", "--limit", "1.5GiB", "--stagger", "0,1ms", &cut, &b]);
    assert_eq!((r["fits"].as_bool(), r["traces"][0]["end_from"].as_str(), r["traces"][0]["end_ns"].as_u64()), (Some(true), Some("last_event"), Some(300_000)));
    let out = vramcap(&["replay", "--limit", "1.5GiB", "--stagger", "0,1ms", &cut, &b]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ends at +0.0003s (its last event: no summary, the trace was cut)"), "{text}");
    assert!(text.contains("ends at +0.00126s (its exit, from the summary)"), "{text}");
}

#[test]
fn the_exit_status_is_the_verdict() {
    let (a, b) = (data("job_rank0.jsonl"), data("job_rank1.jsonl"));
    assert_eq!(vramcap(&["replay", "--limit", "4GiB", &a, &b]).status.code(), Some(1));
    assert_eq!(vramcap(&["replay", "--limit", "5GiB", &a, &b]).status.code(), Some(0));
    assert_eq!(vramcap(&["replay", "--limit", "lots", &a, &b]).status.code(), Some(2));
    let out = vramcap(&["replay", "--limit", "4GiB", &a, &b]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("first broken at +0.000002s on device 0 by pid 100"), "{text}");
    assert!(text.contains("smallest limit at which they fit: device 0: 5.0 GiB"), "{text}");
}

#[test]
fn too_small_a_device_reports_the_first_refusal_and_min_limit() {
    let r = replay(&["--limit", "4GiB"]);
    assert_eq!(r["fits"], false);
    assert_eq!(r["first_denial_t_ns"].as_u64(), Some(2000));
    assert_eq!(r["peak"]["0"].as_u64(), Some(5 * GIB));
    assert_eq!(r["min_limit"]["0"].as_u64(), Some(5 * GIB));
}

#[test]
fn the_min_limit_fits() {
    let r = replay(&["--limit", "5GiB"]);
    assert_eq!(r["fits"], true);
    assert!(r["first_denial_t_ns"].is_null());
}

#[test]
fn percent_takes_the_total_from_the_header() {
    // Headers say 16 GiB: 25% = 4 GiB, the same verdict as --limit 4GiB.
    let r = replay(&["--limit", "25%"]);
    assert_eq!(r["limit"]["0"].as_u64(), Some(4 * GIB));
    assert_eq!(r["fits"], false);
}

#[test]
fn staggering_the_second_job_leaves_only_the_first_jobs_own_demand() {
    // rank1 starting at 4500 ns meets rank0 at 1 GiB: peak is rank0's 3.5 GiB at 5000. What is
    // left over 4 GiB is rank0's own recorded denial (2 GiB asked at 3 GiB used, issue 28 §5):
    // it was refused at 4 GiB, so at 4 GiB they still do not fit, and 5 GiB is the need.
    let r = replay(&["--limit", "4GiB", "--stagger", "0,4500ns"]);
    assert_eq!(r["fits"], false);
    assert_eq!((r["first_denial"]["pid"].as_u64(), r["first_denial"]["recorded"].as_bool()), (Some(100), Some(true)));
    assert_eq!(r["first_denial"]["t_ns"].as_u64(), Some(3000));
    assert_eq!(r["peak"]["0"].as_u64(), Some(3 * GIB + 512 * MIB));
    assert_eq!(r["peak_t_ns"]["0"].as_u64(), Some(5000));
    assert_eq!(r["min_limit"]["0"].as_u64(), Some(5 * GIB));
}

#[test]
fn bad_limit_is_a_clear_error() {
    let out = vramcap(&["replay", "--limit", "lots", &data("job_rank0.jsonl")]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--limit \"lots\"") && err.contains("8GiB"), "{err}");
    let out = vramcap(&["replay", "--limit", "4g", "--stagger", "1s,2s,3s", &data("job_rank0.jsonl")]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stagger has 3 offsets for 1 traces"));
}

#[test]
fn events_without_a_device_do_not_need_a_device_total() {
    // A failed free of an unknown pointer has dev -1; a percentage limit must still work.
    let dir = scratch("nodev");
    let f = dir.join("t.jsonl");
    let golden = std::fs::read_to_string(data("job_rank0.jsonl")).unwrap();
    let extra = r#"{"type":"event","seq":8,"t_ns":8500,"tid":1,"op":"fail","api":"cuMemFree_v2","dev":-1,"ptr":"0x1234","size":0,"result":1,"dur_ns":5,"used":0}"#;
    let mut lines: Vec<&str> = golden.lines().collect();
    lines.insert(lines.len() - 1, extra);
    std::fs::write(&f, lines.join("\n") + "\n").unwrap();
    // 50% = 8 GiB: above the 5 GiB its recorded denial asked for.
    let r = json(&["replay", "--json", "--limit", "50%", f.to_str().unwrap()]);
    assert_eq!(r["fits"], true);
    assert_eq!(r["peak"]["0"].as_u64(), Some(3 * GIB));
    assert!(r["peak"].get("-1").is_none());
}

/// A trace whose cap changed while it ran (issue 26): 1 GiB at start, 512 MiB held, cut to
/// 256 MiB at t = 2 s (a `limit` event, here the ceiling file's), 128 MiB more at t = 3 s; then
/// grown to 1 GiB at t = 4 s and 128 MiB more at t = 5 s.
fn moving_cap(dir: &std::path::Path) -> String {
    let h = r#"{"type":"header","version":1,"pid":9,"ppid":1,"exe":"job","cmdline":["job"],"host":"h","start_unix_ns":1764441600000000000,"devices":[{"index":0,"total":17179869184,"limit":1073741824}],"group":null}"#;
    let ev = |seq: u64, t_s: u64, rest: &str| format!(r#"{{"type":"event","seq":{seq},"t_ns":{},"tid":1,"dev":0,"result":0,"dur_ns":1,{rest}}}"#, t_s * 1_000_000_000);
    let limit = |old: u64, new: u64| format!(r#""op":"limit","api":"ceiling","ptr":"{old:#x}","size":{new},"old":{old},"new":{new},"uid":0,"source":"ceiling","used":536870912"#);
    let lines = [
        h.to_string(),
        ev(0, 1, r#""op":"alloc","api":"cuMemAlloc_v2","ptr":"0x100","size":536870912,"used":536870912"#),
        ev(1, 2, &limit(1 << 30, 256 << 20)),
        ev(2, 3, r#""op":"alloc","api":"cuMemAlloc_v2","ptr":"0x200","size":134217728,"used":671088640"#),
        ev(3, 4, &limit(256 << 20, 1 << 30)),
        ev(4, 5, r#""op":"alloc","api":"cuMemAlloc_v2","ptr":"0x300","size":134217728,"used":805306368"#),
    ];
    let p = dir.join("moving.jsonl");
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn replay_follows_the_recorded_limit_changes_and_limit_ignores_them() {
    let dir = scratch("replay-moving");
    let t = moving_cap(&dir);
    // The recorded limits: the allocation after the cut is refused, the one after the grow is not.
    let v = replay_json(&["replay", "--json", &t]);
    assert_eq!(v["fits"], false, "{v}");
    assert_eq!(v["denials"], 1, "only the allocation under the cut: {v}");
    assert_eq!(v["first_denial"]["t_ns"], 3_000_000_000u64, "{v}");
    assert_eq!((v["limit_changes"]["0"].as_u64(), v["limit"]["0"].as_u64()), (Some(2), Some(1 << 30)), "{v}");
    let text = String::from_utf8_lossy(&vramcap(&["replay", &t]).stdout).to_string();
    assert!(text.contains("against the limits the traces recorded") && text.contains("the recorded limits (2 change(s), last 1.0 GiB): does NOT fit"), "{text}");
    // `--limit` is the device to test: the trace's own changes are ignored.
    let v = replay_json(&["replay", "--json", "--limit", "1g", &t]);
    assert_eq!((v["fits"].as_bool(), v["denials"].as_u64(), v["limit_changes"]["0"].as_u64()), (Some(true), Some(0), Some(0)), "{v}");
    let v = replay_json(&["replay", "--json", "--limit", "700m", &t]);
    assert_eq!((v["fits"].as_bool(), v["first_denial"]["t_ns"].as_u64()), (Some(false), Some(5_000_000_000)), "{v}");
}
