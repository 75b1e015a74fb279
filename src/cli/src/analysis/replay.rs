//! `vramcap replay`: what-if co-location. The traces run together on one clock (all starting at
//! 0, or at `--stagger` offsets) against a device of the given size; per device we sum the
//! processes' charges and report the combined peak, the first moment an allocation would have
//! been refused, and the smallest limit at which everything fits (the combined peak).
//!
//! What happens after a refusal is unknowable from a trace (the job might free its cache and
//! retry, or die), so the replay keeps applying the recorded allocations: the peak and
//! `min_limit` describe the recorded workload, `denials` counts allocations that would have
//! crossed the limit.
//!
//! A process's memory leaves the replay when its trace ends: at the exit time in its summary, or,
//! for a cut trace (killed, or still running), at its last event; the output says which.
//! Exit status, as `grep` and `diff` do: 0 they fit, 1 they do not, 2 an error.
//!
//! `--limit` is the device size to test; the traces' own limit changes are ignored. Without it
//! the replay runs against the limits the traces recorded: per device the group budget of the
//! first header that has one (else the first process cap), moved by the traces' `limit` events
//! as it moved in the recorded run (the group's events; a process cap's ceiling events when no
//! trace had a group budget there).
//!
//! The traces are also one vramcap group, admitted by the library's own code (policy.rs): with `--policy`,
//! `--priority`, `--reserve` and `--headroom` the verdict is the chosen policy's, and the three
//! policies are compared on the same input.

use super::merge::{Align, MAX_DURATION_NS, Merged};
use super::policy::{DevCfg, Denial, Policy, Sim};
use super::stats::{Combined, next_used};
use super::trace::Op;
use vramcap_common::grammar::limits::{DeviceKey, Entry, parse_list};
use vramcap_common::grammar::size::{Size, human};
use serde_json::{Map, Value, json};
use std::path::PathBuf;

struct Dev {
    index: i32,
    limit: u64,
    usage: Combined,
    /// Per process: its charge on this device.
    used: Vec<u64>,
    /// The most a recorded denial asked the device to hold: everyone's charge then + its size.
    demand: u64,
    /// Recorded limit changes applied (without `--limit`); `limit` is the last one.
    changes: u64,
}

impl Dev {
    /// The smallest limit at which the recorded workload fits, recorded denials included.
    fn need(&self) -> u64 {
        self.usage.peak.max(self.demand)
    }
}

/// Where a trace's memory leaves the replay.
#[derive(Clone, Copy)]
enum End {
    /// The exit time in the summary.
    Summary(u64),
    /// No summary (or one without a time): the last event.
    LastEvent(u64),
}

impl End {
    fn t(self) -> u64 {
        match self {
            End::Summary(t) | End::LastEvent(t) => t,
        }
    }
}

/// `vramcap replay`'s arguments.
pub struct Opts<'a> {
    /// `None`: the limits the traces recorded, with their changes.
    pub limit: Option<&'a str>,
    pub paths: &'a [PathBuf],
    pub stagger: &'a [u64],
    pub json: bool,
    pub policy: Policy,
    /// `TRACE=N`, as given.
    pub priority: &'a [String],
    /// `TRACE=SIZE` or `TRACE=0=2g,1=1g`, as given.
    pub reserve: &'a [String],
    pub headroom: Option<&'a str>,
}

/// Ok(true): they fit; Ok(false): they do not (exit status 1).
pub fn run(o: &Opts) -> Result<bool, String> {
    let (paths, stagger, json_out) = (o.paths, o.stagger, o.json);
    let spec = o.limit.unwrap_or("the limits the traces recorded");
    // VRAMCAP_LIMIT's grammar, by the library's own parser: one size, or a per-device list.
    let limit = match o.limit {
        Some(spec) => Some(parse_list("--limit", spec).map_err(|e| format!("--limit {spec:?}: {}; expected {}", e.reason, e.expected))?),
        None => None,
    };
    let limit_for = |m: &Merged, dev: i32| match &limit {
        Some(l) => device_limit(m, l, dev),
        None => Ok(recorded_limit(m, dev).0),
    };
    if let Some(e) = limit.iter().flatten().find(|e| matches!(e.key, Some(DeviceKey::Uuid(_)))) {
        return Err(format!(
            "--limit {spec:?}: `{}` names a GPU by UUID, and traces record devices by CUDA ordinal only; \
             expected ordinals (0=80GiB,1=40GiB)",
            e.text
        ));
    }
    let offsets: Vec<u64> = match stagger.len() {
        0 => vec![0; paths.len()],
        // Checked: a step times the trace count must not wrap around (it did, silently).
        1 if paths.len() > 1 => (0..paths.len() as u64)
            .map(|i| i.checked_mul(stagger[0]).filter(|&o| o <= MAX_DURATION_NS))
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| format!("--stagger step {} ns times {} traces is more than 10 years", stagger[0], paths.len() - 1))?,
        n if n == paths.len() => stagger.to_vec(),
        n => return Err(format!("--stagger has {n} offsets for {} traces: give one per trace, or one step", paths.len())),
    };
    let mut priority = vec![0i64; paths.len()];
    for a in o.priority {
        let (i, v) = assignment("--priority", a, paths, "TRACE=N (N an integer; higher wins)")?;
        priority[i] = v.trim().parse().map_err(|_| format!("--priority {a:?}: `{v}` is not an integer; expected TRACE=N (N an integer; higher wins)"))?;
    }
    let mut reserve: Vec<Vec<Entry>> = vec![Vec::new(); paths.len()];
    for a in o.reserve {
        let expected = "TRACE=SIZE (e.g. a.jsonl=2GiB) or TRACE=0=2GiB,1=1GiB (per device)";
        let (i, v) = assignment("--reserve", a, paths, expected)?;
        reserve[i] = sizes("--reserve", a, v, expected)?;
    }
    let headroom = match o.headroom {
        Some(h) => sizes("--headroom", h, h, "SIZE (e.g. 2GiB) or 0=2GiB,1=1GiB (per device)")?,
        None => Vec::new(),
    };
    let mut m = Merged::open(paths, Align::Offsets(offsets.clone()))?;
    let mut devs: Vec<Dev> = Vec::new();
    let cfg_for = |m: &Merged, dev: i32| -> Result<DevCfg, String> {
        let reserve = reserve.iter().map(|r| device_limit(m, r, dev)).collect::<Result<Vec<u64>, String>>()?;
        Ok(DevCfg { index: dev, limit: limit_for(m, dev)?, headroom: device_limit(m, &headroom, dev)?, reserve })
    };
    // The three policies side by side; `chosen` gives the verdict.
    let mut sims: Vec<Sim> = Policy::ALL.iter().map(|&p| Sim::new(p, priority.clone())).collect();
    let chosen = Policy::ALL.iter().position(|&p| p == o.policy).unwrap_or(0);
    let mut known: Vec<i32> = m.readers.iter().flat_map(|r| r.header.devices.iter().map(|d| d.index)).collect();
    known.sort_unstable();
    known.dedup();
    for &dev in &known {
        for sim in &mut sims {
            sim.add_device(cfg_for(&m, dev)?, 0);
        }
    }
    // Members start at their offsets.
    let mut starts: Vec<(u64, usize)> = offsets.iter().enumerate().map(|(i, &o)| (o, i)).collect();
    starts.sort_unstable();
    let mut next_start = 0;
    let mut denied_in_trace = 0u64;
    let mut events = 0u64;
    let mut ends: Vec<Option<End>> = vec![None; m.readers.len()];
    let mut last_t: Vec<u64> = offsets.clone();
    // Traces that ended and still hold memory: released when the merged clock passes their end.
    let mut to_release: Vec<(u64, usize)> = Vec::new();
    let release = |devs: &mut Vec<Dev>, i: usize, t: u64| {
        for d in devs.iter_mut() {
            d.used[i] = 0;
            d.usage.set(i, 0, t);
        }
    };
    loop {
        let next = m.next();
        let now = next.as_ref().map_or(u64::MAX, |n| n.2);
        to_release.sort_unstable();
        // Ends and starts up to now, in time order (an end before a start at the same time).
        loop {
            let end = to_release.first().map(|x| x.0).filter(|&t| t <= now);
            let start = starts.get(next_start).map(|x| x.0).filter(|&t| t <= now);
            match (end, start) {
                (Some(te), ts) if ts.is_none_or(|ts| te <= ts) => {
                    let (t, i) = to_release.remove(0);
                    release(&mut devs, i, t);
                    sims.iter_mut().for_each(|s| s.end(i));
                }
                (_, Some(ts)) => {
                    let i = starts[next_start].1;
                    next_start += 1;
                    sims.iter_mut().for_each(|s| s.start(i, ts));
                }
                _ => break,
            }
        }
        let Some((i, e, t)) = next else { break };
        events += 1;
        last_t[i] = t;
        if e.op == Op::Deny {
            denied_in_trace += 1;
        }
        if e.dev >= 0 {
            // (No device: e.g. a failed free of an unknown pointer: no charge.)
            let k = match devs.iter().position(|d| d.index == e.dev) {
                Some(k) => k,
                None => {
                    let limit = limit_for(&m, e.dev)?;
                    devs.push(Dev { index: e.dev, limit, usage: Combined { index: e.dev, ..Default::default() }, used: vec![0; m.readers.len()], demand: 0, changes: 0 });
                    devs.len() - 1
                }
            };
            let d = &mut devs[k];
            if e.op == Op::Deny {
                d.demand = d.demand.max(d.used.iter().sum::<u64>().saturating_add(e.size));
            }
            let used = next_used(d.used[i], &e);
            d.used[i] = used;
            d.usage.set(i, used, t);
            if !sims[0].has_device(e.dev) {
                for sim in &mut sims {
                    sim.add_device(cfg_for(&m, e.dev)?, t);
                }
            }
            sims.iter_mut().for_each(|s| s.event(i, &e, t));
            // A recorded limit change (ignored under `--limit`): the budget the next request meets.
            if e.op == Op::Limit && limit.is_none() && recorded_limit(&m, e.dev).1 == (m.names.get(e.api) == "group") {
                let d = &mut devs[k];
                d.limit = e.size;
                d.changes += 1;
                sims.iter_mut().for_each(|s| s.set_limit(e.dev, e.size));
            }
        }
        // Several traces read one event ahead: past its last event, a trace's reader has also
        // read its summary (one trace alone ends with the stream, below).
        if m.readers.len() > 1 && ends[i].is_none() && m.finished(i) {
            let end = end_of_trace(&m, i, t);
            ends[i] = Some(end);
            to_release.push((end.t(), i));
        }
    }
    for i in 0..m.readers.len() {
        if ends[i].is_none() {
            ends[i] = Some(end_of_trace(&m, i, last_t[i]));
        }
    }
    m.finish_progress();
    m.warn_input();
    devs.sort_by_key(|d| d.index);
    let sim = &sims[chosen];
    let fits = sim.fits();
    let end_of = |i: usize| ends[i].unwrap_or(End::LastEvent(0));
    let who = |i: usize| format!("pid {} ({})", m.readers[i].header.pid, m.readers[i].path.display());
    // "cuMemAlloc_v2 of 1.0 GiB", or "a reserve of 2.0 GiB".
    let what = |x: &Denial| match x.api {
        Some(api) if x.recorded => format!("{} of {}, a denial recorded in the trace at that moment", m.names.get(api), human(x.size)),
        Some(api) => format!("{} of {}", m.names.get(api), human(x.size)),
        None => format!("a reserve of {}", human(x.size)),
    };
    if json_out {
        let map = |f: &dyn Fn(&Dev) -> Value| devs.iter().map(|d| (d.index.to_string(), f(d))).collect::<Map<String, Value>>();
        let den = |i: usize, x: &Denial| {
            json!({"t_ns": x.t, "pid": m.readers[i].header.pid, "file": m.readers[i].path, "api": x.api.map(|a| m.names.get(a)),
                   "size": x.size, "device": x.dev, "rule": x.rule.key(), "reason": x.rule.text(), "recorded": x.recorded})
        };
        let per_dev = |f: &dyn Fn(&DevCfg) -> u64| sim.devices().map(|d| (d.index.to_string(), json!(f(d)))).collect::<Map<String, Value>>();
        let traces: Vec<Value> = m
            .readers
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (end, how) = match end_of(i) {
                    End::Summary(t) => (t, "summary"),
                    End::LastEvent(t) => (t, "last_event"),
                };
                json!({"pid": r.header.pid, "file": r.path, "start_ns": offsets[i], "end_ns": end, "end_from": how,
                       "priority": priority[i], "reserve": per_dev(&|d| d.reserve[i]),
                       "denials": sim.denials[i], "first_denial": sim.first[i].map(|x| den(i, &x)),
                       "reserve_refused": sim.refused[i].iter().map(|x| json!({"t_ns": x.t, "device": x.dev, "size": x.size})).collect::<Vec<_>>(),
                       "took_from_reserves": sim.took[i], "reserve_taken": sim.lost[i], "headroom_holder": sim.held_headroom[i],
                       "recorded_denials": sim.recorded_denials[i], "recorded_denials_granted": sim.recorded_granted[i]})
            })
            .collect();
        let policies: Map<String, Value> = sims
            .iter()
            .map(|s| (s.policy.name().to_string(), json!({"fits": s.fits(), "denials": s.total, "first_denial": s.first_overall.map(|(i, x)| den(i, &x))})))
            .collect();
        let out = json!({
            "fits": fits,
            "policy": o.policy.name(),
            "peak": map(&|d| json!(d.usage.peak)),
            "peak_t_ns": map(&|d| json!(d.usage.peak_t)),
            "first_denial_t_ns": sim.first_overall.map(|f| f.1.t),
            "first_denial": sim.first_overall.map(|(i, x)| den(i, &x)),
            "min_limit": map(&|d| json!(d.need())),
            "limit": map(&|d| if d.limit > 0 { json!(d.limit) } else { Value::Null }),
            "limit_changes": map(&|d| json!(d.changes)),
            "headroom": per_dev(&|d| d.headroom),
            "denials": sim.total,
            "denied_in_traces": denied_in_trace,
            "offsets_ns": offsets,
            "traces": traces,
            "policies": policies,
            "events": events,
            "skipped_lines": m.skips.count,
        });
        println!("{out}");
        return Ok(fits);
    }
    println!("replaying {} trace(s), {events} events, against {spec} per device", paths.len());
    for (i, r) in m.readers.iter().enumerate() {
        let end = match end_of(i) {
            End::Summary(t) => format!("ends at +{} (its exit, from the summary)", secs(t)),
            End::LastEvent(t) => format!("ends at +{} (its last event: no summary, the trace was cut)", secs(t)),
        };
        println!("  pid {} ({}) starts at +{}, {end}  {}", r.header.pid, r.header.exe, secs(offsets[i]), r.path.display());
    }
    for d in &devs {
        let cap = if d.limit > 0 { human(d.limit) } else { "no limit".into() };
        let verdict = if d.changes > 0 {
            if sim.denials_on(d.index) == 0 { "fits" } else { "does NOT fit" }
        } else if d.limit == 0 || d.need() <= d.limit {
            "fits"
        } else {
            "does NOT fit"
        };
        let cap = if d.changes > 0 { format!("the recorded limits ({} change(s), last {cap})", d.changes) } else { cap };
        let asked = if d.demand > d.usage.peak { format!(" (a recorded denial asked for {} = {} bytes in all)", human(d.demand), d.demand) } else { String::new() };
        println!("device {}: combined peak {} at +{}{asked} against {cap}: {verdict}", d.index, human(d.usage.peak), secs(d.usage.peak_t));
    }
    let policy = o.policy.name();
    match sim.first_overall {
        None => println!("verdict: they fit (policy {policy})"),
        Some((i, x)) => println!(
            "verdict: they do not fit (policy {policy}); the limit is first broken at +{} on device {} by pid {} ({}: {}): {}; {} denial(s)",
            secs(x.t),
            x.dev,
            m.readers[i].header.pid,
            m.readers[i].path.display(),
            what(&x),
            x.rule.text(),
            sim.total,
        ),
    }
    let need: Vec<String> = devs
        .iter()
        .map(|d| if d.demand > d.usage.peak { format!("device {}: {} ({} bytes)", d.index, human(d.need()), d.need()) } else { format!("device {}: {}", d.index, human(d.need())) })
        .collect();
    if need.is_empty() {
        // A header-only trace (a process killed before its first allocation).
        println!("smallest limit at which they fit: any (the traces hold no device memory event)");
    } else {
        println!("smallest limit at which they fit: {}", need.join(", "));
    }
    if denied_in_trace > 0 {
        println!(
            "note: the traces themselves contain {denied_in_trace} denial(s); each is replayed as the request it was (never charged), and one the replay refuses too is a denial here"
        );
    }
    print!("{}", policy_text(o, sim, &sims, &who, &what));
    Ok(fits)
}

/// Per member under the chosen policy, then the three policies side by side.
fn policy_text(o: &Opts, sim: &Sim, sims: &[Sim], who: &dyn Fn(usize) -> String, what: &dyn Fn(&Denial) -> String) -> String {
    use std::fmt::Write;
    let mut t = format!("policy {}, per member:\n", o.policy.name());
    for i in 0..o.paths.len() {
        let _ = match sim.first[i] {
            None => writeln!(t, "  {}: no denials", who(i)),
            Some(x) => writeln!(t, "  {}: {} denial(s), the first at +{} on device {} ({}): {}", who(i), sim.denials[i], secs(x.t), x.dev, what(&x), x.rule.text()),
        };
        for x in &sim.refused[i] {
            let _ = writeln!(t, "    its reserve of {} on device {} was refused at its start (+{}): it runs with reserve 0 there", human(x.size), x.dev, secs(x.t));
        }
        if sim.took[i] > 0 {
            let _ = writeln!(t, "    it took {} of lower-priority members' unmet reserves", human(sim.took[i]));
        }
        if sim.lost[i] > 0 {
            let _ = writeln!(t, "    {} of its unmet reserve was taken by higher-priority members", human(sim.lost[i]));
        }
        for dev in &sim.held_headroom[i] {
            let _ = writeln!(t, "    it holds the headroom on device {dev}");
        }
        if sim.recorded_granted[i] > 0 {
            let _ = writeln!(
                t,
                "    {} of the {} denial(s) recorded in its trace would be granted here (what the job did after a denial is not in its trace)",
                sim.recorded_granted[i], sim.recorded_denials[i]
            );
        }
    }
    let _ = writeln!(t, "policies compared (same traces, limit, reserves, headroom):");
    let _ = writeln!(t, "  {:<9} {:<5} {:<8} first denied", "policy", "fits", "denials");
    for s in sims {
        let first = match s.first_overall {
            None => "-".to_string(),
            Some((i, x)) => format!("{} at +{} on device {}: {}", who(i), secs(x.t), x.dev, x.rule.text()),
        };
        let _ = writeln!(t, "  {:<9} {:<5} {:<8} {first}", s.policy.name(), if s.fits() { "yes" } else { "no" }, s.total);
    }
    t
}

/// `TRACE=VALUE`: the trace (by the path as given, or its file name) and the value. The split is
/// at the first `=` whose left side names a trace (paths and values may contain `=`).
fn assignment<'a>(flag: &str, arg: &'a str, paths: &[PathBuf], expected: &str) -> Result<(usize, &'a str), String> {
    let mut first_name = None;
    for (at, _) in arg.match_indices('=') {
        let name = &arg[..at];
        first_name.get_or_insert(name);
        if let Some(i) = trace_named(flag, arg, name, paths)? {
            return Ok((i, &arg[at + 1..]));
        }
    }
    let Some(name) = first_name else { return Err(format!("{flag} {arg:?}: no `=`; expected {expected}")) };
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    Err(format!("{flag} {arg:?}: `{name}` names none of the traces ({}); expected {expected}", names.join(", ")))
}

fn trace_named(flag: &str, arg: &str, name: &str, paths: &[PathBuf]) -> Result<Option<usize>, String> {
    if let Some(i) = paths.iter().position(|p| p.as_os_str() == name) {
        return Ok(Some(i));
    }
    let by_file: Vec<usize> = (0..paths.len()).filter(|&i| paths[i].file_name().is_some_and(|f| f == name)).collect();
    match by_file.len() {
        0 => Ok(None),
        1 => Ok(Some(by_file[0])),
        n => Err(format!("{flag} {arg:?}: `{name}` is the file name of {n} traces; give the path as on the command line")),
    }
}

/// A size or per-device list, by the library's parser (UUID keys refused: traces record ordinals).
fn sizes(flag: &str, arg: &str, v: &str, expected: &str) -> Result<Vec<Entry>, String> {
    let e = parse_list(flag, v).map_err(|e| format!("{flag} {arg:?}: {}; expected {expected}", e.reason))?;
    if e.iter().any(|e| matches!(e.key, Some(DeviceKey::Uuid(_)))) {
        return Err(format!("{flag} {arg:?}: traces record devices by CUDA ordinal only; expected {expected}"));
    }
    Ok(e)
}

/// Trace i's end on the merged clock: its exit time from the summary, else its last event (at
/// `last`, on the merged clock).
fn end_of_trace(m: &Merged, i: usize, last: u64) -> End {
    match m.readers[i].summary.as_ref().and_then(|s| s.t_ns) {
        Some(x) => End::Summary(m.base[i].saturating_add(x).max(last)),
        None => End::LastEvent(last),
    }
}

/// Seconds with as many decimals as the value needs (µs resolution): 10s, 0.26ms is 0.00026s.
fn secs(ns: u64) -> String {
    if ns % 1_000_000_000 == 0 {
        return format!("{}s", ns / 1_000_000_000);
    }
    let s = format!("{:.6}", ns as f64 / 1e9);
    format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
}

/// The limit in bytes for device `dev` (0: none): the last entry naming it or every device, as
/// the library applies a list. A percentage needs the device's total from a header.
/// The limit a replay without `--limit` starts device `dev` with: the group budget of the first
/// header that has one, else the first process cap (0: none); and whether it is a group's (then
/// the group's `limit` events move it, else the process caps' ceiling events).
fn recorded_limit(m: &Merged, dev: i32) -> (u64, bool) {
    let on = |r: &super::trace::TraceReader| r.header.devices.iter().find(|d| d.index == dev).cloned();
    if let Some(g) = m.readers.iter().find_map(|r| on(r).and_then(|d| d.group_limit)) {
        return (g, true);
    }
    (m.readers.iter().find_map(|r| on(r).and_then(|d| d.limit)).unwrap_or(0), false)
}

fn device_limit(m: &Merged, entries: &[Entry], dev: i32) -> Result<u64, String> {
    let applies = |e: &&Entry| match e.key {
        None => true,
        Some(DeviceKey::Ordinal(i)) => i as i64 == dev as i64,
        Some(DeviceKey::Uuid(_)) => false,
    };
    let Some(limit) = entries.iter().rev().find(applies).map(|e| e.size) else { return Ok(0) };
    match limit {
        Size::Percent(_) => {
            let total = m.readers.iter().flat_map(|r| r.header.devices.iter()).filter(|d| d.index == dev).map(|d| d.total).find(|t| *t > 0);
            match total {
                Some(t) => Ok(limit.bytes_for(t)),
                None => Err(format!("a percentage limit needs device {dev}'s total memory, and no trace header lists it; give the limit in bytes (e.g. 80GiB)")),
            }
        }
        _ => Ok(limit.bytes_for(0)),
    }
}
