//! The `vramcap` command's code (src/main.rs is its command line): the commands that start and
//! check jobs ([`cli`]: run, doctor, demo), the node's sidecar and `top` ([`sidecar`]), the container
//! runtimes' spec and hooks ([`cdi`]: `vramcap cdi`, `vramcap cdi-hook`), and the offline analysis of traces ([`analysis`]: report, plot, export, replay). It never links the
//! preload library: what both speak (the limit grammar, the group ledger and its sharing rules,
//! the trace records) is the `vramcap-common` crate's.

pub mod analysis;
pub mod cdi;
pub mod cli;
pub mod sidecar;
