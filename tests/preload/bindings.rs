//! NVIDIA's own Python client (`cuda-bindings` from PyPI, installed into `.venv` by scripts/test)
//! drives the driver under the preload. Missing venv is a failure, never a skip.

use vramcap_tests::common;
use common::*;

#[test]
fn nvidia_cuda_bindings_are_capped() {
    build_c();
    let py = root().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} missing: scripts/test creates it (python3 -m venv .venv && .venv/bin/pip install cuda-bindings)",
        py.display()
    );
    let out = Run::program(&py)
        .env("VRAMCAP_LIMIT", "64m")
        .args([root().join("tests/python/bindings_driver.py").to_str().unwrap()])
        .run();
    assert!(out.status.success(), "cuda-bindings test failed:\n{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("bindings ok"), "{}", out.stdout);
    // cuda-bindings 13 looks up every driver entry point at its first call, at CUDA 13.0: a
    // normal process under vramcap prints nothing (main printed the "none of the variants"
    // line for CUDA 13's cuCtxSynchronize_v2).
    // The script's own over-cap requests are denied, and each denial is reported (one line a
    // second, the rest counted in one line at exit): nothing else.
    let other: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| !l.starts_with("vramcap: denied ") && !(l.starts_with("vramcap: ") && l.contains("more denial(s) not shown")))
        .collect();
    assert!(other.is_empty(), "cuda-bindings under vramcap printed on stderr:\n{}", other.join("\n"));
}

/// The cuda-bindings report (primary release, then retain and allocate again) and the
/// other context and VMM lifetimes, through cuda-bindings 13's own lookups (cuCtxCreate = _v4).
#[test]
fn cuda_bindings_see_the_drivers_lifetimes() {
    build_c();
    let py = root().join(".venv/bin/python");
    assert!(py.exists(), "{} missing: scripts/test creates it", py.display());
    let out = Run::program(&py)
        .env("VRAMCAP_LIMIT", "64m")
        .args([root().join("tests/python/bindings_lifetimes.py").to_str().unwrap()])
        .run();
    assert!(out.status.success(), "cuda-bindings lifetimes failed:\n{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("bindings lifetimes ok"), "{}", out.stdout);
    assert!(!out.stderr.contains("none of the variants"), "a context or VMM entry point went unwrapped:\n{}", out.stderr);
}
