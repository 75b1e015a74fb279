//! `/metrics` in the Prometheus text exposition format (version 0.0.4). Each request is served
//! on a thread of its own (at most `MAX_IN_FLIGHT` at once, and `MAX_PER_PEER` from one address;
//! more are answered 503 at once) with a deadline for the whole request, not per read: a scraper
//! that trickles its request or reads the answer slowly holds one thread for at most `DEADLINE`
//! and never delays anyone else, and one address holding its share cannot take the others'.

use super::state::{Client, Registry};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Whole-request deadline: reading the request and writing the answer.
const DEADLINE: Duration = Duration::from_secs(5);
/// Requests served at once: room for 32 addresses' full share, so locking scrapers out takes
/// that many addresses, each held for the whole deadline (a thread each, 256 KiB of stack).
const MAX_IN_FLIGHT: usize = 256;
/// Requests served at once for one peer address (a real scraper sends one at a time).
const MAX_PER_PEER: usize = 8;
/// Longest request head read.
const MAX_REQUEST: usize = 16 * 1024;

fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// `pid`, `exe` (and `device` if given), the pod labels that the client sent, and the container
/// id and pod uid its cgroup path shows.
fn labels(c: &Client, device: Option<String>, extra: &[(&str, &str)]) -> String {
    let mut l = format!("pid=\"{}\"", c.pid);
    if let Some(d) = device {
        let _ = write!(l, ",device=\"{d}\"");
    }
    let _ = write!(l, ",exe=\"{}\"", escape(&c.exe));
    let named = [("namespace", &c.namespace), ("pod", &c.pod), ("container", &c.container), ("group", &c.group)];
    for (k, v) in named.into_iter().chain([("container_id", &c.container_id), ("pod_uid", &c.pod_uid)]) {
        if let Some(v) = v {
            let _ = write!(l, ",{k}=\"{}\"", escape(v));
        }
    }
    for (k, v) in extra {
        let _ = write!(l, ",{k}=\"{}\"", escape(v));
    }
    l
}

/// `policy`, for a member whose header named its group's policy.
fn policy_label(c: &Client) -> Vec<(&'static str, &str)> {
    c.policy.as_deref().map(|p| ("policy", p)).into_iter().collect()
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

pub fn render(r: &Registry) -> String {
    let mut out = String::with_capacity(4096);
    let clients: Vec<&Client> = r.clients.values().collect();
    family(&mut out, "vramcap_clients", "gauge", "Preloaded processes connected to this sidecar.");
    let _ = writeln!(out, "vramcap_clients {}", clients.len());
    family(&mut out, "vramcap_bad_clients_total", "counter", "Connections dropped for breaking the protocol (malformed or oversized lines, no header in time).");
    let _ = writeln!(out, "vramcap_bad_clients_total {}", r.bad_clients);
    family(&mut out, "vramcap_refused_connections_total", "counter", "Connections closed at once: the sidecar's connection limit or the peer uid's quota was reached.");
    let _ = writeln!(out, "vramcap_refused_connections_total {}", r.refused);
    family(&mut out, "vramcap_groups", "gauge", "Group names the sidecar sweeps for dead members (named by a connected client, or with members left in their ledger).");
    let _ = writeln!(out, "vramcap_groups {}", r.groups.len());
    family(&mut out, "vramcap_group_reclaimed_bytes_total", "counter", "Bytes given back to group budgets from members that died without freeing.");
    let _ = writeln!(out, "vramcap_group_reclaimed_bytes_total {}", super::reclaim::RECLAIMED_BYTES.load(std::sync::atomic::Ordering::Relaxed));

    type Pick = fn(&super::state::Device) -> Option<u64>;
    let gauges: [(&str, &str, Pick); 6] = [
        ("vramcap_memory_used_bytes", "Device memory charged to the process now.", |d| Some(d.used)),
        (
            "vramcap_overhead_bytes",
            "Of vramcap_memory_used_bytes, what the driver took beyond allocations (contexts, modules, per-context reservations), as measured from its books.",
            |d| Some(d.overhead),
        ),
        ("vramcap_memory_limit_bytes", "The process's cap on the device (absent when uncapped).", |d| d.limit),
        ("vramcap_memory_peak_bytes", "The most the process held on the device at once.", |d| Some(d.peak)),
        ("vramcap_group_memory_limit_bytes", "The budget of the process's group on the device (group members only).", |d| d.group_limit),
        ("vramcap_group_memory_used_bytes", "All members of the process's group together on the device, as this member last saw it.", |d| d.group_used),
    ];
    for (name, help, pick) in gauges {
        family(&mut out, name, "gauge", help);
        for c in &clients {
            for (i, d) in &c.devices {
                if let Some(v) = pick(d) {
                    let _ = writeln!(out, "{name}{{{}}} {v}", labels(c, Some(i.to_string()), &[]));
                }
            }
        }
    }
    // Each member's sharing settings (issue 17), labelled with its group's policy: what a
    // dashboard needs to tell "denied by its share" from "denied by the budget".
    let sharing: [(&str, &str, Pick); 3] = [
        ("vramcap_group_reserve_bytes", "The member's reserve (VRAMCAP_GROUP_RESERVE) in its group's budget on the device; 0: none.", |d| d.group_reserve),
        ("vramcap_group_share_bytes", "Policy equal only: the most the member may hold on the device now, (budget - headroom) / live members (plus the headroom for its holder), as it last reported.", |d| d.group_share),
        ("vramcap_group_headroom_bytes", "The group's headroom on the device (VRAMCAP_GROUP_HEADROOM): budget kept free for a member not running yet; 0: none.", |d| d.group_headroom),
    ];
    for (name, help, pick) in sharing {
        family(&mut out, name, "gauge", help);
        for c in &clients {
            let extra = policy_label(c);
            for (i, d) in &c.devices {
                if let Some(v) = pick(d) {
                    let _ = writeln!(out, "{name}{{{}}} {v}", labels(c, Some(i.to_string()), &extra));
                }
            }
        }
    }
    family(&mut out, "vramcap_group_priority", "gauge", "The member's VRAMCAP_PRIORITY (higher wins under policy priority; group members only).");
    for c in &clients {
        if let Some(p) = c.priority {
            let extra = policy_label(c);
            let _ = writeln!(out, "vramcap_group_priority{{{}}} {p}", labels(c, None, &extra));
        }
    }
    family(&mut out, "vramcap_group_headroom_holder", "gauge", "1 when the member is the one that may use its group's headroom, else 0 (group members only).");
    for c in &clients {
        if let Some(h) = c.holds_headroom {
            let extra = policy_label(c);
            let _ = writeln!(out, "vramcap_group_headroom_holder{{{}}} {}", labels(c, None, &extra), h as u8);
        }
    }
    family(&mut out, "vramcap_allocations_total", "counter", "Successful counted allocations, per entry point.");
    for c in &clients {
        for ((dev, api), n) in &c.allocations {
            let _ = writeln!(out, "vramcap_allocations_total{{{}}} {n}", labels(c, Some(dev.to_string()), &[("api", api)]));
        }
    }
    family(&mut out, "vramcap_allocation_denied_total", "counter", "Allocations refused by the cap.");
    for c in &clients {
        for (i, d) in &c.devices {
            let _ = writeln!(out, "vramcap_allocation_denied_total{{{}}} {}", labels(c, Some(i.to_string()), &[]), d.denied);
        }
    }
    // Observe mode (issue 26): what enforcing the cap would have refused, and the peak the job
    // reached with nothing refused (to compare with vramcap_memory_limit_bytes).
    family(&mut out, "vramcap_allocation_would_deny_total", "counter", "Observe mode: allocations the cap would have refused, granted (0 for processes that enforce).");
    for c in &clients {
        for (i, d) in &c.devices {
            let _ = writeln!(out, "vramcap_allocation_would_deny_total{{{}}} {}", labels(c, Some(i.to_string()), &[]), d.would_deny);
        }
    }
    family(&mut out, "vramcap_would_be_peak_bytes", "gauge", "Observe mode only: the most the process held on the device at once with nothing refused.");
    for c in clients.iter().filter(|c| c.observe) {
        for (i, d) in &c.devices {
            let _ = writeln!(out, "vramcap_would_be_peak_bytes{{{}}} {}", labels(c, Some(i.to_string()), &[]), d.peak);
        }
    }
    family(&mut out, "vramcap_events_dropped_total", "counter", "Events the sidecar did not receive (client queue or send buffer full, no connection).");
    for c in &clients {
        let _ = writeln!(out, "vramcap_events_dropped_total{{{}}} {}", labels(c, None, &[]), c.dropped);
    }
    out
}

/// Serves until the process exits. One request per connection, each on its own thread.
pub fn serve(listener: TcpListener, registry: Arc<Mutex<Registry>>) {
    static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else {
            // EMFILE and friends: give the descriptors a moment to come back.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let peer = stream.peer_addr().map(|a| a.ip()).ok();
        if IN_FLIGHT.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT || !peer_slot(peer, true) {
            IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
            let _ = stream.set_nonblocking(true);
            let _ = stream.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            continue;
        }
        let r = registry.clone();
        let spawned = std::thread::Builder::new().name("metrics-request".into()).stack_size(256 * 1024).spawn(move || {
            let _ = answer(stream, &r, Instant::now() + DEADLINE);
            peer_slot(peer, false);
            IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            peer_slot(peer, false);
            IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Takes (`take`) or gives back one of the peer address's `MAX_PER_PEER` slots; false when it has
/// none left. The global slot was taken before a peer slot and given back after it, so an
/// address's count never outlives the global one. Only addresses with requests in flight are kept.
fn peer_slot(peer: Option<std::net::IpAddr>, take: bool) -> bool {
    static PEERS: Mutex<Option<std::collections::HashMap<std::net::IpAddr, usize>>> = Mutex::new(None);
    let Some(ip) = peer else { return true };
    let mut g = PEERS.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(Default::default);
    let n = m.entry(ip).or_insert(0);
    if take {
        if *n >= MAX_PER_PEER {
            return false;
        }
        *n += 1;
    } else {
        *n = n.saturating_sub(1);
        if *n == 0 {
            m.remove(&ip);
        }
    }
    true
}

/// The time left before `deadline`, as a socket timeout; an error once it has passed.
fn left(deadline: Instant) -> std::io::Result<Option<Duration>> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "request deadline passed"));
    }
    Ok(Some(d))
}

/// Writes all of `bytes` before `deadline` (each write waits at most for the time left).
fn write_by(s: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !bytes.is_empty() {
        s.set_write_timeout(left(deadline)?)?;
        match s.write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn answer(mut s: TcpStream, registry: &Mutex<Registry>, deadline: Instant) -> std::io::Result<()> {
    let mut req = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && !req.windows(2).any(|w| w == b"\n\n") {
        s.set_read_timeout(left(deadline)?)?;
        let n = s.read(&mut buf)?;
        if n == 0 || req.len() > MAX_REQUEST {
            break;
        }
        req.extend_from_slice(&buf[..n]);
    }
    let first = String::from_utf8_lossy(req.split(|&b| b == b'\n').next().unwrap_or(b""));
    let mut words = first.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, kind, body) = match (method, path) {
        ("GET", "/metrics") => {
            let body = render(&registry.lock().unwrap_or_else(|e| e.into_inner()));
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
        }
        ("GET", "/") => ("200 OK", "text/plain; charset=utf-8", "vramcap sidecar: metrics at /metrics\n".to_string()),
        ("GET", _) => ("404 Not Found", "text/plain; charset=utf-8", "not found; metrics are at /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "only GET\n".to_string()),
    };
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    write_by(&mut s, head.as_bytes(), deadline)?;
    write_by(&mut s, body.as_bytes(), deadline)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One client naming a new entry point on every allocation (500 000 of them, and names of
    /// other forms): the sidecar keeps a bounded set of series, the rest counted as `other`, so
    /// neither its memory nor the `/metrics` page grows with the stream. Counted, not timed.
    #[test]
    fn distinct_api_names_from_one_client_stay_bounded() {
        let h = serde_json::json!({"type":"header","version":1,"pid":1,"exe":"py","devices":[{"index":0,"total":10,"limit":null}]});
        let mut r = Registry::default();
        let mut c = Client::from_header(99, 0, &h).unwrap();
        c.apply(&serde_json::json!({"type":"event","op":"alloc","api":"cuMemAlloc_v2","dev":0,"used":1})).unwrap();
        for i in 0..500_000u32 {
            let api = if i % 2 == 0 { format!("cuMemAlloc{i}") } else { format!("x{}", "y".repeat(i as usize % 300)) };
            c.apply(&serde_json::json!({"type":"event","op":"alloc","api":api,"dev":i % 2,"used":1})).unwrap();
        }
        let n: u64 = c.allocations.values().sum();
        assert_eq!(n, 500_001, "every allocation is counted");
        assert!(c.allocations.len() <= crate::sidecar::state::MAX_ALLOCATION_SERIES + 2, "{} series", c.allocations.len());
        assert_eq!(c.allocations[&(0, "cuMemAlloc_v2".to_string())], 1, "the first names keep their own series");
        assert_eq!(c.allocations[&(1, "other".to_string())], 250_000, "names not of the library's form");
        // A snapshot with as many names is folded the same way.
        let many: Vec<_> = (0..100_000).map(|i| serde_json::json!({"dev":0,"api":format!("cuX{i}"),"count":2})).collect();
        c.apply(&serde_json::json!({"type":"usage","dropped":0,"devices":[],"allocations":many})).unwrap();
        assert!(c.allocations.len() <= crate::sidecar::state::MAX_ALLOCATION_SERIES + 1, "{} series", c.allocations.len());
        assert_eq!(c.allocations.values().sum::<u64>(), 200_000);
        r.clients.insert(1, c);
        let m = render(&r);
        assert!(m.len() < 64 << 10, "a {} byte /metrics page", m.len());
    }

    /// A group member's budget and its group's charge are exported beside its own numbers.
    /// Overhead (issue 24) from the usage snapshot: apart from, and part of, the used bytes.
    #[test]
    fn overhead_is_exported_apart() {
        let h = serde_json::json!({"type":"header","version":1,"pid":1,"exe":"py","devices":[{"index":0,"total":10,"limit":null}]});
        let mut r = Registry::default();
        let mut c = Client::from_header(99, 0, &h).unwrap();
        c.apply(&serde_json::json!({"type":"usage","t_ns":1,"events":0,"dropped":0,"allocations":[],
            "devices":[{"index":0,"used":700,"limit":null,"peak":700,"denied":0,"overhead":300}]})).unwrap();
        r.clients.insert(1, c);
        let m = render(&r);
        assert!(m.contains("vramcap_overhead_bytes{pid=\"99\",device=\"0\",exe=\"py\"} 300"), "{m}");
        assert!(m.contains("vramcap_memory_used_bytes{pid=\"99\",device=\"0\",exe=\"py\"} 700"), "{m}");
    }

    #[test]
    fn group_budgets_are_exported() {
        let h = serde_json::json!({"type":"header","version":1,"pid":1,"exe":"py","group":"team",
            "devices":[{"index":0,"total":10,"limit":null,"group_limit":1536}]});
        let mut r = Registry::default();
        let mut c = Client::from_header(99, 0, &h).unwrap();
        c.apply(&serde_json::json!({"type":"event","op":"alloc","api":"cuMemAlloc_v2","dev":0,"used":256,"group_used":1280})).unwrap();
        r.clients.insert(1, c);
        let m = render(&r);
        assert!(m.contains("vramcap_group_memory_limit_bytes{pid=\"99\",device=\"0\",exe=\"py\",group=\"team\"} 1536"), "{m}");
        assert!(m.contains("vramcap_group_memory_used_bytes{pid=\"99\",device=\"0\",exe=\"py\",group=\"team\"} 1280"), "{m}");
        assert!(m.contains("vramcap_memory_used_bytes{pid=\"99\",device=\"0\",exe=\"py\",group=\"team\"} 256"), "{m}");
    }

    /// A member's sharing settings: from its header, the share as its latest snapshot has it;
    /// a process outside a group gets none of these series.
    #[test]
    fn sharing_settings_are_exported_with_the_policy() {
        let h = serde_json::json!({"type":"header","version":1,"pid":1,"exe":"py","group":"team",
            "group_policy":"equal","group_priority":-2,"group_holds_headroom":true,
            "devices":[{"index":0,"total":10,"limit":null,"group_limit":1000,"group_reserve":100,"group_headroom":200,"group_share":600}]});
        let mut r = Registry::default();
        let mut c = Client::from_header(99, 0, &h).unwrap();
        c.apply(&serde_json::json!({"type":"usage","t_ns":1,"events":0,"dropped":0,"allocations":[],
            "devices":[{"index":0,"used":0,"limit":null,"peak":0,"denied":0,"group_limit":1000,"group_used":0,
                        "group_reserve":100,"group_headroom":200,"group_share":466}]})).unwrap();
        r.clients.insert(1, c);
        let plain = serde_json::json!({"type":"header","version":1,"pid":2,"exe":"other","devices":[{"index":0,"total":10,"limit":5}]});
        r.clients.insert(2, Client::from_header(98, 0, &plain).unwrap());
        let m = render(&r);
        let l = "pid=\"99\",device=\"0\",exe=\"py\",group=\"team\",policy=\"equal\"";
        for want in [
            format!("vramcap_group_reserve_bytes{{{l}}} 100\n"),
            format!("vramcap_group_headroom_bytes{{{l}}} 200\n"),
            format!("vramcap_group_share_bytes{{{l}}} 466\n"),
            "vramcap_group_priority{pid=\"99\",exe=\"py\",group=\"team\",policy=\"equal\"} -2\n".to_string(),
            "vramcap_group_headroom_holder{pid=\"99\",exe=\"py\",group=\"team\",policy=\"equal\"} 1\n".to_string(),
        ] {
            assert!(m.contains(&want), "{want} not in:\n{m}");
        }
        assert!(!m.lines().any(|x| x.starts_with("vramcap_group_") && x.contains("pid=\"98\"")), "{m}");
    }

    #[test]
    fn labels_are_escaped_and_pod_labels_appear_only_when_set() {
        let h = serde_json::json!({"type":"header","version":1,"pid":1,"exe":"a\"b\\c\nd",
            "devices":[{"index":0,"total":10,"limit":8}],"pod":"web-1"});
        let mut r = Registry::default();
        r.clients.insert(1, Client::from_header(99, 0, &h).unwrap());
        r.bad_clients = 3;
        let m = render(&r);
        assert!(m.contains("vramcap_memory_used_bytes{pid=\"99\",device=\"0\",exe=\"a\\\"b\\\\c\\nd\",pod=\"web-1\"} 0"), "{m}");
        assert!(m.contains("vramcap_memory_limit_bytes{pid=\"99\",device=\"0\""));
        assert!(!m.contains("namespace="));
        assert!(m.contains("vramcap_clients 1\n") && m.contains("vramcap_bad_clients_total 3\n"));
        // Every sample line is `name{labels} value` or `name value`.
        for l in m.lines().filter(|l| !l.starts_with('#')) {
            let v = l.rsplit(' ').next().unwrap();
            assert!(v.parse::<u64>().is_ok(), "{l}");
        }
    }
}
