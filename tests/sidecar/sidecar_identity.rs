//! Which container and pod a client runs in, as the sidecar reads it from the client's cgroup
//! path: here with processes placed by hand into cgroups named the way the kubelet and the
//! container runtimes name them (the cgroupfs and systemd drivers), on this machine's cgroup
//! hierarchy (v1 `pids`, or the v2 root). Needs root (SKIPPED otherwise); the podman containers
//! of tests/containers/observe.rs are the real thing.

use vramcap_tests::common::*;
use vramcap_tests::sidecar_support::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const ID: &str = "4b1d0e3c2a9f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6b5a49382716051";
const UID: &str = "0c9a7b1e-2d3f-4a5b-8c6d-7e8f9a0b1c2d";

/// A cgroup hierarchy processes can be moved in: v1's `pids` controller, or the v2 root.
fn hierarchy() -> Option<PathBuf> {
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"].iter().map(PathBuf::from).find(|p| p.join("cgroup.procs").exists())
}

/// A client started in the cgroup `rel` below `base` (made for it), and the directories to remove.
fn client_in(base: &Path, rel: &str, socket: &Path, env: &[(&str, &str)]) -> (std::process::Child, Vec<PathBuf>) {
    build_c();
    let mut made = Vec::new();
    let mut p = base.to_path_buf();
    for part in rel.split('/') {
        p = p.join(part);
        if std::fs::create_dir(&p).is_ok() {
            made.push(p.clone());
        }
    }
    let script = format!("echo $$ > {}/cgroup.procs && exec \"$@\"", p.display());
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &script, "sh"]).arg(ctests_dir().join("client_procaddr")).args("init ctx 0 alloc 32m sleep 30000".split(' '));
    cmd.env("LD_LIBRARY_PATH", shim_dir()).env("LD_PRELOAD", preload_lib()).env("VRAMCAP_SIDECAR", socket);
    for (k, v) in env {
        cmd.env(k, v);
    }
    made.reverse();
    (cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap(), made)
}

fn remove(dirs: &[PathBuf]) {
    for d in dirs {
        for _ in 0..100 {
            if std::fs::remove_dir(d).is_ok() || !d.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn clients_in_kubernetes_cgroups_are_labelled_with_their_container_and_pod() {
    let Some(base) = hierarchy() else {
        eprintln!("SKIPPED: needs root and a cgroup hierarchy to place processes in");
        return;
    };
    let dir = tmpdir("ident");
    let sc = Sidecar::start(&dir.join("s.sock"), &[]);
    let systemd_uid = UID.replace('-', "_");
    let layouts = [
        format!("vramcap-test-{}/kubepods/burstable/pod{UID}/{ID}", std::process::id()),
        format!(
            "vramcap-test-{}.slice/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{systemd_uid}.slice/cri-containerd-{ID}.scope",
            std::process::id()
        ),
    ];
    for rel in &layouts {
        let env = [("POD_NAMESPACE", "ml"), ("POD_NAME", "train-0"), ("CONTAINER_NAME", "trainer")];
        let (mut child, made) = client_in(&base, rel, &sc.socket, &env);
        let pid = child.id().to_string();
        let labels = [("pid", pid.as_str()), ("device", "0"), ("container_id", ID), ("pod_uid", UID), ("pod", "train-0"), ("container", "trainer")];
        let mut found = None;
        wait_until(&format!("{rel} at the sidecar"), Duration::from_secs(20), || {
            found = value(&sc.samples(), "vramcap_memory_used_bytes", &labels);
            found.is_some()
        });
        assert_eq!(found, Some(32 * MIB), "{rel}");
        let top = Command::new(vramcap_bin()).args(["top", "--once", "--socket"]).arg(&sc.socket).output().unwrap();
        let top = String::from_utf8_lossy(&top.stdout);
        // The line under the row wraps at 80 columns: read it as one.
        let flat = top.lines().map(str::trim).collect::<Vec<_>>().join(" ");
        assert!(flat.contains(&format!("in container trainer ({}), pod ml/train-0 (uid {UID})", &ID[..12])), "{rel}: {top}");
        let _ = child.kill();
        let _ = child.wait();
        remove(&made);
    }
}
