//! `vramcap run`: the job gets the preload and the variables, keeps its own LD_PRELOAD entries,
//! sees forwarded signals; we exit with its code (128 + signal when it was killed); bad input
//! fails before anything runs, naming the input and the expected form.

use vramcap_tests::cli_support;
use vramcap_tests::common;
use cli_support::*;
use std::io::{BufRead, BufReader};
use std::process::Stdio;

fn run(args: &[&str]) -> std::process::Output {
    common::build_c();
    clean_vramcap(args).output().expect("run vramcap")
}

fn client(name: &str) -> String {
    common::ctests_dir().join(name).to_string_lossy().into_owned()
}

fn our_lib() -> std::path::PathBuf {
    std::path::Path::new(vramcap_tests::common::vramcap_bin()).parent().unwrap().join("libvramcap.so").canonicalize().unwrap()
}

#[test]
fn exit_codes_pass_through() {
    for code in [0, 1, 7, 255] {
        let out = run(&["run", "--", "sh", "-c", &format!("exit {code}")]);
        assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
    }
    let out = run(&["run", "--", "sh", "-c", "kill -KILL $$"]);
    assert_eq!(out.status.code(), Some(128 + 9), "killed by a signal: 128 + signal");
    let out = run(&["run", "--", "no-such-command-vramcap"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(text(&out.stderr).contains("no-such-command-vramcap") && text(&out.stderr).contains("not found"));
}

#[test]
fn sets_the_variables_and_keeps_an_existing_preload() {
    let other = common::ctests_dir().join("libnextwrap.so");
    common::build_c();
    let out = clean_vramcap(&[
        "run", "--limit", "2GiB", "--group", "team", "--group-limit", "6g", "--trace", "rel-%p.jsonl", "--sidecar", "/tmp/vc.sock",
        "--", "sh", "-c", "echo \"$LD_PRELOAD|$VRAMCAP_LIMIT|$VRAMCAP_GROUP|$VRAMCAP_GROUP_LIMIT|$VRAMCAP_TRACE|$VRAMCAP_SIDECAR\"",
    ])
    .env("LD_PRELOAD", &other)
    .env("VRAMCAP_GROUP_DIR", common::private_group_dir())
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let got = text(&out.stdout);
    let f: Vec<&str> = got.trim().split('|').collect();
    assert_eq!(f[0], format!("{}:{}", our_lib().display(), other.display()), "ours first, the other kept");
    assert_eq!(&f[1..4], &["2GiB", "team", "6g"]);
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(f[4], cwd.join("rel-%p.jsonl").to_string_lossy(), "a relative trace path is made absolute");
    assert_eq!(f[5], "/tmp/vc.sock");
}

#[test]
fn the_cap_applies_to_the_job_with_another_preload_after_ours() {
    common::build_c();
    let out = clean_vramcap(&["run", "--limit", "1GiB", "--", &client("client_procaddr"), "init", "ctx", "0", "info", "alloc", "768m", "alloc", "512m"])
        .env("LD_PRELOAD", common::ctests_dir().join("libnextwrap.so"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<common::Line> = text(&out.stdout).lines().map(common::parse_line).collect();
    let info = lines.iter().find(|l| l.op == "info").unwrap();
    assert_eq!(info.num("total"), common::GIB, "the job sees the capped device");
    let allocs: Vec<i64> = lines.iter().filter(|l| l.op == "alloc").map(|l| l.rc()).collect();
    assert_eq!(allocs, vec![0, 2], "768 MiB granted, 512 MiB more refused");
}

/// `vramcap run -- sh -c SCRIPT` in its own process group (so a failing test can clean up the
/// whole job), with its stdout lines on a channel; returns once the script printed `ready`.
struct Job {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

const WAIT: std::time::Duration = std::time::Duration::from_secs(20);

impl Job {
    fn start(script: &str) -> Job {
        use std::os::unix::process::CommandExt;
        common::build_c();
        let mut child = clean_vramcap(&["run", "--", "sh", "-c", script]).stdout(Stdio::piped()).process_group(0).spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let j = Job { child, lines };
        assert_eq!(j.next_line(), "ready");
        j
    }
    fn next_line(&self) -> String {
        self.lines.recv_timeout(WAIT).unwrap_or_else(|_| panic!("no line from the job in {WAIT:?}"))
    }
    fn signal(&self, sig: i32) {
        assert!(std::process::Command::new("kill").arg(format!("-{sig}")).arg(self.child.id().to_string()).status().unwrap().success());
    }
    /// vramcap's exit code; fails (and kills the job) if it does not end in time.
    fn wait(&mut self) -> Option<i32> {
        let t = std::time::Instant::now();
        while t.elapsed() < WAIT {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("vramcap run did not end within {WAIT:?} of the signal");
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Whatever happened, nothing of the job outlives the test.
        let _ = std::process::Command::new("kill").args(["-KILL", "--", &format!("-{}", self.child.id())]).status();
        let _ = self.child.wait();
    }
}

#[test]
fn signals_are_forwarded_and_the_job_sees_them() {
    let mut j = Job::start("trap 'echo got-USR1' USR1; trap 'echo got-TERM; exit 99' TERM; echo ready; while :; do sleep 0.05; done");
    j.signal(10); // SIGUSR1
    assert_eq!(j.next_line(), "got-USR1");
    j.signal(15);
    assert_eq!(j.next_line(), "got-TERM");
    assert_eq!(j.wait(), Some(99), "the job's own exit code after handling SIGTERM");
}

#[test]
fn a_job_killed_by_a_forwarded_signal_exits_128_plus_signal() {
    for (sig, code) in [(15, 143), (2, 130), (1, 129)] {
        let mut j = Job::start("echo ready; exec sleep 30");
        j.signal(sig);
        assert_eq!(j.wait(), Some(code), "signal {sig}");
    }
}

#[test]
fn report_reads_every_trace_the_job_wrote() {
    let d = scratch("run-report");
    let tmpl = d.join("t-%p.jsonl").to_string_lossy().into_owned();
    let script = format!("{c} init ctx 0 alloc 768m alloc 512m; {c} init ctx 0 alloc 100m", c = client("client_procaddr"));
    let out = run(&["run", "--limit", "1GiB", "--trace", &tmpl, "--report", "--", "sh", "-c", &script]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let files: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 2, "one trace per process: {files:?}");
    for f in &files {
        assert!(err.contains(&*f.to_string_lossy()), "report names {}:\n{err}", f.display());
    }
    assert!(err.contains("== vramcap report") && err.contains("denied          1") && err.contains("all processes"), "{err}");
    assert!(!text(&out.stdout).contains("vramcap report"), "the job's stdout stays the job's");
}

/// Another job writing to the same template while this one runs is not in this job's report:
/// only the traces of the job's own process tree are.
#[test]
fn report_reads_only_this_jobs_process_tree() {
    let d = scratch("run-report-tree");
    let tmpl = d.join("t-%p.jsonl").to_string_lossy().into_owned();
    let other = common::Run::program(std::path::Path::new(&client("client_procaddr")))
        .env("VRAMCAP_TRACE", &tmpl)
        .args(["init ctx 0 alloc 64m sleep 1500"])
        .spawn();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let out = run(&["run", "--limit", "1GiB", "--trace", &tmpl, "--report", "--", &client("client_procaddr"), "init", "ctx", "0", "alloc", "100m", "sleep", "2500"]);
    other.finish();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let files: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 2, "{files:?}");
    let reported: Vec<_> = files.iter().filter(|f| err.contains(&*f.to_string_lossy())).collect();
    assert_eq!(reported.len(), 1, "only this job's trace:\n{err}");
    assert!(!err.contains("all processes") && err.contains("100.0 MiB"), "{err}");
}

/// A process of the job that never uses CUDA (a shell, a launcher) writes no trace; the traces of
/// the processes it starts are still this job's.
#[test]
fn report_follows_the_job_through_processes_that_write_no_trace() {
    let d = scratch("run-report-launcher");
    let tmpl = d.join("t-%p.jsonl").to_string_lossy().into_owned();
    // The outer and the inner shell both fork (a command follows), neither uses CUDA.
    let script = format!("sh -c '{} init ctx 0 alloc 100m; true'; true", client("client_procaddr"));
    let out = run(&["run", "--limit", "1GiB", "--trace", &tmpl, "--report", "--", "sh", "-c", &script]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let files: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(err.contains(&*files[0].to_string_lossy()) && err.contains("100.0 MiB"), "the job's only trace is not reported:\n{err}");
}

/// A process the job daemonizes (double fork + setsid) while the job waits for it is the job's:
/// its parent is gone by the time it writes its header, so its `ppid` is no longer in the tree.
#[test]
fn report_keeps_a_process_the_job_daemonized() {
    let d = scratch("run-report-daemon");
    let tmpl = d.join("t-%p.jsonl").to_string_lossy().into_owned();
    let done = d.join("done");
    let script = format!(
        "(setsid sh -c 'sleep 0.3; {c} init ctx 0 alloc 100m; touch {done}' </dev/null >/dev/null 2>&1 &); \
         for i in $(seq 100); do [ -e {done} ] && exit 0; sleep 0.1; done; exit 1",
        c = client("client_procaddr"),
        done = done.display()
    );
    let out = run(&["run", "--limit", "1GiB", "--trace", &tmpl, "--report", "--", "sh", "-c", &script]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let files: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "jsonl")).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(err.contains(&*files[0].to_string_lossy()) && err.contains("100.0 MiB"), "the daemonized process's trace is not reported:\n{err}");
}

#[test]
fn report_without_trace_uses_a_temporary_one() {
    let out = run(&["run", "--limit", "1GiB", "--report", "--", &client("client_procaddr"), "init", "ctx", "0", "alloc", "2g"]);
    assert!(out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("temporary trace") && err.contains("denied          1"), "{err}");
}

#[test]
fn bad_input_fails_with_exit_2_naming_it() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["run"], &["no command given", "-- CMD ARGS"]),
        (&["run", "--limit", "8x", "--", "true"], &["--limit \"8x\"", "unknown unit", "expected a size"]),
        (&["run", "--limit", "", "--", "true"], &["--limit is empty", "expected"]),
        (&["run", "--limit", "0=4g,foo=1g", "--", "true"], &["--limit", "not a device key", "expected"]),
        (&["run", "--group-limit", "8g", "--", "true"], &["--group-limit needs", "--group NAME"]),
        (&["run", "--group", "a/b", "--", "true"], &["--group \"a/b\"", "expected 1 to 64 characters"]),
        (&["run", "--trace", "/nonexistent-dir/t.jsonl", "--", "true"], &["--trace", "does not exist"]),
    ];
    for (args, wants) in cases {
        let out = run(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        for w in *wants {
            assert!(err.contains(w), "{args:?}: missing {w:?} in {err}");
        }
    }
    // The environment's own bad value is named as such.
    let out = clean_vramcap(&["run", "--", "true"]).env("VRAMCAP_LIMIT", "lots").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("VRAMCAP_LIMIT (from the environment)"), "{}", text(&out.stderr));
    // A job id `run` would pass on to the job's trace headers: checked before the job starts.
    let out = clean_vramcap(&["run", "--report", "--", "sh", "-c", "echo started"]).env("VRAMCAP_JOB", "a b").output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("VRAMCAP_JOB=\"a b\" in the environment") && err.contains("expected 1 to 128 characters"), "{err}");
    assert!(!text(&out.stdout).contains("started"), "the job must not have run");
}

/// Every process of a traced job gets one job id: a fresh one, or the launcher's own.
#[test]
fn a_traced_job_gets_a_job_id_for_its_trace_headers() {
    let dir = scratch("job-id");
    let t = dir.join("t-%p.jsonl");
    let t = t.to_str().unwrap();
    let echo = ["sh", "-c", "echo \"$VRAMCAP_JOB\""];
    let fresh = |_: u8| {
        let out = clean_vramcap(&[&["run", "--trace", t, "--"][..], &echo[..]].concat()).output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).trim().to_string()
    };
    let (a, b) = (fresh(0), fresh(1));
    assert!(a.starts_with("run-") && a.len() == 36 && a[4..].bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
    assert_ne!(a, b, "each run its own id");
    let out = clean_vramcap(&[&["run", "--trace", t, "--"][..], &echo[..]].concat()).env("VRAMCAP_JOB", "train-42").output().unwrap();
    assert_eq!(text(&out.stdout).trim(), "train-42", "the launcher's id is kept");
    let out = clean_vramcap(&[&["run", "--"][..], &echo[..]].concat()).output().unwrap();
    assert_eq!(text(&out.stdout).trim(), "", "no trace, no id");
}

#[test]
fn a_missing_library_is_a_clear_error() {
    let exe = lonely_binary("run-nolib");
    let mut c = std::process::Command::new(&exe);
    clean_env(&mut c);
    let out = output_of_copy(c.args(["run", "--", "true"]));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("libvramcap.so not found") && err.contains(&*exe.parent().unwrap().to_string_lossy()) && err.contains("install.sh"), "{err}");
}

#[test]
fn an_installed_binary_finds_the_library_in_prefix_lib() {
    let prefix = scratch("run-install").join("usr");
    let st = std::process::Command::new(common::root().join("scripts/install.sh"))
        .args(["--no-build", "--prefix"])
        .arg(&prefix)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", text(&st.stderr));
    let mut c = std::process::Command::new(prefix.join("bin/vramcap"));
    clean_env(&mut c);
    let out = output_of_copy(c.args(["run", "--", "sh", "-c", "echo $LD_PRELOAD"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), prefix.join("lib/libvramcap.so").canonicalize().unwrap().to_string_lossy());
}

/// Two steps run one after the other under one launcher's job id (`VRAMCAP_JOB` in the
/// environment, which `run` passes on; a `vramcap run` inside another passes on the outer one the
/// same way): each step's report is of the traces written since that step started. The first
/// step's trace, finished before the second started, is not the second's.
#[test]
fn report_leaves_out_a_trace_of_the_same_job_id_written_before_this_run_started() {
    common::build_c();
    let d = scratch("run-report-steps");
    let tmpl = d.join("t-%p.jsonl").to_string_lossy().into_owned();
    let step = |size: &str| {
        let args = ["run", "--trace", &tmpl, "--report", "--", &client("client_procaddr"), "init", "ctx", "0", "alloc", size];
        let out = clean_vramcap(&args).env("VRAMCAP_JOB", "train-42").output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stderr)
    };
    step("100m");
    let err = step("7m");
    let files: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 2, "{files:?}");
    let reported: Vec<_> = files.iter().filter(|f| err.contains(&*f.to_string_lossy())).collect();
    assert_eq!(reported.len(), 1, "the second step's report reads the first step's trace too:\n{err}");
    assert!(!err.contains("100.0 MiB") && err.contains("7.0 MiB"), "{err}");
}

/// A process of the job with a long command line (a tool given thousands of file names) writes a
/// header longer than 1 MiB (its `cmdline`): it is still the job's, and its trace is reported.
#[test]
fn report_keeps_a_trace_whose_header_is_long() {
    common::build_c();
    let d = scratch("run-report-long-header");
    let tmpl = d.join("t-%p.jsonl").to_string_lossy().into_owned();
    let c = client("client_procaddr");
    // argv[0] of control characters (6 bytes each in JSON) and many arguments: a header over 1 MiB
    // from a command line within ARG_MAX.
    let argv0 = "\u{1}".repeat(120_000);
    let mut args = vec!["run", "--trace", &tmpl, "--report", "--", "bash", "-c", "exec -a \"$0\" \"$@\"", &argv0, &c, "init", "ctx", "0", "alloc", "100m"];
    args.extend(std::iter::repeat_n("version", 50_000));
    let out = clean_vramcap(&args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let files: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let header_len = std::io::BufRead::lines(BufReader::new(std::fs::File::open(&files[0]).unwrap())).next().unwrap().unwrap().len();
    assert!(header_len > 1 << 20, "header of {header_len} bytes");
    assert!(err.contains(&*files[0].to_string_lossy()) && err.contains("100.0 MiB"), "the job's only trace is not reported:\n{}", &err[..err.len().min(2000)]);
}

/// Names taken by someone else push a process's trace to a fallback name (`t.jsonl.<pid>.1`):
/// the report still reads it, because each process tells `run` the file it opened, and reads
/// none of the planted files. In a sticky world-writable directory, as the issue found it, when
/// we are root (another user, uid 65534, plants the names); otherwise hard links do the same
/// (a file with two links is never taken over).
#[test]
fn report_finds_a_trace_pushed_to_a_fallback_name_by_planted_files() {
    use std::os::unix::fs::PermissionsExt;
    common::build_c();
    let d = scratch("run-report-planted");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let t = d.join("t.jsonl");
    let root = unsafe { libc::geteuid() } == 0;
    // The planted files: the template's own name now, `t.jsonl.<pid>` by the job's shell, which
    // then becomes the traced process (exec keeps its pid).
    let plant = |p: &str| {
        if root {
            format!("printf '' > {p} && chown 65534:65534 {p}")
        } else {
            format!("printf '' > {d}/decoy-$$ && ln -f {d}/decoy-$$ {p}", d = d.display())
        }
    };
    let script = format!(
        "{} && {} && exec {} init ctx 0 alloc 100m",
        plant(&t.to_string_lossy()),
        plant(&format!("{}.$$", t.display())),
        client("client_procaddr")
    );
    let tmpl = t.to_string_lossy().into_owned();
    let out = run(&["run", "--limit", "1GiB", "--trace", &tmpl, "--report", "--", "sh", "-c", &script]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let written: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().matches('.').count() == 3)
        .collect();
    assert_eq!(written.len(), 1, "the job wrote t.jsonl.<pid>.1: {written:?}\n{err}");
    assert!(err.contains(&format!("this process writes {}", written[0].display())), "{err}");
    assert!(err.contains(&format!("== vramcap report ({})", written[0].display())) && err.contains("100.0 MiB"), "the fallback trace is not reported:\n{err}");
}

/// Issue 26: `--observe` sets VRAMCAP_MODE=observe: the job is granted what the cap would refuse,
/// and the report says what it would have refused.
#[test]
fn observe_grants_and_the_report_says_what_would_have_been_refused() {
    let d = scratch("run-observe");
    let tmpl = d.join("t.jsonl").to_string_lossy().into_owned();
    let c = client("client_linked");
    for (observe, rc) in [(true, 0), (false, 2)] {
        let mut args = vec!["run", "--limit", "1GiB", "--trace", &tmpl, "--report"];
        if observe {
            args.push("--observe");
        }
        args.extend(["--", c.as_str(), "init", "ctx", "0", "alloc", "768m", "alloc", "512m"]);
        let out = run(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let second = text(&out.stdout).lines().filter(|l| l.starts_with("alloc ")).nth(1).map(str::to_string);
        assert!(second.as_deref().is_some_and(|l| l.starts_with(&format!("alloc rc={rc} "))), "observe={observe}: {second:?}");
        let err = text(&out.stderr);
        assert_eq!(err.contains("observe mode    peak 1.2 GiB: a 1.0 GiB cap would have refused 1 allocation, the first at t="), observe, "{err}");
    }
}
