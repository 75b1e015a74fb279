//! The `event` line, both ways. The writer formats it by hand into a reused buffer (the writer
//! thread formats millions of them and must not allocate per line); the reader scans it in one
//! pass ([`super::scan`]) and falls back to serde_json for a line the scanner declines
//! (escapes, nested unknown fields). Any line of another `type` is parsed here too, so a reader
//! has one entry point: [`parse_line`].

use super::Op;
use super::record::{Header, Summary};
use super::scan::{self, ScanError, Val};
use serde::Deserialize;

/// One event as written: every field of the line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EventLine<'a> {
    pub seq: u64,
    /// Nanoseconds since the trace's time origin.
    pub t_ns: u64,
    pub tid: u64,
    pub op: Op,
    /// The entry point's exported name.
    pub api: &'a str,
    /// Device ordinal, -1 when none applies.
    pub dev: i32,
    /// Device pointer, or the handle for VMM; 0 for a deny.
    pub ptr: u64,
    pub size: u64,
    pub result: i64,
    pub dur_ns: u64,
    pub used: u64,
    /// Group members only: the group's charge on the device after the call.
    pub group_used: Option<u64>,
}

fn push_u64(buf: &mut Vec<u8>, mut v: u64) {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    buf.extend_from_slice(&tmp[i..]);
}

fn push_i64(buf: &mut Vec<u8>, v: i64) {
    if v < 0 {
        buf.push(b'-');
    }
    push_u64(buf, v.unsigned_abs());
}

fn push_hex(buf: &mut Vec<u8>, v: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    buf.extend_from_slice(b"\"0x");
    if v == 0 {
        buf.push(b'0');
    } else {
        let start = (15 - v.leading_zeros() / 4) as i32;
        for shift in (0..=start).rev() {
            buf.push(DIGITS[((v >> (shift * 4)) & 0xf) as usize]);
        }
    }
    buf.push(b'"');
}

/// Appends one `{"type":"event",...}` line. `api` is written as it is: the library's names are
/// plain identifiers, which need no JSON escaping.
pub fn write(buf: &mut Vec<u8>, e: &EventLine) {
    buf.extend_from_slice(b"{\"type\":\"event\",\"seq\":");
    push_u64(buf, e.seq);
    buf.extend_from_slice(b",\"t_ns\":");
    push_u64(buf, e.t_ns);
    buf.extend_from_slice(b",\"tid\":");
    push_u64(buf, e.tid);
    buf.extend_from_slice(b",\"op\":\"");
    buf.extend_from_slice(e.op.name().as_bytes());
    buf.extend_from_slice(b"\",\"api\":\"");
    buf.extend_from_slice(e.api.as_bytes());
    buf.extend_from_slice(b"\",\"dev\":");
    push_i64(buf, e.dev as i64);
    buf.extend_from_slice(b",\"ptr\":");
    push_hex(buf, e.ptr);
    buf.extend_from_slice(b",\"size\":");
    push_u64(buf, e.size);
    buf.extend_from_slice(b",\"result\":");
    push_i64(buf, e.result);
    buf.extend_from_slice(b",\"dur_ns\":");
    push_u64(buf, e.dur_ns);
    buf.extend_from_slice(b",\"used\":");
    push_u64(buf, e.used);
    if let Some(g) = e.group_used {
        buf.extend_from_slice(b",\"group_used\":");
        push_u64(buf, g);
    }
    if e.op == Op::Limit {
        // The same values under their own names (see `Op::Limit`).
        buf.extend_from_slice(b",\"old\":");
        push_u64(buf, e.ptr);
        buf.extend_from_slice(b",\"new\":");
        push_u64(buf, e.size);
        buf.extend_from_slice(b",\"uid\":");
        push_i64(buf, e.result);
        buf.extend_from_slice(b",\"source\":\"");
        buf.extend_from_slice(e.api.as_bytes());
        buf.push(b'"');
    }
    if e.op == Op::WouldDeny {
        // The same values under their own names (see `Op::WouldDeny`).
        buf.extend_from_slice(b",\"cap\":\"");
        buf.extend_from_slice(super::WouldDenyCap::from_result(e.result).map_or("unknown", |c| c.name()).as_bytes());
        buf.extend_from_slice(b"\",\"limit\":");
        push_u64(buf, e.ptr);
        buf.extend_from_slice(b",\"charge\":");
        push_u64(buf, e.dur_ns);
    }
    buf.extend_from_slice(b"}\n");
}

/// One event as read. Strings are interned ([`Names`]) so events are small and `Copy`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    pub seq: u64,
    pub t_ns: u64,
    pub tid: u64,
    pub op: Op,
    /// Interned `op` text (kept for exports that write it back, an unknown op among them).
    pub op_name: u16,
    pub api: u16,
    pub dev: i32,
    pub ptr: u64,
    pub size: u64,
    pub result: i64,
    pub dur_ns: u64,
    /// The device's charge after the call; `None` if the line lacks it.
    pub used: Option<u64>,
    pub group_used: Option<u64>,
}

/// Interned strings (api and op names): a handful of distinct values across millions of lines.
/// A crafted trace (the sidecar's `--trace-dir` files hold clients' lines as received) may carry
/// a new name on every line: the table is bounded ([`Names::MAX`] names of at most
/// [`Names::MAX_LEN`] bytes; the rest share one [`Names::OTHER`] entry) and indexed, so a line
/// costs the same whatever came before it.
#[derive(Default)]
pub struct Names {
    names: Vec<String>,
    /// The first names as written (before [`super::printable`]): a real trace's lines all hit
    /// these, compared without hashing.
    first: Vec<Box<[u8]>>,
    index: std::collections::HashMap<Box<[u8]>, u16>,
    other: Option<u16>,
}

impl Names {
    /// Distinct names kept (the library emits about a hundred api and op names).
    pub const MAX: usize = 1024;
    /// The longest name kept (the library's longest is under 40 bytes).
    pub const MAX_LEN: usize = 128;
    /// What every name past those bounds reads as.
    pub const OTHER: &'static str = "(other)";
    const FIRST: usize = 8;

    pub fn intern(&mut self, s: &[u8]) -> u16 {
        if let Some(i) = self.first.iter().position(|n| **n == *s) {
            return i as u16;
        }
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        if s.len() > Self::MAX_LEN || self.names.len() >= Self::MAX {
            return self.other();
        }
        // Printed by report and replay: a crafted name never reaches a terminal as escapes.
        self.push(s, super::printable(&String::from_utf8_lossy(s)))
    }

    fn push(&mut self, raw: &[u8], shown: String) -> u16 {
        let i = self.names.len() as u16;
        self.names.push(shown);
        if self.first.len() < Self::FIRST {
            self.first.push(raw.into());
        } else {
            self.index.insert(raw.into(), i);
        }
        i
    }

    fn other(&mut self) -> u16 {
        match self.other {
            Some(i) => i,
            None => {
                // One slot past MAX at most: the shared entry itself.
                let i = self.push(b"\0(other)", Self::OTHER.to_string());
                self.other = Some(i);
                i
            }
        }
    }

    pub fn get(&self, id: u16) -> &str {
        self.names.get(id as usize).map(|s| s.as_str()).unwrap_or("?")
    }

    /// How many names are kept (bounded by [`Names::MAX`] + 1).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

#[cfg(test)]
mod names_tests {
    use super::Names;

    /// 100 000 distinct (and some over-long) names: the table stays bounded, the library's
    /// names keep their own entries, and the rest read as one `(other)`.
    #[test]
    fn a_new_name_on_every_line_keeps_the_table_bounded() {
        let mut n = Names::default();
        let a = n.intern(b"cuMemAlloc_v2");
        for i in 0..100_000 {
            n.intern(format!("api{i:07}").as_bytes());
        }
        let long = n.intern(&[b'x'; 4096]);
        assert!(n.len() <= Names::MAX + 1, "{} names kept", n.len());
        assert_eq!((n.intern(b"cuMemAlloc_v2"), n.get(a)), (a, "cuMemAlloc_v2"));
        let (late, early) = (n.intern(b"api0099999"), n.intern(b"api0000005"));
        assert_eq!((n.get(long), n.get(late)), (Names::OTHER, Names::OTHER));
        assert_eq!(n.get(early), "api0000005", "names seen before the table filled keep theirs");
    }

    /// A name that must be escaped for printing is found again by its bytes as written (it was
    /// compared in its printed form, so every line of it added an entry).
    #[test]
    fn a_name_shown_escaped_is_interned_once() {
        let mut n = Names::default();
        let a = n.intern(b"cu\x1bMem");
        let b = n.intern(b"cu\x1bMem");
        assert_eq!((a, n.len()), (b, 1));
    }
}

/// A parsed line.
pub enum Line {
    Event(Event),
    Header(Box<Header>),
    Summary(Box<Summary>),
    /// A line of a `type` this reader does not know (or does not read: `usage`): ignored.
    Ignored,
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
    #[serde(default)]
    group_used: Option<u64>,
}

fn no_dev() -> i32 {
    -1
}

/// Parses one line (without its `\n`). `Err` names what is wrong; the caller skips the line.
pub fn parse_line(line: &[u8], names: &mut Names) -> Result<Line, String> {
    let mut ty: Option<&[u8]> = None;
    let mut e = Event {
        seq: 0,
        t_ns: u64::MAX,
        tid: 0,
        op: Op::Other,
        op_name: u16::MAX,
        api: u16::MAX,
        dev: -1,
        ptr: 0,
        size: 0,
        result: 0,
        dur_ns: 0,
        used: None,
        group_used: None,
    };
    let mut bad: Option<&'static str> = None;
    let mut have_op = false;
    let scanned = scan::scan(line, |k, v| {
        let num = |v: Val| if let Val::Num(n) = v { scan::uint(n) } else { None };
        match k {
            b"type" => ty = if let Val::Str(s) = v { Some(s) } else { None },
            b"t_ns" => e.t_ns = num(v).unwrap_or_else(|| {
                bad = Some("t_ns is not an unsigned integer");
                0
            }),
            b"seq" => e.seq = num(v).unwrap_or(0),
            b"tid" => e.tid = num(v).unwrap_or(0),
            b"size" => e.size = num(v).unwrap_or_else(|| {
                bad = Some("size is not an unsigned integer");
                0
            }),
            b"dur_ns" => e.dur_ns = num(v).unwrap_or(0),
            b"used" => e.used = num(v),
            b"group_used" => e.group_used = num(v),
            b"dev" => match v {
                Val::Num(n) => e.dev = scan::int(n).and_then(|d| i32::try_from(d).ok()).unwrap_or(-1),
                _ => e.dev = -1,
            },
            b"result" => e.result = if let Val::Num(n) = v { scan::int(n).unwrap_or(0) } else { 0 },
            b"ptr" => match v {
                Val::Str(s) => e.ptr = scan::hex(s).unwrap_or_else(|| {
                    bad = Some("ptr is not a \"0x…\" string");
                    0
                }),
                _ => e.ptr = 0,
            },
            b"op" => {
                if let Val::Str(s) = v {
                    have_op = true;
                    e.op = Op::parse(s);
                    e.op_name = names.intern(s);
                }
            }
            b"api" => {
                if let Val::Str(s) = v {
                    e.api = names.intern(s);
                }
            }
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
        "summary" => Ok(Line::Summary(Box::new(Summary::deserialize(&v).map_err(|e| format!("bad summary: {e}"))?))),
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
                op: Op::parse(s.op.as_bytes()),
                op_name: names.intern(s.op.as_bytes()),
                api: names.intern(s.api.as_bytes()),
                dev: s.dev,
                ptr,
                size: s.size,
                result: s.result,
                dur_ns: s.dur_ns,
                used: s.used,
                group_used: s.group_used,
            }))
        }
        _ => Ok(Line::Ignored),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_pointers() {
        let mut buf = Vec::new();
        push_hex(&mut buf, 0);
        push_hex(&mut buf, 0xf);
        push_hex(&mut buf, 0x10);
        push_hex(&mut buf, u64::MAX);
        assert_eq!(String::from_utf8(buf).unwrap(), "\"0x0\"\"0xf\"\"0x10\"\"0xffffffffffffffff\"");
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
