//! The writer thread: drains every thread's ring, formats the lines into one buffer and hands it,
//! in large blocks, to the I/O thread that writes the file. Both block every signal (a file-size
//! limit then yields EFBIG instead of killing the job), never call CUDA, and never make an
//! allocating thread wait. At least twice a second a block goes out, so a killed process loses at
//! most the last second; a write error (full disk, file too large) stops writing, counts what was
//! lost as dropped and warns once. Without a trace file it only feeds the sidecar connection,
//! which it also drives ([`super::sidecar`]).
//!
//! Writing happens on its own thread so that a slow file never stops the draining: truncating a
//! large previous trace, dirty-page throttling or a stalled reader of a FIFO can each hold
//! `write()` for tens of milliseconds, longer than a thread's ring lasts at a million events per
//! second. Up to [`QUEUED_BLOCKS`] blocks wait for the disk; beyond that a block is dropped and
//! counted, never waited for.

use super::format::{self, Summary};
use super::sidecar::Sidecar;
use crate::clock::Calibration;
use crate::events::{self, Record, ThreadBuf};
use crossbeam_channel::{Receiver, Sender, TrySendError};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Write when this much is buffered, even within the second.
const BLOCK: usize = 256 * 1024;
const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// Idle sleeps grow to this; at 1 M events/s from one thread its buffer (16 384) fills in 16 ms.
const MAX_IDLE_SLEEP: Duration = Duration::from_millis(4);
/// Blocks (of about [`BLOCK`] bytes) waiting for the disk: 16 MiB, ~150 000 events.
pub const QUEUED_BLOCKS: usize = 64;
/// At exit, how long the last blocks may wait for the disk (the `atexit` handler waits 5 s in all).
const EXIT_WAIT: Duration = Duration::from_secs(3);

/// Formatted lines on their way to the file, and how many events they hold.
struct Block {
    bytes: Vec<u8>,
    events: u64,
}

/// The I/O thread's end of the file.
struct Io {
    tx: Option<Sender<Block>>,
    /// Written blocks come back for reuse (no allocation and page faults per block).
    spare: Receiver<Vec<u8>>,
    /// Set by the I/O thread after a write error: stop formatting for the file.
    failed: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Blocks handed to the I/O thread, and those it has finished with (written, or counted as
    /// dropped after a write error): at exit the summary waits for the two to meet, or the
    /// events of blocks still queued behind a failed write go uncounted.
    sent: u64,
    done: Arc<AtomicU64>,
    /// A block was refused because the queue was full (warned once).
    overflowed: bool,
}

pub struct Writer {
    io: Option<Io>,
    path: String,
    buf: Vec<u8>,
    /// Events in `buf` not yet handed to the I/O thread.
    buffered_events: u64,
    /// Set when the process exits: until then blocks wait for room in the queue.
    exiting: Option<Instant>,
    origin_mono_ns: u64,
    last_flush: Instant,
    calibration: Calibration,
    threads: Vec<&'static ThreadBuf>,
    sidecar: Option<Sidecar>,
}

impl Writer {
    /// `fd`: the trace file, opened but not yet truncated (-1: none). The I/O thread truncates it
    /// (which can take long for a large previous trace) while this thread already drains.
    pub fn new(fd: i32, path: String, origin_mono_ns: u64, sidecar: Option<Sidecar>) -> Writer {
        let io = (fd >= 0).then(|| spawn_io(fd, path.clone()));
        Writer {
            io,
            path,
            buf: Vec::with_capacity(BLOCK + 4096),
            buffered_events: 0,
            exiting: None,
            origin_mono_ns,
            last_flush: Instant::now(),
            calibration: Calibration::new(&super::lifetime::idle),
            threads: Vec::new(),
            sidecar,
        }
    }

    pub fn line(&mut self, v: &impl serde::Serialize) {
        format::json_line(&mut self.buf, v);
    }

    /// Whether lines still go to a file.
    fn to_file(&self) -> bool {
        self.io.as_ref().is_some_and(|io| io.tx.is_some() && !io.failed.load(Ordering::Relaxed))
    }

    fn event(&mut self, r: &Record) {
        let to_file = self.to_file();
        if !to_file && self.sidecar.is_none() {
            events::add_dropped(1);
            return;
        }
        let t_ns = self.calibration.to_ns(r.at).saturating_sub(self.origin_mono_ns);
        // A `would_deny` carries its cap's charge in bytes there, not a duration.
        let dur_ns = if r.ev.op == events::Op::WouldDeny { r.ev.dur } else { self.calibration.span_ns(r.ev.dur) };
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
            if self.io.is_some() {
                events::add_dropped(1);
            }
        }
    }

    fn poll_sidecar(&mut self) {
        if let Some(s) = self.sidecar.as_mut() {
            s.poll();
        }
    }

    /// Hands what is buffered to the I/O thread. While the process runs this never waits: a full
    /// queue drops the block. At exit (`exiting` set) it waits for room until a deadline, so the
    /// last events and the summary are not lost to a disk that is merely slow.
    pub fn flush(&mut self) {
        self.last_flush = Instant::now();
        self.calibration.refresh();
        let events = std::mem::take(&mut self.buffered_events);
        if self.buf.is_empty() {
            return;
        }
        let fresh = self.io.as_ref().and_then(|io| io.spare.try_recv().ok()).unwrap_or_else(|| Vec::with_capacity(BLOCK + 4096));
        let bytes = std::mem::replace(&mut self.buf, fresh);
        let Some(io) = self.io.as_mut().filter(|io| !io.failed.load(Ordering::Relaxed)) else {
            events::add_dropped(events);
            return;
        };
        let Some(tx) = io.tx.as_ref() else { return };
        let block = Block { bytes, events };
        let sent = match self.exiting {
            Some(deadline) => tx.send_deadline(block, deadline).map_err(|e| match e {
                crossbeam_channel::SendTimeoutError::Timeout(b) => TrySendError::Full(b),
                crossbeam_channel::SendTimeoutError::Disconnected(b) => TrySendError::Disconnected(b),
            }),
            // Lossless: wait for the disk rather than drop (the rings then fill and the job's
            // threads wait in turn: the trade-off this mode is for).
            None if events::lossless() => tx.send(block).map_err(|e| TrySendError::Disconnected(e.0)),
            None => tx.try_send(block),
        };
        match sent {
            Ok(()) => io.sent += 1,
            Err(TrySendError::Full(b)) => {
                events::add_dropped(b.events);
                if !io.overflowed {
                    io.overflowed = true;
                    crate::log::write_line(&format!(
                        "vramcap: trace {}: the file cannot keep up; events are dropped and counted, the job continues",
                        self.path
                    ));
                }
            }
            Err(TrySendError::Disconnected(b)) => events::add_dropped(b.events),
        }
    }

    /// Moves every thread's published records into `batch`.
    fn collect(&mut self, batch: &mut Vec<Record>) {
        events::buffers(&mut self.threads);
        for t in &self.threads {
            t.drain(batch);
        }
    }

    /// Collects and writes until `stop()` says so, then drains once more.
    pub fn run(&mut self, stop: impl Fn() -> bool) {
        let mut batch: Vec<Record> = Vec::with_capacity(events::THREAD_CAPACITY);
        let mut sleep = Duration::from_micros(200);
        loop {
            let stopping = stop();
            if stopping && self.exiting.is_none() {
                self.exiting = Some(Instant::now() + EXIT_WAIT);
            }
            self.collect(&mut batch);
            self.poll_sidecar();
            if batch.is_empty() {
                if stopping {
                    return;
                }
                if !self.buf.is_empty() && self.last_flush.elapsed() >= FLUSH_EVERY {
                    self.flush();
                }
                // Cut short by exit(): the process's end is not delayed by our sleep.
                super::lifetime::idle(sleep);
                sleep = (sleep * 2).min(MAX_IDLE_SLEEP);
                continue;
            }
            sleep = Duration::from_micros(200);
            events::number(&mut batch);
            for r in &batch {
                self.event(r);
                // Blocks stay near BLOCK bytes even when a drain brings 100 000 events: the
                // queue's memory bound (QUEUED_BLOCKS × BLOCK) holds only if they do.
                if self.buf.len() >= BLOCK {
                    self.flush();
                }
            }
            batch.clear();
            self.poll_sidecar();
            if self.buf.len() >= BLOCK || self.last_flush.elapsed() >= FLUSH_EVERY {
                self.flush();
            }
            if stopping {
                // One drain after the exit began holds every event that happened before it.
                // Threads still allocating during `exit()` would keep the rings from ever being
                // seen empty: waiting for that ran out the `atexit` handler's 5 s and the process
                // ended with no summary, often in a cut line. Their later events are neither
                // numbered nor counted, so the summary's `events - dropped` still equals the lines.
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
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
        self.exiting.get_or_insert(Instant::now() + EXIT_WAIT);
        if self.to_file() {
            self.line(summary);
        }
        self.flush();
        if let Some(s) = self.sidecar.as_mut() {
            s.finish(summary);
        }
    }

    /// Hands over what is buffered and waits (until the exit deadline) for the I/O thread to
    /// finish every block it was given, so that the events a failed write left behind are
    /// counted before the summary is: "the events that could not be written are counted" holds
    /// at exit too (a full disk and an exit right after it used to miss up to a block's worth).
    pub fn settle(&mut self) {
        let deadline = *self.exiting.get_or_insert(Instant::now() + EXIT_WAIT);
        self.flush();
        let Some(io) = self.io.as_ref().filter(|io| io.thread.is_some()) else { return };
        while io.done.load(Ordering::Acquire) < io.sent && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Lets the I/O thread write what is queued, close the file and finish.
    pub fn close(&mut self) {
        if let Some(mut io) = self.io.take() {
            drop(io.tx.take());
            if let Some(t) = io.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn spawn_io(fd: i32, path: String) -> Io {
    let (tx, rx) = crossbeam_channel::bounded::<Block>(QUEUED_BLOCKS);
    let (back, spare) = crossbeam_channel::bounded::<Vec<u8>>(4);
    let failed = Arc::new(AtomicBool::new(false));
    let flag = failed.clone();
    let done = Arc::new(AtomicU64::new(0));
    let finished = done.clone();
    // Spawned from the writer thread, so it inherits its fully blocked signal mask.
    let thread = std::thread::Builder::new()
        .name("vramcap-io".into())
        .stack_size(128 * 1024)
        .spawn(move || io_main(fd, &path, rx, &back, &flag, &finished));
    match thread {
        Ok(t) => Io { tx: Some(tx), spare, failed, thread: Some(t), sent: 0, done, overflowed: false },
        Err(_) => {
            // No thread: nothing will be written (counted as dropped, like a full disk).
            unsafe { libc::close(fd) };
            failed.store(true, Ordering::Relaxed);
            Io { tx: None, spare, failed, thread: None, sent: 0, done, overflowed: false }
        }
    }
}

/// The I/O thread: truncates the file, then writes blocks in order until the writer hangs up.
fn io_main(fd: i32, path: &str, rx: Receiver<Block>, back: &Sender<Vec<u8>>, failed: &AtomicBool, done: &AtomicU64) {
    let fd = fresh_file(fd, path);
    for mut block in rx.iter() {
        if failed.load(Ordering::Relaxed) {
            events::add_dropped(block.events);
            done.fetch_add(1, Ordering::Release);
            continue;
        }
        if let Err((written, err)) = crate::log::write_all(fd, &block.bytes) {
            // Full disk, quota, file-size limit: stop, count, say so once. (A removed directory
            // is no error: the open file still takes writes.)
            // Only whole lines were handed to write(), so the file ends at most in one cut line.
            failed.store(true, Ordering::Relaxed);
            let written_lines = block.bytes[..written].iter().filter(|&&b| b == b'\n').count() as u64;
            let total_lines = block.bytes.iter().filter(|&&b| b == b'\n').count() as u64;
            events::add_dropped((total_lines - written_lines).min(block.events));
            crate::log::write_line(&format!(
                "vramcap: trace {path} stopped: {err}; further events are counted as dropped, the job continues"
            ));
        }
        done.fetch_add(1, Ordering::Release);
        // Only blocks of the usual size are worth keeping.
        if block.bytes.capacity() <= 2 * BLOCK {
            block.bytes.clear();
            let _ = back.try_send(block.bytes);
        }
    }
    unsafe { libc::close(fd) };
}

/// Previous traces at least this large are replaced rather than truncated (see [`fresh_file`]).
const REPLACE_FROM_BYTES: i64 = 64 << 20;

/// Empties the trace file `fd` (opened on `path`, not truncated) and returns the descriptor to
/// write to. Truncating a previous trace of a gigabyte takes the kernel a third of a second (its
/// blocks are freed on the spot): long enough to fill the queue at a million events per second.
/// So a large regular file with one link is replaced instead: a new file with the same mode is
/// created beside it and renamed over it, and the old one (still open here, so nothing is freed
/// yet) is closed by a short-lived thread of its own. A smaller one is truncated in place, which
/// also keeps its owner and mode; so is anything we cannot replace (a symlink, a directory we may
/// not create files in). A FIFO or a terminal is left as it is.
fn fresh_file(fd: i32, path: &str) -> i32 {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || (st.st_mode & libc::S_IFMT) != libc::S_IFREG || st.st_size == 0 {
        return fd;
    }
    let link_is_file = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file());
    if link_is_file && st.st_nlink == 1 && st.st_size >= REPLACE_FROM_BYTES {
        let tmp = format!("{path}.vramcap-{}.tmp", unsafe { libc::getpid() });
        if let Ok(c_tmp) = std::ffi::CString::new(tmp.as_str())
            && let Ok(c_path) = std::ffi::CString::new(path)
        {
            let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC;
            let new = unsafe { libc::open(c_tmp.as_ptr(), flags, 0o600) };
            if new >= 0 {
                unsafe { libc::fchmod(new, st.st_mode & 0o7777) };
                if unsafe { libc::rename(c_tmp.as_ptr(), c_path.as_ptr()) } == 0 {
                    // The new file is in use like the old one (create.rs: processes starting now
                    // must not take it over).
                    unsafe { libc::flock(new, libc::LOCK_EX | libc::LOCK_NB) };
                    let old = fd;
                    let closer = std::thread::Builder::new().name("vramcap-unlink".into()).stack_size(64 * 1024);
                    // Freeing a large file's pages is CPU work: at the lowest priority it never
                    // competes with the writer.
                    let close_quietly = move || unsafe {
                        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
                        libc::close(old);
                    };
                    if closer.spawn(close_quietly).is_err() {
                        unsafe { libc::close(old) };
                    }
                    return new;
                }
                unsafe {
                    libc::close(new);
                    libc::unlink(c_tmp.as_ptr());
                }
            }
        }
    }
    unsafe { libc::ftruncate(fd, 0) };
    fd
}
