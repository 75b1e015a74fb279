//! One limit grammar everywhere (issue 16 §2): `vramcap size`, `replay --limit`, `run --limit`
//! and the library accept and reject the same text, and `run` catches a list naming a device the
//! machine lacks before the job starts, quoting what was typed.

use vramcap_tests::cli_support;
use vramcap_tests::common;
use cli_support::*;

#[test]
fn size_accepts_what_vramcap_limit_accepts() {
    let out = vramcap(&["size", "0=1g,1=2g"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "device 0: 1073741824\ndevice 1: 2147483648\n");
    let out = vramcap(&["size", "GPU-8932f937=50%, 1=0"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "GPU-8932f937: 50% of the device\ndevice 1: 0 (no limit)\n");
    assert_eq!(ok(&["size", "8GiB"]), "8589934592\n");
    // What the library rejects, `size` rejects, with the library's expected form.
    for bad in ["0=1g,foo=2g", "0=1g,1", "8x"] {
        let out = vramcap(&["size", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        assert!(text(&out.stderr).contains(&format!("{bad:?}")) && text(&out.stderr).contains("expected"), "{}", text(&out.stderr));
    }
}

#[test]
fn replay_accepts_a_per_device_list() {
    let (a, b) = (data("job_rank0.jsonl"), data("job_rank1.jsonl"));
    // Device 0 peaks at 5 GiB: 4 GiB on it does not fit, whatever device 1 gets.
    // "Does not fit" is exit status 1, as grep and diff say "no".
    let out = vramcap(&["replay", "--json", "--limit", "0=4g,1=2m", &a, &b]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&text(&out.stdout)).expect("valid JSON on stdout");
    assert_eq!(r["limit"]["0"].as_u64(), Some(4 * common::GIB), "{r}");
    assert_eq!(r["fits"], false, "{r}");
    // A list that leaves device 0 out leaves it uncapped, as VRAMCAP_LIMIT would.
    let r = json(&["replay", "--json", "--limit", "1=1g", &a, &b]);
    assert!(r["limit"]["0"].is_null() && r["fits"] == true, "{r}");
    // A device named twice is ambiguous: an error naming both, as in the library.
    let out = vramcap(&["replay", "--json", "--limit", "0=4g,0=6g", &a, &b]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("named twice in one list (`0=4g` and `0=6g`)"), "{}", text(&out.stderr));
    // Traces know devices by ordinal only.
    let out = vramcap(&["replay", "--limit", "GPU-8932f937=8g", &a, &b]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("GPU-8932f937=8g") && text(&out.stderr).contains("ordinal"), "{}", text(&out.stderr));
}

#[test]
fn a_bare_number_below_one_mib_asks_for_a_unit() {
    common::build_c();
    for args in [&["size", "8"][..], &["replay", "--limit", "8", "x.jsonl"], &["run", "--limit", "8", "--", "echo", "started"]] {
        let out = clean_vramcap(args).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("`8` has no unit") && err.contains("8GiB") && err.contains("8b"), "{args:?}: {err}");
        assert!(!text(&out.stdout).contains("started"), "{args:?}: the job must not start");
    }
    assert_eq!(ok(&["size", "8b"]), "8\n");
    assert_eq!(ok(&["size", "1048576"]), "1048576\n");
}

#[test]
fn run_catches_a_missing_device_before_the_job_starts() {
    common::build_c();
    // The fake driver has two devices (0 and 1).
    let out = clean_vramcap(&["run", "--limit", "0=1g,7=2g", "--", "echo", "started"]).output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!text(&out.stdout).contains("started"), "the job started: {err}");
    assert!(err.contains("--limit \"0=1g,7=2g\"") && err.contains("`7=2g`") && err.contains("device 7 does not exist"), "{err}");
    assert!(!err.contains("2147483648"), "quotes what was typed: {err}");
    // The environment's overrides and the group's list are checked the same way.
    let out = clean_vramcap(&["run", "--", "echo", "started"]).env("VRAMCAP_LIMIT_5", "1g").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("VRAMCAP_LIMIT_5 (from the environment)"), "{}", text(&out.stderr));
    let out = clean_vramcap(&["run", "--group", "g", "--group-limit", "GPU-ffff=1g", "--", "echo", "started"])
        .env("VRAMCAP_GROUP_DIR", common::private_group_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--group-limit \"GPU-ffff=1g\""), "{}", text(&out.stderr));
    // Devices that exist pass, and the job runs.
    let out = clean_vramcap(&["run", "--limit", "0=1g,1=2g", "--", "echo", "started"]).output().unwrap();
    assert!(out.status.success() && text(&out.stdout).contains("started"), "{}", text(&out.stderr));
}
