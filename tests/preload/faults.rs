//! Fault injection (issue 10, docs/reliability.md): the fake driver fails where we tell it to,
//! lacks entry points, refuses cuInit; the job forks, execs, takes signals and loses threads while
//! allocating; the trace disk is full or vanishes. After each: nothing crashed or hung, the error
//! codes are the driver's own, and the ledger equals what the driver really holds (our
//! cuMemGetInfo view under a cap, `total - free`, against the fake's own `bytes_held`).

use vramcap_tests::common;

use common::{Output, Run, shim_dir};
use std::path::PathBuf;

const EVERY_FAMILY: &str = "alloc 1m pitch 100 100 managed 1m vmm 2m 0 async 1m array 64 64";

/// Our charge equals what the driver holds, read at the last `info` and `stats 0`.
fn assert_exact(out: &Output) {
    let info = out.of("info").last().copied().expect("an info line").clone();
    let stats = out.of("stats").last().copied().expect("a stats line").clone();
    assert_eq!(info.rc(), 0);
    let used = info.num("total") - info.num("free");
    assert_eq!(used, stats.num("bytes_held"), "ledger {used} vs driver {}\n{}", stats.num("bytes_held"), out.stdout);
}

fn rcs(out: &Output) -> Vec<(String, i64)> {
    out.lines.iter().filter(|l| l.fields.contains_key("rc")).map(|l| (l.op.clone(), l.rc())).collect()
}

#[test]
fn injected_failures_in_every_family_are_the_drivers_codes_and_leave_the_ledger_exact() {
    // Allocation calls 1..6 are the six families above; each fails once with each code.
    for code in ["2", "1", "999"] {
        for n in 1..=6 {
            let ops = format!("init ctx 0 {EVERY_FAMILY} info stats 0");
            let fail = format!("{n}:{code}");
            let ours = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "1g").env("FAKECUDA_FAIL_ALLOC", &fail).args([&ops]).run();
            let bare = Run::client("client_procaddr").bare().env("FAKECUDA_FAIL_ALLOC", &fail).args([&ops]).run();
            ours.ok();
            let failed: Vec<_> = rcs(&ours).into_iter().filter(|(_, rc)| *rc != 0).collect();
            assert_eq!(failed, vec![(failed[0].0.clone(), code.parse().unwrap())], "{fail}: {}", ours.stdout);
            // The caller sees exactly what it sees without vramcap.
            let strip = |o: &Output| rcs(o).into_iter().filter(|(op, _)| op != "info" && op != "stats").collect::<Vec<_>>();
            assert_eq!(strip(&ours), strip(&bare), "{fail}");
            assert_exact(&ours);
        }
    }
}

#[test]
fn frees_of_unknown_and_already_freed_pointers() {
    let ops = "init ctx 0 alloc 1m alloc 2m free 0 free 0 freeptr 0xdeadbeef000 free1 1 free1 1 free 1 info stats 0";
    let ours = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "1g").args([ops]).run();
    let bare = Run::client("client_procaddr").bare().args([ops]).run();
    ours.ok();
    let strip = |o: &Output| rcs(o).into_iter().filter(|(op, _)| op != "info").collect::<Vec<_>>();
    assert_eq!(strip(&ours), strip(&bare), "\n{}\n{}", ours.stdout, bare.stdout);
    assert_ne!(ours.nth("free", 1).rc(), 0, "a double free is the driver's error");
    assert_exact(&ours);
    assert_eq!(ours.nth("stats", 0).num("bytes_held"), 0);
}

#[test]
fn destroying_a_context_with_live_allocations() {
    // The fake driver does not give a destroyed context's memory back (the real one does), so
    // the check is on our side: what that context was charged is released, the rest stays.
    let ops = "init ctx 0 alloc 2m info newctx 0 alloc 4m pitch 64 64 managed 1m ctxdestroy 0 ctx 0 info";
    let out = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "1g").args([ops]).run();
    out.ok();
    assert_eq!(out.nth("ctxdestroy", 0).rc(), 0);
    let used = |i| out.nth("info", i).num("total") - out.nth("info", i).num("free");
    assert_eq!((used(0), used(1)), (2 << 20, 2 << 20), "{}", out.stdout);
}

#[test]
fn a_driver_without_the_optional_entry_points() {
    // target/cuda-shim-old: VMM, pools, managed memory, cuGetProcAddress and UUIDs unexported.
    let old = shim_dir().with_file_name("cuda-shim-old");
    let ops = "init ctx 0 alloc 1m async 1m vmm 2m 0 managed 1m pitch 100 100 info stats 0";
    let out = Run::client("client_linked").env("LD_LIBRARY_PATH", &old).env("VRAMCAP_LIMIT", "1g").args([ops]).run();
    out.ok();
    // What the driver lacks is refused with CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, the rest works.
    for (op, want) in [("alloc", 0), ("async", 302), ("vmm", 302), ("managed", 302), ("pitch", 0)] {
        assert_eq!(out.nth(op, 0).rc(), want, "{op}\n{}", out.stdout);
    }
    assert_exact(&out);
    // Looked up by name, a missing function is missing, as without vramcap.
    for bare in [false, true] {
        let mut r = Run::client("client_dlsym").env("LD_LIBRARY_PATH", &old);
        if bare {
            r = r.bare();
        }
        let o = r.args(["init"]).run();
        assert_eq!(o.status.code(), Some(3), "{}", o.stderr);
        assert!(o.stderr.contains("cannot resolve"), "{}", o.stderr);
    }
}

#[test]
fn cu_init_failing_is_passed_through_and_nothing_is_handed_out() {
    let ops = "init alloc 1m init info";
    let ours = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "1g").env("FAKECUDA_INIT_FAIL", "100").args([ops]).run();
    let bare = Run::client("client_procaddr").bare().env("FAKECUDA_INIT_FAIL", "100").args([ops]).run();
    ours.ok();
    assert_eq!(ours.nth("init", 0).rc(), 100, "CUDA_ERROR_NO_DEVICE from the driver");
    assert_eq!(rcs(&ours), rcs(&bare));
}

#[test]
fn a_configuration_the_parser_once_panicked_on_fails_closed() {
    // Fuzzing found it (tests/fuzz_regressions/*/utf8-key-char-boundary): the panic was caught in
    // the hook, no configuration was stored, and every call re-parsed and ran uncapped.
    let out = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "abcé=1g").args(["init ctx 0 alloc 1m"]).run();
    out.ok();
    assert_ne!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert!(out.stderr.contains("VRAMCAP_LIMIT") && !out.stderr.contains("panicked"), "{}", out.stderr);
}

#[test]
fn a_panic_inside_vramcap_is_caught_and_fails_closed() {
    // A real panic in the configuration parser (VRAMCAP_TEST_PANIC): the unwinder linked into the
    // library (build.rs, no libgcc_s) must find our frames, `catch_unwind` must stop it, and CUDA
    // initialisation must fail closed. A broken unwinder aborts the process instead.
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TEST_PANIC", "config")
        .args(["init ctx 0 alloc 1m"])
        .run();
    out.ok();
    assert_eq!(out.nth("init", 0).rc(), 800, "CUDA_ERROR_NOT_PERMITTED: {}", out.stderr);
    assert!(out.stderr.contains("reading the configuration failed"), "{}", out.stderr);
    // Any other value is no fault: the limit applies as usual.
    let calm = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TEST_PANIC", "no")
        .args(["init ctx 0 alloc 1m alloc 2g"])
        .run();
    calm.ok();
    assert_eq!(calm.nth("alloc", 0).rc(), 0, "{}", calm.stderr);
    assert_eq!(calm.nth("alloc", 1).rc(), 2, "denied over the limit: {}", calm.stderr);
}

fn trace_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vramcap-faults-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn summary(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap();
    let last = text.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["type"], "summary", "{last}");
    v
}

#[test]
fn fork_exec_signals_and_exiting_threads_under_load() {
    let dir = trace_dir("load");
    let t = dir.join("t.jsonl");
    let ops = "init ctx 0 forkbusy 4 40 sigstorm 4 20000 threadleak 1m info stats 0 \
               execchild init ctx 0 alloc 1m info end info stats 0";
    let out = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "4g").env("VRAMCAP_TRACE", &t).args([ops]).run();
    out.ok();
    let f = out.nth("forkbusy", 0);
    assert_eq!((f.num("bad_children"), f.num("other")), (0, 0), "{}", out.stdout);
    let s = out.nth("sigstorm", 0);
    assert_eq!((s.num("ok"), s.num("other")), (80000, 0), "EINTR never leaks out as an error");
    assert_eq!(out.nth("threadleak", 0).rc(), 0);
    assert_eq!(out.nth("execchild", 0).num("status"), 0);
    assert_eq!(out.nth("alloc", 0).rc(), 0, "the exec'd child has its own cap");
    assert_exact(&out);
    // The memory of the exited thread is still charged and traced; everything is accounted for.
    assert_eq!(out.nth("stats", 0).num("bytes_held"), 1 << 20);
    let sm = summary(&t);
    assert_eq!(sm["used"]["0"], 1 << 20);
    let lines = std::fs::read_to_string(&t).unwrap().lines().filter(|l| l.contains("\"type\":\"event\"")).count() as u64;
    assert_eq!(lines + sm["dropped"].as_u64().unwrap(), sm["events"].as_u64().unwrap(), "recorded + dropped = emitted");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_full_disk_stops_the_trace_not_the_job_and_counts_the_loss() {
    // /dev/full: every write fails with ENOSPC (a full tmpfs is in scripts/faults-root).
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", "/dev/full")
        .args(["init ctx 0 threads 4 20000 1m 7 alloc 1m info stats 0"])
        .run();
    out.ok();
    assert_eq!(out.nth("threads", 0).num("other"), 0);
    assert_exact(&out);
    assert!(out.stderr.contains("No space left"), "warned once: {}", out.stderr);
    assert_eq!(out.stderr.matches("No space left").count(), 1, "{}", out.stderr);
}

#[test]
fn the_trace_directory_removed_mid_run() {
    let dir = trace_dir("removed");
    let mut r = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", dir.join("t-%p.jsonl"))
        .args(["init ctx 0 alloc 1m sleep 300 threads 4 20000 1m 3 fork alloc 1m info stats 0"])
        .spawn();
    r.wait_for("alloc");
    // The writer may be creating its file while we delete: a new entry then makes the final
    // rmdir fail with "not empty". Delete until the directory is gone.
    let mut tries = 0;
    while let Err(e) = std::fs::remove_dir_all(&dir) {
        tries += 1;
        assert!(tries < 100 && e.kind() == std::io::ErrorKind::DirectoryNotEmpty, "{e}");
    }
    assert_eq!(r.wait_for("fork").num("status"), 0, "the child could not open its trace, and ran on");
    let (info, stats) = (r.wait_for("info"), r.wait_for("stats"));
    assert_eq!(info.num("total") - info.num("free"), stats.num("bytes_held"));
    let st = r.finish();
    assert!(st.success(), "{st:?}");
}

#[test]
fn short_soak_every_family_sixteen_threads() {
    // scripts/soak runs the long version (16 × 1 M) and prints RSS and rates.
    let dir = trace_dir("soak");
    let t = dir.join("t.jsonl");
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "8GiB")
        .env("VRAMCAP_TRACE", &t)
        .args(["init ctx 0 soak 16 20000 1 info stats 0"])
        .run();
    out.ok();
    let s = out.nth("soak", 0);
    assert_eq!((s.num("ops"), s.num("other")), (320_000, 0), "{}", out.stdout);
    assert_exact(&out);
    assert_eq!(out.nth("stats", 0).num("bytes_held"), 0);
    let sm = summary(&t);
    assert_eq!(sm["used"]["0"], 0);
    let lines = std::fs::read_to_string(&t).unwrap().lines().filter(|l| l.contains("\"type\":\"event\"")).count() as u64;
    assert_eq!(lines + sm["dropped"].as_u64().unwrap(), sm["events"].as_u64().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_stalled_or_killed_sidecar_never_blocks_the_job() {
    use std::os::unix::net::UnixListener;
    for kill in [false, true] {
        let dir = trace_dir(if kill { "sidecar-killed" } else { "sidecar-stalled" });
        let sock = dir.join("s.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        // Accepts every connection and never reads: the socket buffer fills at once. "Killed":
        // the connection is closed shortly after it was accepted.
        let holder = std::thread::spawn(move || {
            let mut held = Vec::new();
            if let Ok((c, _)) = listener.accept() {
                if kill {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    drop(c);
                } else {
                    held.push(c);
                    std::thread::sleep(std::time::Duration::from_secs(30));
                }
            }
            drop(held);
        });
        let t0 = std::time::Instant::now();
        let out = Run::client("client_procaddr")
            .env("VRAMCAP_LIMIT", "1g")
            .env("VRAMCAP_SIDECAR", &sock)
            .timeout(std::time::Duration::from_secs(25))
            .args(["init ctx 0 threads 4 50000 1m 5 alloc 1m info stats 0"])
            .run();
        out.ok();
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "kill={kill}: took {:?}", t0.elapsed());
        assert_eq!(out.nth("threads", 0).num("other"), 0);
        assert_exact(&out);
        if kill {
            holder.join().unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
