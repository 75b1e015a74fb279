//! VRAMCAP_TRACE's file: a fork without `%p`, an unusable path, a previous trace replaced and a
//! symlink written through, processes started together with one template, another user's file
//! or symlink at the path.

use vramcap_tests::common;
use vramcap_tests::trace_support;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use trace_support::*;

#[test]
fn fork_without_pid_placeholder_does_not_overwrite_the_parent() {
    let dir = tmpdir("fork-nop");
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", dir.join("t.jsonl"))
        .args(["init ctx 0 alloc 4m fork"])
        .run();
    out.ok();
    let child = out.nth("fork", 0).num("child");
    assert_eq!(events(&read_trace(&dir.join("t.jsonl"))).len(), 1);
    assert_eq!(events(&read_trace(&dir.join(format!("t.jsonl.{child}")))).len(), 2);
}

#[test]
fn an_unusable_path_is_reported_once_and_the_cap_still_applies() {
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", "/nonexistent-dir/t.jsonl")
        .args(["init ctx 0 alloc 512m alloc 600m alloc 1m"])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 1).rc(), 2);
    assert_eq!(out.nth("alloc", 2).rc(), 0);
    let lines: Vec<_> = out.stderr.lines().filter(|l| l.contains("VRAMCAP_TRACE")).collect();
    assert_eq!(lines.len(), 1, "{}", out.stderr);
    assert!(lines[0].contains("/nonexistent-dir/t.jsonl") && lines[0].contains("cap still applies"));
}

/// Rerunning with the same path starts the trace afresh: a large old file (here a sparse
/// 100 MiB one) is swapped for a new one with the same mode (so freeing it never stalls the
/// writer), no temporary file is left behind; a small one is truncated in place; a symlink is
/// written through, not replaced.
#[test]
fn a_previous_trace_is_replaced_and_a_symlink_written_through() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tmpdir("rerun");
    let run = |p: &Path| Run::client("client_procaddr").env("VRAMCAP_LIMIT", "1g").env("VRAMCAP_TRACE", p).args(["init ctx 0 alloc 1m free 0"]).run();
    let check = |p: &Path| {
        let t = read_trace(p);
        assert_eq!(t[0]["type"], "header", "old content gone");
        assert_eq!(events(&t).len(), 2);
        assert_eq!(t.last().unwrap()["type"], "summary");
    };

    let big = dir.join("big.jsonl");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(100 << 20).unwrap();
    drop(f);
    std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o640)).unwrap();
    let old_inode = std::fs::metadata(&big).unwrap().ino();
    run(&big).ok();
    check(&big);
    let m = std::fs::metadata(&big).unwrap();
    assert_ne!(m.ino(), old_inode, "a large old trace is replaced, not truncated");
    assert_eq!(m.mode() & 0o777, 0o640, "with the old file's mode");

    let small = dir.join("small.jsonl");
    std::fs::write(&small, "old line that is not json\n".repeat(1000)).unwrap();
    let old_inode = std::fs::metadata(&small).unwrap().ino();
    run(&small).ok();
    check(&small);
    assert_eq!(std::fs::metadata(&small).unwrap().ino(), old_inode, "a small one is truncated in place");

    let target = dir.join("target.jsonl");
    std::fs::write(&target, "old\n".repeat(1000)).unwrap();
    let link = dir.join("link.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    run(&link).ok();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
    check(&target);

    let mut names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["big.jsonl", "link.jsonl", "small.jsonl", "target.jsonl"], "no temporary file left");
}

/// Processes started at the same moment with one template without `%p` (issue 15): each gets a
/// file of its own, created exclusively, and every one is complete (one header, its own events,
/// one summary); the processes that did not get `PATH` say in one stderr line which file they
/// wrote. Eight processes wait on a start file and allocate at once, three rounds; each stays a
/// while (a finished run's file may be taken over, a running one's never).
#[test]
fn processes_started_together_with_one_template_write_separate_complete_traces() {
    use std::io::Read;
    let dir = tmpdir("together");
    for round in 0..3 {
        let go = dir.join(format!("go{round}"));
        let template = dir.join(format!("t{round}.jsonl"));
        let mut procs: Vec<Running> = (0..8)
            .map(|_| {
                Run::client("client_linked")
                    .env("VRAMCAP_LIMIT", "1g")
                    .env("VRAMCAP_TRACE", &template)
                    .args([format!("init ctx 0 waitfile {} alloc 1m alloc 2m free 0 sleep 1500", go.display())])
                    .spawn()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&go, "").unwrap();
        let mut said = std::collections::BTreeMap::new();
        for p in &mut procs {
            assert!(p.child.wait().unwrap().success());
            let mut err = String::new();
            p.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            said.insert(p.pid(), err);
        }
        let name = template.file_name().unwrap().to_string_lossy().to_string();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&name))
            .collect();
        files.sort();
        assert_eq!(files.len(), 8, "one file per process: {files:?}");
        for f in &files {
            let t = read_trace(f);
            let headers: Vec<&Value> = t.iter().filter(|v| v["type"] == "header").collect();
            let summaries = t.iter().filter(|v| v["type"] == "summary").count();
            assert_eq!((headers.len(), summaries), (1, 1), "{}: {t:?}", f.display());
            assert_eq!(t[0]["type"], "header");
            assert_eq!(t.last().unwrap()["type"], "summary");
            assert_eq!(t.last().unwrap()["dropped"], 0);
            let ops: Vec<&str> = events(&t).iter().map(|e| e["op"].as_str().unwrap()).collect();
            assert_eq!(ops, ["alloc", "alloc", "free"], "{}", f.display());
            let pid = headers[0]["pid"].as_u64().unwrap() as u32;
            let err = &said[&pid];
            let shown = f.display().to_string();
            if f == &template {
                assert!(!err.contains("this process writes"), "pid {pid} wrote the template's file yet said: {err}");
            } else {
                assert_eq!(shown, format!("{}.{pid}", template.display()), "a fallback is PATH.<pid>");
                let lines: Vec<&str> = err.lines().filter(|l| l.contains("this process writes")).collect();
                assert_eq!(lines.len(), 1, "pid {pid}: {err}");
                assert!(lines[0].ends_with(&shown) && lines[0].contains("another running process"), "{}", lines[0]);
            }
        }
    }
}

/// A symlink another user planted at the trace path is not followed (its target, a root-owned
/// file here, keeps its content), and a file of another user there is not emptied: the trace
/// goes to `PATH.<pid>`, named on stderr. Ownership by another uid needs root (`lchown`).
#[test]
fn a_symlink_or_file_of_another_user_at_the_trace_path_is_left_alone() {
    if unsafe { libc_geteuid() } != 0 {
        eprintln!("SKIPPED a_symlink_or_file_of_another_user_at_the_trace_path_is_left_alone: needs root (CI runs it as root)");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    const OTHER: u32 = 54_321;
    let dir = tmpdir("planted");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    let link = dir.join("t.jsonl");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(OTHER), Some(OTHER)).unwrap();
    let foreign = dir.join("f.jsonl");
    std::fs::write(&foreign, "theirs\n").unwrap();
    std::os::unix::fs::chown(&foreign, Some(OTHER), Some(OTHER)).unwrap();

    for (path, why) in [(&link, format!("is a symbolic link owned by uid {OTHER}, not followed")), (&foreign, format!("belongs to uid {OTHER}, not overwritten"))] {
        let out = Run::client("client_linked").env("VRAMCAP_LIMIT", "1g").env("VRAMCAP_TRACE", path).args(["init ctx 0 alloc 1m free 0"]).run();
        out.ok();
        let prefix = format!("{}.", path.file_name().unwrap().to_string_lossy());
        let moved: Vec<PathBuf> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&prefix)).collect();
        assert_eq!(moved.len(), 1, "{moved:?}");
        let actual = moved[0].clone();
        let pid = actual.extension().unwrap().to_string_lossy().to_string();
        assert!(pid.parse::<u32>().is_ok(), "PATH.<pid>: {}", actual.display());
        let t = read_trace(&actual);
        assert_eq!((t[0]["type"].as_str(), t.last().unwrap()["type"].as_str()), (Some("header"), Some("summary")));
        assert_eq!(events(&t).len(), 2);
        let said: Vec<&str> = out.stderr.lines().filter(|l| l.contains("this process writes")).collect();
        assert_eq!(said.len(), 1, "{}", out.stderr);
        assert!(said[0].contains(&why) && said[0].ends_with(&actual.display().to_string()), "{}", said[0]);
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n", "the link's target was written");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&foreign).unwrap(), "theirs\n", "another user's file was emptied");
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
