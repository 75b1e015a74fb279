//! What the preload library (`libvramcap.so`, src/preload) and the `vramcap` command
//! (src/cli) both speak, defined once (docs/architecture.md, "The tree"):
//!
//! - [`grammar`]: the limit grammar, the variable families, group names and job ids;
//! - [`config`]: the configuration those variables and the machine's ceiling file make, pure;
//! - [`group_ledger`]: a group's shared ledger (layout, file, liveness) and the sharing rules
//!   that admit a member's allocations, run by the library on the mapped file and by `replay`
//!   on a ledger in memory;
//! - [`trace`]: the trace records, written by the library and read by the analysis commands.
//!
//! Linked into the preload library: it may depend only on what that library may
//! (src/preload/Cargo.toml), and nothing here runs unless called.

pub mod config;
pub mod grammar;
#[doc(hidden)]
pub mod litmus;
pub mod group_ledger;
pub mod trace;
