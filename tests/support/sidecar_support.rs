//! The sidecar harness of tests/sidecar/sidecar.rs (a running `vramcap sidecar`, its metrics parsed, raw
//! and preloaded clients), shared with tests/sidecar/sidecar_hostile.rs.

use super::common::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn tmpdir(name: &str) -> PathBuf {
    // Short: a Unix socket path must stay under 108 bytes.
    let d = PathBuf::from(format!("/tmp/vcs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub struct Sidecar {
    pub child: Child,
    pub metrics: String,
    pub socket: PathBuf,
    pub stderr: Arc<Mutex<String>>,
}

impl Sidecar {
    pub fn start(socket: &Path, extra: &[&str]) -> Sidecar {
        let mut child = Command::new(vramcap_bin())
            .arg("sidecar")
            .arg("--socket")
            .arg(socket)
            .args(["--metrics", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the sidecar");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let err = child.stderr.take().unwrap();
        let log = stderr.clone();
        // Drained for the sidecar's whole life, so its logging can never block it.
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("metrics on http://").nth(1) {
                    let _ = tx.send(rest.trim_end_matches("/metrics").to_string());
                }
                log.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let metrics = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| panic!("sidecar did not start: {}", stderr.lock().unwrap()));
        Sidecar { child, metrics, socket: socket.to_path_buf(), stderr }
    }

    pub fn text(&self) -> String {
        let mut s = std::net::TcpStream::connect(&self.metrics).expect("connect to /metrics");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        resp.split_once("\r\n\r\n").unwrap().1.to_string()
    }

    pub fn samples(&self) -> Vec<Sample> {
        parse(&self.text())
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: u64,
}

/// Prometheus text format, as far as this sidecar writes it (no escapes inside test labels).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once("=\"").unwrap();
                    (k.to_string(), v.trim_end_matches('"').to_string())
                })
                .collect();
            Sample { name: name.to_string(), labels, value: value.parse().unwrap_or_else(|_| panic!("{l}")) }
        })
        .collect()
}

/// The value of `name` whose labels include all of `want` (None if no such series).
pub fn value(s: &[Sample], name: &str, want: &[(&str, &str)]) -> Option<u64> {
    let hits: Vec<&Sample> =
        s.iter().filter(|x| x.name == name && want.iter().all(|(k, v)| x.labels.get(*k).map(|s| s.as_str()) == Some(*v))).collect();
    assert!(hits.len() <= 1, "several series match {name} {want:?}: {hits:?}");
    hits.first().map(|x| x.value)
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A long-running preloaded client whose stdout lines are collected as they come.
pub struct Client {
    pub child: Child,
    pub out: Arc<Mutex<Vec<String>>>,
}

/// Copies of what a process of another uid runs (the C clients, the fake driver, the preload
/// library, the CLI) in a directory every user can reach: a checkout under a private directory
/// (`mktemp -d` makes 0700 ones, CI's clone may be one) cannot be reached by another user, and
/// a test that runs as one would fail there for that reason alone.
pub struct Reachable {
    pub ctests: PathBuf,
    pub shim: PathBuf,
    pub lib: PathBuf,
    pub vramcap: PathBuf,
}

pub fn reachable() -> &'static Reachable {
    static R: std::sync::OnceLock<Reachable> = std::sync::OnceLock::new();
    R.get_or_init(|| {
        use std::os::unix::fs::PermissionsExt;
        build_c();
        // Earlier runs' copies (their test process is gone) go first: ~30 MB each.
        for e in std::fs::read_dir("/tmp").into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(pid) = name.strip_prefix("vcs-bin-")
                && !Path::new(&format!("/proc/{pid}")).exists()
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let top = PathBuf::from(format!("/tmp/vcs-bin-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&top);
        let r = Reachable { ctests: top.join("ctests"), shim: top.join("shim"), lib: top.join("libvramcap.so"), vramcap: top.join("vramcap") };
        for d in [&top, &r.ctests, &r.shim] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // Copied by another process, not by this one: a file this test process held open for
        // writing would be inherited by any child another test thread forks meanwhile, and until
        // that child execs, running the copy fails with ETXTBSY ("text file busy").
        let copy = |from: &Path, to: &Path| {
            let st = std::process::Command::new("install").arg("-m").arg("0755").arg(from).arg(to).status();
            assert!(st.as_ref().is_ok_and(|s| s.success()), "install {} {}: {st:?}", from.display(), to.display());
        };
        for e in std::fs::read_dir(ctests_dir()).unwrap().chain(std::fs::read_dir(shim_dir()).unwrap()) {
            let p = e.unwrap().path();
            let to = if p.starts_with(shim_dir()) { &r.shim } else { &r.ctests };
            if p.is_file() {
                copy(&p, &to.join(p.file_name().unwrap()));
            }
        }
        copy(&preload_lib(), &r.lib);
        copy(Path::new(vramcap_bin()), &r.vramcap);
        r
    })
}

impl Client {
    pub fn spawn(name: &str, socket: &Path, env: &[(&str, &str)], ops: &str) -> Client {
        Client::spawn_as(name, socket, env, ops, None)
    }

    /// As another user: `Some((uid, gid))` (the test must run as root).
    pub fn spawn_as(name: &str, socket: &Path, env: &[(&str, &str)], ops: &str, user: Option<(u32, u32)>) -> Client {
        use std::os::unix::process::CommandExt;
        build_c();
        let (ctests, shim, lib) = match user {
            Some(_) => (reachable().ctests.clone(), reachable().shim.clone(), reachable().lib.clone()),
            None => (ctests_dir(), shim_dir(), preload_lib()),
        };
        let mut cmd = Command::new(ctests.join(name));
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().to_string();
            if k.starts_with("VRAMCAP_") || k.starts_with("FAKECUDA_") || k.starts_with("CUDA_DEVICE_MEMORY_LIMIT") || k.starts_with("POD_") || k == "CONTAINER_NAME" {
                cmd.env_remove(&k);
            }
        }
        cmd.env("LD_LIBRARY_PATH", shim).env("LD_PRELOAD", lib).env("VRAMCAP_SIDECAR", socket);
        for (k, v) in env {
            cmd.env(k, v);
        }
        if let Some((uid, gid)) = user {
            cmd.uid(uid).gid(gid);
        }
        let mut child = cmd.args(ops.split_whitespace()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().unwrap();
        let o = out.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                o.lock().unwrap().push(l);
            }
        });
        Client { child, out }
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    pub fn lines(&self) -> Vec<String> {
        self.out.lock().unwrap().clone()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn header_line(pid: u32) -> String {
    format!(
        "{{\"type\":\"header\",\"version\":1,\"protocol\":1,\"pid\":{pid},\"ppid\":1,\"exe\":\"raw\",\"cmdline\":[],\"host\":\"h\",\
         \"start_unix_ns\":1,\"devices\":[{{\"index\":0,\"total\":100,\"limit\":null}}],\"group\":null}}\n"
    )
}

