//! A newcomer's first hour, the rest of issue 28: one `vramcap:` prefix on every subcommand's
//! errors, gzipped traces, `top` on 80 columns, warnings when a job would not get the library,
//! the install script's help.

use std::process::Stdio;
use vramcap_tests::cli_support::*;

/// Every stderr line of a failed command starts with `vramcap: ` (no `vramcap run:`, `vramcap
/// top:`, `vramcap sidecar:` or clap's `error:`).
fn assert_one_prefix(what: &str, err: &str) {
    assert!(!err.trim().is_empty(), "{what}: no message");
    for l in err.lines().filter(|l| !l.trim().is_empty() && !l.starts_with(' ')) {
        assert!(l.starts_with("vramcap: "), "{what}: {l:?} in\n{err}");
        for other in ["vramcap run:", "vramcap top:", "vramcap sidecar:", "vramcap demo:", "vramcap doctor:", "error: "] {
            assert!(!l.contains(other), "{what}: {l:?}");
        }
    }
}

#[test]
fn every_subcommands_errors_have_the_one_vramcap_prefix() {
    let dir = scratch("one-prefix");
    let missing_dir = dir.join("no/such/dir/t.jsonl");
    let cases: Vec<(Vec<String>, i32)> = vec![
        (vec!["run".into()], 2),
        (vec!["run".into(), "--trace".into(), missing_dir.to_string_lossy().into_owned(), "--".into(), "true".into()], 2),
        (vec!["run".into(), "--".into(), "/no/such/command".into()], 127),
        (vec!["run".into(), "--limit".into(), "8 apples".into(), "--".into(), "true".into()], 2),
        (vec!["top".into(), "--once".into(), "--socket".into(), dir.join("none.sock").to_string_lossy().into_owned()], 1),
        (vec!["sidecar".into(), "--socket".into(), "/dev/null/s.sock".into()], 1),
        (vec!["doctor".into(), "--probe".into(), "bogus".into()], 2),
    ];
    for (args, code) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = clean_vramcap(&args).stdin(Stdio::null()).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert_one_prefix(&format!("{args:?}"), &err);
    }
    // --report with nothing traced: a note, in the same form, after the job's own output.
    let out = clean_vramcap(&["run", "--report", "--", "true"]).output().unwrap();
    assert!(out.status.success());
    assert_one_prefix("run --report -- true", &text(&out.stderr));
}

#[test]
fn a_gzipped_trace_is_read_and_other_compressions_are_named() {
    let dir = scratch("gz");
    let plain = dir.join("t.jsonl");
    std::fs::copy(data("job_rank0.jsonl"), &plain).unwrap();
    let want = ok(&["report", "--json", plain.to_str().unwrap()]);
    // gzip keeps the name on its .gz; a renamed one (no .gz) is known by its bytes.
    let st = std::process::Command::new("gzip").arg("-k").arg(&plain).status().unwrap();
    assert!(st.success());
    let gz = dir.join("t.jsonl.gz");
    let renamed = dir.join("renamed.jsonl");
    std::fs::copy(&gz, &renamed).unwrap();
    for f in [&gz, &renamed] {
        let got = ok(&["report", "--json", f.to_str().unwrap()]);
        assert_eq!(got.replace(f.to_str().unwrap(), "P"), want.replace(plain.to_str().unwrap(), "P"), "{}", f.display());
    }
    // Two gzip members one after the other (a rotated log appended to) are one trace.
    let text_of = std::fs::read_to_string(&plain).unwrap();
    let (head, tail) = text_of.split_at(text_of.find('\n').unwrap() + 1);
    let parts = dir.join("parts.jsonl.gz");
    let mut bytes = Vec::new();
    for (i, p) in [head, tail].iter().enumerate() {
        let f = dir.join(format!("p{i}"));
        std::fs::write(&f, p).unwrap();
        let out = std::process::Command::new("gzip").arg("-c").arg(&f).output().unwrap();
        bytes.extend(out.stdout);
    }
    std::fs::write(&parts, bytes).unwrap();
    assert_eq!(ok(&["report", "--json", parts.to_str().unwrap()]).replace(parts.to_str().unwrap(), "P"), want.replace(plain.to_str().unwrap(), "P"));
    // A cut-off gzip: what decompressed is read, the rest is named as a decompression error.
    let cut = dir.join("cut.jsonl.gz");
    let whole = std::fs::read(&gz).unwrap();
    std::fs::write(&cut, &whole[..whole.len() - 12]).unwrap();
    let out = vramcap(&["report", cut.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert!(err.contains("gzipped trace: cannot decompress"), "{err}");
    // zstd, xz and bzip2 are named with the command that undoes them.
    for (tool, name, undo) in [("zstd", "zstd", "zstd -d"), ("xz", "xz", "xz -d"), ("bzip2", "bzip2", "bunzip2")] {
        let out = std::process::Command::new(tool).arg("-c").arg(&plain).output().unwrap();
        assert!(out.status.success(), "{tool}");
        let f = dir.join(format!("t.{tool}"));
        std::fs::write(&f, out.stdout).unwrap();
        let out = vramcap(&["report", f.to_str().unwrap()]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(&format!("compressed with {name}")) && err.contains(undo) && err.starts_with("vramcap: "), "{err}");
    }
    // Control: a plain file that is not a trace is still "no trace header".
    let junk = dir.join("junk.jsonl");
    std::fs::write(&junk, "hello\n").unwrap();
    assert!(text(&vramcap(&["report", junk.to_str().unwrap()]).stderr).contains("no trace header"));
}

fn top_once(socket: &std::path::Path) -> String {
    let out = clean_vramcap(&["top", "--once", "--socket"]).arg(socket).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

/// `top` through the real binary, beside a live sidecar: every line fits 80 columns; a group
/// member with a cap of its own still shows its group's budget; an empty table says which socket
/// it asked and how jobs reach it.
#[test]
fn top_fits_80_columns_shows_the_group_budget_beside_a_cap_and_explains_an_empty_table() {
    use std::time::Duration;
    use vramcap_tests::sidecar_support::{Client, Sidecar, tmpdir, value, wait_until};
    let dir = tmpdir("top80");
    let groups = dir.join("ledgers");
    std::fs::create_dir_all(&groups).unwrap();
    let sc = Sidecar::start(&dir.join("s.sock"), &["--group-dir", groups.to_str().unwrap()]);
    let empty = top_once(&sc.socket);
    let joined = empty.lines().skip(2).map(str::trim).collect::<Vec<_>>().join(" ");
    let s = sc.socket.display().to_string();
    assert!(joined.contains(&format!("No process is connected to the sidecar on {s} yet")), "{empty}");
    assert!(joined.contains(&format!("VRAMCAP_SIDECAR={s}")) && joined.contains(&format!("vramcap run --sidecar {s} -- CMD")), "{empty}");

    let g = groups.to_str().unwrap();
    let env = [
        ("VRAMCAP_GROUP", "a-team-with-a-rather-long-name"),
        ("VRAMCAP_GROUP_DIR", g),
        ("VRAMCAP_GROUP_LIMIT", "3g"),
        ("VRAMCAP_LIMIT", "2g"),
        ("VRAMCAP_GROUP_POLICY", "equal"),
        ("VRAMCAP_GROUP_RESERVE", "100m"),
        ("VRAMCAP_GROUP_HEADROOM", "200m"),
        ("VRAMCAP_PRIORITY", "7"),
    ];
    let c = Client::spawn("client_linked", &sc.socket, &env, "init ctx 0 alloc 1g sleep 60000");
    wait_until("the member's allocation", Duration::from_secs(20), || {
        value(&sc.samples(), "vramcap_memory_used_bytes", &[("pid", &c.pid()), ("device", "0")]) == Some(GIB)
    });
    let t = top_once(&sc.socket);
    for l in t.lines() {
        assert!(l.chars().count() <= 80, "{} columns: {l:?}\n{t}", l.chars().count());
    }
    let rows: Vec<&str> = t.lines().collect();
    let i = rows.iter().position(|l| l.trim_start().starts_with(&c.pid())).unwrap_or_else(|| panic!("no row:\n{t}"));
    assert!(rows[i].contains("1.0 GiB / 2.0 GiB"), "its own cap is the row's limit: {t}");
    let under = rows[i + 1..].iter().take_while(|l| l.starts_with("        ")).map(|l| l.trim()).collect::<Vec<_>>().join(" ");
    assert!(under.starts_with("group \"a-team-with-a-rather-long-name\": budget 3.0 GiB (1.0 GiB used by the group)"), "{t}");
    assert!(under.contains("policy equal, priority 7") && under.contains("reserve 100.0 MiB"), "{t}");
}

/// The doctor's `preload` line, checked by loading the environment's LD_PRELOAD in a child.
fn doctor_preload(env: &[(&str, &str)]) -> (Option<i32>, String) {
    vramcap_tests::common::build_c();
    let mut c = clean_vramcap(&["doctor"]);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let all = text(&out.stdout);
    let i = all.lines().position(|l| l.split_whitespace().nth(1) == Some("preload")).unwrap_or_else(|| panic!("no preload line:\n{all}"));
    let lines: Vec<&str> = all.lines().skip(i).take(2).collect();
    (out.status.code(), lines.join("\n"))
}

#[test]
fn doctor_fails_an_ld_preload_the_loader_would_not_load_and_says_what_resolves() {
    let lib = vramcap_tests::common::preload_lib();
    let lib = lib.to_str().unwrap();
    let shim = vramcap_tests::common::shim_dir();
    // deploy.md's old recipe: a bare name, not on any loader path.
    let (code, l) = doctor_preload(&[("LD_PRELOAD", "libvramcap.so")]);
    assert_eq!(code, Some(1), "{l}");
    assert!(l.trim_start().starts_with("FAIL") && l.contains("bare name") && l.contains("run uncapped"), "{l}");
    assert!(l.contains(&format!("fix: LD_PRELOAD={lib}")), "{l}");
    // A path that does not exist.
    let (code, l) = doctor_preload(&[("LD_PRELOAD", "/nonexistent/libvramcap.so")]);
    assert!(code == Some(1) && l.contains("/nonexistent/libvramcap.so does not exist"), "{l}");
    // Controls: an absolute path, and a bare name whose directory is on LD_LIBRARY_PATH.
    let (_, l) = doctor_preload(&[("LD_PRELOAD", lib)]);
    assert!(l.trim_start().starts_with("OK") && l.contains(&format!("loads {lib}")), "{l}");
    let dirs = format!("{}:{}", shim.display(), std::path::Path::new(lib).parent().unwrap().display());
    let (_, l) = doctor_preload(&[("LD_PRELOAD", "libvramcap.so"), ("LD_LIBRARY_PATH", &dirs)]);
    assert!(l.trim_start().starts_with("OK") && l.contains(&format!("loads {lib}")), "{l}");
}

/// `vramcap run` says when the process it starts would not get the library: a statically linked
/// program, a set-user-ID one (secure-execution mode); a script is judged by its interpreter.
#[test]
fn run_warns_when_the_job_would_not_get_the_library() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("reach");
    let src = dir.join("s.c");
    std::fs::write(&src, "int main(void) { return 3; }\n").unwrap();
    let stat = dir.join("static-prog");
    let st = std::process::Command::new("cc").arg("-static").arg("-o").arg(&stat).arg(&src).status().unwrap();
    assert!(st.success(), "cc -static (libc6-dev's libc.a)");
    let out = clean_vramcap(&["run", "--"]).arg(&stat).output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "the job still runs: {err}");
    assert!(err.contains(&format!("vramcap: warning: {} is statically linked", stat.display())) && err.contains("runs uncapped"), "{err}");
    // A script whose interpreter (through env) is dynamic: no warning; the control for both.
    let script = dir.join("job.sh");
    std::fs::write(&script, "#!/usr/bin/env sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = clean_vramcap(&["run", "--"]).arg(&script).output().unwrap();
    assert!(out.status.success() && !text(&out.stderr).contains("warning"), "{}", text(&out.stderr));
    let out = clean_vramcap(&["run", "--", "true"]).output().unwrap();
    assert!(out.status.success() && out.stderr.is_empty(), "{}", text(&out.stderr));
    // A script run by the static program is judged by it.
    let wrapped = dir.join("wrapped");
    std::fs::write(&wrapped, format!("#!{}\n", stat.display())).unwrap();
    std::fs::set_permissions(&wrapped, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = clean_vramcap(&["run", "--"]).arg(&wrapped).output().unwrap();
    assert!(text(&out.stderr).contains("is statically linked"), "{}", text(&out.stderr));
    if unsafe { libc_getuid() } != 0 {
        eprintln!("SKIPPED the set-user-ID half: needs root (to make a file another user owns)");
        return;
    }
    let suid = dir.join("suid-true");
    std::fs::copy(vramcap_tests::common::ctests_dir().join("client_linked"), &suid).unwrap();
    std::os::unix::fs::chown(&suid, Some(65534), None).unwrap();
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let out = clean_vramcap(&["run", "--"]).arg(&suid).arg("version").output().unwrap();
    let err = text(&out.stderr);
    assert!(err.contains(&format!("vramcap: warning: {} is set-user-ID (owner uid 65534)", suid.display())), "{err}");
}

/// A library the user cannot read would leave every process uncapped: `run` refuses to start.
#[test]
fn run_refuses_a_preload_library_its_user_cannot_read() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if unsafe { libc_getuid() } != 0 {
        eprintln!("SKIPPED: needs root (to run as another uid)");
        return;
    }
    let bin = lonely_binary("unreadable-lib");
    let dir = bin.parent().unwrap();
    let lib = dir.join("libvramcap.so");
    std::fs::copy(vramcap_tests::common::preload_lib(), &lib).unwrap();
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o600)).unwrap();
    for d in [dir, dir.parent().unwrap()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut c = std::process::Command::new(&bin);
    clean_env(&mut c);
    c.args(["run", "--", "true"]).uid(65534).gid(65534).current_dir("/");
    let out = output_of_copy(&mut c);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("{} is not readable by uid 65534", lib.display())) && err.contains("uncapped"), "{err}");
    // Control: readable, it runs.
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut c = std::process::Command::new(&bin);
    clean_env(&mut c);
    c.args(["run", "--", "true"]).uid(65534).gid(65534).current_dir("/");
    let out = output_of_copy(&mut c);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

unsafe extern "C" {
    #[link_name = "getuid"]
    fn libc_getuid() -> u32;
}

/// `scripts/install.sh --help` is the usage and nothing else (no shell code); the README's
/// install line installs where it says (without its build step: the test's build is the one
/// under test); a prefix the user cannot write is refused before anything is built, saying what
/// needs root.
#[test]
fn install_help_is_clean_and_the_readmes_install_line_installs_for_the_user() {
    let root = vramcap_tests::common::root();
    let script = root.join("scripts/install.sh");
    let out = std::process::Command::new(&script).arg("--help").output().unwrap();
    let help = text(&out.stdout);
    assert!(out.status.success() && out.stderr.is_empty(), "{}", text(&out.stderr));
    assert!(help.starts_with("Usage: scripts/install.sh [--prefix DIR] [--no-build]\n"), "{help}");
    for bad in ["set -", "pipefail", "\n#", "$(", "EOF"] {
        assert!(!help.contains(bad), "shell code {bad:?} in --help:\n{help}");
    }
    for want in ["--prefix ~/.local", "root", "sudo scripts/install.sh --no-build", "No ldconfig", "PATH"] {
        assert!(help.contains(want), "{want:?} missing:\n{help}");
    }

    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme.split("## Install\n").nth(1).expect("an Install section");
    let line = section.split("```sh\n").nth(1).unwrap().lines().next().unwrap();
    assert!(line.starts_with("scripts/install.sh --prefix ~/.local"), "{line}");
    let home = scratch("install-home");
    let mut sh = std::process::Command::new("sh");
    clean_env(&mut sh);
    let out = sh.current_dir(&root).env("HOME", &home).arg("-c").arg(format!("{line} --no-build")).output().unwrap();
    let said = text(&out.stdout);
    assert!(out.status.success(), "{line}: {}", text(&out.stderr));
    let local = home.join(".local");
    for f in ["bin/vramcap", "lib/libvramcap.so", "share/vramcap/demo/libcuda.so.1"] {
        assert!(local.join(f).is_file(), "{f} not installed: {said}");
    }
    assert!(said.contains(&format!("{}/bin is not on PATH", local.display())), "{said}");
    let mut c = std::process::Command::new(local.join("bin/vramcap"));
    clean_env(&mut c);
    let out = output_of_copy(c.arg("doctor"));
    let lib_line = text(&out.stdout).lines().find(|l| l.contains(" library ")).unwrap_or_default().to_string();
    assert!(lib_line.trim_start().starts_with("OK") && lib_line.contains(&*local.join("lib/libvramcap.so").to_string_lossy()), "{lib_line}");

    // As a user who cannot write the prefix: refused before building, naming root and ~/.local.
    if unsafe { libc_getuid() } != 0 {
        eprintln!("SKIPPED the other-user half: needs root");
        return;
    }
    use std::os::unix::process::CommandExt;
    let copy = scratch("install-copy");
    std::fs::create_dir_all(copy.join("scripts")).unwrap();
    std::fs::copy(&script, copy.join("scripts/install.sh")).unwrap();
    let mut c = std::process::Command::new("bash");
    clean_env(&mut c);
    let out = c.arg(copy.join("scripts/install.sh")).args(["--prefix", "/opt/vramcap-install-test/x"]).uid(65534).gid(65534).current_dir("/").output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot write to /opt/vramcap-install-test/x") && err.contains("need root") && err.contains("--prefix ~/.local"), "{err}");
    assert!(!err.contains("cargo") || err.contains("sudo scripts/install.sh --no-build"), "{err}");
    assert!(!std::path::Path::new("/opt/vramcap-install-test").exists());
}

/// Issue 28 item 1: no script hides cargo's or pip's progress (`-q` also hid "Blocking waiting
/// for file lock": a demo sat silent for 20 minutes behind another build), and the README says
/// how long a first run takes and why, with the figures measured.
#[test]
fn scripts_show_cargos_and_pips_progress_and_the_readme_says_how_long_a_first_run_takes() {
    let root = vramcap_tests::common::root();
    for e in std::fs::read_dir(root.join("scripts")).unwrap() {
        let p = e.unwrap().path();
        let Ok(s) = std::fs::read_to_string(&p) else { continue };
        for (n, l) in s.lines().enumerate() {
            let code = l.split(" #").next().unwrap_or(l);
            let quiet = code.split_whitespace().any(|w| w == "-q" || w == "--quiet");
            if (code.contains("cargo ") || code.contains("pip install")) && quiet {
                panic!("{}:{}: {l}", p.display(), n + 1);
            }
        }
    }
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let setup = readme.split("## Try the commands on the fake GPU").next().unwrap();
    for want in ["How long a first run takes", "383 s", "fresh clone", "2-core", "432 s", "900 MB", "another build's lock"] {
        assert!(setup.contains(want), "{want:?} missing from the set-up section");
    }
    assert!(!setup.contains("in a couple of\nseconds.") && !setup.contains("in a couple of seconds."), "the first run is not a couple of seconds");
}

/// Issue 28 item 11: `report` reads events in causal order by `t_ns`, not by `seq`. A free
/// stamped before its driver call but written after other threads reused its address (here the
/// reuse is allocated and freed again before the delayed free is written) still ends its own
/// allocation: 0 "frees without a traced allocation" on a complete trace.
#[test]
fn report_matches_frees_in_time_order_when_threads_reuse_each_others_addresses() {
    let dir = scratch("causal-report");
    let header = std::fs::read_to_string(data("job_rank0.jsonl")).unwrap().lines().next().unwrap().to_string();
    let ev = |seq: u64, t: u64, tid: u64, op: &str, size: u64| {
        format!(
            r#"{{"type":"event","seq":{seq},"t_ns":{t},"tid":{tid},"op":"{op}","api":"{}","dev":0,"ptr":"0x7f0000000000","size":{size},"result":0,"dur_ns":50}}"#,
            if op == "alloc" { "cuMemAlloc_v2" } else { "cuMemFree_v2" }
        )
    };
    // Thread 1: alloc at 10, free stamped at 20 but written last. Thread 2 gets the address at
    // 30 and frees it at 40; thread 3 at 50 and 60.
    let lines = [
        header,
        ev(0, 10, 1, "alloc", 1000),
        ev(1, 30, 2, "alloc", 2000),
        ev(2, 40, 2, "free", 2000),
        ev(3, 50, 3, "alloc", 3000),
        ev(4, 60, 3, "free", 3000),
        ev(5, 20, 1, "free", 1000),
        r#"{"type":"summary","events":6,"dropped":0,"peak":{"0":3000},"used":{"0":0}}"#.to_string(),
    ];
    let f = dir.join("t.jsonl");
    std::fs::write(&f, lines.join("\n") + "\n").unwrap();
    let v = json(&["report", "--json", f.to_str().unwrap()]);
    let d = &v["processes"][0]["devices"][0];
    assert_eq!((d["frees"].as_u64(), d["unmatched_frees"].as_u64(), d["leaked_count"].as_u64()), (Some(3), Some(0), Some(0)), "{d}");
    assert!(!ok(&["report", f.to_str().unwrap()]).contains("frees without a traced allocation"));

    // A real multi-threaded run through the preload: threads free and re-allocate each other's
    // addresses (the fake's free returns 200 us after the address is reusable), every event kept.
    vramcap_tests::common::build_c();
    for seed in 1..=3 {
        let path = dir.join(format!("real-{seed}.jsonl"));
        let out = vramcap_tests::common::Run::client("client_procaddr")
            .env("VRAMCAP_TRACE", &path)
            .env("VRAMCAP_TRACE_MODE", "lossless")
            .env("FAKECUDA_FREE_DELAY_US", "200")
            .args([format!("init ctx 0 threads 16 3000 64k {seed}")])
            .run();
        out.ok();
        let v = json(&["report", "--json", path.to_str().unwrap()]);
        let d = &v["processes"][0]["devices"][0];
        assert_eq!(v["processes"][0]["dropped"].as_u64().unwrap_or(0), 0, "the check needs every event: {}", v["processes"][0]);
        assert!(d["frees"].as_u64().unwrap() > 20_000, "{d}");
        assert_eq!((d["unmatched_frees"].as_u64(), d["leaked_count"].as_u64()), (Some(0), Some(0)), "seed {seed}: {d}");
    }
}

/// The value of attribute `name` in one SVG element's text.
fn attr<'a>(el: &'a str, name: &str) -> Option<&'a str> {
    let i = el.find(&format!(" {name}=\""))? + name.len() + 3;
    el[i..].split('"').next()
}

/// The SVG's elements of one kind, as their opening tags.
fn elements<'a>(svg: &'a str, tag: &str) -> Vec<&'a str> {
    svg.split('<').filter(|e| e.starts_with(&format!("{tag} "))).collect()
}

/// Issue 28 item 10, checked in the SVG: every stacked area is opaque (a translucent layer over
/// another blended into colours the legend does not have) and its fill is a legend swatch's; the
/// denied swatch is a × of two red strokes like the chart's; no swatch stands for the "all"
/// total, which nothing drawn matches.
#[test]
fn the_plots_legend_has_the_colours_and_marks_the_chart_draws() {
    let dir = scratch("plot-legend");
    let out = clean_vramcap(&["demo", "--out"]).arg(&dir).stdout(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let demo = dir.join("trace.jsonl");
    for traces in [vec![demo.to_string_lossy().into_owned()], vec![data("job_rank0.jsonl"), data("job_rank1.jsonl")]] {
        let mut args = vec!["plot", "-o", "-"];
        args.extend(traces.iter().map(String::as_str));
        let svg = ok(&args);
        // The legend column starts where the chart ends (its swatches are 16 x 12 rectangles).
        let swatches: Vec<&str> = elements(&svg, "rect").into_iter().filter(|r| attr(r, "width") == Some("16") && attr(r, "height") == Some("12")).collect();
        let legend_x: i64 = swatches.iter().filter_map(|r| attr(r, "x")?.parse().ok()).min().expect("legend swatches");
        let fills: Vec<&str> = swatches.iter().filter_map(|r| attr(r, "fill")).filter(|f| *f != "none").collect();
        let areas = elements(&svg, "polygon");
        assert_eq!(areas.len(), traces.len(), "one area per process: {traces:?}");
        assert_eq!(fills.len(), areas.len(), "one filled swatch per area, none for the total: {fills:?}");
        for a in &areas {
            assert_eq!(attr(a, "opacity"), Some("1"), "a translucent area blends with the one below: {}", &a[..60.min(a.len())]);
            let f = attr(a, "fill").unwrap();
            assert!(fills.contains(&f), "area fill {f} is not in the legend {fills:?}");
        }
        assert!(swatches.iter().all(|r| attr(r, "opacity") == Some("1")), "{swatches:?}");
        assert!(!fills.contains(&"#000000"), "the grey 'all' swatch matches nothing drawn");
        assert!(svg.contains("held at the end"), "the total is still said");
        // The denial: a × in the chart and the same × in the legend.
        let red_lines: Vec<(i64, i64, i64, i64)> = elements(&svg, "line")
            .into_iter()
            .filter(|l| attr(l, "stroke") == Some("#FF0000"))
            .map(|l| {
                let n = |k: &str| attr(l, k).unwrap().parse::<i64>().unwrap();
                (n("x1"), n("y1"), n("x2"), n("y2"))
            })
            .collect();
        let crosses = |legend: bool| red_lines.iter().filter(|l| (l.0 >= legend_x) == legend && l.0 != l.2 && l.1 != l.3).count();
        // The demo's job is denied once (the golden pair has a denial too).
        let denied = svg.contains(">\ndenied\n<");
        assert!(denied, "{traces:?}");
        if denied {
            assert_eq!(crosses(true), 2, "the legend's denied swatch is a ×: {red_lines:?}");
            assert!(crosses(false) >= 2, "the chart marks the denial with a ×");
        }
    }
}
