//! VRAMCAP_TRACE: exact content for a known workload, denials and driver failures, SIGKILL,
//! fork, exit from another thread, full disk, many threads, causal order, lossless mode. Where
//! the trace file goes and whose it may be: tests/trace/trace_files.rs.

use vramcap_tests::common;
use vramcap_tests::trace_support;
use common::*;
use serde_json::Value;
use std::time::{Duration, Instant};
use trace_support::*;

#[test]
fn known_workload_gives_exact_events_header_and_summary() {
    let dir = tmpdir("known");
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "0=1GiB")
        .env("VRAMCAP_TRACE", dir.join("t-%p-%e.jsonl"))
        .env("FAKECUDA_FAIL_ALLOC", "3")
        .args(["init ctx 0 alloc 512m alloc 600m alloc 1m alloc 256m free 0 freeptr 0x1234 alloc1 1m"])
        .run();
    out.ok();
    let path = only_file(&dir);
    let name = path.file_name().unwrap().to_string_lossy().to_string();
    assert!(name.ends_with("-client_procaddr.jsonl") && name.starts_with("t-"), "{name}");
    let t = read_trace(&path);
    let h = &t[0];
    assert_eq!(h["type"], "header");
    assert_eq!(h["version"], 1);
    assert_eq!(h["exe"], "client_procaddr");
    assert_eq!(h["cmdline"][1], "init");
    assert!(h["pid"].as_i64().unwrap() > 0 && h["ppid"].as_i64().unwrap() > 0);
    assert!(h["start_unix_ns"].as_u64().unwrap() > 1_600_000_000_000_000_000);
    assert_eq!(h["devices"][0]["total"], 16 * GIB);
    assert_eq!(h["devices"][0]["limit"], GIB);
    assert_eq!(h["devices"][1]["limit"], Value::Null);
    assert_eq!(h["group"], Value::Null);

    let ev = events(&t);
    let got: Vec<(&str, &str, u64, i64, u64)> = ev
        .iter()
        .map(|e| {
            (
                e["op"].as_str().unwrap(),
                e["api"].as_str().unwrap(),
                e["size"].as_u64().unwrap(),
                e["result"].as_i64().unwrap(),
                e["used"].as_u64().unwrap(),
            )
        })
        .collect();
    let m = MIB;
    assert_eq!(
        got,
        vec![
            ("alloc", "cuMemAlloc_v2", 512 * m, 0, 512 * m),
            ("deny", "cuMemAlloc_v2", 600 * m, 2, 512 * m),
            // FAKECUDA_FAIL_ALLOC=3: the third call that reaches the driver fails.
            ("alloc", "cuMemAlloc_v2", m, 0, 513 * m),
            ("fail", "cuMemAlloc_v2", 256 * m, 2, 513 * m),
            ("free", "cuMemFree_v2", 512 * m, 0, m),
            ("fail", "cuMemFree_v2", 0, 1, 0),
            ("alloc", "cuMemAlloc", m, 0, 2 * m),
        ]
    );
    for (i, e) in ev.iter().enumerate() {
        assert_eq!(e["seq"], i as u64);
        assert!(e["ptr"].as_str().unwrap().starts_with("0x"));
        assert!(e["tid"].as_u64().unwrap() > 0);
    }
    assert_eq!(ev[0]["dev"], 0);
    assert_eq!(ev[1]["dur_ns"], 0, "a denial never reaches the driver");
    assert!(ev[0]["dur_ns"].as_u64().unwrap() > 0);
    assert_eq!(ev[5]["ptr"], "0x1234");
    assert_eq!(ev[4]["ptr"], ev[0]["ptr"]);
    let ts: Vec<u64> = ev.iter().map(|e| e["t_ns"].as_u64().unwrap()).collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{ts:?}");

    let s = t.last().unwrap();
    assert_eq!(s["type"], "summary");
    assert_eq!(s["events"], 7);
    assert_eq!(s["dropped"], 0);
    assert_eq!(s["peak"]["0"], 513 * m);
    assert_eq!(s["used"]["0"], 2 * m);
    assert_eq!(t.len(), 9);
}

#[test]
fn sigkill_leaves_a_readable_prefix() {
    let dir = tmpdir("kill");
    let path = dir.join("t.jsonl");
    let mut child = std::process::Command::new(ctests_dir().join("client_linked"));
    build_c();
    child
        .env("LD_LIBRARY_PATH", shim_dir())
        .env("LD_PRELOAD", preload_lib())
        .env("VRAMCAP_LIMIT", "8g")
        .env("VRAMCAP_TRACE", &path)
        .args("init ctx 0 alloc 1m alloc 2m alloc 3m free 1 sleep 60000".split(' '))
        .stdout(std::process::Stdio::null());
    let mut child = child.spawn().unwrap();
    // The writer flushes at least every second.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::fs::read_to_string(&path).map(|s| s.lines().count() >= 5).unwrap_or(false) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let t = read_trace(&path);
    assert_eq!(t[0]["type"], "header");
    assert_eq!(events(&t).len(), 4, "every event before the kill was flushed within a second");
    assert!(t.iter().all(|v| v["type"] != "summary"));
}

#[test]
fn fork_gives_the_child_its_own_file_and_keeps_its_cap() {
    let dir = tmpdir("fork");
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", dir.join("t-%p.jsonl"))
        .args(["init ctx 0 alloc 4m fork alloc 1g"])
        .run();
    out.ok();
    let child = out.nth("fork", 0).num("child");
    assert_eq!(out.nth("fork", 0).num("status"), 0);
    assert_eq!(out.nth("alloc", 1).rc(), 2, "the parent's cap still holds");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    let child_file = dir.join(format!("t-{child}.jsonl"));
    let c = read_trace(&child_file);
    assert_eq!(c[0]["pid"], child);
    let ce = events(&c);
    assert_eq!(ce.iter().map(|e| e["op"].as_str().unwrap()).collect::<Vec<_>>(), ["alloc", "free"]);
    assert_eq!(ce[0]["seq"], 0);
    assert_eq!(ce[0]["used"], 5 * MIB, "the child starts from the parent's charge");
    assert_eq!(c.last().unwrap()["type"], "summary");
    let parent = files.iter().find(|f| **f != child_file).unwrap();
    let p = read_trace(parent);
    assert_eq!(events(&p).iter().map(|e| e["op"].as_str().unwrap()).collect::<Vec<_>>(), ["alloc", "deny"]);
}

#[test]
fn exit_from_another_thread_still_writes_the_summary() {
    let dir = tmpdir("exit");
    let path = dir.join("t.jsonl");
    let out = Run::client("client_linked")
        .env("VRAMCAP_TRACE", &path)
        .args(["init ctx 0 alloc 1m alloc 1m exitthread"])
        .run();
    out.ok();
    let t = read_trace(&path);
    let s = t.last().unwrap();
    assert_eq!(s["type"], "summary");
    assert_eq!(s["events"], 2);
    assert_eq!(s["used"]["0"], 2 * MIB);
}

#[test]
fn a_file_size_limit_stops_the_trace_not_the_job() {
    let dir = tmpdir("full");
    let path = dir.join("t.jsonl");
    build_c();
    // 8 KiB file-size limit; the job makes thousands of events.
    let script = format!(
        "ulimit -f 8; exec {} init ctx 0 bench 20000 4k alloc 2g info",
        ctests_dir().join("client_linked").display()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .env("LD_LIBRARY_PATH", shim_dir())
        .env("LD_PRELOAD", preload_lib())
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", &path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the job was disturbed: {:?}\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("bench ns_per_pair") && stdout.contains("errors=0"), "{stdout}");
    assert!(stdout.contains("alloc rc=2"), "the cap still applies: {stdout}");
    assert_eq!(stderr.matches("vramcap: trace").count(), 1, "one warning: {stderr}");
    let len = std::fs::metadata(&path).unwrap().len();
    assert!(len <= 8192, "{len}");
    // The file holds whole lines up to the cut.
    let t = read_trace(&path);
    assert_eq!(t[0]["type"], "header");
}

#[test]
fn sixteen_threads_give_consecutive_sequence_numbers() {
    let dir = tmpdir("mt");
    let path = dir.join("t.jsonl");
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "15g")
        .env("VRAMCAP_TRACE", &path)
        .args(["init ctx 0 threads 16 20000 1m 3"])
        .run();
    out.ok();
    let t = read_trace(&path);
    let s = t.last().unwrap();
    assert_eq!(s["type"], "summary");
    let dropped = s["dropped"].as_u64().unwrap();
    let total = s["events"].as_u64().unwrap();
    let mut seqs: Vec<u64> = events(&t).iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs.len() as u64 + dropped, total);
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len() as u64 + dropped, total, "duplicate sequence numbers");
    if dropped == 0 {
        assert_eq!(*seqs.last().unwrap(), total - 1, "gaps without drops");
    }
    let tids: std::collections::BTreeSet<u64> = events(&t).iter().map(|e| e["tid"].as_u64().unwrap()).collect();
    // Thread ids can be reused by threads created after others finished: at least several.
    assert!(tids.len() >= 4, "{tids:?}");
    assert_eq!(s["used"]["0"], 0);
    // Sizes balance: everything allocated was freed.
    let sum = |op: &str| events(&t).iter().filter(|e| e["op"] == op).map(|e| e["size"].as_u64().unwrap()).sum::<u64>();
    if dropped == 0 {
        assert_eq!(sum("alloc"), sum("free"));
    }
}

#[test]
fn every_family_is_traced_with_its_op_and_api() {
    let dir = tmpdir("families");
    let path = dir.join("t.jsonl");
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", &path)
        .args([
            "init ctx 0 vmm 4m 0 vmmmap 0 release 0 host 1m async 1m freeasync 1 sync pitch 100 100 managed 1m",
            "array 64 64 arrfree 4 newctx 0 alloc 1m ctxdestroy 0",
        ])
        .run();
    out.ok();
    let t = read_trace(&path);
    let got: Vec<String> = events(&t).iter().map(|e| format!("{} {}", e["op"].as_str().unwrap(), e["api"].as_str().unwrap())).collect();
    let want = [
        "alloc cuMemCreate",
        "reserve cuMemAddressReserve",
        "map cuMemMap",
        "map cuMemMap",
        "unmap cuMemUnmap",
        "unmap cuMemAddressFree",
        "free cuMemRelease",
        "host_alloc cuMemHostAlloc",
        "host_alloc cuMemAllocHost_v2",
        "host_alloc cuMemHostRegister_v2",
        "host_free cuMemHostUnregister",
        "host_free cuMemFreeHost",
        "host_free cuMemFreeHost",
        "ipc_open cuIpcOpenMemHandle_v2",
        "unmap cuIpcCloseMemHandle",
        "alloc cuMemAllocAsync",
        "free cuMemFreeAsync",
        "alloc cuMemAllocPitch_v2",
        "alloc cuMemAllocManaged",
        "alloc cuArrayCreate_v2",
        "free cuArrayDestroy",
        "alloc cuMemAlloc_v2",
        "free cuCtxDestroy_v2",
    ];
    assert_eq!(got, want);
    // Traced-only kinds never change the charge.
    for e in events(&t).iter().filter(|e| ["map", "unmap", "reserve", "host_alloc", "host_free", "ipc_open"].contains(&e["op"].as_str().unwrap())) {
        assert!(e["used"].as_u64().unwrap() <= 4 * MIB, "{e}");
    }
    let pitch = events(&t).into_iter().find(|e| e["api"] == "cuMemAllocPitch_v2").unwrap();
    assert_eq!(pitch["size"], 512 * 100, "pitch × height, not width × height");
    assert_eq!(t.last().unwrap()["used"]["0"], events(&t).last().unwrap()["used"]);
}

/// A trace going to a FIFO whose reader stalls: the I/O thread blocks in write(), the queue of
/// formatted blocks fills, and events are dropped. Nothing blocks the job; the drops are counted,
/// and the numbers missing from `seq` are exactly the dropped events. (Also: a FIFO or terminal as the trace path used to hang the
/// writer before it wrote a line, when it looked for a previous trace in it.)
#[test]
fn a_stalled_reader_drops_events_and_seq_gaps_mark_them() {
    use std::io::Read;
    let dir = tmpdir("fifo");
    let fifo = dir.join("t.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let reader_path = fifo.clone();
    let reader = std::thread::spawn(move || {
        let mut f = std::fs::File::open(&reader_path).unwrap(); // waits for the writer thread
        std::thread::sleep(Duration::from_millis(1500)); // meanwhile the pipe and the ring fill
        let mut text = String::new();
        f.read_to_string(&mut text).unwrap();
        text
    });
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "8g")
        .env("VRAMCAP_TRACE", &fifo)
        .args(["init ctx 0 benchmt 1 200000 256"])
        .run();
    out.ok();
    let text = reader.join().unwrap();
    let t: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(t[0]["type"], "header");
    let s = t.last().unwrap();
    assert_eq!(s["type"], "summary", "the writer finished");
    let (total, dropped) = (s["events"].as_u64().unwrap(), s["dropped"].as_u64().unwrap());
    assert_eq!(total, 400_000, "every call counted, written or not");
    assert!(dropped > 0, "a stalled reader must cost events: {s}");
    // ... and the job's stderr says so once, at exit, with the numbers and the remedy.
    let said: Vec<&str> = out.stderr.lines().filter(|l| l.contains("events did not reach")).collect();
    assert_eq!(said.len(), 1, "{}", out.stderr);
    assert!(said[0].contains(&format!("{dropped} of {total} events")) && said[0].contains("VRAMCAP_TRACE_MODE=lossless"), "{}", said[0]);
    let seqs: Vec<u64> = events(&t).iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs.len() as u64 + dropped, total);
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "one thread's events in order");
    // The numbers left out are exactly the dropped events: inside gaps or after the last line.
    let in_gaps: u64 = seqs.windows(2).map(|w| w[1] - w[0] - 1).sum::<u64>() + seqs[0];
    let after = total - 1 - seqs.last().unwrap();
    assert_eq!(in_gaps + after, dropped);
    assert!(in_gaps > 0, "a later event marks the drops before it: {seqs:?}");
    // Alloc and free alternate on this thread: the op sequence agrees with the numbering.
    for w in events(&t).windows(2) {
        let (a, b) = (w[0]["seq"].as_u64().unwrap(), w[1]["seq"].as_u64().unwrap());
        let same_parity = (b - a) % 2 == 0;
        assert_eq!(w[0]["op"] == w[1]["op"], same_parity, "{} then {}", w[0], w[1]);
    }
}

/// A free in one thread and the re-allocation of its address in another: on the trace's clock
/// the free comes first (it is stamped before its driver call, the allocation after its call
/// returned), so ordering by `t_ns` never shows an address allocated twice or freed while free.
#[test]
fn a_free_is_stamped_before_the_reallocation_of_its_address() {
    frees_come_before_reallocations("causal", "threads 4 3000 4096", &["cuMemAlloc_v2", "cuMemFree_v2"]);
}

/// The same for stream-ordered frees: the block goes back to the pool at `cuMemFreeAsync`, and the
/// next `cuMemAllocAsync` of any thread gets the same address (the fake's free returns late, as
/// above).
#[test]
fn a_stream_ordered_free_is_stamped_before_the_reallocation_of_its_address() {
    frees_come_before_reallocations("causal-async", "asyncstorm 4 3000 4096", &["cuMemAllocAsync", "cuMemFreeAsync"]);
}

/// Runs `ops` (threads that free and reallocate) twice and checks that, in trace order, no address
/// is allocated while live or freed while not.
fn frees_come_before_reallocations(name: &str, ops: &str, apis: &[&str]) {
    let dir = tmpdir(name);
    let path = dir.join("t.jsonl");
    let (mut impossible, mut checked) = (0, 0);
    for seed in 1..=2 {
        let ops = if ops.starts_with("threads") { format!("init ctx 0 {ops} {seed}") } else { format!("init ctx 0 {ops}") };
        let out = Run::client("client_procaddr")
            .env("VRAMCAP_LIMIT", "15g")
            .env("VRAMCAP_TRACE", &path)
            // Every event, or the check below means nothing.
            .env("VRAMCAP_TRACE_MODE", "lossless")
            // The driver's free returns 200 us after the address is reusable, as a free that
            // synchronizes does: the window in which the old stamping went wrong.
            .env("FAKECUDA_FREE_DELAY_US", "200")
            .args([ops])
            .run();
        out.ok();
        let t = read_trace(&path);
        assert_eq!(t.last().unwrap()["dropped"], 0, "this check needs every event");
        let mut ev: Vec<(u64, u64, bool, u64)> = events(&t)
            .iter()
            .filter(|e| (e["op"] == "alloc" || e["op"] == "free") && apis.iter().any(|a| e["api"] == *a))
            .map(|e| {
                let ptr = u64::from_str_radix(e["ptr"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
                (e["t_ns"].as_u64().unwrap(), e["seq"].as_u64().unwrap(), e["op"] == "alloc", ptr)
            })
            .collect();
        ev.sort();
        let mut live = std::collections::HashSet::new();
        for (_, _, alloc, ptr) in &ev {
            let ok = if *alloc { live.insert(*ptr) } else { live.remove(ptr) };
            impossible += !ok as u32;
        }
        checked += ev.len();
    }
    assert!(checked > 20_000, "{checked}");
    assert_eq!(impossible, 0, "impossible orders among {checked} events");
}

/// Lossless mode: the same stalled reader makes the job wait instead of losing events; every
/// event is written, in order, and nothing is said about drops.
#[test]
fn lossless_mode_waits_for_a_stalled_reader_and_keeps_every_event() {
    use std::io::Read;
    let dir = tmpdir("lossless");
    let fifo = dir.join("t.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let reader_path = fifo.clone();
    let reader = std::thread::spawn(move || {
        let mut f = std::fs::File::open(&reader_path).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        let mut text = String::new();
        f.read_to_string(&mut text).unwrap();
        text
    });
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "8g")
        .env("VRAMCAP_TRACE", &fifo)
        .env("VRAMCAP_TRACE_MODE", "lossless")
        .args(["init ctx 0 benchmt 2 200000 256"])
        .run();
    out.ok();
    let text = reader.join().unwrap();
    let t: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let s = t.last().unwrap();
    assert_eq!(s["type"], "summary", "the writer finished");
    assert_eq!(s["dropped"], 0, "{s}");
    let total = s["events"].as_u64().unwrap();
    assert_eq!(total, 800_000);
    let seqs: Vec<u64> = events(&t).iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (0..total).collect::<Vec<u64>>());
    assert!(!out.stderr.contains("did not reach"), "{}", out.stderr);
}

/// Denial lines are limited to one per second: the ones held back are counted in one line at
/// exit, and the trace's summary counts every denial per device.
#[test]
fn suppressed_denials_are_counted_at_exit_and_in_the_summary() {
    let dir = tmpdir("denials");
    let path = dir.join("t.jsonl");
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .env("VRAMCAP_TRACE", &path)
        .args(["init ctx 0 alloc 2g alloc 2g alloc 2g alloc 2g alloc 2g"])
        .run();
    out.ok();
    assert_eq!(out.stderr.matches("vramcap: denied").count(), 1, "{}", out.stderr);
    assert!(out.stderr.contains("vramcap: 4 more denial(s) not shown"), "{}", out.stderr);
    let t = read_trace(&path);
    assert_eq!(t.last().unwrap()["denied"]["0"], 5);
    // Without a trace the exit line comes all the same.
    let out = Run::client("client_procaddr").env("VRAMCAP_LIMIT", "1g").args(["init ctx 0 alloc 2g alloc 2g alloc 2g"]).run();
    assert!(out.ok().stderr.contains("vramcap: 2 more denial(s) not shown"), "{}", out.stderr);
    // A line printed after the interval carries the count of those held back before it; then
    // nothing is left for the exit line.
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init ctx 0 alloc 2g alloc 2g alloc 2g sleep 1100 alloc 2g"])
        .run();
    let lines: Vec<&str> = out.ok().stderr.lines().filter(|l| l.starts_with("vramcap: denied")).collect();
    assert_eq!(lines.len(), 2, "{}", out.stderr);
    assert!(!lines[0].contains("not shown") && lines[1].ends_with("(2 more denials not shown)"), "{}", out.stderr);
    assert!(!out.stderr.contains("more denial(s) not shown"), "{}", out.stderr);
}

/// A child made without the atfork handlers (`_Fork()`, a raw `clone`): lossless mode must not
/// wait for a writer that exists only in the parent ("No thread waits ... when it never started").
#[test]
fn a_child_forked_without_atfork_handlers_never_waits_for_the_parents_writer() {
    let dir = tmpdir("rawfork");
    let path = dir.join("t-%p.jsonl");
    let t0 = Instant::now();
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "8g")
        .env("VRAMCAP_TRACE", &path)
        .env("VRAMCAP_TRACE_MODE", "lossless")
        // Parent has its writer running before the child is made; the child makes more events
        // than one ring holds.
        .args(["init ctx 0 alloc 1m rawfork 40000"])
        .timeout(Duration::from_secs(30))
        .run();
    assert!(out.status.success() && out.nth("rawfork", 0).num("status") == 0, "child hung or failed after {:?}: {}\n{}", t0.elapsed(), out.stdout, out.stderr);
}

/// Runs `ops` (8 threads allocating flat out, `op` names their result line) on a fake device of
/// 64 MiB with a trace, the driver refusing what does not fit, and checks that the summary's
/// `peak` and every event's `used` (what analysis takes peaks from) stay within the device: they
/// are what the process held, and it never held more than the device has. The trace is streamed,
/// never read whole (it has ~10^5 events).
fn assert_peak_within_the_device(test: &str, ops: &str, op: &str) {
    use std::io::BufRead;
    let dir = tmpdir(test);
    let path = dir.join("t.jsonl");
    let out = Run::client("client_linked").env("FAKECUDA_MEM", "64m").env("VRAMCAP_TRACE", &path).args([ops]).run();
    out.ok();
    assert!(out.nth(op, 0).num("oom") > 0, "the driver refused some: {}", out.stdout);
    let (mut most, mut s) = (0u64, Value::Null);
    for l in std::io::BufReader::new(std::fs::File::open(&path).unwrap()).lines() {
        let v: Value = serde_json::from_str(&l.unwrap()).unwrap();
        if v["type"] == "event" && v["dev"] == 0 {
            most = most.max(v["used"].as_u64().unwrap_or(0));
        }
        s = v;
    }
    assert_eq!(s["type"], "summary");
    let peak = s["peak"]["0"].as_u64().unwrap();
    assert!(peak <= 64 * MIB, "summary peak {peak} bytes on a device of {} bytes: {s}", 64 * MIB);
    assert!(most <= 64 * MIB, "an event says {most} bytes used on a device of {} bytes", 64 * MIB);
    assert_eq!(s["used"]["0"], 0, "everything was freed: {s}");
}

/// The summary's `peak` is exact (docs/configuration.md "Tracing"): what the process really held
/// at most. A thread's reservation for a call that the driver then refuses must not count.
#[test]
fn the_summary_peak_never_counts_allocations_the_driver_refused() {
    assert_peak_within_the_device("peak-oom", "init ctx 0 threads 8 20000 48m 1", "threads");
}

/// The same for VMM memory: the last unmap (or release) of a VMM allocation gives its memory back
/// to the driver, and another thread's cuMemCreate may get that memory at once. Its bytes must stop
/// counting as held before the driver is asked (as `charge::free` does for cuMemFree), or both
/// count at once.
#[test]
fn the_summary_peak_never_exceeds_the_device_with_vmm_memory() {
    assert_peak_within_the_device("peak-vmm", "init ctx 0 vmmstorm 8 20000 48m", "vmmstorm");
}

/// The same for memory a context's end frees (cuCtxDestroy, the last cuCtxDetach): the driver frees
/// it during the call, and another thread may be handed it at once.
#[test]
fn the_summary_peak_never_exceeds_the_device_when_contexts_end() {
    assert_peak_within_the_device("peak-ctx", "init ctx 0 ctxstorm 8 3000 48m", "ctxstorm");
}

/// `exit()` from the main thread while other threads still allocate (op `exitbusy`), in both
/// modes: the writer must finish with the summary (trace-format.md: "`exit()` from any thread
/// ... drains everything and writes the summary, waiting at most 5 seconds"), and the lines must
/// add up (`events - dropped` event lines). A regular file: the writer keeps up with it, so the
/// rings are never seen empty while the threads run. Only the file's tail is read before the
/// summary is known to be there; then the file is streamed line by line.
#[test]
fn exit_while_other_threads_allocate_writes_the_summary_in_both_modes() {
    use std::io::{BufRead, Read, Seek, SeekFrom};
    for mode in ["drop", "lossless"] {
        let dir = tmpdir(&format!("exitbusy-{mode}"));
        let path = dir.join("t.jsonl");
        let t0 = Instant::now();
        let out = Run::client("client_linked")
            .env("VRAMCAP_LIMIT", "8g")
            .env("VRAMCAP_TRACE", &path)
            .env("VRAMCAP_TRACE_MODE", mode)
            .args(["init ctx 0 exitbusy 4 200"])
            .timeout(Duration::from_secs(30))
            .run();
        let took = t0.elapsed();
        out.ok();
        let mut f = std::fs::File::open(&path).unwrap();
        let len = f.metadata().unwrap().len();
        f.seek(SeekFrom::Start(len.saturating_sub(4096))).unwrap();
        let mut tail = String::new();
        f.read_to_string(&mut tail).unwrap();
        let last = tail.trim_end_matches('\n').rsplit('\n').next().unwrap_or("").to_string();
        let fail = |why: &str| {
            let _ = std::fs::remove_dir_all(&dir);
            panic!("{mode}: {why} (exit took {took:?}, trace {len} bytes); last line: {last}\nstderr: {}", out.stderr)
        };
        if !tail.ends_with('\n') {
            fail("the trace ends in a cut line");
        }
        let s: Value = serde_json::from_str(&last).unwrap_or(Value::Null);
        if s["type"] != "summary" {
            fail("no summary");
        }
        let (events, dropped) = (s["events"].as_u64().unwrap(), s["dropped"].as_u64().unwrap());
        let mut event_lines = 0u64;
        let mut line = String::new();
        let mut r = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
        while { line.clear(); r.read_line(&mut line).unwrap() > 0 } {
            event_lines += line.starts_with("{\"type\":\"event\"") as u64;
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(events - dropped, event_lines, "{mode}: {s}");
        assert!(took < Duration::from_secs(5), "{mode}: exit took {took:?}");
    }
}

/// Streams a trace file: (event lines, seq strictly increasing, last line, ends with a newline).
fn stream_trace(path: &std::path::Path) -> (u64, bool, String, bool) {
    use std::io::BufRead;
    let mut r = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let (mut n, mut ordered, mut prev, mut last, mut line) = (0u64, true, -1i64, String::new(), String::new());
    while {
        line.clear();
        r.read_line(&mut line).unwrap() > 0
    } {
        if line.starts_with("{\"type\":\"event\"") {
            n += 1;
            let v: Value = serde_json::from_str(&line).unwrap();
            let seq = v["seq"].as_i64().unwrap();
            ordered &= seq > prev;
            prev = seq;
        }
        std::mem::swap(&mut last, &mut line);
    }
    let complete = last.ends_with('\n');
    (n, ordered, last, complete)
}

/// SIGSTOP then SIGCONT (1.5 s later) while two threads allocate, in both modes: the trace stays
/// valid and complete (the summary is there, `events - dropped` event lines, in `seq` order).
#[test]
fn sigstop_and_sigcont_mid_run_leave_a_complete_trace() {
    for mode in ["drop", "lossless"] {
        let dir = tmpdir(&format!("sigstop-{mode}"));
        let path = dir.join("t.jsonl");
        let mut run = Run::client("client_procaddr")
            .env("VRAMCAP_LIMIT", "8g")
            .env("VRAMCAP_TRACE", &path)
            .env("VRAMCAP_TRACE_MODE", mode)
            .args(["init ctx 0 benchmt 2 400000 256"])
            .spawn();
        run.wait_for("ctx");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(unsafe { libc::kill(run.pid() as i32, libc::SIGSTOP) }, 0);
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(unsafe { libc::kill(run.pid() as i32, libc::SIGCONT) }, 0);
        let st = wait_bounded(&mut run.child, Duration::from_secs(30), mode);
        assert_eq!(st.code(), Some(0), "{mode}: {st:?}");
        let (lines, ordered, last, complete) = stream_trace(&path);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(complete && ordered, "{mode}: complete {complete}, ordered {ordered}: {last}");
        let s: Value = serde_json::from_str(&last).unwrap();
        assert_eq!(s["type"], "summary", "{mode}: {s}");
        assert_eq!(s["events"], 1_600_000, "{mode}: {s}");
        assert_eq!(s["events"].as_u64().unwrap() - s["dropped"].as_u64().unwrap(), lines, "{mode}: {s}");
        if mode == "lossless" {
            assert_eq!(s["dropped"], 0, "{mode}: {s}");
        }
    }
}
