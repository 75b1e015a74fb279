//! The cap counts what the GPU counts (issue 24): contexts, modules' globals and per-context
//! reservations take device memory no allocation returns. The fake driver charges them as the
//! real one does (`FAKECUDA_CTX_BYTES` per context, a module's `.nv.global` sections, the heap and
//! printf FIFO at the first module load, the stack at `cuCtxSetLimit`), and vramcap must learn
//! their sizes from the driver's books, never assume them: every scenario runs under a cap on a
//! big device and on the bare fake with exactly the cap's memory, with two context sizes; both
//! must grant and refuse the same calls, and under the cap the fake's own physical peak never
//! passes the cap.

use vramcap_tests::common;
use common::*;

/// Runs `ops` under a `cap` on a 16 GiB device and on the bare driver with `cap` of memory, with
/// contexts of `ctx` bytes; checks the result codes of each `op` are as `want` in both, that both
/// end with the same free memory, and that the capped run never held more than the cap
/// physically. Returns the capped runs.
fn agree(cap: &str, ctx: &str, ops: &str, checks: &[(&str, &[i64])]) -> Vec<Output> {
    agree_peak(cap, ctx, ops, checks, true)
}

/// [`agree`] with libraries loaded eagerly (`CUDA_MODULE_LOADING=EAGER`: into every context at
/// once; the driver's default since CUDA 12.2 is lazy, into a context at first use).
fn agree_eager(cap: &str, ctx: &str, ops: &str, checks: &[(&str, &[i64])]) -> Vec<Output> {
    agree_in(cap, ctx, ops, checks, true, &[("CUDA_MODULE_LOADING", "EAGER")])
}

/// [`agree`]; `strict`: also the capped device's physical peak stays within the cap.
fn agree_peak(cap: &str, ctx: &str, ops: &str, checks: &[(&str, &[i64])], strict: bool) -> Vec<Output> {
    agree_in(cap, ctx, ops, checks, strict, &[])
}

fn agree_in(cap: &str, ctx: &str, ops: &str, checks: &[(&str, &[i64])], strict: bool, env: &[(&str, &str)]) -> Vec<Output> {
    let mut out = Vec::new();
    for c in CLIENTS {
        let with_env = |mut r: Run| {
            for (k, v) in env {
                r = r.env(k, v);
            }
            r
        };
        let capped = with_env(Run::client(c))
            .env("VRAMCAP_LIMIT", cap)
            .env("FAKECUDA_CTX_BYTES", ctx)
            .args([ops, "info", "stats 0"])
            .run();
        capped.ok();
        let bare =
            with_env(Run::client(c).bare()).env("FAKECUDA_MEM", cap).env("FAKECUDA_CTX_BYTES", ctx).args([ops, "info"]).run();
        bare.ok();
        for (op, want) in checks {
            let rcs = |o: &Output| o.of(op).iter().map(|l| l.rc()).collect::<Vec<_>>();
            assert_eq!(rcs(&bare), *want, "{c}: the bare driver's own answer to `{op}` in: {ops}\n{}", bare.stdout);
            assert_eq!(rcs(&capped), *want, "{c}: `{op}` under the cap in: {ops}\n{}{}", capped.stdout, capped.stderr);
        }
        let free = |o: &Output| o.of("info").last().unwrap().num("free");
        assert_eq!(free(&capped), free(&bare), "{c}: cuMemGetInfo agrees with the driver after: {ops}\n{}", capped.stdout);
        let limit = size(cap);
        let stats = capped.of("stats").last().copied().cloned().unwrap();
        if strict {
            assert!(stats.num("peak") <= limit.max(size(ctx)), "{c}: the device held {} past the cap {limit}: {ops}", stats.num("peak"));
        }
        // What vramcap counts is what the device holds: the cap less it is free.
        let held = stats.num("bytes_held");
        let with_context = capped.of("info").last().unwrap().rc() == 0;
        assert!(!with_context || free(&capped) == limit.saturating_sub(held), "{c}: charge and device disagree after: {ops}\n{}", capped.stdout);
        out.push(capped);
    }
    out
}

fn size(s: &str) -> u64 {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    n.parse::<u64>().unwrap() * match unit {
        "" => 1,
        "m" => MIB,
        "g" => GIB,
        u => panic!("unit {u}"),
    }
}

#[test]
fn a_context_costs_what_the_driver_measures_and_comes_back_when_it_ends() {
    // Two context sizes: vramcap must learn each one, not assume either.
    for (ctx, rest) in [("100m", "924m"), ("300m", "724m")] {
        let ops = format!("init ctx 0 info alloc {rest} alloc 1m release2 0 ctx 0 alloc {rest} alloc 1m");
        let runs = agree("1g", ctx, &ops, &[("alloc", &[0, 2, 0, 2]), ("primrelease", &[0])]);
        for r in &runs {
            // cuMemGetInfo with the context alone: the cap less the context.
            assert_eq!(r.nth("info", 0).num("free"), GIB - size(ctx), "{}", r.stdout);
        }
    }
    // A created context too (all four ABIs), and destroy gives it back.
    agree("1g", "200m", "init ctx 0 mkctx 2 0 mkctx 1 0 mkctx 3 0 alloc 100m mkctx 4 0 destroy2 0 destroy1 1 alloc 300m", &[
        ("mkctx", &[0, 0, 0, 2]),
        ("alloc", &[0, 0]),
    ]);
}

#[test]
fn a_context_that_cannot_fit_is_refused_with_out_of_memory() {
    // A second context past the cap: refused before the driver makes it (the last one's size
    // is reserved first), so the device never holds it.
    agree("1g", "300m", "init ctx 0 alloc 600m mkctx 2 0 alloc 100m", &[("mkctx", &[2]), ("alloc", &[0, 0])]);
    // A cap smaller than one context: the first context is refused, the device held it alone.
    agree("200m", "300m", "init ctx 0", &[("ctx", &[2])]);
}

#[test]
fn modules_cost_their_globals_and_the_heap_and_give_them_back() {
    let dir = private_group_dir();
    let small = dir.join("small.cubin");
    let big = dir.join("big.cubin");
    let (s, b) = (small.display(), big.display());
    // 64 MiB + 16 MiB of globals, and the 8 MiB heap and 1 MiB FIFO the first load brings; a
    // 2 GiB global array does not fit; an unload gives its globals back (the heap stays).
    let ops = format!(
        "init ctx 0 cubin {s} 64m 16m cubin {b} 2g info moddata {s} info moddata {b} modload {s} modunload 1 info alloc 1000m alloc 835m"
    );
    let runs = agree("1g", "100m", &ops, &[("moddata", &[0, 2]), ("modload", &[0]), ("alloc", &[2, 0])]);
    for r in &runs {
        let free = |i| r.nth("info", i).num("free");
        assert_eq!(free(0) - free(1), 89 * MIB, "{}", r.stdout);
        assert_eq!(free(1), free(2), "the second module unloaded again: {}", r.stdout);
    }
    // cuModuleLoadDataEx too.
    agree("1g", "100m", &format!("init ctx 0 cubin {s} 64m 16m cubin {b} 2g moddataex {s} moddataex {b}"), &[("moddataex", &[0, 2])]);
}

#[test]
fn a_limit_that_reserves_past_the_cap_is_refused_and_set_back() {
    // The stack: (value − 1 KiB) × the device's resident threads (132 multiprocessors × 2048 in
    // the fake), taken at once: 2560 bytes take 396 MiB, 5120 bytes 1056 MiB. vramcap reserves
    // that before the call, so the one past the cap is refused before the device holds it (the
    // physical peak stays within the cap).
    let ops = "init ctx 0 setlimit 0 2560 getlimit 0 setlimit 0 5120 getlimit 0 setlimit 0 1k alloc 800m";
    let runs = agree("1g", "100m", ops, &[("setlimit", &[0, 2, 0]), ("alloc", &[0])]);
    for r in &runs {
        assert_eq!(r.nth("getlimit", 1).num("value"), 2560, "set back after the refusal: {}", r.stdout);
    }
    // The heap is allocated at the first module load (Programming Guide): a heap past the cap
    // makes that load fail (the bare driver: CUDA_ERROR_SHARED_OBJECT_INIT_FAILED; under the
    // cap: out of memory). vramcap reserves the heap and FIFO with the first load's globals, so
    // the device never takes a heap past the cap.
    let dir = private_group_dir();
    let m = dir.join("m.cubin");
    let ops = format!("init ctx 0 cubin {} 1m setlimit 2 950m moddata {} info stats 0", m.display(), m.display());
    let bare = Run::client("client_linked").bare().env("FAKECUDA_MEM", "1g").env("FAKECUDA_CTX_BYTES", "100m").args([&ops]).run();
    assert_eq!(bare.nth("moddata", 0).rc(), 303, "{}", bare.stdout);
    for c in CLIENTS {
        let capped = Run::client(c).env("VRAMCAP_LIMIT", "1g").env("FAKECUDA_CTX_BYTES", "100m").args([&ops]).run();
        capped.ok();
        assert_eq!(capped.nth("moddata", 0).rc(), 2, "{c}: {}", capped.stdout);
        let stats = capped.nth("stats", 0);
        assert_eq!(stats.num("bytes_held"), 100 * MIB, "{c}: the heap was never taken: {}", capped.stdout);
        assert!(stats.num("peak") <= GIB, "{c}: the device held {} past the cap: {}", stats.num("peak"), capped.stdout);
        assert_eq!(capped.nth("info", 0).num("free"), GIB - 100 * MIB, "{c}: {}", capped.stdout);
    }
    // Only the first load brings them: a second module that fits with what the first took is not
    // refused for a heap the context already has (100m context, 1m + 9m, 910m: 1020 MiB of 1 GiB).
    let big = dir.join("big.cubin");
    let ops = format!("init ctx 0 cubin {} 1m cubin {} 910m moddata {} moddata {}", m.display(), big.display(), m.display(), big.display());
    agree("1g", "100m", &ops, &[("moddata", &[0, 0])]);
}

#[test]
fn the_trace_and_report_show_overhead_apart_from_allocations() {
    let dir = private_group_dir();
    let trace = dir.join("t.jsonl");
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("FAKECUDA_CTX_BYTES", "300m")
        .env("VRAMCAP_TRACE", &trace)
        .args(["init ctx 0 alloc 100m release2 0"])
        .run();
    out.ok();
    let text = std::fs::read_to_string(&trace).unwrap();
    let events: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v["type"] == "event").collect();
    let ops: Vec<&str> = events.iter().map(|e| e["op"].as_str().unwrap()).collect();
    assert_eq!(ops, ["overhead", "alloc", "free", "overhead_free"], "{text}");
    assert_eq!(events[0]["api"], "cuDevicePrimaryCtxRetain");
    assert_eq!(events[0]["size"], 300 * MIB);
    assert_eq!(events[1]["used"], 400 * MIB, "the charge includes the context");
    assert_eq!(events[3]["size"], 300 * MIB);
    assert_eq!(events[3]["used"], 0);
    let report = std::process::Command::new(vramcap_bin()).args(["report", "--json"]).arg(&trace).output().unwrap();
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    let v: serde_json::Value = serde_json::from_slice(&report.stdout).unwrap();
    let dev = &v["processes"][0]["devices"][0];
    assert_eq!((dev["overhead_peak"].as_u64(), dev["overhead_at_end"].as_u64()), (Some(300 * MIB), Some(0)), "{v}");
    assert_eq!(dev["peak"], 400 * MIB);
    let text = std::process::Command::new(vramcap_bin()).arg("report").arg(&trace).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("overhead        0 B at end, 300.0 MiB at most"), "{text}");
}

/// Observe mode (issue 26) covers overhead too: a context or a module's globals past the cap are
/// granted (the job sees no refusal vramcap made) and recorded as would-be denials; enforced, the
/// same calls are refused.
#[test]
fn observe_mode_grants_overhead_past_the_cap_and_records_it() {
    let dir = private_group_dir();
    let m = dir.join("g.cubin");
    let ops = format!("init ctx 0 alloc 600m mkctx 2 0 cubin {} 500m moddata {}", m.display(), m.display());
    for c in CLIENTS {
        let trace = dir.join(format!("{c}-observe.jsonl"));
        let run = |mode: &str| {
            let trace = dir.join(format!("{c}-{mode}.jsonl"));
            Run::client(c)
                .env("VRAMCAP_LIMIT", "1g")
                .env("VRAMCAP_MODE", mode)
                .env("VRAMCAP_TRACE", trace.to_str().unwrap())
                .env("FAKECUDA_CTX_BYTES", "300m")
                .args([ops.as_str()])
                .run()
        };
        let enforced = run("enforce");
        enforced.ok();
        let rcs = |o: &Output, op: &str| o.of(op).iter().map(|l| l.rc()).collect::<Vec<_>>();
        assert_eq!(rcs(&enforced, "mkctx"), [2], "{c}: enforced, the second context is refused: {}", enforced.stdout);
        let observed = run("observe");
        observed.ok();
        assert_eq!(rcs(&observed, "mkctx"), [0], "{c}: observed, the context is granted: {}{}", observed.stdout, observed.stderr);
        assert_eq!(rcs(&observed, "moddata"), [0], "{c}: observed, the module is granted: {}{}", observed.stdout, observed.stderr);
        let text = std::fs::read_to_string(&trace).unwrap();
        let would = text.lines().filter(|l| l.contains("\"op\":\"would_deny\"")).count();
        assert!(would >= 2, "{c}: the context and the module are would-be denials:\n{text}");
        assert!(!text.lines().any(|l| l.contains("\"op\":\"deny\"")), "{c}: nothing denied in observe mode:\n{text}");
    }
}

/// Libraries (CUDA 12.0) are context-independent: the fake loads one into every live context and
/// every later one (eager loading). Their globals are measured like a module's on every device
/// with a context, refused with out-of-memory when they do not fit, and given back at unload.
#[test]
fn libraries_cost_their_globals_in_every_context_and_give_them_back_at_unload() {
    let dir = private_group_dir();
    let small = dir.join("lib_small.cubin");
    let big = dir.join("lib_big.cubin");
    let (s, b) = (small.display(), big.display());
    // One context: 64 + 16 MiB of globals and the 9 MiB heap and FIFO of its first module; a
    // 2 GiB library does not fit; the unload gives the globals back (the heap stays), so the
    // second load takes only the globals again.
    let ops = format!(
        "init ctx 0 cubin {s} 64m 16m cubin {b} 2g info libdata {s} info libfile {b} libunload 0 info libfile {s} info alloc 900m alloc 835m"
    );
    let runs = agree_eager("1g", "100m", &ops, &[("libdata", &[0]), ("libfile", &[2, 0]), ("libunload", &[0]), ("alloc", &[2, 0])]);
    for r in &runs {
        let free = |i| r.nth("info", i).num("free");
        assert_eq!(free(0) - free(1), 89 * MIB, "{}", r.stdout);
        assert_eq!(free(2) - free(1), 80 * MIB, "the unload gave the globals back: {}", r.stdout);
        assert_eq!(free(1), free(3), "{}", r.stdout);
    }
    // Two contexts on the device: a copy in each. 420 MiB fits once, not twice: refused (the
    // heap its first copy brought stays); 300 MiB twice fits (and the other context's heap), and
    // both copies come back at the unload.
    let ops = format!(
        "init ctx 0 mkctx 2 0 cubin {b} 420m cubin {s} 300m libdata {b} info libdata {s} info libunload 0 info alloc 800m alloc 7m"
    );
    let runs = agree_eager("1g", "100m", &ops, &[("libdata", &[2, 0]), ("libunload", &[0]), ("alloc", &[0, 2])]);
    for r in &runs {
        let free = |i| r.nth("info", i).num("free");
        // Two contexts, two heaps, two copies; then the two heaps alone.
        assert_eq!(free(1), GIB - (2 * 100 + 2 * 9 + 2 * 300) * MIB, "{}", r.stdout);
        assert_eq!(free(2), GIB - (2 * 100 + 2 * 9) * MIB, "{}", r.stdout);
    }
    // A context created while a library is loaded gets its copy: measured as part of its size.
    agree_eager("1g", "100m", &format!("init ctx 0 cubin {s} 300m libdata {s} mkctx 2 0 alloc 200m mkctx 2 0"), &[
        ("libdata", &[0]),
        ("mkctx", &[0, 2]),
        ("alloc", &[0]),
    ]);
}

/// A green context (CUDA 12.4) takes device memory of its own (the fake: a quarter of a
/// context), measured like a context's and given back at its destroy.
#[test]
fn a_green_context_costs_what_the_driver_measures_and_gives_it_back_at_destroy() {
    // The primary context there first: the green context's own 25 MiB, back at its destroy.
    let runs = agree("1g", "100m", "init ctx 0 info green 0 info greendestroy 0 info alloc 900m alloc 24m alloc 1m", &[
        ("green", &[0]),
        ("greendestroy", &[0]),
        ("alloc", &[0, 0, 2]),
    ]);
    for r in &runs {
        let free = |i| r.nth("info", i).num("free");
        assert_eq!(free(0) - free(1), 25 * MIB, "{}", r.stdout);
        assert_eq!(free(0), free(2), "{}", r.stdout);
    }
    // The create makes the primary context too: its destroy is the last release, and all goes.
    agree("1g", "100m", "init green 0 info greendestroy 0 primstate 0 alloc 10m ctx 0 alloc 924m", &[
        ("green", &[0]),
        ("alloc", &[201, 0]),
    ]);
    // The same, with the application's own retain: the primary context stays, and so does its charge.
    agree("1g", "100m", "init green 0 ctx 0 greendestroy 0 alloc 924m alloc 1m", &[("alloc", &[0, 2])]);
    // Measured once, a green context's size is reserved before the next: one past the cap is
    // refused before the driver makes it.
    agree("1g", "100m", "init ctx 0 green 0 greendestroy 0 alloc 900m green 0 alloc 24m", &[
        ("green", &[0, 2]),
        ("alloc", &[0, 0]),
    ]);
    // The first green context past the cap: the driver says its size only by taking it (for the
    // call the device held it past the cap), then it is destroyed again and refused.
    agree_peak("1g", "100m", "init ctx 0 alloc 900m green 0 alloc 24m", &[("green", &[2]), ("alloc", &[0, 0])], false);
}

/// Libraries and green contexts go through the overhead ops: the trace and `report` show them
/// apart from allocations.
#[test]
fn libraries_and_green_contexts_show_in_the_trace_and_report_as_overhead() {
    let dir = private_group_dir();
    let trace = dir.join("lg.jsonl");
    let lib = dir.join("lg.cubin");
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "1g")
        .env("FAKECUDA_CTX_BYTES", "100m")
        .env("VRAMCAP_TRACE", &trace)
        .env("CUDA_MODULE_LOADING", "EAGER")
        .args([format!("init ctx 0 cubin {l} 64m libdata {l} green 0 libunload 0 greendestroy 0 release2 0", l = lib.display())])
        .run();
    out.ok();
    let text = std::fs::read_to_string(&trace).unwrap();
    let events: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v["type"] == "event").collect();
    let seen: Vec<(&str, &str, u64)> =
        events.iter().map(|e| (e["op"].as_str().unwrap(), e["api"].as_str().unwrap(), e["size"].as_u64().unwrap())).collect();
    assert_eq!(seen, [
        ("overhead", "cuDevicePrimaryCtxRetain", 100 * MIB),
        // A module's size in the trace is what its context now holds: the context, the library's
        // globals and the heap and FIFO its first module brings.
        ("overhead", "cuLibraryLoadData", 173 * MIB),
        ("overhead", "cuGreenCtxCreate", 25 * MIB),
        ("overhead_free", "cuLibraryUnload", 64 * MIB),
        ("overhead_free", "cuGreenCtxDestroy", 25 * MIB),
        ("overhead_free", "cuDevicePrimaryCtxRelease_v2", 109 * MIB),
    ], "{text}");
    let report = std::process::Command::new(vramcap_bin()).args(["report", "--json"]).arg(&trace).output().unwrap();
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    let v: serde_json::Value = serde_json::from_slice(&report.stdout).unwrap();
    let dev = &v["processes"][0]["devices"][0];
    assert_eq!((dev["overhead_peak"].as_u64(), dev["overhead_at_end"].as_u64()), (Some(198 * MIB), Some(0)), "{v}");
}
