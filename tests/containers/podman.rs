//! Real containers for the tests: podman with runc, as root (docs/testing.md, "Containers").
//!
//! - One image per test binary, imported from a root filesystem built here: the C clients, their
//!   shared libraries, the fake driver and a few tools, never vramcap (CDI brings it).
//! - Each test writes its own CDI spec with `vramcap cdi` into a directory of its own. podman 4.3
//!   reads specs only from /etc/cdi and /var/run/cdi, so `podman run` is started in a private
//!   mount namespace whose /etc is an overlay with that directory at /etc/cdi (and an empty
//!   /var/run/cdi): the machine's own CDI directories are never written or read.
//! - Everything a test made (containers, pods, the image, directories) is removed when the test
//!   binary exits; what a killed earlier run left (its pid is gone) is removed at start.
//!
//! Without root, podman or runc the tests print SKIPPED and pass, unless
//! `VRAMCAP_CONTAINER_TESTS=run` (scripts/test sets it after installing them), which makes a
//! missing piece a failure.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use vramcap_tests::common::*;

/// podman's flags for these machines: crun fails on hybrid cgroups, the default ulimits are
/// above what the runtime may set here, and no network exists.
pub const RUN_FLAGS: [&str; 6] = ["--runtime", "runc", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"];

/// Where the test clients live in the image (their RUNPATH `$ORIGIN/../cuda-shim` finds the fake).
pub const CLIENTS: &str = "/opt/vramcap-test/ctests";

const OWNER_LABEL: &str = "vramcap-test-owner";

/// `Err(why)` when containers cannot run here.
fn ready() -> Result<(), String> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            if unsafe { libc::geteuid() } != 0 {
                return Err("needs root (rootful podman)".into());
            }
            for tool in ["podman", "runc", "unshare"] {
                let found = Command::new("sh").args(["-c", &format!("command -v {tool}")]).stdout(Stdio::null()).status();
                if !found.is_ok_and(|s| s.success()) {
                    return Err(format!("{tool} is not installed (scripts/test installs podman and runc on Debian)"));
                }
            }
            Ok(())
        })
        .clone()
}

/// True when the test may run; prints SKIPPED (or fails, when required) otherwise.
pub fn available() -> bool {
    let required = std::env::var("VRAMCAP_CONTAINER_TESTS").is_ok_and(|v| v == "run");
    match (ready(), required) {
        (Ok(()), _) => true,
        (Err(why), true) => panic!("VRAMCAP_CONTAINER_TESTS=run but containers cannot run: {why}"),
        (Err(why), false) => {
            eprintln!("SKIPPED: container tests: {why}");
            false
        }
    }
}

#[macro_export]
macro_rules! needs_podman {
    () => {
        if !$crate::podman::available() {
            return;
        }
    };
}

pub fn sh(script: &str) -> std::process::Output {
    Command::new("sh").args(["-c", script]).stdin(Stdio::null()).output().expect("sh")
}

fn pid_alive(pid: &str) -> bool {
    pid.parse::<i32>().is_ok_and(|p| p > 0 && unsafe { libc::kill(p, 0) } == 0)
}

/// This binary's scratch directory: every test's directory is below it.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = PathBuf::from(format!("/tmp/vramcap-containers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        unsafe { libc::atexit(cleanup_at_exit) };
        d
    })
}

/// A fresh directory for one test.
pub fn test_dir(name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = scratch().join(format!("{name}-{}", N.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&d).unwrap();
    d
}

extern "C" fn cleanup_at_exit() {
    remove_owned_by(&std::process::id().to_string());
    let _ = std::fs::remove_dir_all(scratch());
}

/// Containers, pods and the image of the run with this pid.
fn remove_owned_by(pid: &str) {
    let label = format!("label={OWNER_LABEL}={pid}");
    sh(&format!("podman ps -aq --filter {label} | xargs -r podman rm -f -t 0 >/dev/null 2>&1"));
    sh(&format!("podman pod ps -q --filter {label} | xargs -r podman pod rm -f >/dev/null 2>&1"));
    sh(&format!("podman rmi -f localhost/vramcap-test-rootfs:{pid} >/dev/null 2>&1"));
}

/// What earlier runs that were killed left behind.
fn sweep_dead_runs() {
    let listed = |cmd: &str| String::from_utf8_lossy(&sh(cmd).stdout).to_string();
    let mut pids: Vec<String> = listed(&format!("podman ps -a --format '{{{{index .Labels \"{OWNER_LABEL}\"}}}}' --filter label={OWNER_LABEL}"))
        .lines()
        .chain(listed("podman images --format '{{.Tag}}' localhost/vramcap-test-rootfs").lines())
        .map(str::to_string)
        .collect();
    pids.sort();
    pids.dedup();
    for pid in pids.iter().filter(|p| !p.is_empty() && !pid_alive(p)) {
        remove_owned_by(pid);
    }
}

/// `label=...` for everything a test creates.
pub fn owner_label() -> String {
    format!("{OWNER_LABEL}={}", std::process::id())
}

/// Copies `bin` and every library `ldd` names for it into `root` at the same paths.
fn copy_with_libs(bin: &Path, dest: &Path, root: &Path) {
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::copy(bin, dest).unwrap_or_else(|e| panic!("copy {}: {e}", bin.display()));
    let out = Command::new("ldd").arg(bin).output().expect("ldd");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line.split("=>").last().unwrap_or("").split_whitespace().next().unwrap_or("");
        if !path.starts_with('/') {
            continue;
        }
        let target = root.join(path.trim_start_matches('/'));
        if !target.exists() {
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::fs::copy(path, &target).unwrap_or_else(|e| panic!("copy {path}: {e}"));
        }
    }
}

/// The image: built and imported once per test binary.
pub fn image() -> &'static str {
    static IMAGE: OnceLock<String> = OnceLock::new();
    IMAGE.get_or_init(|| {
        build_c();
        sweep_dead_runs();
        let root = scratch().join("rootfs");
        for d in ["etc", "tmp", "proc", "sys", "dev", "run", "bin"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::set_permissions(root.join("tmp"), std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
        for c in ["client_linked", "client_dlsym", "client_procaddr", "client_nvml"] {
            copy_with_libs(&ctests_dir().join(c), &root.join(&CLIENTS[1..]).join(c), &root);
        }
        for lib in ["libcuda.so.1", "libnvidia-ml.so.1"] {
            copy_with_libs(&shim_dir().join(lib), &root.join("opt/vramcap-test/cuda-shim").join(lib), &root);
        }
        for tool in ["sh", "cat", "ls", "mv", "rm", "chmod", "mount", "umount", "env", "sleep", "mkdir", "grep", "id", "stat", "touch", "truncate", "ln", "rmdir", "unshare"] {
            let found = String::from_utf8_lossy(&sh(&format!("command -v {tool}")).stdout).trim().to_string();
            assert!(!found.is_empty(), "{tool} not found on the host");
            copy_with_libs(Path::new(&found), &root.join("bin").join(tool), &root);
        }
        assert!(sh(&format!("find {} -name 'libvramcap*' | grep -q .", root.display())).status.code() == Some(1), "vramcap must come from CDI, not the image");
        let name = format!("localhost/vramcap-test-rootfs:{}", std::process::id());
        let out = sh(&format!("tar -C {} -c . | podman import -q - {name}", root.display()));
        assert!(out.status.success(), "podman import: {}", String::from_utf8_lossy(&out.stderr));
        name
    })
}

/// One test's CDI setup: a spec written by `vramcap cdi` and the directories it names.
pub struct Cdi {
    pub dir: PathBuf,
    pub group_dir: PathBuf,
    pub trace_dir: PathBuf,
    pub state_dir: PathBuf,
}

impl Cdi {
    /// `vramcap cdi --device NAME=SPEC...` plus `extra` flags, into this test's own CDI directory.
    pub fn new(test: &str, devices: &[(&str, &str)], extra: &[&str]) -> Cdi {
        let dir = test_dir(test);
        let c = Cdi { group_dir: dir.join("groups"), trace_dir: dir.join("traces"), state_dir: dir.join("state"), dir };
        std::fs::create_dir_all(c.dir.join("cdi")).unwrap();
        let mut cmd = Command::new(vramcap_bin());
        cmd.arg("cdi").arg("--out").arg(c.dir.join("cdi/vramcap.yaml"));
        cmd.arg("--state-dir").arg(&c.state_dir).arg("--group-dir").arg(&c.group_dir).arg("--trace-dir").arg(&c.trace_dir);
        for (n, s) in devices {
            cmd.arg("--device").arg(format!("{n}={s}"));
        }
        cmd.args(extra);
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "vramcap cdi: {}", String::from_utf8_lossy(&out.stderr));
        c
    }

    /// `podman run` with this spec's devices in the private namespace (`args` go before the
    /// image, then `sh -c script`).
    pub fn command(&self, devices: &[&str], args: &[&str], script: &str) -> Command {
        self.command_on(devices, args, None, script)
    }

    /// [`Cdi::command`] on the image, or with `rootfs` (a plain directory: no overlay, where
    /// every directory can be renamed, as with podman's vfs or btrfs storage) as the root.
    pub fn command_on(&self, devices: &[&str], args: &[&str], rootfs: Option<&Path>, script: &str) -> Command {
        static N: AtomicU64 = AtomicU64::new(0);
        let ns = self.dir.join(format!("ns-{}", N.fetch_add(1, Ordering::Relaxed)));
        for d in ["up", "work", "empty"] {
            std::fs::create_dir_all(ns.join(d)).unwrap();
        }
        // /etc/cdi: this test's specs and nothing else; /var/run/cdi: empty.
        let wrapper = format!(
            "set -e\nmount -t overlay overlay -o lowerdir=/etc,upperdir={n}/up,workdir={n}/work /etc\nmkdir -p /etc/cdi\n\
             mount --bind {cdi} /etc/cdi\nif [ -d /run/cdi ]; then mount --bind {n}/empty /run/cdi; fi\nexec podman \"$@\"\n",
            n = ns.display(),
            cdi = self.dir.join("cdi").display()
        );
        let mut cmd = Command::new("unshare");
        cmd.args(["-m", "--propagation", "private", "sh", "-c", &wrapper, "sh", "run", "--network=none", "--label"]);
        cmd.arg(owner_label()).args(RUN_FLAGS);
        for d in devices {
            cmd.arg("--device").arg(format!("vramcap.io/gpu={d}"));
        }
        cmd.args(args);
        match rootfs {
            Some(r) => cmd.arg("--rootfs").arg(r),
            None => cmd.arg(image()),
        };
        cmd.args(["/bin/sh", "-c", script]);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd
    }

    /// Runs a container to its end (`--rm`) and returns what it printed.
    pub fn run(&self, devices: &[&str], args: &[&str], script: &str) -> Output {
        self.run_on(devices, args, None, script)
    }

    /// [`Cdi::run`] on the image or on a root directory ([`Cdi::command_on`]).
    pub fn run_on(&self, devices: &[&str], args: &[&str], rootfs: Option<&Path>, script: &str) -> Output {
        let mut all = vec!["--rm"];
        all.extend(args);
        let child = self.command_on(devices, &all, rootfs, script).spawn().expect("podman");
        Output::from(wait_with_timeout(child, Duration::from_secs(120)))
    }

    /// Starts a container (`--rm`, named `name`) and returns while it runs.
    pub fn spawn(&self, name: &str, devices: &[&str], args: &[&str], script: &str) -> Container {
        let cidfile = self.dir.join(format!("{name}.cid"));
        let cid = cidfile.to_string_lossy().into_owned();
        let mut all = vec!["--rm", "--name", name, "--cidfile", &cid];
        all.extend(args);
        let mut child = self.command(devices, &all, script).spawn().expect("podman");
        let lines = line_channel(child.stdout.take().unwrap());
        Container { name: name.to_string(), child, lines, cidfile }
    }
}

/// A running container's `podman run` and its output lines.
pub struct Container {
    pub name: String,
    cidfile: PathBuf,
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Container {
    /// The next line starting with `prefix` (earlier lines skipped).
    pub fn wait_for(&mut self, prefix: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!("container {}: no line starting with {prefix:?}", self.name),
            }
        }
    }

    /// The container's full id (podman writes it to the `--cidfile` when it creates the
    /// container, before it starts).
    pub fn id(&self) -> String {
        let id = std::fs::read_to_string(&self.cidfile).unwrap_or_default().trim().to_string();
        assert_eq!(id.len(), 64, "container {}: id {id:?} in {}", self.name, self.cidfile.display());
        id
    }

    /// `podman kill -s KILL`, then waits until podman has removed it (`--rm`).
    pub fn kill9(mut self) {
        let out = sh(&format!("podman kill -s KILL {}", self.name));
        assert!(out.status.success(), "podman kill: {}", String::from_utf8_lossy(&out.stderr));
        wait_bounded(&mut self.child, Duration::from_secs(60), "podman run after kill");
        for _ in 0..600 {
            if !sh(&format!("podman container exists {}", self.name)).status.success() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("container {} still exists 30 s after it was killed", self.name);
    }

    /// Waits for the container's end.
    pub fn finish(mut self) -> std::process::ExitStatus {
        wait_bounded(&mut self.child, Duration::from_secs(120), "podman run")
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            sh(&format!("podman rm -f -t 0 {} >/dev/null 2>&1", self.name));
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `podman run --rm` without any CDI device (a container set up by hand, as HAMi's device
/// plugin sets one up: mounts and variables).
pub fn run_plain(args: &[&str], script: &str) -> Output {
    let mut cmd = Command::new("podman");
    cmd.args(["run", "--rm", "--network=none", "--label"]).arg(owner_label()).args(RUN_FLAGS).args(args);
    cmd.arg(image()).args(["/bin/sh", "-c", script]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    Output::from(wait_with_timeout(cmd.spawn().expect("podman"), Duration::from_secs(120)))
}

/// A private copy of the image's root filesystem as a plain directory (for `--rootfs`).
pub fn rootfs_copy(dir: &Path) -> PathBuf {
    image();
    let to = dir.join("rootfs");
    let out = sh(&format!("cp -a {} {}", scratch().join("rootfs").display(), to.display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    to
}

/// A seccomp profile for podman that refuses to create user namespaces (docs/deploy.md, "What
/// root in the container can still do"): podman's default profile with `unshare` and `clone`
/// allowed only without `CLONE_NEWUSER`, and `clone3` (whose flags a filter cannot see) left to
/// the default answer, ENOSYS, so the C library falls back to `clone`.
pub fn seccomp_without_user_namespaces(dir: &Path) -> PathBuf {
    let base = "/usr/share/containers/seccomp.json";
    let text = std::fs::read_to_string(base).unwrap_or_else(|e| panic!("{base}: {e} (podman's default seccomp profile)"));
    let mut p: serde_json::Value = serde_json::from_str(&text).unwrap();
    let gated = ["unshare", "clone", "clone3"];
    for rule in p["syscalls"].as_array_mut().unwrap() {
        if let Some(names) = rule.get_mut("names").and_then(|n| n.as_array_mut()) {
            names.retain(|n| !gated.contains(&n.as_str().unwrap_or("")));
        }
    }
    const CLONE_NEWUSER: u64 = 0x1000_0000;
    for name in ["unshare", "clone"] {
        p["syscalls"].as_array_mut().unwrap().push(serde_json::json!({
            "names": [name], "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]
        }));
    }
    let out = dir.join("seccomp-no-userns.json");
    std::fs::write(&out, serde_json::to_string(&p).unwrap()).unwrap();
    out
}

/// A container name unique to this run.
pub fn name(what: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("vramcap-test-{}-{what}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// `client OPS` as a shell word list, for scripts.
pub fn client(which: &str, ops: &str) -> String {
    format!("{CLIENTS}/{which} {ops}")
}
