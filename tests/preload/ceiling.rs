//! The platform's ceiling, `/etc/vramcap/limits`, and secure-execution mode (issue 15). The path
//! is fixed (no variable may move it), so these tests run as root in a mount namespace whose
//! `/etc` is an overlay of the real one: the file, and `/etc/ld.so.preload` for the setuid test,
//! exist only there. Without root, `unshare -m` or overlayfs they print `SKIPPED` and pass; CI
//! runs them as root.

use vramcap_tests::common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const OTHER_UID: u32 = 54321;

pub(crate) fn can_overlay_etc() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        if unsafe { libc::geteuid() } != 0 {
            return false;
        }
        let t = scratch();
        let s = format!("mount -t overlay overlay -o lowerdir=/etc,upperdir={t}/up,workdir={t}/work /etc", t = t.display());
        Command::new("unshare").args(["-m", "sh", "-c", &s]).status().is_ok_and(|s| s.success())
    })
}

macro_rules! needs_root_ns {
    () => {
        if !can_overlay_etc() {
            eprintln!("SKIPPED: needs root, unshare -m and overlayfs");
            return;
        }
    };
}

/// A fresh directory anyone can enter (the setuid test's other user must reach its binary).
pub(crate) fn scratch() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = private_group_dir();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(d.join("up")).unwrap();
    std::fs::create_dir_all(d.join("work")).unwrap();
    d
}

/// `prog args...` in a mount namespace where /etc/vramcap/limits holds `limits` (mode `mode`)
/// and, if given, /etc/ld.so.preload names `preload`.
fn with_etc(t: &Path, limits: &str, mode: &str, preload: Option<&Path>, prog: &str) -> Run {
    std::fs::write(t.join("limits"), limits).unwrap();
    let preload = preload.map_or(String::new(), |p| format!("echo {} > /etc/ld.so.preload", p.display()));
    let script = format!(
        "set -e\nmount -t overlay overlay -o lowerdir=/etc,upperdir={t}/up,workdir={t}/work /etc\n\
         mkdir -p /etc/vramcap\ncp {t}/limits /etc/vramcap/limits\nchmod {mode} /etc/vramcap/limits\n{preload}\nexec \"$@\"\n",
        t = t.display()
    );
    std::fs::write(t.join("etc.sh"), script).unwrap();
    Run::program(Path::new("unshare")).args(["-m", "sh", t.join("etc.sh").to_str().unwrap(), prog])
}

pub(crate) fn client(name: &str) -> String {
    build_c();
    ctests_dir().join(name).display().to_string()
}

#[test]
fn the_environment_cannot_disable_raise_or_leave_the_ceiling() {
    needs_root_ns!();
    let t = scratch();
    let g = t.join("groups");
    std::fs::create_dir_all(&g).unwrap();
    let limits = format!(
        "# the platform's budget for this pod\nVRAMCAP_LIMIT=256m\nVRAMCAP_GROUP=plat\nVRAMCAP_GROUP_LIMIT=512m\nVRAMCAP_GROUP_DIR={}\n",
        g.display()
    );
    let out = with_etc(&t, &limits, "0644", None, &client("client_procaddr"))
        .env("VRAMCAP_DISABLE", "1")
        .env("VRAMCAP_LIMIT", "80g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "80g")
        .env("VRAMCAP_GROUP", "mine")
        .env("VRAMCAP_GROUP_LIMIT", "80g")
        .args(["init ctx 0 alloc 300m alloc 200m info"])
        .run();
    out.ok();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (2, 0), "{}", out.stderr);
    assert_eq!(out.nth("info", 0).num("total"), 256 * MIB);
    for line in [
        "ignoring VRAMCAP_DISABLE=\"1\": /etc/vramcap/limits sets this machine's ceiling",
        "ignoring VRAMCAP_GROUP=\"mine\"",
        "VRAMCAP_LIMIT above the ceiling in /etc/vramcap/limits (256.0 MiB on devices 0-1)",
        "VRAMCAP_GROUP_LIMIT above the ceiling in /etc/vramcap/limits (512.0 MiB on devices 0-1)",
    ] {
        assert_eq!(out.stderr.matches(line).count(), 1, "{line}: {}", out.stderr);
    }
    // The member is in the platform's group, under the platform's group limit.
    let m = vramcap_common::group_ledger::file::open_existing(&vramcap_common::group_ledger::file::path_for(g.to_str().unwrap(), "plat")).unwrap().unwrap();
    assert_eq!(m.shm.devices[0].limit.load(std::sync::atomic::Ordering::SeqCst), 512 * MIB);
}

/// Issue 28 item 11: on an eight-GPU node a refused setting is one line, not one per device, in
/// the name the user set; HAMi's variable, unused under the file's vramcap limits, is said once
/// (it was silent). Control: without a file nothing is said about either.
#[test]
fn a_refused_setting_is_one_line_however_many_devices_and_an_unused_hami_limit_is_said() {
    needs_root_ns!();
    let t = scratch();
    let g = t.join("groups");
    std::fs::create_dir_all(&g).unwrap();
    let group_file = format!("VRAMCAP_GROUP=plat\nVRAMCAP_GROUP_DIR={}\nVRAMCAP_GROUP_LIMIT=512m\n", g.display());
    let cases: [(&str, (&str, &str), &str); 4] = [
        ("VRAMCAP_LIMIT=512m\n", ("VRAMCAP_LIMIT", "1g"), "VRAMCAP_LIMIT above the ceiling in /etc/vramcap/limits (512.0 MiB on devices 0-7)"),
        ("CUDA_DEVICE_MEMORY_LIMIT=512m\n", ("CUDA_DEVICE_MEMORY_LIMIT", "1g"), "CUDA_DEVICE_MEMORY_LIMIT above the ceiling in /etc/vramcap/limits (512.0 MiB on devices 0-7)"),
        ("VRAMCAP_LIMIT=512m\n", ("CUDA_DEVICE_MEMORY_LIMIT", "1g"), "ignoring CUDA_DEVICE_MEMORY_LIMIT=\"1g\": /etc/vramcap/limits sets this machine's ceiling"),
        (&group_file, ("CUDA_DEVICE_MEMORY_LIMIT", "1g"), "ignoring CUDA_DEVICE_MEMORY_LIMIT=\"1g\": /etc/vramcap/limits sets this machine's ceiling"),
    ];
    for (file, (k, v), want) in cases {
        let out = with_etc(&t, file, "0644", None, &client("client_procaddr"))
            .env("FAKECUDA_DEVICE_COUNT", "8")
            .env(k, v)
            .args(["init ctx 0 info"])
            .run();
        out.ok();
        assert_eq!(out.nth("info", 0).num("total"), 512 * MIB, "{file} {k}: {}", out.stderr);
        // (Run gives every client a private VRAMCAP_GROUP_DIR, which the file's group refuses.)
        let said: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("vramcap: ") && !l.contains("VRAMCAP_GROUP_DIR")).collect();
        assert_eq!(said.len(), 1, "{file} {k}={v}: {}", out.stderr);
        assert!(said[0].contains(want), "{file} {k}={v}: {}", out.stderr);
    }
    let out = Run::client("client_procaddr").env("FAKECUDA_DEVICE_COUNT", "8").env("CUDA_DEVICE_MEMORY_LIMIT", "1g").args(["init ctx 0 info"]).run();
    out.ok();
    assert!(!out.stderr.contains("vramcap: "), "{}", out.stderr);
}

#[test]
fn the_environment_may_lower_the_ceiling_and_add_a_trace() {
    needs_root_ns!();
    let t = scratch();
    let trace = t.join("t.jsonl");
    let out = with_etc(&t, "VRAMCAP_LIMIT=256m\n", "0644", None, &client("client_linked"))
        .env("VRAMCAP_LIMIT", "64m")
        .env("VRAMCAP_TRACE", &trace)
        .args(["init ctx 0 alloc 100m alloc 32m"])
        .run();
    out.ok();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc()), (2, 0), "{}", out.stderr);
    assert!(!out.stderr.contains("ignoring") && !out.stderr.contains("ceiling"), "{}", out.stderr);
    assert!(std::fs::read_to_string(&trace).unwrap().contains("\"type\":\"summary\""));
}

#[test]
fn a_configmap_volume_of_symlinks_is_a_ceiling() {
    needs_root_ns!();
    let t = scratch();
    // What Kubernetes makes of a ConfigMap mounted at /etc/vramcap: limits -> ..data/limits.
    let run = with_etc(&t, "VRAMCAP_LIMIT=64m\n", "0444", None, "sh");
    let script = t.join("configmap.sh");
    std::fs::write(
        &script,
        "cd /etc/vramcap && mkdir ..2026 && mv limits ..2026/limits && ln -s ..2026 ..data && ln -s ..data/limits limits && exec \"$@\"\n",
    )
    .unwrap();
    let out = run
        .args([script.to_str().unwrap(), &client("client_linked")])
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init ctx 0 alloc 100m"])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 2, "{}", out.stderr);
    assert!(out.stderr.contains("above the ceiling in /etc/vramcap/limits (64.0 MiB on devices 0-1)"), "{}", out.stderr);
}

#[test]
fn a_ceiling_file_others_can_write_is_ignored_with_a_warning() {
    needs_root_ns!();
    let t = scratch();
    let out = with_etc(&t, "VRAMCAP_LIMIT=1m\n", "0666", None, &client("client_linked"))
        .env("VRAMCAP_LIMIT", "1g")
        .args(["init ctx 0 alloc 300m"])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert!(out.stderr.contains("ignoring /etc/vramcap/limits: writable by users other than root (mode 666)"), "{}", out.stderr);
}

#[test]
fn a_setuid_program_never_opens_what_its_callers_environment_names() {
    needs_root_ns!();
    let t = scratch();
    let rootonly = t.join("rootonly");
    std::fs::create_dir_all(&rootonly).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&rootonly, std::fs::Permissions::from_mode(0o700)).unwrap();
    let pwned = rootonly.join("pwned");
    // A library the caller would like the privileged process to load.
    std::fs::write(
        t.join("evil.c"),
        format!("#include <fcntl.h>\n__attribute__((constructor)) static void f(void) {{ open(\"{}\", O_CREAT | O_WRONLY, 0644); }}\n", pwned.display()),
    )
    .unwrap();
    // The setuid program: asks for cuInit the way dlsym-using frameworks do, and calls it.
    std::fs::write(
        t.join("suid.c"),
        "#include <dlfcn.h>\n#include <stdio.h>\nint main(void) { int (*f)(unsigned) = (int (*)(unsigned))dlsym(RTLD_DEFAULT, \"cuInit\");\n\
         printf(\"cuinit found=%d rc=%d\\n\", f != 0, f ? f(0) : -1); return 0; }\n",
    )
    .unwrap();
    for (src, out, extra) in [("evil.c", "evil.so", "-shared -fPIC"), ("suid.c", "suid", "-ldl")] {
        let cmd = format!("cc -o {} {} {extra}", t.join(out).display(), t.join(src).display());
        assert!(Command::new("sh").args(["-c", &cmd]).status().unwrap().success(), "{cmd}");
    }
    std::fs::set_permissions(t.join("suid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    let trace = rootonly.join("trace.jsonl");
    let group = format!("suid-{}", std::process::id());
    let out = with_etc(&t, "# no limits: only secure-execution mode is tested\n", "0644", Some(&preload_lib()), "setpriv")
        .bare()
        .env_remove("VRAMCAP_GROUP_DIR")
        .args([format!("--reuid={OTHER_UID} --regid={OTHER_UID} --clear-groups {}", t.join("suid").display())])
        .env("VRAMCAP_REAL_LIBCUDA", t.join("evil.so"))
        .env("VRAMCAP_TRACE", &trace)
        .env("VRAMCAP_SIDECAR", rootonly.join("sock"))
        .env("VRAMCAP_REAL_LIBNVML", t.join("evil.so"))
        .env("VRAMCAP_GROUP_DIR", rootonly.join("groups"))
        .env("VRAMCAP_GROUP", &group)
        .env("VRAMCAP_GROUP_LIMIT", "1g")
        .run();
    // The group went to the default directory of the process's (effective) uid instead.
    let _ = std::fs::remove_file(format!("/dev/shm/vramcap-0/vramcap-group-{group}"));
    out.ok();
    assert_eq!(out.nth("cuinit", 0).num("found"), 1, "vramcap was loaded through ld.so.preload: {}", out.stderr);
    assert!(!pwned.exists(), "the setuid program loaded the caller's library: {}", out.stderr);
    assert!(!trace.exists(), "the setuid program created the caller's trace");
    assert!(!rootonly.join("groups").exists(), "the setuid program made the caller's group directory");
    for v in ["VRAMCAP_REAL_LIBCUDA", "VRAMCAP_TRACE", "VRAMCAP_SIDECAR", "VRAMCAP_REAL_LIBNVML", "VRAMCAP_GROUP_DIR"] {
        assert!(out.stderr.contains(&format!("ignoring {v}: this process runs in secure-execution mode")), "{v}: {}", out.stderr);
    }
}

/// Issue 26: the environment cannot switch a ceiling machine to observe mode (one line naming the
/// file, and the cap enforces); only a `VRAMCAP_MODE=observe` line in the file does, a
/// machine-wide dry run, where the environment may still choose to enforce. All three lookup
/// paths.
#[test]
fn only_the_ceiling_file_turns_observe_mode_on() {
    needs_root_ns!();
    use vramcap_tests::observe_support::{LOOKUPS, check_trace};
    for c in LOOKUPS {
        let t = scratch();
        let trace = t.join("t.jsonl");
        let out = with_etc(&t, "VRAMCAP_LIMIT=256m\n", "0644", None, &client(c))
            .env("VRAMCAP_MODE", "observe")
            .env("VRAMCAP_TRACE", &trace)
            .args(["init ctx 0 alloc 300m info"])
            .run();
        out.ok();
        assert_eq!(out.nth("alloc", 0).rc(), 2, "{c}: enforced: {}", out.stderr);
        assert_eq!(out.nth("info", 0).num("total"), 256 * MIB, "{c}");
        let said: Vec<&str> = out.stderr.lines().filter(|l| l.contains("VRAMCAP_MODE")).collect();
        assert_eq!(said.len(), 1, "{c}: {}", out.stderr);
        assert!(
            said[0].contains("ignoring VRAMCAP_MODE=\"observe\": /etc/vramcap/limits sets this machine's ceiling, and only a VRAMCAP_MODE=observe line in it"),
            "{}",
            said[0]
        );
        assert!(!std::fs::read_to_string(&trace).unwrap().contains("would_deny"), "{c}");

        // The file's own line: the ceiling's limit only watches.
        let t = scratch();
        let trace = t.join("t.jsonl");
        let out = with_etc(&t, "VRAMCAP_LIMIT=256m\nVRAMCAP_MODE=observe\n", "0644", None, &client(c))
            .env("VRAMCAP_TRACE", &trace)
            .args(["init ctx 0 alloc 300m info"])
            .run();
        out.ok();
        assert_eq!(out.nth("alloc", 0).rc(), 0, "{c}: observed: {}", out.stderr);
        assert_eq!(out.nth("info", 0).num("total"), 16 * GIB, "{c}: the physical view");
        check_trace(&trace, &[("cuMemAlloc_v2", 300 * MIB, "ceiling", 256 * MIB, 0)]);
        // A lower limit of the environment's is the process's cap (still observed) ...
        let out = with_etc(&t, "VRAMCAP_LIMIT=256m\nVRAMCAP_MODE=observe\n", "0644", None, &client(c))
            .env("VRAMCAP_LIMIT", "128m")
            .env("VRAMCAP_TRACE", &trace)
            .args(["init ctx 0 alloc 200m"])
            .run();
        assert_eq!(out.nth("alloc", 0).rc(), 0, "{c}");
        check_trace(&trace, &[("cuMemAlloc_v2", 200 * MIB, "process", 128 * MIB, 0)]);
        // ... and the environment may choose to enforce (stricter), without a word.
        let out = with_etc(&t, "VRAMCAP_LIMIT=256m\nVRAMCAP_MODE=observe\n", "0644", None, &client(c))
            .env("VRAMCAP_MODE", "enforce")
            .args(["init ctx 0 alloc 300m"])
            .run();
        assert_eq!(out.nth("alloc", 0).rc(), 2, "{c}: {}", out.stderr);
        assert!(!out.stderr.contains("VRAMCAP_MODE"), "{}", out.stderr);
    }
}
