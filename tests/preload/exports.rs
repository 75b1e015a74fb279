//! The shared object exports exactly the hook table plus `dlsym`, `fcntl` and `fcntl64` (which
//! keep vramcap's export locks, `intercept::fcntl`), and links nothing but the system libraries
//! (no CLI crates in the preload library).

use vramcap_tests::common;
use common::*;
use std::process::Command;

fn tool(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).arg(preload_lib()).output().expect(args[0]);
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn exports_only_driver_wrappers_dlsym_and_fcntl() {
    let syms = tool(&["nm", "-D", "--defined-only"]);
    let names: Vec<&str> = syms.lines().filter_map(|l| l.split_whitespace().nth(2)).collect();
    assert!(names.contains(&"dlsym"));
    assert!(names.contains(&"fcntl") && names.contains(&"fcntl64"));
    assert!(names.contains(&"cuMemAlloc_v2") && names.contains(&"cuGetProcAddress_v2"));
    for n in &names {
        let ours = ["dlsym", "fcntl", "fcntl64"];
        assert!(n.starts_with("cu") || n.starts_with("nvml") || ours.contains(n), "unexpected export {n}");
    }
}

#[test]
fn links_only_system_libraries_and_no_cli_crates() {
    let dynamic = tool(&["readelf", "-d"]);
    for line in dynamic.lines().filter(|l| l.contains("(NEEDED)")) {
        let ok = ["libc.so", "libm.so", "libdl.so", "libpthread.so", "librt.so", "libutil.so", "ld-linux"];
        assert!(ok.iter().any(|o| line.contains(o)), "unexpected dependency: {line}");
    }
    // The unwinder is linked in (build.rs): libgcc_s cost every process ~100 µs at start.
    assert!(!dynamic.contains("libgcc_s"), "libgcc_s is a dependency again:\n{dynamic}");
    let all = tool(&["nm", "-C"]);
    for cli_crate in ["clap::", "plotters::", "indicatif::"] {
        assert!(!all.contains(cli_crate), "the CLI's {cli_crate} got linked into the preload library");
    }
}
