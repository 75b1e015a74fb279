//! Graph memory the driver allocates in ways beyond one flat graph launched (issue 23): memory
//! nodes nested in child graphs moved in with `cuGraphAddNode_v2` (CUDA 12.9 ownership move), an
//! upload at instantiation (`CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD`), and relaunches of a graph
//! instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`, which free what the
//! previous launch left allocated. Each runs through the three lookup paths, each with a bare
//! control showing the fake driver keeps the documented rule; `stats` (the fake's own count) shows
//! what the device really held.

use vramcap_tests::common;
use common::*;

fn bare(client: &str, ops: &str) -> Output {
    let out = Run::client(client).bare().args([ops]).run();
    out.ok();
    out
}

fn rcs(out: &Output, op: &str) -> Vec<i64> {
    out.of(op).iter().map(|l| l.rc()).collect()
}

fn peak(out: &Output, i: usize) -> u64 {
    out.nth("stats", i).num("peak")
}

#[test]
fn memory_nodes_nested_in_moved_child_graphs_are_charged_at_launch() {
    // gx DEV SIZE FREE DEPTH VARIANT FLAGS: the only memory node is DEPTH child graphs down.
    for c in CLIENTS {
        let out = bare(c, "init ctx 0 gx 0 200m 1 3 0 0 glaunch 0 gmem 0");
        assert_eq!(rcs(&out, "glaunch"), vec![0], "{c} bare: {}", out.stdout);
        assert_eq!(out.nth("gmem", 0).num("reserved"), 200 * MIB, "{c} bare: the launch allocated the nested node");
    }
    for c in CLIENTS {
        for (depth, variant) in [(1, 0), (2, 2), (5, 3)] {
            let ops = format!("init ctx 0 alloc 100m gx 0 200m 1 {depth} {variant} 0 glaunch 0 stats 0 free 0 glaunch 0 info");
            let out = run_capped(c, "256m", &ops);
            let ctx = format!("{c} depth {depth} variant {variant}: {}", out.stdout);
            assert_eq!(out.nth("graph", 0).rc(), 0, "{ctx}");
            assert_eq!(rcs(&out, "glaunch"), vec![2, 0], "{ctx}: denied past the cap, then granted");
            assert!(peak(&out, 0) <= 256 * MIB, "{ctx}: {} bytes reached the device", peak(&out, 0));
            assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{ctx}: the nested node's memory is charged");
        }
    }
}

#[test]
fn an_upload_at_instantiation_is_charged_there() {
    for c in CLIENTS {
        let out = bare(c, "init ctx 0 gx 0 200m 1 0 2 2 gmem 0");
        assert_eq!(out.nth("graph", 0).rc(), 0, "{c} bare: {}", out.stdout);
        assert_eq!(out.nth("gmem", 0).num("reserved"), 200 * MIB, "{c} bare: instantiation backed the graph's memory");
    }
    for c in CLIENTS {
        for variant in [2, 3] {
            let out = run_capped(c, "256m", &format!("init ctx 0 gx 0 200m 1 1 {variant} 2 info alloc 100m stats 0 glaunch 0 stats 0"));
            let ctx = format!("{c} variant {variant}: {}", out.stdout);
            assert_eq!(out.nth("graph", 0).rc(), 0, "{ctx}");
            assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{ctx}: charged at instantiation");
            assert!(peak(&out, 0) <= 256 * MIB && peak(&out, 1) <= 256 * MIB, "{ctx}: the device held more than the cap");
            // Past the cap already: the upload is refused before the driver backs anything.
            let out = run_capped(c, "256m", &format!("init ctx 0 alloc 100m gx 0 200m 1 0 {variant} 2 gmem 0 stats 0"));
            let ctx = format!("{c} variant {variant}: {}", out.stdout);
            assert_eq!(out.nth("graph", 0).rc(), 2, "{ctx}: CUDA_ERROR_OUT_OF_MEMORY");
            assert_eq!(out.nth("gmem", 0).num("reserved"), 0, "{ctx}: never reached the driver");
        }
    }
}

#[test]
fn relaunching_an_auto_free_graph_reuses_what_the_last_launch_left() {
    for c in CLIENTS {
        let out = bare(c, "init ctx 0 gx 0 200m 0 0 0 1 glaunch 0 glaunch 0 gmem 0 gx 0 200m 0 0 0 0 glaunch 1 glaunch 1");
        assert_eq!(rcs(&out, "glaunch"), vec![0, 0, 0, 1], "{c} bare: auto-free relaunches; without the flag it is an error");
        assert_eq!(out.nth("gmem", 0).num("used"), 200 * MIB, "{c} bare: the first launch's memory was freed and reused");
    }
    for c in CLIENTS {
        for variant in [0, 2, 3] {
            let ops = format!("init ctx 0 gx 0 200m 0 0 {variant} 1 glaunch 0 info glaunch 0 info glaunch 0 stats 0");
            let out = run_capped(c, "256m", &ops);
            let ctx = format!("{c} variant {variant}: {}", out.stdout);
            assert_eq!(rcs(&out, "glaunch"), vec![0, 0, 0], "{ctx}: no false out-of-memory");
            assert_eq!(out.nth("info", 1).num("free"), 56 * MIB, "{ctx}: one launch's memory, charged once");
            assert!(peak(&out, 0) <= 256 * MIB, "{ctx}");
        }
        // The application freed the memory and trimmed it away: the relaunch needs it all again,
        // and past the cap it is denied.
        let out = run_capped(c, "256m", "init ctx 0 gx 0 200m 0 0 0 1 glaunch 0 freeasync 0 gtrim 0 alloc 100m glaunch 0 stats 0");
        assert_eq!(rcs(&out, "alloc"), vec![0], "{c}: {}", out.stdout);
        assert_eq!(rcs(&out, "glaunch"), vec![0, 2], "{c}: {}", out.stdout);
        assert!(peak(&out, 0) <= 256 * MIB, "{c}: {} bytes reached the device", peak(&out, 0));
        // Freed by the application, then taken by another graph's launch: nothing left to reuse.
        let ops = "init ctx 0 gx 0 200m 0 0 0 1 gx 0 200m 0 0 0 1 glaunch 0 freeasync 0 glaunch 1 glaunch 0 gmem 0 stats 0";
        let plain = bare(c, ops);
        assert_eq!(rcs(&plain, "glaunch"), vec![0, 0, 0], "{c} bare: {}", plain.stdout);
        assert_eq!(plain.nth("gmem", 0).num("reserved"), 400 * MIB, "{c} bare: the relaunch needed new memory");
        let out = run_capped(c, "256m", ops);
        assert_eq!(rcs(&out, "glaunch"), vec![0, 0, 2], "{c}: {}", out.stdout);
        assert!(peak(&out, 0) <= 256 * MIB, "{c}: {} bytes reached the device", peak(&out, 0));
    }
}

#[test]
fn a_memory_node_past_a_million_other_nodes_is_still_charged() {
    // gwide K M SIZE: 1024 moved children of 1025 (empty, cloned) child graph nodes each, over 2^20
    // nodes in all; the only memory node ends the child read last.
    let ops = "init ctx 0 gwide 1024 1025 200m glaunch 0 gmem 0 stats 0";
    for c in CLIENTS {
        let out = bare(c, ops);
        assert_eq!(out.nth("graph", 0).rc(), 0, "{c} bare: {}", out.stdout);
        assert_eq!(rcs(&out, "glaunch"), vec![0], "{c} bare");
        assert_eq!(out.nth("gmem", 0).num("reserved"), 200 * MIB, "{c} bare: the launch allocated it");
    }
    for c in CLIENTS {
        let out = run_capped(c, "64m", ops);
        assert_eq!(out.nth("graph", 0).rc(), 0, "{c}: {}", out.stdout);
        assert_eq!(rcs(&out, "glaunch"), vec![2], "{c}: 200 MiB past a 64 MiB cap: {}", out.stdout);
        assert!(peak(&out, 0) <= 64 * MIB, "{c}: {} bytes reached the device", peak(&out, 0));
    }
}

/// The relaunch credit of an auto-free graph, raced (issue 23): while one thread relaunches an
/// auto-free graph counting on the memory its last launch left, another frees that memory and
/// launches a second graph into it. The fake takes its time (`FAKECUDA_RELAUNCH_DELAY_US`) before
/// the relaunch reaches that memory: bare, the second graph has taken it by then and the relaunch
/// allocates anew (400 MiB on the device); under a 256 MiB cap the device never holds more than
/// the cap, whichever thread wins each round.
#[test]
fn a_relaunch_credit_cannot_be_taken_by_another_thread_meanwhile() {
    // Graph 0: 200 MiB auto-free, never freed by the graph (slot 0); graph 1: 200 MiB (slot 1).
    let ops = "init ctx 0 gx 0 200m 0 0 0 1 gx 0 200m 0 0 0 0 gxrace 0 0 1 1 20 gtrim 0 stats 0 info";
    for c in CLIENTS {
        let plain = Run::client(c).bare().env("FAKECUDA_RELAUNCH_DELAY_US", "20000").args([ops]).run();
        plain.ok();
        assert_eq!(plain.nth("gxrace", 0).num("errors"), 0, "{c} bare: {}", plain.stdout);
        assert_eq!(peak(&plain, 0), 400 * MIB, "{c} bare: the relaunch allocated anew: {}", plain.stdout);
        let out = Run::client(c).env("VRAMCAP_LIMIT", "256m").env("FAKECUDA_RELAUNCH_DELAY_US", "20000").args([ops]).run();
        out.ok();
        let ctx = format!("{c}: {}", out.stdout);
        let r = out.nth("gxrace", 0);
        assert_eq!(r.num("errors"), 0, "{ctx}");
        assert!(r.num("raced_ok") + r.num("other_ok") > 0, "{ctx}: something must fit");
        assert!(peak(&out, 0) <= 256 * MIB, "{ctx}: {} bytes reached the device", peak(&out, 0));
        // Nothing stays charged that the device gave back.
        assert_eq!(out.nth("info", 0).num("free"), 256 * MIB - out.nth("stats", 0).num("bytes_held"), "{ctx}");
    }
}

/// Many threads relaunching one auto-free graph at once: one launch's memory fits the cap, each
/// relaunch reuses it; the device never holds more than the cap and the charge ends equal to what
/// the device holds (nothing leaked, nothing lost).
#[test]
fn concurrent_relaunches_of_one_auto_free_graph_stay_under_the_cap() {
    let ops = "init ctx 0 gx 0 200m 0 0 0 1 glaunch 0 gxstorm 0 16 200 gmem 0 stats 0 info";
    for c in CLIENTS {
        let out = run_capped(c, "256m", ops);
        let ctx = format!("{c}: {}", out.stdout);
        let s = out.nth("gxstorm", 0);
        assert_eq!(s.num("other"), 0, "{ctx}");
        assert!(s.num("ok") > 0, "{ctx}: relaunches reuse the memory");
        assert!(peak(&out, 0) <= 256 * MIB, "{ctx}: {} bytes reached the device", peak(&out, 0));
        assert_eq!(out.nth("gmem", 0).num("reserved"), 200 * MIB, "{ctx}");
        assert_eq!(out.nth("info", 0).num("free"), 56 * MIB, "{ctx}: charged what the device holds");
    }
}

/// `cuGraphExecUpdate` (v1) and `cuGraphExecUpdate_v2` (issue 23): an update keeps the topology
/// and node types, but the documentation does not fix an allocation node's size, and the fake
/// takes the new one over (bare: the next launch reserves 300 MiB). Under a 256 MiB cap the
/// launch after an update to 300 MiB is denied before the driver allocates it; a refused update
/// (another topology) changes nothing.
#[test]
fn a_graph_updated_to_more_memory_is_charged_what_the_update_asks() {
    for c in CLIENTS {
        for v in [1, 2] {
            let out = bare(c, &format!("init ctx 0 gx 0 100m 1 0 0 0 glaunch 0 gupdate 0 0 300m 1 {v} glaunch 0 gmem 0"));
            assert_eq!(out.nth("gupdate", 0).rc(), 0, "{c} bare v{v}: {}", out.stdout);
            assert_eq!(out.nth("gmem", 0).num("reserved"), 300 * MIB, "{c} bare v{v}: the update's size was launched");
        }
    }
    for c in CLIENTS {
        for (variant, v) in [(0, 1), (0, 2), (2, 2), (3, 1)] {
            let ops = format!("init ctx 0 gx 0 100m 1 0 {variant} 0 glaunch 0 gupdate 0 0 300m 1 {v} glaunch 0 stats 0 \
                               gupdate 0 0 50m 0 {v} glaunch 0 info");
            let out = run_capped(c, "256m", &ops);
            let ctx = format!("{c} variant {variant} v{v}: {}", out.stdout);
            assert_eq!(out.nth("gupdate", 0).rc(), 0, "{ctx}");
            assert_eq!(rcs(&out, "glaunch")[..2], [0, 2], "{ctx}: 300 MiB past the cap, denied");
            assert!(peak(&out, 0) <= 256 * MIB, "{ctx}: {} bytes reached the device", peak(&out, 0));
            // Another topology (no free node): refused by the driver (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
            // topology changed), the charge unchanged.
            assert_eq!(out.nth("gupdate", 1).rc(), 910, "{ctx}");
            assert_eq!(out.nth("gupdate", 1).num("result"), 2, "{ctx}");
        }
    }
}
