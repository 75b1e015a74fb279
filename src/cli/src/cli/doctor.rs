//! `vramcap doctor`: is this machine set up to cap and trace CUDA jobs? One line per check, OK
//! or FAIL with a fix (`--` for information); exit 1 if anything is broken.
//!
//! Everything that loads the driver runs in a child (`vramcap doctor --probe ...`, see probe.rs):
//! a driver that crashes or hangs cannot take the doctor with it, and the interception self-test
//! needs a process started under `LD_PRELOAD`.

use super::probe::{self, Probe};
use super::{clear_vramcap_env, group, limits, preload_library, size::human};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// Internal: run one probe in this process and print key=value lines.
    #[arg(long, hide = true, value_name = "driver|intercept")]
    pub probe: Option<String>,
}

/// The cap the self-test sets: small enough that "over the cap" is a tiny request on any GPU.
const TEST_CAP: u64 = 64 << 20;
const PROBE_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Default)]
struct Checks {
    failed: usize,
}

impl Checks {
    fn line(&mut self, state: &str, what: &str, msg: &str, fix: Option<&str>) {
        println!("  {state:<5} {what:<11} {msg}");
        if let Some(f) = fix {
            let label = if state == "FAIL" { "fix" } else { "hint" };
            println!("        {:<11} {label}: {f}", "");
        }
        if state == "FAIL" {
            self.failed += 1;
        }
    }
    fn ok(&mut self, what: &str, msg: &str) {
        self.line("OK", what, msg, None);
    }
    fn info(&mut self, what: &str, msg: &str, hint: Option<&str>) {
        self.line("--", what, msg, hint);
    }
    fn fail(&mut self, what: &str, msg: &str, fix: &str) {
        self.line("FAIL", what, msg, Some(fix));
    }
}

/// Runs `vramcap doctor --probe KIND` with a clean vramcap environment plus `env`.
pub(super) fn run_probe(kind: &str, preload: Option<&Path>, env: &[(&str, String)]) -> Result<Probe, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args(["doctor", "--probe", kind]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    clear_vramcap_env(&mut cmd);
    // The user's driver choice and the fake's settings still apply: they describe this machine.
    // vars_os: a variable that is not UTF-8 (anyone's) must not panic the doctor.
    for (k, v) in std::env::vars_os() {
        let b = k.as_encoded_bytes();
        if b == b"VRAMCAP_REAL_LIBCUDA" || b.starts_with(b"FAKECUDA_") {
            cmd.env(k, v);
        }
    }
    match preload {
        Some(l) => cmd.env("LD_PRELOAD", l),
        None => cmd.env_remove("LD_PRELOAD"),
    };
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot start the probe: {e}"))?;
    let deadline = Instant::now() + PROBE_TIMEOUT;
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("the probe did not finish in {}s (driver hung?)", PROBE_TIMEOUT.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let p = Probe::parse(&String::from_utf8_lossy(&out.stdout), &String::from_utf8_lossy(&out.stderr));
    if !out.status.success() && p.get("error").is_none() {
        return Err(format!(
            "the probe ended with {} ({})",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("no message")
        ));
    }
    Ok(p)
}

fn cuda_version(v: u64) -> String {
    format!("CUDA {}.{}", v / 1000, (v % 1000) / 10)
}

pub fn main(a: DoctorArgs) -> Result<(), String> {
    if let Some(kind) = a.probe {
        std::process::exit(probe::run(&kind));
    }
    let mut c = Checks::default();
    println!("vramcap doctor");

    // 1. The preload library.
    let lib = match preload_library() {
        Ok(l) => {
            c.ok("library", &l.display().to_string());
            Some(l)
        }
        Err(e) => {
            c.fail("library", &e, "cargo build --release, or scripts/install.sh --prefix PREFIX");
            None
        }
    };

    // 2. The driver, as the job would load it (no preload).
    let driver = run_probe("driver", None, &[]);
    let mut devices: Vec<limits::DeviceInfo> = Vec::new();
    let driver_ok = match &driver {
        Err(e) => {
            c.fail("driver", e, "check the NVIDIA driver (nvidia-smi), or try `vramcap demo` on the fake GPU");
            false
        }
        Ok(p) if p.get("error").is_some() => {
            let which = p.get("lib").unwrap_or("libcuda.so.1");
            let fix = if std::env::var_os("VRAMCAP_REAL_LIBCUDA").is_some() {
                "point VRAMCAP_REAL_LIBCUDA at the driver (e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1) or unset it".to_string()
            } else {
                "install the NVIDIA driver (libcuda.so.1 must be on the loader path: ldconfig -p | grep libcuda), \
                 or try `vramcap demo` on the fake GPU"
                    .to_string()
            };
            c.fail("driver", &format!("{which}: {}", p.get("error").unwrap_or("")), &fix);
            false
        }
        Ok(p) => {
            let path = p.get("path").unwrap_or("?");
            let real = std::fs::canonicalize(path).ok().filter(|r| r != Path::new(path));
            let ver = p.num("version").map(cuda_version).unwrap_or_else(|| "version unknown".into());
            let shown = match real {
                Some(r) => format!("{path} -> {} ({ver})", r.display()),
                None => format!("{path} ({ver})"),
            };
            match p.num("init") {
                Some(0) => {
                    c.ok("driver", &shown);
                    true
                }
                rc => {
                    c.fail(
                        "driver",
                        &format!("{shown}: cuInit failed ({})", probe::result_name(rc.unwrap_or(999))),
                        "check nvidia-smi, CUDA_VISIBLE_DEVICES and the container's GPU access (--gpus all)",
                    );
                    false
                }
            }
        }
    };

    // 3. Devices.
    if driver_ok {
        let p = driver.as_ref().unwrap();
        for d in &p.devices {
            devices.push(limits::DeviceInfo { total: d.total, uuid: d.uuid.clone() });
        }
        if devices.is_empty() {
            c.fail("devices", "the driver sees no device", "check CUDA_VISIBLE_DEVICES and nvidia-smi");
        }
        for d in &p.devices {
            c.ok("devices", &format!("GPU {} {}, {}, {}", d.index, d.name, human(d.total), d.uuid));
        }
    } else {
        c.info("devices", "not checked (no working driver)", None);
    }

    // 4. The limits this environment gives a job.
    check_limits(&mut c, &devices, driver_ok);

    // 5. Interception through the runtime's path.
    match (&lib, driver_ok) {
        (Some(l), true) => self_test(&mut c, l),
        _ => c.info("self-test", "not run (needs the library and a working driver)", None),
    }

    // 6. How jobs get the preload here, and the sidecar.
    check_preload(&mut c, lib.as_deref());
    check_sidecar(&mut c);

    if c.failed == 0 {
        println!("all good");
        Ok(())
    } else {
        println!("{} problem(s)", c.failed);
        std::process::exit(1);
    }
}

fn check_limits(c: &mut Checks, devices: &[limits::DeviceInfo], resolvable: bool) {
    let vars = match super::limit_vars_from_env() {
        Ok(v) => v,
        Err(e) => {
            let fix = format!("set {} in plain text (the expected form is above) or unset it", e.var);
            c.fail("limits", &format!("{e}. A job would fail to initialise CUDA with it"), &fix);
            return;
        }
    };
    check_mode(c, &vars);
    if let Some((_, v)) = vars.iter().find(|(k, _)| k == "VRAMCAP_DISABLE") {
        if matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on") {
            c.info("limits", "VRAMCAP_DISABLE is set: the library passes everything through uncapped", None);
        }
    }
    let (process, grp) = match group::from_vars(vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
        Ok(x) => x,
        Err(e) => {
            let fix = format!("correct {} (the expected form is above) or unset it", e.var);
            c.fail("limits", &format!("{e}. A job would fail to initialise CUDA with it"), &fix);
            return;
        }
    };
    let show = |spec: &limits::LimitSpec, label: &str, c: &mut Checks| {
        let vars: Vec<String> = spec.entries.iter().map(|e| e.var.clone()).collect();
        if !resolvable {
            c.ok("limits", &format!("{label}: {} (parsed; devices unknown)", vars.join(", ")));
            return;
        }
        match spec.resolve(devices) {
            Ok(b) => {
                let per: Vec<String> = b
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| format!("GPU {i} {}", if x == 0 { "no cap".into() } else { human(x) }))
                    .collect();
                c.ok("limits", &format!("{label}: {}", per.join(", ")));
            }
            Err(e) => c.fail("limits", &e.to_string(), "use a device this machine has (vramcap doctor lists them)"),
        }
    };
    if process.is_empty() && grp.is_none() {
        c.info("limits", "no cap set: jobs would run uncapped (trace only)", Some("set VRAMCAP_LIMIT=8GiB (or vramcap run --limit 8GiB)"));
    }
    if !process.is_empty() {
        show(&process, "per process", c);
    }
    if let Some(g) = grp {
        let name = g.name.clone().unwrap_or_else(|| "the container's default group (HAMi)".into());
        if g.limits.is_empty() {
            c.ok("limits", &format!("group {name}: adopts the limit its first member set"));
        } else {
            show(&g.limits, &format!("group {name}"), c);
        }
        let dir = PathBuf::from(&g.dir);
        let writable = std::ffi::CString::new(g.dir.clone())
            .map(|p| unsafe { libc::access(p.as_ptr(), libc::W_OK) } == 0)
            .unwrap_or(false);
        if dir.is_dir() && writable {
            c.ok("group dir", &g.dir);
        } else if !dir.exists() && g.dir == group::default_dir() {
            c.ok("group dir", &format!("{} (the per-user default, made by the first member)", g.dir));
        } else {
            c.fail("group dir", &format!("{} is not a writable directory", g.dir), "create it (shared by the group's processes) or set VRAMCAP_GROUP_DIR");
        }
        check_sharing(c, &g, devices, resolvable);
    }
}

/// Which mode a job started here runs in and why (issue 26): this environment merged with the
/// ceiling file as the library merges them.
fn check_mode(c: &mut Checks, vars: &[(String, String)]) {
    use vramcap_common::config::{CapMode, ModeOrigin, ceiling};
    let cfg = ceiling::from_env_vars(vars);
    if let Some(e) = cfg.error.as_ref().filter(|e| e.var == "VRAMCAP_MODE" || e.value.contains("VRAMCAP_MODE")) {
        let fix = "set VRAMCAP_MODE=enforce (the default) or VRAMCAP_MODE=observe, or unset it";
        return c.fail("mode", &format!("{e}. A job would fail to initialise CUDA with it"), fix);
    }
    if cfg.error.is_some() {
        return; // another input is invalid: reported by its own check
    }
    let group = if cfg.group.is_some() { "; a group observes only while every member observes (docs/configuration.md)" } else { "" };
    match (cfg.mode, cfg.mode_origin) {
        (CapMode::Observe, ModeOrigin::CeilingFile) => c.info(
            "mode",
            &format!("observe, by the VRAMCAP_MODE=observe line in {}: a machine-wide dry run, nothing is refused, what would be is traced as would_deny{group}", ceiling::PATH),
            None,
        ),
        (CapMode::Observe, _) => c.info(
            "mode",
            &format!("observe, by VRAMCAP_MODE=observe in this environment: nothing is refused, what would be is traced as would_deny{group}"),
            Some("to enforce, unset VRAMCAP_MODE (or set it to enforce)"),
        ),
        (_, ModeOrigin::RefusedByCeiling) => c.ok(
            "mode",
            &format!("enforce: {} refuses this environment's VRAMCAP_MODE=observe (only a VRAMCAP_MODE=observe line in it turns observe on)", ceiling::PATH),
        ),
        (_, ModeOrigin::Environment) => c.ok("mode", "enforce, by VRAMCAP_MODE=enforce in this environment: allocations that do not fit are refused"),
        _ => c.ok("mode", "enforce (the default): allocations that do not fit are refused"),
    }
}

/// The group's sharing settings (issue 17), shown as the limits are: what a member started in
/// this environment would ask its group for. A reserve or headroom that names a device this
/// machine lacks, or could never fit in the group's limit, is a FAIL: the job would be refused
/// at CUDA initialisation.
fn check_sharing(c: &mut Checks, g: &group::GroupConfig, devices: &[limits::DeviceInfo], resolvable: bool) {
    let what = "sharing";
    let policy = match g.policy {
        Some(p) => format!("policy {} (VRAMCAP_GROUP_POLICY; a running group keeps the policy its first member set)", p.name()),
        None => "policy: the group's (shared for a new group)".to_string(),
    };
    c.ok(what, &format!("{policy}, priority {}", g.priority));
    if g.priority != 0 && g.policy.is_some_and(|p| p != group::PolicyName::Priority) {
        c.info(what, "VRAMCAP_PRIORITY is set, but only the priority policy uses it", None);
    }
    let per = |b: &[u64]| b.iter().enumerate().map(|(i, &x)| format!("GPU {i} {}", human(x))).collect::<Vec<_>>().join(", ");
    // Resolved per device; `None`: unset, or the devices are unknown (shown as parsed only).
    let resolved = |spec: &limits::LimitSpec, label: &str, unset: &str, c: &mut Checks| -> Option<Vec<u64>> {
        if spec.is_empty() {
            c.ok(what, &format!("{label}: {unset}"));
            return None;
        }
        if !resolvable {
            let vars: Vec<String> = spec.entries.iter().map(|e| e.var.clone()).collect();
            c.ok(what, &format!("{label}: {} (parsed; devices unknown)", vars.join(", ")));
            return None;
        }
        match spec.resolve(devices) {
            Ok(b) => {
                c.ok(what, &format!("{label}: {}", per(&b)));
                Some(b)
            }
            Err(e) => {
                c.fail(what, &e.to_string(), "use a device this machine has (vramcap doctor lists them)");
                None
            }
        }
    };
    let reserve = resolved(&g.reserve, "reserve", "none (VRAMCAP_GROUP_RESERVE unset)", c);
    let headroom = resolved(&g.headroom, "headroom", "the group's (none for a new group)", c);
    let limit = if g.limits.is_empty() || !resolvable { None } else { g.limits.resolve(devices).ok() };
    let Some(limit) = limit else { return };
    for (d, &l) in limit.iter().enumerate().filter(|(_, l)| **l > 0) {
        let h = headroom.as_ref().map_or(0, |h| h[d]);
        if h >= l {
            c.fail(
                what,
                &format!("headroom {} on GPU {d} is the whole group limit {}: only a late starter could ever allocate", human(h), human(l)),
                "lower VRAMCAP_GROUP_HEADROOM below VRAMCAP_GROUP_LIMIT",
            );
            continue;
        }
        let r = reserve.as_ref().map_or(0, |r| r[d]);
        if r > l - h {
            c.fail(
                what,
                &format!(
                    "reserve {} on GPU {d} does not fit the group limit {} less the headroom {}: a job would be refused at CUDA initialisation",
                    human(r),
                    human(l),
                    human(h)
                ),
                "lower VRAMCAP_GROUP_RESERVE, or raise VRAMCAP_GROUP_LIMIT",
            );
        }
    }
}

fn self_test(c: &mut Checks, lib: &Path) {
    let what = "self-test";
    let p = match run_probe("intercept", Some(lib), &[("VRAMCAP_LIMIT", format!("{TEST_CAP}"))]) {
        Ok(p) => p,
        Err(e) => return c.fail(what, &format!("under LD_PRELOAD: {e}"), "run with VRAMCAP_LOG=debug to see why"),
    };
    if let Some(e) = p.get("error") {
        return c.fail(what, &format!("under LD_PRELOAD: {e}"), "run with VRAMCAP_LOG=debug to see why");
    }
    let from = p.get("alloc_from").unwrap_or("?");
    let ours = Path::new(from).canonicalize().ok().as_deref() == Some(lib) || from.ends_with(super::LIB_NAME);
    if !ours {
        return c.fail(
            what,
            &format!("cuGetProcAddress_v2(\"cuMemAlloc\") returned a function of {from}, not of vramcap"),
            "is another library preloaded before vramcap that wraps the driver? (LD_PRELOAD order)",
        );
    }
    let total = p.num("info_total").unwrap_or(0);
    let over = p.num("over_rc");
    let under = p.num("under_rc");
    if total != TEST_CAP || over != Some(2) || under != Some(0) {
        return c.fail(
            what,
            &format!(
                "cap not applied: with a {} test cap the device reported {} total, an over-cap allocation returned {}, a small one {}",
                human(TEST_CAP),
                human(total),
                probe::result_name(over.unwrap_or(999)),
                probe::result_name(under.unwrap_or(999))
            ),
            "run the probe with VRAMCAP_LOG=debug: vramcap doctor --probe intercept",
        );
    }
    c.ok(what, &format!("cuGetProcAddress_v2 gave vramcap's cuMemAlloc_v2; a {} test cap showed in cuMemGetInfo and refused an over-cap allocation", human(TEST_CAP)));
}

/// The entries of a preload list (LD_PRELOAD: spaces or colons; /etc/ld.so.preload: any white
/// space) that name vramcap's library.
fn vramcap_entries(list: &str) -> Vec<&str> {
    list.split([' ', ':', '\t', '\n'])
        .filter(|e| Path::new(e).file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libvramcap") && n.contains(".so")))
        .collect()
}

/// Why the loader would not load `entry` (a bare name, a missing or unreadable path).
fn why_not_loaded(entry: &str) -> String {
    if !entry.contains('/') {
        return format!(
            "{entry:?} is a bare name, which the loader looks up only in LD_LIBRARY_PATH, the ldconfig cache \
             (/etc/ld.so.cache) and /lib, /usr/lib (never the current directory), and it is not there"
        );
    }
    let p = Path::new(entry);
    if !p.exists() {
        format!("{entry} does not exist")
    } else if !super::reach::readable(p) {
        format!("{entry} is not readable by uid {}", unsafe { libc::getuid() })
    } else {
        format!("{entry} did not load (the loader's message, on stderr above, says why)")
    }
}

/// How jobs started from this environment get the preload: the environment's own LD_PRELOAD, or
/// /etc/ld.so.preload for every process. Not trusted from the text: a child started with exactly
/// this environment says whether the loader mapped the library.
fn check_preload(c: &mut Checks, lib: Option<&Path>) {
    let what = "preload";
    let preload = std::env::var_os("LD_PRELOAD").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    let system = std::fs::read_to_string("/etc/ld.so.preload").unwrap_or_default();
    let (env_entries, sys_entries) = (vramcap_entries(&preload), vramcap_entries(&system));
    let fix = match lib {
        Some(l) => format!("LD_PRELOAD={} (a path that resolves), or `vramcap run -- CMD`", l.display()),
        None => "LD_PRELOAD=/absolute/path/to/libvramcap.so, or `vramcap run -- CMD`".to_string(),
    };
    if env_entries.is_empty() && sys_entries.is_empty() {
        return c.info(what, "this environment does not preload vramcap", Some(&format!("use `vramcap run [--limit SPEC] -- CMD`, or {}", fix.split(" (").next().unwrap_or(&fix))));
    }
    let preload_os = std::env::var_os("LD_PRELOAD");
    let probe = run_probe("preloaded", preload_os.as_deref().map(Path::new).filter(|_| !env_entries.is_empty()), &[]);
    let mapped = match &probe {
        Ok(p) => p.get("mapped").map(str::to_string),
        Err(e) => return c.fail(what, &format!("cannot check that the loader loads it: {e}"), &fix),
    };
    match mapped {
        Some(m) if !env_entries.is_empty() => c.ok(what, &format!("LD_PRELOAD={preload} loads {m}")),
        Some(m) => c.ok(what, &format!("every process: /etc/ld.so.preload loads {m}")),
        None => {
            let (source, entries) = if env_entries.is_empty() { ("/etc/ld.so.preload", &sys_entries) } else { ("LD_PRELOAD", &env_entries) };
            let why: Vec<String> = entries.iter().map(|e| why_not_loaded(e)).collect();
            c.fail(what, &format!("{source} names vramcap but the loader does not load it: {}; jobs started here run uncapped", why.join("; ")), &fix);
        }
    }
}

fn check_sidecar(c: &mut Checks) {
    let Some(path) = std::env::var_os("VRAMCAP_SIDECAR").filter(|p| !p.is_empty()) else {
        return c.info("sidecar", "VRAMCAP_SIDECAR not set (optional: live events)", None);
    };
    let shown = path.to_string_lossy().into_owned();
    match std::os::unix::net::UnixStream::connect(&path) {
        Ok(_) => c.ok("sidecar", &format!("{shown} accepts connections")),
        Err(e) => c.fail(
            "sidecar",
            &format!("VRAMCAP_SIDECAR={shown}: cannot connect ({e})"),
            &format!("start it (vramcap sidecar --socket {shown}) or unset VRAMCAP_SIDECAR"),
        ),
    }
}
