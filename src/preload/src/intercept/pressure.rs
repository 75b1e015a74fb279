//! Memory pressure under a virtual cap.
//!
//! Pools keep freed memory up to their release threshold, and graphs keep their memory reserved,
//! all of it counted against the cap (docs/architecture.md, "Pressure", says what the CUDA
//! programming guide promises about it). Without this module a pool that keeps freed blocks
//! (release threshold at max, as PyTorch's `cudaMallocAsync` backend sets it) would make vramcap
//! deny a job what its own unused cache could cover. So before any denial, this process's pools
//! are trimmed (`cuMemPoolTrimTo(pool,
//! 0)`: only unused memory goes) and its graph memory too (`cuDeviceGraphMemTrim`), their
//! charges re-read, and only then is the request decided again.
//!
//! This runs on the thread that asked for memory (vramcap never calls CUDA from threads of its
//! own), and only on the path that would otherwise deny.

use super::charge::{Timed, emit};
use super::pool_table as table;
use crate::events::Op;
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::ledger::{self, Denied};

/// Reserves `bytes` on `dev`, relieving pressure once if they do not fit: this process's own
/// unused memory first, then (when the group refused) its neighbours' (`group::pressure`).
/// Inlined into the allocation path: what fits costs one reservation and one branch.
#[inline]
pub fn reserve(dev: usize, bytes: u64) -> Result<(), Denied> {
    match ledger::reserve(dev, bytes) {
        Ok(()) => Ok(()),
        Err(_) => reserve_under_pressure(dev, bytes),
    }
}

#[cold]
#[inline(never)]
fn reserve_under_pressure(dev: usize, bytes: u64) -> Result<(), Denied> {
    relieve(dev);
    ledger::reserve(dev, bytes)
        .or_else(|d| if d.group && crate::group::pressure::ask(dev, bytes) { ledger::reserve(dev, bytes) } else { Err(d) })
}

/// At every driver call: when a neighbour in the group asked for memory since we last looked,
/// give back what we hold unused, here, in the application's own thread.
#[inline]
pub fn answer_neighbours() {
    if let Some(p) = crate::group::pressure::pending() {
        answer(p);
    }
}

#[cold]
fn answer(p: u64) {
    // Recorded first: a driver call made while trimming does not trim again.
    crate::group::pressure::answered(p);
    for dev in 0..ledger::device_count() {
        relieve(dev);
    }
}

/// Gives back what this process's pools and graph memory on `dev` hold unused; returns whether
/// any charge went down.
pub fn relieve(dev: usize) -> bool {
    let mut released = false;
    if table::any()
        && let Some(trim) = real::cuMemPoolTrimTo()
    {
        for (_, p) in table::slots() {
            let Some(h) = p.handle() else { continue };
            if p.device() != Some(dev) {
                continue;
            }
            if unsafe { trim(h as CUmemoryPool, 0) } == CUDA_SUCCESS {
                let delta = table::settle(p, 0);
                if delta < 0 {
                    released = true;
                    let t = Timed::instant(CUDA_SUCCESS);
                    emit(Op::Free, Hook::cuMemPoolTrimTo, dev as i32, h, delta.unsigned_abs(), t, ledger::used(dev));
                }
            }
        }
    }
    released | super::graph::trim(dev)
}
