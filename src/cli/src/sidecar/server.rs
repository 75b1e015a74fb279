//! The sidecar's socket loop: one thread, `poll(2)` over the listener and every connection, all
//! sockets non-blocking. Nothing a client does can make it wait, and nothing it sends is kept
//! without bound (docs/security.md): reads take what is there; a first line over 64 KiB, a later
//! line over 1 MiB, a malformed line, a connection silent past the hello timeout, a line left
//! unfinished for as long, or a client that sends nothing for the idle timeout gets the client
//! disconnected and counted; the unfinished lines of all connections together are capped; one
//! uid gets at most its quota of connections; and answers to queries leave as the socket accepts
//! them, telling each client only about its own uid's processes.

use super::logline;
use super::state::{Client, Registry, Viewer};
use std::collections::HashMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest line accepted after the header; a longer one marks a broken or hostile client.
pub const MAX_LINE: usize = 1 << 20;
/// Longest first line (a header or a query): a header is a few KiB (the command line is cut to
/// 4 KiB), so an unknown peer cannot make the sidecar hold a megabyte before it said who it is.
pub const MAX_FIRST_LINE: usize = 64 << 10;
/// Unfinished lines held for all connections together; a connection that would add to a full
/// pool is dropped (a real client reconnects and is exact again at once).
pub const MAX_BUFFERED: usize = 64 << 20;
/// Connections beyond this are closed at once (the preload retries with backoff).
const MAX_CONNECTIONS: usize = 4096;
/// Read (and parse) at most this much from one connection per round, so one busy client cannot
/// starve others and a round stays short however many clients stream: at 1 MiB each, 200
/// clients made a round of 200 MiB to parse, which at the DaemonSet's 50m of CPU outlasted the
/// timeouts below, and honest clients were dropped as bad.
const READ_PER_ROUND: usize = 64 << 10;

/// What a server enforces, from the command line (`vramcap sidecar --help`).
pub struct Limits {
    /// First line within this time; no line left unfinished for longer.
    pub hello_timeout: Duration,
    /// A client silent for this long is dropped (a live one sends a usage snapshot every second).
    pub idle_timeout: Duration,
    /// Connections one uid may hold.
    pub max_per_uid: usize,
    /// Members of this group (and root) see every process in a query.
    pub admin_gid: Option<u32>,
}

enum Phase {
    /// Connected, first line not seen yet.
    New,
    /// A preloaded process (header received).
    Client,
    /// A `query` was answered; close once the answer is out.
    Query,
}

struct Conn {
    stream: UnixStream,
    pid: i32,
    uid: u32,
    gid: u32,
    phase: Phase,
    opened: Instant,
    /// The last complete line (or the connection's opening).
    last_line: Instant,
    input: Vec<u8>,
    output: Vec<u8>,
    trace: Option<File>,
    /// Lines for `trace`, written once per read (one write per batch, not per line).
    trace_buf: Vec<u8>,
}

pub struct Server {
    listener: UnixListener,
    registry: Arc<Mutex<Registry>>,
    trace_dir: Option<PathBuf>,
    limits: Limits,
    conns: HashMap<u64, Conn>,
    /// Open connections per uid.
    per_uid: HashMap<u32, usize>,
    /// Sum of every connection's unfinished input.
    buffered: usize,
    next_id: u64,
}

/// Peer credentials of a connected Unix socket (the kernel's word, not the client's). Unknown
/// credentials are nobody's (uid and gid `u32::MAX`): such a peer sees nothing.
fn peer_cred(s: &UnixStream) -> (i32, u32, u32) {
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: u32::MAX };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len)
    };
    if rc != 0 { (0, u32::MAX, u32::MAX) } else { (cred.pid, cred.uid, cred.gid) }
}

/// Whether `pid` (connected now, so not reused) has `gid` among its supplementary groups.
fn in_group(pid: i32, gid: u32) -> bool {
    if pid <= 0 {
        return false;
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
}

/// File name characters we keep from a client-supplied executable name.
fn safe_name(s: &str) -> String {
    let cleaned: String = s.chars().take(64).map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    if cleaned.is_empty() || cleaned.starts_with('.') { format!("_{cleaned}") } else { cleaned }
}

enum Outcome {
    Keep,
    /// The peer closed (a preloaded process exited) or a query was answered.
    Close,
    Bad(String),
}

impl Server {
    pub fn new(listener: UnixListener, registry: Arc<Mutex<Registry>>, trace_dir: Option<PathBuf>, limits: Limits) -> Server {
        Server { listener, registry, trace_dir, limits, conns: HashMap::new(), per_uid: HashMap::new(), buffered: 0, next_id: 1 }
    }

    pub fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut ids: Vec<u64> = Vec::new();
        let mut scratch = vec![0u8; 64 * 1024];
        loop {
            fds.clear();
            ids.clear();
            fds.push(libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            for (id, c) in &self.conns {
                let events = if c.output.is_empty() { libc::POLLIN } else { libc::POLLIN | libc::POLLOUT };
                fds.push(libc::pollfd { fd: c.stream.as_raw_fd(), events, revents: 0 });
                ids.push(*id);
            }
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 250) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == ErrorKind::Interrupted {
                    continue;
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            if fds[0].revents != 0 {
                self.accept();
            }
            for (i, id) in ids.iter().enumerate() {
                let rev = fds[i + 1].revents;
                if rev == 0 {
                    continue;
                }
                let outcome = self.service(*id, rev, &mut scratch);
                self.settle(*id, outcome);
            }
            self.expire();
            logline::flush();
        }
    }

    fn accept(&mut self) {
        // A bounded batch per round keeps a connection storm from starving existing clients.
        for _ in 0..256 {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let (pid, uid, gid) = peer_cred(&stream);
                    let mine = self.per_uid.get(&uid).copied().unwrap_or(0);
                    let full = if self.conns.len() >= MAX_CONNECTIONS {
                        Some(format!("{MAX_CONNECTIONS} connections are open"))
                    } else if mine >= self.limits.max_per_uid {
                        Some(format!("uid {uid} holds {mine} connections (--max-connections-per-uid {})", self.limits.max_per_uid))
                    } else {
                        None
                    };
                    if let Some(why) = full {
                        self.registry.lock().unwrap_or_else(|e| e.into_inner()).refused += 1;
                        logline::log("connection refused", &format!("refused a connection from pid {pid} (uid {uid}): {why}"));
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    *self.per_uid.entry(uid).or_insert(0) += 1;
                    let now = Instant::now();
                    let conn = Conn {
                        stream,
                        pid,
                        uid,
                        gid,
                        phase: Phase::New,
                        opened: now,
                        last_line: now,
                        input: Vec::new(),
                        output: Vec::new(),
                        trace: None,
                        trace_buf: Vec::new(),
                    };
                    self.conns.insert(self.next_id, conn);
                    self.next_id += 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // EMFILE and friends: try again next round rather than spin.
                Err(_) => return,
            }
        }
    }

    fn service(&mut self, id: u64, rev: libc::c_short, scratch: &mut [u8]) -> Outcome {
        if rev & libc::POLLOUT != 0 {
            let c = self.conns.get_mut(&id).expect("polled connection");
            match c.stream.write(&c.output) {
                Ok(n) => drop(c.output.drain(..n)),
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Outcome::Close,
            }
            if c.output.is_empty() && matches!(c.phase, Phase::Query) {
                return Outcome::Close;
            }
        }
        if rev & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) == 0 {
            return Outcome::Keep;
        }
        let mut taken = 0;
        let mut eof = false;
        loop {
            let c = self.conns.get_mut(&id).expect("polled connection");
            if taken >= READ_PER_ROUND {
                break;
            }
            let room = scratch.len().min(READ_PER_ROUND - taken);
            match c.stream.read(&mut scratch[..room]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    taken += n;
                    let before = c.input.len();
                    c.input.extend_from_slice(&scratch[..n]);
                    let mut outcome = self.lines(id);
                    let c = self.conns.get_mut(&id).expect("polled connection");
                    let after = c.input.len();
                    self.buffered = self.buffered + after - before;
                    if matches!(outcome, Outcome::Keep) && after > 0 && self.buffered > MAX_BUFFERED {
                        outcome = Outcome::Bad(format!(
                            "the sidecar holds {MAX_BUFFERED} bytes of unfinished lines; dropped this connection's {after}"
                        ));
                    }
                    if !matches!(outcome, Outcome::Keep) {
                        return outcome;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    eof = true;
                    break;
                }
            }
        }
        if eof {
            let c = &self.conns[&id];
            if matches!(c.phase, Phase::Query) && !c.output.is_empty() {
                return Outcome::Keep;
            }
            return Outcome::Close;
        }
        Outcome::Keep
    }

    /// Handles every complete line in the connection's input.
    fn lines(&mut self, id: u64) -> Outcome {
        let input = std::mem::take(&mut self.conns.get_mut(&id).expect("connection").input);
        let mut start = 0;
        let mut outcome = Outcome::Keep;
        while let Some(nl) = input[start..].iter().position(|&b| b == b'\n') {
            let line = &input[start..start + nl + 1];
            start += nl + 1;
            let limit = if matches!(self.conns[&id].phase, Phase::New) { MAX_FIRST_LINE } else { MAX_LINE };
            if line.len() > limit + 1 {
                outcome = Outcome::Bad(format!("a line of {} bytes (limit {limit})", line.len() - 1));
                break;
            }
            outcome = self.line(id, line);
            if !matches!(outcome, Outcome::Keep) {
                break;
            }
        }
        let c = self.conns.get_mut(&id).expect("connection");
        flush_trace(c);
        c.input = input;
        c.input.drain(..start);
        if start > 0 {
            c.last_line = Instant::now();
        }
        // A burst once is no reason to keep its buffer for the connection's life.
        if c.input.capacity() > (64 << 10) && c.input.capacity() > 4 * c.input.len() {
            c.input.shrink_to(2 * c.input.len());
        }
        let limit = if matches!(c.phase, Phase::New) { MAX_FIRST_LINE } else { MAX_LINE };
        if matches!(outcome, Outcome::Keep) && c.input.len() > limit {
            outcome = Outcome::Bad(format!("more than {limit} bytes without a line end"));
        }
        outcome
    }

    fn line(&mut self, id: u64, raw: &[u8]) -> Outcome {
        let text = raw.trim_ascii();
        if text.is_empty() {
            return Outcome::Keep;
        }
        let v: serde_json::Value = match serde_json::from_slice(text) {
            Ok(v @ serde_json::Value::Object(_)) => v,
            Ok(_) => return Outcome::Bad("a line that is not a JSON object".into()),
            Err(e) => return Outcome::Bad(format!("malformed JSON ({e})")),
        };
        let kind = v.get("type").and_then(|t| t.as_str()).unwrap_or("");
        let c = self.conns.get_mut(&id).expect("connection");
        match (&c.phase, kind) {
            (Phase::Query, _) => Outcome::Keep,
            (Phase::New, "query") => {
                let admin = c.uid == 0 || self.limits.admin_gid.is_some_and(|g| c.gid == g || in_group(c.pid, g));
                let viewer = if admin { Viewer::All } else { Viewer::Uid(c.uid) };
                let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
                let _ = serde_json::to_writer(&mut c.output, &reg.snapshot_for(viewer));
                c.output.push(b'\n');
                c.phase = Phase::Query;
                Outcome::Keep
            }
            (_, "header") => {
                let mut client = match Client::from_header(c.pid, c.uid, &v) {
                    Ok(client) => client,
                    Err(e) => return Outcome::Bad(format!("bad header: {e}")),
                };
                let who = super::identity::of_pid(c.pid);
                (client.container_id, client.pod_uid) = (who.container_id, who.pod_uid);
                if matches!(c.phase, Phase::New) {
                    c.trace = self.trace_dir.as_ref().and_then(|dir| open_trace(dir, &client, &v));
                }
                c.phase = Phase::Client;
                write_trace(c, raw);
                self.register(id, client);
                Outcome::Keep
            }
            (Phase::New, _) => Outcome::Bad(format!("first line of type {kind:?}, expected \"header\" or \"query\"")),
            (Phase::Client, _) => {
                write_trace(c, raw);
                let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
                match reg.clients.get_mut(&id).map(|cl| cl.apply(&v)) {
                    Some(Err(e)) => Outcome::Bad(format!("bad {kind} line: {e}")),
                    _ => Outcome::Keep,
                }
            }
        }
    }

    /// A process has one writer, hence one connection: an older connection of the same process
    /// (same peer pid, same reported pid and start time: a reconnection whose old socket is not
    /// reported closed yet) is superseded, so the process is never counted twice.
    fn register(&mut self, id: u64, client: Client) {
        let stale: Vec<u64> = {
            let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            let same = |c: &Client| (c.pid, c.reported_pid, c.start_unix_ns) == (client.pid, client.reported_pid, client.start_unix_ns);
            let stale = reg.clients.iter().filter(|(k, c)| **k != id && same(c)).map(|(k, _)| *k).collect();
            if let Some(g) = &client.group {
                reg.groups.insert((client.uid, g.clone()));
            }
            reg.clients.insert(id, client);
            stale
        };
        for old in stale {
            self.settle(old, Outcome::Close);
        }
    }

    fn settle(&mut self, id: u64, outcome: Outcome) {
        let reason = match outcome {
            Outcome::Keep => return,
            Outcome::Close => None,
            Outcome::Bad(reason) => Some(reason),
        };
        let Some(mut c) = self.conns.remove(&id) else { return };
        self.buffered -= c.input.len();
        if let Some(n) = self.per_uid.get_mut(&c.uid) {
            *n -= 1;
            if *n == 0 {
                self.per_uid.remove(&c.uid);
            }
        }
        let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        reg.clients.remove(&id);
        if let Some(reason) = reason {
            reg.bad_clients += 1;
            drop(reg);
            logline::log("bad client", &format!("disconnected pid {} (uid {}): {reason}", c.pid, c.uid));
        }
        flush_trace(&mut c);
    }

    /// Drops connections that said nothing in time: no first line within the hello timeout, a
    /// line left unfinished as long (a client trickling bytes), or nothing at all for the idle
    /// timeout. These time the client's silence, not our slowness: a connection whose bytes wait
    /// unread (we stopped at the round's budget, or they came in after we last read it) is not
    /// silent, and is judged once we have caught up with it.
    fn expire(&mut self) {
        let now = Instant::now();
        let (hello, idle) = (self.limits.hello_timeout, self.limits.idle_timeout);
        let late: Vec<(u64, String)> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.waiting_on_us())
            .filter_map(|(id, c)| {
                let why = match c.phase {
                    Phase::New if now.duration_since(c.opened) > hello => {
                        format!("no header or query within {} s", hello.as_secs_f64())
                    }
                    Phase::Client if !c.input.is_empty() && now.duration_since(c.last_line) > hello => {
                        format!("a line left unfinished for more than {} s", hello.as_secs_f64())
                    }
                    Phase::Client if now.duration_since(c.last_line) > idle => {
                        format!("nothing sent for {} s (--idle-timeout)", idle.as_secs_f64())
                    }
                    Phase::Query if now.duration_since(c.opened) > idle => {
                        format!("the answer to its query not read within {} s", idle.as_secs_f64())
                    }
                    _ => return None,
                };
                Some((*id, why))
            })
            .collect();
        for (id, why) in late {
            self.settle(id, Outcome::Bad(why));
        }
    }
}

impl Conn {
    /// Whether bytes the client sent wait unread in its socket (the kernel's count, `FIONREAD`):
    /// we stopped at the round's budget, or they came in while the round ran. Such a client is
    /// not silent. A client trickling bytes gets at most a round's reprieve each time (it is read
    /// in the next round and found drained), and its unfinished line stays capped at MAX_LINE.
    fn waiting_on_us(&self) -> bool {
        if !matches!(self.phase, Phase::New | Phase::Client) {
            return false;
        }
        let mut pending: libc::c_int = 0;
        let ok = unsafe { libc::ioctl(self.stream.as_raw_fd(), libc::FIONREAD, &mut pending) } == 0;
        ok && pending > 0
    }
}

/// `DIR/<exe>-<pid>-<start>.jsonl`, appended to: a client that reconnects (to this sidecar or
/// after a restart) continues its file with a fresh header.
fn open_trace(dir: &std::path::Path, c: &Client, header: &serde_json::Value) -> Option<File> {
    let start = header.get("start_unix_ns").and_then(|v| v.as_u64()).unwrap_or(0) / 1_000_000_000;
    let path = dir.join(format!("{}-{}-{start}.jsonl", safe_name(&c.exe), c.pid));
    // Never through a symlink; readable by the sidecar's user and group only (other jobs' data).
    match std::fs::OpenOptions::new().create(true).append(true).mode(0o640).custom_flags(libc::O_NOFOLLOW).open(&path) {
        Ok(f) => Some(f),
        Err(e) => {
            logline::log("trace file", &format!("cannot write {}: {e}; this client's records are not kept", path.display()));
            None
        }
    }
}

/// Keeps the line as received, for [`flush_trace`].
fn write_trace(c: &mut Conn, raw: &[u8]) {
    if c.trace.is_some() {
        c.trace_buf.extend_from_slice(raw);
    }
}

/// Writes whole lines only, so a killed sidecar leaves valid files; a write error stops this
/// client's file, not the sidecar.
fn flush_trace(c: &mut Conn) {
    if let Some(f) = c.trace.as_mut()
        && !c.trace_buf.is_empty()
        && f.write_all(&c.trace_buf).is_err()
    {
        logline::log("trace file", &format!("writing the trace of pid {} failed; its file stops here", c.pid));
        c.trace = None;
    }
    c.trace_buf.clear();
}

#[cfg(test)]
mod tests {
    use super::safe_name;

    #[test]
    fn client_names_cannot_escape_the_trace_dir() {
        assert_eq!(safe_name("../../etc/passwd"), "_.._.._etc_passwd");
        assert_eq!(safe_name("python3.11"), "python3.11");
        assert_eq!(safe_name(""), "_");
    }
}
