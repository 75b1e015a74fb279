//! Helpers for the `vramcap` CLI tests: run the binary on the golden traces in tests/data.

use std::path::PathBuf;
use std::process::{Command, Output};

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

pub fn data(name: &str) -> String {
    super::common::root().join("tests/data").join(name).to_string_lossy().into_owned()
}

/// A fresh scratch directory for one test's outputs.
pub fn scratch(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vramcap-cli-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn vramcap(args: &[&str]) -> Output {
    Command::new(super::common::vramcap_bin()).args(args).output().expect("run vramcap")
}

/// Runs vramcap, requires success, returns stdout.
pub fn ok(args: &[&str]) -> String {
    let out = vramcap(args);
    assert!(out.status.success(), "vramcap {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

pub fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(args)).expect("valid JSON on stdout")
}

/// Runs a Python snippet (python3 is available on dev machines and CI) and returns its stdout.
pub fn python(script: &str, args: &[&str]) -> String {
    let out = Command::new("python3").arg("-c").arg(script).args(args).output().expect("python3");
    assert!(out.status.success(), "python failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `vramcap ARGS` with none of the developer's vramcap/fake-driver variables or preloads, and
/// the fake driver on the loader path (the front-door tests: run, demo, doctor).
pub fn clean_vramcap(args: &[&str]) -> Command {
    let mut c = Command::new(super::common::vramcap_bin());
    clean_env(&mut c);
    c.args(args);
    c
}

pub fn clean_env(c: &mut Command) {
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().to_string();
        if k.starts_with("VRAMCAP_") || k.starts_with("CUDA_DEVICE_MEMORY_LIMIT") || k.starts_with("FAKECUDA_") || k == "LD_PRELOAD" {
            c.env_remove(&k);
        }
    }
    let root = super::common::root();
    c.env("LD_LIBRARY_PATH", root.join("target/cuda-shim"));
}

/// A copy of the vramcap binary alone in a fresh directory: no library, no source tree near it.
pub fn lonely_binary(test: &str) -> PathBuf {
    let d = scratch(test).join("bin");
    std::fs::create_dir_all(&d).unwrap();
    let exe = d.join("vramcap");
    std::fs::copy(super::common::vramcap_bin(), &exe).unwrap();
    exe
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs a freshly copied binary. Another test thread forking while the copy's file was open for
/// writing leaves the child a writable descriptor until it execs: exec then fails with ETXTBSY
/// for a moment, so retry briefly.
pub fn output_of_copy(c: &mut Command) -> Output {
    for _ in 0..100 {
        match c.output() {
            Err(e) if e.raw_os_error() == Some(26) => std::thread::sleep(std::time::Duration::from_millis(20)),
            r => return r.expect("run the copied vramcap"),
        }
    }
    panic!("the copied binary stayed busy (ETXTBSY)");
}
