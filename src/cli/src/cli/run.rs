//! `vramcap run [--limit SPEC] [--group NAME --group-limit SPEC] [--observe] [--trace PATH]
//! [--sidecar PATH] [--report] -- CMD ARGS...`: one command in front of the job instead of `LD_PRELOAD` and a
//! handful of variables set by hand.
//!
//! We stay the parent (rather than exec) so that `--report` can read the trace when the job ends;
//! so signals sent to us are forwarded, and we exit with the job's code (128 + signal if killed),
//! as a shell would report it.

use super::limits::{ConfigError, DeviceInfo, LimitSpec};
use super::{group, prepend_preload, preload_library, shell_code, traces};
use crate::analysis;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

#[derive(clap::Args)]
pub struct RunArgs {
    /// Per-process cap (VRAMCAP_LIMIT): 8GiB, 50%, 0=8GiB,1=4GiB, GPU-8932f937=8GiB.
    #[arg(long, value_name = "SPEC")]
    pub limit: Option<String>,
    /// Share one budget with every process of this group (VRAMCAP_GROUP).
    #[arg(long, value_name = "NAME")]
    pub group: Option<String>,
    /// The group's budget (VRAMCAP_GROUP_LIMIT), same grammar as --limit.
    #[arg(long, value_name = "SPEC")]
    pub group_limit: Option<String>,
    /// Observe mode (VRAMCAP_MODE=observe): grant what the caps would refuse and record it (the
    /// trace's `would_deny` events, the report's observe line); the job sees the physical GPU.
    /// Refused where a ceiling file does not allow it (the library says so and enforces).
    #[arg(long)]
    pub observe: bool,
    /// Write the allocation trace here (VRAMCAP_TRACE; %p pid, %t start, %e exe, %h host).
    #[arg(long, value_name = "PATH")]
    pub trace: Option<String>,
    /// Stream live events to the sidecar listening on this Unix socket (VRAMCAP_SIDECAR).
    #[arg(long, value_name = "PATH")]
    pub sidecar: Option<String>,
    /// When the command ends, print the report of its trace(s) on stderr (a temporary trace is
    /// used without --trace).
    #[arg(long)]
    pub report: bool,
    /// Run the job on the bundled fake GPU (one device of SIZE, simulated on host memory; the
    /// driver `vramcap demo` uses) instead of the real driver: try limits, traces, the sidecar
    /// and `top` on a machine without a GPU.
    #[arg(long, value_name = "SIZE")]
    pub fake_gpu: Option<String>,
    /// The command and its arguments (after `--`). Not `allow_hyphen_values`: a mistyped flag
    /// before `--` (`--limti 4g`) must be an error with clap's suggestion, not the command.
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

const USAGE: &str = "vramcap run [--limit SPEC] [--group NAME --group-limit SPEC] [--observe] [--trace PATH] \
                     [--sidecar PATH] [--report] [--fake-gpu SIZE] -- CMD ARGS...";

/// Bad usage: exit 2 with the message. Never returns.
fn usage_error(msg: String) -> ! {
    eprintln!("vramcap: {msg}");
    std::process::exit(2);
}

/// Which flag set a variable, for messages in the user's terms.
fn flag_of(var: &str, a: &RunArgs) -> String {
    let (flag, given) = match var {
        "VRAMCAP_LIMIT" => ("--limit", a.limit.is_some()),
        "VRAMCAP_GROUP" => ("--group", a.group.is_some()),
        "VRAMCAP_GROUP_LIMIT" => ("--group-limit", a.group_limit.is_some()),
        _ => ("", false),
    };
    if given { flag.to_string() } else { format!("{var} (from the environment)") }
}

/// The message for a bad value, quoting what the user typed: the whole flag value, and the list
/// item at fault when it is one item of it.
fn explain(e: &ConfigError, a: &RunArgs) -> String {
    if e.reason.contains("needs a group") {
        return format!("{} needs a group to apply to; expected --group NAME next to it", flag_of(&e.var, a));
    }
    let typed = match e.var.as_str() {
        "VRAMCAP_LIMIT" => a.limit.as_deref(),
        "VRAMCAP_GROUP" => a.group.as_deref(),
        "VRAMCAP_GROUP_LIMIT" => a.group_limit.as_deref(),
        _ => None,
    };
    match typed {
        Some(v) if v.trim() != e.value && !e.value.is_empty() => {
            format!("{} {v:?}: `{}`: {}; expected {}", flag_of(&e.var, a), e.value, e.reason, e.expected)
        }
        _ => format!("{} {:?}: {}; expected {}", flag_of(&e.var, a), e.value, e.reason, e.expected),
    }
}

/// A limit that names devices (`0=1g,7=2g`, `GPU-8932f937=8g`, `VRAMCAP_LIMIT_3`) is resolved
/// against the devices the job will see before the job starts: a device that does not exist
/// would otherwise fail the job's CUDA initialisation after it started (minutes into a
/// container's setup). The driver is asked in a child process, as `doctor` does, and only then:
/// a plain `8GiB` or `50%` fits any device and costs no probe. Without a working driver nothing
/// is decided here; the library still refuses a bad list at CUDA initialisation.
fn check_devices(specs: &[&LimitSpec], a: &RunArgs) -> Result<(), String> {
    if !specs.iter().any(|s| s.entries.iter().any(|e| e.key.is_some())) {
        return Ok(());
    }
    let Ok(p) = super::doctor::run_probe("driver", None, &[]) else { return Ok(()) };
    if p.get("error").is_some() || p.num("init") != Some(0) {
        return Ok(());
    }
    let devices: Vec<DeviceInfo> = p.devices.iter().map(|d| DeviceInfo { total: d.total, uuid: d.uuid.clone() }).collect();
    for s in specs {
        s.resolve(&devices).map_err(|e| explain(&e, a))?;
    }
    Ok(())
}

/// The variables to set, validated with the library's own parser against what the job will see
/// (ours override the environment's).
fn variables(a: &RunArgs, trace: Option<&str>, sidecar: Option<&str>) -> Result<Vec<(&'static str, String)>, String> {
    let mut set: Vec<(&'static str, String)> = Vec::new();
    let flags = [("VRAMCAP_LIMIT", &a.limit), ("VRAMCAP_GROUP", &a.group), ("VRAMCAP_GROUP_LIMIT", &a.group_limit)];
    for (var, v) in flags {
        if let Some(v) = v {
            if v.trim().is_empty() {
                let hint = if var == "VRAMCAP_GROUP" { "a group name".to_string() } else { super::limits::LIST_FORM.to_string() };
                return Err(format!("{} is empty; expected {hint}", flag_of(var, a)));
            }
            set.push((var, v.clone()));
        }
    }
    let mut all = super::limit_vars_from_env().map_err(|e| explain(&e, a))?;
    all.retain(|(k, _)| !set.iter().any(|(s, _)| k == s));
    all.extend(set.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let (process, grp) = group::from_vars(all.iter().map(|(k, v)| (k.as_str(), v.as_str()))).map_err(|e| explain(&e, a))?;
    let mut specs = vec![&process];
    specs.extend(grp.as_ref().map(|g| &g.limits));
    check_devices(&specs, a)?;
    if a.observe {
        set.push(("VRAMCAP_MODE", "observe".to_string()));
    }
    if let Some(t) = trace {
        set.push(("VRAMCAP_TRACE", t.to_string()));
        set.push(("VRAMCAP_JOB", job_id()?));
    }
    if let Some(s) = sidecar {
        set.push(("VRAMCAP_SIDECAR", s.to_string()));
    }
    Ok(set)
}

/// The job's id for its trace headers (`--report` finds the job's traces by it): the one in the
/// environment if there is one (a launcher's name for the job), else a fresh random one.
fn job_id() -> Result<String, String> {
    if let Some(v) = std::env::var_os("VRAMCAP_JOB") {
        let v = v.to_string_lossy();
        return vramcap_common::grammar::job::parse(&v)
            .map(str::to_string)
            .map_err(|why| format!("VRAMCAP_JOB={v:?} in the environment: {why}; expected {}", vramcap_common::grammar::job::FORM));
    }
    let mut b = [0u8; 16];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| format!("cannot read /dev/urandom for the job's id: {e}"))?;
    Ok(format!("run-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>()))
}

/// A new directory only this user can enter, under the temporary directory: a fixed name there
/// could be made first by another user (and then be theirs to read and fill).
fn private_dir() -> Result<PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt;
    let mut b = [0u8; 8];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
    let name = format!("vramcap-run-{}-{}", std::process::id(), b.iter().map(|x| format!("{x:02x}")).collect::<String>());
    let d = std::env::temp_dir().join(name);
    std::fs::DirBuilder::new().mode(0o700).create(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    Ok(d)
}

/// A relative path made absolute, so a job that changes directory still writes where we read.
fn absolute(p: &str) -> String {
    let path = Path::new(p);
    if path.is_absolute() || p.starts_with('@') {
        return p.to_string();
    }
    std::env::current_dir().map(|d| d.join(path).to_string_lossy().into_owned()).unwrap_or_else(|_| p.to_string())
}

static CHILD: AtomicI32 = AtomicI32::new(0);
static PENDING: AtomicU64 = AtomicU64::new(0);
const FORWARDED: [i32; 6] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2];

extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // A terminal's Ctrl-C / Ctrl-\ / hangup goes to the whole foreground process group, which the
    // job is in: it already has it. Forwarding would deliver it twice.
    if !info.is_null() && unsafe { (*info).si_code } == libc::SI_KERNEL {
        return;
    }
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        unsafe { libc::kill(pid, sig) };
    } else {
        PENDING.fetch_or(1 << sig, Ordering::SeqCst);
    }
}

fn install_forwarding() {
    for sig in FORWARDED {
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = forward as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// `--fake-gpu SIZE`: the bundled fake driver first on the loader path (and as the driver our
/// library opens, even where a real one is installed), with one device of SIZE.
fn fake_gpu(cmd: &mut Command, size: &str) -> Result<(), String> {
    use vramcap_common::grammar::size::{Size, parse_size};
    let bytes = match parse_size(size) {
        Ok(Size::Bytes(b)) => b,
        Ok(_) => return Err(format!("--fake-gpu {size:?}: expected the device's size in bytes, such as 16GiB (not 0 or a percentage)")),
        Err(e) => return Err(format!("--fake-gpu {size:?}: {e}; expected the device's size, such as 16GiB")),
    };
    let dir = super::demo::fake_driver_dir()?;
    let mut path = dir.clone().into_os_string();
    if let Some(p) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(p);
    }
    cmd.env("LD_LIBRARY_PATH", path)
        .env("VRAMCAP_REAL_LIBCUDA", dir.join("libcuda.so.1"))
        .env("FAKECUDA_DEVICE_COUNT", "1")
        .env("FAKECUDA_MEM", bytes.to_string());
    Ok(())
}

pub fn main(a: RunArgs) -> Result<(), String> {
    let Some((prog, args)) = a.command.split_first() else {
        usage_error(format!("no command given; expected {USAGE}"));
    };
    let lib = preload_library().unwrap_or_else(|e| usage_error(e));
    // The loader needs to read the library: without that every process would run uncapped.
    if !super::reach::readable(&lib) {
        usage_error(format!(
            "{} is not readable by uid {}: the loader could not preload it and the job would run uncapped; \
             expected a library this user can read (its directories searchable too)",
            lib.display(),
            unsafe { libc::getuid() }
        ));
    }
    // Where the job itself would not get it (it may still start processes that do): say so.
    if let Some(p) = super::reach::resolve(prog) {
        for w in super::reach::program_warnings(&p) {
            eprintln!("vramcap: warning: {w}");
        }
    }
    if let Some(t) = &a.trace {
        let dir = Path::new(t).parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if !dir.to_string_lossy().contains('%') && !dir.is_dir() {
            usage_error(format!("--trace {t:?}: directory {} does not exist; expected a path in an existing directory", dir.display()));
        }
    }
    // --report: a private directory for the list of trace files the job's processes wrote (and,
    // without --trace, for the trace itself), removed after the report.
    let private: Option<PathBuf> = a.report.then(|| private_dir().unwrap_or_else(|e| usage_error(e)));
    let tmp = private.as_ref().filter(|_| a.trace.is_none());
    let trace = match (&a.trace, tmp) {
        (Some(t), _) => Some(absolute(t)),
        (None, Some(d)) => Some(d.join("%e-%p.jsonl").to_string_lossy().into_owned()),
        _ => None,
    };
    let sidecar = a.sidecar.as_deref().map(absolute);
    let mut vars = variables(&a, trace.as_deref(), sidecar.as_deref()).unwrap_or_else(|e| usage_error(e));
    let list = private.as_ref().filter(|_| trace.is_some()).map(|d| d.join("traces"));
    if let Some(l) = &list {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(l)
            .unwrap_or_else(|e| usage_error(format!("cannot create {}: {e}", l.display())));
        vars.push(("VRAMCAP_TRACE_LIST", l.to_string_lossy().into_owned()));
    }

    let mut cmd = Command::new(prog);
    cmd.args(args);
    if let Some(size) = &a.fake_gpu {
        fake_gpu(&mut cmd, size).unwrap_or_else(|e| usage_error(e));
    }
    cmd.env("LD_PRELOAD", prepend_preload(&lib, std::env::var_os("LD_PRELOAD").as_deref()));
    for (k, v) in &vars {
        cmd.env(k, v);
    }
    install_forwarding();
    let started = std::time::SystemTime::now();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let (code, why) = match e.kind() {
                std::io::ErrorKind::NotFound => (127, "command not found".to_string()),
                std::io::ErrorKind::PermissionDenied => (126, "permission denied (not executable?)".to_string()),
                _ => (126, e.to_string()),
            };
            eprintln!("vramcap: cannot run {:?}: {why}", prog);
            std::process::exit(code);
        }
    };
    CHILD.store(child.id() as i32, Ordering::SeqCst);
    let pending = PENDING.swap(0, Ordering::SeqCst);
    for sig in FORWARDED {
        if pending & (1 << sig) != 0 {
            unsafe { libc::kill(child.id() as i32, sig) };
        }
    }
    let status = child.wait().map_err(|e| format!("waiting for the command: {e}"))?;
    if let Some(t) = trace.as_deref().filter(|_| a.report) {
        let job = vars.iter().find(|(k, _)| *k == "VRAMCAP_JOB").map(|(_, v)| v.as_str());
        print_report(t, list.as_deref(), started, tmp.is_some(), child.id(), job);
    }
    if let Some(d) = private {
        let _ = std::fs::remove_dir_all(d);
    }
    std::process::exit(shell_code(status));
}

/// The report goes to stderr: the job's stdout stays the job's.
/// Only this job's traces: written since it started, carrying its id or by its process tree.
fn print_report(template: &str, list: Option<&Path>, since: std::time::SystemTime, temporary: bool, root: u32, job: Option<&str>) {
    let listed = list.map(traces::listed).unwrap_or_default();
    let found = traces::find(template, since).map(|f| traces::of_tree(f, root, job, since));
    let files = match found.map(|f| traces::union(listed, f)) {
        Ok(f) if !f.is_empty() => f,
        Ok(_) => {
            eprintln!("vramcap: --report: no trace matching {template} was written (did the command use CUDA?)");
            return;
        }
        Err(e) => {
            eprintln!("vramcap: --report: {e}");
            return;
        }
    };
    match analysis::report::compute(&files) {
        Ok(r) => {
            let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            eprintln!("\n== vramcap report ({})", if temporary { "temporary trace; --trace PATH keeps it".into() } else { names.join(", ") });
            r.merged.warn_input();
            eprint!("{}", analysis::report::to_text(&r));
            eprintln!();
        }
        Err(e) => eprintln!("vramcap: --report: {e}"),
    }
}
