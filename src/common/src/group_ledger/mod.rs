//! A group's ledger: the per-device budgets several processes share (a container's cap), as they
//! lie in a file mapped `MAP_SHARED` by every member and by the sidecar, and every rule that
//! decides on them. One copy of each rule: the library admits its allocations with [`admit`],
//! and `vramcap replay --policy` runs the same functions over a ledger in memory
//! ([`shm::Shared::in_memory`]), so the two cannot disagree.
//!
//! - [`shm`]: the layout, member slots (claim, reclaim exactly once), device entries.
//! - [`admit`]: a member's request under the group's policy (budget, headroom, `equal`,
//!   `priority`, reserves), each rule decided by compare-and-swap.
//! - [`budget`]: who set a device's budget (an operator's `vramcap limit`, or a member).
//! - [`join`]: a member's start: the group's policy and headroom, its reserve, the headroom holder.
//! - [`loan`]: reserve a higher priority took, given back to its lender when freed.
//! - [`exports`]: exported VMM memory that outlives its exporter while imports hold it.
//! - [`kept`]: exported memory whose fd may still be open after its exporter ended.
//! - [`file`]: creating, opening and checking the file; [`guard`]: a file truncated while mapped.
//! - [`liveness`]: whether the process a slot names still runs, from any PID namespace.
//!
//! Nothing here waits on another process: every step is one compare-and-swap or atomic add.

pub mod admit;
pub mod budget;
pub mod exports;
pub mod file;
pub mod guard;
pub mod join;
pub mod kept;
pub mod lease;
pub mod liveness;
pub mod loan;
pub mod shm;

/// Gives back what the dead members of ledger `s` hold, judged from this process (its PID
/// namespace and `/proc`), and their exported memory no open fd keeps any more (`/proc/locks`);
/// returns (members, bytes given back by the members' end). Members call it when they join and
/// before a denial, the sidecar on its sweep, `vramcap limit` before it shows the books.
pub fn reclaim_in(s: &shm::Shared) -> (usize, u64) {
    let r = s.reclaim_dead(std::process::id(), &file::liveness);
    s.sweep_exports(&kept::proc_locks);
    r
}
