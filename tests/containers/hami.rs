//! A container set up for HAMi-core keeps working with libvramcap.so in libvgpu.so's place: the
//! mounts and variables HAMi's device plugin gives a container (`/usr/local/vgpu/libvgpu.so` and
//! `/etc/ld.so.preload` naming it, `CUDA_DEVICE_MEMORY_LIMIT_<i>=<n>m`,
//! `CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/<uuid>.cache` in a per-container host
//! directory mounted at /usr/local/vgpu), no CDI and nothing else of vramcap's.

use crate::needs_podman;
use crate::podman::{client, run_plain, test_dir};
use std::path::{Path, PathBuf};
use vramcap_tests::common::*;

/// The host side of one HAMi container: the container's cache directory and the preload file.
struct Hami {
    cache_dir: PathBuf,
    preload: PathBuf,
}

fn hami(name: &str) -> Hami {
    let dir = test_dir(name);
    let cache_dir = dir.join("containers/pod-uid_trainer");
    std::fs::create_dir_all(&cache_dir).unwrap();
    let preload = dir.join("ld.so.preload");
    std::fs::write(&preload, "/usr/local/vgpu/libvgpu.so\n").unwrap();
    Hami { cache_dir, preload }
}

impl Hami {
    /// podman's flags for HAMi's mounts and variables (a cache file `cache` per process list).
    fn args(&self, env: &[(&str, &str)]) -> Vec<String> {
        let mut a = vec![
            "-v".to_string(),
            format!("{}:/usr/local/vgpu", self.cache_dir.display()),
            "-v".into(),
            format!("{}:/usr/local/vgpu/libvgpu.so:ro", preload_lib().display()),
            "-v".into(),
            format!("{}:/etc/ld.so.preload:ro", self.preload.display()),
            "-e".into(),
            "CUDA_DEVICE_MEMORY_LIMIT_0=256m".into(),
            "-e".into(),
            "CUDA_DEVICE_SM_LIMIT=50".into(),
        ];
        for (k, v) in env {
            a.push("-e".into());
            a.push(format!("{k}={v}"));
        }
        a
    }
}

fn run(h: &Hami, env: &[(&str, &str)], script: &str) -> Output {
    let args = h.args(env);
    run_plain(&args.iter().map(String::as_str).collect::<Vec<_>>(), script)
}

/// Processes of the container share the 256m; the second starts while the first holds 200m.
fn shared_script(second_env: &str) -> String {
    format!(
        "{} > /tmp/h.out &\nh=$!\nwhile ! grep -q '^alloc' /tmp/h.out; do sleep 0.05; done; cat /tmp/h.out\n{second_env} {}\nkill $h\n",
        client("client_procaddr", "init ctx 0 alloc 200m sleep 30000"),
        client("client_linked", "init ctx 0 alloc 100m alloc 50m info")
    )
}

const CACHE: &str = "/usr/local/vgpu/5b7e1f0c-3a2d-4e6f-9b8a-1c2d3e4f5a6b.cache";

#[test]
fn a_container_set_up_for_hami_core_is_capped_as_one_budget_kept_in_its_shared_cache() {
    needs_podman!();
    let h = hami("hami");
    let out = run(&h, &[("CUDA_DEVICE_MEMORY_SHARED_CACHE", CACHE)], &shared_script(""));
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0, "{}", out.stderr);
    assert_eq!((out.nth("alloc", 1).rc(), out.nth("alloc", 2).rc()), (2, 0), "one budget for the container: {}", out.stderr);
    assert_eq!(out.nth("info", 0).num("total"), 256 * MIB, "cuMemGetInfo shows HAMi's limit");
    // The budget lived in the file HAMi named, in the container's host directory.
    let file = h.cache_dir.join(Path::new(CACHE).file_name().unwrap());
    let m = vramcap_common::group_ledger::file::open_existing(&file).unwrap().unwrap_or_else(|| panic!("no ledger at {}", file.display()));
    assert!(m.shm.name().starts_with("hami-"), "{}", m.shm.name());
    assert_eq!(m.shm.devices.iter().map(|d| d.limit.load(std::sync::atomic::Ordering::SeqCst)).max(), Some(256 * MIB));
    m.unmap();
}

/// The cache file is where the budget lives: a process given another file has a budget of its own
/// (without the variable honoured, both would share the container's default group).
#[test]
fn hamis_shared_cache_decides_which_processes_share_a_budget() {
    needs_podman!();
    let h = hami("hami-two");
    let other = "CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/other.cache";
    let out = run(&h, &[("CUDA_DEVICE_MEMORY_SHARED_CACHE", CACHE)], &shared_script(other));
    out.ok();
    assert_eq!((out.nth("alloc", 0).rc(), out.nth("alloc", 1).rc(), out.nth("alloc", 2).rc()), (0, 0, 0), "{}", out.stderr);
    assert!(h.cache_dir.join("other.cache").is_file());
}

/// A file HAMi-core itself left at that path is not a vramcap ledger: refused, CUDA fails (never
/// uncapped), and the line names the variable.
#[test]
fn a_cache_file_hami_core_wrote_is_refused_and_the_job_is_never_uncapped() {
    needs_podman!();
    let h = hami("hami-foreign");
    let mut foreign = 19920718u32.to_le_bytes().to_vec();
    foreign.resize(4 << 20, 0);
    std::fs::write(h.cache_dir.join("old.cache"), foreign).unwrap();
    let out = run(&h, &[("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/usr/local/vgpu/old.cache")], &client("client_procaddr", "init ctx 0 alloc 1m"));
    assert_ne!(out.nth("init", 0).rc(), 0, "{}", out.stderr);
    assert!(out.stderr.contains("CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/old.cache"), "{}", out.stderr);
}

/// HAMi-core's off switch is not vramcap's: the cap stays, and one line says so.
#[test]
fn cuda_disable_control_does_not_turn_the_cap_off() {
    needs_podman!();
    let h = hami("hami-off");
    let out = run(&h, &[("CUDA_DEVICE_MEMORY_SHARED_CACHE", CACHE), ("CUDA_DISABLE_CONTROL", "true")], &client("client_procaddr", "init ctx 0 alloc 300m"));
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 2, "{}", out.stderr);
    assert!(out.stderr.contains("ignoring CUDA_DISABLE_CONTROL=\"true\""), "{}", out.stderr);
}
