//! The sidecar's socket loop: one thread, `poll(2)` over the listener and every connection, all
//! sockets non-blocking. Nothing a client does can make it wait: reads take what is there,
//! a line over 1 MiB, a malformed line or a connection silent past the hello timeout gets the
//! client disconnected and counted, and answers to queries leave as the socket accepts them.

use super::state::{Client, Registry};
use std::collections::HashMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest line accepted; a longer one marks a broken or hostile client.
pub const MAX_LINE: usize = 1 << 20;
/// Connections beyond this are closed at once (the preload retries with backoff).
const MAX_CONNECTIONS: usize = 4096;
/// Read at most this much from one connection per round, so one busy client cannot starve others.
const READ_PER_ROUND: usize = 1 << 20;

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
    phase: Phase,
    opened: Instant,
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
    hello_timeout: Duration,
    conns: HashMap<u64, Conn>,
    next_id: u64,
}

/// Peer credentials of a connected Unix socket (the kernel's word, not the client's).
fn peer_cred(s: &UnixStream) -> (i32, u32) {
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: u32::MAX };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len)
    };
    if rc != 0 { (0, u32::MAX) } else { (cred.pid, cred.uid) }
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
    pub fn new(listener: UnixListener, registry: Arc<Mutex<Registry>>, trace_dir: Option<PathBuf>, hello_timeout: Duration) -> Server {
        Server { listener, registry, trace_dir, hello_timeout, conns: HashMap::new(), next_id: 1 }
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
        }
    }

    fn accept(&mut self) {
        // A bounded batch per round keeps a connection storm from starving existing clients.
        for _ in 0..256 {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.conns.len() >= MAX_CONNECTIONS || stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let (pid, uid) = peer_cred(&stream);
                    let conn = Conn {
                        stream,
                        pid,
                        uid,
                        phase: Phase::New,
                        opened: Instant::now(),
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
        while taken < READ_PER_ROUND {
            let c = self.conns.get_mut(&id).expect("polled connection");
            match c.stream.read(scratch) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    taken += n;
                    c.input.extend_from_slice(&scratch[..n]);
                    let outcome = self.lines(id);
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
            if line.len() > MAX_LINE + 1 {
                outcome = Outcome::Bad(format!("a line of {} bytes (limit {MAX_LINE})", line.len() - 1));
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
        if matches!(outcome, Outcome::Keep) && c.input.len() > MAX_LINE {
            outcome = Outcome::Bad(format!("more than {MAX_LINE} bytes without a line end"));
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
                let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
                let _ = serde_json::to_writer(&mut c.output, &reg.snapshot());
                c.output.push(b'\n');
                c.phase = Phase::Query;
                Outcome::Keep
            }
            (_, "header") => {
                let client = match Client::from_header(c.pid, c.uid, &v) {
                    Ok(client) => client,
                    Err(e) => return Outcome::Bad(format!("bad header: {e}")),
                };
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
                reg.groups.insert(g.clone());
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
        let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        reg.clients.remove(&id);
        if let Some(reason) = reason {
            reg.bad_clients += 1;
            drop(reg);
            eprintln!("vramcap sidecar: disconnected pid {} (uid {}): {reason}", c.pid, c.uid);
        }
        flush_trace(&mut c);
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let silent: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| matches!(c.phase, Phase::New) && now.duration_since(c.opened) > self.hello_timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in silent {
            let secs = self.hello_timeout.as_secs_f64();
            self.settle(id, Outcome::Bad(format!("no header or query within {secs} s")));
        }
    }
}

/// `DIR/<exe>-<pid>-<start>.jsonl`, appended to: a client that reconnects (to this sidecar or
/// after a restart) continues its file with a fresh header.
fn open_trace(dir: &std::path::Path, c: &Client, header: &serde_json::Value) -> Option<File> {
    let start = header.get("start_unix_ns").and_then(|v| v.as_u64()).unwrap_or(0) / 1_000_000_000;
    let path = dir.join(format!("{}-{}-{start}.jsonl", safe_name(&c.exe), c.pid));
    match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("vramcap sidecar: cannot write {}: {e}; this client's records are not kept", path.display());
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
        eprintln!("vramcap sidecar: writing the trace of pid {} failed; its file stops here", c.pid);
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
