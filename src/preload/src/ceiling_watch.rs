//! The machine's ceiling file, re-read while the process runs (issue 26): an edit of
//! `/etc/vramcap/limits` takes effect within about a second, off the allocation path.
//!
//! A thread of ours (`vramcap-ceiling`, started once the limits are resolved where a ceiling
//! file was in force at start, or in a group member, whose group's budget it watches too) looks at the file's identity every [`EVERY`] with one
//! `stat`; only when it changed is the file read, checked as at start (root's, writable only by
//! root) and merged with the environment the process started with. The new per-device limits are
//! published with one atomic store each; allocations re-read the limit after their
//! compare-and-swap (`ledger::reserve_local`), so none passes the lower of the old and new.
//!
//! A file that becomes invalid or untrusted keeps the last valid ceiling and says so once (until
//! a valid one comes back); a removed file keeps the last ceiling: removing it is not a way out.
//! Only the limits are live (`VRAMCAP_LIMIT*`, `VRAMCAP_GROUP_LIMIT*` as each member's bound);
//! the group, the driver and the trace are fixed at start. The thread calls no CUDA, blocks
//! every asynchronous signal and never keeps the process alive; a forked child keeps the limits it inherited.

use crate::config::{self, ceiling, limits::DeviceInfo, size::human};
use crate::ledger;
use std::sync::OnceLock;
use std::time::Duration;

/// How often the file's identity is looked at.
pub const EVERY: Duration = Duration::from_millis(250);

static DEVICES: OnceLock<Vec<DeviceInfo>> = OnceLock::new();

/// Starts the watcher once (the first resolver wins; racing ones find it started). `file`:
/// a ceiling file was in force at start (watch it); group members are watched for changes of
/// their group's budget either way (a `limit` event in the trace).
pub fn start(devices: &[DeviceInfo], file: bool) {
    if DEVICES.set(devices.to_vec()).is_err() {
        return;
    }
    let _ = std::thread::Builder::new().name("vramcap-ceiling".into()).stack_size(128 * 1024).spawn(move || watch(file));
}

fn watch(file: bool) {
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        // Not the synchronous ones: a ledger truncated under us raises SIGBUS on this thread's
        // read, which the ledger's guard handles (`group_ledger::guard`); blocked, it would kill.
        for sig in [libc::SIGBUS, libc::SIGSEGV, libc::SIGFPE, libc::SIGILL] {
            libc::sigdelset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    // The file as the configuration read it, not as it is when this thread first runs.
    let mut last = config::ceiling_identity_at_start().unwrap_or_else(|| config::file_identity(ceiling::PATH));
    let mut said: Option<String> = None;
    let mut group_seen = [u64::MAX; ledger::MAX_DEVICES];
    loop {
        for (d, old, new, uid) in crate::group::limit_changes(&mut group_seen) {
            let used = crate::group::view(d).map_or(0, |v| v.1);
            crate::events::limit_changed(crate::events::API_GROUP, d, old, new, uid, used);
        }
        std::thread::sleep(EVERY);
        if !file {
            continue;
        }
        let now = config::file_identity(ceiling::PATH);
        if now == last {
            continue;
        }
        last = now;
        match reread() {
            Ok(()) => said = None,
            Err(why) if said.as_deref() != Some(why.as_str()) => {
                crate::log::write_line(&format!("vramcap: {why}"));
                said = Some(why);
            }
            Err(_) => {}
        }
    }
}

/// Reads the file again and applies its limits; `Err` says why the last ceiling stays.
fn reread() -> Result<(), String> {
    let path = ceiling::PATH;
    let text = match ceiling::read_file(path) {
        Ok(Some(t)) => t,
        Ok(None) => return Err(format!("{path} was removed: keeping the last ceiling (removing the file does not lift it)")),
        Err(w) => return Err(format!("{w}: keeping the last valid ceiling")),
    };
    let c = ceiling::merge(Some((path, &text)), config::env_vars(), ceiling::secure_mode());
    let keep = |e: String| format!("{path} changed but {e}: keeping the last valid ceiling");
    if let Some(e) = &c.error {
        return Err(keep(e.to_string()));
    }
    let devices = DEVICES.get().map_or(&[][..], Vec::as_slice);
    let cl = c.ceiling.as_ref().ok_or_else(|| keep("it sets no ceiling".into()))?;
    let mut limits = c.limits.resolve(devices).map_err(|e| keep(e.to_string()))?;
    let file_limits = cl.limits.resolve(devices).map_err(|e| keep(e.to_string()))?;
    ceiling::cap(&mut limits, &file_limits);
    crate::observe::set_from_ceiling(&limits, &file_limits);
    let group = cl.group_limits.resolve(devices).map_err(|e| keep(e.to_string()))?;
    // The members' own group budget, bounded by the new ceiling (the newest setting wins, an
    // operator's `vramcap limit` stays).
    let mut member_group = match &c.group {
        Some(g) if !g.limits.is_empty() => Some(g.limits.resolve(devices).map_err(|e| keep(e.to_string()))?),
        _ => None,
    };
    if let Some(gl) = member_group.as_mut()
        && !cl.group_limits.is_empty()
    {
        ceiling::cap(gl, &group);
    }
    for (d, &new) in limits.iter().enumerate() {
        let old = ledger::limit(d).unwrap_or(0);
        if new != old {
            ledger::set_limit(d, new);
            changed(d, old, new, "limit");
        }
        if crate::group::active() {
            let before = crate::group::set_ceiling(d, group.get(d).copied().unwrap_or(0));
            let after = group.get(d).copied().unwrap_or(0);
            if before != after {
                changed(d, before, after, "the group's ceiling");
            }
        }
    }
    if let Some(gl) = member_group
        && crate::group::active()
    {
        crate::group::rewrite_limits(&gl);
    }
    Ok(())
}

/// A limit the ceiling file moved: one line, and the `limit` event (uid 0: the file is root's).
fn changed(dev: usize, old: u64, new: u64, what: &str) {
    let show = |b: u64| if b == 0 { "no limit".to_string() } else { human(b) };
    crate::log::write_line(&format!("vramcap: device {dev}: {what} {} -> {} ({} changed)", show(old), show(new), ceiling::PATH));
    crate::events::limit_changed(crate::events::API_CEILING, dev, old, new, 0, ledger::used(dev));
}
