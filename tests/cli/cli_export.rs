//! `vramcap export` (chrome, memory-viz, csv) and `vramcap plot` outputs are what their
//! consumers accept: JSON with counters, a pickle Python loads in PyTorch's snapshot layout, a
//! well-formed SVG, CSV rows with the trace's column names.

use vramcap_tests::cli_support;
use cli_support::*;

#[test]
fn chrome_export_is_json_with_counters_and_denial_instants() {
    let dir = scratch("chrome");
    let out = dir.join("t.json");
    ok(&["export", "--format", "chrome", &data("job_rank0.jsonl"), &data("job_rank1.jsonl"), "-o", out.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).expect("chrome export parses as JSON");
    let evs = v["traceEvents"].as_array().unwrap();
    let counters: Vec<&serde_json::Value> = evs.iter().filter(|e| e["ph"] == "C").collect();
    // Every alloc and free of both ranks is a counter sample: rank0 4 + 2, rank1 2 + 1.
    assert_eq!(counters.len(), 9);
    let rank0_max = counters.iter().filter(|e| e["pid"] == 100).map(|e| e["args"]["bytes"].as_u64().unwrap()).max();
    assert_eq!(rank0_max, Some(3 * GIB));
    assert!(counters.iter().all(|e| e["name"] == "GPU 0 used"));
    // rank1's first alloc sits 2.5 us after rank0's start on the wall clock.
    assert!(counters.iter().any(|e| e["pid"] == 200 && e["ts"].as_f64() == Some(2.5)));
    let instants: Vec<&serde_json::Value> = evs.iter().filter(|e| e["ph"] == "i").collect();
    assert_eq!(instants.len(), 2, "one denial and one driver failure");
    assert!(instants[0]["name"].as_str().unwrap().starts_with("denied"));
    assert!(evs.iter().any(|e| e["ph"] == "M" && e["args"]["name"].as_str().is_some_and(|n| n.contains("pid 200"))));
}

#[test]
fn chrome_window_starts_at_the_right_level() {
    let dir = scratch("window");
    let out = dir.join("t.json");
    ok(&["export", "--format", "chrome", &data("job_rank0.jsonl"), "-o", out.to_str().unwrap(), "--from", "4500ns", "--to", "7500ns"]);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let c: Vec<(f64, u64)> = v["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "C").map(|e| (e["ts"].as_f64().unwrap(), e["args"]["bytes"].as_u64().unwrap())).collect();
    // The level at 4.5 us (1 GiB), then the allocs at 5 us and 7 us; the free at 8 us is out.
    assert_eq!(c, vec![(4.5, GIB), (5.0, GIB + 512 * MIB), (7.0, GIB + 768 * MIB)]);
}

#[test]
fn memory_viz_pickle_loads_in_python_with_the_snapshot_layout() {
    let dir = scratch("memviz");
    let out = dir.join("snap.pickle");
    ok(&["export", "--format", "memory-viz", &data("job_rank0.jsonl"), "-o", out.to_str().unwrap()]);
    let script = r#"
import pickle, sys, json
with open(sys.argv[1], 'rb') as f:
    head = f.read(2)
    f.seek(0)
    s = pickle.load(f)
assert head[0] == 0x80 and head[1] <= 4, head
t = s['device_traces'][0]
print(json.dumps({
  'keys': sorted(s.keys()),
  'actions': [e['action'] for e in t],
  'oom': [e for e in t if e['action'] == 'oom'],
  'first': t[0],
  'segments': [(g['device'], g['address'], g['total_size'], g['blocks'][0]['state'], g['segment_pool_id']) for g in s['segments']],
}))
"#;
    let v: serde_json::Value = serde_json::from_str(&python(script, &[out.to_str().unwrap()])).unwrap();
    assert_eq!(v["keys"], serde_json::json!(["device_traces", "segments"]));
    let actions: Vec<&str> = v["actions"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(
        actions,
        ["segment_alloc", "alloc", "segment_alloc", "alloc", "oom", "free_completed", "segment_free", "segment_alloc", "alloc", "segment_alloc", "alloc", "free_completed", "segment_free"]
    );
    // The denial: 2 GiB requested while 3 of the 4 GiB cap were in use.
    assert_eq!(v["oom"][0]["size"].as_u64(), Some(2 * GIB));
    assert_eq!(v["oom"][0]["device_free"].as_u64(), Some(GIB));
    assert_eq!(v["first"]["addr"], 0x1000);
    assert_eq!(v["first"]["time_us"].as_u64(), Some(1_764_441_600_000_001));
    assert_eq!(v["first"]["frames"][0]["filename"], "cuMemAlloc_v2");
    // What is still allocated at the end: the two leaks, as segments of one active block.
    assert_eq!(v["segments"], serde_json::json!([[0, 0x1000, GIB, "active_allocated", [0, 0]], [0, 0x3000, 512 * MIB, "active_allocated", [0, 0]]]));
}

#[test]
fn csv_has_one_row_per_event_with_trace_column_names() {
    let dir = scratch("csv");
    let out = dir.join("t.csv");
    ok(&["export", "--format", "csv", &data("job_rank0.jsonl"), &data("job_rank1.jsonl"), "-o", out.to_str().unwrap()]);
    let text = std::fs::read_to_string(&out).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    for col in ["seq", "t_ns", "tid", "op", "api", "dev", "ptr", "size", "result", "dur_ns", "used", "pid"] {
        assert!(header.contains(&col), "missing column {col}");
    }
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 11);
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    // Rows come in wall-clock order: rank1's first alloc (wall 2500) sits between rank0's 2000 and 3000.
    let unix: Vec<u64> = rows.iter().map(|r| r[col("unix_ns")].parse().unwrap()).collect();
    assert!(unix.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(rows[2][col("pid")], "200");
    assert_eq!(rows[2][col("ptr")], "0xa000");
}

#[test]
fn plot_writes_a_well_formed_svg_with_cap_and_denials() {
    let dir = scratch("plot");
    let out = dir.join("usage.svg");
    ok(&["plot", &data("job_rank0.jsonl"), &data("job_rank1.jsonl"), "-o", out.to_str().unwrap()]);
    let script = r#"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag.endswith('svg'), root.tag
print('\n'.join(t.text or '' for t in root.iter() if t.tag.endswith('text')))
"#;
    let texts = python(script, &[out.to_str().unwrap()]);
    for want in ["GPU 0", "cap", "denied", "pid 100", "pid 200"] {
        assert!(texts.contains(want), "SVG lacks {want:?}; texts:\n{texts}");
    }
}

/// The state at each trace's end is drawn and named (rank0 ends holding 1.5 GiB, rank1 1 GiB),
/// tick labels carry no needless decimals, time is in seconds as the docs say, and the legend
/// sits beside the data, not on it.
#[test]
fn plot_shows_the_end_state_plain_ticks_and_a_legend_beside_the_data() {
    let dir = scratch("plot-end");
    let out = dir.join("usage.svg");
    ok(&["plot", &data("job_rank0.jsonl"), &data("job_rank1.jsonl"), "-o", out.to_str().unwrap()]);
    let script = r#"
import sys, re, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
right = 0.0
for el in root.iter():
    if el.tag.endswith('polygon') or el.tag.endswith('polyline'):
        for p in el.get('points', '').split():
            right = max(right, float(p.split(',')[0]))
for t in root.iter():
    if t.tag.endswith('text'):
        print(f"{float(t.get('x')):.0f}|{(t.text or '').strip()}")
print(f"RIGHT|{right:.0f}")
"#;
    let lines = python(script, &[out.to_str().unwrap()]);
    let texts: Vec<(f64, &str)> = lines.lines().filter_map(|l| l.split_once('|')).map(|(x, t)| (x.parse().unwrap_or(0.0), t)).collect();
    let right: f64 = lines.lines().find_map(|l| l.strip_prefix("RIGHT|")).unwrap().parse().unwrap();
    let has = |want: &str| texts.iter().find(|t| t.1.contains(want)).unwrap_or_else(|| panic!("no {want:?} in {lines}"));
    assert!(has("pid 100 (python3): 1.5 GiB at end").0 > right, "legend beside the data: {lines}");
    has("pid 200 (python3): 1.0 GiB at end");
    has("all: 2.5 GiB held at the end");
    has("seconds since the first trace start");
    for (_, t) in &texts {
        if t.parse::<f64>().is_ok() {
            assert!(!(t.contains('.') && t.ends_with('0')), "needless decimals in tick {t:?}");
        }
    }
}

/// Found by fuzzing (trace_reader): an event on device 1879048192 made the memory-viz export write
/// one empty list per ordinal up to it and never finish; device -1 wrapped the count.
#[test]
fn memory_viz_with_implausible_device_numbers_finishes_and_loads() {
    let dir = scratch("memviz-devs");
    let trace = dir.join("t.jsonl");
    let h = r#"{"type":"header","version":1,"pid":7,"ppid":1,"exe":"x","cmdline":["x"],"host":"h","start_unix_ns":1764441600000000000,"devices":[{"index":0,"total":1024,"limit":null}],"group":null}"#;
    let ev = |seq: u64, dev: i64, ptr: &str| {
        format!(r#"{{"type":"event","seq":{seq},"t_ns":{},"tid":1,"op":"alloc","api":"cuMemAlloc_v2","dev":{dev},"ptr":"{ptr}","size":256,"result":0,"dur_ns":1,"used":256}}"#, 1000 * (seq + 1))
    };
    std::fs::write(&trace, format!("{h}\n{}\n{}\n{}\n", ev(0, 0, "0x100"), ev(1, 1879048192, "0x200"), ev(2, -1, "0x300"))).unwrap();
    let out = dir.join("snap.pickle");
    let t0 = std::time::Instant::now();
    ok(&["export", "--format", "memory-viz", trace.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(t0.elapsed() < std::time::Duration::from_secs(20));
    let n = python("import pickle,sys; print(len(pickle.load(open(sys.argv[1],'rb'))['device_traces']))", &[out.to_str().unwrap()]);
    // Devices 0 and 1879048192 get a list each (device -1 events have none), not one per ordinal.
    assert_eq!(n.trim(), "2");
}

/// A cap that changed while the job ran (issue 26: `limit` events) is drawn as the step function
/// it was: level at 1 GiB, down to 256 MiB at t = 2 s, level again; the group's dashed budget
/// steps from 2 GiB to 4 GiB at t = 3 s. The legend names both ends.
#[test]
fn plot_draws_a_cap_that_changed_as_steps() {
    let dir = scratch("plot-steps");
    let trace = dir.join("t.jsonl");
    let h = r#"{"type":"header","version":1,"pid":7,"ppid":1,"exe":"x","cmdline":["x"],"host":"h","start_unix_ns":1764441600000000000,"devices":[{"index":0,"total":17179869184,"limit":1073741824,"group_limit":2147483648}],"group":"g"}"#;
    let ev = |seq: u64, t_s: u64, rest: &str| format!(r#"{{"type":"event","seq":{seq},"t_ns":{},"tid":1,"dev":0,"result":0,"dur_ns":1,{rest}}}"#, t_s * 1_000_000_000);
    let lines = [
        h.to_string(),
        ev(0, 1, r#""op":"alloc","api":"cuMemAlloc_v2","ptr":"0x100","size":134217728,"used":134217728"#),
        ev(1, 2, r#""op":"limit","api":"ceiling","ptr":"0x40000000","size":268435456,"used":134217728,"old":1073741824,"new":268435456,"uid":0,"source":"ceiling""#),
        ev(2, 3, r#""op":"limit","api":"group","ptr":"0x80000000","size":4294967296,"used":134217728,"old":2147483648,"new":4294967296,"uid":0,"source":"group""#),
        ev(3, 5, r#""op":"free","api":"cuMemFree_v2","ptr":"0x100","size":134217728,"used":0"#),
    ];
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let out = dir.join("usage.svg");
    ok(&["plot", trace.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    // The red solid line (the cap) and the legend's texts; the dashed budget's pieces' heights.
    let script = r#"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
solid, dashed = [], set()
for el in root.iter():
    if el.tag.endswith('polyline') and el.get('stroke', '').upper() == '#FF0000':
        pts = [tuple(float(v) for v in p.split(',')) for p in el.get('points', '').split()]
        if len(pts) > 2:
            solid.append(pts)
        else:
            dashed.update(round(p[1]) for p in pts)
for pts in solid:
    print('SOLID', ' '.join(f'{x:.0f},{y:.0f}' for x, y in pts))
print('DASHED', len(dashed))
print('\n'.join(t.text or '' for t in root.iter() if t.tag.endswith('text')))
"#;
    let got = python(script, &[out.to_str().unwrap()]);
    let solid: Vec<Vec<(f64, f64)>> = got
        .lines()
        .filter_map(|l| l.strip_prefix("SOLID "))
        .map(|l| l.split(' ').map(|p| p.split_once(',').map(|(x, y)| (x.parse().unwrap(), y.parse().unwrap())).unwrap()).collect())
        .collect();
    // One cap line, four points: level, a vertical step at one x, level again, lower down (SVG y
    // grows downwards).
    let cap: Vec<_> = solid.iter().filter(|p| p.len() == 4).collect();
    assert_eq!(cap.len(), 1, "{got}");
    let p = cap[0];
    assert!(p[0].1 == p[1].1 && p[1].0 == p[2].0 && p[2].1 == p[3].1 && p[2].1 > p[1].1, "not a step down: {p:?}\n{got}");
    let dashed: usize = got.lines().find_map(|l| l.strip_prefix("DASHED ")).unwrap().parse().unwrap();
    assert!(dashed >= 2, "the budget's dashes at two heights: {got}");
    for want in ["cap 1.0 GiB -> 256.0 MiB (1 change)", "group \"g\" budget 2.0 GiB -> 4.0 GiB (1 change)"] {
        assert!(got.contains(want), "no {want:?}:\n{got}");
    }
}
