//! scripts/gpu-check.sh without a GPU: syntax, the pure Python parts' unit tests, the plan, and
//! the whole pipeline on the fake driver with a stand-in torch (`--self-test`), once with the
//! preload (every capping check passes) and once with a preload that does not load (they fail).

use vramcap_tests::common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vramcap-gpu-check-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn script(args: &[&str]) -> Output {
    Command::new("bash")
        .arg(root().join("scripts/gpu-check.sh"))
        .args(args)
        .env_remove("LD_PRELOAD")
        .env_remove("VRAMCAP_LIMIT")
        .output()
        .expect("bash")
}

fn self_test(name: &str, lib: &Path) -> (Output, String) {
    build_c();
    let out = scratch(name);
    let o = script(&["--self-test", "--out", out.to_str().unwrap(), "--lib", lib.to_str().unwrap(), "--bin",
        vramcap_tests::common::vramcap_bin()]);
    let results = std::fs::read_to_string(out.join("gpu-check-results.md"))
        .unwrap_or_else(|e| panic!("no results file ({e}); output:\n{}", text(&o)));
    (o, results)
}

/// The status column of the row named `check`.
fn status<'a>(results: &'a str, check: &str) -> &'a str {
    let row = results.lines().find(|l| l.starts_with(&format!("| {check} |")));
    row.unwrap_or_else(|| panic!("no row {check:?} in\n{results}")).split(" | ").nth(1).unwrap()
}

const MODES: [&str; 3] = ["default", "expandable", "async"];
const CAPPING: [&str; 5] = ["mem_get_info total == cap", "over-cap alloc -> OutOfMemoryError",
    "fill to cap -> OutOfMemoryError", "training continues after OOM", "trace peak <= cap"];

#[test]
fn shell_and_python_parse() {
    let o = Command::new("bash").arg("-n").arg(root().join("scripts/gpu-check.sh")).output().unwrap();
    assert!(o.status.success(), "bash -n: {}", text(&o));
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in ["scripts/gpu_check", "scripts/gpu_check/selftest/torch"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "py") {
                files.push(p);
            }
        }
    }
    assert!(files.len() >= 7, "python files not found: {files:?}");
    let o = Command::new("python3").args(["-m", "py_compile"]).args(&files)
        .env("PYTHONPYCACHEPREFIX", scratch("pyc")).output().expect("python3");
    assert!(o.status.success(), "py_compile: {}", text(&o));
}

#[test]
fn pure_parts_unit_tests() {
    let o = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s", "scripts/gpu_check", "-p", "test_*.py"])
        .current_dir(root())
        .env("PYTHONPYCACHEPREFIX", scratch("pyc-unit"))
        .output()
        .expect("python3");
    let t = text(&o);
    assert!(o.status.success(), "unit tests failed:\n{t}");
    assert!(t.contains("test_missing_checks_fail_with_the_reason") && t.contains("\nOK"), "{t}");
}

#[test]
fn dry_run_plans_three_allocator_modes_and_tensorflow() {
    let o = script(&["--dry-run", "--python", "/opt/py/bin/python3"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let plan: Vec<&str> = t.lines().filter(|l| l.starts_with("PLAN ")).collect();
    let checks: Vec<&&str> = plan.iter().filter(|l| l.contains("torch_worker.py check 300")).collect();
    assert_eq!(checks.len(), 3, "{t}");
    for l in &checks {
        assert!(l.contains("VRAMCAP_LIMIT=4GiB") && l.contains("VRAMCAP_TRACE=") && l.contains("LD_PRELOAD="), "{l}");
        assert!(l.contains("/opt/py/bin/python3"), "{l}");
    }
    assert!(!checks[0].contains("PYTORCH_CUDA_ALLOC_CONF"), "{}", checks[0]);
    assert!(checks[1].contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"), "{}", checks[1]);
    assert!(checks[2].contains("PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"), "{}", checks[2]);
    // Speed: bare and preloaded runs alternate, and the bare ones carry no vramcap setting.
    let speed: Vec<&&str> = plan.iter().filter(|l| l.contains("-speed")).collect();
    assert_eq!(speed.len(), 12, "{t}");
    assert!(speed[0].contains("speed0-bare") && !speed[0].contains("LD_PRELOAD") && !speed[0].contains("VRAMCAP_"));
    assert!(speed[1].contains("speed0-preload") && speed[2].contains("speed1-preload"), "{t}");
    let tf: Vec<&&str> = plan.iter().filter(|l| l.contains("tf_worker.py")).collect();
    assert_eq!(tf.len(), 2, "{t}");
    assert!(!tf[0].contains("TF_FORCE_GPU_ALLOW_GROWTH") && tf[1].contains("TF_FORCE_GPU_ALLOW_GROWTH=true"), "{t}");

    let t = text(&script(&["--dry-run", "--no-tf"]));
    assert!(!t.contains("tf_worker.py"), "{t}");
}

#[test]
fn bad_usage_names_the_option() {
    let o = script(&["--steps", "many"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("--steps expects a whole number, got 'many'"), "{}", text(&o));
    let o = script(&["--frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("unknown option '--frobnicate'"), "{}", text(&o));
}

#[test]
fn self_test_on_the_fake_driver_passes_every_capping_check() {
    let (o, results) = self_test("pass", &preload_lib());
    assert!(o.status.success(), "{}\n{results}", text(&o));
    for mode in MODES {
        for check in CAPPING.iter().chain(["training loop", "steps/s preload/bare"].iter()) {
            assert_eq!(status(&results, &format!("torch[{mode}]: {check}")), "PASS", "{mode} {check}\n{results}");
        }
        // No nvidia-smi here: the NVML row says so instead of passing.
        assert_eq!(status(&results, &format!("torch[{mode}]: NVML usage <= cap + overhead")), "SKIP");
    }
    assert_eq!(status(&results, "tensorflow"), "SKIP");
    assert!(results.contains("overall PASS") && results.contains("1073741824 B"), "{results}");
}

#[test]
fn self_test_without_a_working_preload_fails_and_still_writes_the_table() {
    let (o, results) = self_test("fail", Path::new("/nonexistent/libvramcap.so"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    for mode in MODES {
        for check in ["mem_get_info total == cap", "over-cap alloc -> OutOfMemoryError",
            "fill to cap -> OutOfMemoryError", "trace peak <= cap"] {
            assert_eq!(status(&results, &format!("torch[{mode}]: {check}")), "FAIL", "{mode} {check}\n{results}");
        }
    }
    assert!(results.contains("overall FAIL"), "{results}");
}

#[test]
fn self_test_without_out_leaves_nothing_in_the_repository_root() {
    build_c();
    let in_root = root().join("gpu-check-results.md");
    let before = std::fs::metadata(&in_root).and_then(|m| m.modified()).ok();
    let started = std::time::SystemTime::now();
    let o = script(&["--self-test", "--lib", preload_lib().to_str().unwrap(), "--bin", vramcap_tests::common::vramcap_bin()]);
    let after = std::fs::metadata(&in_root).and_then(|m| m.modified()).ok();
    assert_eq!(after, before, "the self-test wrote {}; output:\n{}", in_root.display(), text(&o));
    let results = root().join("target/gpu-check-selftest/gpu-check-results.md");
    let written = std::fs::metadata(&results).and_then(|m| m.modified()).unwrap_or_else(|e| panic!("{}: {e}\n{}", results.display(), text(&o)));
    assert!(written >= started, "{} is not this run's", results.display());
    assert!(text(&o).contains("target/gpu-check-selftest/gpu-check-results.md"), "{}", text(&o));
}
