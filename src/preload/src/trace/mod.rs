//! `VRAMCAP_TRACE=PATH`: every intercepted call to a JSON Lines file (docs/trace-format.md).
//!
//! The allocating threads only append records to their own buffers ([`crate::events`]); one
//! writer thread per process formats and writes them. Lifecycle: the first event starts the writer; `exit()` from any thread
//! drains the queue and writes the summary (an `atexit` handler waits for the writer, bounded);
//! a program whose main thread ended with `pthread_exit` is ended by the writer once only our
//! threads are left ([`lifetime`]), as glibc would end it;
//! a forked child starts its own writer on its own file; `exec` starts fresh from the environment.
//! `VRAMCAP_SIDECAR=PATH` makes the same writer stream the lines to the node's sidecar
//! ([`sidecar`]); either consumer alone starts it.

mod announce;
mod create;
pub mod format;
mod lifetime;
pub mod sidecar;
mod writer;

use crate::config;
use crate::events;
use crate::ledger;
use format::{DeviceLine, DeviceSharing, Header, Summary};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

static ORIGIN_MONO_NS: AtomicU64 = AtomicU64::new(0);
static ORIGIN_UNIX_NS: AtomicU64 = AtomicU64::new(0);
/// Pid whose writer is running (0: none). A forked child sees its parent's pid here.
static WRITER_PID: AtomicI32 = AtomicI32::new(0);
/// Set in a forked child: without `%p` in the template it would write its parent's file.
static FORK_CHILD: AtomicBool = AtomicBool::new(false);

/// The entry points' names, by [`events::Api`] index: the hook table's, handed over by
/// [`configure`] (the event path itself never reads the table).
static API_NAMES: std::sync::OnceLock<fn(events::Api) -> &'static str> = std::sync::OnceLock::new();

/// The name of entry point `api` as the trace writes it.
pub fn api_name(api: events::Api) -> &'static str {
    API_NAMES.get().map_or("?", |f| f(api))
}

/// Turns event recording on if a trace file or a sidecar wants events; `names` gives each
/// entry point's exported name. Called by CUDA's initialisation (`intercept::init`), which every
/// counted call follows; idempotent.
pub fn configure(cfg: &config::Config, names: fn(events::Api) -> &'static str) {
    if (cfg.trace.is_none() && cfg.sidecar.is_none()) || cfg.disabled || cfg.error.is_some() {
        return;
    }
    static CONFIGURED: AtomicBool = AtomicBool::new(false);
    if CONFIGURED.swap(true, Ordering::AcqRel) {
        return;
    }
    let _ = API_NAMES.set(names);
    crate::clock::init();
    ORIGIN_MONO_NS.store(crate::log::monotonic_ns(), Ordering::Relaxed);
    ORIGIN_UNIX_NS.store(unix_ns(), Ordering::Relaxed);
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
    events::set_lossless(cfg.lossless);
    events::set_enabled(true);
}

fn unix_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

extern "C" fn after_fork_child() {
    FORK_CHILD.store(true, Ordering::Relaxed);
    WRITER_PID.store(0, Ordering::Relaxed);
    lifetime::reset_after_fork();
    sidecar::close_inherited_in_child();
    events::after_fork_child();
    crate::denials::after_fork_child();
    crate::observe::after_fork_child();
}

/// Starts this process's writer thread. False if no thread could be started.
pub fn spawn_writer() -> bool {
    let cfg = config::get();
    if cfg.trace.is_none() && cfg.sidecar.is_none() {
        return false;
    }
    let template = cfg.trace.clone();
    let socket = cfg.sidecar.clone();
    let pid = unsafe { libc::getpid() };
    WRITER_PID.store(pid, Ordering::Relaxed);
    static ATEXIT: AtomicBool = AtomicBool::new(false);
    if !ATEXIT.swap(true, Ordering::AcqRel) {
        unsafe { libc::atexit(at_exit) };
    }
    let file = template.map(|template| {
        let mut path = expand(&template);
        if FORK_CHILD.load(Ordering::Relaxed) && !template.contains("%p") {
            // Never write over the parent's file.
            path = format!("{path}.{pid}");
        }
        (template, path)
    });
    let spawned = std::thread::Builder::new()
        .name("vramcap-writer".into())
        .stack_size(256 * 1024)
        .spawn(move || writer_main(file, socket));
    spawned.is_ok()
}

fn writer_main(mut file: Option<(String, String)>, socket: Option<String>) {
    block_all_signals();
    let origin = ORIGIN_MONO_NS.load(Ordering::Relaxed);
    let mut fd = -1;
    if let Some((template, path)) = &mut file {
        // create.rs: exclusive creation, no foreign symlink followed, no foreign file emptied.
        match create::open_trace(path, unsafe { libc::getpid() }) {
            Ok(opened) => {
                if let Some(why) = &opened.moved {
                    crate::log::write_line(&format!("vramcap: trace {why}; this process writes {}", opened.path));
                }
                fd = opened.fd;
                *path = opened.path;
                if let Some(list) = &config::get().trace_list {
                    announce::announce(list, path);
                }
            }
            Err((failed, err)) => {
                let off = if socket.is_some() { "the trace file is off (the sidecar still gets events)" } else { "tracing is off" };
                crate::log::write_line(&format!(
                    "vramcap: cannot write the trace VRAMCAP_TRACE={template} ({failed}): {err}; {off}, the cap still applies"
                ));
            }
        }
    }
    let trace_path = file.as_ref().filter(|_| fd >= 0).map(|f| f.1.clone());
    let sidecar = socket.map(|s| sidecar::Sidecar::new(s, hello_line(), origin));
    let has_sidecar = sidecar.is_some();
    let mut w = writer::Writer::new(fd, file.map(|f| f.1).unwrap_or_default(), origin, sidecar);
    if fd < 0 && !has_sidecar {
        events::set_enabled(false);
        events::set_writer_live(false);
        w.discard();
        lifetime::writer_done();
        return;
    }
    if fd >= 0 {
        w.line(&header());
        w.flush();
    }
    // Stops at `exit()`, or when the program's own threads have all ended after its
    // main thread called pthread_exit (lifetime.rs): then nobody else will ever call exit().
    let last_check = std::cell::Cell::new(Instant::now());
    let orphaned = std::cell::Cell::new(false);
    w.run(|| {
        if lifetime::exiting() {
            return true;
        }
        if last_check.get().elapsed() >= lifetime::CHECK_EVERY {
            last_check.set(Instant::now());
            orphaned.set(lifetime::only_ours_left());
        }
        orphaned.get()
    });
    // The last drain is done: a lossless thread still allocating (or the program's exit handlers,
    // which run on this thread after a pthread_exit) must not wait for it.
    events::set_writer_live(false);
    // The summary counts what the I/O thread dropped only once it has seen every block.
    w.settle();
    let s = summary();
    w.summary(&s);
    w.close();
    // The exit line's count is read after the I/O thread ended: a block still queued when the
    // settle's deadline passed is in it too.
    let (events, dropped) = events::emitted_and_dropped();
    warn_dropped(events, dropped, trace_path.as_deref());
    lifetime::writer_done();
    if orphaned.get() && !lifetime::exiting() {
        lifetime::exit_as_last_thread();
    }
}

/// One stderr line at exit when events were lost, so nobody reads an incomplete trace unawares.
fn warn_dropped(events: u64, dropped: u64, path: Option<&str>) {
    if dropped == 0 || !crate::log::enabled(config::Level::Warn) {
        return;
    }
    let whose = path.map_or("the sidecar stream".to_string(), |p| format!("the trace {p}"));
    crate::log::write_line(&format!(
        "vramcap: {} of {} events did not reach {whose} (threads outran the writer, or the disk \
         refused them); the summary's peak and held-at-exit are exact, lists built from events are \
         incomplete; VRAMCAP_TRACE_MODE=lossless keeps every event (the job's threads then wait \
         for the writer)",
        dropped, events
    ));
}

fn block_all_signals() {
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// `exit()` from any thread: let the writer drain, write the summary and close (bounded wait,
/// so a stuck disk can delay exit by at most a few seconds, never hang it).
extern "C" fn at_exit() {
    if WRITER_PID.load(Ordering::Relaxed) != unsafe { libc::getpid() } {
        return;
    }
    lifetime::exit_and_wait(Instant::now() + Duration::from_secs(5));
}

/// A group member's sharing settings on device `d`: reserve, headroom, equal share, only
/// where its group caps `d` (beside `group_limit`, which is absent elsewhere).
pub(crate) fn sharing_on(v: Option<&crate::group::sharing::MemberView>, d: usize, capped: bool) -> DeviceSharing {
    match v.and_then(|v| v.on(d)).filter(|_| capped) {
        Some((reserve, headroom, share)) => DeviceSharing { group_reserve: Some(reserve), group_headroom: Some(headroom), group_share: share },
        None => DeviceSharing::default(),
    }
}

fn header() -> Header {
    let pid = unsafe { libc::getpid() };
    let member = crate::group::sharing::view();
    let devices = (0..ledger::device_count())
        .map(|i| {
            let group_limit = crate::group::view(i).map(|g| g.0);
            let sharing = sharing_on(member.as_ref(), i, group_limit.is_some());
            DeviceLine { index: i as i32, total: ledger::total(i), limit: ledger::limit(i), group_limit, sharing }
        })
        .collect();
    Header {
        kind: "header".into(),
        version: format::VERSION as u64,
        pid: pid as u64,
        ppid: unsafe { libc::getppid() } as u64,
        exe: exe_name(),
        cmdline: std::fs::read("/proc/self/cmdline")
            .map(|b| b.split(|&c| c == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect())
            .unwrap_or_default(),
        host: host_name(),
        start_unix_ns: ORIGIN_UNIX_NS.load(Ordering::Relaxed),
        devices,
        group: crate::group::name().map(str::to_string),
        group_policy: member.as_ref().map(|m| m.policy.to_string()),
        group_priority: member.as_ref().map(|m| m.priority),
        group_holds_headroom: member.as_ref().map(|m| m.holds_headroom),
        job: config::get().job.clone(),
        mode: crate::observe::active().then(|| "observe".to_string()),
    }
}

/// The header as the sidecar gets it: the trace header plus `protocol` and the pod's identity
/// (docs/sidecar-protocol.md); trace readers ignore the extra fields.
fn hello_line() -> Vec<u8> {
    let mut v = serde_json::to_value(header()).unwrap_or_default();
    if let Some(obj) = v.as_object_mut() {
        obj.insert("protocol".into(), sidecar::PROTOCOL.into());
        // The sidecar is shared by the node: the command line (which may carry secrets) goes
        // only when asked for, and redacted (docs/security.md).
        let cmdline = match obj.get("cmdline").and_then(|c| c.as_array()) {
            Some(args) if config::privacy::cmdline_wanted(std::env::var("VRAMCAP_SIDECAR_CMDLINE").ok().as_deref()) => {
                let args: Vec<String> = args.iter().filter_map(|a| a.as_str().map(str::to_string)).collect();
                config::privacy::redact(&args)
            }
            _ => Vec::new(),
        };
        obj.insert("cmdline".into(), cmdline.into());
        for (field, var) in [("namespace", "POD_NAMESPACE"), ("pod", "POD_NAME"), ("container", "CONTAINER_NAME")] {
            if let Some(val) = std::env::var(var).ok().filter(|s| !s.is_empty()) {
                obj.insert(field.into(), val.into());
            }
        }
    }
    let mut line = Vec::new();
    format::json_line(&mut line, &v);
    line
}

fn summary() -> Summary {
    let n = ledger::device_count().max(ledger::highest_used_device() + 1);
    let group = crate::group::name().map(|name| {
        let caps: Vec<(usize, (u64, u64))> = (0..n).filter_map(|d| Some((d, crate::group::view(d)?))).collect();
        let member = crate::group::sharing::view();
        let (mut reserve, mut headroom, mut share) = Default::default();
        for (d, _) in &caps {
            let s = sharing_on(member.as_ref(), *d, true);
            for (map, v) in [(&mut reserve, s.group_reserve), (&mut headroom, s.group_headroom), (&mut share, s.group_share)] {
                if let Some(v) = v {
                    std::collections::BTreeMap::insert(map, d.to_string(), v);
                }
            }
        }
        format::GroupSummary {
            name: name.to_string(),
            limit: caps.iter().map(|(d, (l, _))| (d.to_string(), *l)).collect(),
            used: caps.iter().map(|(d, (_, u))| (d.to_string(), *u)).collect(),
            policy: member.as_ref().map(|m| m.policy.to_string()),
            priority: member.as_ref().map(|m| m.priority),
            holds_headroom: member.as_ref().map(|m| m.holds_headroom),
            reserve,
            headroom,
            share,
        }
    });
    let (events, dropped) = events::emitted_and_dropped();
    Summary {
        kind: "summary".into(),
        t_ns: Some(crate::log::monotonic_ns().saturating_sub(ORIGIN_MONO_NS.load(Ordering::Relaxed))),
        events,
        dropped,
        peak: (0..n).map(|d| (d.to_string(), ledger::peak(d))).collect(),
        used: (0..n).map(|d| (d.to_string(), ledger::used(d))).collect(),
        denied: Some((0..n).map(|d| (d.to_string(), crate::denials::count(d))).collect()),
        would_deny: crate::observe::summarised().then(|| (0..n).map(|d| (d.to_string(), crate::observe::count(d))).collect()),
        group,
    }
}

pub fn exe_name() -> String {
    std::fs::read_link("/proc/self/exe")
        .ok()
        .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "unknown".into())
}

pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Process start time in Unix seconds (from /proc: boot time + start ticks).
pub fn process_start_unix_secs() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Field 22 (starttime) counts from after the parenthesised command name.
    let ticks: u64 = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(19)?.parse().ok()).unwrap_or(0);
    let btime: u64 = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok()))
        .unwrap_or(0);
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    btime + ticks / hz
}

/// `%p` pid, `%t` process start (Unix seconds), `%e` executable name, `%h` host name, `%%` a `%`.
pub fn expand(template: &str) -> String {
    let mut out = String::with_capacity(template.len() + 16);
    let mut chars = template.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('p') => out.push_str(&unsafe { libc::getpid() }.to_string()),
            Some('t') => out.push_str(&process_start_unix_secs().to_string()),
            Some('e') => out.push_str(&exe_name()),
            Some('h') => out.push_str(&host_name()),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders() {
        let pid = std::process::id().to_string();
        assert_eq!(expand("/tmp/t-%p.jsonl"), format!("/tmp/t-{pid}.jsonl"));
        assert_eq!(expand("a%%b%q%"), "a%b%q%");
        assert_eq!(expand("%h"), host_name());
        let t: u64 = expand("%t").parse().unwrap();
        let now = unix_ns() / 1_000_000_000;
        assert!(t <= now && t + 3600 > now, "start {t} vs now {now}");
        assert!(!expand("%e").is_empty());
    }
}
