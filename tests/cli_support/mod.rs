//! Helpers for the `vramcap` CLI tests: run the binary on the golden traces in tests/data.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

pub fn data(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name).to_string_lossy().into_owned()
}

/// A fresh scratch directory for one test's outputs.
pub fn scratch(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vramcap-cli-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn vramcap(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vramcap")).args(args).output().expect("run vramcap")
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
