//! `vramcap cdi` as a command: what it writes, and that bad input is a clear error that writes
//! nothing. It must run as root (the ceiling files it writes count only when root owns them).

use crate::podman::test_dir;
use std::path::{Path, PathBuf};
use std::process::Command;
use vramcap_tests::common::*;

macro_rules! needs_root {
    () => {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: vramcap cdi runs as root");
            return;
        }
    };
}

struct Dirs {
    dir: PathBuf,
    state: PathBuf,
}

fn dirs(name: &str) -> Dirs {
    let dir = test_dir(name);
    Dirs { state: dir.join("state"), dir }
}

fn cdi(d: &Dirs, args: &[&str]) -> std::process::Output {
    Command::new(vramcap_bin()).arg("cdi").arg("--state-dir").arg(&d.state).args(args).output().unwrap()
}

/// Every file below `dir`, with its contents (what a failed run must leave unchanged).
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap_or_default()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn bad_input_is_a_clear_error_and_writes_nothing() {
    needs_root!();
    let d = dirs("bad");
    let text = d.dir.join("notes.txt");
    std::fs::write(&text, "not a library\n").unwrap();
    let foreign = d.dir.join("nvidia.yaml");
    std::fs::write(&foreign, "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n").unwrap();
    let lib = preload_lib().display().to_string();
    let program = vramcap_bin().to_string();
    let (t, f) = (text.display().to_string(), foreign.display().to_string());
    let out_json = d.dir.join("out.json").display().to_string();
    let sock_dir = d.dir.join("sidecar");
    std::fs::create_dir_all(&sock_dir).unwrap();
    let (sock, inside) = (sock_dir.join("s.sock").display().to_string(), sock_dir.join("traces").display().to_string());
    let sock_dir = sock_dir.display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--device", "small=8g", "--devcie", "x=1g"], "--devcie"),
        (vec![], "--device <NAME=SPEC>"),
        (vec!["--device", "small=lots"], "`lots`"),
        (vec!["--device", "small=8"], "has no unit"),
        (vec!["--device", "small=0"], "0 means no limit"),
        (vec!["--device", "small"], "expected NAME=SPEC"),
        (vec!["--device", "a/b=1g"], "is not usable"),
        (vec!["--device", "a=1g", "--device", "a=2g"], "given twice"),
        (vec!["--device", "a=1g", "--lib", "/nonexistent/libvramcap.so"], "/nonexistent/libvramcap.so"),
        (vec!["--device", "a=1g", "--lib", &t], "not an ELF file"),
        (vec!["--device", "a=1g", "--lib", &program], "a program"),
        (vec!["--device", "a=1g", "--lib", &lib, "--out", &f], "is not a spec vramcap cdi wrote"),
        (vec!["--device", "a=1g", "--out", "/tmp/spec.txt"], "*.json, *.yaml"),
        (vec!["--device", "a=1g", "--kind", "gpu"], "VENDOR/CLASS"),
        (vec!["--device", "a=1g", "--group-dir", "relative/dir"], "absolute path"),
        (vec!["--device", "a=1g", "--sidecar", "/tmp/sidecar.sock"], "directory of its own"),
        (vec!["--device", "a=1g", "--sidecar", "/nonexistent/sidecar.sock"], "its directory does not exist"),
        (vec!["--device", "a=1g", "--out", &out_json, "--hook", &t], "not an executable file"),
        (vec!["--device", "a=1g", "--sidecar", &sock, "--group-dir", &sock_dir], "overlap"),
        (vec!["--device", "a=1g", "--sidecar", &sock, "--trace-dir", &inside], "overlap"),
    ];
    let before = snapshot(&d.dir);
    for (args, says) in &cases {
        let out = cdi(&d, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: expected {says:?} in: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: printed a spec");
        assert!(!d.state.exists(), "{args:?}: wrote {}", d.state.display());
        assert_eq!(snapshot(&d.dir), before, "{args:?}: changed a file");
    }
}

#[test]
fn the_spec_names_each_budget_and_replaces_only_its_own_file() {
    needs_root!();
    let d = dirs("spec");
    let out = d.dir.join("vramcap.json");
    let o = out.display().to_string();
    let run = |args: &[&str]| {
        let r = cdi(&d, args);
        assert!(r.status.success(), "{args:?}: {}", String::from_utf8_lossy(&r.stderr));
    };
    run(&["--device", "small=256m", "--device", "big=0=1g,1=2g", "--out", &o]);
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!((spec["cdiVersion"].as_str(), spec["kind"].as_str()), (Some("0.3.0"), Some("vramcap.io/gpu")), "the lowest version: {spec}");
    let names: Vec<&str> = spec["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["small", "big"]);
    let small = &spec["devices"][0]["containerEdits"];
    let mounts: Vec<(&str, &str)> = small["mounts"].as_array().unwrap().iter().map(|m| (m["hostPath"].as_str().unwrap(), m["containerPath"].as_str().unwrap())).collect();
    let state = d.state.join("vramcap.io_gpu");
    assert_eq!(mounts[0], (state.join("small").to_str().unwrap(), "/etc/vramcap"));
    assert_eq!(mounts[1], (preload_lib().canonicalize().unwrap().to_str().unwrap(), "/etc/vramcap/libvramcap.so"));
    assert_eq!(mounts[2], (state.join("ld.so.preload").to_str().unwrap(), "/etc/ld.so.preload"));
    for m in small["mounts"].as_array().unwrap() {
        assert!(m["options"].as_array().unwrap().contains(&serde_json::json!("ro")), "every mount is read-only: {m}");
    }
    let hooks: Vec<&str> = small["hooks"].as_array().unwrap().iter().map(|h| h["hookName"].as_str().unwrap()).collect();
    assert_eq!(hooks, ["createContainer", "poststop"]);
    assert_eq!(std::fs::read_to_string(state.join("ld.so.preload")).unwrap(), "/etc/vramcap/libvramcap.so\n");
    let limits = std::fs::read_to_string(state.join("big/limits")).unwrap();
    for line in ["VRAMCAP_GROUP=big", "VRAMCAP_GROUP_LIMIT=0=1g,1=2g", "VRAMCAP_GROUP_DIR=/etc/vramcap/group"] {
        assert!(limits.lines().any(|l| l == line), "{line} in {limits}");
    }
    // The library's own parser reads the file as the ceiling it is.
    let lines: Vec<(String, String)> = vramcap_common::config::ceiling::parse("limits", &limits)
        .unwrap()
        .into_iter()
        .collect();
    assert!(lines.iter().any(|(k, v)| k == "VRAMCAP_LIMIT" && v == "0=1g,1=2g"));
    use std::os::unix::fs::MetadataExt;
    for p in [state.join("big/limits"), state.join("big"), state.join("ld.so.preload")] {
        let m = std::fs::metadata(&p).unwrap();
        assert!(m.uid() == 0 && m.mode() & 0o022 == 0, "{} must be root's and writable only by root", p.display());
    }
    // Its own file is replaced; a name starting with a digit needs cdiVersion 0.5.0.
    run(&["--device", "20g=20g", "--out", &o]);
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!((spec["cdiVersion"].as_str(), spec["devices"][0]["name"].as_str()), (Some("0.5.0"), Some("20g")));
    // YAML on stdout, marked as ours.
    let r = cdi(&d, &["--device", "small=1g"]);
    let yaml = String::from_utf8_lossy(&r.stdout);
    assert!(yaml.starts_with("# Written by `vramcap cdi`") && yaml.contains("kind: \"vramcap.io/gpu\""), "{yaml}");
}
