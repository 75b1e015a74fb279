//! libvramcap.so: an `LD_PRELOAD` library in front of the CUDA driver that caps device memory per
//! process and device. See docs/architecture.md for how the pieces fit.
//!
//! - [`hooks`]: the one declarative table of wrapped entry points.
//! - [`dl`]: our `dlsym` trampoline, the real `dlsym`, and the driver handle we open ourselves.
//! - [`intercept`]: the wrappers (cuInit, allocation, memory views, cuGetProcAddress).
//! - [`ledger`]: per-device budgets and the live-allocation table.
//! - [`group`]: budgets shared by several processes (container caps) in a mapped file.
//! - [`config`]: environment parsing (switches; limits through [`grammar`], the limit grammar
//!   the `vramcap` binary shares).

pub mod clock;
pub mod config;
pub mod dl;
pub mod events;
pub mod ffi;
pub mod grammar;
pub mod group;
pub mod hooks;
pub mod intercept;
pub mod ledger;
pub mod livetable;
pub mod log;
pub mod sync;
pub mod trace;
