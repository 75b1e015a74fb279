//! Observe mode on /metrics (issue 26): what the cap would have refused
//! (`vramcap_allocation_would_deny_total`) and the peak with nothing refused
//! (`vramcap_would_be_peak_bytes`), per process and device; a process that enforces has a zero
//! count and no would-be peak (the control).

use std::time::Duration;
use vramcap_tests::common::*;
use vramcap_tests::sidecar_support::*;

#[test]
fn metrics_count_what_observe_mode_would_have_refused() {
    let dir = tmpdir("observe");
    let sc = Sidecar::start(&dir.join("s.sock"), &[]);
    let ops = "init ctx 0 alloc 600m alloc 600m alloc 100m sleep 60000";
    let a = Client::spawn("client_linked", &sc.socket, &[("VRAMCAP_LIMIT", "1g"), ("VRAMCAP_MODE", "observe")], ops);
    let b = Client::spawn("client_dlsym", &sc.socket, &[("VRAMCAP_LIMIT", "1g")], ops);
    let (pa, pb) = (a.pid(), b.pid());
    let at = |pid: &str| [("pid", pid.to_string()), ("device", "0".to_string())];
    let get = |s: &[Sample], name: &str, pid: &str| {
        let l = at(pid);
        value(s, name, &[(l[0].0, l[0].1.as_str()), (l[1].0, l[1].1.as_str())])
    };
    wait_until("both processes' allocations", Duration::from_secs(20), || {
        let s = sc.samples();
        get(&s, "vramcap_memory_used_bytes", &pa) == Some(1300 * MIB) && get(&s, "vramcap_memory_used_bytes", &pb) == Some(700 * MIB)
    });
    let s = sc.samples();
    assert_eq!(get(&s, "vramcap_allocation_would_deny_total", &pa), Some(2));
    assert_eq!(get(&s, "vramcap_allocation_denied_total", &pa), Some(0));
    assert_eq!(get(&s, "vramcap_would_be_peak_bytes", &pa), Some(1300 * MIB));
    assert_eq!(get(&s, "vramcap_memory_limit_bytes", &pa), Some(GIB), "the limit it would be held to");
    assert_eq!(get(&s, "vramcap_allocation_would_deny_total", &pb), Some(0));
    assert_eq!(get(&s, "vramcap_allocation_denied_total", &pb), Some(1));
    assert_eq!(get(&s, "vramcap_would_be_peak_bytes", &pb), None, "enforcing: no would-be peak");
    // A usage snapshot (every second) carries the count too: it stays right, not doubled.
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(get(&sc.samples(), "vramcap_allocation_would_deny_total", &pa), Some(2));
    let text = sc.text();
    assert!(text.contains("# TYPE vramcap_allocation_would_deny_total counter") && text.contains("# TYPE vramcap_would_be_peak_bytes gauge"), "{text}");
    drop((a, b));
}
