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
