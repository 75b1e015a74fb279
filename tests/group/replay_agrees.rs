//! `vramcap replay --policy` runs the library's own admission code over a ledger in memory, so on
//! traces recorded by a real group it grants what the library granted and refuses what it
//! refused, under every policy (issue 22). Three members take turns (each step waits for the
//! one before), so the recorded order is the order the replay sees on the wall clock.

use super::group_policy::{member, touch, trace_lines};
use serde_json::Value;
use std::path::{Path, PathBuf};
use vramcap_tests::common::*;

/// The group's limit, member a's reserve and member b's priority, for the run and the replay.
const LIMIT: &str = "300m";

/// Runs the scenario under `policy` and returns the three members' traces (a, b, c).
///
/// a (reserve 100m) takes 50m; b (priority 5) 150m; c asks 120m then 40m; b asks 60m; a asks
/// 50m; a and c free what they took; all exit together. Under `shared` c's 120m and b's 60m are
/// refused (a's unmet reserve is in the way), under `equal` (share 100m among three) c's 120m
/// and b's 60m, under `priority` c's 120m and a's 50m (b took a's unmet reserve).
fn record(policy: &str) -> (PathBuf, Vec<PathBuf>) {
    let dir = private_group_dir();
    let g = |n: &str| dir.join(n);
    let traces: Vec<PathBuf> = ["a", "b", "c"].iter().map(|n| dir.join(format!("{n}.jsonl"))).collect();
    let base = [("VRAMCAP_GROUP_LIMIT", LIMIT), ("VRAMCAP_GROUP_POLICY", policy)];
    let run = |i: usize, extra: &[(&str, &str)], script: String| {
        let mut env: Vec<(&str, &str)> = base.to_vec();
        env.extend_from_slice(extra);
        member(&dir, "agree", &env).env("VRAMCAP_TRACE", &traces[i]).args([script]).spawn()
    };
    let end = g("end").display().to_string();
    let mut a = run(0, &[("VRAMCAP_GROUP_RESERVE", "100m")], format!("init ctx 0 alloc 50m waitfile {} alloc 50m waitfile {} free 0 waitfile {end}", g("a2").display(), g("free").display()));
    a.wait_for("alloc");
    let mut b = run(1, &[("VRAMCAP_PRIORITY", "5")], format!("init ctx 0 alloc 150m waitfile {} alloc 60m waitfile {end}", g("b2").display()));
    b.wait_for("alloc");
    let mut c = run(2, &[], format!("init ctx 0 alloc 120m alloc 40m waitfile {} free 1 waitfile {end}", g("free").display()));
    c.wait_for("alloc");
    c.wait_for("alloc");
    touch(&g("b2"));
    b.wait_for("alloc");
    touch(&g("a2"));
    a.wait_for("alloc");
    touch(&g("free"));
    a.wait_for("free");
    c.wait_for("free");
    touch(&g("end"));
    for m in [a, b, c] {
        assert!(m.finish().success());
    }
    (dir, traces)
}

fn deny_events(trace: &Path) -> u64 {
    trace_lines(trace).iter().filter(|l| l["type"] == "event" && l["op"] == "deny").count() as u64
}

/// `vramcap replay --json --policy POLICY` over the traces, each placed at its recorded start.
fn replay(policy: &str, traces: &[PathBuf]) -> Value {
    let starts: Vec<u64> = traces.iter().map(|t| trace_lines(t)[0]["start_unix_ns"].as_u64().unwrap()).collect();
    let first = *starts.iter().min().unwrap();
    let stagger = starts.iter().map(|s| format!("{}ns", s - first)).collect::<Vec<_>>().join(",");
    let paths: Vec<String> = traces.iter().map(|t| t.display().to_string()).collect();
    let out = std::process::Command::new(vramcap_bin())
        .args(["replay", "--json", "--limit", LIMIT, "--policy", policy, "--priority", "b.jsonl=5", "--reserve", "a.jsonl=100m", "--stagger", &stagger])
        .args(&paths)
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
}

/// A member's replay denials of requests its recorded run was granted: its denials less the
/// recorded denials the replay refused as well.
fn granted_refused(t: &Value) -> u64 {
    let n = |k: &str| t[k].as_u64().unwrap();
    n("denials") - (n("recorded_denials") - n("recorded_denials_granted"))
}

#[test]
fn replay_grants_and_refuses_what_the_library_did_under_every_policy() {
    let mut recorded = Vec::new();
    for policy in ["shared", "equal", "priority"] {
        let (_dir, traces) = record(policy);
        let denied: Vec<u64> = traces.iter().map(|t| deny_events(t)).collect();
        assert_eq!(denied.iter().sum::<u64>(), 2, "{policy}: the scenario refuses two requests: {denied:?}");
        let r = replay(policy, &traces);
        for (i, t) in r["traces"].as_array().unwrap().iter().enumerate() {
            // A recorded denial the replay refuses too is a denial of the replay (issue 28 §5);
            // any other is an allocation the library granted.
            assert_eq!(granted_refused(t), 0, "{policy}: the replay refuses an allocation the library granted: {t}");
            assert_eq!(t["recorded_denials"], denied[i], "{policy}: {t}");
            assert_eq!(t["recorded_denials_granted"], 0, "{policy}: the replay grants a request the library refused: {t}");
        }
        recorded.push((policy, traces, denied));
    }
    // The comparison can tell a wrong admission: each recording, replayed under a policy that
    // decides one of its requests otherwise (`priority` lets b take a's reserve, the others do
    // not), disagrees with it.
    for (policy, traces, _) in &recorded {
        let other = if *policy == "priority" { "shared" } else { "priority" };
        let r = replay(other, traces);
        let disagree: u64 = r["traces"].as_array().unwrap().iter().map(|t| granted_refused(t) + t["recorded_denials_granted"].as_u64().unwrap()).sum();
        assert!(disagree > 0, "the {policy} recording replays under {other} without a difference: {r}");
    }
}
