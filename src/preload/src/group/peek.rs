//! A group's books read without joining it (issue 24): `nvidia-smi`, nvitop or gpustat in a
//! preloaded container ask NVML before (or without) CUDA, and must see what the group's jobs
//! hold, not the tool's own nothing. The ledger is mapped and read; no slot is taken, nothing is
//! written, CUDA is not touched. A member that has joined reads its own mapping.

use super::{file, shm};
use crate::config::GroupConfig;
use shm::Shared;
use std::sync::atomic::{AtomicPtr, Ordering::*};

/// The ledger mapped for reading (kept: a tool asks again and again).
static PEEKED: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());

fn ledger(cfg: &GroupConfig) -> Option<&'static Shared> {
    if let Some(s) = super::shared() {
        return Some(s);
    }
    let p = PEEKED.load(Acquire);
    if !p.is_null() {
        return Some(unsafe { &*p });
    }
    let (_, path) = super::ledger_path(cfg);
    // The checks a member makes (owner, mode, layout): a squatted file is not believed either.
    let m = file::open_member(&path).ok()??;
    if PEEKED.compare_exchange(std::ptr::null_mut(), m.shm as *const Shared as *mut Shared, AcqRel, Acquire).is_err() {
        m.unmap();
    }
    Some(unsafe { &*PEEKED.load(Acquire) })
}

/// The group's (budget, what its members hold) on the GPU with this UUID (`None`: no ledger yet,
/// or no member has used the GPU). Budget 0: none.
pub fn peek(cfg: &GroupConfig, uuid: &str) -> Option<(u64, u64)> {
    let s = ledger(cfg)?;
    let key = shm::device_key(uuid);
    let e = s.devices.iter().position(|d| d.key.load(Acquire) == key)?;
    Some((s.devices[e].limit.load(Acquire), s.used(e)))
}
