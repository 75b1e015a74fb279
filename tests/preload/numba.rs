//! numba-cuda (PyPI `numba-cuda[cu13]`, installed into `.venv` by scripts/test) is a second real
//! client: it drives the driver through NVIDIA's cuda-bindings with its own memory manager
//! (deferred frees, deallocate-and-retry on out-of-memory). Missing venv is a failure, never a skip.
//! `VRAMCAP_TEST_PYTHON` names another interpreter (a developer's own venv).

use vramcap_tests::common;
use common::*;
use std::path::PathBuf;

fn python() -> PathBuf {
    let py = std::env::var_os("VRAMCAP_TEST_PYTHON").map(PathBuf::from).unwrap_or_else(|| root().join(".venv/bin/python"));
    assert!(
        py.exists(),
        "{} missing: scripts/test creates it (python3 -m venv .venv && .venv/bin/pip install 'numba-cuda[cu13]')",
        py.display()
    );
    py
}

fn numba(stage: &str, trace: &std::path::Path) -> Output {
    build_c();
    Run::program(&python())
        .env("VRAMCAP_LIMIT", "64m")
        .env("VRAMCAP_TRACE", trace)
        .env("FAKECUDA_DEVICE_COUNT", "1")
        .args([root().join("tests/python/numba_driver.py").to_str().unwrap(), stage])
        .run()
}

/// get_memory_info shows the cap; arrays up to the cap work and hold data (HtoD, DtoH, DtoD,
/// async copies on a stream); one past it raises CudaAPIError(CUDA_ERROR_OUT_OF_MEMORY); numba's
/// deallocate-and-retry succeeds. Nothing but the denials on stderr.
#[test]
fn numba_cuda_sees_and_keeps_the_cap() {
    let trace = std::env::temp_dir().join(format!("vramcap-numba-{}.jsonl", std::process::id()));
    let out = numba("cap", &trace);
    assert!(out.status.success(), "numba-cuda test failed:\n{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("numba cap ok"), "{}", out.stdout);
    // The retry really happened: the 8 MiB request was denied, numba freed its pending arrays,
    // and the same request was then granted.
    let text = std::fs::read_to_string(&trace).unwrap_or_default();
    let _ = std::fs::remove_file(&trace);
    let ops: Vec<(String, u64)> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "event")
        .map(|v| (v["op"].as_str().unwrap_or("").to_string(), v["size"].as_u64().unwrap_or(0)))
        .collect();
    let deny = ops.iter().position(|o| *o == ("deny".to_string(), 8 * MIB)).expect("no denied 8 MiB request");
    let granted = ops[deny + 1..].iter().position(|o| *o == ("alloc".to_string(), 8 * MIB));
    assert!(granted.is_some() && ops[deny + 1].0 == "free", "no deallocate-and-retry after the denial: {:?}", &ops[deny..]);

    // Denials are reported (one line a second, the rest counted in one line at exit): nothing else.
    let other: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| !l.starts_with("vramcap: denied ") && !(l.starts_with("vramcap: ") && l.contains("more denial(s) not shown")))
        .collect();
    assert!(other.is_empty(), "numba-cuda under vramcap printed on stderr:\n{}", other.join("\n"));
}

/// cuda.close() ends the context (numba pops it, releases the primary context and resets it):
/// the memory it held is gone, so the next context starts from zero.
#[test]
fn numba_cuda_close_then_a_new_context_starts_from_zero() {
    let trace = std::env::temp_dir().join(format!("vramcap-numba-close-{}.jsonl", std::process::id()));
    let out = numba("close", &trace);
    let _ = std::fs::remove_file(&trace);
    assert!(out.status.success(), "numba-cuda test failed:\n{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("numba close ok"), "{}", out.stdout);
}
