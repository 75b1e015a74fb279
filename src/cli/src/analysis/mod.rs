//! Offline analysis of trace files (docs/trace-format.md): `vramcap report`, `plot`, `export`,
//! `replay`. The lines are read by `vramcap_common::trace` (the library writes them by the same
//! definitions); everything here works on the events those give.

pub mod export;
pub mod memviz;
pub mod merge;
pub mod output;
pub mod pickle;
pub mod plot;
pub mod policy;
pub mod replay;
pub mod report;
pub mod stats;
pub mod synth;
pub mod trace;

/// What a trace or a client says, safe to print on a terminal: control characters (escape
/// sequences, line breaks that would forge report lines) become `?`. Every string the analysis
/// and `top` print from a file or a socket goes through here.
pub use vramcap_common::trace::printable;
