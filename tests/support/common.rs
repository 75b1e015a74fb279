//! Shared harness for the integration tests: builds the fake driver and the C clients once,
//! finds the built library and binary (refusing outputs older than their sources), and runs a
//! client under the preload with a clean, explicit environment.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

/// The repository's root (this package is `tests/`).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// `target/`: where this test binary was built (`target/<profile>/deps/<test>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// `target/release`: the outputs `cargo build --release` writes, which the tests drive.
pub fn release_dir() -> PathBuf {
    target_dir().join("release")
}

/// A unit-test module (`tests.rs`, `*_tests.rs`): compiled only into `cargo test`, so editing it
/// leaves the release outputs as they are, and `cargo build --release` rightly rebuilds nothing.
fn test_only(p: &Path) -> bool {
    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n == "tests.rs" || n.ends_with("_tests.rs"))
}

/// The newest modification time among `dirs` (recursively) and `files` under the root.
fn newest_source(dirs: &[&str], files: &[&str]) -> Option<(std::time::SystemTime, PathBuf)> {
    fn walk(p: &Path, best: &mut Option<(std::time::SystemTime, PathBuf)>) {
        let Ok(m) = std::fs::metadata(p) else { return };
        if m.is_dir() {
            for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
                walk(&e.path(), best);
            }
        } else if let Ok(t) = m.modified()
            && !test_only(p)
            && best.as_ref().is_none_or(|(b, _)| t > *b)
        {
            *best = Some((t, p.to_path_buf()));
        }
    }
    let mut best = None;
    for d in dirs.iter().chain(files) {
        walk(&root().join(d), &mut best);
    }
    best
}

/// A built output, checked to exist and to be newer than its sources: a test of an old build
/// would pass or fail for the wrong reason.
fn built(name: &str, sources: &[&str]) -> PathBuf {
    let p = release_dir().join(name);
    let Ok(built) = std::fs::metadata(&p).and_then(|m| m.modified()) else {
        panic!("{} is missing: run `cargo build --release` first (scripts/test does)", p.display());
    };
    if let Some((t, src)) = newest_source(sources, &["Cargo.toml", "Cargo.lock"])
        && t > built
    {
        panic!("{} is older than {}: run `cargo build --release` first (scripts/test does)", p.display(), src.display());
    }
    p
}

/// `target/release/libvramcap.so`, as `cargo build --release` built it.
pub fn preload_lib() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| built("libvramcap.so", &["src/preload", "src/common"])).clone()
}

/// `target/release/vramcap`, as `cargo build --release` built it.
pub fn vramcap_bin() -> &'static str {
    static BIN: OnceLock<String> = OnceLock::new();
    BIN.get_or_init(|| built("vramcap", &["src/cli", "src/common"]).to_string_lossy().into_owned())
}

pub fn shim_dir() -> PathBuf {
    root().join("target/cuda-shim")
}

pub fn ctests_dir() -> PathBuf {
    root().join("target/ctests")
}

/// Builds cuda-shim/ and tests/c/ once per test binary (make is idempotent across binaries).
pub fn build_c() {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        for dir in ["cuda-shim"] {
            if !root().join(dir).join("Makefile").exists() {
                continue;
            }
            let st = Command::new("make").arg("-s").arg("-C").arg(root().join(dir)).status().expect("make");
            assert!(st.success(), "make -C {dir} failed");
        }
    });
}

pub fn lookups(name: &str) -> PathBuf {
    let p = root().join("tests/data/lookups").join(name);
    assert!(p.exists(), "{} missing", p.display());
    p
}

/// One client run.
pub struct Run {
    cmd: Command,
    before: Vec<PathBuf>,
    after: Vec<PathBuf>,
    use_vramcap: bool,
    timeout: Duration,
    /// This run's private group directory, removed when `run` returns.
    auto_dir: PathBuf,
}

pub struct Output {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub lines: Vec<Line>,
}

#[derive(Debug, Clone)]
pub struct Line {
    pub op: String,
    pub fields: HashMap<String, String>,
}

impl Line {
    pub fn get(&self, k: &str) -> &str {
        self.fields.get(k).map(|s| s.as_str()).unwrap_or_else(|| panic!("no field {k} in {self:?}"))
    }
    pub fn num(&self, k: &str) -> u64 {
        let v = self.get(k);
        if let Some(h) = v.strip_prefix("0x") {
            u64::from_str_radix(h, 16).unwrap()
        } else {
            v.parse().unwrap_or_else(|_| panic!("{k}={v} is not a number"))
        }
    }
    pub fn rc(&self) -> i64 {
        self.get("rc").parse().unwrap()
    }
}

impl Run {
    pub fn client(name: &str) -> Run {
        build_c();
        let path = ctests_dir().join(name);
        assert!(path.exists(), "{} missing", path.display());
        Run::program(&path)
    }

    pub fn program(path: &Path) -> Run {
        let mut cmd = Command::new(path);
        // Nothing from the developer's shell leaks in: every test states its configuration.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().to_string();
            if k.starts_with("VRAMCAP_") || k.starts_with("CUDA_DEVICE_MEMORY_LIMIT") || k.starts_with("FAKECUDA_") || k == "LD_PRELOAD" {
                cmd.env_remove(&k);
            }
        }
        cmd.env("LD_LIBRARY_PATH", shim_dir());
        // Group ledgers (HAMi's variable makes one too) go to a directory of this run's own, so
        // parallel tests never share a budget unless they name a directory together.
        let auto_dir = private_group_dir();
        cmd.env("VRAMCAP_GROUP_DIR", &auto_dir);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        Run { cmd, before: Vec::new(), after: Vec::new(), use_vramcap: true, timeout: Duration::from_secs(120), auto_dir }
    }

    pub fn env(mut self, k: &str, v: impl AsRef<std::ffi::OsStr>) -> Run {
        self.cmd.env(k, v);
        self
    }

    pub fn env_remove(mut self, k: &str) -> Run {
        self.cmd.env_remove(k);
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<str>>(mut self, args: I) -> Run {
        for a in args {
            for w in a.as_ref().split_whitespace() {
                self.cmd.arg(w);
            }
        }
        self
    }

    /// Run without libvramcap.so (the bare driver).
    pub fn bare(mut self) -> Run {
        self.use_vramcap = false;
        self
    }

    /// Another preloaded library, before or after vramcap in `LD_PRELOAD`.
    pub fn also_preload(mut self, lib: PathBuf, before_vramcap: bool) -> Run {
        if before_vramcap { self.before.push(lib) } else { self.after.push(lib) }
        self
    }

    pub fn timeout(mut self, d: Duration) -> Run {
        self.timeout = d;
        self
    }

    pub fn run(mut self) -> Output {
        self.set_preload();
        let child = self.cmd.spawn().expect("spawn client");
        let out = wait_with_timeout(child, self.timeout);
        let _ = std::fs::remove_dir_all(&self.auto_dir);
        Output::from(out)
    }

    /// Starts the client and returns while it runs (its stdout is read line by line).
    pub fn spawn(mut self) -> Running {
        self.set_preload();
        let mut child = self.cmd.spawn().expect("spawn client");
        let lines = line_channel(child.stdout.take().unwrap());
        Running { child, lines }
    }

    fn set_preload(&mut self) {
        let mut libs: Vec<PathBuf> = self.before.clone();
        if self.use_vramcap {
            libs.push(preload_lib());
        }
        libs.extend(self.after.iter().cloned());
        if !libs.is_empty() {
            let s: Vec<String> = libs.iter().map(|p| p.display().to_string()).collect();
            self.cmd.env("LD_PRELOAD", s.join(":"));
        }
    }
}

/// Root, and the kernel lets us make PID namespaces (what [`in_pid_namespace`] needs).
pub fn can_unshare() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        (unsafe { libc::geteuid() }) == 0
            && Command::new("unshare")
                .args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"])
                .status()
                .is_ok_and(|s| s.success())
    })
}

/// A C client in a PID namespace of its own (pid 1 there), like a container's process (root
/// only). `own_proc`: with a `/proc` of that namespace too (`--mount-proc`: it cannot see its
/// pid as the host knows it), else it sees the host's `/proc`.
pub fn in_pid_namespace(client: &str, own_proc: bool, ops: &str) -> Run {
    build_c();
    let flags = if own_proc { "--pid --fork --mount-proc --kill-child" } else { "--pid --fork --kill-child" };
    Run::program(Path::new("unshare")).args([flags]).args([ctests_dir().join(client).to_str().unwrap(), ops])
}

/// The three ways a program reaches the driver, one C client each: linked against libcuda.so.1,
/// `dlopen`+`dlsym`, and `cuGetProcAddress_v2` on an `RTLD_LOCAL` handle (what the CUDA runtime
/// does). A rule of the cap holds only if it holds on all three.
pub const CLIENTS: [&str; 3] = ["client_linked", "client_dlsym", "client_procaddr"];

/// `client` running `ops` under `VRAMCAP_LIMIT=limit`, checked to have run to its end.
pub fn run_capped(client: &str, limit: &str, ops: &str) -> Output {
    let out = Run::client(client).env("VRAMCAP_LIMIT", limit).args([ops]).run();
    out.ok();
    out
}

/// A fresh directory under the system temp dir (removed by the OS's tmp cleaning, tiny).
pub fn private_group_dir() -> PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("vramcap-tests-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A client started with [`Run::spawn`].
pub struct Running {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Running {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next result line of `op` (earlier lines of other ops are skipped).
    pub fn wait_for(&mut self, op: &str) -> Line {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let l = self.lines.recv_timeout(left).unwrap_or_else(|_| panic!("no `{op}` line from the client"));
            let l = parse_line(&l);
            if l.op == op {
                return l;
            }
        }
    }

    pub fn sigkill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits for a normal exit.
    pub fn finish(mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }

    /// Waits for a successful exit and returns what the client wrote on stderr (keep it short:
    /// nobody reads the pipe while the client runs).
    pub fn child_stderr_after_finish(mut self) -> String {
        use std::io::Read;
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let st = wait_bounded(&mut self.child, Duration::from_secs(60), "client");
        assert!(st.success(), "client failed: {st:?}
{err}");
        err
    }
}

/// Waits up to `limit` for a spawned child; SIGKILLs it and fails the test on a hang.
pub fn wait_bounded(child: &mut std::process::Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?} (killed)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A child's stdout, line by line as it comes, read by a thread of its own.
pub fn line_channel(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for a child's output; SIGKILLs it after `timeout`.
pub fn wait_with_timeout(child: std::process::Child, timeout: Duration) -> std::process::Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if rx.recv_timeout(timeout).is_err() {
            unsafe { libc_kill(pid as i32, 9) };
        }
    });
    let out = child.wait_with_output().expect("wait");
    let _ = tx.send(());
    out
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

pub fn parse_line(l: &str) -> Line {
    let mut words = l.split_whitespace();
    let op = words.next().unwrap_or("").to_string();
    let fields = words.filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Line { op, fields }
}

impl From<std::process::Output> for Output {
    /// A finished client's result lines.
    fn from(out: std::process::Output) -> Output {
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let lines = stdout.lines().map(parse_line).collect();
        Output { status: out.status, stdout, stderr, lines }
    }
}

impl Output {
    pub fn ok(&self) -> &Self {
        assert!(self.status.success(), "client failed: {:?}\nstdout:\n{}\nstderr:\n{}", self.status, self.stdout, self.stderr);
        self
    }
    /// All result lines of one op, in order.
    pub fn of(&self, op: &str) -> Vec<&Line> {
        self.lines.iter().filter(|l| l.op == op).collect()
    }
    pub fn nth(&self, op: &str, n: usize) -> &Line {
        let v = self.of(op);
        assert!(n < v.len(), "only {} `{op}` lines in:\n{}\nstderr:\n{}", v.len(), self.stdout, self.stderr);
        v[n]
    }
}

/// The fake driver's device counters shared by processes (`FAKECUDA_SHARED_DEVICE`: {held, peak}
/// per device, u64): what one physical GPU would hold, whoever allocated it. Device 0's.
pub struct SharedDevice(*mut std::sync::atomic::AtomicU64);

impl SharedDevice {
    pub fn open(path: &Path) -> SharedDevice {
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).unwrap();
        // Growing only: the fake keeps its per-process table after the device counters.
        if f.metadata().unwrap().len() < 64 * 16 {
            f.set_len(64 * 16).unwrap();
        }
        use std::os::fd::AsRawFd;
        let p = unsafe { libc::mmap(std::ptr::null_mut(), 64 * 16, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0) };
        assert_ne!(p, libc::MAP_FAILED);
        SharedDevice(p.cast())
    }
    pub fn held(&self) -> u64 {
        unsafe { &*self.0 }.load(std::sync::atomic::Ordering::SeqCst)
    }
    pub fn peak(&self) -> &std::sync::atomic::AtomicU64 {
        unsafe { &*self.0.add(1) }
    }
}
