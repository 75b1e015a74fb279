//! `VRAMCAP_SIDECAR=PATH`: streams this process's trace lines to the node's sidecar over a Unix
//! socket (docs/sidecar-protocol.md).
//!
//! Everything here runs on the writer thread: allocating threads never see the socket. Sends are
//! non-blocking into a bounded buffer; what does not fit, or arrives while there is no
//! connection, is dropped and counted. A missing or restarted sidecar is retried with a backoff
//! capped at 5 s, and every (re)connection starts with a fresh header and a usage snapshot, so
//! the sidecar's numbers are right again without the events it missed.

use super::format::{self, AllocCount, DeviceUsage, Summary, Usage};
use crate::events::{self, Op, Record};
use crate::ledger;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Version of docs/sidecar-protocol.md, sent in the header as `protocol`.
pub const PROTOCOL: u32 = 1;
/// Bytes waiting for the socket; beyond this, event lines are dropped and counted.
pub const BUFFER_CAP: usize = 1 << 20;
pub const USAGE_EVERY: Duration = Duration::from_secs(1);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A connection that lived this long resets the backoff (one that the sidecar closes at once,
/// e.g. because it is full, keeps backing off).
const STABLE: Duration = Duration::from_secs(5);
/// How long the summary may take to leave at exit.
const FINAL_FLUSH: Duration = Duration::from_millis(500);

/// The connected socket, so that a forked child can close its inherited copy: otherwise the
/// sidecar would only see the parent exit once every child had exited too.
static FD: AtomicI32 = AtomicI32::new(-1);

/// In a forked child (fork handler: `close` is async-signal-safe).
pub fn close_inherited_in_child() {
    let fd = FD.swap(-1, Ordering::Relaxed);
    if fd >= 0 {
        unsafe { libc::close(fd) };
    }
}

/// What the writer counted from every event it drained, whether or not it reached the sidecar.
#[derive(Default)]
struct Tally {
    allocs: Vec<(usize, i32, u64)>,
    denied: Vec<u64>,
    /// Observe mode's would-be denials, counted as `denied` is: from the events the sidecar is
    /// sent, so a snapshot never counts one whose event comes after it.
    would_deny: Vec<u64>,
}

impl Tally {
    fn note(&mut self, r: &Record) {
        match r.ev.op {
            Op::Alloc => {
                let key = (r.ev.api as usize, r.ev.dev);
                match self.allocs.iter_mut().find(|(a, d, _)| (*a, *d) == key) {
                    Some(e) => e.2 += 1,
                    None => self.allocs.push((key.0, key.1, 1)),
                }
            }
            Op::Deny | Op::WouldDeny if r.ev.dev >= 0 => {
                let d = r.ev.dev as usize;
                let v = if r.ev.op == Op::Deny { &mut self.denied } else { &mut self.would_deny };
                if v.len() <= d {
                    v.resize(d + 1, 0);
                }
                v[d] += 1;
            }
            _ => {}
        }
    }
}

pub struct Sidecar {
    path: String,
    fd: i32,
    /// The header line, built once (devices and limits are known when the writer starts).
    hello: Vec<u8>,
    out: Vec<u8>,
    /// Bytes of `out` already sent.
    sent: usize,
    backoff: Duration,
    next_attempt: Instant,
    connected_at: Instant,
    last_usage: Instant,
    origin_mono_ns: u64,
    tally: Tally,
    /// Event lines that never reached the socket (no connection, buffer full, connection lost).
    dropped: u64,
}

impl Sidecar {
    pub fn new(path: String, hello: Vec<u8>, origin_mono_ns: u64) -> Sidecar {
        let now = Instant::now();
        Sidecar {
            path,
            fd: -1,
            hello,
            out: Vec::with_capacity(64 * 1024),
            sent: 0,
            backoff: FIRST_BACKOFF,
            next_attempt: now,
            connected_at: now,
            last_usage: now,
            origin_mono_ns,
            tally: Tally::default(),
            dropped: 0,
        }
    }

    /// One formatted event line (with its record, for the tally).
    pub fn event(&mut self, r: &Record, line: &[u8]) {
        self.tally.note(r);
        if self.fd < 0 || self.out.len() - self.sent + line.len() > BUFFER_CAP {
            self.dropped += 1;
            return;
        }
        self.out.extend_from_slice(line);
    }

    /// Called by the writer loop every few milliseconds: connects when due, sends the periodic
    /// usage snapshot, and pushes out what the socket takes without blocking.
    pub fn poll(&mut self) {
        let now = Instant::now();
        if self.fd < 0 {
            if now < self.next_attempt || !self.connect(now) {
                return;
            }
        } else if now.duration_since(self.last_usage) >= USAGE_EVERY && self.out.len() - self.sent < BUFFER_CAP {
            self.push_usage(now);
        }
        self.send();
    }

    fn connect(&mut self, now: Instant) -> bool {
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            self.retry_later(now);
            return false;
        }
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = self.path.as_bytes();
        if bytes.len() >= addr.sun_path.len() {
            unsafe { libc::close(fd) };
            // Cannot ever work: stop trying (the sidecar documents the length limit).
            self.next_attempt = now + Duration::from_secs(3600 * 24 * 365);
            return false;
        }
        for (d, &s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
        let rc = unsafe { libc::connect(fd, (&raw const addr).cast(), len as libc::socklen_t) };
        if rc != 0 {
            // Absent (ENOENT), stale (ECONNREFUSED) or its backlog is full (EAGAIN): later.
            unsafe { libc::close(fd) };
            self.retry_later(now);
            return false;
        }
        self.fd = fd;
        FD.store(fd, Ordering::Relaxed);
        self.connected_at = now;
        self.out.clear();
        self.sent = 0;
        self.out.extend_from_slice(&self.hello);
        self.push_usage(now);
        true
    }

    fn retry_later(&mut self, now: Instant) {
        self.next_attempt = now + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }

    fn push_usage(&mut self, now: Instant) {
        self.last_usage = now;
        let usage = self.usage();
        format::json_line(&mut self.out, &usage);
    }

    fn usage(&self) -> Usage {
        let n = ledger::device_count().max(ledger::highest_used_device() + 1).max(self.tally.denied.len());
        let member = crate::group::sharing::view();
        let (events, dropped) = events::emitted_and_dropped();
        Usage {
            kind: "usage".into(),
            t_ns: crate::log::monotonic_ns().saturating_sub(self.origin_mono_ns),
            events,
            dropped: dropped + self.dropped,
            devices: (0..n)
                .map(|d| {
                    let group = crate::group::view(d);
                    let sharing = super::sharing_on(member.as_ref(), d, group.is_some());
                    DeviceUsage {
                        index: d as i32,
                        used: ledger::used(d),
                        limit: ledger::limit(d),
                        peak: ledger::peak(d),
                        denied: self.tally.denied.get(d).copied().unwrap_or(0),
                        would_deny: self.tally.would_deny.get(d).copied().unwrap_or(0),
                        group_limit: group.map(|g| g.0),
                        group_used: group.map(|g| g.1),
                        overhead: ledger::overhead(d),
                        sharing,
                    }
                })
                .collect(),
            allocations: self
                .tally
                .allocs
                .iter()
                .map(|&(api, dev, count)| AllocCount { dev, api: super::api_name(api as events::Api).to_string(), count })
                .collect(),
        }
    }

    /// Events the sidecar will never see: lost in the rings (or by the trace file) and here.
    fn total_dropped(&self) -> u64 {
        events::dropped() + self.dropped
    }

    fn send(&mut self) {
        while self.fd >= 0 && self.sent < self.out.len() {
            let rest = &self.out[self.sent..];
            let n = unsafe { libc::send(self.fd, rest.as_ptr().cast(), rest.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n > 0 {
                self.sent += n as usize;
                continue;
            }
            let err = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if n < 0 && err == libc::EINTR {
                continue;
            }
            if n < 0 && (err == libc::EAGAIN || err == libc::EWOULDBLOCK) {
                break;
            }
            self.disconnect();
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        } else if self.sent >= 64 * 1024 {
            self.out.drain(..self.sent);
            self.sent = 0;
        }
    }

    /// The sidecar went away: what was not sent is lost (event lines counted), and the next
    /// connection starts over with a header.
    fn disconnect(&mut self) {
        let now = Instant::now();
        let lost = self.out[self.sent..].split(|&b| b == b'\n').filter(|l| l.starts_with(b"{\"type\":\"event\"")).count();
        self.dropped += lost as u64;
        self.out.clear();
        self.sent = 0;
        FD.store(-1, Ordering::Relaxed);
        unsafe { libc::close(self.fd) };
        self.fd = -1;
        if now.duration_since(self.connected_at) >= STABLE {
            self.backoff = FIRST_BACKOFF;
        }
        self.retry_later(now);
    }

    /// At exit: the summary (with the sidecar's own drop count), then a bounded wait for the
    /// socket to take the rest.
    pub fn finish(&mut self, summary: &Summary) {
        if self.fd < 0 {
            return;
        }
        let mut s = summary.clone();
        s.dropped = self.total_dropped();
        format::json_line(&mut self.out, &s);
        let deadline = Instant::now() + FINAL_FLUSH;
        loop {
            self.send();
            if self.fd < 0 || self.out.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.fd >= 0 {
            FD.store(-1, Ordering::Relaxed);
            unsafe { libc::close(self.fd) };
            self.fd = -1;
        }
    }
}
