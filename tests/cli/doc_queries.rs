//! The DuckDB queries printed in docs/analysis.md, run as written (DuckDB from PyPI, installed into
//! `.venv` by scripts/test) on a folder of real traces: the documented answers must be right.
//! (They were not: `max(used)` compared text until the query cast the column.)

use vramcap_tests::common;
use common::*;
use serde_json::Value;

#[test]
fn the_documented_duckdb_queries_give_the_right_answers() {
    let dir = std::env::temp_dir().join(format!("vramcap-docq-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("traces")).unwrap();
    // A capped job: peak 10 MiB (8 + 2 at the end), two denials (100 MiB, 200 MiB), 10 MiB held at exit.
    Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "64m")
        .env("VRAMCAP_TRACE", dir.join("traces/a-%p.jsonl"))
        .args(["init ctx 0 alloc 1m alloc 8m free 0 alloc 100m alloc 200m alloc 2m"])
        .run()
        .ok();
    // A job whose peak (300 MiB) sorts lower as text than its later 5 MiB.
    Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", dir.join("traces/b-%p.jsonl"))
        .args(["init ctx 0 alloc 300m free 0 alloc 5m free 1"])
        .run()
        .ok();

    let py = root().join(".venv/bin/python");
    assert!(py.exists(), "{} missing: scripts/test creates it with duckdb", py.display());
    let out = std::process::Command::new(&py)
        .arg(root().join("tests/python/doc_queries.py"))
        .arg(root().join("docs/analysis.md"))
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let results: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let rows = |needle: &str| -> Vec<Vec<Value>> {
        let r = results.iter().find(|r| r["sql"].as_str().unwrap().contains(needle)).unwrap_or_else(|| panic!("no query ending in {needle:?}: {results:?}"));
        serde_json::from_value(r["rows"].clone()).unwrap()
    };

    // Peak per process and device, largest first: host, pid, exe, dev, peak_bytes.
    let peaks = rows("ORDER BY peak_bytes DESC");
    let got: Vec<(String, u64)> = peaks.iter().map(|r| (r[2].as_str().unwrap().to_string(), r[4].as_u64().unwrap())).collect();
    assert_eq!(got, [("client_linked".to_string(), 300 * MIB), ("client_procaddr".to_string(), 10 * MIB)]);
    assert!(peaks.iter().all(|r| r[3] == 0), "device 0 only: {peaks:?}");

    // Denials: host, pid, exe, count, largest request.
    let denials = rows("ORDER BY denials DESC");
    assert_eq!(denials.len(), 1, "{denials:?}");
    assert_eq!((denials[0][2].as_str(), denials[0][3].as_u64(), denials[0][4].as_u64()), (Some("client_procaddr"), Some(2), Some(200 * MIB)));

    // Memory left behind, from the summary lines.
    let left = rows("WHERE type = 'summary'");
    assert_eq!(left.len(), 2);
    let held = |prefix: &str| -> Value {
        let r = left.iter().find(|r| r[0].as_str().unwrap().contains(prefix)).unwrap();
        serde_json::from_str(r[1].as_str().unwrap()).unwrap()
    };
    assert_eq!(held("traces/a-")["0"], 10 * MIB);
    assert_eq!(held("traces/b-")["0"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}
