//! The trace reader behind `vramcap report`, `export` (csv, chrome, memory-viz) and `replay`: the
//! input is written as a trace file (and, split at the first 0xFF byte, as two traces, to drive
//! the k-way merge) and every command runs over it. Corrupt lines must be skipped, never crash.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use vramcap_fuzz::analysis::policy::Policy as replay_policy;
use vramcap_fuzz::analysis::{export, memviz, replay, report};

fuzz_target!(|data: &[u8]| {
    let dir = vramcap_fuzz::scratch_dir();
    let mut paths: Vec<PathBuf> = Vec::new();
    let parts: Vec<&[u8]> = match data.iter().position(|&b| b == 0xff) {
        Some(i) => vec![&data[..i], &data[i + 1..]],
        None => vec![data],
    };
    for (i, part) in parts.iter().enumerate() {
        let p = dir.join(format!("in{i}.jsonl"));
        std::fs::write(&p, part).unwrap();
        paths.push(p);
    }
    if let Ok(r) = report::compute(&paths) {
        let _ = report::to_text(&r);
        let _ = report::to_json(&r);
    }
    let all = export::Window { from: 0, to: u64::MAX };
    let out = dir.join("out");
    let _ = export::csv(&paths, &out, all);
    let _ = export::chrome(&paths, &out, all);
    let _ = memviz::export(&paths, &out, all);
    for (limit, stagger, json, policy) in [("1GiB", &[][..], true, replay_policy::Shared), ("50%", &[1000][..], false, replay_policy::Equal)] {
        let o = replay::Opts { limit, paths: &paths, stagger, json, policy, priority: &[], reserve: &[], headroom: None };
        let _ = replay::run(&o);
    }
});
