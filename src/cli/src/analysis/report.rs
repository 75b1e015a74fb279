//! `vramcap report`: per process and device, peak and when, counts, leaks, denials and failures
//! with the usage at that moment, size and lifetime distributions, time in the driver.

use super::merge::{Align, Merged};
use super::stats::{Combined, DevStats, LIFETIME_BOUNDS, ProcStats};
use super::printable;
use super::trace::Names;
use vramcap_common::grammar::size::human;
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::path::PathBuf;

pub struct Report {
    pub merged: Merged,
    pub procs: Vec<ProcStats>,
    pub combined: Vec<Combined>,
    pub events: u64,
}

pub fn compute(paths: &[PathBuf]) -> Result<Report, String> {
    let mut merged = Merged::open_usable(paths, Align::WallClock)?;
    let mut procs: Vec<ProcStats> = merged.readers.iter().map(|_| ProcStats::new()).collect();
    let multi = procs.len() > 1;
    let mut combined: Vec<Combined> = Vec::new();
    let mut events = 0u64;
    while let Some((i, e, t)) = merged.next() {
        events += 1;
        let Some(d) = procs[i].dev(e.dev) else { continue };
        d.apply(&e);
        if multi {
            let used = d.used;
            let c = match combined.iter().position(|c| c.index == e.dev) {
                Some(k) => &mut combined[k],
                None => {
                    combined.push(Combined { index: e.dev, ..Default::default() });
                    combined.last_mut().unwrap()
                }
            };
            c.set(i, used, t);
        }
    }
    merged.finish_progress();
    combined.sort_by_key(|c| c.index);
    Ok(Report { merged, procs, combined, events })
}

fn limit_of(r: &Report, proc_idx: usize, dev: i32) -> (Option<u64>, Option<u64>) {
    let h = &r.merged.readers[proc_idx].header;
    h.devices.iter().find(|d| d.index == dev).map(|d| (d.limit, Some(d.total))).unwrap_or((None, None))
}

/// The group's budget on `dev` for a group member (header, else its summary).
fn group_limit_of(r: &Report, proc_idx: usize, dev: i32) -> Option<u64> {
    let rd = &r.merged.readers[proc_idx];
    rd.header.devices.iter().find(|d| d.index == dev).and_then(|d| d.group_limit).or_else(|| {
        rd.summary.as_ref()?.group.as_ref()?.limit.get(&dev.to_string()).copied()
    })
}

/// A group member's sharing settings (issue 17): member-wide from the header (else the summary),
/// per device from the header at start and the summary at exit.
#[derive(Default)]
struct Sharing {
    policy: Option<String>,
    priority: Option<i64>,
    holds_headroom: Option<bool>,
    reserve: Option<u64>,
    headroom: Option<u64>,
    share: Option<u64>,
    share_at_exit: Option<u64>,
}

fn sharing_of(r: &Report, proc_idx: usize, dev: i32) -> Sharing {
    let rd = &r.merged.readers[proc_idx];
    let (h, g) = (&rd.header, rd.summary.as_ref().and_then(|s| s.group.as_ref()));
    let d = h.devices.iter().find(|d| d.index == dev);
    let at_exit = |m: Option<&std::collections::BTreeMap<String, u64>>| m.and_then(|m| m.get(&dev.to_string()).copied());
    Sharing {
        policy: h.group_policy.clone().or_else(|| g?.policy.clone()).map(|p| vramcap_common::grammar::group::PolicyName::shown(&p).to_string()),
        priority: h.group_priority.or_else(|| g?.priority),
        holds_headroom: h.group_holds_headroom.or_else(|| g?.holds_headroom),
        reserve: d.and_then(|d| d.sharing.group_reserve).or_else(|| at_exit(g.map(|g| &g.reserve))),
        headroom: d.and_then(|d| d.sharing.group_headroom).or_else(|| at_exit(g.map(|g| &g.headroom))),
        share: d.and_then(|d| d.sharing.group_share),
        share_at_exit: at_exit(g.map(|g| &g.share)),
    }
}

/// `policy equal, priority 0, share 150.0 MiB at start / 100.0 MiB at exit, reserve …, headroom …`.
fn sharing_text(s: &Sharing) -> Option<String> {
    let mut parts = Vec::new();
    if let Some(p) = &s.policy {
        parts.push(format!("policy {p}"));
    }
    if let Some(p) = s.priority {
        parts.push(format!("priority {p}"));
    }
    match (s.share, s.share_at_exit) {
        (Some(a), Some(b)) if a != b => parts.push(format!("share {} at start, {} at exit", human(a), human(b))),
        (Some(a), _) | (None, Some(a)) => parts.push(format!("share {}", human(a))),
        (None, None) => {}
    }
    if let Some(v) = s.reserve {
        parts.push(format!("reserve {}", human(v)));
    }
    if let Some(v) = s.headroom {
        let held = if s.holds_headroom == Some(true) && v > 0 { " (this process could use it)" } else { "" };
        parts.push(format!("headroom {}{held}", human(v)));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// The trace's word on what was held at exit (`None`: no summary) and how many events it lost.
fn exit_truth(r: &Report, proc_idx: usize, dev: i32) -> (Option<u64>, u64) {
    let s = r.merged.readers[proc_idx].summary.as_ref();
    (s.and_then(|s| s.used_at_exit(dev)), s.map_or(0, |s| s.dropped))
}

fn hist_json(d: &DevStats) -> (Value, Value) {
    let sizes: Vec<Value> = (0..64)
        .filter(|&b| d.size_hist[b] > 0)
        .map(|b| json!({"min": 1u64 << b, "count": d.size_hist[b]}))
        .collect();
    let lives: Vec<Value> = d
        .life_hist
        .iter()
        .enumerate()
        .map(|(k, n)| json!({"under_ns": LIFETIME_BOUNDS.get(k).map(|b| b.0), "count": n}))
        .collect();
    (Value::Array(sizes), Value::Array(lives))
}

/// The observe-mode line (issue 26): "peak 23.4 GiB: a 20 GiB cap would have refused 3
/// allocations, the first at t=41.2 s in cuMemAlloc_v2 (1.0 GiB)". `None` when the process did
/// not observe and nothing was observed.
fn observe_text(names: &Names, observing: bool, d: &DevStats, limit: Option<u64>) -> Option<String> {
    let peak = human(d.peak);
    match d.first_would_deny {
        Some(w) => {
            let cap = match vramcap_common::trace::WouldDenyCap::from_result(w.cap) {
                Some(vramcap_common::trace::WouldDenyCap::Group) => "group budget",
                Some(vramcap_common::trace::WouldDenyCap::Ceiling) => "ceiling",
                _ => "cap",
            };
            let n = d.would_deny;
            Some(format!(
                "peak {peak}: a {} {cap} would have refused {n} allocation{}, the first at t={:.1} s in {} ({})",
                human(w.limit),
                if n == 1 { "" } else { "s" },
                w.t_ns as f64 / 1e9,
                names.get(w.api),
                human(w.size)
            ))
        }
        None if observing => Some(match limit {
            Some(l) => format!("peak {peak}: the {} cap would have refused nothing", human(l)),
            None => format!("peak {peak}: no cap on this device"),
        }),
        None => None,
    }
}

fn would_deny_json(names: &Names, d: &DevStats) -> Value {
    d.first_would_deny.map_or(Value::Null, |w| {
        let cap = vramcap_common::trace::WouldDenyCap::from_result(w.cap).map_or("unknown", |c| c.name());
        json!({"t_ns": w.t_ns, "api": names.get(w.api), "size": w.size, "cap": cap, "limit": w.limit, "charge": w.charge})
    })
}

fn incident_json(names: &Names, v: &[super::stats::Incident]) -> Value {
    v.iter().map(|x| json!({"t_ns": x.t_ns, "api": names.get(x.api), "size": x.size, "result": x.result, "used": x.used})).collect()
}

pub fn to_json(r: &Report) -> Value {
    let names = &r.merged.names;
    let processes: Vec<Value> = r
        .procs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let h = &r.merged.readers[i].header;
            let devices: Vec<Value> = p
                .devices
                .iter()
                .map(|d| {
                    let (limit, total) = limit_of(r, i, d.index);
                    let (held_at_exit, dropped) = exit_truth(r, i, d.index);
                    let (sizes, lives) = hist_json(d);
                    let sh = sharing_of(r, i, d.index);
                    let leaks: Vec<Value> = d
                        .largest_leaks(10)
                        .iter()
                        .map(|(ptr, l)| json!({"ptr": format!("{ptr:#x}"), "api": names.get(l.api), "size": l.size, "t_ns": l.t_ns}))
                        .collect();
                    json!({
                        "index": d.index, "peak": d.peak, "peak_t_ns": d.peak_t_ns,
                        "peak_unix_ns": h.start_unix_ns + d.peak_t_ns,
                        // Never above what the process said it held at exit: with events dropped
                        // the traced list can keep allocations whose frees were lost.
                        "leaked_bytes": held_at_exit.map_or(d.leaked_bytes(), |h| d.leaked_bytes().min(h)), "leaked_count": d.live.len(),
                        "would_deny": d.would_deny, "first_would_deny": would_deny_json(names, d),
                        "would_deny_total": r.merged.readers[i].summary.as_ref().and_then(|s| s.would_deny.as_ref()?.get(&d.index.to_string()).copied()),
                        "denied": d.denied, "failed": d.failed, "allocs": d.allocs, "frees": d.frees,
                        "other_events": d.other, "unmatched_frees": d.unmatched_frees,
                        "allocated_bytes": d.alloc_bytes, "used_at_end": d.used,
                        "overhead_at_end": d.overhead, "overhead_peak": d.overhead_peak,
                        "limit": limit, "total": total,
                        "group_limit": group_limit_of(r, i, d.index),
                        "group_reserve": sh.reserve, "group_headroom": sh.headroom,
                        "group_share": sh.share, "group_share_at_exit": sh.share_at_exit,
                        "held_at_exit": held_at_exit, "leaks_complete": dropped == 0,
                        "denied_total": r.merged.readers[i].summary.as_ref().and_then(|s| s.denied.as_ref()?.get(&d.index.to_string()).copied()),
                        "driver_ns": {"alloc": d.driver_ns[0], "free": d.driver_ns[1], "fail": d.driver_ns[2], "other": d.driver_ns[3]},
                        "largest_leaks": leaks,
                        "denials": incident_json(names, &d.denials), "failures": incident_json(names, &d.failures),
                        "limit_changes": d.limits.iter().map(|c| json!({"t_ns": c.t_ns, "old": c.old, "new": c.new,
                            "source": names.get(c.source), "uid": c.uid})).collect::<Vec<_>>(),
                        "size_histogram": sizes, "lifetime_histogram": lives,
                    })
                })
                .collect();
            let sh = sharing_of(r, i, -1);
            json!({"pid": h.pid, "exe": h.exe, "host": h.host, "group": h.group, "file": r.merged.readers[i].path,
                   "mode": h.mode.as_deref().unwrap_or("enforce"),
                   "group_policy": sh.policy, "group_priority": sh.priority, "group_holds_headroom": sh.holds_headroom,
                   "start_unix_ns": h.start_unix_ns, "devices": devices,
                   "dropped": r.merged.readers[i].summary.as_ref().map(|s| s.dropped),
                   "untracked_device_events": p.untracked,
                   "complete": r.merged.readers[i].summary.is_some()})
        })
        .collect();
    let combined: Vec<Value> = r
        .combined
        .iter()
        .map(|c| json!({"index": c.index, "peak": c.peak, "peak_unix_ns": r.merged.origin_unix_ns + c.peak_t}))
        .collect();
    let skipped: Vec<Value> = r.merged.skips.first.iter().map(|s| json!({"file": s.file, "line": s.line, "reason": s.reason})).collect();
    json!({"processes": processes, "combined": combined, "events": r.events,
           "skipped_lines": r.merged.skips.count, "skipped": skipped})
}

fn secs(ns: u64) -> String {
    format!("{:.3}s", ns as f64 / 1e9)
}

pub fn to_text(r: &Report) -> String {
    let names = &r.merged.names;
    let mut o = String::new();
    for (i, p) in r.procs.iter().enumerate() {
        let rd = &r.merged.readers[i];
        let h = &rd.header;
        let _ = writeln!(o, "process {} ({}) on {} — {}", h.pid, printable(&h.exe), printable(&h.host), rd.path.display());
        if p.devices.is_empty() {
            let _ = writeln!(o, "  no events");
        }
        if p.untracked > 0 {
            let _ = writeln!(o, "  {} event(s) on device ordinals past the first {} of this process: not read (no vramcap trace has so many)", p.untracked, ProcStats::MAX_DEVICES);
        }
        for d in &p.devices {
            let (limit, _) = limit_of(r, i, d.index);
            let mut cap = limit.map(|l| format!(", cap {}", human(l))).unwrap_or_default();
            if let Some(g) = group_limit_of(r, i, d.index) {
                let name = printable(h.group.as_deref().unwrap_or("?"));
                let _ = write!(cap, ", group \"{name}\" budget {}", human(g));
            }
            let (held_at_exit, dropped) = exit_truth(r, i, d.index);
            let dev = if d.index < 0 { "no device".to_string() } else { format!("device {}", d.index) };
            let _ = writeln!(o, "  {dev}{cap}");
            if h.group.is_some()
                && let Some(t) = sharing_text(&sharing_of(r, i, d.index))
            {
                let _ = writeln!(o, "    group sharing   {t}");
            }
            let _ = writeln!(o, "    peak            {} at t={}", human(d.peak), secs(d.peak_t_ns));
            let _ = writeln!(o, "    allocations     {} ({} total), frees {}, other events {}", d.allocs, human(d.alloc_bytes), d.frees, d.other);
            if d.overhead_peak > 0 {
                // Contexts, modules, per-context reservations: in the peak and the cap, not allocations.
                let _ = writeln!(o, "    overhead        {} at end, {} at most (contexts, modules, limits; counted in the peak)", human(d.overhead), human(d.overhead_peak));
            }
            if let Some(held) = held_at_exit {
                let _ = writeln!(o, "    held at exit    {} (the process's own count, from its summary)", human(held));
            }
            if rd.summary.is_none() && d.leaked_bytes() > 0 {
                // No summary: the process ended without exit() (killed: Ctrl-C, SIGKILL, OOM
                // killer), or still runs. What a killed process held is no leak: the driver
                // frees it when the process goes.
                let _ = writeln!(
                    o,
                    "    held when it was killed (freed by the driver at exit)  {} in {} allocation(s) traced (the trace has no exit summary: killed, or still running)",
                    human(d.leaked_bytes()),
                    d.live.len()
                );
            } else {
                let _ = writeln!(o, "    held at end     {} in {} allocation(s) traced", human(d.leaked_bytes()), d.live.len());
            }
            if dropped > 0 {
                let _ = writeln!(o, "      incomplete: {dropped} event(s) were dropped, so this list may miss frees and allocations (trust the line above; VRAMCAP_TRACE_MODE=lossless keeps every event)");
            }
            for (ptr, l) in d.largest_leaks(5) {
                let _ = writeln!(o, "      {:>10}  {}  {ptr:#x}  allocated at t={}", human(l.size), names.get(l.api), secs(l.t_ns));
            }
            if d.unmatched_frees > 0 {
                let _ = writeln!(o, "    frees without a traced allocation: {}", d.unmatched_frees);
            }
            if let Some(t) = observe_text(names, h.mode.as_deref() == Some("observe"), d, limit) {
                let _ = writeln!(o, "    observe mode    {t}");
            }
            let _ = writeln!(o, "    denied          {}", d.denied);
            for x in &d.denials {
                let _ = writeln!(o, "      t={}  {} {}  while using {}", secs(x.t_ns), names.get(x.api), human(x.size), human(x.used));
            }
            if !d.limits.is_empty() {
                let _ = writeln!(o, "    limit changes   {}", d.limits.len());
                let show = |b: u64| if b == 0 { "no limit".to_string() } else { human(b) };
                for c in &d.limits {
                    let _ = writeln!(o, "      t={}  {} -> {}  by {} (uid {})", secs(c.t_ns), show(c.old), show(c.new), names.get(c.source), c.uid);
                }
            }
            let _ = writeln!(o, "    driver failures {}", d.failed);
            for x in &d.failures {
                let _ = writeln!(o, "      t={}  {} {} → error {}  while using {}", secs(x.t_ns), names.get(x.api), human(x.size), x.result, human(x.used));
            }
            let dn = d.driver_ns;
            let _ = writeln!(o, "    time in driver  {} (alloc {}, free {}, failed {}, other {})", secs(dn.iter().sum()), secs(dn[0]), secs(dn[1]), secs(dn[2]), secs(dn[3]));
            if d.allocs > 0 {
                let _ = writeln!(o, "    sizes");
                for b in (0..64).filter(|&b| d.size_hist[b] > 0) {
                    let _ = writeln!(o, "      {:>10} – {:<10} {:>10}", human(1u64 << b), human((1u64 << b).saturating_mul(2)), d.size_hist[b]);
                }
            }
            if d.frees > 0 {
                let _ = writeln!(o, "    lifetimes (freed allocations)");
                for (k, n) in d.life_hist.iter().enumerate().filter(|(_, n)| **n > 0) {
                    let label = LIFETIME_BOUNDS.get(k).map(|b| b.1).unwrap_or(">=100s");
                    let _ = writeln!(o, "      {label:>8} {n:>10}");
                }
            }
        }
    }
    for c in &r.combined {
        let _ = writeln!(o, "all processes, device {}: peak {} at +{} from the first trace start", c.index, human(c.peak), secs(c.peak_t));
    }
    let _ = writeln!(o, "{} events, {} skipped line(s)", r.events, r.merged.skips.count);
    for s in &r.merged.skips.first {
        let _ = writeln!(o, "  skipped {}:{}: {}", s.file.display(), s.line, s.reason);
    }
    o
}
