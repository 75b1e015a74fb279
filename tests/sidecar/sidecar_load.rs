//! The sidecar at the CPU the DaemonSet recipe requests (docs/deploy.md: 50m), many clients
//! streaming at once: the timeouts time a client's silence, not the sidecar's own slowness, and
//! a round's work per client is bounded. `scripts/bench-sidecar-load` measures it with 200
//! preloaded clients; this test is its small, counted form (no timings asserted).

use vramcap_tests::sidecar_support;
use sidecar_support::*;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

unsafe extern "C" {
    fn geteuid() -> u32;
}

/// A cgroup of its own holding `pid` to `milli` thousandths of a CPU (v2 `cpu.max`, else v1
/// `cpu.cfs_quota_us`); `None` where this process cannot make one (not root, no cpu controller).
struct CpuCap(std::path::PathBuf);

impl CpuCap {
    fn new(pid: u32, milli: u64) -> Option<CpuCap> {
        if unsafe { geteuid() } != 0 {
            return None;
        }
        let v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        let base = if v2 { "/sys/fs/cgroup" } else { "/sys/fs/cgroup/cpu" };
        let d = std::path::PathBuf::from(format!("{base}/vramcap-test-{}", std::process::id()));
        std::fs::create_dir(&d).ok()?;
        let set = if v2 {
            std::fs::write(d.join("cpu.max"), format!("{} 100000", milli * 100))
        } else {
            std::fs::write(d.join("cpu.cfs_period_us"), "100000").and_then(|_| std::fs::write(d.join("cpu.cfs_quota_us"), (milli * 100).to_string()))
        };
        let cap = CpuCap(d);
        set.ok()?;
        std::fs::write(cap.0.join("cgroup.procs"), pid.to_string()).ok()?;
        Some(cap)
    }
}

impl Drop for CpuCap {
    fn drop(&mut self) {
        // Only an empty cgroup can be removed: what is still in it (the sidecar, when a failed
        // assertion drops this first) goes back to the parent.
        let parent = self.0.parent().unwrap().join("cgroup.procs");
        for pid in std::fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default().lines() {
            let _ = std::fs::write(&parent, pid);
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Twenty clients each send their header and 1.5 MiB of event lines at once to a sidecar held to
/// 50m of CPU with a 1 s hello timeout. It used to read 1 MiB a connection per round and parse
/// all of it: a round outlasted the timeout, and clients whose unfinished line (cut at the 1 MiB
/// boundary) waited on the sidecar were dropped as "bad". Now every one of them is kept, and a
/// client that really leaves a line unfinished is still dropped (the control).
#[test]
fn streaming_clients_are_not_dropped_for_the_sidecars_slowness() {
    let d = tmpdir("load");
    let sock = d.join("s.sock");
    let mut sc = Sidecar::start(&sock, &["--hello-timeout", "1"]);
    let Some(_cap) = CpuCap::new(sc.child.id(), 50) else {
        eprintln!("SKIPPED: needs root and a writable cpu cgroup (to hold the sidecar to 50m)");
        return;
    };
    let line = "{\"type\":\"event\",\"seq\":0,\"t_ns\":1,\"tid\":1,\"op\":\"alloc\",\"api\":\"cuMemAlloc_v2\",\"dev\":0,\"ptr\":\"0x1\",\"size\":4096,\"result\":0,\"dur_ns\":1,\"used\":4096}\n";
    let burst = line.repeat((3 << 19) / line.len());
    let writers: Vec<_> = (0..20u32)
        .map(|i| {
            let (sock, burst) = (sock.clone(), burst.clone());
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&sock).unwrap();
                s.write_all(header_line(70_000 + i).as_bytes()).unwrap();
                // Blocks while the sidecar is behind; an error here is the sidecar hanging up.
                s.write_all(burst.as_bytes()).map(|_| s)
            })
        })
        .collect();
    let mut trickler = UnixStream::connect(&sock).unwrap();
    trickler.write_all(header_line(79_999).as_bytes()).unwrap();
    trickler.write_all(b"{\"type\":\"usage\"").unwrap();
    let kept: Vec<UnixStream> = writers.into_iter().map(|w| w.join().unwrap().expect("the sidecar hung up on an honest client")).collect();
    // Everything is sent; let the sidecar finish reading it, then look (well within the 60 s idle
    // timeout: a silent but complete client stays).
    let lines = (burst.len() / line.len()) as u64;
    let counted = |s: &[Sample]| s.iter().filter(|x| x.name == "vramcap_allocations_total").map(|x| x.value).sum::<u64>();
    wait_until("the sidecar has read every burst", Duration::from_secs(180), || {
        let s = sc.samples();
        let bad = value(&s, "vramcap_bad_clients_total", &[]).unwrap_or(0);
        // Judged as soon as an honest client is dropped, or once every line is read.
        bad > 1 || (counted(&s) == 20 * lines && bad == 1)
    });
    let s = sc.samples();
    assert_eq!(value(&s, "vramcap_bad_clients_total", &[]), Some(1), "only the client that left its line unfinished:\n{}", sc.stderr.lock().unwrap());
    assert_eq!(value(&s, "vramcap_clients", &[]), Some(20));
    drop(kept);
    drop(trickler);
    sc.kill();
}
