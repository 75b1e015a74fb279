//! The writer and the readers agree on every record: each kind is written with every field set
//! and read back, and the written lines are the golden ones checked in at
//! tests/data/golden/trace-v1.jsonl (`VRAMCAP_BLESS=1 cargo test -p vramcap-common golden`
//! rewrites that file after a deliberate format change; docs/trace-format.md says what changed).

use super::Op;
use super::event::{self, EventLine, Line, Names, parse_line};
use super::record::*;

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/golden/trace-v1.jsonl");

fn per_device(v: &[(&str, u64)]) -> PerDevice {
    v.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn sharing(i: u64) -> DeviceSharing {
    DeviceSharing { group_reserve: Some(2 << 30 | i), group_headroom: Some(4 << 30 | i), group_share: Some(12 << 30 | i) }
}

/// A header with every field set (and one device without a group cap, whose group fields are
/// absent, and without a limit: `null`).
fn header() -> Header {
    Header {
        kind: "header".into(),
        version: 1,
        pid: 4243,
        ppid: 4200,
        exe: "python3".into(),
        cmdline: vec!["python3".into(), "eval.py".into(), "--lr=0.1".into()],
        host: "node-7".into(),
        start_unix_ns: 1_764_441_600_000_000_000,
        devices: vec![
            DeviceLine { index: 0, total: 17_179_869_184, limit: Some(4 << 30), group_limit: Some(20 << 30), sharing: sharing(1) },
            DeviceLine { index: 1, total: 17_179_869_184, limit: None, group_limit: None, sharing: DeviceSharing::default() },
        ],
        group: Some("team".into()),
        group_policy: Some("equal".into()),
        group_priority: Some(-5),
        group_holds_headroom: Some(true),
        job: Some("0f3a-job_7:retry.2".into()),
        mode: Some("observe".into()),
    }
}

fn summary() -> Summary {
    Summary {
        kind: "summary".into(),
        t_ns: Some(5_023_114_000),
        events: 1234,
        dropped: 3,
        peak: per_device(&[("0", 8 << 30), ("1", 1 << 20)]),
        used: per_device(&[("0", 0), ("1", 4096)]),
        denied: Some(per_device(&[("0", 12), ("1", 0)])),
        would_deny: Some(per_device(&[("0", 3), ("1", 0)])),
        group: Some(GroupSummary {
            name: "team".into(),
            limit: per_device(&[("0", 20 << 30)]),
            used: per_device(&[("0", 4 << 30)]),
            policy: Some("equal".into()),
            priority: Some(-5),
            holds_headroom: Some(true),
            reserve: per_device(&[("0", 2 << 30)]),
            headroom: per_device(&[("0", 4 << 30)]),
            share: per_device(&[("0", 8 << 30)]),
        }),
    }
}

fn usage() -> Usage {
    Usage {
        kind: "usage".into(),
        t_ns: 1_014_156_442,
        events: 2,
        dropped: 1,
        devices: vec![
            DeviceUsage {
                index: 0,
                used: 100 << 20,
                limit: Some(1 << 30),
                peak: 200 << 20,
                denied: 1,
                would_deny: 2,
                group_limit: Some(20 << 30),
                group_used: Some(6 << 30),
                overhead: 300 << 20,
                sharing: sharing(2),
            },
            DeviceUsage { index: 1, used: 0, limit: None, peak: 0, denied: 0, would_deny: 0, group_limit: None, group_used: None, overhead: 0, sharing: DeviceSharing::default() },
        ],
        allocations: vec![AllocCount { dev: 0, api: "cuMemAlloc_v2".into(), count: 7 }],
    }
}

/// One event per op the library writes, each field distinct from the others and from its
/// default, with and without `group_used`.
fn events() -> Vec<EventLine<'static>> {
    Op::WRITTEN
        .iter()
        .enumerate()
        .map(|(i, &op)| {
            let i = i as u64;
            EventLine {
                seq: 17 + i,
                t_ns: 1_200_345 + i,
                tid: 4243 + i,
                op,
                api: ["cuMemAlloc_v2", "cuMemFreeAsync_ptsz", "cuMemCreate"][i as usize % 3],
                dev: if op == Op::HostAlloc { -1 } else { i as i32 % 3 },
                ptr: 0x7f3a_4000_0000 + (i << 12),
                size: 1_048_576 + i,
                result: if op == Op::Fail { 2 } else if op == Op::Deny { -(i as i64) } else if op == Op::WouldDeny { 2 } else { 0 },
                dur_ns: 850 + i,
                used: 5_242_880 + i,
                group_used: (i % 2 == 0).then_some(1 << 33 | i),
            }
        })
        .collect()
}

fn golden_text() -> String {
    let mut buf = Vec::new();
    json_line(&mut buf, &header());
    for e in events() {
        event::write(&mut buf, &e);
    }
    json_line(&mut buf, &usage());
    json_line(&mut buf, &summary());
    String::from_utf8(buf).unwrap()
}

fn check_event(line: &[u8], want: &EventLine) {
    let mut names = Names::default();
    let got = match parse_line(line, &mut names) {
        Ok(Line::Event(e)) => e,
        _ => panic!("not read as an event: {}", String::from_utf8_lossy(line)),
    };
    let read = EventLine {
        seq: got.seq,
        t_ns: got.t_ns,
        tid: got.tid,
        op: got.op,
        api: names.get(got.api),
        dev: got.dev,
        ptr: got.ptr,
        size: got.size,
        result: got.result,
        dur_ns: got.dur_ns,
        used: got.used.expect("used"),
        group_used: got.group_used,
    };
    assert_eq!(&read, want, "{}", String::from_utf8_lossy(line));
    assert_eq!(names.get(got.op_name), want.op.name());
}

/// Every op, every field: written by the writer, read by the reader's fast path and by its
/// serde fallback (a nested unknown field forces it), unknown fields skipped on both.
#[test]
fn every_event_field_survives_a_round_trip_on_both_read_paths() {
    for e in events() {
        let mut buf = Vec::new();
        event::write(&mut buf, &e);
        let line = buf.strip_suffix(b"\n").unwrap().to_vec();
        check_event(&line, &e);
        let text = String::from_utf8(line).unwrap();
        let unknown_flat = text.replacen("{\"type\":\"event\",", "{\"type\":\"event\",\"future\":1,\"note\":\"x\",", 1);
        check_event(unknown_flat.as_bytes(), &e);
        let nested = text.replacen("{\"type\":\"event\",", "{\"type\":\"event\",\"future\":{\"a\":[1,{\"b\":null}]},", 1);
        check_event(nested.as_bytes(), &e);
        let escaped = text.replacen("{\"type\":\"event\",", "{\"type\":\"event\",\"note\":\"a\\\"b\",", 1);
        check_event(escaped.as_bytes(), &e);
        // Every key the writer wrote is one the reader knows (no field left unread).
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        let mut known = vec!["type", "seq", "t_ns", "tid", "op", "api", "dev", "ptr", "size", "result", "dur_ns", "used", "group_used"];
        if e.op == Op::Limit {
            // A `limit` event's named fields repeat ptr, size, result and api (read through them).
            known.extend(["old", "new", "uid", "source"]);
            assert_eq!((v["old"].as_u64(), v["new"].as_u64(), v["uid"].as_i64()), (Some(e.ptr), Some(e.size), Some(e.result)));
            assert_eq!(v["source"].as_str(), Some(e.api));
        }
        if e.op == Op::WouldDeny {
            // A `would_deny` event's named fields repeat result, ptr and dur_ns.
            known.extend(["cap", "limit", "charge"]);
            assert_eq!((v["cap"].as_str(), v["limit"].as_u64(), v["charge"].as_u64()), (Some("group"), Some(e.ptr), Some(e.dur_ns)));
        }
        assert!(keys.iter().all(|k| known.contains(&k.as_str())), "{keys:?}");
        assert_eq!(keys.len(), known.len() - if e.group_used.is_some() { 0 } else { 1 });
    }
}

/// Header, usage and summary: what is written reads back equal, unknown fields skipped.
#[test]
fn header_usage_and_summary_survive_a_round_trip() {
    let mut names = Names::default();
    let mut buf = Vec::new();
    json_line(&mut buf, &header());
    let mut line = String::from_utf8(buf).unwrap().trim_end().to_string();
    match parse_line(line.as_bytes(), &mut names) {
        Ok(Line::Header(h)) => assert_eq!(*h, header()),
        _ => panic!("header not read: {line}"),
    }
    line = line.replacen("{\"type\":\"header\",", "{\"type\":\"header\",\"future\":{\"x\":[1]},", 1);
    assert!(matches!(parse_line(line.as_bytes(), &mut names), Ok(Line::Header(h)) if *h == header()));

    let mut buf = Vec::new();
    json_line(&mut buf, &summary());
    let line = String::from_utf8(buf).unwrap();
    match parse_line(line.trim_end().as_bytes(), &mut names) {
        Ok(Line::Summary(s)) => assert_eq!(*s, summary()),
        _ => panic!("summary not read: {line}"),
    }

    let mut buf = Vec::new();
    json_line(&mut buf, &usage());
    let back: Usage = serde_json::from_slice(&buf).unwrap();
    assert_eq!(back, usage());
    // Usage lines are the sidecar's; a trace reader skips them.
    assert!(matches!(parse_line(buf.trim_ascii_end(), &mut names), Ok(Line::Ignored)));
}

/// The writer's lines are exactly the golden ones, and the golden ones read as the records.
#[test]
fn the_written_lines_are_the_golden_lines() {
    let text = golden_text();
    if std::env::var_os("VRAMCAP_BLESS").is_some() {
        std::fs::write(GOLDEN, &text).unwrap();
    }
    let golden = std::fs::read_to_string(GOLDEN).unwrap_or_else(|e| panic!("{GOLDEN}: {e}"));
    for (n, (want, got)) in golden.lines().zip(text.lines()).enumerate() {
        assert_eq!(got, want, "line {} of {GOLDEN} differs from what the writer writes", n + 1);
    }
    assert_eq!(golden.lines().count(), text.lines().count());
    let lines: Vec<&str> = golden.lines().collect();
    let mut names = Names::default();
    assert!(matches!(parse_line(lines[0].as_bytes(), &mut names), Ok(Line::Header(h)) if *h == header()));
    for (line, e) in lines[1..].iter().zip(events()) {
        check_event(line.as_bytes(), &e);
    }
    let usage_line = lines[lines.len() - 2];
    assert_eq!(serde_json::from_str::<Usage>(usage_line).unwrap(), usage());
    assert!(matches!(parse_line(lines[lines.len() - 1].as_bytes(), &mut names), Ok(Line::Summary(s)) if *s == summary()));
}

/// Traces written before a field existed still read (the format's compatibility rule).
#[test]
fn lines_without_the_later_fields_still_read() {
    let mut names = Names::default();
    let old_header = br#"{"type":"header","version":1,"pid":7,"start_unix_ns":5}"#;
    let Ok(Line::Header(h)) = parse_line(old_header, &mut names) else { panic!() };
    assert_eq!((h.pid, h.devices.len(), h.job.clone(), h.group_policy.clone()), (7, 0, None, None));
    let old_summary = br#"{"type":"summary","events":3,"dropped":0,"peak":{"0":1},"used":{"0":0}}"#;
    let Ok(Line::Summary(s)) = parse_line(old_summary, &mut names) else { panic!() };
    assert_eq!((s.t_ns, s.denied.clone(), s.group.clone()), (None, None, None));
    let old_event = br#"{"type":"event","t_ns":9,"op":"free"}"#;
    let Ok(Line::Event(e)) = parse_line(old_event, &mut names) else { panic!() };
    assert_eq!((e.op, e.dev, e.used, e.group_used), (Op::Free, -1, None, None));
    assert!(matches!(parse_line(br#"{"type":"event","t_ns":9,"op":"teleport"}"#, &mut names), Ok(Line::Event(e)) if e.op == Op::Other));
}

/// The event example of docs/trace-format.md is what the writer writes for those values.
#[test]
fn the_documented_event_example_is_what_the_writer_writes() {
    let e = EventLine {
        seq: 17,
        t_ns: 1_200_345,
        tid: 4243,
        op: Op::Alloc,
        api: "cuMemAlloc_v2",
        dev: 0,
        ptr: 0x7f3a_4000_0000,
        size: 1_048_576,
        result: 0,
        dur_ns: 850,
        used: 5_242_880,
        group_used: None,
    };
    let mut buf = Vec::new();
    event::write(&mut buf, &e);
    let line = String::from_utf8(buf).unwrap();
    let doc = include_str!("../../../../docs/trace-format.md");
    // The example is wrapped after `"dev":0,` in the doc.
    let (first, second) = line.trim_end().split_once("\"dev\":0,").unwrap();
    assert!(doc.contains(&format!("{first}\"dev\":0,\n {second}")), "docs/trace-format.md's event example is not {line}");
}
