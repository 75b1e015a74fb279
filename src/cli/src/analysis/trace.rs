//! Reading one trace file (docs/trace-format.md, version 1) as a stream of events. Memory stays
//! constant per file: one reused line buffer. Corrupt or truncated lines are skipped and recorded
//! (file and line number); unknown `type`s and fields are ignored as the format requires. The
//! lines themselves are parsed by `vramcap_common::trace`, the same definitions the library
//! writes them by.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use vramcap_common::trace::event::{Line, parse_line};

pub use vramcap_common::trace::Op;
pub use vramcap_common::trace::event::{Event, Names};
pub use vramcap_common::trace::record::{DeviceLine as DeviceInfo, GroupSummary, Header, Summary};

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
    reader: BufReader<Box<dyn Read + Send>>,
    buf: Vec<u8>,
    line_no: u64,
    /// Bytes of the file consumed so far (for progress bars: compressed bytes of a gzipped trace).
    pub bytes_read: u64,
    /// Set for a gzipped trace: the file's bytes the decoder has read (decoded lines are longer).
    compressed_read: Option<Arc<AtomicU64>>,
    /// The whole file was read (a missing summary then means the process did not finish).
    pub at_end: bool,
}

impl TraceReader {
    /// Opens a trace and reads its header (the first line that parses; earlier lines are skipped).
    pub fn open(path: &Path, names: &mut Names, skips: &mut Skips) -> Result<TraceReader, String> {
        let mut file = File::open(path).map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
        // A gzipped trace (`trace.jsonl.gz`, a rotated log) is read through a decoder: it is
        // known by its magic bytes, not its name, so a renamed one is read too.
        let mut magic = [0u8; 6];
        let got = read_prefix(&mut file, &mut magic).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let magic = &magic[..got];
        let gz = magic.starts_with(&GZIP_MAGIC);
        if let Some((what, tool)) = OTHER_COMPRESSION.iter().find(|(m, _, _)| magic.starts_with(m)).map(|(_, w, t)| (w, t)) {
            return Err(format!("{}: compressed with {what}, which vramcap does not read; expected a JSON Lines trace or a gzipped one (decompress it first: {tool})", path.display()));
        }
        use std::io::Seek;
        file.rewind().map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let (inner, compressed_read): (Box<dyn Read + Send>, _) = if gz {
            let n = Arc::new(AtomicU64::new(0));
            let counted = Counted { inner: file, n: n.clone() };
            (Box::new(flate2::read::MultiGzDecoder::new(BufReader::with_capacity(1 << 16, counted))), Some(n))
        } else {
            (Box::new(file), None)
        };
        let mut r = TraceReader {
            path: path.to_path_buf(),
            header: Header::empty(),
            summary: None,
            reader: BufReader::with_capacity(1 << 18, inner),
            buf: Vec::with_capacity(512),
            line_no: 0,
            bytes_read: 0,
            compressed_read,
            at_end: false,
        };
        // `next_line` skips corrupt lines: the first line it returns must be the header.
        match r.next_line(names, skips)? {
            None => Err(format!(
                "{}: no trace header: expected a vramcap trace whose first line is {{\"type\":\"header\",\"version\":1,…}}",
                path.display()
            )),
            Some(Line::Header(h)) => {
                if h.version != 1 {
                    eprintln!("vramcap: {}: trace format version {} (this reader knows 1); reading what it understands", path.display(), h.version);
                }
                r.header = *h;
                Ok(r)
            }
            Some(_) => Err(format!("{}: line {}: expected the trace header first (docs/trace-format.md)", path.display(), r.line_no)),
        }
    }

    fn next_line(&mut self, names: &mut Names, skips: &mut Skips) -> Result<Option<Line>, String> {
        loop {
            self.buf.clear();
            let n = self.reader.read_until(b'\n', &mut self.buf).map_err(|e| self.read_error(e))?;
            if n == 0 {
                self.at_end = true;
                return Ok(None);
            }
            self.bytes_read = match &self.compressed_read {
                Some(c) => c.load(Ordering::Relaxed),
                None => self.bytes_read + n as u64,
            };
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

    fn read_error(&self, e: std::io::Error) -> String {
        if self.compressed_read.is_some() {
            format!("{}: gzipped trace: cannot decompress: {e}", self.path.display())
        } else {
            format!("{}: read error: {e}", self.path.display())
        }
    }

    /// The next event, or `None` at the end of the file. A summary line is kept, not returned.
    pub fn next_event(&mut self, names: &mut Names, skips: &mut Skips) -> Option<Event> {
        loop {
            match self.next_line(names, skips) {
                Ok(Some(Line::Event(e))) => return Some(e),
                Ok(Some(Line::Summary(s))) => self.summary = Some(*s),
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

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// Compressions a trace may arrive in that are named rather than read: (magic, name, how to undo it).
const OTHER_COMPRESSION: [(&[u8], &str, &str); 3] = [
    (&[0x28, 0xb5, 0x2f, 0xfd], "zstd", "zstd -d FILE"),
    (&[0xfd, b'7', b'z', b'X', b'Z', 0], "xz", "xz -d FILE"),
    (b"BZh", "bzip2", "bunzip2 FILE"),
];

/// Up to `buf.len()` bytes from the start (fewer only at the end of the file).
fn read_prefix(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// A file that counts the bytes read from it (a gzipped trace's progress).
struct Counted {
    inner: File,
    n: Arc<AtomicU64>,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
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
}
