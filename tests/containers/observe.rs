//! What a container leaves for the operator: each process's trace in the container's own trace
//! directory, owned by the container's user.

use crate::needs_podman;
use crate::podman::{Cdi, client, name};
use std::os::unix::fs::MetadataExt;

#[test]
fn each_process_writes_its_trace_to_the_containers_own_directory_as_its_user() {
    needs_podman!();
    let c = Cdi::new("trace", &[("small", "256m")], &[]);
    let script = format!(
        "id -u; {}; {}; ls -ln /etc/vramcap/trace",
        client("client_linked", "init ctx 0 alloc 100m alloc 200m"),
        client("client_procaddr", "init ctx 0 alloc 50m")
    );
    let mut ctr = c.spawn(&name("trace"), &["small"], &["--user", "1000:1000"], &script);
    assert_eq!(ctr.wait_for("1000"), "1000", "runs as uid 1000");
    let id = ctr.id();
    ctr.wait_for("alloc rc=0");
    ctr.wait_for("alloc rc=2");
    ctr.wait_for("alloc rc=0");
    assert!(ctr.finish().success());
    let dir = c.trace_dir.join(&id);
    let m = std::fs::metadata(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1000, 1000, 0o750), "the container's trace directory");
    let mut traces: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    traces.sort();
    assert_eq!(traces.len(), 2, "{traces:?}");
    for t in &traces {
        let m = std::fs::metadata(t).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (1000, 0o644), "{}", t.display());
        let text = std::fs::read_to_string(t).unwrap();
        let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["type"], "summary", "{}", t.display());
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["group"], "small", "{}", t.display());
    }
    let name0 = traces[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name0.starts_with("client_linked-"), "{name0}: %e-%p-%t");
    // Traces stay after the container is gone; the ledger does not.
    assert!(!c.group_dir.join(format!("ctr-{id}")).exists());
}

/// The sidecar's answer to a `query` (root: every process).
fn query(socket: &std::path::Path) -> serde_json::Value {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.write_all(b"{\"type\":\"query\",\"protocol\":1}\n").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

/// The host's sidecar, its socket mounted through the spec, sees the container's processes with
/// the container's id (from their cgroup path: the kernel's word, not theirs), on /metrics and in
/// `top`; what it shows of a process is what the process's trace in the container's trace
/// directory says.
#[test]
fn the_hosts_sidecar_sees_the_containers_processes_as_their_traces_do() {
    needs_podman!();
    use vramcap_tests::sidecar_support::{Sidecar, tmpdir, value, wait_until};
    let sockdir = tmpdir("ctr");
    let socket = sockdir.join("sidecar.sock");
    let sidecar = Sidecar::start(&socket, &[]);
    let c = Cdi::new("sidecar", &[("small", "256m")], &["--sidecar", socket.to_str().unwrap()]);
    let ops = "init ctx 0 alloc 100m alloc 64m free 0 alloc 200m sleep 4000";
    let script = format!(
        "POD_NAMESPACE=ml POD_NAME=train-0 CONTAINER_NAME=trainer {}",
        client("client_procaddr", ops)
    );
    let mut ctr = c.spawn(&name("sidecar"), &["small"], &[], &script);
    ctr.wait_for("alloc rc=2");
    let id = ctr.id();
    let mut seen = serde_json::Value::Null;
    wait_until("the container's process at the sidecar", std::time::Duration::from_secs(3), || {
        let state = query(&socket);
        let hit = state["clients"].as_array().unwrap().iter().find(|c| c["container_id"] == id.as_str()).cloned();
        seen = hit.unwrap_or_default();
        seen["devices"][0]["used"] == 64 << 20 && seen["devices"][0]["denied"] == 1
    });
    assert_eq!((seen["exe"].as_str(), seen["group"].as_str(), seen["pod_uid"].as_str()), (Some("client_procaddr"), Some("small"), None), "{seen}");
    assert_eq!((seen["namespace"].as_str(), seen["pod"].as_str(), seen["container"].as_str()), (Some("ml"), Some("train-0"), Some("trainer")));
    let pid = seen["pid"].to_string();
    let metrics = sidecar.samples();
    let used = value(&metrics, "vramcap_memory_used_bytes", &[("pid", &pid), ("device", "0"), ("container_id", &id), ("container", "trainer")]);
    assert_eq!(used, Some(64 << 20), "{}", sidecar.text());
    let top = std::process::Command::new(vramcap_tests::common::vramcap_bin()).args(["top", "--once", "--socket"]).arg(&socket).output().unwrap();
    let top = String::from_utf8_lossy(&top.stdout);
    // The line under the row wraps at 80 columns: read it as one.
    let flat = top.lines().map(str::trim).collect::<Vec<_>>().join(" ");
    assert!(flat.contains(&format!("in container trainer ({}), pod ml/train-0", &id[..12])), "{top}");
    assert!(ctr.finish().success());
    // The process's own trace, in the container's trace directory, says the same.
    let dir = c.trace_dir.join(&id);
    let trace = std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path();
    let text = std::fs::read_to_string(&trace).unwrap();
    let summary: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(summary["type"], "summary");
    assert_eq!(summary["peak"]["0"], seen["devices"][0]["peak"], "peak: {summary}\n{seen}");
    assert_eq!(summary["used"]["0"], seen["devices"][0]["used"], "held at exit: {summary}\n{seen}");
    let allocs = text.lines().filter(|l| l.contains("\"op\":\"alloc\"")).count() as u64;
    let counted: u64 = seen["allocations"].as_array().unwrap().iter().map(|a| a["count"].as_u64().unwrap()).sum();
    assert_eq!((allocs, counted), (2, 2), "{seen}");
    let _ = std::fs::remove_dir_all(&sockdir);
}
