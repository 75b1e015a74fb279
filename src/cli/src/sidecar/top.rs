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

/// Every line of the table fits an 80-column terminal (79 characters, so the cursor never sits
/// in the last column): the columns below add up to 79, and the lines under a row wrap.
pub const WIDTH: usize = 79;

/// The header and a row share these widths: PID 7, COMMAND 14, DEV 3, USED / LIMIT 23 (two
/// sizes of at most 10 characters), the bar 10, PEAK 10, DENIED 6, one space between.
fn row(pid: &str, exe: &str, dev: &str, used_limit: &str, bar: &str, peak: &str, denied: &str) -> String {
    format!("{pid:>7} {exe:<14} {dev:>3} {used_limit:>23} {bar:<10} {peak:>10} {denied:>6}\n")
}

/// Lines under a row, indented, its parts joined with ", " and wrapped at [`WIDTH`] (a part
/// too long for a line of its own is cut with "…").
fn under(first: &str, parts: &[String]) -> String {
    const INDENT: &str = "        ";
    let fit = |l: &str| {
        let l = l.trim_end();
        if l.chars().count() > WIDTH { l.chars().take(WIDTH - 1).collect::<String>() + "…\n" } else { format!("{l}\n") }
    };
    let mut out = String::new();
    let mut line = format!("{INDENT}{first}");
    // Something besides the indent on the line: the next part may go to a new one.
    let mut used = !first.is_empty();
    for (i, p) in parts.iter().enumerate() {
        let piece = if i + 1 < parts.len() { format!("{p},") } else { p.clone() };
        if used && line.chars().count() + 1 + piece.chars().count() > WIDTH {
            out.push_str(&fit(&line));
            line = format!("{INDENT}  ");
            used = false;
        }
        if used {
            line.push(' ');
        }
        line.push_str(&piece);
        used = true;
    }
    out.push_str(&fit(&line));
    out
}

/// Why the table is empty, and what to do: which socket, how jobs reach it, and whose processes
/// this viewer may see.
fn empty_hint(socket: &Path) -> String {
    let s = crate::analysis::printable(&socket.display().to_string());
    let mut text = format!(
        "No process is connected to the sidecar on {s} yet: a job connects when it first uses CUDA, if it was \
         started with VRAMCAP_SIDECAR={s} (or vramcap run --sidecar {s} -- CMD)."
    );
    let uid = unsafe { libc::getuid() };
    if uid != 0 {
        text.push_str(&format!(" As uid {uid} you see only your own processes (root and the sidecar's --admin-group see all)."));
    }
    // Word-wrapped under the header: the parts are words here.
    let words: Vec<String> = text.split(' ').map(str::to_string).collect();
    under_words(&words)
}

/// [`under`] for running text: words joined by spaces, wrapped at [`WIDTH`].
fn under_words(words: &[String]) -> String {
    let mut out = String::new();
    let mut line = String::from("        ");
    for w in words {
        if !line.trim().is_empty() && line.chars().count() + 1 + w.chars().count() > WIDTH {
            out.push_str(line.trim_end());
            out.push('\n');
            line = String::from("        ");
        }
        if !line.trim().is_empty() {
            line.push(' ');
        }
        line.push_str(w);
    }
    out.push_str(line.trim_end());
    out.push('\n');
    out
}

/// The table: one row per process and device it used or is capped on. `socket` is named when the
/// table is empty.
pub fn render(state: &Value, socket: &Path) -> String {
    let mut out = String::new();
    let clients = state.get("clients").and_then(Value::as_array).cloned().unwrap_or_default();
    out.push_str(&format!(
        "vramcap top: {} process(es), {} bad client(s)\n",
        clients.len(),
        state.get("bad_clients").and_then(Value::as_u64).unwrap_or(0)
    ));
    out.push_str(&row("PID", "COMMAND", "DEV", "USED / LIMIT", "", "PEAK", "DENIED"));
    if clients.is_empty() {
        out.push_str(&empty_hint(socket));
    }
    for c in &clients {
        let pid = c.get("pid").and_then(Value::as_i64).unwrap_or(0).to_string();
        // A client's words: control characters (escape sequences, line breaks) never reach the terminal.
        let exe: String = crate::analysis::printable(c.get("exe").and_then(Value::as_str).unwrap_or("?")).chars().take(14).collect();
        let devices = c.get("devices").and_then(Value::as_array).cloned().unwrap_or_default();
        let shown: Vec<&Value> = devices
            .iter()
            .filter(|d| {
                let n = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
                n("used") > 0 || n("peak") > 0 || n("denied") > 0 || !d["limit"].is_null() || !d["group_limit"].is_null()
            })
            .collect();
        if shown.is_empty() {
            out.push_str(&row(&pid, &exe, "-", "0 B / -", &bar(0, None, 8), "0 B", "0"));
        }
        for d in shown {
            let n = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
            let own = d.get("limit").and_then(Value::as_u64);
            let group = d.get("group_limit").and_then(Value::as_u64);
            // The tighter bound is the one the bar fills towards: its own cap, else its group's
            // budget; the group's budget is always named on the line under the row.
            let limit = own.or(group);
            let used_limit = format!("{} / {}", human(n("used")), limit.map_or("-".to_string(), human));
            out.push_str(&row(&pid, &exe, &n("index").to_string(), &used_limit, &bar(n("used"), limit, 8), &human(n("peak")), &n("denied").to_string()));
            if n("overhead") > 0 {
                out.push_str(&under("overhead:", &[format!("{} of the used (contexts, modules, limits)", human(n("overhead")))]));
            }
            if let Some(line) = group_line(c, d) {
                out.push_str(&line);
            }
        }
        if let Some(line) = identity_line(c) {
            out.push_str(&line);
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
    if parts.is_empty() {
        return None;
    }
    parts[0] = format!("in {}", parts[0]);
    Some(under("", &parts))
}

/// Under a group member's row: its group's budget on this device (and what the group uses of it,
/// also when a cap of its own is what the row shows), its policy, its priority, and its share
/// (`equal`), reserve and the group's headroom (issue 17). `None` outside a group.
fn group_line(c: &Value, d: &Value) -> Option<String> {
    let policy = c.get("group_policy").and_then(Value::as_str);
    let bytes = |k: &str| d.get(k).and_then(Value::as_u64);
    let (budget, share, reserve, headroom) = (bytes("group_limit"), bytes("group_share"), bytes("group_reserve"), bytes("group_headroom"));
    if budget.is_none() && policy.is_none() && reserve.is_none() && headroom.is_none() {
        return None;
    }
    let mut parts = Vec::new();
    if let Some(b) = budget {
        let used = bytes("group_used").map(|u| format!(" ({} used by the group)", human(u))).unwrap_or_default();
        parts.push(format!("budget {}{used}", human(b)));
    }
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
    let name: String = crate::analysis::printable(c.get("group").and_then(Value::as_str).unwrap_or("?")).chars().take(32).collect();
    Some(under(&format!("group \"{name}\":"), &parts))
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

/// `--once --wait`: the first answer that shows a process, or when the time is up the last
/// answer (or the last error) as it is. Polled every 100 ms: a query costs the sidecar one line.
fn query_waiting(socket: &Path, wait: Option<Duration>) -> Result<Value, String> {
    let Some(wait) = wait else { return query(socket) };
    let deadline = std::time::Instant::now() + wait;
    loop {
        let r = query(socket);
        let shown = r.as_ref().is_ok_and(|v| v.get("clients").and_then(Value::as_array).is_some_and(|c| !c.is_empty()));
        if shown || std::time::Instant::now() >= deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `--once`: one snapshot. Otherwise every second: on a terminal, redrawn in place; into a pipe
/// or file, plain snapshots one after another (no screen-control codes), each ending with a blank
/// line. A reader that goes away ends top like any Unix tool (SIGPIPE).
pub fn run(socket: &Path, once: bool, wait: Option<Duration>) -> Result<(), String> {
    let mut stdout = std::io::stdout();
    let mut put = |s: &str| stdout.write_all(s.as_bytes()).and_then(|_| stdout.flush()).map_err(|e| stdout_failed(&e));
    if once {
        return put(&render(&query_waiting(socket, wait)?, socket));
    }
    let tty = unsafe { libc::isatty(1) } == 1;
    let mut failures = 0u32;
    loop {
        let screen = match query(socket) {
            Ok(state) => {
                failures = 0;
                render(&state, socket)
            }
            Err(e) if !tty => {
                failures += 1;
                if failures >= PIPE_RETRIES {
                    return Err(format!("{e}; gave up after {PIPE_RETRIES} attempts, one a second (output is not a terminal)"));
                }
                eprintln!("vramcap: top: {e} (attempt {failures} of {PIPE_RETRIES})");
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

    fn render(state: &Value) -> String {
        super::render(state, Path::new("/run/vramcap/sidecar.sock"))
    }

    /// The lines under the row that starts with `pid`, joined as one.
    fn below(t: &str, pid: &str) -> String {
        let rows: Vec<&str> = t.lines().collect();
        let i = rows.iter().position(|l| l.trim_start().starts_with(pid)).unwrap();
        rows[i + 1..].iter().take_while(|l| l.starts_with("        ")).map(|l| l.trim()).collect::<Vec<_>>().join(" ")
    }

    /// Overhead gets a line of its own; none, no line.
    #[test]
    fn overhead_is_shown_apart() {
        let state = serde_json::json!({"type":"state","bad_clients":0,"clients":[
            {"pid":42,"exe":"python3","devices":[{"index":0,"used":1u64<<30,"limit":2u64<<30,"peak":1u64<<30,"denied":0,"overhead":300u64<<20}]},
            {"pid":43,"exe":"plain","devices":[{"index":0,"used":1,"limit":2,"peak":1,"denied":0,"overhead":0}]}]});
        let t = render(&state);
        assert!(t.contains("overhead: 300.0 MiB of the used (contexts, modules, limits)"), "{t}");
        assert_eq!(t.matches("overhead").count(), 1, "{t}");
    }

    /// A group member without a cap of its own is bounded by its group's budget, not `-`; one
    /// with a cap of its own still shows the group's budget under its row.
    #[test]
    fn a_group_member_shows_its_group_budget() {
        let state = serde_json::json!({"type":"state","bad_clients":0,"clients":[
            {"pid":42,"exe":"python3","group":"team","devices":[{"index":0,"used":1u64<<30,"limit":null,"group_limit":3u64<<29,"group_used":5u64<<28,"peak":1u64<<30,"denied":0}]},
            {"pid":43,"exe":"python3","group":"team","devices":[{"index":0,"used":1u64<<28,"limit":1u64<<30,"group_limit":3u64<<29,"group_used":5u64<<28,"peak":1u64<<28,"denied":0}]}]});
        let t = render(&state);
        assert!(t.contains("1.0 GiB / 1.5 GiB [#####...]"), "{t}");
        assert!(!t.contains("1.0 GiB / -"), "{t}");
        assert_eq!(below(&t, "42"), "group \"team\": budget 1.5 GiB (1.2 GiB used by the group)");
        assert!(t.contains("256.0 MiB / 1.0 GiB"), "{t}");
        assert_eq!(below(&t, "43"), "group \"team\": budget 1.5 GiB (1.2 GiB used by the group)");
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
        assert_eq!(
            below(&t, "42"),
            "group \"team\": budget 300.0 MiB, policy equal, priority 3, share 150.0 MiB, reserve 100.0 MiB, headroom 200.0 MiB (this process may use it)"
        );
        assert_eq!(below(&t, "43"), "", "no group line for a process outside a group: {t}");
        assert!(t.lines().all(|l| l.chars().count() <= WIDTH), "{t}");
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
        assert_eq!(below(&t, "42"), "in container trainer (1d45a55e836b), pod ml/train-0 (uid 6f3b3e8a-8d5c-4a4f-9a0b-2e4f5c6d7e8f)", "{t}");
        assert_eq!(below(&t, "43"), "in container 1d45a55e836b", "{t}");
        assert_eq!(below(&t, "44"), "", "{t}");
        assert!(t.lines().all(|l| l.chars().count() <= WIDTH), "{t}");
    }

    /// The widest values every column can hold still fit 80 columns, and so does a long name.
    #[test]
    fn the_widest_rows_fit_80_columns() {
        let big = 1023u64 << 30 | 900 << 20;
        let state = serde_json::json!({"type":"state","bad_clients":0,"clients":[
            {"pid":4194304,"exe":"a-very-long-executable-name","group":"g".repeat(200),"group_policy":"priority","group_priority":-2147483648i64,
             "container_id":"c".repeat(64),"container":"x".repeat(64),"pod":"p".repeat(64),"namespace":"n".repeat(64),"pod_uid":"u".repeat(64),
             "devices":[{"index":255,"used":big,"limit":big,"group_limit":big,"group_used":big,"group_share":big,"group_reserve":big,"group_headroom":big,"peak":big,"denied":999999}]}]});
        let t = render(&state);
        for l in t.lines() {
            assert!(l.chars().count() <= WIDTH, "{} columns: {l:?}", l.chars().count());
        }
        assert!(t.contains("1023.9 GiB / 1023.9 GiB"), "{t}");
    }

    #[test]
    fn an_empty_table_says_which_socket_and_how_jobs_reach_it() {
        let t = render(&serde_json::json!({"type":"state","bad_clients":0,"clients":[]}));
        let joined = t.lines().skip(2).map(str::trim).collect::<Vec<_>>().join(" ");
        assert!(joined.contains("No process is connected to the sidecar on /run/vramcap/sidecar.sock yet"), "{t}");
        assert!(joined.contains("VRAMCAP_SIDECAR=/run/vramcap/sidecar.sock") && joined.contains("vramcap run --sidecar /run/vramcap/sidecar.sock -- CMD"), "{t}");
        assert!(t.lines().all(|l| l.chars().count() <= WIDTH), "{t}");
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
        assert!(r.contains("42") && r.contains("python3") && r.contains("1.0 GiB / 2.0 GiB") && r.contains("[####....]"), "{r}");
        assert!(r.contains("1.5 GiB") && r.trim_end().ends_with('4'), "{r}");
        assert!(t.lines().all(|l| l.chars().count() <= WIDTH), "{t}");
    }
}
