//! `vramcap sidecar` and `vramcap top` against real preloaded processes: metrics equal what each
//! process holds, a sidecar killed and restarted mid-run, 64 concurrent clients, 256 raw
//! connections, malformed and oversized input, per-client trace files, `top --once`.

use vramcap_tests::common;
use common::*;
use vramcap_tests::sidecar_support;
use sidecar_support::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[test]
fn metrics_equal_what_each_process_holds() {
    let dir = tmpdir("m");
    let sc = Sidecar::start(&dir.join("s.sock"), &[]);
    let pod = [("VRAMCAP_LIMIT", "1g"), ("POD_NAMESPACE", "ns1"), ("POD_NAME", "pod-a"), ("CONTAINER_NAME", "trainer")];
    let mut a = Client::spawn("client_linked", &sc.socket, &pod, "init ctx 0 alloc 100m alloc 28m alloc 2g sleep 60000");
    let b = Client::spawn("client_procaddr", &sc.socket, &[], "init ctx 0 alloc 64m free 0 alloc 16m alloc1 1m sleep 60000");
    let c = Client::spawn("client_dlsym", &sc.socket, &[("VRAMCAP_LIMIT", "1=512m")], "init ctx 1 alloc 8m sleep 60000");
    let (pa, pb, pc) = (a.pid(), b.pid(), c.pid());
    let used = |s: &[Sample], pid: &str, dev: &str| value(s, "vramcap_memory_used_bytes", &[("pid", pid), ("device", dev)]);
    wait_until("the three processes' charges", Duration::from_secs(20), || {
        let s = sc.samples();
        used(&s, &pa, "0") == Some(128 * MIB) && used(&s, &pb, "0") == Some(17 * MIB) && used(&s, &pc, "1") == Some(8 * MIB)
    });
    // One more snapshot period, so the counters from the usage lines are in too.
    std::thread::sleep(Duration::from_millis(1200));
    let s = sc.samples();
    assert_eq!(value(&s, "vramcap_clients", &[]), Some(3));
    assert_eq!(value(&s, "vramcap_bad_clients_total", &[]), Some(0));
    let la = [("pid", pa.as_str()), ("device", "0"), ("exe", "client_linked"), ("namespace", "ns1"), ("pod", "pod-a"), ("container", "trainer")];
    assert_eq!(value(&s, "vramcap_memory_used_bytes", &la), Some(128 * MIB));
    assert_eq!(value(&s, "vramcap_memory_limit_bytes", &la), Some(GIB));
    assert_eq!(value(&s, "vramcap_memory_peak_bytes", &la), Some(128 * MIB));
    assert_eq!(value(&s, "vramcap_allocation_denied_total", &la), Some(1));
    assert_eq!(value(&s, "vramcap_allocations_total", &[("pid", &pa), ("device", "0"), ("api", "cuMemAlloc_v2")]), Some(2));
    assert_eq!(value(&s, "vramcap_events_dropped_total", &[("pid", &pa)]), Some(0));

    let lb = [("pid", pb.as_str()), ("device", "0"), ("exe", "client_procaddr")];
    assert_eq!(value(&s, "vramcap_memory_peak_bytes", &lb), Some(64 * MIB));
    assert_eq!(value(&s, "vramcap_memory_limit_bytes", &lb), None, "no cap, no limit series");
    assert_eq!(value(&s, "vramcap_allocation_denied_total", &lb), Some(0));
    assert_eq!(value(&s, "vramcap_allocations_total", &[("pid", &pb), ("api", "cuMemAlloc_v2")]), Some(2));
    assert_eq!(value(&s, "vramcap_allocations_total", &[("pid", &pb), ("api", "cuMemAlloc")]), Some(1));
    let b_series: Vec<&Sample> = s.iter().filter(|x| x.labels.get("pid") == Some(&pb)).collect();
    assert!(b_series.iter().all(|x| !x.labels.contains_key("pod") && !x.labels.contains_key("namespace")), "{b_series:?}");

    assert_eq!(value(&s, "vramcap_memory_limit_bytes", &[("pid", &pc), ("device", "1")]), Some(512 * MIB));
    assert_eq!(used(&s, &pc, "0"), Some(0));

    // A process that dies (even by SIGKILL) leaves: its connection closes.
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    wait_until("the killed process to leave", Duration::from_secs(10), || {
        let s = sc.samples();
        value(&s, "vramcap_clients", &[]) == Some(2) && used(&s, &pa, "0").is_none()
    });
    assert_eq!(used(&sc.samples(), &pb, "0"), Some(17 * MIB));
}

#[test]
fn a_restarted_sidecar_is_right_again_and_clients_never_notice() {
    let dir = tmpdir("r");
    let socket = dir.join("s.sock");
    let mut s1 = Sidecar::start(&socket, &[]);
    let client = Client::spawn("client_linked", &socket, &[("VRAMCAP_LIMIT", "1g")], "init ctx 0 alloc 10m sleep 2500 alloc 20m free 0 sleep 60000");
    let pid = client.pid();
    let used = |sc: &Sidecar| value(&sc.samples(), "vramcap_memory_used_bytes", &[("pid", &pid), ("device", "0")]);
    wait_until("the first sidecar to see 10 MiB", Duration::from_secs(20), || used(&s1) == Some(10 * MIB));
    s1.kill();
    assert!(socket.exists(), "SIGKILL leaves the socket file behind");
    // While no sidecar runs, the client allocates and frees as usual.
    wait_until("the client's ops without a sidecar", Duration::from_secs(20), || client.lines().iter().any(|l| l.starts_with("free")));
    let lines = client.lines();
    assert!(lines.iter().filter(|l| l.starts_with("alloc")).all(|l| l.starts_with("alloc rc=0")), "{lines:?}");
    assert!(lines.iter().any(|l| l == "free rc=0"), "{lines:?}");

    let s2 = Sidecar::start(&socket, &[]);
    assert!(s2.stderr.lock().unwrap().contains("took over the stale socket"));
    // Backoff is capped at 5 s; the fresh header and usage snapshot make the numbers right.
    wait_until("the restarted sidecar to be right", Duration::from_secs(12), || used(&s2) == Some(20 * MIB));
    let s = s2.samples();
    let l = [("pid", pid.as_str()), ("device", "0")];
    assert_eq!(value(&s, "vramcap_memory_peak_bytes", &l), Some(30 * MIB));
    assert_eq!(value(&s, "vramcap_memory_limit_bytes", &l), Some(GIB));
    assert_eq!(value(&s, "vramcap_allocations_total", &[("pid", &pid), ("api", "cuMemAlloc_v2")]), Some(2));
    assert_eq!(value(&s, "vramcap_events_dropped_total", &[("pid", &pid)]), Some(2), "the alloc and free sent into the void");
    assert_eq!(value(&s, "vramcap_clients", &[]), Some(1));
}

#[test]
fn sixty_four_concurrent_clients() {
    let dir = tmpdir("64");
    let sc = Sidecar::start(&dir.join("s.sock"), &[]);
    let clients: Vec<Client> =
        (0..64).map(|i| Client::spawn("client_linked", &sc.socket, &[], &format!("init ctx 0 alloc {}m sleep 60000", i + 1))).collect();
    wait_until("64 clients with their charges", Duration::from_secs(60), || {
        let s = sc.samples();
        value(&s, "vramcap_clients", &[]) == Some(64)
            && clients.iter().enumerate().all(|(i, c)| {
                value(&s, "vramcap_memory_used_bytes", &[("pid", &c.pid()), ("device", "0")]) == Some((i as u64 + 1) * MIB)
            })
    });
    let s = sc.samples();
    let total: u64 = s.iter().filter(|x| x.name == "vramcap_memory_used_bytes").map(|x| x.value).sum();
    assert_eq!(total, 64 * 65 / 2 * MIB);
    drop(clients);
    wait_until("all 64 to leave", Duration::from_secs(20), || value(&sc.samples(), "vramcap_clients", &[]) == Some(0));
}


/// Sends `data` and waits for the sidecar to close the connection (read returns 0 or an error).
fn send_and_expect_close(socket: &Path, data: &[u8]) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(data);
    let mut buf = [0u8; 64];
    let closed = matches!(s.read(&mut buf), Ok(0) | Err(_));
    assert!(closed, "the sidecar kept a bad client: {:?}", String::from_utf8_lossy(&data[..data.len().min(80)]));
}

#[test]
fn malformed_oversized_silent_and_256_clients_never_stall_the_sidecar() {
    let dir = tmpdir("bad");
    let sc = Sidecar::start(&dir.join("s.sock"), &["--hello-timeout", "1"]);
    let real = Client::spawn("client_linked", &sc.socket, &[], "init ctx 0 alloc 5m sleep 60000");
    // A silent connection must not hold anything up while it waits to be timed out.
    let silent = UnixStream::connect(&sc.socket).unwrap();
    wait_until("the real client", Duration::from_secs(20), || {
        value(&sc.samples(), "vramcap_memory_used_bytes", &[("pid", &real.pid()), ("device", "0")]) == Some(5 * MIB)
    });
    send_and_expect_close(&sc.socket, b"this is not json\n");
    send_and_expect_close(&sc.socket, b"[1,2,3]\n");
    send_and_expect_close(&sc.socket, b"{\"type\":\"event\",\"op\":\"alloc\"}\n");
    send_and_expect_close(&sc.socket, header_line(1).replace("\"version\":1", "\"version\":7").as_bytes());
    let mut big = header_line(2).into_bytes();
    big.extend(std::iter::repeat_n(b'a', 2 << 20));
    send_and_expect_close(&sc.socket, &big);
    let mut long_line = header_line(3).into_bytes();
    long_line.extend_from_slice(b"{\"type\":\"note\",\"x\":\"");
    long_line.extend(std::iter::repeat_n(b'b', (1 << 20) + 10));
    long_line.extend_from_slice(b"\"}\n");
    send_and_expect_close(&sc.socket, &long_line);
    let mut after_header = header_line(4).into_bytes();
    after_header.extend_from_slice(b"{\"type\":\"usage\",\"dropped\":\"x\",\"devices\":[]}\n");
    send_and_expect_close(&sc.socket, &after_header);
    let mut buf = [0u8; 8];
    silent.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(matches!((&silent).read(&mut buf), Ok(0) | Err(_)), "the silent client was kept");
    wait_until("8 bad clients counted", Duration::from_secs(10), || value(&sc.samples(), "vramcap_bad_clients_total", &[]) == Some(8));

    // 256 raw clients at once, each a valid header and a usage snapshot.
    let raw: Vec<UnixStream> = (0..256u32)
        .map(|i| {
            let mut s = UnixStream::connect(&sc.socket).unwrap();
            let usage = format!(
                "{{\"type\":\"usage\",\"t_ns\":1,\"events\":0,\"dropped\":0,\"devices\":[{{\"index\":0,\"used\":{},\"limit\":null,\"peak\":{},\"denied\":0}}],\"allocations\":[]}}\n",
                i + 1,
                i + 1
            );
            s.write_all((header_line(1000 + i) + &usage).as_bytes()).unwrap();
            s
        })
        .collect();
    wait_until("257 clients", Duration::from_secs(20), || value(&sc.samples(), "vramcap_clients", &[]) == Some(257));
    let s = sc.samples();
    let raw_total: u64 = s.iter().filter(|x| x.name == "vramcap_memory_used_bytes" && x.labels["exe"] == "raw").map(|x| x.value).sum();
    assert_eq!(raw_total, 256 * 257 / 2);
    drop(raw);
    wait_until("the raw clients to leave", Duration::from_secs(10), || value(&sc.samples(), "vramcap_clients", &[]) == Some(1));
    let s = sc.samples();
    assert_eq!(value(&s, "vramcap_memory_used_bytes", &[("pid", &real.pid()), ("device", "0")]), Some(5 * MIB));
    assert_eq!(value(&s, "vramcap_bad_clients_total", &[]), Some(8));
    let log = sc.stderr.lock().unwrap().clone();
    for reason in ["malformed JSON", "not a JSON object", "first line of type \"event\"", "version 7", "without a line end", "bad usage line", "no header or query within"] {
        assert!(log.contains(reason), "no {reason:?} in the log:\n{log}");
    }
}

#[test]
fn a_second_sidecar_is_refused_and_the_socket_is_0660() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmpdir("own");
    let socket = dir.join("sub/s.sock");
    let sc = Sidecar::start(&socket, &[]);
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "{mode:o}");
    let out = Command::new(vramcap_tests::common::vramcap_bin()).args(["sidecar", "--socket"]).arg(&socket).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("another sidecar is already listening"), "{out:?}");
    assert!(UnixStream::connect(&sc.socket).is_ok(), "the first sidecar still owns the path");
    let file = dir.join("plain");
    std::fs::write(&file, "keep me").unwrap();
    let out = Command::new(vramcap_tests::common::vramcap_bin()).args(["sidecar", "--socket"]).arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a socket"), "{out:?}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

#[test]
fn top_once_prints_one_row_per_process_and_device() {
    let dir = tmpdir("top");
    let sc = Sidecar::start(&dir.join("s.sock"), &[]);
    let c = Client::spawn("client_linked", &sc.socket, &[("VRAMCAP_LIMIT", "0=1g")], "init ctx 0 alloc 256m alloc 1g sleep 60000");
    wait_until("the client's denial", Duration::from_secs(20), || {
        value(&sc.samples(), "vramcap_allocation_denied_total", &[("pid", &c.pid()), ("device", "0")]) == Some(1)
    });
    let out = Command::new(vramcap_tests::common::vramcap_bin()).args(["top", "--once", "--socket"]).arg(&sc.socket).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{out:?}");
    let rows: Vec<&str> = text.lines().filter(|l| l.trim_start().starts_with(&c.pid())).collect();
    assert_eq!(rows.len(), 1, "only device 0 was used or capped:\n{text}");
    let r = rows[0];
    for want in ["client_linked", "256.0 MiB / 1.0 GiB", "[##......]", "256.0 MiB"] {
        assert!(r.contains(want), "{want:?} missing from {r:?}");
    }
    assert_eq!(r.split_whitespace().last(), Some("1"), "denials: {r}");
    assert!(text.starts_with("vramcap top: 1 process(es)"), "{text}");
    assert!(!text.contains('\x1b'), "--once prints plain text");
    let out = Command::new(vramcap_tests::common::vramcap_bin()).args(["top", "--once", "--socket"]).arg(dir.join("none.sock")).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no sidecar on"), "{out:?}");
}

#[test]
fn trace_dir_keeps_each_clients_records_and_no_sidecar_changes_nothing() {
    let dir = tmpdir("td");
    let traces = dir.join("traces");
    let sc = Sidecar::start(&dir.join("s.sock"), &["--trace-dir", traces.to_str().unwrap()]);
    let out = Run::client("client_linked")
        .env("VRAMCAP_SIDECAR", &sc.socket)
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init ctx 0 alloc 1m alloc 2g alloc 3m free 0"])
        .run();
    out.ok();
    // The sidecar writes what it has received when it next polls: the client may have exited
    // first (a busy machine, CI), so wait for the summary to reach the file.
    wait_until("the client's summary in its trace file", Duration::from_secs(20), || {
        std::fs::read_dir(&traces).into_iter().flatten().flatten().any(|e| {
            std::fs::read_to_string(e.path()).is_ok_and(|t| t.lines().last().is_some_and(|l| l.contains("\"type\":\"summary\"")))
        })
    });
    let files: Vec<PathBuf> = std::fs::read_dir(&traces).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("client_linked-"), "{name}");
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&files[0]).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["type"], "header");
    assert_eq!(lines[0]["protocol"], 1);
    assert_eq!(lines[0]["version"], 1);
    assert_eq!(lines[1]["type"], "usage", "a usage snapshot follows every header");
    let ops: Vec<&str> = lines.iter().filter(|l| l["type"] == "event").map(|l| l["op"].as_str().unwrap()).collect();
    assert_eq!(ops, ["alloc", "deny", "alloc", "free"]);
    let last = lines.last().unwrap();
    assert_eq!(last["type"], "summary");
    assert_eq!((last["events"].as_u64(), last["dropped"].as_u64(), last["used"]["0"].as_u64()), (Some(4), Some(0), Some(3 * MIB)));

    // No sidecar at all: the job runs exactly as without one, and says nothing.
    let out = Run::client("client_linked")
        .env("VRAMCAP_SIDECAR", dir.join("absent.sock"))
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init ctx 0 alloc 1m alloc 2g alloc 3m free 0"])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0);
    assert_eq!(out.nth("alloc", 1).rc(), 2);
    assert_eq!(out.nth("free", 0).rc(), 0);
    assert!(!out.stderr.contains("sidecar"), "{}", out.stderr);
}

#[test]
fn the_sidecar_reclaims_a_killed_group_member_and_labels_the_group() {
    let dir = tmpdir("group-reclaim");
    let groups = dir.join("ledgers");
    std::fs::create_dir_all(&groups).unwrap();
    let socket = dir.join("s.sock");
    let sc = Sidecar::start(&socket, &["--group-dir", groups.to_str().unwrap(), "--reclaim-every", "0.2"]);
    let env = [("VRAMCAP_GROUP", "team"), ("VRAMCAP_GROUP_DIR", groups.to_str().unwrap()), ("VRAMCAP_GROUP_LIMIT", "1g")];
    let mut a = Client::spawn("client_linked", &socket, &env, "init ctx 0 alloc 768m sleep 60000");
    wait_until("the member's allocation", Duration::from_secs(20), || a.lines().iter().any(|l| l.starts_with("alloc rc=0")));
    let pid = a.pid();
    wait_until("the group label", Duration::from_secs(20), || {
        value(&sc.samples(), "vramcap_memory_used_bytes", &[("pid", &pid), ("device", "0"), ("group", "team")]) == Some(768 * MIB)
    });
    // Killed holding 768 MiB, and nobody else allocates: only the sidecar can give it back.
    let _ = a.child.kill();
    let _ = a.child.wait();
    let reclaimed = || value(&sc.samples(), "vramcap_group_reclaimed_bytes_total", &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while reclaimed() != Some(768 * MIB) {
        assert!(Instant::now() < deadline, "no reclaim ({:?}): {}", reclaimed(), sc.stderr.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The whole budget is there again for a new member.
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_GROUP", "team")
        .env("VRAMCAP_GROUP_DIR", &groups)
        .args(["init ctx 0 info alloc 1g"])
        .run();
    out.ok();
    assert_eq!(out.nth("info", 0).num("free"), GIB, "{}", out.stderr);
    assert_eq!(out.nth("alloc", 0).rc(), 0);
    assert!(sc.stderr.lock().unwrap().contains("reclaimed 805306368 bytes from 1 dead member"));
}

/// A process that forks: the child (which allocates, frees and exits) reports on a connection of
/// its own, with its own header, and never writes on the parent's inherited socket; the parent's
/// stream stays whole.
#[test]
fn a_forked_child_reports_on_its_own_connection() {
    let dir = tmpdir("fork");
    let traces = dir.join("traces");
    let sc = Sidecar::start(&dir.join("s.sock"), &["--trace-dir", traces.to_str().unwrap()]);
    let parent = Client::spawn("client_linked", &sc.socket, &[("VRAMCAP_LIMIT", "1g")], "init ctx 0 alloc 64m fork alloc 2m sleep 60000");
    let pp = parent.pid();
    wait_until("the fork and the parent's second allocation", Duration::from_secs(20), || {
        value(&sc.samples(), "vramcap_memory_used_bytes", &[("pid", &pp), ("device", "0")]) == Some(66 * MIB)
    });
    let child_pid: String = parent
        .lines()
        .iter()
        .find_map(|l| l.strip_prefix("fork child=").map(|r| r.split_whitespace().next().unwrap().to_string()))
        .expect("the client printed the child's pid");
    assert!(parent.lines().iter().any(|l| l.starts_with("fork") && l.ends_with("status=0")), "{:?}", parent.lines());
    let read = |pid: &str| -> Vec<serde_json::Value> {
        let f = std::fs::read_dir(&traces).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().contains(&format!("-{pid}")));
        let f = f.unwrap_or_else(|| panic!("no record for pid {pid} in {}", traces.display()));
        std::fs::read_to_string(f).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    wait_until("the child's summary", Duration::from_secs(20), || {
        std::fs::read_dir(&traces).map(|d| d.count()).unwrap_or(0) == 2 && read(&child_pid).last().is_some_and(|l| l["type"] == "summary")
    });
    let child = read(&child_pid);
    assert_eq!(child[0]["type"], "header");
    assert_eq!(child[0]["pid"].as_u64().unwrap().to_string(), child_pid);
    assert_eq!(child[0]["ppid"].as_u64().unwrap().to_string(), pp, "the child names its parent");
    let ops: Vec<(&str, u64)> =
        child.iter().filter(|l| l["type"] == "event").map(|l| (l["op"].as_str().unwrap(), l["size"].as_u64().unwrap())).collect();
    assert_eq!(ops, [("alloc", MIB), ("free", MIB)], "only the child's own calls, from seq 0");
    assert_eq!(child.iter().find(|l| l["type"] == "event").unwrap()["seq"], 0);
    assert_eq!(child.last().unwrap()["used"]["0"], 64 * MIB, "the child inherited the parent's 64 MiB charge");

    let mine = read(&pp);
    let ops: Vec<(&str, u64)> =
        mine.iter().filter(|l| l["type"] == "event").map(|l| (l["op"].as_str().unwrap(), l["size"].as_u64().unwrap())).collect();
    assert_eq!(ops, [("alloc", 64 * MIB), ("alloc", 2 * MIB)], "the parent's stream has none of the child's events");
    assert_eq!(mine.iter().filter(|l| l["type"] == "header").count(), 1, "the parent never reconnected");
    let s = sc.samples();
    assert_eq!(value(&s, "vramcap_bad_clients_total", &[]), Some(0));
    assert_eq!(value(&s, "vramcap_clients", &[]), Some(1), "the child left");
}

/// `vramcap top` without `--once`: started before any sidecar it says so and retries; then it
/// redraws every second, shows a new process and drops one that exits.
#[test]
fn top_live_retries_then_follows_processes() {
    let dir = tmpdir("toplive");
    let socket = dir.join("s.sock");
    let mut top = Command::new(vramcap_tests::common::vramcap_bin())
        .args(["top", "--socket"])
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let screens = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = screens.clone();
    let mut stdout = top.stdout.take().unwrap();
    // Into a pipe, "no sidecar yet" goes to stderr, one line per attempt (issue 16 §4).
    let complaints = Arc::new(Mutex::new(String::new()));
    let log = complaints.clone();
    let stderr = top.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            log.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut text = String::new();
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
            // Into a pipe: plain snapshots, each starting with its title line, no screen control.
            assert!(!text.contains('\x1b'), "screen-control codes into a pipe: {text:?}");
            let parts: Vec<&str> = text.split("vramcap top:").collect();
            let mut s = sink.lock().unwrap();
            *s = parts.iter().filter(|p| !p.is_empty()).map(|p| format!("vramcap top:{p}")).collect();
        }
    });
    let last = || screens.lock().unwrap().last().cloned().unwrap_or_default();
    wait_until("top to say there is no sidecar yet", Duration::from_secs(10), || complaints.lock().unwrap().contains("(attempt 1 of 10)"));

    let sc = Sidecar::start(&socket, &[]);
    let c = Client::spawn("client_linked", &sc.socket, &[("VRAMCAP_LIMIT", "0=1g")], "init ctx 0 alloc 256m sleep 3000");
    let pid = c.pid();
    wait_until("top to show the client", Duration::from_secs(20), || {
        last().lines().any(|l| l.trim_start().starts_with(&pid) && l.contains("256.0 MiB / 1.0 GiB"))
    });
    let shown = screens.lock().unwrap().len();
    wait_until("the client to exit and leave the screen", Duration::from_secs(20), || {
        last().contains("vramcap top: 0 process(es)")
    });
    assert!(screens.lock().unwrap().len() > shown, "it kept redrawing");
    let _ = top.kill();
    let _ = top.wait();
    drop(c);
}

/// Kubernetes with `hostPID: true` (issue 15): a member in a PID namespace of its own, whose pid
/// there is one no host process has, keeps its charge through every sweep of the root sidecar while
/// it lives (a sidecar judging by the host's `/proc/<pid>` would reclaim it at once: 400 MiB under
/// a 256 MiB group), and is reclaimed by the sidecar once it dies.
#[test]
fn the_sidecar_keeps_a_live_member_of_another_pid_namespace_and_reclaims_it_once_dead() {
    let unshare_ok = unsafe { libc::geteuid() } == 0
        && Command::new("unshare").args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"]).status().is_ok_and(|s| s.success());
    if !unshare_ok {
        eprintln!("SKIPPED the_sidecar_keeps_a_live_member_of_another_pid_namespace_and_reclaims_it_once_dead: needs root and unshare --pid");
        return;
    }
    let dir = tmpdir("pidns");
    let groups = dir.join("ledgers");
    std::fs::create_dir_all(&groups).unwrap();
    let socket = dir.join("s.sock");
    let sc = Sidecar::start(&socket, &["--group-dir", groups.to_str().unwrap(), "--reclaim-every", "0.2"]);
    // A pid no host process has: inside its namespace the member gets exactly that one.
    let pid = (20_000..30_000u32).rev().find(|p| !Path::new(&format!("/proc/{p}")).exists()).unwrap();
    let client = ctests_dir().join("client_linked");
    let script = dir.join("member.sh");
    std::fs::write(&script, format!("echo {} > /proc/sys/kernel/ns_last_pid && {} init ctx 0 alloc 200m sleep 60000\n", pid - 1, client.display())).unwrap();
    let mut a = Run::program(Path::new("unshare"))
        .env("VRAMCAP_GROUP", "ns")
        .env("VRAMCAP_GROUP_DIR", &groups)
        .env("VRAMCAP_GROUP_LIMIT", "256m")
        .env("VRAMCAP_SIDECAR", &socket)
        .args(["--pid --fork --mount-proc --kill-child sh", script.to_str().unwrap()])
        .spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let m = vramcap_common::group_ledger::file::open_existing(&vramcap_common::group_ledger::file::path_for(groups.to_str().unwrap(), "ns")).unwrap().unwrap();
    use vramcap_common::group_ledger::shm::{SlotWord, State};
    let live: Vec<u32> = m.shm.slots.iter().map(|s| SlotWord::unpack(s.word.load(std::sync::atomic::Ordering::SeqCst))).filter(|w| w.state == State::Live).map(|w| w.pid).collect();
    assert!(live.contains(&pid) && !Path::new(&format!("/proc/{pid}")).exists(), "the member is pid {pid} of its namespace, unknown to the host: {live:?}");
    // The sidecar knows the group (the member told it) and sweeps it every 0.2 s.
    wait_until("the member's report", Duration::from_secs(20), || value(&sc.samples(), "vramcap_clients", &[]) == Some(1));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(m.shm.used(0), 200 * MIB, "a live member's charge survived the sweeps: {}", sc.stderr.lock().unwrap());
    assert_eq!(value(&sc.samples(), "vramcap_group_reclaimed_bytes_total", &[]).unwrap_or(0), 0);
    // Dead with its namespace: the sidecar, seeing every namespace, gives the charge back.
    a.sigkill();
    wait_until("the sidecar's reclaim", Duration::from_secs(20), || m.shm.used(0) == 0);
    assert_eq!(value(&sc.samples(), "vramcap_group_reclaimed_bytes_total", &[]), Some(200 * MIB));
}

/// Without `--group-dir` the sidecar sweeps each client's group where that client's members keep
/// it by default, `/dev/shm/vramcap-<uid>` of the client's uid (from the socket's credentials): a
/// member killed holding memory is reclaimed with no directory configured anywhere.
#[test]
fn without_group_dir_the_sidecar_sweeps_the_members_default_directory() {
    let dir = tmpdir("dflt");
    let socket = dir.join("s.sock");
    let sc = Sidecar::start(&socket, &["--reclaim-every", "0.2"]);
    let group = format!("dflt-{}", std::process::id());
    let env = [("VRAMCAP_GROUP", group.as_str()), ("VRAMCAP_GROUP_LIMIT", "1g")];
    let mut a = Client::spawn("client_linked", &socket, &env, "init ctx 0 alloc 512m sleep 60000");
    wait_until("the member's allocation", Duration::from_secs(20), || a.lines().iter().any(|l| l.starts_with("alloc rc=0")));
    wait_until("the member's report", Duration::from_secs(20), || value(&sc.samples(), "vramcap_groups", &[]) == Some(1));
    let _ = a.child.kill();
    let _ = a.child.wait();
    let ledger = PathBuf::from(format!("/dev/shm/vramcap-{}/vramcap-group-{group}", unsafe { libc::geteuid() }));
    let reclaimed = || value(&sc.samples(), "vramcap_group_reclaimed_bytes_total", &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while reclaimed() != Some(512 * MIB) {
        if Instant::now() > deadline {
            let _ = std::fs::remove_file(&ledger);
            panic!("no reclaim ({:?}): {}", reclaimed(), sc.stderr.lock().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::remove_file(&ledger).unwrap();
}

/// Issue 17 item 6: `/metrics` exports each group member's reserve, `equal` share, the group's
/// headroom, its priority and whether it holds the headroom, labelled with the policy; the share
/// follows a member leaving (the sidecar's sweep reclaims it); `top` prints them under the row.
#[test]
fn metrics_and_top_show_each_members_sharing_settings() {
    let dir = tmpdir("sharing");
    let groups = dir.join("ledgers");
    std::fs::create_dir_all(&groups).unwrap();
    let sc = Sidecar::start(&dir.join("s.sock"), &["--group-dir", groups.to_str().unwrap(), "--reclaim-every", "0.2"]);
    let g = [("VRAMCAP_GROUP", "fair"), ("VRAMCAP_GROUP_DIR", groups.to_str().unwrap())];
    let a_env = [g[0], g[1], ("VRAMCAP_GROUP_LIMIT", "400m"), ("VRAMCAP_GROUP_POLICY", "equal"), ("VRAMCAP_GROUP_HEADROOM", "100m"), ("VRAMCAP_GROUP_RESERVE", "50m"), ("VRAMCAP_PRIORITY", "4")];
    let a = Client::spawn("client_linked", &sc.socket, &a_env, "init ctx 0 alloc 10m sleep 60000");
    wait_until("A's allocation", Duration::from_secs(20), || a.lines().iter().any(|l| l.starts_with("alloc rc=0")));
    // B starts while A holds memory: B holds the headroom.
    let mut b = Client::spawn("client_linked", &sc.socket, &g, "init ctx 0 alloc 1m sleep 60000");
    let (pa, pb) = (a.pid(), b.pid());
    let at = |pid: &str| [("pid", pid.to_string()), ("device", "0".to_string()), ("group", "fair".to_string()), ("policy", "equal".to_string())];
    let get = |s: &[Sample], name: &str, pid: &str, dev: bool| {
        let l = at(pid);
        let l: Vec<(&str, &str)> = l.iter().filter(|(k, _)| dev || *k != "device").map(|(k, v)| (*k, v.as_str())).collect();
        value(s, name, &l)
    };
    wait_until("both members' shares", Duration::from_secs(20), || {
        let s = sc.samples();
        get(&s, "vramcap_group_share_bytes", &pa, true) == Some(150 * MIB) && get(&s, "vramcap_group_share_bytes", &pb, true) == Some(250 * MIB)
    });
    let s = sc.samples();
    assert_eq!(get(&s, "vramcap_group_reserve_bytes", &pa, true), Some(50 * MIB));
    assert_eq!(get(&s, "vramcap_group_reserve_bytes", &pb, true), Some(0));
    assert_eq!(get(&s, "vramcap_group_headroom_bytes", &pa, true), Some(100 * MIB));
    assert_eq!(get(&s, "vramcap_group_headroom_bytes", &pb, true), Some(100 * MIB));
    assert_eq!(get(&s, "vramcap_group_priority", &pa, false), Some(4));
    assert_eq!(get(&s, "vramcap_group_priority", &pb, false), Some(0));
    assert_eq!(get(&s, "vramcap_group_headroom_holder", &pa, false), Some(0));
    assert_eq!(get(&s, "vramcap_group_headroom_holder", &pb, false), Some(1));
    assert_eq!(value(&s, "vramcap_group_memory_limit_bytes", &[("pid", &pa), ("device", "0")]), Some(400 * MIB), "existing series unchanged");
    assert!(s.iter().filter(|x| x.name == "vramcap_group_memory_limit_bytes").all(|x| !x.labels.contains_key("policy")));

    let out = Command::new(vramcap_tests::common::vramcap_bin()).args(["top", "--once", "--socket"]).arg(&sc.socket).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{out:?}");
    // The lines under a row (wrapped at 80 columns), joined as one.
    let under = |pid: &str| {
        let rows: Vec<&str> = text.lines().collect();
        let i = rows.iter().position(|l| l.trim_start().starts_with(pid)).unwrap_or_else(|| panic!("no row for {pid}:\n{text}"));
        rows[i + 1..].iter().take_while(|l| l.starts_with("        ")).map(|l| l.trim()).collect::<Vec<_>>().join(" ")
    };
    let budget = |pid: &str| under(pid).split(", policy").next().unwrap().to_string();
    assert!(budget(&pa).starts_with("group \"fair\": budget 400.0 MiB (") && budget(&pa).ends_with(" used by the group)"), "{text}");
    assert_eq!(under(&pa).split_once(", policy").unwrap().1, " equal, priority 4, share 150.0 MiB, reserve 50.0 MiB, headroom 100.0 MiB", "{text}");
    assert_eq!(under(&pb).split_once(", policy").unwrap().1, " equal, priority 0, share 250.0 MiB, reserve 0 B, headroom 100.0 MiB (this process may use it)", "{text}");

    // B is killed: the sweep reclaims it, and A alone may hold the whole 300 MiB.
    let _ = b.child.kill();
    let _ = b.child.wait();
    wait_until("A's share to grow back", Duration::from_secs(20), || get(&sc.samples(), "vramcap_group_share_bytes", &pa, true) == Some(300 * MIB));
    assert_eq!(get(&sc.samples(), "vramcap_group_share_bytes", &pb, true), None, "B's series left with it");
}

/// Issue 26: `vramcap limit` on a running group shows on `/metrics` (the member's group budget)
/// and in `top` within about a second of the change; polled with a generous deadline, not timed.
#[test]
fn a_changed_group_budget_shows_on_metrics_and_in_top() {
    let dir = tmpdir("livelimit");
    let groups = private_group_dir();
    let sc = Sidecar::start(&dir.join("s.sock"), &[]);
    let env = [("VRAMCAP_GROUP", "live"), ("VRAMCAP_GROUP_DIR", groups.to_str().unwrap()), ("VRAMCAP_GROUP_LIMIT", "1g")];
    let a = Client::spawn("client_linked", &sc.socket, &env, "init ctx 0 alloc 10m sleep 60000");
    let pa = a.pid();
    let budget = || value(&sc.samples(), "vramcap_group_memory_limit_bytes", &[("pid", &pa), ("device", "0")]);
    wait_until("the member's group budget", Duration::from_secs(20), || budget() == Some(GIB));
    let o = Command::new(vramcap_bin()).args(["limit", "--group", "live", "--group-dir", groups.to_str().unwrap(), "300m"]).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    wait_until("the new budget on /metrics", Duration::from_secs(20), || budget() == Some(300 * MIB));
    // The member's row fills towards the budget; the line under it names the group's budget.
    let top = || {
        let out = Command::new(vramcap_bin()).args(["top", "--once", "--socket"]).arg(&sc.socket).output().unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    wait_until("the new budget in top", Duration::from_secs(20), || {
        let t = top();
        let row = t.lines().find(|l| l.trim_start().starts_with(&pa)).unwrap_or_default().to_string();
        row.contains("10.0 MiB / 300.0 MiB") && t.contains("group \"live\": budget 300.0 MiB")
    });
}
