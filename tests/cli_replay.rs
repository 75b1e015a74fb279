//! `vramcap replay`: the golden job's two ranks on one device (see tests/data/job_rank*.jsonl).
//! Aligned at 0: rank1 holds 2 GiB from t=0, rank0 reaches 3 GiB at t=2000 → 5 GiB combined
//! until rank1 frees at t=2200.

mod cli_support;
use cli_support::*;

fn replay(extra: &[&str]) -> serde_json::Value {
    let (a, b) = (data("job_rank0.jsonl"), data("job_rank1.jsonl"));
    let mut args = vec!["replay", "--json"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&[&a, &b]);
    json(&args)
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
fn staggering_the_second_job_makes_them_fit() {
    // rank1 starting at 4500 ns meets rank0 at 1 GiB: peak is rank0's 3.5 GiB at 5000.
    let r = replay(&["--limit", "4GiB", "--stagger", "0,4500ns"]);
    assert_eq!(r["fits"], true);
    assert_eq!(r["peak"]["0"].as_u64(), Some(3 * GIB + 512 * MIB));
    assert_eq!(r["peak_t_ns"]["0"].as_u64(), Some(5000));
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
    let r = json(&["replay", "--json", "--limit", "25%", f.to_str().unwrap()]);
    assert_eq!(r["fits"], true);
    assert_eq!(r["peak"]["0"].as_u64(), Some(3 * GIB));
    assert!(r["peak"].get("-1").is_none());
}
