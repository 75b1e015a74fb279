//! A newcomer's first hour (issue 28): a mistyped flag is an error, not the command; `-o -` is
//! standard output; one `vramcap:` prefix; sizes that are slips of the decimal point are refused;
//! a replay counts the trace's own denials; a killed job's report is not a leak report.

use vramcap_tests::cli_support::*;
use std::process::Stdio;

fn demo_trace(test: &str) -> std::path::PathBuf {
    let dir = scratch(test);
    let out = clean_vramcap(&["demo", "--out"]).arg(&dir).stdout(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "demo: {}", text(&out.stderr));
    dir.join("trace.jsonl")
}

#[test]
fn a_mistyped_flag_before_the_double_dash_is_an_error_with_a_suggestion() {
    for (args, suggestion) in [
        (&["run", "--limti", "4g", "--", "true"][..], Some("--limit")),
        (&["run", "--repot", "--", "true"][..], Some("--report")),
        (&["run", "-l", "4g", "--", "true"][..], None),
    ] {
        let out = clean_vramcap(args).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("vramcap: unexpected argument"), "{args:?}: {err}");
        assert!(!err.contains("command not found") && !err.contains("No such file"), "{args:?} ran the flag: {err}");
        if let Some(s) = suggestion {
            assert!(err.contains(&format!("similar argument exists: '{s}'")), "{args:?}: {err}");
        }
    }
    // Control: the command's own flags, after `--` or after the command's name, are its own.
    let out = clean_vramcap(&["run", "--", "sh", "-c", "echo -x"]).output().unwrap();
    assert!(out.status.success() && text(&out.stdout) == "-x\n", "{}", text(&out.stderr));
    let out = clean_vramcap(&["run", "sh", "-c", "echo --limti"]).output().unwrap();
    assert!(out.status.success() && text(&out.stdout) == "--limti\n", "{}", text(&out.stderr));
}

#[test]
fn every_error_has_the_one_vramcap_prefix_clap_s_too() {
    for args in [&["bogus"][..], &["report"][..], &["replay", "--limit"][..], &["top", "--nope"][..]] {
        let out = vramcap(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("vramcap: ") && !err.contains("error: "), "{args:?}: {err}");
    }
    // Help is not an error.
    let out = vramcap(&["--help"]);
    assert!(out.status.success() && text(&out.stdout).contains("Usage"));
}

#[test]
fn a_sub_kibibyte_size_from_a_unit_and_a_decimal_comma_are_refused_with_a_hint() {
    for (s, want) in [("0.0000001g", "107 bytes"), ("0.5k", "512 bytes"), ("1,5g", "1.5g")] {
        let out = vramcap(&["size", s]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{s} accepted: {}", text(&out.stdout));
        assert!(err.contains(want) && err.contains("decimal point"), "{s}: {err}");
    }
    // Control: a unit suffix of at least one KiB, and bytes on purpose.
    assert_eq!(ok(&["size", "1k"]), "1024\n");
    assert_eq!(ok(&["size", "107b"]), "107\n");
    assert_eq!(ok(&["size", "1.5g"]), format!("{}\n", 3 * GIB / 2));
}

#[test]
fn dash_o_dash_is_standard_output_everywhere() {
    let dir = scratch("dash-o");
    let t = data("job_rank0.jsonl");
    for args in [
        vec!["report", "-o", "-", &t],
        vec!["plot", "-o", "-", &t],
        vec!["export", "--format", "csv", "-o", "-", &t],
        vec!["export", "--format", "chrome", "-o", "-", &t],
        vec!["export", "--format", "memory-viz", "-o", "-", &t],
    ] {
        let out = std::process::Command::new(vramcap_tests::common::vramcap_bin()).args(&args).current_dir(&dir).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        assert!(!out.stdout.is_empty(), "{args:?}: nothing on stdout");
        assert!(!dir.join("-").exists(), "{args:?} wrote a file named -");
        assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "{args:?} left files in the working directory");
    }
    let svg = ok(&["plot", "-o", "-", &t]);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", &svg[..80.min(svg.len())]);
    // report -o FILE: the same text in the file, nothing on stdout.
    let f = dir.join("r.txt");
    let out = vramcap(&["report", "-o", f.to_str().unwrap(), &t]);
    assert!(out.status.success() && out.stdout.is_empty(), "{}", text(&out.stderr));
    assert_eq!(std::fs::read_to_string(&f).unwrap(), ok(&["report", &t]));
}

#[test]
fn plot_into_a_directory_says_what_and_where() {
    let dir = scratch("plot-dir");
    let out = vramcap(&["plot", "-o", dir.to_str().unwrap(), &data("job_rank0.jsonl")]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot write the plot") && err.contains(dir.to_str().unwrap()) && err.contains("Is a directory"), "{err}");
    assert!(!err.contains("backend error"), "{err}");
}

#[test]
fn a_replay_at_the_limit_the_job_was_denied_at_does_not_fit_and_names_the_denial() {
    let t = demo_trace("replay-denied");
    let t = t.to_str().unwrap();
    let out = vramcap(&["replay", "--limit", "8GiB", t]);
    let s = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "the demo job was denied at 8 GiB: {s}");
    assert!(s.contains("they do not fit") && s.contains("a denial recorded in the trace"), "{s}");
    let v: serde_json::Value = serde_json::from_slice(&vramcap(&["replay", "--json", "--limit", "8GiB", t]).stdout).unwrap();
    assert_eq!(v["fits"], false);
    assert_eq!(v["first_denial"]["recorded"], true, "{v}");
    // The smallest limit covers what the denied request asked for.
    let need = v["min_limit"]["0"].as_u64().unwrap();
    assert!(need > 8 * GIB, "{need}");
    // Control: at that limit it fits (the recorded denial would have been granted).
    let out = vramcap(&["replay", "--limit", &format!("{need}"), t]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
}

#[test]
fn a_header_only_trace_replays_with_a_complete_sentence() {
    let dir = scratch("replay-header-only");
    let full = std::fs::read_to_string(data("job_rank0.jsonl")).unwrap();
    let f = dir.join("killed.jsonl");
    std::fs::write(&f, format!("{}\n", full.lines().next().unwrap())).unwrap();
    let out = vramcap(&["replay", "--limit", "8GiB", f.to_str().unwrap()]);
    let s = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{s} {}", text(&out.stderr));
    let line = s.lines().find(|l| l.starts_with("smallest limit")).unwrap();
    assert!(line.trim_end().len() > "smallest limit at which they fit:".len(), "{line:?}");
}

/// job_rank0.jsonl with its last line (the summary) replaced, or dropped.
fn rank0_with_summary(test: &str, summary: Option<&str>) -> String {
    let full = std::fs::read_to_string(data("job_rank0.jsonl")).unwrap();
    let mut lines: Vec<&str> = full.lines().collect();
    assert!(lines.last().unwrap().contains("\"summary\""));
    lines.pop();
    lines.extend(summary);
    let f = scratch(test).join("t.jsonl");
    std::fs::write(&f, lines.join("\n") + "\n").unwrap();
    f.to_string_lossy().into_owned()
}

#[test]
fn a_killed_jobs_report_says_what_it_held_when_killed_not_a_leak() {
    let t = rank0_with_summary("killed", None);
    let s = ok(&["report", &t]);
    assert!(s.contains("held when it was killed (freed by the driver at exit)  1.5 GiB in 2 allocation(s)"), "{s}");
    assert!(!s.contains("held at end"), "{s}");
    // Control: the complete trace still lists its leak.
    assert!(ok(&["report", &data("job_rank0.jsonl")]).contains("held at end     1.5 GiB in 2 allocation(s)"));
}

#[test]
fn json_leaked_bytes_is_never_above_what_was_held_at_exit() {
    let t = rank0_with_summary("dropped", Some(r#"{"type":"summary","events":10,"dropped":2,"peak":{"0":3221225472},"used":{"0":0}}"#));
    let v = json(&["report", "--json", &t]);
    let d = &v["processes"][0]["devices"][0];
    assert_eq!(d["held_at_exit"], 0, "{d}");
    assert_eq!(d["leaked_bytes"], 0, "{d}");
    assert_eq!(d["leaks_complete"], false);
    // Control: a complete trace's leak is the traced one.
    let v = json(&["report", "--json", &data("job_rank0.jsonl")]);
    assert_eq!(v["processes"][0]["devices"][0]["leaked_bytes"].as_u64(), Some(3 * GIB / 2));
}

#[test]
fn top_defaults_to_the_documented_socket() {
    let out = clean_vramcap(&["top", "--once"]).output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("/run/vramcap/sidecar.sock"), "{err}");
    assert!(vramcap(&["sidecar", "--help"]).stdout.windows(26).any(|w| w == b"/run/vramcap/sidecar.sock]"));
}

#[test]
fn the_demos_running_line_runs_as_printed_on_the_fake_gpu() {
    let dir = scratch("demo-line");
    let out = clean_vramcap(&["demo", "--out"]).arg(&dir).env_remove("LD_LIBRARY_PATH").output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix("running:")).expect("a running: line").trim().to_string();
    assert!(line.contains(" --fake-gpu "), "{line}");
    let trace = dir.join("trace.jsonl");
    std::fs::remove_file(&trace).unwrap();
    // As a user pastes it into a shell: no fake driver on the loader path, nothing but the line.
    let mut sh = std::process::Command::new("sh");
    clean_env(&mut sh);
    let out = sh.env_remove("LD_LIBRARY_PATH").arg("-c").arg(&line).output().unwrap();
    assert!(out.status.success(), "{line}: {}", text(&out.stderr));
    assert!(text(&out.stderr).contains("vramcap: denied"), "the job meets its cap: {}", text(&out.stderr));
    let r = json(&["report", "--json", trace.to_str().unwrap()]);
    assert_eq!(r["processes"][0]["devices"][0]["total"].as_u64(), Some(16 * GIB));
    assert_eq!(r["processes"][0]["devices"][0]["limit"].as_u64(), Some(8 * GIB));
    // A bad size is an error naming the flag.
    let out = clean_vramcap(&["run", "--fake-gpu", "50%", "--", "true"]).output().unwrap();
    assert!(out.status.code() == Some(2) && text(&out.stderr).contains("--fake-gpu \"50%\""), "{}", text(&out.stderr));
}

/// The README's fake-GPU walkthrough, pasted line by line into one shell in a fresh directory
/// beside the built tree: every line ends as its comment says (0, or `# exit 1`), the background
/// jobs included; `top` shows the group member with its cap and the group's budget, `/metrics`
/// its usage, `limit` moves the budget. The metrics port is swapped for a free one (the only
/// change: tests run side by side), and a private group directory keeps other runs out.
#[test]
fn the_readmes_fake_gpu_walkthrough_runs_line_by_line() {
    use std::os::unix::process::CommandExt;
    let root = vramcap_tests::common::root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme.split("## Try the commands on the fake GPU").nth(1).expect("the section");
    let block = section.split("```sh\n").nth(1).unwrap().split("```").next().unwrap();
    let dir = scratch("readme-walk");
    std::os::unix::fs::symlink(root.join("target"), dir.join("target")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let lines: Vec<String> = block.lines().filter(|l| !l.trim().is_empty()).map(|l| l.replace("127.0.0.1:9400", &format!("127.0.0.1:{port}"))).collect();
    for want in ["--limit", "--trace", "report", "sidecar", "/metrics", "top", "--group", "limit --group"] {
        assert!(lines.iter().any(|l| l.contains(want)), "the walkthrough lacks {want:?}:\n{block}");
    }
    // One shell, as a person pastes: each line's status is recorded after it.
    let mut script = String::from("set +e\n");
    for (i, l) in lines.iter().enumerate() {
        script.push_str(&format!("echo '>>> {i}'\n{l}\necho \"<<< {i} $?\"\n"));
    }
    let groups = vramcap_tests::common::private_group_dir();
    let mut sh = std::process::Command::new("bash");
    clean_env(&mut sh);
    let out = sh
        .env_remove("LD_LIBRARY_PATH")
        .env("VRAMCAP_GROUP_DIR", &groups)
        .current_dir(&dir)
        .arg("-c")
        .arg(&script)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let pgid = out.id() as i32;
    // The background jobs hold the output pipes too: a line that failed to stop them must not
    // keep the test waiting, so the whole process group goes at the deadline.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let guard = std::thread::spawn(move || {
        if rx.recv_timeout(std::time::Duration::from_secs(180)).is_err() {
            unsafe { libc_kill(-pgid, 9) };
        }
    });
    let out = out.wait_with_output().unwrap();
    let _ = tx.send(());
    guard.join().unwrap();
    // Whatever is left of the group (nothing, when `kill %2 %1` ran) goes with the shell.
    unsafe { libc_kill(-pgid, 9) };
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    let mut rcs = std::collections::HashMap::new();
    for l in stdout.lines() {
        if let Some(rest) = l.strip_prefix("<<< ") {
            let (i, rc) = rest.split_once(' ').unwrap();
            rcs.insert(i.parse::<usize>().unwrap(), rc.parse::<i32>().unwrap());
        }
    }
    for (i, line) in lines.iter().enumerate() {
        let want = if line.contains("# exit 1") { 1 } else { 0 };
        assert_eq!(rcs.get(&i), Some(&want), "{line}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    }
    let section = |i: usize| stdout.split(&format!(">>> {i}\n")).nth(1).unwrap().split(&format!("<<< {i} ")).next().unwrap().to_string();
    let at = |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap();
    let top = section(at("vramcap top"));
    assert!(top.contains("demo_train") && top.contains("/ 8.0 GiB") && top.contains("group \"demo\": budget 8.0 GiB"), "{top}");
    assert!(section(at("curl")).contains("vramcap_memory_used_bytes{"), "{stdout}");
    assert!(section(at("limit --group")).contains("limit 8.0 GiB -> 7.0 GiB"), "{stdout}");
    let svg = std::fs::read_to_string(dir.join("usage.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}
