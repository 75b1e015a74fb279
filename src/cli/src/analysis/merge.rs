//! Several traces as one stream: a k-way merge of per-file streams on a common clock (the wall
//! clock, `start_unix_ns + t_ns`, or per-trace offsets for what-if replays). Memory: one pending
//! event per file.

use super::trace::{Event, Names, Skips, TraceReader};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::PathBuf;

pub enum Align {
    /// Each trace at its recorded wall-clock start.
    WallClock,
    /// Trace i starts at offsets[i] ns on a common clock (missing: 0).
    Offsets(Vec<u64>),
}

pub struct Merged {
    pub readers: Vec<TraceReader>,
    pub names: Names,
    pub skips: Skips,
    /// Per trace: where its time origin sits on the merged clock.
    pub base: Vec<u64>,
    /// The merged clock's origin on the wall clock (earliest trace start).
    pub origin_unix_ns: u64,
    heap: BinaryHeap<Reverse<(u64, usize)>>,
    pending: Vec<Option<Event>>,
    progress: Option<ProgressBar>,
    count: u64,
}

/// Files at least this big get a progress bar (on a terminal only; hidden when piped).
const PROGRESS_MIN_BYTES: u64 = 32 << 20;

impl Merged {
    /// Like [`Merged::open`], but with several files one that cannot be used (missing, unreadable,
    /// no header) is left out with one line on stderr instead of ending the command: a report
    /// over `traces/*.jsonl` still describes the rest. Only when none is usable is it an error.
    /// (`replay` keeps [`Merged::open`]: a verdict without one of the jobs would be wrong.)
    pub fn open_usable(paths: &[PathBuf], align: Align) -> Result<Merged, String> {
        if paths.len() < 2 {
            return Merged::open(paths, align);
        }
        let (mut names, mut skips) = (Names::default(), Skips::default());
        let mut usable = Vec::new();
        for p in paths {
            match TraceReader::open(p, &mut names, &mut skips) {
                Ok(_) => usable.push(p.clone()),
                Err(e) => eprintln!("vramcap: skipping {e}"),
            }
        }
        if usable.is_empty() {
            return Err(format!("none of the {} trace files is usable (each is named above)", paths.len()));
        }
        Merged::open(&usable, align)
    }

    pub fn open(paths: &[PathBuf], align: Align) -> Result<Merged, String> {
        if paths.is_empty() {
            return Err("no trace files given".into());
        }
        let mut names = Names::default();
        let mut skips = Skips::default();
        let mut readers = Vec::new();
        for p in paths {
            readers.push(TraceReader::open(p, &mut names, &mut skips)?);
        }
        let origin_unix_ns = readers.iter().map(|r| r.header.start_unix_ns).min().unwrap_or(0);
        let base = match align {
            Align::WallClock => readers.iter().map(|r| r.header.start_unix_ns - origin_unix_ns).collect(),
            Align::Offsets(o) => (0..readers.len()).map(|i| o.get(i).copied().unwrap_or(0)).collect(),
        };
        let total: u64 = paths.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
        let progress = (total >= PROGRESS_MIN_BYTES).then(|| {
            let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            pb.set_style(
                ProgressStyle::with_template("{spinner} {bytes}/{total_bytes} {wide_bar} {eta} left")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            pb
        });
        let mut m = Merged { pending: readers.iter().map(|_| None).collect(), readers, names, skips, base, origin_unix_ns, heap: BinaryHeap::new(), progress, count: 0 };
        // One trace reads straight through (see `next`); several prime the heap.
        if m.readers.len() > 1 {
            for i in 0..m.readers.len() {
                m.refill(i);
            }
        }
        Ok(m)
    }

    fn refill(&mut self, i: usize) {
        if let Some(e) = self.readers[i].next_event(&mut self.names, &mut self.skips) {
            self.heap.push(Reverse((self.base[i].saturating_add(e.t_ns), i)));
            self.pending[i] = Some(e);
        }
    }

    /// The next event on the merged clock: (trace index, event, ns since the merged origin).
    #[inline]
    pub fn next(&mut self) -> Option<(usize, Event, u64)> {
        self.count += 1;
        if self.count & 0xffff == 0 {
            if let Some(pb) = &self.progress {
                pb.set_position(self.readers.iter().map(|r| r.bytes_read).sum());
            }
        }
        // One trace: no heap needed (the common case, and the benchmark's).
        if self.readers.len() == 1 {
            let e = self.readers[0].next_event(&mut self.names, &mut self.skips)?;
            return Some((0, e, self.base[0].saturating_add(e.t_ns)));
        }
        let Reverse((t, i)) = self.heap.pop()?;
        let e = self.pending[i].take()?;
        self.refill(i);
        Some((i, e, t))
    }

    /// Trace i has no more events: its reader reached the end and nothing of it is pending.
    pub fn finished(&self, i: usize) -> bool {
        self.readers[i].at_end && self.pending[i].is_none()
    }

    pub fn finish_progress(&self) {
        if let Some(pb) = &self.progress {
            pb.finish_and_clear();
        }
    }

    /// Warnings about the input that every command prints (to stderr).
    pub fn warn_input(&self) {
        for r in &self.readers {
            match &r.summary {
                None if r.at_end => eprintln!("vramcap: {}: no summary line (the process was killed or is still running); read up to the last complete line", r.path.display()),
                Some(s) if s.dropped > 0 => eprintln!("vramcap: {}: the writer dropped {} events; counts are lower bounds", r.path.display(), s.dropped),
                _ => {}
            }
        }
        if self.skips.count > 0 {
            eprintln!("vramcap: skipped {} corrupt or truncated line(s):", self.skips.count);
            for s in self.skips.first.iter().take(10) {
                eprintln!("  {}:{}: {}", s.file.display(), s.line, s.reason);
            }
            if self.skips.count > 10 {
                eprintln!("  … ({} more; `--json` lists up to {})", self.skips.count - 10, Skips::KEEP);
            }
        }
    }
}

/// `30s`, `1.5s`, `250ms`, `100us`, `10ns`, `2m`, `1h`, or a bare number of seconds → ns.
/// The longest offset or window bound a command takes (`--from`, `--to`, `--stagger`): ten years.
/// Anything longer is a typo, not a trace; it used to be clamped to the 584-year end of the clock.
pub const MAX_DURATION_NS: u64 = 10 * 365 * 24 * 3600 * 1_000_000_000;

pub fn parse_duration(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let end = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(end);
    let v: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 1.5s, 250ms, 100us, 2m, 1h or seconds"))?;
    let scale = match unit.trim() {
        "" | "s" => 1e9,
        "ms" => 1e6,
        "us" | "µs" => 1e3,
        "ns" => 1.0,
        "m" | "min" => 60e9,
        "h" => 3600e9,
        u => return Err(format!("invalid duration {s:?}: unknown unit {u:?} (use ns, us, ms, s, m, h)")),
    };
    let ns = v * scale;
    if !ns.is_finite() || ns > MAX_DURATION_NS as f64 {
        return Err(format!("invalid duration {s:?}: more than 10 years; expected an offset within a trace's span"));
    }
    Ok(ns as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations() {
        assert_eq!(super::parse_duration("1.5s"), Ok(1_500_000_000));
        assert_eq!(super::parse_duration("250ms"), Ok(250_000_000));
        assert_eq!(super::parse_duration("2"), Ok(2_000_000_000));
        assert_eq!(super::parse_duration("1h"), Ok(3_600_000_000_000));
        assert!(super::parse_duration("5 parsecs").is_err());
        // Huge values are errors, not clamped to the end of the clock.
        for huge in ["584y", "99999999999999999999", "1e300", "87601h", "18446744073709551615ns"] {
            assert!(super::parse_duration(huge).is_err(), "{huge}");
        }
        assert_eq!(super::parse_duration("87600h"), Ok(super::MAX_DURATION_NS));
    }
}
