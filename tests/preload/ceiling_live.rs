//! The ceiling file edited while a job runs (issue 26): grown, made invalid, shrunk below what the
//! process holds, removed; and a group member held to its ceiling above an operator's budget. As
//! in `ceiling.rs`, root in a mount namespace with its own `/etc`; here `/etc/vramcap/limits` is a
//! link (as a ConfigMap's is) to a root-owned file the test rewrites from outside.

use super::ceiling::{can_overlay_etc, client, scratch};
use vramcap_tests::common;
use common::*;
use std::io::Read;
use std::path::Path;

/// The client under `/etc/vramcap/limits` → `t/live/limits`.
fn with_live_etc(t: &Path, limits: &str, prog: &str) -> Run {
    let live = t.join("live");
    std::fs::create_dir_all(&live).unwrap();
    write_limits(t, limits);
    let script = format!(
        "set -e\nmount -t overlay overlay -o lowerdir=/etc,upperdir={t}/up,workdir={t}/work /etc\n\
         mkdir -p /etc/vramcap\nln -sf {t}/live/limits /etc/vramcap/limits\nexec \"$@\"\n",
        t = t.display()
    );
    std::fs::write(t.join("etc.sh"), script).unwrap();
    Run::program(Path::new("unshare")).args(["-m", "sh", t.join("etc.sh").to_str().unwrap(), prog])
}

/// Replaces the file in one step (a reader never sees half of it).
fn write_limits(t: &Path, text: &str) {
    let tmp = t.join("live/.limits.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, t.join("live/limits")).unwrap();
}

/// Longer than the watcher's look (250 ms) plus a loaded machine's delay: the clients sleep this.
const SETTLE_MS: u64 = 1500;

fn stderr_of(mut r: Running) -> String {
    let mut err = String::new();
    r.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(r.finish().success());
    err
}

#[test]
fn an_edited_ceiling_applies_within_a_second_and_a_bad_or_removed_one_keeps_the_last() {
    if !can_overlay_etc() {
        eprintln!("SKIPPED: needs root, unshare -m and overlayfs");
        return;
    }
    let t = scratch();
    let ops = format!(
        "init ctx 0 alloc 200m sleep {s} alloc 100m sleep {s} alloc 100m sleep {s} alloc 16m info sleep {s} alloc 16m",
        s = SETTLE_MS
    );
    let trace = t.join("job.jsonl");
    let mut r = with_live_etc(&t, "VRAMCAP_LIMIT=256m\n", &client("client_linked")).env("VRAMCAP_TRACE", &trace).args([ops]).spawn();
    assert_eq!(r.wait_for("alloc").rc(), 0);
    write_limits(&t, "VRAMCAP_LIMIT=512m\n");
    assert_eq!(r.wait_for("alloc").rc(), 0, "the grown ceiling lets 300 MiB through");
    write_limits(&t, "VRAMCAP_LIMIT=lots\n");
    assert_eq!(r.wait_for("alloc").rc(), 0, "an invalid file keeps the last valid ceiling (512 MiB)");
    write_limits(&t, "VRAMCAP_LIMIT=128m\n");
    assert_eq!(r.wait_for("alloc").rc(), 2, "shrunk below what is held: new memory is refused");
    let info = r.wait_for("info");
    assert_eq!((info.num("total"), info.num("free")), (128 * MIB, 0), "the new total, nothing free");
    std::fs::remove_file(t.join("live/limits")).unwrap();
    assert_eq!(r.wait_for("alloc").rc(), 2, "a removed file keeps the last ceiling");
    let err = stderr_of(r);
    assert!(err.contains("limit 256.0 MiB -> 512.0 MiB (/etc/vramcap/limits changed)"), "{err}");
    assert_eq!(err.matches("keeping the last valid ceiling").count(), 1, "said once: {err}");
    assert!(err.contains("was removed: keeping the last ceiling"), "{err}");
    // Each change is a `limit` event in the trace: 256 → 512 → 128 MiB, by the ceiling file.
    let changes: Vec<(u64, u64, String)> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["op"] == "limit" && v["dev"] == 0)
        .map(|v| (v["old"].as_u64().unwrap(), v["new"].as_u64().unwrap(), v["source"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(changes, vec![(256 * MIB, 512 * MIB, "ceiling".into()), (512 * MIB, 128 * MIB, "ceiling".into())]);
}

#[test]
fn a_group_member_is_held_to_its_ceiling_above_an_operators_budget() {
    if !can_overlay_etc() {
        eprintln!("SKIPPED: needs root, unshare -m and overlayfs");
        return;
    }
    let t = scratch();
    let g = t.join("groups");
    std::fs::create_dir_all(&g).unwrap();
    let limits = format!("VRAMCAP_GROUP=plat\nVRAMCAP_GROUP_LIMIT=256m\nVRAMCAP_GROUP_DIR={}\n", g.display());
    let ops = format!("init ctx 0 alloc 200m sleep {SETTLE_MS} alloc 100m info");
    let mut r = with_live_etc(&t, &limits, &client("client_linked")).args([ops]).spawn();
    assert_eq!(r.wait_for("alloc").rc(), 0);
    let o = std::process::Command::new(vramcap_bin())
        .args(["limit", "--group", "plat", "--group-dir", g.to_str().unwrap(), "1g"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    assert_eq!(r.wait_for("alloc").rc(), 2, "the ledger says 1 GiB, the member's ceiling 256 MiB");
    assert_eq!(r.wait_for("info").num("total"), 256 * MIB);
    stderr_of(r);
}
