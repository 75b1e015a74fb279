//! `vramcap replay --policy`: the traces as one vramcap group (docs/analysis.md, "Group
//! policies"). Each test builds small traces whose verdicts are worked out by hand in comments.

use vramcap_tests::cli_support;
use vramcap_tests::common;
use cli_support::*;
use serde_json::Value;

/// A trace of one process on device 0: `events` as (t_ns, op, ptr, size, used), and a summary
/// with the exit time `end`.
fn synth(dir: &std::path::Path, name: &str, pid: u32, events: &[(u64, &str, u64, u64, u64)], end: u64) -> String {
    let mut t = format!(
        r#"{{"type":"header","version":1,"pid":{pid},"ppid":1,"exe":"job","cmdline":["job"],"host":"h","start_unix_ns":1764441600000000000,"devices":[{{"index":0,"total":17179869184,"limit":null}}],"group":null}}"#
    ) + "\n";
    for (seq, (at, op, ptr, size, used)) in events.iter().enumerate() {
        t += &format!(
            r#"{{"type":"event","seq":{seq},"t_ns":{at},"tid":1,"op":"{op}","api":"cuMemAlloc_v2","dev":0,"ptr":"{ptr:#x}","size":{size},"result":0,"dur_ns":5,"used":{used}}}"#
        );
        t += "\n";
    }
    let used = events.last().map_or(0, |e| e.4);
    t += &format!(r#"{{"type":"summary","t_ns":{end},"events":{},"dropped":0,"peak":{{"0":{used}}},"used":{{"0":{used}}}}}"#, events.len());
    t += "\n";
    let p = dir.join(name);
    std::fs::write(&p, t).unwrap();
    p.to_str().unwrap().to_string()
}

/// `vramcap replay --json ARGS`; the exit status must agree with `fits` (0 fits, 1 does not).
fn replay(args: &[&str]) -> Value {
    let mut all = vec!["replay", "--json"];
    all.extend_from_slice(args);
    let out = vramcap(&all);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out.stderr)));
    assert_eq!(out.status.code(), Some(if v["fits"] == true { 0 } else { 1 }), "{v}");
    v
}

fn replay_text(args: &[&str]) -> (Option<i32>, String) {
    let mut all = vec!["replay"];
    all.extend_from_slice(args);
    let out = vramcap(&all);
    (out.status.code(), text(&out.stdout))
}

/// Limit 4 GiB, both live from 0: a takes 3 GiB at 100 us, b 512 MiB at 200 us. Shared: 3.5 GiB
/// fits. Equal: the share is 4/2 = 2 GiB, so a's 3 GiB is denied; b's 512 MiB is not.
#[test]
fn equal_split_denies_the_bigger_job_that_shared_lets_through() {
    let dir = scratch("equal");
    let a = synth(&dir, "a.jsonl", 1, &[(100_000, "alloc", 0x1000, 3 * GIB, 3 * GIB)], 1_000_000);
    let b = synth(&dir, "b.jsonl", 2, &[(200_000, "alloc", 0x1000, 512 * MIB, 512 * MIB)], 1_000_000);
    let r = replay(&["--limit", "4GiB", &a, &b]);
    assert_eq!((r["fits"].as_bool(), r["policy"].as_str(), r["denials"].as_u64()), (Some(true), Some("shared"), Some(0)));
    assert_eq!(r["policies"]["equal"]["denials"].as_u64(), Some(1), "{r}");
    let r = replay(&["--limit", "4GiB", "--policy", "equal", &a, &b]);
    assert_eq!(r["fits"], false);
    assert_eq!(r["denials"].as_u64(), Some(1));
    let f = &r["first_denial"];
    assert_eq!((f["pid"].as_u64(), f["t_ns"].as_u64(), f["size"].as_u64(), f["rule"].as_str()), (Some(1), Some(100_000), Some(3 * GIB), Some("equal_share")));
    assert_eq!(f["reason"], "equal share 2.0 GiB of 4.0 GiB among 2 members");
    assert_eq!((r["traces"][0]["denials"].as_u64(), r["traces"][1]["denials"].as_u64()), (Some(1), Some(0)));
    assert!(r["traces"][1]["first_denial"].is_null());
    assert_eq!(r["policies"]["shared"]["fits"], true);
    assert_eq!(r["policies"]["priority"]["fits"], true);
}

/// The text output: the chosen policy's verdict, per member, then the three policies.
#[test]
fn the_three_policy_table_is_printed() {
    let dir = scratch("table");
    let a = synth(&dir, "a.jsonl", 1, &[(100_000, "alloc", 0x1000, 3 * GIB, 3 * GIB)], 1_000_000);
    let b = synth(&dir, "b.jsonl", 2, &[(200_000, "alloc", 0x1000, 512 * MIB, 512 * MIB)], 1_000_000);
    let (code, t) = replay_text(&["--limit", "4GiB", &a, &b]);
    assert_eq!(code, Some(0), "{t}");
    assert!(t.contains("verdict: they fit (policy shared)"), "{t}");
    assert!(t.contains(&format!("  pid 1 ({a}): no denials\n")), "{t}");
    assert!(t.contains("policies compared (same traces, limit, reserves, headroom):\n  policy    fits  denials  first denied\n"), "{t}");
    assert!(t.contains("\n  shared    yes   0        -\n"), "{t}");
    assert!(t.contains(&format!("\n  equal     no    1        pid 1 ({a}) at +0.0001s on device 0: equal share 2.0 GiB of 4.0 GiB among 2 members\n")), "{t}");
    assert!(t.contains("\n  priority  yes   0        -\n"), "{t}");
    let (code, t) = replay_text(&["--limit", "4GiB", "--policy", "equal", &a, &b]);
    assert_eq!(code, Some(1), "{t}");
    assert!(t.contains(&format!("  pid 1 ({a}): 1 denial(s), the first at +0.0001s on device 0 (cuMemAlloc_v2 of 3.0 GiB): equal share 2.0 GiB of 4.0 GiB among 2 members\n")), "{t}");
}

/// Limit 4 GiB. hi (priority 10, reserve 2 GiB) and lo (priority 0, reserve 1 GiB) start at 0:
/// held = 3 GiB. lo's 1.5 GiB at 100 us uses its own 1 GiB reserve: held 2 + 1.5 = 3.5 GiB.
/// lo's next 1 GiB at 200 us would make 4.5 GiB: hi's unmet 2 GiB is what is in the way. lo
/// frees that 1 GiB at 300 us (3.5 GiB held; lo's reserve is used up, nothing refills).
#[test]
fn priority_denies_a_low_job_while_a_high_jobs_reserve_is_unmet() {
    let dir = scratch("prio-deny");
    let hi = synth(&dir, "hi.jsonl", 1, &[(500_000, "alloc", 0x1000, GIB, GIB)], 1_000_000);
    let lo = synth(
        &dir,
        "lo.jsonl",
        2,
        &[(100_000, "alloc", 0x1000, 1536 * MIB, 1536 * MIB), (200_000, "alloc", 0x2000, GIB, 2560 * MIB), (300_000, "free", 0x2000, GIB, 1536 * MIB)],
        1_000_000,
    );
    let args = ["--limit", "4GiB", "--policy", "priority", "--priority", "hi.jsonl=10", "--priority", &format!("{lo}=0"), "--reserve", "hi.jsonl=2GiB", "--reserve", "lo.jsonl=1GiB", &hi, &lo];
    let r = replay(&args);
    assert_eq!((r["fits"].as_bool(), r["denials"].as_u64()), (Some(false), Some(1)), "{r}");
    let f = &r["first_denial"];
    assert_eq!((f["pid"].as_u64(), f["t_ns"].as_u64(), f["size"].as_u64(), f["rule"].as_str()), (Some(2), Some(200_000), Some(GIB), Some("priority")));
    assert_eq!(f["reason"], "reserved for higher priority");
    assert_eq!((r["traces"][0]["priority"].as_i64(), r["traces"][1]["priority"].as_i64()), (Some(10), Some(0)));
    assert_eq!(r["traces"][0]["reserve"]["0"].as_u64(), Some(2 * GIB));
    // hi's own 1 GiB at 500 us comes out of its reserve: held 3.5 - 1 + 1, no new denial.
    assert_eq!(r["traces"][0]["denials"].as_u64(), Some(0));
    // Under `shared` the same allocation is refused too: hi's unmet reserve is in the way, as the
    // library's denial line says ("reserved for other members").
    assert_eq!(r["policies"]["shared"]["denials"].as_u64(), Some(1));
    assert_eq!(r["policies"]["shared"]["first_denial"]["rule"], "reserved");
    assert_eq!(r["policies"]["shared"]["first_denial"]["reason"], "reserved for other members");
    assert_eq!(r["policies"]["shared"]["first_denial"]["t_ns"].as_u64(), Some(200_000));
}

/// Limit 4 GiB. lo (priority 0) reserves 2 GiB at 0; hi (priority 5) asks 3 GiB at 100 us:
/// held 2 + 3 = 5 GiB, 1 GiB over, so under `priority` hi takes 1 GiB of lo's unmet reserve.
/// lo's 1 GiB at 200 us uses its remaining 1 GiB: held stays 4 GiB. Under `shared` and `equal`
/// nothing is taken: hi is over the budget (5 GiB), and (the replay going on with hi's recorded
/// 3 GiB) lo's 1 GiB still comes out of its own reserve, which the library grants whatever the
/// others hold: one denial, hi's.
#[test]
fn a_high_job_takes_a_low_jobs_reserve() {
    let dir = scratch("prio-take");
    let lo = synth(&dir, "lo.jsonl", 1, &[(200_000, "alloc", 0x1000, GIB, GIB)], 1_000_000);
    let hi = synth(&dir, "hi.jsonl", 2, &[(100_000, "alloc", 0x1000, 3 * GIB, 3 * GIB)], 1_000_000);
    let mut args = vec!["--limit", "4GiB", "--priority", "hi.jsonl=5", "--reserve", "lo.jsonl=2GiB", &lo, &hi];
    let r = replay(&args);
    assert_eq!((r["fits"].as_bool(), r["denials"].as_u64()), (Some(false), Some(1)), "{r}");
    assert_eq!(r["first_denial"]["pid"].as_u64(), Some(2));
    // lo's unmet reserve is what stands in the way, as the library's denial line says.
    assert_eq!(r["first_denial"]["rule"], "reserved");
    assert_eq!((r["traces"][0]["denials"].as_u64(), r["traces"][1]["denials"].as_u64()), (Some(0), Some(1)));
    assert_eq!(r["policies"]["equal"]["denials"].as_u64(), Some(1));
    assert_eq!((r["policies"]["priority"]["fits"].as_bool(), r["policies"]["priority"]["denials"].as_u64()), (Some(true), Some(0)));
    args.splice(0..0, ["--policy", "priority"]);
    let r = replay(&args);
    assert_eq!((r["fits"].as_bool(), r["denials"].as_u64()), (Some(true), Some(0)), "{r}");
    assert_eq!(r["traces"][1]["took_from_reserves"].as_u64(), Some(GIB));
    assert_eq!(r["traces"][0]["reserve_taken"].as_u64(), Some(GIB));
    assert_eq!(r["traces"][0]["took_from_reserves"].as_u64(), Some(0));
    let (code, t) = replay_text(&args);
    assert_eq!(code, Some(0), "{t}");
    assert!(t.contains("    it took 1.0 GiB of lower-priority members' unmet reserves\n"), "{t}");
    assert!(t.contains("    1.0 GiB of its unmet reserve was taken by higher-priority members\n"), "{t}");
}

/// Limit 5 GiB, `--policy priority`. mid (priority 1), low1 and low2 (priority 0, low2 started
/// later) reserve 1 GiB each: held 3 GiB. hi (priority 5) asks 2.5 GiB at 100 us: 0.5 GiB over,
/// taken from low2 (lowest priority, latest started). hi asks 1 GiB at 200 us: held 5, 1 GiB
/// over: low2's last 0.5 GiB, then 0.5 GiB of low1's; mid keeps its reserve. low2's 256 MiB at
/// 300 us (+1 ns: its offset; 5.25 GiB) cannot take low1's reserve (equal priority): denied, with mid's 1 GiB in
/// the way.
#[test]
fn reserves_are_taken_lowest_priority_first_then_latest_started() {
    let dir = scratch("prio-order");
    let hi = synth(&dir, "hi.jsonl", 1, &[(100_000, "alloc", 0x1000, 2560 * MIB, 2560 * MIB), (200_000, "alloc", 0x2000, GIB, 3584 * MIB)], 1_000_000);
    let mid = synth(&dir, "mid.jsonl", 2, &[], 1_000_000);
    let low1 = synth(&dir, "low1.jsonl", 3, &[], 1_000_000);
    let low2 = synth(&dir, "low2.jsonl", 4, &[(300_000, "alloc", 0x1000, 256 * MIB, 256 * MIB)], 1_000_000);
    let r = replay(&[
        "--limit", "5GiB", "--policy", "priority", "--stagger", "0,0,0,1ns",
        "--priority", "hi.jsonl=5", "--priority", "mid.jsonl=1",
        "--reserve", "mid.jsonl=1GiB", "--reserve", "low1.jsonl=1GiB", "--reserve", "low2.jsonl=1GiB",
        &hi, &mid, &low1, &low2,
    ]);
    let taken: Vec<u64> = (0..4).map(|i| r["traces"][i]["reserve_taken"].as_u64().unwrap()).collect();
    assert_eq!(taken, [0, 0, GIB / 2, GIB], "{r}");
    assert_eq!(r["traces"][0]["took_from_reserves"].as_u64(), Some(3 * GIB / 2));
    assert_eq!((r["fits"].as_bool(), r["denials"].as_u64()), (Some(false), Some(1)));
    let f = &r["first_denial"];
    assert_eq!((f["pid"].as_u64(), f["t_ns"].as_u64(), f["rule"].as_str()), (Some(4), Some(300_001), Some("priority")));
}

/// Limit 4 GiB. a takes 3 GiB at 100 us; b starts at 1 ms asking a 2 GiB reserve on device 0
/// (the per-device form): 3 + 2 > 4, refused. b then runs with reserve 0, so its 512 MiB at
/// 1.1 ms fits (3.5 GiB); with the reserve kept it would not have (3 + 2 - 0.5 + 0.5 = 5 GiB).
#[test]
fn a_reserve_that_does_not_fit_is_refused_at_start() {
    let dir = scratch("reserve");
    let a = synth(&dir, "a.jsonl", 1, &[(100_000, "alloc", 0x1000, 3 * GIB, 3 * GIB)], 5_000_000);
    let b = synth(&dir, "b.jsonl", 2, &[(100_000, "alloc", 0x1000, 512 * MIB, 512 * MIB)], 5_000_000);
    let args = ["--limit", "4GiB", "--stagger", "0,1ms", "--reserve", "b.jsonl=0=2GiB", &a, &b];
    let r = replay(&args);
    assert_eq!((r["fits"].as_bool(), r["denials"].as_u64()), (Some(false), Some(1)), "{r}");
    let f = &r["first_denial"];
    assert_eq!((f["pid"].as_u64(), f["t_ns"].as_u64(), f["size"].as_u64(), f["rule"].as_str()), (Some(2), Some(1_000_000), Some(2 * GIB), Some("reserve_at_start")));
    assert!(f["api"].is_null());
    assert_eq!(r["traces"][1]["reserve_refused"], serde_json::json!([{"t_ns": 1_000_000, "device": 0, "size": 2 * GIB}]));
    assert_eq!(r["traces"][0]["denials"].as_u64(), Some(0));
    let (code, t) = replay_text(&args);
    assert_eq!(code, Some(1));
    assert!(t.contains("    its reserve of 2.0 GiB on device 0 was refused at its start (+0.001s): it runs with reserve 0 there\n"), "{t}");
    assert!(t.contains("(a reserve of 2.0 GiB): reserve does not fit at start"), "{t}");
}

/// Limit 4 GiB, headroom 1 GiB: members other than the holder get 3 GiB. a (alone, so never the
/// holder) takes 2 GiB at 100 us, asks 1.5 GiB more at 200 us (3.5 > 3: headroom), frees it at
/// 300 us. b starts at 1 ms beside a's 2 GiB: it holds the headroom, and its 1.5 GiB at 1.1 ms
/// fits (3.5 <= 4). c starts at 2 ms while b holds it: its 256 MiB at 2.1 ms (3.75 > 3) is denied.
#[test]
fn headroom_is_kept_for_a_later_starter_and_used_by_it() {
    let dir = scratch("headroom");
    let a = synth(&dir, "a.jsonl", 1, &[(100_000, "alloc", 0x1000, 2 * GIB, 2 * GIB), (200_000, "alloc", 0x2000, 1536 * MIB, 3584 * MIB), (300_000, "free", 0x2000, 1536 * MIB, 2 * GIB)], 5_000_000);
    let b = synth(&dir, "b.jsonl", 2, &[(100_000, "alloc", 0x1000, 1536 * MIB, 1536 * MIB)], 5_000_000);
    let c = synth(&dir, "c.jsonl", 3, &[(100_000, "alloc", 0x1000, 256 * MIB, 256 * MIB)], 5_000_000);
    let r = replay(&["--limit", "4GiB", "--headroom", "1GiB", "--stagger", "0,1ms,2ms", &a, &b, &c]);
    assert_eq!((r["fits"].as_bool(), r["denials"].as_u64()), (Some(false), Some(2)), "{r}");
    assert_eq!(r["headroom"]["0"].as_u64(), Some(GIB));
    let f = &r["first_denial"];
    assert_eq!((f["pid"].as_u64(), f["t_ns"].as_u64(), f["rule"].as_str()), (Some(1), Some(200_000), Some("headroom")));
    assert_eq!(f["reason"], "headroom kept for a later member");
    let holders: Vec<&Value> = (0..3).map(|i| &r["traces"][i]["headroom_holder"]).collect();
    assert_eq!(holders, [&serde_json::json!([]), &serde_json::json!([0]), &serde_json::json!([])]);
    assert_eq!((r["traces"][1]["denials"].as_u64(), r["traces"][2]["denials"].as_u64()), (Some(0), Some(1)));
    assert_eq!(r["traces"][2]["first_denial"]["t_ns"].as_u64(), Some(2_100_000));
    // Without headroom all of it fits: 3.5 GiB at most.
    assert_eq!(replay(&["--limit", "4GiB", "--stagger", "0,1ms,2ms", &a, &b, &c])["fits"], true);
}

#[test]
fn bad_priority_or_reserve_is_an_error_naming_the_input() {
    let dir = scratch("bad");
    let a = synth(&dir, "a.jsonl", 1, &[(100_000, "alloc", 0x1000, GIB, GIB)], 1_000_000);
    let cases: [(&[&str], &[&str]); 6] = [
        (&["--priority", "a.jsonl=high"], &["--priority \"a.jsonl=high\"", "`high` is not an integer", "TRACE=N"]),
        (&["--priority", "zzz.jsonl=3"], &["--priority \"zzz.jsonl=3\"", "`zzz.jsonl` names none of the traces", "TRACE=N"]),
        (&["--priority", "a.jsonl"], &["--priority \"a.jsonl\"", "no `=`", "TRACE=N"]),
        (&["--reserve", "nosuch.jsonl=1GiB"], &["--reserve \"nosuch.jsonl=1GiB\"", "`nosuch.jsonl` names none of the traces", "TRACE=SIZE"]),
        (&["--reserve", "a.jsonl=lots"], &["--reserve \"a.jsonl=lots\"", "`lots` does not start with a number", "TRACE=SIZE"]),
        (&["--headroom", "1x"], &["--headroom \"1x\"", "unknown unit `x`", "SIZE"]),
    ];
    for (flags, want) in cases {
        let mut args = vec!["replay", "--limit", "4GiB"];
        args.extend_from_slice(flags);
        args.push(&a);
        let out = vramcap(&args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(out.stdout.is_empty(), "{flags:?}");
        for w in want {
            assert!(err.contains(w), "{flags:?}: want {w:?} in {err}");
        }
    }
}

/// The library's verdict and replay's, for the same processes: group limit 400 MiB, headroom
/// 100 MiB. a (reserve 100 MiB) takes 50 MiB; b starts beside it, holds the headroom and takes
/// 300 MiB (held 50 + 50 unmet + 300 = 400 <= L, the holder's budget). a then takes 50 MiB more,
/// all of it from its own unmet reserve: the library grants it (nothing new enters `held`, the
/// reserve "is kept for it while it lives"), so the live run has no denial. Replayed with the
/// same limit, reserve, headroom and start offsets, the verdict must be the same: they fit.
#[test]
fn replay_agrees_with_the_library_on_an_allocation_from_a_members_own_reserve_past_the_headroom() {
    let dir = common::private_group_dir();
    let go = |n: u32| dir.join(format!("go{n}"));
    let env = |r: common::Run, name: &str| {
        r.env("VRAMCAP_GROUP", "hr").env("VRAMCAP_GROUP_DIR", &dir).env("VRAMCAP_GROUP_LIMIT", "400m").env("VRAMCAP_GROUP_HEADROOM", "100m").env("VRAMCAP_TRACE", dir.join(name))
    };
    let mut a = env(common::Run::client("client_linked"), "a.jsonl")
        .env("VRAMCAP_GROUP_RESERVE", "100m")
        .args([format!("init ctx 0 alloc 50m waitfile {} alloc 50m waitfile {}", go(1).display(), go(2).display())])
        .spawn();
    assert_eq!(a.wait_for("alloc").rc(), 0);
    let mut b = env(common::Run::client("client_linked"), "b.jsonl").args([format!("init ctx 0 alloc 300m waitfile {}", go(2).display())]).spawn();
    assert_eq!(b.wait_for("alloc").rc(), 0, "b holds the headroom: 400 MiB <= L");
    std::fs::write(go(1), "").unwrap();
    assert_eq!(a.wait_for("alloc").rc(), 0, "the library grants a's allocation from its own reserve");
    std::fs::write(go(2), "").unwrap();
    assert!(a.finish().success() && b.finish().success());
    let (ta, tb) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
    let start = |p: &std::path::Path| -> u64 {
        let first = std::fs::read_to_string(p).unwrap().lines().next().unwrap().to_string();
        serde_json::from_str::<Value>(&first).unwrap()["start_unix_ns"].as_u64().unwrap()
    };
    let (sa, sb) = (start(&ta), start(&tb));
    assert!(sb > sa);
    let stagger = format!("0,{}ns", sb - sa);
    let (ta, tb) = (ta.to_str().unwrap(), tb.to_str().unwrap());
    let r = replay(&["--limit", "400m", "--headroom", "100m", "--reserve", "a.jsonl=100m", "--stagger", &stagger, ta, tb]);
    assert!(r["traces"][1]["headroom_holder"].as_array().unwrap().contains(&serde_json::json!(0)), "b holds the headroom: {r}");
    assert_eq!((r["fits"].as_bool(), r["denials"].as_u64()), (Some(true), Some(0)), "the live run denied nothing: {r}");
}
