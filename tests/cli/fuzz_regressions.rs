//! Replays every input the fuzzers ever found (tests/fuzz_regressions/<target>/, one file each,
//! named after the bug) through the same entry points as the fuzz target of that name (fuzz/),
//! so a fixed crash stays fixed without cargo-fuzz. Add a file here for every finding.

use vramcap_tests::cli_support;
use vramcap_tests::env_input;

use std::path::PathBuf;
use vramcap_common::config::Config;
use vramcap_common::grammar::limits::parse_list;
use vramcap_common::grammar::size::{Size, parse_size};
use vramcap_common::group_ledger::{file, shm};

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = vramcap_tests::common::root().join("tests/fuzz_regressions").join(target);
    let mut v: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort();
    v.into_iter().map(|p| (p.clone(), std::fs::read(&p).unwrap())).collect()
}

#[test]
fn size_grammar() {
    for (p, data) in inputs("size_grammar") {
        let s = String::from_utf8_lossy(&data);
        match parse_size(&s) {
            Ok(Size::Percent(pct)) => assert!(pct > 0.0 && pct <= 100.0, "{}", p.display()),
            // Only a size written as zero means "no limit".
            Ok(Size::Unlimited) => assert!(s.trim().trim_start_matches(['0', '.']).chars().next().is_none_or(|c| !c.is_ascii_digit()), "{}: {s:?}", p.display()),
            _ => {}
        }
        if let Err(e) = parse_list("VRAMCAP_LIMIT", &s) {
            assert!(e.to_string().contains("expected"), "{}: {e}", p.display());
        }
    }
}

#[test]
fn env_config() {
    for (p, data) in inputs("env_config") {
        let vars = env_input::vars(&data);
        let c = Config::from_vars(&vars);
        if let Some(e) = c.error {
            assert!(e.to_string().contains(&e.var), "{}: {e}", p.display());
        }
    }
}

#[test]
fn group_ledger() {
    let dir = cli_support::scratch("fuzz-ledger");
    for (p, data) in inputs("group_ledger") {
        let Some((&mode, body)) = data.split_first() else { continue };
        let _ = file::parse_stat(&String::from_utf8_lossy(body));
        let len = if mode % 4 == 0 { body.len() } else { shm::LAYOUT_BYTES + (mode as usize >> 2) };
        let mut bytes = vec![0u8; len];
        let n = body.len().min(len);
        bytes[..n].copy_from_slice(&body[..n]);
        let f = dir.join("ledger");
        std::fs::write(&f, &bytes).unwrap();
        if let Ok(Some(m)) = file::open_existing(&f) {
            let _ = m.shm.reclaim_dead(1, &|ms: &[shm::Member]| vec![shm::Liveness::Dead; ms.len()]);
            m.unmap();
        }
        let _ = p;
    }
}

#[test]
fn trace_reader() {
    let dir = cli_support::scratch("fuzz-trace");
    for (p, data) in inputs("trace_reader") {
        let t = dir.join("in.jsonl");
        std::fs::write(&t, &data).unwrap();
        let (t, out) = (t.to_str().unwrap(), dir.join("out").to_string_lossy().into_owned());
        for args in [
            vec!["report", t],
            vec!["export", "--format", "csv", t, "-o", &out],
            vec!["export", "--format", "chrome", t, "-o", &out],
            vec!["export", "--format", "memory-viz", t, "-o", &out],
            vec!["replay", "--limit", "1GiB", t],
        ] {
            let o = cli_support::vramcap(&args);
            // 0 or a clean error (1/2): never a panic (101) or a signal.
            assert!(matches!(o.status.code(), Some(0..=2)), "{} {args:?}: {:?}\n{}", p.display(), o.status, String::from_utf8_lossy(&o.stderr));
        }
    }
}

