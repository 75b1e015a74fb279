//! Offline analysis of trace files (docs/trace-format.md) for the `vramcap` binary only: these
//! modules use CLI crates (plotters, indicatif) and are never declared by src/lib.rs.

pub mod synth;
pub mod merge;
pub mod report;
pub mod scan;
pub mod stats;
pub mod trace;
pub mod export;
pub mod memviz;
pub mod pickle;
pub mod plot;
pub mod policy;
pub mod replay;

/// What a trace or a client says, safe to print on a terminal: control characters (escape
/// sequences, line breaks that would forge report lines) become `?`. Every string the analysis
/// and `top` print from a file or a socket goes through here.
pub fn printable(s: &str) -> String {
    s.chars().map(|ch| if ch.is_control() { '?' } else { ch }).collect()
}
