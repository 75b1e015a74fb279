//! The job never waits for us (issue 16 §3): a program whose main thread ends with
//! `pthread_exit` exits as it would without vramcap, with the trace's summary written, whether
//! the trace, the sidecar stream or both are on; SIGTERM and SIGINT still end it. Every run has a
//! timeout: a hang is killed and reported, never waited for.

use vramcap_tests::common;
use common::*;
use std::path::PathBuf;
use std::time::Duration;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vramcap-lifetime-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn last_line(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(text.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()))
}

/// (name, trace on, sidecar on). The sidecar socket does not exist: the writer keeps retrying,
/// which is exactly the thread that must not keep the process alive.
const MODES: [(&str, bool, bool); 4] =
    [("bare", false, false), ("trace", true, false), ("sidecar", false, true), ("both", true, true)];

fn client(dir: &std::path::Path, trace: bool, sidecar: bool, worker_ms: &str) -> Run {
    let mut run = Run::client("client_mainexit").args([worker_ms]);
    if trace {
        run = run.env("VRAMCAP_TRACE", dir.join("t.jsonl"));
    }
    if sidecar {
        run = run.env("VRAMCAP_SIDECAR", dir.join("no-sidecar.sock"));
    }
    run
}

#[test]
fn main_thread_pthread_exit_ends_the_process_with_the_summary_written() {
    for (name, trace, sidecar) in MODES {
        let dir = tmpdir(name);
        let mut run = client(&dir, trace, sidecar, "100").spawn();
        run.wait_for("ready");
        let st = wait_bounded(&mut run.child, Duration::from_secs(20), name);
        assert_eq!(st.code(), Some(0), "{name}: {st:?}");
        if trace {
            let s = last_line(&dir.join("t.jsonl"));
            assert_eq!(s["type"], "summary", "{name}: {s}");
            assert_eq!(s["events"], 6, "{name}: three alloc/free pairs: {s}");
            assert_eq!(s["used"]["0"], 0, "{name}: {s}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn sigterm_and_sigint_end_a_process_whose_main_thread_has_ended() {
    for (sig, signame) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        for (name, trace, sidecar) in MODES {
            let dir = tmpdir(&format!("{name}-{signame}"));
            // The worker sleeps until a signal ends the process.
            let mut run = client(&dir, trace, sidecar, "-1").spawn();
            run.wait_for("ready");
            // Time for the main thread to finish pthread_exit.
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(unsafe { libc::kill(run.pid() as i32, sig) }, 0);
            let st = wait_bounded(&mut run.child, Duration::from_secs(20), &format!("{name} after {signame}"));
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(st.signal(), Some(sig), "{name}: {signame} must end the process: {st:?}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Lossless mode, main thread gone with `pthread_exit` while the worker does 300 000 alloc/free
/// pairs flat out (its ring fills; it waits for the writer): the process still ends with
/// status 0 and every event, the summary last.
#[test]
fn lossless_mode_with_the_main_thread_gone_keeps_every_event_and_ends() {
    for worker_ms in ["0", "100"] {
        let dir = tmpdir(&format!("lossless-{worker_ms}"));
        let path = dir.join("t.jsonl");
        let mut run = Run::client("client_mainexit")
            .args([worker_ms, "300000"])
            .env("VRAMCAP_TRACE", &path)
            .env("VRAMCAP_TRACE_MODE", "lossless")
            .spawn();
        run.wait_for("ready");
        let st = wait_bounded(&mut run.child, Duration::from_secs(20), "lossless mainexit");
        assert_eq!(st.code(), Some(0), "{st:?}");
        // About 120 MB: only its tail is read.
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&path).unwrap();
        f.seek(SeekFrom::End(-4096)).unwrap();
        let mut tail = String::new();
        f.read_to_string(&mut tail).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(tail.ends_with('\n'), "cut last line: {tail}");
        let s: serde_json::Value = serde_json::from_str(tail.trim_end().rsplit('\n').next().unwrap()).unwrap();
        assert_eq!(s["type"], "summary", "{s}");
        assert_eq!(s["events"], 600_006, "{s}");
        assert_eq!(s["dropped"], 0, "{s}");
    }
}
