//! `vramcap doctor` on the fake driver: a good setup is all OK (exit 0); a missing driver, a bad
//! limit, a limit for a device that is not there, an unreachable sidecar are FAIL lines with a fix
//! (exit 1).

use vramcap_tests::cli_support;
use vramcap_tests::common;
use cli_support::*;

fn doctor(env: &[(&str, &str)]) -> (Option<i32>, String) {
    common::build_c();
    let mut c = clean_vramcap(&["doctor"]);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    (out.status.code(), text(&out.stdout) + &text(&out.stderr))
}

/// The doctor's line for one check (first one if several).
fn line<'a>(out: &'a str, what: &str) -> &'a str {
    out.lines().find(|l| l.split_whitespace().nth(1) == Some(what)).unwrap_or_else(|| panic!("no {what} line in:\n{out}"))
}

fn state<'a>(out: &'a str, what: &str) -> &'a str {
    line(out, what).split_whitespace().next().unwrap()
}

#[test]
fn a_good_setup_is_all_ok() {
    let (code, out) = doctor(&[("VRAMCAP_LIMIT", "4GiB"), ("FAKECUDA_DEVICE_COUNT", "2")]);
    assert_eq!(code, Some(0), "{out}");
    for what in ["library", "driver", "devices", "limits", "self-test"] {
        assert_eq!(state(&out, what), "OK", "{what}:\n{out}");
    }
    assert!(line(&out, "driver").contains("target/cuda-shim/libcuda.so.1"), "names the driver file:\n{out}");
    assert!(line(&out, "driver").contains("CUDA 13."), "driver version:\n{out}");
    assert_eq!(out.lines().filter(|l| l.contains(" devices ") && l.contains("16.0 GiB")).count(), 2, "{out}");
    assert!(line(&out, "limits").contains("GPU 0 4.0 GiB, GPU 1 4.0 GiB"), "{out}");
    assert!(out.contains("all good"));
}

#[test]
fn limits_resolve_against_the_devices() {
    let (code, out) = doctor(&[("VRAMCAP_LIMIT", "25%"), ("VRAMCAP_LIMIT_1", "1g"), ("FAKECUDA_DEVICE_COUNT", "2"), ("FAKECUDA_MEM", "8g,16g")]);
    assert_eq!(code, Some(0), "{out}");
    assert!(line(&out, "limits").contains("GPU 0 2.0 GiB, GPU 1 1.0 GiB"), "{out}");
}

#[test]
fn a_missing_driver_is_reported_with_a_fix() {
    let (code, out) = doctor(&[("VRAMCAP_REAL_LIBCUDA", "/nonexistent/libcuda.so.1")]);
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(state(&out, "driver"), "FAIL");
    assert!(line(&out, "driver").contains("/nonexistent/libcuda.so.1"), "{out}");
    assert!(out.contains("fix: point VRAMCAP_REAL_LIBCUDA at the driver"), "{out}");
    assert!(!out.contains("all good"));
    // A library that loads but is no driver.
    let not_a_driver = common::ctests_dir().join("libnextwrap.so");
    let (code, out) = doctor(&[("VRAMCAP_REAL_LIBCUDA", &not_a_driver.to_string_lossy())]);
    assert_eq!((code, state(&out, "driver")), (Some(1), "FAIL"), "{out}");
    assert!(line(&out, "driver").contains("has no cuInit"), "{out}");
}

#[test]
fn a_failing_driver_init_is_reported() {
    let (code, out) = doctor(&[("FAKECUDA_INIT_FAIL", "100")]);
    assert_eq!((code, state(&out, "driver")), (Some(1), "FAIL"), "{out}");
    assert!(line(&out, "driver").contains("CUDA_ERROR_NO_DEVICE"), "{out}");
}

#[test]
fn bad_limits_are_reported_with_the_variable_and_form() {
    for (env, want) in [
        (vec![("VRAMCAP_LIMIT", "abc")], "invalid VRAMCAP_LIMIT=\"abc\""),
        (vec![("VRAMCAP_LIMIT", "3=1g")], "device 3 does not exist"),
        (vec![("VRAMCAP_GROUP_LIMIT", "1g")], "needs a group"),
        (vec![("CUDA_DEVICE_MEMORY_LIMIT", "6q")], "CUDA_DEVICE_MEMORY_LIMIT"),
    ] {
        let (code, out) = doctor(&env);
        assert_eq!(code, Some(1), "{env:?}: {out}");
        assert_eq!(state(&out, "limits"), "FAIL", "{env:?}: {out}");
        assert!(line(&out, "limits").contains(want), "{env:?}: {out}");
        // The self-test does not depend on the user's limits: it still passes.
        assert_eq!(state(&out, "self-test"), "OK", "{env:?}: {out}");
    }
}

#[test]
fn the_sidecar_is_checked_when_configured() {
    let d = scratch("doctor-sidecar");
    let sock = d.join("s.sock");
    let (code, out) = doctor(&[("VRAMCAP_SIDECAR", &sock.to_string_lossy())]);
    assert_eq!((code, state(&out, "sidecar")), (Some(1), "FAIL"), "{out}");
    assert!(line(&out, "sidecar").contains("cannot connect"), "{out}");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let (code, out) = doctor(&[("VRAMCAP_SIDECAR", &sock.to_string_lossy())]);
    assert_eq!((code, state(&out, "sidecar")), (Some(0), "OK"), "{out}");
    let (_, out) = doctor(&[]);
    assert_eq!(state(&out, "sidecar"), "--", "not configured is not a failure");
}

#[test]
fn a_missing_library_is_a_failure() {
    let exe = lonely_binary("doctor-nolib");
    let mut c = std::process::Command::new(&exe);
    clean_env(&mut c);
    let out = output_of_copy(c.arg("doctor"));
    let so = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{so}");
    assert_eq!(state(&so, "library"), "FAIL");
    assert_eq!(state(&so, "self-test"), "--", "not run without the library");
}

/// Any variable may hold bytes that are not UTF-8 (a path, a locale string): the doctor reads
/// them without panicking, and a limit it cannot read is a FAIL naming it, as the library
/// refuses to run with it.
#[test]
fn variables_that_are_not_utf8_do_not_panic_the_doctor() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    common::build_c();
    let bad = OsStr::from_bytes(b"x\xffy");
    // Someone else's variable, and vramcap's own non-limit variables: no panic, no failure.
    let mut c = clean_vramcap(&["doctor"]);
    c.env("SOME_TOOL_SETTING", bad).env("FAKECUDA_DEVICE_COUNT", "1").env("VRAMCAP_LIMIT", "1g");
    let out = c.output().unwrap();
    let text_out = text(&out.stdout) + &text(&out.stderr);
    assert!(!text_out.contains("panicked"), "{text_out}");
    assert_eq!(out.status.code(), Some(0), "{text_out}");
    // A limit that is not UTF-8: reported, exit 1, never a panic.
    for var in ["VRAMCAP_LIMIT", "VRAMCAP_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT"] {
        let mut c = clean_vramcap(&["doctor"]);
        c.env(var, bad).env("FAKECUDA_DEVICE_COUNT", "1");
        let out = c.output().unwrap();
        let text_out = text(&out.stdout) + &text(&out.stderr);
        assert!(!text_out.contains("panicked"), "{var}: {text_out}");
        assert_eq!(out.status.code(), Some(1), "{var}: {text_out}");
        assert_eq!(state(&text_out, "limits"), "FAIL", "{var}: {text_out}");
        assert!(line(&text_out, "limits").contains(var) && text_out.contains("UTF-8"), "{var}: {text_out}");
    }
}

/// Every "sharing" line, in order.
fn sharing(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.split_whitespace().nth(1) == Some("sharing")).collect()
}

/// Issue 17: the group's policy, the member's priority, reserve and headroom are shown as the
/// limits are, resolved on the devices (per-device lists too).
#[test]
fn group_sharing_settings_are_shown() {
    let dir = scratch("doctor-sharing");
    let (code, out) = doctor(&[
        ("FAKECUDA_DEVICE_COUNT", "2"),
        ("VRAMCAP_GROUP", "team"),
        ("VRAMCAP_GROUP_DIR", dir.to_str().unwrap()),
        ("VRAMCAP_GROUP_LIMIT", "2g"),
        ("VRAMCAP_GROUP_POLICY", "priority"),
        ("VRAMCAP_PRIORITY", "5"),
        ("VRAMCAP_GROUP_RESERVE", "512m"),
        ("VRAMCAP_GROUP_RESERVE_1", "1g"),
        ("VRAMCAP_GROUP_HEADROOM", "256m"),
    ]);
    assert_eq!(code, Some(0), "{out}");
    let lines = sharing(&out);
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines.iter().all(|l| l.split_whitespace().next() == Some("OK")), "{out}");
    assert!(lines[0].contains("policy priority (VRAMCAP_GROUP_POLICY") && lines[0].ends_with("priority 5"), "{out}");
    assert!(lines[1].ends_with("reserve: GPU 0 512.0 MiB, GPU 1 1.0 GiB"), "{out}");
    assert!(lines[2].ends_with("headroom: GPU 0 256.0 MiB, GPU 1 256.0 MiB"), "{out}");
    // Unset: the group's, and a priority that the policy does not use is pointed out.
    let (code, out) = doctor(&[("VRAMCAP_GROUP", "team"), ("VRAMCAP_GROUP_DIR", dir.to_str().unwrap()), ("VRAMCAP_GROUP_POLICY", "equal"), ("VRAMCAP_PRIORITY", "2")]);
    assert_eq!(code, Some(0), "{out}");
    let lines = sharing(&out);
    assert!(lines[0].contains("policy equal") && lines[0].ends_with("priority 2"), "{out}");
    assert!(lines.iter().any(|l| l.starts_with("  --") && l.contains("only the priority policy uses it")), "{out}");
    assert!(lines.iter().any(|l| l.ends_with("reserve: none (VRAMCAP_GROUP_RESERVE unset)")), "{out}");
    assert!(lines.iter().any(|l| l.ends_with("headroom: the group's (none for a new group)")), "{out}");
}

/// A bad policy, priority, reserve or headroom is a FAIL naming the variable (under "limits"
/// when it does not parse, as other bad values; under "sharing" when it names a device this
/// machine lacks or could never fit the group's limit), and the doctor exits 1.
#[test]
fn bad_group_sharing_settings_are_reported() {
    let dir = scratch("doctor-sharing-bad");
    let d = dir.to_str().unwrap();
    for (env, what, want) in [
        (vec![("VRAMCAP_GROUP_POLICY", "fair")], "limits", "invalid VRAMCAP_GROUP_POLICY=\"fair\": not a policy"),
        (vec![("VRAMCAP_PRIORITY", "high")], "limits", "invalid VRAMCAP_PRIORITY=\"high\": not an integer"),
        (vec![("VRAMCAP_GROUP_RESERVE", "lots")], "limits", "invalid VRAMCAP_GROUP_RESERVE=\"lots\""),
        (vec![("VRAMCAP_GROUP_HEADROOM", "3=1g")], "sharing", "device 3 does not exist"),
        (vec![("VRAMCAP_GROUP_LIMIT", "1g"), ("VRAMCAP_GROUP_RESERVE", "900m"), ("VRAMCAP_GROUP_HEADROOM", "200m")], "sharing", "reserve 900.0 MiB on GPU 0 does not fit the group limit 1.0 GiB less the headroom 200.0 MiB"),
        (vec![("VRAMCAP_GROUP_LIMIT", "1g"), ("VRAMCAP_GROUP_HEADROOM", "1g")], "sharing", "headroom 1.0 GiB on GPU 0 is the whole group limit 1.0 GiB"),
    ] {
        let mut env = env.clone();
        env.extend([("VRAMCAP_GROUP", "team"), ("VRAMCAP_GROUP_DIR", d)]);
        let (code, out) = doctor(&env);
        assert_eq!(code, Some(1), "{env:?}: {out}");
        let fail = out.lines().find(|l| l.split_whitespace().take(2).eq(["FAIL", what])).unwrap_or_else(|| panic!("{env:?}: no FAIL {what}:\n{out}"));
        assert!(fail.contains(want), "{env:?}: {out}");
        assert!(out.contains("fix:"), "{env:?}: {out}");
    }
}

/// Issue 26: which mode a job started here runs in, and why.
#[test]
fn the_mode_in_force_and_why() {
    let (code, out) = doctor(&[("VRAMCAP_LIMIT", "4GiB")]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(state(&out, "mode"), "OK");
    assert!(line(&out, "mode").contains("enforce (the default)"), "{out}");
    let (code, out) = doctor(&[("VRAMCAP_LIMIT", "4GiB"), ("VRAMCAP_MODE", "enforce")]);
    assert_eq!(code, Some(0), "{out}");
    assert!(line(&out, "mode").contains("enforce, by VRAMCAP_MODE=enforce in this environment"), "{out}");
    let (code, out) = doctor(&[("VRAMCAP_LIMIT", "4GiB"), ("VRAMCAP_MODE", "observe"), ("VRAMCAP_GROUP", "pod")]);
    assert_eq!(code, Some(0), "observe is a choice, not a problem: {out}");
    assert_eq!(state(&out, "mode"), "--");
    let l = line(&out, "mode");
    assert!(l.contains("observe, by VRAMCAP_MODE=observe in this environment") && l.contains("every member observes"), "{l}");
    let (code, out) = doctor(&[("VRAMCAP_LIMIT", "4GiB"), ("VRAMCAP_MODE", "dry-run")]);
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(state(&out, "mode"), "FAIL");
    let l = line(&out, "mode");
    assert!(l.contains("VRAMCAP_MODE") && l.contains("dry-run") && l.contains("enforce") && l.contains("observe"), "{l}");
}
