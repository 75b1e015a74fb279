//! `vramcap top`: asks the sidecar for its state over the same socket (a `query` line) and
//! prints one row per process and device.

use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The sidecar's state (`{"type":"state",...}`), or a message for the user.
pub fn query(socket: &Path) -> Result<Value, String> {
    let shown = socket.display();
    let mut s = UnixStream::connect(socket).map_err(|e| format!("no sidecar on {shown}: {e}"))?;
    let timeout = Some(Duration::from_secs(5));
    s.set_read_timeout(timeout).and_then(|_| s.set_write_timeout(timeout)).map_err(|e| e.to_string())?;
    let q = format!("{{\"type\":\"query\",\"protocol\":{}}}\n", super::PROTOCOL);
    s.write_all(q.as_bytes()).map_err(|e| format!("cannot query the sidecar on {shown}: {e}"))?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).map_err(|e| format!("no answer from the sidecar on {shown}: {e}"))?;
    let v: Value = serde_json::from_str(&line).map_err(|e| format!("unreadable answer from the sidecar on {shown}: {e}"))?;
    if v.get("type").and_then(Value::as_str) != Some("state") {
        return Err(format!("unexpected answer from the sidecar on {shown}: {}", line.trim()));
    }
    Ok(v)
}

/// Binary units with one decimal, as people read them (`1.5 GiB`).
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", UNITS[u]) }
}

fn bar(used: u64, limit: Option<u64>, width: usize) -> String {
    let Some(limit) = limit.filter(|&l| l > 0) else { return format!("[{}]", " ".repeat(width)) };
    let filled = ((used as f64 / limit as f64) * width as f64).round().clamp(0.0, width as f64) as usize;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width - filled))
}

/// The table: one row per process and device it used or is capped on.
pub fn render(state: &Value) -> String {
    let mut out = String::new();
    let clients = state.get("clients").and_then(Value::as_array).cloned().unwrap_or_default();
    out.push_str(&format!(
        "vramcap top: {} process(es), {} bad client(s)\n",
        clients.len(),
        state.get("bad_clients").and_then(Value::as_u64).unwrap_or(0)
    ));
    out.push_str(&format!(
        "{:>8}  {:<20} {:>3}  {:>23} {:<22} {:>10} {:>7}\n",
        "PID", "COMMAND", "DEV", "USED / LIMIT", "", "PEAK", "DENIED"
    ));
    for c in &clients {
        let pid = c.get("pid").and_then(Value::as_i64).unwrap_or(0);
        // A client's words: control characters (escape sequences, line breaks) never reach the terminal.
        let exe: String = crate::analysis::printable(c.get("exe").and_then(Value::as_str).unwrap_or("?")).chars().take(20).collect();
        let devices = c.get("devices").and_then(Value::as_array).cloned().unwrap_or_default();
        let shown: Vec<&Value> = devices
            .iter()
            .filter(|d| {
                let n = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
                n("used") > 0 || n("peak") > 0 || n("denied") > 0 || !d["limit"].is_null() || !d["group_limit"].is_null()
            })
            .collect();
        if shown.is_empty() {
            out.push_str(&format!("{pid:>8}  {exe:<20} {:>3}  {:>23} {:<22} {:>10} {:>7}\n", "-", "0 B / -", bar(0, None, 20), "0 B", 0));
        }
        for d in shown {
            let n = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
            let own = d.get("limit").and_then(Value::as_u64);
            let group = d.get("group_limit").and_then(Value::as_u64);
            // A group member without a cap of its own is bounded by its group's budget.
            let (limit, used_limit) = match (own, group) {
                (Some(l), _) => (Some(l), format!("{} / {}", human(n("used")), human(l))),
                (None, Some(g)) => (Some(g), format!("{} / {} group", human(n("used")), human(g))),
                (None, None) => (None, format!("{} / -", human(n("used")))),
            };
            out.push_str(&format!(
                "{pid:>8}  {exe:<20} {:>3}  {used_limit:>23} {:<22} {:>10} {:>7}\n",
                n("index"),
                bar(n("used"), limit, 20),
                human(n("peak")),
                n("denied")
            ));
            if n("overhead") > 0 {
                let line = format!("of which overhead {} (contexts, modules, limits)", human(n("overhead")));
                out.push_str(&format!("{:>8}  {:<20} {:>3}  {line}
", "", "", ""));
            }
            if let Some(line) = sharing_line(c, d) {
                out.push_str(&format!("{:>8}  {:<20} {:>3}  {line}\n", "", "", ""));
            }
        }
        if let Some(line) = identity_line(c) {
            out.push_str(&format!("{:>8}  {line}\n", ""));
        }
    }
    out
}

/// Under a process's first row: the container and pod it runs in. The container id and pod uid
/// come from its cgroup path (the sidecar's reading); namespace, pod and container names from its
/// environment (the downward API), which it could have set to anything: they are shown as names.
fn identity_line(c: &Value) -> Option<String> {
    let field = |k: &str| c.get(k).and_then(Value::as_str).map(|s| crate::analysis::printable(s).chars().take(64).collect::<String>());
    let (id, uid) = (field("container_id"), field("pod_uid"));
    let (ns, pod, name) = (field("namespace"), field("pod"), field("container"));
    let mut parts = Vec::new();
    if id.is_some() || name.is_some() {
        let short = id.as_deref().map(|i| i.chars().take(12).collect::<String>());
        parts.push(match (name, short) {
            (Some(n), Some(s)) => format!("container {n} ({s})"),
            (Some(n), None) => format!("container {n}"),
            (None, Some(s)) => format!("container {s}"),
            (None, None) => unreachable!(),
        });
    }
    if pod.is_some() || uid.is_some() {
        let named = match (ns, pod) {
            (Some(ns), Some(p)) => Some(format!("{ns}/{p}")),
            (None, Some(p)) => Some(p),
            _ => None,
        };
        parts.push(match (named, uid) {
            (Some(n), Some(u)) => format!("pod {n} (uid {u})"),
            (Some(n), None) => format!("pod {n}"),
            (None, Some(u)) => format!("pod uid {u}"),
            (None, None) => unreachable!(),
        });
    }
    (!parts.is_empty()).then(|| format!("in {}", parts.join(", ")))
}

/// Under a group member's row: its group's policy, its priority, and on this device its share
/// (`equal`), reserve and the group's headroom (issue 17). `None` when it sent none of them.
fn sharing_line(c: &Value, d: &Value) -> Option<String> {
    let policy = c.get("group_policy").and_then(Value::as_str);
    let bytes = |k: &str| d.get(k).and_then(Value::as_u64);
    let (share, reserve, headroom) = (bytes("group_share"), bytes("group_reserve"), bytes("group_headroom"));
    if policy.is_none() && reserve.is_none() && headroom.is_none() {
        return None;
    }
    let mut parts = Vec::new();
    if let Some(p) = policy {
        parts.push(format!("policy {p}"));
    }
    if let Some(p) = c.get("group_priority").and_then(Value::as_i64) {
        parts.push(format!("priority {p}"));
    }
    if let Some(s) = share {
        parts.push(format!("share {}", human(s)));
    }
    if let Some(r) = reserve {
        parts.push(format!("reserve {}", human(r)));
    }
    if let Some(h) = headroom {
        let mine = c.get("group_holds_headroom").and_then(Value::as_bool) == Some(true) && h > 0;
        parts.push(format!("headroom {}{}", human(h), if mine { " (this process may use it)" } else { "" }));
    }
    let name = c.get("group").and_then(Value::as_str).unwrap_or("?");
    Some(format!("group \"{name}\": {}", parts.join(", ")))
}

/// top keeps SIGPIPE ignored (a sidecar hanging up on the query must stay an error value): a
/// reader of stdout that went away ends it as SIGPIPE ends any Unix tool, silently.
fn stdout_failed(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::raise(libc::SIGPIPE);
        }
    }
    format!("cannot write to stdout: {e}")
}

/// When stdout is not a terminal, top gives up after this many failed queries in a row (one a
/// second): a logging pipeline must not wait for ever on a sidecar that is not there. On a
/// terminal it retries until Ctrl-C, as the person watching can see why.
pub const PIPE_RETRIES: u32 = 10;

/// `--once`: one snapshot. Otherwise every second: on a terminal, redrawn in place; into a pipe
/// or file, plain snapshots one after another (no screen-control codes), each ending with a blank
/// line. A reader that goes away ends top like any Unix tool (SIGPIPE).
pub fn run(socket: &Path, once: bool) -> Result<(), String> {
    let mut stdout = std::io::stdout();
    let mut put = |s: &str| stdout.write_all(s.as_bytes()).and_then(|_| stdout.flush()).map_err(|e| stdout_failed(&e));
    if once {
        return put(&render(&query(socket)?));
    }
    let tty = unsafe { libc::isatty(1) } == 1;
    let mut failures = 0u32;
    loop {
        let screen = match query(socket) {
            Ok(state) => {
                failures = 0;
                render(&state)
            }
            Err(e) if !tty => {
                failures += 1;
                if failures >= PIPE_RETRIES {
                    return Err(format!("{e}; gave up after {PIPE_RETRIES} attempts, one a second (output is not a terminal)"));
                }
                eprintln!("vramcap top: {e} (attempt {failures} of {PIPE_RETRIES})");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
            Err(e) => format!("{e}\n(retrying every second; Ctrl-C quits)\n"),
        };
        if tty {
            // Home, draw, clear the rest: no flicker from clearing first.
            put(&format!("\x1b[H{}\x1b[J", screen.replace('\n', "\x1b[K\n")))?;
        } else {
            put(&format!("{screen}\n"))?;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Overhead gets a line of its own; none, no line.
    #[test]
    fn overhead_is_shown_apart() {
        let state = serde_json::json!({"type":"state","bad_clients":0,"clients":[
            {"pid":42,"exe":"python3","devices":[{"index":0,"used":1u64<<30,"limit":2u64<<30,"peak":1u64<<30,"denied":0,"overhead":300u64<<20}]},
            {"pid":43,"exe":"plain","devices":[{"index":0,"used":1,"limit":2,"peak":1,"denied":0,"overhead":0}]}]});
        let t = render(&state);
        assert!(t.contains("of which overhead 300.0 MiB (contexts, modules, limits)"), "{t}");
        assert_eq!(t.matches("overhead").count(), 1, "{t}");
    }

    /// A group member without a cap of its own shows its group's budget, not `-`.
    #[test]
    fn a_group_member_shows_its_group_budget() {
        let state = serde_json::json!({"type":"state","bad_clients":0,"clients":[
            {"pid":42,"exe":"python3","devices":[{"index":0,"used":1u64<<30,"limit":null,"group_limit":3u64<<29,"group_used":5u64<<28,"peak":1u64<<30,"denied":0}]}]});
        let t = render(&state);
        assert!(t.contains("1.0 GiB / 1.5 GiB group"), "{t}");
        assert!(!t.contains("1.0 GiB / -"), "{t}");
    }

    /// Each member's sharing settings are shown under its row, per device.
    #[test]
    fn a_group_members_policy_share_reserve_and_headroom_are_shown() {
        let state = serde_json::json!({"type":"state","bad_clients":0,"clients":[
            {"pid":42,"exe":"python3","group":"team","group_policy":"equal","group_priority":3,"group_holds_headroom":true,
             "devices":[{"index":0,"used":1u64<<20,"limit":null,"group_limit":300u64<<20,"group_share":150u64<<20,
                         "group_reserve":100u64<<20,"group_headroom":200u64<<20,"peak":1u64<<20,"denied":0}]},
            {"pid":43,"exe":"plain","devices":[{"index":0,"used":1,"limit":null,"peak":1,"denied":0}]}]});
        let t = render(&state);
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows.len(), 5, "{t}");
        assert!(rows[2].trim_start().starts_with("42"), "{t}");
        assert_eq!(
            rows[3].trim(),
            "group \"team\": policy equal, priority 3, share 150.0 MiB, reserve 100.0 MiB, headroom 200.0 MiB (this process may use it)"
        );
        assert!(rows[4].trim_start().starts_with("43"), "no sharing line for a process outside a group: {t}");
    }

    /// The container and pod a process runs in, under its row; nothing for a process outside one.
    #[test]
    fn a_process_in_a_container_shows_its_container_and_pod() {
        let id = "1d45a55e836b5108fa4cc2a0bd6c3967905d9f39b75d5afc96a02c6bb3ae4f37";
        let state = serde_json::json!({"type":"state","bad_clients":0,"clients":[
            {"pid":42,"exe":"python3","container_id":id,"pod_uid":"6f3b3e8a-8d5c-4a4f-9a0b-2e4f5c6d7e8f",
             "namespace":"ml","pod":"train-0","container":"trainer","devices":[{"index":0,"used":1,"limit":2,"peak":1,"denied":0}]},
            {"pid":43,"exe":"podman","container_id":id,"devices":[]},
            {"pid":44,"exe":"host","devices":[{"index":0,"used":1,"limit":2,"peak":1,"denied":0}]}]});
        let t = render(&state);
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows[3].trim(), "in container trainer (1d45a55e836b), pod ml/train-0 (uid 6f3b3e8a-8d5c-4a4f-9a0b-2e4f5c6d7e8f)", "{t}");
        assert_eq!(rows[5].trim(), "in container 1d45a55e836b", "{t}");
        assert!(rows[6].trim_start().starts_with("44") && rows.len() == 7, "{t}");
    }

    #[test]
    fn table_rows_and_units() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.5 GiB");
        assert_eq!(bar(5, Some(10), 4), "[##..]");
        let state = serde_json::json!({"type":"state","bad_clients":2,"clients":[
            {"pid":42,"exe":"python3","devices":[{"index":0,"used":1u64<<30,"limit":2u64<<30,"peak":3u64<<29,"denied":4},
                                                 {"index":1,"used":0,"limit":null,"peak":0,"denied":0}]}]});
        let t = render(&state);
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows.len(), 3, "{t}");
        assert!(rows[0].contains("1 process(es), 2 bad client(s)"));
        let r = rows[2];
        assert!(r.contains("42") && r.contains("python3") && r.contains("1.0 GiB / 2.0 GiB") && r.contains("[##########..........]"), "{r}");
        assert!(r.contains("1.5 GiB") && r.trim_end().ends_with('4'), "{r}");
    }
}
