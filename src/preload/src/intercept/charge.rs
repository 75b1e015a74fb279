//! The one shape every counted entry point follows:
//! decide (reserve against the ledger) → call the real driver exactly once → commit or roll back,
//! plus the event for the trace/sidecar. Family-specific wrappers only say how to call the driver,
//! how big the request is, which device it is for and where the result lands.

use super::init::ensure_limits;
use super::{Mode, current, guarded, mode};
use crate::clock;
use crate::events::{self, Event, Op};
use crate::ffi::*;
use crate::hooks::Hook;
use crate::ledger::{self, Charge, Kind};

/// Which device a request is charged to.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// The calling thread's current context (cuMemAlloc and friends).
    CurrentContext,
    /// A device named by the request itself (VMM properties, pools).
    Device(usize),
}

/// What to do with a request, decided before the driver is called.
enum Plan {
    /// Charged to this device (made in this context); commit or roll back after the call.
    Charged(usize, u64),
    /// Refused: return this code without calling the driver.
    Deny(CUresult, i32, u64),
    /// Not ours to count (no current context: the driver will say so itself).
    Forward,
}

fn plan(api: Hook, target: Target, size: u64) -> Plan {
    if let Err(e) = ensure_limits() {
        return Plan::Deny(e.code(), -1, 0);
    }
    let (dev, ctx) = match target {
        Target::Device(d) => (d, super::current_context()),
        Target::CurrentContext => match current() {
            Some(c) => c,
            None => return Plan::Forward,
        },
    };
    // Before refusing, relieve the pressure the driver would feel on a full device: this
    // process's pools and graph memory give back what they hold unused.
    match super::pressure::reserve(dev, size) {
        Ok(()) => Plan::Charged(dev, ctx),
        Err(d) => {
            let scope = if d.group { crate::group::name() } else { None };
            crate::denials::denied_in(crate::hooks::info(api).name, dev, size, &d, scope);
            // The event's `used` is this process's charge, even when the group's budget refused.
            Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, dev as i32, ledger::used(dev))
        }
    }
}

/// The driver's answer and how long it took: `dur` ticks, ending at tick `at` (both 0 when nobody
/// consumes events, so an untraced process pays no clock reads). Ticks: [`crate::clock`].
#[derive(Clone, Copy)]
pub struct Timed {
    pub rc: CUresult,
    pub dur: u64,
    pub at: u64,
}

impl Timed {
    /// An event that involved no driver call (a denial, a release found at synchronize).
    pub fn instant(rc: CUresult) -> Timed {
        Timed { rc, dur: 0, at: 0 }
    }
}

#[inline]
pub fn timed(call: impl FnOnce() -> CUresult) -> Timed {
    if events::enabled() {
        let t0 = clock::ticks();
        let rc = call();
        let at = clock::ticks();
        Timed { rc, dur: at.saturating_sub(t0), at }
    } else {
        Timed { rc: call(), dur: 0, at: 0 }
    }
}

/// Reserve `size` on the target device, call the driver, then record `key → charge` (read with
/// `read_key` only after success) or roll back.
// Inlined into its wrapper: generic over the call, so each copy has exactly one caller anyway,
// and the hot path (issue 4) must not pay a call frame for it.
#[inline(always)]
pub fn alloc(
    api: Hook,
    kind: Kind,
    target: Target,
    size: u64,
    call: impl FnOnce() -> CUresult,
    read_key: impl FnOnce() -> u64,
) -> CUresult {
    alloc_settled(api, kind, target, size, call, || (read_key(), size))
}

/// Like [`alloc`] when the driver decides the real size (a pitched allocation): reserve `bound`,
/// a safe upper bound, before the call; after success `read` gives the key and the bytes really
/// committed, and the charge is settled to them.
#[inline(always)]
pub fn alloc_settled(
    api: Hook,
    kind: Kind,
    target: Target,
    bound: u64,
    call: impl FnOnce() -> CUresult,
    read: impl FnOnce() -> (u64, u64),
) -> CUresult {
    alloc_with(api, target, bound, call, read, |key, _, _, _| (kind, key))
}

/// Like [`alloc_settled`], where the ledger entry is not the pointer's own: after success
/// `place(key, device, context, bytes)` says under which kind and ledger key the charge is kept
/// (managed memory keeps one entry per device its pages count on).
#[inline(always)]
pub fn alloc_with(
    api: Hook,
    target: Target,
    bound: u64,
    call: impl FnOnce() -> CUresult,
    read: impl FnOnce() -> (u64, u64),
    place: impl FnOnce(u64, usize, u64, u64) -> (Kind, u64),
) -> CUresult {
    let size = bound;
    match mode() {
        Mode::PassThrough => return call(),
        Mode::FailClosed => return CUDA_ERROR_NOT_PERMITTED,
        Mode::Enforce => {}
    }
    // A bookkeeping panic denies rather than hands out memory we did not count.
    match guarded(Plan::Deny(CUDA_ERROR_OUT_OF_MEMORY, -1, 0), || plan(api, target, size)) {
        Plan::Deny(rc, dev, used) => {
            emit(Op::Deny, api, dev, 0, size, Timed { rc, dur: 0, at: 0 }, used);
            rc
        }
        Plan::Forward => {
            let t = timed(call);
            if t.rc != CUDA_SUCCESS {
                emit(Op::Fail, api, -1, 0, size, t, 0);
            }
            t.rc
        }
        Plan::Charged(dev, ctx) => {
            let t = timed(call);
            guarded((), || {
                if t.rc == CUDA_SUCCESS {
                    let (key, real) = read();
                    if real > size {
                        ledger::charge_reserved(dev, real - size);
                    } else if real < size {
                        ledger::unreserve(dev, size - real);
                    }
                    ledger::commit(dev, real);
                    let charge = Charge { dev: dev as u16, size: real, ctx };
                    let (kind, entry) = place(key, dev, ctx, real);
                    // An entry already under this key is an allocation whose free we never saw:
                    // the driver has reused the address, so that charge is gone.
                    if let Some(stale) = ledger::insert(kind, entry, charge) {
                        ledger::release(stale.dev as usize, stale.size);
                    }
                    emit(Op::Alloc, api, dev as i32, key, real, t, ledger::used(dev));
                } else {
                    // Never memory: the reservation goes, `held` and the peak never saw it.
                    ledger::unreserve(dev, size);
                    emit(Op::Fail, api, dev as i32, 0, size, t, ledger::used(dev));
                }
            });
            t.rc
        }
    }
}

/// Take the entry out before the driver frees (so a racing allocation that gets the same key
/// cannot have its entry removed by us), release after success, put it back after failure.
/// The bytes stop counting as held before the call too: once the driver has the free, another
/// thread can be handed the same memory, and both must never count at once (the peak would
/// exceed what existed). Their charge stays until the call returned, so the cap never counts
/// them out early.
/// Keys we never charged go to the driver untouched. A stream-ordered pointer (a kind that is not
/// charged itself) is charged through its pool: after its free the pool's holding is re-read.
#[inline(always)]
pub fn free(api: Hook, kind: Kind, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if mode() == Mode::PassThrough {
        return call();
    }
    let taken = guarded(None, || {
        let c = ledger::take(kind, key);
        if let Some(c) = c.filter(|_| kind.charged()) {
            ledger::uncommit(c.dev as usize, c.size);
        }
        c
    });
    // Managed memory is kept apart (its pages can count on several devices): only a pointer the
    // table does not hold can be one.
    if taken.is_none() && kind == Kind::DevicePtr && super::managed::tracked() {
        return super::managed::free(api, key, call);
    }
    // Stamped when the call began (an allocation is stamped when its call returned): once the
    // driver has the free, another thread can be handed the same address, and that allocation's
    // event must not come out earlier than this free.
    let t = begun(timed(call));
    guarded((), || match taken {
        Some(c) if t.rc == CUDA_SUCCESS => {
            if kind.charged() {
                ledger::unreserve(c.dev as usize, c.size);
            } else {
                super::pool::refresh_device(c.dev as usize);
            }
            emit(Op::Free, api, c.dev as i32, key, c.size, t, ledger::used(c.dev as usize));
        }
        Some(c) => {
            if kind.charged() {
                ledger::commit(c.dev as usize, c.size);
            }
            ledger::insert(kind, key, c);
            emit(Op::Fail, api, c.dev as i32, key, 0, t, ledger::used(c.dev as usize));
        }
        None if t.rc != CUDA_SUCCESS => emit(Op::Fail, api, -1, key, 0, t, 0),
        None => {}
    });
    t.rc
}

/// A call's timing stamped when it began (`timed` stamps when it returned). Every call that can
/// end memory is stamped so: the moment the driver has it, another thread can be given the same
/// address or handle value, and that allocation's event must not sort before this end.
#[inline]
pub fn begun(t: Timed) -> Timed {
    Timed { at: t.at.saturating_sub(t.dur), ..t }
}

/// Records one event (a no-op unless a trace or sidecar consumes events). The check is inlined
/// into every wrapper, so an untraced process pays one load, not a call.
#[inline(always)]
pub fn emit(op: Op, api: Hook, dev: i32, ptr: u64, size: u64, t: Timed, used: u64) {
    if events::enabled() {
        let group_used = if dev >= 0 && crate::group::active() {
            crate::group::view(dev as usize).map_or(events::NO_GROUP, |(_, used)| used)
        } else {
            events::NO_GROUP
        };
        record(Event { op, api: api as events::Api, dev, ptr, size, result: t.rc, dur: t.dur, used, group_used }, t.at);
    }
}

#[inline(always)]
fn record(ev: Event, at: u64) {
    let at = if at != 0 { at } else { clock::ticks() };
    events::emit(ev, at);
}
