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

use super::merge::{Align, MAX_DURATION_NS, Merged};
use super::stats::{Combined, next_used};
use super::trace::Op;
use crate::grammar::limits::{DeviceKey, Entry, parse_list};
use crate::size::{Size, human};
use serde_json::{Map, Value, json};
use std::path::PathBuf;

struct Dev {
    index: i32,
    limit: u64,
    usage: Combined,
    /// Per process: its charge on this device.
    used: Vec<u64>,
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

/// Ok(true): they fit; Ok(false): they do not (exit status 1).
pub fn run(spec: &str, paths: &[PathBuf], stagger: &[u64], json_out: bool) -> Result<bool, String> {
    // VRAMCAP_LIMIT's grammar, by the library's own parser: one size, or a per-device list.
    let limit = parse_list("--limit", spec).map_err(|e| format!("--limit {spec:?}: {}; expected {}", e.reason, e.expected))?;
    if let Some(e) = limit.iter().find(|e| matches!(e.key, Some(DeviceKey::Uuid(_)))) {
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
    let mut m = Merged::open(paths, Align::Offsets(offsets.clone()))?;
    let mut devs: Vec<Dev> = Vec::new();
    let mut denials = 0u64;
    // (time, trace, api, size, device)
    let mut first_denial: Option<(u64, usize, u16, u64, i32)> = None;
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
        while to_release.first().is_some_and(|&(t, _)| t <= now) {
            let (t, i) = to_release.remove(0);
            release(&mut devs, i, t);
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
                    let limit = device_limit(&m, &limit, e.dev)?;
                    devs.push(Dev { index: e.dev, limit, usage: Combined { index: e.dev, ..Default::default() }, used: vec![0; m.readers.len()] });
                    devs.len() - 1
                }
            };
            let d = &mut devs[k];
            let used = next_used(d.used[i], &e);
            d.used[i] = used;
            d.usage.set(i, used, t);
            if e.op == Op::Alloc && d.limit > 0 && d.usage.used > d.limit {
                denials += 1;
                if first_denial.is_none() {
                    first_denial = Some((t, i, e.api, e.size, e.dev));
                }
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
    let fits = first_denial.is_none();
    let end_of = |i: usize| ends[i].unwrap_or(End::LastEvent(0));
    if json_out {
        let map = |f: &dyn Fn(&Dev) -> Value| devs.iter().map(|d| (d.index.to_string(), f(d))).collect::<Map<String, Value>>();
        let first = first_denial.map(|(t, i, api, size, dev)| {
            json!({"t_ns": t, "pid": m.readers[i].header.pid, "file": m.readers[i].path, "api": m.names.get(api), "size": size, "device": dev})
        });
        let traces: Vec<Value> = m
            .readers
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (end, how) = match end_of(i) {
                    End::Summary(t) => (t, "summary"),
                    End::LastEvent(t) => (t, "last_event"),
                };
                json!({"pid": r.header.pid, "file": r.path, "start_ns": offsets[i], "end_ns": end, "end_from": how})
            })
            .collect();
        let out = json!({
            "fits": fits,
            "peak": map(&|d| json!(d.usage.peak)),
            "peak_t_ns": map(&|d| json!(d.usage.peak_t)),
            "first_denial_t_ns": first_denial.map(|f| f.0),
            "first_denial": first,
            "min_limit": map(&|d| json!(d.usage.peak)),
            "limit": map(&|d| if d.limit > 0 { json!(d.limit) } else { Value::Null }),
            "denials": denials,
            "denied_in_traces": denied_in_trace,
            "offsets_ns": offsets,
            "traces": traces,
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
        let verdict = if d.limit == 0 || d.usage.peak <= d.limit { "fits" } else { "does NOT fit" };
        println!("device {}: combined peak {} at +{} against {cap}: {verdict}", d.index, human(d.usage.peak), secs(d.usage.peak_t));
    }
    match first_denial {
        None => println!("verdict: they fit"),
        Some((t, i, api, size, dev)) => {
            println!(
                "verdict: they do not fit; the limit is first broken at +{} on device {dev} by pid {} ({}: {} of {}), {denials} allocation(s) over the limit",
                secs(t),
                m.readers[i].header.pid,
                m.readers[i].path.display(),
                m.names.get(api),
                human(size),
            );
        }
    }
    let need: Vec<String> = devs.iter().map(|d| format!("device {}: {}", d.index, human(d.usage.peak))).collect();
    println!("smallest limit at which they fit: {}", need.join(", "));
    if denied_in_trace > 0 {
        println!("note: the traces themselves contain {denied_in_trace} denial(s); those requests were never charged and are not replayed");
    }
    Ok(fits)
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
