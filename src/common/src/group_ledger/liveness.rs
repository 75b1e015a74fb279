//! Is a group member still alive? Answered from `/proc`, by any observer: another member, or the
//! sidecar in another PID namespace (Kubernetes: members in pods, the sidecar with `hostPID`).
//!
//! A slot names its owner by (pid, start time, PID namespace inode). The pid only means something
//! in its own namespace, so:
//! - **Same namespace as the observer** (or unknown): `kill(pid, 0)` and `/proc/<pid>/stat` as
//!   before — gone, zombie or another start time (a reused pid) is dead.
//! - **Another namespace**: one scan of `/proc` finds the processes in the namespaces asked about
//!   and their pids there (the last `NSpid` field of `/proc/<p>/status`). Found with the same
//!   start time: alive. Not found, while the namespace has processes we can see: dead. A
//!   namespace with no process at all is dead only for an observer that sees every process
//!   (root in the initial PID namespace, i.e. a `hostPID` sidecar); anyone else cannot tell a
//!   vanished namespace from one it cannot see, and leaves the slot to the members.
//!
//! Every "cannot tell" is `Alive`: a charge is never reclaimed on a guess.

use super::shm::{Liveness, Member};
use std::collections::{HashMap, HashSet};

/// `PROC_PID_INIT_INO`: the kernel's fixed inode number of the initial PID namespace.
pub const INIT_PID_NS: u64 = 0xEFFF_FFFC;

/// Inode of the PID namespace `/proc/<who>/ns/pid` points at (`who` = "self" or a pid).
pub fn pid_ns(who: &str) -> Result<u64, std::io::Error> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{who}/ns/pid")).map(|m| m.ino())
}

/// Field 22 (`starttime`) of a `/proc/.../stat` text, and whether the process is a zombie.
/// The command name (field 2) may contain spaces and parentheses: fields are counted after the
/// last `)`.
pub fn parse_stat(s: &str) -> Option<(u64, bool)> {
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace(); // field 3 onwards
    let state = f.next()?;
    let start = f.nth(18)?.parse().ok()?; // field 22
    Some((start, state == "Z" || state == "X"))
}

/// Start time and zombie state of `/proc/<who>`. The start time is as the initial time namespace
/// has it: `/proc` shows it shifted by the reader's boot-time offset (Linux ≥ 5.6, time
/// namespaces), so a member inside a time namespace and an observer outside it would otherwise
/// never agree, and every observer would judge a live member dead (and reclaim its charge).
pub fn proc_start_of(who: &str) -> Option<(u64, bool)> {
    let (start, zombie) = parse_stat(&std::fs::read_to_string(format!("/proc/{who}/stat")).ok()?)?;
    Some((start.wrapping_sub(boottime_offset_ticks() as u64), zombie))
}

/// This process's boot-time offset in clock ticks (0 outside a time namespace, or before 5.6).
/// `/proc/self/timens_offsets` shows the offsets of the namespace the process's *children* get
/// (`/proc/self/ns/time_for_children`): after `unshare(CLONE_NEWTIME)` without exec that is a new
/// namespace the process itself is not in. Its offsets are then not ours: ours are those of the
/// namespace we were in, which is the initial one (offset 0) in every case but a process that
/// was already in a time namespace and made another — which has no way to learn its own.
fn boottime_offset_ticks() -> i64 {
    static TICKS: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        let link = |p: &str| std::fs::read_link(p).ok();
        if !offsets_are_ours(link("/proc/self/ns/time"), link("/proc/self/ns/time_for_children")) {
            return 0;
        }
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
        std::fs::read_to_string("/proc/self/timens_offsets").ok().as_deref().map_or(0, |t| parse_boottime_offset(t, hz))
    })
}

/// Whether `timens_offsets` describes our own namespace: our children's is ours. Without the
/// links (no time namespaces, before 5.6) the file is absent too.
pub fn offsets_are_ours(own: Option<std::path::PathBuf>, for_children: Option<std::path::PathBuf>) -> bool {
    match (own, for_children) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// The `boottime SECONDS NANOSECONDS` line of `/proc/self/timens_offsets`, in ticks of `hz`.
pub fn parse_boottime_offset(text: &str, hz: i64) -> i64 {
    let Some(line) = text.lines().find(|l| l.split_whitespace().next() == Some("boottime")) else { return 0 };
    let mut f = line.split_whitespace().skip(1).map(|v| v.parse::<i64>().unwrap_or(0));
    let (secs, nanos) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
    secs.saturating_mul(hz).saturating_add(nanos.saturating_mul(hz) / 1_000_000_000)
}

/// The pid in its own (innermost) namespace: the last field of `NSpid:` in `/proc/<p>/status`.
pub fn parse_nspid(status: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line["NSpid:".len()..].split_whitespace().last()?.parse().ok()
}

/// This process's identity as other members will check it: (start time, PID namespace inode).
/// Read through `/proc/self`, which is right even when `/proc` belongs to another namespace.
pub fn self_identity() -> (u64, u64) {
    (proc_start_of("self").map_or(0, |(s, _)| s), pid_ns("self").unwrap_or(0))
}

/// Whether `/proc` shows our own PID namespace (a pid namespace entered without remounting
/// `/proc` shows the parent's pids: then `/proc/<pid>` is somebody else).
fn proc_is_ours() -> bool {
    std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str()?.parse::<u32>().ok())
        .is_some_and(|p| p == std::process::id())
}

/// One member of our own namespace.
fn local(m: &Member, proc_ours: bool) -> Liveness {
    if unsafe { libc::kill(m.pid as i32, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return Liveness::Dead;
    }
    if !proc_ours {
        return Liveness::Alive;
    }
    // A pid we may not signal (another user) whose `/proc` entry we cannot read counts as alive.
    match proc_start_of(&m.pid.to_string()) {
        Some((_, true)) => Liveness::Dead,
        Some((s, false)) if m.start != 0 && s != m.start => Liveness::Dead,
        _ => Liveness::Alive,
    }
}

/// What one scan of `/proc` saw of the namespaces asked about.
struct Foreign {
    /// (namespace, pid there) → (start time, zombie)
    found: HashMap<(u64, u32), (u64, bool)>,
    /// Namespaces with at least one process we saw.
    seen: HashSet<u64>,
    /// We see every process: root (no `hidepid` hides anything from it) and nothing unreadable.
    complete: bool,
    /// And every namespace there is: the initial PID namespace.
    everything: bool,
}

fn scan(wanted: &HashSet<u64>, me_ns: u64) -> Foreign {
    let mut f = Foreign { found: HashMap::new(), seen: HashSet::new(), complete: unsafe { libc::geteuid() } == 0, everything: false };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        f.complete = false;
        return f;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(p) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        let ns = match pid_ns(p) {
            Ok(ns) => ns,
            // Exited during the scan: nothing to see.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)) => continue,
            // Unreadable (another user namespace's process): one NSpid entry puts it in the
            // namespace of our `/proc`, which is ours, so it is not one of the members asked about.
            Err(_) => {
                let status = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
                let depth = status.lines().find(|l| l.starts_with("NSpid:")).map(|l| l.split_whitespace().count() - 1);
                if depth != Some(1) {
                    f.complete = false;
                }
                continue;
            }
        };
        if !wanted.contains(&ns) {
            continue;
        }
        f.seen.insert(ns);
        let nspid = std::fs::read_to_string(format!("/proc/{p}/status")).ok().as_deref().and_then(parse_nspid);
        match (nspid, proc_start_of(p)) {
            (Some(nspid), Some(st)) => {
                f.found.insert((ns, nspid), st);
            }
            _ => f.complete = false, // vanished or unreadable between two reads: cannot tell
        }
    }
    f.everything = f.complete && me_ns == INIT_PID_NS;
    f
}

impl Foreign {
    fn judge(&self, m: &Member) -> Liveness {
        match self.found.get(&(m.pidns, m.pid)) {
            Some(&(_, true)) => Liveness::Dead,
            Some(&(s, false)) if m.start != 0 && s != m.start => Liveness::Dead,
            Some(_) => Liveness::Alive,
            // The namespace lives and we see all of it (it is below ours): the pid is gone.
            None if self.complete && self.seen.contains(&m.pidns) => Liveness::Dead,
            // No process is in that namespace, and we would see one if there were.
            None if self.everything => Liveness::Dead,
            None => Liveness::Alive,
        }
    }
}

/// The verdict on each member, in order (see the module comment). Scans `/proc` at most once,
/// and only when a member lives in another PID namespace.
pub fn liveness(members: &[Member]) -> Vec<Liveness> {
    let me_ns = pid_ns("self").unwrap_or(0);
    let ours = proc_is_ours();
    let foreign = |m: &Member| m.pidns != 0 && m.pidns != me_ns;
    let wanted: HashSet<u64> = members.iter().filter(|m| foreign(m)).map(|m| m.pidns).collect();
    // The scan starts after the slots were read (the caller's order): a member that claimed its
    // slot before we read it is in `/proc` for the scan, if it lives.
    let view = (!wanted.is_empty() && ours).then(|| scan(&wanted, me_ns));
    members
        .iter()
        .map(|m| {
            if m.pid == 0 || m.pid > i32::MAX as u32 {
                Liveness::Dead
            } else if !foreign(m) {
                local(m, ours)
            } else {
                view.as_ref().map_or(Liveness::Alive, |v| v.judge(m))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_odd_command_names() {
        let line = "1234 (a) b (c)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        assert_eq!(parse_stat(line), Some((987654, false)));
        let z = "7 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 42 20";
        assert_eq!(parse_stat(z), Some((42, true)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn the_boot_time_offset_is_read_in_ticks() {
        assert_eq!(parse_boottime_offset("monotonic 0 0\nboottime  100000 0\n", 100), 10_000_000);
        assert_eq!(parse_boottime_offset("monotonic 5 0\nboottime -2 500000000\n", 100), -150);
        assert_eq!(parse_boottime_offset("", 100), 0);
    }

    #[test]
    fn the_offsets_file_is_ours_only_when_our_children_share_our_namespace() {
        let p = |s: &str| Some(std::path::PathBuf::from(s));
        assert!(offsets_are_ours(p("time:[4026531834]"), p("time:[4026531834]")));
        assert!(!offsets_are_ours(p("time:[4026531834]"), p("time:[4026532611]")), "unshared for the children only");
        assert!(offsets_are_ours(None, None), "no time namespaces: nothing to tell apart");
    }

    #[test]
    fn nspid_is_the_innermost_pid() {
        assert_eq!(parse_nspid("Name:\tx\nNSpid:\t4242\t17\t1\nNSsid: 1\n"), Some(1));
        assert_eq!(parse_nspid("NSpid:\t99\n"), Some(99));
        assert_eq!(parse_nspid("Name: x\n"), None);
    }

    #[test]
    fn own_identity_is_alive_and_a_wrong_start_is_not() {
        let me = std::process::id();
        let (s, ns) = self_identity();
        assert!(s > 0 && ns > 0);
        let m = |pid, start, pidns| Member { pid, start, pidns };
        let v = liveness(&[m(me, s, ns), m(me, 0, ns), m(me, s + 1, ns), m(0, 0, ns), m(me, s, 0)]);
        assert_eq!(v, [Liveness::Alive, Liveness::Alive, Liveness::Dead, Liveness::Dead, Liveness::Alive]);
    }

    #[test]
    fn an_unknown_foreign_namespace_is_dead_only_to_an_all_seeing_observer() {
        // A namespace inode no process has.
        let m = Member { pid: 1, start: 1, pidns: 1 };
        let everything = pid_ns("self").unwrap() == INIT_PID_NS && unsafe { libc::geteuid() } == 0;
        if !everything {
            assert_eq!(liveness(&[m]), [Liveness::Alive]);
        } else {
            // Root in the initial namespace: dead, unless some process could not be read.
            let v = liveness(&[m]);
            eprintln!("root observer in the initial PID namespace: {v:?}");
            assert_eq!(v, [Liveness::Dead]);
        }
    }
}
