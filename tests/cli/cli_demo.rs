//! `vramcap demo` end to end on the fake GPU: it runs, its files exist and parse, and they tell
//! the story the job acts out (a cap, a denial at the burst, a leak held at exit).

use vramcap_tests::cli_support;
use vramcap_tests::common;
use cli_support::*;

const CAP: u64 = 8 * GIB;

#[test]
fn demo_runs_end_to_end_and_its_outputs_parse() {
    common::build_c();
    let out_dir = scratch("demo").join("out");
    let out = clean_vramcap(&["demo", "--out", &out_dir.to_string_lossy()]).output().unwrap();
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "demo failed:\n{so}\n{se}");

    // The trace: every line JSON, header first, summary last, a deny among the events.
    let trace = std::fs::read_to_string(out_dir.join("trace.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> =
        trace.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l}: {e}"))).collect();
    assert_eq!(lines[0]["type"], "header");
    assert_eq!(lines.last().unwrap()["type"], "summary");
    assert_eq!(lines[0]["devices"][0]["limit"].as_u64(), Some(CAP));
    let denies: Vec<&serde_json::Value> = lines.iter().filter(|e| e["op"] == "deny").collect();
    assert_eq!(denies.len(), 1, "the burst is refused once");
    let d = denies[0];
    assert!(d["used"].as_u64().unwrap() + d["size"].as_u64().unwrap() > CAP, "refused because it would pass the cap");
    assert_eq!(d["result"], 2, "CUDA_ERROR_OUT_OF_MEMORY");
    let max_used = lines.iter().filter_map(|e| e["used"].as_u64()).max().unwrap();
    assert!(max_used <= CAP && max_used > CAP / 2, "usage climbs near the cap but never over it: {max_used}");

    // The report: on stdout, in report.txt, and the same facts from `vramcap report --json`.
    let report_txt = std::fs::read_to_string(out_dir.join("report.txt")).unwrap();
    assert!(so.contains(&report_txt), "stdout shows the report");
    assert!(report_txt.contains("denied          1") && report_txt.contains("cap 8.0 GiB"), "{report_txt}");
    let r = json(&["report", "--json", &out_dir.join("trace.jsonl").to_string_lossy()]);
    let dev = &r["processes"][0]["devices"][0];
    assert_eq!(dev["denied"], 1);
    let (leaked, n) = (dev["leaked_bytes"].as_u64().unwrap(), dev["leaked_count"].as_u64().unwrap());
    assert!(n > 10 && leaked == n * 12 * MIB, "the leak: {n} loss tensors of 12 MiB held at exit, got {leaked} bytes");

    // The plot: a well-formed SVG with the cap and the denial drawn.
    let svg = out_dir.join("usage.svg");
    let root = python("import sys, xml.etree.ElementTree as E; print(E.parse(sys.argv[1]).getroot().tag)", &[&svg.to_string_lossy()]);
    assert_eq!(root.trim(), "{http://www.w3.org/2000/svg}svg");
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.contains("denied") && svg_text.contains("cap"), "legend names the cap and the denial");
    // ... and the leak at exit: the last step of the plot holds it, and the legend says it.
    let held = format!("{:.1} MiB held at the end", leaked as f64 / MIB as f64);
    assert!(svg_text.contains(&held), "the plot shows the leak at exit ({held})");
    assert!(report_txt.contains(&format!("held at exit    {:.1} MiB", leaked as f64 / MIB as f64)), "{report_txt}");

    // The Perfetto export parses too.
    let chrome: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("trace.chrome.json")).unwrap()).unwrap();
    assert!(chrome.is_object() || chrome.is_array());

    // And the user is told where the files are and what to look at.
    for want in ["what to look at", "the denial", "the leak", "usage.svg", "trace.jsonl", &out_dir.to_string_lossy()] {
        assert!(so.contains(want), "missing {want:?} in:\n{so}");
    }
}

#[test]
fn demo_without_a_fake_driver_says_how_to_get_one() {
    // The binary alone, with the library next to it but no source tree or installed demo.
    let exe = lonely_binary("demo-nofake");
    std::fs::copy(
        std::path::Path::new(vramcap_tests::common::vramcap_bin()).parent().unwrap().join("libvramcap.so"),
        exe.parent().unwrap().join("libvramcap.so"),
    )
    .unwrap();
    let mut c = std::process::Command::new(&exe);
    clean_env(&mut c);
    let out = output_of_copy(c.args(["demo", "--out", &scratch("demo-nofake-out").join("o").to_string_lossy()]));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("make -C cuda-shim") && err.contains("libcuda.so.1") && err.contains("install.sh"), "{err}");
}
