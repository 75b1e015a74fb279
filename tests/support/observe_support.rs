//! Observe mode (issue 26): what the preload, group and CLI tests check of a trace written in
//! observe mode — every would-be denial in it, the report's summary of them, and `replay` agreeing.

use super::common::vramcap_bin;
use super::trace_support::{events, read_trace};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// The three ways a program reaches the driver (tests/preload/lookups.rs).
pub const LOOKUPS: [&str; 3] = ["client_linked", "client_dlsym", "client_procaddr"];

/// One `would_deny` event as the test expects it: (api, size, cap, limit, charge).
pub type Want<'a> = (&'a str, u64, &'a str, u64, u64);

/// The trace's `would_deny` events are exactly `want`, in order, each followed on its thread by
/// the granted `alloc` of the same size; the header says observe and the summary counts them.
/// Returns the trace's lines.
pub fn check_trace(path: &Path, want: &[Want]) -> Vec<Value> {
    let t = read_trace(path);
    let ev = events(&t);
    let got: Vec<&Value> = ev.iter().copied().filter(|e| e["op"] == "would_deny").collect();
    let shown: Vec<Want> = got
        .iter()
        .map(|e| (e["api"].as_str().unwrap(), e["size"].as_u64().unwrap(), e["cap"].as_str().unwrap(), e["limit"].as_u64().unwrap(), e["charge"].as_u64().unwrap()))
        .collect();
    assert_eq!(shown, want, "{}", path.display());
    for w in &got {
        // The named fields repeat ptr, result and dur_ns (docs/trace-format.md).
        assert_eq!(w["ptr"].as_str().unwrap(), format!("{:#x}", w["limit"].as_u64().unwrap()));
        assert_eq!(w["dur_ns"], w["charge"]);
        let seq = w["seq"].as_u64().unwrap();
        let next = ev
            .iter()
            .find(|e| e["seq"].as_u64().unwrap() > seq && e["tid"] == w["tid"] && e["op"] != "would_deny")
            .unwrap_or_else(|| panic!("nothing after {w}"));
        assert_eq!((next["op"].as_str(), next["result"].as_i64()), (Some("alloc"), Some(0)), "granted: {next}");
    }
    assert!(!ev.iter().any(|e| e["op"] == "deny"), "observe mode refuses nothing");
    assert_eq!(t[0]["mode"], "observe", "header: {}", t[0]);
    let summary = t.last().unwrap();
    assert_eq!(summary["type"], "summary");
    let counted: u64 = summary["would_deny"].as_object().expect("summary would_deny").values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(counted, want.len() as u64, "{summary}");
    t
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(vramcap_bin()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `vramcap report` on the trace: the device's would-be denials, the first one and the summary
/// line, e.g. "peak 1.3 GiB: a 1.0 GiB cap would have refused 2 allocations, the first at t=0.0 s
/// in cuMemAlloc_v2 (600.0 MiB)" (`cap` is "cap", "group budget" or "ceiling"); then `replay
/// --limit` with `limit` counts the same refusals, the first one being the same allocation.
pub fn check_report_and_replay(path: &Path, want: &[Want], cap: &str, replay_limit: Option<&str>) {
    let p = path.to_str().unwrap();
    let (ok, text) = run(&["report", "--json", p]);
    assert!(ok, "report failed");
    let r: Value = serde_json::from_str(&text).unwrap();
    let proc = &r["processes"][0];
    assert_eq!(proc["mode"], "observe");
    let d = proc["devices"].as_array().unwrap().iter().find(|d| d["index"] == 0).expect("device 0");
    assert_eq!(d["would_deny"].as_u64(), Some(want.len() as u64), "{d}");
    assert_eq!(d["would_deny_total"].as_u64(), Some(want.len() as u64), "{d}");
    assert_eq!(d["denied"].as_u64(), Some(0));
    let f = &d["first_would_deny"];
    let (api, size, kind, limit, charge) = want[0];
    assert_eq!((f["api"].as_str(), f["size"].as_u64(), f["cap"].as_str(), f["limit"].as_u64(), f["charge"].as_u64()), (Some(api), Some(size), Some(kind), Some(limit), Some(charge)));
    let t_s = f["t_ns"].as_u64().unwrap() as f64 / 1e9;
    let peak = vramcap_common::grammar::size::human(d["peak"].as_u64().unwrap());
    let n = want.len();
    let line = format!(
        "observe mode    peak {peak}: a {} {cap} would have refused {n} allocation{}, the first at t={t_s:.1} s in {api} ({})",
        vramcap_common::grammar::size::human(limit),
        if n == 1 { "" } else { "s" },
        vramcap_common::grammar::size::human(size)
    );
    let (_, text) = run(&["report", p]);
    assert!(text.contains(&line), "want {line:?} in:\n{text}");
    let Some(l) = replay_limit else { return };
    let (fits, out) = run(&["replay", "--json", "--limit", l, p]);
    assert!(!fits, "replay must say they do not fit");
    let rp: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rp["denials"].as_u64(), Some(n as u64), "replay counts what observe mode counted: {rp}");
    let fd = &rp["first_denial"];
    assert_eq!((fd["api"].as_str(), fd["size"].as_u64()), (Some(api), Some(size)), "{fd}");
    // The same allocation: replay stamps it when its granted `alloc` returned.
    let t = read_trace(path);
    let ev = events(&t);
    let first = ev.iter().position(|e| e["op"] == "would_deny").unwrap();
    let granted = ev[first + 1..].iter().find(|e| e["op"] == "alloc" && e["tid"] == ev[first]["tid"]).unwrap();
    assert_eq!(fd["t_ns"], granted["t_ns"], "{fd} vs {granted}");
}
