//! Periodic reclaim of dead group members (issue 6): a member killed with SIGKILL leaves its charge
//! in the group ledger until another member is about to be denied. The sidecar sweeps every group
//! its clients belong to, so the budget comes back even when nobody is allocating.
//!
//! It maps the same ledger files the members do (docs/configuration.md, group caps) and uses the
//! same once-only reclaim (`Shared::reclaim_dead`): a member that reclaims at the same moment
//! cannot double-count, whoever wins the slot's compare-and-swap gives the charge back.

#[allow(dead_code)]
#[path = "../group/shm.rs"]
mod shm;
#[allow(dead_code)]
#[path = "../group/file.rs"]
mod file;
#[allow(dead_code)]
#[path = "../group/liveness.rs"]
mod liveness;
#[allow(dead_code)]
#[path = "../group/guard.rs"]
mod guard;

use super::state::Registry;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bytes given back to groups since start (metric `vramcap_group_reclaimed_bytes_total`).
pub static RECLAIMED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Sweeps `dir/vramcap-group-<name>` for every group name clients have reported, every `every`.
pub fn spawn(dir: PathBuf, registry: Arc<Mutex<Registry>>, every: Duration) -> std::io::Result<()> {
    std::thread::Builder::new().name("group-reclaim".into()).spawn(move || {
        loop {
            std::thread::sleep(every);
            let groups: BTreeSet<String> = registry.lock().unwrap_or_else(|e| e.into_inner()).groups.clone();
            for g in &groups {
                sweep(&dir, g);
            }
        }
    })?;
    Ok(())
}

/// One group: returns (members, bytes) reclaimed.
pub fn sweep(dir: &std::path::Path, group: &str) -> (usize, u64) {
    let path = file::path_for(&dir.to_string_lossy(), group);
    let m = match file::open_existing(&path) {
        Ok(Some(m)) => m,
        Ok(None) => return (0, 0),
        Err(e) => {
            eprintln!("vramcap sidecar: group {group:?}: {e}");
            return (0, 0);
        }
    };
    let (n, bytes) = m.shm.reclaim_dead(std::process::id(), &file::liveness);
    m.unmap();
    if n > 0 {
        RECLAIMED_BYTES.fetch_add(bytes, Ordering::Relaxed);
        eprintln!("vramcap sidecar: group {group:?}: reclaimed {bytes} bytes from {n} dead member(s)");
    }
    (n, bytes)
}
