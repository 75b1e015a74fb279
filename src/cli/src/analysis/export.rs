//! `vramcap export --format chrome|csv`: streaming conversions (one event in, a few bytes out;
//! nothing accumulates but the current usage per process and device).

use super::merge::{Align, Merged};
use super::stats::next_used;
use super::trace::Op;
use vramcap_common::grammar::size::human;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// A time window on the merged clock (ns since the earliest trace start), inclusive.
#[derive(Clone, Copy)]
pub struct Window {
    pub from: u64,
    pub to: u64,
}

impl Window {
    fn check(&self) -> Result<(), String> {
        if self.from > self.to { Err("--from is after --to".into()) } else { Ok(()) }
    }
}

/// `--from` after the traces' last event: nothing can be exported. An empty file with status 0
/// looked like success, so this is an error (exit status 2) saying where the traces end, and the
/// empty output is removed. A window inside the traces that merely holds no event is not an error.
pub(super) fn past_the_end(out: &Path, w: Window, last_t: Option<u64>, exported: bool) -> Result<(), String> {
    match last_t {
        Some(end) if !exported && w.from > end => {
            super::output::remove(out);
            Err(format!(
                "--from {:.3}s is past the end of the traces (their last event is at {:.3}s after the earliest start); nothing exported",
                w.from as f64 / 1e9,
                end as f64 / 1e9
            ))
        }
        _ => Ok(()),
    }
}

/// Browsers (Perfetto UI, chrome://tracing) struggle to load JSON traces beyond this.
pub const CHROME_WARN_BYTES: u64 = 200 << 20;

fn create(path: &Path) -> Result<BufWriter<File>, String> {
    super::output::create(path).map(|f| BufWriter::with_capacity(1 << 20, f))
}

fn ts(t: u64) -> String {
    format!("{}.{:03}", t / 1000, t % 1000)
}

/// Chrome pids: the traced pid, unless two traces share one (containers are all pid 1), then
/// the trace's position; the process name always carries the real pid and host.
fn chrome_pids(m: &Merged) -> Vec<u64> {
    let pids: Vec<u64> = m.readers.iter().map(|r| r.header.pid).collect();
    let unique = pids.iter().all(|p| pids.iter().filter(|q| *q == p).count() == 1);
    if unique { pids } else { (1..=pids.len() as u64).collect() }
}

pub fn chrome(paths: &[PathBuf], out: &Path, w: Window) -> Result<(), String> {
    w.check()?;
    let mut m = Merged::open(paths, Align::WallClock)?;
    let pids = chrome_pids(&m);
    let mut f = create(out)?;
    let io = |e: std::io::Error| format!("{}: write error: {e}", out.display());
    let mut bytes = 0u64;
    let mut put = |f: &mut BufWriter<File>, s: String| -> Result<(), String> {
        bytes += s.len() as u64 + 2;
        f.write_all(s.as_bytes()).and_then(|_| f.write_all(b",\n")).map_err(io)
    };
    f.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n").map_err(io)?;
    for (i, r) in m.readers.iter().enumerate() {
        let h = &r.header;
        let name = serde_json::to_string(&format!("{} (pid {} on {})", h.exe, h.pid, h.host)).unwrap_or_default();
        put(&mut f, format!(r#"{{"name":"process_name","ph":"M","pid":{},"tid":0,"args":{{"name":{name}}}}}"#, pids[i]))?;
    }
    // Current charge per (trace, device), to start a window at the right level.
    let mut used: Vec<Vec<(i32, u64)>> = vec![Vec::new(); m.readers.len()];
    let mut started = false;
    let (mut first_t, mut last_t, mut counters) = (None, 0u64, 0u64);
    let mut end_t = None;
    while let Some((i, e, t)) = m.next() {
        if t > w.to {
            break;
        }
        end_t = Some(t);
        let slot = match used[i].iter().position(|(d, _)| *d == e.dev) {
            Some(k) => k,
            None => {
                used[i].push((e.dev, 0));
                used[i].len() - 1
            }
        };
        let before = used[i][slot].1;
        let after = next_used(before, &e);
        used[i][slot].1 = after;
        if t < w.from {
            continue;
        }
        if !started && w.from > 0 {
            started = true;
            for (j, devs) in used.iter().enumerate() {
                for &(d, u) in devs.iter().filter(|(d, _)| *d >= 0) {
                    let u = if j == i && d == e.dev { before } else { u };
                    put(&mut f, format!(r#"{{"name":"GPU {d} used","ph":"C","ts":{},"pid":{},"args":{{"bytes":{u}}}}}"#, ts(w.from), pids[j]))?;
                }
            }
        }
        first_t.get_or_insert(t);
        last_t = t;
        let pid = pids[i];
        if e.dev >= 0 && (after != before || matches!(e.op, Op::Alloc | Op::Free)) {
            counters += 1;
            put(&mut f, format!(r#"{{"name":"GPU {} used","ph":"C","ts":{},"pid":{pid},"args":{{"bytes":{after}}}}}"#, e.dev, ts(t)))?;
        }
        if matches!(e.op, Op::Deny | Op::Fail) {
            let what = if e.op == Op::Deny { "denied" } else { "driver failure" };
            put(
                &mut f,
                format!(
                    r#"{{"name":"{what}: {} {}","cat":"vramcap","ph":"i","s":"p","ts":{},"pid":{pid},"tid":{},"args":{{"dev":{},"size":{},"used":{after},"result":{}}}}}"#,
                    m.names.get(e.api), human(e.size), ts(t), e.tid, e.dev, e.size, e.result
                ),
            )?;
        }
    }
    m.finish_progress();
    // A trailing metadata record keeps the array valid JSON without tracking the last comma.
    f.write_all(b"{\"name\":\"vramcap\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{}}\n]}\n").map_err(io)?;
    f.flush().map_err(io)?;
    m.warn_input();
    drop(f);
    past_the_end(out, w, end_t, first_t.is_some())?;
    eprintln!("vramcap: wrote {} ({counters} counter events, {})", super::output::shown(out), human(bytes));
    if bytes > CHROME_WARN_BYTES {
        let start = first_t.unwrap_or(0);
        let span = last_t.saturating_sub(start).max(1);
        let fit = (span as f64 * CHROME_WARN_BYTES as f64 / bytes as f64) as u64;
        eprintln!(
            "vramcap: warning: {} is {}, more than a browser loads comfortably (~{}); export a time window, e.g. --from {:.3}s --to {:.3}s",
            out.display(),
            human(bytes),
            human(CHROME_WARN_BYTES),
            start as f64 / 1e9,
            (start + fit) as f64 / 1e9
        );
    }
    Ok(())
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

/// One row per event. Columns are the trace's names, plus `pid`/`host` from the header and
/// `unix_ns` (= start_unix_ns + t_ns) so rows of several traces can be joined and ordered.
pub fn csv(paths: &[PathBuf], out: &Path, w: Window) -> Result<(), String> {
    w.check()?;
    let mut m = Merged::open(paths, Align::WallClock)?;
    let mut f = create(out)?;
    let io = |e: std::io::Error| format!("{}: write error: {e}", out.display());
    writeln!(f, "pid,host,seq,t_ns,unix_ns,tid,op,api,dev,ptr,size,result,dur_ns,used").map_err(io)?;
    let hosts: Vec<String> = m.readers.iter().map(|r| csv_field(&r.header.host)).collect();
    let mut rows = 0u64;
    let mut end_t = None;
    while let Some((i, e, t)) = m.next() {
        if t > w.to {
            break;
        }
        end_t = Some(t);
        if t < w.from {
            continue;
        }
        rows += 1;
        let h = &m.readers[i].header;
        let used = e.used.map(|u| u.to_string()).unwrap_or_default();
        writeln!(
            f,
            "{},{},{},{},{},{},{},{},{},{:#x},{},{},{},{used}",
            h.pid,
            hosts[i],
            e.seq,
            e.t_ns,
            h.start_unix_ns + e.t_ns,
            e.tid,
            csv_field(m.names.get(e.op_name)),
            csv_field(m.names.get(e.api)),
            e.dev,
            e.ptr,
            e.size,
            e.result,
            e.dur_ns
        )
        .map_err(io)?;
    }
    m.finish_progress();
    f.flush().map_err(io)?;
    m.warn_input();
    drop(f);
    past_the_end(out, w, end_t, rows > 0)?;
    eprintln!("vramcap: wrote {} ({rows} rows)", super::output::shown(out));
    Ok(())
}
