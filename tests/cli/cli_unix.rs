//! The CLI behaves like a Unix tool (issue 16 §4): a reader that goes away ends it quietly, as
//! coreutils end (SIGPIPE); `top` into a pipe prints plain snapshots and gives up on a missing
//! sidecar; a multi-file report skips an unusable file; `export --from` past the end says so;
//! huge durations are errors; every argument has help text.

use vramcap_tests::cli_support;
use vramcap_tests::common;
use cli_support::*;
use std::io::{BufRead, BufReader};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A pipe whose read end is already closed: the first write to it fails with EPIPE.
fn closed_pipe() -> Stdio {
    let mut fds = [0i32; 2];
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    unsafe { libc::close(fds[0]) };
    Stdio::from(unsafe { OwnedFd::from_raw_fd(fds[1]) })
}

#[test]
fn a_reader_that_goes_away_ends_the_command_like_coreutils() {
    let (a, b) = (data("job_rank0.jsonl"), data("job_rank1.jsonl"));
    let cases: [&[&str]; 5] = [
        &["doctor"],
        &["report", &a, &b],
        &["replay", "--limit", "4GiB", &a, &b],
        &["size", "0=1g,1=2g"],
        &["report", "--json", &a],
    ];
    for args in cases {
        let out = clean_vramcap(args).stdout(closed_pipe()).stderr(Stdio::piped()).output().unwrap();
        let err = text(&out.stderr);
        assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{args:?}: {err}");
        // As `seq 1000000 | head -1` ends seq: by SIGPIPE (a shell shows 141), not exit 101.
        assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{args:?}: {:?} {err}", out.status);
    }
}

#[test]
fn top_into_a_pipe_gives_up_on_a_missing_sidecar() {
    let dir = scratch("top-nosidecar");
    let mut child = Command::new(vramcap_tests::common::vramcap_bin())
        .args(["top", "--socket"])
        .arg(dir.join("none.sock"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let st = common::wait_bounded(&mut child, Duration::from_secs(40), "vramcap");
    let out = child.wait_with_output().unwrap();
    assert_eq!(st.code(), Some(1), "{st:?}");
    assert!(!text(&out.stdout).contains('\x1b'), "no screen-control codes into a pipe: {:?}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("gave up after 10 attempts") && err.contains("none.sock"), "{err}");
}

#[test]
fn top_into_a_pipe_prints_plain_snapshots() {
    // Short: a Unix socket path must stay under 108 bytes.
    let dir = std::path::PathBuf::from(format!("/tmp/vcu-top-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("s.sock");
    let mut sidecar = Command::new(vramcap_tests::common::vramcap_bin())
        .arg("sidecar")
        .arg("--socket")
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut top = Command::new(vramcap_tests::common::vramcap_bin())
        .args(["top", "--socket"])
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(top.stdout.take().unwrap()).lines();
    let mut got = Vec::new();
    // Two snapshots: header, column titles, blank line each.
    while got.iter().filter(|l: &&String| l.starts_with("vramcap top:")).count() < 2 {
        match lines.next() {
            Some(Ok(l)) => got.push(l),
            _ => break,
        }
    }
    let _ = top.kill();
    let _ = top.wait();
    let _ = sidecar.kill();
    let _ = sidecar.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let all = got.join("\n");
    assert_eq!(got.iter().filter(|l| l.starts_with("vramcap top:")).count(), 2, "{all}");
    assert!(!all.contains('\x1b'), "no screen-control codes into a pipe: {all:?}");
    assert!(got.iter().any(String::is_empty), "snapshots are separated by a blank line: {all}");
}

#[test]
fn a_multi_file_report_skips_an_unusable_file() {
    let (a, b) = (data("job_rank0.jsonl"), data("job_rank1.jsonl"));
    let dir = scratch("report-skip");
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let missing = dir.join("missing.jsonl");
    let out = vramcap(&["report", "--json", &a, missing.to_str().unwrap(), &b, empty.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let skipped: Vec<&str> = err.lines().filter(|l| l.contains("skipping")).collect();
    assert_eq!(skipped.len(), 2, "one line per unusable file: {err}");
    assert!(skipped[0].contains("missing.jsonl") && skipped[1].contains("empty.jsonl"), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["processes"].as_array().map(Vec::len), Some(2), "the usable two are reported: {r}");
    // Nothing usable at all is still an error.
    let out = vramcap(&["report", missing.to_str().unwrap(), empty.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    // A single unusable file is an error, as before.
    assert_eq!(vramcap(&["report", missing.to_str().unwrap()]).status.code(), Some(2));
}

#[test]
fn export_from_past_the_end_says_so() {
    let a = data("job_rank0.jsonl");
    let dir = scratch("export-past");
    for format in ["csv", "chrome", "memory-viz"] {
        let out_file = dir.join(format!("out.{format}"));
        let out = vramcap(&["export", "--format", format, "--from", "30s", "-o", out_file.to_str().unwrap(), &a]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{format}: {err}");
        assert!(err.contains("--from 30.000s is past the end of the traces") && err.contains("nothing exported"), "{format}: {err}");
        assert!(!out_file.exists(), "{format}: no empty file left behind");
        // Inside the traces, the window exports as before.
        let out = vramcap(&["export", "--format", format, "--from", "1us", "-o", out_file.to_str().unwrap(), &a]);
        assert!(out.status.success() && out_file.exists(), "{format}: {}", text(&out.stderr));
    }
}

#[test]
fn huge_durations_are_errors_not_clamped() {
    let (a, b) = (data("job_rank0.jsonl"), data("job_rank1.jsonl"));
    let dir = scratch("huge");
    let o = dir.join("o.csv");
    let o = o.to_str().unwrap();
    for args in [
        &["replay", "--limit", "4g", "--stagger", "0,99999999999999999999", &a, &b][..],
        &["replay", "--limit", "4g", "--stagger", "1000000000000h", &a, &b],
        &["export", "--format", "csv", "--from", "600000h", "-o", o, &a],
        &["export", "--format", "csv", "--to", "18446744073709551616ns", "-o", o, &a],
    ] {
        let out = vramcap(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(text(&out.stderr).contains("more than 10 years"), "{args:?}: {}", text(&out.stderr));
    }
    // A step that is fine alone but wraps when multiplied by the trace count.
    let c = data("job_rank0.jsonl");
    let out = vramcap(&["replay", "--limit", "4g", "--stagger", "87000h", &a, &b, &c]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("more than 10 years"), "{}", text(&out.stderr));
}

#[test]
fn every_argument_has_help_text() {
    let subcommands = ["size", "sidecar", "top", "report", "plot", "export", "replay", "run", "demo", "doctor", "gen-trace"];
    let mut missing = Vec::new();
    for sub in subcommands {
        let help = ok(&[sub, "-h"]);
        let mut in_args = false;
        for line in help.lines() {
            if line == "Arguments:" || line == "Options:" {
                in_args = true;
                continue;
            }
            // Entries start with two spaces; wrapped help lines are indented further.
            if !in_args || !line.starts_with("  ") || line.starts_with("   ") {
                continue;
            }
            let mut rest = line.trim();
            // Drop the names: `-o, --output <OUTPUT>`, `<TRACES>...`, `[CMD]...`.
            loop {
                let word = rest.split_whitespace().next().unwrap_or("");
                let is_name = word.starts_with('-') || word.starts_with('<') || word.starts_with('[') && !word.starts_with("[default") && !word.starts_with("[possible");
                if !is_name || word.is_empty() {
                    break;
                }
                rest = rest[word.len()..].trim_start();
            }
            let desc: String = rest
                .split('[')
                .filter(|p| !(p.starts_with("default:") || p.starts_with("possible values:")))
                .collect::<Vec<_>>()
                .join("[");
            let desc = desc.replace(']', "");
            if desc.trim().is_empty() && !line.contains("--help") && !line.contains("--version") {
                missing.push(format!("{sub}: {}", line.trim()));
            }
        }
    }
    assert!(missing.is_empty(), "arguments without help text:\n{}", missing.join("\n"));
}
