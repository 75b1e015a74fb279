//! Helpers shared by the trace tests (tests/trace/trace.rs, tests/trace/trace_files.rs).

use serde_json::Value;
use std::path::{Path, PathBuf};

pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vramcap-trace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every complete line of a trace, parsed; a cut last line (no newline) is skipped.
pub fn read_trace(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    complete
        .lines()
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}:{}: {e}: {l}", path.display(), i + 1)))
        .collect()
}

pub fn events(t: &[Value]) -> Vec<&Value> {
    t.iter().filter(|v| v["type"] == "event").collect()
}

pub fn only_file(dir: &Path) -> PathBuf {
    let files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}
