//! The writer thread: swaps every thread's filled event buffer for an empty one, formats the lines
//! into one buffer and writes it in large blocks. It blocks every signal (a file-size limit then yields EFBIG instead of killing the job),
//! never calls CUDA, and never makes an allocating thread wait. At least once a second it flushes,
//! so a killed process loses at most the last second; a write error (full disk, file too large)
//! stops writing, counts what was lost as dropped and warns once. Without a trace file (`fd` -1)
//! it only feeds the sidecar connection, which it also drives ([`super::sidecar`]).

use super::format::{self, Summary};
use super::sidecar::Sidecar;
use crate::clock::Calibration;
use crate::events::{self, Record, ThreadBuf};
use std::time::{Duration, Instant};

/// Write when this much is buffered, even within the second.
const BLOCK: usize = 256 * 1024;
const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// Idle sleeps grow to this; at 1 M events/s from one thread its buffer (16 384) fills in 16 ms.
const MAX_IDLE_SLEEP: Duration = Duration::from_millis(4);

pub struct Writer {
    fd: i32,
    path: String,
    buf: Vec<u8>,
    /// Events in `buf` not yet written (counted as dropped if the write fails).
    buffered_events: u64,
    failed: bool,
    origin_mono_ns: u64,
    last_flush: Instant,
    calibration: Calibration,
    threads: Vec<&'static ThreadBuf>,
    sidecar: Option<Sidecar>,
}

impl Writer {
    pub fn new(fd: i32, path: String, origin_mono_ns: u64, sidecar: Option<Sidecar>) -> Writer {
        Writer {
            fd,
            path,
            buf: Vec::with_capacity(BLOCK + 4096),
            buffered_events: 0,
            failed: false,
            origin_mono_ns,
            last_flush: Instant::now(),
            calibration: Calibration::new(),
            threads: Vec::new(),
            sidecar,
        }
    }

    pub fn line(&mut self, v: &impl serde::Serialize) {
        format::json_line(&mut self.buf, v);
    }

    fn event(&mut self, r: &Record) {
        let to_file = self.fd >= 0 && !self.failed;
        if !to_file && self.sidecar.is_none() {
            events::add_dropped(1);
            return;
        }
        let t_ns = self.calibration.to_ns(r.at).saturating_sub(self.origin_mono_ns);
        let dur_ns = self.calibration.span_ns(r.ev.dur);
        // Formatted once, at the end of the file buffer; the sidecar gets a copy of the line.
        let start = self.buf.len();
        format::event_line(&mut self.buf, r, t_ns, dur_ns);
        if let Some(s) = self.sidecar.as_mut() {
            s.event(r, &self.buf[start..]);
        }
        if to_file {
            self.buffered_events += 1;
        } else {
            self.buf.truncate(start);
            if self.fd >= 0 {
                events::add_dropped(1);
            }
        }
    }

    fn poll_sidecar(&mut self) {
        if let Some(s) = self.sidecar.as_mut() {
            s.poll();
        }
    }

    pub fn flush(&mut self) {
        self.last_flush = Instant::now();
        self.calibration.refresh();
        if self.failed || self.buf.is_empty() {
            self.buf.clear();
            return;
        }
        let mut off = 0;
        while off < self.buf.len() {
            let n = unsafe { libc::write(self.fd, self.buf[off..].as_ptr().cast(), self.buf.len() - off) };
            if n > 0 {
                off += n as usize;
                continue;
            }
            let err = std::io::Error::last_os_error();
            if n < 0 && err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // Full disk, quota, file-size limit, removed directory: stop, count, say so once.
            // Only whole lines were handed to write(), so the file ends at most in one cut line.
            self.failed = true;
            let written_lines = self.buf[..off].iter().filter(|&&b| b == b'\n').count() as u64;
            let total_lines = self.buf.iter().filter(|&&b| b == b'\n').count() as u64;
            let lost_events = (total_lines - written_lines).min(self.buffered_events);
            events::add_dropped(lost_events);
            crate::log::write_line(&format!(
                "vramcap: trace {} stopped: {err}; further events are counted as dropped, the job continues",
                self.path
            ));
            break;
        }
        self.buf.clear();
        self.buffered_events = 0;
    }

    /// Moves every thread's published records into `batch`.
    fn collect(&mut self, batch: &mut Vec<Record>) {
        events::buffers(&mut self.threads);
        for t in &self.threads {
            t.drain(batch);
        }
    }

    /// Collects and writes until `stop()` says so, then drains what is left.
    pub fn run(&mut self, stop: impl Fn() -> bool) {
        let mut batch: Vec<Record> = Vec::with_capacity(events::THREAD_CAPACITY);
        let mut sleep = Duration::from_micros(200);
        loop {
            let stopping = stop();
            self.collect(&mut batch);
            self.poll_sidecar();
            if batch.is_empty() {
                if stopping {
                    return;
                }
                if !self.buf.is_empty() && self.last_flush.elapsed() >= FLUSH_EVERY {
                    self.flush();
                }
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(MAX_IDLE_SLEEP);
                continue;
            }
            sleep = Duration::from_micros(200);
            events::number(&mut batch);
            for r in &batch {
                self.event(r);
            }
            batch.clear();
            self.poll_sidecar();
            if self.buf.len() >= BLOCK || self.last_flush.elapsed() >= FLUSH_EVERY {
                self.flush();
            }
            if !stopping {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Collects and counts as dropped (when there is nowhere to write).
    pub fn discard(&mut self) {
        let mut batch = Vec::new();
        self.collect(&mut batch);
        events::number(&mut batch);
        events::add_dropped(batch.len() as u64);
    }

    pub fn summary(&mut self, summary: &Summary) {
        if self.fd >= 0 && !self.failed {
            self.line(summary);
        }
        self.flush();
        if let Some(s) = self.sidecar.as_mut() {
            s.finish(summary);
        }
    }

    pub fn close(&mut self) {
        if self.fd >= 0 {
            unsafe { libc::close(self.fd) };
            self.fd = -1;
        }
    }
}
