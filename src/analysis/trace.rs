//! Reading one trace file (docs/trace-format.md, version 1) as a stream of events. Memory stays
//! constant per file: one reused line buffer. Corrupt or truncated lines are skipped and recorded
//! (file and line number); unknown `type`s and fields are ignored as the format requires.

use super::scan::{self, ScanError, Val};
use serde::Deserialize;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Alloc,
    Free,
    Deny,
    Fail,
    /// Traced-only kinds (`map`, `reserve`, …) and kinds this reader does not know.
    Other,
}

/// One event line. Strings are interned (`Names`) so events are small and `Copy`.
#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub seq: u64,
    pub t_ns: u64,
    pub tid: u64,
    pub op: Op,
    /// Interned `op` text (kept for exports that write it back).
    pub op_name: u16,
    pub api: u16,
    pub dev: i32,
    pub ptr: u64,
    pub size: u64,
    pub result: i64,
    pub dur_ns: u64,
    /// The device's charge after the call; `None` if the line lacks it.
    pub used: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct DeviceInfo {
    pub index: i32,
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub limit: Option<u64>,
    /// The group's budget on this device (group members).
    #[serde(default)]
    pub group_limit: Option<u64>,
    /// The member's reserve, the group's headroom and (`equal`) its share when the trace began.
    #[serde(default)]
    pub group_reserve: Option<u64>,
    #[serde(default)]
    pub group_headroom: Option<u64>,
    #[serde(default)]
    pub group_share: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Header {
    pub version: u64,
    pub pid: u64,
    #[serde(default)]
    pub exe: String,
    #[serde(default)]
    pub host: String,
    pub start_unix_ns: u64,
    #[serde(default)]
    pub devices: Vec<DeviceInfo>,
    #[serde(default)]
    pub group: Option<String>,
    /// The group's policy, the member's priority and whether it held the headroom.
    #[serde(default)]
    pub group_policy: Option<String>,
    #[serde(default)]
    pub group_priority: Option<i64>,
    #[serde(default)]
    pub group_holds_headroom: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Summary {
    /// When the process exited (traces from before this field: `None`).
    #[serde(default)]
    pub t_ns: Option<u64>,
    #[serde(default)]
    pub dropped: u64,
    /// Per device (ordinal as a string): the charge at exit, the truth even when events dropped.
    #[serde(default)]
    pub used: std::collections::BTreeMap<String, u64>,
    #[serde(default)]
    pub denied: Option<std::collections::BTreeMap<String, u64>>,
    #[serde(default)]
    pub group: Option<GroupSummary>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct GroupSummary {
    #[serde(default)]
    pub limit: std::collections::BTreeMap<String, u64>,
    #[serde(default)]
    pub policy: Option<String>,
    #[serde(default)]
    pub priority: Option<i64>,
    #[serde(default)]
    pub holds_headroom: Option<bool>,
    #[serde(default)]
    pub reserve: std::collections::BTreeMap<String, u64>,
    #[serde(default)]
    pub headroom: std::collections::BTreeMap<String, u64>,
    /// `equal`: the member's share at its exit.
    #[serde(default)]
    pub share: std::collections::BTreeMap<String, u64>,
}

impl Summary {
    pub fn used_at_exit(&self, dev: i32) -> Option<u64> {
        self.used.get(&dev.to_string()).copied()
    }
}

/// Interned strings (api and op names): a handful of distinct values across millions of lines.
#[derive(Default)]
pub struct Names {
    names: Vec<String>,
}

impl Names {
    pub fn intern(&mut self, s: &[u8]) -> u16 {
        if let Some(i) = self.names.iter().position(|n| n.as_bytes() == s) {
            return i as u16;
        }
        // Past 65535 distinct names the trace is not a vramcap trace; share the last slot.
        if self.names.len() >= u16::MAX as usize {
            return u16::MAX - 1;
        }
        // Printed by report and replay: a crafted name never reaches a terminal as escapes.
        self.names.push(super::printable(&String::from_utf8_lossy(s)));
        (self.names.len() - 1) as u16
    }
    pub fn get(&self, id: u16) -> &str {
        self.names.get(id as usize).map(|s| s.as_str()).unwrap_or("?")
    }
}

/// A skipped line, for the report.
#[derive(Clone, Debug)]
pub struct Skip {
    pub file: PathBuf,
    pub line: u64,
    pub reason: String,
}

/// All skipped lines: the count is exact, the list keeps the first few.
#[derive(Default)]
pub struct Skips {
    pub count: u64,
    pub first: Vec<Skip>,
}

impl Skips {
    pub const KEEP: usize = 100;
    pub fn add(&mut self, file: &Path, line: u64, reason: impl Into<String>) {
        self.count += 1;
        if self.first.len() < Self::KEEP {
            self.first.push(Skip { file: file.to_path_buf(), line, reason: reason.into() });
        }
    }
}

pub struct TraceReader {
    pub path: PathBuf,
    pub header: Header,
    pub summary: Option<Summary>,
    reader: BufReader<File>,
    buf: Vec<u8>,
    line_no: u64,
    /// Bytes consumed so far (for progress bars).
    pub bytes_read: u64,
    /// The whole file was read (a missing summary then means the process did not finish).
    pub at_end: bool,
}

/// The slow path for event lines the scanner declines (escapes, nested unknown fields).
#[derive(Deserialize)]
struct SlowEvent {
    #[serde(default)]
    seq: u64,
    t_ns: u64,
    #[serde(default)]
    tid: u64,
    op: String,
    #[serde(default)]
    api: String,
    #[serde(default = "no_dev")]
    dev: i32,
    #[serde(default)]
    ptr: Option<String>,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    result: i64,
    #[serde(default)]
    dur_ns: u64,
    #[serde(default)]
    used: Option<u64>,
}

fn no_dev() -> i32 {
    -1
}

enum Line {
    Event(Event),
    Header(Box<Header>),
    Summary(Summary),
    /// A line of a `type` this reader does not know: ignored, not an error.
    Ignored,
}

fn op_of(s: &[u8]) -> Op {
    match s {
        b"alloc" => Op::Alloc,
        b"free" => Op::Free,
        b"deny" => Op::Deny,
        b"fail" => Op::Fail,
        _ => Op::Other,
    }
}

fn parse_line(line: &[u8], names: &mut Names) -> Result<Line, String> {
    let mut ty: Option<&[u8]> = None;
    let mut e = Event { seq: 0, t_ns: u64::MAX, tid: 0, op: Op::Other, op_name: u16::MAX, api: u16::MAX, dev: -1, ptr: 0, size: 0, result: 0, dur_ns: 0, used: None };
    let mut bad: Option<&'static str> = None;
    let mut have_op = false;
    let scanned = scan::scan(line, |k, v| {
        let num = |v: Val| if let Val::Num(n) = v { scan::uint(n) } else { None };
        match k {
            b"type" => ty = if let Val::Str(s) = v { Some(s) } else { None },
            b"t_ns" => e.t_ns = num(v).unwrap_or_else(|| { bad = Some("t_ns is not an unsigned integer"); 0 }),
            b"seq" => e.seq = num(v).unwrap_or(0),
            b"tid" => e.tid = num(v).unwrap_or(0),
            b"size" => e.size = num(v).unwrap_or_else(|| { bad = Some("size is not an unsigned integer"); 0 }),
            b"dur_ns" => e.dur_ns = num(v).unwrap_or(0),
            b"used" => e.used = num(v),
            b"dev" => match v {
                Val::Num(n) => e.dev = scan::int(n).and_then(|d| i32::try_from(d).ok()).unwrap_or(-1),
                _ => e.dev = -1,
            },
            b"result" => e.result = if let Val::Num(n) = v { scan::int(n).unwrap_or(0) } else { 0 },
            b"ptr" => match v {
                Val::Str(s) => e.ptr = scan::hex(s).unwrap_or_else(|| { bad = Some("ptr is not a \"0x…\" string"); 0 }),
                _ => e.ptr = 0,
            },
            b"op" => if let Val::Str(s) = v {
                have_op = true;
                e.op = op_of(s);
                e.op_name = names.intern(s);
            },
            b"api" => if let Val::Str(s) = v {
                e.api = names.intern(s);
            },
            _ => {}
        }
    });
    match scanned {
        Ok(()) => match ty {
            Some(b"event") => {
                if let Some(why) = bad {
                    return Err(why.into());
                }
                if e.t_ns == u64::MAX || !have_op {
                    return Err("event without t_ns or op".into());
                }
                Ok(Line::Event(e))
            }
            Some(b"header") | Some(b"summary") => slow_line(line, names),
            Some(_) => Ok(Line::Ignored),
            None => Err("no \"type\" field".into()),
        },
        Err(ScanError::Unusual) => slow_line(line, names),
        Err(ScanError::Corrupt(why)) => Err(why.into()),
    }
}

fn slow_line(line: &[u8], names: &mut Names) -> Result<Line, String> {
    let v: serde_json::Value = serde_json::from_slice(line).map_err(|e| format!("invalid JSON: {e}"))?;
    let ty = v.get("type").and_then(|t| t.as_str()).ok_or("no \"type\" field")?;
    match ty {
        "header" => Ok(Line::Header(Box::new(Header::deserialize(&v).map_err(|e| format!("bad header: {e}"))?))),
        "summary" => Ok(Line::Summary(Summary::deserialize(&v).map_err(|e| format!("bad summary: {e}"))?)),
        "event" => {
            let s = SlowEvent::deserialize(&v).map_err(|e| format!("bad event: {e}"))?;
            let ptr = match s.ptr.as_deref() {
                None => 0,
                Some(p) => scan::hex(p.as_bytes()).ok_or("ptr is not a \"0x…\" string")?,
            };
            Ok(Line::Event(Event {
                seq: s.seq,
                t_ns: s.t_ns,
                tid: s.tid,
                op: op_of(s.op.as_bytes()),
                op_name: names.intern(s.op.as_bytes()),
                api: names.intern(s.api.as_bytes()),
                dev: s.dev,
                ptr,
                size: s.size,
                result: s.result,
                dur_ns: s.dur_ns,
                used: s.used,
            }))
        }
        _ => Ok(Line::Ignored),
    }
}

impl TraceReader {
    /// Opens a trace and reads its header (the first line that parses; earlier lines are skipped).
    pub fn open(path: &Path, names: &mut Names, skips: &mut Skips) -> Result<TraceReader, String> {
        let file = File::open(path).map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
        let mut r = TraceReader {
            path: path.to_path_buf(),
            header: Header { version: 0, pid: 0, exe: String::new(), host: String::new(), start_unix_ns: 0, devices: vec![], group: None, group_policy: None, group_priority: None, group_holds_headroom: None },
            summary: None,
            reader: BufReader::with_capacity(1 << 18, file),
            buf: Vec::with_capacity(512),
            line_no: 0,
            bytes_read: 0,
            at_end: false,
        };
        loop {
            match r.next_line(names, skips)? {
                None => {
                    return Err(format!(
                        "{}: no trace header: expected a vramcap trace whose first line is {{\"type\":\"header\",\"version\":1,…}}",
                        path.display()
                    ));
                }
                Some(Line::Header(h)) => {
                    if h.version != 1 {
                        eprintln!("vramcap: {}: trace format version {} (this reader knows 1); reading what it understands", path.display(), h.version);
                    }
                    r.header = *h;
                    return Ok(r);
                }
                Some(_) => {
                    return Err(format!("{}: line {}: expected the trace header first (docs/trace-format.md)", path.display(), r.line_no));
                }
            }
        }
    }

    fn next_line(&mut self, names: &mut Names, skips: &mut Skips) -> Result<Option<Line>, String> {
        loop {
            self.buf.clear();
            let n = self.reader.read_until(b'\n', &mut self.buf).map_err(|e| format!("{}: read error: {e}", self.path.display()))?;
            if n == 0 {
                self.at_end = true;
                return Ok(None);
            }
            self.bytes_read += n as u64;
            self.line_no += 1;
            let line = self.buf.strip_suffix(b"\n").unwrap_or(&self.buf);
            if line.iter().all(|c| c.is_ascii_whitespace()) {
                continue;
            }
            match parse_line(line, names) {
                Ok(Line::Ignored) => continue,
                Ok(l) => return Ok(Some(l)),
                Err(why) => {
                    let truncated = !self.buf.ends_with(b"\n");
                    let why = if truncated { format!("truncated last line ({why})") } else { why };
                    skips.add(&self.path, self.line_no, why);
                }
            }
        }
    }

    /// The next event, or `None` at the end of the file. A summary line is kept, not returned.
    pub fn next_event(&mut self, names: &mut Names, skips: &mut Skips) -> Option<Event> {
        loop {
            match self.next_line(names, skips) {
                Ok(Some(Line::Event(e))) => return Some(e),
                Ok(Some(Line::Summary(s))) => self.summary = Some(s),
                Ok(Some(Line::Header(_))) => skips.add(&self.path, self.line_no, "a second header"),
                Ok(Some(Line::Ignored)) => {}
                Ok(None) => return None,
                Err(e) => {
                    // An I/O error mid-file: count it and stop this file, keep the others going.
                    skips.add(&self.path, self.line_no + 1, e);
                    return None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_and_slow_paths_agree() {
        let mut names = Names::default();
        let line = br#"{"type":"event","seq":17,"t_ns":1200345,"tid":4243,"op":"alloc","api":"cuMemAlloc_v2","dev":0,"ptr":"0x7f3a40000000","size":1048576,"result":0,"dur_ns":850,"used":5242880}"#;
        let Ok(Line::Event(a)) = parse_line(line, &mut names) else { panic!() };
        let with_nested = br#"{"type":"event","x":{"y":[1]},"seq":17,"t_ns":1200345,"tid":4243,"op":"alloc","api":"cuMemAlloc_v2","dev":0,"ptr":"0x7f3a40000000","size":1048576,"result":0,"dur_ns":850,"used":5242880}"#;
        let Ok(Line::Event(b)) = parse_line(with_nested, &mut names) else { panic!() };
        for e in [a, b] {
            assert_eq!((e.seq, e.t_ns, e.tid, e.op, e.dev, e.ptr, e.size, e.dur_ns, e.used), (17, 1200345, 4243, Op::Alloc, 0, 0x7f3a40000000, 1 << 20, 850, Some(5 << 20)));
            assert_eq!(names.get(e.api), "cuMemAlloc_v2");
        }
    }

    #[test]
    fn bad_fields_make_the_line_corrupt() {
        let mut names = Names::default();
        for l in [r#"{"type":"event","t_ns":-1,"op":"alloc"}"#, r#"{"type":"event","op":"alloc"}"#, r#"{"type":"event","t_ns":1,"op":"alloc","ptr":"zz"}"#] {
            assert!(parse_line(l.as_bytes(), &mut names).is_err(), "{l}");
        }
        assert!(matches!(parse_line(br#"{"type":"usage","x":1}"#, &mut names), Ok(Line::Ignored)));
    }
}
